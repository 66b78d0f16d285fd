//! leasehold-controller: the controller role. It initialises new jobs, requeues jobs whose
//! lease expired, cancels, deletes finished jobs after their TTL, and records Events. It never
//! imports the worker; what both roles share lives in leasehold-kube and leasehold-core, and
//! the rules it applies (expiry, the fence's patch) are leasehold-core's.
//!
//! - this file: [`run`] and [`reconcile`]'s shape, its [`Config`] and [`ReconcileError`];
//! - [`leader`]: leader election among replicas, fenced like workers;
//! - [`dispatch`]: the dispatcher, which offers waiting jobs to waiting workers;
//! - [`crd_check`]: the start-up check that the installed CRD is up to date;
//! - `expire`: the expiry look at one Leased job and its requeue;
//! - `initial_hold`: the new jobs whose initial status write waits for a claim the dispatcher
//!   is about to answer;
//! - `queues`: the LeasedQueue objects: their pause (told to the dispatcher), status, Events;
//! - `report`: per-queue metrics and the Undecodable Events;
//! - `transitions`: the Events and counts of the transitions seen (claims, completions, ...);
//! - `workers`: the watches that keep the slim cache and queue jobs, and the workers that
//!   reconcile them;
//! - `workqueue`: the jobs waiting for a reconcile, each handed to one worker at a time.
//!
//! Shape: the job watch keeps a slim copy of every job ([`leasehold_core::job_cache`]: what
//! the decisions read, packed, about 0.3 KiB a job) and queues each job that changes; a Lease
//! that changes queues its job. [`RECONCILE_CONCURRENCY`] workers take jobs from the queue.
//! [`reconcile`] gets the job rebuilt from the slim copy and its Lease (from a second watch
//! cache), asks the pure core ([`leasehold_core::expiry`], [`leasehold_core::fence`]) what to do, then writes.
//! Every write is conditional: initialisation under the job's resourceVersion, the requeue as a
//! JSON Patch that tests the expired token and the Leased phase, Lease releases as JSON Patches
//! that test holderIdentity. When a worker's result lands first, the requeue is refused by the
//! API server and dropped.
//!
//! Leases: the controller clears the holderIdentity of an attempt it ended itself (expiry,
//! cancel), so that the holder, which does not know, is refused by the API server at its next
//! renewal. It never writes the Lease of an attempt its holder ended: the job's status fences
//! that attempt, and a Lease naming a token the job no longer holds as Leased is stale, counts
//! as no Lease for expiry (`leasehold_core::expiry::record_of`) and is taken over by the next claim
//! (docs/protocol.md, "What fences what").

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use thiserror::Error;
use tracing::{info, warn};

mod adoption;
pub mod crd_check;
pub mod crd_upgrade;
pub mod dispatch;
mod expire;
mod initial_hold;
pub mod leader;
mod queues;
pub mod reinject;
mod report;
mod transitions;
mod workers;
mod workqueue;

use expire::check_expiry;
use report::{report, undecodable_reporter, Reported};
use transitions::record_transitions;

use crate::leader::Leadership;
use crate::workers::{follow_jobs, follow_leases, work};
use crate::workqueue::WorkQueue;
use leasehold_core::crd::{LeasedJob, LeasedJobStatus, Phase, MANAGED_BY, MANAGED_BY_LABEL};
use leasehold_core::expiry::Observation;
use leasehold_core::fence;
use leasehold_core::job_cache::{JobCache, JobKey};
use leasehold_core::lease;
use leasehold_core::queue::LeasedQueue;
use leasehold_core::Category;
use leasehold_kube::api::{is_status, Clients};
use leasehold_kube::events::{EventType, Note, Publisher, Reporter};
use leasehold_kube::health::Health;
use leasehold_kube::recorder::Recorder;
use leasehold_kube::shutdown;
use leasehold_kube::watch;
use leasehold_metrics::Metrics;

/// Name under which the controller reports Events.
pub const REPORTER: &str = "leasehold-controller";

