//! `leasehold`: one binary: the controller, the sidecar, the CRD, and (also as the kubectl plugin
//! `kubectl-leasehold`) get, retry and cancel. This file only wires: it parses arguments,
//! starts logging, builds the client and runs the chosen part of the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};
use std::sync::Arc;

use axum::routing::get;
use leasehold::kubeapi::Clients;
use leasehold::metrics::{Health, Metrics};
use leasehold::{
    admission, controller, crd, crd_check, http, leader, plugin, sidecar, telemetry, tls, worker,
};

/// A Kubernetes-native job queue in which workers lease jobs and prove the lease on every write.
///
/// Every subcommand finds the cluster the standard way: KUBECONFIG (or ~/.kube/config), then
/// the in-cluster service account.
#[derive(Parser)]
#[command(name = "leasehold", version, about)]
struct Cli {
    /// Log format: `text` (human) or `json` (one object per line, for log pipelines).
    #[arg(
        long,
        global = true,
        env = "LEASEHOLD_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: telemetry::LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// Leader election among controller replicas (client-go's defaults: 15 s, 10 s, 2 s).
#[derive(clap::Args)]
struct ElectionArgs {
    /// Elect one leader among replicas; only the leader writes. `false` runs as the only writer.
    #[arg(long, env = "LEASEHOLD_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// Namespace of the leader Lease (default: POD_NAMESPACE, else --namespace, else default).
    #[arg(long, env = "POD_NAMESPACE")]
    leader_namespace: Option<String>,
    /// Name of the leader Lease.
    #[arg(long, default_value = "leasehold-controller")]
    leader_lease_name: String,
    /// Seconds a leader's Lease stays valid without renewal, for the standbys.
    #[arg(long, default_value_t = 15.0)]
    leader_lease_duration: f64,
    /// Seconds the leader keeps leading without a successful renewal (< lease duration).
    #[arg(long, default_value_t = 10.0)]
    leader_renew_deadline: f64,
    /// Seconds between the leader's renewals and a standby's tries.
    #[arg(long, default_value_t = 2.0)]
    leader_retry_period: f64,
}

/// Bounds on what an HTTP client can make a server wait for (see `leasehold::http`).
#[derive(clap::Args)]
struct HttpArgs {
    /// Seconds a client may take to send a request's headers, and may leave a keep-alive
    /// connection idle; then the connection is closed.
    #[arg(long, env = "LEASEHOLD_HEADER_TIMEOUT", default_value_t = http::DEFAULT_HEADER_TIMEOUT.as_secs_f64())]
    header_timeout: f64,
    /// Seconds a client may take to send a whole request body after its headers; then the
    /// request is answered 408.
    #[arg(long, env = "LEASEHOLD_BODY_TIMEOUT", default_value_t = http::DEFAULT_BODY_TIMEOUT.as_secs_f64())]
    body_timeout: f64,
}

impl HttpArgs {
    fn limits(&self) -> anyhow::Result<http::Limits> {
        Ok(http::Limits {
            header_timeout: seconds("--header-timeout", self.header_timeout)?,
            body_timeout: seconds("--body-timeout", self.body_timeout)?,
            ..http::Limits::default()
        })
    }
}

/// The admission webhook that refuses LeasedJobs too large to store (see
/// `leasehold::admission`). Off unless --admission-listen is given.
#[derive(clap::Args)]
struct AdmissionArgs {
    /// Serve the validating admission webhook (HTTPS, path /validate/leasedjobs) on this
    /// address. Needs --admission-cert and --admission-key.
    #[arg(long, env = "LEASEHOLD_ADMISSION_LISTEN", value_name = "ADDR", requires_all = ["admission_cert", "admission_key"])]
    admission_listen: Option<SocketAddr>,
    /// PEM file of the webhook's serving certificate (its chain after it); read again
    /// whenever it changes, so a rotated Secret needs no restart.
    #[arg(
        long,
        env = "LEASEHOLD_ADMISSION_CERT",
        value_name = "FILE",
        requires = "admission_listen"
    )]
    admission_cert: Option<PathBuf>,
    /// PEM file of the certificate's private key (PKCS#8, PKCS#1 or SEC1); read again whenever
    /// it changes.
    #[arg(
        long,
        env = "LEASEHOLD_ADMISSION_KEY",
        value_name = "FILE",
        requires = "admission_listen"
    )]
    admission_key: Option<PathBuf>,
}

