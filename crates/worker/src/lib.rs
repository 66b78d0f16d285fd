//! The worker client: the library a Rust worker uses, and what the sidecar serves over HTTP.
//!
//! A [`Worker`] claims the jobs of one queue of one namespace: those its dispatcher offers
//! ([`dispatched`]), or, without one, those it chooses from its watch cache of the queue
//! ([`leasehold_core::claim`]). It keeps every held lease renewed in the background, and forwards the
//! worker's heartbeats, results, failures and releases as conditional writes.
//!
//! The claim's own write starts the lease: an attempt's Lease is written by its first renewal
//! (the worker's first heartbeat, or the background renewal a third of a lease duration after
//! the claim), so an attempt that ends before then costs two writes, the claim and its end
//! (docs/protocol.md, "The Lease is written by the first renewal"). A first renewal whose Lease
//! name is taken by something else undoes the claim, as a release with the condition
//! `LeaseConflict`; one that would come a whole lease duration after the claim (this process
//! was frozen) is not made: the lease is lost.
//!
//! Background renewal runs every `leaseDurationSeconds / 3` per held job (client-go's leader
//! election renews at a similar fraction of its lease). It stops when:
//! - the attempt ends (complete, fail, release);
//! - a renewal finds holderIdentity changed or the Lease gone, or the held-jobs watch cache
//!   shows the job no longer Leased to the attempt (expired, cancelled), or a fresh read does
//!   for a job that left that cache (superseded by another holder's claim, deleted): the lease
//!   is lost;
//! - renewals have failed (network, 5xx, 403) for a whole lease duration, measured on the
//!   monotonic clock from the last success: the lease is declared lost, since the controller
//!   may have requeued the job by then;
//! - the worker has not called for `max(worker_timeout, leaseDurationSeconds)`: a hung worker
//!   must not keep its lease forever. The sidecar stops renewing; the controller then requeues
//!   the job once the lease runs out.
//!
//! From the moment a lease is declared lost, every call with its token is answered with
//! [`WorkerError::LeaseLost`], without asking the API server.
//!
//! An attempt this process ends (complete, fail, release) leaves its Lease as it is: the job's
//! status fences the ended attempt, so the Lease keeps naming the ended token until the next
//! claim takes it over or garbage collection deletes it with the job (docs/protocol.md, "What
//! fences what"). Since the Lease would still accept that token's renewals, a heartbeat is
//! accepted only when the job is also still Leased to the token: this process remembers the
//! attempts it ended, checks its watch cache before and after the renewal, and reads the job

pub mod dispatched;
mod end;
mod heartbeat;
pub mod held_watch;
mod limited;
mod listed;
mod own_slots;
mod paused;
mod pick;
mod renew;
#[cfg(test)]
mod tests;
mod window;

pub use end::validate_reason;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::Api;
use serde::Serialize;
use serde_json::Value;
use thiserror::Error;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use leasehold_core::claim;
use leasehold_core::claim_index::ClaimIndex;
use leasehold_core::crd::{AttemptFailure, LeasedJob};
use leasehold_core::fence::Refusal;
use leasehold_core::progress::Progress;
use leasehold_core::token::{Token, TokenError};
use leasehold_core::Category;
use leasehold_kube::api::Clients;
use leasehold_kube::health::Health;
use leasehold_kube::queue_watch::{self, QueueWatch};
use leasehold_kube::recorder::Recorder;

/// Default for [`WorkerConfig::worker_timeout`]: five minutes.
pub const DEFAULT_WORKER_TIMEOUT: Duration = Duration::from_secs(300);
/// Default for [`WorkerConfig::spread`].
pub const DEFAULT_SPREAD: usize = 16;
/// Longest accepted failure message, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 4096;
/// Delay before retrying a failed background renewal.
/// How long a job whose claim was undone waits before the next claim, when its Lease name is
/// taken by something that is not leasehold's (a person must act).
pub const FOREIGN_LEASE_RETRY: Duration = Duration::from_secs(30);
/// As [`FOREIGN_LEASE_RETRY`], when the Lease was left by an earlier job of the same name
/// (garbage collection removes it within seconds).
pub const STALE_LEASE_RETRY: Duration = Duration::from_secs(3);