/// Extra time added to a computed expiry before looking again, so the look lands after it.
const EXPIRY_SLACK: Duration = Duration::from_millis(20);
/// How soon a standby looks again at a job it would have written to.
const NOT_LEADER_REQUEUE: Duration = Duration::from_secs(1);
/// Requeue delay after a failed reconcile.
const ERROR_REQUEUE: Duration = Duration::from_secs(2);

/// Errors of one reconcile; each has a stable category.
#[derive(Debug, Error)]
pub enum ReconcileError {
    /// A write or read of the job failed.
    #[error("LeasedJob {job}: {action} failed")]
    Job {
        /// `namespace/name`.
        job: String,
        /// What was being done.
        action: &'static str,
        /// The underlying error.
        #[source]
        source: kube::Error,
    },
    /// This replica does not lead (or its term just ended): it must not write.
    #[error("not the leader: LeasedJob {job} is left to the leading replica")]
    NotLeader {
        /// `namespace/name`.
        job: String,
    },
    /// A Lease operation failed.
    #[error("LeasedJob {job}: Lease {action} failed")]
    Lease {
        /// `namespace/name`.
        job: String,
        /// What was being done.
        action: &'static str,
        /// The underlying error.
        #[source]
        source: leasehold_kube::lease::LeaseError,
    },
}

impl Category for ReconcileError {
    /// Stable category, for logs, metrics and Event reasons.
    fn category(&self) -> &'static str {
        match self {
            ReconcileError::Job { .. } => "job_write",
            ReconcileError::Lease { .. } => "lease_write",
            ReconcileError::NotLeader { .. } => "not_leader",
        }
    }
}

/// Options of [`run`].
#[derive(Clone, Debug)]
pub struct Config {
    /// Watch only this namespace; all namespaces when None.
    pub namespace: Option<String>,
    /// This replica's name, reported as the Events' reportingInstance and in the field
    /// manager of its writes (`leasehold-controller/<identity>`).
    pub identity: String,
    /// Leader election among replicas; None runs as the only writer.
    pub election: Option<leader::ElectionConfig>,
    /// Which transitions get an Event.
    pub events: EventPolicy,
    /// The dispatcher fed from the job watch, answering while this replica leads, and where
    /// it is advertised; None dispatches nothing (sidecars then choose on their own).
    pub dispatch: Option<dispatch::Setup>,
    /// Namespaces whose pods that escaped sidecar injection are evicted at the start of each
    /// term ([`reinject`]); empty: none.
    pub reinject: Vec<String>,
}

/// Which transitions the controller records as Events. Events are for people and for
/// problems: each is one more write to the API server, so the happy path (a claim, a
/// completion, a release) records none by default, which saves two writes per job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EventPolicy {
    /// Warnings (failures, expiries, Lease conflicts, undecodable objects), cancellations and
    /// retries (people's actions, rare).
    #[default]
    Problems,
    /// Every transition, `Claimed`, `Completed` and `Released` included.
    All,
}

impl EventPolicy {
    /// Whether an Event of `type_` with `reason` is recorded under this policy.
    pub fn records(self, type_: EventType, reason: &str) -> bool {
        self == EventPolicy::All
            || type_ == EventType::Warning
            || reason == "Cancelled"
            || reason == "Retried"
    }
}

