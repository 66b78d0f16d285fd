//! `/metrics`, `/healthz` and `/readyz` as HTTP responses, for the sidecar's and the
//! controller's observability servers.
//!
//! Health tells the truth: `/readyz` is 200 only once the watches have synced and before
//! shutdown begins; `/healthz` fails once a background task has died
//! ([`leasehold_kube::health::Health`]).

use std::sync::Arc;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use leasehold_kube::health::Health;
use leasehold_metrics::Metrics;

/// `/metrics`: the registry in the OpenMetrics text format.
pub fn metrics(metrics: &Metrics) -> Response {
    (
        [(header::CONTENT_TYPE, leasehold_metrics::CONTENT_TYPE)],
        metrics.render(),
    )
        .into_response()
}

/// `/readyz`: 200 once synced and before shutdown, else 503 saying why.
pub fn readyz(health: &Health) -> Response {
    match health.readiness() {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response(),
    }
}

/// `/healthz`: 200 while every background task lives, else 500 naming the dead ones.
pub fn healthz(health: &Health) -> Response {
    let dead = health.dead_tasks();
    if dead.is_empty() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        let text = format!("background task died: {}\n", dead.join(", "));
        (StatusCode::INTERNAL_SERVER_ERROR, text).into_response()
    }
}

/// A router serving `/metrics`, `/healthz` and `/readyz` from `metrics` and `health`.
pub fn router(metrics: Arc<Metrics>, health: Arc<Health>) -> Router {
    let ready = Arc::clone(&health);
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = Arc::clone(&metrics);
                async move { self::metrics(&metrics) }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let health = Arc::clone(&health);
                async move { healthz(&health) }
            }),
        )
        .route(
            "/readyz",
            get(move || {
                let health = Arc::clone(&ready);
                async move { readyz(&health) }
            }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readyz_and_healthz_answer_with_the_health() {
        let h = Health::new();
        assert_eq!(readyz(&h).status(), StatusCode::SERVICE_UNAVAILABLE);
        h.set_synced();
        assert_eq!(readyz(&h).status(), StatusCode::OK);
        h.set_shutting_down();
        assert_eq!(readyz(&h).status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(healthz(&h).status(), StatusCode::OK);
        h.task_died("renewer");
        assert_eq!(healthz(&h).status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
