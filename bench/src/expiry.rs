//! Row 4, expiry latency: sidecar processes holding jobs are killed with SIGKILL; for each job,
//! from its last heartbeat (the Lease's renewTime, the last one the dead sidecar wrote) to the
//! moment a watch sees the controller's requeue, in multiples of leaseDurationSeconds.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use leasehold_core::crd::Phase;
use leasehold_core::lease;
use serde_json::Value;

use crate::cluster::{self, status_phase, Bench, JobWatch};
use crate::procs;

/// Result of one run.
pub struct Expiry {
    /// Last heartbeat to requeue seen, per job, in seconds.
    pub latencies_s: Vec<f64>,
    /// The jobs' leaseDurationSeconds.
    pub lease_seconds: i32,
    /// Sidecars killed.
    pub holders: usize,
}

fn micros(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// `holders` sidecars claim `jobs` jobs (lease `lease_seconds`) between them, renew in the
/// background for half a lease, and are killed.
pub async fn run(
    bench: &Bench,
    holders: usize,
    jobs: usize,
    lease_seconds: i32,
) -> anyhow::Result<Expiry> {
    let ns = bench.namespace("bench-expiry").await?;
    let queue = "expiry";
    let mut controller = procs::controller(&bench.leasehold, &bench.kubeconfig, &bench.logs, &ns)?;
    let http = crate::procs::sidecar_http();
    let mut sidecars = procs::sidecars(bench, &http, &ns, queue, holders).await?;
    let watch = JobWatch::start(bench.client.clone(), &ns).await?;
    bench
        .create_jobs(&ns, queue, "e", jobs, lease_seconds, 16)
        .await?;
    let queued = watch.wait_phase(jobs, Phase::Queued, Duration::from_secs(120));
    controller.while_running(queued).await?;
    // Each sidecar claims its share, all sidecars at once.
    let claims = sidecars.iter().enumerate().map(|(i, s)| {
        let share = jobs / holders + usize::from(i < jobs % holders);
        let (http, base) = (http.clone(), s.base.clone());
        async move {
            let mut names = Vec::new();
            for _ in 0..share {
                let r = http
                    .post(format!("{base}/v1/claim?wait=10"))
                    .send()
                    .await
                    .context("claim")?;
                anyhow::ensure!(r.status() == 200, "claim answered {}", r.status());
                let body: Value = r.json().await?;
                names.push(cluster::text(&body, "name")?);
            }
            anyhow::Ok(names)
        }
    });
    let names: Vec<String> = futures::future::try_join_all(claims)
        .await?
        .into_iter()
        .flatten()
        .collect();
    // Let background renewals run for a while, so last heartbeats are spread out.
    tokio::time::sleep(Duration::from_secs_f64(f64::from(lease_seconds) / 2.0)).await;
    controller.check_running()?;
    for s in &mut sidecars {
        s.proc.kill().await;
    }
    // A renewal in flight at the kill may still land; read the Leases just after.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let leases: Api<Lease> = Api::namespaced(bench.client.clone(), &ns);
    let renewed: HashMap<String, i64> = leases
        .list(&Default::default())
        .await
        .context("list Leases")?
        .items
        .into_iter()
        .filter_map(|l| {
            let name = l.metadata.name.clone()?;
            let t = l.spec?.renew_time?.0;
            Some((name, t.as_microsecond()))
        })
        .collect();
    let timeout = Duration::from_secs(u64::try_from(lease_seconds).unwrap_or(60) * 3 + 30);
    watch
        .wait("requeues", timeout, |all| {
            all.iter()
                .filter(|j| j.attempt() >= 1 && status_phase(j) == Some(Phase::Queued))
                .count()
                >= names.len()
        })
        .await?;
    let mut latencies_s = Vec::new();
    for name in &names {
        let last = renewed
            .get(&lease::lease_name(name))
            .with_context(|| format!("no renewTime on the Lease of {name}"))?;
        let seen = watch
            .seen(name, 1, Some(Phase::Queued))
            .with_context(|| format!("requeue of {name} not seen"))?;
        latencies_s.push((micros(seen.wall) - last) as f64 / 1e6);
    }
    controller.kill().await;
    Ok(Expiry {
        latencies_s,
        lease_seconds,
        holders,
    })
}
