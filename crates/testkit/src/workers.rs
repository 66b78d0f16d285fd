//! The example Python worker (examples/worker.py) run as a real process beside a sidecar, and
//! a log of the JSON events it prints on stdout (claimed, heartbeat, complete, fail, release,
//! lost, idle, error: see the worker's docstring), shared by all the workers of a test.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::Value;

use crate::{repo_root, Proc};

/// One line of a worker's stdout.
#[derive(Clone, Debug)]
pub struct WorkerEvent {
    /// The worker's `--name`.
    pub worker: String,
    /// When the test read the line (later than the worker wrote it when the test is busy).
    pub at: Instant,
    /// The event object, e.g. `{"event":"complete","name":"w-0001","attempt":2,"status":409,
    /// "error":"lease_lost"}`.
    pub event: Value,
}

impl WorkerEvent {
    /// The `event` field ("claimed", "complete", ...).
    pub fn kind(&self) -> &str {
        self.event["event"].as_str().unwrap_or_default()
    }

    /// The job the event is about, if any.
    pub fn job(&self) -> Option<&str> {
        self.event["name"].as_str()
    }

    /// The attempt the event is about (0 if absent).
    pub fn attempt(&self) -> i64 {
        self.event["attempt"].as_i64().unwrap_or(0)
    }

    /// The HTTP status the sidecar answered (None for events without one).
    pub fn status(&self) -> Option<u64> {
        self.event["status"].as_u64()
    }
}

/// The events of every worker a test started, in the order the test read them.
#[derive(Clone, Default)]
pub struct EventLog(Arc<Mutex<Vec<WorkerEvent>>>);

impl EventLog {
    /// A copy of every event so far.
    pub fn all(&self) -> Vec<WorkerEvent> {
        self.0.lock().unwrap().clone()
    }
}

/// Starts examples/worker.py as worker `name` against the sidecar at `sidecar_base`, with
/// `extra` flags (e.g. `--insist`, `--wait 5`); its stdout events go to `log`, its stderr
/// narration to the log file `{log_name}.log`. Killed when the returned [`Proc`] drops.
pub fn spawn_worker(
    log_name: &str,
    name: &str,
    sidecar_base: &str,
    extra: &[&str],
    log: &EventLog,
) -> Proc {
    let script = repo_root().join("examples/worker.py");
    let mut args = vec![
        script.to_str().unwrap(),
        "--sidecar",
        sidecar_base,
        "--name",
        name,
    ];
    args.extend_from_slice(extra);
    let mut proc = Proc::spawn(log_name, Path::new("python3"), &args, Stdio::piped());
    let stdout = proc.child.stdout.take().expect("worker stdout");
    let (log, worker) = (log.clone(), name.to_string());
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(event) = serde_json::from_str::<Value>(&line) {
                log.0.lock().unwrap().push(WorkerEvent {
                    worker: worker.clone(),
                    at: Instant::now(),
                    event,
                });
            }
        }
    });
    proc
}
