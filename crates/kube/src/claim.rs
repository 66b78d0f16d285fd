//! The claim's write: the Leased status that [`leasehold_core::claim::claimed_status`] builds,
//! sent as a status replace under the snapshot's resourceVersion, so that anyone who wrote the
//! job since makes the API server answer 409 Conflict (Kubernetes API conventions:
//! "Concurrency Control and Consistency").

use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, ResourceExt};
use thiserror::Error;

use leasehold_core::adoption::obeyed_at_generation;
use leasehold_core::claim::{claimable, claimed_status};
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::queue::LeasedQueue;
use leasehold_core::slots::SlotsTaken;
use leasehold_core::token::Token;

use crate::api::is_status;

/// What every refusal by the limit rules of the chart's admission policy starts with
/// (charts/leasehold/templates/admission-policy.yaml, `-worker-limits`).
pub const LIMIT_RULES: &str = "leasehold rule limits-";

/// Errors of [`claim`].
#[derive(Debug, Error)]
pub enum ClaimError {
    /// Someone wrote the job since the snapshot (another claimer won, or the controller
    /// initialised its status): pick again.
    #[error("LeasedJob {job} changed since it was read (409 Conflict); another claimer won")]
    Conflict {
        /// `namespace/name`.
        job: String,
    },
    /// The job was deleted.
    #[error("LeasedJob {job} no longer exists")]
    Gone {
        /// `namespace/name`.
        job: String,
    },
    /// The snapshot is not claimable (not Queued, cancelled, being deleted, or before its
    /// notBefore or retryAfter).
    #[error("LeasedJob {job} is not claimable now (phase {phase})")]
    NotQueued {
        /// `namespace/name`.
        job: String,
        /// Its phase in the snapshot.
        phase: Phase,
    },
    /// The API server's admission refused the claim by one of leasehold's limit rules
    /// (`limits-obeyed`, `limits-adopted`: docs/security.md): its copy of the job's LeasedQueue
    /// sets limits this claim was not made under, or that are not confirmed yet. Nothing was
    /// written. The two copies of the LeasedQueue differ: the claimer's lags the API server's,
    /// or the API server's (read by its admission) lags the claimer's for a moment; either
    /// way a claim under the same copy would be refused again until one catches up.
    #[error(
        "the API server refused the claim of LeasedJob {job} under its queue's limits: {message}"
    )]
    OutsideLimits {
        /// `namespace/name`.
        job: String,
        /// The refusal, naming the rule.
        message: String,
    },
    /// The snapshot has no resourceVersion: a claim is only written under one (the API server
    /// refuses an update of a custom resource without one, 422). Nothing was sent. A copy read
    /// from the API server always has one.
    #[error("LeasedJob {job}'s copy has no resourceVersion; a claim is only written under one")]
    Unversioned {
        /// `namespace/name`.
        job: String,
    },
    /// Any other API failure; nothing was written.
    #[error("claim of LeasedJob {job} failed")]
    Api {
        /// `namespace/name`.
        job: String,
        /// The underlying error.
        #[source]
        source: kube::Error,
    },
}

/// Claims `snapshot` for `holder`: replaces its status with [`claimed_status`] under the
/// snapshot's resourceVersion, recording the attempt's policy resolved over the defaults of
/// `queue` (the job's LeasedQueue as the claimer read it; None without one) and the limits it
/// sets, whose slots the caller took. Returns the claimed job (as the API
/// server stored it) and the token. Does not touch the Lease: see [`crate::lease::acquire`].
///
/// # Errors
/// [`ClaimError::Conflict`] when anyone wrote the job since the snapshot;
/// [`ClaimError::NotQueued`] when the snapshot is not claimable; [`ClaimError::Unversioned`]
/// when it has no resourceVersion; [`ClaimError::Gone`]; [`ClaimError::Api`].
pub async fn claim(
    api: &Api<LeasedJob>,
    snapshot: &LeasedJob,
    holder: &str,
    queue: Option<&LeasedQueue>,
) -> Result<(LeasedJob, Token), ClaimError> {
    let token = Token::issue(snapshot.attempt() + 1);
    claim_with(api, snapshot, holder, queue, token).await
}

/// [`claim`] with a token the caller issued (for the claim's next attempt,
/// `Token::issue(snapshot.attempt() + 1)`): a claim of a limited queue marks its slots with it
/// before the write ([`crate::slots::acquire`]).
///
/// # Errors
/// As [`claim`]; [`ClaimError::NotQueued`] too when `token` is not for the next attempt.
pub async fn claim_with(
    api: &Api<LeasedJob>,
    snapshot: &LeasedJob,
    holder: &str,
    queue: Option<&LeasedQueue>,
    token: Token,
) -> Result<(LeasedJob, Token), ClaimError> {
    claim_taking(api, snapshot, holder, queue, token, SlotsTaken::default()).await
}

/// [`claim_with`], for a claim that took the slots `taken`: its status records their indices
/// (`queueSlot`, `keySlot`), and when one was swapped ([`leasehold_core::slots::may_swap`]),
/// its `status.limits` name the LeasedQueue's generation too ([`obeyed_at_generation`]), so
/// that the API server's admission refuses it under any other generation of the queue.
///
/// # Errors
/// As [`claim_with`].
pub async fn claim_taking(
    api: &Api<LeasedJob>,
    snapshot: &LeasedJob,
    holder: &str,
    queue: Option<&LeasedQueue>,
    token: Token,
    taken: SlotsTaken,
) -> Result<(LeasedJob, Token), ClaimError> {
    let job = snapshot.reference();
    if snapshot.guarding_version().is_none() {
        return Err(ClaimError::Unversioned { job });
    }
    let next_attempt = token.attempt() == snapshot.attempt() + 1;
    if !next_attempt || !claimable(snapshot, &snapshot.spec.queue, Timestamp::now()) {
        return Err(ClaimError::NotQueued {
            job,
            phase: snapshot.phase(),
        });
    }
    let mut next = snapshot.clone();
    let mut status = claimed_status(snapshot, &token, holder, Timestamp::now(), queue);
    if taken.swapped {
        status.limits = queue.and_then(obeyed_at_generation);
    }
    let index = |i: Option<u32>| i.and_then(|i| i32::try_from(i).ok());
    status.queue_slot = index(taken.queue);
    status.key_slot = index(taken.key);
    next.status = Some(status);
    match api
        .replace_status(&snapshot.name_any(), &PostParams::default(), &next)
        .await
    {
        Ok(stored) => Ok((stored, token)),
        Err(e) if is_status(&e, 409) => Err(ClaimError::Conflict { job }),
        Err(e) if is_status(&e, 404) => Err(ClaimError::Gone { job }),
        Err(kube::Error::Api(refusal))
            if refusal.code == 422 && refusal.message.contains(LIMIT_RULES) =>
        {
            Err(ClaimError::OutsideLimits {
                job,
                message: refusal.message,
            })
        }
        Err(source) => Err(ClaimError::Api { job, source }),
    }
}
