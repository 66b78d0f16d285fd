//! The TypeScript client (clients/typescript) against the real sidecar and control plane:
//! builds it with `tsc` (its dev dependencies from the npm registry, installed once per machine
//! by tests/tools/node/modules.sh, which scripts/test runs) in a copy of the package, then runs
//! its `node --test` suite (clients/typescript/test) with a controller for the test's
//! namespace. The suite starts its own sidecars (this crate's `leasehold` binary) and worker
//! processes, and freezes, stops and cancels them: lease loss under SIGSTOP of the worker,
//! cancellation, resume from a checkpoint, SIGTERM of the worker and of the sidecar, a worker
//! running four jobs at once, the example worker, and every error code; its unit tests run
//! against a stub sidecar.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use leasehold_testkit::*;

/// What the suite needs of the package: everything but what building and installing make.
const PACKAGE_ENTRIES: &[&str] = &[
    "package.json",
    "package-lock.json",
    "tsconfig.json",
    "README.md",
    "src",
    "test",
    "examples",
];

/// The TypeScript client builds with `tsc` and passes its `node --test` suite against the
/// real sidecar.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typescript_client_node_test_suite() {
    require_control_plane!();
    let modules = PathBuf::from(std::env::var_os("LEASEHOLD_NODE_MODULES").expect(
        "LEASEHOLD_NODE_MODULES is not set: the client's node_modules come from \
         tests/tools/node/modules.sh; run `scripts/test`",
    ));
    let Fixture { ns, .. } = fixture!("typescript-client");
    let _controller = controller(&ns.name);
    let root = repo_root();
    let logs = log_dir().join(format!("{}-node-test", ns.name));
    std::fs::create_dir_all(&logs).unwrap();
    // A copy of the package, so that building writes nothing into the repository.
    let package = target_tmpdir().join(format!("typescript-client-{}", ns.name));
    let _ = std::fs::remove_dir_all(&package);
    for entry in PACKAGE_ENTRIES {
        copy_tree(
            &root.join("clients/typescript").join(entry),
            &package.join(entry),
        );
    }
    std::os::unix::fs::symlink(&modules, package.join("node_modules")).unwrap();

    let build = run_in(&package, "npm", &["run", "build"], &[]).await;
    assert!(
        build.status.success(),
        "`npm run build` (tsc) of the TypeScript client failed:\n{}",
        text(&build)
    );

    let kubectl = kubectl_path();
    let env: Vec<(&str, PathBuf)> = vec![
        ("LEASEHOLD_BIN", leasehold_bin()),
        ("LEASEHOLD_TEST_NAMESPACE", PathBuf::from(&ns.name)),
        ("LEASEHOLD_KUBECTL", kubectl),
        ("LEASEHOLD_NODE_TEST_LOGS", logs.clone()),
        ("LEASEHOLD_REPO_ROOT", root.clone()),
        ("KUBECONFIG", kubeconfig_path()),
    ];
    let out = run_in(
        &package,
        "node",
        &[
            "--test",
            "--test-reporter=spec",
            "test/unit.test.mjs",
            "test/sidecar.test.mjs",
        ],
        &env,
    )
    .await;
    let report = text(&out);
    println!("{report}");
    assert!(
        out.status.success(),
        "the TypeScript client's tests failed (logs of its sidecars and workers: {}):\n{report}",
        logs.display()
    );
    // Every test ran: none was skipped for want of the environment above.
    assert!(
        report.contains("skipped 0") || report.contains("ℹ skipped 0"),
        "some of the TypeScript client's tests were skipped:\n{report}"
    );
    let _ = std::fs::remove_dir_all(&package);
}

/// Runs `program args` in `dir` with `env` (and without the variables a worker pod would
/// have), off the async runtime.
async fn run_in(dir: &Path, program: &str, args: &[&str], env: &[(&str, PathBuf)]) -> Output {
    let mut command = Command::new(program);
    command
        .args(args)
        .current_dir(dir)
        .env_remove("LEASEHOLD_SIDECAR")
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE")
        .env_remove("NODE_OPTIONS");
    for (key, value) in env {
        command.env(key, value);
    }
    let what = format!("{program} {}", args.join(" "));
    tokio::task::spawn_blocking(move || {
        command
            .output()
            .unwrap_or_else(|e| panic!("run {what}: {e}"))
    })
    .await
    .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Copies the file or directory `from` to `to`.
fn copy_tree(from: &Path, to: &Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            copy_tree(&entry.path(), &to.join(entry.file_name()));
        }
    } else {
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::copy(from, to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
    }
}
