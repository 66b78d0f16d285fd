//! Processes: the `leasehold` controller and sidecars the benchmark starts, and what `/proc`
//! says about their (and the control plane's) memory and CPU.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use leasehold_testkit::{ControllerArgs, SidecarArgs};
use tokio::process::{Child, Command};

/// What `/proc/PID/{stat,status}` says about one process.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sample {
    /// Resident set size now, KiB (VmRSS).
    pub rss_kib: u64,
    /// Peak resident set size, KiB (VmHWM).
    pub hwm_kib: u64,
    /// User + system CPU time so far, in clock ticks.
    pub cpu_ticks: u64,
}

/// Reads one process; None when it is gone.
pub fn sample(pid: u32) -> Option<Sample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at field 3, "state".
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Some(Sample {
        rss_kib: kib("VmRSS:"),
        hwm_kib: kib("VmHWM:"),
        cpu_ticks: utime + stime,
    })
}

/// Clock ticks per second (sysconf `_SC_CLK_TCK`).
pub fn ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a constant of the C library.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// CPU used by named groups of processes over a window.
pub struct CpuWindow {
    start: Instant,
    before: BTreeMap<String, u64>,
    groups: Vec<(String, Vec<u32>)>,
}

impl CpuWindow {
    /// Starts a window over `groups` (name, pids).
    pub fn start(groups: Vec<(String, Vec<u32>)>) -> CpuWindow {
        let before = groups
            .iter()
            .map(|(name, pids)| (name.clone(), ticks(pids)))
            .collect();
        CpuWindow {
            start: Instant::now(),
            before,
            groups,
        }
    }

    /// Ends the window: per group, the CPU used in cores (1.0 = one core busy all the time).
    pub fn finish(&self) -> Vec<(String, f64)> {
        let wall = self.start.elapsed().as_secs_f64().max(1e-9);
        let tps = ticks_per_second();
        self.groups
            .iter()
            .map(|(name, pids)| {
                let used = ticks(pids).saturating_sub(self.before[name]);
                (name.clone(), used as f64 / tps / wall)
            })
            .collect()
    }
}

/// CPU seconds `group` used per item, from a window's [`CpuWindow::finish`] (`cpu`, in cores)
/// over `elapsed`, for `items` items (jobs, claims); 0 for a group the window did not have.
pub fn cpu_seconds_per(cpu: &[(String, f64)], group: &str, elapsed: Duration, items: usize) -> f64 {
    cpu.iter()
        .find(|(name, _)| name == group)
        .map_or(0.0, |(_, cores)| {
            cores * elapsed.as_secs_f64() / items.max(1) as f64
        })
}

fn ticks(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| sample(*p))
        .map(|s| s.cpu_ticks)
        .sum()
}

/// Tasks aborted when this is dropped (a `JoinHandle` alone detaches its task): the watches of
/// in-process claimers, so that a run that fails half-way leaves none running.
#[derive(Default)]
pub struct AbortOnDrop(pub Vec<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// The machine: CPU model, cores, memory.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    format!(
        "{cores} cores ({model}), {:.1} GiB memory, {} {}",
        mem_kib as f64 / 1024.0 / 1024.0,
        std::env::consts::OS,
        std::env::consts::ARCH
    )
}

/// A `leasehold` process the benchmark started; killed when dropped (and by the kernel if the
/// benchmark itself dies, through PR_SET_PDEATHSIG).
pub struct Proc {
    child: Child,
    /// Its name, for reports.
    pub name: String,
    /// Its log file.
    pub log: PathBuf,
}

impl Proc {
    /// Starts `bin args`, with KUBECONFIG set and stderr to `logs/name.log`.
    pub fn spawn(
        bin: &Path,
        args: &[impl AsRef<std::ffi::OsStr>],
        kubeconfig: &Path,
        logs: &Path,
        name: &str,
    ) -> anyhow::Result<Proc> {
        let log = logs.join(format!("{name}.log"));
        let err =
            std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .env("KUBECONFIG", kubeconfig)
            .env(
                "RUST_LOG",
                std::env::var("LEASEHOLD_BENCH_CHILD_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe and touches no memory of this process.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("start {} ({name})", bin.display()))?;
        Ok(Proc {
            child,
            name: name.to_string(),
            log,
        })
    }

    /// Its process id (0 once reaped).
    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// Sends SIGKILL and reaps it.
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// Fails if the process has exited, pointing at its log.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            bail!(
                "{} exited ({status}); see {}",
                self.name,
                self.log.display()
            );
        }
        Ok(())
    }

    /// Runs `wait` (a wait for what this process should bring about, such as the controller
    /// initialising jobs) while checking every second that the process still runs: fails at
    /// once when it exits (a controller refusing an out-of-date CRD, say) instead of after the
    /// wait's own timeout.
    pub async fn while_running<T>(
        &mut self,
        wait: impl std::future::Future<Output = anyhow::Result<T>>,
    ) -> anyhow::Result<T> {
        let mut wait = std::pin::pin!(wait);
        loop {
            tokio::select! {
                out = &mut wait => return out,
                () = tokio::time::sleep(Duration::from_secs(1)) => self.check_running()?,
            }
        }
    }
}

/// Starts `leasehold controller` for one namespace.
pub fn controller(bin: &Path, kubeconfig: &Path, logs: &Path, ns: &str) -> anyhow::Result<Proc> {
    controller_at(bin, kubeconfig, logs, ns, "127.0.0.1:0", "controller")
}

