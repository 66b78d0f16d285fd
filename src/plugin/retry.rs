//! The writes of `kubectl leasehold retry`: a Failed or Cancelled job goes back to Queued for a
//! new attempt, its history kept. Pure: each function builds a JSON Patch from one snapshot of
//! the job, and every patch first `test`s that snapshot's resourceVersion, so the API server
//! applies it to exactly the object that was judged, or refuses it (422) when anything wrote
//! the job in between.
//!
//! Kept: status.attempt (the next claim makes it attempt + 1), status.failures, the checkpoint
//! (the new attempt resumes from it), token and holder (they name the last attempt until the
//! next claim replaces them). The finished condition (`Failed` or `Cancelled`) stays in the list
//! with status False and reason `Retried`, its message saying what it was. Removed:
//! finishedTime (so ttlSecondsAfterFinished no longer applies), retryAfter and result.
//!
//! Two writes, because the spec and the status are written through different endpoints (a
//! status patch ignores spec changes): first the spec, when it must change (spec.cancel
//! cleared, else the controller would cancel the job again at once; spec.maxAttempts raised
//! when the failures already reached it, else the new attempt's first retryable failure would
//! end the job), then the status. A retry interrupted between the two leaves a finished job
//! whose spec no longer asks to cancel it, and is simply run again.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use serde_json::{json, Value};
use thiserror::Error;

use leasehold_core::crd::{LeasedJob, Phase, CONDITION_CANCELLED, CONDITION_FAILED};

/// Reason of a finished condition that a retry turned False.
pub const REASON_RETRIED: &str = "Retried";
/// Longest message kept in a condition a retry rewrote, in bytes (the rest is cut).
const MAX_CONDITION_MESSAGE: usize = 1024;

/// Why a job cannot be retried.
#[derive(Debug, Error, PartialEq)]
pub enum NotRetryable {
    /// Only Failed and Cancelled jobs are retried; the others still run or succeeded.
    #[error("LeasedJob {job} is {phase}: only a Failed or Cancelled job can be retried{hint}")]
    Phase {
        /// `namespace/name`.
        job: String,
        /// Its phase.
        phase: Phase,
        /// What to do instead.
        hint: &'static str,
    },
    /// `more_attempts` was below 1.
    #[error("--attempts must be at least 1, got {0}")]
    Attempts(i32),
}

/// The spec patch of a retry of `job` that grants `more_attempts` (>= 1) failed attempts from
/// now: spec.cancel cleared and spec.maxAttempts raised to failures + `more_attempts` when it is
/// lower. None when the spec needs no change.
///
/// # Errors
/// [`NotRetryable`] when the job is not Failed or Cancelled, or `more_attempts` < 1.
pub fn spec_patch(
    job: &LeasedJob,
    more_attempts: i32,
) -> Result<Option<json_patch::Patch>, NotRetryable> {
    check(job, more_attempts)?;
    let failures = i32::try_from(job.failed_attempts()).unwrap_or(i32::MAX);
    let wanted = failures.saturating_add(more_attempts);
    let mut ops = vec![resource_version_test(job)];
    if job.spec.cancel {
        ops.push(json!({"op": "remove", "path": "/spec/cancel"}));
    }
    // A job that sets none gets its queue's default at its next claim, which may be lower
    // than what its last claim recorded: it sets its own from now on, at least `wanted`.
    match job.spec.max_attempts {
        Some(current) if current >= wanted => {}
        Some(_) => ops.push(json!({"op": "add", "path": "/spec/maxAttempts", "value": wanted})),
        None => {
            let value = wanted.max(job.policy().max_attempts);
            ops.push(json!({"op": "add", "path": "/spec/maxAttempts", "value": value}));
        }
    }
    if ops.len() == 1 {
        return Ok(None);
    }
    Ok(Some(
        serde_json::from_value(Value::Array(ops)).expect("static JSON Patch shape"),
    ))
}