/// Options of a [`Worker`].
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Namespace whose LeasedJobs this worker claims.
    pub namespace: String,
    /// Queue (spec.queue) it claims from.
    pub queue: String,
    /// Identity written to status.holder: the pod name.
    pub identity: String,
    /// How many of the oldest top-priority jobs a claim chooses among at random (1 = strict
    /// FIFO). Spreads concurrent claimers over different jobs so fewer claims conflict. Under
    /// contention the window adapts: a 409 quadruples it (while more jobs are claimable than
    /// it holds, up to 64 x spread), a successful claim narrows it by 1/32 back towards
    /// spread, so it settles where a few claims in a hundred conflict. Spread 1 never widens.
    pub spread: usize,
    /// How long the worker may stay silent (no heartbeat or other call) before background
    /// renewal stops for its jobs. The effective limit is at least the job's lease duration.
    pub worker_timeout: Duration,
    /// Claim through the dispatcher when one is advertised ([`dispatched`]); None chooses on
    /// its own always.
    pub dispatch: Option<dispatched::DispatchConfig>,
}

/// A job just claimed: what the worker needs to do it and prove it.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Claimed {
    /// The job's namespace.
    pub namespace: String,
    /// The job's name.
    pub name: String,
    /// The job's queue (spec.queue): the one this sidecar claims from.
    pub queue: String,
    /// This attempt's number (status.attempt).
    pub attempt: i32,
    /// The fencing token, to present on every later call.
    pub token: Token,
    /// spec.payload, exactly as applied.
    pub payload: Value,
    /// The lease duration, in seconds.
    pub lease_duration_seconds: i32,
    /// The checkpoint left by an earlier attempt, or null.
    pub checkpoint: Option<Value>,
    /// Failed attempts that end the job: maxAttempts of the policy this attempt was claimed
    /// under ([`LeasedJob::policy`]).
    pub max_attempts: i32,
    /// The job's earlier failed attempts (status.failures), oldest first: expiries included
    /// (reason `LeaseExpired`), releases not.
    pub failures: Vec<AttemptFailure>,
    /// Whether a failure of this attempt ends the job Failed: `failures.len() + 1 >=
    /// max_attempts` ([`leasehold_core::fence::next_phase`]).
    pub last_attempt: bool,
    /// The producer's W3C traceparent, from the job's annotation
    /// [`leasehold_core::trace::TRACEPARENT_ANNOTATION`]: absent when the job has none or its
    /// value is malformed ([`leasehold_core::trace::carried`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The producer's W3C tracestate ([`leasehold_core::trace::TRACESTATE_ANNOTATION`]): only
    /// beside a traceparent, and only when valid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

/// A successful renewal.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Renewal {
    /// The renewTime written to the Lease (RFC 3339, this host's clock).
    pub renew_time: Timestamp,
    /// renewTime + leaseDurationSeconds: when the lease runs out if not renewed again. The
    /// controller judges expiry on its own clock from when it saw the renewal, so this is a
    /// guide, not a promise.
    pub expires_at: Timestamp,
    /// The lease duration, in seconds.
    pub lease_duration_seconds: i32,
}

