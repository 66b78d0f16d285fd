//! The LeasedQueue objects ([`leasehold_core::queue`]): the controller follows every one it
//! can see, tells the dispatcher which queues are paused, how their keys share and their limits, and, while this replica leads,
//! writes each one's status (jobs queued and leased, the oldest queued job, the pause) and an
//! Event `Paused` or `Resumed` when its pause changes.
//!
//! While it leads it also gives slots to the jobs Leased before a queue's limit existed
//! ([`crate::adoption`]) and confirms the limits in the status once they all hold one (a
//! write of its own: the status written here leaves `slotsAdopted` alone).
//!
//! Status writes: when a pause changes, at once; otherwise when the counts changed, at most
//! every [`STATUS_EVERY`] per queue, so that a busy queue costs the API server one write every
//! few seconds, not one per job. A queue with no LeasedQueue costs nothing.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::Notify;
use tracing::{info, warn};

use super::Context;
use crate::dispatch::Dispatcher;
use leasehold_core::adoption;
use leasehold_core::dispatch::{Policy, QueueKey};
use leasehold_core::queue::{self, LeasedQueue, LeasedQueueStatus, Member, Transition};
use leasehold_core::Category;
use leasehold_kube::events::{EventType, Note};
use leasehold_kube::recorder::Recorder;
use leasehold_metrics::QueueObjectLabels;

/// How often the leader looks at every LeasedQueue's counts (and writes those that changed).
pub const STATUS_EVERY: Duration = Duration::from_secs(5);

/// Follows the LeasedQueues `api` sees (the controller's namespace, or all) and keeps their
/// statuses while this replica leads; `dispatcher` is told which queues are paused. Runs
/// until dropped.
pub(super) async fn run(
    api: Api<LeasedQueue>,
    ctx: Arc<Context>,
    dispatcher: Option<Arc<Dispatcher>>,
    jobs_synced: leasehold_kube::watch::Synced,
) {
    let (store, writer) = reflector::store();
    let due = Arc::new(Notify::new());
    let follow = follow(
        api,
        store.clone(),
        writer,
        Arc::clone(&ctx),
        dispatcher,
        Arc::clone(&due),
    );
    // No status from a job cache that has not listed the jobs yet: it would read 0 queued.
    let report = async move {
        jobs_synced.wait().await;
        report(store, ctx, due).await;
    };
    tokio::join!(follow, report);
}

/// Keeps `writer`'s store from the watch, the dispatcher's paused queues from it, and
/// notifies `due` when a queue's pause differs from what its status reports.
async fn follow(
    api: Api<LeasedQueue>,
    store: Store<LeasedQueue>,
    writer: reflector::store::Writer<LeasedQueue>,
    ctx: Arc<Context>,
    dispatcher: Option<Arc<Dispatcher>>,
    due: Arc<Notify>,
) {
    let metrics = Arc::clone(&ctx.metrics) as Arc<dyn Recorder>;
    let stream = leasehold_kube::watch::watch(&api, watcher::Config::default(), metrics, |_| {})
        .reflect(writer);
    let mut stream = std::pin::pin!(stream);
    // What the dispatcher was told of each queue.
    let mut set: HashMap<QueueKey, Policy> = HashMap::new();
    let mut warned = false;
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Apply(q)) | Ok(watcher::Event::InitApply(q)) => {
                // Seen without limits: their confirmation goes now, from this very version,
                // even if limits are set again before a pass reads the store.
                crate::adoption::clear(&ctx, &q).await;
                // A pause changed, or limits wait for their slots' adoption: a pass at once.
                if queue::transition(&q).is_some() || !adoption::adopted(&q) {
                    due.notify_one();
                }
            }
            Ok(watcher::Event::Delete(_) | watcher::Event::Init) => {}
            Ok(watcher::Event::InitDone) => due.notify_one(),
            Err(e) => {
                match leasehold_kube::queue_object::unreadable(&e) {
                    Some(code) if !warned => {
                        warned = true;
                        warn!(code, "The LeasedQueue API cannot be read (404: its CRD is not installed, see `leasehold crd`; 403: the controller's ClusterRole lacks leasedqueues): queues cannot be paused until it can be; retrying");
                    }
                    Some(_) => {}
                    None => leasehold_kube::watch::log_error("LeasedQueue", &e),
                }
                continue;
            }
        }
        // The store holds the event now: the policies follow it whole, so that a queue
        // deleted (or missed during a re-list) loses its weights and limits too. (The pause is
        // not the dispatcher's: each sidecar reads it, and does not ask while paused.)
        let queues = store.state();
        let policies: HashMap<QueueKey, Policy> = queues
            .iter()
            .filter_map(|q| Some((key_of(q)?, Policy::of(&q.spec))))
            .collect();
        if let Some(dispatcher) = &dispatcher {
            for gone in set.keys().filter(|k| !policies.contains_key(*k)) {
                dispatcher.set_policy(gone, None);
            }
            for (key, policy) in &policies {
                if set.get(key) != Some(policy) {
                    dispatcher.set_policy(key, Some(policy.clone()));
                }
            }
        }
        set = policies;
    }
}

