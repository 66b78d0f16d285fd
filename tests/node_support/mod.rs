//! Helpers of the node tests: the node that `tests/node/start.sh` started, a release of the
//! chart installed on it (with the images under test), and containers' logs followed through
//! a pod's end.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::ListParams;
use kube::{Api, Client};
use leasehold_core::crd::{LeasedJob, Phase};
use serde_json::json;

use crate::chart_support::{chart_dir, helm_ok, Release};
use leasehold_testkit::*;

/// The node `tests/node/start.sh` started (its state directory, from scripts/test).
pub struct Node {
    pub state: PathBuf,
}

impl Node {
    pub fn get() -> Node {
        let state = std::env::var_os("LEASEHOLD_NODE_STATE").unwrap_or_else(|| {
            panic!(
                "LEASEHOLD_NODE_STATE is not set: the node tests run under `scripts/test --test \
                 node`, which starts the node (tests/node/start.sh) as root"
            )
        });
        Node {
            state: PathBuf::from(state),
        }
    }

    /// A value of the node's env file (written by start.sh), e.g. `LEASEHOLD_NODE_REGISTRY`.
    pub fn env(&self, key: &str) -> String {
        let file = self.state.join("env");
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let prefix = format!("{key}=");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no {key} in {}", file.display()))
            .to_string()
    }

    /// The node's registry: `host:port` on loopback, plain HTTP, which containerd pulls from.
    pub fn registry(&self) -> Registry {
        Registry {
            host: self.env("LEASEHOLD_NODE_REGISTRY"),
        }
    }

    /// The names of the images containerd holds for the kubelet (`ctr -n k8s.io images ls`),
    /// digests aside.
    pub fn images(&self) -> Vec<String> {
        let ctr = PathBuf::from(self.env("LEASEHOLD_NODE_BIN")).join("ctr");
        let socket = self.env("LEASEHOLD_NODE_SOCKET");
        let (ok, out) = run(
            &ctr,
            &["--address", &socket, "-n", "k8s.io", "images", "ls", "-q"],
            "",
            &[],
        );
        assert!(ok, "ctr images ls: {out}");
        out.lines()
            .filter(|l| !l.starts_with("sha256:"))
            .map(str::to_string)
            .collect()
    }

    /// The projected service-account token the kubelet mounted into `pod` (its
    /// `kube-api-access-*` volume), read from the kubelet's root directory.
    pub fn projected_token(&self, pod: &Pod) -> String {
        let uid = pod.metadata.uid.as_deref().unwrap();
        let dir = self
            .state
            .join("kubelet/pods")
            .join(uid)
            .join("volumes/kubernetes.io~projected");
        let vol = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("kube-api-access-")
            })
            .expect("a kube-api-access volume");
        std::fs::read_to_string(vol.join("token")).unwrap()
    }
}

/// The images under test, as scripts/test pushed them to the node's registry (the kubelet
/// pulls them from there).
pub fn image_sets() -> Vec<String> {
    let image = std::env::var("LEASEHOLD_NODE_IMAGE").expect("LEASEHOLD_NODE_IMAGE (scripts/test)");
    let worker = std::env::var("LEASEHOLD_NODE_WORKER_IMAGE")
        .expect("LEASEHOLD_NODE_WORKER_IMAGE (scripts/test)");
    let (repo, tag) = image.rsplit_once(':').unwrap();
    let (worker_repo, worker_tag) = worker.rsplit_once(':').unwrap();
    vec![
        format!("image.repository={repo}"),
        format!("image.tag={tag}"),
        "image.pullPolicy=IfNotPresent".into(),
        "exampleWorker.enabled=true".into(),
        format!("exampleWorker.image.repository={worker_repo}"),
        format!("exampleWorker.image.tag={worker_tag}"),
        "exampleWorker.image.pullPolicy=IfNotPresent".into(),
    ]
}

/// The node's OCI registry (start.sh): pushed to as a release pushes its image and chart.
pub struct Registry {
    /// `127.0.0.1:PORT`.
    pub host: String,
}

