//! The command line and the sizes a run measures (the full benchmark, `--smoke`, or flags).

use std::path::PathBuf;

use std::fmt::Write as _;

use clap::Parser;

use crate::procs;

/// Benchmarks leasehold against the local API server's own ceiling and against batch/v1 Jobs.
///
/// Sizes default to the full benchmark; `--smoke` picks small ones (seconds, for CI), and any
/// size flag given overrides either.
#[derive(Parser, Debug)]
#[command(name = "leasehold-bench", version)]
pub(crate) struct Cli {
    /// Kubeconfig of the cluster to use; its API server must be on loopback.
    #[arg(long)]
    pub(crate) kubeconfig: PathBuf,
    /// The `leasehold` binary to run as controller and sidecars (default: beside this one).
    #[arg(long)]
    pub(crate) leasehold: Option<PathBuf>,
    /// The `env` file written by tests/controlplane/start.sh, for the control plane's pids
    /// (default: `env` beside the kubeconfig, if there is one). Without it, no CPU breakdown
    /// for kube-apiserver, etcd and kube-controller-manager.
    #[arg(long)]
    pub(crate) controlplane_env: Option<PathBuf>,
    /// Markdown file to write the results into, between generated-block markers (the text
    /// around them is kept).
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// With `--out`: write into the block of this name instead of the full run's, so that a
    /// run of some rows (`--rows`) sits beside the full table instead of replacing it.
    #[arg(long, default_value = "")]
    pub(crate) block: String,
    /// Directory for the logs of the processes started (default: a new temporary directory).
    #[arg(long)]
    pub(crate) logs: Option<PathBuf>,
    /// Small sizes: checks that every row still runs, in about a minute. Figures from a smoke
    /// run mean nothing.
    #[arg(long)]
    pub(crate) smoke: bool,
    /// Rows to run (default all): e.g. `--rows 1,2`.
    #[arg(long, value_delimiter = ',')]
    pub(crate) rows: Vec<u8>,
    /// Row 1: seconds measured per N (after a 1 s warm-up). Default 10.
    #[arg(long)]
    pub(crate) ceiling_seconds: Option<f64>,
    /// Rows 1 and 2: rounds. Each round measures, at each N, the ceiling and then the claim
    /// run compared with it; the verdicts read the median over the rounds. Default 3 (smoke 1).
    #[arg(long)]
    pub(crate) rounds: Option<usize>,
    /// Rows 1 and 2: numbers of concurrent writers/claimers. Default 1,8,32.
    #[arg(long, value_delimiter = ',')]
    pub(crate) claimers: Option<Vec<usize>>,
    /// Row 2: queued jobs per N. Default 1000.
    #[arg(long)]
    pub(crate) claim_jobs: Option<usize>,
    /// Row 3: jobs created one at a time. Default 200.
    #[arg(long)]
    pub(crate) dispatch_jobs: Option<usize>,
    /// Row 3: idle workers, each with its own sidecar. Default 4.
    #[arg(long)]
    pub(crate) dispatch_workers: Option<usize>,
    /// Row 4: jobs held when their holders are killed. Default 100.
    #[arg(long)]
    pub(crate) expiry_jobs: Option<usize>,
    /// Row 4: sidecars holding them. Default 4.
    #[arg(long)]
    pub(crate) expiry_holders: Option<usize>,
    /// Row 4: leaseDurationSeconds of those jobs (5 is the least the CRD allows). Default 5.
    #[arg(long)]
    pub(crate) expiry_lease: Option<i32>,
    /// Rows 5-6: jobs in the namespace. Default 10000.
    #[arg(long)]
    pub(crate) footprint_jobs: Option<usize>,
    /// Rows 5-6: jobs leased and heartbeating. Default 1000.
    #[arg(long)]
    pub(crate) footprint_held: Option<usize>,
    /// Rows 5-6: sidecars holding them. Default 10.
    #[arg(long)]
    pub(crate) footprint_sidecars: Option<usize>,
    /// Rows 5-6: leaseDurationSeconds (renewals every third of it). Default 30.
    #[arg(long)]
    pub(crate) footprint_lease: Option<i32>,
    /// Rows 5-6: renew intervals measured. Default 3.
    #[arg(long)]
    pub(crate) heartbeat_intervals: Option<u32>,
    /// Row 7: items on each side. Default 1000.
    #[arg(long)]
    pub(crate) versus_jobs: Option<usize>,
    /// Row 7: idle workers (sidecars) on the LeasedJob side. Default 16.
    #[arg(long)]
    pub(crate) versus_workers: Option<usize>,
    /// Row 8: queued jobs in each of the two queues (small and large payloads). Default 2000.
    #[arg(long)]
    pub(crate) payload_jobs: Option<usize>,
    /// Row 9: numbers of sidecars watching one queue. Default 8,64,200.
    #[arg(long, value_delimiter = ',')]
    pub(crate) fanout_sidecars: Option<Vec<usize>>,
    /// Row 9: jobs claimed and completed at each number. Default 200.
    #[arg(long)]
    pub(crate) fanout_jobs: Option<usize>,
    /// Row 11: numbers of sidecars waiting on one queue, with the dispatcher. Default 8,500.
    #[arg(long, value_delimiter = ',')]
    pub(crate) fleet_sidecars: Option<Vec<usize>>,
    /// Row 11: jobs created, claimed and completed at each number. Default 600.
    #[arg(long)]
    pub(crate) fleet_jobs: Option<usize>,
    /// Row 10: jobs in the queue at each stage, ascending. Default 1000,10000,100000.
    #[arg(long, value_delimiter = ',')]
    pub(crate) queue_lengths: Option<Vec<usize>>,
    /// Row 12: sidecars waiting on one queue when the leading dispatcher is killed. Default 8.
    #[arg(long)]
    pub(crate) failover_sidecars: Option<usize>,
}

