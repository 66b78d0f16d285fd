//! Fault injection against the real control plane, for the chaos test: a TCP relay that can
//! stall a sidecar's connections to the API server, etcd restarts, and a forced etcd compaction
//! (so that watches resumed from an old resourceVersion get 410 Gone). Sidecars started on a
//! chosen port with a chosen kubeconfig (to restart one where its worker expects it, or to
//! route it through the relay) are [`crate::Sidecar::start_at`].
//!
//! Every process-level fault touches the one control plane that `scripts/test` started, so
//! every test sharing it sees the fault: keep tests that use these in their own test binary.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::{kubeconfig_path, log_dir, repo_root};

/// The state directory of the running control plane (tests/controlplane/start.sh).
pub fn state_dir() -> PathBuf {
    std::env::var_os("LEASEHOLD_CONTROLPLANE_STATE")
        .map(PathBuf::from)
        .expect("LEASEHOLD_CONTROLPLANE_STATE is not set; run `scripts/test`")
}

/// The value of `key` in the control plane's `env` file (KEY=VALUE lines written by start.sh
/// and kept current by the restart scripts), e.g. `LEASEHOLD_ETCD_URL`.
pub fn control_plane_env(key: &str) -> String {
    let path = state_dir().join("env");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .map(|v| v.trim_matches('\'').to_string())
        .unwrap_or_else(|| panic!("no {key} in {}", path.display()))
}

/// The loopback port the kube-apiserver serves on (from the test kubeconfig's `server`).
pub fn apiserver_port() -> u16 {
    let url = control_plane_env("LEASEHOLD_APISERVER_URL");
    url.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in LEASEHOLD_APISERVER_URL {url}"))
}

