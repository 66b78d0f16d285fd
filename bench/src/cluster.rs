//! The cluster the benchmark runs against, and helpers shared by its phases: clients,
//! namespaces, the CRD, job creation, and a watch that timestamps what it sees.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context as _};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Config, ResourceExt};
use leasehold_core::crd::{LeasedJob, LeasedJobSpec, Phase};
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Pids of the control plane's processes, when known.
#[derive(Clone, Debug, Default)]
pub struct ControlPlane {
    /// kube-apiserver.
    pub apiserver: Option<u32>,
    /// etcd.
    pub etcd: Option<u32>,
    /// kube-controller-manager.
    pub kcm: Option<u32>,
}

impl ControlPlane {
    /// Reads the `env` file that tests/controlplane/start.sh writes (KEY=VALUE lines).
    pub fn from_env_file(path: &Path) -> ControlPlane {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let get = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
                .and_then(|v| v.trim().parse().ok())
        };
        ControlPlane {
            apiserver: get("KUBE_APISERVER_PID"),
            etcd: get("ETCD_PID"),
            kcm: get("KUBE_CONTROLLER_MANAGER_PID"),
        }
    }

    /// (name, pids) groups for CPU accounting, for those known.
    pub fn groups(&self) -> Vec<(String, Vec<u32>)> {
        [
            ("kube-apiserver", self.apiserver),
            ("etcd", self.etcd),
            ("kube-controller-manager", self.kcm),
        ]
        .into_iter()
        .filter_map(|(n, p)| Some((n.to_string(), vec![p?])))
        .collect()
    }
}

/// Everything a phase needs.
pub struct Bench {
    /// The kubeconfig every client and process uses.
    pub kubeconfig: PathBuf,
    config: Config,
    /// An admin client for set-up, checks and metrics.
    pub client: Client,
    /// The `leasehold` binary.
    pub leasehold: PathBuf,
    /// Where the processes' logs go.
    pub logs: PathBuf,
    /// The control plane's pids, when known.
    pub controlplane: ControlPlane,
    /// Suffix that makes this run's namespaces unique.
    pub run_id: String,
    namespaces: Mutex<Vec<String>>,
}

impl Bench {
    /// Connects with `kubeconfig`; refuses any API server not on this machine's loopback.
    pub async fn connect(
        kubeconfig: PathBuf,
        leasehold: PathBuf,
        logs: PathBuf,
        controlplane: ControlPlane,
    ) -> anyhow::Result<Bench> {
        let kc = Kubeconfig::read_from(&kubeconfig)
            .with_context(|| format!("read kubeconfig {}", kubeconfig.display()))?;
        let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .context("kubeconfig")?;
        let host = config.cluster_url.host().unwrap_or_default().to_string();
        let loopback = host == "localhost"
            || host
                .trim_matches(['[', ']'])
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        if !loopback {
            bail!(
                "the kubeconfig points at {}: the benchmark floods the API server with writes \
                 and only runs against a local control plane on loopback",
                config.cluster_url
            );
        }
        let client = leasehold_kube::api::client(config.clone()).context("client")?;
        let run_id = format!("{:06x}", rand::random::<u32>() & 0xff_ffff);
        Ok(Bench {
            kubeconfig,
            config,
            client,
            leasehold,
            logs,
            controlplane,
            run_id,
            namespaces: Mutex::default(),
        })
    }

    /// A new client with its own connection pool, as a separate process would have, built as
    /// the controller and the sidecar build theirs ([`leasehold_kube::api::client`]).
    pub fn new_client(&self) -> anyhow::Result<Client> {
        leasehold_kube::api::client(self.config.clone()).context("client")
    }

    /// The API server's version, e.g. `v1.37.2`.
    pub async fn version(&self) -> String {
        match self.client.apiserver_version().await {
            Ok(v) => v.git_version,
            Err(e) => format!("unknown ({e})"),
        }
    }

