//! leasehold-metrics: one `prometheus-client` registry per process. It counts what the
//! worker and the watches report through [`leasehold_kube::recorder::Recorder`], and what the
//! controller sets; the binary serves it (`/metrics`). No HTTP here.
//!
//! Names follow `leasehold_<what>_<unit>`. The controller moves `leasehold_jobs` (by queue and
//! phase, counted from its watch cache every second) and `leasehold_lease_expiries_total`, and
//! registers the metrics of [`ControllerMetrics`] (leadership, readiness, and per-queue gauges
//! computed from its caches by [`leasehold_core::queue_stats`]) that only a controller has; the sidecar
//! moves the claim, heartbeat, refusal and duration metrics; both count the objects their
//! watches skip as undecodable (`leasehold_undecodable_objects_total`, see [`leasehold_kube::watch`]).
//! Both serve them at `/metrics` in the Prometheus text format, beside `/healthz` and
//! `/readyz`. The chart's alerts (docs/alerts.md) are written on these names.
//!

use std::sync::atomic::AtomicU64;

use leasehold_kube::recorder::Recorder;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of `leasehold_jobs`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobLabels {
    /// spec.queue.
    pub queue: String,
    /// status.phase.
    pub phase: String,
}

/// Label of `leasehold_heartbeats_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `ok` or `failed`.
    pub result: &'static str,
}

/// Labels of `leasehold_slot_writes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SlotWriteLabels {
    /// `take` (a slot listed and judged free, or a reused one marked) or `swap` (the
    /// claimer's own free slot, with no list or read).
    pub kind: &'static str,
    /// `written`, or `refused` (another claimer wrote the slot first; for a swap, also a
    /// slot deleted since).
    pub result: &'static str,
}

/// Label of `leasehold_undecodable_objects_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The object's kind: `LeasedJob` or `Lease`.
    pub kind: String,
}

/// Label of the controller's per-queue gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabel {
    /// spec.queue.
    pub queue: String,
}

/// Labels of the gauges of one LeasedQueue object (its namespace matters: two namespaces may
/// each have a queue of one name, one paused and one not). Their number is that of the
/// LeasedQueue objects, which operators create, never of jobs or keys. The namespace's label
/// is `queue_namespace`, not `namespace`, which Prometheus' Kubernetes discovery sets to the
/// scraped pod's.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueObjectLabels {
    /// The LeasedQueue's namespace.
    pub queue_namespace: String,
    /// Its name: the queue's.
    pub queue: String,
}

/// Labels of `leasehold_attempts_ended_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// spec.queue.
    pub queue: String,
    /// How the attempt ended: one of [`leasehold_core::queue_stats::Outcome`]'s names (`succeeded`,
    /// `failed`, `expired`, `released`, `cancelled`).
    pub outcome: &'static str,
}

/// A gauge of seconds, with sub-second precision.
pub type SecondsGauge = Gauge<f64, AtomicU64>;

