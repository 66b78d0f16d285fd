//! `leasehold`: one binary, three subcommands. This file only wires: it parses arguments,
//! starts logging, builds the client and runs the chosen part of the library.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};
use kube::Client;
use leasehold::{controller, crd, crd_check, sidecar, telemetry, worker};

/// A Kubernetes-native job queue in which workers lease jobs and prove the lease on every write.
///
/// Every subcommand finds the cluster the standard way: KUBECONFIG (or ~/.kube/config), then
/// the in-cluster service account.
#[derive(Parser)]
#[command(name = "leasehold", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Reconcile LeasedJobs: initialise new ones, requeue expired leases, record Events.
    ///
    /// Refuses to start when the installed LeasedJob CRD lacks fields this version needs.
    Controller {
        /// Watch only this namespace (default: all namespaces).
        #[arg(long, env = "LEASEHOLD_NAMESPACE")]
        namespace: Option<String>,
        /// This replica's name in Events (default: POD_NAME, else the hostname).
        #[arg(long, env = "POD_NAME")]
        identity: Option<String>,
    },
    /// Serve the worker's HTTP API: claim, heartbeat, complete, fail, release.
    Sidecar {
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
    },
    /// Print the LeasedJob CustomResourceDefinition as YAML.
    Crd,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Crd => {
            print!("{}", crd::crd_yaml()?);
            Ok(())
        }
        Command::Controller {
            namespace,
            identity,
        } => {
            telemetry::init();
            let client = client().await?;
            let identity = identity_or_hostname(identity)?;
            crd_check::check(&client).await?;
            controller::run(
                client,
                controller::Config {
                    namespace,
                    identity,
                },
            )
            .await?;
            Ok(())
        }
        Command::Sidecar {
            queue,
            namespace,
            listen,
            identity,
            worker_timeout,
            spread,
        } => {
            telemetry::init();
            check_dns_label("--queue", &queue)?;
            if spread == 0 {
                bail!("--spread 0 is not allowed: it must be at least 1 (1 means strict FIFO)");
            }
            let client = client().await?;
            let namespace = namespace.unwrap_or_else(|| client.default_namespace().to_string());
            check_dns_label("--namespace", &namespace)?;
            let identity = identity_or_hostname(identity)?;
            let config = worker::WorkerConfig {
                namespace,
                queue,
                identity,
                spread,
                worker_timeout: Duration::from_secs(worker_timeout),
            };
            run_sidecar(client, config, listen).await
        }
    }
}

async fn client() -> anyhow::Result<Client> {
    Client::try_default().await.context(
        "no Kubernetes cluster found: set KUBECONFIG, or run in a pod with a service account",
    )
}

async fn run_sidecar(
    client: Client,
    config: worker::WorkerConfig,
    listen: SocketAddr,
) -> anyhow::Result<()> {
    let (queue, namespace, identity) = (
        config.queue.clone(),
        config.namespace.clone(),
        config.identity.clone(),
    );
    let (worker, watch_task) = worker::Worker::start(client, config);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("--listen {listen}: cannot bind"))?;
    tracing::info!(%listen, %queue, %namespace, %identity, "Started leasehold sidecar");
    let server =
        axum::serve(listener, sidecar::router(worker)).with_graceful_shutdown(shutdown_signal());
    tokio::select! {
        served = server => served.context("HTTP server failed"),
        _ = watch_task => bail!("the LeasedJob watch task ended unexpectedly"),
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("Shutting down leasehold sidecar");
}

fn identity_or_hostname(identity: Option<String>) -> anyhow::Result<String> {
    let id = match identity.filter(|s| !s.is_empty()) {
        Some(id) => id,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .or_else(|_| std::fs::read_to_string("/etc/hostname"))
            .map(|h| h.trim().to_string())
            .context("no --identity, POD_NAME or hostname to name this worker")?,
    };
    if id.is_empty() || id.len() > 253 || id.chars().any(|c| c.is_control() || c.is_whitespace()) {
        bail!("--identity {id:?} is not usable: it must be 1 to 253 characters without spaces (a pod name)");
    }
    Ok(id)
}

fn check_dns_label(flag: &str, value: &str) -> anyhow::Result<()> {
    let ok = (1..=63).contains(&value.len())
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !value.starts_with('-')
        && !value.ends_with('-');
    if !ok {
        bail!("{flag} {value:?} is not a DNS label: 1 to 63 lowercase letters, digits and '-', starting and ending with a letter or digit");
    }
    Ok(())
}
