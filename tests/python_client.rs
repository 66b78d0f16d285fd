//! The Python client (clients/python) against the real sidecar and control plane: runs its
//! pytest suite (clients/python/tests) in the venv that scripts/test prepares
//! (tests/tools/python/venv.sh), with a controller for the test's namespace. The suite starts
//! its own sidecars (this crate's `leasehold` binary) and worker processes, and freezes,
//! stops and cancels them: lease loss under SIGSTOP of the worker and of the sidecar,
//! cancellation, resume from a checkpoint, SIGTERM, and every documented error code.
//!
//! The client's tests that need no cluster (clients/python/tests_unit, on the fake sidecar of
//! `leasehold.testing`, and clients/python/examples) run here too, without a control plane.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output};

use leasehold_testkit::*;

/// `python -m pytest` in `dir` on `paths`, verbose, with no cache and the five slowest tests
/// named, and no sidecar of the caller's environment.
fn pytest(python: &OsStr, dir: &Path, paths: &[&OsStr]) -> Command {
    let mut command = Command::new(python);
    command
        .args([
            "-m",
            "pytest",
            "-v",
            "-p",
            "no:cacheprovider",
            "--durations=5",
        ])
        .args(paths)
        .current_dir(dir)
        .env_remove("LEASEHOLD_SIDECAR");
    command
}

/// Prints what pytest wrote and fails, saying `what` failed, unless it passed.
fn passed(out: &Output, what: &str) {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "{what} failed:\n{text}");
}

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
    let logs = log_dir().join(format!("{}-pytest", ns.name));
    std::fs::create_dir_all(&logs).unwrap();
    let mut command = pytest(
        &python,
        root,
        &[root.join("clients/python/tests").as_os_str()],
    );
    command
        .env("LEASEHOLD_BIN", leasehold_bin())
        .env("LEASEHOLD_TEST_NAMESPACE", &ns.name)
        .env("LEASEHOLD_KUBECTL", kubectl_path())
        .env("LEASEHOLD_PYTEST_LOGS", &logs)
        .env("KUBECONFIG", kubeconfig_path())
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE");
    let out = tokio::task::spawn_blocking(move || command.output().expect("run pytest"))
        .await
        .unwrap();
    passed(
        &out,
        &format!(
            "the Python client's tests (logs of its sidecars and workers: {})",
            logs.display()
        ),
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
    let out = pytest(
        &python,
        &client,
        &["tests_unit".as_ref(), "examples".as_ref()],
    )
    .output()
    .expect("run pytest");
    passed(&out, "the Python client's unit tests");
}
