//! Row 9, watch fan-out: what one claim costs the API server as the number of sidecars on one
//! queue grows. For each S, S sidecar processes watch one queue (as S worker pods would);
//! [`CLAIMERS`] of them claim and complete J jobs created during the window, the others stay
//! idle (their workers busy elsewhere, as most of a large fleet is). Over the window: the API
//! server's CPU from /proc and the LeasedJob watch events and bytes it sent
//! (`apiserver_watch_events_total`, `apiserver_watch_events_sizes_sum`), per claim.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::{json, Value};

use crate::cluster::{self, Bench};
use crate::metrics::{self, WatchSent};
use crate::procs::{self, CpuWindow};

/// Sidecars that claim; the rest only watch.
pub const CLAIMERS: usize = 4;

/// One S.
pub struct Fanout {
    /// Sidecars watching the queue.
    pub sidecars: usize,
    /// Jobs claimed and completed in the window.
    pub jobs: usize,
    /// LeasedJob watch events and bytes the API server sent in the window.
    pub sent: WatchSent,
    /// CPU by process group over the window, in cores.
    pub cpu: Vec<(String, f64)>,
    /// The window's length.
    pub elapsed: Duration,
    /// Resident memory of the sidecars at the end, KiB, summed.
    pub sidecars_rss_kib: u64,
}

impl Fanout {
    /// CPU seconds a group used per claim.
    pub fn cpu_seconds_per_claim(&self, group: &str) -> f64 {
        crate::procs::cpu_seconds_per(&self.cpu, group, self.elapsed, self.jobs)
    }

    /// Watch bytes sent per claim.
    pub fn bytes_per_claim(&self) -> f64 {
        self.sent.bytes / self.jobs as f64
    }

    /// Watch events sent per claim.
    pub fn events_per_claim(&self) -> f64 {
        self.sent.events / self.jobs as f64
    }
}

/// Runs the scenario for each S in `sidecar_counts`, `jobs` jobs each.
pub async fn run(
    bench: &Bench,
    sidecar_counts: &[usize],
    jobs: usize,
) -> anyhow::Result<Vec<Fanout>> {
    let mut out = Vec::new();
    for &s in sidecar_counts {
        eprintln!("row 9: {s} sidecars on one queue");
        out.push(one(bench, s, jobs).await?);
    }
    Ok(out)
}

async fn one(bench: &Bench, sidecars: usize, jobs: usize) -> anyhow::Result<Fanout> {
    let ns = bench.namespace(&format!("bench-fanout{sidecars}")).await?;
    let queue = "fanout";
    let mut controller = procs::controller(&bench.leasehold, &bench.kubeconfig, &bench.logs, &ns)?;
    let http = procs::sidecar_http();
    let mut scs = procs::sidecars(bench, &http, &ns, queue, sidecars).await?;
    // Let every sidecar's watch settle after its initial list.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = metrics::scrape_text(&bench.client).await?;
    let mut groups = bench.controlplane.groups();
    groups.push(("leasehold controller".into(), vec![controller.pid()]));
    groups.push((
        "leasehold sidecars".into(),
        scs.iter().map(|s| s.proc.pid()).collect(),
    ));
    let cpu = CpuWindow::start(groups);
    let start = Instant::now();
    let claimers = sidecars.min(CLAIMERS);
    let loops = scs.iter().take(claimers).enumerate().map(|(i, s)| {
        let share = jobs / claimers + usize::from(i < jobs % claimers);
        let (http, base) = (http.clone(), s.base.clone());
        async move {
            for _ in 0..share {
                let r = http
                    .post(format!("{base}/v1/claim?wait=30"))
                    .send()
                    .await
                    .context("claim")?;
                let status = r.status();
                anyhow::ensure!(status == 200, "claim answered {status}");
                let body: Value = r.json().await.context("claim body")?;
                let name = cluster::text(&body, "name")?;
                let r = http
                    .post(format!("{base}/v1/jobs/{name}/complete"))
                    .json(&json!({"token": body["token"], "result": {}}))
                    .send()
                    .await
                    .context("complete")?;
                anyhow::ensure!(r.status().is_success(), "complete answered {}", r.status());
            }
            anyhow::Ok(())
        }
    });
    let create = bench.create_jobs(&ns, queue, "f", jobs, 60, 4);
    let (created, claimed) = tokio::join!(create, futures::future::try_join_all(loops));
    created?;
    claimed?;
    // The last completions' events reach every watcher.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let elapsed = start.elapsed();
    let cpu = cpu.finish();
    let after = metrics::scrape_text(&bench.client).await?;
    controller.check_running()?;
    let mut sidecars_rss_kib = 0;
    for s in &mut scs {
        s.proc.check_running()?;
        sidecars_rss_kib += procs::sample(s.proc.pid()).map_or(0, |x| x.rss_kib);
    }
    drop(scs);
    controller.kill().await;
    Ok(Fanout {
        sidecars,
        jobs,
        sent: WatchSent::parse(&after, "leasedjobs")
            .since(&WatchSent::parse(&before, "leasedjobs")),
        cpu,
        elapsed,
        sidecars_rss_kib,
    })
}
