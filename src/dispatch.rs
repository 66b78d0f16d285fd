//! The dispatcher's HTTP edge, served by the controller: a sidecar's long poll for a job of
//! its queue, and its word that it could not claim one it was offered.
//!
//! Routes (JSON; every caller presents a bearer token, checked by
//! [`leasehold_kube::access::Access`] for the right to claim in the namespace asked about):
//! - `POST /v1/dispatch/poll` `{namespace, queue, worker, waitMs, keepAliveMs?, ownSlots?}`
//!   -> 200 `{name, resourceVersion, queueSlot?, keySlot?, ownQueueSlot?, ownKeySlot?}` (the
//!   slots: in a queue with limits, the index of the slot of each limited scope to try first,
//!   advice as the rest; `own...: true` when it is one of the caller's `ownSlots`, its own free
//!   slots `[{key?, index}]`, for it to swap: docs/protocol.md, "Limits"), or 204 when no job
//!   came within the wait. With `keepAliveMs`
//!   (50 to 10,000), an answer that is not ready at once is 200 with a streamed body: a
//!   newline every `keepAliveMs` while the caller is admitted and the poll waits, then one
//!   JSON object, the offer as above, `{}` (no job within the wait) or an error object
//!   as below (a refusal of the caller too). The
//!   newlines let a sidecar tell a waiting dispatcher from a frozen one, or a stalled path,
//!   within a bound, without asking again and again;
//! - `POST /v1/dispatch/declined` `{namespace, queue, worker, name}` -> 204: ends the offer
//!   of `name` if it stands for this `worker` of this caller (the user and, for a token bound
//!   to a pod, the pod that the TokenReview names: [`Caller`]); a decline by anyone else
//!   changes nothing, and is answered 204 all the same.
//!
//! Errors are `{"error": "<code>", "message": "..."}`: 400 `invalid_request`; 413
//! `too_large` (a body over [`MAX_BODY_BYTES`]); 401
//! `unauthenticated`; 403 `forbidden`; 503 `not_leading` (ask the leader, or choose on your
//! own), `not_listed` (the leader has just started and is still listing the jobs: choose on
//! your own), `view_stale` (the leader could not reach the API server lately, so its view may
//! miss new jobs: choose on your own), `unavailable` (a review could not be made). A refusal names the rule and the caller,
//! never a job.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRequest, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use leasehold_controller::dispatch::{Answer, Dispatcher};
use leasehold_core::crd::is_dns_label;
use leasehold_core::dispatch::{Hint, OwnSlot, QueueKey};
use leasehold_kube::access::{Access, Caller, Refusal};

/// Largest request body accepted, in bytes: a poll is a few hundred, or up to about 13,000
/// with 16 `ownSlots` of the longest keys.
pub const MAX_BODY_BYTES: usize = 16_384;

/// What the routes share.
#[derive(Clone)]
pub struct Shared {
    /// The replica's dispatcher.
    pub dispatcher: Arc<Dispatcher>,
    /// The reviews of callers.
    pub access: Arc<Access>,
}

/// The dispatcher's routes.
pub fn router(shared: Shared) -> Router {
    Router::new()
        .route("/v1/dispatch/poll", post(poll))
        .route("/v1/dispatch/declined", post(declined))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PollBody {
    namespace: String,
    queue: String,
    worker: String,
    wait_ms: u64,
    #[serde(default)]
    keep_alive_ms: Option<u64>,
    /// Free slots the worker took itself and may swap (advice: [`OwnSlot`]).
    #[serde(default)]
    own_slots: Vec<OwnSlotBody>,
}

/// One of a poll's `ownSlots`: `{"key": <concurrencyKey>, "index": <n>}`, or `{"index": <n>}`
/// for the queue's own limit.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct OwnSlotBody {
    #[serde(default)]
    key: Option<String>,
    index: u32,
}

/// The most `ownSlots` a poll may name (a sidecar names its newest 16): 16 of the longest keys,
/// escaped, still fit in [`MAX_BODY_BYTES`].
pub const MAX_OWN_SLOTS: usize = 16;