impl AdmissionArgs {
    /// The address and TLS configuration to serve the webhook with, when it is on.
    fn config(&self) -> anyhow::Result<Option<(SocketAddr, Arc<rustls::ServerConfig>)>> {
        let (Some(addr), Some(cert), Some(key)) = (
            self.admission_listen,
            &self.admission_cert,
            &self.admission_key,
        ) else {
            return Ok(None);
        };
        let tls = tls::server_config(cert, key).context(
            "--admission-cert and --admission-key must name a PEM certificate and its key",
        )?;
        Ok(Some((addr, tls)))
    }
}

fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("{flag} {value} is not a positive number of seconds"))
}

impl ElectionArgs {
    fn config(
        self,
        identity: &str,
        namespace: Option<&str>,
    ) -> anyhow::Result<Option<leader::ElectionConfig>> {
        if !self.leader_elect {
            return Ok(None);
        }
        let namespace = self
            .leader_namespace
            .or_else(|| namespace.map(str::to_string))
            .unwrap_or_else(|| "default".to_string());
        check_dns_label("--leader-namespace", &namespace)?;
        if !leasehold::crd::is_dns_subdomain(&self.leader_lease_name) {
            bail!(
                "--leader-lease-name {:?} is not a valid object name: a lowercase RFC 1123 subdomain of at most 253 characters",
                self.leader_lease_name
            );
        }
        let config = leader::ElectionConfig {
            namespace,
            lease_name: self.leader_lease_name,
            identity: identity.to_string(),
            lease_duration: seconds("--leader-lease-duration", self.leader_lease_duration)?,
            renew_deadline: seconds("--leader-renew-deadline", self.leader_renew_deadline)?,
            retry_period: seconds("--leader-retry-period", self.leader_retry_period)?,
        };
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(Some(config))
    }
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
        #[command(flatten)]
        http: HttpArgs,
    },
    /// Print the LeasedJob CustomResourceDefinition as YAML.
    Crd,
    /// List LeasedJobs with queue, phase, attempt, holder, last heartbeat, time until the lease
    /// runs out, and the progress their worker reported (`kubectl leasehold get`).
    Get {
        /// Only these jobs (default: all in the namespace).
        names: Vec<String>,
        #[command(flatten)]
        scope: ScopeArgs,
        /// After listing, keep watching: print a job's row again each time it or its Lease
        /// changes (every heartbeat).
        #[arg(short = 'w', long)]
        watch: bool,
    },
    /// Give a Failed or Cancelled LeasedJob a new attempt, keeping its failures, checkpoint and
    /// attempt count (`kubectl leasehold retry`).
    Retry {
        /// The job's name.
        name: String,
        /// Namespace of the job (default: the kubeconfig's).
        #[arg(short = 'n', long)]
        namespace: Option<String>,
        /// Failed attempts allowed from now on: spec.maxAttempts is raised to the failures so
        /// far plus this, when it is lower.
        #[arg(long, default_value_t = 1)]
        attempts: i32,
    },
    /// Cancel a LeasedJob: set spec.cancel, for the controller to end it (`kubectl leasehold
    /// cancel`).
    Cancel {
        /// The job's name.
        name: String,
        /// Namespace of the job (default: the kubeconfig's).
        #[arg(short = 'n', long)]
        namespace: Option<String>,
    },
}

/// Which namespaces `get` looks at.
#[derive(clap::Args)]
struct ScopeArgs {
    /// Namespace of the jobs (default: the kubeconfig's).
    #[arg(short = 'n', long, conflicts_with = "all_namespaces")]
    namespace: Option<String>,
    /// Jobs of every namespace.
    #[arg(short = 'A', long)]
    all_namespaces: bool,
}

/// The name the binary answers to as a kubectl plugin: kubectl runs `kubectl-leasehold` for
/// `kubectl leasehold ...` (kubectl's plugin mechanism: any executable of that name on PATH).
const PLUGIN_NAME: &str = "kubectl-leasehold";

