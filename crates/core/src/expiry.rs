//! How the controller judges that a lease has expired, without trusting any worker's clock.
//!
//! The rule is client-go leader election's (`tools/leaderelection`: `observedRecord` and
//! `observedTime`): the controller never compares a Lease's `renewTime` with its own clock. It
//! treats the Lease's (holderIdentity, renewTime) pair, together with the job's token, as an
//! opaque *record*, and notes on its own monotonic clock when it last saw that record change. A
//! lease is expired once the record has not changed for `leaseDurationSeconds` of the
//! controller's own time. A worker whose clock is wrong therefore cannot make its lease look
//! fresher or staler than it is: only the arrival of renewals counts.
//!
//! The price (Gray and Cheriton, "Leases", SOSP 1989: leases depend on well-behaved clocks) is
//! paid by the controller's own clock rate alone, and by one consequence of memory: a controller
//! that starts (or restarts) has seen nothing yet, so it first sees every record at start-up and
//! a lease that stopped being renewed just before the restart expires up to one full
//! leaseDurationSeconds after the restart, never earlier.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;

use crate::crd::LeasedJob;
use crate::lease;

/// What the controller compares between observations of one leased job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The job's status.token.
    pub token: String,
    /// The Lease's holderIdentity (None when there is no Lease or no holder yet).
    pub holder_identity: Option<String>,
    /// The Lease's renewTime, as text; only compared for equality.
    pub renew_time: Option<String>,
}

/// The last record seen for a job and when (controller's monotonic clock) it last changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    /// The record.
    pub record: Record,
    /// When it was first seen with this value.
    pub seen_at: Instant,
}

/// Verdict on a leased job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Still valid; look again after this long if nothing changes.
    Live {
        /// Time left, on the controller's clock.
        expires_in: Duration,
    },
    /// Not renewed for the whole lease duration.
    Expired {
        /// How long the record has been unchanged.
        silent_for: Duration,
    },
}

/// Folds a new sighting of `record` at `now` into the previous observation: the time stays
/// when the record is unchanged and restarts when it changed.
pub fn observe(previous: Option<&Observation>, record: Record, now: Instant) -> Observation {
    match previous {
        Some(p) if p.record == record => p.clone(),
        _ => Observation {
            record,
            seen_at: now,
        },
    }
}

/// Judges an observation against the lease duration at `now`.
pub fn judge(observation: &Observation, lease_duration: Duration, now: Instant) -> Verdict {
    let silent_for = now.saturating_duration_since(observation.seen_at);
    if silent_for >= lease_duration {
        Verdict::Expired { silent_for }
    } else {
        Verdict::Live {
            expires_in: lease_duration - silent_for,
        }
    }
}

/// How far past its lease a leased job is at `now`, as this controller observed it: how long
/// the record of `observation` has gone unchanged beyond `lease_duration`, while `current` (the
/// record the caches hold now) is still that record. None while the lease is live, and once the
/// record has changed: a renewal the reconciler has not looked at yet is a renewal, not an
/// overdue job. For `leasehold_lease_overdue_seconds`: the leader requeues a job within
/// milliseconds of this becoming Some, so a value that keeps growing means it cannot.
pub fn overdue(
    observation: &Observation,
    current: &Record,
    lease_duration: Duration,
    now: Instant,
) -> Option<Duration> {
    if observation.record != *current {
        return None;
    }
    match judge(observation, lease_duration, now) {
        Verdict::Expired { silent_for } => Some(silent_for - lease_duration),
        Verdict::Live { .. } => None,
    }
}

/// What the controller compares between looks at a leased job. A Lease that does not carry
/// this attempt's heartbeats (another token, or another pod named as its holder) counts as no
/// Lease: only the holder's renewals keep a job alive.
pub fn record_of(job: &LeasedJob, lease: Option<&Lease>) -> Record {
    let token = job.token().unwrap_or_default();
    let holder = job.status.as_ref().and_then(|s| s.holder.as_deref());
    let spec = lease
        .filter(|l| lease::names_attempt(l, token, holder))
        .and_then(|l| l.spec.as_ref());
    Record {
        token: token.to_string(),
        holder_identity: spec.and_then(|s| s.holder_identity.clone()),
        renew_time: spec
            .and_then(|s| s.renew_time.as_ref())
            .map(|t| t.0.to_string()),
    }
}

