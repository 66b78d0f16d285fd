//! The real `leasehold` binary as the tests run it: a controller for a test's namespace, and
//! a sidecar with an HTTP client for its API.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};

use crate::{
    free_port, http_client, kubeconfig_path, leasehold_bin, token_of, ControllerArgs, Proc,
    SidecarArgs,
};

/// Starts `leasehold controller` for one namespace, serving its metrics on a free port
/// (`Proc::port`).
pub fn controller(ns: &str) -> Proc {
    controller_with(ns, "test-controller", &[])
}

/// Starts `leasehold controller` for one namespace with `identity` and extra arguments.
pub fn controller_with(ns: &str, identity: &str, extra: &[&str]) -> Proc {
    ControllerArgs::new(ns)
        .identity(identity)
        .args(extra)
        .spawn()
}

impl ControllerArgs {
    /// Starts the controller with the test kubeconfig, on a free port (`Proc::port`) unless
    /// [`ControllerArgs::metrics_addr`] chose one; its log is `NS-IDENTITY.log`.
    pub fn spawn(self) -> Proc {
        let (args, port) = if self.metrics_addr == "127.0.0.1:0" {
            let port = free_port();
            (self.metrics_addr(&format!("127.0.0.1:{port}")), Some(port))
        } else {
            (self, None)
        };
        let mut p = Proc::spawn(
            &format!("{}-{}", args.namespace, args.identity),
            &leasehold_bin(),
            &args.to_args(),
            Stdio::null(),
        );
        p.port = port;
        p
    }
}

/// A running `leasehold sidecar` and an HTTP client for it.
pub struct Sidecar {
    /// The process.
    pub proc: Proc,
    /// `http://127.0.0.1:PORT`.
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
    ///
    /// A body the sidecar refuses before reading it (too large) races its answer: the sidecar
    /// answers 413 and closes the connection while the client may still be writing, and the
    /// client then sees a broken pipe instead of the answer (RFC 9112, section 9.6). Such a
    /// send is tried again on a fresh connection, at most five times; any other error fails.
    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> (u16, Value) {
        let mut tries = 0;
        let r = loop {
            tries += 1;
            let client = if tries == 1 {
                self.http.clone()
            } else {
                reqwest::Client::new()
            };
            match client
                .post(format!("{}{path}", self.base))
                .body(body.clone())
                .send()
                .await
            {
                Ok(r) => break r,
                Err(e) if tries < 5 && format!("{e:?}").contains("BodyWrite") => continue,
                Err(e) => panic!("sidecar reachable: {e:?}"),
            }
        };
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

    /// POSTs `body` as JSON; returns the status and the JSON body (Null when empty).
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

    /// The sidecar's metrics page (`GET /metrics`), as text.
    pub async fn metrics(&self) -> String {
        reqwest::get(format!("{}/metrics", self.base))
            .await
            .expect("metrics served")
            .text()
            .await
            .expect("metrics read")
    }

    /// POST /v1/claim?wait=`wait`: the status and the answer.
    pub async fn claim(&self, wait: u64) -> (u16, Value) {
        self.post(&format!("/v1/claim?wait={wait}"), json!(null))
            .await
    }

    /// POST /v1/jobs/`name`/heartbeat with `body`.
    pub async fn heartbeat(&self, name: &str, body: Value) -> (u16, Value) {
        self.post(&format!("/v1/jobs/{name}/heartbeat"), body).await
    }

    /// POST /v1/jobs/`name`/complete with `token` and `result`.
    pub async fn complete(&self, name: &str, token: &str, result: Value) -> (u16, Value) {
        self.post(
            &format!("/v1/jobs/{name}/complete"),
            json!({"token": token, "result": result}),
        )
        .await
    }
}

impl Sidecar {
    /// Starts `leasehold sidecar` on 127.0.0.1:`port` with the credentials and server of
    /// `kubeconfig`, and waits up to `ready_within` for its /readyz. Used to restart a killed
    /// sidecar where its worker expects it, and to route one through a `Relay`.
    pub async fn start_at(
        ns: &str,
        queue: &str,
        id: &str,
        port: u16,
        kubeconfig: &Path,
        extra: &[&str],
        ready_within: Duration,
    ) -> Sidecar {
        Sidecar::launch(
            ns,
            queue,
            id,
            port,
            kubeconfig,
            extra,
            "/readyz",
            ready_within,
        )
        .await
    }

    /// As [`Sidecar::start_as`], but waits only for /healthz (it serves), not for readiness:
    /// for a sidecar that is expected not to become ready.
    pub async fn start_serving(
        ns: &str,
        queue: &str,
        id: &str,
        extra: &[&str],
        kubeconfig: &Path,
    ) -> Sidecar {
        let within = Duration::from_secs(30);
        Sidecar::launch(
            ns,
            queue,
            id,
            free_port(),
            kubeconfig,
            extra,
            "/healthz",
            within,
        )
        .await
    }

    /// Starts the sidecar and waits up to `ready_within` for `path` (a GET) to answer 2xx.
    #[allow(clippy::too_many_arguments)]
    async fn launch(
        ns: &str,
        queue: &str,
        id: &str,
        port: u16,
        kubeconfig: &Path,
        extra: &[&str],
        path: &str,
        ready_within: Duration,
    ) -> Sidecar {
        let listen = format!("127.0.0.1:{port}");
        let args = SidecarArgs::new(ns, queue, id).listen(&listen).args(extra);
        let mut proc = Proc::spawn_as(
            &format!("{ns}-{id}"),
            &leasehold_bin(),
            &args.to_args(),
            Stdio::null(),
            kubeconfig,
        );
        proc.port = Some(port);
        let sidecar = Sidecar {
            proc,
            base: format!("http://{listen}"),
            http: http_client(),
        };
        // Each probe has its own deadline, and a timeout says what the last probe saw and
        // what the sidecar logged, so that a sidecar that never gets ready can be told from a
        // probe that never got through.
        let url = format!("{}{path}", sidecar.base);
        let deadline = std::time::Instant::now() + ready_within;
        loop {
            let probe = sidecar
                .http
                .get(&url)
                .timeout(Duration::from_secs(2))
                .send();
            let last = match probe.await {
                Ok(r) if r.status().is_success() => break,
                Ok(r) => {
                    let status = r.status();
                    format!("{status} {}", r.text().await.unwrap_or_default().trim())
                }
                Err(e) => format!("{e:?}"),
            };
            if std::time::Instant::now() > deadline {
                let log = sidecar.proc.log_text();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                panic!(
                    "sidecar {id} did not answer {path} on port {port} within {ready_within:?}; last \
                     probe of {url}: {last}; its log ends:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        sidecar
    }

    /// GET /healthz: true when the sidecar answers 200 (no background task has died).
    pub async fn healthy(&self) -> bool {
        let r = self
            .http
            .get(format!("{}/healthz", self.base))
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        matches!(r, Ok(r) if r.status().is_success())
    }
}