/// Shared state of the reconciler.
pub struct Context {
    event_policy: EventPolicy,
    client: Client,
    metrics: Arc<Metrics>,
    leadership: Arc<Leadership>,
    field_manager: String,
    leases: Store<Lease>,
    /// Set once `leases` has listed every Lease.
    leases_synced: watch::Synced,
    events: Publisher,
    /// Every job watched, slim ([`leasehold_core::job_cache`]), with the (attempt, phase) at
    /// which its transitions were last recorded.
    jobs: Mutex<JobCache>,
    /// What the controller has seen of each leased job's Lease, and when (see [`leasehold_core::expiry`]).
    observations: Mutex<HashMap<ObjectRef<LeasedJob>, Observation>>,
    /// Leased jobs whose Lease cache disagreed with a fresh read of the Lease (the cache lags,
    /// or the Lease left the cache's label selector because someone removed its label): their
    /// expiry is judged on fresh reads until the cache agrees again, so that the two sources
    /// can never take turns restarting the expiry clock.
    fresh_reads: Mutex<std::collections::HashSet<ObjectRef<LeasedJob>>>,
    /// The slots of limited queues seen pending, and since when: a slot pending for
    /// [`leasehold_core::adoption::PENDING_GRACE`] is freed (`adoption`).
    stalled: Mutex<leasehold_core::adoption::Stalled>,
    /// The dispatcher this replica feeds, if it runs one.
    dispatcher: Option<Arc<dispatch::Dispatcher>>,
    /// Jobs not initialised yet whose initial status write is held back, and since when
    /// ([`Context::initialise_after`]).
    held_back: initial_hold::InitialHolds<ObjectRef<LeasedJob>>,
}

/// Reconciles run at once, at most: the workers taking jobs from the queue. With no limit, a
/// controller starting with 100,000 jobs held a reconcile in flight for every one of them
/// (917 MiB resident, benchmark row 10). Reconciles are short (a decision and at most one
/// write), so a few dozen keep up with any rate the API server sustains; the rest wait as keys
/// in the queue.
pub const RECONCILE_CONCURRENCY: u16 = 32;

