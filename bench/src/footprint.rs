//! Rows 5 and 6, in one scenario: F jobs in a namespace, H of them claimed through S sidecar
//! processes and then only renewed in the background (the worker stays silent). Over a window
//! of whole renew intervals: the API server's own request counts (heartbeat cost, with every
//! renewal carrying progress and a message, which one heartbeat per job sets first), and the
//! controller's and sidecars' memory and CPU from /proc (footprint).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use leasehold_core::crd::Phase;

use crate::cluster::{Bench, JobWatch};
use crate::metrics::{self, Requests};
use crate::procs::{self, CpuWindow, Sample};

/// Result of one run.
pub struct Footprint {
    /// Jobs in the namespace.
    pub jobs: usize,
    /// Jobs held and renewed.
    pub held: usize,
    /// Sidecars holding them.
    pub sidecars: usize,
    /// leaseDurationSeconds of the jobs.
    pub lease_seconds: i32,
    /// Renew intervals in the window.
    pub intervals: u32,
    /// Requests the API server counted during the window.
    pub requests: Requests,
    /// The controller at the end of the window.
    pub controller: Sample,
    /// Each sidecar at the end of the window.
    pub sidecar_samples: Vec<Sample>,
    /// CPU by process group during the window, in cores.
    pub cpu: Vec<(String, f64)>,
    /// Latency of each claim made through the sidecars while all F jobs were cached, ms.
    pub claim_ms: Vec<f64>,
    /// Time to create the F jobs and see all of them Queued.
    pub fill: Duration,
}

impl Footprint {
    /// Lease PATCHes (renewals) per held job per renew interval.
    pub fn lease_writes_per_job_interval(&self) -> f64 {
        self.requests
            .sum(|k| k.resource == "leases" && k.verb == "PATCH")
            / (self.held as f64 * f64::from(self.intervals))
    }

    /// LeasedJob writes (any verb, any subresource) during the window.
    pub fn job_writes(&self) -> f64 {
        self.requests
            .sum(|k| k.resource == "leasedjobs" && k.is_write())
    }
}

/// Runs the scenario.
pub async fn run(
    bench: &Bench,
    jobs: usize,
    held: usize,
    sidecars: usize,
    lease_seconds: i32,
    intervals: u32,
) -> anyhow::Result<Footprint> {
    let ns = bench.namespace("bench-footprint").await?;
    let queue = "footprint";
    let mut controller = procs::controller(&bench.leasehold, &bench.kubeconfig, &bench.logs, &ns)?;
    let fill_start = Instant::now();
    bench
        .create_jobs(&ns, queue, "f", jobs, lease_seconds, 32)
        .await?;
    {
        let watch = JobWatch::start(bench.client.clone(), &ns).await?;
        let queued = watch.wait_phase(jobs, Phase::Queued, Duration::from_secs(900));
        controller.while_running(queued).await?;
    }
    let fill = fill_start.elapsed();
    let http = crate::procs::sidecar_http();
    let mut scs = procs::sidecars(bench, &http, &ns, queue, sidecars).await?;
    // One heartbeat with progress and a message per job: every background renewal in the
    // window carries them, so the row counts renewals as they are when a worker reports
    // progress.
    let claim_ms = procs::claim_loops(&http, &scs, held, procs::AfterClaim::Heartbeat).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let interval = Duration::from_secs(u64::try_from(lease_seconds).unwrap_or(60)) / 3;
    let m0 = metrics::scrape(&bench.client).await?;
    let mut groups = bench.controlplane.groups();
    groups.push(("leasehold controller".into(), vec![controller.pid()]));
    groups.push((
        format!("leasehold sidecars ({sidecars})"),
        scs.iter().map(|s| s.proc.pid()).collect(),
    ));
    let cpu = CpuWindow::start(groups);
    tokio::time::sleep(interval * intervals).await;
    let cpu = cpu.finish();
    let requests = metrics::scrape(&bench.client).await?.since(&m0);
    controller.check_running()?;
    let controller_sample = procs::sample(controller.pid()).context("controller gone")?;
    let mut sidecar_samples = Vec::new();
    for s in &mut scs {
        s.proc.check_running()?;
        sidecar_samples.push(procs::sample(s.proc.pid()).context("sidecar gone")?);
    }
    drop(scs);
    controller.kill().await;
    Ok(Footprint {
        jobs,
        held,
        sidecars,
        lease_seconds,
        intervals,
        requests,
        controller: controller_sample,
        sidecar_samples,
        cpu,
        claim_ms,
        fill,
    })
}
