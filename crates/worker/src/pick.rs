//! Claiming: which job to try, how wide the claim window is, and the claim write itself.
//!
//! With a dispatcher ([`crate::dispatched`]) a sidecar keeps no copy of its queue: a claim asks
//! the dispatcher and claims the job it offers (`claim_dispatched`), from a copy read afresh,
//! and while the dispatcher is not usable chooses on its own from bounded lists
//! ([`crate::listed`]).
//!
//! Without one, a claim chooses from the queue's
//! [`ClaimIndex`](leasehold_core::claim_index::ClaimIndex) (kept by the queue watch): alone,
//! at random among the oldest top-priority jobs of the adaptive window ([`claim::pick`]);
//! beside other claimers, by the rendezvous turn of [`share::choose`], reading a job afresh
//! before a turn at one that is not this claimer's own. The claim is one status write guarded
//! by the snapshot's resourceVersion ([`leasehold_kube::claim::claim`]); a 409 marks the
//! snapshot stale and widens the window, a success narrows it ([`crate::window`]). The claim
//! does not write the Lease: the attempt's first renewal does (`heartbeat.rs`).
//!
//! The rules: docs/protocol.md, "Claiming" and "The token"; the window's bounds:
//! [`WorkerConfig::spread`](crate::WorkerConfig::spread).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::api::GetParams;
use kube::runtime::reflector::ObjectRef;
use kube::ResourceExt;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use leasehold_core::claim;
use leasehold_core::crd::LeasedJob;
use leasehold_core::fence::Outcome;
use leasehold_core::share;
use leasehold_core::slots::Preferred;
use leasehold_core::token::Token;
use leasehold_core::trace;
use leasehold_kube::api::error_chain;
use leasehold_kube::claim::{claim_taking, ClaimError};
use leasehold_kube::queue_watch;

use crate::window::MAX_WINDOW_FACTOR;
use crate::{call_bound, Claimed, Worker, WorkerError, MAX_CALL_BOUND};

/// What a claimer found to do.
enum Pick {
    /// Try to claim this job.
    Job(Arc<LeasedJob>),
    /// Read this job afresh, and try to claim it if it is still claimable (a turn at a job
    /// that is not this claimer's own, or one of its last own jobs: [`share::Choice::Turn`],
    /// [`share::Choice::Contested`]).
    Fresh(Arc<LeasedJob>),
    /// Nothing claimable.
    Nothing,
    /// Nothing to try now, but a turn comes or a reserved job opens at this instant
    /// ([`share::Choice::Defer`]): look again then.
    Defer(Instant),
}

/// How a claim through the dispatcher ended.
enum Dispatch {
    /// A job was claimed (boxed: the other variants are empty).
    Claimed(Box<Claimed>),
    /// None in time, or the caller went away.
    Nothing,
    /// The dispatcher is not usable: choose on our own.
    FallBack,
}

/// Offers that could not be claimed, in one round through one dispatcher (see
/// `claim_dispatched`), after which the dispatcher is set aside: a sound one's offers fail only
/// in a race with another claim or a change.
const MAX_DECLINED: u32 = 5;

/// The longest the read of an offered job may take: 1 s, the API server's own objective for a
/// single object's read (Kubernetes' API call latency SLO, p99). The read asks for a copy not
/// older than the offer's resourceVersion, which the API server answers from its watch cache
/// at once when its cache has reached it, and otherwise only once it has (up to 3 s, then
/// 504). An offer not read within this is declined as [`Offer::Unreached`].
pub(crate) const OFFER_READ_BOUND: Duration = Duration::from_secs(1);

/// Offers not read within [`OFFER_READ_BOUND`], in one round through one dispatcher (see
/// `claim_dispatched`), after which the dispatcher is set aside at once: offers ahead of the
/// API server by that much are a lie, or a view this API server is far behind. One slow read
/// alone (a replica catching up, a loaded moment) does not set a sound dispatcher aside; two
/// cost a liar's victim 2 s of reads (their declines are said in the background), whatever it
/// offers between them.
const MAX_UNREACHED: u32 = 2;

