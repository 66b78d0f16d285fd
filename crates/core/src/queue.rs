//! The `LeasedQueue` custom resource (`leasedqueues.leasehold.dev/v1alpha1`, short name `lq`):
//! a queue as an object, so that an operator can act on a queue as a whole. Optional: a job's
//! queue works without one, as before. Its name is the queue's name (`spec.queue` of its
//! jobs, in the same namespace).
//!
//! What it does today: `spec.paused` stops new claims of the queue's jobs (within 1 s:
//! docs/protocol.md, "Flow control"); jobs already Leased go on, heartbeat, complete and fail
//! as usual. The controller reports the queue in its status (jobs queued and leased, the oldest
//! queued job's creation time, whether the pause has taken effect) and records an Event when a
//! queue is paused or resumed ([`transition`]).
//!
//! Pure: the controller and the sidecar read it; [`status_of`] and [`transition`] are the
//! decisions they make from it.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::crd::Phase;

/// The rule every LeasedQueue's name must follow, as a CEL expression: the name is a queue's
/// name, and a queue's name is a DNS label (as `spec.queue` of a LeasedJob).
pub const NAME_RULE: &str =
    "size(self.metadata.name) <= 63 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')";

/// What an operator sets on a queue.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "leasehold.dev",
    version = "v1alpha1",
    kind = "LeasedQueue",
    plural = "leasedqueues",
    shortname = "lq",
    namespaced,
    status = "LeasedQueueStatus",
    derive = "Default",
    doc = "A queue of LeasedJobs as an object: its name is the jobs' spec.queue, in the same namespace. Optional: a queue works without one. spec.paused stops new claims of its jobs; its status reports the queue.",
    validation = Rule::new(NAME_RULE).message("metadata.name is the queue's name, which a LeasedJob's spec.queue names: a DNS label (lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63 characters)"),
    printcolumn = r#"{"name":"Paused","type":"boolean","jsonPath":".spec.paused"}"#,
    printcolumn = r#"{"name":"Queued","type":"integer","jsonPath":".status.queued"}"#,
    printcolumn = r#"{"name":"Leased","type":"integer","jsonPath":".status.leased"}"#,
    printcolumn = r#"{"name":"Oldest Queued","type":"date","jsonPath":".status.oldestQueuedTime"}"#,
    printcolumn = r#"{"name":"Keys At Limit","type":"integer","jsonPath":".status.keysAtLimit"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct LeasedQueueSpec {
    /// True stops new claims of this queue's jobs, within a second (`kubectl leasehold pause
    /// QUEUE`); false (the default) lets them go on (`kubectl leasehold resume QUEUE`). Jobs
    /// already Leased are not touched: they heartbeat, complete, fail and expire as usual.
    #[serde(default)]
    pub paused: bool,

    /// Fair sharing between the queue's concurrency keys (a LeasedJob's spec.concurrencyKey):
    /// key -> weight, 1 to 1000. The dispatcher offers the keys that have waiting jobs in
    /// turn, each in proportion to its weight (a key not listed weighs 1; jobs without a key
    /// share the empty key), so a key with 10,000 waiting jobs and a key with 3 alternate.
    /// Within a key, jobs go by priority, then age.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "weights_schema")]
    pub weights: BTreeMap<String, i32>,

    /// At most this many jobs of the queue Leased at once, 1 to 1000; unset: no limit. Exact:
    /// each Leased job holds one of the queue's slots, taken by a conditional write before
    /// its claim, so the API server never sees more (docs/protocol.md, "Limits"). A slot comes
    /// back when its job's attempt ends or its lease expires, never earlier. Lowered below the
    /// jobs Leased now, it stops new claims until the jobs above it have ended; running jobs
    /// are not touched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_leased: Option<i32>,

    /// At most this many Leased jobs per spec.concurrencyKey value, 1 to 1000; unset: no
    /// limit. Exact in the same way as maxLeased; jobs without a key are not limited by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_leased_per_key: Option<i32>,

    /// What the queue's jobs get where their spec sets none: leaseDurationSeconds (5 to 86400),
    /// maxAttempts (at least 1), backoff. Each claim resolves them (the job's own value, else
    /// this, else leasehold's 60 s, 3 attempts, no backoff) and records the result in the
    /// job's status.policy, so a change applies from each job's next claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defaults: Option<crate::policy::JobDefaults>,
}