/// Starts `leasehold controller` for one namespace serving `/readyz` and `/metrics` on
/// `metrics_addr`; its log is `logs/NS-NAME.log`.
pub fn controller_at(
    bin: &Path,
    kubeconfig: &Path,
    logs: &Path,
    ns: &str,
    metrics_addr: &str,
    name: &str,
) -> anyhow::Result<Proc> {
    Proc::spawn(
        bin,
        &ControllerArgs::new(ns)
            .identity("bench-controller")
            .metrics_addr(metrics_addr)
            .to_args(),
        kubeconfig,
        logs,
        &format!("{ns}-{name}"),
    )
}

/// A free loopback address (`127.0.0.1:PORT`) to give a process.
pub fn free_addr() -> anyhow::Result<String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    Ok(format!("127.0.0.1:{port}"))
}

/// A running `leasehold sidecar` and its base URL.
pub struct Sidecar {
    /// The process.
    pub proc: Proc,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
}

/// Starts `leasehold sidecar` for `queue` in `ns` on a free loopback port. Call
/// [`Sidecar::ready`] before use.
pub fn sidecar(
    bin: &Path,
    kubeconfig: &Path,
    logs: &Path,
    ns: &str,
    queue: &str,
    identity: &str,
) -> anyhow::Result<Sidecar> {
    sidecar_with(bin, kubeconfig, logs, (ns, queue, identity), &[])
}

/// As [`sidecar`], for (namespace, queue, identity), with `extra` flags.
pub fn sidecar_with(
    bin: &Path,
    kubeconfig: &Path,
    logs: &Path,
    (ns, queue, identity): (&str, &str, &str),
    extra: &[&str],
) -> anyhow::Result<Sidecar> {
    let listen = free_addr()?;
    let proc = Proc::spawn(
        bin,
        // The benchmark's workers stay silent while they hold jobs; keep renewing.
        &SidecarArgs::new(ns, queue, identity)
            .listen(&listen)
            .worker_timeout(3600)
            .args(extra)
            .to_args(),
        kubeconfig,
        logs,
        &format!("{ns}-{identity}"),
    )?;
    Ok(Sidecar {
        proc,
        base: format!("http://{listen}"),
    })
}

impl Sidecar {
    /// Waits until `/healthz` answers 200 (its watch has synced).
    pub async fn ready(&mut self, http: &reqwest::Client, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.proc.check_running()?;
            if let Ok(r) = http.get(format!("{}/healthz", self.base)).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "{} not ready after {timeout:?}; see {}",
                    self.proc.name,
                    self.proc.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Starts `n` sidecars and waits until all are ready.
pub async fn sidecars(
    bench: &crate::cluster::Bench,
    http: &reqwest::Client,
    ns: &str,
    queue: &str,
    n: usize,
) -> anyhow::Result<Vec<Sidecar>> {
    let mut all = Vec::with_capacity(n);
    for i in 0..n {
        all.push(sidecar(
            &bench.leasehold,
            &bench.kubeconfig,
            &bench.logs,
            ns,
            queue,
            &format!("sidecar-{i}"),
        )?);
    }
    for s in &mut all {
        s.ready(http, Duration::from_secs(120)).await?;
    }
    Ok(all)
}

/// An HTTP client for a sidecar: its pool drops a connection idle for 5 s, under the sidecar's
/// 10 s keep-alive limit, so that no request goes out on a connection being closed.
pub fn sidecar_http() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_idle_timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("HTTP client")
}

/// What a claim loop ([`claim_loops`]) does with each job it claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterClaim {
    /// Nothing: the sidecar holds the job (and renews its Lease) until it stops.
    Hold,
    /// Completes it at once, with an empty result.
    Complete,
    /// Holds it, after one heartbeat with progress and a message (which every background
    /// renewal then carries, as when a worker reports progress).
    Heartbeat,
}

/// `n` claims spread evenly over `sidecars`, one at a time on each, each followed by `after`.
/// Returns each claim's latency (request to answer), in ms.
///
/// # Errors
/// A claim that does not answer 200 within its 30 s wait, or an `after` call that fails.
pub async fn claim_loops(
    http: &reqwest::Client,
    sidecars: &[Sidecar],
    n: usize,
    after: AfterClaim,
) -> anyhow::Result<Vec<f64>> {
    let loops = sidecars.iter().enumerate().map(|(i, s)| {
        let share = n / sidecars.len() + usize::from(i < n % sidecars.len());
        let (http, base) = (http.clone(), s.base.clone());
        async move {
            let mut took = Vec::with_capacity(share);
            for _ in 0..share {
                let t = Instant::now();
                let r = http
                    .post(format!("{base}/v1/claim?wait=30"))
                    .send()
                    .await
                    .context("claim")?;
                anyhow::ensure!(r.status() == 200, "claim answered {}", r.status());
                took.push(crate::stats::ms(t.elapsed()));
                let (path, body) = match after {
                    AfterClaim::Hold => continue,
                    AfterClaim::Complete => ("complete", serde_json::json!({"result": {}})),
                    AfterClaim::Heartbeat => (
                        "heartbeat",
                        serde_json::json!({"progress": 0.5, "message": "benchmark: halfway"}),
                    ),
                };
                let claimed: serde_json::Value = r.json().await.context("claim answer")?;
                let name = claimed["name"].as_str().context("claim without a name")?;
                let mut body = body;
                body["token"] = claimed["token"].clone();
                let r = http
                    .post(format!("{base}/v1/jobs/{name}/{path}"))
                    .json(&body)
                    .send()
                    .await
                    .context(path)?;
                anyhow::ensure!(r.status().is_success(), "{path} answered {}", r.status());
            }
            anyhow::Ok(took)
        }
    });
    Ok(futures::future::try_join_all(loops)
        .await?
        .into_iter()
        .flatten()
        .collect())
}
