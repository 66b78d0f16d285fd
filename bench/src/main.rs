//! `leasehold-bench`: measures leasehold against the API server it runs on, side by side in one
//! run, and prints the table (also written into docs/benchmarks.md with `--out`).
//!
//! Rows: 1 the ceiling (raw conditional status updates/s), 2 claim throughput, 3 dispatch
//! latency, 4 expiry latency, 5 heartbeat cost, 6 footprint, 7 against batch/v1 Jobs, 8 memory
//! against payload bytes, 9 watch fan-out against sidecars, 10 queue length. Every
//! figure comes from one run on one API server; request counts come from the API server's own
//! `apiserver_request_total`, memory and CPU from /proc. `scripts/bench` builds everything,
//! starts a local control plane and runs this; `--kubeconfig` points it at one already running
//! (on loopback only).

mod ceiling;
mod claims;
mod cluster;
mod dispatch;
mod expiry;
mod fanout;
mod footprint;
mod metrics;
mod paired;
mod payload;
mod plots;
mod procs;
mod queuelen;
mod report;
mod stats;
mod versus;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Parser;
use report::{Report, Row, Verdict};
use stats::{median, mib, percentile};

/// Benchmarks leasehold against the local API server's own ceiling and against batch/v1 Jobs.
///
/// Sizes default to the full benchmark; `--smoke` picks small ones (seconds, for CI), and any
/// size flag given overrides either.
#[derive(Parser, Debug)]
#[command(name = "leasehold-bench", version)]
struct Cli {
    /// Kubeconfig of the cluster to use; its API server must be on loopback.
    #[arg(long)]
    kubeconfig: PathBuf,
    /// The `leasehold` binary to run as controller and sidecars (default: beside this one).
    #[arg(long)]
    leasehold: Option<PathBuf>,
    /// The `env` file written by tests/controlplane/start.sh, for the control plane's pids
    /// (default: `env` beside the kubeconfig, if there is one). Without it, no CPU breakdown
    /// for kube-apiserver, etcd and kube-controller-manager.
    #[arg(long)]
    controlplane_env: Option<PathBuf>,
    /// Markdown file to write the results into, between generated-block markers (the text
    /// around them is kept).
    #[arg(long)]
    out: Option<PathBuf>,
    /// With `--out`: write into the block of this name instead of the full run's, so that a
    /// run of some rows (`--rows`) sits beside the full table instead of replacing it.
    #[arg(long, default_value = "")]
    block: String,
    /// Directory for the logs of the processes started (default: a new temporary directory).
    #[arg(long)]
    logs: Option<PathBuf>,
    /// Small sizes: checks that every row still runs, in about a minute. Figures from a smoke
    /// run mean nothing.
    #[arg(long)]
    smoke: bool,
    /// Rows to run (default all): e.g. `--rows 1,2`.
    #[arg(long, value_delimiter = ',')]
    rows: Vec<u8>,
    /// Row 1: seconds measured per N (after a 1 s warm-up). Default 10.
    #[arg(long)]
    ceiling_seconds: Option<f64>,
    /// Rows 1 and 2: rounds. Each round measures, at each N, the ceiling and then the claim
    /// run compared with it; the verdicts read the median over the rounds. Default 3 (smoke 1).
    #[arg(long)]
    rounds: Option<usize>,
    /// Rows 1 and 2: numbers of concurrent writers/claimers. Default 1,8,32.
    #[arg(long, value_delimiter = ',')]
    claimers: Option<Vec<usize>>,
    /// Row 2: queued jobs per N. Default 1000.
    #[arg(long)]
    claim_jobs: Option<usize>,
    /// Row 3: jobs created one at a time. Default 200.
    #[arg(long)]
    dispatch_jobs: Option<usize>,
    /// Row 3: idle workers, each with its own sidecar. Default 4.
    #[arg(long)]
    dispatch_workers: Option<usize>,
    /// Row 4: jobs held when their holders are killed. Default 100.
    #[arg(long)]
    expiry_jobs: Option<usize>,
    /// Row 4: sidecars holding them. Default 4.
    #[arg(long)]
    expiry_holders: Option<usize>,
    /// Row 4: leaseDurationSeconds of those jobs (5 is the least the CRD allows). Default 5.
    #[arg(long)]
    expiry_lease: Option<i32>,
    /// Rows 5-6: jobs in the namespace. Default 10000.
    #[arg(long)]
    footprint_jobs: Option<usize>,
    /// Rows 5-6: jobs leased and heartbeating. Default 1000.
    #[arg(long)]
    footprint_held: Option<usize>,
    /// Rows 5-6: sidecars holding them. Default 10.
    #[arg(long)]
    footprint_sidecars: Option<usize>,
    /// Rows 5-6: leaseDurationSeconds (renewals every third of it). Default 30.
    #[arg(long)]
    footprint_lease: Option<i32>,
    /// Rows 5-6: renew intervals measured. Default 3.
    #[arg(long)]
    heartbeat_intervals: Option<u32>,
    /// Row 7: items on each side. Default 1000.
    #[arg(long)]
    versus_jobs: Option<usize>,
    /// Row 7: idle workers (sidecars) on the LeasedJob side. Default 16.
    #[arg(long)]
    versus_workers: Option<usize>,
    /// Row 8: queued jobs in each of the two queues (small and large payloads). Default 2000.
    #[arg(long)]
    payload_jobs: Option<usize>,
    /// Row 9: numbers of sidecars watching one queue. Default 8,64,200.
    #[arg(long, value_delimiter = ',')]
    fanout_sidecars: Option<Vec<usize>>,
    /// Row 9: jobs claimed and completed at each number. Default 200.
    #[arg(long)]
    fanout_jobs: Option<usize>,
    /// Row 10: jobs in the queue at each stage, ascending. Default 1000,10000,100000.
    #[arg(long, value_delimiter = ',')]
    queue_lengths: Option<Vec<usize>>,
}

