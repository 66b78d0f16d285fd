//! What the controller tells Prometheus about each queue, computed from its caches: jobs by
//! phase, the age of the longest-running attempt, how far the most overdue lease is past its
//! expiry, and how the attempts it saw end. Plain data in, numbers out: the controller reads
//! its caches and sets the metrics (`leasehold_metrics::ControllerMetrics`); the chart's alerts
//! (docs/alerts.md) are written on them.
//!
//! Every number is per queue (`spec.queue`), never per job, so the metrics' cardinality grows
//! with the number of queues only. A queue's name is counted across every namespace the
//! controller watches.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use crate::crd::{AttemptFailure, Phase};
use crate::fence::REASON_LEASE_EXPIRED;

/// One job, as the per-queue gauges see it.
#[derive(Clone, Debug)]
pub struct JobSample<'a> {
    /// spec.queue.
    pub queue: &'a str,
    /// status.phase.
    pub phase: Phase,
    /// status.claimedTime: when the current attempt was claimed (read for Leased jobs only).
    pub claimed_time: Option<Timestamp>,
    /// How far past its lease the job is ([`crate::expiry::overdue`]); read for Leased jobs
    /// only, None while its lease is live or not yet judged.
    pub overdue: Option<Duration>,
}

/// The gauges of one queue.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueGauges {
    /// Jobs by phase name (`Queued`, `Leased`, ...); phases without a job are absent.
    pub jobs: BTreeMap<&'static str, i64>,
    /// Time since the claim of the longest-running Leased job; zero when none is Leased.
    pub oldest_attempt: Duration,
    /// How far the most overdue Leased job is past its lease; zero when none is.
    pub lease_overdue: Duration,
}

/// The gauges of every queue that has a job, at `now` (the controller's wall clock, compared
/// with claimedTime only). A claimedTime in the future (the claimer's clock ahead of the
/// controller's) counts as an attempt that has just begun.
pub fn gauges<'a>(
    jobs: impl IntoIterator<Item = JobSample<'a>>,
    now: Timestamp,
) -> BTreeMap<String, QueueGauges> {
    let mut queues: BTreeMap<String, QueueGauges> = BTreeMap::new();
    for job in jobs {
        let queue = queues.entry(job.queue.to_string()).or_default();
        *queue.jobs.entry(job.phase.as_str()).or_default() += 1;
        if job.phase != Phase::Leased {
            continue;
        }
        if let Some(claimed) = job.claimed_time {
            let running = Duration::try_from(now.duration_since(claimed)).unwrap_or_default();
            queue.oldest_attempt = queue.oldest_attempt.max(running);
        }
        if let Some(overdue) = job.overdue {
            queue.lease_overdue = queue.lease_overdue.max(overdue);
        }
    }
    queues
}

/// How an attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Its holder completed the job (phase Succeeded).
    Succeeded,
    /// Its holder failed it (a `status.failures` entry with the worker's reason), retried or
    /// not.
    Failed,
    /// Its lease expired and the controller requeued or failed it (a `status.failures` entry
    /// with reason `LeaseExpired`).
    Expired,
    /// Its holder handed it back (or the claim was undone for a Lease conflict): no failure
    /// recorded, and a later attempt began or the job is Queued again.
    Released,
    /// The job was cancelled while this attempt held it.
    Cancelled,
}

impl Outcome {
    /// Every outcome.
    pub const ALL: [Outcome; 5] = [
        Outcome::Succeeded,
        Outcome::Failed,
        Outcome::Expired,
        Outcome::Released,
        Outcome::Cancelled,
    ];

