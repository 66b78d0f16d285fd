//! Expiry: the controller's look at a Leased job's Lease ([`check_expiry`]) and, when the
//! pure core ([`leasehold_core::expiry`]) says the lease ran out on this replica's clock, the requeue or
//! failure that ends the attempt ([`expire`]), fenced by the expired token.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;
use kube::Api;
use tracing::{info, warn};

use super::{Action, Context, ReconcileError, EXPIRY_SLACK};

use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::expiry::{self, lease_duration, record_of, Verdict};
use leasehold_core::fence::{self, Outcome, REASON_LEASE_EXPIRED};
use leasehold_core::lease;
use leasehold_core::token::Token;
use leasehold_kube::api::{is_too_large, is_undecodable};
use leasehold_kube::events::EventType;

/// Looks at the Leased `job`'s Lease (`lease`, from the cache, named `lease_name`) and judges
/// it on this replica's clock ([`expiry::observe`], [`expiry::judge`]): a live lease requeues
/// the reconcile for when it would run out; an expired one is confirmed by a fresh read (a
/// renewal the watch had not delivered restarts the clock) before [`expire`] ends the attempt.
///
/// # Errors
/// [`ReconcileError`] when the Lease cannot be read or the job not written.
pub(super) async fn check_expiry(
    job: &Arc<LeasedJob>,
    ctx: &Context,
    jobs: &Api<LeasedJob>,
    leases: &Api<Lease>,
    lease_name: &str,
    lease: Option<&Lease>,
) -> Result<Action, ReconcileError> {
    let key = ObjectRef::from_obj(&**job);
    let token = job.token().unwrap_or_default().to_string();
    let read_fresh = || async {
        match leases.get_opt(lease_name).await {
            Ok(fresh) => Ok(fresh),
            // A Lease this binary cannot read (an admin wrote a renewTime in year 9999) carries
            // no heartbeat it can judge: as the watch skipped it, so does the expiry. A live
            // holder would have rewritten renewTime by now.
            Err(e) if is_undecodable(&e) => Ok(None),
            Err(source) => Err(ReconcileError::Lease {
                job: job.reference(),
                action: "read",
                source: leasehold_kube::lease::LeaseError::Api(source),
            }),
        }
    };
    // Where this look's record comes from: the cache, or a fresh read while the cache is known
    // to disagree with one (see Context::fresh_reads).
    let cached_record = record_of(job, lease);
    // A Lease that was seen carrying this attempt's heartbeats and is now missing from the
    // cache may only have left the cache (its label was removed): ask before believing it.
    let vanished = cached_record.holder_identity.is_none()
        && ctx
            .observations
            .lock()
            .unwrap()
            .get(&key)
            .is_some_and(|o| o.record.holder_identity.is_some());
    if vanished {
        ctx.fresh_reads.lock().unwrap().insert(key.clone());
    }
    let mut fresh = None;
    if ctx.fresh_reads.lock().unwrap().contains(&key) {
        let read = read_fresh().await?;
        if record_of(job, read.as_ref()) == cached_record {
            ctx.fresh_reads.lock().unwrap().remove(&key);
        }
        fresh = Some(read);
    }
    let (record, lease) = match &fresh {
        Some(read) => (record_of(job, read.as_ref()), read.as_ref()),
        None => (cached_record, lease),
    };
    let duration = lease_duration(job, lease, &token);
    let now = Instant::now();
    let observation = {
        let mut seen = ctx.observations.lock().unwrap();
        let o = expiry::observe(seen.get(&key), record, now);
        seen.insert(key.clone(), o.clone());
        o
    };
    let verdict = expiry::judge(&observation, duration, now);
    tracing::debug!(job = %job.reference(), fresh_read = fresh.is_some(), ?verdict, record = ?observation.record, "Judged the lease of LeasedJob {}", job.reference());
    let silent_for = match verdict {
        Verdict::Live { expires_in } => return Ok(Action::requeue(expires_in + EXPIRY_SLACK)),
        Verdict::Expired { silent_for } => silent_for,
    };
    // The watch may lag (a restarted API server, a slow connection): confirm with a fresh read
    // before taking a job away. A renewal we had not seen restarts the clock, and from then on
    // this job is judged on fresh reads until the cache agrees.
    let fresh = match fresh {
        Some(read) => read,
        None => read_fresh().await?,
    };
    let fresh_record = record_of(job, fresh.as_ref());
    if fresh_record != observation.record {
        ctx.fresh_reads.lock().unwrap().insert(key.clone());
        let o = expiry::observe(Some(&observation), fresh_record, Instant::now());
        ctx.observations.lock().unwrap().insert(key, o);
        return Ok(Action::requeue(duration + EXPIRY_SLACK));
    }
    expire(
        job,
        ctx,
        jobs,
        leases,
        lease_name,
        fresh.as_ref(),
        silent_for,
        duration,
    )
    .await
}

