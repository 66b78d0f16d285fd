//! `leasehold controller`: the controller's process: the reconciler, its /metrics, /healthz
//! and /readyz, and optionally the admission webhook.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use leasehold_controller as controller;
use leasehold_kube::health::Health;
use leasehold_metrics::Metrics;

use super::args::{AdmissionArgs, ElectionArgs, HttpArgs};
use super::{check_dns_label, clients, identity_or_hostname};
use crate::{admission, http, observe};

/// Reconcile LeasedJobs: initialise new ones, requeue expired leases, record Events.
///
/// Refuses to start when the installed LeasedJob CRD lacks fields this version needs.
#[derive(clap::Args)]
pub struct ControllerArgs {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "LEASEHOLD_NAMESPACE")]
    namespace: Option<String>,
    /// This replica's name in Events (default: POD_NAME, else the hostname).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, env = "LEASEHOLD_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    #[command(flatten)]
    election: ElectionArgs,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    admission: AdmissionArgs,
    /// Which transitions get an Event: `problems` (failures, expiries, Lease conflicts,
    /// cancellations) or `all` (also every claim, completion and release: two more writes
    /// per job).
    #[arg(long, env = "LEASEHOLD_EVENTS", default_value = "problems", value_parser = ["problems", "all"])]
    events: String,
}

/// Runs the controller until it ends or a server fails.
///
/// # Errors
/// Bad flags (named with their value and rule), an unreachable API server, an out-of-date CRD
/// ([`controller::crd_check`]), an address that cannot be bound, or a server that failed.
pub async fn run(args: ControllerArgs) -> anyhow::Result<()> {
    let ControllerArgs {
        namespace,
        identity,
        metrics_addr,
        election,
        http,
        admission,
        events,
    } = args;
    let limits = http.limits()?;
    let admission = admission.config()?;
    if let Some(ns) = &namespace {
        check_dns_label("--namespace", ns)?;
    }
    let identity = identity_or_hostname(identity)?;
    let election = election.config(&identity, namespace.as_deref())?;
    let clients = clients().await?;
    controller::crd_check::check(&clients.requests).await?;
    let metrics = Arc::new(Metrics::controller());
    let health = Health::new();
    let listener = tokio::net::TcpListener::bind(metrics_addr)
        .await
        .with_context(|| format!("--metrics-addr {metrics_addr}: cannot bind"))?;
    if let Ok(bound) = listener.local_addr() {
        tracing::info!(metrics_addr = %bound, "Serving /metrics, /healthz and /readyz");
    }
    let server = http::serve(
        listener,
        observe::router(Arc::clone(&metrics), Arc::clone(&health)),
        limits,
        std::future::pending(),
    );
    let admission = match admission {
        Some((addr, tls)) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--admission-listen {addr}: cannot bind"))?;
            let bound = listener.local_addr().unwrap_or(addr);
            tracing::info!(admission_listen = %bound, "Serving the admission webhook at https://{bound}{}", admission::PATH);
            Some(tokio::spawn(http::serve_tls(
                listener,
                admission::router(),
                limits,
                tls,
                std::future::pending(),
            )))
        }
        None => None,
    };
    let admitted = async {
        match admission {
            Some(task) => task.await,
            None => std::future::pending().await,
        }
    };
    let draining = Arc::clone(&health);
    tokio::spawn(async move {
        leasehold_kube::shutdown::signal().await;
        draining.set_shutting_down();
    });
    let controller = controller::run(
        clients,
        controller::Config {
            namespace,
            identity,
            election,
            events: if events == "all" {
                controller::EventPolicy::All
            } else {
                controller::EventPolicy::Problems
            },
        },
        metrics,
        Arc::clone(&health),
    );
    tokio::select! {
    () = controller => {}
    served = server => served.context("metrics server failed")?,
    admitted = admitted => {
        admitted.context("the admission webhook server panicked")?.context("admission webhook server failed")?;
    }
    }
    Ok(())
}