/// The lease duration in force: the Lease's while it carries the current attempt's heartbeats
/// ([`lease::names_attempt`]), else the one the attempt's claim recorded ([`LeasedJob::policy`]).
pub fn lease_duration(job: &LeasedJob, lease: Option<&Lease>, token: &str) -> Duration {
    let holder = job.status.as_ref().and_then(|s| s.holder.as_deref());
    let from_lease = lease
        .filter(|l| lease::names_attempt(l, token, holder))
        .and_then(|l| l.spec.as_ref())
        .and_then(|s| s.lease_duration_seconds);
    let secs = from_lease
        .unwrap_or_else(|| job.policy().lease_duration_seconds)
        .max(1);
    Duration::from_secs(u64::try_from(secs).unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(token: &str, holder: Option<&str>, renew: Option<&str>) -> Record {
        Record {
            token: token.into(),
            holder_identity: holder.map(Into::into),
            renew_time: renew.map(Into::into),
        }
    }

    #[test]
    fn unchanged_record_keeps_its_time_and_changes_restart_it() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(3);
        let first = observe(None, rec("1.a", Some("1.a"), Some("10:00")), t0);
        assert_eq!(first.seen_at, t0);
        let same = observe(Some(&first), rec("1.a", Some("1.a"), Some("10:00")), t1);
        assert_eq!(same.seen_at, t0);
        for changed in [
            rec("1.a", Some("1.a"), Some("10:01")),
            rec("2.b", Some("1.a"), Some("10:00")),
            rec("1.a", None, Some("10:00")),
        ] {
            assert_eq!(observe(Some(&first), changed, t1).seen_at, t1);
        }
    }

    #[test]
    fn verdicts_by_elapsed_controller_time() {
        let t0 = Instant::now();
        let o = observe(None, rec("1.a", None, None), t0);
        let d = Duration::from_secs(5);
        let cases = [
            (0, Verdict::Live { expires_in: d }),
            (
                4999,
                Verdict::Live {
                    expires_in: Duration::from_millis(1),
                },
            ),
            (5000, Verdict::Expired { silent_for: d }),
            (
                9000,
                Verdict::Expired {
                    silent_for: Duration::from_secs(9),
                },
            ),
        ];
        for (ms, want) in cases {
            assert_eq!(judge(&o, d, t0 + Duration::from_millis(ms)), want, "{ms}");
        }
    }

    #[test]
    fn overdue_counts_beyond_the_lease_while_the_record_stands() {
        let t0 = Instant::now();
        let d = Duration::from_secs(5);
        let record = rec("1.a", Some("1.a"), Some("10:00"));
        let o = observe(None, record.clone(), t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(overdue(&o, &record, d, at(4)), None);
        assert_eq!(overdue(&o, &record, d, at(5)), Some(Duration::ZERO));
        assert_eq!(
            overdue(&o, &record, d, at(65)),
            Some(Duration::from_secs(60))
        );
        // Renewed since the reconciler's last look: not overdue, however old the look.
        let renewed = rec("1.a", Some("1.a"), Some("10:01"));
        assert_eq!(overdue(&o, &renewed, d, at(65)), None);
    }

    #[test]
    fn a_renew_time_from_a_skewed_clock_is_only_a_change_marker() {
        // A worker whose clock is an hour ahead writes renewTimes far in the future; the
        // controller still expires it exactly one duration after the last change it saw.
        let t0 = Instant::now();
        let d = Duration::from_secs(5);
        let o = observe(
            None,
            rec("1.a", Some("1.a"), Some("2099-01-01T00:00:00Z")),
            t0,
        );
        assert!(matches!(judge(&o, d, t0 + d), Verdict::Expired { .. }));
    }
}