/// Ends the attempt of `job` whose lease ran out (`silent_for` without a renewal, against
/// `duration`): requeues it, or fails it once its attempts are used up, with a JSON Patch that
/// tests the expired token and the Leased phase (a result that landed first wins, and the
/// requeue is dropped); then clears the Lease's holderIdentity, so that a holder still
/// renewing is refused by the API server.
///
/// # Errors
/// [`ReconcileError`] when a write fails for another reason than losing to the holder.
#[allow(clippy::too_many_arguments)]
async fn expire(
    job: &Arc<LeasedJob>,
    ctx: &Context,
    jobs: &Api<LeasedJob>,
    leases: &Api<Lease>,
    lease_name: &str,
    lease: Option<&Lease>,
    silent_for: Duration,
    duration: Duration,
) -> Result<Action, ReconcileError> {
    let key = ObjectRef::from_obj(&**job);
    let job_ref = job.reference();
    let token_text = job.token().unwrap_or_default();
    let Ok(token) = Token::parse(token_text) else {
        warn!(job = %job_ref, "LeasedJob {job_ref} is Leased with a malformed token; leaving it to a human");
        return Ok(Action::await_change());
    };
    let holder = job
        .status
        .as_ref()
        .and_then(|s| s.holder.clone())
        .unwrap_or_default();
    let checkpoint = lease
        .filter(|l| lease::names_attempt(l, token.as_str(), Some(&holder)))
        .and_then(lease::checkpoint);
    let message = format!(
        "no heartbeat from {holder} for {:.1}s (leaseDurationSeconds {}), attempt {} expired",
        silent_for.as_secs_f64(),
        duration.as_secs(),
        token.attempt()
    );
    let outcome = Outcome::Fail {
        reason: REASON_LEASE_EXPIRED.into(),
        message: message.clone(),
        retryable: true,
        checkpoint,
        retry_after_seconds: None,
    };
    let patch = |outcome: &Outcome| {
        fence::end_attempt_patch(
            job,
            &token,
            &holder,
            outcome,
            Timestamp::now(),
            rand::random(),
        )
    };
    let max_attempts = job.policy().max_attempts;
    let next = fence::next_phase(&outcome, job.failed_attempts(), max_attempts);
    let action = "requeue after lease expiry";
    let written = match ctx
        .patch_status_if_unchanged(jobs, job, patch(&outcome), action)
        .await
    {
        // The checkpoint would push the job past the API server's object size limit: requeue
        // without it rather than leave the job Leased forever.
        Err(ReconcileError::Job { source, .. }) if is_too_large(&source) => {
            warn!(job = %job_ref, "The last checkpoint of LeasedJob {job_ref} does not fit in the job; requeueing without it");
            let Outcome::Fail {
                reason,
                message,
                retryable,
                ..
            } = outcome
            else {
                unreachable!("expiry is a failure")
            };
            let without = Outcome::Fail {
                reason,
                message,
                retryable,
                checkpoint: None,
                retry_after_seconds: None,
            };
            ctx.patch_status_if_unchanged(jobs, job, patch(&without), action)
                .await?
        }
        other => other?,
    };
    if !written {
        // The token or phase changed since our snapshot: a result (or a release, or a newer
        // claim) landed first. It stands; the requeue is dropped.
        info!(job = %job_ref, attempt = token.attempt(), "Dropped requeue of LeasedJob {job_ref}: it changed before the lease expiry was written");
        ctx.observations.lock().unwrap().remove(&key);
        return Ok(Action::await_change());
    }
    ctx.observations.lock().unwrap().remove(&key);
    ctx.metrics.lease_expiries.inc();
    info!(job = %job_ref, attempt = token.attempt(), "Expired lease of LeasedJob {job_ref} (attempt {}); now {next}", token.attempt());
    let (type_, reason) = if next == Phase::Failed {
        (EventType::Warning, "LeaseExpiredFailed")
    } else {
        (EventType::Warning, REASON_LEASE_EXPIRED)
    };
    let note = if next == Phase::Failed {
        format!("{message}; failed attempts reached maxAttempts {max_attempts}, job Failed")
    } else {
        format!("{message}; requeued")
    };
    ctx.event(job, type_, reason, note).await;
    ctx.leading(job)?;
    leasehold_kube::lease::release(leases, lease_name, token.as_str())
        .await
        .map_err(|source| ReconcileError::Lease {
            job: job.reference(),
            action: "release after expiry",
            source,
        })?;
    Ok(Action::await_change())
}
