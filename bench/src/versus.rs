//! Row 7, against Kubernetes Jobs, on the same API server: J batch/v1 Jobs, from the first
//! create request until a Pod exists for every one (made by the real kube-controller-manager's
//! job controller; the Pods stay Pending, there is no kubelet), against J LeasedJobs, from the
//! first create request until idle workers (real sidecar processes, long-polling) have claimed
//! every one. Both create their objects the same way, `concurrency` requests at a time.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::runtime::{watcher, WatchStreamExt};
use kube::Api;

use crate::cluster::Bench;
use crate::metrics::{self, Requests};
use crate::procs::{self, CpuWindow};

/// One side of the comparison.
pub struct Side {
    /// Time from the first create to the last create answered.
    pub created: Duration,
    /// Time from the first create until every item is dispatched (Pod exists / claimed).
    pub done: Duration,
    /// Requests the API server counted meanwhile.
    pub requests: Requests,
    /// CPU by process during the run, in cores.
    pub cpu: Vec<(String, f64)>,
}

/// Result of both runs.
pub struct Versus {
    /// Items per side.
    pub items: usize,
    /// Idle workers on the LeasedJob side.
    pub workers: usize,
    /// batch/v1 Jobs -> Pods.
    pub jobs: Side,
    /// LeasedJobs -> claims.
    pub leasedjobs: Side,
}

const CONCURRENCY: usize = 16;
const TIMEOUT: Duration = Duration::from_secs(1200);

/// Runs both sides, LeasedJobs first (the Jobs' Pending Pods keep kube-controller-manager
/// busy for a while afterwards).
pub async fn run(bench: &Bench, items: usize, workers: usize) -> anyhow::Result<Versus> {
    let leasedjobs = leasedjobs(bench, items, workers).await?;
    let jobs = kube_jobs(bench, items).await?;
    Ok(Versus {
        items,
        workers,
        jobs,
        leasedjobs,
    })
}

async fn leasedjobs(bench: &Bench, items: usize, workers: usize) -> anyhow::Result<Side> {
    let ns = bench.namespace("bench-vs-ljobs").await?;
    let queue = "versus";
    let mut controller = procs::controller(&bench.leasehold, &bench.kubeconfig, &bench.logs, &ns)?;
    let http = crate::procs::sidecar_http();
    let sidecars = procs::sidecars(bench, &http, &ns, queue, workers).await?;
    let claimed = Arc::new(AtomicU64::new(0));
    let mut loops = Vec::new();
    for s in &sidecars {
        let (http, base, claimed) = (http.clone(), s.base.clone(), Arc::clone(&claimed));
        loops.push(tokio::spawn(async move {
            loop {
                let r = http
                    .post(format!("{base}/v1/claim?wait=30"))
                    .send()
                    .await
                    .context("claim")?;
                match r.status().as_u16() {
                    200 => {
                        claimed.fetch_add(1, Ordering::Relaxed);
                    }
                    204 => {}
                    s => bail!("claim answered {s}: {}", r.text().await.unwrap_or_default()),
                }
            }
            #[allow(unreachable_code)]
            anyhow::Ok(())
        }));
    }
    let mut groups = bench.controlplane.groups();
    groups.push(("leasehold controller".into(), vec![controller.pid()]));
    groups.push((
        format!("leasehold sidecars ({workers})"),
        sidecars.iter().map(|s| s.proc.pid()).collect(),
    ));
    let m0 = metrics::scrape(&bench.client).await?;
    let cpu = CpuWindow::start(groups);
    let t0 = Instant::now();
    let created = {
        bench
            .create_jobs(&ns, queue, "v", items, 60, CONCURRENCY)
            .await?;
        t0.elapsed()
    };
    while claimed.load(Ordering::Relaxed) < items as u64 {
        controller.check_running()?;
        if let Some(done) = loops.iter().find(|l| l.is_finished()) {
            bail!("a worker loop ended: {:?}", done);
        }
        if t0.elapsed() > TIMEOUT {
            bail!(
                "only {} of {items} LeasedJobs claimed after {TIMEOUT:?}",
                claimed.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let done = t0.elapsed();
    let cpu = cpu.finish();
    let requests = metrics::scrape(&bench.client).await?.since(&m0);
    for l in loops {
        l.abort();
    }
    drop(sidecars);
    controller.kill().await;
    Ok(Side {
        created,
        done,
        requests,
        cpu,
    })
}

fn batch_job(name: &str) -> anyhow::Result<Job> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "work", "image": "worker:bench",
                                "args": ["--input", format!("s3://bench/{name}.wav")]}]
            }}
        }
    }))?)
}

async fn kube_jobs(bench: &Bench, items: usize) -> anyhow::Result<Side> {
    let ns = bench.namespace("bench-vs-jobs").await?;
    bench.wait_default_service_account(&ns).await?;
    let pods: Api<Pod> = Api::namespaced(bench.client.clone(), &ns);
    let (tx, rx) = tokio::sync::oneshot::channel::<Instant>();
    let mut stream = watcher(pods, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    // Wait for the (empty) initial list, so that no Pod is missed.
    let counter = tokio::spawn(async move {
        let mut owners = HashSet::new();
        let mut tx = Some(tx);
        while let Some(pod) = stream.next().await {
            let Ok(pod) = pod else { continue };
            let owner = pod
                .metadata
                .owner_references
                .unwrap_or_default()
                .into_iter()
                .find(|o| o.kind == "Job");
            if let Some(o) = owner {
                owners.insert(o.name);
            }
            if owners.len() >= items {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(Instant::now());
                }
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let api: Api<Job> = Api::namespaced(bench.client.clone(), &ns);
    let m0 = metrics::scrape(&bench.client).await?;
    let cpu = CpuWindow::start(bench.controlplane.groups());
    let t0 = Instant::now();
    futures::stream::iter(0..items)
        .map(|i| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &batch_job(&format!("k-{i}"))?)
                    .await
                    .with_context(|| format!("create Job k-{i}"))?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<()>>()
        .await?;
    let created = t0.elapsed();
    let at = tokio::time::timeout(TIMEOUT, rx)
        .await
        .with_context(|| format!("not every Job had its Pod after {TIMEOUT:?}"))?
        .context("Pod watch ended")?;
    let done = at - t0;
    let cpu = cpu.finish();
    let requests = metrics::scrape(&bench.client).await?.since(&m0);
    counter.abort();
    Ok(Side {
        created,
        done,
        requests,
        cpu,
    })
}
