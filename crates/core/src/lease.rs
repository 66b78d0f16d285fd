//! The per-job `coordination.k8s.io/v1` Lease: its name, and the writes made to it — acquire
//! (create or take over), renew (the heartbeat, optionally with a checkpoint) and release (the
//! controller's, for an attempt it ended itself: expiry or cancel; and the sidecar's, for a
//! Lease its first renewal wrote after the attempt ended).
//!
//! Field meanings follow client-go's leader election (`tools/leaderelection/resourcelock`):
//! `holderIdentity` is the current fencing token, `acquireTime` the attempt's first renewal
//! (the sidecar writes the Lease then, not at the claim), `renewTime` the
//! last heartbeat, `leaseDurationSeconds` the job's, and `leaseTransitions` counts owners.
//!
//! Every write is conditional. Acquire replaces the Lease under the resourceVersion it read, and
//! never takes a Lease from a holder of a newer attempt. Renew and release are JSON Patches whose
//! first operation `test`s that holderIdentity is still the caller's token, so the API server
//! applies them atomically or not at all: a renewal never re-creates or re-takes a Lease that
//! expired or went to someone else.
//!
//! A Lease proves a holder only together with its job: the job's status is the authority, and a
//! Lease whose holderIdentity is not the token of a job Leased with it is stale and free to take
//! over. The holder leaves its Lease as it is after ending its attempt, so a Lease normally
//! keeps naming the last attempt's token until the next claim takes it over or garbage
//! collection deletes it with the job (docs/protocol.md, "What fences what").

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::{Resource, ResourceExt};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::crd::{LeasedJob, MANAGED_BY, MANAGED_BY_LABEL};
use crate::progress::{Progress, MESSAGE_ANNOTATION, PROGRESS_ANNOTATION};
use crate::token::Token;

/// Annotation on the Lease that holds the latest checkpoint, as JSON text.
pub const CHECKPOINT_ANNOTATION: &str = "leasehold.dev/checkpoint";
/// Annotation on the Lease naming its LeasedJob (the full name, which a label could not hold).
pub const JOB_ANNOTATION: &str = "leasehold.dev/job";
/// Annotation on the Lease naming the pod that acquired it (the claim's status.holder). It lets
/// the API server's admission policy, which cannot read the LeasedJob while judging a Lease
/// write, tell the holder's renewals from anyone else's: only the pod named here may renew or
/// release the Lease (see docs/security.md). The controller counts a renewal only when this
/// names the job's holder.
pub const HOLDER_ANNOTATION: &str = "leasehold.dev/holder";
/// Largest checkpoint accepted, in bytes of JSON text. Annotations of one object may hold
/// 256 KiB in all (Kubernetes' `TotalAnnotationSizeLimitB`); a checkpoint is meant to be small.
pub const MAX_CHECKPOINT_BYTES: usize = 64 * 1024;

const PREFIX: &str = "ljob-";
/// Longest object name Kubernetes accepts (a DNS subdomain, RFC 1123).
const MAX_NAME: usize = 253;
const HASH_HEX: usize = 16;

/// The name of a job's Lease: `ljob-<job name>`, or, when that would pass the 253 characters an
/// object name may have, `ljob--`, the job name cut short, then `-` and 16 hex digits of the
/// SHA-256 of the whole job name (so that two long names sharing a prefix still get distinct
/// Leases). The result is always a valid DNS subdomain when the job name is one.
///
/// Injective over job names (up to the 64-bit hash): a job name starts with a letter or digit,
/// so a plain name never has `-` right after the prefix, and a shortened one always has; no
/// job's plain name can therefore equal another's shortened one.
pub fn lease_name(job_name: &str) -> String {
    let plain = format!("{PREFIX}{job_name}");
    if plain.len() <= MAX_NAME {
        return plain;
    }
    let digest = Sha256::digest(job_name.as_bytes());
    let hash: String = digest
        .iter()
        .take(HASH_HEX / 2)
        .map(|b| format!("{b:02x}"))
        .collect();
    let keep = MAX_NAME - PREFIX.len() - 2 - HASH_HEX;
    // Names are ASCII (DNS subdomains), so byte slicing is safe; trim so each dot-separated
    // label still ends with an alphanumeric character.
    let cut = job_name[..keep].trim_end_matches(['-', '.']);
    format!("{PREFIX}-{cut}-{hash}")
}

/// `renewTime` (or `acquireTime`) as the API server stores it.
pub fn micro_time(now: Timestamp) -> MicroTime {
    MicroTime(now)
}

/// The holderIdentity of a Lease, if any.
pub fn holder_identity(lease: &Lease) -> Option<&str> {
    lease.spec.as_ref()?.holder_identity.as_deref()
}

