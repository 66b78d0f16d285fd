//! The sidecar: the worker client ([`leasehold_worker`]) served as JSON over local HTTP, so that a
//! worker in any language can lease jobs.
//!
//! Routes (all JSON; see docs/protocol.md):
//! - `POST /v1/claim?wait=SECONDS` -> 200 claimed job, or 204 when nothing was claimable in time
//! - `POST /v1/jobs/{name}/heartbeat` `{token, checkpoint?, progress?, message?}` -> 200
//!   renewal (`progress` a number from 0 to 1, `message` at most
//!   [`leasehold_core::progress::MAX_MESSAGE_BYTES`] bytes: [`leasehold_core::progress`])
//! - `POST /v1/jobs/{name}/complete` `{token, result}` -> 200
//! - `POST /v1/jobs/{name}/fail` `{token, reason, message, retryable, retryAfterSeconds?}`
//!   -> 200 (`retryAfterSeconds`: the failure's own delay before the next attempt:
//!   [`leasehold_core::fence::requested_delay`])
//! - `POST /v1/jobs/{name}/release` `{token}` -> 200
//! - `GET /healthz` (background tasks alive), `GET /readyz` (watch synced, not shutting
//!   down), `GET /metrics` (Prometheus text format), `GET /openapi.json` (this API described
//!   in OpenAPI 3.1: [`OPENAPI`])
//!
//! Every answer the router gives is JSON. Errors are `{"error": "<code>", "message": "..."}`:
//! 400 `invalid_json`, `invalid_request`, `invalid_token`, `invalid_name`; 404 `job_not_found`
//! (and `not_found` for unknown routes); 405 `method_not_allowed`; 408 `body_timeout`; 409
//! `lease_lost`, `job_finished`, `cancelled`; 413 `too_large`; 503 `unavailable`,
//! `shutting_down`. No response ever contains a token other than the one a claim
//! hands out. (A request hyper cannot parse never reaches the router: see [`crate::http`].)
//!
//! Bounds: a body must arrive within the server's body timeout ([`crate::http::Limits`]); a
//! `Content-Length` over [`MAX_BODY_BYTES`] is refused before any of the body is read; every
//! call about a held job answers within [`leasehold_worker::call_bound`] (503 `unavailable` with
//! `expiresAt` past it); a claim answers within its `wait` plus that bound.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use std::sync::Arc;

use leasehold_core::crd::LeasedJob;
use leasehold_core::progress::Progress;
use leasehold_core::Category;
use leasehold_metrics::Metrics;
use leasehold_worker::{Worker, WorkerError};

/// Largest request body accepted, in bytes: a whole LeasedJob's limit
/// ([`leasehold_core::crd::MAX_JOB_BYTES`], 1 MiB), since a result or checkpoint larger than that can
/// never be stored in one.
pub const MAX_BODY_BYTES: usize = leasehold_core::crd::MAX_JOB_BYTES;
/// Where the sidecar serves [`OPENAPI`] (GET).
pub const OPENAPI_PATH: &str = "/openapi.json";
/// The OpenAPI 3.1 document of this API (`docs/sidecar-openapi.json`, built in): every route,
/// body, answer and error code, as docs/protocol.md describes them. `tests/openapi.rs` checks
/// the live sidecar's answers against it, fuzzing every endpoint with schemathesis.
pub const OPENAPI: &str = include_str!("../docs/sidecar-openapi.json");
/// Longest long poll accepted by `/v1/claim?wait=`, in seconds.
pub const MAX_WAIT_SECONDS: u64 = 300;

/// A JSON error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    /// With 503 `unavailable` about a held job: when its lease runs out unless a renewal gets
    /// through, as far as the sidecar knows (`expiresAt` in the answer).
    expires_at: Option<k8s_openapi::jiff::Timestamp>,
    /// Answer with `Connection: close`: the body was not (fully) read, so the connection
    /// cannot carry another request, and the client must not try to reuse it.
    close: bool,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            expires_at: None,
            close: false,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({"error": self.code, "message": self.message});
        if let Some(t) = self.expires_at {
            body["expiresAt"] = json!(t.to_string());
        }
        let mut response = (self.status, Json(body)).into_response();
        if self.close {
            response.headers_mut().insert(
                header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        response
    }
}

