//! Fencing: the conditional writes that end an attempt, and where a stale token is refused.
//!
//! Every write that ends an attempt — complete, fail, release by the holder, expiry by the
//! controller — is built as one JSON Patch on the LeasedJob's status subresource whose first
//! two operations `test` that `/status/token` is the attempt's token and `/status/phase` is
//! `Leased`. The API server applies a JSON Patch to the object it holds, atomically, so the
//! check and the write use the same snapshot: a token from an older attempt, or a result that
//! arrives after the controller requeued the job, is refused by the API server itself, whatever
//! the sidecar believed. (The fencing-token rule of distributed locking: the resource checks the
//! token on every write.) A holder may instead send the status that patch makes ([`patched`])
//! as a replace under the resourceVersion of a snapshot showing its attempt: refused with 409
//! if anything changed since, it fences at least as strictly.
//!
//! The patches are built by pure functions here; `leasehold_kube::fence::apply` sends one
//! and, when it is refused, [`refusal`] explains why from a fresh read, without ever revealing
//! the current token.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::{json, Value};
use thiserror::Error;

use crate::crd::{
    AttemptFailure, Backoff, LeasedJob, Phase, CONDITION_CANCELLED, CONDITION_COMPLETE,
    CONDITION_FAILED, CONDITION_LEASE_CONFLICT,
};
use crate::token::Token;
use crate::Category;

/// Reason recorded when the controller requeues a job whose lease expired.
pub const REASON_LEASE_EXPIRED: &str = "LeaseExpired";
/// Reason of the Failed condition when failed attempts used up maxAttempts.
pub const REASON_ATTEMPTS_EXHAUSTED: &str = "AttemptsExhausted";

/// How an attempt ends.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The worker finished: Succeeded with this result.
    Complete {
        /// Any JSON value.
        result: Value,
    },
    /// The attempt failed (a worker's report, or an expired lease). Requeued when `retryable`
    /// and failed attempts remain under maxAttempts, else Failed.
    Fail {
        /// Short CamelCase cause.
        reason: String,
        /// What happened.
        message: String,
        /// False ends the job now.
        retryable: bool,
        /// Progress to hand to the next attempt, if any.
        checkpoint: Option<Value>,
        /// The worker's own delay before the next attempt, in seconds, instead of the
        /// backoff's ([`requested_delay`]); None: the backoff's.
        retry_after_seconds: Option<u32>,
    },
    /// The holder gives the job back unfinished; it does not count as a failed attempt.
    Release {
        /// Progress to hand to the next attempt, if any.
        checkpoint: Option<Value>,
    },
    /// The claimer undoes a claim whose Lease it could not take (the Lease named `ljob-...`
    /// belongs to something else): Queued again, not a failed attempt, with the condition
    /// `LeaseConflict` saying why and `status.retryAfter` so that claimers do not spin on it.
    Unclaim {
        /// Short CamelCase cause, the condition's reason.
        reason: String,
        /// What is in the way and what to do, the condition's message.
        message: String,
        /// Not claimable before this time.
        retry_after: Timestamp,
    },
}

/// Why a write that names a job and a token was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No such LeasedJob.
    #[error("LeasedJob {job} not found")]
    NotFound {
        /// `namespace/name`.
        job: String,
    },
    /// The job is Succeeded or Failed: nothing changes it any more.
    #[error(
        "LeasedJob {job} is already {phase} (attempt {attempt}); nothing more can be written to it"
    )]
    Finished {
        /// `namespace/name`.
        job: String,
        /// Succeeded or Failed.
        phase: Phase,
        /// The attempt that finished it.
        attempt: i32,
    },
    /// The job was cancelled (spec.cancel).
    #[error("LeasedJob {job} was cancelled; stop working on it")]
    Cancelled {
        /// `namespace/name`.
        job: String,
    },
    /// The token is not the current holder's.
    #[error("lease lost: {job} {detail}; stop working on it and claim again")]
    LeaseLost {
        /// `namespace/name`.
        job: String,
        /// Which way the token is stale, without revealing the current one.
        detail: String,
    },
}

