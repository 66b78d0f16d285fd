//! The controller's validating admission webhook: the API server asks it about every create
//! and update of a LeasedJob (spec and status), and it refuses one that would make the job
//! larger than [`MAX_JOB_BYTES`], with a 413 that names the job, its largest field, the sizes
//! and the limit, before anything is stored. It also refuses, with a 422, a create or update of
//! a job that sets `leasehold.dev/traceparent` or `leasehold.dev/tracestate` to a value that
//! breaks the W3C Trace Context rules ([`leasehold_core::trace::check_annotations`]), naming
//! the annotation, the value and the rule: a CRD's validation rules cannot read annotations.
//!
//! Why a webhook: without it, a job too large for etcd is refused by etcd itself, behind the
//! API server, as a 500 (`etcdserver: request is too large`) or a gRPC ResourceExhausted,
//! which names neither the limit nor the field. Neither a CRD's validation rules nor a
//! ValidatingAdmissionPolicy can measure it first: CEL has no function that serialises a
//! value, and `spec.payload` is free-form JSON.
//!
//! The decision is a pure function over the AdmissionReview's JSON ([`review()`]); the HTTP edge
//! ([`router`], served over TLS by [`crate::http::serve_tls`]) only reads the body and writes
//! the answer. The protocol is `admission.k8s.io/v1` AdmissionReview, as described in
//! "Dynamic Admission Control" (kubernetes.io/docs/reference/access-authn-authz/
//! extensible-admission-controllers/). The API server passes a denial's `status.code` through
//! when it is 400 or more (k8s.io/apiserver `pkg/admission/plugin/webhook/errors`,
//! `ToStatusErr`), so the client sees 413 with our message after the API server's prefix
//! `admission webhook "<name>" denied the request: `.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::review::{self, deny, envelope};
pub use crate::review::{ReviewError, MAX_REVIEWS_IN_FLIGHT, MAX_REVIEW_BYTES};
pub use leasehold_core::crd::MAX_JOB_BYTES;
use leasehold_core::trace::{self, BadTraceAnnotation};

/// The path the webhook serves (POST, `Content-Type: application/json`).
pub const PATH: &str = "/validate/leasedjobs";

/// What the webhook decided about one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The request may go on (small enough, or not about a LeasedJob create or update).
    Allowed,
    /// The request would make a job too large.
    TooLarge(TooLarge),
    /// The request sets a trace annotation that breaks the W3C Trace Context rules.
    BadTrace(BadTrace),
}

/// A refused write that sets a malformed trace annotation: which job, and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadTrace {
    /// `<namespace>/<name>` (for a create with `generateName`, the prefix followed by `*`).
    pub job: String,
    /// The annotation, its value and the rule.
    pub refusal: BadTraceAnnotation,
}

impl std::fmt::Display for BadTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LeasedJob {}: {}. Set it from the producer's current span (kubectl leasehold submit --traceparent, leasehold.Producer.submit), or leave it out",
            self.job, self.refusal
        )
    }
}

/// A refused write: which job, how large, and where the bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TooLarge {
    /// `CREATE` or `UPDATE`.
    pub operation: String,
    /// `status` for a write to the status subresource, empty for the main resource.
    pub sub_resource: String,
    /// `<namespace>/<name>` (for a create with `generateName`, the prefix followed by `*`).
    pub job: String,
    /// Bytes of the object as JSON, as the API server sent it.
    pub size: usize,
    /// Bytes of the stored object before an update, when there is one.
    pub old_size: Option<usize>,
    /// The limit, in bytes ([`MAX_JOB_BYTES`] in production).
    pub limit: usize,
    /// The largest field (e.g. `spec.payload`, `status.result`, `metadata.annotations`) and its
    /// size in bytes as JSON; None when the object could not be parsed to look.
    pub largest: Option<(String, usize)>,
}

impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.operation.as_str(), self.sub_resource.as_str()) {
            ("CREATE", _) => write!(f, "LeasedJob {} is", self.job)?,
            (_, "") => write!(f, "this update would make LeasedJob {}", self.job)?,
            (_, sub) => write!(f, "this {sub} update would make LeasedJob {}", self.job)?,
        }
        write!(f, " {} bytes as JSON", self.size)?;
        if let Some(old) = self.old_size {
            write!(f, " (from {old})")?;
        }
        write!(
            f,
            ", over leasehold's limit of {} bytes per LeasedJob",
            self.limit
        )?;
        if self.limit > 0 && self.limit % (1024 * 1024) == 0 {
            write!(f, " ({} MiB)", self.limit / (1024 * 1024))?;
        }
        if let Some((field, size)) = &self.largest {
            write!(f, "; its largest field is {field} at {size} bytes")?;
            if field == "metadata.annotations" {
                write!(f, " (kubectl apply keeps a copy of the whole object there, in kubectl.kubernetes.io/last-applied-configuration: use kubectl create, or kubectl apply --server-side)")?;
            }
        }
        write!(
            f,
            ". Keep large inputs and results out of the job: put them in an object store (or a database) and pass a reference, such as a URL or a key, in spec.payload or status.result"
        )
    }
}

/// The parts of an `admission.k8s.io/v1` AdmissionReview the decision reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AdmissionReview<'a> {
    api_version: String,
    #[serde(borrow)]
    request: Option<AdmissionRequest<'a>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AdmissionRequest<'a> {
    uid: String,
    #[serde(default)]
    resource: GroupVersionResource,
    #[serde(default)]
    sub_resource: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    operation: String,
    #[serde(borrow, default)]
    object: Option<&'a RawValue>,
    #[serde(borrow, default)]
    old_object: Option<&'a RawValue>,
}

#[derive(Debug, Default, Deserialize)]
struct GroupVersionResource {
    #[serde(default)]
    group: String,
    #[serde(default)]
    resource: String,
}

/// The answer to an AdmissionReview: the response's JSON (an AdmissionReview of the request's
/// apiVersion, with the request's uid) and the decision it carries.
#[derive(Debug)]
pub struct Reviewed {
    /// The AdmissionReview to send back.
    pub response: Value,
    /// What was decided.
    pub decision: Decision,
}

/// Decides the AdmissionReview `body` (JSON) against `limit` bytes.
///
/// The rule: a `CREATE` or `UPDATE` of `leasedjobs` (or `leasedjobs/status`, group
/// `leasehold.dev`) whose object, as JSON, is larger than `limit` bytes is refused with code
/// 413, reason `RequestEntityTooLarge`, and a message naming the job, the sizes, the limit,
/// the largest field and where large data belongs ([`TooLarge`]'s Display). Exception: an
/// update that does not make the object larger is allowed, so that a job stored before the
/// limit (etcd took up to about 1.5 MiB) can still be cancelled, finished or deleted; and a
/// write to the status subresource may go [`status_headroom`] past the limit, so that a job
/// created right at the limit can still be initialised, claimed and failed.
/// A create or update of the job itself (not of its status) that sets or changes a trace
/// annotation to a malformed value is refused with code 422, reason `Invalid` ([`BadTrace`]'s
/// Display). Everything else (other resources, `DELETE`, `CONNECT`) is allowed.
///
/// Sizes are the byte lengths of `request.object` and `request.oldObject` exactly as the API
/// server encoded them in the review (compact JSON, the encoding it stores a custom resource
/// in), so the decision costs no re-encoding. Field sizes, for the message only, are measured
/// by re-encoding the parsed object.
///
/// # Errors
/// [`ReviewError`] when `body` is not an AdmissionReview with a request.
pub fn review(body: &[u8], limit: usize) -> Result<Reviewed, ReviewError> {
    let review: AdmissionReview<'_> =
        serde_json::from_slice(body).map_err(ReviewError::NotAReview)?;
    let request = review.request.ok_or(ReviewError::NoRequest)?;
    let decision = decide(&request, limit);
    let mut response = json!({"uid": request.uid, "allowed": true});
    match &decision {
        Decision::TooLarge(refusal) => deny(
            &mut response,
            413,
            "RequestEntityTooLarge",
            refusal.to_string(),
        ),
        Decision::BadTrace(refusal) => deny(&mut response, 422, "Invalid", refusal.to_string()),
        Decision::Allowed => {}
    }
    Ok(Reviewed {
        response: envelope(&review.api_version, response),
        decision,
    })
}

