//! Shared harness of the integration tests: a client for the local control plane, a namespace
//! per test, and the real `leasehold` binary run as controller and sidecar processes.
//!
//! The control plane is started by `scripts/test`, which exports LEASEHOLD_TEST_KUBECONFIG (and
//! LEASEHOLD_CONTROLPLANE_BIN, the directory of its kubectl). The tests never read KUBECONFIG,
//! so they never touch whatever cluster the user's kubeconfig points at.
#![allow(dead_code)]

pub mod faults;
pub mod workers;

use std::fs::File;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use leasehold_core::crd::LeasedJob;
use serde_json::{json, Value};

/// Path of the test control plane's kubeconfig.
pub fn kubeconfig_path() -> PathBuf {
    match std::env::var_os("LEASEHOLD_TEST_KUBECONFIG") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "LEASEHOLD_TEST_KUBECONFIG is not set: integration tests run against the local \
             control plane that scripts/test starts; run `scripts/test`"
        ),
    }
}

/// The directory holding the control plane's kubectl.
pub fn kubectl_path() -> PathBuf {
    let dir = std::env::var_os("LEASEHOLD_CONTROLPLANE_BIN")
        .expect("LEASEHOLD_CONTROLPLANE_BIN is not set; run `scripts/test`");
    Path::new(&dir).join("kubectl")
}

/// A client for the test control plane.
pub async fn client() -> Client {
    let kc = Kubeconfig::read_from(kubeconfig_path()).expect("read test kubeconfig");
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("test kubeconfig");
    Client::try_from(config).expect("client")
}

/// Installs the committed CRD (server-side apply; idempotent) and waits until it is Established.
pub async fn install_crd(client: &Client) {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/leasehold/crds/leasedjob.yaml"),
    )
    .expect("charts/leasehold/crds/leasedjob.yaml");
    let crd: CustomResourceDefinition = serde_yaml::from_str(&text).expect("CRD YAML");
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(
        "leasedjobs.leasehold.dev",
        &PatchParams::apply("leasehold-tests").force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("apply CRD");
    wait_for("CRD Established", Duration::from_secs(30), || async {
        let crd = api.get("leasedjobs.leasehold.dev").await.ok()?;
        let established = crd
            .status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        established.then_some(())
    })
    .await;
    // Discovery can lag Established by a moment. Served = a one-item list answers; raw, so
    // that another test's job that no binary can decode (tests/poison.rs) does not read as
    // "not served".
    let jobs: Api<leasehold_kube::watch::Raw<LeasedJob>> = Api::all(client.clone());
    let one = kube::api::ListParams::default().limit(1);
    wait_for("LeasedJob API served", Duration::from_secs(30), || async {
        jobs.list(&one).await.ok().map(|_| ())
    })
    .await;
}

/// A namespace for one test, named after it plus a random suffix; deleted on drop (the
/// namespace controller removes its contents).
pub struct TestNamespace {
    pub name: String,
    client: Client,
}

impl TestNamespace {
    pub async fn new(client: &Client, test: &str) -> TestNamespace {
        install_crd(client).await;
        let suffix: u32 = rand::random();
        let name = format!("{test}-{:08x}", suffix);
        let api: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        api.create(&PostParams::default(), &ns)
            .await
            .expect("create namespace");
        TestNamespace {
            name,
            client: client.clone(),
        }
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        let api: Api<Namespace> = Api::all(self.client.clone());
        let name = self.name.clone();
        // Best effort, without blocking the runtime that is shutting the test down.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = api.delete(&name, &DeleteParams::default()).await;
            });
        }
    }
}

/// Polls `probe` until it returns Some, panicking with `what` after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Creates a LeasedJob from a JSON manifest (namespace filled in).
pub async fn create_job(client: &Client, ns: &str, manifest: Value) -> LeasedJob {
    let api: Api<LeasedJob> = Api::namespaced(client.clone(), ns);
    let mut manifest = manifest;
    manifest["apiVersion"] = json!("leasehold.dev/v1alpha1");
    manifest["kind"] = json!("LeasedJob");
    manifest["metadata"]["namespace"] = json!(ns);
    let job: LeasedJob = serde_json::from_value(manifest).expect("job manifest");
    api.create(&PostParams::default(), &job)
        .await
        .expect("create job")
}

