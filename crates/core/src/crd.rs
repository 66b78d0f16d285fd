//! The `LeasedJob` custom resource (`leasedjobs.leasehold.dev/v1alpha1`).
//!
//! Types only, plus small helpers: the rules that move a job between phases live in
//! [`crate::fence`] (writes by the holder), [`crate::claim`] (queued -> leased) and
//! [`crate::expiry`] (the controller's requeue). Every field carries a doc comment because it
//! becomes the description that `kubectl explain leasedjob` prints.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::{CustomResource, KubeSchema, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::definition::{
    all_crds_yaml, crd_yaml, definition, paragraphs, queue_crd_yaml, queue_definition,
    BETA_VERSION, STORAGE_VERSION, VERSION_ANNOTATION,
};

/// API group of every leasehold resource.
pub const GROUP: &str = "leasehold.dev";
/// Label put on every Lease leasehold manages; its value is the LeasedJob's name (or a hash of
/// it when the name is longer than a label value may be).
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of [`MANAGED_BY_LABEL`].
pub const MANAGED_BY: &str = "leasehold";
/// Finished condition types, as batch/v1 Job names them.
pub const CONDITION_COMPLETE: &str = "Complete";
/// See [`CONDITION_COMPLETE`].
pub const CONDITION_FAILED: &str = "Failed";
/// See [`CONDITION_COMPLETE`].
pub const CONDITION_CANCELLED: &str = "Cancelled";
/// True while the job's last claim was undone because its Lease (`ljob-...`) belongs to
/// something else: another application's Lease of that name, or one left by an earlier
/// LeasedJob of the same name that garbage collection has not removed yet. Cleared when an
/// attempt that held its Lease ends.
pub const CONDITION_LEASE_CONFLICT: &str = "LeaseConflict";

/// Largest a LeasedJob may be, in bytes of JSON, the whole object (metadata, spec and status):
/// 1 MiB.
///
/// A LeasedJob is one etcd value, and etcd refuses a request over its `--max-request-bytes`
/// (1.5 MiB by default) with a 500 that names no field. This limit stays a third below that,
/// so the object plus the bookkeeping around it (managedFields, a few status writes) always
/// fits. The controller's admission webhook refuses a create or update that would make a job
/// larger with a 413 naming the field (the binary's `admission` module); the sidecar refuses a request
/// body larger than this before reading it (its `MAX_BODY_BYTES`).
pub const MAX_JOB_BYTES: usize = 1024 * 1024;

