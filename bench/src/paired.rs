//! Rows 1 and 2 over several rounds: each round measures the ceiling at N and then the claim
//! runs at N, so each claim run is compared with the ceiling measured at the start of its
//! round, on a machine in the same state. The verdict reads the median of the rounds' ratios; the spread
//! is printed beside it.
//!
//! Why rounds: on a small shared machine the ceiling alone moved from 363 to 630 writes/s
//! between runs of the same code, and one claim run's ratio from 0.20 to 0.40. A single pair
//! measured minutes apart made the verdict a coin toss; the median of paired rounds does not
//! hide the spread, it stops one slow minute from deciding.

use crate::ceiling::Ceiling;
use crate::claims::Claims;
use crate::metrics::Requests;
use crate::stats::median;

/// Row 2's figures at one N, over every round.
pub struct AtN<'a> {
    /// Concurrent claimers.
    pub claimers: usize,
    /// The claim runs at N, in round order.
    pub runs: Vec<&'a Claims>,
    /// Per claim run, in the same order: claims/s over the ceiling at N of the same round
    /// (None when that round has no ceiling at N).
    pub ratios: Vec<Option<f64>>,
    /// Claims/s over all rounds: the median.
    pub per_second: f64,
    /// The median of the ratios measured (None when none was).
    pub ratio: Option<f64>,
    /// Jobs claimed and completed, all rounds together.
    pub jobs: usize,
    /// Claim writes (PUT leasedjobs/status but one per job, its completion), all rounds
    /// together.
    pub claim_writes: f64,
    /// Share of those answered 409.
    pub conflict_share: f64,
    /// Every request the API server counted during the claim runs, all rounds together.
    pub requests: Requests,
    /// Every request the claimers' own clients sent during the claim runs, all rounds
    /// together ([`Claims::by_claimers`]).
    pub by_claimers: Requests,
}

impl AtN<'_> {
    /// Of the requests matching `matches`, those the API server would have counted in the
    /// runs' time with no claim running ([`Claims::background`]), all rounds together.
    pub fn background(&self, matches: impl Fn(&crate::metrics::Key) -> bool + Copy) -> f64 {
        self.runs.iter().map(|c| c.background(matches)).sum()
    }

    /// Per job claimed and completed, the requests matching `matches`, less their
    /// [`AtN::background`]: what the jobs themselves cost.
    pub fn net_per_job(&self, matches: impl Fn(&crate::metrics::Key) -> bool + Copy) -> f64 {
        (self.requests.sum(matches) - self.background(matches)) / self.jobs.max(1) as f64
    }

    /// Per job claimed and completed, the requests matching `matches` that the claimers'
    /// own clients sent: exact, with no background to take off.
    pub fn by_claimers_per_job(&self, matches: impl Fn(&crate::metrics::Key) -> bool) -> f64 {
        self.by_claimers.sum(matches) / self.jobs.max(1) as f64
    }
}

/// Groups the claim runs by N (in the order the Ns first appear) and pairs each with the
/// ceiling of its round.
pub fn at_each_n<'a>(ceilings: &[Ceiling], results: &[&'a Claims]) -> Vec<AtN<'a>> {
    let mut ns: Vec<usize> = Vec::new();
    for c in results {
        if !ns.contains(&c.claimers) {
            ns.push(c.claimers);
        }
    }
    ns.into_iter()
        .map(|n| {
            let mut runs: Vec<&Claims> = results
                .iter()
                .copied()
                .filter(|c| c.claimers == n)
                .collect();
            runs.sort_by_key(|c| c.round);
            let ratios: Vec<Option<f64>> = runs
                .iter()
                .map(|c| {
                    ceilings
                        .iter()
                        .find(|x| x.writers == n && x.round == c.round && x.per_second > 0.0)
                        .map(|x| c.per_second / x.per_second)
                })
                .collect();
            let measured: Vec<f64> = ratios.iter().flatten().copied().collect();
            let rates: Vec<f64> = runs.iter().map(|c| c.per_second).collect();
            let requests = runs
                .iter()
                .fold(Requests::default(), |all, c| all.plus(&c.requests));
            let by_claimers = runs
                .iter()
                .fold(Requests::default(), |all, c| all.plus(&c.by_claimers));
            let jobs: usize = runs.iter().map(|c| c.jobs).sum();
            let (claim_writes, conflicts) = crate::conflicts::claim_writes(&requests, jobs as f64);
            AtN {
                claimers: n,
                jobs,
                per_second: median(&rates).unwrap_or(0.0),
                ratio: median(&measured),
                ratios,
                claim_writes,
                conflict_share: crate::conflicts::share((claim_writes, conflicts)),
                requests,
                by_claimers,
                runs,
            }
        })
        .collect()
}

/// The ceilings at N, in round order, and their median writes/s.
pub fn ceiling_at(ceilings: &[Ceiling], n: usize) -> (Vec<&Ceiling>, f64) {
    let mut at: Vec<&Ceiling> = ceilings.iter().filter(|c| c.writers == n).collect();
    at.sort_by_key(|c| c.round);
    let rates: Vec<f64> = at.iter().map(|c| c.per_second).collect();
    (at, median(&rates).unwrap_or(0.0))
}