impl From<WorkerError> for ApiError {
    fn from(e: WorkerError) -> Self {
        let status = match &e {
            WorkerError::InvalidToken(_) | WorkerError::Invalid { .. } => StatusCode::BAD_REQUEST,
            WorkerError::Refused(r) if r.category() == "job_not_found" => StatusCode::NOT_FOUND,
            WorkerError::LeaseLost { code, .. } if *code == "job_not_found" => {
                StatusCode::NOT_FOUND
            }
            WorkerError::Refused(_) | WorkerError::LeaseLost { .. } => StatusCode::CONFLICT,
            WorkerError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            WorkerError::Unavailable { .. } | WorkerError::ShuttingDown => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        };
        let mut answer = ApiError::new(status, e.category(), e.to_string());
        if let WorkerError::Unavailable { expires_at, .. } = e {
            answer.expires_at = expires_at;
        }
        answer
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimQuery {
    wait: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HeartbeatBody {
    token: Option<String>,
    #[serde(default)]
    checkpoint: Option<Value>,
    /// Read as any JSON value, so that a wrong type is answered `invalid_request` naming the
    /// field and its rule ([`Progress::from_json`]) rather than a serde message.
    #[serde(default)]
    progress: Option<Value>,
    #[serde(default)]
    message: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompleteBody {
    token: Option<String>,
    /// Present (even as `null`) or absent.
    #[serde(default, deserialize_with = "present")]
    result: Option<Value>,
}

/// Some(value) for a field that is present, null included; absent fields get the default.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FailBody {
    token: Option<String>,
    reason: Option<String>,
    #[serde(default)]
    message: Option<String>,
    retryable: Option<bool>,
    /// Read as any JSON value, so that a wrong type is answered `invalid_request` naming the
    /// field and the value ([`retry_after_seconds`]); a wrong range, by the worker library.
    #[serde(default)]
    retry_after_seconds: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseBody {
    token: Option<String>,
}

/// The answer to complete, fail and release.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Ended {
    namespace: String,
    name: String,
    attempt: i32,
    phase: String,
    /// For a job requeued with a delay (a failure under a backoff, or one that asked for its
    /// own): when it is claimable again (RFC 3339, whole seconds).
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after: Option<k8s_openapi::jiff::Timestamp>,
}

impl From<LeasedJob> for Ended {
    fn from(job: LeasedJob) -> Self {
        use kube::ResourceExt;
        let queued = job.phase() == leasehold_core::crd::Phase::Queued;
        // A claim clears status.retryAfter, so a Queued job's is the one its last ending set.
        let retry_after = job
            .status
            .as_ref()
            .and_then(|s| s.retry_after.as_ref())
            .filter(|_| queued)
            .map(|t| t.0);
        Ended {
            namespace: job.namespace().unwrap_or_default(),
            name: job.name_any(),
            attempt: job.attempt(),
            phase: job.phase().to_string(),
            retry_after,
        }
    }
}

/// `retryAfterSeconds` of a fail body as a number of seconds: a whole number (`30.0` included,
/// as JSON Schema counts it) that fits 32 bits, else 400 `invalid_request` naming the value.
/// Its range (at most [`leasehold_core::fence::MAX_RETRY_AFTER_SECONDS`], retryable failures
/// only) is the worker library's rule, checked by `Worker::fail` for every caller.
fn retry_after_seconds(value: Option<&Value>) -> Result<Option<u32>, ApiError> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    // JSON Schema's integer: 30.0 is one too.
    let whole = value.as_u64().or_else(|| {
        value
            .as_f64()
            .filter(|f| f.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(f))
            .map(|f| f as u64)
    });
    whole
        .and_then(|s| u32::try_from(s).ok())
        .map(Some)
        .ok_or_else(|| {
            let shown: String = value.to_string().chars().take(40).collect();
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("retryAfterSeconds {shown} is not a whole number of seconds (0 or more)"),
            )
        })
}

/// The sidecar's router over `worker`. Every call about a held job is answered within the
/// worker's own bound ([`leasehold_worker::call_bound`]: min(5 s, leaseDurationSeconds / 3)),
/// with 503 `unavailable` and the lease's known `expiresAt` when the API server has not
/// answered by then. `/metrics` serves `metrics` (the registry the worker records into) and
/// `/healthz` and `/readyz` the worker's health.
pub fn router(worker: Worker, metrics: Arc<Metrics>) -> Router {
    let observed = crate::observe::router(metrics, Arc::clone(worker.health()));
    let jobs = Router::new()
        .route("/v1/jobs/{name}/heartbeat", post(heartbeat))
        .route("/v1/jobs/{name}/complete", post(complete))
        .route("/v1/jobs/{name}/fail", post(fail))
        .route("/v1/jobs/{name}/release", post(release));
    Router::new()
        .route(
            OPENAPI_PATH,
            get(|| async { ([(header::CONTENT_TYPE, "application/json")], OPENAPI) }),
        )
        .route("/v1/claim", post(claim))
        .merge(jobs)
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                "no such route; see docs/protocol.md for the sidecar's API",
            )
        })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this route takes POST (GET for /healthz, /readyz, /metrics and /openapi.json)",
            )
        })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(worker)
        .merge(observed)
}