/// Metrics only a controller registers: a sidecar serving them would read as a replica that
/// never leads, never gets ready and sees no queue.
pub struct ControllerMetrics {
    /// `leasehold_leader`: 1 while this replica leads (its term is valid on its monotonic
    /// clock: the controller's `Leadership::is_leader`), else 0. Always 1 with
    /// `--leader-elect false`. Across the replicas of one installation the sum is 1, or 0
    /// while no replica leads, when nothing expires, requeues or cancels jobs.
    pub leader: Gauge,
    /// `leasehold_controller_ready`: 1 while `/readyz` answers 200 (both watches synced, not
    /// shutting down), else 0.
    pub ready: Gauge,
    /// `leasehold_oldest_attempt_seconds{queue}`: seconds since status.claimedTime of the
    /// longest-running current attempt (a Leased job) of the queue, by the controller's wall
    /// clock (claimedTime is the claimer's: clock skew between the two shifts it by as much);
    /// 0 when none of the queue's jobs is Leased. Large values are attempts kept alive by
    /// heartbeats far longer than their work should take: a stuck worker whose heartbeats
    /// still run.
    pub oldest_attempt_seconds: Family<QueueLabel, SecondsGauge>,
    /// `leasehold_lease_overdue_seconds{queue}`: how far past its lease the most overdue Leased
    /// job of the queue is, in seconds, on this replica's monotonic clock: the time its Lease
    /// record has gone unchanged ([`leasehold_core::expiry`]) beyond its leaseDurationSeconds; 0 when
    /// none is. The leader requeues an expired job within milliseconds of its expiry, so a
    /// value that keeps growing means the controller is not taking jobs back (no leader, or
    /// its writes fail).
    pub lease_overdue_seconds: Family<QueueLabel, SecondsGauge>,
    /// `leasehold_attempts_ended_total{queue,outcome}`: attempts this replica saw end, by how
    /// they ended ([`leasehold_core::queue_stats::ended_attempts`]). Every replica counts what its watch
    /// shows (standbys too), so aggregate replicas with `max`, not `sum`; an attempt that began
    /// and ended while no replica watched is not counted.
    pub attempts_ended: Family<OutcomeLabels, Counter>,
    /// `leasehold_queue_paused{queue_namespace,queue}`: 1 while the LeasedQueue's spec.paused is
    /// true, else 0; one series per LeasedQueue object (a queue without one has none).
    pub queue_paused: Family<QueueObjectLabels, Gauge>,
    /// `leasehold_queue_paused_seconds{queue_namespace,queue}`: seconds since the LeasedQueue's
    /// status.pausedTime (when the leading controller saw the pause), by the controller's wall
    /// clock; 0 while it is not paused. The alert "paused for long" is written on it.
    pub queue_paused_seconds: Family<QueueObjectLabels, SecondsGauge>,
    /// `leasehold_queue_oldest_queued_seconds{queue_namespace,queue}`: seconds since the
    /// creation of the LeasedQueue's oldest Queued job (its status.oldestQueuedTime), by the
    /// controller's wall clock; 0 when none is queued. With fair sharing, a key whose jobs are
    /// not served shows here: its oldest job grows old while the others' are claimed.
    pub queue_oldest_queued_seconds: Family<QueueObjectLabels, SecondsGauge>,
    /// `leasehold_queue_at_limit{queue_namespace,queue}`: 1 while the LeasedQueue has its
    /// maxLeased jobs Leased (or more), else 0.
    pub queue_at_limit: Family<QueueObjectLabels, Gauge>,
    /// `leasehold_queue_keys_at_limit{queue_namespace,queue}`: how many of its concurrency keys
    /// have their maxLeasedPerKey jobs Leased (a count, not a label per key: keys are many).
    pub queue_keys_at_limit: Family<QueueObjectLabels, Gauge>,
}

impl ControllerMetrics {
    fn new() -> ControllerMetrics {
        ControllerMetrics {
            leader: Gauge::default(),
            ready: Gauge::default(),
            oldest_attempt_seconds: Family::default(),
            lease_overdue_seconds: Family::default(),
            attempts_ended: Family::default(),
            queue_paused: Family::default(),
            queue_paused_seconds: Family::default(),
            queue_oldest_queued_seconds: Family::default(),
            queue_at_limit: Family::default(),
            queue_keys_at_limit: Family::default(),
        }
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "leader",
            "1 while this controller replica leads, else 0",
            self.leader.clone(),
        );
        registry.register(
            "controller_ready",
            "1 while this controller replica is ready (watches synced, not shutting down)",
            self.ready.clone(),
        );
        registry.register(
            "oldest_attempt_seconds",
            "Seconds since the claim of the queue's longest-running Leased job",
            self.oldest_attempt_seconds.clone(),
        );
        registry.register(
            "lease_overdue_seconds",
            "Seconds the queue's most overdue Leased job is past its lease without being requeued",
            self.lease_overdue_seconds.clone(),
        );
        registry.register(
            "attempts_ended",
            "Attempts seen ending, by queue and outcome",
            self.attempts_ended.clone(),
        );
        registry.register(
            "queue_paused",
            "1 while the LeasedQueue pauses new claims, else 0",
            self.queue_paused.clone(),
        );
        registry.register(
            "queue_paused_seconds",
            "Seconds since the LeasedQueue was paused; 0 while it is not",
            self.queue_paused_seconds.clone(),
        );
        registry.register(
            "queue_oldest_queued_seconds",
            "Seconds since the creation of the LeasedQueue's oldest Queued job; 0 when none is",
            self.queue_oldest_queued_seconds.clone(),
        );
        registry.register(
            "queue_at_limit",
            "1 while the LeasedQueue has maxLeased jobs Leased, else 0",
            self.queue_at_limit.clone(),
        );
        registry.register(
            "queue_keys_at_limit",
            "Concurrency keys of the LeasedQueue with maxLeasedPerKey jobs Leased",
            self.queue_keys_at_limit.clone(),
        );
    }
}

