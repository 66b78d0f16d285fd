//! The claim: one atomic transition Queued -> Leased that issues a fresh token.
//!
//! A claimer picks a Queued job from its watch cache ([`pick`]), builds the Leased status from
//! that same snapshot ([`claimed_status`]) and replaces the status under the snapshot's
//! resourceVersion (optimistic concurrency, Kubernetes API conventions: "Concurrency Control and
//! Consistency"). The "is it still Queued?" check and the write therefore use one snapshot: if
//! anyone wrote the job since, the API server answers 409 Conflict and the claimer moves on.

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, ResourceExt};
use rand::Rng;
use thiserror::Error;

use crate::crd::{LeasedJob, LeasedJobStatus, Phase};
use crate::kubeapi::is_status;
use crate::lease::lease_name;
use crate::token::Token;

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

/// True when `job` may be claimed from `queue` at `now`: Queued, in that queue, not cancelled,
/// not being deleted, and past spec.notBefore and status.retryAfter.
pub fn claimable(job: &LeasedJob, queue: &str, now: Timestamp) -> bool {
    job.phase() == Phase::Queued
        && job.spec.queue == queue
        && !job.spec.cancel
        && job.metadata.deletion_timestamp.is_none()
        && job.claimable_at().is_none_or(|t| t <= now)
}

/// The earliest future time at which a Queued job of `queue` becomes claimable (by notBefore
/// or retryAfter), so that a waiting claimer can wake up for it.
pub fn next_claimable_at(
    jobs: &[Arc<LeasedJob>],
    queue: &str,
    now: Timestamp,
) -> Option<Timestamp> {
    jobs.iter()
        .filter(|j| j.phase() == Phase::Queued && j.spec.queue == queue && !j.spec.cancel)
        .filter_map(|j| j.claimable_at())
        .filter(|t| *t > now)
        .min()
}

/// Chooses which job to try to claim. Candidates are the claimable jobs of the highest priority
/// present, in FIFO order (creationTimestamp, then name); the choice is random among the first
/// `spread` of them, so that many idle claimers woken by the same event do not all race for the
/// same job. `spread` 1 gives strict FIFO. `skip` filters out snapshots already tried.
pub fn pick<R: Rng>(
    jobs: &[Arc<LeasedJob>],
    queue: &str,
    now: Timestamp,
    spread: usize,
    skip: impl Fn(&LeasedJob) -> bool,
    rng: &mut R,
) -> Option<Arc<LeasedJob>> {
    let mut candidates: Vec<&Arc<LeasedJob>> = jobs
        .iter()
        .filter(|j| claimable(j, queue, now) && !skip(j))
        .collect();
    let top = candidates.iter().map(|j| j.spec.priority).max()?;
    candidates.retain(|j| j.spec.priority == top);
    let window = candidates.len().min(spread.max(1));
    if window < candidates.len() {
        // Only which jobs are the `window` oldest matters, not their order (the choice among
        // them is uniform): select them in linear time rather than sort every candidate on
        // every claim, which cost tens of milliseconds per claim with 10,000 jobs queued.
        candidates.select_nth_unstable_by(window - 1, |a, b| fifo_key(a).cmp(&fifo_key(b)));
    }
    let chosen = rng.random_range(0..window);
    Some(Arc::clone(candidates[chosen]))
}

/// FIFO order: creationTimestamp, then name.
fn fifo_key(job: &LeasedJob) -> (Option<Timestamp>, Option<&str>) {
    (
        job.metadata.creation_timestamp.as_ref().map(|t| t.0),
        job.metadata.name.as_deref(),
    )
}

/// The status a successful claim writes: Leased, attempt + 1, the new token and holder, the
/// claim time, the Lease's name. Everything else (failures, checkpoint, conditions) is kept.
pub fn claimed_status(
    job: &LeasedJob,
    token: &Token,
    holder: &str,
    now: Timestamp,
) -> LeasedJobStatus {
    let mut status = job.status.clone().unwrap_or_default();
    status.phase = Some(Phase::Leased);
    status.attempt = token.attempt();
    status.token = Some(token.as_str().to_string());
    status.holder = Some(holder.to_string());
    status.claimed_time = Some(Time(now));
    status.lease_name = Some(lease_name(&job.name_any()));
    status.retry_after = None;
    if status.queued_time.is_none() {
        status.queued_time = job.metadata.creation_timestamp.clone();
    }
    status
}

