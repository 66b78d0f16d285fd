//! What leasehold's integration tests (tests/*.rs) and its benchmark (bench/) share: a client
//! for the local control plane and a namespace per test ([`Fixture`], [`TestNamespace`]), the
//! real `leasehold` binary run as controller and sidecar processes ([`Proc`], [`Sidecar`]),
//! the command lines of those two roles ([`ControllerArgs`], [`SidecarArgs`]), fault
//! injection ([`faults`]), the example Python worker ([`workers`]), and the repository's
//! files and YAML ([`repo`], [`documents`]).
//!
//! The control plane is started by `scripts/test`, which exports LEASEHOLD_TEST_KUBECONFIG (and
//! LEASEHOLD_CONTROLPLANE_BIN, the directory of its kubectl). The tests never read KUBECONFIG,
//! so they never touch whatever cluster the user's kubeconfig points at. Without
//! LEASEHOLD_TEST_KUBECONFIG (a plain `cargo test`) the tests that need the control plane
//! return at once ([`fixture!`], [`require_control_plane!`]) and one line per test binary says
//! how to run them.

mod args;
pub mod dispatcher;
pub mod faults;
pub mod peaks;
mod process;
mod sidecar;
pub mod workers;

pub use args::{ControllerArgs, SidecarArgs};
pub use process::{leasehold_bin, log_dir, signal, target_tmpdir, Proc};
pub use sidecar::{controller, controller_with, Sidecar};

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use leasehold_core::crd::LeasedJob;
use serde_json::{json, Value};

/// The environment variable through which `scripts/test` hands the tests its control plane.
pub const KUBECONFIG_VAR: &str = "LEASEHOLD_TEST_KUBECONFIG";

/// True when a control plane is configured (LEASEHOLD_TEST_KUBECONFIG is set, as `scripts/test`
/// does). When it is not, says once per test binary, on stderr (past the test harness's
/// capture), that the tests needing it are skipped and how to run them.
pub fn control_plane_configured() -> bool {
    static NOTICE: Once = Once::new();
    if std::env::var_os(KUBECONFIG_VAR).is_some() {
        return true;
    }
    NOTICE.call_once(|| {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED the integration tests of this binary: {KUBECONFIG_VAR} is unset; they run \
             against a local control plane that `scripts/test` starts (e.g. `scripts/test \
             --test fencing`)"
        );
    });
    false
}

/// Returns from the calling test when no control plane is configured (see
/// [`control_plane_configured`]); does nothing when one is, so a test under `scripts/test` never
/// skips.
#[macro_export]
macro_rules! require_control_plane {
    () => {
        if !$crate::control_plane_configured() {
            return;
        }
    };
}

/// `fixture!("name")`: the test's [`Fixture`] (a client and a fresh namespace named after
/// `name`), or a return from the calling test when no control plane is configured.
#[macro_export]
macro_rules! fixture {
    ($test:expr) => {
        match $crate::Fixture::try_new($test).await {
            Some(fixture) => fixture,
            None => return,
        }
    };
}

/// What an integration test starts with: a client for the test control plane and a fresh
/// namespace of its own, deleted when it drops. Made by [`fixture!`], which skips the test
/// without a control plane; destructure it to name the parts:
/// `let Fixture { client, ns } = fixture!("fencing");`.
pub struct Fixture {
    /// An admin client for the test control plane.
    pub client: Client,
    /// The test's namespace.
    pub ns: TestNamespace,
}

impl Fixture {
    /// A client and a namespace named after `test` (the CRD installed); None when no control
    /// plane is configured.
    pub async fn try_new(test: &str) -> Option<Fixture> {
        if !control_plane_configured() {
            return None;
        }
        Some(Fixture::new(test).await)
    }

    /// As [`Fixture::try_new`], panicking when no control plane is configured.
    pub async fn new(test: &str) -> Fixture {
        let client = client().await;
        let ns = TestNamespace::new(&client, test).await;
        Fixture { client, ns }
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.ns.name
    }

    /// The LeasedJobs of the namespace.
    pub fn jobs(&self) -> Api<LeasedJob> {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }

    /// Starts a controller for the namespace ([`controller`]).
    pub fn controller(&self) -> Proc {
        controller(&self.ns.name)
    }

