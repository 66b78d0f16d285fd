//! Processes the tests start: the real `leasehold` binary (and others), killed when dropped,
//! each logging to a file of its own.

use std::ffi::OsStr;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::kubeconfig_path;

/// Directory for the logs of processes the tests start.
pub fn log_dir() -> PathBuf {
    let dir = std::env::var_os("LEASEHOLD_TEST_LOGS")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_tmpdir().join("logs"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A process the test started; killed on drop.
pub struct Proc {
    /// The process.
    pub child: Child,
    /// Its name, which also names its log file.
    pub name: String,
    /// Its log file (stderr).
    pub log: PathBuf,
    /// The HTTP port it serves on, when the test chose one.
    pub port: Option<u16>,
}

impl Proc {
    /// Starts `program args` with the test kubeconfig, logging to a file named `name`.
    pub fn spawn<A: AsRef<OsStr>>(name: &str, program: &Path, args: &[A], stdout: Stdio) -> Proc {
        Proc::spawn_as(name, program, args, stdout, &kubeconfig_path())
    }

    /// As [`Proc::spawn`], with the credentials of `kubeconfig`. The pod's downward-API
    /// variables of the test runner's own environment are never passed on.
    pub fn spawn_as<A: AsRef<OsStr>>(
        name: &str,
        program: &Path,
        args: &[A],
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

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (STOP, CONT, KILL, TERM) with kill(1).
    pub fn signal(&self, sig: &str) {
        signal(self.pid(), sig);
    }

    /// What it has logged so far (empty if the log cannot be read).
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

/// The `leasehold` binary that Cargo built beside the running test binary (`cargo test` builds
/// the package's binaries for its integration tests: `target/<profile>/leasehold`, where the
/// test binary is `target/<profile>/deps/<test>-<hash>`).
pub fn leasehold_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|profile| profile.join("leasehold"))
        .expect("the test binary lies in target/<profile>/deps");
    assert!(
        bin.is_file(),
        "{} is missing: build it with `cargo build` (`cargo test` and `scripts/test` do)",
        bin.display()
    );
    bin
}

/// The temporary directory Cargo keeps for integration tests (`CARGO_TARGET_TMPDIR`, i.e.
/// `target/tmp`), found from the running test binary: the nearest ancestor directory with
/// Cargo's `CACHEDIR.TAG` is the target directory. Falls back to the system's temporary
/// directory.
pub fn target_tmpdir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe
        .ancestors()
        .find(|d| d.join("CACHEDIR.TAG").is_file())
        .map(|target| target.join("tmp"))
        .unwrap_or_else(|| std::env::temp_dir().join("leasehold-tests"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