/// The sizes in force.
#[derive(Debug)]
struct Sizes {
    ceiling_seconds: f64,
    rounds: usize,
    claimers: Vec<usize>,
    claim_jobs: usize,
    dispatch_jobs: usize,
    dispatch_workers: usize,
    expiry_jobs: usize,
    expiry_holders: usize,
    expiry_lease: i32,
    footprint_jobs: usize,
    footprint_held: usize,
    footprint_sidecars: usize,
    footprint_lease: i32,
    heartbeat_intervals: u32,
    versus_jobs: usize,
    versus_workers: usize,
    payload_jobs: usize,
    payload_bytes: Vec<usize>,
    fanout_sidecars: Vec<usize>,
    fanout_jobs: usize,
    queue_lengths: Vec<usize>,
}

impl Sizes {
    fn of(cli: &Cli) -> Sizes {
        let s = cli.smoke;
        let pick = |given: Option<usize>, smoke: usize, full: usize| {
            given.unwrap_or(if s { smoke } else { full }).max(1)
        };
        Sizes {
            ceiling_seconds: cli.ceiling_seconds.unwrap_or(if s { 2.0 } else { 10.0 }),
            rounds: pick(cli.rounds, 1, 3),
            claimers: cli.claimers.clone().unwrap_or_else(|| {
                if s {
                    vec![1, 4]
                } else {
                    vec![1, 8, 32]
                }
            }),
            claim_jobs: pick(cli.claim_jobs, 20, 1000),
            dispatch_jobs: pick(cli.dispatch_jobs, 10, 200),
            dispatch_workers: pick(cli.dispatch_workers, 2, 4),
            expiry_jobs: pick(cli.expiry_jobs, 4, 100),
            expiry_holders: pick(cli.expiry_holders, 2, 4),
            expiry_lease: cli.expiry_lease.unwrap_or(5),
            footprint_jobs: pick(cli.footprint_jobs, 100, 10_000),
            footprint_held: pick(cli.footprint_held, 10, 1000),
            footprint_sidecars: pick(cli.footprint_sidecars, 2, 10),
            footprint_lease: cli.footprint_lease.unwrap_or(if s { 6 } else { 30 }),
            heartbeat_intervals: cli
                .heartbeat_intervals
                .unwrap_or(if s { 1 } else { 3 })
                .max(1),
            versus_jobs: pick(cli.versus_jobs, 20, 1000),
            versus_workers: pick(cli.versus_workers, 2, 16),
            payload_jobs: pick(cli.payload_jobs, 20, 2000),
            payload_bytes: if s {
                vec![100, 64 * 1024]
            } else {
                vec![100, 4 * 1024, 16 * 1024, 64 * 1024]
            },
            fanout_sidecars: cli.fanout_sidecars.clone().unwrap_or_else(|| {
                if s {
                    vec![2, 6]
                } else {
                    vec![8, 64, 200]
                }
            }),
            fanout_jobs: pick(cli.fanout_jobs, 12, 200),
            queue_lengths: cli.queue_lengths.clone().unwrap_or_else(|| {
                if s {
                    vec![20, 60]
                } else {
                    vec![1000, 10_000, 100_000]
                }
            }),
        }
    }

