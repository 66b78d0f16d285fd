//! The fence's write: an attempt ended with the JSON Patch that
//! [`leasehold_core::fence::end_attempt_patch`] builds, whose `test` operations make the API
//! server refuse it if the token or phase changed since the read; a refusal is explained from
//! a fresh read ([`leasehold_core::fence::refusal`]).

use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::Api;
use thiserror::Error;

use leasehold_core::crd::LeasedJob;
use leasehold_core::fence::*;
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

/// As [`apply`], but builds the patch from `snapshot` (a watch cache's copy of the job) instead
/// of reading the job first, when the snapshot shows `token` holding it (Leased, this token).
/// That is as safe as a fresh read: while the token and the Leased phase stay, nothing else in
/// the status changes, and the patch's `test` operations make the API server refuse it if
/// either changed since. It saves one read per ended attempt. Any other snapshot is ignored.
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
    let usable = snapshot.filter(|j| refusal(&job_ref, Some(j), token).is_none());
    let job = match usable {
        Some(j) => j.clone(),
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
    let holder = job
        .status
        .as_ref()
        .and_then(|s| s.holder.clone())
        .unwrap_or_default();
    let patch = end_attempt_patch(
        &job,
        token,
        &holder,
        outcome,
        Timestamp::now(),
        rand::random(),
    );
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
