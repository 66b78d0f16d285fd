//! Row 8: memory against the bytes of the queue. The same number of queued jobs, once with
//! small payloads and once with large ones, each in its own namespace with its own controller
//! and sidecar; after both have synced and settled, each process's memory from /proc. Flat
//! means the watch caches keep what decisions need, not the payloads (issue: "sidecar RSS,
//! 2000 queued jobs with 64 KiB payloads vs with 100-byte payloads: within 10 % of each
//! other, and < 25 MiB").

use std::time::Duration;

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt};
use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};

use crate::cluster::{self, Bench, JobWatch};
use crate::procs::{self, Sample};

/// One queue's measurement.
pub struct Side {
    /// Bytes of each job's payload (its one string field).
    pub payload_bytes: usize,
    /// The controller, settled.
    pub controller: Sample,
    /// The sidecar, settled.
    pub sidecar: Sample,
}

/// Both queues.
pub struct Payload {
    /// Queued jobs in each queue.
    pub jobs: usize,
    /// Small payloads first, then large.
    pub sides: Vec<Side>,
}

/// How long both processes are left alone after syncing before they are measured.
pub const SETTLE: Duration = Duration::from_secs(10);

/// Runs the scenario with `jobs` jobs per queue, for each size in `payload_bytes`.
pub async fn run(bench: &Bench, jobs: usize, payload_bytes: &[usize]) -> anyhow::Result<Payload> {
    let mut sides = Vec::new();
    for &size in payload_bytes {
        let ns = bench.namespace(&format!("bench-payload-{size}")).await?;
        let queue = "payload";
        let mut controller =
            procs::controller(&bench.leasehold, &bench.kubeconfig, &bench.logs, &ns)?;
        let api: Api<LeasedJob> = Api::namespaced(bench.client.clone(), &ns);
        let filler = "x".repeat(size);
        futures::stream::iter(0..jobs)
            .map(|i| {
                let api = api.clone();
                let mut job = cluster::job(&format!("p-{i}"), queue, 300);
                job.spec.payload = serde_json::json!({ "data": filler });
                async move { cluster::create_with_retry(&api, &job).await }
            })
            .buffer_unordered(16)
            .try_collect::<Vec<()>>()
            .await?;
        let watch = JobWatch::start(bench.client.clone(), &ns).await?;
        let queued = watch.wait_phase(jobs, Phase::Queued, Duration::from_secs(900));
        controller.while_running(queued).await?;
        let http = procs::sidecar_http();
        let mut sidecars = procs::sidecars(bench, &http, &ns, queue, 1).await?;
        tokio::time::sleep(SETTLE).await;
        controller.check_running()?;
        let sidecar = sidecars.remove(0);
        let side = Side {
            payload_bytes: size,
            controller: procs::sample(controller.pid()).context("controller gone")?,
            sidecar: procs::sample(sidecar.proc.pid()).context("sidecar gone")?,
        };
        drop(sidecar);
        controller.kill().await;
        sides.push(side);
    }
    Ok(Payload { jobs, sides })
}
