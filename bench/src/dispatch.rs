//! Row 3, dispatch latency: idle workers wait in `POST /v1/claim?wait=30` on real sidecar
//! processes; jobs are created one at a time; latency is from just before the create request
//! to the worker receiving the claim. A watch of the namespace splits it into creation ->
//! the controller's Queued status seen, and the rest.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::cluster::{self, Bench, JobWatch};
use crate::procs;
use crate::stats::ms;

/// Latencies of one run, in milliseconds.
pub struct Dispatch {
    /// Creation to claim received, per job.
    pub latencies_ms: Vec<f64>,
    /// Creation to the watch seeing the controller's Queued status, per job (when seen).
    pub to_queued_ms: Vec<f64>,
    /// Workers (sidecars) waiting.
    pub workers: usize,
    /// Jobs claimed before the controller had initialised them (claimable at once).
    pub before_queued: usize,
}

/// Creates `jobs` jobs one at a time for `workers` idle sidecar-backed workers.
pub async fn run(bench: &Bench, workers: usize, jobs: usize) -> anyhow::Result<Dispatch> {
    let ns = bench.namespace("bench-dispatch").await?;
    let queue = "dispatch";
    let mut controller = procs::controller(&bench.leasehold, &bench.kubeconfig, &bench.logs, &ns)?;
    let http = crate::procs::sidecar_http();
    let sidecars = procs::sidecars(bench, &http, &ns, queue, workers).await?;
    let watch = JobWatch::start(bench.client.clone(), &ns).await?;
    let (tx, mut rx) = mpsc::unbounded_channel::<(String, Instant)>();
    let mut loops = Vec::new();
    for s in &sidecars {
        let (http, base, tx) = (http.clone(), s.base.clone(), tx.clone());
        loops.push(tokio::spawn(async move {
            loop {
                let r = http
                    .post(format!("{base}/v1/claim?wait=30"))
                    .send()
                    .await
                    .context("claim")?;
                if r.status() == reqwest::StatusCode::NO_CONTENT {
                    continue;
                }
                let status = r.status();
                let body: Value = r.json().await.context("claim body")?;
                anyhow::ensure!(status.is_success(), "claim answered {status}: {body}");
                let at = Instant::now();
                let name = cluster::text(&body, "name")?;
                let token = cluster::text(&body, "token")?;
                let _ = tx.send((name.clone(), at));
                let r = http
                    .post(format!("{base}/v1/jobs/{name}/complete"))
                    .json(&json!({"token": token, "result": {}}))
                    .send()
                    .await
                    .context("complete")?;
                anyhow::ensure!(r.status().is_success(), "complete answered {}", r.status());
            }
            #[allow(unreachable_code)]
            anyhow::Ok(())
        }));
    }
    let api: Api<LeasedJob> = Api::namespaced(bench.client.clone(), &ns);
    let mut latencies_ms = Vec::with_capacity(jobs);
    let mut to_queued_ms = Vec::new();
    let mut before_queued = 0;
    let mut created = Vec::with_capacity(jobs);
    for i in 0..jobs {
        // Let the last worker finish its complete and go back to waiting.
        tokio::time::sleep(Duration::from_millis(100)).await;
        controller.check_running()?;
        let name = format!("d-{i}");
        let t0 = Instant::now();
        cluster::create_with_retry(&api, &cluster::job(&name, queue, 60)).await?;
        let (claimed, at) = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .with_context(|| format!("job {name} not claimed within 30 s"))?
            .context("all workers stopped")?;
        anyhow::ensure!(claimed == name, "expected a claim of {name}, got {claimed}");
        latencies_ms.push(ms(at - t0));
        created.push((name, t0, at));
    }
    // The Queued status may be seen after the claim (or never, when the claim came first).
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (name, t0, at) in &created {
        match watch.seen(name, 0, Some(Phase::Queued)) {
            Some(s) if s.at <= *at => to_queued_ms.push(ms(s.at - *t0)),
            _ => before_queued += 1,
        }
    }
    for l in loops {
        l.abort();
    }
    drop(sidecars);
    controller.kill().await;
    Ok(Dispatch {
        latencies_ms,
        to_queued_ms,
        workers,
        before_queued,
    })
}