    fn describe(&self) -> String {
        format!(
            "{} rounds of: ceiling {} s at N, then claims at N; N = {}; claim M = {} jobs; dispatch {} jobs to {} workers; \
             expiry {} jobs on {} killed sidecars, lease {} s; footprint {} jobs, {} held by {} \
             sidecars, lease {} s, {} renew intervals; vs Jobs {} items, {} workers; payloads \
             {} jobs per queue, {} bytes; fan-out {} jobs at {} sidecars; queue lengths {}",
            self.rounds,
            self.ceiling_seconds,
            self.claimers
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            self.claim_jobs,
            self.dispatch_jobs,
            self.dispatch_workers,
            self.expiry_jobs,
            self.expiry_holders,
            self.expiry_lease,
            self.footprint_jobs,
            self.footprint_held,
            self.footprint_sidecars,
            self.footprint_lease,
            self.heartbeat_intervals,
            self.versus_jobs,
            self.versus_workers,
            self.payload_jobs,
            self.payload_bytes
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            self.fanout_jobs,
            list(&self.fanout_sidecars),
            list(&self.queue_lengths),
        )
    }
}

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
            let at = paired::at_each_n(&ceilings, &results);
            claim_rows(&mut report, &at, &ceilings, &sizes);
            charts.extend(claim_charts(&at));
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
            charts.extend(queuelen_charts(&q));
        }
        if let Some(e) = end {
            failures.push(("10", e));
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

fn list(v: &[usize]) -> String {
    v.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn describe_run(version: &str, sizes: &Sizes, smoke: bool) -> String {
    let commit = std::env::var("LEASEHOLD_BENCH_COMMIT").unwrap_or_default();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Run of {} (leasehold {}{}){}.\n",
        k8s_openapi::jiff::Timestamp::now().strftime("%Y-%m-%d %H:%M UTC"),
        env!("CARGO_PKG_VERSION"),
        if commit.is_empty() {
            String::new()
        } else {
            format!(", commit {commit}")
        },
        if smoke {
            ", SMOKE SIZES: figures mean nothing"
        } else {
            ""
        }
    );
    let _ = writeln!(s, "- Machine: {}", procs::machine());
    let _ = writeln!(
        s,
        "- Kubernetes {version}: kube-apiserver, etcd and kube-controller-manager on loopback \
         (tests/controlplane/start.sh), sharing the machine with the benchmark"
    );
    let _ = writeln!(s, "- Sizes: {}", sizes.describe());
    s
}

fn cpu_line(cpu: &[(String, f64)]) -> String {
    cpu.iter()
        .map(|(n, c)| format!("{n} {c:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn requests_table(columns: &[(&str, &metrics::Requests, f64)]) -> String {
    let grouped: Vec<Vec<metrics::Grouped>> = columns
        .iter()
        .map(|(_, r, _)| r.by_resource_verb())
        .collect();
    let mut keys: Vec<(String, String)> = Vec::new();
    for g in &grouped {
        for row in g {
            let key = (row.resource.clone(), row.verb.clone());
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
    }
    let mut s = String::from("| resource | verb |");
    for (name, _, _) in columns {
        let _ = write!(s, " {name} |");
    }
    s.push_str("\n|---|---|");
    for _ in columns {
        s.push_str("---|");
    }
    s.push('\n');
    for (res, verb) in keys {
        let mut cells = String::new();
        let mut shown = false;
        for (g, (_, _, per)) in grouped.iter().zip(columns) {
            match g.iter().find(|x| x.resource == res && x.verb == verb) {
                Some(x) if x.count / per >= 0.005 => {
                    shown = true;
                    let _ = write!(cells, " {:.2}", x.count / per);
                    let failed: Vec<String> = x
                        .failed
                        .iter()
                        .map(|(code, n)| format!("{:.2} {code}", n / per))
                        .collect();
                    if !failed.is_empty() {
                        let _ = write!(cells, " (of which {})", failed.join(", "));
                    }
                    cells.push_str(" |");
                }
                _ => cells.push_str(" 0 |"),
            }
        }
        if shown {
            let _ = writeln!(s, "| {res} | {verb} |{cells}");
        }
    }
    s
}

/// Rows 1 and 2, round by round: at each N, the ceiling, then (with `claims`) the claim run
/// compared with it. A failed measurement is recorded and the rest goes on.
async fn rows_1_and_2(
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
                eprintln!("row 2: claim throughput, N = {n}, round {}", round + 1);
                match claims::run(bench, n, sizes.claim_jobs, round).await {
                    Ok(c) => results.push(c),
                    Err(e) => failures.push(("2", e)),
                }
            }
        }
    }
    (ceilings, results)
}

fn ceiling_rows(report: &mut Report, ceilings: &[ceiling::Ceiling], sizes: &Sizes) {
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
const SCALE_RATIO_GOAL: f64 = 0.28;

fn claim_rows(
    report: &mut Report,
    at: &[paired::AtN],
    ceilings: &[ceiling::Ceiling],
    sizes: &Sizes,
) {
    let most = sizes.claimers.iter().copied().max().unwrap_or(1);
    let mut detail = String::new();
    for a in at {
        report.rows.push(Row {
            id: format!("2 (N={})", a.claimers),
            what: "Claim throughput (claim + complete)".into(),
            figure: format!(
                "{:.1} claims/s (median); {} of the ceiling; 409 on {:.1}% of claim writes",
                a.per_second,
                paired::ratio_text(a),
                a.conflict_share * 100.0
            ),
            goal: ">= 0.40 of the ceiling".into(),
            verdict: a.ratio.map_or(Verdict::Missed, |r| Verdict::of(r >= 0.4)),
            method: format!(
                "{} queued jobs; {} Worker instances (the sidecar's library, each with its own \
                 client and watch) claim then complete in a loop, controller running; claims/s = \
                 jobs / time until all completed; ratio = claims/s / the ceiling at the same N \
                 measured before it in the same round, the median of the {} ratios measured \
                 ({} rounds); 409 share from apiserver_request_total (PUT leasedjobs/status), \
                 all rounds together",
                sizes.claim_jobs,
                a.claimers,
                a.ratios.iter().flatten().count(),
                a.runs.len()
            ),
        });
        if a.claimers == most {
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
                method: "apiserver_request_total: PUT leasedjobs/status with code 409 / all PUT \
                         leasedjobs/status, during the runs above"
                    .into(),
            });
        }
        for (c, ratio) in a.runs.iter().zip(&a.ratios) {
            claim_detail(&mut detail, c, *ratio, ceilings);
        }
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
    let columns: Vec<(String, &metrics::Requests, f64)> = at
        .iter()
        .map(|a| (format!("N={}", a.claimers), &a.requests, a.jobs as f64))
        .collect();
    let columns: Vec<(&str, &metrics::Requests, f64)> = columns
        .iter()
        .map(|(n, r, p)| (n.as_str(), *r, *p))
        .collect();
    let _ = write!(
        detail,
        "\nRequests per job, counted by the API server over every round (all clients: \
         claimers, controller, and the controller's Events):\n\n{}",
        requests_table(&columns)
    );
    report
        .details
        .push(("Row 2: claim throughput".into(), detail));
}

/// One line of row 2's detail: one claim run.
fn claim_detail(
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
const WRITES_PER_JOB_GOAL: f64 = 3.2;

/// True for a write leasehold makes on a job's behalf: to LeasedJobs (and their status),
/// Leases and Events.
fn is_job_write(k: &metrics::Key) -> bool {
    k.is_write() && matches!(k.resource.as_str(), "leasedjobs" | "leases" | "events")
}

/// The row "API writes per happy-path job": every write to LeasedJobs, Leases and Events during
/// the claim runs of row 2 (default settings: the controller records Events for problems only),
/// per job claimed and completed, every round together; the goal must hold at every N,
/// conflicts (409) included.
fn writes_per_job_row(at: &[paired::AtN]) -> Row {
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

fn dispatch_rows(report: &mut Report, d: &dispatch::Dispatch) {
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

fn expiry_rows(report: &mut Report, x: &expiry::Expiry) {
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

fn footprint_rows(report: &mut Report, f: &footprint::Footprint) {
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
fn payload_chart(p: &payload::Payload) -> plots::Chart {
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

/// Row 2's curves: claims per second (the median over the rounds), and the share of claim
/// writes answered 409 (all rounds together), against N.
fn claim_charts(at: &[paired::AtN]) -> Vec<plots::Chart> {
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

fn payload_rows(report: &mut Report, p: &payload::Payload) {
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

fn versus_rows(report: &mut Report, v: &versus::Versus) {
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
fn fanout_rows(report: &mut Report, f: &[fanout::Fanout]) {
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
fn fanout_chart(f: &[fanout::Fanout]) -> plots::Chart {
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
fn queuelen_rows(report: &mut Report, q: &[queuelen::Stage]) {
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
             round {}; the rounds took {}), mean {:.1} ms, of which the API server's own time for the claim write (PUT \
             leasedjobs/status, apiserver_request_duration_seconds, {:.0} writes) {}; \
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
fn queuelen_charts(q: &[queuelen::Stage]) -> Vec<plots::Chart> {
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

/// A 409 share over part of a claim run, as a percentage; "not measured" when the run ended
/// before the benchmark scraped the API server's metrics at that part's marks (NaN).
fn split_share(share: f64) -> String {
    if share.is_nan() {
        "not measured".into()
    } else {
        format!("{:.1}%", share * 100.0)
    }
}

#[cfg(test)]
mod tests {
    use super::split_share;

    #[test]
    fn a_share_not_measured_says_so() {
        assert_eq!(split_share(f64::NAN), "not measured");
        assert_eq!(split_share(0.0), "0.0%");
        assert_eq!(split_share(0.0125), "1.2%");
    }
}