/// The job name of a `/v1/jobs/{name}/...` route, percent-decoded and checked: 400
/// `invalid_name` when it is not valid percent-encoded UTF-8 or not a valid object name.
struct JobName(String);

impl<S: Send + Sync> FromRequestParts<S> for JobName {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(name) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_name",
                    format!("the job name in the URL is not a valid object name: {}; a LeasedJob name is a lowercase RFC 1123 subdomain", e.body_text()),
                )
            })?;
        checked_name(&name)?;
        Ok(JobName(name))
    }
}

/// A request body read in full: 413 `too_large` at once, before any of it is read, when
/// `Content-Length` announces more than [`MAX_BODY_BYTES`] (and as soon as more arrives
/// without one); 408 `body_timeout` when it does not arrive within the server's body timeout
/// ([`crate::http::BodyTimeout`]); 400 `invalid_request` when it cannot be read otherwise.
struct RequestBody(Bytes);

impl<S: Send + Sync> FromRequest<S> for RequestBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let announced = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(length) = announced.filter(|l| *l > MAX_BODY_BYTES as u64) {
            return Err(too_large(&format!("request body of {length} bytes")));
        }
        Bytes::from_request(request, state)
            .await
            .map(RequestBody)
            .map_err(body_error)
    }
}

fn too_large(what: &str) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        format!("{what} is larger than {MAX_BODY_BYTES} bytes: send results and checkpoints of at most that size"),
    );
    e.close = true;
    e
}

fn body_error(e: BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large("request body");
    }
    if let Some(timeout) = crate::http::body_timeout_in(&e) {
        let mut e = ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            format!("{timeout}: send the whole body at once"),
        );
        e.close = true;
        return e;
    }
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        format!("request body could not be read: {e}"),
    )
}

/// Parses a JSON body whatever its Content-Type (curl users forget it), refusing anything
/// else with 400 and a message that says where it broke.
fn parse<T: DeserializeOwned>(RequestBody(body): RequestBody) -> Result<T, ApiError> {
    serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("request body is not the expected JSON object: {e}"),
        )
    })
}

/// Checks a job name taken from the URL: a DNS subdomain (RFC 1123) of at most 253 characters.
fn checked_name(name: &str) -> Result<&str, ApiError> {
    let ok = leasehold_core::crd::is_dns_subdomain(name);
    if ok {
        Ok(name)
    } else {
        let shown: String = name.chars().take(80).collect();
        Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_name",
            format!("job name {shown:?} is not a valid LeasedJob name (a lowercase RFC 1123 subdomain of at most 253 characters)"),
        ))
    }
}

