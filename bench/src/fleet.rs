//! Row 11, the fleet: what a job costs as the number of waiting workers grows, with the
//! dispatcher. For each S, S sidecar processes serve one queue with a dispatcher token (as S
//! worker pods of the chart would), and every one of them waits in a claim (its worker idle);
//! jobs are created one at a time at a steady rate, and each is completed as soon as it is
//! claimed. Over the window: the LeasedJob watch events the API server sent
//! (`apiserver_watch_events_total`), its CPU from /proc, every write it counted
//! (`apiserver_request_total`) but the creates, the claim writes answered 409, and, per job,
//! creation (the create's answer) to claim (the claim's answer at the worker). At the end, the
//! sidecars' resident memory.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::{json, Value};

use crate::cluster::{self, Bench};
use crate::metrics::{self, Requests, WatchSent};
use crate::procs::{self, CpuWindow};

/// Jobs created per second.
pub const RATE: f64 = 20.0;

/// One S.
pub struct Fleet {
    /// Sidecars waiting on the queue.
    pub sidecars: usize,
    /// Jobs created and claimed in the window (each completed as soon as it was claimed; a
    /// completion still in flight when the window closes is not in its requests).
    pub jobs: usize,
    /// LeasedJob watch events and bytes the API server sent in the window.
    pub sent: WatchSent,
    /// LeasedJob watches open on the API server when the window opened (every sidecar's
    /// watch of its own jobs, the controller's, kube-controller-manager's).
    pub open_watches: f64,
    /// Requests the API server counted in the window.
    pub requests: Requests,
    /// CPU by process group over the window, in cores.
    pub cpu: Vec<(String, f64)>,
    /// The window's length.
    pub elapsed: Duration,
    /// Creation -> claim of each job, ms.
    pub latency_ms: Vec<f64>,
    /// Resident memory of each sidecar at the end, KiB.
    pub sidecar_rss_kib: Vec<u64>,
    /// Resident memory of the controller (and its dispatcher) at the end, KiB.
    pub controller_rss_kib: u64,
}

impl Fleet {
    /// CPU seconds a group used per job.
    pub fn cpu_seconds_per_job(&self, group: &str) -> f64 {
        crate::procs::cpu_seconds_per(&self.cpu, group, self.elapsed, self.jobs)
    }

    /// LeasedJob watch events sent per job.
    pub fn events_per_job(&self) -> f64 {
        self.sent.events / self.jobs as f64
    }

    /// Writes per job, the creates aside (claims, completions, the controller's, Leases: every
    /// write the API server counted on any resource of the window).
    pub fn writes_per_job(&self) -> f64 {
        let writes = self.requests.sum(|k| k.is_write() && k.code != "409");
        let creates = self
            .requests
            .sum(|k| k.resource == "leasedjobs" && k.subresource.is_empty() && k.verb == "POST");
        (writes - creates) / self.jobs as f64
    }

    /// Share of the claim writes (PUT leasedjobs/status, each job's completion aside)
    /// answered 409.
    pub fn conflict_share(&self) -> f64 {
        crate::conflicts::share(crate::conflicts::claim_writes(
            &self.requests,
            self.jobs as f64,
        ))
    }
}

/// Runs the scenario for each S in `sidecar_counts`, `jobs` jobs each.
pub async fn run(
    bench: &Bench,
    sidecar_counts: &[usize],
    jobs: usize,
) -> anyhow::Result<Vec<Fleet>> {
    let mut out = Vec::new();
    for &s in sidecar_counts {
        eprintln!("row 11: {s} waiting sidecars on one queue, with the dispatcher");
        out.push(one(bench, s, jobs).await?);
    }
    Ok(out)
}