/// Errors of worker calls; [`Category::category`] is the stable code the sidecar returns.
#[derive(Debug, Error)]
pub enum WorkerError {
    /// The token is missing or malformed.
    #[error("{0}")]
    InvalidToken(#[from] TokenError),
    /// A field of the request breaks a rule.
    #[error("{field} {problem}")]
    Invalid {
        /// The field, e.g. `reason`.
        field: &'static str,
        /// What is wrong with its value, and the rule.
        problem: String,
    },
    /// The API server refused the write: see the refusal.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// The sidecar itself declared this lease lost earlier (or learnt it from the cache); the
    /// code is the refusal's (`lease_lost`, `cancelled`, `job_finished`, ...).
    #[error("{message}")]
    LeaseLost {
        /// Stable error code.
        code: &'static str,
        /// What happened, to which job, what to do.
        message: String,
    },
    /// The checkpoint is too large, or the write would make the job larger than a job may be
    /// ([`leasehold_core::crd::MAX_JOB_BYTES`]).
    #[error("{0}")]
    TooLarge(String),
    /// The sidecar is shutting down and claims no more jobs.
    #[error("this sidecar is shutting down and claims no more jobs; held jobs can still be heartbeated, completed, failed or released")]
    ShuttingDown,
    /// The API server could not be reached, failed, or did not answer within the call's bound
    /// ([`call_bound`]). Retry with the same token: a write that did get through is then
    /// refused or found done, never applied twice.
    #[error("{what} failed: {detail}; try again with the same token")]
    Unavailable {
        /// What was being done, naming the job.
        what: String,
        /// The cause.
        detail: String,
        /// For a held job: when its lease runs out unless a renewal gets through, as far as
        /// this sidecar knows (the last confirmed renewTime + leaseDurationSeconds).
        expires_at: Option<Timestamp>,
    },
}

impl WorkerError {
    fn unavailable(what: impl Into<String>, detail: impl Into<String>) -> WorkerError {
        WorkerError::Unavailable {
            what: what.into(),
            detail: detail.into(),
            expires_at: None,
        }
    }
}

/// The longest a worker's call about a held job waits for the API server before it is answered
/// [`WorkerError::Unavailable`]: `min(5 s, leaseDurationSeconds / 3)`, well inside the lease, so
/// that a worker always hears back while its lease may still be valid and can decide to stop.
/// (The issue that set it: a heartbeat through a partition must not block for the whole outage
/// and answer only after another worker holds the job.)
pub fn call_bound(lease_duration: Duration) -> Duration {
    (lease_duration / 3).min(MAX_CALL_BOUND)
}

/// Upper limit of [`call_bound`].
pub const MAX_CALL_BOUND: Duration = Duration::from_secs(5);

impl Category for WorkerError {
    /// Stable error code.
    fn category(&self) -> &'static str {
        match self {
            WorkerError::InvalidToken(_) => "invalid_token",
            WorkerError::Invalid { .. } => "invalid_request",
            WorkerError::Refused(r) => r.category(),
            WorkerError::LeaseLost { code, .. } => code,
            WorkerError::TooLarge(_) => "too_large",
            WorkerError::Unavailable { .. } => "unavailable",
            WorkerError::ShuttingDown => "shutting_down",
        }
    }
}

/// One held attempt, as this process knows it.
struct Held {
    token: Token,
    /// The job as the claim's answer stored it (payload and result dropped), when this process
    /// made the claim: the snapshot an end of the attempt builds its write from while the
    /// watch has not delivered the claim yet (quick jobs), instead of a read.
    claimed: Option<LeasedJob>,
    lease_name: String,
    duration: Duration,
    state: Mutex<HeldState>,
    /// Wakes the background renewer when the attempt ends or a renewal moved the schedule.
    wake: Notify,
}

impl Held {
    /// Whether the attempt's Lease was written.
    fn lease_taken(&self) -> bool {
        self.state.lock().unwrap().lease_taken
    }

    /// Whether the attempt is held still: neither ended nor declared lost.
    fn is_held(&self) -> bool {
        let st = self.state.lock().unwrap();
        !st.ended && st.lost.is_none()
    }
}