impl Category for Refusal {
    /// Stable error code, as the sidecar's HTTP API returns it.
    fn category(&self) -> &'static str {
        match self {
            Refusal::NotFound { .. } => "job_not_found",
            Refusal::Finished { .. } => "job_finished",
            Refusal::Cancelled { .. } => "cancelled",
            Refusal::LeaseLost { .. } => "lease_lost",
        }
    }
}

/// Explains why `presented` may not write to `job` (as freshly read), or `None` when it may:
/// the job is Leased and its token is `presented`.
pub fn refusal(job_ref: &str, job: Option<&LeasedJob>, presented: &Token) -> Option<Refusal> {
    let job_ref = job_ref.to_string();
    let Some(job) = job else {
        return Some(Refusal::NotFound { job: job_ref });
    };
    let phase = job.phase();
    let current = job.attempt();
    let ours = job.token() == Some(presented.as_str());
    if phase == Phase::Cancelled && (ours || presented.attempt() <= current) {
        return Some(Refusal::Cancelled { job: job_ref });
    }
    if phase.is_finished() && (ours || presented.attempt() <= current) {
        return Some(Refusal::Finished {
            job: job_ref,
            phase,
            attempt: current,
        });
    }
    if ours && phase == Phase::Leased {
        return None;
    }
    let detail = if ours {
        format!(
            "is {phase} again: attempt {current} ended (its lease expired or it was given back)"
        )
    } else if presented.attempt() < current {
        format!(
            "is on attempt {current}, your token is from attempt {}",
            presented.attempt()
        )
    } else {
        format!(
            "is on attempt {current}; the token presented is not the token of that attempt (is it another job's?)"
        )
    };
    Some(Refusal::LeaseLost {
        job: job_ref,
        detail,
    })
}

/// True when `job` (as freshly read) shows `outcome` already written for attempt `token`: a
/// retry of a write whose first try got through but whose answer was lost (a timeout). The
/// retry is then answered as the first try would have been, instead of as a stale token.
pub fn already_applied(job: &LeasedJob, token: &Token, outcome: &Outcome) -> bool {
    let Some(status) = job.status.as_ref() else {
        return false;
    };
    if job.token() != Some(token.as_str()) || job.phase() == Phase::Leased {
        return false;
    }
    let failed_here = status
        .failures
        .iter()
        .rfind(|f| f.attempt == token.attempt());
    match outcome {
        Outcome::Complete { result } => {
            job.phase() == Phase::Succeeded && status.result.as_ref() == Some(result)
        }
        Outcome::Fail {
            reason, message, ..
        } => failed_here.is_some_and(|f| f.reason == *reason && f.message == *message),
        Outcome::Release { .. } => job.phase() == Phase::Queued && failed_here.is_none(),
        Outcome::Unclaim { .. } => false,
    }
}

/// The phase an attempt's outcome leads to, given the failed attempts recorded before it and
/// maxAttempts (the number of failed attempts that ends the job).
pub fn next_phase(outcome: &Outcome, failures_before: usize, max_attempts: i32) -> Phase {
    match outcome {
        Outcome::Complete { .. } => Phase::Succeeded,
        Outcome::Release { .. } | Outcome::Unclaim { .. } => Phase::Queued,
        Outcome::Fail { retryable, .. } => {
            let failed = failures_before as i64 + 1;
            if *retryable && failed < i64::from(max_attempts) {
                Phase::Queued
            } else {
                Phase::Failed
            }
        }
    }
}

/// The delay before the next attempt after `failed` failed attempts (>= 1) under `backoff`:
/// `d = min(maxSeconds, initialSeconds * 2^(failed-1))`, then equal jitter: `d/2 + jitter *
/// d/2` with `jitter` in [0, 1] (AWS Architecture Blog, "Exponential Backoff And Jitter").
pub fn retry_delay(backoff: &Backoff, failed: usize, jitter: f64) -> SignedDuration {
    let initial = f64::from(backoff.initial_seconds.max(0));
    let max = f64::from(backoff.max_seconds.max(0));
    let exp = i32::try_from(failed.saturating_sub(1))
        .unwrap_or(i32::MAX)
        .min(62);
    let full = (initial * 2f64.powi(exp)).min(max);
    let secs = full / 2.0 + jitter.clamp(0.0, 1.0) * full / 2.0;
    SignedDuration::from_secs_f64(secs)
}

