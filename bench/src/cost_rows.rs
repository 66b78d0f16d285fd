//! Rows 3 to 10: dispatch, expiry, footprint, payloads, against batch/v1 Jobs, watch fan-out
//! and queue length, with their charts.

use std::fmt::Write as _;

use crate::report::{Report, Row, Verdict};
use crate::stats::{median, mib, percentile};
use crate::*;

pub(crate) fn dispatch_rows(report: &mut Report, d: &dispatch::Dispatch) {
    let p50 = percentile(&d.latencies_ms, 50.0).unwrap_or(f64::NAN);
    let p99 = percentile(&d.latencies_ms, 99.0).unwrap_or(f64::NAN);
    report.rows.push(Row {
        id: "3".into(),
        what: "Dispatch latency (creation to claim)".into(),
        figure: format!("p50 {p50:.0} ms, p99 {p99:.0} ms"),
        goal: "p99 < 100 ms".into(),
        verdict: Verdict::of(p99 < 100.0),
        method: format!(
            "{} idle workers in POST /v1/claim?wait=30 on their own sidecar processes; {} jobs \
             created one at a time, 100 ms apart; from just before the create request to the \
             claim response at the worker",
            d.workers,
            d.latencies_ms.len()
        ),
    });
    let q50 = percentile(&d.to_queued_ms, 50.0).unwrap_or(f64::NAN);
    let q99 = percentile(&d.to_queued_ms, 99.0).unwrap_or(f64::NAN);
    let max = d.latencies_ms.iter().copied().fold(f64::NAN, f64::max);
    let detail = format!(
        "- creation to claim: p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms over {} jobs\n\
         - creation to the controller's Queued status seen by a watch: p50 {q50:.1} ms, p99 \
         {q99:.1} ms ({} jobs were claimed before the controller had initialised them)\n",
        d.latencies_ms.len(),
        d.before_queued
    );
    report
        .details
        .push(("Row 3: dispatch latency".into(), detail));
}

pub(crate) fn expiry_rows(report: &mut Report, x: &expiry::Expiry) {
    let l = f64::from(x.lease_seconds);
    let p50 = percentile(&x.latencies_s, 50.0).unwrap_or(f64::NAN);
    let p99 = percentile(&x.latencies_s, 99.0).unwrap_or(f64::NAN);
    report.rows.push(Row {
        id: "4".into(),
        what: "Expiry latency (last heartbeat to requeue)".into(),
        figure: format!(
            "p50 {:.2}x, p99 {:.2}x leaseDurationSeconds ({p50:.2} s, {p99:.2} s at {} s)",
            p50 / l,
            p99 / l,
            x.lease_seconds
        ),
        goal: format!("p99 <= lease + 1 s ({:.2}x)", (l + 1.0) / l),
        verdict: Verdict::of(p99 <= l + 1.0),
        method: format!(
            "{} jobs held by {} sidecar processes, SIGKILLed after half a lease of background \
             renewals; per job, from the Lease's last renewTime to a watch seeing the job \
             Queued again",
            x.latencies_s.len(),
            x.holders
        ),
    });
}