fn required<T>(value: Option<T>, field: &str) -> Result<T, ApiError> {
    value.ok_or_else(|| {
        let (code, text) = if field == "token" {
            (
                "invalid_token",
                "token is missing: present the token your claim returned".to_string(),
            )
        } else {
            ("invalid_request", format!("{field} is missing"))
        };
        ApiError::new(StatusCode::BAD_REQUEST, code, text)
    })
}

async fn claim(
    State(worker): State<Worker>,
    query: Result<Query<ClaimQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("bad query string: {e}; the only parameter is wait=SECONDS"),
        )
    })?;
    let wait = match query.wait.as_deref() {
        None => 0,
        Some(text) => text
            .parse::<u64>()
            .ok()
            .filter(|w| *w <= MAX_WAIT_SECONDS)
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    format!("wait={text:?} is not a whole number of seconds from 0 to {MAX_WAIT_SECONDS}"),
                )
            })?,
    };
    // The claim runs as a task of its own: if the worker goes away (its request timed out,
    // its connection closed) the long poll stops, and a job claimed meanwhile is given back at
    // once instead of staying Leased to nobody until its lease runs out.
    let (tx, rx) = tokio::sync::oneshot::channel();
    let claimer = worker.clone();
    tokio::spawn(async move {
        let mut tx = tx;
        let claimed = claimer
            .claim_until(Duration::from_secs(wait), tx.closed())
            .await;
        if let Err(Ok(Some(claimed))) = tx.send(claimed) {
            claimer.give_back(&claimed).await;
        }
    });
    let claimed = rx.await.map_err(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the claim failed inside the sidecar; try again",
        )
    })?;
    match claimed? {
        Some(claimed) => Ok(Json(claimed).into_response()),
        None => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}

async fn heartbeat(
    State(worker): State<Worker>,
    JobName(name): JobName,
    body: RequestBody,
) -> Result<Response, ApiError> {
    let name = name.as_str();
    let body: HeartbeatBody = parse(body)?;
    let token = required(body.token, "token")?;
    let progress = Progress::from_json(body.progress.as_ref(), body.message.as_ref())
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", e.to_string()))?;
    let renewal = worker
        .heartbeat(name, &token, body.checkpoint, progress)
        .await?;
    Ok(Json(renewal).into_response())
}

async fn complete(
    State(worker): State<Worker>,
    JobName(name): JobName,
    body: RequestBody,
) -> Result<Response, ApiError> {
    let name = name.as_str();
    let body: CompleteBody = parse(body)?;
    let token = required(body.token, "token")?;
    let result = required(body.result, "result")?;
    let job = worker.complete(name, &token, result).await?;
    Ok(Json(Ended::from(job)).into_response())
}

async fn fail(
    State(worker): State<Worker>,
    JobName(name): JobName,
    body: RequestBody,
) -> Result<Response, ApiError> {
    let name = name.as_str();
    let body: FailBody = parse(body)?;
    let token = required(body.token, "token")?;
    let reason = required(body.reason, "reason")?;
    let retryable = required(body.retryable, "retryable")?;
    let message = body.message.unwrap_or_default();
    let retry_after = retry_after_seconds(body.retry_after_seconds.as_ref())?;
    let job = worker
        .fail(name, &token, &reason, &message, retryable, retry_after)
        .await?;
    Ok(Json(Ended::from(job)).into_response())
}

