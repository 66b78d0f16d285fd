//! Ending attempts: complete, fail and release, the undo of a claim whose Lease could not be
//! taken, and a shutdown's drain and release of everything still held.
//!
//! An end is one status replace under the resourceVersion of the snapshot in which this
//! process saw its attempt hold the job, or, when that snapshot is stale, one JSON Patch on
//! the job's status that tests the token and the Leased phase
//! ([`leasehold_kube::fence::apply_from`]); a stale token is refused by the API server, or
//! before any write when the job read shows it. The Lease is left as it is: the job's status
//! fences the ended attempt, and this process remembers it
//! ([`Inner::ended_here`](crate::Inner::ended_here)) so that a later heartbeat with its token is refused.
//!
//! The rules: docs/protocol.md, "Phases" (the table), "What fences what", "Retries, delayed
//! start, cancellation, cleanup" and "Shutting a worker pod down".

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::runtime::reflector::ObjectRef;
use kube::ResourceExt;
use serde_json::Value;
use tokio::time::Instant;
use tracing::{info, warn};

use leasehold_core::crd::LeasedJob;
use leasehold_core::fence::{self, Outcome, Refusal};
use leasehold_core::lease;
use leasehold_core::token::Token;
use leasehold_core::Category;
use leasehold_kube::api::{error_chain, is_too_large};
use leasehold_kube::fence::FenceError;
use leasehold_kube::lease::LeaseError;

use crate::renew::mark_ended;
use crate::{
    lost_message, Claimed, Held, Worker, WorkerError, FOREIGN_LEASE_RETRY, MAX_CALL_BOUND,
    MAX_MESSAGE_BYTES, STALE_LEASE_RETRY,
};

/// At most this many attempts ended by this process are remembered (one per job name, the
/// latest); past it the memory starts over and the watch cache and fresh reads answer alone.
pub(crate) const MAX_ENDED: usize = 10_000;