pub(crate) fn footprint_rows(report: &mut Report, f: &footprint::Footprint) {
    let per = f.lease_writes_per_job_interval();
    let job_writes = f.job_writes();
    let lease_other = f
        .requests
        .sum(|k| k.resource == "leases" && k.is_write() && k.verb != "PATCH");
    let lease_reads = f
        .requests
        .sum(|k| k.resource == "leases" && (k.verb == "GET" || k.verb == "LIST"));
    report.rows.push(Row {
        id: "5".into(),
        what: "Heartbeat cost".into(),
        figure: format!(
            "{per:.3} Lease writes per job per interval; {job_writes:.0} LeasedJob writes"
        ),
        goal: "1 Lease write per job per interval; 0 LeasedJob writes".into(),
        verdict: Verdict::of((per - 1.0).abs() <= 0.02 && job_writes == 0.0),
        method: format!(
            "{} jobs held by {} sidecars (background renewal every leaseDurationSeconds/3 = \
             {:.0} s), over {} intervals: PATCH leases from apiserver_request_total / (jobs x \
             intervals); LeasedJob writes = every write verb on leasedjobs and its status",
            f.held,
            f.sidecars,
            f64::from(f.lease_seconds) / 3.0,
            f.intervals
        ),
    });
    let sc_rss: Vec<f64> = f.sidecar_samples.iter().map(|s| mib(s.rss_kib)).collect();
    let sc_avg = sc_rss.iter().sum::<f64>() / sc_rss.len().max(1) as f64;
    let sc_max = sc_rss.iter().copied().fold(0.0, f64::max);
    let cpu_of = |prefix: &str| {
        f.cpu
            .iter()
            .find(|(n, _)| n.starts_with(prefix))
            .map_or(f64::NAN, |x| x.1)
    };
    let ctl_rss = mib(f.controller.rss_kib);
    let ctl_hwm = mib(f.controller.hwm_kib);
    report.rows.push(Row {
        id: "6".into(),
        what: "Footprint".into(),
        figure: format!(
            "controller {ctl_rss:.0} MiB (peak {ctl_hwm:.0}), {:.3} cores; sidecar {sc_avg:.0} \
             MiB (max {sc_max:.0}), {:.3} cores each",
            cpu_of("leasehold controller"),
            cpu_of("leasehold sidecars") / f.sidecars as f64
        ),
        goal: "controller < 100 MiB".into(),
        verdict: Verdict::of(ctl_hwm.max(ctl_rss) < 100.0),
        method: format!(
            "{} jobs, {} leased by {} sidecars and renewed in the background; VmRSS (and \
             VmHWM, the peak) from /proc at the end of the window, CPU from /proc over the \
             window",
            f.jobs, f.held, f.sidecars
        ),
    });
    let c50 = percentile(&f.claim_ms, 50.0).unwrap_or(f64::NAN);
    let c99 = percentile(&f.claim_ms, 99.0).unwrap_or(f64::NAN);
    let detail = format!(
        "- Window: {} renew intervals of {:.1} s with {} held jobs.\n\
         - Lease PATCHes per job per interval {per:.3}; other Lease writes {lease_other:.0} \
         (not ours: kube-apiserver renews its own identity Lease); Lease reads {lease_reads:.0}; \
         LeasedJob writes {job_writes:.0}.\n\
         - CPU in cores over the window: {}.\n\
         - Sidecars' RSS: {}.\n\
         - Creating the {} jobs and seeing all Queued took {:.1} s; the {} claims through the \
         sidecars, with all jobs in their watch caches, took p50 {c50:.1} ms, p99 {c99:.1} ms.\n\n\
         Requests counted by the API server during the window, per held job per interval:\n\n{}",
        f.intervals,
        f64::from(f.lease_seconds) / 3.0,
        f.held,
        cpu_line(&f.cpu),
        f.sidecar_samples
            .iter()
            .map(|s| format!("{:.0} MiB (peak {:.0})", mib(s.rss_kib), mib(s.hwm_kib)))
            .collect::<Vec<_>>()
            .join(", "),
        f.jobs,
        f.fill.as_secs_f64(),
        f.claim_ms.len(),
        requests_table(&[(
            "per job per interval",
            &f.requests,
            f.held as f64 * f64::from(f.intervals)
        )])
    );
    report
        .details
        .push(("Rows 5 and 6: heartbeat cost and footprint".into(), detail));
}

/// Row 8's curve: resident memory against the MiB of payload in the queue.
pub(crate) fn payload_chart(p: &payload::Payload) -> plots::Chart {
    let queue_mib = |s: &payload::Side| (p.jobs * s.payload_bytes) as f64 / (1024.0 * 1024.0);
    let line = |name: &str, of: fn(&payload::Side) -> &procs::Sample| plots::Line {
        name: name.into(),
        points: p
            .sides
            .iter()
            .map(|s| (queue_mib(s), mib(of(s).rss_kib)))
            .collect(),
    };
    plots::Chart {
        file: "memory-vs-queue-bytes.svg",
        title: format!(
            "Resident memory against queue bytes ({} queued jobs)",
            p.jobs
        ),
        x: "MiB of payload in the queue",
        y: "VmRSS, MiB",
        lines: vec![
            line("sidecar", |s| &s.sidecar),
            line("controller", |s| &s.controller),
        ],
    }
}