/// A ServiceAccount of `ns` that may claim there, and a file holding its token for the
/// dispatcher's audience: what the chart mounts into a worker pod.
pub(crate) async fn dispatch_token(bench: &Bench, ns: &str) -> anyhow::Result<PathBuf> {
    let pp = PatchParams::apply("leasehold-bench");
    let sa: Api<ServiceAccount> = Api::namespaced(bench.client.clone(), ns);
    sa.patch(
        "worker",
        &pp,
        &Patch::Apply(json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "worker"}})),
    )
    .await
    .context("create the workers' ServiceAccount")?;
    let roles: Api<Role> = Api::namespaced(bench.client.clone(), ns);
    roles
        .patch(
            "worker-claims",
            &pp,
            &Patch::Apply(
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": "worker-claims"},
                "rules": [{"apiGroups": ["leasehold.dev"], "resources": ["leasedjobs/status"],
                    "verbs": ["get", "update", "patch"]}]}),
            ),
        )
        .await
        .context("create the workers' Role")?;
    let bindings: Api<RoleBinding> = Api::namespaced(bench.client.clone(), ns);
    bindings
        .patch(
            "worker-claims",
            &pp,
            &Patch::Apply(json!({"apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding", "metadata": {"name": "worker-claims"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "worker-claims"},
                "subjects": [{"kind": "ServiceAccount", "name": "worker", "namespace": ns}]})),
        )
        .await
        .context("create the workers' RoleBinding")?;
    let request: TokenRequest = serde_json::from_value(json!({
        "spec": {"audiences": [leasehold_kube::access::AUDIENCE], "expirationSeconds": 3600}
    }))?;
    let token = sa
        .create_token_request("worker", &PostParams::default(), &request)
        .await
        .context("request the workers' token")?
        .status
        .context("a TokenRequest without status")?
        .token
        .context("a TokenRequest without a token")?;
    let path = bench.logs.join(format!("{ns}-dispatch-token"));
    std::fs::write(&path, token).context("write the token file")?;
    Ok(path)
}

/// Waits until the controller of `ns` advertises its dispatcher there (within 60 s).
pub(crate) async fn wait_for_advert(bench: &Bench, ns: &str) -> anyhow::Result<()> {
    let leases: Api<Lease> = Api::namespaced(bench.client.clone(), ns);
    cluster::wait_until(
        "the dispatcher's advert",
        Duration::from_secs(60),
        || async {
            leases
                .get_opt(leasehold_core::dispatch::ADVERT_LEASE)
                .await
                .ok()
                .flatten()
                .map(|_| ())
        },
    )
    .await
}

async fn one(bench: &Bench, sidecars: usize, jobs: usize) -> anyhow::Result<Fleet> {
    let ns = bench.namespace(&format!("bench-fleet{sidecars}")).await?;
    let queue = "fleet";
    let token = dispatch_token(bench, &ns).await?;
    let mut controller = procs::controller(&bench.leasehold, &bench.kubeconfig, &bench.logs, &ns)?;
    wait_for_advert(bench, &ns).await?;
    let http = procs::sidecar_http();
    let token_arg = token.display().to_string();
    let mut scs = Vec::with_capacity(sidecars);
    for i in 0..sidecars {
        scs.push(procs::sidecar_with(
            &bench.leasehold,
            &bench.kubeconfig,
            &bench.logs,
            (&ns, queue, &format!("sidecar-{i}")),
            &["--dispatch-token-file", &token_arg],
        )?);
    }
    for (i, s) in scs.iter_mut().enumerate() {
        // A free port picked for a sidecar may be taken meanwhile (by one of the many
        // outgoing connections of the others): start that one again on another.
        for retry in 1..=3 {
            match s.ready(&http, Duration::from_secs(300)).await {
                Ok(()) => break,
                Err(e)
                    if retry < 3
                        && std::fs::read_to_string(&s.proc.log)
                            .is_ok_and(|l| l.contains("cannot bind")) =>
                {
                    eprintln!(
                        "row 11: sidecar-{i} could not bind its port; starting it again ({e:#})"
                    );
                    *s = procs::sidecar_with(
                        &bench.leasehold,
                        &bench.kubeconfig,
                        &bench.logs,
                        (&ns, queue, &format!("sidecar-{i}-{retry}")),
                        &["--dispatch-token-file", &token_arg],
                    )?;
                }
                Err(e) => return Err(e),
            }
        }
    }
    // Every sidecar waits in a claim before the window opens.
    let loops = ClaimLoops::start(&http, &scs, jobs);
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
    let api: Api<leasehold_core::crd::LeasedJob> = Api::namespaced(bench.client.clone(), &ns);
    let mut created_at = HashMap::new();
    let every = Duration::from_secs_f64(1.0 / RATE);
    for i in 0..jobs {
        let due = start + every * u32::try_from(i).unwrap_or(u32::MAX);
        tokio::time::sleep_until(tokio::time::Instant::from_std(due)).await;
        let name = format!("f-{i}");
        cluster::create_with_retry(&api, &cluster::job(&name, queue, 60)).await?;
        created_at.insert(name, Instant::now());
    }
    loops.wait(jobs, Duration::from_secs(120)).await?;
    // The last completions' events reach every watcher.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let elapsed = start.elapsed();
    let cpu = cpu.finish();
    let after = metrics::scrape_text(&bench.client).await?;
    let claimed_at = loops.claimed_at();
    let latency_ms = created_at
        .iter()
        .filter_map(|(name, created)| {
            claimed_at
                .get(name)
                .map(|c| c.saturating_duration_since(*created).as_secs_f64() * 1000.0)
        })
        .collect();
    controller.check_running()?;
    let controller_rss_kib = procs::sample(controller.pid()).map_or(0, |x| x.rss_kib);
    let mut sidecar_rss_kib = Vec::with_capacity(sidecars);
    for s in &mut scs {
        s.proc.check_running()?;
        sidecar_rss_kib.push(procs::sample(s.proc.pid()).map_or(0, |x| x.rss_kib));
    }
    drop(scs);
    controller.kill().await;
    Ok(Fleet {
        sidecars,
        jobs,
        sent: WatchSent::parse(&after, "leasedjobs")
            .since(&WatchSent::parse(&before, "leasedjobs")),
        open_watches: metrics::open_watches(&before, "leasedjobs"),
        requests: Requests::parse(&after).since(&Requests::parse(&before)),
        cpu,
        elapsed,
        latency_ms,
        sidecar_rss_kib,
        controller_rss_kib,
    })
}

