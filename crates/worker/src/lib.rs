//! The worker client: the library a Rust worker uses, and what the sidecar serves over HTTP.
//!
//! A [`Worker`] watches one queue of one namespace, claims jobs from that watch cache
//! ([`leasehold_core::claim`]), keeps every held lease renewed in the background, and forwards the
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
//! afresh before renewing for a token it does not hold.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use serde::Serialize;
use serde_json::Value;
use thiserror::Error;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

use leasehold_core::claim;
use leasehold_core::claim_index::ClaimIndex;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::fence::{self, Outcome, Refusal};
use leasehold_core::lease;
use leasehold_core::progress::Progress;
use leasehold_core::share;
use leasehold_core::token::{Token, TokenError};
use leasehold_core::Category;
use leasehold_kube::api::{error_chain, is_too_large, Clients};
use leasehold_kube::claim::ClaimError;
use leasehold_kube::fence::FenceError;
use leasehold_kube::health::Health;
use leasehold_kube::lease::LeaseError;
use leasehold_kube::queue_watch::{self, QueueWatch};
use leasehold_kube::recorder::Recorder;

/// Default for [`WorkerConfig::worker_timeout`]: five minutes.
pub const DEFAULT_WORKER_TIMEOUT: Duration = Duration::from_secs(300);
/// Default for [`WorkerConfig::spread`].
pub const DEFAULT_SPREAD: usize = 16;
/// Longest accepted failure message, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 4096;
/// Delay before retrying a failed background renewal.
const RENEW_RETRY: Duration = Duration::from_secs(1);
/// How long a job whose claim was undone waits before the next claim, when its Lease name is
/// taken by something that is not leasehold's (a person must act).
pub const FOREIGN_LEASE_RETRY: Duration = Duration::from_secs(30);
/// As [`FOREIGN_LEASE_RETRY`], when the Lease was left by an earlier job of the same name
/// (garbage collection removes it within seconds).
pub const STALE_LEASE_RETRY: Duration = Duration::from_secs(3);
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

/// The claim window never widens past this many times [`WorkerConfig::spread`].
const MAX_WINDOW_FACTOR: usize = 64;
/// At most this many attempts ended by this process are remembered (one per job name, the
/// latest); past it the memory starts over and the watch cache and fresh reads answer alone.
const MAX_ENDED: usize = 10_000;

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
}