pub(crate) fn payload_rows(report: &mut Report, p: &payload::Payload) {
    let [small, large] = [&p.sides[0], &p.sides[p.sides.len() - 1]];
    let growth = |a: &procs::Sample, b: &procs::Sample| mib(b.rss_kib) / mib(a.rss_kib) - 1.0;
    let sc = growth(&small.sidecar, &large.sidecar);
    let ctl = growth(&small.controller, &large.controller);
    let queue_mib = (p.jobs * large.payload_bytes) as f64 / (1024.0 * 1024.0);
    let side = |s: &payload::Side| {
        format!(
            "{} B: sidecar {:.0} MiB (peak {:.0}), controller {:.0} MiB (peak {:.0})",
            s.payload_bytes,
            mib(s.sidecar.rss_kib),
            mib(s.sidecar.hwm_kib),
            mib(s.controller.rss_kib),
            mib(s.controller.hwm_kib)
        )
    };
    report.rows.push(Row {
        id: "8".into(),
        what: "Memory against queue bytes".into(),
        figure: format!(
            "{}; {}; sidecar {:+.0}%, controller {:+.0}%",
            side(small),
            side(large),
            sc * 100.0,
            ctl * 100.0
        ),
        goal: "large within 10% of small, for both; sidecar < 25 MiB".into(),
        verdict: Verdict::of(
            sc.abs() <= 0.10 && ctl.abs() <= 0.10 && mib(large.sidecar.rss_kib) < 25.0,
        ),
        method: format!(
            "two namespaces, each with {} queued jobs whose payload is one string of {} or {} \
             bytes ({queue_mib:.0} MiB of payload in the large queue), its own controller and one \
             sidecar; VmRSS (and VmHWM, the peak: the initial LIST passes through) from /proc \
             {} s after the sidecar was ready",
            p.jobs,
            small.payload_bytes,
            large.payload_bytes,
            payload::SETTLE.as_secs()
        ),
    });
}

pub(crate) fn versus_rows(report: &mut Report, v: &versus::Versus) {
    let ratio = v.jobs.done.as_secs_f64() / v.leasedjobs.done.as_secs_f64();
    report.rows.push(Row {
        id: "7".into(),
        what: "Against Kubernetes Jobs".into(),
        figure: format!(
            "{} Jobs -> all Pods exist: {:.1} s; {} LeasedJobs -> all claimed: {:.1} s; \
             LeasedJobs {ratio:.1}x faster",
            v.items,
            v.jobs.done.as_secs_f64(),
            v.items,
            v.leasedjobs.done.as_secs_f64()
        ),
        goal: "- (report both and the ratio)".into(),
        verdict: Verdict::NoGoal,
        method: format!(
            "same API server; both sides created 16 requests at a time; Jobs: from the first \
             create until a Pod of every Job exists (real kube-controller-manager job \
             controller, Pods stay Pending); LeasedJobs: until {} idle workers (sidecar \
             processes in POST /v1/claim?wait=30) have claimed every one",
            v.workers
        ),
    });
    let detail = format!(
        "- batch/v1 Jobs: created in {:.1} s, all Pods after {:.1} s; CPU in cores: {}\n\
         - LeasedJobs: created in {:.1} s, all claimed after {:.1} s; CPU in cores: {}\n\n\
         Requests per item counted by the API server:\n\n{}",
        v.jobs.created.as_secs_f64(),
        v.jobs.done.as_secs_f64(),
        cpu_line(&v.jobs.cpu),
        v.leasedjobs.created.as_secs_f64(),
        v.leasedjobs.done.as_secs_f64(),
        cpu_line(&v.leasedjobs.cpu),
        requests_table(&[
            ("batch/v1 Jobs", &v.jobs.requests, v.items as f64),
            ("LeasedJobs", &v.leasedjobs.requests, v.items as f64),
        ])
    );
    report
        .details
        .push(("Row 7: against Kubernetes Jobs".into(), detail));
}