/// Directory for the logs of processes the tests start.
pub fn log_dir() -> PathBuf {
    let dir = std::env::var_os("LEASEHOLD_TEST_LOGS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_TARGET_TMPDIR")).join("logs"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A process the test started; killed on drop.
pub struct Proc {
    pub child: Child,
    pub name: String,
    pub log: PathBuf,
    /// The HTTP port it serves on, when the test chose one.
    pub port: Option<u16>,
}

impl Proc {
    /// Starts `program args` with the test kubeconfig, logging to a file named `name`.
    pub fn spawn(name: &str, program: &Path, args: &[&str], stdout: Stdio) -> Proc {
        Proc::spawn_as(name, program, args, stdout, &kubeconfig_path())
    }

    /// As [`Proc::spawn`], with the credentials of `kubeconfig`. The pod's downward-API
    /// variables of the test runner's own environment are never passed on.
    pub fn spawn_as(
        name: &str,
        program: &Path,
        args: &[&str],
        stdout: Stdio,
        kubeconfig: &Path,
    ) -> Proc {
        let log = log_dir().join(format!("{name}.log"));
        let err = File::create(&log).unwrap();
        let child = Command::new(program)
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env(
                "RUST_LOG",
                // More detail for one run: LEASEHOLD_TEST_RUST_LOG=info,kube_runtime=debug
                std::env::var("LEASEHOLD_TEST_RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        Proc {
            child,
            name: name.to_string(),
            log,
            port: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (STOP, CONT, KILL, TERM) with kill(1).
    pub fn signal(&self, sig: &str) {
        signal(self.pid(), sig);
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        signal(self.pid(), "CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `sig` to `pid` with kill(1).
pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

pub fn leasehold_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_leasehold"))
}

/// Starts `leasehold controller` for one namespace, serving its metrics on a free port
/// (`Proc::port`).
pub fn controller(ns: &str) -> Proc {
    controller_with(ns, "test-controller", &[])
}

/// Starts `leasehold controller` for one namespace with `identity` and extra arguments.
pub fn controller_with(ns: &str, identity: &str, extra: &[&str]) -> Proc {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut args = vec![
        "controller",
        "--namespace",
        ns,
        "--identity",
        identity,
        "--metrics-addr",
        &addr,
    ];
    args.extend_from_slice(extra);
    let mut p = Proc::spawn(
        &format!("{ns}-{identity}"),
        &leasehold_bin(),
        &args,
        Stdio::null(),
    );
    p.port = Some(port);
    p
}

/// GETs `http://127.0.0.1:{port}{path}`: (status, body), or None when nothing answers.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let r = reqwest::get(format!("http://127.0.0.1:{port}{path}"))
        .await
        .ok()?;
    let status = r.status().as_u16();
    Some((status, r.text().await.ok()?))
}

/// The value of the sample `name` (with its labels, exactly as rendered) in a Prometheus text
/// body, if present.
pub fn sample(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// An HTTP client for the sidecar: its pool drops a connection idle for 5 s, under the
/// sidecar's 10 s keep-alive limit (`--header-timeout`), so that no request is sent on a
/// connection the sidecar is closing at that moment (docs/protocol.md, Bounded waits).
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .expect("HTTP client")
}

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The token of a claim's answer (`{"token": ...}`); panics if it has none.
pub fn token_of(claim: &Value) -> String {
    claim["token"]
        .as_str()
        .expect("claim has a token")
        .to_string()
}

/// A running `leasehold sidecar` and an HTTP client for it.
pub struct Sidecar {
    pub proc: Proc,
    pub base: String,
    http: reqwest::Client,
}

impl Sidecar {
    /// Starts a sidecar for `queue` in `ns` with identity `id` and waits until it is ready.
    pub async fn start(ns: &str, queue: &str, id: &str, extra: &[&str]) -> Sidecar {
        Sidecar::start_as(ns, queue, id, extra, &kubeconfig_path()).await
    }

    /// As [`Sidecar::start`], reaching the API server with `kubeconfig`.
    pub async fn start_as(
        ns: &str,
        queue: &str,
        id: &str,
        extra: &[&str],
        kubeconfig: &Path,
    ) -> Sidecar {
        let port = free_port();
        let ready_within = Duration::from_secs(30);
        Sidecar::start_at(ns, queue, id, port, kubeconfig, extra, ready_within).await
    }

    /// POSTs a raw body; returns the status and the JSON body (Null when empty).
    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .body(body)
            .send()
            .await
            .expect("sidecar reachable");
        let status = r.status().as_u16();
        let bytes = r.bytes().await.unwrap();
        let value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| json!({"raw": String::from_utf8_lossy(&bytes)}))
        };
        (status, value)
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.post_raw(path, serde_json::to_vec(&body).unwrap())
            .await
    }

    /// Claims (waiting up to `wait` s), asserting it answers 200; returns the claim's answer
    /// and its token.
    pub async fn claim_ok(&self, wait: u64) -> (Value, String) {
        let (status, claimed) = self.claim(wait).await;
        assert_eq!(status, 200, "{claimed}");
        let token = token_of(&claimed);
        (claimed, token)
    }

    /// Claims a job, as [`Sidecar::claim_ok`], then heartbeats once, as a worker does before
    /// its first expensive call: the attempt's first renewal writes its Lease.
    pub async fn claim_leased(&self, wait: u64) -> (Value, String) {
        let (claimed, token) = self.claim_ok(wait).await;
        let name = claimed["name"].as_str().expect("claimed name");
        let (s, r) = self.heartbeat(name, json!({"token": token})).await;
        assert_eq!(s, 200, "the first heartbeat of {name}: {r}");
        (claimed, token)
    }

    pub async fn claim(&self, wait: u64) -> (u16, Value) {
        self.post(&format!("/v1/claim?wait={wait}"), json!(null))
            .await
    }

    pub async fn heartbeat(&self, name: &str, body: Value) -> (u16, Value) {
        self.post(&format!("/v1/jobs/{name}/heartbeat"), body).await
    }

    pub async fn complete(&self, name: &str, token: &str, result: Value) -> (u16, Value) {
        self.post(
            &format!("/v1/jobs/{name}/complete"),
            json!({"token": token, "result": result}),
        )
        .await
    }
}

/// Runs `program args` with the admin kubeconfig, feeding `stdin`; returns success and the
/// combined output.
pub fn run(program: &Path, args: &[&str], stdin: &str, env: &[(&str, &Path)]) -> (bool, String) {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("KUBECONFIG", kubeconfig_path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// kubectl with the admin kubeconfig.
pub fn kubectl(args: &[&str], stdin: &str) -> (bool, String) {
    run(&kubectl_path(), args, stdin, &[])
}

/// Restarts the test control plane's kube-apiserver for real (tests/controlplane/
/// restart-apiserver.sh): stopped with `signal`, left down for `downtime`, started again with
/// the same flags, and ready when this returns. Every test sharing the control plane sees it.
pub fn restart_apiserver(signal: &str, downtime: Duration) {
    let state = std::env::var_os("LEASEHOLD_CONTROLPLANE_STATE")
        .expect("LEASEHOLD_CONTROLPLANE_STATE is not set; run `scripts/test`");
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/controlplane/restart-apiserver.sh");
    let status = Command::new("bash")
        .arg(script)
        .arg(&state)
        .arg(signal)
        .env("LEASEHOLD_RESTART_DOWNTIME", downtime.as_secs().to_string())
        .stdout(Stdio::null())
        .status()
        .expect("restart-apiserver.sh");
    assert!(status.success(), "restarting kube-apiserver failed");
}
