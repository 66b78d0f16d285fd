//! Row 2k: claims in a queue with a limit per concurrency key, through the dispatcher, each
//! run against the ceiling of its round and beside the dispatched run without limits (row 2d)
//! of the same N: what the slots of docs/protocol.md's "Limits" cost.

use std::fmt::Write as _;

use crate::report::{Report, Row, Verdict};
use crate::*;

/// The issue "Flow control"'s goals for claims with limits on: claims/s at least this share
/// of the ceiling at every N measured ...
pub(crate) const LIMITED_RATIO_GOAL: f64 = 0.3;
/// ... and at most this many API writes per keyed job more than the same claims without
/// limits (the slot's one conditional write).
pub(crate) const LIMITED_EXTRA_WRITES_GOAL: f64 = 1.0;

/// Whether keyed claims met the writes goal: `mine`, the claimers' extra writes per job over
/// row 2d's (their own clients' count, exact), at most [`LIMITED_EXTRA_WRITES_GOAL`]; and
/// `others`, everyone else's extra writes per job (the API server's count less the claimers',
/// net of the writes it counts by the second), at most `noise`, the writes per job counted by
/// the second in the limited runs: a difference no larger than the whole of what is estimated
/// cannot be told from an error of the estimate.
pub(crate) fn extra_writes_met(mine: f64, others: f64, noise: f64) -> bool {
    mine <= LIMITED_EXTRA_WRITES_GOAL && others <= noise
}

/// Rows 2k: `limited`, the limited runs grouped by N, and `plain`, the dispatched runs
/// without limits (row 2d) to compare their writes with.
pub(crate) fn limited_claim_rows(
    report: &mut Report,
    limited: &[paired::AtN],
    plain: &[paired::AtN],
    ceilings: &[ceiling::Ceiling],
    sizes: &Sizes,
) {
    let mut detail = String::new();
    throughput_rows(report, limited, ceilings, &mut detail, |a| {
        limited_row(a, plain.iter().find(|p| p.claimers == a.claimers), sizes)
    });
    if limited.is_empty() {
        return;
    }
    let _ = write!(
        detail,
        "\nRequests per job, counted by the API server over every round (all clients):\n\n{}",
        requests_per_n(limited)
    );
    let names: Vec<String> = limited
        .iter()
        .map(|a| format!("2k, N={}", a.claimers))
        .chain(plain.iter().map(|p| format!("2d, N={}", p.claimers)))
        .collect();
    let columns: Vec<(&str, &metrics::Requests, f64)> = limited
        .iter()
        .chain(plain)
        .zip(&names)
        .map(|(a, n)| (n.as_str(), &a.by_claimers, a.jobs.max(1) as f64))
        .collect();
    let _ = write!(
        detail,
        "\nRequests per job sent by the claimers' own clients over every round, with limits \
         (2k) and without (2d):\n\n{}",
        requests_table(&columns)
    );
    report.details.push((
        "Row 2k: claim throughput with a limit per key".into(),
        detail,
    ));
}

/// Row 2k at one N: `a`, the limited runs, against `plain`, row 2d's runs at that N.
fn limited_row(a: &paired::AtN, plain: Option<&paired::AtN>, sizes: &Sizes) -> Row {
    // The claimers' writes are counted by their own clients, exactly; everyone else's are what
    // the API server counted beyond those, net of the writes it counts by the second whatever
    // runs (the control plane's own Leases), since a limited run is longer.
    let mine = |x: &paired::AtN| x.by_claimers_per_job(is_job_write);
    let others = |x: &paired::AtN| x.net_per_job(is_job_write) - mine(x);
    let extra = plain.map(|p| (mine(a) - mine(p), others(a) - others(p)));
    let noise = a.background(is_job_write) / a.jobs.max(1) as f64;
    let slots = |k: &metrics::Key| k.is_write() && k.resource == "leases";
    let slot_writes = a.by_claimers_per_job(slots);
    let slot_refused = a.by_claimers_per_job(|k| slots(k) && !k.code.starts_with('2'));
    Row {
        id: format!("2k (N={})", a.claimers),
        what: "Claim throughput with a limit per key (claim + complete)".into(),
        figure: format!(
            "{}; {}; {slot_writes:.3} slot Lease writes/job ({slot_refused:.3} of them refused); \
             {:.2} writes/job as the API server counts them, {noise:.3} of them by the second",
            throughput_figure(a),
            extra.map_or(
                "? more writes/job (no row 2d at this N)".into(),
                |(m, o)| {
                    format!(
                        "{m:+.3} writes/job by the claimers more than without limits (row 2d), \
                     {o:+.3} by everyone else"
                    )
                }
            ),
            writes_per_job(a),
        ),
        goal: format!(
            ">= {LIMITED_RATIO_GOAL} of the ceiling; <= {LIMITED_EXTRA_WRITES_GOAL} more \
             write/job by the claimers than without limits, and none more by anyone else"
        ),
        verdict: Verdict::of(
            a.ratio.is_some_and(|r| r >= LIMITED_RATIO_GOAL)
                && extra.is_some_and(|(m, o)| extra_writes_met(m, o, noise)),
        ),
        method: format!(
            "as row 2d at the same N, in the same rounds, but the queue has a LeasedQueue with \
             maxLeasedPerKey: {} and each of the {} jobs one of {} concurrency keys in turn, so \
             every claim first takes a slot Lease of its key; writes/job as row 2 (LeasedJobs, \
             Leases, Events, whatever their answer); the claimers' counted by their own \
             clients; everyone else's (the controller's, the control plane's) are the API \
             server's count less those, net of the writes it counts by the second (each run's \
             rate in the {} s before its clock, claimers ready and idle, times its length), \
             read as none more than row 2d's when within those writes by the second; the \
             median of {} paired ratios",
            claims::PER_KEY,
            sizes.claim_jobs,
            claims::KEYS,
            claims::IDLE.as_secs(),
            a.ratios.iter().flatten().count()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_claims_meet_the_writes_goal_with_one_more_write_and_nothing_else() {
        // The slot's one write, and everyone else's unchanged within the noise.
        assert!(extra_writes_met(1.0, 0.001, 0.01));
        assert!(extra_writes_met(0.98, -0.004, 0.01));
        // A slot write refused and written again is a write more.
        assert!(!extra_writes_met(1.003, 0.0, 0.01));
        // Anyone else writing for some keyed jobs (say the controller, once per 20) is seen.
        assert!(!extra_writes_met(1.0, 0.05, 0.01));
        assert!(extra_writes_met(1.0, 0.01, 0.01));
    }
}