struct HeldState {
    /// When the last renewal was confirmed (monotonic clock).
    last_renewed: Instant,
    /// The renewTime of the last confirmed renewal (wall clock), for `expiresAt`.
    renew_time: Timestamp,
    /// False until the attempt's Lease is written (by its first renewal): until then the
    /// claim's write is its only renewal, and `last_renewed` is when that write was sent.
    lease_taken: bool,
    /// True once a first renewal was sent: one whose answer was lost may have written the
    /// Lease, and its checkpoint, all the same.
    first_renewal_sent: bool,
    last_contact: Instant,
    checkpoint: Option<Value>,
    /// The progress the worker last sent, carried by every renewal from then on (background
    /// ones included), so a heartbeat whose own renewal did not get through is not lost.
    progress: Progress,
    /// Why the lease was declared lost: (error code, message).
    lost: Option<(&'static str, String)>,
    ended: bool,
}

struct Inner {
    config: WorkerConfig,
    jobs: Api<LeasedJob>,
    leases: Api<Lease>,
    /// The copy of the queue claims choose from; `None` with a dispatcher: then the sidecar
    /// keeps no copy of its queue (see [`listed`]).
    queue: Option<QueueCopy>,
    /// The jobs this process's identity holds or last held, in any phase, from an attempt's
    /// first renewal while attempts are held (its `store`): what heartbeats and ends of
    /// attempts check; and the way to start the watch behind them ([`held_watch`]).
    held_watch: held_watch::HeldWatch,
    held: Arc<Mutex<HashMap<String, Arc<Held>>>>,
    /// The latest attempt this process ended per job name, with the refusal its token now
    /// earns: its Lease still names it (see the module doc), so a heartbeat with it must be
    /// refused here.
    ended_here: Mutex<HashMap<String, (Token, Refusal)>>,
    /// Where claims, conflicts, refusals, heartbeats and run times are reported.
    metrics: Arc<dyn Recorder>,
    health: Arc<Health>,
    /// Wakes [`Worker::drained`] when a held attempt ends.
    ended: Notify,
    /// True once draining began: pending long polls end with [`WorkerError::ShuttingDown`].
    draining: watch::Sender<bool>,
    /// The claim window now (see [`WorkerConfig::spread`]).
    window: AtomicUsize,
    /// How long claim writes have been taking, in ms: a moving average (1/4 of each new
    /// answer's time), for the rendezvous guard ([`share::rendezvous_guard_ms`]).
    claim_write_ms: AtomicU64,
    /// The dispatcher's client, when claims go through it ([`WorkerConfig::dispatch`]).
    dispatched: Option<dispatched::Dispatched>,
    /// The queue's LeasedQueue: whether it pauses claims ([`paused`]), and the limits claims
    /// take slots for ([`limited`]).
    queue_object: watch::Receiver<leasehold_kube::queue_object::Known>,
    /// The keys found at their limit lately, which picks pass over ([`limited`]).
    full_keys: limited::FullKeys,
    /// The last claim the API server refused as outside the queue's limits ([`limited`]).
    outside_limits: limited::OutsideLimits,
    /// The slots this claimer took itself, held and ended ([`own_slots`]).
    own_slots: own_slots::OwnSlots,
    /// Lets unit tests, whose watches are never answered, say what the LeasedQueue is.
    #[cfg(test)]
    queue_object_tx: watch::Sender<leasehold_kube::queue_object::Known>,
}

/// What a sidecar without a dispatcher keeps of its queue to choose claims from, all fed by
/// one queue watch ([`leasehold_kube::queue_watch`]).
struct QueueCopy {
    /// Whether the queue watch runs, is complete, and who is claiming.
    watch: Arc<QueueWatch>,
    /// The queue's jobs: empty while the queue watch is stopped.
    store: Store<LeasedJob>,
    /// Bumped after every event of the queue watch.
    changes: watch::Receiver<u64>,
    /// The queue's claimable jobs in claim order, and its recent claimers, kept from the same
    /// watch as `store` (which is never older than it).
    index: Arc<Mutex<ClaimIndex>>,
    /// Snapshots known stale (claimed here, lost with a 409, or no longer claimable), so a
    /// cache entry the watch has not replaced yet is not tried again.
    tried: Mutex<claim::Stale>,
}

/// A claimer of one queue. Cheap to clone.
#[derive(Clone)]
pub struct Worker {
    inner: Arc<Inner>,
}

impl Worker {
    /// Starts watching the queue. Returns the worker and the watch task's handle, which runs
    /// until aborted; await or select it so that its end is noticed. Claims, conflicts,
    /// refusals, heartbeats, run times and skipped objects are reported to `recorder`
    /// ([`leasehold_kube::recorder::NoRecorder`] for none).
    pub fn start(
        clients: impl Into<Clients>,
        config: WorkerConfig,
        recorder: Arc<dyn Recorder>,
    ) -> (Worker, JoinHandle<()>) {
        let clients = clients.into();
        let jobs: Api<LeasedJob> = Api::namespaced(clients.requests.clone(), &config.namespace);
        let leases: Api<Lease> = Api::namespaced(clients.requests, &config.namespace);
        let (dispatched, follow_advert) = match config.dispatch.clone() {
            Some(dispatch) => {
                let adverts: Api<Lease> =
                    Api::namespaced(clients.watches.clone(), &dispatch.advert_namespace);
                let asker = dispatched::Asker {
                    namespace: config.namespace.clone(),
                    queue: config.queue.clone(),
                    worker: config.identity.clone(),
                };
                let (d, follow) = dispatched::Dispatched::start(adverts, dispatch, asker);
                (Some(d), futures::future::Either::Left(follow))
            }
            None => (
                None,
                futures::future::Either::Right(std::future::pending::<()>()),
            ),
        };
        let watched: Api<LeasedJob> = Api::namespaced(clients.watches.clone(), &config.namespace);
        let metrics = recorder;
        let (queue_object_tx, queue_object) = watch::channel(Default::default());
        let follow_pause = leasehold_kube::queue_object::follow(
            Api::namespaced(clients.watches, &config.namespace),
            &config.queue,
            Arc::clone(&metrics),
            queue_object_tx.clone(),
        );
        // Two watches, both filtered by the API server on selectable fields of the CRD: the
        // jobs this process holds, from a first renewal while it holds one (held_watch), and, only without a
        // dispatcher, the queue's jobs for claiming, kept while claims come
        // (leasehold_kube::queue_watch). With a dispatcher
        // the sidecar keeps no copy of its queue: it claims what it is offered, and falls back
        // to a bounded list (listed.rs).
        let (queue, queue_task) = if dispatched.is_some() {
            (None, futures::future::Either::Left(std::future::pending()))
        } else {
            let (store, writer) = reflector::store();
            let (tx, changes) = watch::channel(0u64);
            let index = Arc::new(Mutex::new(ClaimIndex::new(&config.queue)));
            let queue_watch = Arc::new(QueueWatch::default());
            let task = queue_watch::run(
                watched.clone(),
                config.queue.clone(),
                Arc::clone(&metrics),
                queue_watch::Cache {
                    writer,
                    store: store.clone(),
                    index: Arc::clone(&index),
                    changes: tx,
                },
                Arc::clone(&queue_watch),
            );
            let copy = QueueCopy {
                watch: queue_watch,
                store,
                changes,
                index,
                tried: Mutex::default(),
            };
            (Some(copy), futures::future::Either::Right(task))
        };
        let held: Arc<Mutex<HashMap<String, Arc<Held>>>> = Arc::default();
        let holds = {
            let held = Arc::clone(&held);
            move |name: Option<&str>| {
                let held = held.lock().unwrap();
                match name {
                    Some(name) => held.get(name).is_some_and(|h| h.is_held()),
                    None => held.values().any(|h| h.is_held()),
                }
            }
        };
        let (held_watch, held_task) = held_watch::HeldWatch::start(
            watched,
            &config.queue,
            &config.identity,
            Arc::clone(&metrics),
            holds,
        );
        let health = Health::new();
        let ready = {
            let (health, queue_watch, mut known) = (
                Arc::clone(&health),
                queue.as_ref().map(|q| Arc::clone(&q.watch)),
                queue_object.clone(),
            );
            async move {
                let _ = known.wait_for(|k| k.paused().is_some()).await;
                if let Some(queue_watch) = queue_watch {
                    queue_watch.wait_ever_synced().await;
                }
                health.set_synced();
                std::future::pending::<()>().await;
            }
        };
        // One task for all of them, so that aborting it stops them all.
        let watch_task = tokio::spawn(async move {
            tokio::select! {
                () = queue_task => {}
                () = held_task => {}
                () = ready => {}
                () = follow_advert => {}
                () = follow_pause => {}
            }
        });
        let window = config.spread;
        let inner = Inner {
            config,
            jobs,
            leases,
            queue,
            held_watch,
            held,
            ended_here: Mutex::default(),
            metrics,
            health,
            ended: Notify::new(),
            draining: watch::channel(false).0,
            window: AtomicUsize::new(window),
            claim_write_ms: AtomicU64::new(0),
            dispatched,
            queue_object,
            full_keys: limited::FullKeys::default(),
            outside_limits: limited::OutsideLimits::default(),
            own_slots: own_slots::OwnSlots::default(),
            #[cfg(test)]
            queue_object_tx,
        };
        (
            Worker {
                inner: Arc::new(inner),
            },
            watch_task,
        )
    }

