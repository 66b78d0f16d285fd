//! The per-job Lease's writes: acquire (create or take over), renew (the heartbeat,
//! optionally with a checkpoint and progress) and release. What they write, and the rules of
//! whose a Lease is, are decided in [`leasehold_core::lease`]; this module sends them and
//! classifies the API server's answers.

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::Value;
use thiserror::Error;

use leasehold_core::crd::LeasedJob;
use leasehold_core::lease::*;
use leasehold_core::progress::Progress;
use leasehold_core::token::Token;

use crate::api::{is_status, is_undecodable};
use leasehold_core::Category;

/// Errors of Lease writes.
#[derive(Debug, Error)]
pub enum LeaseError {
    /// The Lease is held by another token (or is gone): this caller no longer holds it.
    #[error("Lease {lease} is no longer held by this token")]
    Lost {
        /// `namespace/name` of the Lease.
        lease: String,
    },
    /// The checkpoint is larger than [`MAX_CHECKPOINT_BYTES`].
    #[error("checkpoint is {size} bytes of JSON; at most {MAX_CHECKPOINT_BYTES} are accepted")]
    CheckpointTooLarge {
        /// Size of the checkpoint's JSON text, in bytes.
        size: usize,
    },
    /// The API server could not be reached or answered with an error that says nothing about
    /// who holds the Lease (5xx, 403, timeouts): retry.
    #[error("Lease write failed")]
    Api(#[source] kube::Error),
    /// A Lease of that name exists but is not this job's: another application's, or one left by
    /// an earlier LeasedJob of the same name. leasehold never writes it.
    #[error("Lease {lease} is not this LeasedJob's: {why}")]
    NotOurs {
        /// `namespace/name` of the Lease.
        lease: String,
        /// Whose it is, as far as its ownerReferences tell (never its holderIdentity).
        why: String,
        /// True when it was left by an earlier LeasedJob of the same name: garbage collection
        /// removes it soon.
        stale: bool,
    },
    /// The attempt ended (expired, cancelled, superseded, its job deleted) before its first
    /// renewal's Lease write was confirmed against the job: `why` says how, in the words of
    /// the job's refusal (never another attempt's token).
    #[error("the attempt ended before its first renewal: {why}")]
    Ended {
        /// The job's refusal of the token.
        why: String,
        /// The code a worker's call gets back: `cancelled` for a cancelled job (as when the
        /// held-jobs cache shows it), `lease_lost` otherwise.
        code: &'static str,
    },
    /// No answer from the API server within `after`: the write may or may not have been
    /// applied. Retry.
    #[error("no answer from the API server within {} ms", after.as_millis())]
    Timeout {
        /// How long the caller waited.
        after: std::time::Duration,
    },
}

impl From<CheckpointTooLarge> for LeaseError {
    fn from(e: CheckpointTooLarge) -> LeaseError {
        LeaseError::CheckpointTooLarge { size: e.size }
    }
}

impl Category for LeaseError {
    /// Stable category, for metrics and logs.
    fn category(&self) -> &'static str {
        match self {
            LeaseError::Lost { .. } | LeaseError::Ended { .. } => "lease_lost",
            LeaseError::CheckpointTooLarge { .. } => "too_large",
            LeaseError::Api(_) => "api",
            LeaseError::Timeout { .. } => "timeout",
            LeaseError::NotOurs { .. } => "lease_conflict",
        }
    }
}

/// What the first renewal of an attempt carries into the Lease it creates ([`acquire`]):
/// nothing for a background renewal, the worker's checkpoint and progress for a heartbeat.
#[derive(Debug, Clone, Copy)]
pub struct FirstRenewal<'a> {
    /// The checkpoint to store (any JSON up to [`MAX_CHECKPOINT_BYTES`]).
    pub checkpoint: Option<&'a Value>,
    /// The progress to show.
    pub progress: &'a Progress,
}

impl Default for FirstRenewal<'_> {
    fn default() -> Self {
        static NONE: Progress = Progress {
            fraction: None,
            message: None,
        };
        FirstRenewal {
            checkpoint: None,
            progress: &NONE,
        }
    }
}

