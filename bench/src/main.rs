//! `leasehold-bench`: measures leasehold against the API server it runs on, side by side in one
//! run, and prints the table (also written into docs/benchmarks.md with `--out`).
//!
//! Rows: 1 the ceiling (raw conditional status updates/s), 2 claim throughput (2d through the
//! dispatcher, 2k with limits per key, 2b and 2bk the bounds of two and three writes per job),
//! 3 dispatch latency, 4 expiry latency, 5 heartbeat cost, 6 footprint, 7 against batch/v1
//! Jobs, 8 memory against payload bytes, 9 watch fan-out against sidecars, 10 queue length, 11
//! the fleet (waiting sidecars with the dispatcher), 12 the leading dispatcher killed. Every
//! figure comes from one run on one API server; request counts come from the API server's own
//! `apiserver_request_total` (row 2k's claimers' writes also from their own clients' count),
//! memory and CPU from /proc. `scripts/bench` builds everything,
//! starts a local control plane and runs this; `--kubeconfig` points it at one already running
//! (on loopback only).

mod args;
mod bound;
mod ceiling;
mod claim_mode;
mod claim_rows;
mod claims;
mod cluster;
mod conflicts;
mod cost_rows;
mod counted;
mod dispatch;
mod expiry;
mod failover;
mod fanout;
mod fleet;
mod fleet_rows;
mod footprint;
mod limit_rows;
mod metrics;
mod paired;
mod payload;
mod plots;
mod procs;
mod queuelen;
mod report;
mod stats;
mod text;
mod versus;

use std::path::Path;

use anyhow::Context as _;
use clap::Parser;
use report::{Report, Row, Verdict};