impl Worker {
    /// Waits until no attempt is held, for at most `timeout`. True when none is.
    pub async fn drained(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let ended = self.inner.ended.notified();
            if self.held_count() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                return self.held_count() == 0;
            }
        }
    }

    /// Releases every attempt still held (with its last checkpoint), so that each job is
    /// requeued at once. Only for when the worker is known to have stopped. Returns how many
    /// were released.
    pub async fn release_all(&self) -> usize {
        let held: Vec<(String, Token)> = self
            .inner
            .held
            .lock()
            .unwrap()
            .iter()
            .map(|(name, h)| (name.clone(), h.token.clone()))
            .collect();
        let mut released = 0;
        for (name, token) in held {
            match self.release(&name, token.as_str()).await {
                Ok(_) => released += 1,
                Err(e) => {
                    warn!(job = %self.job_ref(&name), error = %e, "Release at shutdown failed")
                }
            }
        }
        released
    }

    /// Undoes the claim of `job` with `token` that could not get its Lease: `outcome` is a
    /// release or an [`Outcome::Unclaim`], fenced by the token like any end of an attempt.
    pub(crate) async fn undo_claim(&self, job: &LeasedJob, token: &Token, outcome: Outcome) {
        let (job_ref, name) = (job.reference(), job.name_any());
        let undo = leasehold_kube::fence::apply_from(
            &self.inner.jobs,
            &self.inner.config.namespace,
            &name,
            token,
            &outcome,
            Some(job),
        );
        match tokio::time::timeout(MAX_CALL_BOUND, undo).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                warn!(job = %job_ref, error = %error_chain(&e), "Giving back the claim of LeasedJob {job_ref} failed; its lease will expire")
            }
            Err(_) => {
                warn!(job = %job_ref, "Giving back the claim of LeasedJob {job_ref} got no answer in time; its lease will expire")
            }
        }
    }

    /// Undoes the claim of `job` whose Lease name is taken by something else (`conflict`, a
    /// [`LeaseError::NotOurs`]): a release that sets the condition `LeaseConflict` and
    /// `status.retryAfter` ([`STALE_LEASE_RETRY`] for a leftover of an earlier job of the same
    /// name, else [`FOREIGN_LEASE_RETRY`]), so the job waits and is not counted as failed.
    /// Returns what the worker is told.
    pub(crate) async fn undo_for_conflict(
        &self,
        job: &LeasedJob,
        token: &Token,
        conflict: &LeaseError,
    ) -> String {
        let stale = matches!(conflict, LeaseError::NotOurs { stale: true, .. });
        let (reason, after) = if stale {
            ("StaleLease", STALE_LEASE_RETRY)
        } else {
            ("LeaseNotOurs", FOREIGN_LEASE_RETRY)
        };
        let identity = &self.inner.config.identity;
        let message = format!(
            "{conflict}; the claim by {identity} was undone (not a failed attempt) and the job is retried after {}s",
            after.as_secs()
        );
        let outcome = Outcome::Unclaim {
            reason: reason.to_string(),
            message: message.clone(),
            retry_after: Timestamp::now() + SignedDuration::try_from(after).unwrap_or_default(),
        };
        self.undo_claim(job, token, outcome).await;
        let job_ref = job.reference();
        warn!(job = %job_ref, attempt = token.attempt(), error = %error_chain(conflict), "Gave the claim of LeasedJob {job_ref} back: its Lease could not be taken");
        lost_message(&job_ref, &message)
    }

    /// Gives back a claim whose claimer went away before it was answered (its HTTP client
    /// disconnected, or timed out): a release, so the job is claimable again at once and the
    /// attempt does not count as failed.
    pub async fn give_back(&self, claimed: &Claimed) {
        let job_ref = self.job_ref(&claimed.name);
        match self.release(&claimed.name, claimed.token.as_str()).await {
            Ok(_) => {
                info!(job = %job_ref, attempt = claimed.attempt, "Released LeasedJob {job_ref}: the claimer went away before the claim was answered")
            }
            Err(e) => {
                warn!(job = %job_ref, error = %e, "Releasing LeasedJob {job_ref} after its claimer went away failed; its lease will expire")
            }
        }
    }

    /// Completes the attempt with `result`: Succeeded, if and only if the API server still
    /// shows this token as the holder of a Leased job. The Lease is left as it is (the job's
    /// status fences the ended attempt; see the module doc).
    ///
    /// # Errors
    /// As [`Worker::heartbeat`], plus [`Refusal::Finished`] for a job already finished.
    pub async fn complete(
        &self,
        name: &str,
        token: &str,
        result: Value,
    ) -> Result<LeasedJob, WorkerError> {
        self.end_attempt(name, token, false, |_| Outcome::Complete { result })
            .await
    }

    /// Reports a failed attempt. `reason` is a short CamelCase word (`^[A-Za-z][A-Za-z0-9]*$`,
    /// at most 64 characters), `message` at most [`MAX_MESSAGE_BYTES`]. Requeues when
    /// `retryable` and failed attempts remain under maxAttempts (handing the last checkpoint to
    /// the next attempt); otherwise the job ends Failed. `retry_after_seconds` (0 to
    /// [`fence::MAX_RETRY_AFTER_SECONDS`], retryable failures only) replaces the backoff's
    /// delay before the next attempt, capped by the job's policy
    /// ([`fence::requested_delay`]).
    ///
    /// # Errors
    /// [`WorkerError::Invalid`] for a bad reason, message or retry delay; otherwise as
    /// [`Worker::complete`].
    pub async fn fail(
        &self,
        name: &str,
        token: &str,
        reason: &str,
        message: &str,
        retryable: bool,
        retry_after_seconds: Option<u32>,
    ) -> Result<LeasedJob, WorkerError> {
        validate_reason(reason)?;
        if let Some(seconds) = retry_after_seconds {
            if !retryable {
                return Err(WorkerError::Invalid {
                    field: "retryAfterSeconds",
                    problem: "is given for a failure that is not retryable: only a retryable failure is retried".into(),
                });
            }
            if seconds > fence::MAX_RETRY_AFTER_SECONDS {
                return Err(WorkerError::Invalid {
                    field: "retryAfterSeconds",
                    problem: format!(
                        "{seconds} is out of range: at most {} seconds (one day)",
                        fence::MAX_RETRY_AFTER_SECONDS
                    ),
                });
            }
        }
        if message.len() > MAX_MESSAGE_BYTES {
            return Err(WorkerError::Invalid {
                field: "message",
                problem: format!(
                    "is {} bytes; at most {MAX_MESSAGE_BYTES} are accepted",
                    message.len()
                ),
            });
        }
        let (reason, message) = (reason.to_string(), message.to_string());
        self.end_attempt(name, token, true, move |checkpoint| Outcome::Fail {
            reason,
            message,
            retryable,
            checkpoint,
            retry_after_seconds,
        })
        .await
    }

    /// Gives the job back to the queue now, with the last checkpoint; not a failed attempt.
    ///
    /// # Errors
    /// As [`Worker::complete`].
    pub async fn release(&self, name: &str, token: &str) -> Result<LeasedJob, WorkerError> {
        self.end_attempt(name, token, true, |checkpoint| Outcome::Release {
            checkpoint,
        })
        .await
    }

    /// Ends an attempt with the outcome `outcome` builds from the newest checkpoint (`None`
    /// when `outcome` does not carry one, i.e. a completion).
    async fn end_attempt(
        &self,
        name: &str,
        token: &str,
        carries_checkpoint: bool,
        outcome: impl FnOnce(Option<Value>) -> Outcome + Send + 'static,
    ) -> Result<LeasedJob, WorkerError> {
        let (me, n, t) = (self.clone(), name.to_string(), token.to_string());
        let what = if carries_checkpoint {
            "end of attempt"
        } else {
            "completion"
        };
        self.bounded(name, what, async move {
            me.end_attempt_inner(&n, &t, carries_checkpoint, outcome)
                .await
        })
        .await
        .map_err(|e| self.counted(e))
    }

    /// The newest checkpoint of attempt `token`: the one this process last wrote, else the one
    /// its Lease holds (this process may have restarted since the heartbeat that wrote it). A
    /// Lease that no longer names the token holds no checkpoint of this attempt.
    async fn newest_checkpoint(
        &self,
        name: &str,
        token: &Token,
        held: Option<&Arc<Held>>,
    ) -> Option<Value> {
        if let Some(h) = held {
            let st = h.state.lock().unwrap();
            if st.checkpoint.is_some() || !st.first_renewal_sent {
                // The worker's latest, or none: no Lease of this attempt was written yet.
                return st.checkpoint.clone();
            }
        }
        match self.inner.leases.get_opt(&lease::lease_name(name)).await {
            Ok(Some(l)) if lease::holder_identity(&l) == Some(token.as_str()) => {
                lease::checkpoint(&l)
            }
            Ok(_) => None,
            Err(e) => {
                warn!(job = %self.job_ref(name), error = %error_chain(&e), "Reading the Lease's checkpoint failed; ending the attempt without it");
                None
            }
        }
    }

    async fn end_attempt_inner(
        &self,
        name: &str,
        token: &str,
        carries_checkpoint: bool,
        outcome: impl FnOnce(Option<Value>) -> Outcome,
    ) -> Result<LeasedJob, WorkerError> {
        let token = Token::parse(token)?;
        let held = self.held_for(name, &token)?;
        let checkpoint = if carries_checkpoint {
            self.newest_checkpoint(name, &token, held.as_ref()).await
        } else {
            None
        };
        let outcome = outcome(checkpoint);
        let ns = &self.inner.config.namespace;
        let cached = self
            .inner
            .held_watch
            .store
            .get(&ObjectRef::new(name).within(ns));
        // The watch cache once it shows this attempt (it may be newer than the claim), else
        // the claim's own answer; either way the write is conditional on that snapshot's
        // version, and a stale snapshot costs a refused write, a read and the patch that
        // tests the token and phase.
        let snapshot = match (&cached, held.as_ref().and_then(|h| h.claimed.as_ref())) {
            (Some(c), _) if c.token() == Some(token.as_str()) => Some(&**c),
            (_, Some(answer)) => Some(answer),
            (c, None) => c.as_deref(),
        };
        let job = match leasehold_kube::fence::apply_from(&self.inner.jobs, ns, name, &token, &outcome, snapshot)
        .await
        {
            Ok(job) => job,
            Err(FenceError::Refused(r)) => {
                if let Some(h) = &held {
                    self.lose(h, r.category(), r.to_string());
                }
                return Err(WorkerError::Refused(r));
            }
            Err(FenceError::Api { source, .. }) if is_too_large(&source) => {
                return Err(WorkerError::TooLarge(format!(
                    "LeasedJob {} would exceed the size limit of a job ({} bytes for the whole job as JSON, payload included) with this write; nothing was written: send a smaller result or message, or store large results elsewhere and send a reference",
                    self.job_ref(name),
                    leasehold_core::crd::MAX_JOB_BYTES
                )))
            }
            Err(e @ FenceError::Api { .. }) => {
                return Err(WorkerError::unavailable(
                    format!("write to LeasedJob {}", self.job_ref(name)),
                    error_chain(&e),
                ))
            }
        };
        // The job's status now fences the ended attempt, so its Lease is not written again: it
        // keeps naming this token until the next claim takes it over or garbage collection
        // deletes it with the job. Its token is refused from here on (the Lease would still
        // accept its renewals). Recorded before the attempt stops being held, so that no
        // heartbeat in between finds neither.
        remember_ended(
            &mut self.inner.ended_here.lock().unwrap(),
            name,
            &token,
            &self.job_ref(name),
            &job,
        );
        if let Some(h) = self.inner.held.lock().unwrap().remove(name) {
            mark_ended(&h);
        }
        // Its slots are free now: the next claim in their scopes may swap them.
        self.inner.own_slots.ended(name, token.as_str());
        self.inner.ended.notify_waiters();
        if let Some(claimed) = job.status.as_ref().and_then(|s| s.claimed_time.as_ref()) {
            let ran = Timestamp::now().duration_since(claimed.0).as_secs_f64();
            self.inner.metrics.attempt_ran(ran.max(0.0));
        }
        let job_ref = self.job_ref(name);
        info!(job = %job_ref, attempt = token.attempt(), phase = %job.phase(), "Ended attempt {} of LeasedJob {job_ref}: {}", token.attempt(), job.phase());
        Ok(job)
    }
}