/// The queue a LeasedQueue names: its namespace and name.
fn key_of(q: &LeasedQueue) -> Option<QueueKey> {
    Some(QueueKey {
        namespace: q.namespace()?,
        queue: q.name_any(),
    })
}

/// Every [`STATUS_EVERY`], or when `due`, writes the statuses that changed (while this replica
/// leads) and sets the per-queue metrics.
async fn report(store: Store<LeasedQueue>, ctx: Arc<Context>, due: Arc<Notify>) {
    let mut reported: HashSet<QueueObjectLabels> = HashSet::new();
    loop {
        tokio::select! {
            () = due.notified() => {}
            () = tokio::time::sleep(STATUS_EVERY) => {}
        }
        let queues = store.state();
        let now = Timestamp::now();
        let statuses = statuses(&ctx, &queues, now);
        reported = set_metrics(&ctx, &queues, &statuses, now, reported);
        if !ctx.leadership.is_leader() {
            // A later leadership times pending slots afresh.
            ctx.stalled.lock().unwrap().clear();
            continue;
        }
        for (q, status) in queues.iter().zip(statuses) {
            if q.status.as_ref() != Some(&status) {
                write_status(&ctx, q, &status).await;
            }
        }
        // Then the slots of the queues with limits, after every count and pause is written.
        let limited: HashSet<String> = queues
            .iter()
            .filter(|q| adoption::adoption_of(q).is_some())
            .map(|q| format!("{}/{}", q.namespace().unwrap_or_default(), q.name_any()))
            .collect();
        ctx.stalled.lock().unwrap().retain(&limited);
        for q in &queues {
            crate::adoption::clear(&ctx, q).await;
            crate::adoption::pass(&ctx, q).await;
        }
    }
}

/// The status each of `queues` should have, from the controller's cache of jobs: one pass
/// over the jobs, counting those of the queues that have a LeasedQueue.
fn statuses(ctx: &Context, queues: &[Arc<LeasedQueue>], now: Timestamp) -> Vec<LeasedQueueStatus> {
    // namespace -> queue -> index in `queues`, borrowed: no allocation per job.
    let mut index: HashMap<&str, HashMap<&str, usize>> = HashMap::new();
    for (i, q) in queues.iter().enumerate() {
        let (Some(ns), Some(name)) = (q.metadata.namespace.as_deref(), q.metadata.name.as_deref())
        else {
            continue;
        };
        index.entry(ns).or_default().insert(name, i);
    }
    let jobs = ctx.jobs.lock().unwrap();
    let mut members: Vec<Vec<Member<'_>>> = vec![Vec::new(); queues.len()];
    if !index.is_empty() {
        for (key, record) in jobs.records() {
            let found = index
                .get(&*key.namespace)
                .and_then(|q| q.get(record.queue()));
            if let Some(&i) = found {
                members[i].push(Member {
                    phase: record.phase(),
                    created: record.created(),
                    key: record.concurrency_key(),
                });
            }
        }
    }
    queues
        .iter()
        .zip(members)
        .map(|(q, m)| queue::status_of(q, m, now))
        .collect()
}