/// What to do, and how to lease it. Workers never write the spec.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "leasehold.dev",
    version = "v1alpha1",
    kind = "LeasedJob",
    plural = "leasedjobs",
    shortname = "ljob",
    namespaced,
    status = "LeasedJobStatus",
    derive = "Default",
    doc = "A job that workers lease: claimed by one worker at a time with a fresh fencing token, kept alive by heartbeats on its Lease, and requeued by the controller when the heartbeats stop.",
    // Field selectors the API server evaluates: `spec.queue` and `status.phase` narrow each
    // sidecar's queue watch to its queue's live jobs, `status.holder` its watch of the jobs it
    // holds (leasehold_kube::queue_watch); `status.phase` is for people too (`kubectl get ljob
    // --field-selector status.phase=Failed`). Selectable fields need Kubernetes 1.30 or later
    // (KEP-4358).
    selectable = ".spec.queue",
    selectable = ".status.phase",
    selectable = ".status.holder",
    validation = Rule::new("has(self.spec.concurrencyKey) == has(oldSelf.spec.concurrencyKey) && (!has(self.spec.concurrencyKey) || self.spec.concurrencyKey == oldSelf.spec.concurrencyKey)").message("spec.concurrencyKey is immutable: the job's share (and any limit) was counted under it; create a new LeasedJob instead"),
    validation = Rule::new("self.spec.queue == oldSelf.spec.queue").message("spec.queue is immutable: the sidecars of the new queue could not see this job's claim; create a new LeasedJob instead"),
    validation = Rule::new("!has(oldSelf.status) || !has(oldSelf.status.phase) || oldSelf.status.phase != 'Leased' || (has(self.spec.leaseDurationSeconds) == has(oldSelf.spec.leaseDurationSeconds) && (!has(self.spec.leaseDurationSeconds) || self.spec.leaseDurationSeconds == oldSelf.spec.leaseDurationSeconds))").message("spec.leaseDurationSeconds cannot change while the job is Leased: its holder was granted the lease with the old duration. Change it while the job is Queued (it applies from the next claim), or cancel the job"),
    printcolumn = r#"{"name":"Queue","type":"string","jsonPath":".spec.queue"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Attempt","type":"integer","jsonPath":".status.attempt"}"#,
    printcolumn = r#"{"name":"Holder","type":"string","jsonPath":".status.holder"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct LeasedJobSpec {
    /// Queue this job waits in. Sidecars claim only from the queue they serve (`leasehold
    /// sidecar --queue`). A DNS label: lowercase letters, digits and '-', at most 63 characters.
    #[serde(default = "default_queue")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub queue: String,

    /// The work itself: any JSON value, handed to the worker exactly as given. The whole job
    /// may be at most 1 MiB as JSON: keep large inputs in an object store and put a reference
    /// (a URL or a key) here.
    #[serde(default, skip_serializing_if = "Value::is_null")]
    #[schemars(schema_with = "any_json")]
    pub payload: Value,

    /// How long, in seconds, a claim stays valid without a heartbeat. The controller requeues a
    /// job whose Lease it has not seen renewed for this long. 5 to 86400. Unset: the queue's
    /// LeasedQueue spec.defaults.leaseDurationSeconds, else 60. Each claim records the value
    /// its attempt runs under in status.policy. Fixed while the job is Leased (a change is
    /// refused): it applies from the next claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 5, max = 86400), transform = not_nullable)]
    pub lease_duration_seconds: Option<i32>,

    /// How many attempts may fail (an explicit failure or an expired lease) before the job ends
    /// Failed. A release (the worker hands the job back) does not count. At least 1. Unset: the
    /// queue's LeasedQueue spec.defaults.maxAttempts, else 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1), transform = not_nullable)]
    pub max_attempts: Option<i32>,

    /// Higher priorities are claimed first; among equal priorities, older jobs first. Default 0.
    #[serde(default)]
    pub priority: i32,

    /// Delay before the next attempt after a retryable failure or an expired lease:
    /// exponential in the number of failed attempts, with jitter. Unset: the queue's LeasedQueue
    /// spec.defaults.backoff, else none (the job is claimable again at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<Backoff>,

    /// Not claimable before this time (RFC 3339 in UTC or with an offset, years 1000 to 8999,
    /// at most 9 fractional digits; e.g. 2026-12-01T09:00:00Z).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_time"
    )]
    #[schemars(regex(
        pattern = r"^[1-8][0-9]{3}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?(Z|[+-][0-9]{2}:[0-9]{2})$"
    ))]
    pub not_before: Option<Time>,

    /// Set to true to cancel the job (`kubectl patch ljob NAME --type merge -p
    /// '{"spec":{"cancel":true}}'`). A Queued job ends Cancelled at once; a Leased job ends
    /// Cancelled and its holder learns it at its next heartbeat (409, error `cancelled`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cancel: bool,

    /// Who the job is for, when a queue is shared (a tenant, a customer, a vendor account): the
    /// dispatcher shares the queue's claims between the keys that have waiting jobs, in turn
    /// (each key's share is its weight in the queue's LeasedQueue, 1 by default), and orders
    /// jobs by priority and age within a key. Jobs without one share the empty key. At most
    /// 128 characters. Fixed once the job exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub concurrency_key: Option<String>,

    /// Delete the job this many seconds after it finished (Succeeded, Failed or Cancelled), as
    /// batch/v1 Job's field of the same name does. Unset: keep it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i32>,
}