/// Claims `snapshot` for `holder`: replaces its status with [`claimed_status`] under the
/// snapshot's resourceVersion. Returns the claimed job (as the API server stored it) and the
/// token. Does not touch the Lease: see [`crate::lease::acquire`].
///
/// # Errors
/// [`ClaimError::Conflict`] when anyone wrote the job since the snapshot;
/// [`ClaimError::NotQueued`] when the snapshot is not claimable; [`ClaimError::Gone`];
/// [`ClaimError::Api`].
pub async fn claim(
    api: &Api<LeasedJob>,
    snapshot: &LeasedJob,
    holder: &str,
) -> Result<(LeasedJob, Token), ClaimError> {
    let job = snapshot.reference();
    if !claimable(snapshot, &snapshot.spec.queue, Timestamp::now()) {
        return Err(ClaimError::NotQueued {
            job,
            phase: snapshot.phase(),
        });
    }
    let token = Token::issue(snapshot.attempt() + 1);
    let mut next = snapshot.clone();
    next.status = Some(claimed_status(snapshot, &token, holder, Timestamp::now()));
    match api
        .replace_status(&snapshot.name_any(), &PostParams::default(), &next)
        .await
    {
        Ok(stored) => Ok((stored, token)),
        Err(e) if is_status(&e, 409) => Err(ClaimError::Conflict { job }),
        Err(e) if is_status(&e, 404) => Err(ClaimError::Gone { job }),
        Err(source) => Err(ClaimError::Api { job, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::LeasedJobSpec;
    use rand::SeedableRng;

    fn job(
        name: &str,
        queue: &str,
        priority: i32,
        created: i64,
        phase: Option<Phase>,
    ) -> Arc<LeasedJob> {
        let mut j = LeasedJob::new(
            name,
            LeasedJobSpec {
                queue: queue.into(),
                priority,
                ..Default::default()
            },
        );
        j.metadata.creation_timestamp = Some(Time(Timestamp::from_second(created).unwrap()));
        j.status = phase.map(|p| LeasedJobStatus {
            phase: Some(p),
            ..Default::default()
        });
        Arc::new(j)
    }

    #[test]
    fn strict_fifo_within_the_highest_priority() {
        let jobs = vec![
            job("old-low", "q", 0, 1, None),
            job("new-high", "q", 5, 30, None),
            job("old-high", "q", 5, 20, Some(Phase::Queued)),
            job("leased-high", "q", 9, 1, Some(Phase::Leased)),
            job("other-queue", "r", 9, 1, None),
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let got = pick(&jobs, "q", Timestamp::now(), 1, |_| false, &mut rng).unwrap();
        assert_eq!(got.name_any(), "old-high");
        let got = pick(
            &jobs,
            "q",
            Timestamp::now(),
            1,
            |j| j.name_any() == "old-high",
            &mut rng,
        )
        .unwrap();
        assert_eq!(got.name_any(), "new-high");
        assert!(pick(&jobs, "none", Timestamp::now(), 1, |_| false, &mut rng).is_none());
    }

    #[test]
    fn spread_stays_inside_the_window_and_uses_it() {
        let jobs: Vec<_> = (0..10)
            .map(|i| job(&format!("j{i}"), "q", 0, i, None))
            .collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            seen.insert(
                pick(&jobs, "q", Timestamp::now(), 4, |_| false, &mut rng)
                    .unwrap()
                    .name_any(),
            );
        }
        assert_eq!(
            seen.into_iter().collect::<Vec<_>>(),
            ["j0", "j1", "j2", "j3"]
        );
    }

    #[test]
    fn not_before_retry_after_and_cancel_keep_a_job_unclaimable() {
        let now = Timestamp::from_second(1000).unwrap();
        let at = |s| Some(Time(Timestamp::from_second(s).unwrap()));
        let base = job("j", "q", 0, 5, Some(Phase::Queued));
        let with = |f: &dyn Fn(&mut LeasedJob)| {
            let mut j = (*base).clone();
            f(&mut j);
            Arc::new(j)
        };
        let cases = [
            (with(&|_| {}), true),
            (with(&|j| j.spec.not_before = at(1001)), false),
            (with(&|j| j.spec.not_before = at(1000)), true),
            (
                with(&|j| j.status.as_mut().unwrap().retry_after = at(1500)),
                false,
            ),
            (
                with(&|j| j.status.as_mut().unwrap().retry_after = at(999)),
                true,
            ),
            (with(&|j| j.spec.cancel = true), false),
        ];
        for (j, want) in &cases {
            assert_eq!(claimable(j, "q", now), *want, "{:?} {:?}", j.spec, j.status);
        }
        let jobs: Vec<_> = cases.iter().map(|(j, _)| Arc::clone(j)).collect();
        assert_eq!(
            next_claimable_at(&jobs, "q", now),
            Some(Timestamp::from_second(1001).unwrap())
        );
    }

    #[test]
    fn claimed_status_moves_exactly_one_attempt() {
        let mut j = (*job("j", "q", 0, 5, Some(Phase::Queued))).clone();
        j.status.as_mut().unwrap().attempt = 2;
        j.status.as_mut().unwrap().checkpoint = Some(serde_json::json!({"offset": 9}));
        let t = Token::issue(3);
        let s = claimed_status(&j, &t, "pod-a", Timestamp::UNIX_EPOCH);
        assert_eq!(s.phase, Some(Phase::Leased));
        assert_eq!(s.attempt, 3);
        assert_eq!(s.token.as_deref(), Some(t.as_str()));
        assert_eq!(s.holder.as_deref(), Some("pod-a"));
        assert_eq!(s.checkpoint, Some(serde_json::json!({"offset": 9})));
        assert_eq!(s.queued_time, j.metadata.creation_timestamp);
        assert_eq!(s.lease_name.as_deref(), Some("ljob-j"));
    }
}