/// Largest delay a failure may ask for, in seconds (one day): `retryAfterSeconds` of the
/// sidecar's fail call.
pub const MAX_RETRY_AFTER_SECONDS: u32 = 86_400;
/// The cap of a failure's own delay for a job whose policy has no backoff, in seconds (one
/// hour): such a job is otherwise claimable again at once, and a worker asking for a delay
/// (a vendor's `Retry-After`) should get it, within reason.
pub const NO_BACKOFF_RETRY_AFTER_CAP_SECONDS: u32 = 3_600;

/// The delay a failure that asked for `seconds` gets under `backoff`: the request, capped at
/// `backoff.maxSeconds` (the longest the job's own policy ever waits), or at
/// [`NO_BACKOFF_RETRY_AFTER_CAP_SECONDS`] without a backoff. A worker may ask for less than
/// the backoff would wait (it knows when its dependency recovers), never for more than the
/// policy allows, so a job's owner keeps the bound on how long a retry can be put off.
pub fn requested_delay(backoff: Option<&Backoff>, seconds: u32) -> SignedDuration {
    let cap = backoff.map_or(NO_BACKOFF_RETRY_AFTER_CAP_SECONDS, |b| {
        u32::try_from(b.max_seconds.max(0)).unwrap_or(0)
    });
    SignedDuration::from_secs(i64::from(seconds.min(cap)))
}

/// `t` rounded up to a whole second: metav1.Time keeps seconds only, and a retryAfter rounded
/// down would let a job be claimed before its backoff ran out.
fn ceil_to_second(t: Timestamp) -> Timestamp {
    let secs = t.as_second() + i64::from(t.subsec_nanosecond() > 0);
    Timestamp::from_second(secs).unwrap_or(t)
}