/// Drops `nullable` from an optional field's schema, so that the API server prunes an explicit
/// `null` (Kubernetes "Defaulting and Nullable": null is pruned from fields not nullable)
/// instead of storing it. For fields that were plain integers with a schema default before
/// they became optional: a binary of that time cannot decode a stored `null`, and would skip
/// the job as undecodable.
fn not_nullable(schema: &mut schemars::Schema) {
    schema.remove("nullable");
    // schemars writes an Option as `type: [T, "null"]`, which becomes `nullable` later.
    if let Some(serde_json::Value::Array(types)) = schema.get("type").cloned() {
        let mut kept: Vec<serde_json::Value> = types.into_iter().filter(|t| t != "null").collect();
        let kept = match kept.len() {
            1 => kept.remove(0),
            _ => serde_json::Value::Array(kept),
        };
        schema.insert("type".into(), kept);
    }
}

impl Default for LeasedJobSpec {
    /// The spec a manifest with an empty `spec: {}` gets, after the CRD's defaults.
    fn default() -> Self {
        LeasedJobSpec {
            queue: default_queue(),
            payload: Value::Null,
            lease_duration_seconds: None,
            max_attempts: None,
            priority: 0,
            backoff: None,
            not_before: None,
            cancel: false,
            concurrency_key: None,
            ttl_seconds_after_finished: None,
        }
    }
}

/// Exponential backoff between attempts: the delay after the n-th failed attempt is
/// `min(maxSeconds, initialSeconds * 2^(n-1))`, of which a random half is taken off ("equal
/// jitter", so that retries of many jobs failed together spread out).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.initialSeconds <= self.maxSeconds").message("initialSeconds must not exceed maxSeconds"))]
pub struct Backoff {
    /// Delay after the first failed attempt, in seconds (before jitter). Default 1.
    #[serde(default = "default_backoff_initial")]
    #[schemars(range(min = 0, max = 86400))]
    pub initial_seconds: i32,
    /// Largest delay, in seconds. Default 300.
    #[serde(default = "default_backoff_max")]
    #[schemars(range(min = 0, max = 86400))]
    pub max_seconds: i32,
}

fn default_backoff_initial() -> i32 {
    1
}

fn default_backoff_max() -> i32 {
    300
}

/// The policy an attempt runs under, fixed at its claim: a LeasedJob's `status.policy`.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Policy {
    /// The lease this attempt was granted, in seconds (also its Lease's leaseDurationSeconds):
    /// 5 to 86400, as spec.leaseDurationSeconds.
    #[schemars(range(min = 5, max = 86400))]
    pub lease_duration_seconds: i32,
    /// Failed attempts that end the job Failed: at least 1, as spec.maxAttempts.
    #[schemars(range(min = 1))]
    pub max_attempts: i32,
    /// Delay before the next attempt after a failure; none: claimable again at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<Backoff>,
}

/// Where a job stands. Only the holder of the current token moves it out of `Leased` by a write
/// of its own; only the controller moves it back to `Queued` when its lease expires.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Phase {
    /// Waiting to be claimed.
    Queued,
    /// Claimed: a worker holds the token of the current attempt.
    Leased,
    /// Finished with a result.
    Succeeded,
    /// Finished without one: a non-retryable failure, or no attempts left.
    Failed,
    /// Cancelled by a user (spec.cancel).
    Cancelled,
}

