//! `leasehold controller`: the controller's process: the reconciler, its /metrics, /healthz
//! and /readyz, and optionally the admission webhook.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use leasehold_controller as controller;
use leasehold_kube::health::Health;
use leasehold_metrics::Metrics;

use super::args::{self, AdmissionArgs, ElectionArgs, HttpArgs};
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
    /// Offer waiting jobs to waiting sidecars (the dispatcher; docs/protocol.md, "Dispatch").
    /// `false` leaves every sidecar to choose on its own.
    #[arg(long, env = "LEASEHOLD_DISPATCH", default_value_t = true, action = clap::ArgAction::Set)]
    dispatch: bool,
    /// Address the dispatcher listens on; port 0 (the default) takes a free port, which the
    /// leading replica advertises to sidecars in the Lease `leasehold-dispatcher`.
    #[arg(long, env = "LEASEHOLD_DISPATCH_LISTEN", default_value = "0.0.0.0:0")]
    dispatch_listen: SocketAddr,
    /// Where sidecars reach the dispatcher: `HOST` or `HOST:PORT`, HOST an IP address or a DNS
    /// name; the port defaults to the one listened on (give one when something in between,
    /// such as a proxy, listens elsewhere). Default host: POD_IP, else the listen address's IP
    /// when it names one, else 127.0.0.1.
    #[arg(long, env = "LEASEHOLD_DISPATCH_ADVERTISE")]
    dispatch_advertise: Option<String>,
    /// Most connections the dispatcher keeps open at once: each waiting sidecar keeps one, so
    /// this bounds the fleet it serves (past it, sidecars wait to connect and then choose on
    /// their own). At least 1.
    #[arg(long, env = "LEASEHOLD_DISPATCH_MAX_CONNECTIONS", default_value_t = DISPATCH_MAX_CONNECTIONS)]
    dispatch_max_connections: usize,
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
        dispatch,
        dispatch_listen,
        dispatch_advertise,
        dispatch_max_connections,
        events,
    } = args;
    anyhow::ensure!(
        dispatch_max_connections >= 1,
        "--dispatch-max-connections 0: must be at least 1"
    );
    let limits = http.limits()?;
    let admission = admission.config()?;
    let reinject = admission
        .as_ref()
        .and_then(|a| a.injection.as_ref())
        .map(|sidecar| sidecar.namespaces().to_vec())
        .unwrap_or_default();
    if let Some(ns) = &namespace {
        check_dns_label("--namespace", ns)?;
    }
    let identity = identity_or_hostname(identity)?;
    let election = election.config(&identity, namespace.as_deref())?;
    let clients = clients().await?;
    controller::crd_check::check(&clients.requests).await?;
    controller::crd_check::check_queues(&clients.requests).await?;
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
        Some(args::Admission {
            addr,
            tls,
            injection,
        }) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--admission-listen {addr}: cannot bind"))?;
            let bound = listener.local_addr().unwrap_or(addr);
            tracing::info!(admission_listen = %bound, "Serving the admission webhook at https://{bound}{}", admission::PATH);
            if injection.is_some() {
                tracing::info!(admission_listen = %bound, "Serving the sidecar injection webhook at https://{bound}{}", crate::inject::PATH);
            }
            Some(tokio::spawn(http::serve_tls(
                listener,
                admission_routes(injection),
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
    let (dispatch, dispatched) = if dispatch {
        let listener = http::bind(dispatch_listen)
            .with_context(|| format!("--dispatch-listen {dispatch_listen}: cannot bind"))?;
        let bound = listener.local_addr().unwrap_or(dispatch_listen);
        let address = advertised_address(dispatch_advertise, bound)?;
        let advert_namespace = election
            .as_ref()
            .map(|e| e.namespace.clone())
            .or_else(|| namespace.clone())
            .or_else(|| std::env::var("POD_NAMESPACE").ok())
            .unwrap_or_else(|| "default".into());
        tracing::info!(dispatch_listen = %bound, address = %address, "Serving the dispatcher at http://{bound}, advertised as {address} in Lease {advert_namespace}/{}", leasehold_core::dispatch::ADVERT_LEASE);
        let dispatcher = Arc::new(controller::dispatch::Dispatcher::new());
        let shared = crate::dispatch::Shared {
            dispatcher: Arc::clone(&dispatcher),
            access: Arc::new(leasehold_kube::access::Access::new(
                clients.requests.clone(),
            )),
        };
        let served = tokio::spawn(http::serve(
            listener,
            crate::dispatch::router(shared),
            http::Limits {
                max_connections: dispatch_max_connections,
                ..limits
            },
            std::future::pending(),
        ));
        (
            Some(controller::dispatch::Setup {
                dispatcher,
                advert_namespace,
                address,
            }),
            Some(served),
        )
    } else {
        (None, None)
    };
    let dispatched = async {
        match dispatched {
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
            dispatch,
            reinject,
        },
        metrics,
        Arc::clone(&health),
    );
    tokio::select! {
    () = controller => {}
    served = server => served.context("metrics server failed")?,
    dispatched = dispatched => {
        dispatched.context("the dispatcher's server panicked")?.context("dispatcher server failed")?;
    }
    admitted = admitted => {
        admitted.context("the admission webhook server panicked")?.context("admission webhook server failed")?;
    }
    }
    Ok(())
}

/// Default of `--dispatch-max-connections`: a fleet of thousands of waiting sidecars, each
/// with one keep-alive connection (a file descriptor and a few KiB each).
pub const DISPATCH_MAX_CONNECTIONS: usize = 8192;

/// The `host:port` sidecars reach the dispatcher at: `flag` if given (checked: `HOST` or
/// `HOST:PORT`, the port defaulting to the bound one), else POD_IP, else the listen address's
/// IP when it names one, else 127.0.0.1, with the bound port.
fn advertised_address(flag: Option<String>, bound: SocketAddr) -> anyhow::Result<String> {
    let port = bound.port();
    if let Some(flag) = flag {
        if let Ok(address) = flag.parse::<SocketAddr>() {
            return Ok(address.to_string());
        }
        if let Ok(ip) = flag.parse::<std::net::IpAddr>() {
            return Ok(format!("{}:{port}", host_of(ip)));
        }
        let (host, port) = match flag.rsplit_once(':') {
            Some((host, p)) => {
                let p = p.parse::<u16>().ok().filter(|p| *p > 0);
                let Some(p) = p else {
                    anyhow::bail!(
                        "--dispatch-advertise {flag:?}: the port after the last ':' must be a number from 1 to 65535"
                    );
                };
                (host, p)
            }
            None => (flag.as_str(), port),
        };
        anyhow::ensure!(
            leasehold_core::crd::is_dns_subdomain(host),
            "--dispatch-advertise {flag:?}: {host:?} is neither an IP address nor a DNS name (a lowercase RFC 1123 subdomain)"
        );
        return Ok(format!("{host}:{port}"));
    }
    if let Some(ip) = std::env::var("POD_IP")
        .ok()
        .and_then(|ip| ip.parse::<std::net::IpAddr>().ok())
    {
        return Ok(format!("{}:{port}", host_of(ip)));
    }
    let ip = bound.ip();
    Ok(if ip.is_unspecified() {
        format!("127.0.0.1:{port}")
    } else {
        format!("{}:{port}", host_of(ip))
    })
}

/// An IP as the host part of `host:port` (IPv6 in brackets).
fn host_of(ip: std::net::IpAddr) -> String {
    match ip {
        std::net::IpAddr::V4(v4) => v4.to_string(),
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

/// The admission server's routes: the size webhook, and the injection webhook with a
/// template; one set of turns for both.
fn admission_routes(injection: Option<Arc<crate::inject::Sidecar>>) -> axum::Router {
    let turns = crate::review::turns();
    let size = admission::router(Arc::clone(&turns));
    match injection {
        Some(sidecar) => size.merge(crate::inject::router(turns, sidecar)),
        None => size,
    }
}

#[cfg(test)]
mod tests {
    use super::advertised_address;

    fn advertised(flag: &str) -> Result<String, String> {
        let bound = "0.0.0.0:4321".parse().unwrap();
        advertised_address(Some(flag.to_string()), bound).map_err(|e| e.to_string())
    }

    #[test]
    fn the_advertised_address_takes_a_host_and_an_optional_port() {
        assert_eq!(advertised("10.0.0.7").unwrap(), "10.0.0.7:4321");
        assert_eq!(advertised("10.0.0.7:80").unwrap(), "10.0.0.7:80");
        assert_eq!(advertised("::1").unwrap(), "[::1]:4321");
        assert_eq!(advertised("[::1]:80").unwrap(), "[::1]:80");
        assert_eq!(
            advertised("leasehold.example.svc").unwrap(),
            "leasehold.example.svc:4321"
        );
        assert_eq!(
            advertised("leasehold.example.svc:8080").unwrap(),
            "leasehold.example.svc:8080"
        );
    }

    #[test]
    fn a_bad_advertised_address_is_refused_naming_the_flag_and_the_rule() {
        let e = advertised("host:0").unwrap_err();
        assert!(
            e.contains("--dispatch-advertise \"host:0\"") && e.contains("1 to 65535"),
            "{e}"
        );
        let e = advertised("Bad_Host").unwrap_err();
        assert!(e.contains("\"Bad_Host\"") && e.contains("RFC 1123"), "{e}");
        let e = advertised("host:http").unwrap_err();
        assert!(e.contains("port"), "{e}");
    }
}