fn decide(request: &AdmissionRequest<'_>, limit: usize) -> Decision {
    let ours = request.resource.group == leasehold_core::crd::GROUP
        && request.resource.resource == "leasedjobs"
        && matches!(request.operation.as_str(), "CREATE" | "UPDATE");
    let Some(object) = request.object.filter(|_| ours) else {
        return Decision::Allowed;
    };
    let limit = if request.sub_resource == "status" {
        limit + status_headroom(limit)
    } else {
        limit
    };
    let size = object.get().len();
    let old_size = request.old_object.map(|o| o.get().len());
    if size <= limit || old_size.is_some_and(|old| size <= old) {
        return trace_annotations(request, object);
    }
    let parsed: Option<Value> = serde_json::from_str(object.get()).ok();
    let job = job_ref(request, parsed.as_ref());
    Decision::TooLarge(TooLarge {
        operation: request.operation.clone(),
        sub_resource: request.sub_resource.clone(),
        job,
        size,
        old_size,
        limit,
        largest: parsed.as_ref().and_then(largest_field),
    })
}

/// The metadata.annotations of an object, all that [`trace_annotations`] reads of it.
#[derive(Default, Deserialize)]
struct Annotated {
    #[serde(default)]
    metadata: AnnotatedMeta,
}

#[derive(Default, Deserialize)]
struct AnnotatedMeta {
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
}

/// A create or update of the job itself (not its status, where the API server ignores
/// metadata) may not set or change a trace annotation to a malformed value
/// ([`leasehold_core::trace::check_annotations`]); one kept as stored is not judged. An
/// object whose metadata cannot be read is left to the API server's own validation.
fn trace_annotations(request: &AdmissionRequest<'_>, object: &RawValue) -> Decision {
    if !request.sub_resource.is_empty() {
        return Decision::Allowed;
    }
    let annotations = |raw: &RawValue| {
        serde_json::from_str::<Annotated>(raw.get())
            .ok()
            .and_then(|a| a.metadata.annotations)
            .unwrap_or_default()
    };
    let new = annotations(object);
    if !new.contains_key(trace::TRACEPARENT_ANNOTATION)
        && !new.contains_key(trace::TRACESTATE_ANNOTATION)
    {
        return Decision::Allowed;
    }
    let old = request.old_object.map(annotations);
    match trace::check_annotations(&new, old.as_ref()) {
        Ok(()) => Decision::Allowed,
        Err(refusal) => {
            let parsed: Option<Value> = serde_json::from_str(object.get()).ok();
            Decision::BadTrace(BadTrace {
                job: job_ref(request, parsed.as_ref()),
                refusal,
            })
        }
    }
}

/// Room a write to the status subresource has beyond the limit: a sixteenth of it (64 KiB of
/// 1 MiB). A job may be created right at the limit; leasehold's own status writes on it (the
/// initial status, a claim, a failure record) must still land, and 1 MiB plus this still
/// leaves etcd's 1.5 MiB room for the metadata around the object. A worker's result or
/// checkpoint that needs more is refused as usual.
pub fn status_headroom(limit: usize) -> usize {
    limit / 16
}

/// `<namespace>/<name>` of the request's object: the request's name, else the object's, else
/// its `generateName` and `*`.
fn job_ref(request: &AdmissionRequest<'_>, object: Option<&Value>) -> String {
    let metadata = object.map(|o| &o["metadata"]);
    let field = |key: &str| {
        metadata
            .and_then(|m| m[key].as_str())
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    };
    let name = Some(request.name.clone())
        .filter(|n| !n.is_empty())
        .or_else(|| field("name"))
        .or_else(|| field("generateName").map(|prefix| format!("{prefix}*")))
        .unwrap_or_else(|| "(unnamed)".to_string());
    let namespace = Some(request.namespace.clone())
        .filter(|n| !n.is_empty())
        .or_else(|| field("namespace"))
        .unwrap_or_default();
    format!("{namespace}/{name}")
}

/// The largest member of the object's top-level objects (`metadata.*`, `spec.*`, `status.*`)
/// or, for a top-level value that is not an object, that value: its dotted path and its size
/// as compact JSON.
fn largest_field(object: &Value) -> Option<(String, usize)> {
    let Value::Object(top) = object else {
        return None;
    };
    let mut candidates = Vec::new();
    for (key, value) in top {
        match value {
            Value::Object(members) => candidates.extend(
                members
                    .iter()
                    .map(|(member, v)| (format!("{key}.{member}"), encoded_len(v))),
            ),
            other => candidates.push((key.clone(), encoded_len(other))),
        }
    }
    candidates.into_iter().max_by_key(|(_, size)| *size)
}