/// Records in `ended` (the attempt this process ended last per job name, with the refusal its
/// token now earns) that attempt `token` of job `name` (`job_ref`) ended, leaving `job`: when
/// `job` refuses the token, as it does after every end. Past [`MAX_ENDED`] names the memory
/// starts over.
pub(crate) fn remember_ended(
    ended: &mut HashMap<String, (Token, Refusal)>,
    name: &str,
    token: &Token,
    job_ref: &str,
    job: &LeasedJob,
) {
    if let Some(r) = fence::refusal(job_ref, Some(job), token) {
        if ended.len() >= MAX_ENDED {
            ended.clear();
        }
        ended.insert(name.to_string(), (token.clone(), r));
    }
}

/// Checks a failure reason: `^[A-Za-z][A-Za-z0-9]*$`, 1 to 64 characters (it becomes a
/// condition reason, whose rule is stricter than free text).
///
/// # Errors
/// [`WorkerError::Invalid`] naming the field, the value and the rule.
pub fn validate_reason(reason: &str) -> Result<(), WorkerError> {
    let ok = (1..=64).contains(&reason.len())
        && reason.starts_with(|c: char| c.is_ascii_alphabetic())
        && reason.chars().all(|c| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        let shown: String = reason.chars().take(80).collect();
        Err(WorkerError::Invalid {
            field: "reason",
            problem: format!(
                "{shown:?} is not a CamelCase word: expected 1 to 64 ASCII letters and digits, starting with a letter"
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_must_be_camel_case_words() {
        for ok in ["Timeout", "BadPayload", "E42", "x"] {
            assert!(validate_reason(ok).is_ok(), "{ok}");
        }
        for bad in ["", "9Lives", "has space", "dash-ed", "ünï", &"a".repeat(65)] {
            let e = validate_reason(bad).unwrap_err();
            assert_eq!(e.category(), "invalid_request");
            assert!(e.to_string().starts_with("reason "), "{e}");
        }
    }
}