/// Row 9: the API server's CPU and watch bytes per claim, first against last S.
pub(crate) fn fanout_rows(report: &mut Report, f: &[fanout::Fanout]) {
    let (Some(first), Some(last)) = (f.first(), f.last()) else {
        return;
    };
    let api = |x: &fanout::Fanout| x.cpu_seconds_per_claim("kube-apiserver") * 1000.0;
    let at = |x: &fanout::Fanout| {
        format!(
            "S={}: {:.1} ms CPU, {:.0} events, {:.0} KiB",
            x.sidecars,
            api(x),
            x.events_per_claim(),
            x.bytes_per_claim() / 1024.0
        )
    };
    let cpu_growth = api(last) / api(first);
    let bytes_growth = last.bytes_per_claim() / first.bytes_per_claim();
    report.rows.push(Row {
        id: "9".into(),
        what: "API-server cost per claim against sidecars on one queue".into(),
        figure: format!(
            "{}; from S={} to S={}: CPU x{cpu_growth:.1}, watch bytes x{bytes_growth:.1}",
            f.iter().map(at).collect::<Vec<_>>().join("; "),
            first.sidecars,
            last.sidecars
        ),
        goal: "grows < 2x from the fewest sidecars to the most".into(),
        verdict: Verdict::of(cpu_growth < 2.0 && bytes_growth < 2.0),
        method: format!(
            "S sidecar processes watch one queue; {} of them claim and complete {} jobs created \
             during the window, the others stay idle; kube-apiserver CPU from /proc and LeasedJob \
             watch events and bytes from apiserver_watch_events_total and \
             apiserver_watch_events_sizes_sum over the window, divided by the jobs",
            fanout::CLAIMERS,
            first.jobs
        ),
    });
    let mut detail = String::new();
    for x in f {
        let _ = writeln!(
            detail,
            "- S = {}: {} jobs in {:.1} s; per claim: kube-apiserver {:.1} ms CPU, etcd {:.1} ms, \
             sidecars together {:.1} ms, {:.1} watch events, {:.1} KiB; sidecars' RSS {:.0} MiB in \
             all ({:.1} MiB each); CPU in cores: {}",
            x.sidecars,
            x.jobs,
            x.elapsed.as_secs_f64(),
            api(x),
            x.cpu_seconds_per_claim("etcd") * 1000.0,
            x.cpu_seconds_per_claim("leasehold sidecars") * 1000.0,
            x.events_per_claim(),
            x.bytes_per_claim() / 1024.0,
            mib(x.sidecars_rss_kib),
            mib(x.sidecars_rss_kib) / x.sidecars as f64,
            cpu_line(&x.cpu)
        );
    }
    report.details.push(("Row 9: watch fan-out".into(), detail));
}

/// Row 9's curve: the API server's CPU and the watch bytes per claim, against S.
pub(crate) fn fanout_chart(f: &[fanout::Fanout]) -> plots::Chart {
    plots::Chart {
        file: "api-cost-vs-sidecars.svg",
        title: "API-server cost per claim against sidecars watching one queue".into(),
        x: "sidecars (S)",
        y: "per claim",
        lines: vec![
            plots::Line {
                name: "kube-apiserver CPU, ms".into(),
                points: f
                    .iter()
                    .map(|x| {
                        (
                            x.sidecars as f64,
                            x.cpu_seconds_per_claim("kube-apiserver") * 1000.0,
                        )
                    })
                    .collect(),
            },
            plots::Line {
                name: "LeasedJob watch bytes sent, KiB".into(),
                points: f
                    .iter()
                    .map(|x| (x.sidecars as f64, x.bytes_per_claim() / 1024.0))
                    .collect(),
            },
        ],
    }
}