/// Runs the controller until SIGTERM/SIGINT, reporting into `metrics` and `health` (ready
/// once both watches have synced).
pub async fn run(clients: Clients, config: Config, metrics: Arc<Metrics>, health: Arc<Health>) {
    let client = clients.requests;
    let (jobs, leases): (Api<LeasedJob>, Api<Lease>) = match &config.namespace {
        Some(ns) => (
            Api::namespaced(clients.watches.clone(), ns),
            Api::namespaced(clients.watches.clone(), ns),
        ),
        None => (
            Api::all(clients.watches.clone()),
            Api::all(clients.watches.clone()),
        ),
    };
    let field_manager: String = format!("leasehold-controller/{}", config.identity)
        .chars()
        .take(128)
        .collect();
    let events = Publisher::new(
        client.clone(),
        Reporter {
            controller: REPORTER.into(),
            instance: config.identity.clone(),
        },
        field_manager.clone(),
    );
    let leadership = Arc::new(match config.election {
        Some(_) => Leadership::default(),
        None => Leadership::always(),
    });
    let (lease_store, lease_writer) = reflector::store();
    let lease_selector = format!("{MANAGED_BY_LABEL}={MANAGED_BY}");
    // Each object is decoded on its own: one Lease or LeasedJob that cannot be decoded is
    // skipped and reported (with a Warning Event on it) instead of failing every list.
    let (report_undecodable, undecodable_events) = undecodable_reporter(&events, &leadership);
    let lease_stream = watch::watch(
        &leases,
        watcher::Config::default().labels(&lease_selector),
        Arc::clone(&metrics) as Arc<dyn Recorder>,
        report_undecodable.clone(),
    )
    .reflect(lease_writer);
    let leases_synced = watch::Synced::default();
    let leases_synced_tracked = leases_synced.track(lease_stream);
    let elector = config.election.clone().map(|election| {
        let api: Api<Lease> = Api::namespaced(client.clone(), &election.namespace);
        let leadership = Arc::clone(&leadership);
        tokio::spawn(
            async move { leader::run(api, election, &leadership, shutdown::signal()).await },
        )
    });
    let advert = config.dispatch.clone().map(|setup| {
        setup.dispatcher.lead_with(Arc::clone(&leadership));
        let leases = Api::namespaced(client.clone(), &setup.advert_namespace);
        tokio::spawn(dispatch::probe_path(
            leases.clone(),
            Arc::clone(&setup.dispatcher),
            shutdown::signal(),
        ));
        let (identity, leadership) = (config.identity.clone(), Arc::clone(&leadership));
        tokio::spawn(async move {
            dispatch::advertise(
                leases,
                identity,
                setup.address,
                leadership,
                shutdown::signal(),
            )
            .await;
        })
    });
    if !config.reinject.is_empty() {
        tokio::spawn(reinject::run(
            client.clone(),
            config.reinject.clone(),
            Arc::clone(&leadership),
            Arc::clone(&health),
        ));
    }
    let ctx = Arc::new(Context {
        event_policy: config.events,
        client,
        metrics: Arc::clone(&metrics),
        leadership,
        field_manager,
        leases: lease_store.clone(),
        leases_synced: leases_synced.clone(),
        events,
        jobs: Mutex::default(),
        observations: Mutex::default(),
        fresh_reads: Mutex::default(),
        stalled: Mutex::default(),
        dispatcher: config.dispatch.as_ref().map(|d| Arc::clone(&d.dispatcher)),
        held_back: initial_hold::InitialHolds::default(),
    });
    let queue: Arc<WorkQueue<JobKey>> = Arc::new(WorkQueue::new());
    let job_stream = watch::watch(
        &jobs,
        watcher::Config::default(),
        Arc::clone(&metrics) as Arc<dyn Recorder>,
        report_undecodable,
    )
    .inspect({
        let dispatcher = config.dispatch.as_ref().map(|d| Arc::clone(&d.dispatcher));
        move |event| {
            if let (Some(dispatcher), Ok(event)) = (&dispatcher, event) {
                dispatcher.observe(event);
            }
        }
    });
    let jobs_synced = watch::Synced::default();
    let job_stream = jobs_synced.track(job_stream);
    let queue_objects: Api<LeasedQueue> = match &config.namespace {
        Some(ns) => Api::namespaced(clients.watches.clone(), ns),
        None => Api::all(clients.watches.clone()),
    };
    let followers = [
        tokio::spawn(follow_jobs(
            job_stream,
            Arc::clone(&ctx),
            Arc::clone(&queue),
        )),
        tokio::spawn(follow_leases(
            leases_synced_tracked,
            Arc::clone(&ctx),
            Arc::clone(&queue),
        )),
        tokio::spawn({
            let queue = Arc::clone(&queue);
            async move { queue.run_timer().await }
        }),
        tokio::spawn(queues::run(
            queue_objects,
            Arc::clone(&ctx),
            config.dispatch.as_ref().map(|d| Arc::clone(&d.dispatcher)),
            jobs_synced.clone(),
        )),
    ];
    let workers: Vec<_> = (0..RECONCILE_CONCURRENCY)
        .map(|_| tokio::spawn(work(Arc::clone(&queue), Arc::clone(&ctx))))
        .collect();
    // Report the caches in the metrics every second; forget what we knew of deleted jobs now
    // and then.
    let prune_ctx = Arc::clone(&ctx);
    let reporting_health = Arc::clone(&health);
    let pruner = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut reported = Reported::default();
        for n in 0u64.. {
            tick.tick().await;
            report(&prune_ctx, &reporting_health, &mut reported);
            if n % 60 == 59 {
                prune_ctx.forget_missing();
            }
        }
    });
    // Judge nothing before the Lease cache is ready (reconcile checks readiness itself).
    let synced = tokio::spawn(async move {
        leases_synced.wait().await;
        jobs_synced.wait().await;
        health.set_synced();
    });
    let scope = config.namespace.as_deref().unwrap_or("(all namespaces)");
    info!(namespace = scope, "Started leasehold controller");
    shutdown::signal().await;
    // Reconciles under way finish; no new one starts.
    queue.shut_down();
    for worker in workers {
        let _ = worker.await;
    }
    for task in followers {
        task.abort();
    }
    synced.abort();
    pruner.abort();
    undecodable_events.abort();
    if let Some(advert) = advert {
        advert.abort();
    }
    // The elector gives the leader Lease up on the same signal; let it finish.
    if let Some(elector) = elector {
        let _ = elector.await;
    }
}

