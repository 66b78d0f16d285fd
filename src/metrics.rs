//! Metrics (one `prometheus-client` registry per process) and health.
//!
//! Names follow `leasehold_<what>_<unit>`. The controller moves `leasehold_jobs` (by queue and
//! phase, counted from its watch cache at scrape time) and `leasehold_lease_expiries_total`;
//! the sidecar moves the claim, heartbeat, refusal and duration metrics; both count the
//! objects their watches skip as undecodable (`leasehold_undecodable_objects_total`, see
//! [`crate::watch`]). Both serve them at `/metrics` in the Prometheus text format, beside
//! `/healthz` and `/readyz`.
//!
//! Health tells the truth: `/readyz` is OK only once the watches have synced and before
//! shutdown begins; `/healthz` fails once a background task has died.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::FutureExt;
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

/// Label of `leasehold_undecodable_objects_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The object's kind: `LeasedJob` or `Lease`.
    pub kind: String,
}

/// Every leasehold metric.
pub struct Metrics {
    registry: Registry,
    /// Jobs by queue and phase (controller; set at scrape time).
    pub jobs: Family<JobLabels, Gauge>,
    /// Successful claims (sidecar).
    pub claims: Counter,
    /// Claim writes refused with 409 Conflict because another claimer won (sidecar).
    pub claim_conflicts: Counter,
    /// Leases the controller found expired and requeued or failed (controller).
    pub lease_expiries: Counter,
    /// Writes refused because the token was not the current holder's (sidecar).
    pub stale_token_refusals: Counter,
    /// Lease renewals by result, background and worker-initiated (sidecar).
    pub heartbeats: Family<ResultLabel, Counter>,
    /// Objects a watch skipped because they could not be decoded, by kind (both roles; counted
    /// again at every re-list while the object stays unreadable). See [`crate::watch`].
    pub undecodable_objects: Family<KindLabel, Counter>,
    /// Seconds from a job's creation to its claim (sidecar).
    pub queue_wait_seconds: Histogram,
    /// Seconds from a claim to the end of that attempt by its holder (sidecar).
    pub run_seconds: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("leasehold");
        let jobs = Family::<JobLabels, Gauge>::default();
        let claims = Counter::default();
        let claim_conflicts = Counter::default();
        let lease_expiries = Counter::default();
        let stale_token_refusals = Counter::default();
        let heartbeats = Family::<ResultLabel, Counter>::default();
        let undecodable_objects = Family::<KindLabel, Counter>::default();
        // 1 ms .. ~9 h, doubling.
        let queue_wait_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 25));
        let run_seconds = Histogram::new(exponential_buckets(0.01, 2.0, 23));
        registry.register("jobs", "LeasedJobs by queue and phase", jobs.clone());
        registry.register("claims", "Successful claims", claims.clone());
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
        Metrics {
            registry,
            jobs,
            claims,
            claim_conflicts,
            lease_expiries,
            stale_token_refusals,
            heartbeats,
            undecodable_objects,
            queue_wait_seconds,
            run_seconds,
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

    /// The registry in the Prometheus text format, as an HTTP response.
    pub fn render(&self) -> Response {
        let mut text = String::new();
        match prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            Ok(()) => (
                [(
                    header::CONTENT_TYPE,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )],
                text,
            )
                .into_response(),
            Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
        }
    }
}

/// Liveness and readiness of one process.
#[derive(Default)]
pub struct Health {
    synced: AtomicBool,
    shutting_down: AtomicBool,
    dead: Mutex<Vec<String>>,
}

impl Health {
    /// A fresh, not yet ready, health.
    pub fn new() -> Arc<Health> {
        Arc::default()
    }

    /// Marks the watches synced.
    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::SeqCst);
    }

    /// Marks the start of shutdown: not ready from now on.
    pub fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// True once shutdown began.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Records that background task `name` died.
    pub fn task_died(&self, name: &str) {
        self.dead.lock().unwrap().push(name.to_string());
    }

    /// `/readyz`: 200 once synced and before shutdown, else 503 saying why.
    pub fn readyz(&self) -> Response {
        if self.is_shutting_down() {
            (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response()
        } else if !self.synced.load(Ordering::SeqCst) {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "watches have not synced yet\n",
            )
                .into_response()
        } else {
            (StatusCode::OK, "ok\n").into_response()
        }
    }

    /// `/healthz`: 200 while every background task lives, else 500 naming the dead ones.
    pub fn healthz(&self) -> Response {
        let dead = self.dead.lock().unwrap();
        if dead.is_empty() {
            (StatusCode::OK, "ok\n").into_response()
        } else {
            let text = format!("background task died: {}\n", dead.join(", "));
            (StatusCode::INTERNAL_SERVER_ERROR, text).into_response()
        }
    }

    /// Spawns `task` as `name`; a panic in it is recorded (and makes `/healthz` fail) instead
    /// of vanishing silently.
    pub fn spawn<F>(self: &Arc<Self>, name: String, task: F) -> tokio::task::JoinHandle<()>
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let health = Arc::clone(self);
        tokio::spawn(async move {
            if std::panic::AssertUnwindSafe(task)
                .catch_unwind()
                .await
                .is_err()
            {
                tracing::error!(task = %name, "background task panicked");
                health.task_died(&name);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_follows_sync_and_shutdown() {
        let h = Health::new();
        assert_eq!(h.readyz().status(), StatusCode::SERVICE_UNAVAILABLE);
        h.set_synced();
        assert_eq!(h.readyz().status(), StatusCode::OK);
        h.set_shutting_down();
        assert_eq!(h.readyz().status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(h.healthz().status(), StatusCode::OK);
        h.task_died("renewer");
        assert_eq!(h.healthz().status(), StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[tokio::test]
    async fn a_panicking_task_makes_healthz_fail() {
        let h = Health::new();
        h.spawn("boom".into(), async { panic!("boom") })
            .await
            .unwrap();
        assert_eq!(h.healthz().status(), StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn metrics_render_with_their_prefix() {
        let m = Metrics::new();
        m.claims.inc();
        m.heartbeat(true);
        m.undecodable("Lease");
        m.jobs
            .get_or_create(&JobLabels {
                queue: "q".into(),
                phase: "Queued".into(),
            })
            .set(3);
        let body =
            futures::executor::block_on(axum::body::to_bytes(m.render().into_body(), usize::MAX))
                .unwrap();
        let text = String::from_utf8(body.to_vec()).unwrap();
        assert!(text.contains("leasehold_claims_total 1"), "{text}");
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
}