impl LeasedQueueSpec {
    /// Whether a claim of some job of this queue takes a slot ([`crate::slots`]).
    pub fn limits(&self) -> bool {
        self.max_leased.is_some() || self.max_leased_per_key.is_some()
    }
}

/// The schema of [`LeasedQueueSpec::weights`]: a map of keys (1 to 128 characters) to weights
/// (1 to 1000), each bound checked by the API server with the field named.
fn weights_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "description": "Fair sharing between the queue's concurrency keys (a LeasedJob's spec.concurrencyKey): key -> weight, 1 to 1000. The dispatcher offers the keys that have waiting jobs in turn, each in proportion to its weight (a key not listed weighs 1; jobs without a key share the empty key), so a key with 10,000 waiting jobs and a key with 3 alternate. Within a key, jobs go by priority, then age.",
        "additionalProperties": {"type": "integer", "format": "int32", "minimum": 1, "maximum": 1000},
        "maxProperties": 10000,
        "x-kubernetes-validations": [
            {"rule": "self.all(k, size(k) <= 128)", "message": "spec.weights: every key is a concurrency key, at most 128 characters"}
        ]
    })
}

/// The weight of concurrency key `key` in a queue with `weights` ([`LeasedQueueSpec::weights`]):
/// as listed, clamped to 1..=1000, or 1.
pub fn weight_of(weights: &BTreeMap<String, i32>, key: &str) -> u32 {
    weights
        .get(key)
        .map_or(1, |w| u32::try_from((*w).clamp(1, 1000)).unwrap_or(1))
}

/// What the controller reports about a queue. Counts are of the jobs of this namespace whose
/// spec.queue is this object's name, as the leading controller's watch saw them, written when
/// they change (at most every few seconds) and at once when the pause changes.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeasedQueueStatus {
    /// Jobs of the queue in phase Queued (claimable now or later).
    #[serde(default)]
    pub queued: i64,
    /// Jobs of the queue in phase Leased.
    #[serde(default)]
    pub leased: i64,
    /// Creation time of the oldest Queued job; absent when none is queued. `kubectl get lq`
    /// shows its age.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_queued_time: Option<Time>,
    /// The concurrency key of that job (absent for none): with fair sharing, a key whose jobs
    /// are not served (at its limit, or outweighed) shows here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_queued_key: Option<String>,
    /// Whether the controller has taken the pause into account: spec.paused as of
    /// observedGeneration.
    #[serde(default)]
    pub paused: bool,
    /// Since when the queue has been paused (the controller's clock when it saw the pause);
    /// absent while it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_time: Option<Time>,
    /// metadata.generation of the spec this status reflects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// True while the queue has maxLeased jobs Leased (or more, after the limit was lowered).
    #[serde(default)]
    pub at_limit: bool,
    /// How many concurrency keys have maxLeasedPerKey jobs Leased (or more).
    #[serde(default)]
    pub keys_at_limit: i64,
    /// The first of those keys, in order, at most 10.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys_at_limit_shown: Vec<String>,
    /// The limits whose slots count every Leased job of the queue, as
    /// `<metadata.uid>:<fields>` (the LeasedQueue's uid, and which of maxLeased and
    /// maxLeasedPerKey the spec sets): written by the controller once each job Leased before a
    /// limit existed holds a slot. Until it names the limits the spec sets, sidecars make no
    /// claim that a limit applies to (docs/protocol.md, "Limits").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots_adopted: Option<String>,
}

impl LeasedQueue {
    /// Whether new claims of this queue's jobs must stop.
    pub fn is_paused(&self) -> bool {
        self.spec.paused
    }
}