/// A TCP relay on 127.0.0.1 in front of a loopback port: the kube-apiserver's, or a
/// dispatcher's. It forwards bytes both ways until
/// told to stall: then it holds every byte in both directions (no reset, no FIN; connections
/// stay open, as in a network partition that drops packets) until told to resume, when the
/// held bytes flow on. Runs on its own thread and runtime, so a test that blocks its own
/// runtime (a synchronous restart script) never stalls it by accident.
pub struct Relay {
    /// The port to connect to instead of the API server's.
    pub port: u16,
    stalled: Arc<watch::Sender<bool>>,
    connections: Arc<AtomicU64>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Relay {
    /// Starts relaying 127.0.0.1:`port` (a free port) to 127.0.0.1:`upstream`.
    pub fn start(upstream: u16) -> Relay {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stalled, rx) = watch::channel(false);
        let connections = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&connections);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("relay runtime");
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener).expect("relay listener");
                let accept = async move {
                    loop {
                        let Ok((client, _)) = listener.accept().await else {
                            continue;
                        };
                        counted.fetch_add(1, Ordering::Relaxed);
                        let rx = rx.clone();
                        tokio::spawn(async move {
                            let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await
                            else {
                                return; // dropping the client closes it: the server is down
                            };
                            let _ = client.set_nodelay(true);
                            let _ = server.set_nodelay(true);
                            let (cr, cw) = client.into_split();
                            let (sr, sw) = server.into_split();
                            tokio::join!(pump(cr, sw, rx.clone()), pump(sr, cw, rx));
                        });
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = stopped => {}
                }
            });
        });
        Relay {
            port,
            stalled: Arc::new(stalled),
            connections,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Holds every byte from now on, until [`Relay::resume`].
    pub fn stall(&self) {
        self.stalled.send_replace(true);
    }

    /// Lets held and new bytes flow again.
    pub fn resume(&self) {
        self.stalled.send_replace(false);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// A copy of the test kubeconfig whose `server` is this relay, written as `name`.yaml in
    /// the log directory. TLS still verifies: the API server's certificate has the SAN
    /// IP:127.0.0.1, whichever port the bytes came through.
    pub fn kubeconfig(&self, name: &str) -> PathBuf {
        let text = std::fs::read_to_string(kubeconfig_path()).expect("read test kubeconfig");
        let from = format!("server: https://127.0.0.1:{}", apiserver_port());
        assert!(
            text.contains(&from),
            "the test kubeconfig has no `{from}` line to point at the relay"
        );
        let text = text.replace(&from, &format!("server: https://127.0.0.1:{}", self.port));
        let path = log_dir().join(format!("{name}.kubeconfig.yaml"));
        std::fs::write(&path, text).expect("write relay kubeconfig");
        path
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.resume();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Copies `from` to `to`, waiting before every read and every write while the relay is
/// stalled, so that at most one read's worth of bytes is held in between.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut stalled: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if stalled.wait_for(|s| !*s).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                let _ = stalled.wait_for(|s| !*s).await;
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => n,
        };
        if stalled.wait_for(|s| !*s).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Runs a script of tests/controlplane with the state directory and `signal`, after
/// `downtime` seconds down; panics with its output when it fails.
fn run_restart_script(script: &str, signal: &str, downtime: Duration) {
    let path = repo_root().join("tests/controlplane").join(script);
    let out = Command::new("bash")
        .arg(&path)
        .arg(state_dir())
        .arg(signal)
        .env("LEASEHOLD_RESTART_DOWNTIME", downtime.as_secs().to_string())
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{script}: {e}"));
    assert!(
        out.status.success(),
        "{script} {signal} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Restarts the control plane's etcd for real (tests/controlplane/restart-etcd.sh): stopped
/// with `signal` (TERM, or KILL for a crash), down for `downtime` (whole seconds), started
/// again with the same flags and data, and healthy when this returns. The API server stays up
/// and reconnects by itself; it is not necessarily ready yet when this returns. Blocks.
pub fn restart_etcd(signal: &str, downtime: Duration) {
    run_restart_script("restart-etcd.sh", signal, downtime);
}

/// What a forced compaction did.
#[derive(Debug)]
pub struct Compaction {
    /// etcd's revision when it was compacted: everything older is gone.
    pub revision: i64,
    /// etcd's answer to a read at `revision - 1` afterwards (must say "compacted").
    pub old_read_error: String,
}

/// Compacts etcd up to its current revision, physically, through its v3 JSON gateway
/// (LEASEHOLD_ETCD_URL): POST /v3/kv/range for the header's revision, then POST
/// /v3/kv/compaction. Afterwards a watch from an older resourceVersion cannot be served from
/// etcd: the API server answers it with 410 Gone ("too old resource version") once its own
/// watch cache cannot serve it either (e.g. after an API-server restart). Checks the
/// compaction took effect by reading at the previous revision.
pub async fn compact_etcd() -> Compaction {
    let etcd = control_plane_env("LEASEHOLD_ETCD_URL");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let post = |path: &str, body: Value| {
        let req = http.post(format!("{etcd}{path}")).json(&body);
        async move {
            let r = req.send().await.unwrap_or_else(|e| panic!("etcd: {e}"));
            let v: Value = r.json().await.unwrap_or_else(|e| panic!("etcd: {e}"));
            v
        }
    };
    // key "\0" (base64 "AA=="): any key will do, only the header matters.
    let head = post("/v3/kv/range", json!({"key": "AA=="})).await;
    let revision: i64 = head["header"]["revision"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no header.revision in etcd's answer {head}"));
    let done = post(
        "/v3/kv/compaction",
        json!({"revision": revision.to_string(), "physical": true}),
    )
    .await;
    assert!(
        done.get("error").is_none() && done.get("code").is_none(),
        "etcd refused the compaction at revision {revision}: {done}"
    );
    let old = post(
        "/v3/kv/range",
        json!({"key": "AA==", "revision": (revision - 1).to_string()}),
    )
    .await;
    let old_read_error = old["error"]
        .as_str()
        .or(old["message"].as_str())
        .unwrap_or_default()
        .to_string();
    Compaction {
        revision,
        old_read_error,
    }
}