/// Whether `status` is the API server's refusal of a read at a resourceVersion its watch cache
/// did not reach in time (504, reason `Timeout`, cause `ResourceVersionTooLarge`).
fn too_large_version(status: &kube::core::Status) -> bool {
    status.code == 504
        && status.details.as_ref().is_some_and(|d| {
            d.causes
                .iter()
                .any(|c| c.reason == "ResourceVersionTooLarge")
        })
}

/// What came of an offer.
enum Offer {
    /// The job offered is this worker's now (boxed: the other variants are empty).
    Claimed(Box<Claimed>),
    /// It could not be claimed: malformed, not this sidecar's to claim, gone, not claimable,
    /// stale, held back by a limit, or its read failed.
    Declined,
    /// The API server did not reach the offer's resourceVersion within [`OFFER_READ_BOUND`].
    Unreached,
}

/// The API server had not reached an offer's resourceVersion within [`OFFER_READ_BOUND`].
struct Unreached;

/// What [`Worker::try_claim`] did.
pub(crate) enum Tried {
    /// The job is this worker's (boxed: the other variants are empty).
    Claimed(Box<Claimed>),
    /// The copy was stale (409), or the job is no longer claimable: it is marked tried.
    Lost,
    /// Not attempted, nothing written or marked: the queue is paused, or a limit is reached.
    HeldBack,
}

impl Worker {
    /// Claims the best claimable job, waiting up to `wait` for one to appear (woken by the
    /// watch, not by polling). `Ok(None)` when none could be claimed in time.
    ///
    /// # Errors
    /// [`WorkerError::Unavailable`] when the API server failed a claim write.
    pub async fn claim(&self, wait: Duration) -> Result<Option<Claimed>, WorkerError> {
        self.claim_until(wait, std::future::pending()).await
    }