/// The JSON Patch that ends attempt `token` of `job` with `outcome`, made by `holder` at `now`.
/// Its first operations test the token and the Leased phase; the token and holder themselves
/// stay (they name the latest attempt's owner), and attempt is never touched. Whether a
/// failure requeues or ends the job, and its backoff, follow the policy the attempt's claim
/// recorded ([`LeasedJob::policy`]: maxAttempts and backoff from the spec, else the queue's
/// defaults). A failure that requeues a job sets status.retryAfter to now plus its own
/// delay when it asked for one ([`requested_delay`]; none for 0), else, with a backoff, the
/// backoff's ([`retry_delay`] with `jitter` in [0, 1]).
pub fn end_attempt_patch(
    job: &LeasedJob,
    token: &Token,
    holder: &str,
    outcome: &Outcome,
    now: Timestamp,
    jitter: f64,
) -> json_patch::Patch {
    let failures_before = job.failed_attempts();
    let policy = job.policy();
    let phase = next_phase(outcome, failures_before, policy.max_attempts);
    let time = Time(now);
    let mut ops = vec![
        json!({"op": "test", "path": "/status/token", "value": token.as_str()}),
        json!({"op": "test", "path": "/status/phase", "value": Phase::Leased}),
        json!({"op": "add", "path": "/status/phase", "value": phase}),
    ];
    let mut conditions = job
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    // An attempt that got its Lease and ended is past any earlier Lease conflict.
    let had_conflict = conditions
        .iter()
        .any(|c| c.type_ == CONDITION_LEASE_CONFLICT);
    conditions.retain(|c| c.type_ != CONDITION_LEASE_CONFLICT);
    match outcome {
        Outcome::Complete { result } => {
            ops.push(json!({"op": "add", "path": "/status/result", "value": result}));
        }
        Outcome::Fail {
            reason,
            message,
            checkpoint,
            retry_after_seconds,
            ..
        } => {
            let failure = AttemptFailure {
                attempt: token.attempt(),
                holder: holder.to_string(),
                reason: reason.clone(),
                message: message.clone(),
                time: time.clone(),
            };
            // `/status/failures/-` appends; the array may not exist yet, so write it whole.
            let mut failures = job
                .status
                .as_ref()
                .map(|s| s.failures.clone())
                .unwrap_or_default();
            failures.push(failure);
            ops.push(json!({"op": "add", "path": "/status/failures", "value": failures}));
            if let Some(c) = checkpoint {
                ops.push(json!({"op": "add", "path": "/status/checkpoint", "value": c}));
            }
            let delay = match (retry_after_seconds, &policy.backoff) {
                (Some(seconds), backoff) => Some(requested_delay(backoff.as_ref(), *seconds)),
                (None, Some(backoff)) => Some(retry_delay(backoff, failures_before + 1, jitter)),
                (None, None) => None,
            };
            if let (Phase::Queued, Some(delay)) = (phase, delay.filter(|d| d.is_positive())) {
                let at = Time(ceil_to_second(now + delay));
                ops.push(json!({"op": "add", "path": "/status/retryAfter", "value": at}));
            }
        }
        Outcome::Release { checkpoint } => {
            if let Some(c) = checkpoint {
                ops.push(json!({"op": "add", "path": "/status/checkpoint", "value": c}));
            }
        }
        Outcome::Unclaim {
            reason,
            message,
            retry_after,
        } => {
            let at = Time(ceil_to_second(*retry_after));
            ops.push(json!({"op": "add", "path": "/status/retryAfter", "value": at}));
            conditions.push(Condition {
                type_: CONDITION_LEASE_CONFLICT.to_string(),
                status: "True".to_string(),
                reason: condition_reason(reason),
                message: message.clone(),
                last_transition_time: time.clone(),
                observed_generation: job.metadata.generation,
            });
        }
    }
    if !phase.is_finished() && (had_conflict || matches!(outcome, Outcome::Unclaim { .. })) {
        ops.push(json!({"op": "add", "path": "/status/conditions", "value": conditions}));
    }
    if phase.is_finished() {
        ops.push(json!({"op": "add", "path": "/status/finishedTime", "value": time}));
        let (kind, reason, message) = match outcome {
            Outcome::Complete { .. } => (
                CONDITION_COMPLETE,
                "Succeeded".to_string(),
                format!("attempt {} completed", token.attempt()),
            ),
            Outcome::Fail {
                reason,
                message,
                retryable,
                ..
            } => {
                if *retryable {
                    (
                        CONDITION_FAILED,
                        REASON_ATTEMPTS_EXHAUSTED.to_string(),
                        format!(
                            "{} failed attempts reached maxAttempts {}; the last: {reason}: {message}",
                            failures_before + 1,
                            policy.max_attempts
                        ),
                    )
                } else {
                    (CONDITION_FAILED, reason.clone(), message.clone())
                }
            }
            Outcome::Release { .. } | Outcome::Unclaim { .. } => {
                unreachable!("a release never finishes a job")
            }
        };
        conditions.retain(|c| c.type_ != CONDITION_COMPLETE && c.type_ != CONDITION_FAILED);
        conditions.push(Condition {
            type_: kind.to_string(),
            status: "True".to_string(),
            reason: condition_reason(&reason),
            message,
            last_transition_time: time,
            observed_generation: job.metadata.generation,
        });
        ops.push(json!({"op": "add", "path": "/status/conditions", "value": conditions}));
    }
    serde_json::from_value(Value::Array(ops)).expect("static JSON Patch shape")
}

/// `job` as the API server would store it after `patch` (an [`end_attempt_patch`] of it),
/// applied here to the same snapshot: what a status replace under the snapshot's
/// resourceVersion sends instead of the patch. The replace is refused with 409 if anything at
/// all changed since the snapshot, a stronger condition than the patch's `test` operations, so
/// it fences the attempt as well and ends it with the same status.
///
/// Returns None when a `test` operation fails on the snapshot (it does not show the attempt
/// holding the job) or the result is no LeasedJob.
pub fn patched(job: &LeasedJob, patch: &json_patch::Patch) -> Option<LeasedJob> {
    let mut doc = serde_json::to_value(job).ok()?;
    json_patch::patch(&mut doc, patch).ok()?;
    serde_json::from_value(doc).ok()
}

