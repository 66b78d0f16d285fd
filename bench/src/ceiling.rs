//! Row 1, the ceiling: how many conditional status updates per second N concurrent writers get
//! from this API server with the same client library, each writer replacing the status of its
//! own LeasedJob under the resourceVersion it last got back (so none conflicts).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kube::api::PostParams;
use kube::{Api, ResourceExt};
use leasehold_core::claim;
use leasehold_core::crd::LeasedJob;
use leasehold_core::token::Token;
use tokio::task::JoinSet;

use crate::cluster::Bench;
use crate::metrics;
use crate::procs::CpuWindow;

/// The ceiling at one N, in one round.
#[derive(Clone, Debug)]
pub struct Ceiling {
    /// Concurrent writers.
    pub writers: usize,
    /// The round it was measured in (0-based; each round measures the ceiling at N just
    /// before the claim run at N that is compared with it).
    pub round: usize,
    /// Successful writes per second.
    pub per_second: f64,
    /// Writes counted by the API server per second (all resources), as a cross-check.
    pub server_writes_per_second: f64,
    /// Failed writes (should be 0).
    pub errors: u64,
    /// CPU by process during the window, in cores.
    pub cpu: Vec<(String, f64)>,
}

/// The writers' jobs, one per writer, in a namespace of their own.
pub struct Jobs {
    ns: String,
    count: usize,
}

/// Creates the namespace `bench-ceiling` with `most` jobs, enough for the largest N.
pub async fn prepare(bench: &Bench, most: usize) -> anyhow::Result<Jobs> {
    let ns = bench.namespace("bench-ceiling").await?;
    bench.create_jobs(&ns, "ceiling", "c", most, 60, 16).await?;
    Ok(Jobs { ns, count: most })
}

/// Measures the ceiling at N = `n` (at most the jobs prepared), `seconds` after a 1 s warm-up.
pub async fn measure(
    bench: &Bench,
    jobs: &Jobs,
    n: usize,
    round: usize,
    seconds: f64,
) -> anyhow::Result<Ceiling> {
    anyhow::ensure!(n <= jobs.count, "{n} writers but only {} jobs", jobs.count);
    let ns = jobs.ns.as_str();
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // A JoinSet aborts its tasks when dropped: a measurement that fails half-way leaves no
    // writer running into the next one.
    let mut tasks = JoinSet::new();
    for i in 0..n {
        let api: Api<LeasedJob> = Api::namespaced(bench.new_client()?, ns);
        let (done, errors, stop) = (Arc::clone(&done), Arc::clone(&errors), Arc::clone(&stop));
        tasks.spawn(async move {
            let name = format!("c-{i}");
            let mut current = api.get(&name).await.context("read ceiling job")?;
            while !stop.load(Ordering::Relaxed) {
                // The same write a claim makes: a new token, holder and claim time, under the
                // resourceVersion last read.
                let mut next = current.clone();
                let token = Token::issue(current.attempt() + 1);
                next.status = Some(claim::claimed_status(
                    &current,
                    &token,
                    "bench-ceiling",
                    k8s_openapi::jiff::Timestamp::now(),
                    None,
                ));
                match api
                    .replace_status(&current.name_any(), &PostParams::default(), &next)
                    .await
                {
                    Ok(stored) => {
                        current = stored;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        current = api.get(&name).await.context("re-read ceiling job")?;
                    }
                }
            }
            anyhow::Ok(())
        });
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let m0 = metrics::scrape(&bench.client).await?;
    let mut groups = bench.controlplane.groups();
    groups.push(("leasehold-bench".into(), vec![std::process::id()]));
    let cpu = CpuWindow::start(groups);
    let (c0, t0) = (done.load(Ordering::Relaxed), Instant::now());
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    let (c1, elapsed) = (done.load(Ordering::Relaxed), t0.elapsed());
    let cpu = cpu.finish();
    let m1 = metrics::scrape(&bench.client).await?;
    stop.store(true, Ordering::Relaxed);
    while let Some(t) = tasks.join_next().await {
        t??;
    }
    let server = m1.since(&m0).sum(|k| k.is_write());
    let secs = elapsed.as_secs_f64();
    Ok(Ceiling {
        writers: n,
        round,
        per_second: (c1 - c0) as f64 / secs,
        server_writes_per_second: server / secs,
        errors: errors.load(Ordering::Relaxed),
        cpu,
    })
}
