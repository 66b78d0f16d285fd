//! Background renewal: the renewer each held attempt runs, its schedule and its bounds.
//!
//! Every held attempt has one renewer task, which renews its Lease every
//! `leaseDurationSeconds / 3` ([`renewal_interval`]) unless a worker heartbeat renewed it
//! meanwhile, and stops when the attempt ends, when the lease is lost (the Lease or the job
//! says so), when renewals have failed for a whole lease duration on the monotonic clock
//! ([`outlived`]), or when the worker has been silent past
//! `max(worker_timeout, leaseDurationSeconds)` ([`silence_limit`]); [`on_wake`] decides. A
//! lost attempt answers every later call with
//! [`WorkerError::LeaseLost`](crate::WorkerError::LeaseLost) without asking the API server.
//!
//! The rules: docs/protocol.md, "Heartbeats and checkpoints" and "Expiry"; the bounds are the
//! crate doc's list.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use leasehold_core::crd::LeasedJob;
use leasehold_core::fence;
use leasehold_core::lease;
use leasehold_core::progress::Progress;
use leasehold_core::token::Token;
use leasehold_core::Category;
use leasehold_kube::api::error_chain;
use leasehold_kube::lease::LeaseError;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::warn;

use crate::{lost_message, Held, HeldState, Worker, LEASE_LOST};

const RENEW_RETRY: Duration = Duration::from_secs(1);

impl Worker {
    /// Starts holding an attempt: records it and spawns its background renewer. `claimed` is
    /// the claim's answer when this process made the claim at `renewed` (when its write was
    /// sent); its Lease is then not written yet. Without it, the attempt was found holding a
    /// Lease renewed at `renewed`.
    pub(crate) fn hold(
        &self,
        name: &str,
        token: Token,
        duration_s: i32,
        claimed: Option<LeasedJob>,
        renewed: Instant,
    ) -> Arc<Held> {
        let now = Instant::now();
        let lease_taken = claimed.is_none();
        let held = Arc::new(Held {
            token,
            claimed,
            lease_name: lease::lease_name(name),
            duration: Duration::from_secs(u64::try_from(duration_s.max(1)).unwrap_or(1)),
            state: Mutex::new(HeldState {
                last_renewed: renewed,
                renew_time: Timestamp::now(),
                lease_taken,
                first_renewal_sent: lease_taken,
                last_contact: now,
                checkpoint: None,
                progress: Progress::default(),
                lost: None,
                ended: false,
            }),
            wake: Notify::new(),
        });
        let previous = self
            .inner
            .held
            .lock()
            .unwrap()
            .insert(name.to_string(), Arc::clone(&held));
        if let Some(p) = previous {
            mark_ended(&p);
        }
        self.inner.held_watch.held();
        let worker = self.clone();
        let task = format!("renewer of {}", self.job_ref(name));
        let name = name.to_string();
        let renewer = Arc::clone(&held);
        self.inner.health.spawn(task, async move {
            worker.renew_in_background(&name, &renewer).await;
        });
        held
    }

