//! The transitions the controller sees between two looks at a job: an Event for each (as
//! [`crate::EventPolicy`] allows) and the count of attempts that ended
//! (`leasehold_attempts_ended_total`).

use leasehold_core::crd::{LeasedJob, Phase, CONDITION_LEASE_CONFLICT};
use leasehold_core::fence::REASON_LEASE_EXPIRED;
use leasehold_core::queue_stats;
use leasehold_kube::events::EventType;
use leasehold_metrics::OutcomeLabels;

use crate::Context;

/// Records Events for the transitions seen since the last look at this job: claims,
/// completions, failures and releases; and counts the attempts that ended in between
/// (`leasehold_attempts_ended_total`). The first sight of a job records nothing (after a
/// controller restart, history is not replayed).
pub(crate) async fn record_transitions(job: &LeasedJob, ctx: &Context) {
    let now = (job.attempt(), job.phase());
    let before = {
        let mut jobs = ctx.jobs.lock().unwrap();
        let key = jobs.key(
            job.metadata.namespace.as_deref().unwrap_or_default(),
            job.metadata.name.as_deref().unwrap_or_default(),
        );
        jobs.swap_seen(&key, now)
    };
    let Some((was_attempt, was_phase)) = before else {
        return;
    };
    if (was_attempt, was_phase) == now {
        return;
    }
    let status = job.status.clone().unwrap_or_default();
    for (_, outcome) in queue_stats::ended_attempts((was_attempt, was_phase), now, &status.failures)
    {
        let labels = OutcomeLabels {
            queue: job.spec.queue.clone(),
            outcome: outcome.as_str(),
        };
        ctx.metrics
            .controller
            .attempts_ended
            .get_or_create(&labels)
            .inc();
    }
    let holder = status.holder.clone().unwrap_or_default();
    let (attempt, phase) = now;
    if was_phase.is_finished() && phase == Phase::Queued {
        // `kubectl leasehold retry` (crate::plugin::retry): not a failure nor a release.
        let note = format!(
            "Retried after it was {was_phase} (attempt {attempt}); the next claim is attempt {}",
            attempt + 1
        );
        ctx.event(job, EventType::Normal, "Retried", note).await;
        return;
    }
    if attempt > was_attempt {
        let note = format!("Claimed by {holder} (attempt {attempt})");
        ctx.event(job, EventType::Normal, "Claimed", note).await;
    }
    let last_failure = status.failures.last().filter(|f| f.attempt == attempt);
    match phase {
        Phase::Succeeded => {
            let note = format!("Completed by {holder} (attempt {attempt})");
            ctx.event(job, EventType::Normal, "Completed", note).await;
        }
        Phase::Cancelled => {}
        Phase::Failed => {
            let why = status
                .conditions
                .last()
                .map(|c| format!("{}: {}", c.reason, c.message))
                .unwrap_or_default();
            if last_failure.is_none_or(|f| f.reason != REASON_LEASE_EXPIRED) {
                ctx.event(
                    job,
                    EventType::Warning,
                    "Failed",
                    format!("Failed (attempt {attempt}): {why}"),
                )
                .await;
            }
        }
        Phase::Queued if attempt > 0 => match last_failure {
            Some(f) if f.reason == REASON_LEASE_EXPIRED => {}
            Some(f) => {
                let note = format!(
                    "Attempt {attempt} failed on {holder}: {}: {}; requeued",
                    f.reason, f.message
                );
                ctx.event(job, EventType::Warning, "AttemptFailed", note)
                    .await;
            }
            None => {
                // A claim undone because its Lease was not the job's (see Outcome::Unclaim)
                // leaves the condition LeaseConflict, stamped after the claim.
                let conflict = status.conditions.iter().find(|c| {
                    c.type_ == CONDITION_LEASE_CONFLICT
                        && status
                            .claimed_time
                            .as_ref()
                            .is_some_and(|t| c.last_transition_time.0 >= t.0)
                });
                match conflict {
                    Some(c) => {
                        let note = format!(
                            "Claim by {holder} (attempt {attempt}) undone: {}",
                            c.message
                        );
                        ctx.event(job, EventType::Warning, "LeaseConflict", note)
                            .await;
                    }
                    None => {
                        let note = format!("Released by {holder} (attempt {attempt}); requeued");
                        ctx.event(job, EventType::Normal, "Released", note).await;
                    }
                }
            }
        },
        _ => {}
    }
}