/// The JSON Patch that cancels `job` (spec.cancel): Cancelled, finishedTime, and the condition
/// `Cancelled`. Conditional on what the snapshot shows: for a Leased job, its token and phase
/// (so a result that lands first stands); for a Queued job, the phase and attempt (so a claim
/// that lands first wins, and the cancel is judged again against the Leased job).
pub fn cancel_patch(job: &LeasedJob, now: Timestamp) -> json_patch::Patch {
    let time = Time(now);
    let mut ops = match (job.phase(), job.token()) {
        (Phase::Leased, Some(token)) => vec![
            json!({"op": "test", "path": "/status/token", "value": token}),
            json!({"op": "test", "path": "/status/phase", "value": Phase::Leased}),
        ],
        _ => vec![
            json!({"op": "test", "path": "/status/phase", "value": job.phase()}),
            json!({"op": "test", "path": "/status/attempt", "value": job.attempt()}),
        ],
    };
    let mut conditions = job
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    conditions.retain(|c| c.type_ != CONDITION_CANCELLED);
    conditions.push(Condition {
        type_: CONDITION_CANCELLED.to_string(),
        status: "True".to_string(),
        reason: "Cancelled".to_string(),
        message: format!("spec.cancel was set; cancelled in phase {}", job.phase()),
        last_transition_time: time.clone(),
        observed_generation: job.metadata.generation,
    });
    ops.push(json!({"op": "add", "path": "/status/phase", "value": Phase::Cancelled}));
    ops.push(json!({"op": "add", "path": "/status/finishedTime", "value": time}));
    ops.push(json!({"op": "add", "path": "/status/conditions", "value": conditions}));
    serde_json::from_value(Value::Array(ops)).expect("static JSON Patch shape")
}