/// The command line, read as `kubectl leasehold` when the binary was started under
/// [`PLUGIN_NAME`] (a symlink or copy), so that help and errors name the command users typed.
fn parse_cli() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let invoked = std::path::Path::new(&argv0)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string();
    let mut command = Cli::command();
    if invoked == PLUGIN_NAME {
        command = command.bin_name("kubectl leasehold");
    }
    let matches = command.get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = parse_cli();
    let log_format = cli.log_format;
    if matches!(
        cli.command,
        Command::Controller { .. } | Command::Sidecar { .. }
    ) {
        leasehold::memory::configure();
        tokio::spawn(leasehold::memory::trim_periodically());
    }
    match cli.command {
        Command::Crd => {
            print!("{}", crd::crd_yaml()?);
            Ok(())
        }
        Command::Controller {
            namespace,
            identity,
            metrics_addr,
            election,
            http,
            admission,
            events,
        } => {
            telemetry::init(log_format);
            let limits = http.limits()?;
            let admission = admission.config()?;
            if let Some(ns) = &namespace {
                check_dns_label("--namespace", ns)?;
            }
            let identity = identity_or_hostname(identity)?;
            let election = election.config(&identity, namespace.as_deref())?;
            let clients = clients().await?;
            crd_check::check(&clients.requests).await?;
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
                observability_router(Arc::clone(&metrics), Arc::clone(&health)),
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
                leasehold::shutdown::signal().await;
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
        Command::Sidecar {
            queue,
            namespace,
            listen,
            identity,
            worker_timeout,
            spread,
            drain_timeout,
            release_on_shutdown,
            metrics_addr,
            http,
        } => {
            telemetry::init(log_format);
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
            let namespace =
                namespace.unwrap_or_else(|| clients.requests.default_namespace().to_string());
            check_dns_label("--namespace", &namespace)?;
            let identity = identity_or_hostname(identity)?;
            let config = worker::WorkerConfig {
                namespace,
                queue,
                identity,
                spread,
                worker_timeout: Duration::from_secs(worker_timeout),
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
        Command::Get {
            names,
            scope,
            watch,
        } => {
            let clients = clients().await?;
            let scope = if scope.all_namespaces {
                plugin::Scope::All
            } else {
                plugin::Scope::Namespace(namespace_or_default(&clients, scope.namespace)?)
            };
            let mut out = std::io::stdout().lock();
            if watch {
                plugin::watch(&clients, &scope, &names, &mut out).await?;
            } else {
                plugin::get(&clients, &scope, &names, &mut out).await?;
            }
            Ok(())
        }
        Command::Retry {
            name,
            namespace,
            attempts,
        } => {
            let clients = clients().await?;
            let ns = namespace_or_default(&clients, namespace)?;
            let job = plugin::retry(&clients, &ns, &name, attempts).await?;
            println!(
                "LeasedJob {} retried: Queued; its next claim is attempt {} (failed attempts so far: {}, maxAttempts {})",
                job.reference(),
                job.attempt() + 1,
                job.failed_attempts(),
                job.spec.max_attempts
            );
            Ok(())
        }
        Command::Cancel { name, namespace } => {
            let clients = clients().await?;
            let ns = namespace_or_default(&clients, namespace)?;
            let job = plugin::cancel(&clients, &ns, &name).await?;
            match job.phase() {
                crd::Phase::Cancelled => println!("LeasedJob {} is Cancelled", job.reference()),
                crd::Phase::Leased => println!(
                    "LeasedJob {} cancel requested: the controller ends it now; its holder {} is told at its next heartbeat",
                    job.reference(),
                    job.status.as_ref().and_then(|s| s.holder.as_deref()).unwrap_or("-")
                ),
                phase => println!(
                    "LeasedJob {} cancel requested ({phase}): the controller ends it now",
                    job.reference()
                ),
            }
            Ok(())
        }
    }
}

/// `--namespace`, else the kubeconfig's namespace, checked.
fn namespace_or_default(clients: &Clients, namespace: Option<String>) -> anyhow::Result<String> {
    let ns = namespace.unwrap_or_else(|| clients.requests.default_namespace().to_string());
    check_dns_label("--namespace", &ns)?;
    Ok(ns)
}

async fn clients() -> anyhow::Result<Clients> {
    Ok(Clients::infer().await?)
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
    let (worker, watch_task) = worker::Worker::start(clients, config);
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
            let router =
                observability_router(Arc::clone(worker.metrics()), Arc::clone(worker.health()));
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
    let server = http::serve(listener, sidecar::router(worker), limits, drain);
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
    leasehold::shutdown::signal().await;
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

/// `/metrics`, `/healthz` and `/readyz`, for the controller and the sidecar's --metrics-addr.
fn observability_router(metrics: Arc<Metrics>, health: Arc<Health>) -> axum::Router {
    let h = Arc::clone(&health);
    axum::Router::new()
        .route("/metrics", get(move || async move { metrics.render() }))
        .route("/healthz", get(move || async move { health.healthz() }))
        .route("/readyz", get(move || async move { h.readyz() }))
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