    /// Installs the LeasedJob CRD (server-side apply) and waits until it is served and
    /// kube-controller-manager watches it.
    pub async fn install_crd(&self) -> anyhow::Result<()> {
        let api: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        // Both, as the chart installs them: sidecars and the controller then follow
        // LeasedQueues (row 2k sets limits with one) rather than logging that the API is not
        // served.
        for crd in [
            leasehold_core::crd::definition(),
            leasehold_core::definition::queue_definition(),
        ] {
            let name = crd.metadata.name.clone().unwrap_or_default();
            api.patch(
                &name,
                &PatchParams::apply("leasehold-bench").force(),
                &Patch::Apply(&crd),
            )
            .await
            .with_context(|| format!("apply the CustomResourceDefinition {name}"))?;
        }
        // Served = a one-item list answers; raw, so that a job no binary can decode (or
        // thousands of jobs) left on a reused control plane does not read as "not served".
        let jobs: Api<leasehold_kube::watch::Raw<LeasedJob>> = Api::all(self.client.clone());
        let one = kube::api::ListParams::default().limit(1);
        let queues: Api<leasehold_core::queue::LeasedQueue> = Api::all(self.client.clone());
        wait_until(
            "the LeasedJob and LeasedQueue APIs to be served",
            Duration::from_secs(60),
            || async {
                jobs.list(&one).await.ok()?;
                queues.list(&one).await.ok().map(|_| ())
            },
        )
        .await?;
        // kube-controller-manager (its garbage collector and quota monitors) finds a new
        // resource at its next discovery, up to 30 s later, and then watches it: 4 more events
        // per job. A window opened before that counts them for part of its jobs only (row 11
        // once read 7.6 events per job at 8 sidecars against 10.0 at 500 for that reason).
        // Nothing of leasehold runs yet, so any open watch of LeasedJobs is its.
        wait_until(
            "kube-controller-manager to watch LeasedJobs",
            Duration::from_secs(90),
            || async {
                let text = crate::metrics::scrape_text(&self.client).await.ok()?;
                (crate::metrics::open_watches(&text, "leasedjobs") >= 1.0).then_some(())
            },
        )
        .await
    }

    /// Creates a namespace `prefix-RUNID` (deleted by [`Bench::cleanup`]).
    pub async fn namespace(&self, prefix: &str) -> anyhow::Result<String> {
        let name = format!("{prefix}-{}", self.run_id);
        let api: Api<Namespace> = Api::all(self.client.clone());
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        api.create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("create namespace {name}"))?;
        self.namespaces.lock().unwrap().push(name.clone());
        Ok(name)
    }

    /// Waits for the namespace's `default` ServiceAccount, which Pods need.
    pub async fn wait_default_service_account(&self, ns: &str) -> anyhow::Result<()> {
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), ns);
        wait_until(
            "the default ServiceAccount",
            Duration::from_secs(60),
            || async { api.get_opt("default").await.ok().flatten().map(|_| ()) },
        )
        .await
    }

    /// Deletes this run's namespaces, without waiting.
    pub async fn cleanup(&self) {
        let api: Api<Namespace> = Api::all(self.client.clone());
        let names = std::mem::take(&mut *self.namespaces.lock().unwrap());
        for name in names {
            let _ = api.delete(&name, &DeleteParams::background()).await;
        }
    }

    /// Creates LeasedJobs `prefix-0..n` in `ns`, `concurrency` at a time.
    pub async fn create_jobs(
        &self,
        ns: &str,
        queue: &str,
        prefix: &str,
        n: usize,
        lease_seconds: i32,
        concurrency: usize,
    ) -> anyhow::Result<()> {
        let api: Api<LeasedJob> = Api::namespaced(self.client.clone(), ns);
        create_range(&api, queue, prefix, 0..n, lease_seconds, concurrency).await
    }
}

/// Creates jobs `PREFIX-i` for every i in `range` on `queue`, `concurrency` at a time.
pub async fn create_range(
    api: &Api<LeasedJob>,
    queue: &str,
    prefix: &str,
    range: std::ops::Range<usize>,
    lease_seconds: i32,
    concurrency: usize,
) -> anyhow::Result<()> {
    futures::stream::iter(range)
        .map(|i| {
            let api = api.clone();
            async move {
                let job = job(&format!("{prefix}-{i}"), queue, lease_seconds);
                create_with_retry(&api, &job).await
            }
        })
        .buffer_unordered(concurrency.max(1))
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Creates `job`, retrying a few times on server-side throttling or faults.
pub async fn create_with_retry(api: &Api<LeasedJob>, job: &LeasedJob) -> anyhow::Result<()> {
    let mut tries = 0;
    loop {
        match api.create(&PostParams::default(), job).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => return Ok(()),
            Err(e) if tries < 5 => {
                tries += 1;
                tracing::debug!(error = %e, "create failed; retrying");
                tokio::time::sleep(Duration::from_millis(200 * tries)).await;
            }
            Err(e) => {
                return Err(e).with_context(|| format!("create LeasedJob {}", job.name_any()))
            }
        }
    }
}