/// Every leasehold metric.
pub struct Metrics {
    registry: Registry,
    /// Jobs by queue and phase (controller; set at scrape time).
    pub jobs: Family<JobLabels, Gauge>,
    /// Successful claims (sidecar).
    pub claims: Counter,
    /// `leasehold_claims_offered_total`: those of [`Metrics::claims`] whose job the dispatcher
    /// offered; the rest the sidecar chose on its own (no dispatcher token, or the fallback)
    /// (sidecar).
    pub claims_offered: Counter,
    /// Claim writes refused with 409 Conflict because another claimer won (sidecar).
    pub claim_conflicts: Counter,
    /// Leases the controller found expired and requeued or failed (controller).
    pub lease_expiries: Counter,
    /// Writes refused because the token was not the current holder's (sidecar).
    pub stale_token_refusals: Counter,
    /// `leasehold_slot_writes_total{kind,result}`: the slot Lease writes claims in limited
    /// queues made to take or swap their slots (sidecar; docs/protocol.md, "Limits").
    pub slot_writes: Family<SlotWriteLabels, Counter>,
    /// Lease renewals by result, background and worker-initiated (sidecar).
    pub heartbeats: Family<ResultLabel, Counter>,
    /// Objects a watch skipped because they could not be decoded, by kind (both roles; counted
    /// again at every re-list while the object stays unreadable). See [`leasehold_kube::watch`].
    pub undecodable_objects: Family<KindLabel, Counter>,
    /// Seconds from a job's creation to its claim (sidecar).
    pub queue_wait_seconds: Histogram,
    /// Seconds from a claim to the end of that attempt by its holder (sidecar).
    pub run_seconds: Histogram,
    /// `leasehold_queue_watch_running`: 1 while the sidecar's watch of its queue runs, 0 while
    /// it is stopped for want of claims ([`leasehold_kube::queue_watch`]) (sidecar).
    pub queue_watch_running: Gauge,
    /// `leasehold_queue_watch_stops_total`: times that watch stopped because no claim came
    /// while the queue's changes outnumbered a fresh list (sidecar).
    pub queue_watch_stops: Counter,
    /// The controller's own metrics: registered only by [`Metrics::controller`]; setting them
    /// in a registry made by [`Metrics::new`] shows nothing.
    pub controller: ControllerMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The registry of a controller: every metric of [`Metrics::new`] and the
    /// [`ControllerMetrics`].
    pub fn controller() -> Metrics {
        let mut metrics = Metrics::new();
        metrics.controller.register(&mut metrics.registry);
        metrics
    }