/// A condition reason must match `^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`; worker reasons are
/// checked before they get here, this only guards the shape.
fn condition_reason(reason: &str) -> String {
    let cleaned: String = reason
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    match cleaned.chars().next() {
        Some(c) if c.is_ascii_alphabetic() => cleaned,
        _ => format!("Reason{cleaned}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{LeasedJobSpec, LeasedJobStatus};

    fn job(phase: Phase, attempt: i32, token: Option<&Token>, failures: usize) -> LeasedJob {
        let mut j = LeasedJob::new("j", LeasedJobSpec::default());
        j.status = Some(LeasedJobStatus {
            phase: Some(phase),
            attempt,
            token: token.map(|t| t.as_str().to_string()),
            failures: (0..failures)
                .map(|i| AttemptFailure {
                    attempt: i as i32 + 1,
                    holder: "w".into(),
                    reason: "X".into(),
                    message: String::new(),
                    time: Time(Timestamp::UNIX_EPOCH),
                })
                .collect(),
            ..Default::default()
        });
        j
    }

    #[test]
    fn refusals_name_the_cause_and_never_the_current_token() {
        let t1 = Token::issue(1);
        let t2 = Token::issue(2);
        let other2 = Token::issue(2);
        let cases: Vec<(LeasedJob, &Token, Option<&str>)> = vec![
            (job(Phase::Leased, 2, Some(&t2), 1), &t2, None),
            (job(Phase::Leased, 2, Some(&t2), 1), &t1, Some("lease_lost")),
            (
                job(Phase::Leased, 2, Some(&t2), 1),
                &other2,
                Some("lease_lost"),
            ),
            (job(Phase::Queued, 2, Some(&t2), 1), &t2, Some("lease_lost")),
            (
                job(Phase::Succeeded, 2, Some(&t2), 1),
                &t2,
                Some("job_finished"),
            ),
            (
                job(Phase::Failed, 2, Some(&t2), 1),
                &t1,
                Some("job_finished"),
            ),
            (job(Phase::Leased, 1, Some(&t1), 0), &t2, Some("lease_lost")),
        ];
        for (j, presented, want) in cases {
            let got = refusal("ns/j", Some(&j), presented);
            assert_eq!(
                got.as_ref().map(Refusal::category),
                want,
                "{j:?} {presented:?}"
            );
            if let Some(r) = got {
                let msg = r.to_string();
                assert!(
                    !msg.contains(t2.as_str()) && !msg.contains(other2.as_str()),
                    "{msg}"
                );
                assert!(msg.contains("ns/j"), "{msg}");
            }
        }
        let stale = refusal("ns/j", Some(&job(Phase::Leased, 2, Some(&t2), 1)), &t1).unwrap();
        assert_eq!(
            stale.to_string(),
            "lease lost: ns/j is on attempt 2, your token is from attempt 1; stop working on it and claim again"
        );
        assert_eq!(
            refusal("ns/j", None, &t1).unwrap().category(),
            "job_not_found"
        );
    }

    #[test]
    fn backoff_doubles_up_to_its_maximum_with_equal_jitter() {
        let b = Backoff {
            initial_seconds: 2,
            max_seconds: 30,
        };
        let secs = |failed, jitter| retry_delay(&b, failed, jitter).as_secs_f64();
        let cases = [
            (1, 0.0, 1.0),
            (1, 1.0, 2.0),
            (2, 1.0, 4.0),
            (3, 0.5, 6.0),
            (4, 1.0, 16.0),
            (5, 1.0, 30.0),
            (5, 0.0, 15.0),
            (200, 1.0, 30.0),
        ];
        for (failed, jitter, want) in cases {
            assert!(
                (secs(failed, jitter) - want).abs() < 1e-9,
                "{failed} {jitter}: {}",
                secs(failed, jitter)
            );
        }
        assert_eq!(
            ceil_to_second(Timestamp::from_second(5).unwrap()),
            Timestamp::from_second(5).unwrap()
        );
        let t = Timestamp::from_second(5).unwrap() + SignedDuration::from_millis(1);
        assert_eq!(ceil_to_second(t), Timestamp::from_second(6).unwrap());
    }

    #[test]
    fn a_retryable_failure_with_backoff_sets_retry_after() {
        let t = Token::issue(1);
        let mut j = job(Phase::Leased, 1, Some(&t), 0);
        j.spec.backoff = Some(Backoff {
            initial_seconds: 10,
            max_seconds: 60,
        });
        let fail = Outcome::Fail {
            reason: "R".into(),
            message: String::new(),
            retryable: true,
            checkpoint: None,
            retry_after_seconds: None,
        };
        let now = Timestamp::from_second(100).unwrap();
        let p = serde_json::to_value(end_attempt_patch(&j, &t, "w", &fail, now, 1.0)).unwrap();
        let retry = p
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["path"] == "/status/retryAfter")
            .unwrap();
        assert_eq!(retry["value"], "1970-01-01T00:01:50Z");
        // Without backoff, or when the job ends, there is no retryAfter.
        j.spec.backoff = None;
        let p = serde_json::to_value(end_attempt_patch(&j, &t, "w", &fail, now, 1.0)).unwrap();
        assert!(!p.to_string().contains("retryAfter"));
    }

    #[test]
    fn a_failure_may_ask_for_its_own_delay_within_the_backoff() {
        let t = Token::issue(1);
        let mut j = job(Phase::Leased, 1, Some(&t), 0);
        let fail = |seconds| Outcome::Fail {
            reason: "R".into(),
            message: String::new(),
            retryable: true,
            checkpoint: None,
            retry_after_seconds: Some(seconds),
        };
        let now = Timestamp::from_second(100).unwrap();
        let retry_after = |j: &LeasedJob, seconds| {
            let p = serde_json::to_value(end_attempt_patch(j, &t, "w", &fail(seconds), now, 1.0))
                .unwrap();
            p.as_array()
                .unwrap()
                .iter()
                .find(|o| o["path"] == "/status/retryAfter")
                .map(|o| o["value"].as_str().unwrap().to_string())
        };
        // Without a backoff: the request, up to an hour; 0 is claimable at once.
        assert_eq!(retry_after(&j, 30).as_deref(), Some("1970-01-01T00:02:10Z"));
        assert_eq!(retry_after(&j, 0), None);
        assert_eq!(
            retry_after(&j, MAX_RETRY_AFTER_SECONDS).as_deref(),
            Some("1970-01-01T01:01:40Z")
        );
        // With one: the request replaces the backoff's delay (less is fine), capped at
        // maxSeconds.
        j.spec.backoff = Some(Backoff {
            initial_seconds: 10,
            max_seconds: 60,
        });
        assert_eq!(retry_after(&j, 2).as_deref(), Some("1970-01-01T00:01:42Z"));
        assert_eq!(
            retry_after(&j, 600).as_deref(),
            Some("1970-01-01T00:02:40Z")
        );
        // A failure that ends the job sets none.
        j.spec.max_attempts = Some(1);
        assert_eq!(retry_after(&j, 30), None);
    }

    #[test]
    fn a_failure_follows_the_policy_its_claim_recorded_not_the_spec() {
        let t = Token::issue(1);
        let mut j = job(Phase::Leased, 1, Some(&t), 0);
        j.spec.max_attempts = Some(5);
        j.status.as_mut().unwrap().policy = Some(crate::policy::Policy {
            lease_duration_seconds: 60,
            max_attempts: 2,
            backoff: Some(Backoff {
                initial_seconds: 10,
                max_seconds: 10,
            }),
        });
        let fail = Outcome::Fail {
            reason: "R".into(),
            message: String::new(),
            retryable: true,
            checkpoint: None,
            retry_after_seconds: None,
        };
        let now = Timestamp::from_second(100).unwrap();
        // The first of 2 failed attempts requeues, after the recorded backoff.
        let p = serde_json::to_value(end_attempt_patch(&j, &t, "w", &fail, now, 1.0)).unwrap();
        assert!(p.to_string().contains("1970-01-01T00:01:50Z"), "{p}");
        // The second ends it, though the spec would allow 5.
        j.status.as_mut().unwrap().failures.push(AttemptFailure {
            attempt: 0,
            holder: "w".into(),
            reason: "R".into(),
            message: String::new(),
            time: Time(now),
        });
        let p = serde_json::to_value(end_attempt_patch(&j, &t, "w", &fail, now, 1.0)).unwrap();
        assert!(p.to_string().contains("reached maxAttempts 2"), "{p}");
    }

    #[test]
    fn a_cancel_is_conditional_on_what_was_seen() {
        let t = Token::issue(2);
        let leased = serde_json::to_value(cancel_patch(
            &job(Phase::Leased, 2, Some(&t), 0),
            Timestamp::UNIX_EPOCH,
        ))
        .unwrap();
        assert_eq!(
            leased[0],
            json!({"op": "test", "path": "/status/token", "value": t.as_str()})
        );
        assert_eq!(
            leased[1],
            json!({"op": "test", "path": "/status/phase", "value": "Leased"})
        );
        let queued = serde_json::to_value(cancel_patch(
            &job(Phase::Queued, 2, Some(&t), 0),
            Timestamp::UNIX_EPOCH,
        ))
        .unwrap();
        assert_eq!(
            queued[0],
            json!({"op": "test", "path": "/status/phase", "value": "Queued"})
        );
        assert_eq!(
            queued[1],
            json!({"op": "test", "path": "/status/attempt", "value": 2})
        );
        assert!(queued.to_string().contains("\"Cancelled\""));
        assert_eq!(
            refusal("ns/j", Some(&job(Phase::Cancelled, 2, Some(&t), 0)), &t)
                .unwrap()
                .category(),
            "cancelled"
        );
    }

    #[test]
    fn phase_after_each_outcome() {
        let fail = |retryable| Outcome::Fail {
            reason: "R".into(),
            message: "m".into(),
            retryable,
            checkpoint: None,
            retry_after_seconds: None,
        };
        let done = Outcome::Complete { result: json!(1) };
        let release = Outcome::Release { checkpoint: None };
        let cases = [
            (&done, 0, 3, Phase::Succeeded),
            (&release, 2, 3, Phase::Queued),
            (&fail(true), 0, 3, Phase::Queued),
            (&fail(true), 1, 3, Phase::Queued),
            (&fail(true), 2, 3, Phase::Failed),
            (&fail(true), 0, 1, Phase::Failed),
            (&fail(false), 0, 3, Phase::Failed),
        ];
        for (outcome, before, max, want) in cases {
            assert_eq!(
                next_phase(outcome, before, max),
                want,
                "{outcome:?} {before} {max}"
            );
        }
    }

    #[test]
    fn patched_ends_the_snapshot_only_while_it_shows_the_attempt() {
        let t = Token::issue(2);
        let held = job(Phase::Leased, 2, Some(&t), 1);
        let done = Outcome::Complete {
            result: json!({"words": 3}),
        };
        let patch = end_attempt_patch(&held, &t, "w", &done, Timestamp::UNIX_EPOCH, 0.5);
        let ended = patched(&held, &patch).expect("the snapshot shows the attempt");
        assert_eq!(ended.phase(), Phase::Succeeded);
        assert!(already_applied(&ended, &t, &done));
        let status = ended.status.as_ref().unwrap();
        assert_eq!(status.result, Some(json!({"words": 3})));
        assert_eq!(status.failures.len(), 1, "earlier failures are kept");
        assert_eq!(
            (status.attempt, status.token.as_deref()),
            (2, Some(t.as_str()))
        );

        let newer = Token::issue(3);
        let requeued = job(Phase::Leased, 3, Some(&newer), 2);
        assert!(
            patched(&requeued, &patch).is_none(),
            "another token fails the test"
        );
        let queued = job(Phase::Queued, 2, Some(&t), 2);
        assert!(
            patched(&queued, &patch).is_none(),
            "another phase fails the test"
        );
    }

    #[test]
    fn every_patch_tests_token_and_phase_first() {
        let t = Token::issue(2);
        let j = job(Phase::Leased, 2, Some(&t), 2);
        let outcomes = [
            Outcome::Complete {
                result: json!({"a": [1, "ü"]}),
            },
            Outcome::Release {
                checkpoint: Some(json!({"offset": 3})),
            },
            Outcome::Fail {
                reason: "LeaseExpired".into(),
                message: "m".into(),
                retryable: true,
                checkpoint: None,
                retry_after_seconds: None,
            },
        ];
        for o in &outcomes {
            let p = serde_json::to_value(end_attempt_patch(
                &j,
                &t,
                "w",
                o,
                Timestamp::UNIX_EPOCH,
                0.5,
            ))
            .unwrap();
            assert_eq!(
                p[0],
                json!({"op": "test", "path": "/status/token", "value": t.as_str()})
            );
            assert_eq!(
                p[1],
                json!({"op": "test", "path": "/status/phase", "value": "Leased"})
            );
            let touched: Vec<&str> = p
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o["path"].as_str().unwrap())
                .collect();
            assert!(!touched.contains(&"/status/attempt"), "{touched:?}");
        }
        // The third failure of a maxAttempts-3 job ends it Failed, with a condition saying why.
        let p = serde_json::to_value(end_attempt_patch(
            &j,
            &t,
            "w",
            &outcomes[2],
            Timestamp::UNIX_EPOCH,
            0.5,
        ))
        .unwrap();
        let ops = p.as_array().unwrap();
        assert!(ops
            .iter()
            .any(|o| o["path"] == "/status/phase" && o["value"] == "Failed"));
        let cond = ops
            .iter()
            .find(|o| o["path"] == "/status/conditions")
            .unwrap();
        assert_eq!(cond["value"][0]["reason"], "AttemptsExhausted");
        assert!(cond["value"][0]["message"]
            .as_str()
            .unwrap()
            .contains("LeaseExpired"));
        let failures = ops
            .iter()
            .find(|o| o["path"] == "/status/failures")
            .unwrap();
        assert_eq!(failures["value"].as_array().unwrap().len(), 3);
    }
}
