//! The fence's write: an attempt ended with the JSON Patch that
//! [`leasehold_core::fence::end_attempt_patch`] builds, whose `test` operations make the API
//! server refuse it if the token or phase changed since the read, or, by a holder whose
//! snapshot shows its attempt, with the status that patch makes sent as a replace under the
//! snapshot's resourceVersion ([`apply_from`]); a refusal is explained from a fresh read
//! ([`leasehold_core::fence::refusal`]).

use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use thiserror::Error;

use leasehold_core::crd::LeasedJob;
use leasehold_core::fence::*;
use leasehold_core::json::encoded_len;
use leasehold_core::token::Token;

use crate::api::is_status;
use leasehold_core::Category;

/// Errors of [`apply`].
#[derive(Debug, Error)]
pub enum FenceError {
    /// The write was refused: see the refusal.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// The API server could not be asked, or failed (5xx, 403, timeouts); nothing was written.
    #[error("LeasedJob {job} status write failed; nothing was written")]
    Api {
        /// `namespace/name`.
        job: String,
        /// The underlying error.
        #[source]
        source: kube::Error,
    },
}

impl Category for FenceError {
    /// Stable category for metrics and the HTTP error code.
    fn category(&self) -> &'static str {
        match self {
            FenceError::Refused(r) => r.category(),
            FenceError::Api { .. } => "unavailable",
        }
    }
}

/// Ends attempt `token` of job `name` with `outcome` (the failure entry, if any, names the
/// holder recorded by the claim): reads the job, checks the token (so a
/// refusal comes with a clear reason), and sends the [`end_attempt_patch`], whose `test`
/// operations make the API server refuse it if the token or phase changed since the read.
///
/// # Errors
/// [`FenceError::Refused`] when the token is not the current holder's (stale, another job's,
/// the job requeued or finished, or no such job); [`FenceError::Api`] on API faults.
pub async fn apply(
    api: &Api<LeasedJob>,
    namespace: &str,
    name: &str,
    token: &Token,
    outcome: &Outcome,
) -> Result<LeasedJob, FenceError> {
    apply_from(api, namespace, name, token, outcome, None).await
}

/// As [`apply`], but first tries to end the attempt from `snapshot` (a watch cache's copy of
/// the job, or the claim's answer) without reading the job, when the snapshot shows `token`
/// holding it (Leased, this token): one status replace under the snapshot's resourceVersion,
/// with the status the patch would make. That is as safe as the patch: the API server refuses
/// the replace with 409 if anything changed since the snapshot. It saves one read per ended
/// attempt, and the API server the patch's application. When the replace is refused (the
/// snapshot was stale), the attempt is ended as [`apply`] ends it, from a fresh read. Any other
/// snapshot is ignored.
///
/// # Errors
/// As [`apply`].
pub async fn apply_from(
    api: &Api<LeasedJob>,
    namespace: &str,
    name: &str,
    token: &Token,
    outcome: &Outcome,
    snapshot: Option<&LeasedJob>,
) -> Result<LeasedJob, FenceError> {
    let job_ref = format!("{namespace}/{name}");
    let api_err = |source| FenceError::Api {
        job: job_ref.clone(),
        source,
    };
    let from_snapshot = match snapshot.filter(|j| refusal(&job_ref, Some(j), token).is_none()) {
        Some(snap) => match replace_ended(api, name, snap, token, outcome).await {
            Some(Ok(job)) => return Ok(job),
            // Anything changed since the snapshot, or the job is gone: judge from a read.
            Some(Err(e)) if is_status(&e, 409) || is_status(&e, 404) => None,
            // Anything else (5xx, 413, a refusal by admission) would meet the patch too:
            // nothing was written, and the caller decides whether to repeat.
            Some(Err(e)) => return Err(api_err(e)),
            // Not to be replaced (a large status): the patch, from the snapshot.
            None => Some(snap.clone()),
        },
        None => None,
    };
    let job = match from_snapshot {
        Some(job) => job,
        None => {
            let job = api.get_opt(name).await.map_err(api_err)?;
            if let Some(done) = job.as_ref().filter(|j| already_applied(j, token, outcome)) {
                return Ok(done.clone());
            }
            if let Some(r) = refusal(&job_ref, job.as_ref(), token) {
                return Err(r.into());
            }
            job.expect("refusal() refuses a missing job")
        }
    };
    let patch = end_patch(&job, token, outcome);
    match api
        .patch_status(name, &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
    {
        Ok(job) => Ok(job),
        Err(e) if is_status(&e, 422) || is_status(&e, 409) || is_status(&e, 404) => {
            // The test operations failed: something changed since our read. Say what.
            let fresh = api.get_opt(name).await.map_err(api_err)?;
            if let Some(done) = fresh
                .as_ref()
                .filter(|j| already_applied(j, token, outcome))
            {
                return Ok(done.clone());
            }
            match refusal(&job_ref, fresh.as_ref(), token) {
                Some(r) => Err(r.into()),
                None => Err(api_err(e)),
            }
        }
        Err(e) => Err(api_err(e)),
    }
}

/// The largest status (as JSON, before the attempt's ending) that a holder sends whole to end
/// its attempt, in bytes. A replace re-sends the whole status, a patch only what changes: a
/// status carrying more than this (a checkpoint handed over from an earlier attempt, many
/// failures) is ended with the patch, which then costs less to send and to decode.
pub const MAX_REPLACED_STATUS_BYTES: usize = 16 * 1024;

/// The [`end_attempt_patch`] of `job` for `token`, made now, by the holder its claim recorded.
fn end_patch(job: &LeasedJob, token: &Token, outcome: &Outcome) -> json_patch::Patch {
    let holder = job
        .status
        .as_ref()
        .and_then(|s| s.holder.as_deref())
        .unwrap_or_default();
    end_attempt_patch(
        job,
        token,
        holder,
        outcome,
        Timestamp::now(),
        rand::random(),
    )
}

/// Ends the attempt held in `snapshot` with one status replace under the snapshot's
/// resourceVersion: the status its [`end_attempt_patch`] makes ([`patched`]), sent whole. The
/// API server refuses it with 409 if anything changed since the snapshot, so it fences as the
/// patch does; it costs the API server less (no patch to apply to the stored object). None
/// when the snapshot is not to be ended so, and nothing was sent: it does not show the
/// attempt, has no resourceVersion, or its status (a checkpoint handed over from an earlier
/// attempt, say) is over [`MAX_REPLACED_STATUS_BYTES`] or cannot be written as JSON.
async fn replace_ended(
    api: &Api<LeasedJob>,
    name: &str,
    snapshot: &LeasedJob,
    token: &Token,
    outcome: &Outcome,
) -> Option<Result<LeasedJob, kube::Error>> {
    // Without a version the API server refuses the replace (422): the patch, with its tests,
    // ends the attempt instead.
    snapshot.guarding_version()?;
    // The status subresource takes only the status from the body and keeps the rest as stored:
    // the payload and managedFields need not be sent, nor decoded. A Leased job has no result.
    let mut slim = snapshot.clone();
    slim.drop_payload_and_result();
    if encoded_len(&slim.status).is_none_or(|n| n > MAX_REPLACED_STATUS_BYTES) {
        return None;
    }
    let ended = patched(&slim, &end_patch(&slim, token, outcome))?;
    Some(
        api.replace_status(name, &PostParams::default(), &ended)
            .await,
    )
}