    /// Starts a sidecar for `queue` in the namespace as `id`, ready when this returns
    /// ([`Sidecar::start`]).
    pub async fn sidecar(&self, queue: &str, id: &str, extra: &[&str]) -> Sidecar {
        Sidecar::start(&self.ns.name, queue, id, extra).await
    }
}

/// The root of the repository (the workspace), for its committed files.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The text of the repository's file at `path` (relative to its root).
pub fn repo(path: &str) -> String {
    std::fs::read_to_string(repo_root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Parses a multi-document YAML stream into JSON values (skipping empty documents).
pub fn documents(yaml: &str) -> Vec<Value> {
    use serde::Deserialize;
    serde_yaml::Deserializer::from_str(yaml)
        .filter_map(|d| {
            let v = Value::deserialize(d).expect("rendered YAML");
            (!v.is_null()).then_some(v)
        })
        .collect()
}

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

/// The committed CRDs as `leasehold crd` prints them: leasedjob.yaml, `---`, leasedqueue.yaml.
pub fn committed_crds() -> String {
    let read = |file: &str| {
        std::fs::read_to_string(repo_root().join("charts/leasehold/crds").join(file))
            .unwrap_or_else(|e| panic!("charts/leasehold/crds/{file}: {e}"))
    };
    format!(
        "{}---\n{}",
        read("leasedjob.yaml"),
        read("leasedqueue.yaml")
    )
}

/// Installs the committed CRDs (LeasedJob and LeasedQueue; server-side apply; idempotent) and
/// waits until they are Established and served.
pub async fn install_crd(client: &Client) {
    for (file, name) in [
        ("leasedjob.yaml", "leasedjobs.leasehold.dev"),
        ("leasedqueue.yaml", "leasedqueues.leasehold.dev"),
    ] {
        apply_crd(client, file, name).await;
    }
    // Discovery can lag Established by a moment. Served = a one-item list answers; raw, so
    // that another test's job that no binary can decode (tests/poison.rs) does not read as
    // "not served".
    let jobs: Api<leasehold_kube::watch::Raw<LeasedJob>> = Api::all(client.clone());
    let queues: Api<leasehold_core::queue::LeasedQueue> = Api::all(client.clone());
    let one = kube::api::ListParams::default().limit(1);
    wait_for(
        "LeasedJob and LeasedQueue APIs served",
        Duration::from_secs(30),
        || async {
            jobs.list(&one).await.ok()?;
            queues.list(&one).await.ok().map(|_| ())
        },
    )
    .await;
}

/// The versions `crd` declares, in order, each with whether it is the storage version.
pub fn crd_versions(crd: &CustomResourceDefinition) -> Vec<(String, bool)> {
    crd.spec
        .versions
        .iter()
        .map(|v| (v.name.clone(), v.storage))
        .collect()
}

/// Applies charts/leasehold/crds/`file`, the CRD `name`, and waits until it is Established.
async fn apply_crd(client: &Client, file: &str, name: &str) {
    let path = repo_root().join("charts/leasehold/crds").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let crd: CustomResourceDefinition = serde_yaml::from_str(&text).expect("CRD YAML");
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(
        name,
        &PatchParams::apply("leasehold-tests").force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("apply CRD");
    wait_for("CRD Established", Duration::from_secs(30), || async {
        let crd = api.get(name).await.ok()?;
        let established = crd
            .status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        established.then_some(())
    })
    .await;
}

/// A namespace for one test, named after it plus a random suffix; deleted on drop (the
/// namespace controller removes its contents).
pub struct TestNamespace {
    /// The namespace's name.
    pub name: String,
    client: Client,
}

impl TestNamespace {
    /// Installs the CRD and creates a namespace named `test-XXXXXXXX`.
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

/// The ports [`free_port`] hands out: below Linux's default ephemeral range (32768-60999, from
/// which the kernel picks the local port of every outgoing connection and of every bind to
/// port 0), below the range from which tests/controlplane/start.sh and tests/node/start.sh
/// pick theirs (20000-31999: an API server or etcd restarted by a fault test binds its port
/// again, which must not have been handed out meanwhile), and above the ports of a node's own
/// components (10248-10259).
const FREE_PORTS: std::ops::Range<u16> = 12000..20000;

/// A free loopback port for a process the test starts, which binds it itself.
///
/// The port is bound to check that it is free, then released. It is taken from `FREE_PORTS`
/// (12000-19999), which nothing else picks from, so no outgoing connection, no bind to port
/// 0 and no restarted control-plane component can take it between this check and the
/// child's bind (with a port from a bind to port 0 they could, and a controller then failed
/// with "Address already in use"). Within one test binary no port is handed out twice; test
/// binaries running at once start at different points of the range (by process id).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let span = u32::from(FREE_PORTS.end - FREE_PORTS.start);
    // The first call places this process in the range; later calls walk on from there.
    let start = std::process::id().wrapping_mul(2_654_435_761) % span;
    let _ = NEXT.compare_exchange(u32::MAX, start, Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..span {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let port = FREE_PORTS.start + offset as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {FREE_PORTS:?}")
}

/// The token of a claim's answer (`{"token": ...}`); panics if it has none.
pub fn token_of(claim: &Value) -> String {
    claim["token"]
        .as_str()
        .expect("claim has a token")
        .to_string()
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
    let script = repo_root().join("tests/controlplane/restart-apiserver.sh");
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

/// A ServiceAccount `sa` of `ns` with a Role and RoleBinding `<sa>-claims` that lets it claim
/// there (update `leasedjobs/status`) when `may_claim`, or only read them.
pub fn service_account(ns: &str, sa: &str, may_claim: bool) {
    let verbs = if may_claim {
        serde_json::json!(["get", "update", "patch"])
    } else {
        serde_json::json!(["get"])
    };
    let role = format!("{sa}-claims");
    let objects = [
        serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": sa, "namespace": ns}}),
        serde_json::json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": role, "namespace": ns},
            "rules": [{"apiGroups": ["leasehold.dev"], "resources": ["leasedjobs/status"],
                "verbs": verbs}]}),
        serde_json::json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": role, "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]}),
    ];
    for object in objects {
        let (ok, out) = kubectl(
            &["apply", "--server-side", "-f", "-"],
            &serde_json::to_string(&object).unwrap(),
        );
        assert!(ok, "kubectl apply: {out}");
    }
}

/// A kubeconfig for the test cluster that authenticates with bearer `token` (a
/// ServiceAccount's, from [`sa_token`]) as user `file`, in namespace `ns`: written to the log
/// directory as `file`; its path.
pub fn token_kubeconfig(file: &str, token: &str, ns: &str) -> PathBuf {
    let admin = kube::config::Kubeconfig::read_from(kubeconfig_path()).expect("admin kubeconfig");
    let cluster = admin.clusters[0].cluster.clone().expect("cluster");
    let kc = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {
            "server": cluster.server,
            "certificate-authority-data": cluster.certificate_authority_data,
        }}],
        "users": [{"name": file, "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": file, "namespace": ns}}],
        "current-context": "test",
    });
    let path = log_dir().join(file);
    std::fs::write(&path, serde_yaml::to_string(&kc).unwrap()).unwrap();
    path
}

/// A token of ServiceAccount `sa` of `ns` (1 h), for `audience` (the API server's when None).
pub fn sa_token(ns: &str, sa: &str, audience: Option<&str>) -> String {
    let mut args = vec!["create", "token", sa, "--namespace", ns, "--duration", "1h"];
    if let Some(a) = audience {
        args.extend(["--audience", a]);
    }
    let (ok, out) = kubectl(&args, "");
    assert!(ok, "kubectl create token: {out}");
    out.trim().to_string()
}

/// What a sidecar pod of `ns` mounts for the dispatcher: a token of a ServiceAccount that may
/// claim there, for the audience `leasehold-dispatcher`, written to a file; its path, for
/// `--dispatch-token-file`.
pub fn dispatch_token_file(ns: &str) -> PathBuf {
    service_account(ns, "leasehold-sidecar", true);
    let token = sa_token(ns, "leasehold-sidecar", Some("leasehold-dispatcher"));
    let path = log_dir().join(format!("{ns}-dispatch-token"));
    std::fs::write(&path, token).unwrap();
    path
}