/// Bytes of `value` as compact JSON, counted without building the text.
fn encoded_len(value: &Value) -> usize {
    leasehold_core::json::encoded_len(value).expect("a Value always encodes")
}

/// The size webhook's route, sharing `turns` ([`review::turns`]) with the other webhooks the
/// admission server serves: `POST` [`PATH`] answers an AdmissionReview; anything else is 404
/// (or 405 for another method on [`PATH`]). Serve it with [`crate::http::serve_tls`]: the API
/// server calls webhooks over HTTPS only.
///
/// Answers: 200 with the AdmissionReview; 400 when the body is not one; 408 when it did not
/// arrive within the server's body timeout; 413 over [`MAX_REVIEW_BYTES`]. Refusals are logged
/// at info level with the job and its largest field.
pub fn router(turns: Arc<Semaphore>) -> Router {
    Router::new()
        .route(PATH, post(answer))
        .layer(DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .with_state(turns)
}

async fn answer(State(turns): State<Arc<Semaphore>>, request: Request) -> Response {
    let (_turn, body) = match review::receive(&turns, request).await {
        Ok(received) => received,
        Err(refused) => return refused,
    };
    match review(&body, MAX_JOB_BYTES) {
        Ok(reviewed) => {
            if let Decision::BadTrace(refusal) = &reviewed.decision {
                tracing::info!(job = %refusal.job, annotation = refusal.refusal.annotation, "Refused a write of LeasedJob {}: {}", refusal.job, refusal.refusal);
            }
            if let Decision::TooLarge(refusal) = &reviewed.decision {
                let field = refusal.largest.as_ref().map_or("", |(f, _)| f.as_str());
                let write = match refusal.sub_resource.as_str() {
                    "" => refusal.operation.clone(),
                    sub => format!("{} ({sub})", refusal.operation),
                };
                tracing::info!(job = %refusal.job, size = refusal.size, largest = field, "Refused {write} of LeasedJob {}: {} bytes as JSON, over the limit of {} bytes", refusal.job, refusal.size, refusal.limit);
            }
            axum::Json(reviewed.response).into_response()
        }
        Err(e) => review::unreadable(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: usize = 1000;

    fn job(payload_bytes: usize, result_bytes: usize) -> Value {
        let mut job = json!({
            "apiVersion": "leasehold.dev/v1alpha1",
            "kind": "LeasedJob",
            "metadata": {"name": "big", "namespace": "jobs"},
            "spec": {"queue": "default", "payload": {"data": "x".repeat(payload_bytes)}},
        });
        if result_bytes > 0 {
            job["status"] = json!({"phase": "Succeeded", "result": "r".repeat(result_bytes)});
        }
        job
    }

    fn request(operation: &str, sub: &str, object: Option<&Value>, old: Option<&Value>) -> Value {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "leasehold.dev", "version": "v1alpha1", "kind": "LeasedJob"},
                "resource": {"group": "leasehold.dev", "version": "v1alpha1", "resource": "leasedjobs"},
                "subResource": sub,
                "name": "big",
                "namespace": "jobs",
                "operation": operation,
                "object": object,
                "oldObject": old,
            }
        })
    }

    fn decide_json(review_json: &Value) -> Reviewed {
        review(&serde_json::to_vec(review_json).unwrap(), LIMIT).expect("a review")
    }

    fn size(v: &Value) -> usize {
        serde_json::to_vec(v).unwrap().len()
    }

    #[test]
    fn status_writes_have_headroom_so_a_job_created_at_the_limit_can_still_run() {
        // A job as large as a create may be, then its status grows by less than the headroom.
        let mut at_limit = job(0, 0);
        at_limit["spec"]["payload"] = json!("");
        let pad = LIMIT - size(&at_limit);
        at_limit["spec"]["payload"] = json!("p".repeat(pad));
        assert_eq!(size(&at_limit), LIMIT);
        let out = decide_json(&request("CREATE", "", Some(&at_limit), None));
        assert_eq!(out.decision, Decision::Allowed);
        let mut claimed = at_limit.clone();
        claimed["status"]["phase"] = json!("Leased");
        assert!(size(&claimed) - LIMIT < status_headroom(LIMIT));
        let out = decide_json(&request(
            "UPDATE",
            "status",
            Some(&claimed),
            Some(&at_limit),
        ));
        assert_eq!(out.decision, Decision::Allowed);
        // The same growth through the main resource is refused: the headroom is the status's.
        let out = decide_json(&request("UPDATE", "", Some(&claimed), Some(&at_limit)));
        assert!(matches!(out.decision, Decision::TooLarge(_)));
        // And a status past the headroom is refused, naming the effective limit.
        let mut huge = at_limit.clone();
        huge["status"]["result"] = json!("r".repeat(status_headroom(LIMIT) + 1));
        match decide_json(&request("UPDATE", "status", Some(&huge), Some(&at_limit))).decision {
            Decision::TooLarge(t) => assert_eq!(t.limit, LIMIT + status_headroom(LIMIT)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn writes_are_judged_by_the_size_of_the_whole_object() {
        let small = job(100, 0);
        let big = job(2000, 0);
        let big_result = job(100, 2000);
        // (operation and subresource, object, old object, the largest field when refused)
        type Case<'a> = (&'a str, &'a Value, Option<&'a Value>, Option<&'a str>);
        let cases: [Case; 8] = [
            ("CREATE", &small, None, None),
            ("CREATE", &big, None, Some("spec.payload")),
            ("UPDATE", &big, Some(&small), Some("spec.payload")),
            (
                "UPDATE status",
                &big_result,
                Some(&small),
                Some("status.result"),
            ),
            ("UPDATE status", &small, Some(&small), None),
            // Not growing: a job stored before the limit can still be changed.
            ("UPDATE", &big, Some(&big), None),
            ("UPDATE status", &big, Some(&big_result), None),
            // Not a write the limit is about.
            ("DELETE", &big, None, None),
        ];
        for (write, object, old, field) in cases {
            let (operation, sub) = write.split_once(' ').unwrap_or((write, ""));
            let allowed = field.is_none();
            let out = decide_json(&request(operation, sub, Some(object), old));
            let response = &out.response["response"];
            assert_eq!(response["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
            assert_eq!(out.response["apiVersion"], "admission.k8s.io/v1");
            assert_eq!(out.response["kind"], "AdmissionReview");
            assert_eq!(
                response["allowed"], allowed,
                "{operation} {sub}: {response}"
            );
            if allowed {
                assert_eq!(out.decision, Decision::Allowed);
                assert!(response.get("status").is_none(), "{response}");
                continue;
            }
            let status = &response["status"];
            assert_eq!(status["code"], 413, "{status}");
            assert_eq!(status["reason"], "RequestEntityTooLarge");
            let message = status["message"].as_str().unwrap();
            let field = field.unwrap();
            for part in [
                "LeasedJob jobs/big".to_string(),
                format!("{} bytes", size(object)),
                format!(
                    "limit of {} bytes",
                    if sub == "status" {
                        LIMIT + status_headroom(LIMIT)
                    } else {
                        LIMIT
                    }
                ),
                format!("largest field is {field}"),
                "object store".to_string(),
            ] {
                assert!(message.contains(&part), "{part:?} missing from {message}");
            }
        }
    }

    #[test]
    fn the_message_says_which_write_and_how_large_before_and_after() {
        let (small, big) = (job(100, 0), job(100, 2000));
        let out = decide_json(&request("UPDATE", "status", Some(&big), Some(&small)));
        let Decision::TooLarge(refusal) = out.decision else {
            panic!("allowed")
        };
        assert_eq!(refusal.old_size, Some(size(&small)));
        assert_eq!(refusal.largest, Some(("status.result".into(), 2002)));
        let message = refusal.to_string();
        assert!(
            message.starts_with(&format!(
                "this status update would make LeasedJob jobs/big {} bytes as JSON (from {})",
                size(&big),
                size(&small)
            )),
            "{message}"
        );
        // The production limit is named in MiB too.
        let mut production = refusal.clone();
        production.limit = MAX_JOB_BYTES;
        assert!(production
            .to_string()
            .contains("limit of 1048576 bytes per LeasedJob (1 MiB)"));
    }

    #[test]
    fn kubectl_apply_copies_are_explained() {
        let mut object = job(10, 0);
        object["metadata"]["annotations"] = json!({
            "kubectl.kubernetes.io/last-applied-configuration": "y".repeat(2000)
        });
        let out = decide_json(&request("CREATE", "", Some(&object), None));
        let message = out.response["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            message.contains("largest field is metadata.annotations")
                && message.contains("kubectl apply --server-side"),
            "{message}"
        );
    }

    #[test]
    fn a_generated_name_is_named_by_its_prefix() {
        let mut object = job(2000, 0);
        object["metadata"] = json!({"generateName": "transcode-", "namespace": "jobs"});
        let mut review_json = request("CREATE", "", Some(&object), None);
        review_json["request"]["name"] = json!("");
        let out = decide_json(&review_json);
        let Decision::TooLarge(refusal) = out.decision else {
            panic!("allowed")
        };
        assert_eq!(refusal.job, "jobs/transcode-*");
    }

    #[test]
    fn a_malformed_trace_annotation_is_refused_when_set_not_when_kept() {
        const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let annotated = |value: &str| {
            let mut j = job(10, 0);
            j["metadata"]["annotations"] = json!({"leasehold.dev/traceparent": value});
            j
        };
        let good = annotated(VALID);
        let bad = annotated("00-not-a-trace");
        let out = decide_json(&request("CREATE", "", Some(&good), None));
        assert_eq!(out.decision, Decision::Allowed);
        let out = decide_json(&request("CREATE", "", Some(&bad), None));
        let Decision::BadTrace(refusal) = &out.decision else {
            panic!("{:?}", out.decision)
        };
        assert_eq!(refusal.job, "jobs/big");
        let status = &out.response["response"]["status"];
        assert_eq!(out.response["response"]["allowed"], false);
        assert_eq!(
            (status["code"].as_u64(), status["reason"].as_str()),
            (Some(422), Some("Invalid"))
        );
        let message = status["message"].as_str().unwrap();
        for part in [
            "LeasedJob jobs/big",
            "annotation leasehold.dev/traceparent",
            "\"00-not-a-trace\"",
            "section 3.2",
        ] {
            assert!(message.contains(part), "{part}: {message}");
        }
        // An update that keeps it (a cancel, a retry) goes on; one that sets it is judged;
        // a status write is not judged (the API server ignores metadata there).
        let out = decide_json(&request("UPDATE", "", Some(&bad), Some(&bad)));
        assert_eq!(out.decision, Decision::Allowed);
        let out = decide_json(&request("UPDATE", "", Some(&bad), Some(&good)));
        assert!(matches!(out.decision, Decision::BadTrace(_)));
        let out = decide_json(&request("UPDATE", "status", Some(&bad), Some(&good)));
        assert_eq!(out.decision, Decision::Allowed);
        // Too large and malformed: the size is what is refused.
        let mut both = annotated("00-not-a-trace");
        both["spec"]["payload"] = json!("x".repeat(LIMIT));
        let out = decide_json(&request("CREATE", "", Some(&both), None));
        assert!(matches!(out.decision, Decision::TooLarge(_)));
    }

    #[test]
    fn other_resources_and_objectless_requests_are_allowed() {
        let big = job(2000, 0);
        let mut other = request("CREATE", "", Some(&big), None);
        other["request"]["resource"] =
            json!({"group": "", "version": "v1", "resource": "configmaps"});
        assert_eq!(decide_json(&other).decision, Decision::Allowed);
        let none = request("CREATE", "", None, None);
        assert_eq!(decide_json(&none).decision, Decision::Allowed);
    }

    #[test]
    fn a_body_that_is_not_a_review_is_an_error() {
        assert!(matches!(
            review(b"{\"not\": \"json", LIMIT),
            Err(ReviewError::NotAReview(_))
        ));
        assert!(matches!(
            review(
                br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}"#,
                LIMIT
            ),
            Err(ReviewError::NoRequest)
        ));
    }

    #[test]
    fn sizes_are_the_bytes_the_api_server_sent() {
        // Whitespace inside the object counts as sent: the API server sends compact JSON, so
        // this only shows that the measure is the raw text, not a re-encoding.
        let body = format!(
            r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"u","resource":{{"group":"leasehold.dev","resource":"leasedjobs"}},"operation":"CREATE","namespace":"jobs","name":"w","object":{{"metadata":{{"name":"w"}},"spec":{{"payload":"{}"}}}}}}}}"#,
            "p".repeat(LIMIT - 60)
        );
        let out = review(body.as_bytes(), LIMIT).unwrap();
        assert_eq!(out.decision, Decision::Allowed, "{}", out.response);
        let padded = body.replace(
            "\"spec\":",
            "\"spec\":                                                  ",
        );
        let out = review(padded.as_bytes(), LIMIT).unwrap();
        assert!(matches!(out.decision, Decision::TooLarge(_)));
    }
}