    /// As [`Worker::claim`], for a caller that may go away: while no job has been claimed yet,
    /// `gone` resolving ends the wait with `Ok(None)` and nothing written. (A caller that goes
    /// away after the claim write must release the job itself: see the sidecar.)
    ///
    /// # Errors
    /// As [`Worker::claim`].
    pub async fn claim_until(
        &self,
        wait: Duration,
        gone: impl std::future::Future<Output = ()>,
    ) -> Result<Option<Claimed>, WorkerError> {
        let mut gone = std::pin::pin!(gone);
        if self.inner.health.is_shutting_down() {
            return Err(WorkerError::ShuttingDown);
        }
        let deadline = Instant::now() + wait;
        let mut draining = self.inner.draining.subscribe();
        let Some(queue) = self.inner.queue.as_ref() else {
            // A sidecar with a dispatcher keeps no copy of its queue.
            return self
                .claim_without_queue(deadline, &mut gone, &mut draining)
                .await;
        };
        let queue_watch = &queue.watch;
        let mut changes = queue.changes.clone();
        let mut paused = self.inner.queue_object.clone();
        let mut held_back = None;
        // The queue watch runs while this claim is in progress (and starts again if it had
        // stopped): a stopped one lists the queue first, waited for as long as `wait` and at
        // least RELIST_WAIT.
        let _claiming = queue_watch.claiming();
        let listed = deadline.max(Instant::now() + queue_watch::RELIST_WAIT);
        tokio::select! {
            synced = tokio::time::timeout_at(listed, queue_watch.wait_synced()) => {
                if synced.is_err() {
                    // Not an empty queue: this sidecar cannot see the queue yet.
                    return Err(WorkerError::unavailable(
                        format!("claim from queue {}", self.inner.config.queue),
                        "the LeasedJob watch of the queue has not listed it yet (see /readyz)",
                    ));
                }
            }
            () = &mut gone => return Ok(None),
            _ = draining.wait_for(|d| *d) => return Err(WorkerError::ShuttingDown),
        }
        loop {
            if !self
                .wait_unpaused(deadline, &mut gone, &mut draining)
                .await?
            {
                return Ok(None);
            }
            changes.borrow_and_update();
            let picked = self.pick(queue);
            let turn = match picked {
                Pick::Defer(turn) => Some(turn),
                _ => None,
            };
            // A job read afresh keeps its cached snapshot: after the claim of the fresh copy,
            // whatever its answer, both are stale, and the cache still holds the older.
            let (picked, cached) = match picked {
                Pick::Fresh(cached) => (self.read_afresh(Arc::clone(&cached)).await, Some(cached)),
                picked => (picked, None),
            };
            if let Pick::Job(snapshot) = picked {
                if *draining.borrow() {
                    return Err(WorkerError::ShuttingDown);
                }
                let marks = self.inner.full_keys.marks();
                match self.try_claim(&snapshot, None).await? {
                    Tried::Claimed(claimed) => return Ok(Some(*claimed)),
                    // Paused, or a limit reached: the job is not stale; look again a little
                    // later (a limit's slot comes back with no change of this queue's jobs
                    // that the cache would see first). A key found full is passed over from
                    // now on: pick again at once among the others' jobs (each key is found
                    // full at most once per pause, so this does not spin).
                    Tried::HeldBack => {
                        held_back = Some(Instant::now() + crate::limited::HELD_BACK_PAUSE);
                        if self.inner.full_keys.marks() != marks {
                            continue;
                        }
                    }
                    Tried::Lost => {
                        // try_claim marked the fresh copy stale (claimed, 409, or no longer
                        // claimable); the cache holds the older snapshot until the watch
                        // brings the fresh one and then the change, so both are skipped
                        // (claim::Stale keeps two). Lost the race (or the job went away):
                        // the write that beat us is on its way through the watch, usually
                        // already here; pick again from a cache at least that fresh.
                        if let Some(cached) = cached {
                            self.mark_tried(&cached);
                        }
                    }
                }
            }
            // Wake for the next job whose notBefore or retryAfter passes, if before the deadline.
            let now = Timestamp::now();
            let next = queue.index.lock().unwrap().next_claimable_at(now);
            let wake = next
                .map(|t| {
                    Instant::now() + Duration::try_from(t.duration_since(now)).unwrap_or_default()
                })
                .map_or(deadline, |t| t.min(deadline));
            // A claimer waiting its turn for a job looks again when the turn comes, even if no
            // change arrives (the claimers ahead of it may be busy or gone).
            let wake = turn.map_or(wake, |t| wake.min(t));
            let wake = held_back.take().map_or(wake, |t| wake.min(t));
            // Jobs passed over because their key was full are looked at again when it may not be.
            let wake = self
                .inner
                .full_keys
                .next_expiry()
                .map_or(wake, |t| wake.min(t));
            tokio::select! {
                () = &mut gone => return Ok(None),
                _ = draining.wait_for(|d| *d) => return Err(WorkerError::ShuttingDown),
                // Paused or resumed meanwhile: look again (the loop waits while paused).
                _ = paused.changed() => {}
                () = tokio::time::sleep_until(wake), if wake < deadline => {}
                changed = changes.changed() => {
                    if changed.is_err() {
                        return Err(WorkerError::unavailable(
                            "claim",
                            "the LeasedJob watch stopped",
                        ));
                    }
                }
                () = tokio::time::sleep_until(deadline) => return Ok(None),
            }
        }
    }