    /// The options this worker runs with.
    pub fn config(&self) -> &WorkerConfig {
        &self.inner.config
    }

    /// True once the queue's LeasedQueue is known (or known to be absent) and (without a
    /// dispatcher) the queue's watch has listed the queue once (it may have stopped since:
    /// [`leasehold_kube::queue_watch`]). The held jobs are not listed: their watch runs only
    /// from an attempt's first renewal while this process holds one ([`held_watch`]).
    pub fn is_ready(&self) -> bool {
        self.inner.queue_object.borrow().paused().is_some()
            && self
                .inner
                .queue
                .as_ref()
                .is_none_or(|q| q.watch.ever_synced())
    }

    /// This worker's health (readiness, dead background tasks).
    pub fn health(&self) -> &Arc<Health> {
        &self.inner.health
    }

    /// Starts a graceful shutdown: claims are refused from now on (and readiness fails), while
    /// heartbeats, results, failures and releases of held jobs still work.
    pub fn start_draining(&self) {
        self.inner.health.set_shutting_down();
        self.inner.draining.send_replace(true);
    }

    /// Counts refusals of stale or foreign tokens on the way out.
    fn counted(&self, e: WorkerError) -> WorkerError {
        if e.category() == LEASE_LOST {
            self.inner.metrics.stale_token_refused();
        }
        e
    }