/// The status patch of a retry of `job` (whose spec no longer cancels it) at `now`, by `who`
/// (shown in the condition's message): phase Queued, history kept (see the module doc).
///
/// # Errors
/// [`NotRetryable`] when the job is not Failed or Cancelled.
pub fn status_patch(
    job: &LeasedJob,
    now: Timestamp,
    who: &str,
) -> Result<json_patch::Patch, NotRetryable> {
    check(job, 1)?;
    let phase = job.phase();
    let status = job.status.clone().unwrap_or_default();
    let mut ops = vec![
        resource_version_test(job),
        json!({"op": "test", "path": "/status/phase", "value": phase}),
        json!({"op": "add", "path": "/status/phase", "value": Phase::Queued}),
    ];
    for (present, path) in [
        (status.finished_time.is_some(), "/status/finishedTime"),
        (status.retry_after.is_some(), "/status/retryAfter"),
        (status.result.is_some(), "/status/result"),
    ] {
        if present {
            ops.push(json!({"op": "remove", "path": path}));
        }
    }
    let mut conditions = status.conditions.clone();
    for c in conditions.iter_mut().filter(|c| {
        (c.type_ == CONDITION_FAILED || c.type_ == CONDITION_CANCELLED) && c.status == "True"
    }) {
        let mut message = format!(
            "retried by {who} after attempt {}; it was {phase} ({}: {})",
            job.attempt(),
            c.reason,
            c.message
        );
        if message.len() > MAX_CONDITION_MESSAGE {
            let mut cut = MAX_CONDITION_MESSAGE - 3;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str("...");
        }
        c.status = "False".to_string();
        c.reason = REASON_RETRIED.to_string();
        c.message = message;
        c.last_transition_time = Time(now);
    }
    if conditions != status.conditions {
        ops.push(json!({"op": "add", "path": "/status/conditions", "value": conditions}));
    }
    Ok(serde_json::from_value(Value::Array(ops)).expect("static JSON Patch shape"))
}

fn check(job: &LeasedJob, more_attempts: i32) -> Result<(), NotRetryable> {
    let phase = job.phase();
    let hint = match phase {
        Phase::Failed | Phase::Cancelled => "",
        Phase::Succeeded => "; create a new LeasedJob to run it again",
        Phase::Queued | Phase::Leased => "; it has not finished",
    };
    if !hint.is_empty() {
        return Err(NotRetryable::Phase {
            job: job.reference(),
            phase,
            hint,
        });
    }
    if more_attempts < 1 {
        return Err(NotRetryable::Attempts(more_attempts));
    }
    Ok(())
}