/// Checks a poll's `ownSlots`: at most [`MAX_OWN_SLOTS`], each key 1 to 128 characters (as
/// `spec.concurrencyKey`) and each index below 1000 (the largest limit). The error names the
/// entry, the value and the rule.
fn own_slots(body: &[OwnSlotBody]) -> Result<Vec<OwnSlot>, String> {
    if body.len() > MAX_OWN_SLOTS {
        return Err(format!(
            "ownSlots has {} entries: at most {MAX_OWN_SLOTS}",
            body.len()
        ));
    }
    let most = leasehold_core::slots::MAX_LIMIT.unsigned_abs();
    body.iter()
        .enumerate()
        .map(|(i, s)| {
            if let Some(key) = &s.key {
                let n = key.chars().count();
                if !(1..=128).contains(&n) {
                    return Err(format!(
                        "ownSlots[{i}].key has {n} characters: a concurrencyKey has 1 to 128"
                    ));
                }
            }
            if s.index >= most {
                return Err(format!(
                    "ownSlots[{i}].index {}: must be below {most} (the largest limit)",
                    s.index
                ));
            }
            Ok(OwnSlot {
                key: s.key.clone(),
                index: s.index,
            })
        })
        .collect()
}

/// Bounds of a poll's `keepAliveMs`, in ms.
pub const KEEP_ALIVE_MS: std::ops::RangeInclusive<u64> = 50..=10_000;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DeclinedBody {
    namespace: String,
    queue: String,
    worker: String,
    name: String,
}

impl DeclinedBody {
    fn queue(&self) -> (&str, &str) {
        (&self.namespace, &self.queue)
    }
}

fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": code, "message": message.into()})),
    )
        .into_response()
}

/// Reads a JSON body, refusing a bad one with a message naming the field and the rule.
async fn body<T: serde::de::DeserializeOwned>(request: Request) -> Result<T, Response> {
    let bytes = axum::body::Bytes::from_request(request, &())
        .await
        .map_err(|e| {
            let code = if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                "too_large"
            } else {
                "invalid_request"
            };
            error(
                e.status(),
                code,
                format!("{} (at most {MAX_BODY_BYTES} bytes)", e.body_text()),
            )
        })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("the body is not the expected JSON object: {e}"),
        )
    })
}

/// A refusal: its status code (when it is a response of its own), code and message.
struct Refused {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl Refused {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Refused {
        Refused {
            status,
            code,
            message: message.into(),
        }
    }

    fn response(self) -> Response {
        error(self.status, self.code, self.message)
    }

    fn json(&self) -> serde_json::Value {
        json!({"error": self.code, "message": self.message})
    }
}

/// Checks a namespace and queue name, and the caller's right to claim in the namespace: the
/// queue, and who the caller is.
async fn admit(
    shared: &Shared,
    token: Option<String>,
    namespace: &str,
    queue: &str,
) -> Result<(QueueKey, Caller), Refused> {
    if !is_dns_label(namespace) {
        return Err(Refused::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("namespace {namespace:?} is not a namespace name: a lowercase RFC 1123 label of at most 63 characters"),
        ));
    }
    if !is_dns_label(queue) {
        return Err(Refused::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("queue {queue:?} is not a queue name: a lowercase RFC 1123 label of at most 63 characters, as spec.queue"),
        ));
    }
    match shared.access.check(token.as_deref(), namespace).await {
        Ok(Ok(caller)) => Ok((
            QueueKey {
                namespace: namespace.to_string(),
                queue: queue.to_string(),
            },
            caller,
        )),
        Ok(Err(refusal @ (Refusal::NoToken | Refusal::NotAuthenticated))) => Err(Refused::new(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            refusal.to_string(),
        )),
        Ok(Err(refusal @ Refusal::NotAllowed { .. })) => Err(Refused::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            refusal.to_string(),
        )),
        Err(failed) => Err(Refused::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            format!("{failed}: the caller's rights could not be checked"),
        )),
    }
}

fn bearer(request: &Request) -> Option<String> {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    value.strip_prefix("Bearer ").map(|t| t.trim().to_string())
}

/// Reads a request's body and admits its caller for the queue the body names (`queue_of`):
/// the body, the queue and the caller, or the refusal to answer.
async fn admitted<T: serde::de::DeserializeOwned>(
    shared: &Shared,
    request: Request,
    queue_of: fn(&T) -> (&str, &str),
) -> Result<(T, QueueKey, Caller), Response> {
    let token = bearer(&request);
    let body: T = body(request).await?;
    let (namespace, queue) = queue_of(&body);
    let (queue, caller) = admit(shared, token, namespace, queue)
        .await
        .map_err(Refused::response)?;
    Ok((body, queue, caller))
}