/// A LeasedJob for the benchmark: a small payload, as a real job's pointer to its input.
pub fn job(name: &str, queue: &str, lease_seconds: i32) -> LeasedJob {
    LeasedJob::new(
        name,
        LeasedJobSpec {
            queue: queue.into(),
            payload: serde_json::json!({"input": format!("s3://bench/{name}.wav"), "lang": "ko"}),
            lease_duration_seconds: Some(lease_seconds),
            ..Default::default()
        },
    )
}

/// Polls `probe` every 50 ms until it gives Some.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = probe().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// When the watch first saw a job in a state.
#[derive(Clone, Copy, Debug)]
pub struct Seen {
    /// On the monotonic clock.
    pub at: Instant,
    /// On the wall clock (to compare with timestamps the API server stores).
    pub wall: SystemTime,
}

/// First sightings by (job name, attempt, status.phase).
type SeenMap = Arc<Mutex<HashMap<(String, i32, Option<&'static str>), Seen>>>;

/// A watch of a namespace's LeasedJobs that records when each job was first seen in each
/// (attempt, phase).
pub struct JobWatch {
    store: Store<LeasedJob>,
    changes: watch::Receiver<u64>,
    seen: SeenMap,
    task: JoinHandle<()>,
}

impl JobWatch {
    /// Starts watching `ns` and waits for the initial list.
    pub async fn start(client: Client, ns: &str) -> anyhow::Result<JobWatch> {
        let api: Api<LeasedJob> = Api::namespaced(client, ns);
        let (store, writer) = reflector::store();
        let (tx, changes) = watch::channel(0u64);
        let seen: SeenMap = Arc::default();
        let record = Arc::clone(&seen);
        let stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .reflect(writer)
            .applied_objects();
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                if let Ok(job) = event {
                    let now = Seen {
                        at: Instant::now(),
                        wall: SystemTime::now(),
                    };
                    record
                        .lock()
                        .unwrap()
                        .entry((
                            job.name_any(),
                            job.attempt(),
                            status_phase(&job).map(Phase::as_str),
                        ))
                        .or_insert(now);
                }
                tx.send_modify(|n| *n = n.wrapping_add(1));
            }
        });
        let w = JobWatch {
            store,
            changes,
            seen,
            task,
        };
        tokio::time::timeout(Duration::from_secs(60), w.store.wait_until_ready())
            .await
            .context("LeasedJob watch did not sync")??;
        Ok(w)
    }

    /// When `name` was first seen at (attempt, status.phase); `None` is a job without status.
    pub fn seen(&self, name: &str, attempt: i32, phase: Option<Phase>) -> Option<Seen> {
        self.seen
            .lock()
            .unwrap()
            .get(&(name.to_string(), attempt, phase.map(Phase::as_str)))
            .copied()
    }

    /// Waits until `done(jobs)` holds for the cached jobs.
    pub async fn wait(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[Arc<LeasedJob>]) -> bool,
    ) -> anyhow::Result<()> {
        let mut changes = self.changes.clone();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            changes.borrow_and_update();
            let jobs = self.store.state();
            if done(&jobs) {
                return Ok(());
            }
            // A large cache is scanned at most a few times a second, not once per event.
            if jobs.len() > LARGE_CACHE {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            tokio::select! {
                r = changes.changed() => r.context("LeasedJob watch ended")?,
                () = tokio::time::sleep_until(deadline) => bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
    }

    /// Waits until `n` jobs are in `phase` (status written by the controller, not just defaulted).
    pub async fn wait_phase(
        &self,
        n: usize,
        phase: Phase,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        self.wait(&format!("{n} LeasedJobs {phase}"), timeout, |jobs| {
            jobs.iter()
                .filter(|j| status_phase(j) == Some(phase))
                .count()
                >= n
        })
        .await
    }
}

impl Drop for JobWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Above this many cached jobs, [`JobWatch::wait`] checks its condition at most five times a
/// second (a check scans every job).
const LARGE_CACHE: usize = 5000;

/// status.phase as written (None before the controller initialised the job).
pub fn status_phase(job: &LeasedJob) -> Option<Phase> {
    job.status.as_ref().and_then(|s| s.phase)
}

/// A JSON body's string field.
pub fn text(v: &Value, field: &str) -> anyhow::Result<String> {
    v[field]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("no {field} in {v}"))
}