/// One job of a queue, as [`status_of`] counts it.
#[derive(Clone, Copy, Debug)]
pub struct Member<'a> {
    /// status.phase.
    pub phase: Phase,
    /// metadata.creationTimestamp.
    pub created: Option<&'a Time>,
    /// spec.concurrencyKey.
    pub key: Option<&'a str>,
}

/// How many keys at their limit a LeasedQueue's status names (the rest are counted).
pub const KEYS_AT_LIMIT_SHOWN: usize = 10;

/// The status a queue should have, from its jobs, its spec and generation, and the status it
/// has (`was`: its pausedTime is kept while the pause lasts). `now` is the controller's clock,
/// used only as the pausedTime of a pause seen now.
pub fn status_of<'a>(
    queue: &LeasedQueue,
    jobs: impl IntoIterator<Item = Member<'a>>,
    now: Timestamp,
) -> LeasedQueueStatus {
    let mut status = LeasedQueueStatus {
        paused: queue.spec.paused,
        observed_generation: queue.metadata.generation,
        ..LeasedQueueStatus::default()
    };
    let mut oldest: Option<(&Time, Option<&str>)> = None;
    let mut per_key: BTreeMap<&str, i64> = BTreeMap::new();
    for job in jobs {
        if let (Phase::Leased, Some(key)) = (job.phase, job.key) {
            *per_key.entry(key).or_default() += 1;
        }
        match job.phase {
            Phase::Queued => {
                status.queued += 1;
                if let Some(created) = job.created {
                    if oldest.is_none_or(|(o, _)| created.0 < o.0) {
                        oldest = Some((created, job.key));
                    }
                }
            }
            Phase::Leased => status.leased += 1,
            _ => {}
        }
    }
    status.oldest_queued_time = oldest.map(|(t, _)| t.clone());
    status.oldest_queued_key = oldest.and_then(|(_, k)| k.map(str::to_string));
    if let Some(max) = queue.spec.max_leased {
        status.at_limit = status.leased >= i64::from(max);
    }
    if let Some(max) = queue.spec.max_leased_per_key {
        let full: Vec<&str> = per_key
            .iter()
            .filter(|(_, n)| **n >= i64::from(max))
            .map(|(k, _)| *k)
            .collect();
        status.keys_at_limit = i64::try_from(full.len()).unwrap_or(i64::MAX);
        status.keys_at_limit_shown = full
            .into_iter()
            .take(KEYS_AT_LIMIT_SHOWN)
            .map(str::to_string)
            .collect();
    }
    let was = queue.status.as_ref();
    status.paused_time = match (queue.spec.paused, was) {
        (false, _) => None,
        (true, Some(w)) if w.paused => w.paused_time.clone().or(Some(Time(now))),
        (true, _) => Some(Time(now)),
    };
    // Kept as written: only the controller's adoption of the Leased jobs changes it.
    status.slots_adopted = was.and_then(|w| w.slots_adopted.clone());
    status
}

/// A change of a queue's pause, as the controller records it (an Event on the LeasedQueue).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// spec.paused turned true: new claims stop.
    Paused,
    /// spec.paused turned false: claims go on.
    Resumed,
}

impl Transition {
    /// The Event's reason.
    pub fn reason(self) -> &'static str {
        match self {
            Transition::Paused => "Paused",
            Transition::Resumed => "Resumed",
        }
    }
}