/// Acquires the Lease of `job` for `token`: creates it, or takes it over from an older attempt
/// with a resourceVersion precondition, adding one to leaseTransitions. The sidecar does this
/// at the attempt's first renewal, not at the claim (the claim's own write starts the lease:
/// see docs/protocol.md, "The Lease is written by the first renewal"), so `first` carries what
/// that renewal carries: a checkpoint and progress, stored in the same write. Retries on
/// conflict a few times; the claim already made this caller the owner, so a conflict only
/// means someone (the controller releasing, an old holder's last renewal) wrote in between. A
/// first attempt's Lease normally does not exist yet, so for attempt 1 the create is tried
/// before any read (one request instead of two); if the Lease exists after all, the create
/// fails with 409 and the read path follows.
///
/// A Lease of that name that is not this job's ([`ownership`]) is never written.
///
/// # Errors
/// [`LeaseError::Lost`] when the Lease is held by the same or a newer attempt;
/// [`LeaseError::NotOurs`] when the Lease belongs to something else;
/// [`LeaseError::CheckpointTooLarge`]; [`LeaseError::Api`] otherwise.
pub async fn acquire(
    api: &Api<Lease>,
    job: &LeasedJob,
    token: &Token,
    first: &FirstRenewal<'_>,
) -> Result<Lease, LeaseError> {
    let checkpoint = first.checkpoint.map(checkpoint_text).transpose()?;
    let for_claim = |now: Timestamp, transitions: i32, previous: Option<&Lease>| {
        let mut lease = lease_for_claim(job, token, now, transitions, previous);
        let annotations = lease
            .metadata
            .annotations
            .get_or_insert_with(Default::default);
        if let Some(text) = &checkpoint {
            annotations.insert(CHECKPOINT_ANNOTATION.to_string(), text.clone());
        }
        for (name, text) in first.progress.annotations() {
            annotations.insert(name.to_string(), text);
        }
        lease
    };
    let name = lease_name(&job.name_any());
    let ns = job.namespace().unwrap_or_default();
    let mut last_err = None;
    if token.attempt() == 1 {
        let lease = for_claim(Timestamp::now(), 0, None);
        match api.create(&PostParams::default(), &lease).await {
            Ok(l) => return Ok(l),
            Err(e) if is_status(&e, 409) => last_err = Some(e),
            Err(e) => return Err(LeaseError::Api(e)),
        }
    }
    for _ in 0..8 {
        let now = Timestamp::now();
        match api.get_opt(&name).await.map_err(LeaseError::Api)? {
            None => {
                let lease = for_claim(now, 0, None);
                match api.create(&PostParams::default(), &lease).await {
                    Ok(l) => return Ok(l),
                    Err(e) if is_status(&e, 409) => last_err = Some(e),
                    Err(e) => return Err(LeaseError::Api(e)),
                }
            }
            Some(current) => {
                match ownership(&current, job) {
                    Ownership::Ours => {}
                    Ownership::Stale { uid } => {
                        return Err(LeaseError::NotOurs {
                            lease: lease_ref(&ns, &name),
                            why: format!("it was left by an earlier LeasedJob of the same name (uid {uid}), and garbage collection has not removed it yet"),
                            stale: true,
                        })
                    }
                    Ownership::Foreign => {
                        return Err(LeaseError::NotOurs {
                            lease: lease_ref(&ns, &name),
                            why: "it has no ownerReference to this LeasedJob, so it belongs to something else (another application, or a hand-made copy); leasehold never writes it. Delete or rename that Lease, or rename the job".to_string(),
                            stale: false,
                        })
                    }
                }
                if !may_take_over(holder_identity(&current), token) {
                    return Err(LeaseError::Lost {
                        lease: lease_ref(&ns, &name),
                    });
                }
                if holder_identity(&current) == Some(token.as_str()) {
                    // Taken already: by a first renewal of the same attempt sent at the same
                    // moment, or by this one's own write whose answer was lost. This one is
                    // written as a renewal, so that its renewTime, checkpoint and progress
                    // are on the Lease when it is answered.
                    return renew(api, &name, token, first.checkpoint, Some(first.progress)).await;
                }
                let transitions = current
                    .spec
                    .as_ref()
                    .and_then(|s| s.lease_transitions)
                    .unwrap_or(0)
                    + 1;
                let lease = for_claim(now, transitions, Some(&current));
                match api.replace(&name, &PostParams::default(), &lease).await {
                    Ok(l) => return Ok(l),
                    Err(e) if is_status(&e, 409) => last_err = Some(e),
                    Err(e) => return Err(LeaseError::Api(e)),
                }
            }
        }
    }
    Err(LeaseError::Api(last_err.expect("loop ran")))
}

/// Renews the Lease `name` held by `token` (the heartbeat), storing `checkpoint` and
/// `progress` with it if given. One PATCH request; on a refusal, one GET to tell a lost Lease
/// from a passing fault.
///
/// # Errors
/// [`LeaseError::Lost`] when holderIdentity is no longer `token` or the Lease is gone;
/// [`LeaseError::CheckpointTooLarge`]; [`LeaseError::Api`] for faults worth retrying.
pub async fn renew(
    api: &Api<Lease>,
    name: &str,
    token: &Token,
    checkpoint: Option<&Value>,
    progress: Option<&Progress>,
) -> Result<Lease, LeaseError> {
    let text = checkpoint.map(checkpoint_text).transpose()?;
    let patch = renew_patch(token, Timestamp::now(), text.as_deref(), progress);
    match api
        .patch(name, &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
    {
        Ok(lease) => Ok(lease),
        Err(e) => Err(classify_refusal(api, name, token.as_str(), e).await),
    }
}

/// Releases the Lease `name` if `holder` still holds it: the controller's, after it ended the
/// attempt itself (expiry, cancel), so that the holder's next renewal is refused by the API
/// server. A Lease already released, re-taken or gone counts as released.
///
/// # Errors
/// [`LeaseError::Api`] when the API server could not be asked.
pub async fn release(api: &Api<Lease>, name: &str, holder: &str) -> Result<(), LeaseError> {
    match api
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Json::<()>(release_patch(holder)),
        )
        .await
    {
        Ok(_) => Ok(()),
        // Released; only the answer (a Lease with a field this binary cannot read) was not.
        Err(e) if is_undecodable(&e) => Ok(()),
        Err(e) => match classify_refusal(api, name, holder, e).await {
            LeaseError::Lost { .. } => Ok(()),
            other => Err(other),
        },
    }
}

/// After a refused conditional Lease write: Lost if a fresh read shows another (or no) holder
/// or no Lease, else the original error.
async fn classify_refusal(
    api: &Api<Lease>,
    name: &str,
    holder: &str,
    err: kube::Error,
) -> LeaseError {
    if is_status(&err, 404) {
        return LeaseError::Lost {
            lease: name.to_string(),
        };
    }
    match api.get_opt(name).await {
        Ok(None) => LeaseError::Lost {
            lease: name.to_string(),
        },
        Ok(Some(l)) if holder_identity(&l) != Some(holder) => LeaseError::Lost {
            lease: format!("{}/{}", l.namespace().unwrap_or_default(), name),
        },
        _ => LeaseError::Api(err),
    }
}

fn lease_ref(api_ns: &str, name: &str) -> String {
    format!("{api_ns}/{name}")
}