impl Registry {
    /// Pushes the local image `local` (in podman's storage) as `HOST/repository:tag`; returns
    /// that reference.
    pub fn push_image(&self, local: &str, repository: &str, tag: &str) -> String {
        let reference = format!("{}/{repository}:{tag}", self.host);
        let conf = repo_path("scripts/containers.conf");
        let (ok, out) = run(
            Path::new("podman"),
            &[
                "push",
                "--quiet",
                "--tls-verify=false",
                local,
                &format!("docker://{reference}"),
            ],
            "",
            &[("CONTAINERS_CONF", &conf)],
        );
        assert!(ok, "podman push {local} {reference}: {out}");
        reference
    }

    /// Packages the chart with its `version` and `appVersion` set to `version` (the chart
    /// as it is when that is its own version) and pushes it with `helm push` to
    /// `oci://HOST/charts`; returns helm's arguments for installing it from there.
    pub fn push_chart(&self, version: &str) -> Vec<String> {
        let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "registry-chart-{}-{version}",
            self.host.replace(':', "-")
        ));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).unwrap();
        let chart = if chart_version() == version {
            chart_dir()
        } else {
            let copy = work.join("leasehold");
            copy_dir(&chart_dir(), &copy);
            let meta = std::fs::read_to_string(copy.join("Chart.yaml")).unwrap();
            let meta: Vec<String> = meta
                .lines()
                .map(|l| {
                    if l.starts_with("version:") {
                        format!("version: {version}")
                    } else if l.starts_with("appVersion:") {
                        format!("appVersion: \"{version}\"")
                    } else {
                        l.to_string()
                    }
                })
                .collect();
            std::fs::write(copy.join("Chart.yaml"), meta.join("\n") + "\n").unwrap();
            copy
        };
        let out = work.to_str().unwrap();
        helm_ok(&["package", chart.to_str().unwrap(), "-d", out]);
        let package = work.join(format!("leasehold-{version}.tgz"));
        let target = format!("oci://{}/charts", self.host);
        helm_ok(&["push", package.to_str().unwrap(), &target, "--plain-http"]);
        vec![
            format!("{target}/leasehold"),
            "--version".into(),
            version.into(),
            "--plain-http".into(),
        ]
    }
}

/// The chart's own version (Chart.yaml).
pub fn chart_version() -> String {
    let meta: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(chart_dir().join("Chart.yaml")).unwrap())
            .unwrap();
    meta["version"].as_str().unwrap().to_string()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), &dest).unwrap();
        }
    }
}

/// A release of the chart on the node: its namespace, a worker namespace, both controller
/// replicas and `workers` example workers Ready.
pub struct Install {
    pub client: Client,
    pub release: Release,
    pub workers: TestNamespace,
    // Dropped after the release (fields drop in order).
    _ns: TestNamespace,
}

impl Install {
    pub async fn new(test: &str, workers: u32, extra: &[&str]) -> Install {
        let chart = chart_dir();
        Install::from_chart(
            test,
            workers,
            &[chart.to_str().unwrap()],
            image_sets(),
            extra,
        )
        .await
    }