async fn release(
    State(worker): State<Worker>,
    JobName(name): JobName,
    body: RequestBody,
) -> Result<Response, ApiError> {
    let name = name.as_str();
    let body: ReleaseBody = parse(body)?;
    let token = required(body.token, "token")?;
    let job = worker.release(name, &token).await?;
    Ok(Json(Ended::from(job)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_openapi_document_is_json_and_describes_every_route() {
        let doc: Value = serde_json::from_str(OPENAPI).expect("docs/sidecar-openapi.json is JSON");
        assert_eq!(doc["openapi"], "3.1.0");
        for path in [
            "/v1/claim",
            "/v1/jobs/{name}/heartbeat",
            "/v1/jobs/{name}/complete",
            "/v1/jobs/{name}/fail",
            "/v1/jobs/{name}/release",
            "/readyz",
            "/healthz",
            "/metrics",
            OPENAPI_PATH,
        ] {
            assert!(doc["paths"][path].is_object(), "{path} is not described");
        }
        let codes = &doc["components"]["schemas"]["Error"]["properties"]["error"]["enum"];
        for code in ["invalid_json", "too_large", "body_timeout", "shutting_down"] {
            assert!(codes.as_array().unwrap().contains(&json!(code)), "{code}");
        }
        let message = &doc["components"]["schemas"]["HeartbeatRequest"]["properties"]["message"];
        assert_eq!(
            message["maxLength"],
            leasehold_core::progress::MAX_MESSAGE_BYTES
        );
    }

    #[test]
    fn job_names_from_urls_are_checked() {
        for ok in ["a", "job-1", "a.b-c", &"x".repeat(253)] {
            assert!(checked_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "A", "-a", "a-", "a..b", "a_b", &"x".repeat(254), "ü"] {
            let e = checked_name(bad).unwrap_err();
            assert_eq!(e.code, "invalid_name", "{bad}");
        }
    }

    #[test]
    fn bodies_must_be_json_of_the_right_shape() {
        let bad = [
            &b"not json"[..],
            b"[1]",
            b"{\"token\": 5}",
            b"{\"token\":\"t\",\"extra\":1}",
        ];
        for body in bad {
            let e = parse::<ReleaseBody>(RequestBody(Bytes::from_static(body))).unwrap_err();
            assert_eq!(
                (e.status, e.code),
                (StatusCode::BAD_REQUEST, "invalid_json")
            );
        }
        let ok: ReleaseBody = parse(RequestBody(Bytes::from_static(b"{\"token\":\"t\"}"))).unwrap();
        assert_eq!(ok.token.as_deref(), Some("t"));
    }

    #[test]
    fn a_null_result_is_a_result() {
        let null: CompleteBody = parse(RequestBody(Bytes::from_static(
            b"{\"token\":\"t\",\"result\":null}",
        )))
        .unwrap();
        assert_eq!(null.result, Some(Value::Null));
        let absent: CompleteBody =
            parse(RequestBody(Bytes::from_static(b"{\"token\":\"t\"}"))).unwrap();
        assert_eq!(absent.result, None);
    }

    #[test]
    fn a_retry_delay_is_a_whole_number_of_seconds() {
        let max = leasehold_core::fence::MAX_RETRY_AFTER_SECONDS;
        // The range is the worker library's rule (Worker::fail), not the parse's.
        for (value, want) in [
            (json!(0), Some(0)),
            (json!(30), Some(30)),
            (json!(30.0), Some(30)),
            (json!(max), Some(max)),
            (json!(max + 1), Some(max + 1)),
        ] {
            assert_eq!(retry_after_seconds(Some(&value)).unwrap(), want, "{value}");
        }
        assert_eq!(retry_after_seconds(None).unwrap(), None);
        assert_eq!(retry_after_seconds(Some(&Value::Null)).unwrap(), None);
        for bad in [json!(-1), json!(1.5), json!("30"), json!(u64::MAX)] {
            let e = retry_after_seconds(Some(&bad)).unwrap_err();
            assert_eq!(
                (e.status, e.code),
                (StatusCode::BAD_REQUEST, "invalid_request")
            );
            assert!(e.message.contains("retryAfterSeconds"), "{}", e.message);
        }
        let body: FailBody = parse(RequestBody(Bytes::from_static(
            b"{\"token\":\"t\",\"reason\":\"R\",\"retryable\":true,\"retryAfterSeconds\":5}",
        )))
        .unwrap();
        assert_eq!(body.retry_after_seconds, Some(json!(5)));
    }

    #[test]
    fn a_missing_token_is_an_invalid_token() {
        let e = required::<String>(None, "token").unwrap_err();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::BAD_REQUEST, "invalid_token")
        );
        let e = required::<String>(None, "result").unwrap_err();
        assert_eq!(e.code, "invalid_request");
    }
}
