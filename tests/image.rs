//! The container image, built by `scripts/image` from the project's Dockerfile, run as users
//! run it: its controller and sidecar started from the image with podman (`--network host`,
//! `--read-only`, no `--user`: the image's own USER), against the local control plane, through
//! claim -> heartbeat -> complete. Also what the image holds: one static executable and no
//! shell.
//!
//! And the example worker's image (`scripts/image --worker`): the Python client installed by
//! pip, and examples/worker.py.
//!
//! `scripts/test` builds the images (cached by their inputs) and exports LEASEHOLD_IMAGE and
//! LEASEHOLD_WORKER_IMAGE; these tests fail, never skip, when they are missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_testkit::*;
use serde_json::{json, Value};

/// The image under test (`localhost/leasehold:<appVersion>`), from scripts/test.
fn image() -> String {
    std::env::var("LEASEHOLD_IMAGE").unwrap_or_else(|_| {
        panic!(
            "LEASEHOLD_IMAGE is not set: the image tests run under `scripts/test --test image`, \
             which builds the image with scripts/image"
        )
    })
}

/// podman with the project's containers.conf (runc, no default ulimits).
fn podman(args: &[&str]) -> (bool, String) {
    let conf = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/containers.conf");
    let out = Command::new("podman")
        .args(args)
        .env("CONTAINERS_CONF", conf)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("podman {}: {e}", args.join(" ")));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn podman_ok(args: &[&str]) -> String {
    let (ok, out) = podman(args);
    assert!(ok, "podman {} failed:\n{out}", args.join(" "));
    out
}

/// A container started from the image; its log is kept in the test logs and it is removed
/// on drop.
struct Container {
    name: String,
}

impl Container {
    /// `podman run -d` of the image with `args` as the command (after the ENTRYPOINT), on the
    /// host's network, with a read-only root filesystem, no capabilities, and the kubeconfig
    /// at `kubeconfig` mounted read-only.
    fn run(name: &str, kubeconfig: &Path, args: &[String]) -> Container {
        let _ = podman(&["rm", "-f", "-t", "0", name]);
        let mount = format!("{}:/etc/leasehold/kubeconfig:ro", kubeconfig.display());
        let mut argv = vec![
            "run",
            "-d",
            "--name",
            name,
            "--network",
            "host",
            "--read-only",
            "--cap-drop",
            "ALL",
            "--security-opt",
            "no-new-privileges",
            "-v",
            &mount,
            "-e",
            "KUBECONFIG=/etc/leasehold/kubeconfig",
            "-e",
            "RUST_LOG=info",
        ];
        let image = image();
        argv.push(&image);
        argv.extend(args.iter().map(String::as_str));
        podman_ok(&argv);
        Container {
            name: name.to_string(),
        }
    }

    /// The host pid of the container's main process.
    fn pid(&self) -> u32 {
        let out = podman_ok(&["inspect", "--format", "{{.State.Pid}}", &self.name]);
        out.trim().parse().expect("container pid")
    }

    fn logs(&self) -> String {
        podman(&["logs", &self.name]).1
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let log = log_dir().join(format!("{}.log", self.name));
        let _ = std::fs::write(log, self.logs());
        let _ = podman(&["rm", "-f", "-t", "2", &self.name]);
    }
}

/// The value of `key` (e.g. "Uid") in /proc/PID/status: its whitespace-separated fields.
fn proc_status(pid: u32, key: &str) -> Vec<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .unwrap_or_else(|| panic!("/proc/{pid}/status has no {key}"));
    line.split_whitespace().map(str::to_string).collect()
}

/// The mount options of `/` as the process `pid` sees it (its mount namespace).
fn root_mount_options(pid: u32) -> Vec<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    // Fields: id parent major:minor root mount-point options ...; the last mount of "/" wins.
    let line = text
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some("/"))
        .expect("a mount of / in mountinfo");
    line.split(' ')
        .nth(5)
        .unwrap()
        .split(',')
        .map(str::to_string)
        .collect()
}

/// A copy of the admin kubeconfig that the image's user (65532) can read.
fn readable_kubeconfig(ns: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("image-kubeconfigs");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(ns);
    std::fs::copy(kubeconfig_path(), &path).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    path
}