pub(crate) use args::{describe_run, Cli, Sizes};
pub(crate) use claim_rows::*;
pub(crate) use cost_rows::*;
pub(crate) use text::*;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let sizes = Sizes::of(&cli);
    let leasehold = match &cli.leasehold {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("no directory of this binary")?
            .join("leasehold"),
    };
    anyhow::ensure!(
        leasehold.is_file(),
        "{} not found: build it (cargo build --bins) or pass --leasehold",
        leasehold.display()
    );
    let logs = match &cli.logs {
        Some(p) => p.clone(),
        None => std::env::temp_dir().join(format!("leasehold-bench-{}", std::process::id())),
    };
    std::fs::create_dir_all(&logs).with_context(|| format!("create {}", logs.display()))?;
    let env_file = cli.controlplane_env.clone().or_else(|| {
        let p = cli.kubeconfig.parent()?.join("env");
        p.is_file().then_some(p)
    });
    let controlplane = env_file
        .as_deref()
        .map(cluster::ControlPlane::from_env_file)
        .unwrap_or_default();
    let bench = cluster::Bench::connect(
        cli.kubeconfig.clone(),
        leasehold,
        logs.clone(),
        controlplane,
    )
    .await?;
    bench.install_crd().await?;
    let version = bench.version().await;
    let want = |row: u8| cli.rows.is_empty() || cli.rows.contains(&row);
    eprintln!(
        "leasehold-bench: Kubernetes {version}; {}; logs in {}",
        sizes.describe(),
        logs.display()
    );

    let mut report = Report::default();
    let mut charts = Vec::new();
    let mut failures = Vec::new();
    if want(1) || want(2) {
        let (ceilings, results) = rows_1_and_2(&bench, &sizes, want(2), &mut failures).await;
        ceiling_rows(&mut report, &ceilings, &sizes);
        if want(2) {
            let of = |mode: claim_mode::Mode| -> Vec<&claims::Claims> {
                results.iter().filter(|c| c.mode == mode).collect()
            };
            let (plain, dispatched, limited, bound, bound_keyed) = (
                of(claim_mode::Mode::Plain),
                of(claim_mode::Mode::Dispatched),
                of(claim_mode::Mode::Limited),
                of(claim_mode::Mode::Bound),
                of(claim_mode::Mode::BoundKeyed),
            );
            let at = paired::at_each_n(&ceilings, &plain);
            claim_rows(&mut report, &at, &ceilings, &sizes);
            charts.extend(claim_charts(&at));
            let at_dispatched = paired::at_each_n(&ceilings, &dispatched);
            dispatched_claim_rows(&mut report, &at_dispatched, &ceilings, &sizes);
            let at_limited = paired::at_each_n(&ceilings, &limited);
            limit_rows::limited_claim_rows(
                &mut report,
                &at_limited,
                &at_dispatched,
                &ceilings,
                &sizes,
            );
            // In the order they run in each round: the bounds last.
            let at_bound = paired::at_each_n(&ceilings, &bound);
            bound_claim_rows(
                &mut report,
                &at_bound,
                &ceilings,
                &sizes,
                claim_mode::Mode::Bound,
            );
            let at_bound_keyed = paired::at_each_n(&ceilings, &bound_keyed);
            bound_claim_rows(
                &mut report,
                &at_bound_keyed,
                &ceilings,
                &sizes,
                claim_mode::Mode::BoundKeyed,
            );
        }
    }
    if want(3) {
        eprintln!("row 3: dispatch latency");
        match dispatch::run(&bench, sizes.dispatch_workers, sizes.dispatch_jobs).await {
            Ok(d) => dispatch_rows(&mut report, &d),
            Err(e) => failures.push(("3", e)),
        }
    }
    if want(4) {
        eprintln!("row 4: expiry latency");
        match expiry::run(
            &bench,
            sizes.expiry_holders,
            sizes.expiry_jobs,
            sizes.expiry_lease,
        )
        .await
        {
            Ok(x) => expiry_rows(&mut report, &x),
            Err(e) => failures.push(("4", e)),
        }
    }
    if want(5) || want(6) {
        eprintln!("rows 5-6: heartbeat cost and footprint");
        match footprint::run(
            &bench,
            sizes.footprint_jobs,
            sizes.footprint_held,
            sizes.footprint_sidecars,
            sizes.footprint_lease,
            sizes.heartbeat_intervals,
        )
        .await
        {
            Ok(f) => footprint_rows(&mut report, &f),
            Err(e) => failures.push(("5-6", e)),
        }
    }
    if want(7) {
        eprintln!("row 7: against Kubernetes Jobs");
        match versus::run(&bench, sizes.versus_jobs, sizes.versus_workers).await {
            Ok(v) => versus_rows(&mut report, &v),
            Err(e) => failures.push(("7", e)),
        }
    }
    if want(8) {
        eprintln!("row 8: memory against payload bytes");
        match payload::run(&bench, sizes.payload_jobs, &sizes.payload_bytes).await {
            Ok(p) => {
                payload_rows(&mut report, &p);
                charts.push(payload_chart(&p));
            }
            Err(e) => failures.push(("8", e)),
        }
    }
    if want(9) {
        eprintln!("row 9: watch fan-out against sidecars");
        match fanout::run(&bench, &sizes.fanout_sidecars, sizes.fanout_jobs).await {
            Ok(f) => {
                fanout_rows(&mut report, &f);
                charts.push(fanout_chart(&f));
            }
            Err(e) => failures.push(("9", e)),
        }
    }
    if want(10) {
        eprintln!("row 10: queue length");
        let (q, end) = queuelen::run(&bench, &sizes.queue_lengths).await;
        if !q.is_empty() {
            queuelen_rows(&mut report, &q);
            fleet_rows::dispatched_queuelen_rows(&mut report, &q);
            charts.extend(queuelen_charts(&q));
        }
        if let Some(e) = end {
            failures.push(("10", e));
        }
    }
    if want(11) {
        eprintln!("row 11: the fleet, with the dispatcher");
        match fleet::run(&bench, &sizes.fleet_sidecars, sizes.fleet_jobs).await {
            Ok(f) => fleet_rows::fleet_rows(&mut report, &f),
            Err(e) => failures.push(("11", e)),
        }
    }
    if want(12) {
        eprintln!("row 12: the leading dispatcher killed");
        match failover::run(&bench, sizes.failover_sidecars).await {
            Ok(f) => fleet_rows::failover_rows(&mut report, &f),
            Err(e) => failures.push(("12", e)),
        }
    }
    bench.cleanup().await;

    for (row, e) in &failures {
        report.rows.push(Row {
            id: (*row).to_string(),
            what: "run failed".into(),
            figure: format!("{e:#}"),
            goal: "-".into(),
            verdict: Verdict::Missed,
            method: format!("see the logs in {}", logs.display()),
        });
    }
    // The curves go beside the report they illustrate (docs/bench/ for docs/benchmarks.md),
    // or with the logs when no report is written.
    let plot_dir = match &cli.out {
        Some(out) => out.parent().unwrap_or(Path::new(".")).join("bench"),
        None => logs.join("plots"),
    };
    let mut drawn = Vec::new();
    for chart in &charts {
        // A block's curves get names of their own, so that they do not replace the curves
        // of the full run (or of another block) drawn from other figures.
        let file = match cli.block.as_str() {
            "" => chart.file.to_string(),
            block => format!("{block}-{}", chart.file),
        };
        match plots::draw(&plot_dir, &file, chart) {
            Ok(_) => drawn.push(format!("![{}](bench/{file})", chart.title)),
            Err(e) => failures.push(("plots", e)),
        }
    }
    if !drawn.is_empty() {
        report
            .details
            .push(("Cost curves".into(), drawn.join("\n\n")));
    }
    println!("{}", report.text());
    if let Some(out) = &cli.out {
        let run = describe_run(&version, &sizes, cli.smoke);
        report::write_block(out, &cli.block, &report.markdown(&run))?;
        eprintln!("wrote {}", out.display());
    }
    if !failures.is_empty() {
        anyhow::bail!("{} benchmark row(s) failed to run", failures.len());
    }
    Ok(())
}
