//! What the controller reports besides its writes: the metrics it computes from its caches
//! every second ([`report`]), and Warning Events on objects its watches cannot decode
//! ([`undecodable_reporter`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;
use kube::ResourceExt;
use tracing::warn;

use super::{Context, NOT_LEADER_REQUEUE};
use crate::leader::Leadership;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::expiry::{self, Observation};
use leasehold_core::expiry::{lease_duration, record_of};
use leasehold_core::lease;
use leasehold_core::queue_stats::{self, JobSample};
use leasehold_core::Category;
use leasehold_kube::events::{EventType, Note, Publisher};
use leasehold_kube::health::Health;
use leasehold_kube::watch::Undecodable;
use leasehold_metrics::{JobLabels, OutcomeLabels, QueueLabel};

/// How many skipped objects may wait for this replica to lead before more are dropped (their
/// log line and metric stand; a later re-list reports them again).
const UNDECODABLE_BACKLOG: usize = 256;

/// What the controller does with the objects its watches skip as undecodable, besides the log
/// line and the metric [`watch::watch`](leasehold_kube::watch::watch) gives them: a Warning Event `Undecodable` on each
/// (see [`record_undecodable`]), recorded once this replica leads (standbys do not write;
/// the initial list usually comes before the first election is won). Returns the callback for
/// the watches and the task that records, to be aborted at shutdown.
pub(super) fn undecodable_reporter(
    events: &Publisher,
    leadership: &Arc<Leadership>,
) -> (
    impl FnMut(Undecodable) + Clone + Send + 'static,
    tokio::task::JoinHandle<()>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Undecodable>(UNDECODABLE_BACKLOG);
    let events = events.clone();
    let leadership = Arc::clone(leadership);
    let task = tokio::spawn(async move {
        while let Some(skipped) = rx.recv().await {
            while !leadership.is_leader() {
                tokio::time::sleep(NOT_LEADER_REQUEUE).await;
            }
            record_undecodable(&events, &skipped).await;
        }
    });
    let report = move |skipped: Undecodable| {
        let _ = tx.try_send(skipped);
    };
    (report, task)
}

/// Records a Warning Event `Undecodable` on the object `skipped` names (an ObjectReference
/// built from its metadata alone, since the object itself could not be read). A failure to
/// record it is logged, never returned: the object was already reported in the log and the
/// metric.
async fn record_undecodable(events: &Publisher, skipped: &Undecodable) {
    let note = Note {
        type_: EventType::Warning,
        reason: "Undecodable".into(),
        action: "Skipped".into(),
        text: format!(
            "leasehold cannot read this {}: {}; it is skipped (never claimed, expired or \
             requeued) until it is fixed or deleted",
            skipped.kind, skipped.error
        ),
    };
    if let Err(e) = events.publish(&skipped.object, &note).await {
        warn!(object = %skipped.reference, category = e.category(), error = %leasehold_kube::api::error_chain(&e), "Recording Event Undecodable failed");
    }
}

/// The label sets [`report`] set last time, so that the next report removes those whose
/// queue or phase has no job any more (and leaves the rest in place: a scrape never sees a
/// family half rebuilt).
#[derive(Default)]
pub(super) struct Reported {
    jobs: HashSet<JobLabels>,
    queues: HashSet<String>,
}

/// Sets the metrics the controller computes from its caches: `leasehold_jobs` by queue and
/// phase, whether it leads and is ready, and the per-queue gauges of [`queue_stats`] (the
/// oldest attempt's age, the most overdue lease). Called every second.
pub(super) fn report(ctx: &Context, health: &Health, reported: &mut Reported) {
    let metrics = &ctx.metrics;
    let gauges = &metrics.controller;
    gauges.leader.set(i64::from(ctx.leadership.is_leader()));
    gauges.ready.set(i64::from(health.is_ready()));
    let queues = {
        let jobs = ctx.jobs.lock().unwrap();
        let observations = ctx.observations.lock().unwrap();
        let now = Instant::now();
        let samples = jobs.records().map(|(key, record)| {
            let phase = record.phase();
            let leased = phase == Phase::Leased;
            JobSample {
                queue: record.queue(),
                phase,
                claimed_time: record.claimed_time().filter(|_| leased).map(|t| t.0),
                overdue: if leased {
                    let observed = ObjectRef::new(&key.name).within(&key.namespace);
                    observations
                        .get(&observed)
                        .and_then(|observation| overdue_of(&jobs.job(key)?, ctx, observation, now))
                } else {
                    None
                },
            }
        });
        queue_stats::gauges(samples, Timestamp::now())
    };
    let mut now_reported = Reported::default();
    for (queue, q) in &queues {
        for (phase, n) in &q.jobs {
            let labels = JobLabels {
                queue: queue.clone(),
                phase: phase.to_string(),
            };
            metrics.jobs.get_or_create(&labels).set(*n);
            now_reported.jobs.insert(labels);
        }
        let label = QueueLabel {
            queue: queue.clone(),
        };
        gauges
            .oldest_attempt_seconds
            .get_or_create(&label)
            .set(q.oldest_attempt.as_secs_f64());
        gauges
            .lease_overdue_seconds
            .get_or_create(&label)
            .set(q.lease_overdue.as_secs_f64());
        // Every outcome from 0, so that rate() and increase() count a queue's first ones.
        for outcome in queue_stats::Outcome::ALL {
            let _ = gauges.attempts_ended.get_or_create(&OutcomeLabels {
                queue: queue.clone(),
                outcome: outcome.as_str(),
            });
        }
        now_reported.queues.insert(queue.clone());
    }
    for gone in reported.jobs.difference(&now_reported.jobs) {
        metrics.jobs.remove(gone);
    }
    for gone in reported.queues.difference(&now_reported.queues) {
        let label = QueueLabel {
            queue: gone.clone(),
        };
        gauges.oldest_attempt_seconds.remove(&label);
        gauges.lease_overdue_seconds.remove(&label);
    }
    *reported = now_reported;
}

/// How far past its lease the Leased `job` is, by this replica's last look at it,
/// `observation` (see [`expiry::overdue`]).
fn overdue_of(
    job: &LeasedJob,
    ctx: &Context,
    observation: &Observation,
    now: Instant,
) -> Option<Duration> {
    let ns = job.namespace().unwrap_or_default();
    let lease_name = job
        .status
        .as_ref()
        .and_then(|s| s.lease_name.clone())
        .unwrap_or_else(|| lease::lease_name(&job.name_any()));
    let lease = ctx.leases.get(&ObjectRef::new(&lease_name).within(&ns));
    let token = job.token().unwrap_or_default();
    let record = record_of(job, lease.as_deref());
    let duration = lease_duration(job, lease.as_deref(), token);
    expiry::overdue(observation, &record, duration, now)
}