    /// A registry with every metric both roles share registered (the sidecar's).
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("leasehold");
        let jobs = Family::<JobLabels, Gauge>::default();
        let claims = Counter::default();
        let claims_offered = Counter::default();
        let claim_conflicts = Counter::default();
        let lease_expiries = Counter::default();
        let stale_token_refusals = Counter::default();
        let slot_writes = Family::<SlotWriteLabels, Counter>::default();
        let heartbeats = Family::<ResultLabel, Counter>::default();
        let undecodable_objects = Family::<KindLabel, Counter>::default();
        // 1 ms .. ~9 h, doubling.
        let queue_wait_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 25));
        let run_seconds = Histogram::new(exponential_buckets(0.01, 2.0, 23));
        let queue_watch_running = Gauge::default();
        let queue_watch_stops = Counter::default();
        registry.register("jobs", "LeasedJobs by queue and phase", jobs.clone());
        registry.register("claims", "Successful claims", claims.clone());
        registry.register(
            "claims_offered",
            "Successful claims of a job the dispatcher offered (the rest were chosen by the sidecar)",
            claims_offered.clone(),
        );
        registry.register(
            "claim_conflicts",
            "Claim writes that lost to another claimer (409 Conflict)",
            claim_conflicts.clone(),
        );
        registry.register(
            "lease_expiries",
            "Leases found expired by the controller",
            lease_expiries.clone(),
        );
        registry.register(
            "stale_token_refusals",
            "Writes refused because the token was not the current holder's",
            stale_token_refusals.clone(),
        );
        registry.register(
            "slot_writes",
            "Slot Lease writes of claims in limited queues, by kind (take, swap) and result (written, refused)",
            slot_writes.clone(),
        );
        registry.register("heartbeats", "Lease renewals by result", heartbeats.clone());
        registry.register(
            "undecodable_objects",
            "Objects a watch skipped because they could not be decoded",
            undecodable_objects.clone(),
        );
        registry.register(
            "queue_wait_seconds",
            "Seconds from a job's creation to its claim",
            queue_wait_seconds.clone(),
        );
        registry.register(
            "run_seconds",
            "Seconds from a claim to the end of the attempt",
            run_seconds.clone(),
        );
        registry.register(
            "queue_watch_running",
            "1 while the sidecar watches its queue, 0 while that watch is stopped for want of claims",
            queue_watch_running.clone(),
        );
        registry.register(
            "queue_watch_stops",
            "Times the sidecar stopped watching its queue because no claim came",
            queue_watch_stops.clone(),
        );
        Metrics {
            registry,
            jobs,
            claims,
            claims_offered,
            claim_conflicts,
            lease_expiries,
            stale_token_refusals,
            slot_writes,
            heartbeats,
            undecodable_objects,
            queue_wait_seconds,
            run_seconds,
            queue_watch_running,
            queue_watch_stops,
            controller: ControllerMetrics::new(),
        }
    }

    /// Counts one renewal.
    pub fn heartbeat(&self, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        self.heartbeats.get_or_create(&ResultLabel { result }).inc();
    }

    /// Counts one object of `kind` skipped as undecodable.
    pub fn undecodable(&self, kind: &str) {
        self.undecodable_objects
            .get_or_create(&KindLabel {
                kind: kind.to_string(),
            })
            .inc();
    }

    /// The registry in the OpenMetrics text format ([`CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }
}