impl Phase {
    /// True for `Succeeded`, `Failed` and `Cancelled`: no write changes the job after that.
    pub fn is_finished(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed | Phase::Cancelled)
    }

    /// The name as it is stored in `status.phase`.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Queued => "Queued",
            Phase::Leased => "Leased",
            Phase::Succeeded => "Succeeded",
            Phase::Failed => "Failed",
            Phase::Cancelled => "Cancelled",
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the control plane knows about a job's attempts.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeasedJobStatus {
    /// Queued, Leased, Succeeded, Failed or Cancelled. A job without a status is Queued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,

    /// Number of claims so far: grows by exactly one per claim and never decreases.
    #[serde(default)]
    pub attempt: i32,

    /// Identity (pod name) of the worker that made the latest claim. Valid as the owner only
    /// while the phase is Leased.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,

    /// Fencing token of the latest claim, `<attempt>.<32 hex digits>`. Every write by a worker
    /// must present it; it is the current Lease's holderIdentity while the phase is Leased.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,

    /// Name of the coordination.k8s.io/v1 Lease that carries this job's heartbeats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_name: Option<String>,

    /// When the job became claimable (its creation time).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_time"
    )]
    pub queued_time: Option<Time>,

    /// When the latest claim was made.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_time"
    )]
    pub claimed_time: Option<Time>,

    /// When the job reached Succeeded, Failed or Cancelled.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_time"
    )]
    pub finished_time: Option<Time>,

    /// After a failed attempt with a backoff (status.policy's: the spec's, else its queue's
    /// default): the job is not claimable before this time.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_time"
    )]
    pub retry_after: Option<Time>,

    /// The worker's result: any JSON value, set once, by the holder, with the phase Succeeded.
    /// Counts towards the job's 1 MiB limit: store large results elsewhere and put a reference
    /// here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_json")]
    pub result: Option<Value>,

    /// One entry per failed attempt: explicit failures and expired leases, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<AttemptFailure>,

    /// Progress saved by the last attempt that did not finish (moved here from the Lease when
    /// the job was requeued), handed to the next claim so it can resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_json")]
    pub checkpoint: Option<Value>,

    /// Standard conditions: `Complete`, `Failed` or `Cancelled` (True once finished), as
    /// batch/v1 Job has `Complete` and `Failed`.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "lenient_conditions"
    )]
    pub conditions: Vec<Condition>,

    /// The lease duration, maxAttempts and backoff the latest attempt runs under, as its claim
    /// resolved them (the spec's, else the LeasedQueue's spec.defaults, else leasehold's) and
    /// wrote them in the same write: the sidecar, the Lease and the controller's expiry all
    /// read these, so a change of either applies from the next claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<Policy>,

    /// The metadata.generation the controller last initialised this status from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// The last slot of a limit that a claimer left pending on this job and the controller
    /// freed: `<slot Lease> <job>@<resourceVersion>#<attempt>`, the slot and the claim it named.
    /// That claimer took the slot for a claim guarded by that resourceVersion and never wrote
    /// it (it died or stalled between the two writes); the controller's write of this field,
    /// guarded by the same resourceVersion, moved the job past it, so that no claim from it can
    /// land and the slot is free (docs/protocol.md, "Limits": a pending slot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_slot_freed: Option<String>,

    /// The limits the latest claim was made under, as the claimer read its LeasedQueue:
    /// `<uid>:maxLeased=<n>,maxLeasedPerKey=<m>` (those set), or `<uid>/<generation>:...` for a
    /// claim that swapped a slot of its claimer's own; absent when the claimer saw no
    /// limits. The claimer took a slot of each limited scope before this write.
    /// With the chart's admission policy the API server refuses a worker's claim that does not
    /// name the limits its own copy of the LeasedQueue sets, and confirms (docs/security.md,
    /// rule `limits-obeyed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<String>,

    /// The index of the slot of the queue's `maxLeased` that the latest claim took (slot Lease
    /// `lhq-<queue>-q-<index>`); absent when it took none. Advice for the dispatcher, which
    /// suggests other slots to the next claims (docs/protocol.md, "Limits"); the slot Leases
    /// alone decide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 999))]
    pub queue_slot: Option<i32>,

    /// The index of the slot of its concurrency key's `maxLeasedPerKey` that the latest claim
    /// took; absent when it took none. Advice, as `queueSlot`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 999))]
    pub key_slot: Option<i32>,
}

/// One failed attempt.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttemptFailure {
    /// The attempt that failed (status.attempt at the time).
    pub attempt: i32,
    /// Identity of the worker that held that attempt.
    #[serde(default)]
    pub holder: String,
    /// A short CamelCase cause: `LeaseExpired` for an expired lease, else the worker's reason.
    pub reason: String,
    /// What happened, in words.
    #[serde(default)]
    pub message: String,
    /// When the failure was recorded.
    #[serde(deserialize_with = "lenient_time_or_epoch")]
    pub time: Time,
}

/// True when `name` is a valid object name: a lowercase RFC 1123 subdomain of at most 253
/// characters (Kubernetes' `IsDNS1123Subdomain`).
pub fn is_dns_subdomain(name: &str) -> bool {
    name.len() <= 253
        && name
            .split('.')
            .all(|label| label_chars(label) && !label.is_empty())
}