/// Every sidecar claiming in a loop (`POST /v1/claim?wait=30`) and completing each job at once,
/// until `jobs` jobs were claimed in all; when each job was claimed, by name. The loops are
/// aborted when this is dropped.
pub(crate) struct ClaimLoops {
    claimed_at: Arc<Mutex<HashMap<String, Instant>>>,
    claimed: Arc<AtomicUsize>,
    _abort: procs::AbortOnDrop,
}

impl ClaimLoops {
    /// Starts one loop per sidecar.
    pub(crate) fn start(http: &reqwest::Client, scs: &[procs::Sidecar], jobs: usize) -> ClaimLoops {
        let claimed_at: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let claimed = Arc::new(AtomicUsize::new(0));
        let loops: Vec<_> = scs
            .iter()
            .map(|s| {
                let (http, base) = (http.clone(), s.base.clone());
                let (times, count) = (Arc::clone(&claimed_at), Arc::clone(&claimed));
                let run = async move {
                    while count.load(Ordering::SeqCst) < jobs {
                        let r = http
                            .post(format!("{base}/v1/claim?wait=30"))
                            .send()
                            .await
                            .context("claim")?;
                        let status = r.status();
                        if status == 204 {
                            continue;
                        }
                        anyhow::ensure!(status == 200, "claim answered {status}");
                        let when = Instant::now();
                        let body: Value = r.json().await.context("claim body")?;
                        let name = cluster::text(&body, "name")?;
                        times.lock().unwrap().insert(name.clone(), when);
                        count.fetch_add(1, Ordering::SeqCst);
                        let r = http
                            .post(format!("{base}/v1/jobs/{name}/complete"))
                            .json(&json!({"token": body["token"], "result": {}}))
                            .send()
                            .await
                            .context("complete")?;
                        anyhow::ensure!(
                            r.status().is_success(),
                            "complete answered {}",
                            r.status()
                        );
                    }
                    anyhow::Ok(())
                };
                let claimed = Arc::clone(&claimed);
                tokio::spawn(async move {
                    // After the window the sidecars are stopped under their pending claims.
                    if let Err(e) = run.await {
                        if claimed.load(Ordering::SeqCst) < jobs {
                            eprintln!("a claim loop ended: {e:#}");
                        }
                    }
                })
            })
            .collect();
        ClaimLoops {
            claimed_at,
            claimed,
            _abort: procs::AbortOnDrop(loops),
        }
    }

    /// Waits until `jobs` jobs were claimed in all.
    pub(crate) async fn wait(&self, jobs: usize, timeout: Duration) -> anyhow::Result<()> {
        cluster::wait_until("every job claimed", timeout, || async {
            (self.claimed.load(Ordering::SeqCst) >= jobs).then_some(())
        })
        .await
    }

    /// When each job claimed so far was claimed.
    pub(crate) fn claimed_at(&self) -> HashMap<String, Instant> {
        self.claimed_at.lock().unwrap().clone()
    }
}