    /// The renewer of attempt `held` of job `name`: runs until the attempt ends or its lease
    /// is lost (see the module doc for when).
    async fn renew_in_background(&self, name: &str, held: &Held) {
        let job_ref = self.job_ref(name);
        let interval = renewal_interval(held.duration);
        let silence_limit = silence_limit(self.inner.config.worker_timeout, held.duration);
        let mut due = Instant::now() + interval;
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(due) => {}
                () = held.wake.notified() => {}
            }
            let now = Instant::now();
            let step = {
                let st = held.state.lock().unwrap();
                on_wake(&st, now, interval, silence_limit)
            };
            match step {
                Wake::Stop => return,
                Wake::Later(at) => {
                    // A worker heartbeat renewed it meanwhile.
                    due = at;
                    continue;
                }
                Wake::Silent => {
                    let why = format!(
                        "the worker made no call for {}s, so the sidecar stopped renewing the lease",
                        silence_limit.as_secs()
                    );
                    warn!(job = %job_ref, attempt = held.token.attempt(), "Stopped renewing LeasedJob {job_ref}: {why}");
                    self.lose(held, LEASE_LOST, lost_message(&job_ref, &why));
                    return;
                }
                Wake::Renew => {}
            }
            // An attempt that ended elsewhere (expired, cancelled) may keep a Lease that still
            // accepts renewals: the job decides.
            if let Some((code, why)) = self.cached_job_moved_on(name, &held.token) {
                warn!(job = %job_ref, attempt = held.token.attempt(), "Stopped renewing LeasedJob {job_ref}: {why}");
                self.lose(held, code, lost_message(&job_ref, &why));
                return;
            }
            // Not in the held-jobs cache: claimed by another holder since (superseded), or
            // deleted; a fresh read tells. A first renewal reads the job after its Lease write
            // instead (`take_lease`), and clears a Lease it wrote for an attempt that ended.
            let first = held.claimed.is_some() && !held.lease_taken();
            let read = if first {
                None
            } else {
                self.read_if_uncached(name).await
            };
            if let Some(job) = read {
                if let Some(r) = fence::refusal(&job_ref, job.as_ref(), &held.token) {
                    warn!(job = %job_ref, attempt = held.token.attempt(), "Stopped renewing LeasedJob {job_ref}: {r}");
                    self.lose(held, r.category(), r.to_string());
                    return;
                }
            }
            let renewed = self.renew_bounded(held, None).await;
            self.inner.metrics.heartbeat(renewed.is_ok());
            match renewed {
                Ok((lease, _)) => {
                    let mut st = held.state.lock().unwrap();
                    st.last_renewed = Instant::now();
                    if let Some(t) = lease.spec.as_ref().and_then(|s| s.renew_time.as_ref()) {
                        st.renew_time = t.0;
                    }
                    due = Instant::now() + interval;
                }
                // Its Lease name is taken by something else (the claim was undone), or the
                // attempt ended before its first renewal: already declared lost.
                Err(LeaseError::NotOurs { .. } | LeaseError::Ended { .. }) => return,
                Err(LeaseError::Lost { .. }) => {
                    warn!(job = %job_ref, attempt = held.token.attempt(), "Lost lease of LeasedJob {job_ref}: holderIdentity changed");
                    self.lose(
                        held,
                        LEASE_LOST,
                        lost_message(&job_ref, "its Lease is held by another attempt"),
                    );
                    return;
                }
                Err(e) => {
                    if self.renewals_failed_too_long(&job_ref, held) {
                        warn!(job = %job_ref, error = %error_chain(&e), "Lost lease of LeasedJob {job_ref}: renewals failed for a whole lease duration");
                        return;
                    }
                    warn!(job = %job_ref, error = %error_chain(&e), "Renewal of LeasedJob {job_ref} failed; retrying");
                    due = Instant::now() + retry_delay(interval);
                }
            }
        }
    }

    /// After a failed renewal: declares the lease lost once renewals have failed for a whole
    /// lease duration since the last success (monotonic clock).
    pub(crate) fn renewals_failed_too_long(&self, job_ref: &str, held: &Held) -> bool {
        let since = held.state.lock().unwrap().last_renewed.elapsed();
        if outlived(since, held.duration) {
            let why = format!(
                "renewals failed for {}s, a whole lease duration",
                since.as_secs()
            );
            self.lose(held, LEASE_LOST, lost_message(job_ref, &why));
            true
        } else {
            false
        }
    }

    /// Declares the held attempt lost with `code` and `message` (what later calls get back).
    /// A lost attempt is no longer held: a drain waiting for held jobs is woken.
    pub(crate) fn lose(&self, held: &Held, code: &'static str, message: String) {
        let mut st = held.state.lock().unwrap();
        if st.lost.is_none() {
            st.lost = Some((code, message));
        }
        drop(st);
        held.wake.notify_one();
        self.inner.ended.notify_waiters();
    }
}

pub(crate) fn mark_ended(held: &Held) {
    held.state.lock().unwrap().ended = true;
    held.wake.notify_one();
}

/// How often background renewal renews a lease of `duration`: every third of it, so that two
/// renewals in a row may fail before it runs out (client-go's leader election renews at a
/// similar fraction).
pub(crate) fn renewal_interval(duration: Duration) -> Duration {
    duration / 3
}

/// How long the worker may make no call before background renewal stops for an attempt whose
/// lease is `duration`: `max(worker_timeout, leaseDurationSeconds)`, so that a hung worker
/// does not keep its lease forever, and a lease is never given up sooner than it would run out.
pub(crate) fn silence_limit(worker_timeout: Duration, duration: Duration) -> Duration {
    worker_timeout.max(duration)
}

/// Whether a lease of `duration` must be declared lost, `since` (monotonic clock) the last
/// confirmed renewal (or the claim's write, before the first renewal): after a whole lease
/// duration without one, the controller may have requeued the job.
pub(crate) fn outlived(since: Duration, duration: Duration) -> bool {
    since >= duration
}

/// How long the renewer waits after a failed renewal: [`RENEW_RETRY`], or the renewal interval
/// when that is shorter.
pub(crate) fn retry_delay(interval: Duration) -> Duration {
    RENEW_RETRY.min(interval)
}

/// What the background renewer does when it wakes (its timer, or a wake from the attempt's
/// end, a loss or a renewal that moved the schedule).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wake {
    /// The attempt ended or its lease was declared lost: the renewer stops.
    Stop,
    /// A renewal was confirmed less than an interval ago: sleep until this instant.
    Later(Instant),
    /// The worker has made no call for the silence limit: the lease is given up.
    Silent,
    /// Renew now (after checking the job has not moved on).
    Renew,
}

/// The renewer's decision at `now` for an attempt in state `st`, renewed every `interval`,
/// whose worker may stay silent for `silence_limit`.
pub(crate) fn on_wake(
    st: &HeldState,
    now: Instant,
    interval: Duration,
    silence_limit: Duration,
) -> Wake {
    if st.ended || st.lost.is_some() {
        Wake::Stop
    } else if st.last_renewed + interval > now {
        Wake::Later(st.last_renewed + interval)
    } else if now.duration_since(st.last_contact) >= silence_limit {
        Wake::Silent
    } else {
        Wake::Renew
    }
}