/// What a reconcile asks for next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Look at the job again after this long, or sooner if it changes.
    Requeue(Duration),
    /// Look at it again when it (or its Lease) changes.
    AwaitChange,
}

impl Action {
    /// Look again after `after`, or sooner on a change.
    pub fn requeue(after: Duration) -> Action {
        Action::Requeue(after)
    }

    /// Look again on a change only.
    pub fn await_change() -> Action {
        Action::AwaitChange
    }
}

impl Context {
    /// How long to hold back the initial status write of `job` (not initialised yet), if at
    /// all: while it may be claimed through an offer of this replica's dispatcher
    /// ([`dispatch::Dispatcher::may_claim_soon`]), up to [`dispatch::INITIAL_HOLD`] from the
    /// first reconcile that found so; a job no longer claimable (cancelled, say) is not held
    /// any longer. A claim made meanwhile is the job's first write, and a waiting worker gets
    /// the job without waiting for that write and its watch event; its claim changes the job,
    /// and the reconcile that change brings finds it initialised. None: write it now. A job
    /// is held again only if its initial write failed after its hold (an error, or a 409 from
    /// a change that left it without status) and a worker may claim it again.
    fn initialise_after(&self, job: &LeasedJob) -> Option<Duration> {
        let dispatcher = self.dispatcher.as_ref()?;
        let claimable = leasehold_core::claim::claimable(job, &job.spec.queue, Timestamp::now());
        self.held_back.hold_for(
            ObjectRef::from_obj(job),
            claimable,
            || dispatcher.may_claim_soon(job),
            std::time::Instant::now(),
        )
    }

    /// Forgets the hold of `job`'s initial status write, if it had one: it has a status now
    /// (a claim made during the hold, or that write).
    fn initialised(&self, job: &LeasedJob) {
        // Most reconciles find no hold at all: no key is built for them, and the holds are
        // looked at once.
        if self.dispatcher.is_some() {
            self.held_back.forget(|| ObjectRef::from_obj(job));
        }
    }

    /// Ok while this replica leads; ask immediately before every write.
    fn leading(&self, job: &LeasedJob) -> Result<(), ReconcileError> {
        if self.leadership.is_leader() {
            Ok(())
        } else {
            Err(ReconcileError::NotLeader {
                job: job.reference(),
            })
        }
    }

    /// Sends a status JSON Patch whose `test` operations check the snapshot it was built from,
    /// if this replica still leads. Ok(false) when the API server refused it because the job
    /// changed (or is gone) since: nothing was written.
    async fn patch_status_if_unchanged(
        &self,
        jobs: &Api<LeasedJob>,
        job: &LeasedJob,
        patch: json_patch::Patch,
        action: &'static str,
    ) -> Result<bool, ReconcileError> {
        self.leading(job)?;
        match jobs
            .patch_status(
                &job.name_any(),
                &self.patch_params(),
                &Patch::Json::<()>(patch),
            )
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if is_status(&e, 422) || is_status(&e, 409) || is_status(&e, 404) => Ok(false),
            Err(source) => Err(ReconcileError::Job {
                job: job.reference(),
                action,
                source,
            }),
        }
    }

    fn patch_params(&self) -> PatchParams {
        PatchParams {
            field_manager: Some(self.field_manager.clone()),
            ..PatchParams::default()
        }
    }

    fn post_params(&self) -> PostParams {
        PostParams {
            field_manager: Some(self.field_manager.clone()),
            ..PostParams::default()
        }
    }

    fn forget_missing(&self) {
        let jobs = self.jobs.lock().unwrap();
        let keep = |k: &ObjectRef<LeasedJob>| {
            jobs.contains(k.namespace.as_deref().unwrap_or_default(), &k.name)
        };
        self.observations.lock().unwrap().retain(|k, _| keep(k));
        self.fresh_reads.lock().unwrap().retain(keep);
    }

    /// Records an Event on `job` if this replica leads; the action is the reason. A failure
    /// is logged, never retried: Events are best-effort.
    async fn event(&self, job: &LeasedJob, type_: EventType, reason: &str, text: String) {
        if !self.leadership.is_leader() || !self.event_policy.records(type_, reason) {
            return;
        }
        let note = Note {
            type_,
            reason: reason.into(),
            action: reason.into(),
            text,
        };
        if let Err(e) = self.events.publish(&job.object_ref(&()), &note).await {
            warn!(job = %job.reference(), category = e.category(), error = %leasehold_kube::api::error_chain(&e), "Recording Event {reason} on LeasedJob {} failed", job.reference());
        }
    }
}