/// The pod named by the Lease's [`HOLDER_ANNOTATION`], if any.
pub fn holder_pod(lease: &Lease) -> Option<&str> {
    lease
        .annotations()
        .get(HOLDER_ANNOTATION)
        .map(String::as_str)
}

/// True when `lease` carries the heartbeats of the attempt with `token` held by `holder`: its
/// holderIdentity is the token and its [`HOLDER_ANNOTATION`] (when present: Leases written
/// before it existed have none) names the holder. Renewals of any other Lease say nothing
/// about the attempt.
pub fn names_attempt(lease: &Lease, token: &str, holder: Option<&str>) -> bool {
    holder_identity(lease) == Some(token) && holder_pod(lease).is_none_or(|pod| Some(pod) == holder)
}

/// A checkpoint larger than [`MAX_CHECKPOINT_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("checkpoint is {size} bytes of JSON; at most {MAX_CHECKPOINT_BYTES} are accepted")]
pub struct CheckpointTooLarge {
    /// Size of the checkpoint's JSON text, in bytes.
    pub size: usize,
}

/// The checkpoint stored on a Lease, if it has a valid one.
pub fn checkpoint(lease: &Lease) -> Option<Value> {
    let text = lease.annotations().get(CHECKPOINT_ANNOTATION)?;
    serde_json::from_str(text).ok()
}

/// The checkpoint as annotation text.
///
/// # Errors
/// [`CheckpointTooLarge`] past [`MAX_CHECKPOINT_BYTES`].
pub fn checkpoint_text(checkpoint: &Value) -> Result<String, CheckpointTooLarge> {
    let text = checkpoint.to_string();
    if text.len() > MAX_CHECKPOINT_BYTES {
        return Err(CheckpointTooLarge { size: text.len() });
    }
    Ok(text)
}

/// Whose a Lease is, for the job about to use it, from the Lease's ownerReferences: the only
/// proof that survives a name collision, a re-created job of the same name, or another
/// application choosing the same name. (Labels and the name prove nothing: anyone can set them.)
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ownership {
    /// Owned by this very LeasedJob (same uid).
    Ours,
    /// Owned by an earlier LeasedJob of the same name (another uid), which no longer exists
    /// since names are unique: garbage collection deletes it soon.
    Stale {
        /// The earlier owner's uid.
        uid: String,
    },
    /// Anything else: another application's Lease, or one with no LeasedJob owner.
    Foreign,
}

/// The owner references of `lease` that name a LeasedJob (kind `LeasedJob`, group
/// `leasehold.dev`): the jobs it may carry the heartbeats of.
pub fn job_owners(
    lease: &Lease,
) -> impl Iterator<Item = &k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference> {
    lease
        .metadata
        .owner_references
        .as_deref()
        .unwrap_or_default()
        .iter()
        .filter(|o| o.kind == "LeasedJob" && o.api_version.starts_with("leasehold.dev/"))
}

/// Judges whose `lease` is for `job` (see [`Ownership`]).
pub fn ownership(lease: &Lease, job: &LeasedJob) -> Ownership {
    let uid = job.metadata.uid.as_deref();
    let leased_jobs = job_owners(lease);
    let mut stale = None;
    for o in leased_jobs {
        if Some(o.uid.as_str()) == uid {
            return Ownership::Ours;
        }
        if Some(o.name.as_str()) == job.metadata.name.as_deref() {
            stale = Some(o.uid.clone());
        }
    }
    match stale {
        Some(uid) => Ownership::Stale { uid },
        None => Ownership::Foreign,
    }
}

/// Whether a holder with `ours` may take over a Lease now held by `current`: yes when it is
/// free or held by an older attempt (released, or left naming an attempt that ended: the usual
/// case, since a holder does not release the Lease of an attempt it ended); never from the same
/// or a newer attempt (that would let a delayed claimer steal the Lease of the owner that
/// replaced it).
pub fn may_take_over(current: Option<&str>, ours: &Token) -> bool {
    match current.map(Token::parse) {
        None => true,
        Some(Ok(held)) => held == *ours || held.attempt() < ours.attempt(),
        // Not one of our tokens (edited by hand): the job's claim is the authority.
        Some(Err(_)) => true,
    }
}

