//! `leasehold sidecar`: the worker's HTTP API on loopback, over the worker library, with a
//! graceful drain on SIGTERM.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use leasehold_kube::api::Clients;
use leasehold_metrics::Metrics;
use leasehold_worker as worker;

use super::args::HttpArgs;
use super::{check_dns_label, clients, identity_or_hostname};
use crate::{http, observe, sidecar};

/// Serve the worker's HTTP API: claim, heartbeat, complete, fail, release.
#[derive(clap::Args)]
pub struct SidecarArgs {
    /// Queue to claim from (spec.queue of the LeasedJobs).
    #[arg(long, env = "LEASEHOLD_QUEUE")]
    queue: String,
    /// Namespace of the jobs (default: POD_NAMESPACE, else the kubeconfig's namespace).
    #[arg(long, env = "POD_NAMESPACE")]
    namespace: Option<String>,
    /// Address to serve on. Keep it on loopback: the API is for the pod's own worker.
    #[arg(long, env = "LEASEHOLD_LISTEN", default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Identity written as the holder (default: POD_NAME, else the hostname).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds the worker may stay silent before the sidecar stops renewing its leases
    /// (at least each job's leaseDurationSeconds).
    #[arg(long, env = "LEASEHOLD_WORKER_TIMEOUT", default_value_t = worker::DEFAULT_WORKER_TIMEOUT.as_secs())]
    worker_timeout: u64,
    /// A claim picks at random among this many of the oldest top-priority jobs (1 = FIFO).
    #[arg(long, env = "LEASEHOLD_SPREAD", default_value_t = worker::DEFAULT_SPREAD)]
    spread: usize,
    /// On SIGTERM, how many seconds to keep serving held jobs (heartbeats, results) while
    /// the worker finishes, before exiting. Keep it under the pod's
    /// terminationGracePeriodSeconds.
    #[arg(long, env = "LEASEHOLD_DRAIN_TIMEOUT", default_value_t = 25)]
    drain_timeout: u64,
    /// On SIGTERM, release held jobs at once (requeued immediately, with their last
    /// checkpoint). Only safe when the worker has already exited when the sidecar is told
    /// to stop, as with a native sidecar (an initContainer with restartPolicy: Always).
    #[arg(long, env = "LEASEHOLD_RELEASE_ON_SHUTDOWN")]
    release_on_shutdown: bool,
    /// Also serve /metrics, /healthz and /readyz (not the worker API) on this address, for
    /// Prometheus and the kubelet's probes, which cannot reach the loopback --listen.
    #[arg(long, env = "LEASEHOLD_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Claim through the controller's dispatcher when it advertises one (docs/protocol.md,
    /// "Dispatch"); `false` always chooses on its own.
    #[arg(long, env = "LEASEHOLD_DISPATCH", default_value_t = true, action = clap::ArgAction::Set)]
    dispatch: bool,
    /// The projected service-account token for the audience `leasehold-dispatcher` that
    /// proves this sidecar to the dispatcher. Without it the sidecar chooses on its own.
    #[arg(long, env = "LEASEHOLD_DISPATCH_TOKEN_FILE", default_value = DEFAULT_DISPATCH_TOKEN_FILE)]
    dispatch_token_file: std::path::PathBuf,
    /// Namespace of the controller's Lease `leasehold-dispatcher`, which says where the
    /// dispatcher answers (default: the jobs' namespace).
    #[arg(long, env = "LEASEHOLD_DISPATCH_NAMESPACE")]
    dispatch_namespace: Option<String>,
    #[command(flatten)]
    http: HttpArgs,
}

/// Where the chart's pods mount the dispatcher token (a projected volume).
pub const DEFAULT_DISPATCH_TOKEN_FILE: &str = "/var/run/secrets/leasehold.dev/dispatcher/token";

/// Runs the sidecar until SIGTERM and its drain, or until a server or its watch fails.
///
/// # Errors
/// Bad flags (named with their value and rule), an unreachable API server, an address that
/// cannot be bound, or a server or watch that ended.
pub async fn run(args: SidecarArgs) -> anyhow::Result<()> {
    let SidecarArgs {
        queue,
        namespace,
        listen,
        identity,
        worker_timeout,
        spread,
        drain_timeout,
        release_on_shutdown,
        metrics_addr,
        dispatch,
        dispatch_token_file,
        dispatch_namespace,
        http,
    } = args;
    let limits = http.limits()?;
    check_dns_label("--queue", &queue)?;
    for (flag, value, max) in [
        ("--drain-timeout", drain_timeout, 86_400),
        ("--worker-timeout", worker_timeout, 7 * 86_400),
    ] {
        if value > max {
            bail!("{flag} {value} is too long: at most {max} seconds");
        }
    }
    if spread == 0 {
        bail!("--spread 0 is not allowed: it must be at least 1 (1 means strict FIFO)");
    }
    let clients = clients().await?;
    let namespace = namespace.unwrap_or_else(|| clients.requests.default_namespace().to_string());
    check_dns_label("--namespace", &namespace)?;
    let identity = identity_or_hostname(identity)?;
    let config = worker::WorkerConfig {
        namespace: namespace.clone(),
        queue,
        identity,
        spread,
        worker_timeout: Duration::from_secs(worker_timeout),
        dispatch: dispatch_config(
            dispatch,
            dispatch_token_file,
            dispatch_namespace,
            &namespace,
        )?,
    };
    let shutdown = Shutdown {
        drain_timeout: Duration::from_secs(drain_timeout),
        release_on_shutdown,
    };
    let serving = Serving {
        listen,
        metrics_addr,
        limits,
    };
    run_sidecar(clients, config, serving, shutdown).await
}