    /// Claims with no copy of the queue: the job the dispatcher offers, or, while it cannot be
    /// used, one chosen from bounded lists of the queue ([`crate::listed`]), until `deadline`.
    async fn claim_without_queue(
        &self,
        deadline: Instant,
        gone: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
        draining: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<Option<Claimed>, WorkerError> {
        loop {
            match self.claim_dispatched(deadline, gone, draining).await? {
                Dispatch::Claimed(claimed) => return Ok(Some(*claimed)),
                Dispatch::Nothing => return Ok(None),
                Dispatch::FallBack => {}
            }
            if let Some(claimed) = self.claim_listed(deadline, gone, draining).await? {
                return Ok(Some(claimed));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    /// Claims through the dispatcher ([`crate::dispatched`]) until `deadline`: asks it for a
    /// job, claims the one offered from a copy read from the API server, and tells it when
    /// that failed. Falls back when no dispatcher is usable or a poll fails (which includes
    /// one not answered within [`crate::dispatched::FALLBACK_AFTER`]).
    async fn claim_dispatched(
        &self,
        deadline: Instant,
        gone: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
        draining: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<Dispatch, WorkerError> {
        let Some(dispatched) = self.inner.dispatched.as_ref() else {
            return Ok(Dispatch::FallBack);
        };
        // Counted for this round through the dispatcher, per address: a new address (a new
        // leader) starts afresh, and so does a dispatcher asked again after it was set aside
        // (the next round).
        let mut declined = 0u32;
        let mut unreached = 0u32;
        let mut counted_for: Option<String> = None;
        let mut asked = false;
        loop {
            // A paused queue is not asked about; a resumed one at once.
            if !self.wait_unpaused(deadline, gone, draining).await? {
                return Ok(Dispatch::Nothing);
            }
            let Some(address) = dispatched.usable() else {
                return Ok(Dispatch::FallBack);
            };
            if counted_for.as_deref() != Some(address.as_str()) {
                (declined, unreached) = (0, 0);
                counted_for = Some(address.clone());
            }
            if declined > 0 {
                // A dispatcher offering job after job that cannot be claimed is asked again
                // more slowly (10 ms, doubling to 160 ms), so it cannot drive this sidecar to
                // read the API server in a tight loop.
                tokio::time::sleep(Duration::from_millis(10 << declined.min(4))).await;
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            // A claim that will not wait (wait=0) still asks once.
            if remaining.is_zero() && asked {
                return Ok(Dispatch::Nothing);
            }
            asked = true;
            let poll = dispatched.poll(&address, remaining, self.inner.own_slots.advertised());
            let hint = tokio::select! {
                answer = poll => match answer {
                    Ok(Some(hint)) => hint,
                    // The poll's wait ended first: ask again.
                    Ok(None) => continue,
                    Err(_) => return Ok(Dispatch::FallBack),
                },
                () = gone.as_mut() => return Ok(Dispatch::Nothing),
                _ = draining.wait_for(|d| *d) => return Err(WorkerError::ShuttingDown),
            };
            let draining_now = *draining.borrow();
            if self.paused_now() && !draining_now {
                // Paused while the poll waited: the offer is given back, and not counted
                // against the dispatcher (it may not have seen the pause yet).
                dispatched.declined(&address, &hint.name).await;
                continue;
            }
            let offer = if draining_now {
                Offer::Declined
            } else {
                self.claim_hint(&hint).await?
            };
            let slow = match offer {
                Offer::Claimed(claimed) => {
                    dispatched.answered(&address);
                    return Ok(Dispatch::Claimed(claimed));
                }
                Offer::Unreached => {
                    // Said in the background: this offer has cost its read already.
                    let (me, name, to) = (self.clone(), hint.name.clone(), address.clone());
                    tokio::spawn(async move {
                        if let Some(dispatched) = me.inner.dispatched.as_ref() {
                            dispatched.declined(&to, &name).await;
                        }
                    });
                    true
                }
                Offer::Declined => {
                    dispatched.declined(&address, &hint.name).await;
                    if draining_now {
                        return Err(WorkerError::ShuttingDown);
                    }
                    // The API server refused the claim as outside the limits its copy of the
                    // LeasedQueue sets: the copies differ, which is not the dispatcher's
                    // doing. The offer does not count against it; the next round waits out
                    // the hold (wait_unpaused).
                    if self.outside_limits_hold().is_some() {
                        continue;
                    }
                    false
                }
            };
            declined += 1;
            unreached += u32::from(slow);
            if declined >= MAX_DECLINED || unreached >= MAX_UNREACHED {
                // Its view is far from the API server's, or it lies: choose on our own.
                dispatched.set_aside(
                    &address,
                    &format!(
                        "offered {declined} jobs that could not be claimed, {unreached} of them at resourceVersions the API server had not reached within {} ms",
                        OFFER_READ_BOUND.as_millis()
                    ),
                );
                return Ok(Dispatch::FallBack);
            }
        }
    }

    /// Claims the job a hint names, from a copy read from the API server: one GET not older
    /// than the hint's resourceVersion, which the API server answers from its watch cache.
    /// The hint's word is never used in the write: a lying resourceVersion costs a read that
    /// fails, waits ([`Offer::Unreached`]) or gives a copy that is stale (409). A hint whose
    /// name is not an object name, or whose resourceVersion is not one, is declined unread.
    async fn claim_hint(&self, hint: &crate::dispatched::Hint) -> Result<Offer, WorkerError> {
        if !hint.is_well_formed() {
            debug!(
                "Declined an offer that names no LeasedJob (a name or resourceVersion out of form)"
            );
            return Ok(Offer::Declined);
        }
        let Ok(read) = self.read_offered(hint).await else {
            return Ok(Offer::Unreached);
        };
        let Some(snapshot) = read else {
            return Ok(Offer::Declined);
        };
        match self
            .try_claim(&snapshot, Some((hint.preferred(), hint.swappable())))
            .await?
        {
            Tried::Claimed(claimed) => Ok(Offer::Claimed(claimed)),
            // An offer of a scope at its limit counts against the dispatcher, which knows the
            // limits: one that keeps making such offers is set aside.
            Tried::Lost | Tried::HeldBack => Ok(Offer::Declined),
        }
    }

    /// The job to try to claim next, if any.
    ///
    /// The candidates are the oldest claimable jobs of the queue's
    /// [`ClaimIndex`](leasehold_core::claim_index::ClaimIndex): the
    /// adaptive window, at least [`claim::WINDOW_PER_CLAIMER`] per claimer seen
    /// ([`claim::recent_claimers`]; [`claim::COLD_CLAIMERS`] when no claim was seen lately),
    /// less the snapshots already tried. When other claimers are seen, [`share::choose`] says
    /// which to try: this claimer's own oldest job, a turn at an open one, or
    /// [`Pick::Defer`] until a turn comes or a reserved job opens. Alone, or at a cold start, or
    /// with `--spread 1`: [`claim::pick`]'s random (or FIFO) choice in the window.
    fn pick(&self, queue: &crate::QueueCopy) -> Pick {
        let config = &self.inner.config;
        let now = Timestamp::now();
        let index = queue.index.lock().unwrap();
        let claimers = index.recent_claimers(&config.identity, now);
        let claimers: HashSet<&str> = claimers.iter().map(String::as_str).collect();
        let tried = queue.tried.lock().unwrap();
        let warm = index.claimed_lately(now);
        let seen = if warm {
            claimers.len()
        } else {
            claim::COLD_CLAIMERS
        };
        let window = claim::window_for(
            self.inner.window.load(Ordering::Relaxed),
            config.spread,
            seen,
            config.spread * MAX_WINDOW_FACTOR,
        );
        // Jobs of a key found full lately are passed over (crate::limited::FullKeys).
        let full = crate::limited::PassOver::new(self, queue, &config.namespace, Instant::now());
        let names = index.candidates(now, window, |name, rv| {
            tried.contains(name, rv) || full.skips(name)
        });
        drop(tried);
        if config.spread > 1 && claimers.len() > 1 {
            let now_ms = u64::try_from(now.as_millisecond()).unwrap_or_default();
            let guard =
                share::rendezvous_guard_ms(self.inner.claim_write_ms.load(Ordering::Relaxed));
            let choice = share::choose(
                &names,
                &config.identity,
                &claimers,
                |c| index.active_until_ms(c),
                now_ms,
                guard,
            );
            // Only the chosen name is copied, so that the index can be unlocked first.
            let (name, afresh) = match choice {
                share::Choice::Own(i) => (names[i].to_string(), false),
                share::Choice::Contested(i) | share::Choice::Turn(i) => {
                    (names[i].to_string(), true)
                }
                share::Choice::Defer(wait) => return Pick::Defer(Instant::now() + wait),
                share::Choice::Nothing => return Pick::Nothing,
            };
            drop(index);
            return match cached(queue, &config.namespace, &[&name]).pop() {
                Some(job) if afresh => Pick::Fresh(job),
                Some(job) => Pick::Job(job),
                None => Pick::Nothing,
            };
        }
        // The snapshots tried are already left out of `names`. The index stays locked while
        // the store is read (its names are borrowed): at most the window's lookups, 512 at a
        // cold start, and no path takes the index lock while holding the store's.
        let jobs = cached(queue, &config.namespace, &names);
        drop(index);
        claim::pick(&jobs, &config.queue, now, window, &mut rand::rng())
            .map_or(Pick::Nothing, Pick::Job)
    }

    /// [`Pick::Fresh`]: reads `cached` from the API server (a quorum read, one GET) and answers
    /// the copy read if it is still claimable, so a turn at a job another claimer has just
    /// claimed costs a read instead of a claim write answered 409 (benchmark row 2: on a loaded
    /// API server the watch trailed the writes by a second at a queue's end). Otherwise the
    /// cached snapshot is marked tried, so that it is not picked again before the watch
    /// brings the change, and nothing is tried. A read that fails marks nothing.
    async fn read_afresh(&self, cached: Arc<LeasedJob>) -> Pick {
        let name = cached.name_any();
        let read = tokio::time::timeout(MAX_CALL_BOUND, self.inner.jobs.get_opt(&name)).await;
        let Ok(Ok(found)) = read else {
            // The read failed: nothing is known, so nothing is marked; the next change tries
            // again.
            return Pick::Nothing;
        };
        if let Some(fresh) = found.and_then(|f| self.if_claimable(f)) {
            return Pick::Job(fresh);
        }
        let job_ref = cached.reference();
        tracing::debug!(job = %job_ref, "Skipped LeasedJob {job_ref}: read afresh for a turn, it is no longer claimable");
        self.mark_tried(&cached);
        Pick::Nothing
    }

    /// Reads the job `hint` offers from the API server, in this sidecar's namespace: one GET
    /// not older than the hint's resourceVersion, bounded by [`OFFER_READ_BOUND`]. Answers the
    /// copy read if it is the job offered and claimable now; None if it is not, is gone, or
    /// the read failed.
    async fn read_offered(
        &self,
        hint: &crate::dispatched::Hint,
    ) -> Result<Option<Arc<LeasedJob>>, Unreached> {
        let params = GetParams {
            resource_version: Some(hint.resource_version.clone()),
        };
        let read = self.inner.jobs.get_with(&hint.name, &params);
        let found = match tokio::time::timeout(OFFER_READ_BOUND, read).await {
            Ok(Ok(found)) => found,
            // The API server waited for its cache to reach the resourceVersion, and gave up.
            Ok(Err(kube::Error::Api(e))) if too_large_version(&e) => return Err(Unreached),
            Ok(Err(_)) => return Ok(None),
            Err(_) => return Err(Unreached),
        };
        let namespace = &self.inner.config.namespace;
        if found.metadata.name.as_deref() != Some(hint.name.as_str())
            || found.metadata.namespace.as_deref() != Some(namespace.as_str())
        {
            return Ok(None);
        }
        Ok(self.if_claimable(found))
    }

    /// `job`, slimmed as the watch cache keeps it, if it is claimable now.
    fn if_claimable(&self, mut job: LeasedJob) -> Option<Arc<LeasedJob>> {
        if !claim::claimable(&job, &self.inner.config.queue, Timestamp::now()) {
            return None;
        }
        // As in the watch cache: the claim's write sends neither managedFields nor the payload
        // back (the status subresource ignores the spec; the claim's answer carries the
        // payload).
        job.drop_payload_and_result();
        Some(Arc::new(job))
    }

    /// Marks `job`'s snapshot stale in the queue copy, if one is kept.
    fn mark_tried(&self, job: &LeasedJob) {
        if let Some(queue) = self.inner.queue.as_ref() {
            let rv = job.resource_version().unwrap_or_default();
            queue.tried.lock().unwrap().mark(&job.name_any(), &rv);
        }
    }

    /// Claims `snapshot`. `Ok(None)` when it was stale (409) or is no longer claimable. In
    /// both cases, and when the claim succeeds, `snapshot` is marked tried: it is known stale.
    /// A write that failed or timed out is an error and marks nothing. `offered`: the job was
    /// offered by the dispatcher (said in the log), with these slots to try first in a queue
    /// with limits ([`Preferred`]). [`Tried::HeldBack`], with nothing
    /// written or marked, when the queue was paused since the job was chosen
    /// ([`crate::paused`]) or a limit of the queue is reached ([`crate::limited`]).
    pub(crate) async fn try_claim(
        &self,
        snapshot: &LeasedJob,
        offered: Option<(Preferred, Preferred)>,
    ) -> Result<Tried, WorkerError> {
        if self.paused_now() {
            return Ok(Tried::HeldBack);
        }
        // One copy of the LeasedQueue for the whole claim: the limits it takes slots for are
        // the limits its write records (status.limits), and its defaults are the policy.
        let queue = self.queue_object();
        let copy = queue
            .as_ref()
            .and_then(|q| q.metadata.resource_version.clone());
        // Refused as outside the limits under this very copy a moment ago: it lags the API
        // server's, and would be refused again.
        if self
            .inner
            .outside_limits
            .holds(copy.as_deref(), Instant::now())
            .is_some()
        {
            return Ok(Tried::HeldBack);
        }
        // A limited queue: a slot of each limit first, marked with the claim's token.
        let fresh = Token::issue(snapshot.attempt() + 1);
        let (prefer, swap) = offered.unwrap_or((Preferred::NONE, Preferred::NONE));
        let Some(slots) = self
            .take_slots(queue.as_deref(), snapshot, &fresh, prefer, swap)
            .await?
        else {
            return Ok(Tried::HeldBack);
        };
        // The queue's defaults, for what the job sets none of: the claim records the result
        // (status.policy), which every later decision about the attempt reads.
        let defaults = queue.as_ref().and_then(|q| q.spec.defaults.clone());
        let policy = leasehold_core::policy::resolve(&snapshot.spec, defaults.as_ref());
        let lease_duration =
            Duration::from_secs(u64::try_from(policy.lease_duration_seconds.max(1)).unwrap_or(1));
        let bound = call_bound(lease_duration);
        // The claim write runs as a task of its own, so that one whose answer comes too late
        // is still seen through: if it got through after all, it is given back.
        // Taken before the write can be sent: the lease runs from the claim (see take_lease).
        let started = Instant::now();
        let taken = leasehold_kube::slots::summary(&slots);
        let mut write = {
            let (me, snapshot) = (self.clone(), snapshot.clone());
            tokio::spawn(async move {
                let identity = &me.inner.config.identity;
                let queue = queue.as_deref();
                claim_taking(&me.inner.jobs, &snapshot, identity, queue, fresh, taken).await
            })
        };
        let claimed = match tokio::time::timeout(bound, &mut write).await {
            Ok(Ok(claimed)) => {
                self.note_claim_write(started.elapsed());
                Ok(claimed)
            }
            Ok(Err(join)) => {
                return Err(WorkerError::unavailable(
                    format!("claim of LeasedJob {}", snapshot.reference()),
                    format!("the claim failed inside the sidecar: {join}"),
                ))
            }
            Err(elapsed) => {
                let me = self.clone();
                tokio::spawn(async move {
                    if let Ok(Ok((job, token))) = write.await {
                        let release = Outcome::Release { checkpoint: None };
                        me.undo_claim(&job, &token, release).await;
                    }
                });
                Err(elapsed)
            }
        };
        let (job, token) = match claimed {
            Ok(Ok(claimed)) => {
                // The snapshot is stale now too: this claim changed the job. Until the watch
                // brings the claim, the cache still shows the job claimable, and a claimer
                // quick to come back would pick it again, its oldest own job, and meet its
                // own write (409).
                self.mark_tried(snapshot);
                self.narrow_window();
                claimed
            }
            Ok(Err(ClaimError::Conflict { .. })) => {
                // Only a snapshot known to be stale is skipped from now on: one whose write
                // failed or timed out is tried again, or its owner would pass it by while the
                // others leave it to that owner (share::RESERVED_PER_CLAIMER).
                self.mark_tried(snapshot);
                self.inner.metrics.claim_conflict();
                self.widen_window();
                return Ok(Tried::Lost);
            }
            Ok(Err(
                ClaimError::NotQueued { .. }
                | ClaimError::Gone { .. }
                | ClaimError::Unversioned { .. },
            )) => {
                self.mark_tried(snapshot);
                // Not sent (or the job is gone): its slots name a claim that is not made.
                self.give_back_slots(&slots).await;
                return Ok(Tried::Lost);
            }
            Ok(Err(e @ ClaimError::OutsideLimits { .. })) => {
                // The API server's copy of the LeasedQueue sets limits this copy does not show
                // (or has not confirmed them yet): nothing was written. Claims under this copy
                // wait limited::OUTSIDE_LIMITS_HOLD, or until the watch brings another.
                let (hold, first) = self
                    .inner
                    .outside_limits
                    .refused(copy.as_deref(), Instant::now());
                if first {
                    warn!(job = %snapshot.reference(), "{e}; the API server's copy of the LeasedQueue and this sidecar's differ: claims under this copy wait {hold:?}, longer if refused again, or until it changes");
                } else {
                    debug!(job = %snapshot.reference(), "{e}; claims under this copy wait {hold:?}");
                }
                self.give_back_slots(&slots).await;
                return Ok(Tried::HeldBack);
            }
            Ok(Err(e @ ClaimError::Api { .. })) => {
                return Err(WorkerError::unavailable(
                    format!("claim of LeasedJob {}", snapshot.reference()),
                    error_chain(&e),
                ))
            }
            Err(_) => {
                // The claim write may have landed without its answer: undo it if it did (a
                // release fenced by the token it would carry is refused if it did not).
                return Err(WorkerError::unavailable(
                    format!("claim of LeasedJob {}", snapshot.reference()),
                    format!(
                        "the API server did not answer within {} ms; a claim that got through is being given back",
                        bound.as_millis()
                    ),
                ));
            }
        };
        // The Lease is not written here: the attempt's first renewal writes it (see the module
        // doc), so a job done before then costs the claim and its end only.
        let job_ref = job.reference();
        let offered = offered.is_some();
        let via = if offered {
            ", offered by the dispatcher"
        } else {
            ""
        };
        info!(job = %job_ref, attempt = token.attempt(), offered, "Claimed LeasedJob {job_ref} (attempt {}){via}", token.attempt());
        let waited = job.metadata.creation_timestamp.as_ref().map(|created| {
            Timestamp::now()
                .duration_since(created.0)
                .as_secs_f64()
                .max(0.0)
        });
        self.inner.metrics.claimed(waited);
        if offered {
            self.inner.metrics.claimed_offered();
        }
        let status = job.status.clone().unwrap_or_default();
        let mut slim = job.clone();
        slim.drop_payload_and_result();
        let policy = job.policy();
        let lease_duration_seconds = policy.lease_duration_seconds;
        let last_attempt = status.failures.len() as i64 + 1 >= i64::from(policy.max_attempts);
        self.hold(
            &job.name_any(),
            token.clone(),
            lease_duration_seconds,
            Some(slim),
            started,
        );
        self.inner
            .own_slots
            .held(&job.name_any(), token.as_str(), &slots);
        let trace = trace_context(&job);
        Ok(Tried::Claimed(Box::new(Claimed {
            namespace: self.inner.config.namespace.clone(),
            name: job.name_any(),
            queue: job.spec.queue.clone(),
            attempt: token.attempt(),
            token,
            payload: job.spec.payload.clone(),
            lease_duration_seconds,
            checkpoint: status.checkpoint,
            max_attempts: policy.max_attempts,
            failures: status.failures,
            last_attempt,
            traceparent: trace.as_ref().map(|t| t.traceparent.clone()),
            tracestate: trace.and_then(|t| t.tracestate),
        })))
    }
}

/// The trace context the claim of `job` carries ([`leasehold_core::trace::carried`]). A
/// malformed annotation is skipped with one log line (info: the producer's trace is cut here,
/// which someone reading traces may want to know), never an error of the claim.
fn trace_context(job: &LeasedJob) -> Option<trace::Carried> {
    let job_ref = job.reference();
    match trace::carried(job.annotations()) {
        Ok((carried, None)) => carried,
        Ok((carried, Some(skipped))) => {
            info!(job = %job_ref, "LeasedJob {job_ref}: annotation {}: {skipped}; the claim carries no tracestate", trace::TRACESTATE_ANNOTATION);
            carried
        }
        Err(e) => {
            info!(job = %job_ref, "LeasedJob {job_ref}: annotation {}: {e}; the claim carries no trace context", trace::TRACEPARENT_ANNOTATION);
            None
        }
    }
}

/// The queue copy's snapshots of the jobs `names` of namespace `ns`, in that order (a job the
/// copy no longer has is left out).
fn cached(queue: &crate::QueueCopy, ns: &str, names: &[&str]) -> Vec<Arc<LeasedJob>> {
    names
        .iter()
        .filter_map(|n| queue.store.get(&ObjectRef::new(n).within(ns)))
        .collect()
}
