//! Row 11's text: the fleet goals of the dispatcher, each a row, from the fewest waiting
//! sidecars to the most, side by side.

use std::fmt::Write as _;

use crate::fleet::{self, Fleet};
use crate::queuelen::Stage;
use crate::report::{Report, Row, Verdict};
use crate::stats::{mib, percentile};

pub(crate) fn fleet_rows(report: &mut Report, f: &[Fleet]) {
    let (Some(first), Some(last)) = (f.first(), f.last()) else {
        return;
    };
    let method = format!(
        "S sidecar processes with a dispatcher token on one queue, every one waiting in POST \
         /v1/claim?wait=30; {} jobs created one at a time ({} per second), each completed at \
         once; over the window, from the API server's own metrics and /proc",
        first.jobs,
        fleet::RATE
    );
    let each = |what: &dyn Fn(&Fleet) -> String| {
        f.iter()
            .map(|x| format!("S={}: {}", x.sidecars, what(x)))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let events_growth = last.events_per_job() / first.events_per_job();
    report.rows.push(Row {
        id: "11a".into(),
        what: "LeasedJob watch events sent per job, against waiting sidecars".into(),
        figure: format!(
            "{}; x{events_growth:.2} from S={} to S={}",
            each(&|x| format!(
                "{:.1} ({} LeasedJob watches open)",
                x.events_per_job(),
                x.open_watches
            )),
            first.sidecars,
            last.sidecars
        ),
        goal: "grows < 1.2x".into(),
        verdict: Verdict::of(events_growth < 1.2),
        method: method.clone(),
    });
    let api = |x: &Fleet| x.cpu_seconds_per_job("kube-apiserver") * 1000.0;
    let cpu_growth = api(last) / api(first);
    report.rows.push(Row {
        id: "11b".into(),
        what: "kube-apiserver CPU per claimed job, against waiting sidecars".into(),
        figure: format!(
            "{}; x{cpu_growth:.2}",
            each(&|x| format!("{:.1} ms", api(x)))
        ),
        goal: "grows < 1.2x".into(),
        verdict: Verdict::of(cpu_growth < 1.2),
        method: method.clone(),
    });
    let p99 = |x: &Fleet| percentile(&x.latency_ms, 99.0).unwrap_or(f64::NAN);
    report.rows.push(Row {
        id: "11c".into(),
        what: "Creation to claim, p99, with every sidecar waiting".into(),
        figure: each(&|x| format!("{:.0} ms", p99(x))),
        goal: format!("< 50 ms at S={}", last.sidecars),
        verdict: Verdict::of(p99(last) < 50.0),
        method: method.clone(),
    });
    let writes = f.iter().map(Fleet::writes_per_job).fold(0.0, f64::max);
    report.rows.push(Row {
        id: "11d".into(),
        what: "API writes per short job, the create aside (claims, completions, the \
               controller's, Leases, adverts)"
            .into(),
        figure: each(&|x| format!("{:.2}", x.writes_per_job())),
        goal: "<= 2.1 (+1, the controller's initial status)".into(),
        verdict: Verdict::of(writes <= 3.1),
        method: method.clone(),
    });
    let conflicts = f.iter().map(Fleet::conflict_share).fold(0.0, f64::max);
    report.rows.push(Row {
        id: "11e".into(),
        what: "Claim writes answered 409, with every sidecar waiting".into(),
        figure: each(&|x| format!("{:.2} %", 100.0 * x.conflict_share())),
        goal: "< 0.2 %".into(),
        verdict: Verdict::of(conflicts < 0.002),
        method: method.clone(),
    });
    let largest = |x: &Fleet| x.sidecar_rss_kib.iter().copied().max().unwrap_or(0);
    report.rows.push(Row {
        id: "11f".into(),
        what: "Sidecar resident memory (largest), with a dispatcher".into(),
        figure: each(&|x| format!("{:.1} MiB", mib(largest(x)))),
        goal: "<= 20 MiB".into(),
        verdict: Verdict::of(f.iter().all(|x| mib(largest(x)) <= 20.0)),
        method,
    });
    let mut detail = String::new();
    for x in f {
        let p50 = percentile(&x.latency_ms, 50.0).unwrap_or(f64::NAN);
        let total: u64 = x.sidecar_rss_kib.iter().sum();
        let _ = writeln!(
            detail,
            "- S = {}: {} jobs in {:.1} s; creation to claim p50 {p50:.1} ms, p99 {:.1} ms; per \
             job: kube-apiserver {:.1} ms CPU, etcd {:.1} ms, controller {:.1} ms, sidecars \
             together {:.1} ms, {:.1} watch events ({:.1} KiB), {:.2} writes; 409s {:.2} %; \
             sidecars' RSS {:.0} MiB in all, {:.1} MiB the largest; controller {:.1} MiB",
            x.sidecars,
            x.jobs,
            x.elapsed.as_secs_f64(),
            p99(x),
            api(x),
            x.cpu_seconds_per_job("etcd") * 1000.0,
            x.cpu_seconds_per_job("leasehold controller") * 1000.0,
            x.cpu_seconds_per_job("leasehold sidecars") * 1000.0,
            x.events_per_job(),
            x.sent.bytes / x.jobs as f64 / 1024.0,
            x.writes_per_job(),
            100.0 * x.conflict_share(),
            mib(total),
            mib(largest(x)),
            mib(x.controller_rss_kib),
        );
        let mut writes: Vec<_> = x
            .requests
            .by_resource_verb()
            .into_iter()
            .filter(|g| {
                matches!(
                    g.verb.as_str(),
                    "POST" | "PUT" | "PATCH" | "APPLY" | "DELETE"
                )
            })
            .map(|g| format!("{} {} {:.0}", g.verb, g.resource, g.count))
            .collect();
        writes.sort();
        let _ = writeln!(detail, "  - writes in the window: {}", writes.join(", "));
    }
    report
        .details
        .push(("Row 11: the fleet, with the dispatcher".into(), detail));
}

/// Row 10's fleet figures: a sidecar with the dispatcher, and the controller, against the
/// queue's length.
pub(crate) fn dispatched_queuelen_rows(report: &mut Report, q: &[Stage]) {
    let (Some(first), Some(last)) = (q.first(), q.last()) else {
        return;
    };
    let each = |what: &dyn Fn(&Stage) -> String| {
        q.iter()
            .map(|s| format!("{} jobs: {}", s.jobs, what(s)))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let rss = |s: &Stage| mib(s.dispatched.rss_kib);
    let flat = rss(last) - rss(first);
    report.rows.push(Row {
        id: "10d".into(),
        what: "Sidecar resident memory with a dispatcher, against the jobs queued on its queue"
            .into(),
        figure: format!(
            "{}; {flat:+.1} MiB from {} to {} jobs",
            each(&|s| format!("{:.1} MiB", rss(s))),
            first.jobs,
            last.jobs
        ),
        goal: "<= 20 MiB, and flat (within 2 MiB)".into(),
        verdict: Verdict::of(q.iter().all(|s| rss(s) <= 20.0) && flat.abs() <= 2.0),
        method: "a sidecar with a dispatcher token started afresh at each stage; VmRSS a second \
                 after its first claim"
            .into(),
    });
    let first_claim = |s: &Stage| s.dispatched_first_claim.as_secs_f64();
    report.rows.push(Row {
        id: "10e".into(),
        what: "First claim after a sidecar (re)start, with a dispatcher".into(),
        figure: each(&|s| format!("{:.2} s", first_claim(s))),
        goal: "< 1 s".into(),
        verdict: Verdict::of(q.iter().all(|s| first_claim(s) < 1.0)),
        method: "from spawning the sidecar process to its first POST /v1/claim answered 200 \
                 (the process starts, watches its held jobs and the advert Lease, asks the \
                 dispatcher, reads and claims the job offered)"
            .into(),
    });
    let per_thousand = |s: &Stage| mib(s.controller.rss_kib) / s.jobs as f64 * 1000.0;
    let slope = (mib(last.controller.rss_kib) - mib(first.controller.rss_kib))
        / (last.jobs - first.jobs).max(1) as f64
        * 1000.0;
    report.rows.push(Row {
        id: "10f".into(),
        what: "Controller (with its dispatcher) memory per 1,000 jobs".into(),
        figure: format!(
            "{:.2} MiB per 1,000 jobs between {} and {} jobs ({}); ready in {:.1} s at {} jobs",
            slope,
            first.jobs,
            last.jobs,
            each(&|s| format!(
                "{:.0} MiB, {:.2} per 1,000",
                mib(s.controller.rss_kib),
                per_thousand(s)
            )),
            last.controller_ready.as_secs_f64(),
            last.jobs
        ),
        goal: "<= 0.6 MiB per 1,000 jobs; ready < 30 s".into(),
        verdict: Verdict::of(slope <= 0.6 && last.controller_ready.as_secs_f64() < 30.0),
        method: "the controller's VmRSS after its restart at each stage (row 10); the slope \
                 between the smallest and the largest stage"
            .into(),
    });
}

/// Row 12: the leading dispatcher killed.
pub(crate) fn failover_rows(report: &mut Report, f: &crate::failover::Failover) {
    use crate::failover::{failover_bound, LEADER_LEASE, RATE, RETRY_PERIOD, WRITES};
    let method = format!(
        "two controller replicas (leader election on, defaults), {} sidecar processes with a \
         dispatcher token on one queue, every one waiting in a claim and completing at once; \
         jobs created at {RATE} a second; the leading replica SIGKILLed; creation (the \
         create's answer) to claim (the claim's answer at the worker), split at the moment the \
         advert Lease names the new leader; the share offered from the sidecars' \
         leasehold_claims_offered_total / leasehold_claims_total",
        f.sidecars
    );
    let max = |v: &[f64]| v.iter().copied().fold(f64::NAN, f64::max);
    let bound = failover_bound();
    report.rows.push(Row {
        id: "12a".into(),
        what: "Claims while the killed dispatcher has no successor (the fallback)".into(),
        figure: format!(
            "{} jobs created in that time, claimed within {:.0} ms at most (p99 {:.0} ms); \
             {:.0} % offered by a dispatcher",
            f.during_ms.len(),
            max(&f.during_ms),
            percentile(&f.during_ms, 99.0).unwrap_or(f64::NAN),
            100.0 * f.during.offered_share()
        ),
        goal: "every claim within 1 s".into(),
        verdict: Verdict::of(!f.during_ms.is_empty() && max(&f.during_ms) <= 1000.0),
        method: method.clone(),
    });
    let offered_after = f.after.offered_share();
    report.rows.push(Row {
        id: "12b".into(),
        what: "Dispatch by the new leader".into(),
        figure: format!(
            "advertised {:.1} s after the kill; then {} jobs claimed, p99 {:.0} ms, {:.0} % of \
             the claims offered by its dispatcher",
            f.advertised_after.as_secs_f64(),
            f.after_ms.len(),
            percentile(&f.after_ms, 99.0).unwrap_or(f64::NAN),
            100.0 * offered_after
        ),
        goal: format!(
            "advertised within {} s (leader Lease {} s + 2 x retry period {} s + {} s for \
             its writes); >= 90 % offered after",
            bound.as_secs(),
            LEADER_LEASE.as_secs(),
            RETRY_PERIOD.as_secs(),
            WRITES.as_secs()
        ),
        verdict: Verdict::of(f.advertised_after <= bound && offered_after >= 0.9),
        method,
    });
}
