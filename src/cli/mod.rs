//! The command line: the clap types, and one function per subcommand (`controller`,
//! `sidecar`, `crd`, and the kubectl plugin's `get`, `retry`, `cancel`). `main` calls
//! [`Cli::parse_and_run`] and nothing else.

use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};
use leasehold_kube::api::Clients;

pub mod args;
pub mod controller;
pub mod kubectl;
pub mod sidecar;
pub mod smoke;

use crate::telemetry;

/// A Kubernetes-native job queue in which workers lease jobs and prove the lease on every write.
///
/// Every subcommand finds the cluster the standard way: KUBECONFIG (or ~/.kube/config), then
/// the in-cluster service account.
#[derive(Parser)]
#[command(name = "leasehold", version, about)]
pub struct Cli {
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

/// The subcommands.
#[derive(Subcommand)]
enum Command {
    /// Reconcile LeasedJobs: initialise new ones, requeue expired leases, record Events.
    ///
    /// Refuses to start when the installed LeasedJob CRD lacks fields this version needs.
    Controller(controller::ControllerArgs),
    /// Serve the worker's HTTP API: claim, heartbeat, complete, fail, release.
    Sidecar(sidecar::SidecarArgs),
    /// Print leasehold's CustomResourceDefinitions (LeasedJob, then LeasedQueue) as one YAML
    /// stream, for `kubectl apply --server-side -f -`; or, with --apply, install or upgrade
    /// them in the cluster (never replacing a newer one).
    Crd(CrdArgs),
    /// List LeasedJobs with queue, phase, attempt, holder, last heartbeat, time until the lease
    /// runs out, and the progress their worker reported (`kubectl leasehold get`).
    Get(kubectl::GetArgs),
    /// Submit a LeasedJob to a queue, idempotently with --key; with --wait, wait for its
    /// result (`kubectl leasehold submit`).
    Submit(kubectl::SubmitArgs),
    /// Give a Failed or Cancelled LeasedJob a new attempt, keeping its failures, checkpoint and
    /// attempt count (`kubectl leasehold retry`).
    Retry(kubectl::RetryArgs),
    /// Cancel a LeasedJob: set spec.cancel, for the controller to end it (`kubectl leasehold
    /// cancel`).
    Cancel(kubectl::CancelArgs),
    /// Show one LeasedJob: its attempts and failures, who holds it, its Lease (heartbeat, time
    /// left, progress) and its checkpoint (`kubectl leasehold describe`).
    Describe(kubectl::DescribeArgs),
    /// Stop new claims of a queue: set spec.paused of its LeasedQueue, creating it if need be
    /// (`kubectl leasehold pause QUEUE`). Jobs already Leased go on.
    Pause(kubectl::QueueArgs),
    /// Let claims of a paused queue go on (`kubectl leasehold resume QUEUE`).
    Resume(kubectl::QueueArgs),
    /// Run one job through this installation, end to end: create a LeasedJob in --queue,
    /// claim it through the sidecar, complete it, check it Succeeded, delete it (the chart's
    /// `helm test` runs this in a pod whose sidecar is injected).
    SmokeTest(smoke::SmokeArgs),
    /// Print a shell completion script: `source <(leasehold completion bash)`, or with
    /// `--plugin` for the name kubectl runs (`kubectl-leasehold`).
    Completion(CompletionArgs),
}

/// What `leasehold crd` does.
#[derive(clap::Args)]
struct CrdArgs {
    /// Install or upgrade the CRDs in the cluster (KUBECONFIG, then in-cluster credentials)
    /// with server-side apply, and wait until the API server serves them; a CRD newer than
    /// this binary's (one that declares something it lacks) is left as it is. Needs get,
    /// create and patch on customresourcedefinitions.
    #[arg(long)]
    apply: bool,
}

/// `leasehold crd --apply`: one line per CRD saying what was done.
async fn apply_crds() -> anyhow::Result<()> {
    let clients = clients().await?;
    for crd in [
        leasehold_core::crd::definition(),
        leasehold_core::crd::queue_definition(),
    ] {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let outcome = leasehold_controller::crd_upgrade::apply(&clients.requests, &crd).await?;
        println!("CustomResourceDefinition {name}: {outcome}");
    }
    Ok(())
}

/// The shell, and which name the script completes.
#[derive(clap::Args)]
struct CompletionArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
    /// Complete `kubectl-leasehold` (the plugin's executable) instead of `leasehold`.
    #[arg(long)]
    plugin: bool,
}

