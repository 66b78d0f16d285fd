//! The kubectl plugin's subcommands (`kubectl leasehold get|retry|cancel|pause|resume`).

use leasehold_core::crd;

use super::{clients, namespace_or_default};
use crate::plugin;

/// List LeasedJobs with queue, phase, attempt, holder, last heartbeat, time until the lease
/// runs out, and the progress their worker reported (`kubectl leasehold get`).
#[derive(clap::Args)]
pub struct GetArgs {
    /// Only these jobs (default: all in the namespace).
    names: Vec<String>,
    #[command(flatten)]
    scope: ScopeArgs,
    /// After listing, keep watching: print a job's row again each time it or its Lease
    /// changes (every heartbeat).
    #[arg(short = 'w', long)]
    watch: bool,
}

/// Give a Failed or Cancelled LeasedJob a new attempt, keeping its failures, checkpoint and
/// attempt count (`kubectl leasehold retry`).
#[derive(clap::Args)]
pub struct RetryArgs {
    /// The job's name.
    name: String,
    /// Namespace of the job (default: the kubeconfig's).
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// Failed attempts allowed from now on: spec.maxAttempts is raised to the failures so
    /// far plus this, when it is lower.
    #[arg(long, default_value_t = 1)]
    attempts: i32,
}

/// Cancel a LeasedJob: set spec.cancel, for the controller to end it (`kubectl leasehold
/// cancel`).
#[derive(clap::Args)]
pub struct CancelArgs {
    /// The job's name.
    name: String,
    /// Namespace of the job (default: the kubeconfig's).
    #[arg(short = 'n', long)]
    namespace: Option<String>,
}

/// Stop new claims of a queue: set spec.paused of its LeasedQueue, creating it if need be
/// (`kubectl leasehold pause`); `resume` lets them go on. Jobs already Leased are not touched.
#[derive(clap::Args)]
pub struct QueueArgs {
    /// The queue's name (the jobs' spec.queue).
    queue: String,
    /// Namespace of the queue (default: the kubeconfig's).
    #[arg(short = 'n', long)]
    namespace: Option<String>,
}

/// Which namespaces `get` looks at.
#[derive(clap::Args)]
pub struct ScopeArgs {
    /// Namespace of the jobs (default: the kubeconfig's).
    #[arg(short = 'n', long, conflicts_with = "all_namespaces")]
    namespace: Option<String>,
    /// Jobs of every namespace.
    #[arg(short = 'A', long)]
    all_namespaces: bool,
}

/// Lists (and with `--watch`, follows) LeasedJobs.
///
/// # Errors
/// Bad flags, an unreachable API server, or the API server's refusal, with the job named.
pub async fn get(args: GetArgs) -> anyhow::Result<()> {
    let GetArgs {
        names,
        scope,
        watch,
    } = args;
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

/// Gives a Failed or Cancelled job a new attempt and says so.
///
/// # Errors
/// Bad flags, an unreachable API server, or the API server's refusal, with the job named.
pub async fn retry(args: RetryArgs) -> anyhow::Result<()> {
    let RetryArgs {
        name,
        namespace,
        attempts,
    } = args;
    let clients = clients().await?;
    let ns = namespace_or_default(&clients, namespace)?;
    let job = plugin::retry(&clients, &ns, &name, attempts).await?;
    println!(
        "LeasedJob {} retried: Queued; its next claim is attempt {} (failed attempts so far: {}, maxAttempts {})",
        job.reference(),
        job.attempt() + 1,
        job.failed_attempts(),
        job.spec
            .max_attempts
            .unwrap_or_else(|| job.policy().max_attempts)
    );
    Ok(())
}

/// Cancels a job and says what happens next.
///
/// # Errors
/// Bad flags, an unreachable API server, or the API server's refusal, with the job named.
pub async fn cancel(args: CancelArgs) -> anyhow::Result<()> {
    let CancelArgs { name, namespace } = args;
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

/// Pauses (`paused`) or resumes a queue and says what that means.
///
/// # Errors
/// Bad flags, an unreachable API server, or the API server's refusal, with the queue named.
pub async fn set_paused(args: QueueArgs, paused: bool) -> anyhow::Result<()> {
    let QueueArgs { queue, namespace } = args;
    let clients = clients().await?;
    let ns = namespace_or_default(&clients, namespace)?;
    match plugin::queue::set_paused(&clients, &ns, &queue, paused).await? {
        plugin::queue::Outcome::NoObject => println!(
            "Queue {ns}/{queue} has no LeasedQueue: it is not paused; nothing was written"
        ),
        plugin::queue::Outcome::Written(_) if paused => println!(
            "Queue {ns}/{queue} paused: no new claims within a second; Leased jobs go on (`kubectl get lq {queue} -n {ns}`)"
        ),
        plugin::queue::Outcome::Written(_) => {
            println!("Queue {ns}/{queue} resumed: claims go on within a second")
        }
    }
    Ok(())
}