/// The pause change to record for `queue`: its spec against the pause its status last
/// reported. A queue created paused is `Paused`; one created running records nothing. Judged
/// from the object alone, so a controller that restarts or fails over between the change and
/// its status write records it once more at most, never misses it.
pub fn transition(queue: &LeasedQueue) -> Option<Transition> {
    let reported = queue.status.as_ref().is_some_and(|s| s.paused);
    match (queue.spec.paused, reported) {
        (true, false) => Some(Transition::Paused),
        (false, true) => Some(Transition::Resumed),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(paused: bool, status: Option<LeasedQueueStatus>) -> LeasedQueue {
        let mut q = LeasedQueue::new(
            "q",
            LeasedQueueSpec {
                paused,
                ..LeasedQueueSpec::default()
            },
        );
        q.metadata.generation = Some(3);
        q.status = status;
        q
    }

    fn at(s: &str) -> Time {
        Time(s.parse().unwrap())
    }

    #[test]
    fn the_status_counts_queued_and_leased_jobs_and_the_oldest_queued() {
        let (old, new) = (at("2026-01-01T00:00:00Z"), at("2026-01-02T00:00:00Z"));
        let jobs = [
            Member {
                phase: Phase::Queued,
                created: Some(&new),
                key: None,
            },
            Member {
                phase: Phase::Queued,
                created: Some(&old),
                key: Some("a"),
            },
            Member {
                phase: Phase::Leased,
                created: Some(&at("2025-01-01T00:00:00Z")),
                key: Some("a"),
            },
            Member {
                phase: Phase::Succeeded,
                created: None,
                key: None,
            },
            Member {
                phase: Phase::Queued,
                created: None,
                key: None,
            },
        ];
        let now: Timestamp = "2026-02-01T00:00:00Z".parse().unwrap();
        let got = status_of(&queue(false, None), jobs, now);
        assert_eq!(
            got,
            LeasedQueueStatus {
                queued: 3,
                leased: 1,
                oldest_queued_time: Some(old),
                oldest_queued_key: Some("a".into()),
                paused: false,
                paused_time: None,
                observed_generation: Some(3),
                ..LeasedQueueStatus::default()
            }
        );
        let empty = status_of(&queue(false, None), [], now);
        assert_eq!((empty.queued, empty.oldest_queued_time), (0, None));
    }

    #[test]
    fn the_status_names_the_scopes_at_their_limit() {
        let mut q = queue(false, None);
        q.spec.max_leased = Some(3);
        q.spec.max_leased_per_key = Some(1);
        let leased = |key| Member {
            phase: Phase::Leased,
            created: None,
            key,
        };
        let now: Timestamp = "2026-02-01T00:00:00Z".parse().unwrap();
        let got = status_of(
            &q,
            [leased(Some("b")), leased(Some("a")), leased(None)],
            now,
        );
        assert!(got.at_limit);
        assert_eq!(
            (got.keys_at_limit, got.keys_at_limit_shown),
            (2, vec!["a".to_string(), "b".to_string()])
        );
        let got = status_of(&q, [leased(Some("a"))], now);
        assert!(!got.at_limit);
        let many: Vec<String> = (0..15).map(|i| format!("k{i:02}")).collect();
        let got = status_of(&q, many.iter().map(|k| leased(Some(k))), now);
        assert_eq!((got.keys_at_limit, got.keys_at_limit_shown.len()), (15, 10));
    }

    #[test]
    fn paused_time_is_when_the_pause_was_first_seen_and_goes_with_it() {
        let now: Timestamp = "2026-02-01T00:00:00Z".parse().unwrap();
        let seen = status_of(&queue(true, None), [], now);
        assert_eq!(
            (seen.paused, seen.paused_time.clone()),
            (true, Some(Time(now)))
        );
        let later: Timestamp = "2026-02-01T01:00:00Z".parse().unwrap();
        let kept = status_of(&queue(true, Some(seen.clone())), [], later);
        assert_eq!(kept.paused_time, Some(Time(now)));
        let resumed = status_of(&queue(false, Some(kept)), [], later);
        assert_eq!((resumed.paused, resumed.paused_time), (false, None));
    }

    #[test]
    fn a_pause_change_is_judged_against_the_reported_pause() {
        let reported = |paused| {
            Some(LeasedQueueStatus {
                paused,
                ..LeasedQueueStatus::default()
            })
        };
        let cases = [
            (true, None, Some(Transition::Paused)),
            (false, None, None),
            (true, reported(false), Some(Transition::Paused)),
            (true, reported(true), None),
            (false, reported(true), Some(Transition::Resumed)),
            (false, reported(false), None),
        ];
        for (paused, status, want) in cases {
            assert_eq!(
                transition(&queue(paused, status.clone())),
                want,
                "{paused} {status:?}"
            );
        }
    }
}