async fn poll(State(shared): State<Shared>, request: Request) -> Response {
    let token = bearer(&request);
    let body: PollBody = match body(request).await {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let wait = Duration::from_millis(body.wait_ms);
    let keep_alive = match body.keep_alive_ms {
        None => None,
        Some(ms) if KEEP_ALIVE_MS.contains(&ms) => Some(Duration::from_millis(ms)),
        Some(ms) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!(
                    "keepAliveMs {ms}: must be from {} to {} (ms)",
                    KEEP_ALIVE_MS.start(),
                    KEEP_ALIVE_MS.end()
                ),
            )
        }
    };
    let own = match own_slots(&body.own_slots) {
        Ok(own) => own,
        Err(message) => return error(StatusCode::BAD_REQUEST, "invalid_request", message),
    };
    // The admission is part of the answer: with keep-alives it may take its time (a review
    // of a token whose cached answer lapsed, on a busy API server) without the caller taking
    // the silence for a frozen dispatcher.
    let mut answer = Box::pin(async move {
        let (queue, caller) = admit(&shared, token, &body.namespace, &body.queue).await?;
        // The offer stands for this caller's worker: only the same caller can decline it.
        let worker = caller.worker(&body.worker);
        match shared.dispatcher.poll(&queue, &worker, wait, &own).await {
            Answer::Offer(hint) => Ok(Some(hint)),
            Answer::Empty => Ok(None),
            Answer::NotLeading => Err(Refused::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "not_leading",
                "this controller replica does not lead: it offers no jobs",
            )),
            Answer::NotListed => Err(Refused::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "not_listed",
                "this controller has not listed the jobs yet since it started: it offers none until it has",
            )),
            Answer::Stale => Err(Refused::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "view_stale",
                "this controller could not reach the API server lately: its view of the jobs may be stale, so it offers none until it can",
            )),
        }
    });
    let Some(every) = keep_alive else {
        return answered(answer.await);
    };
    // An answer ready at once (an offer, or a refusal) keeps its status code.
    if let Some(ready) = futures::FutureExt::now_or_never(&mut answer) {
        return answered(ready);
    }
    let tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    let stream = futures::stream::unfold(Some((answer, tick)), |state| async move {
        let (mut answer, mut tick) = state?;
        tokio::select! {
            ready = &mut answer => Some((final_line(ready), None)),
            _ = tick.tick() => Some((axum::body::Bytes::from_static(b"\n"), Some((answer, tick)))),
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(futures::StreamExt::map(
            stream,
            Ok::<_, std::convert::Infallible>,
        )),
    )
        .into_response()
}

/// A poll's answer, as its own response: 200 with the job, 204 for none, or the refusal.
fn answered(answer: Result<Option<Hint>, Refused>) -> Response {
    match answer {
        Ok(Some(hint)) => (StatusCode::OK, Json(offer(&hint))).into_response(),
        Ok(None) => StatusCode::NO_CONTENT.into_response(),
        Err(refused) => refused.response(),
    }
}

/// A poll's answer, as the last line of a streamed body.
fn final_line(answer: Result<Option<Hint>, Refused>) -> axum::body::Bytes {
    let value = match answer {
        Ok(Some(hint)) => offer(&hint),
        Ok(None) => json!({}),
        Err(refused) => refused.json(),
    };
    axum::body::Bytes::from(value.to_string())
}

fn offer(hint: &Hint) -> serde_json::Value {
    let mut answer = json!({"name": hint.name, "resourceVersion": hint.resource_version});
    for (field, slot) in [("queueSlot", hint.slots.queue), ("keySlot", hint.slots.key)] {
        if let Some(slot) = slot {
            answer[field] = json!(slot);
        }
    }
    // The asker's own free slot, suggested for it to swap.
    for (field, swap) in [
        ("ownQueueSlot", hint.swaps.queue),
        ("ownKeySlot", hint.swaps.key),
    ] {
        if swap.is_some() {
            answer[field] = json!(true);
        }
    }
    answer
}

async fn declined(State(shared): State<Shared>, request: Request) -> Response {
    let (body, queue, caller) = match admitted(&shared, request, DeclinedBody::queue).await {
        Ok(admitted) => admitted,
        Err(refused) => return refused,
    };
    // Ends the offer only if it stands for this caller's worker of that name: a caller with
    // other credentials (another ServiceAccount, or a token bound to another pod) cannot end
    // it, whatever `worker` it gives. The answer is 204 either way, so it tells nothing of
    // others' offers.
    shared
        .dispatcher
        .declined(&queue, &body.name, &caller.worker(&body.worker));
    StatusCode::NO_CONTENT.into_response()
}