/// Row 10: the controller at the longest queue; claims and expiry, longest against shortest.
pub(crate) fn queuelen_rows(report: &mut Report, q: &[queuelen::Stage]) {
    let (Some(first), Some(last)) = (q.first(), q.last()) else {
        return;
    };
    let ready_s = last.controller_ready.as_secs_f64();
    let rss = mib(last.controller.rss_kib);
    report.rows.push(Row {
        id: "10".into(),
        what: format!("Controller with {} jobs ({} leased)", last.jobs, last.held),
        figure: format!(
            "start to ready {ready_s:.1} s; {rss:.0} MiB (peak {:.0}) {} s later",
            mib(last.controller.hwm_kib),
            queuelen::SETTLE.as_secs()
        ),
        goal: "< 300 MiB; ready < 60 s".into(),
        verdict: Verdict::of(rss < 300.0 && ready_s < 60.0),
        method: "the controller is SIGKILLed and started again with the whole namespace in \
                 place; from its start to /readyz answering 200 (its watches have listed \
                 everything), then VmRSS and VmHWM from /proc"
            .into(),
    });
    let p99 = |v: &[f64]| percentile(v, 99.0).unwrap_or(f64::NAN);
    // The median of the rounds' p99s at each stage (one round's p99 moved by x1.7 between
    // runs at 1,000 jobs).
    let claim_p99 = |s: &queuelen::Stage| median(&s.round_p99_ms).unwrap_or(f64::NAN);
    let rounds = |s: &queuelen::Stage| {
        s.round_p99_ms
            .iter()
            .map(|v| format!("{v:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let claim_ratio = claim_p99(last) / claim_p99(first);
    let lease = f64::from(queuelen::EXPIRY_LEASE);
    let worst_expiry = q.iter().map(|s| p99(&s.expiry_s)).fold(0.0, f64::max);
    report.rows.push(Row {
        id: "10".into(),
        what: format!(
            "Claim and expiry p99, {} jobs against {}",
            last.jobs, first.jobs
        ),
        figure: format!(
            "claim p99 {:.1} ms against {:.1} ms (x{claim_ratio:.1}; each the median of its \
             rounds' p99s: {} against {}); expiry p99 {:.2} s against {:.2} s at {lease:.0} s",
            claim_p99(last),
            claim_p99(first),
            rounds(last),
            rounds(first),
            p99(&last.expiry_s),
            p99(&first.expiry_s)
        ),
        goal: "claim p99 <= 2x; expiry p99 <= lease + 1 s at every length".into(),
        verdict: Verdict::of(claim_ratio <= 2.0 && worst_expiry <= lease + 1.0),
        method: format!(
            "one namespace grown stage by stage, {:.0}% of it held by {} sidecars renewing in \
             the background (lease {} s); claims: {} rounds at each stage of {} claims (at \
             most half of its queued jobs; the queue topped up to its length before each \
             round), each then completed, through those sidecars (their caches hold the whole \
             queue), the p99 of each round and their median; expiry: {} jobs \
             of their own queue (lease {} s) held by a sidecar SIGKILLed half a lease later, \
             from the Lease's last renewTime to a watch seeing the job Queued",
            queuelen::HELD_SHARE * 100.0,
            queuelen::HOLDERS,
            queuelen::QUEUE_LEASE,
            queuelen::LATENCY_ROUNDS,
            queuelen::LATENCY_CLAIMS,
            queuelen::EXPIRY_JOBS,
            queuelen::EXPIRY_LEASE
        ),
    });
    let mut detail = String::new();
    for s in q {
        let _ = writeln!(
            detail,
            "- {} jobs ({} held): filled in {:.1} s; {} claims p50 {:.1} ms, p99 {:.1} ms (by \
             round {}; the rounds took {}), mean {:.1} ms; the API server's own time per status write (PUT \
             leasedjobs/status: the claims, and the completions a holder sends as a PUT; \
             apiserver_request_duration_seconds, {:.0} writes) {}; \
             controller ready in {:.1} s, {:.0} MiB (peak {:.0}); holder sidecar {:.0} MiB (peak \
             {:.0}); expiry p50 {:.2} s, p99 {:.2} s",
            s.jobs,
            s.held,
            s.fill.as_secs_f64(),
            s.claim_ms.len(),
            percentile(&s.claim_ms, 50.0).unwrap_or(f64::NAN),
            p99(&s.claim_ms),
            rounds(s),
            s.round_load
                .iter()
                .map(|(secs, renewals)| format!("{secs:.1} s with {renewals:.0} Lease renewals"))
                .collect::<Vec<_>>()
                .join(", "),
            s.claim_ms.iter().sum::<f64>() / s.claim_ms.len().max(1) as f64,
            s.claim_writes.count,
            s.claim_writes
                .mean_ms()
                .map_or("not measured".into(), |m| format!("mean {m:.1} ms")),
            s.controller_ready.as_secs_f64(),
            mib(s.controller.rss_kib),
            mib(s.controller.hwm_kib),
            mib(s.sidecar.rss_kib),
            mib(s.sidecar.hwm_kib),
            percentile(&s.expiry_s, 50.0).unwrap_or(f64::NAN),
            p99(&s.expiry_s)
        );
    }
    report.details.push(("Row 10: queue length".into(), detail));
}

/// Row 10's curves: claim latency, and memory, against the jobs in the queue.
pub(crate) fn queuelen_charts(q: &[queuelen::Stage]) -> Vec<plots::Chart> {
    let points = |f: &dyn Fn(&queuelen::Stage) -> f64| {
        q.iter().map(|s| (s.jobs as f64, f(s))).collect::<Vec<_>>()
    };
    vec![
        plots::Chart {
            file: "claim-latency-vs-queue-length.svg",
            title: "Claim latency through a sidecar against queue length".into(),
            x: "jobs in the queue",
            y: "claim latency, ms",
            lines: vec![
                plots::Line {
                    name: "p50".into(),
                    points: points(&|s| percentile(&s.claim_ms, 50.0).unwrap_or(0.0)),
                },
                plots::Line {
                    name: "p99".into(),
                    points: points(&|s| percentile(&s.claim_ms, 99.0).unwrap_or(0.0)),
                },
            ],
        },
        plots::Chart {
            file: "memory-vs-queue-length.svg",
            title: "Resident memory against queue length".into(),
            x: "jobs in the namespace",
            y: "VmRSS, MiB",
            lines: vec![
                plots::Line {
                    name: "controller".into(),
                    points: points(&|s| mib(s.controller.rss_kib)),
                },
                plots::Line {
                    name: "sidecar".into(),
                    points: points(&|s| mib(s.sidecar.rss_kib)),
                },
            ],
        },
    ]
}