/// `0.31 (median of paired rounds 0.27, 0.31, 0.35)`, or the one ratio when there is one round; `?` for a
/// round without a ceiling.
pub fn ratio_text(at: &AtN) -> String {
    let one = |r: &Option<f64>| r.map_or("?".to_string(), |r| format!("{r:.2}"));
    let median = at.ratio.map_or("?".to_string(), |r| format!("{r:.2}"));
    if at.ratios.len() <= 1 {
        return median;
    }
    let each: Vec<String> = at.ratios.iter().map(one).collect();
    format!("{median} (median of paired rounds {})", each.join(", "))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::metrics::Key;

    fn ceiling(writers: usize, round: usize, per_second: f64) -> Ceiling {
        Ceiling {
            writers,
            round,
            per_second,
            server_writes_per_second: per_second,
            errors: 0,
            cpu: vec![],
        }
    }

    fn run(claimers: usize, round: usize, per_second: f64, puts: f64, conflicts: f64) -> Claims {
        let key = |code: &str| Key {
            group: "leasehold.dev".into(),
            resource: "leasedjobs".into(),
            subresource: "status".into(),
            verb: "PUT".into(),
            code: code.into(),
        };
        let mut requests = Requests::default();
        requests.0.insert(key("200"), puts - conflicts);
        requests.0.insert(key("409"), conflicts);
        Claims {
            claimers,
            round,
            mode: crate::claim_mode::Mode::Plain,
            jobs: 100,
            per_second,
            conflict_share: conflicts / puts,
            conflict_split: [0.0; 4],
            split_seconds: [0.0; 4],
            requests,
            idle: Requests::default(),
            idle_seconds: 0.0,
            by_claimers: Requests::default(),
            errors: 0,
            cpu: vec![],
            elapsed: Duration::from_secs(1),
        }
    }

    #[test]
    fn each_run_is_compared_with_the_ceiling_of_its_own_round() {
        let ceilings = [
            ceiling(8, 0, 400.0),
            ceiling(8, 1, 600.0),
            ceiling(8, 2, 500.0),
        ];
        // Round 1's claim run is the fastest, but its ceiling is too: paired, it is the
        // lowest ratio.
        // Each run's status PUTs: its claims and its 100 completions.
        let results = [
            run(8, 2, 150.0, 200.0, 0.0),
            run(8, 0, 120.0, 200.0, 2.0),
            run(8, 1, 160.0, 210.0, 9.0),
        ];
        let at = at_each_n(&ceilings, &results.iter().collect::<Vec<_>>());
        assert_eq!(at.len(), 1);
        let at = &at[0];
        assert_eq!(
            at.runs.iter().map(|c| c.round).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        let ratios: Vec<f64> = at.ratios.iter().map(|r| r.unwrap()).collect();
        assert_eq!(ratios, [0.3, 160.0 / 600.0, 0.3]);
        assert_eq!(at.ratio, Some(0.3));
        assert_eq!(at.per_second, 150.0);
        assert_eq!(at.jobs, 300);
        // The 409 share is over every claim write of every round, not a median of shares;
        // the completions' PUTs are not claim writes.
        assert_eq!(at.claim_writes, 310.0);
        assert!((at.conflict_share - 11.0 / 310.0).abs() < 1e-12);
        assert_eq!(
            ratio_text(at),
            "0.30 (median of paired rounds 0.30, 0.27, 0.30)"
        );
    }

    #[test]
    fn a_round_without_a_ceiling_has_no_ratio_and_is_left_out_of_the_median() {
        let ceilings = [ceiling(32, 0, 400.0), ceiling(8, 1, 500.0)];
        let results = [run(32, 0, 100.0, 10.0, 0.0), run(32, 1, 300.0, 10.0, 0.0)];
        let results: Vec<&Claims> = results.iter().collect();
        let at = &at_each_n(&ceilings, &results)[0];
        assert_eq!(at.ratios, [Some(0.25), None]);
        assert_eq!(at.ratio, Some(0.25));
        assert_eq!(ratio_text(at), "0.25 (median of paired rounds 0.25, ?)");
        let none = at_each_n(&[], &results);
        assert_eq!(none[0].ratio, None);
    }

    #[test]
    fn ns_keep_their_order_and_one_round_prints_one_ratio() {
        let ceilings = [ceiling(1, 0, 200.0), ceiling(8, 0, 400.0)];
        let results = [run(1, 0, 50.0, 10.0, 0.0), run(8, 0, 100.0, 10.0, 0.0)];
        let at = at_each_n(&ceilings, &results.iter().collect::<Vec<_>>());
        assert_eq!(at.iter().map(|a| a.claimers).collect::<Vec<_>>(), [1, 8]);
        assert_eq!(ratio_text(&at[1]), "0.25");
        let (rounds, rate) = ceiling_at(&ceilings, 8);
        assert_eq!((rounds.len(), rate), (1, 400.0));
    }
}
