//! The claim: one atomic transition Queued -> Leased that issues a fresh token.
//!
//! A claimer picks a Queued job from its watch cache ([`pick`]), builds the Leased status from
//! that same snapshot ([`claimed_status`]) and replaces the status under the snapshot's
//! resourceVersion (optimistic concurrency, Kubernetes API conventions: "Concurrency Control and
//! Consistency"). The "is it still Queued?" check and the write therefore use one snapshot: if
//! anyone wrote the job since, the API server answers 409 Conflict and the claimer moves on.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use rand::Rng;

use crate::adoption::obeyed;
use crate::crd::{LeasedJob, LeasedJobStatus, Phase};
use crate::lease::lease_name;
use crate::policy;
use crate::queue::LeasedQueue;
use crate::token::Token;

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
/// same job. `spread` 1 gives strict FIFO. Snapshots already tried are left out by the
/// caller (the [`crate::claim_index::ClaimIndex`] leaves them out of its candidates).
pub fn pick<R: Rng>(
    jobs: &[Arc<LeasedJob>],
    queue: &str,
    now: Timestamp,
    spread: usize,
    rng: &mut R,
) -> Option<Arc<LeasedJob>> {
    let mut candidates: Vec<&Arc<LeasedJob>> =
        jobs.iter().filter(|j| claimable(j, queue, now)).collect();
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

/// Room the claim window makes per competing claimer. C claimers picking at random among the
/// same W oldest jobs collide about (C - 1) / W of the time, so 32 per claimer keeps a pick's
/// chance of a 409 near 3 %.
pub const WINDOW_PER_CLAIMER: usize = 32;

/// How many claimers a claimer assumes when it has seen no claim at all from its queue in the
/// last [`RECENT_CLAIM_SECONDS`] (a cold start, or the first burst after a quiet spell): many
/// sidecars woken by the same jobs would otherwise all pick among the [`WINDOW_PER_CLAIMER`]
/// oldest and most of their first claims would meet in 409s (benchmark row 2: a third of 32
/// cold claimers' first claims). Its first pick therefore spreads over up to 16 x 32 oldest
/// jobs; once claims are seen (its own included, a few hundred milliseconds later) the window
/// follows the claimers actually seen.
pub const COLD_CLAIMERS: usize = 16;

/// How recent a claim must be (by its `status.claimedTime`) for its holder to count as a
/// claimer competing now, in seconds.
pub const RECENT_CLAIM_SECONDS: i64 = 10;

/// The claimers of `queue` seen claiming lately: the distinct `status.holder` of its jobs
/// claimed within [`RECENT_CLAIM_SECONDS`] of `now` (in any phase since), with `me` among
/// them.
///
/// A sidecar cannot see the other sidecars of its queue, but it sees their claims in its
/// watch: while workers are quick this names everyone claiming; with long jobs claims are rare
/// and so is contention, and the set stays small, keeping picks close to FIFO. (A holder busy
/// with its job still counts: with quick jobs it is claiming again within milliseconds, and
/// leaving it out made the window too narrow; 409s at 32 claimers doubled.)
pub fn recent_claimers<'a>(
    jobs: &'a [Arc<LeasedJob>],
    queue: &str,
    me: &'a str,
    now: Timestamp,
) -> HashSet<&'a str> {
    let since = now - SignedDuration::from_secs(RECENT_CLAIM_SECONDS);
    let mut claimers: HashSet<&str> = jobs
        .iter()
        .filter(|j| j.spec.queue == queue)
        .filter_map(|j| j.status.as_ref())
        .filter(|s| s.claimed_time.as_ref().is_some_and(|t| t.0 >= since))
        .filter_map(|s| s.holder.as_deref())
        .collect();
    claimers.insert(me);
    claimers
}