fn resource_version_test(job: &LeasedJob) -> Value {
    json!({
        "op": "test",
        "path": "/metadata/resourceVersion",
        "value": job.metadata.resource_version.clone().unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
    use leasehold_core::crd::{AttemptFailure, LeasedJobSpec, LeasedJobStatus};

    fn finished(phase: Phase, failures: usize, max_attempts: i32, cancel: bool) -> LeasedJob {
        let mut j = LeasedJob::new(
            "x",
            LeasedJobSpec {
                max_attempts: Some(max_attempts),
                cancel,
                ..Default::default()
            },
        );
        j.metadata.namespace = Some("ns".into());
        j.metadata.resource_version = Some("42".into());
        let failure = |attempt| AttemptFailure {
            attempt,
            holder: "pod-a".into(),
            reason: "Boom".into(),
            message: "m".into(),
            time: Time(Timestamp::UNIX_EPOCH),
        };
        j.status = Some(LeasedJobStatus {
            phase: Some(phase),
            attempt: i32::try_from(failures.max(1)).unwrap(),
            failures: (1..=failures)
                .map(|a| failure(i32::try_from(a).unwrap()))
                .collect(),
            finished_time: Some(Time(Timestamp::UNIX_EPOCH)),
            checkpoint: Some(json!({"offset": 7})),
            conditions: vec![Condition {
                type_: if phase == Phase::Cancelled {
                    CONDITION_CANCELLED
                } else {
                    CONDITION_FAILED
                }
                .into(),
                status: "True".into(),
                reason: "Boom".into(),
                message: "m".into(),
                last_transition_time: Time(Timestamp::UNIX_EPOCH),
                observed_generation: None,
            }],
            ..Default::default()
        });
        j
    }

    fn ops(p: &json_patch::Patch) -> Vec<Value> {
        serde_json::from_value(serde_json::to_value(p).unwrap()).unwrap()
    }

    #[test]
    fn only_failed_and_cancelled_jobs_are_retried() {
        for phase in [Phase::Queued, Phase::Leased, Phase::Succeeded] {
            let j = finished(phase, 0, 3, false);
            assert!(matches!(
                status_patch(&j, Timestamp::UNIX_EPOCH, "me"),
                Err(NotRetryable::Phase { .. })
            ));
            assert!(spec_patch(&j, 1).is_err());
        }
        let j = finished(Phase::Failed, 1, 3, false);
        assert_eq!(spec_patch(&j, 0), Err(NotRetryable::Attempts(0)));
    }

    #[test]
    fn the_spec_changes_only_when_it_must() {
        // Failed once, non-retryably, with attempts left: no spec write.
        assert_eq!(
            spec_patch(&finished(Phase::Failed, 1, 3, false), 1),
            Ok(None)
        );
        // Attempts exhausted: maxAttempts raised so the new attempt can fail and retry.
        let p = ops(&spec_patch(&finished(Phase::Failed, 3, 3, false), 2)
            .unwrap()
            .unwrap());
        assert_eq!(p[0]["path"], "/metadata/resourceVersion");
        assert_eq!(p[0]["value"], "42");
        assert_eq!(
            p[1],
            json!({"op": "add", "path": "/spec/maxAttempts", "value": 5})
        );
        // Cancelled: spec.cancel cleared first, else the controller cancels it again.
        let p = ops(&spec_patch(&finished(Phase::Cancelled, 0, 3, true), 1)
            .unwrap()
            .unwrap());
        assert_eq!(p[1], json!({"op": "remove", "path": "/spec/cancel"}));
        assert_eq!(p.len(), 2);
        // A job that sets none gets its queue's default at its next claim, which may be
        // lower than its last claim's: it is given its own, at least what its last claim had.
        let mut none = finished(Phase::Cancelled, 0, 3, false);
        none.spec.max_attempts = None;
        let p = ops(&spec_patch(&none, 1).unwrap().unwrap());
        assert_eq!(
            p[1],
            json!({"op": "add", "path": "/spec/maxAttempts", "value": 3})
        );
        let mut none = finished(Phase::Failed, 3, 3, false);
        none.spec.max_attempts = None;
        let p = ops(&spec_patch(&none, 2).unwrap().unwrap());
        assert_eq!(
            p[1],
            json!({"op": "add", "path": "/spec/maxAttempts", "value": 5})
        );
    }

    #[test]
    fn the_status_goes_back_to_queued_with_its_history() {
        let j = finished(Phase::Failed, 2, 3, false);
        let p = ops(&status_patch(&j, Timestamp::UNIX_EPOCH, "alice").unwrap());
        assert_eq!(p[0]["op"], "test");
        assert_eq!(p[0]["path"], "/metadata/resourceVersion");
        assert_eq!(
            p[1],
            json!({"op": "test", "path": "/status/phase", "value": "Failed"})
        );
        assert_eq!(
            p[2],
            json!({"op": "add", "path": "/status/phase", "value": "Queued"})
        );
        assert_eq!(
            p[3],
            json!({"op": "remove", "path": "/status/finishedTime"})
        );
        let conditions = &p[4]["value"];
        assert_eq!(conditions[0]["type"], "Failed");
        assert_eq!(conditions[0]["status"], "False");
        assert_eq!(conditions[0]["reason"], "Retried");
        assert!(conditions[0]["message"]
            .as_str()
            .unwrap()
            .starts_with("retried by alice after attempt 2; it was Failed (Boom: m)"));
        // Nothing touches failures, attempt, checkpoint, token or holder.
        let touched: Vec<&str> = p.iter().filter_map(|o| o["path"].as_str()).collect();
        for kept in ["failures", "attempt", "checkpoint", "token", "holder"] {
            assert!(
                !touched.iter().any(|t| t.ends_with(kept)),
                "{kept}: {touched:?}"
            );
        }
        // Applied to the job, the patch leaves a Queued job with its failures.
        let mut doc = serde_json::to_value(&j).unwrap();
        json_patch::patch(
            &mut doc,
            &status_patch(&j, Timestamp::UNIX_EPOCH, "a").unwrap(),
        )
        .unwrap();
        let after: LeasedJob = serde_json::from_value(doc).unwrap();
        assert_eq!(after.phase(), Phase::Queued);
        assert_eq!(after.failed_attempts(), 2);
        assert_eq!(after.attempt(), 2);
        assert_eq!(after.status.unwrap().finished_time, None);
    }
}