/// True when `name` is a lowercase RFC 1123 label of 1 to 63 characters (Kubernetes'
/// `IsDNS1123Label`): what a namespace's or a queue's name must be.
pub fn is_dns_label(name: &str) -> bool {
    (1..=63).contains(&name.len()) && label_chars(name)
}

/// Lowercase letters, digits and '-', not starting or ending with '-'.
fn label_chars(label: &str) -> bool {
    label
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !label.starts_with('-')
        && !label.ends_with('-')
}

/// Reads an optional time, taking an unreadable one (a date the API server's schema accepted
/// but this binary cannot represent) as absent, so that one odd object cannot stall a watch
/// of every job (kube's watcher fails a whole LIST on one undecodable item).
fn lenient_time<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Time>, D::Error> {
    let value = Option::<Value>::deserialize(d)?;
    Ok(value.and_then(|v| serde_json::from_value(v).ok()))
}

/// As [`lenient_time`], for a required time: the Unix epoch when unreadable.
fn lenient_time_or_epoch<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Time, D::Error> {
    Ok(lenient_time(d)?.unwrap_or_else(epoch))
}

/// A [`Condition`] as stored, with a lenient lastTransitionTime.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StoredCondition {
    #[serde(default = "epoch", deserialize_with = "lenient_time_or_epoch")]
    last_transition_time: Time,
    #[serde(default)]
    message: String,
    #[serde(default)]
    observed_generation: Option<i64>,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    status: String,
    #[serde(default, rename = "type")]
    type_: String,
}

fn epoch() -> Time {
    Time(Timestamp::UNIX_EPOCH)
}

/// Reads status.conditions with [`lenient_time_or_epoch`] for each lastTransitionTime: an
/// admin's condition dated in a year this binary cannot represent (9999) reads as the epoch
/// instead of making the whole job undecodable.
fn lenient_conditions<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Condition>, D::Error> {
    let stored = Option::<Vec<StoredCondition>>::deserialize(d)?;
    Ok(stored
        .unwrap_or_default()
        .into_iter()
        .map(|c| Condition {
            last_transition_time: c.last_transition_time,
            message: c.message,
            observed_generation: c.observed_generation,
            reason: c.reason,
            status: c.status,
            type_: c.type_,
        })
        .collect())
}

fn default_queue() -> String {
    "default".to_string()
}

