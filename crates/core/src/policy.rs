//! A job's policy: how long its lease lasts, how many attempts may fail, how long to wait
//! between them. Each comes from the job's own spec when it sets it, else from its queue's
//! LeasedQueue (`spec.defaults`), else from leasehold's defaults (60 s, 3 attempts, no
//! backoff): "where a job sets none", as a LimitRange's defaults apply to pods that set none.
//!
//! The claim fixes the policy of its attempt: it writes what it resolved into the job's
//! `status.policy` ([`crate::claim::claimed_status`]), in the same conditional write. Every
//! later decision about that attempt (the Lease's duration, the controller's expiry, whether a
//! failure requeues or ends the job, its backoff) reads [`LeasedJob::policy`], so the sidecar
//! and the controller agree whatever LeasedQueue each of them last read, and a change of the
//! LeasedQueue's defaults applies from the next claim, as a change of the job's spec does.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The policy an attempt runs under: a status field, so it lives with the resource
/// ([`crate::crd`]), which this module resolves it for.
pub use crate::crd::Policy;
use crate::crd::{Backoff, LeasedJob, LeasedJobSpec};

/// leasehold's lease duration for a job whose spec and queue set none, in seconds.
pub const LEASE_DURATION_SECONDS: i32 = 60;
/// leasehold's maxAttempts for a job whose spec and queue set none.
pub const MAX_ATTEMPTS: i32 = 3;

/// A LeasedQueue's `spec.defaults`: what its jobs get where their spec sets none. Each field
/// has the bounds of the LeasedJob field of the same name, checked by the API server.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobDefaults {
    /// spec.leaseDurationSeconds of the queue's jobs that set none, 5 to 86400 seconds; unset:
    /// 60.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 5, max = 86400))]
    pub lease_duration_seconds: Option<i32>,

    /// spec.maxAttempts of the queue's jobs that set none, at least 1; unset: 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_attempts: Option<i32>,

    /// spec.backoff of the queue's jobs that set none; unset: none (a failed job is claimable
    /// again at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<Backoff>,
}

/// The policy of a job with `spec` in a queue whose LeasedQueue has `defaults` (None: no
/// LeasedQueue, or none read): field by field, the spec's value, else the queue's, else
/// [`LEASE_DURATION_SECONDS`], [`MAX_ATTEMPTS`] and no backoff.
pub fn resolve(spec: &LeasedJobSpec, defaults: Option<&JobDefaults>) -> Policy {
    let lease_duration_seconds = spec
        .lease_duration_seconds
        .or_else(|| defaults?.lease_duration_seconds)
        .unwrap_or(LEASE_DURATION_SECONDS);
    let max_attempts = spec
        .max_attempts
        .or_else(|| defaults?.max_attempts)
        .unwrap_or(MAX_ATTEMPTS);
    let backoff = spec.backoff.clone().or_else(|| defaults?.backoff.clone());
    Policy {
        lease_duration_seconds,
        max_attempts,
        backoff,
    }
}

impl LeasedJob {
    /// The policy of the job's latest attempt: `status.policy` as its claim wrote it, or, for
    /// a job never claimed or claimed by a sidecar older than `status.policy`, its spec's
    /// values over leasehold's defaults ([`resolve`] without a queue).
    pub fn policy(&self) -> Policy {
        self.status
            .as_ref()
            .and_then(|s| s.policy.clone())
            .unwrap_or_else(|| resolve(&self.spec, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::LeasedJobStatus;

    fn backoff(initial: i32) -> Backoff {
        Backoff {
            initial_seconds: initial,
            max_seconds: 600,
        }
    }

    #[test]
    fn each_field_comes_from_the_spec_then_the_queue_then_leasehold() {
        let queue = JobDefaults {
            lease_duration_seconds: Some(300),
            max_attempts: None,
            backoff: Some(backoff(10)),
        };
        // A spec that sets nothing: the queue's where it sets them, leasehold's elsewhere.
        let none = LeasedJobSpec::default();
        assert_eq!(
            resolve(&none, Some(&queue)),
            Policy {
                lease_duration_seconds: 300,
                max_attempts: MAX_ATTEMPTS,
                backoff: Some(backoff(10)),
            }
        );
        // No LeasedQueue: leasehold's.
        assert_eq!(
            resolve(&none, None),
            Policy {
                lease_duration_seconds: LEASE_DURATION_SECONDS,
                max_attempts: MAX_ATTEMPTS,
                backoff: None,
            }
        );
        // A spec that sets all three wins over the queue, field by field.
        let all = LeasedJobSpec {
            lease_duration_seconds: Some(20),
            max_attempts: Some(7),
            backoff: Some(backoff(1)),
            ..LeasedJobSpec::default()
        };
        assert_eq!(
            resolve(&all, Some(&queue)),
            Policy {
                lease_duration_seconds: 20,
                max_attempts: 7,
                backoff: Some(backoff(1)),
            }
        );
        // One field set: only that one is the spec's.
        let one = LeasedJobSpec {
            max_attempts: Some(1),
            ..LeasedJobSpec::default()
        };
        let got = resolve(&one, Some(&queue));
        assert_eq!(
            (got.lease_duration_seconds, got.max_attempts),
            (300, 1),
            "{got:?}"
        );
    }

    #[test]
    fn a_claimed_job_keeps_the_policy_its_claim_recorded() {
        let mut job = LeasedJob::new("j", LeasedJobSpec::default());
        assert_eq!(job.policy(), resolve(&job.spec, None), "never claimed");
        let recorded = Policy {
            lease_duration_seconds: 300,
            max_attempts: 9,
            backoff: Some(backoff(5)),
        };
        job.status = Some(LeasedJobStatus {
            policy: Some(recorded.clone()),
            ..LeasedJobStatus::default()
        });
        // A later change of the spec applies from the next claim, not to this attempt.
        job.spec.max_attempts = Some(1);
        assert_eq!(job.policy(), recorded);
    }

    #[test]
    fn the_status_field_reads_as_the_claim_writes_it() {
        let json = serde_json::json!({
            "leaseDurationSeconds": 45, "maxAttempts": 2,
            "backoff": {"initialSeconds": 3, "maxSeconds": 60}
        });
        let policy: Policy = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(serde_json::to_value(&policy).unwrap(), json);
        let bare: Policy = serde_json::from_value(
            serde_json::json!({"leaseDurationSeconds": 45, "maxAttempts": 2}),
        )
        .unwrap();
        assert_eq!(bare.backoff, None);
    }
}