/// The window a pick uses: the adaptive `window` (widened by 409s, narrowed by successes), but
/// never less than [`WINDOW_PER_CLAIMER`] times the `claimers` seen, and never more than
/// `max`. `spread` 1 is strict FIFO and stays 1.
pub fn window_for(window: usize, spread: usize, claimers: usize, max: usize) -> usize {
    if spread <= 1 {
        return 1;
    }
    window
        .max(claimers.saturating_mul(WINDOW_PER_CLAIMER))
        .min(max)
        .max(spread)
}

/// The snapshots (a job's name and resourceVersion) a claimer knows to be stale though its
/// watch cache may still hold them: one it claimed itself, lost with a 409, or found no
/// longer claimable. A cache trails the writes (by hundreds of milliseconds on a loaded API
/// server), so without this a claimer back from a job would pick the same snapshot again and
/// meet a write already made, often its own.
///
/// Keeps the last [`Stale::PER_JOB`] resourceVersions marked per job: a job read afresh
/// before its claim has two known-stale snapshots, the cached one and the fresh copy, and the
/// cache still passes through the second on its way to the claim. Forgets everything past
/// [`Stale::MAX_JOBS`] jobs (a stale snapshot is then at worst tried once more).
/// resourceVersions are compared for equality only, never ordered (the API's rule).
#[derive(Debug, Default)]
pub struct Stale {
    by_job: HashMap<String, Vec<String>>,
}

impl Stale {
    /// resourceVersions kept per job.
    pub const PER_JOB: usize = 2;
    /// Jobs kept before everything is forgotten.
    pub const MAX_JOBS: usize = 10_000;

    /// Marks the snapshot `rv` of job `name` stale.
    pub fn mark(&mut self, name: &str, rv: &str) {
        if self.by_job.len() >= Self::MAX_JOBS && !self.by_job.contains_key(name) {
            self.by_job.clear();
        }
        let rvs = self.by_job.entry(name.to_owned()).or_default();
        if rvs.iter().any(|r| r == rv) {
            return;
        }
        if rvs.len() >= Self::PER_JOB {
            rvs.remove(0);
        }
        rvs.push(rv.to_owned());
    }

    /// True when the snapshot `rv` of job `name` was marked stale.
    pub fn contains(&self, name: &str, rv: &str) -> bool {
        self.by_job
            .get(name)
            .is_some_and(|rvs| rvs.iter().any(|r| r == rv))
    }
}

/// The claimable jobs of the highest priority present, at most `limit` of them, the oldest,
/// in FIFO order: the linear scan that [`crate::claim_index::ClaimIndex::candidates`] answers
/// without reading the whole queue, kept as the reference its tests compare with.
#[cfg(test)]
pub fn top_candidates<'a>(
    jobs: &'a [Arc<LeasedJob>],
    queue: &str,
    now: Timestamp,
    limit: usize,
) -> Vec<&'a Arc<LeasedJob>> {
    if limit == 0 {
        return Vec::new();
    }
    let mut candidates: Vec<&Arc<LeasedJob>> =
        jobs.iter().filter(|j| claimable(j, queue, now)).collect();
    let Some(top) = candidates.iter().map(|j| j.spec.priority).max() else {
        return candidates;
    };
    candidates.retain(|j| j.spec.priority == top);
    if candidates.len() > limit {
        candidates.select_nth_unstable_by(limit - 1, |a, b| fifo_key(a).cmp(&fifo_key(b)));
        candidates.truncate(limit);
    }
    candidates.sort_by(|a, b| fifo_key(a).cmp(&fifo_key(b)));
    candidates
}

/// FIFO order: creationTimestamp, then name.
fn fifo_key(job: &LeasedJob) -> (Option<Timestamp>, Option<&str>) {
    (
        job.metadata.creation_timestamp.as_ref().map(|t| t.0),
        job.metadata.name.as_deref(),
    )
}