/// Schema for a field that holds any JSON value, kept unpruned
/// (`x-kubernetes-preserve-unknown-fields`, see the CustomResourceDefinition docs on pruning).
fn any_json(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// The annotation in which `kubectl apply` (client-side) keeps the whole manifest it applied.
pub const LAST_APPLIED_ANNOTATION: &str = "kubectl.kubernetes.io/last-applied-configuration";

impl LeasedJob {
    /// `namespace/name`, for messages and log fields.
    pub fn reference(&self) -> String {
        format!(
            "{}/{}",
            self.namespace().unwrap_or_default(),
            self.name_any()
        )
    }

    /// The phase, treating a job without status (just applied) as Queued.
    pub fn phase(&self) -> Phase {
        self.status
            .as_ref()
            .and_then(|s| s.phase)
            .unwrap_or(Phase::Queued)
    }

    /// The resourceVersion a write guarded by this copy is sent under (a claim, an attempt's
    /// ending) and a slot names; None for a copy without one, or with an empty one, which is
    /// never written from (the API server refuses an update of a custom resource without one).
    pub fn guarding_version(&self) -> Option<&str> {
        self.metadata
            .resource_version
            .as_deref()
            .filter(|v| !v.is_empty())
    }

    /// status.attempt, 0 before the first claim.
    pub fn attempt(&self) -> i32 {
        self.status.as_ref().map_or(0, |s| s.attempt)
    }

    /// status.token, if a claim was ever made.
    pub fn token(&self) -> Option<&str> {
        self.status.as_ref().and_then(|s| s.token.as_deref())
    }

    /// Number of failed attempts so far (status.failures).
    pub fn failed_attempts(&self) -> usize {
        self.status.as_ref().map_or(0, |s| s.failures.len())
    }

    /// Drops spec.payload and status.result from this copy (a cache's), which no decision of
    /// the controller or of a claimer reads, with metadata.managedFields and kubectl's copy of
    /// the manifest that `kubectl apply` keeps in the annotation [`LAST_APPLIED_ANNOTATION`]
    /// (the payload again). Never write such a copy's spec or metadata back; status writes (the
    /// status subresource ignores everything but the status) are fine.
    pub fn drop_payload_and_result(&mut self) {
        self.metadata.managed_fields = None;
        if let Some(annotations) = self.metadata.annotations.as_mut() {
            annotations.remove(LAST_APPLIED_ANNOTATION);
        }
        self.spec.payload = Value::Null;
        if let Some(status) = self.status.as_mut() {
            status.result = None;
        }
    }

    /// The earliest time the job may be claimed: the later of spec.notBefore and
    /// status.retryAfter, if either is set.
    pub fn claimable_at(&self) -> Option<Timestamp> {
        let not_before = self.spec.not_before.as_ref().map(|t| t.0);
        let retry = self
            .status
            .as_ref()
            .and_then(|s| s.retry_after.as_ref())
            .map(|t| t.0);
        not_before.max(retry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_copy_keeps_no_payload_result_or_kubectls_copy_of_the_manifest() {
        let mut job = LeasedJob::new(
            "j",
            LeasedJobSpec {
                queue: "q".into(),
                payload: serde_json::json!({"audio": "x".repeat(1000)}),
                ..LeasedJobSpec::default()
            },
        );
        job.metadata.annotations = Some(
            [
                (LAST_APPLIED_ANNOTATION.to_string(), "{...}".to_string()),
                ("team".to_string(), "a".to_string()),
            ]
            .into(),
        );
        job.status = Some(LeasedJobStatus {
            result: Some(serde_json::json!("done")),
            ..LeasedJobStatus::default()
        });
        job.drop_payload_and_result();
        assert_eq!(job.spec.payload, Value::Null);
        assert_eq!(job.status.unwrap().result, None);
        let annotations = job.metadata.annotations.unwrap();
        assert_eq!(annotations.len(), 1, "other annotations stay");
        assert_eq!(annotations["team"], "a");
    }

    #[test]
    fn an_unreadable_time_cannot_stall_a_watch() {
        // Dates the API server's date-time format accepts but no Rust time type can hold.
        let job: LeasedJob = serde_json::from_value(serde_json::json!({
            "apiVersion": "leasehold.dev/v1alpha1",
            "kind": "LeasedJob",
            "metadata": {"name": "odd", "namespace": "ns"},
            "spec": {"notBefore": "9999-12-31T23:59:59Z"},
            "status": {
                "phase": "Queued",
                "claimedTime": "2026-12-01T00:00:00.123456789012Z",
                "failures": [{"attempt": 1, "reason": "X", "time": "99999-01-01T00:00:00Z"}],
                "conditions": [
                    {"type": "Complete", "status": "True", "reason": "Admin", "message": "m",
                     "lastTransitionTime": "9999-12-31T23:59:59Z"},
                    {"type": "Other", "status": "False", "reason": "R", "message": "",
                     "lastTransitionTime": "2026-01-02T03:04:05Z", "observedGeneration": 2}
                ]
            }
        }))
        .expect("decodes");
        assert_eq!(job.spec.not_before, None);
        assert_eq!(job.status.as_ref().unwrap().claimed_time, None);
        let status = job.status.unwrap();
        assert_eq!(status.failures[0].time, Time(Timestamp::UNIX_EPOCH));
        let c = &status.conditions;
        assert_eq!(c[0].last_transition_time, Time(Timestamp::UNIX_EPOCH));
        assert_eq!(
            (c[0].type_.as_str(), c[0].reason.as_str()),
            ("Complete", "Admin")
        );
        assert_eq!(
            c[1].last_transition_time.0,
            "2026-01-02T03:04:05Z".parse::<Timestamp>().unwrap()
        );
        assert_eq!(c[1].observed_generation, Some(2));
    }
}
