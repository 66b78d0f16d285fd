//! The Python client (clients/python) against the real sidecar and control plane: runs its
//! pytest suite (clients/python/tests) in the venv that scripts/test prepares
//! (tests/tools/python/venv.sh), with a controller for the test's namespace. The suite starts
//! its own sidecars (this crate's `leasehold` binary) and worker processes, and freezes,
//! stops and cancels them: lease loss under SIGSTOP of the worker and of the sidecar,
//! cancellation, resume from a checkpoint, SIGTERM, and every documented error code.
//!
//! The client's tests that need no cluster (clients/python/tests_unit, on the fake sidecar of
//! `leasehold.testing`, and clients/python/examples) run here too, without a control plane.

use std::path::Path;
use std::process::Command;

use leasehold_testkit::*;

/// The Python client passes its pytest suite against the real sidecar.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_pytest_suite() {
    require_control_plane!();
    let python = std::env::var_os("LEASEHOLD_PYTHON").expect(
        "LEASEHOLD_PYTHON is not set: the venv with pytest comes from tests/tools/python/venv.sh; \
         run `scripts/test`",
    );
    let Fixture { ns, .. } = fixture!("python-client");
    let _controller = controller(&ns.name);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let kubectl = kubectl_path();
    let logs = log_dir().join(format!("{}-pytest", ns.name));
    std::fs::create_dir_all(&logs).unwrap();
    let suite = root.join("clients/python/tests");
    let python = python.clone();
    let ns_name = ns.name.clone();
    let logs2 = logs.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(&python)
            .args([
                "-m",
                "pytest",
                "-v",
                "-p",
                "no:cacheprovider",
                "--durations=5",
            ])
            .arg(&suite)
            .current_dir(root)
            .env("LEASEHOLD_BIN", leasehold_bin())
            .env("LEASEHOLD_TEST_NAMESPACE", &ns_name)
            .env("LEASEHOLD_KUBECTL", &kubectl)
            .env("LEASEHOLD_PYTEST_LOGS", &logs2)
            .env("KUBECONFIG", kubeconfig_path())
            .env_remove("LEASEHOLD_SIDECAR")
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE")
            .output()
            .expect("run pytest")
    })
    .await
    .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(
        out.status.success(),
        "the Python client's tests failed (logs of its sidecars and workers: {}):\n{text}",
        logs.display()
    );
}

/// The Python client's tests that need no cluster pass: its unit tests and the example's, run
/// on the in-process fake sidecar of `leasehold.testing`. They need only the venv.
#[test]
fn python_client_unit_tests() {
    let Some(python) = std::env::var_os("LEASEHOLD_PYTHON") else {
        eprintln!(
            "SKIPPED the Python client's unit tests: LEASEHOLD_PYTHON is unset; the venv with \
             pytest comes from tests/tools/python/venv.sh (`scripts/test` sets it)"
        );
        return;
    };
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python");
    let out = Command::new(&python)
        .args([
            "-m",
            "pytest",
            "-v",
            "-p",
            "no:cacheprovider",
            "--durations=5",
        ])
        .args(["tests_unit", "examples"])
        .current_dir(&client)
        .env_remove("LEASEHOLD_SIDECAR")
        .output()
        .expect("run pytest");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(
        out.status.success(),
        "the Python client's unit tests failed:\n{text}"
    );
}