    /// [`Install::new`] of the chart that `chart` names (helm's arguments for it, as
    /// [`Registry::push_chart`] returns them), with `images` (`--set`s) for its images.
    pub async fn from_chart(
        test: &str,
        workers: u32,
        chart: &[&str],
        images: Vec<String>,
        extra: &[&str],
    ) -> Install {
        let client = client().await;
        let ns = TestNamespace::new(&client, test).await;
        let w = TestNamespace::new(&client, &format!("{test}-w")).await;
        let mut sets = images;
        sets.push(format!("workers.namespaces={{{}}}", w.name));
        sets.push(format!("exampleWorker.replicas={workers}"));
        // The controller pods serve the size webhook; the API server reaches them by their
        // pod IPs. Scoped to this test's worker namespace.
        sets.push("admissionWebhook.enabled=true".into());
        // The example worker is a plain Deployment with the annotation leasehold.dev/queue:
        // the controllers' webhook injects its sidecar.
        sets.push("sidecar.injection.enabled=true".into());
        // `helm upgrade` runs the CRD upgrade Job on the node.
        sets.push("crds.upgradeJob.enabled=true".into());
        sets.push(format!(
            "admissionWebhook.namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name={}",
            w.name
        ));
        sets.extend(extra.iter().map(|s| s.to_string()));
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let release = Release::install_from(test, &ns.name, chart, &sets);
        let install = Install {
            client,
            release,
            workers: w,
            _ns: ns,
        };
        install
            .wait_ready(
                &install.controller_deployment(),
                &install.release.namespace,
                2,
            )
            .await;
        install
            .wait_ready(&install.worker_deployment(), &install.workers.name, workers)
            .await;
        // The worker pods made before the webhook existed (Helm creates it after the
        // Deployment) are evicted by the leading controller and made again, injected: wait
        // for those, all ready.
        wait_for(
            "every example worker pod injected and ready",
            Duration::from_secs(180),
            || async {
                let pods = install.pods(&install.workers.name, "example-worker").await;
                let injected = pods.iter().all(|p| {
                    let annotated =
                        p.metadata.annotations.as_ref().is_some_and(|a| {
                            a.contains_key(leasehold::inject::INJECTED_ANNOTATION)
                        });
                    let ready = p
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| {
                            c.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        });
                    annotated && ready
                });
                (pods.len() == workers as usize && injected).then_some(())
            },
        )
        .await;
        install
    }

    pub fn controller_deployment(&self) -> String {
        format!("{}-controller", self.release.fullname())
    }

    pub fn worker_deployment(&self) -> String {
        format!("{}-example-worker", self.release.fullname())
    }

    /// Waits until Deployment `name` has `n` ready replicas of its current revision.
    pub async fn wait_ready(&self, name: &str, ns: &str, n: u32) {
        let api: Api<Deployment> = Api::namespaced(self.client.clone(), ns);
        let start = Instant::now();
        loop {
            let d = api.get(name).await.unwrap();
            let s = d.status.clone().unwrap_or_default();
            if s.ready_replicas.unwrap_or(0) == n as i32
                && s.updated_replicas.unwrap_or(0) == n as i32
                && s.replicas.unwrap_or(0) == n as i32
            {
                return;
            }
            if start.elapsed() > Duration::from_secs(180) {
                let (_, pods) = kubectl(&["get", "pods", "-n", ns, "-o", "wide"], "");
                let (_, events) = kubectl(&["get", "events", "-n", ns], "");
                panic!(
                    "Deployment {ns}/{name} has not {n} ready replicas: {s:?}\n{pods}\n{events}\n{}",
                    self.pod_logs(ns)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The logs of every container of every pod in `ns`, from the node's podLogsDir.
    pub fn pod_logs(&self, ns: &str) -> String {
        let dir = Node::get().state.join("pod-logs");
        let mut out = String::new();
        for pod in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if !pod
                .file_name()
                .to_string_lossy()
                .starts_with(&format!("{ns}_"))
            {
                continue;
            }
            for c in std::fs::read_dir(pod.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                for f in std::fs::read_dir(c.path()).into_iter().flatten().flatten() {
                    let text = std::fs::read_to_string(f.path()).unwrap_or_default();
                    let tail: Vec<&str> = text.lines().rev().take(30).collect();
                    out.push_str(&format!(
                        "--- {}:\n{}\n",
                        f.path().display(),
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    ));
                }
            }
        }
        out
    }

    /// The running pods of the Deployment `component` (controller or example-worker).
    pub async fn pods(&self, ns: &str, component: &str) -> Vec<Pod> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let lp = ListParams::default().labels(&format!(
            "app.kubernetes.io/instance={},app.kubernetes.io/component={component}",
            self.release.name
        ));
        api.list(&lp)
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect()
    }

    pub fn jobs(&self) -> Api<LeasedJob> {
        Api::namespaced(self.client.clone(), &self.workers.name)
    }

    /// The pod of the controllers' leader: the leader-election Lease's annotation
    /// `leasehold.dev/holder-pod` while the Lease is held (its holderIdentity is the term's
    /// token, not a pod name).
    pub async fn leader(&self) -> Option<String> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.release.namespace);
        let lease = leases.get_opt("leasehold-controller").await.unwrap()?;
        lease.spec?.holder_identity.filter(|h| !h.is_empty())?;
        lease
            .metadata
            .annotations?
            .get("leasehold.dev/holder-pod")
            .cloned()
    }

    /// Waits until every job named in `names` has ended Succeeded; returns them.
    pub async fn wait_succeeded(&self, names: &[&str], within: Duration) -> Vec<LeasedJob> {
        let jobs = self.jobs();
        let start = Instant::now();
        loop {
            let mut done = vec![];
            for n in names {
                let j = jobs.get(n).await.unwrap();
                let phase = j.status.as_ref().and_then(|s| s.phase);
                assert!(
                    !matches!(phase, Some(Phase::Failed) | Some(Phase::Cancelled)),
                    "job {n} ended {phase:?}: {:?}",
                    j.status
                );
                if phase == Some(Phase::Succeeded) {
                    done.push(j);
                }
            }
            if done.len() == names.len() {
                return done;
            }
            if start.elapsed() > within {
                let (_, table) = kubectl(&["get", "ljob", "-n", &self.workers.name], "");
                panic!(
                    "jobs not all Succeeded within {within:?}:\n{table}\n{}",
                    self.pod_logs(&self.workers.name)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Creates a slow job on the example worker's queue: SHA-256 of GPL-3 in 1 KiB chunks,
    /// `delay` seconds each (about 35 chunks), so that it is in progress when a pod goes.
    pub async fn slow_job(&self, name: &str, delay: f64) {
        create_job(
            &self.client,
            &self.workers.name,
            json!({"metadata": {"name": name}, "spec": {"queue": "demo", "leaseDurationSeconds": 10,
                "payload": {"task": "sha256", "file": "/usr/share/common-licenses/GPL-3",
                    "chunkBytes": 1024, "chunkDelaySeconds": delay}}}),
        )
        .await;
    }

    /// Waits until job `name` is Leased, then 3 s more, so that its worker is some chunks
    /// into it (checkpoints travel with heartbeats, which renew the job's Lease, not the job);
    /// returns its holder, which must still hold it then.
    pub async fn wait_in_progress(&self, name: &str) -> String {
        let jobs = self.jobs();
        let leased = || async {
            let s = jobs.get(name).await.ok()?.status?;
            (s.phase == Some(Phase::Leased)).then_some(s.holder?)
        };
        let holder = wait_for(
            &format!("job {name} Leased"),
            Duration::from_secs(60),
            leased,
        )
        .await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let still = leased().await;
        assert_eq!(
            still.as_deref(),
            Some(holder.as_str()),
            "job {name} is no longer held by {holder} 3 s after its claim"
        );
        holder
    }
}

/// `kubectl logs -f --timestamps` of one container, read on a thread until the container ends.
pub struct LogFollower {
    child: std::process::Child,
    reader: std::thread::JoinHandle<Vec<(Timestamp, String)>>,
}

impl LogFollower {
    pub fn start(ns: &str, pod: &str, container: &str) -> LogFollower {
        use std::io::BufRead;
        let mut child = std::process::Command::new(kubectl_path())
            .args(["logs", "-f", "--timestamps", "-n", ns, pod, "-c", container])
            .env("KUBECONFIG", kubeconfig_path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("kubectl logs -f");
        let out = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            std::io::BufReader::new(out)
                .lines()
                .map_while(Result::ok)
                .filter_map(|l| {
                    let (ts, rest) = l.split_once(' ')?;
                    Some((ts.parse().ok()?, rest.to_string()))
                })
                .collect()
        });
        LogFollower { child, reader }
    }

    /// Waits (up to 30 s) for the stream to end with the container; its lines.
    pub fn finish(mut self) -> Vec<(Timestamp, String)> {
        for _ in 0..300 {
            if self.reader.is_finished() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reader.join().unwrap()
    }
}

pub fn repo_path(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(p)
}
