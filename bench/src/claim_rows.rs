//! Rows 1 and 2 and their detail: the API server's ceiling, claim throughput in paired rounds,
//! writes per job, and their charts.

use std::fmt::Write as _;

use crate::claim_mode::Mode;
use crate::report::{Report, Row, Verdict};
use crate::*;

/// Rows 1, 2, 2d, 2k, 2b and 2bk, round by round: at each N, the ceiling, then (with
/// `claims`) the claim run compared with it, and at N > 1 two pairs of runs against the same
/// ceiling: through the dispatcher without limits and with a limit per key (2d, 2k), and the
/// bounds of two and of three writes per job (2b, 2bk); the first pair in rounds 1, 3, ...,
/// the bounds first in rounds 2, 4, .... A failed measurement is recorded and the rest goes
/// on.
pub(crate) async fn rows_1_and_2(
    bench: &cluster::Bench,
    sizes: &Sizes,
    claims: bool,
    failures: &mut Vec<(&'static str, anyhow::Error)>,
) -> (Vec<ceiling::Ceiling>, Vec<claims::Claims>) {
    let (mut ceilings, mut results) = (Vec::new(), Vec::new());
    let most = sizes.claimers.iter().copied().max().unwrap_or(1);
    // Without the ceiling's jobs the claim runs still run: their ratios print as unknown.
    let jobs = match ceiling::prepare(bench, most).await {
        Ok(j) => Some(j),
        Err(e) => {
            failures.push(("1", e));
            None
        }
    };
    for round in 0..sizes.rounds {
        for &n in &sizes.claimers {
            if let Some(jobs) = &jobs {
                eprintln!("row 1: ceiling, N = {n}, round {}", round + 1);
                match ceiling::measure(bench, jobs, n, round, sizes.ceiling_seconds).await {
                    Ok(c) => ceilings.push(c),
                    Err(e) => failures.push(("1", e)),
                }
            }
            if claims {
                eprintln!(
                    "row 2: {}, N = {n}, round {}",
                    progress(Mode::Plain),
                    round + 1
                );
                match claims::run(bench, n, sizes.claim_jobs, round, Mode::Plain).await {
                    Ok(c) => results.push(c),
                    Err(e) => failures.push(("2", e)),
                }
            }
            // Several claimers again, against the same ceiling: through the dispatcher (row
            // 2d), with a limit per concurrency key (row 2k), and the bounds of two writes per
            // job (row 2b) and three (row 2bk). The pairs take turns going first, round by
            // round, so that neither is always the one measured further from its ceiling.
            if claims && n > 1 {
                let rows = [Mode::Dispatched, Mode::Limited];
                let bounds = [Mode::Bound, Mode::BoundKeyed];
                let order = if round % 2 == 0 {
                    [rows, bounds]
                } else {
                    [bounds, rows]
                };
                for mode in order.into_iter().flatten() {
                    eprintln!(
                        "row {}: {}, N = {n}, round {}",
                        mode.row(),
                        progress(mode),
                        round + 1
                    );
                    match claims::run(bench, n, sizes.claim_jobs, round, mode).await {
                        Ok(c) => results.push(c),
                        Err(e) => failures.push((mode.row(), e)),
                    }
                }
            }
        }
    }
    (ceilings, results)
}

pub(crate) fn ceiling_rows(report: &mut Report, ceilings: &[ceiling::Ceiling], sizes: &Sizes) {
    let mut detail = String::from(
        "| N | round | writes/s (writers' count) | writes/s (apiserver_request_total) | errors | CPU, cores |\n|---|---|---|---|---|---|\n",
    );
    for &n in &sizes.claimers {
        let (rounds, median) = paired::ceiling_at(ceilings, n);
        if rounds.is_empty() {
            continue;
        }
        let figure = if rounds.len() == 1 {
            format!("{median:.0} writes/s")
        } else {
            let each: Vec<String> = rounds
                .iter()
                .map(|c| format!("{:.0}", c.per_second))
                .collect();
            format!(
                "{median:.0} writes/s (median of rounds {})",
                each.join(", ")
            )
        };
        report.rows.push(Row {
            id: format!("1 (N={n})"),
            what: "Ceiling: conditional LeasedJob status updates".into(),
            figure,
            goal: "- (reference)".into(),
            verdict: Verdict::NoGoal,
            method: format!(
                "{n} writers, each with its own kube-rs client and its own LeasedJob, replace the \
                 status (the same write a claim makes) under the resourceVersion last returned; \
                 {} s after a 1 s warm-up, in each of {} rounds (with row 2: each followed by \
                 the claim run at the same N, once its queue is ready)",
                sizes.ceiling_seconds,
                rounds.len()
            ),
        });
        for c in rounds {
            let _ = writeln!(
                detail,
                "| {} | {} | {:.0} | {:.0} | {} | {} |",
                c.writers,
                c.round + 1,
                c.per_second,
                c.server_writes_per_second,
                c.errors,
                cpu_line(&c.cpu)
            );
        }
    }
    if !ceilings.is_empty() {
        report.details.push(("Row 1: ceiling".into(), detail));
    }
}

/// The issue "Scale"'s throughput goal: claims/s at least this share of the ceiling, at
/// N = 8 and N = 32 (the median of the rounds).
pub(crate) const SCALE_RATIO_GOAL: f64 = 0.28;

/// `133.4 claims/s (median); 0.31 (median of paired rounds ...) of the ceiling`: how every
/// throughput row of row 2 (2, 2b, 2bk, 2d, 2k) begins its figure.
pub(crate) fn throughput_figure(a: &paired::AtN) -> String {
    format!(
        "{:.1} claims/s (median); {} of the ceiling",
        a.per_second,
        paired::ratio_text(a)
    )
}

/// One throughput row per N of `at`, made by `row`, each followed by one detail line per run
/// of it, against its round's ceiling, in `detail`.
pub(crate) fn throughput_rows(
    report: &mut Report,
    at: &[paired::AtN],
    ceilings: &[ceiling::Ceiling],
    detail: &mut String,
    row: impl Fn(&paired::AtN) -> Row,
) {
    for a in at {
        report.rows.push(row(a));
        for (c, ratio) in a.runs.iter().zip(&a.ratios) {
            claim_detail(detail, c, *ratio, ceilings);
        }
    }
}

pub(crate) fn claim_rows(
    report: &mut Report,
    at: &[paired::AtN],
    ceilings: &[ceiling::Ceiling],
    sizes: &Sizes,
) {
    let most = sizes.claimers.iter().copied().max().unwrap_or(1);
    let mut detail = String::new();
    throughput_rows(report, at, ceilings, &mut detail, |a| Row {
        id: format!("2 (N={})", a.claimers),
        what: "Claim throughput (claim + complete)".into(),
        figure: format!(
            "{}; 409 on {:.1}% of claim writes",
            throughput_figure(a),
            a.conflict_share * 100.0
        ),
        goal: ">= 0.40 of the ceiling".into(),
        verdict: a.ratio.map_or(Verdict::Missed, |r| Verdict::of(r >= 0.4)),
        method: format!(
            "{} queued jobs; {} Worker instances (the sidecar's library, each with its own \
             client and watch) claim then complete in a loop, controller running; claims/s = \
             jobs / time until all completed; ratio = claims/s / the ceiling at the same N \
             measured before it in the same round, the median of the {} ratios measured ({} \
             rounds); 409 share from apiserver_request_total (PUT leasedjobs/status, one per \
             job aside: its completion), all rounds together",
            sizes.claim_jobs,
            a.claimers,
            a.ratios.iter().flatten().count(),
            a.runs.len()
        ),
    });
    if let Some(a) = at.iter().find(|a| a.claimers == most) {
        report.rows.push(Row {
            id: format!("2 (N={})", a.claimers),
            what: "Claim conflicts".into(),
            figure: format!(
                "{:.1}% of {:.0} claim writes answered 409",
                a.conflict_share * 100.0,
                a.claim_writes
            ),
            goal: format!("< 10% at {most} claimers"),
            verdict: Verdict::of(a.conflict_share < 0.10),
            method: "apiserver_request_total: PUT leasedjobs/status with code 409 / the PUT \
                     leasedjobs/status but one per job (its completion), during the runs above"
                .into(),
        });
    }
    if at.is_empty() {
        return;
    }
    // Every N >= 8 asked for counts: one whose runs all failed is missed, not left out.
    let scale: Vec<(usize, Option<f64>)> = sizes
        .claimers
        .iter()
        .filter(|&&n| n >= 8)
        .map(|&n| (n, at.iter().find(|a| a.claimers == n).and_then(|a| a.ratio)))
        .collect();
    if !scale.is_empty() {
        let figure: Vec<String> = scale
            .iter()
            .map(|(n, ratio)| {
                format!(
                    "{} at N={n}",
                    ratio.map_or("not measured".into(), |r| format!("{r:.2}"))
                )
            })
            .collect();
        report.rows.push(Row {
            id: "2 (N>=8)".into(),
            what: "Claim throughput / ceiling, the goal of the issue \"Scale\"".into(),
            figure: figure.join("; "),
            goal: format!(">= {SCALE_RATIO_GOAL} at every N >= 8"),
            verdict: Verdict::of(
                scale
                    .iter()
                    .all(|(_, ratio)| ratio.is_some_and(|r| r >= SCALE_RATIO_GOAL)),
            ),
            method: "the median paired ratios of the rows above".into(),
        });
    }
    report.rows.push(writes_per_job_row(at));
    let _ = write!(
        detail,
        "\nRequests per job, counted by the API server over every round (all clients: \
         claimers, controller, and the controller's Events):\n\n{}",
        requests_per_n(at)
    );
    report
        .details
        .push(("Row 2: claim throughput".into(), detail));
}

/// The table of requests per job at each N of `at`, every round together.
pub(crate) fn requests_per_n(at: &[paired::AtN]) -> String {
    let names: Vec<String> = at.iter().map(|a| format!("N={}", a.claimers)).collect();
    let columns: Vec<(&str, &metrics::Requests, f64)> = at
        .iter()
        .zip(&names)
        .map(|(a, n)| (n.as_str(), &a.requests, a.jobs as f64))
        .collect();
    requests_table(&columns)
}

/// API writes (LeasedJobs, Leases, Events) per job claimed and completed at one N, every
/// round together.
pub(crate) fn writes_per_job(a: &paired::AtN) -> f64 {
    a.requests.sum(is_job_write) / a.jobs.max(1) as f64
}

/// One line of row 2's detail: one claim run.
pub(crate) fn claim_detail(
    detail: &mut String,
    c: &claims::Claims,
    ratio: Option<f64>,
    ceilings: &[ceiling::Ceiling],
) {
    let ceiling = ceilings
        .iter()
        .find(|x| x.writers == c.claimers && x.round == c.round);
    let writes = c.requests.sum(metrics::Key::is_write) / c.elapsed.as_secs_f64();
    let _ = writeln!(
        detail,
        "- N = {}, round {}: {} jobs in {:.1} s, {:.1} claims/s = {} of that round's \
         ceiling; {} worker errors; 409 share {:.1}% in all, {} over the first quarter of the \
         jobs, {} over the middle half, {} over the last quarter but the last {} jobs, {} over \
         the last {}; the four parts took {} s; the API server handled {:.0} writes/s ({}) \
         and {:.0} reads/s; CPU in cores: {}",
        c.claimers,
        c.round + 1,
        c.jobs,
        c.elapsed.as_secs_f64(),
        c.per_second,
        ratio.map_or("?".into(), |r| format!("{r:.2}")),
        c.errors,
        c.conflict_share * 100.0,
        split_share(c.conflict_split[0]),
        split_share(c.conflict_split[1]),
        split_share(c.conflict_split[2]),
        c.claimers.min(c.jobs),
        split_share(c.conflict_split[3]),
        c.claimers.min(c.jobs),
        c.split_seconds
            .iter()
            .map(|s| if s.is_nan() {
                "?".into()
            } else {
                format!("{s:.2}")
            })
            .collect::<Vec<_>>()
            .join(", "),
        writes,
        ceiling.map_or("no ceiling measured".into(), |x| format!(
            "{:.2}x the ceiling's write rate",
            writes / x.server_writes_per_second
        )),
        c.requests
            .sum(|k| matches!(k.verb.as_str(), "GET" | "LIST"))
            / c.elapsed.as_secs_f64(),
        cpu_line(&c.cpu)
    );
}

/// Largest number of API writes a claimed-and-completed job may cost (the issue "Scale"'s
/// goal: the claim, the Lease create and the completion, plus a little for claim conflicts).
pub(crate) const WRITES_PER_JOB_GOAL: f64 = 3.2;

/// True for a write leasehold makes on a job's behalf: to LeasedJobs (and their status),
/// Leases and Events.
pub(crate) fn is_job_write(k: &metrics::Key) -> bool {
    k.is_write() && matches!(k.resource.as_str(), "leasedjobs" | "leases" | "events")
}

/// The row "API writes per happy-path job": every write to LeasedJobs, Leases and Events during
/// the claim runs of row 2 (default settings: the controller records Events for problems only),
/// per job claimed and completed, every round together; the goal must hold at every N,
/// conflicts (409) included.
pub(crate) fn writes_per_job_row(at: &[paired::AtN]) -> Row {
    let per_job: Vec<(usize, f64, f64)> = at
        .iter()
        .map(|a| {
            let jobs = a.jobs.max(1) as f64;
            let all = a.requests.sum(is_job_write) / jobs;
            let refused = a
                .requests
                .sum(|k| is_job_write(k) && !k.code.starts_with('2'))
                / jobs;
            (a.claimers, all, refused)
        })
        .collect();
    let figure = per_job
        .iter()
        .map(|(n, all, refused)| {
            if *refused >= 0.005 {
                format!("{all:.2} at N={n} ({refused:.2} of them refused, mostly 409)")
            } else {
                format!("{all:.2} at N={n}")
            }
        })
        .collect::<Vec<_>>()
        .join("; ");
    Row {
        id: "2 (all N)".into(),
        what: "API writes per happy-path job (claim + complete), default settings".into(),
        figure: format!("{figure} writes/job"),
        goal: format!("<= {WRITES_PER_JOB_GOAL} at every N"),
        verdict: Verdict::of(
            per_job
                .iter()
                .all(|(_, all, _)| *all <= WRITES_PER_JOB_GOAL),
        ),
        method: "the claim runs of row 2 (controller with its default --events problems): \
                 apiserver_request_total writes (POST, PUT, PATCH, DELETE) on leasedjobs (and \
                 their status), leases and events, whatever their answer, / jobs; includes the \
                 few writes of the control plane's own Leases in the same seconds"
            .into(),
    }
}

/// Row 2's curves: claims per second (the median over the rounds), and the share of claim
/// writes answered 409 (all rounds together), against N.
pub(crate) fn claim_charts(at: &[paired::AtN]) -> Vec<plots::Chart> {
    let points = |f: fn(&paired::AtN) -> f64| {
        at.iter()
            .map(|a| (a.claimers as f64, f(a)))
            .collect::<Vec<_>>()
    };
    vec![
        plots::Chart {
            file: "claims-vs-claimers.svg",
            title: "Claim throughput against concurrent claimers".into(),
            x: "claimers (N)",
            y: "jobs claimed and completed per second",
            lines: vec![plots::Line {
                name: "claims/s".into(),
                points: points(|a| a.per_second),
            }],
        },
        plots::Chart {
            file: "conflicts-vs-claimers.svg",
            title: "Claim conflicts against concurrent claimers".into(),
            x: "claimers (N)",
            y: "% of claim writes answered 409",
            lines: vec![plots::Line {
                name: "409 share".into(),
                points: points(|a| a.conflict_share * 100.0),
            }],
        },
    ]
}

/// The issue "Fleet scale"'s goals for claims through the dispatcher: claims/s at least this
/// share of the ceiling at N = 8 and 32 (the limit at 2 writes per job is 0.5) ...
pub(crate) const FLEET_RATIO_GOAL: f64 = 0.45;
/// ... fewer than this share of claim writes answered 409 at the most claimers ...
pub(crate) const FLEET_CONFLICT_GOAL: f64 = 0.002;
/// ... and at most this many API writes per short job, everything counted.
pub(crate) const FLEET_WRITES_GOAL: f64 = 2.1;

/// What a claim run of `mode` measures, for the progress line.
fn progress(mode: Mode) -> String {
    match mode {
        Mode::Plain => "claim throughput".into(),
        Mode::Dispatched => "claim throughput through the dispatcher".into(),
        Mode::Limited => "claim throughput with limits per key".into(),
        Mode::Bound | Mode::BoundKeyed => {
            format!("{} writes per job and nothing else", mode.writes_per_job())
        }
    }
}

/// Rows 2b, the bound, or 2bk, the keyed bound (`mode`; `at`: that mode's runs only), at each
/// N, each against the ceiling of its round, as row 2; a reference, without a goal of its own.
pub(crate) fn bound_claim_rows(
    report: &mut Report,
    at: &[paired::AtN],
    ceilings: &[ceiling::Ceiling],
    sizes: &Sizes,
    mode: Mode,
) {
    let keyed = mode.takes_slots();
    let id = mode.row();
    let (what, writes, title) = if keyed {
        (
            "Keyed bound: the three writes of each job of row 2k and nothing else (slot + claim \
             + complete)",
            "a replace of a Lease of the claimer's own under the resourceVersion its last \
             write returned, written as a slot's take writes it (without the list of the \
             scope's slots and the judging read a take makes first, and without an owner), \
             then the job's claim",
            "Row 2bk: the keyed bound, three writes per job and nothing else",
        )
    } else {
        (
            "Bound: the two writes of each job and nothing else (claim + complete)",
            "each job's claim",
            "Row 2b: the bound, two writes per job and nothing else",
        )
    };
    let order = if sizes.rounds > 1 {
        "after rows 2d and 2k in rounds 1, 3, ..., before them in rounds 2, 4, ..."
    } else {
        "after rows 2d and 2k"
    };
    let mut detail = String::new();
    throughput_rows(report, at, ceilings, &mut detail, |a| Row {
        id: format!("{id} (N={})", a.claimers),
        what: what.into(),
        figure: throughput_figure(a),
        goal: format!(
            "- (reference: what the {} writes alone reach here)",
            if keyed { "three" } else { "two" }
        ),
        verdict: Verdict::NoGoal,
        method: format!(
            "as row 2 at the same N, in the same rounds ({order}), but with no \
             Worker, read, watch, dispatcher or controller (stopped once the jobs are Queued): \
             N claimers, each with its own kube-rs client, take the {} jobs of one list read \
             before the clock, dealt out in turn, and make {writes} (status replace under the \
             listed resourceVersion) and completion (status replace from the claim's answer); \
             the median of {} paired ratios",
            sizes.claim_jobs,
            a.ratios.iter().flatten().count()
        ),
    });
    if !at.is_empty() {
        report.details.push((title.into(), detail));
    }
}

/// Row 2d: the claim runs through the dispatcher (`at`: the dispatched runs only), each
/// against the ceiling of its round, as row 2.
pub(crate) fn dispatched_claim_rows(
    report: &mut Report,
    at: &[paired::AtN],
    ceilings: &[ceiling::Ceiling],
    sizes: &Sizes,
) {
    let mut detail = String::new();
    throughput_rows(report, at, ceilings, &mut detail, |a| Row {
        id: format!("2d (N={})", a.claimers),
        what: "Claim throughput through the dispatcher (claim + complete)".into(),
        figure: format!(
            "{}; 409 on {:.2}% of {:.0} claim writes",
            throughput_figure(a),
            a.conflict_share * 100.0,
            a.claim_writes
        ),
        goal: format!(
            ">= {FLEET_RATIO_GOAL} of the ceiling; 409 < {:.1}%",
            FLEET_CONFLICT_GOAL * 100.0
        ),
        verdict: Verdict::of(
            a.ratio.is_some_and(|r| r >= FLEET_RATIO_GOAL)
                && a.conflict_share < FLEET_CONFLICT_GOAL,
        ),
        method: format!(
            "as row 2 at the same N, in the same rounds, but each Worker has a dispatcher token \
             and keeps no copy of the queue: it claims the job the controller's dispatcher \
             offers it; {} queued jobs; the median of {} paired ratios",
            sizes.claim_jobs,
            a.ratios.iter().flatten().count()
        ),
    });
    if at.is_empty() {
        return;
    }
    let mut row = writes_per_job_row(at);
    row.id = "2d (all N)".into();
    row.what = "API writes per short job through the dispatcher (claim + complete)".into();
    row.goal = format!("<= {FLEET_WRITES_GOAL} at every N");
    row.verdict = Verdict::of(at.iter().all(|a| writes_per_job(a) <= FLEET_WRITES_GOAL));
    report.rows.push(row);
    report.details.push((
        "Row 2d: claim throughput through the dispatcher".into(),
        detail,
    ));
}