/// The Lease object for a fresh claim of `job` with `token`: holderIdentity is the token,
/// leaseDurationSeconds the one its claim recorded ([`LeasedJob::policy`]), acquireTime and
/// renewTime are `now`, leaseTransitions is `transitions`,
/// [`HOLDER_ANNOTATION`] is the claim's holder (status.holder), and the job owns it (so it is
/// garbage-collected with the job).
pub fn lease_for_claim(
    job: &LeasedJob,
    token: &Token,
    now: Timestamp,
    transitions: i32,
    previous: Option<&Lease>,
) -> Lease {
    let name = lease_name(&job.name_any());
    let mut meta = previous
        .map(|l| l.metadata.clone())
        .unwrap_or_else(|| ObjectMeta {
            name: Some(name),
            namespace: job.namespace(),
            ..ObjectMeta::default()
        });
    meta.owner_references = job.controller_owner_ref(&()).map(|o| vec![o]);
    meta.labels
        .get_or_insert_with(Default::default)
        .insert(MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string());
    let annotations = meta.annotations.get_or_insert_with(Default::default);
    annotations.insert(JOB_ANNOTATION.to_string(), job.name_any());
    annotations.remove(CHECKPOINT_ANNOTATION);
    // A new attempt starts with no progress shown.
    annotations.remove(PROGRESS_ANNOTATION);
    annotations.remove(MESSAGE_ANNOTATION);
    match job.status.as_ref().and_then(|s| s.holder.clone()) {
        Some(holder) => annotations.insert(HOLDER_ANNOTATION.to_string(), holder),
        None => annotations.remove(HOLDER_ANNOTATION),
    };
    Lease {
        metadata: meta,
        spec: Some(LeaseSpec {
            holder_identity: Some(token.as_str().to_string()),
            lease_duration_seconds: Some(job.policy().lease_duration_seconds),
            acquire_time: Some(micro_time(now)),
            renew_time: Some(micro_time(now)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }),
    }
}

/// The JSON Patch of a renewal: test holderIdentity, set renewTime, store the checkpoint if
/// one is given (text from [`checkpoint_text`]) and the parts of `progress` that are given
/// ([`Progress::annotations`]; a job's progress: the leader Lease carries none). One request,
/// whatever it carries.
pub fn renew_patch(
    token: &Token,
    now: Timestamp,
    checkpoint: Option<&str>,
    progress: Option<&Progress>,
) -> json_patch::Patch {
    let mut ops = vec![
        json!({"op": "test", "path": "/spec/holderIdentity", "value": token.as_str()}),
        json!({"op": "add", "path": "/spec/renewTime", "value": micro_time(now)}),
    ];
    if let Some(text) = checkpoint {
        ops.push(json!({
            "op": "add",
            "path": format!("/metadata/annotations/{}", escape_pointer(CHECKPOINT_ANNOTATION)),
            "value": text,
        }));
    }
    for (name, text) in progress.map(Progress::annotations).unwrap_or_default() {
        ops.push(json!({
            "op": "add",
            "path": format!("/metadata/annotations/{}", escape_pointer(name)),
            "value": text,
        }));
    }
    serde_json::from_value(Value::Array(ops)).expect("static JSON Patch shape")
}

/// The JSON Patch of a release: test holderIdentity, then clear it.
pub fn release_patch(holder: &str) -> json_patch::Patch {
    serde_json::from_value(json!([
        {"op": "test", "path": "/spec/holderIdentity", "value": holder},
        {"op": "remove", "path": "/spec/holderIdentity"},
    ]))
    .expect("static JSON Patch shape")
}

/// Escapes a JSON Pointer segment (RFC 6901: `~` -> `~0`, `/` -> `~1`).
pub fn escape_pointer(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::is_dns_subdomain;

    #[test]
    fn short_names_are_prefixed() {
        assert_eq!(lease_name("transcode-42"), "ljob-transcode-42");
    }

    #[test]
    fn long_names_stay_valid_and_unique() {
        let a = format!("{}a", "x".repeat(252));
        let b = format!("{}b", "x".repeat(252));
        let dotted = format!("{}.{}", "y".repeat(226), "z".repeat(26));
        let dashed = format!("{}-{}", "q".repeat(225), "r".repeat(27));
        for name in [&a, &b, &dotted, &dashed] {
            let l = lease_name(name);
            assert!(is_dns_subdomain(&l), "{l}");
            assert!(l.len() <= 253);
        }
        assert_ne!(lease_name(&a), lease_name(&b));
        // No job's plain Lease name is another job's shortened one (the issue's collision: a
        // 253-character name, and a second name that is the first one's Lease name without the
        // prefix).
        let long = "h".repeat(253);
        let hashed = lease_name(&long);
        let tail = hashed.strip_prefix(PREFIX).unwrap();
        if is_dns_subdomain(tail) {
            assert_ne!(lease_name(tail), hashed);
        }
        assert!(!is_dns_subdomain(tail), "{tail}: a job could be named so");
        // Exactly at the boundary: no hashing needed.
        let edge = "e".repeat(253 - PREFIX.len());
        assert_eq!(lease_name(&edge), format!("{PREFIX}{edge}"));
        let over = "e".repeat(253 - PREFIX.len() + 1);
        assert_ne!(lease_name(&over), format!("{PREFIX}{over}"));
        assert!(is_dns_subdomain(&lease_name(&over)));
    }

    #[test]
    fn take_over_only_from_older_attempts() {
        let t3 = Token::issue(3);
        let cases = [
            (None, true),
            (Some(Token::issue(2).as_str().to_string()), true),
            (Some(t3.as_str().to_string()), true),
            (Some(Token::issue(3).as_str().to_string()), false),
            (Some(Token::issue(4).as_str().to_string()), false),
            (Some("someone".to_string()), true),
        ];
        for (current, want) in cases {
            assert_eq!(may_take_over(current.as_deref(), &t3), want, "{current:?}");
        }
    }

    #[test]
    fn renew_patch_tests_the_holder_first() {
        let t = Token::issue(1);
        let none = Progress::default();
        let p = serde_json::to_value(renew_patch(
            &t,
            Timestamp::UNIX_EPOCH,
            Some("{\"o\":1}"),
            Some(&none),
        ))
        .unwrap();
        assert_eq!(p[0]["op"], "test");
        assert_eq!(p[0]["path"], "/spec/holderIdentity");
        assert_eq!(p[0]["value"], t.as_str());
        assert_eq!(p[1]["path"], "/spec/renewTime");
        assert_eq!(
            p[2]["path"],
            "/metadata/annotations/leasehold.dev~1checkpoint"
        );
        assert_eq!(p.as_array().unwrap().len(), 3);
        let p = serde_json::to_value(renew_patch(&t, Timestamp::UNIX_EPOCH, None, Some(&none)))
            .unwrap();
        assert_eq!(p.as_array().unwrap().len(), 2);
        // Progress rides on the same patch, after the test.
        let progress = Progress {
            fraction: Some(0.5),
            message: Some("half".into()),
        };
        let p = serde_json::to_value(renew_patch(
            &t,
            Timestamp::UNIX_EPOCH,
            None,
            Some(&progress),
        ))
        .unwrap();
        assert_eq!(p[0]["op"], "test");
        assert_eq!(
            p[2]["path"],
            "/metadata/annotations/leasehold.dev~1progress"
        );
        assert_eq!(p[2]["value"], "0.5");
        assert_eq!(
            p[3]["path"],
            "/metadata/annotations/leasehold.dev~1progress-message"
        );
        assert_eq!(p.as_array().unwrap().len(), 4);
    }

    #[test]
    fn a_claims_lease_names_its_holder_and_only_it_counts_as_the_attempts() {
        use crate::crd::{LeasedJobSpec, LeasedJobStatus};
        let mut job = LeasedJob::new(
            "j",
            LeasedJobSpec {
                queue: "q".into(),
                lease_duration_seconds: Some(30),
                ..Default::default()
            },
        );
        job.status = Some(LeasedJobStatus {
            holder: Some("pod-a".into()),
            ..Default::default()
        });
        let t = Token::issue(2);
        let mut l = lease_for_claim(&job, &t, Timestamp::UNIX_EPOCH, 1, None);
        assert_eq!(holder_pod(&l), Some("pod-a"));
        assert!(names_attempt(&l, t.as_str(), Some("pod-a")));
        assert!(!names_attempt(&l, t.as_str(), Some("pod-b")));
        assert!(!names_attempt(&l, Token::issue(2).as_str(), Some("pod-a")));
        l.metadata
            .annotations
            .as_mut()
            .unwrap()
            .remove(HOLDER_ANNOTATION);
        assert!(names_attempt(&l, t.as_str(), Some("pod-a")));
        // A take-over by another claim replaces the annotation.
        job.status.as_mut().unwrap().holder = Some("pod-b".into());
        let t3 = Token::issue(3);
        let taken = lease_for_claim(&job, &t3, Timestamp::UNIX_EPOCH, 2, Some(&l));
        assert_eq!(holder_pod(&taken), Some("pod-b"));
    }

    #[test]
    fn oversized_checkpoints_are_refused() {
        let big = Value::String("a".repeat(MAX_CHECKPOINT_BYTES));
        assert!(matches!(
            checkpoint_text(&big),
            Err(CheckpointTooLarge { .. })
        ));
        assert!(checkpoint_text(&json!({"offset": 10})).is_ok());
    }
}