/// The name the binary answers to as a kubectl plugin: kubectl runs `kubectl-leasehold` for
/// `kubectl leasehold ...` (kubectl's plugin mechanism: any executable of that name on PATH).
pub const PLUGIN_NAME: &str = "kubectl-leasehold";

impl Cli {
    /// Parses the process's command line, read as `kubectl leasehold` when the binary was
    /// started under [`PLUGIN_NAME`] (a symlink or copy), so that help and errors name the
    /// command users typed; exits with clap's message on bad arguments.
    pub fn parse_args() -> Cli {
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

    /// Parses the command line and runs the chosen subcommand.
    ///
    /// # Errors
    /// Whatever the subcommand fails with; `main` prints it with its causes.
    pub async fn parse_and_run() -> anyhow::Result<()> {
        Cli::parse_args().run().await
    }

    /// Runs the chosen subcommand.
    ///
    /// # Errors
    /// Whatever the subcommand fails with.
    pub async fn run(self) -> anyhow::Result<()> {
        if matches!(self.command, Command::Controller(_) | Command::Sidecar(_)) {
            leasehold_kube::memory::configure();
            tokio::spawn(leasehold_kube::memory::trim_periodically());
            telemetry::init(self.log_format);
        }
        match self.command {
            Command::Crd(args) if args.apply => apply_crds().await,
            Command::Crd(_) => {
                print!("{}", leasehold_core::crd::all_crds_yaml()?);
                Ok(())
            }
            Command::Controller(args) => controller::run(args).await,
            Command::Sidecar(args) => sidecar::run(args).await,
            Command::Get(args) => kubectl::get(args).await,
            Command::Submit(args) => kubectl::submit(args).await,
            Command::Retry(args) => kubectl::retry(args).await,
            Command::Cancel(args) => kubectl::cancel(args).await,
            Command::Describe(args) => kubectl::describe(args).await,
            Command::Pause(args) => kubectl::set_paused(args, true).await,
            Command::Resume(args) => kubectl::set_paused(args, false).await,
            Command::SmokeTest(args) => smoke::run(args).await,
            Command::Completion(args) => {
                use clap::CommandFactory;
                let name = if args.plugin {
                    PLUGIN_NAME
                } else {
                    "leasehold"
                };
                let mut command = Cli::command();
                clap_complete::generate(args.shell, &mut command, name, &mut std::io::stdout());
                Ok(())
            }
        }
    }
}

/// `value` seconds as a positive duration, or an error naming `flag`.
fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| {
            if value.is_finite() && value > 0.0 {
                format!("{flag} {value} is too large a number of seconds")
            } else {
                format!("{flag} {value} is not a positive number of seconds")
            }
        })
}

/// `--namespace`, else the kubeconfig's namespace, checked.
fn namespace_or_default(clients: &Clients, namespace: Option<String>) -> anyhow::Result<String> {
    let ns = namespace.unwrap_or_else(|| clients.requests.default_namespace().to_string());
    check_dns_label("--namespace", &ns)?;
    Ok(ns)
}

/// Clients for the cluster, found the standard way (KUBECONFIG, then in-cluster).
async fn clients() -> anyhow::Result<Clients> {
    Ok(Clients::infer().await?)
}

/// `--identity` (or POD_NAME), else the hostname, checked.
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

/// Checks that `value` of `flag` is a DNS label (RFC 1123).
fn check_dns_label(flag: &str, value: &str) -> anyhow::Result<()> {
    if !leasehold_core::crd::is_dns_label(value) {
        bail!("{flag} {value:?} is not a DNS label: 1 to 63 lowercase letters, digits and '-', starting and ending with a letter or digit");
    }
    Ok(())
}