    /// The `outcome` label's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Failed => "failed",
            Outcome::Expired => "expired",
            Outcome::Released => "released",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// The attempts that ended between two sightings of one job, `before` and `after` (each
/// status.attempt and status.phase), with how each ended, oldest first; `failures` is the job's
/// status.failures as of `after`.
///
/// The controller does not see every state a job passes through: its reconciler runs on the
/// latest state of the cache, so a job claimed and completed within milliseconds can go from
/// `(0, Queued)` to `(1, Succeeded)` between two looks. So the rule counts attempts, not
/// transitions: every attempt from the one Leased at `before` (or the first claimed after it)
/// up to the one of `after` has ended, except an attempt still Leased at `after`. An attempt
/// with a `status.failures` entry failed (or expired, for reason `LeaseExpired`); otherwise the
/// latest one ended as `after`'s phase says (Succeeded, Cancelled), and an earlier one, or one
/// that is Queued again, was released. A `kubectl leasehold retry` (finished -> Queued, same
/// attempt) ends nothing.
pub fn ended_attempts(
    before: (i32, Phase),
    after: (i32, Phase),
    failures: &[AttemptFailure],
) -> Vec<(i32, Outcome)> {
    let ((was_attempt, was_phase), (attempt, phase)) = (before, after);
    let first = if was_phase == Phase::Leased {
        was_attempt
    } else {
        was_attempt + 1
    };
    let last = if phase == Phase::Leased {
        attempt - 1
    } else {
        attempt
    };
    (first.max(1)..=last)
        .map(|a| {
            let failure = failures.iter().rev().find(|f| f.attempt == a);
            let outcome = match failure {
                Some(f) if f.reason == REASON_LEASE_EXPIRED => Outcome::Expired,
                Some(_) => Outcome::Failed,
                None if a < attempt => Outcome::Released,
                None => match phase {
                    Phase::Succeeded => Outcome::Succeeded,
                    Phase::Cancelled => Outcome::Cancelled,
                    // Failed without a failure entry of its own does not happen (every failed
                    // attempt appends one); count it as what the phase says.
                    Phase::Failed => Outcome::Failed,
                    Phase::Queued | Phase::Leased => Outcome::Released,
                },
            };
            (a, outcome)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn failure(attempt: i32, reason: &str) -> AttemptFailure {
        AttemptFailure {
            attempt,
            holder: "pod".into(),
            reason: reason.into(),
            message: String::new(),
            time: Time(Timestamp::UNIX_EPOCH),
        }
    }

    #[test]
    fn attempts_ended_between_two_sightings() {
        use Outcome as O;
        use Phase as P;
        let none: &[AttemptFailure] = &[];
        let crashed = [failure(1, "Crashed")];
        let expired = [failure(1, REASON_LEASE_EXPIRED)];
        let both = [failure(1, REASON_LEASE_EXPIRED), failure(2, "Crashed")];
        #[allow(clippy::type_complexity)]
        let cases: &[(
            (i32, Phase),
            (i32, Phase),
            &[AttemptFailure],
            &[(i32, Outcome)],
        )] = &[
            // Claims begin nothing that ended.
            ((0, P::Queued), (1, P::Leased), none, &[]),
            ((1, P::Leased), (1, P::Leased), none, &[]),
            // One attempt, each way it can end.
            (
                (1, P::Leased),
                (1, P::Succeeded),
                none,
                &[(1, O::Succeeded)],
            ),
            ((1, P::Leased), (1, P::Failed), &crashed, &[(1, O::Failed)]),
            ((1, P::Leased), (1, P::Queued), &crashed, &[(1, O::Failed)]),
            ((1, P::Leased), (1, P::Queued), &expired, &[(1, O::Expired)]),
            ((1, P::Leased), (1, P::Failed), &expired, &[(1, O::Expired)]),
            ((1, P::Leased), (1, P::Queued), none, &[(1, O::Released)]),
            (
                (1, P::Leased),
                (1, P::Cancelled),
                none,
                &[(1, O::Cancelled)],
            ),
            // Claimed and finished between two looks.
            (
                (0, P::Queued),
                (1, P::Succeeded),
                none,
                &[(1, O::Succeeded)],
            ),
            ((0, P::Queued), (1, P::Queued), &crashed, &[(1, O::Failed)]),
            // Several attempts between two looks; the latest still running.
            (
                (1, P::Leased),
                (3, P::Leased),
                &both,
                &[(1, O::Expired), (2, O::Failed)],
            ),
            (
                (0, P::Queued),
                (3, P::Succeeded),
                &both,
                &[(1, O::Expired), (2, O::Failed), (3, O::Succeeded)],
            ),
            ((1, P::Queued), (3, P::Leased), &both, &[(2, O::Failed)]),
            ((1, P::Leased), (2, P::Leased), none, &[(1, O::Released)]),
            // Nothing ended: a queued job cancelled, a finished job retried.
            ((1, P::Queued), (1, P::Cancelled), none, &[]),
            ((2, P::Failed), (2, P::Queued), &both, &[]),
            ((2, P::Queued), (2, P::Queued), &both, &[]),
        ];
        for (before, after, failures, want) in cases {
            assert_eq!(
                ended_attempts(*before, *after, failures),
                want.to_vec(),
                "{before:?} -> {after:?}"
            );
        }
    }

    #[test]
    fn gauges_per_queue() {
        let now: Timestamp = "2026-01-01T12:00:00Z".parse().unwrap();
        let ago = |s: i64| Some(now - k8s_openapi::jiff::SignedDuration::from_secs(s));
        let sample = |queue, phase, claimed, overdue: Option<u64>| JobSample {
            queue,
            phase,
            claimed_time: claimed,
            overdue: overdue.map(Duration::from_secs),
        };
        let jobs = [
            sample("a", Phase::Queued, None, None),
            sample("a", Phase::Queued, None, None),
            sample("a", Phase::Leased, ago(30), None),
            sample("a", Phase::Leased, ago(700), Some(5)),
            sample("a", Phase::Leased, ago(10), Some(40)),
            // Only Leased jobs count for age and overdue: a finished job's claim is history.
            sample("a", Phase::Succeeded, ago(9000), Some(9000)),
            // The claimer's clock ahead of the controller's.
            sample("b", Phase::Leased, ago(-5), None),
            sample("c", Phase::Failed, None, None),
        ];
        let got = gauges(jobs, now);
        assert_eq!(got.len(), 3);
        let a = &got["a"];
        assert_eq!(
            a.jobs,
            BTreeMap::from([("Queued", 2), ("Leased", 3), ("Succeeded", 1)])
        );
        assert_eq!(a.oldest_attempt, Duration::from_secs(700));
        assert_eq!(a.lease_overdue, Duration::from_secs(40));
        assert_eq!(got["b"].oldest_attempt, Duration::ZERO);
        assert_eq!(got["b"].jobs, BTreeMap::from([("Leased", 1)]));
        assert_eq!(
            got["c"],
            QueueGauges {
                jobs: BTreeMap::from([("Failed", 1)]),
                ..QueueGauges::default()
            }
        );
    }
}