/// A job just claimed: what the worker needs to do it and prove it.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Claimed {
    /// The job's namespace.
    pub namespace: String,
    /// The job's name.
    pub name: String,
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
    /// The queue's jobs, for claiming: empty while the queue watch
    /// is stopped ([`leasehold_kube::queue_watch`]).
    store: Store<LeasedJob>,
    /// Whether the queue watch runs, is complete, and who is claiming.
    queue_watch: Arc<QueueWatch>,
    /// The jobs this process's identity holds or last held, in any phase: what heartbeats and
    /// ends of attempts check.
    held_store: Store<LeasedJob>,
    /// Set once `held_store` has listed them.
    held_synced: leasehold_kube::watch::Synced,
    /// Bumped after every event of the queue watch.
    changes: watch::Receiver<u64>,
    held: Mutex<HashMap<String, Arc<Held>>>,
    /// Snapshots known stale (claimed here, lost with a 409, or no longer claimable), so a
    /// cache entry the watch has not replaced yet is not tried again.
    tried: Mutex<claim::Stale>,
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
    /// The queue's claimable jobs in claim order, and its recent claimers, kept from the same
    /// watch as `store` (which is never older than it).
    index: Arc<Mutex<ClaimIndex>>,
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
        let watched: Api<LeasedJob> = Api::namespaced(clients.watches, &config.namespace);
        let metrics = recorder;
        // Two watches, both filtered by the API server on selectable fields of the CRD: the
        // queue's jobs, for claiming, kept only while claims come (leasehold_kube::queue_watch),
        // and the jobs this process holds, always.
        let (store, writer) = reflector::store();
        let (tx, changes) = watch::channel(0u64);
        let queue_watch = Arc::new(QueueWatch::default());
        let index = Arc::new(Mutex::new(ClaimIndex::new(&config.queue)));
        let queue_task = queue_watch::run(
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
        let (held_store, held_writer) = reflector::store();
        let held_stream = leasehold_kube::watch::watch(
            &watched,
            watcher::Config::default()
                .fields(&queue_watch::held_selector(&config.queue, &config.identity)),
            Arc::clone(&metrics),
            |_| {},
        )
        .modify(leasehold_core::crd::LeasedJob::drop_payload_and_result)
        .reflect(held_writer);
        let held_synced = leasehold_kube::watch::Synced::default();
        let held_stream = held_synced.track(held_stream);
        let held_task = async move {
            let mut stream = std::pin::pin!(held_stream);
            while let Some(event) = stream.next().await {
                if let Err(e) = event {
                    leasehold_kube::watch::log_error("LeasedJob", &e);
                }
            }
        };
        let health = Health::new();
        let ready = {
            let (health, held_synced, queue_watch) = (
                Arc::clone(&health),
                held_synced.clone(),
                Arc::clone(&queue_watch),
            );
            async move {
                held_synced.wait().await;
                queue_watch.wait_ever_synced().await;
                health.set_synced();
                std::future::pending::<()>().await;
            }
        };
        // One task for all three, so that aborting it stops them all.
        let watch_task = tokio::spawn(async move {
            tokio::select! {
                () = queue_task => {}
                () = held_task => {}
                () = ready => {}
            }
        });
        let window = config.spread;
        let inner = Inner {
            config,
            jobs,
            leases,
            store,
            queue_watch,
            held_store,
            held_synced,
            changes,
            held: Mutex::default(),
            tried: Mutex::default(),
            ended_here: Mutex::default(),
            metrics,
            health,
            ended: Notify::new(),
            draining: watch::channel(false).0,
            window: AtomicUsize::new(window),
            claim_write_ms: AtomicU64::new(0),
            index,
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

    /// True once the watch of the jobs this process holds has listed them, and the queue's
    /// watch has listed the queue once (it may have stopped since: [`leasehold_kube::queue_watch`]).
    pub fn is_ready(&self) -> bool {
        self.inner.held_synced.is_synced() && self.inner.queue_watch.ever_synced()
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

    /// Waits until no attempt is held, for at most `timeout`. True when none is.
    pub async fn drained(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let ended = self.inner.ended.notified();
            if self.held_count() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                return self.held_count() == 0;
            }
        }
    }

    /// Releases every attempt still held (with its last checkpoint), so that each job is
    /// requeued at once. Only for when the worker is known to have stopped. Returns how many
    /// were released.
    pub async fn release_all(&self) -> usize {
        let held: Vec<(String, Token)> = self
            .inner
            .held
            .lock()
            .unwrap()
            .iter()
            .map(|(name, h)| (name.clone(), h.token.clone()))
            .collect();
        let mut released = 0;
        for (name, token) in held {
            match self.release(&name, token.as_str()).await {
                Ok(_) => released += 1,
                Err(e) => {
                    warn!(job = %self.job_ref(&name), error = %e, "Release at shutdown failed")
                }
            }
        }
        released
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
            .filter(|h| {
                let st = h.state.lock().unwrap();
                !st.ended && st.lost.is_none()
            })
            .count()
    }

    fn job_ref(&self, name: &str) -> String {
        format!("{}/{}", self.inner.config.namespace, name)
    }

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
        let mut changes = self.inner.changes.clone();
        // The queue watch runs while this claim is in progress (and starts again if it had
        // stopped): a stopped one lists the queue first, waited for as long as `wait` and at
        // least RELIST_WAIT.
        let _claiming = self.inner.queue_watch.claiming();
        let mut draining = self.inner.draining.subscribe();
        let listed = deadline.max(Instant::now() + queue_watch::RELIST_WAIT);
        tokio::select! {
            synced = tokio::time::timeout_at(listed, self.inner.queue_watch.wait_synced()) => {
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
            changes.borrow_and_update();
            let picked = self.pick();
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
                let claimed = self.try_claim(&snapshot).await?;
                // try_claim marked the fresh copy stale (claimed, 409, or no longer
                // claimable); the cache holds the older snapshot until the watch brings the
                // fresh one and then the change, so both are skipped (claim::Stale keeps two).
                if let Some(cached) = cached {
                    self.mark_tried(&cached);
                }
                if let Some(claimed) = claimed {
                    return Ok(Some(claimed));
                }
                // Lost the race (or the job went away): the cache was stale. The write that
                // beat us is on its way through the watch, usually already here; pick again
                // from a cache at least that fresh rather than from the same stale one.
            }
            // Wake for the next job whose notBefore or retryAfter passes, if before the deadline.
            let now = Timestamp::now();
            let next = self.inner.index.lock().unwrap().next_claimable_at(now);
            let wake = next
                .map(|t| {
                    Instant::now() + Duration::try_from(t.duration_since(now)).unwrap_or_default()
                })
                .map_or(deadline, |t| t.min(deadline));
            // A claimer waiting its turn for a job looks again when the turn comes, even if no
            // change arrives (the claimers ahead of it may be busy or gone).
            let wake = turn.map_or(wake, |t| wake.min(t));
            tokio::select! {
                () = &mut gone => return Ok(None),
                _ = draining.wait_for(|d| *d) => return Err(WorkerError::ShuttingDown),
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

    /// The job to try to claim next, if any.
    ///
    /// The candidates are the oldest claimable jobs of the queue's [`ClaimIndex`]: the
    /// adaptive window, at least [`claim::WINDOW_PER_CLAIMER`] per claimer seen
    /// ([`claim::recent_claimers`]; [`claim::COLD_CLAIMERS`] when no claim was seen lately),
    /// less the snapshots already tried. When other claimers are seen, [`share::choose`] says
    /// which to try: this claimer's own oldest job, a turn at an open one, or
    /// [`Pick::Defer`] until a turn comes or a reserved job opens. Alone, or at a cold start, or
    /// with `--spread 1`: [`claim::pick`]'s random (or FIFO) choice in the window.
    fn pick(&self) -> Pick {
        let config = &self.inner.config;
        let now = Timestamp::now();
        let index = self.inner.index.lock().unwrap();
        let claimers = index.recent_claimers(&config.identity, now);
        let claimers: HashSet<&str> = claimers.iter().map(String::as_str).collect();
        let tried = self.inner.tried.lock().unwrap();
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
        let names = index.candidates(now, window, |name, rv| tried.contains(name, rv));
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
            return match self.cached(&[&name]).pop() {
                Some(job) if afresh => Pick::Fresh(job),
                Some(job) => Pick::Job(job),
                None => Pick::Nothing,
            };
        }
        // The snapshots tried are already left out of `names`. The index stays locked while
        // the store is read (its names are borrowed): at most the window's lookups, 512 at a
        // cold start, and no path takes the index lock while holding the store's.
        let jobs = self.cached(&names);
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
        if let Some(mut fresh) = found {
            if claim::claimable(&fresh, &self.inner.config.queue, Timestamp::now()) {
                // As in the watch cache: the claim's write sends neither managedFields nor the
                // payload back (the status subresource ignores the spec; the claim's answer
                // carries the payload).
                fresh.metadata.managed_fields = None;
                fresh.drop_payload_and_result();
                return Pick::Job(Arc::new(fresh));
            }
        }
        let job_ref = cached.reference();
        tracing::debug!(job = %job_ref, "Skipped LeasedJob {job_ref}: read afresh for a turn, it is no longer claimable");
        self.mark_tried(&cached);
        Pick::Nothing
    }

    /// The watch cache's copies of the jobs `names`, in that order (a job the cache no longer
    /// has is left out).
    fn cached(&self, names: &[&str]) -> Vec<Arc<LeasedJob>> {
        let ns = &self.inner.config.namespace;
        names
            .iter()
            .filter_map(|n| self.inner.store.get(&ObjectRef::new(n).within(ns)))
            .collect()
    }

    /// After a 409: widens the claim window fourfold, if more jobs are claimable than it holds
    /// (with fewer, a wider window would not spread claimers any further).
    fn widen_window(&self) {
        let spread = self.inner.config.spread;
        let window = self.inner.window.load(Ordering::Relaxed);
        if spread <= 1 || window >= spread * MAX_WINDOW_FACTOR {
            return;
        }
        let more = self
            .inner
            .index
            .lock()
            .unwrap()
            .claimable_more_than(Timestamp::now(), window);
        if more {
            let wider = (window * 4).min(spread * MAX_WINDOW_FACTOR);
            self.inner.window.store(wider, Ordering::Relaxed);
        }
        tracing::debug!(
            window,
            more_claimable = more,
            "Claim conflict (409); claim window was {window}"
        );
    }

    /// Folds the time one claim write took into [`Inner::claim_write_ms`].
    fn note_claim_write(&self, took: Duration) {
        let took = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
        let average = &self.inner.claim_write_ms;
        let was = average.load(Ordering::Relaxed);
        let now = if was == 0 { took } else { (3 * was + took) / 4 };
        average.store(now, Ordering::Relaxed);
    }

    /// After a successful claim: narrows the claim window by 1/32, not below spread.
    fn narrow_window(&self) {
        let spread = self.inner.config.spread;
        let window = self.inner.window.load(Ordering::Relaxed);
        if window > spread {
            let narrower = window.saturating_sub((window / 32).max(1)).max(spread);
            self.inner.window.store(narrower, Ordering::Relaxed);
        }
    }

    fn mark_tried(&self, job: &LeasedJob) {
        let rv = job.resource_version().unwrap_or_default();
        self.inner.tried.lock().unwrap().mark(&job.name_any(), &rv);
    }

    /// Claims `snapshot`. `Ok(None)` when it was stale (409) or is no longer claimable. In
    /// both cases, and when the claim succeeds, `snapshot` is marked tried: it is known stale.
    /// A write that failed or timed out is an error and marks nothing.
    async fn try_claim(&self, snapshot: &LeasedJob) -> Result<Option<Claimed>, WorkerError> {
        let lease_duration = Duration::from_secs(
            u64::try_from(snapshot.spec.lease_duration_seconds.max(1)).unwrap_or(1),
        );
        let bound = call_bound(lease_duration);
        // The claim write runs as a task of its own, so that one whose answer comes too late
        // is still seen through: if it got through after all, it is given back.
        // Taken before the write can be sent: the lease runs from the claim (see take_lease).
        let started = Instant::now();
        let mut write = {
            let (me, snapshot) = (self.clone(), snapshot.clone());
            tokio::spawn(async move {
                let identity = &me.inner.config.identity;
                leasehold_kube::claim::claim(&me.inner.jobs, &snapshot, identity).await
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
                return Ok(None);
            }
            Ok(Err(ClaimError::NotQueued { .. } | ClaimError::Gone { .. })) => {
                self.mark_tried(snapshot);
                return Ok(None);
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
        info!(job = %job_ref, attempt = token.attempt(), "Claimed LeasedJob {job_ref} (attempt {})", token.attempt());
        let waited = job.metadata.creation_timestamp.as_ref().map(|created| {
            Timestamp::now()
                .duration_since(created.0)
                .as_secs_f64()
                .max(0.0)
        });
        self.inner.metrics.claimed(waited);
        let status = job.status.clone().unwrap_or_default();
        let mut slim = job.clone();
        slim.drop_payload_and_result();
        self.hold(
            &job.name_any(),
            token.clone(),
            job.spec.lease_duration_seconds,
            Some(slim),
            started,
        );
        Ok(Some(Claimed {
            namespace: self.inner.config.namespace.clone(),
            name: job.name_any(),
            attempt: token.attempt(),
            token,
            payload: job.spec.payload.clone(),
            lease_duration_seconds: job.spec.lease_duration_seconds,
            checkpoint: status.checkpoint,
        }))
    }

    /// Undoes the claim of `job` with `token` that could not get its Lease: `outcome` is a
    /// release or an [`Outcome::Unclaim`], fenced by the token like any end of an attempt.
    async fn undo_claim(&self, job: &LeasedJob, token: &Token, outcome: Outcome) {
        let (job_ref, name) = (job.reference(), job.name_any());
        let undo = leasehold_kube::fence::apply_from(
            &self.inner.jobs,
            &self.inner.config.namespace,
            &name,
            token,
            &outcome,
            Some(job),
        );
        match tokio::time::timeout(MAX_CALL_BOUND, undo).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                warn!(job = %job_ref, error = %error_chain(&e), "Giving back the claim of LeasedJob {job_ref} failed; its lease will expire")
            }
            Err(_) => {
                warn!(job = %job_ref, "Giving back the claim of LeasedJob {job_ref} got no answer in time; its lease will expire")
            }
        }
    }

    /// Undoes the claim of `job` whose Lease name is taken by something else (`conflict`, a
    /// [`LeaseError::NotOurs`]): a release that sets the condition `LeaseConflict` and
    /// `status.retryAfter` ([`STALE_LEASE_RETRY`] for a leftover of an earlier job of the same
    /// name, else [`FOREIGN_LEASE_RETRY`]), so the job waits and is not counted as failed.
    /// Returns what the worker is told.
    async fn undo_for_conflict(
        &self,
        job: &LeasedJob,
        token: &Token,
        conflict: &LeaseError,
    ) -> String {
        let stale = matches!(conflict, LeaseError::NotOurs { stale: true, .. });
        let (reason, after) = if stale {
            ("StaleLease", STALE_LEASE_RETRY)
        } else {
            ("LeaseNotOurs", FOREIGN_LEASE_RETRY)
        };
        let identity = &self.inner.config.identity;
        let message = format!(
            "{conflict}; the claim by {identity} was undone (not a failed attempt) and the job is retried after {}s",
            after.as_secs()
        );
        let outcome = Outcome::Unclaim {
            reason: reason.to_string(),
            message: message.clone(),
            retry_after: Timestamp::now() + SignedDuration::try_from(after).unwrap_or_default(),
        };
        self.undo_claim(job, token, outcome).await;
        let job_ref = job.reference();
        warn!(job = %job_ref, attempt = token.attempt(), error = %error_chain(conflict), "Gave the claim of LeasedJob {job_ref} back: its Lease could not be taken");
        lost_message(&job_ref, &message)
    }

    /// Gives back a claim whose claimer went away before it was answered (its HTTP client
    /// disconnected, or timed out): a release, so the job is claimable again at once and the
    /// attempt does not count as failed.
    pub async fn give_back(&self, claimed: &Claimed) {
        let job_ref = self.job_ref(&claimed.name);
        match self.release(&claimed.name, claimed.token.as_str()).await {
            Ok(_) => {
                info!(job = %job_ref, attempt = claimed.attempt, "Released LeasedJob {job_ref}: the claimer went away before the claim was answered")
            }
            Err(e) => {
                warn!(job = %job_ref, error = %e, "Releasing LeasedJob {job_ref} after its claimer went away failed; its lease will expire")
            }
        }
    }

    /// Starts holding an attempt: records it and spawns its background renewer. `claimed` is
    /// the claim's answer when this process made the claim at `renewed` (when its write was
    /// sent); its Lease is then not written yet. Without it, the attempt was found holding a
    /// Lease renewed at `renewed`.
    fn hold(
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
            end(&p);
        }
        let worker = self.clone();
        let task = format!("renewer of {}", self.job_ref(name));
        let name = name.to_string();
        let renewer = Arc::clone(&held);
        self.inner.health.spawn(task, async move {
            worker.renew_in_background(&name, &renewer).await;
        });
        held
    }

    async fn renew_in_background(&self, name: &str, held: &Held) {
        let job_ref = self.job_ref(name);
        let interval = held.duration / 3;
        let silence_limit = self.inner.config.worker_timeout.max(held.duration);
        let mut due = Instant::now() + interval;
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(due) => {}
                () = held.wake.notified() => {}
            }
            let now = Instant::now();
            {
                let st = held.state.lock().unwrap();
                if st.ended || st.lost.is_some() {
                    return;
                }
                if st.last_renewed + interval > now {
                    // A worker heartbeat renewed it meanwhile.
                    due = st.last_renewed + interval;
                    continue;
                }
                if now.duration_since(st.last_contact) >= silence_limit {
                    drop(st);
                    let why = format!(
                        "the worker made no call for {}s, so the sidecar stopped renewing the lease",
                        silence_limit.as_secs()
                    );
                    warn!(job = %job_ref, attempt = held.token.attempt(), "Stopped renewing LeasedJob {job_ref}: {why}");
                    self.lose(held, LEASE_LOST, lost_message(&job_ref, &why));
                    return;
                }
            }
            // An attempt that ended elsewhere (expired, cancelled) may keep a Lease that still
            // accepts renewals: the job decides.
            if let Some((code, why)) = self.cached_job_moved_on(name, &held.token) {
                warn!(job = %job_ref, attempt = held.token.attempt(), "Stopped renewing LeasedJob {job_ref}: {why}");
                self.lose(held, code, lost_message(&job_ref, &why));
                return;
            }
            // Not in the held-jobs cache: claimed by another holder since (superseded), or
            // deleted; a fresh read tells.
            if let Some(job) = self.read_if_uncached(name).await {
                if let Some(r) = fence::refusal(&job_ref, job.as_ref(), &held.token) {
                    warn!(job = %job_ref, attempt = held.token.attempt(), "Stopped renewing LeasedJob {job_ref}: {r}");
                    self.lose(held, r.category(), r.to_string());
                    return;
                }
            }
            let renewed = self.renew_bounded(held, None).await;
            self.inner.metrics.heartbeat(renewed.is_ok());
            match renewed {
                Ok(lease) => {
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
                    due = Instant::now() + RENEW_RETRY.min(interval);
                }
            }
        }
    }

    /// After a failed renewal: declares the lease lost once renewals have failed for a whole
    /// lease duration since the last success (monotonic clock).
    fn renewals_failed_too_long(&self, job_ref: &str, held: &Held) -> bool {
        let since = held.state.lock().unwrap().last_renewed.elapsed();
        if since >= held.duration {
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
    fn lose(&self, held: &Held, code: &'static str, message: String) {
        let mut st = held.state.lock().unwrap();
        if st.lost.is_none() {
            st.lost = Some((code, message));
        }
        drop(st);
        held.wake.notify_one();
        self.inner.ended.notify_waiters();
    }

    /// The held attempt of `name` if it is this token's, after checking it was not declared
    /// lost; records the worker's call.
    fn held_for(&self, name: &str, token: &Token) -> Result<Option<Arc<Held>>, WorkerError> {
        let held = self.inner.held.lock().unwrap().get(name).cloned();
        let Some(held) = held.filter(|h| h.token == *token) else {
            return Ok(None);
        };
        let mut st = held.state.lock().unwrap();
        if st.lost.is_none() && st.last_renewed.elapsed() >= held.duration {
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
            .held_store
            .get(&key)
            .or_else(|| self.inner.store.get(&key))
            .map_or(5, |j| j.spec.lease_duration_seconds.max(1));
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

    /// Renews the lease now, storing `checkpoint` (any JSON up to
    /// [`lease::MAX_CHECKPOINT_BYTES`]) with it for the next attempt should this one not finish,
    /// and `progress` (the parts given; see [`leasehold_core::progress`]) for people to see. Writes only
    /// the Lease, never the LeasedJob, in one request whatever it carries. The progress is
    /// remembered and carried by every later renewal of the attempt, background ones included.
    ///
    /// # Errors
    /// [`WorkerError::InvalidToken`]; [`WorkerError::Invalid`] for progress that breaks its
    /// rules (nothing is written); [`WorkerError::TooLarge`]; [`WorkerError::LeaseLost`] or
    /// [`WorkerError::Refused`] when the token no longer holds the job;
    /// [`WorkerError::Unavailable`] when the API server failed (retry).
    pub async fn heartbeat(
        &self,
        name: &str,
        token: &str,
        checkpoint: Option<Value>,
        progress: Progress,
    ) -> Result<Renewal, WorkerError> {
        progress.validate().map_err(|e| WorkerError::Invalid {
            field: e.field,
            problem: e.problem,
        })?;
        let (me, n, t) = (self.clone(), name.to_string(), token.to_string());
        self.bounded(name, "heartbeat", async move {
            me.heartbeat_inner(&n, &t, checkpoint, progress).await
        })
        .await
        .map_err(|e| self.counted(e))
    }

    /// One renewal of `held`'s Lease, waiting at most [`call_bound`] of its lease duration. It
    /// carries the latest progress the worker sent for the attempt. The attempt's first
    /// renewal writes the Lease ([`Worker::take_lease`]).
    async fn renew_bounded(
        &self,
        held: &Held,
        checkpoint: Option<&Value>,
    ) -> Result<Lease, LeaseError> {
        let after = call_bound(held.duration);
        let (progress, taken) = {
            let st = held.state.lock().unwrap();
            (st.progress.clone(), st.lease_taken)
        };
        if let (false, Some(job)) = (taken, &held.claimed) {
            return self.take_lease(held, job, checkpoint, &progress).await;
        }
        let renew = leasehold_kube::lease::renew(
            &self.inner.leases,
            &held.lease_name,
            &held.token,
            checkpoint,
            Some(&progress),
        );
        tokio::time::timeout(after, renew)
            .await
            .unwrap_or(Err(LeaseError::Timeout { after }))
    }

    /// The first renewal of an attempt this process claimed (`job`, the claim's answer): writes
    /// its Lease ([`lease::acquire`]) with `checkpoint` and `progress`, waiting at most
    /// [`call_bound`] of its lease duration.
    ///
    /// Not made once a whole lease duration has passed since the claim was sent (this process
    /// was frozen, or every try failed): no renewal reached the API server, so the controller
    /// may have requeued the job, and a Lease written now could name an attempt that ended.
    /// The attempt is lost then. A Lease name taken by something else undoes the claim
    /// ([`Worker::undo_for_conflict`]) and the attempt is lost with that reason.
    ///
    /// # Errors
    /// [`LeaseError::Lost`] (lost as above, or the Lease names a newer attempt);
    /// [`LeaseError::NotOurs`]; [`LeaseError::Timeout`] and [`LeaseError::Api`] (retry).
    async fn take_lease(
        &self,
        held: &Held,
        job: &LeasedJob,
        checkpoint: Option<&Value>,
        progress: &Progress,
    ) -> Result<Lease, LeaseError> {
        let job_ref = job.reference();
        let since = held.state.lock().unwrap().last_renewed.elapsed();
        if since >= held.duration {
            let why = format!(
                "no renewal got through in {}s since the claim, a whole lease duration",
                since.as_secs()
            );
            warn!(job = %job_ref, attempt = held.token.attempt(), "Stopped renewing LeasedJob {job_ref}: {why}");
            self.lose(held, LEASE_LOST, lost_message(&job_ref, &why));
            return Err(LeaseError::Lost {
                lease: held.lease_name.clone(),
            });
        }
        let after = call_bound(held.duration);
        let first = leasehold_kube::lease::FirstRenewal {
            checkpoint,
            progress,
        };
        held.state.lock().unwrap().first_renewal_sent = true;
        let acquired = tokio::time::timeout(after, async {
            let lease =
                leasehold_kube::lease::acquire(&self.inner.leases, job, &held.token, &first)
                    .await?;
            self.confirm_first_renewal(&job.name_any(), &held.token)
                .await?;
            Ok(lease)
        })
        .await
        .unwrap_or(Err(LeaseError::Timeout { after }));
        match &acquired {
            Ok(_) => held.state.lock().unwrap().lease_taken = true,
            Err(e @ LeaseError::NotOurs { .. }) => {
                let message = self.undo_for_conflict(job, &held.token, e).await;
                self.lose(held, LEASE_LOST, message);
            }
            Err(LeaseError::Ended { why, code }) => {
                let message = lost_message(&job_ref, why);
                self.lose(held, code, message);
            }
            Err(_) => {}
        }
        acquired
    }

    /// After a first renewal wrote the Lease of `name` for `token`: reads the job afresh, and
    /// when it is no longer Leased to the token, clears the Lease's holderIdentity (fenced by
    /// the token) and says so. The controller ends an attempt (expiry, cancel) before it
    /// clears that attempt's Lease, and before the first renewal there was no Lease to clear;
    /// so a Lease written after that clear would name the ended token and accept its renewals.
    /// A read after the write that still shows the job Leased to the token proves the write
    /// came first, and the controller's clear will find it.
    ///
    /// # Errors
    /// [`LeaseError::Ended`] when the attempt ended (the Lease cleared, or left to a newer
    /// attempt); [`LeaseError::Api`] when the job could not be read (the renewal is retried).
    async fn confirm_first_renewal(&self, name: &str, token: &Token) -> Result<(), LeaseError> {
        let job = self
            .inner
            .jobs
            .get_opt(name)
            .await
            .map_err(LeaseError::Api)?;
        let Some(refusal) = fence::refusal(&self.job_ref(name), job.as_ref(), token) else {
            return Ok(());
        };
        let lease_name = lease::lease_name(name);
        if let Err(e) =
            leasehold_kube::lease::release(&self.inner.leases, &lease_name, token.as_str()).await
        {
            warn!(job = %self.job_ref(name), error = %error_chain(&e), "Clearing the Lease a first renewal wrote for an ended attempt failed; the job's status still fences it");
        }
        // The same code the held-jobs cache would give (cached_job_moved_on): a cancel seen
        // first by this fresh read is still `cancelled`, not a lost lease.
        let code = match refusal {
            Refusal::Cancelled { .. } => "cancelled",
            _ => LEASE_LOST,
        };
        Err(LeaseError::Ended {
            why: refusal.to_string(),
            code,
        })
    }

    async fn heartbeat_inner(
        &self,
        name: &str,
        token: &str,
        checkpoint: Option<Value>,
        progress: Progress,
    ) -> Result<Renewal, WorkerError> {
        let token = Token::parse(token)?;
        if let Some(c) = &checkpoint {
            lease::checkpoint_text(c).map_err(|e| WorkerError::TooLarge(e.to_string()))?;
        }
        let held = self.held_for(name, &token)?;
        // The job as read for a token this process does not hold.
        let mut unheld = None;
        // The Lease alone proves nothing: the Lease of an attempt that ended still names its
        // token. A token whose attempt is known to have ended is refused before any write.
        match &held {
            Some(h) => {
                if let Some((code, why)) = self.cached_job_moved_on(name, &token) {
                    let message = lost_message(&self.job_ref(name), &why);
                    self.lose(h, code, message.clone());
                    return Err(WorkerError::LeaseLost { code, message });
                }
            }
            None => unheld = Some(self.check_unheld(name, &token).await?),
        }
        let renewed = match &held {
            Some(h) => {
                h.state.lock().unwrap().progress.update(&progress);
                self.renew_bounded(h, checkpoint.as_ref()).await
            }
            // Not held by this process (it restarted since the claim), and the job says the
            // token holds it: the Lease decides.
            None => {
                let lease_name = lease::lease_name(name);
                let renewed = leasehold_kube::lease::renew(
                    &self.inner.leases,
                    &lease_name,
                    &token,
                    checkpoint.as_ref(),
                    Some(&progress),
                )
                .await;
                match (renewed, &unheld) {
                    // Its Lease is not written yet (the first renewal writes it, and this
                    // process restarted before that) or names an older attempt: this is the
                    // first renewal, made for the holder the job names, which is this process.
                    (Err(LeaseError::Lost { .. }), Some(job))
                        if job.status.as_ref().and_then(|s| s.holder.as_deref())
                            == Some(self.inner.config.identity.as_str()) =>
                    {
                        let first = leasehold_kube::lease::FirstRenewal {
                            checkpoint: checkpoint.as_ref(),
                            progress: &progress,
                        };
                        let acquired = match leasehold_kube::lease::acquire(
                            &self.inner.leases,
                            job,
                            &token,
                            &first,
                        )
                        .await
                        {
                            Ok(lease) => self
                                .confirm_first_renewal(name, &token)
                                .await
                                .map(|()| lease),
                            e => e,
                        };
                        if let Err(e @ LeaseError::NotOurs { .. }) = &acquired {
                            let message = self.undo_for_conflict(job, &token, e).await;
                            return Err(WorkerError::LeaseLost {
                                code: LEASE_LOST,
                                message,
                            });
                        }
                        acquired
                    }
                    (renewed, _) => renewed,
                }
            }
        };
        if !matches!(renewed, Err(LeaseError::CheckpointTooLarge { .. })) {
            self.inner.metrics.heartbeat(renewed.is_ok());
        }
        match renewed {
            Ok(lease) => {
                // The attempt may have ended while the renewal was on its way (a complete sent
                // meanwhile, an expiry, a cancel): the job itself must still be Leased to this
                // token.
                if let Some(r) = self.ended_refusal(name, &token) {
                    return Err(WorkerError::Refused(r));
                }
                let moved_on = match self.cached_job_moved_on(name, &token) {
                    // Not in the held-jobs cache: deleted, or claimed by another holder since
                    // (superseded); a fresh read tells.
                    None => match self.read_if_uncached(name).await {
                        Some(None) => {
                            Some(("job_not_found", "the LeasedJob was deleted".to_string()))
                        }
                        Some(Some(job)) => {
                            if let Some(r) = fence::refusal(&self.job_ref(name), Some(&job), &token)
                            {
                                if let Some(h) = &held {
                                    self.lose(h, r.category(), r.to_string());
                                }
                                return Err(WorkerError::Refused(r));
                            }
                            None
                        }
                        None => None,
                    },
                    other => other,
                };
                if let Some((code, why)) = moved_on {
                    let message = lost_message(&self.job_ref(name), &why);
                    if let Some(h) = &held {
                        self.lose(h, code, message.clone());
                    }
                    return Err(WorkerError::LeaseLost { code, message });
                }
                let duration_s = lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.lease_duration_seconds)
                    .unwrap_or(60);
                let held = held.unwrap_or_else(|| {
                    self.hold(name, token.clone(), duration_s, None, Instant::now())
                });
                let renew_time = lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.renew_time.as_ref())
                    .map_or_else(Timestamp::now, |t| t.0);
                {
                    let mut st = held.state.lock().unwrap();
                    st.last_renewed = Instant::now();
                    st.renew_time = renew_time;
                    if checkpoint.is_some() {
                        st.checkpoint = checkpoint;
                    }
                    st.progress.update(&progress);
                }
                Ok(Renewal {
                    renew_time,
                    expires_at: renew_time + SignedDuration::from_secs(i64::from(duration_s)),
                    lease_duration_seconds: duration_s,
                })
            }
            Err(LeaseError::Ended { why, code }) => Err(WorkerError::LeaseLost {
                code,
                message: lost_message(&self.job_ref(name), &why),
            }),
            Err(e @ (LeaseError::Lost { .. } | LeaseError::NotOurs { .. })) => {
                // Lost before any write (a first renewal too late), or its claim undone for a
                // Lease name taken by something else: the reason is already known.
                if let Some(h) = &held {
                    let lost = h.state.lock().unwrap().lost.clone();
                    if let (Some((code, message)), true) = (
                        lost,
                        matches!(e, LeaseError::NotOurs { .. }) || !h.lease_taken(),
                    ) {
                        return Err(WorkerError::LeaseLost { code, message });
                    }
                }
                let err = self.explain_lost(name, &token).await;
                if let Some(h) = &held {
                    self.lose(h, err.category(), err.to_string());
                }
                Err(err)
            }
            Err(LeaseError::CheckpointTooLarge { size }) => Err(WorkerError::TooLarge(format!(
                "checkpoint is {size} bytes of JSON; at most {} are accepted",
                lease::MAX_CHECKPOINT_BYTES
            ))),
            Err(e @ (LeaseError::Api(_) | LeaseError::Timeout { .. })) => {
                let unavailable = || {
                    WorkerError::unavailable(
                        format!("heartbeat of LeasedJob {}", self.job_ref(name)),
                        error_chain(&e),
                    )
                };
                if let Some(h) = &held {
                    if self.renewals_failed_too_long(&self.job_ref(name), h) {
                        return Err(self
                            .held_for(name, &token)
                            .err()
                            .unwrap_or_else(unavailable));
                    }
                }
                Err(unavailable())
            }
        }
    }

    /// The refusal `token` earns when this process ended its attempt (see
    /// [`Inner::ended_here`]).
    fn ended_refusal(&self, name: &str, token: &Token) -> Option<Refusal> {
        let ended = self.inner.ended_here.lock().unwrap();
        ended
            .get(name)
            .filter(|(t, _)| t == token)
            .map(|(_, r)| r.clone())
    }

    /// Before a renewal for a token this process does not hold: refuses it when this process
    /// ended its attempt, else asks the API server whether the job is still Leased to it. (This
    /// process may have restarted since the claim; the Lease of an ended attempt would accept
    /// the renewal, so only the job can tell.) One read, for the first heartbeat of an attempt
    /// after a restart; a successful renewal makes the attempt held again.
    ///
    /// Returns the job read, Leased to the token.
    ///
    /// # Errors
    /// [`WorkerError::Refused`] with the job's refusal; [`WorkerError::Unavailable`] when the
    /// job could not be read.
    async fn check_unheld(&self, name: &str, token: &Token) -> Result<LeasedJob, WorkerError> {
        if let Some(r) = self.ended_refusal(name, token) {
            return Err(WorkerError::Refused(r));
        }
        let job_ref = self.job_ref(name);
        let job = self.inner.jobs.get_opt(name).await.map_err(|e| {
            WorkerError::unavailable(format!("heartbeat of LeasedJob {job_ref}"), error_chain(&e))
        })?;
        match (fence::refusal(&job_ref, job.as_ref(), token), job) {
            (None, Some(job)) => Ok(job),
            (Some(r), _) => Err(WorkerError::Refused(r)),
            (None, None) => Err(WorkerError::Refused(Refusal::NotFound { job: job_ref })),
        }
    }

    /// Why the watch cache says the job no longer belongs to `token`, if it does: (error code,
    /// reason).
    fn cached_job_moved_on(&self, name: &str, token: &Token) -> Option<(&'static str, String)> {
        let key = ObjectRef::new(name).within(&self.inner.config.namespace);
        // Not in the cache: deleted, or claimed by another holder since; the caller asks the
        // API server.
        let job = self.inner.held_store.get(&key)?;
        if job.attempt() > token.attempt() {
            let why = format!(
                "is on attempt {}, your token is from attempt {}",
                job.attempt(),
                token.attempt()
            );
            return Some((LEASE_LOST, why));
        }
        if job.token() == Some(token.as_str()) && job.phase() != Phase::Leased {
            let code = if job.phase() == Phase::Cancelled {
                "cancelled"
            } else {
                LEASE_LOST
            };
            let why = format!(
                "attempt {} ended: the job is {}",
                token.attempt(),
                job.phase()
            );
            return Some((code, why));
        }
        None
    }

    /// The job `name` as the API server has it now (`Some(None)`: deleted), read when the
    /// synced held-jobs cache does not show it: a job claimed by another holder since has left
    /// that cache (its `status.holder` changed), and only a fresh read tells this process its
    /// attempt was superseded. `None` when the cache shows the job, has not listed yet, or the
    /// read failed: nothing is known beyond the cache, and the Lease decides.
    async fn read_if_uncached(&self, name: &str) -> Option<Option<LeasedJob>> {
        let key = ObjectRef::new(name).within(&self.inner.config.namespace);
        if self.inner.held_store.get(&key).is_some() || !self.inner.held_synced.is_synced() {
            return None;
        }
        self.inner.jobs.get_opt(name).await.ok()
    }

    /// After the Lease refused a renewal: the refusal as the job explains it.
    async fn explain_lost(&self, name: &str, token: &Token) -> WorkerError {
        let job_ref = self.job_ref(name);
        match self.inner.jobs.get_opt(name).await {
            Ok(job) => match fence::refusal(&job_ref, job.as_ref(), token) {
                Some(r) => WorkerError::Refused(r),
                None => WorkerError::LeaseLost {
                    code: LEASE_LOST,
                    message: lost_message(&job_ref, "its Lease no longer names this token"),
                },
            },
            Err(e) => WorkerError::LeaseLost {
                code: LEASE_LOST,
                message: lost_message(
                    &job_ref,
                    &format!("its Lease no longer names this token ({})", error_chain(&e)),
                ),
            },
        }
    }

    /// Completes the attempt with `result`: Succeeded, if and only if the API server still
    /// shows this token as the holder of a Leased job. The Lease is left as it is (the job's
    /// status fences the ended attempt; see the module doc).
    ///
    /// # Errors
    /// As [`Worker::heartbeat`], plus [`Refusal::Finished`] for a job already finished.
    pub async fn complete(
        &self,
        name: &str,
        token: &str,
        result: Value,
    ) -> Result<LeasedJob, WorkerError> {
        self.end_attempt(name, token, false, |_| Outcome::Complete { result })
            .await
    }

    /// Reports a failed attempt. `reason` is a short CamelCase word (`^[A-Za-z][A-Za-z0-9]*$`,
    /// at most 64 characters), `message` at most [`MAX_MESSAGE_BYTES`]. Requeues when
    /// `retryable` and failed attempts remain under maxAttempts (handing the last checkpoint to
    /// the next attempt); otherwise the job ends Failed.
    ///
    /// # Errors
    /// [`WorkerError::Invalid`] for a bad reason or message; otherwise as [`Worker::complete`].
    pub async fn fail(
        &self,
        name: &str,
        token: &str,
        reason: &str,
        message: &str,
        retryable: bool,
    ) -> Result<LeasedJob, WorkerError> {
        validate_reason(reason)?;
        if message.len() > MAX_MESSAGE_BYTES {
            return Err(WorkerError::Invalid {
                field: "message",
                problem: format!(
                    "is {} bytes; at most {MAX_MESSAGE_BYTES} are accepted",
                    message.len()
                ),
            });
        }
        let (reason, message) = (reason.to_string(), message.to_string());
        self.end_attempt(name, token, true, move |checkpoint| Outcome::Fail {
            reason,
            message,
            retryable,
            checkpoint,
        })
        .await
    }

    /// Gives the job back to the queue now, with the last checkpoint; not a failed attempt.
    ///
    /// # Errors
    /// As [`Worker::complete`].
    pub async fn release(&self, name: &str, token: &str) -> Result<LeasedJob, WorkerError> {
        self.end_attempt(name, token, true, |checkpoint| Outcome::Release {
            checkpoint,
        })
        .await
    }

    /// Ends an attempt with the outcome `outcome` builds from the newest checkpoint (`None`
    /// when `outcome` does not carry one, i.e. a completion).
    async fn end_attempt(
        &self,
        name: &str,
        token: &str,
        carries_checkpoint: bool,
        outcome: impl FnOnce(Option<Value>) -> Outcome + Send + 'static,
    ) -> Result<LeasedJob, WorkerError> {
        let (me, n, t) = (self.clone(), name.to_string(), token.to_string());
        let what = if carries_checkpoint {
            "end of attempt"
        } else {
            "completion"
        };
        self.bounded(name, what, async move {
            me.end_attempt_inner(&n, &t, carries_checkpoint, outcome)
                .await
        })
        .await
        .map_err(|e| self.counted(e))
    }

    /// The newest checkpoint of attempt `token`: the one this process last wrote, else the one
    /// its Lease holds (this process may have restarted since the heartbeat that wrote it). A
    /// Lease that no longer names the token holds no checkpoint of this attempt.
    async fn newest_checkpoint(
        &self,
        name: &str,
        token: &Token,
        held: Option<&Arc<Held>>,
    ) -> Option<Value> {
        if let Some(h) = held {
            let st = h.state.lock().unwrap();
            if st.checkpoint.is_some() || !st.first_renewal_sent {
                // The worker's latest, or none: no Lease of this attempt was written yet.
                return st.checkpoint.clone();
            }
        }
        match self.inner.leases.get_opt(&lease::lease_name(name)).await {
            Ok(Some(l)) if lease::holder_identity(&l) == Some(token.as_str()) => {
                lease::checkpoint(&l)
            }
            Ok(_) => None,
            Err(e) => {
                warn!(job = %self.job_ref(name), error = %error_chain(&e), "Reading the Lease's checkpoint failed; ending the attempt without it");
                None
            }
        }
    }

    async fn end_attempt_inner(
        &self,
        name: &str,
        token: &str,
        carries_checkpoint: bool,
        outcome: impl FnOnce(Option<Value>) -> Outcome,
    ) -> Result<LeasedJob, WorkerError> {
        let token = Token::parse(token)?;
        let held = self.held_for(name, &token)?;
        let checkpoint = if carries_checkpoint {
            self.newest_checkpoint(name, &token, held.as_ref()).await
        } else {
            None
        };
        let outcome = outcome(checkpoint);
        let ns = &self.inner.config.namespace;
        let cached = self.inner.held_store.get(&ObjectRef::new(name).within(ns));
        // The watch cache once it shows this attempt (it may be newer than the claim), else
        // the claim's own answer; either way the write tests the token and phase, and a stale
        // snapshot costs a read and nothing else.
        let snapshot = match (&cached, held.as_ref().and_then(|h| h.claimed.as_ref())) {
            (Some(c), _) if c.token() == Some(token.as_str()) => Some(&**c),
            (_, Some(answer)) => Some(answer),
            (c, None) => c.as_deref(),
        };
        let job = match leasehold_kube::fence::apply_from(&self.inner.jobs, ns, name, &token, &outcome, snapshot)
        .await
        {
            Ok(job) => job,
            Err(FenceError::Refused(r)) => {
                if let Some(h) = &held {
                    self.lose(h, r.category(), r.to_string());
                }
                return Err(WorkerError::Refused(r));
            }
            Err(FenceError::Api { source, .. }) if is_too_large(&source) => {
                return Err(WorkerError::TooLarge(format!(
                    "LeasedJob {} would exceed the size limit of a job ({} bytes for the whole job as JSON, payload included) with this write; nothing was written: send a smaller result or message, or store large results elsewhere and send a reference",
                    self.job_ref(name),
                    leasehold_core::crd::MAX_JOB_BYTES
                )))
            }
            Err(e @ FenceError::Api { .. }) => {
                return Err(WorkerError::unavailable(
                    format!("write to LeasedJob {}", self.job_ref(name)),
                    error_chain(&e),
                ))
            }
        };
        // The job's status now fences the ended attempt, so its Lease is not written again: it
        // keeps naming this token until the next claim takes it over or garbage collection
        // deletes it with the job. Its token is refused from here on (the Lease would still
        // accept its renewals). Recorded before the attempt stops being held, so that no
        // heartbeat in between finds neither.
        if let Some(r) = fence::refusal(&self.job_ref(name), Some(&job), &token) {
            let mut ended = self.inner.ended_here.lock().unwrap();
            if ended.len() >= MAX_ENDED {
                ended.clear();
            }
            ended.insert(name.to_string(), (token.clone(), r));
        }
        if let Some(h) = self.inner.held.lock().unwrap().remove(name) {
            end(&h);
        }
        self.inner.ended.notify_waiters();
        if let Some(claimed) = job.status.as_ref().and_then(|s| s.claimed_time.as_ref()) {
            let ran = Timestamp::now().duration_since(claimed.0).as_secs_f64();
            self.inner.metrics.attempt_ran(ran.max(0.0));
        }
        let job_ref = self.job_ref(name);
        info!(job = %job_ref, attempt = token.attempt(), phase = %job.phase(), "Ended attempt {} of LeasedJob {job_ref}: {}", token.attempt(), job.phase());
        Ok(job)
    }
}

const LEASE_LOST: &str = "lease_lost";

/// The text of a lease declared lost by this process.
fn lost_message(job_ref: &str, why: &str) -> String {
    format!("lease lost: {job_ref}: {why}; stop working on it and claim again")
}

fn end(held: &Held) {
    held.state.lock().unwrap().ended = true;
    held.wake.notify_one();
}

/// Checks a failure reason: `^[A-Za-z][A-Za-z0-9]*$`, 1 to 64 characters (it becomes a
/// condition reason, whose rule is stricter than free text).
///
/// # Errors
/// [`WorkerError::Invalid`] naming the field, the value and the rule.
pub fn validate_reason(reason: &str) -> Result<(), WorkerError> {
    let ok = (1..=64).contains(&reason.len())
        && reason.starts_with(|c: char| c.is_ascii_alphabetic())
        && reason.chars().all(|c| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        let shown: String = reason.chars().take(80).collect();
        Err(WorkerError::Invalid {
            field: "reason",
            problem: format!(
                "{shown:?} is not a CamelCase word: expected 1 to 64 ASCII letters and digits, starting with a letter"
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_must_be_camel_case_words() {
        for ok in ["Timeout", "BadPayload", "E42", "x"] {
            assert!(validate_reason(ok).is_ok(), "{ok}");
        }
        for bad in ["", "9Lives", "has space", "dash-ed", "ünï", &"a".repeat(65)] {
            let e = validate_reason(bad).unwrap_err();
            assert_eq!(e.category(), "invalid_request");
            assert!(e.to_string().starts_with("reason "), "{e}");
        }
    }
}