/// The status a successful claim writes: Leased, attempt + 1, the new token and holder, the
/// claim time, the Lease's name, the policy the attempt runs under (the job's own lease
/// duration, maxAttempts and backoff over its queue's `defaults`: [`policy::resolve`]), and the
/// limits it was made under (`status.limits`: [`obeyed`] of the queue). `queue` is the job's
/// LeasedQueue as the claimer read it, the one whose limits it took slots for (None without
/// one). Everything else (failures, checkpoint, conditions) is kept.
pub fn claimed_status(
    job: &LeasedJob,
    token: &Token,
    holder: &str,
    now: Timestamp,
    queue: Option<&LeasedQueue>,
) -> LeasedJobStatus {
    let mut status = job.status.clone().unwrap_or_default();
    let defaults = queue.and_then(|q| q.spec.defaults.as_ref());
    status.policy = Some(policy::resolve(&job.spec, defaults));
    status.limits = queue.and_then(obeyed);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::LeasedJobSpec;
    use crate::policy::JobDefaults;
    use rand::SeedableRng;

    #[test]
    fn stale_keeps_the_last_two_snapshots_of_a_job() {
        let mut stale = Stale::default();
        assert!(!stale.contains("a", "1"));
        // A job read afresh: the cached snapshot and the fresh copy are both stale after the
        // claim, in either order of marking.
        stale.mark("a", "2");
        stale.mark("a", "1");
        assert!(stale.contains("a", "1") && stale.contains("a", "2"));
        assert!(!stale.contains("a", "3") && !stale.contains("b", "1"));
        // Marking one twice keeps the other.
        stale.mark("a", "1");
        assert!(stale.contains("a", "2"));
        // A third forgets the oldest marked.
        stale.mark("a", "3");
        assert!(!stale.contains("a", "2"));
        assert!(stale.contains("a", "1") && stale.contains("a", "3"));
    }

    #[test]
    fn stale_forgets_everything_past_its_bound() {
        let mut stale = Stale::default();
        for n in 0..Stale::MAX_JOBS {
            stale.mark(&format!("j{n}"), "1");
        }
        assert!(stale.contains("j0", "1"));
        // A job already kept does not clear.
        stale.mark("j0", "2");
        assert!(stale.contains("j1", "1"));
        // A new one does.
        stale.mark("new", "1");
        assert!(!stale.contains("j1", "1"));
        assert!(stale.contains("new", "1"));
    }

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

    fn claimed_by(name: &str, holder: &str, seconds_ago: i64, now: Timestamp) -> Arc<LeasedJob> {
        let mut j = (*job(name, "q", 0, 1, Some(Phase::Succeeded))).clone();
        let status = j.status.as_mut().unwrap();
        status.holder = Some(holder.into());
        status.claimed_time = Some(Time(now - SignedDuration::from_secs(seconds_ago)));
        Arc::new(j)
    }

    #[test]
    fn recent_claimers_are_the_holders_of_recent_claims_and_me() {
        let now = Timestamp::now();
        let jobs = vec![
            claimed_by("a1", "pod-a", 1, now),
            claimed_by("a2", "pod-a", 2, now),
            claimed_by("b1", "pod-b", RECENT_CLAIM_SECONDS - 1, now),
            claimed_by("c1", "pod-c", RECENT_CLAIM_SECONDS + 5, now),
            job("queued", "q", 0, 1, Some(Phase::Queued)),
        ];
        let got = recent_claimers(&jobs, "q", "me", now);
        let mut got: Vec<&str> = got.into_iter().collect();
        got.sort_unstable();
        assert_eq!(got, ["me", "pod-a", "pod-b"]);
        assert_eq!(recent_claimers(&jobs, "other", "me", now).len(), 1);
    }

    #[test]
    fn the_window_makes_room_for_the_claimers_seen_within_its_bounds() {
        // (adaptive window, spread, claimers, max) -> window
        let cases = [
            ((16, 16, 1, 1024), 32),
            ((16, 16, 32, 1024), 1024),
            ((16, 16, 100, 1024), 1024),
            ((400, 16, 2, 1024), 400),
            ((16, 1, 32, 64), 1),
            ((4, 4, 0, 256), 4),
        ];
        for ((window, spread, claimers, max), want) in cases {
            assert_eq!(
                window_for(window, spread, claimers, max),
                want,
                "{window} {spread} {claimers} {max}"
            );
        }
    }

    #[test]
    fn top_candidates_are_the_oldest_of_the_top_priority() {
        let jobs = vec![
            job("c", "q", 1, 30, None),
            job("a", "q", 1, 10, None),
            job("b", "q", 1, 20, None),
            job("low", "q", 0, 1, None),
            job("leased", "q", 1, 1, Some(Phase::Leased)),
        ];
        let got: Vec<String> = top_candidates(&jobs, "q", Timestamp::now(), 2)
            .iter()
            .map(|j| j.name_any())
            .collect();
        assert_eq!(got, ["a", "b"]);
        assert_eq!(top_candidates(&jobs, "q", Timestamp::now(), 10).len(), 3);
        assert!(top_candidates(&jobs, "none", Timestamp::now(), 10).is_empty());
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
        let got = pick(&jobs, "q", Timestamp::now(), 1, &mut rng).unwrap();
        assert_eq!(got.name_any(), "old-high");
        // With the oldest already tried (left out by the caller), the next oldest.
        let untried: Vec<Arc<LeasedJob>> = jobs
            .iter()
            .filter(|j| j.name_any() != "old-high")
            .cloned()
            .collect();
        let got = pick(&untried, "q", Timestamp::now(), 1, &mut rng).unwrap();
        assert_eq!(got.name_any(), "new-high");
        assert!(pick(&jobs, "none", Timestamp::now(), 1, &mut rng).is_none());
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
                pick(&jobs, "q", Timestamp::now(), 4, &mut rng)
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
        let s = claimed_status(&j, &t, "pod-a", Timestamp::UNIX_EPOCH, None);
        assert_eq!(s.phase, Some(Phase::Leased));
        assert_eq!(s.attempt, 3);
        assert_eq!(s.token.as_deref(), Some(t.as_str()));
        assert_eq!(s.holder.as_deref(), Some("pod-a"));
        assert_eq!(s.checkpoint, Some(serde_json::json!({"offset": 9})));
        assert_eq!(s.queued_time, j.metadata.creation_timestamp);
        assert_eq!(s.lease_name.as_deref(), Some("ljob-j"));
        assert_eq!(s.policy, Some(policy::resolve(&j.spec, None)));
    }

    #[test]
    fn a_claim_records_the_queue_s_defaults_where_the_job_sets_none() {
        let mut j = (*job("j", "q", 0, 5, Some(Phase::Queued))).clone();
        j.spec.max_attempts = Some(7);
        let defaults = JobDefaults {
            lease_duration_seconds: Some(600),
            max_attempts: Some(1),
            backoff: None,
        };
        let mut queue = LeasedQueue::new("q", Default::default());
        queue.spec.defaults = Some(defaults);
        let s = claimed_status(
            &j,
            &Token::issue(1),
            "pod-a",
            Timestamp::UNIX_EPOCH,
            Some(&queue),
        );
        let p = s.policy.expect("recorded");
        assert_eq!((p.lease_duration_seconds, p.max_attempts), (600, 7));
        assert_eq!(s.limits, None, "a queue without limits");
    }

    #[test]
    fn a_claim_records_the_limits_it_was_made_under_and_only_those() {
        let mut j = (*job("j", "q", 0, 5, Some(Phase::Queued))).clone();
        let mut queue = LeasedQueue::new("q", Default::default());
        queue.metadata.uid = Some("u1".into());
        queue.spec.max_leased_per_key = Some(2);
        let s = claimed_status(
            &j,
            &Token::issue(1),
            "pod-a",
            Timestamp::UNIX_EPOCH,
            Some(&queue),
        );
        assert_eq!(s.limits.as_deref(), Some("u1:maxLeasedPerKey=2"));
        // The next claim, made under no limits, does not keep the last one's.
        j.status = Some(s);
        j.status.as_mut().unwrap().phase = Some(Phase::Queued);
        let s = claimed_status(&j, &Token::issue(2), "pod-a", Timestamp::UNIX_EPOCH, None);
        assert_eq!(s.limits, None);
    }
}
