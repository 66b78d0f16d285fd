//! What the controller's admission webhooks share: reading an `admission.k8s.io/v1`
//! AdmissionReview from a request with bounded memory and time, and writing the answer
//! ("Dynamic Admission Control", kubernetes.io). The decisions are the webhooks' own:
//! [`crate::admission`] (job size) and [`crate::inject`] (sidecar injection).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use leasehold_core::Category;
use serde_json::{json, Value};
use thiserror::Error;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Largest AdmissionReview read, in bytes: 8 MiB. A review carries the new object and, for an
/// update, the old one. The API server refuses request bodies over 3 MiB itself, and the old
/// object is one etcd accepted (at most about 1.5 MiB), so every review about a create, an
/// update or a merge patch fits with room to spare. A larger review (a JSON Patch that copies
/// large values many times over) is answered 413 without a decision, which the API server
/// treats as a failed call (`failurePolicy`).
pub const MAX_REVIEW_BYTES: usize = 8 * 1024 * 1024;

/// Reviews read and decided at once; further requests wait for a turn before their body is
/// read. Bounds the webhook's memory to this many times [`MAX_REVIEW_BYTES`] (plus the parsed
/// object of a refused one), whoever connects; a decision takes milliseconds.
pub const MAX_REVIEWS_IN_FLIGHT: usize = 8;

/// Why an AdmissionReview could not be answered (the HTTP answer is then 400, which the API
/// server treats as a failed call: see `failurePolicy`).
#[derive(Debug, Error)]
pub enum ReviewError {
    /// The body is not an AdmissionReview.
    #[error("the body is not an admission.k8s.io/v1 AdmissionReview with a request")]
    NotAReview(#[source] serde_json::Error),
    /// The AdmissionReview has no `request`.
    #[error("the AdmissionReview has no request to answer")]
    NoRequest,
}

impl Category for ReviewError {
    /// Stable category, for logs.
    fn category(&self) -> &'static str {
        match self {
            ReviewError::NotAReview(_) | ReviewError::NoRequest => "invalid_review",
        }
    }
}

/// The turns of one admission server: [`MAX_REVIEWS_IN_FLIGHT`] reviews read and decided at
/// once, shared by every webhook it serves, so the bound holds for the server as a whole.
pub fn turns() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(MAX_REVIEWS_IN_FLIGHT))
}

/// Waits for a turn, then reads the request's body (at most [`MAX_REVIEW_BYTES`], within the server's body timeout); the turn is held until
/// the returned permit is dropped, after the answer is decided.
///
/// # Errors
/// The answer to send instead (413, 408 or 400).
pub async fn receive(
    turns: &Arc<Semaphore>,
    request: Request,
) -> Result<(OwnedSemaphorePermit, Bytes), Response> {
    let turn = Arc::clone(turns)
        .acquire_owned()
        .await
        .expect("the semaphore is never closed");
    Ok((turn, read_body(request).await?))
}

/// Reads an AdmissionReview's body: at most [`MAX_REVIEW_BYTES`] (413 otherwise, refused
/// before reading when the announced length is larger), within the server's body timeout
/// (408), else 400.
async fn read_body(request: Request) -> Result<Bytes, Response> {
    let announced = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|l| l > MAX_REVIEW_BYTES as u64) {
        return Err(too_large_review());
    }
    match Bytes::from_request(request, &()).await {
        Ok(body) => Ok(body),
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(too_large_review()),
        Err(e) => {
            let status = if crate::http::body_timeout_in(&e).is_some() {
                StatusCode::REQUEST_TIMEOUT
            } else {
                StatusCode::BAD_REQUEST
            };
            Err((
                status,
                format!("the AdmissionReview could not be read: {e}"),
            )
                .into_response())
        }
    }
}

/// The 400 for a body that is not an AdmissionReview, logged.
pub fn unreadable(e: &ReviewError) -> Response {
    tracing::warn!(category = e.category(), error = %leasehold_kube::api::error_chain(e), "Answered an unreadable AdmissionReview with 400");
    (StatusCode::BAD_REQUEST, e.to_string()).into_response()
}

fn too_large_review() -> Response {
    let mut response = (
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the AdmissionReview is larger than {MAX_REVIEW_BYTES} bytes"),
    )
        .into_response();
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

/// Marks an AdmissionReview `response` as a denial with HTTP `code`, `reason` and `message`
/// (the API server passes a code of 400 or more through to the client).
pub fn deny(response: &mut Value, code: u16, reason: &str, message: String) {
    response["allowed"] = json!(false);
    response["status"] = json!({
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    });
}

/// The AdmissionReview to send back: `response` in an AdmissionReview of `api_version`.
pub fn envelope(api_version: &str, response: Value) -> Value {
    json!({
        "apiVersion": api_version,
        "kind": "AdmissionReview",
        "response": response,
    })
}