/// The sizes in force.
#[derive(Debug)]
pub(crate) struct Sizes {
    pub(crate) ceiling_seconds: f64,
    pub(crate) rounds: usize,
    pub(crate) claimers: Vec<usize>,
    pub(crate) claim_jobs: usize,
    pub(crate) dispatch_jobs: usize,
    pub(crate) dispatch_workers: usize,
    pub(crate) expiry_jobs: usize,
    pub(crate) expiry_holders: usize,
    pub(crate) expiry_lease: i32,
    pub(crate) footprint_jobs: usize,
    pub(crate) footprint_held: usize,
    pub(crate) footprint_sidecars: usize,
    pub(crate) footprint_lease: i32,
    pub(crate) heartbeat_intervals: u32,
    pub(crate) versus_jobs: usize,
    pub(crate) versus_workers: usize,
    pub(crate) payload_jobs: usize,
    pub(crate) payload_bytes: Vec<usize>,
    pub(crate) fanout_sidecars: Vec<usize>,
    pub(crate) fanout_jobs: usize,
    pub(crate) queue_lengths: Vec<usize>,
    pub(crate) fleet_sidecars: Vec<usize>,
    pub(crate) fleet_jobs: usize,
    pub(crate) failover_sidecars: usize,
}

impl Sizes {
    pub(crate) fn of(cli: &Cli) -> Sizes {
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
            fleet_sidecars: cli.fleet_sidecars.clone().unwrap_or_else(|| {
                if s {
                    vec![2, 6]
                } else {
                    vec![8, 500]
                }
            }),
            fleet_jobs: pick(cli.fleet_jobs, 12, 600),
            failover_sidecars: pick(cli.failover_sidecars, 2, 8),
            queue_lengths: cli.queue_lengths.clone().unwrap_or_else(|| {
                if s {
                    vec![20, 60]
                } else {
                    vec![1000, 10_000, 100_000]
                }
            }),
        }
    }

    pub(crate) fn describe(&self) -> String {
        format!(
            "{} rounds of: ceiling {} s at N, then claims at N; N = {}; claim M = {} jobs; dispatch {} jobs to {} workers; \
             expiry {} jobs on {} killed sidecars, lease {} s; footprint {} jobs, {} held by {} \
             sidecars, lease {} s, {} renew intervals; vs Jobs {} items, {} workers; payloads \
             {} jobs per queue, {} bytes; fan-out {} jobs at {} sidecars; queue lengths {}; \
             fleet {} jobs at {} waiting sidecars; failover {} sidecars",
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
            self.fleet_jobs,
            list(&self.fleet_sidecars),
            self.failover_sidecars,
        )
    }
}

pub(crate) fn list(v: &[usize]) -> String {
    v.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) fn describe_run(version: &str, sizes: &Sizes, smoke: bool) -> String {
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
