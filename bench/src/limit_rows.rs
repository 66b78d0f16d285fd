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
    for a in limited {
        // Compared net of the writes the API server counts by the second whatever runs (the
        // control plane's own Leases): a limited run is longer, and would otherwise seem to
        // make more writes per job than it does.
        let extra = plain
            .iter()
            .find(|p| p.claimers == a.claimers)
            .map(|p| a.net_per_job(is_job_write) - p.net_per_job(is_job_write));
        let slot_writes =
            a.net_per_job(|k| k.is_write() && k.resource == "leases" && k.code.starts_with('2'));
        let background = a.background(is_job_write) / a.jobs.max(1) as f64;
        report.rows.push(Row {
            id: format!("2k (N={})", a.claimers),
            what: "Claim throughput with a limit per key (claim + complete)".into(),
            figure: format!(
                "{:.1} claims/s (median); {} of the ceiling; {:.2} writes/job ({background:.3} \
                 of them by the second, not by the job), {} than without limits (row 2d), net \
                 of those; {slot_writes:.2} Lease writes/job, net",
                a.per_second,
                paired::ratio_text(a),
                writes_per_job(a),
                extra.map_or("? more (no row 2d at this N)".into(), |x| format!(
                    "{x:+.2}"
                )),
            ),
            goal: format!(
                ">= {LIMITED_RATIO_GOAL} of the ceiling; <= {LIMITED_EXTRA_WRITES_GOAL} more \
                 write/job than without limits"
            ),
            verdict: Verdict::of(
                a.ratio.is_some_and(|r| r >= LIMITED_RATIO_GOAL)
                    && extra.is_some_and(|x| x <= LIMITED_EXTRA_WRITES_GOAL),
            ),
            method: format!(
                "as row 2d at the same N, in the same rounds, but the queue has a LeasedQueue \
                 with maxLeasedPerKey: {} and each of the {} jobs one of {} concurrency keys in \
                 turn, so every claim first takes a slot Lease of its key; writes/job as row 2 \
                 (LeasedJobs, Leases, Events, whatever their answer), compared with row 2d's \
                 net of the writes counted by the second (each run's rate in the {} s before \
                 its clock, claimers ready and idle, times its length); the median of {} \
                 paired ratios",
                claims::PER_KEY,
                sizes.claim_jobs,
                claims::KEYS,
                claims::IDLE.as_secs(),
                a.ratios.iter().flatten().count()
            ),
        });
        for (c, ratio) in a.runs.iter().zip(&a.ratios) {
            claim_detail(&mut detail, c, *ratio, ceilings);
        }
    }
    if limited.is_empty() {
        return;
    }
    let _ = write!(
        detail,
        "\nRequests per job, counted by the API server over every round (all clients):\n\n{}",
        requests_per_n(limited)
    );
    report.details.push((
        "Row 2k: claim throughput with a limit per key".into(),
        detail,
    ));
}