/// Sets the per-LeasedQueue gauges (paused, paused for, at limit, keys at limit), and
/// removes the series of queues gone since `before`. Returns the label sets set.
fn set_metrics(
    ctx: &Context,
    queues: &[Arc<LeasedQueue>],
    statuses: &[LeasedQueueStatus],
    now: Timestamp,
    before: HashSet<QueueObjectLabels>,
) -> HashSet<QueueObjectLabels> {
    let gauges = &ctx.metrics.controller;
    let mut set = HashSet::new();
    for (q, status) in queues.iter().zip(statuses) {
        let labels = QueueObjectLabels {
            queue_namespace: q.namespace().unwrap_or_default(),
            queue: q.name_any(),
        };
        // The status as written, or as about to be: pausedTime is kept across failovers.
        let since = q
            .status
            .as_ref()
            .and_then(|s| s.paused_time.clone())
            .or_else(|| status.paused_time.clone());
        let seconds = match (q.is_paused(), since) {
            (true, Some(t)) => now.duration_since(t.0).as_secs_f64().max(0.0),
            _ => 0.0,
        };
        gauges
            .queue_paused
            .get_or_create(&labels)
            .set(i64::from(q.is_paused()));
        gauges
            .queue_paused_seconds
            .get_or_create(&labels)
            .set(seconds);
        let oldest = status
            .oldest_queued_time
            .as_ref()
            .map_or(0.0, |t| now.duration_since(t.0).as_secs_f64().max(0.0));
        gauges
            .queue_oldest_queued_seconds
            .get_or_create(&labels)
            .set(oldest);
        gauges
            .queue_at_limit
            .get_or_create(&labels)
            .set(i64::from(status.at_limit));
        gauges
            .queue_keys_at_limit
            .get_or_create(&labels)
            .set(status.keys_at_limit);
        set.insert(labels);
    }
    for gone in before.difference(&set) {
        gauges.queue_paused.remove(gone);
        gauges.queue_paused_seconds.remove(gone);
        gauges.queue_oldest_queued_seconds.remove(gone);
        gauges.queue_at_limit.remove(gone);
        gauges.queue_keys_at_limit.remove(gone);
    }
    set
}

/// Records the Event of a pause change of `q`, if any, then writes `status` on it (a merge
/// patch of the status subresource, absent times as null), each only while this replica
/// leads. Failures are logged and the next pass tries again: an Event is recorded again only
/// when its status write failed, and never missed.
async fn write_status(ctx: &Context, q: &LeasedQueue, status: &LeasedQueueStatus) {
    let (Some(ns), name) = (q.namespace(), q.name_any()) else {
        return;
    };
    if let Some(transition) = queue::transition(q) {
        if !ctx.leadership.is_leader() {
            return;
        }
        record(ctx, q, transition, status).await;
    }
    let api: Api<LeasedQueue> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = json!({
        "status": {
            "queued": status.queued,
            "leased": status.leased,
            "oldestQueuedTime": status.oldest_queued_time,
            "oldestQueuedKey": status.oldest_queued_key,
            "paused": status.paused,
            "pausedTime": status.paused_time,
            "observedGeneration": status.observed_generation,
            "atLimit": status.at_limit,
            "keysAtLimit": status.keys_at_limit,
            "keysAtLimitShown": status.keys_at_limit_shown,
        }
    });
    let params = PatchParams {
        field_manager: Some(ctx.field_manager.clone()),
        ..PatchParams::default()
    };
    if !ctx.leadership.is_leader() {
        return;
    }
    let written = api
        .patch_status(&name, &params, &Patch::Merge(&patch))
        .await;
    if let Err(e) = written {
        if !leasehold_kube::api::is_status(&e, 404) {
            warn!(queue = %format!("{ns}/{name}"), error = %leasehold_kube::api::error_chain(&e), "Writing the status of LeasedQueue {ns}/{name} failed; retrying in {STATUS_EVERY:?}");
        }
    }
}

/// Records the Event `Paused` or `Resumed` on `q` (best effort: a failure is logged).
async fn record(
    ctx: &Context,
    q: &LeasedQueue,
    transition: Transition,
    status: &LeasedQueueStatus,
) {
    let (ns, name) = (q.namespace().unwrap_or_default(), q.name_any());
    info!(queue = %format!("{ns}/{name}"), "Queue {}", transition.reason().to_lowercase());
    let text = match transition {
        Transition::Paused => format!(
            "Queue {name} paused: no new claims of its jobs; the {} Leased go on ({} queued)",
            status.leased, status.queued
        ),
        Transition::Resumed => format!(
            "Queue {name} resumed: claims of its {} queued jobs go on",
            status.queued
        ),
    };
    let note = Note {
        type_: EventType::Normal,
        reason: transition.reason().into(),
        action: transition.reason().into(),
        text,
    };
    if let Err(e) = ctx.events.publish(&q.object_ref(&()), &note).await {
        warn!(queue = %format!("{ns}/{name}"), category = e.category(), error = %leasehold_kube::api::error_chain(&e), "Recording Event {} on LeasedQueue {ns}/{name} failed", transition.reason());
    }
}