/// What follows a failed reconcile: a standby looks again in a second, anything else is logged
/// and retried after [`ERROR_REQUEUE`].
fn error_policy(job: &LeasedJob, err: &ReconcileError) -> Action {
    if let ReconcileError::NotLeader { .. } = err {
        return Action::requeue(NOT_LEADER_REQUEUE);
    }
    warn!(job = %job.reference(), category = err.category(), error = %err, "reconcile failed; retrying");
    Action::requeue(ERROR_REQUEUE)
}

/// One pass over one job.
///
/// # Errors
/// [`ReconcileError`] when a write or read failed; the job is retried after a short delay.
pub async fn reconcile(job: Arc<LeasedJob>, ctx: Arc<Context>) -> Result<Action, ReconcileError> {
    if job.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    // Before anything waits: a job first seen later (after a claim already made) would have
    // its claim taken for history and get no Event.
    record_transitions(&job, &ctx).await;
    if !ctx.leases_synced.is_synced() {
        // Without the Lease cache every record would look new; try again shortly.
        return Ok(Action::requeue(Duration::from_millis(200)));
    }
    let ns = job.namespace().unwrap_or_default();
    let jobs: Api<LeasedJob> = Api::namespaced(ctx.client.clone(), &ns);
    let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(status) = job.status.as_ref().filter(|s| s.phase.is_some()) else {
        ctx.leading(&job)?;
        if let Some(after) = ctx.initialise_after(&job) {
            return Ok(Action::requeue(after));
        }
        initialise(&jobs, &job, &ctx.post_params()).await?;
        return Ok(Action::await_change());
    };
    ctx.initialised(&job);
    let lease_name = status
        .lease_name
        .clone()
        .unwrap_or_else(|| lease::lease_name(&job.name_any()));
    let lease = ctx.leases.get(&ObjectRef::new(&lease_name).within(&ns));
    let phase = job.phase();
    if job.spec.cancel && matches!(phase, Phase::Queued | Phase::Leased) {
        return cancel(&job, &ctx, &jobs, &leases, &lease_name).await;
    }
    match phase {
        Phase::Leased => {
            check_expiry(&job, &ctx, &jobs, &leases, &lease_name, lease.as_deref()).await
        }
        _ => {
            ctx.observations
                .lock()
                .unwrap()
                .remove(&ObjectRef::from_obj(&*job));
            // A Lease still naming an ended attempt's token is left as it is: the job's status
            // fences that attempt (docs/protocol.md, "What fences what").
            if phase.is_finished() {
                return delete_after_ttl(&job, &ctx, &jobs).await;
            }
            Ok(Action::await_change())
        }
    }
}