/// The HTTP content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The worker's and the watches' reports, counted.
impl Recorder for Metrics {
    fn claimed(&self, queue_wait_seconds: Option<f64>) {
        self.claims.inc();
        if let Some(waited) = queue_wait_seconds {
            self.queue_wait_seconds.observe(waited.max(0.0));
        }
    }
    fn claimed_offered(&self) {
        self.claims_offered.inc();
    }
    fn claim_conflict(&self) {
        self.claim_conflicts.inc();
    }
    fn stale_token_refused(&self) {
        self.stale_token_refusals.inc();
    }
    fn heartbeat(&self, ok: bool) {
        Metrics::heartbeat(self, ok);
    }
    fn attempt_ran(&self, seconds: f64) {
        self.run_seconds.observe(seconds.max(0.0));
    }
    fn undecodable(&self, kind: &str) {
        Metrics::undecodable(self, kind);
    }
    fn queue_watch_running(&self, running: bool) {
        self.queue_watch_running.set(i64::from(running));
    }
    fn queue_watch_stopped(&self) {
        self.queue_watch_stops.inc();
    }
    fn slot_writes(&self, writes: &leasehold_kube::slots::Writes) {
        let counts = [
            ("take", "written", writes.taken),
            ("take", "refused", writes.takes_refused),
            ("swap", "written", writes.swapped),
            ("swap", "refused", writes.swaps_refused),
        ];
        for (kind, result, n) in counts {
            if n > 0 {
                self.slot_writes
                    .get_or_create(&SlotWriteLabels { kind, result })
                    .inc_by(u64::from(n));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendered(m: &Metrics) -> String {
        m.render()
    }

    #[test]
    fn only_a_controller_registry_serves_the_controller_metrics() {
        let set = |m: &Metrics| {
            m.controller.leader.set(1);
            m.controller.ready.set(1);
            let q = QueueLabel { queue: "q".into() };
            m.controller
                .oldest_attempt_seconds
                .get_or_create(&q)
                .set(2.5);
            m.controller
                .lease_overdue_seconds
                .get_or_create(&q)
                .set(0.0);
            m.controller
                .attempts_ended
                .get_or_create(&OutcomeLabels {
                    queue: "q".into(),
                    outcome: "expired",
                })
                .inc();
        };
        let controller = Metrics::controller();
        set(&controller);
        let text = rendered(&controller);
        for line in [
            "leasehold_leader 1",
            "leasehold_controller_ready 1",
            "leasehold_oldest_attempt_seconds{queue=\"q\"} 2.5",
            "leasehold_lease_overdue_seconds{queue=\"q\"} 0.0",
            "leasehold_attempts_ended_total{queue=\"q\",outcome=\"expired\"} 1",
            "leasehold_claims_total 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        let sidecar = Metrics::new();
        set(&sidecar);
        let text = rendered(&sidecar);
        for name in [
            "leasehold_leader",
            "leasehold_controller_ready",
            "leasehold_oldest_attempt_seconds",
            "leasehold_lease_overdue_seconds",
            "leasehold_attempts_ended",
        ] {
            assert!(!text.contains(name), "the sidecar serves {name}:\n{text}");
        }
    }

    #[test]
    fn metrics_render_with_their_prefix() {
        let m = Metrics::new();
        m.claimed(None);
        m.claimed(Some(0.2));
        m.claimed_offered();
        m.heartbeat(true);
        m.undecodable("Lease");
        m.jobs
            .get_or_create(&JobLabels {
                queue: "q".into(),
                phase: "Queued".into(),
            })
            .set(3);
        let text = m.render();
        assert!(text.contains("leasehold_claims_total 2"), "{text}");
        assert!(text.contains("leasehold_claims_offered_total 1"), "{text}");
        assert!(
            text.contains("leasehold_heartbeats_total{result=\"ok\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("leasehold_undecodable_objects_total{kind=\"Lease\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("leasehold_jobs{queue=\"q\",phase=\"Queued\"} 3"),
            "{text}"
        );
    }

    #[test]
    fn slot_writes_are_counted_by_kind_and_result_and_zeros_add_no_series() {
        let m = Metrics::new();
        let writes = |taken, takes_refused, swapped, swaps_refused| leasehold_kube::slots::Writes {
            taken,
            takes_refused,
            swapped,
            swaps_refused,
        };
        m.slot_writes(&writes(1, 0, 0, 1));
        m.slot_writes(&writes(0, 0, 2, 0));
        let text = m.render();
        for (series, n) in [
            ("{kind=\"take\",result=\"written\"}", 1),
            ("{kind=\"swap\",result=\"refused\"}", 1),
            ("{kind=\"swap\",result=\"written\"}", 2),
        ] {
            let line = format!("leasehold_slot_writes_total{series} {n}");
            assert!(text.contains(&line), "{line}:\n{text}");
        }
        assert!(!text.contains("result=\"refused\"} 0"), "{text}");
        assert!(!text.contains("kind=\"take\",result=\"refused\""), "{text}");
    }
}