    /// Number of attempts this worker holds now: ended attempts and leases declared lost are
    /// not held (a drain does not wait for them).
    pub fn held_count(&self) -> usize {
        self.inner
            .held
            .lock()
            .unwrap()
            .values()
            .filter(|h| h.is_held())
            .count()
    }

    fn job_ref(&self, name: &str) -> String {
        format!("{}/{}", self.inner.config.namespace, name)
    }
    /// The held attempt of `name` if it is this token's, after checking it was not declared
    /// lost; records the worker's call.
    fn held_for(&self, name: &str, token: &Token) -> Result<Option<Arc<Held>>, WorkerError> {
        let held = self.inner.held.lock().unwrap().get(name).cloned();
        let Some(held) = held.filter(|h| h.token == *token) else {
            return Ok(None);
        };
        let mut st = held.state.lock().unwrap();
        if st.lost.is_none() && renew::outlived(st.last_renewed.elapsed(), held.duration) {
            // Renewals may be stuck behind a partition: a whole lease has passed without a
            // confirmed one, so the controller may have requeued the job by now.
            let why = format!(
                "no renewal was confirmed for {}s, a whole lease duration",
                st.last_renewed.elapsed().as_secs()
            );
            st.lost = Some((LEASE_LOST, lost_message(&self.job_ref(name), &why)));
        }
        if let Some((code, message)) = &st.lost {
            return Err(WorkerError::LeaseLost {
                code,
                message: message.clone(),
            });
        }
        st.last_contact = Instant::now();
        drop(st);
        Ok(Some(held))
    }

    /// The bound of a call about job `name` ([`call_bound`] of its lease duration, as held or
    /// cached), and when its lease runs out as far as this sidecar knows.
    fn bound_of(&self, name: &str) -> (Duration, Option<Timestamp>) {
        if let Some(h) = self.inner.held.lock().unwrap().get(name) {
            let st = h.state.lock().unwrap();
            let expires = st.renew_time + SignedDuration::try_from(h.duration).unwrap_or_default();
            return (call_bound(h.duration), Some(expires));
        }
        let key = ObjectRef::new(name).within(&self.inner.config.namespace);
        let secs = self
            .inner
            .held_watch
            .store
            .get(&key)
            .or_else(|| self.inner.queue.as_ref()?.store.get(&key))
            .map_or(5, |j| j.policy().lease_duration_seconds.max(1));
        let secs = u64::try_from(secs).unwrap_or(5);
        (call_bound(Duration::from_secs(secs)), None)
    }

    /// Runs `call` (one of the worker's calls about job `name`) as a task of its own and waits
    /// for it at most [`Worker::bound_of`] the job. Past the bound the worker is answered
    /// [`WorkerError::Unavailable`] with the lease's known expiry, while the call goes on to its
    /// end in the background, so that this process's state stays consistent (a write that lands
    /// late is recorded as if answered in time; the worker's retry then finds it done).
    async fn bounded<T: Send + 'static>(
        &self,
        name: &str,
        what: &str,
        call: impl std::future::Future<Output = Result<T, WorkerError>> + Send + 'static,
    ) -> Result<T, WorkerError> {
        let (bound, expires_at) = self.bound_of(name);
        let task = tokio::spawn(call);
        match tokio::time::timeout(bound, task).await {
            Ok(Ok(Err(WorkerError::Unavailable {
                what,
                detail,
                expires_at: None,
            }))) => Err(WorkerError::Unavailable {
                what,
                detail,
                expires_at: self.bound_of(name).1,
            }),
            Ok(Ok(result)) => result,
            Ok(Err(join)) => Err(WorkerError::unavailable(
                format!("{what} of LeasedJob {}", self.job_ref(name)),
                format!("the call failed inside the sidecar: {join}"),
            )),
            Err(_) => Err(WorkerError::Unavailable {
                what: format!("{what} of LeasedJob {}", self.job_ref(name)),
                detail: format!(
                    "the API server did not answer within {} ms (the bound for this job's calls: min(5 s, leaseDurationSeconds / 3))",
                    bound.as_millis()
                ),
                expires_at,
            }),
        }
    }
}

const LEASE_LOST: &str = "lease_lost";

/// The text of a lease declared lost by this process.
fn lost_message(job_ref: &str, why: &str) -> String {
    format!("lease lost: {job_ref}: {why}; stop working on it and claim again")
}