/// Where and how the sidecar serves HTTP.
struct Serving {
    listen: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    limits: http::Limits,
}

/// What the sidecar does on SIGTERM.
struct Shutdown {
    drain_timeout: Duration,
    release_on_shutdown: bool,
}

async fn run_sidecar(
    clients: Clients,
    config: worker::WorkerConfig,
    serving: Serving,
    shutdown: Shutdown,
) -> anyhow::Result<()> {
    let Serving {
        listen,
        metrics_addr,
        limits,
    } = serving;
    let (queue, namespace, identity) = (
        config.queue.clone(),
        config.namespace.clone(),
        config.identity.clone(),
    );
    let metrics = Arc::new(Metrics::new());
    let (worker, watch_task) = worker::Worker::start(clients, config, Arc::clone(&metrics) as _);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("--listen {listen}: cannot bind"))?;
    let listen = listener.local_addr().unwrap_or(listen);
    if !listen.ip().is_loopback() {
        tracing::warn!(%listen, "--listen is not a loopback address: the sidecar's API has no authentication of its own, so anything that reaches this address can claim jobs in this pod's name");
    }
    tracing::info!(%listen, %queue, %namespace, %identity, "Started leasehold sidecar");
    let observability = match metrics_addr {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--metrics-addr {addr}: cannot bind"))?;
            let router = observe::router(Arc::clone(&metrics), Arc::clone(worker.health()));
            Some(tokio::spawn(http::serve(
                l,
                router,
                limits,
                std::future::pending(),
            )))
        }
        None => None,
    };
    let drain = drain_on_signal(worker.clone(), shutdown);
    let server = http::serve(listener, sidecar::router(worker, metrics), limits, drain);
    let observed = async {
        match observability {
            Some(task) => task.await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        served = server => served.context("HTTP server failed"),
        _ = watch_task => bail!("the LeasedJob watch task ended unexpectedly"),
        _ = observed => bail!("the --metrics-addr server ended unexpectedly"),
    }
}

/// Resolves when the sidecar may stop serving: after SIGTERM, once no job is held (the worker
/// finished, failed or released them) or the drain timeout passed. Claims are refused from the
/// signal on. Held jobs are released only with --release-on-shutdown (the worker is known to
/// be gone); otherwise a job still held at the timeout keeps its lease until it expires,
/// because the worker may still be working on it.
async fn drain_on_signal(worker: worker::Worker, shutdown: Shutdown) {
    leasehold_kube::shutdown::signal().await;
    worker.start_draining();
    let held = worker.held_count();
    tracing::info!(held, "Draining leasehold sidecar: no more claims");
    if shutdown.release_on_shutdown {
        let released = worker.release_all().await;
        tracing::info!(
            released,
            "Released held jobs at shutdown (--release-on-shutdown)"
        );
    } else if !worker.drained(shutdown.drain_timeout).await {
        tracing::warn!(
            held = worker.held_count(),
            "Drain timeout passed with jobs still held; their leases will expire"
        );
    }
    tracing::info!("Stopped leasehold sidecar");
}

/// The dispatcher's client configuration: None with `--dispatch false`, or without the token
/// file (said once, at start).
///
/// # Errors
/// A `--dispatch-namespace` that is not a namespace name.
fn dispatch_config(
    dispatch: bool,
    token_file: std::path::PathBuf,
    advert_namespace: Option<String>,
    namespace: &str,
) -> anyhow::Result<Option<worker::dispatched::DispatchConfig>> {
    if let Some(ns) = &advert_namespace {
        check_dns_label("--dispatch-namespace", ns)?;
    }
    if !dispatch {
        return Ok(None);
    }
    if !token_file.is_file() {
        tracing::info!(token_file = %token_file.display(), "No dispatcher token at {}: this sidecar chooses jobs on its own", token_file.display());
        return Ok(None);
    }
    Ok(Some(worker::dispatched::DispatchConfig {
        token_file,
        advert_namespace: advert_namespace.unwrap_or_else(|| namespace.to_string()),
    }))
}