/// Waits until GET `url` answers 200; panics with the container's log otherwise.
async fn wait_ready(http: &reqwest::Client, url: &str, c: &Container) {
    for _ in 0..300 {
        if let Ok(r) = http.get(url).timeout(Duration::from_secs(2)).send().await {
            if r.status().is_success() {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{url} never answered 200; {} logged:\n{}", c.name, c.logs());
}

async fn post(http: &reqwest::Client, url: &str, body: Value) -> (u16, Value) {
    let r = http.post(url).json(&body).send().await.expect("sidecar");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[test]
fn the_image_holds_one_static_executable_and_no_shell() {
    require_control_plane!();
    let image = image();
    let cfg = podman_ok(&[
        "image",
        "inspect",
        "--format",
        "{{.Config.User}} {{json .Config.Entrypoint}}",
        &image,
    ]);
    assert_eq!(
        cfg.trim(),
        r#"65532:65532 ["/usr/local/bin/leasehold"]"#,
        "the image's USER and ENTRYPOINT"
    );
    let name = &format!("leasehold-image-listing-{}", std::process::id());
    let _ = podman(&["rm", "-f", name]);
    podman_ok(&["create", "--name", name, &image]);
    let tar = Path::new(env!("CARGO_TARGET_TMPDIR")).join("image-export.tar");
    let exported = podman(&["export", "-o", tar.to_str().unwrap(), name]);
    let _ = podman(&["rm", "-f", name]);
    assert!(exported.0, "podman export: {}", exported.1);
    let out = Command::new("tar")
        .args(["-tvf", tar.to_str().unwrap()])
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout).to_string();
    let _ = std::fs::remove_file(&tar);
    // Regular files with any execute bit: only the leasehold binary.
    let executables: Vec<&str> = listing
        .lines()
        .filter(|l| l.starts_with('-') && l[1..10].contains('x'))
        .collect();
    assert_eq!(executables.len(), 1, "executables in the image:\n{listing}");
    assert!(
        executables[0].ends_with("usr/local/bin/leasehold"),
        "{listing}"
    );
    for shell in ["bin/sh", "bin/bash", "bin/busybox"] {
        assert!(
            !listing.contains(shell),
            "the image has {shell}:\n{listing}"
        );
    }
    assert!(
        listing.contains("etc/ssl/certs/ca-certificates.crt"),
        "{listing}"
    );
    // Starting a shell in it fails: there is none.
    let (ok, out) = podman(&[
        "run",
        "--rm",
        "--entrypoint",
        "/bin/sh",
        &image,
        "-c",
        "true",
    ]);
    assert!(!ok, "a shell ran in the image: {out}");
    // The entrypoint is the binary itself: `crd` prints the committed CRD.
    let crd = podman_ok(&[
        "run",
        "--rm",
        "--read-only",
        "--network",
        "none",
        &image,
        "crd",
    ]);
    assert!(
        crd == leasehold_testkit::committed_crds(),
        "`crd` from the image differs from charts/leasehold/crds/"
    );
}

/// The example worker's image (`scripts/image --worker`, from examples/Dockerfile), run as
/// the chart runs it: as its own non-root user, read-only, with no PYTHONPATH. Its python
/// imports the client pip installed in site-packages (a distribution `leasehold` of the
/// package version, whose modules are the repository's clients/python/leasehold/*.py),
/// and its entrypoint is examples/worker.py at /app/worker.py.
#[test]
fn example_worker_image_runs_on_the_pip_installed_client() {
    require_control_plane!();
    let image = std::env::var("LEASEHOLD_WORKER_IMAGE").unwrap_or_else(|_| {
        panic!(
            "LEASEHOLD_WORKER_IMAGE is not set: the image tests run under \
             `scripts/test --test image`, which builds it with scripts/image --worker"
        )
    });
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let probe = r#"
import importlib.metadata, json, os, site, sys
import leasehold
pkg = os.path.dirname(leasehold.__file__)
print(json.dumps({
    "uid": os.getuid(),
    "pythonpath": os.environ.get("PYTHONPATH"),
    "package": pkg,
    "site": site.getsitepackages(),
    "version": importlib.metadata.version("leasehold"),
    "files": {n: open(os.path.join(pkg, n)).read() for n in os.listdir(pkg) if n.endswith(".py")},
    "worker": open("/app/worker.py").read(),
}))
"#;
    let out = podman_ok(&[
        "run",
        "--rm",
        "--read-only",
        "--network",
        "none",
        "--cap-drop",
        "ALL",
        "--entrypoint",
        "python3",
        &image,
        "-c",
        probe,
    ]);
    let got: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(got["uid"], 65532, "{out}");
    assert_eq!(got["pythonpath"], Value::Null, "{out}");
    let package = Path::new(got["package"].as_str().unwrap());
    assert!(
        got["site"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| Path::new(s.as_str().unwrap()) == package.parent().unwrap()),
        "leasehold is not imported from site-packages: {out}"
    );
    // The package's own __version__, which pyproject.toml reads (scripts/version keeps it).
    let init = std::fs::read_to_string(root.join("clients/python/leasehold/__init__.py")).unwrap();
    let version = init
        .lines()
        .find_map(|l| l.strip_prefix("__version__ = "))
        .map(|v| v.trim_matches('"'))
        .expect("the client's version");
    assert_eq!(got["version"], version, "{out}");
    let mut sources: Vec<String> = std::fs::read_dir(root.join("clients/python/leasehold"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".py"))
        .collect();
    sources.sort();
    let files = got["files"].as_object().unwrap();
    let mut installed: Vec<&String> = files.keys().collect();
    installed.sort();
    assert_eq!(installed, sources.iter().collect::<Vec<_>>());
    for name in &sources {
        let source =
            std::fs::read_to_string(root.join("clients/python/leasehold").join(name)).unwrap();
        assert!(
            files[name] == source.as_str(),
            "the image's leasehold/{name} differs from clients/python/leasehold/{name}: \
             rebuild it (scripts/image --worker)"
        );
    }
    let worker = std::fs::read_to_string(root.join("examples/worker.py")).unwrap();
    assert!(
        got["worker"] == worker.as_str(),
        "the image's /app/worker.py differs from examples/worker.py"
    );
    // The image's own command, as the chart's (`python3 /app/worker.py`).
    let help = podman_ok(&[
        "run",
        "--rm",
        "--read-only",
        "--network",
        "none",
        &image,
        "--help",
    ]);
    assert!(help.contains("--sidecar"), "{help}");
}

/// The image's controller and sidecar run as 65532 read-only through a job lifecycle.
#[tokio::test]
async fn image_runs_a_job_lifecycle() {
    let Fixture { client, ns } = fixture!("image");
    let kubeconfig = readable_kubeconfig(&ns.name);
    let (metrics_port, sidecar_port, sidecar_metrics) = (free_port(), free_port(), free_port());
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let controller = Container::run(
        &format!("{}-controller", ns.name),
        &kubeconfig,
        &ControllerArgs::new(&ns.name)
            .identity("image-controller")
            .leader_elect(false)
            .metrics_addr(&metrics_addr)
            .to_args(),
    );
    let listen = format!("127.0.0.1:{sidecar_port}");
    let sidecar_metrics_addr = format!("127.0.0.1:{sidecar_metrics}");
    let sidecar = Container::run(
        &format!("{}-sidecar", ns.name),
        &kubeconfig,
        &SidecarArgs::new(&ns.name, "img", "image-sidecar")
            .listen(&listen)
            .metrics_addr(&sidecar_metrics_addr)
            .to_args(),
    );
    let http = http_client();
    wait_ready(&http, &format!("http://{metrics_addr}/readyz"), &controller).await;
    wait_ready(&http, &format!("http://{listen}/readyz"), &sidecar).await;

    // Both run as the image's user, 65532, with / mounted read-only.
    for c in [&controller, &sidecar] {
        let pid = c.pid();
        assert_eq!(
            proc_status(pid, "Uid"),
            ["65532"; 4],
            "{} runs as another user",
            c.name
        );
        assert_eq!(proc_status(pid, "Gid"), ["65532"; 4], "{}", c.name);
        let opts = root_mount_options(pid);
        assert!(
            opts.iter().any(|o| o == "ro"),
            "{}'s / is mounted {opts:?}",
            c.name
        );
        assert_eq!(
            proc_status(pid, "CapEff"),
            ["0000000000000000"],
            "{} has capabilities",
            c.name
        );
    }

    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "from-image"}, "spec": {"queue": "img", "payload": {"n": 1}}}),
    )
    .await;
    let base = format!("http://{listen}");
    let (s, claim) = post(&http, &format!("{base}/v1/claim?wait=20"), json!(null)).await;
    assert_eq!(
        s,
        200,
        "claim: {claim}; sidecar logged:\n{}",
        sidecar.logs()
    );
    assert_eq!(claim["name"], "from-image");
    assert_eq!(claim["payload"], json!({"n": 1}));
    let token = claim["token"].as_str().unwrap().to_string();
    let (s, hb) = post(
        &http,
        &format!("{base}/v1/jobs/from-image/heartbeat"),
        json!({"token": token, "checkpoint": {"step": 1}}),
    )
    .await;
    assert_eq!(s, 200, "heartbeat: {hb}");
    let (s, done) = post(
        &http,
        &format!("{base}/v1/jobs/from-image/complete"),
        json!({"token": token, "result": {"ok": true}}),
    )
    .await;
    assert_eq!(s, 200, "complete: {done}");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let job = jobs.get("from-image").await.unwrap();
    let status = job.status.expect("status");
    assert_eq!(status.phase, Some(Phase::Succeeded));
    assert_eq!(status.result, Some(json!({"ok": true})));
    assert_eq!(status.holder.as_deref(), Some("image-sidecar"));

    // The controller in the image did its part: it watched the job to its end (its gauge of
    // jobs by queue and phase says so).
    let series = r#"leasehold_jobs{queue="img",phase="Succeeded"}"#;
    let mut last = String::new();
    for _ in 0..100 {
        if let Some((_, body)) = http_get(metrics_port, "/metrics").await {
            if sample(&body, series) == Some(1.0) {
                return;
            }
            last = body;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the image's controller never counted the job Succeeded; /metrics:\n{last}");
}