/// Cancels a Queued or Leased job whose spec.cancel is set, then frees its Lease so that the
/// holder's next heartbeat is refused with `cancelled`.
async fn cancel(
    job: &LeasedJob,
    ctx: &Context,
    jobs: &Api<LeasedJob>,
    leases: &Api<Lease>,
    lease_name: &str,
) -> Result<Action, ReconcileError> {
    let job_ref = job.reference();
    let was = job.phase();
    let patch = fence::cancel_patch(job, Timestamp::now());
    // Claimed, finished or changed since our snapshot: the watch brings the new state and the
    // cancel is judged again.
    if !ctx
        .patch_status_if_unchanged(jobs, job, patch, "cancel")
        .await?
    {
        return Ok(Action::requeue(Duration::from_millis(100)));
    }
    info!(job = %job_ref, attempt = job.attempt(), "Cancelled LeasedJob {job_ref} (was {was})");
    ctx.observations
        .lock()
        .unwrap()
        .remove(&ObjectRef::from_obj(job));
    let holder = job
        .status
        .as_ref()
        .and_then(|s| s.holder.clone())
        .unwrap_or_default();
    let note = if was == Phase::Leased {
        format!("Cancelled while leased by {holder} (attempt {}); the holder is told at its next heartbeat", job.attempt())
    } else {
        "Cancelled while queued".to_string()
    };
    ctx.event(job, EventType::Normal, "Cancelled", note).await;
    if let (Phase::Leased, Some(token)) = (was, job.token()) {
        ctx.leading(job)?;
        leasehold_kube::lease::release(leases, lease_name, token)
            .await
            .map_err(|source| ReconcileError::Lease {
                job: job.reference(),
                action: "release after cancel",
                source,
            })?;
    }
    Ok(Action::await_change())
}

/// Deletes a finished job spec.ttlSecondsAfterFinished after status.finishedTime (as batch/v1
/// Job's TTL-after-finished controller does), or says when to look again.
async fn delete_after_ttl(
    job: &LeasedJob,
    ctx: &Context,
    jobs: &Api<LeasedJob>,
) -> Result<Action, ReconcileError> {
    let (Some(ttl), Some(finished)) = (
        job.spec.ttl_seconds_after_finished,
        job.status.as_ref().and_then(|s| s.finished_time.as_ref()),
    ) else {
        return Ok(Action::await_change());
    };
    let due = finished.0 + SignedDuration::from_secs(i64::from(ttl.max(0)));
    let now = Timestamp::now();
    if due > now {
        let wait = Duration::try_from(due.duration_since(now)).unwrap_or_default();
        return Ok(Action::requeue(wait + EXPIRY_SLACK));
    }
    let job_ref = job.reference();
    // Only the object we judged: not a new job that took the same name meanwhile.
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: job.uid(),
            resource_version: job.resource_version(),
        }),
        ..DeleteParams::background()
    };
    ctx.leading(job)?;
    match jobs.delete(&job.name_any(), &params).await {
        Ok(_) => {
            info!(job = %job_ref, "Deleted LeasedJob {job_ref}: {ttl}s after it finished (ttlSecondsAfterFinished)");
            Ok(Action::await_change())
        }
        Err(e) if is_status(&e, 404) || is_status(&e, 409) => Ok(Action::await_change()),
        Err(source) => Err(ReconcileError::Job {
            job: job_ref,
            action: "delete after ttlSecondsAfterFinished",
            source,
        }),
    }
}

/// Gives a job applied without status its Queued status, under its resourceVersion.
async fn initialise(
    jobs: &Api<LeasedJob>,
    job: &LeasedJob,
    params: &PostParams,
) -> Result<(), ReconcileError> {
    let mut next = job.clone();
    next.status = Some(LeasedJobStatus {
        phase: Some(Phase::Queued),
        queued_time: job.metadata.creation_timestamp.clone(),
        lease_name: Some(lease::lease_name(&job.name_any())),
        observed_generation: job.metadata.generation,
        ..job.status.clone().unwrap_or_default()
    });
    match jobs.replace_status(&job.name_any(), params, &next).await {
        Ok(_) => {
            info!(job = %job.reference(), "Queued LeasedJob {}", job.reference());
            Ok(())
        }
        // A claimer (or another write) got there first: the watch brings the new version.
        Err(e) if is_status(&e, 409) || is_status(&e, 404) => Ok(()),
        Err(source) => Err(ReconcileError::Job {
            job: job.reference(),
            action: "initialise status",
            source,
        }),
    }
}
