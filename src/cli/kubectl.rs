//! The kubectl plugin's subcommands (`kubectl leasehold get|submit|retry|cancel|describe|pause|resume`).

use leasehold_core::crd;

use anyhow::{bail, Context as _};
use kube::config::{KubeConfigOptions, Kubeconfig};
use leasehold_kube::api::Clients;

use super::{check_dns_label, clients, namespace_or_default};
use crate::plugin;
use crate::plugin::select::{Format, Selection};

/// List LeasedJobs with queue, phase, attempt, holder, last heartbeat, time until the lease
/// runs out, and the progress their worker reported (`kubectl leasehold get`).
#[derive(clap::Args)]
pub struct GetArgs {
    /// Only these jobs (default: all in the namespace).
    names: Vec<String>,
    #[command(flatten)]
    scope: ScopeArgs,
    #[command(flatten)]
    select: SelectArgs,
    /// Output format: `wide` (the table with priority, concurrency key, lease and
    /// maxAttempts), `json` or `yaml` (the jobs as a v1 List, as `kubectl get -o json`).
    #[arg(short = 'o', long, value_enum)]
    output: Option<Format>,
    /// After listing, keep watching: print a job's row again each time it or its Lease
    /// changes (every heartbeat). Prints the table only.
    #[arg(short = 'w', long, conflicts_with = "output")]
    watch: bool,
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// Which jobs, when not named: every condition given must hold; the API server selects.
#[derive(clap::Args)]
pub struct SelectArgs {
    /// Label selector, as kubectl takes it (e.g. `team=media,tier!=batch`).
    #[arg(short = 'l', long = "selector", value_name = "SELECTOR")]
    labels: Option<String>,
    /// Only the jobs of this queue (spec.queue).
    #[arg(long)]
    queue: Option<String>,
    /// Only the jobs in this phase: Queued, Leased, Succeeded, Failed or Cancelled.
    #[arg(long, value_parser = plugin::select::parse_phase)]
    phase: Option<crd::Phase>,
}

impl SelectArgs {
    /// The selection, its queue checked.
    fn selection(self) -> anyhow::Result<Selection> {
        if let Some(q) = &self.queue {
            check_dns_label("--queue", q)?;
        }
        if let Some(l) = &self.labels {
            if l.trim().is_empty() {
                bail!("--selector is empty: give a label selector such as team=media");
            }
        }
        Ok(Selection {
            labels: self.labels,
            queue: self.queue,
            phase: self.phase,
        })
    }
}

/// Which cluster: the kubeconfig and context to use instead of the standard ones (KUBECONFIG
/// or ~/.kube/config, its current context; then the in-cluster service account).
#[derive(clap::Args)]
pub struct ClusterArgs {
    /// Path of the kubeconfig file to use.
    #[arg(long, value_name = "PATH")]
    kubeconfig: Option<std::path::PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, value_name = "NAME")]
    context: Option<String>,
}

impl ClusterArgs {
    /// Clients for the cluster these flags name.
    async fn clients(&self) -> anyhow::Result<Clients> {
        if self.kubeconfig.is_none() && self.context.is_none() {
            return clients().await;
        }
        let kubeconfig = match &self.kubeconfig {
            Some(path) => Kubeconfig::read_from(path)
                .with_context(|| format!("--kubeconfig {}: cannot read it", path.display()))?,
            None => Kubeconfig::read()
                .context("reading the kubeconfig (KUBECONFIG, or ~/.kube/config) for --context")?,
        };
        if let Some(context) = &self.context {
            if !kubeconfig.contexts.iter().any(|c| &c.name == context) {
                let known: Vec<&str> = kubeconfig
                    .contexts
                    .iter()
                    .map(|c| c.name.as_str())
                    .collect();
                bail!(
                    "--context {context:?}: the kubeconfig has no such context (it has: {})",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                );
            }
        }
        let options = KubeConfigOptions {
            context: self.context.clone(),
            ..KubeConfigOptions::default()
        };
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
            .await
            .context("building a client from the kubeconfig")?;
        Ok(Clients::from_config(config)?)
    }
}

/// Give a Failed or Cancelled LeasedJob a new attempt, keeping its failures, checkpoint and
/// attempt count (`kubectl leasehold retry`).
#[derive(clap::Args)]
pub struct RetryArgs {
    /// The job's name; or select jobs with -l, --queue or --phase (each Failed or Cancelled
    /// one of them is retried).
    name: Option<String>,
    #[command(flatten)]
    select: SelectArgs,
    /// Namespace of the job (default: the kubeconfig's).
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// Failed attempts allowed from now on: spec.maxAttempts is raised to the failures so
    /// far plus this, when it is lower.
    #[arg(long, default_value_t = 1)]
    attempts: i32,
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// Cancel a LeasedJob: set spec.cancel, for the controller to end it (`kubectl leasehold
/// cancel`).
#[derive(clap::Args)]
pub struct CancelArgs {
    /// The job's name; or select jobs with -l, --queue or --phase (each one of them not
    /// finished yet is cancelled).
    name: Option<String>,
    #[command(flatten)]
    select: SelectArgs,
    /// Namespace of the job (default: the kubeconfig's).
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// Show one LeasedJob: its attempts and failures, who holds it, its Lease (heartbeat, time
/// left, progress) and its checkpoint (`kubectl leasehold describe`).
#[derive(clap::Args)]
pub struct DescribeArgs {
    /// The job's name.
    name: String,
    /// Namespace of the job (default: the kubeconfig's).
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// Prints one job's description.
///
/// # Errors
/// Bad flags, an unreachable API server, or the API server's refusal, with the job named.
pub async fn describe(args: DescribeArgs) -> anyhow::Result<()> {
    let DescribeArgs {
        name,
        namespace,
        cluster,
    } = args;
    let clients = cluster.clients().await?;
    let ns = namespace_or_default(&clients, namespace)?;
    print!("{}", plugin::describe_job(&clients, &ns, &name).await?);
    Ok(())
}

/// Submit a LeasedJob to a queue, idempotently with --key (`kubectl leasehold submit`).
#[derive(clap::Args)]
pub struct SubmitArgs {
    /// The queue (spec.queue): a DNS label.
    queue: String,
    /// The payload, as JSON (default `{}`).
    #[arg(long, value_name = "JSON", conflicts_with = "payload_file")]
    payload: Option<String>,
    /// Read the payload, as JSON, from this file (`-`: standard input).
    #[arg(long, value_name = "PATH")]
    payload_file: Option<std::path::PathBuf>,
    /// Idempotency key: submitting again with the same key (and spec) returns the same job,
    /// from any producer; with another spec it is refused. The job is named
    /// `<queue>-<16 hex digits of the key's SHA-256>` unless --name is given.
    #[arg(long, value_name = "KEY")]
    key: Option<String>,
    /// The job's name (default: from --key, else generated as `<queue>-<random>`).
    #[arg(long)]
    name: Option<String>,
    /// spec.priority: higher is claimed first.
    #[arg(long, allow_negative_numbers = true)]
    priority: Option<i32>,
    /// spec.leaseDurationSeconds, 5 to 86400.
    #[arg(long, value_name = "SECONDS")]
    lease_duration: Option<i32>,
    /// spec.maxAttempts: failed attempts that end the job, at least 1.
    #[arg(long, value_name = "N")]
    max_attempts: Option<i32>,
    /// spec.notBefore: not claimed before this time (RFC 3339, e.g. 2026-12-05T18:00:00Z).
    #[arg(long, value_name = "TIME")]
    not_before: Option<String>,
    /// spec.concurrencyKey: the key its LeasedQueue's limits and fair sharing count it under.
    #[arg(long, value_name = "KEY")]
    concurrency_key: Option<String>,
    /// A label of the job, `key=value` (repeat for more).
    #[arg(short = 'l', long = "label", value_name = "KEY=VALUE")]
    labels: Vec<String>,
    /// The producer's W3C trace context, `00-<32 hex trace-id>-<16 hex parent-id>-<2 hex
    /// flags>`, set as the job's annotation leasehold.dev/traceparent: the worker's span is
    /// made its child. Default: the environment variable TRACEPARENT (OpenTelemetry's
    /// convention for passing a trace context to a command), when set and not empty (a
    /// malformed one is ignored with a warning).
    #[arg(long, value_name = "TRACEPARENT")]
    traceparent: Option<String>,
    /// Wait until the job finishes: print its result (Succeeded, exit 0), or its phase,
    /// reason and failures (Failed or Cancelled, exit 1).
    #[arg(long)]
    wait: bool,
    /// With --wait: give up after this many seconds (exit 1; the job goes on).
    #[arg(long, value_name = "SECONDS", requires = "wait")]
    timeout: Option<f64>,
    /// Print the job: `name` (its name only), `json` or `yaml`; default a sentence.
    #[arg(short = 'o', long, value_name = "FORMAT", value_parser = ["name", "json", "yaml"])]
    output: Option<String>,
    /// Namespace of the job (default: the kubeconfig's).
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// Submits a job and says what became of it; with --wait, waits for its outcome.
///
/// # Errors
/// Bad flags (naming the flag, the value and the rule), a key whose job exists with another
/// spec, the API server's refusal of the job (naming the field), a job that failed or was
/// cancelled (with --wait), or a timeout.
pub async fn submit(args: SubmitArgs) -> anyhow::Result<()> {
    let SubmitArgs {
        queue,
        payload,
        payload_file,
        key,
        name,
        priority,
        lease_duration,
        max_attempts,
        not_before,
        concurrency_key,
        labels,
        traceparent,
        wait,
        timeout,
        output,
        namespace,
        cluster,
    } = args;
    check_dns_label("queue", &queue)?;
    let payload = match (payload, payload_file) {
        (Some(text), _) => serde_json::from_str(&text)
            .with_context(|| format!("--payload is not JSON: {}", shown(&text)))?,
        (None, Some(path)) => {
            let text = if path.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin())
                    .context("reading the payload from standard input")?
            } else {
                std::fs::read_to_string(&path)
                    .with_context(|| format!("--payload-file {}: cannot read it", path.display()))?
            };
            serde_json::from_str(&text)
                .with_context(|| format!("--payload-file {}: not JSON", path.display()))?
        }
        (None, None) => serde_json::json!({}),
    };
    // As the Python producer takes None: no payload. (A null would not be stored.)
    let payload = if payload.is_null() {
        serde_json::json!({})
    } else {
        payload
    };
    if let Some(number) = leasehold_core::submit::out_of_range_number(&payload) {
        bail!("the payload's number {number} is beyond the 64-bit integer range: the API server would store it as a rounded float; send it as a string");
    }
    if let Some(k) = &key {
        leasehold_core::submit::check_key(k)?;
    }
    if let Some(n) = &name {
        if !crd::is_dns_subdomain(n) {
            bail!("--name {n:?} is not a valid LeasedJob name (a lowercase RFC 1123 subdomain of at most 253 characters)");
        }
    }
    let mut label_map = std::collections::BTreeMap::new();
    for label in labels {
        let Some((k, v)) = label.split_once('=') else {
            bail!("--label {label:?} is not KEY=VALUE");
        };
        label_map.insert(k.to_string(), v.to_string());
    }
    let timeout = timeout
        .map(|t| super::seconds("--timeout", t))
        .transpose()?;
    let (traceparent, ignored) = traceparent_given(traceparent, std::env::var("TRACEPARENT").ok())?;
    if let Some(warning) = ignored {
        eprintln!("{warning}");
    }
    let submission = plugin::submit::Submission {
        queue,
        payload,
        key,
        name,
        priority,
        lease_duration_seconds: lease_duration,
        max_attempts,
        not_before,
        concurrency_key,
        labels: label_map,
        traceparent,
    };
    let clients = cluster.clients().await?;
    let ns = namespace_or_default(&clients, namespace)?;
    let (job, created) = plugin::submit::submit(&clients, &ns, &submission).await?;
    use kube::ResourceExt;
    match output.as_deref() {
        Some("name") => println!("{}", job.name_any()),
        Some("json") => println!("{}", serde_json::to_string_pretty(&job)?),
        Some("yaml") => print!("{}", serde_yaml::to_string(&job)?),
        _ if wait => {}
        _ if created => println!(
            "LeasedJob {} submitted to queue {}",
            job.reference(),
            job.spec.queue
        ),
        _ => println!(
            "LeasedJob {} was already submitted with this key ({}): unchanged",
            job.reference(),
            job.phase()
        ),
    }
    if !wait {
        return Ok(());
    }
    let done = plugin::submit::await_finished(&clients, &ns, &job.name_any(), timeout).await?;
    let text = plugin::submit::outcome_text(&done);
    if done.phase() == crd::Phase::Succeeded {
        println!("{text}");
        Ok(())
    } else {
        bail!("{text}")
    }
}

/// The traceparent to submit with: `--traceparent`, else the environment's `TRACEPARENT` when
/// not empty, checked by the W3C Trace Context rules ([`leasehold_core::trace`]). A malformed
/// flag is an error; a malformed `TRACEPARENT` is ignored with a warning (the second item), as
/// OpenTelemetry's propagators ignore a malformed incoming context and start a new trace: a
/// context inherited from the environment must not stop a submit.
///
/// # Errors
/// A malformed `--traceparent`, naming the flag, the value and the rule.
fn traceparent_given(
    flag: Option<String>,
    env: Option<String>,
) -> anyhow::Result<(Option<String>, Option<String>)> {
    match (flag, env) {
        (Some(flag), _) => match leasehold_core::trace::parse_traceparent(&flag) {
            Ok(_) => Ok((Some(flag), None)),
            Err(e) => bail!("--traceparent: {e}"),
        },
        (None, Some(env)) if !env.is_empty() => {
            match leasehold_core::trace::parse_traceparent(&env) {
                Ok(_) => Ok((Some(env), None)),
                Err(e) => Ok((
                    None,
                    Some(format!(
                        "warning: the environment variable TRACEPARENT is ignored: {e}"
                    )),
                )),
            }
        }
        (None, _) => Ok((None, None)),
    }
}

/// `text` cut to 80 characters, for messages.
fn shown(text: &str) -> String {
    let cut: String = text.chars().take(80).collect();
    if cut.len() < text.len() {
        format!("{cut:?}...")
    } else {
        format!("{cut:?}")
    }
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
    #[command(flatten)]
    cluster: ClusterArgs,
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
        select,
        output,
        watch,
        cluster,
    } = args;
    let selection = select.selection()?;
    let clients = cluster.clients().await?;
    let scope = if scope.all_namespaces {
        plugin::Scope::All
    } else {
        plugin::Scope::Namespace(namespace_or_default(&clients, scope.namespace)?)
    };
    let mut out = std::io::stdout().lock();
    if watch {
        plugin::watch(&clients, &scope, &names, &selection, &mut out).await?;
    } else {
        let format = output.unwrap_or_default();
        plugin::get(&clients, &scope, &names, &selection, format, &mut out).await?;
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
        select,
        namespace,
        attempts,
        cluster,
    } = args;
    let target = Target::of(name, select)?;
    let clients = cluster.clients().await?;
    let ns = namespace_or_default(&clients, namespace)?;
    let names = target.names(&clients, &ns).await?;
    let mut tally = Tally::default();
    for name in &names {
        match plugin::retry(&clients, &ns, name, attempts).await {
            Ok(job) => {
                tally.done += 1;
                println!(
                    "LeasedJob {} retried: Queued; its next claim is attempt {} (failed attempts so far: {}, maxAttempts {})",
                    job.reference(),
                    job.attempt() + 1,
                    job.failed_attempts(),
                    job.spec
                        .max_attempts
                        .unwrap_or_else(|| job.policy().max_attempts)
                );
            }
            Err(plugin::PluginError::NotRetryable(e)) if target.is_selection() => {
                tally.skipped += 1;
                println!("LeasedJob {ns}/{name} skipped: {e}");
            }
            Err(e) => tally.failed(&target, e)?,
        }
    }
    tally.finish(&target, &ns, "retried", "not Failed or Cancelled")
}

/// Cancels a job, or the jobs selected, and says what happens next.
///
/// # Errors
/// Bad flags, an unreachable API server, or the API server's refusal, with the job named.
pub async fn cancel(args: CancelArgs) -> anyhow::Result<()> {
    let CancelArgs {
        name,
        select,
        namespace,
        cluster,
    } = args;
    let target = Target::of(name, select)?;
    let clients = cluster.clients().await?;
    let ns = namespace_or_default(&clients, namespace)?;
    let names = target.names(&clients, &ns).await?;
    let mut tally = Tally::default();
    for name in &names {
        let job = match plugin::cancel(&clients, &ns, name).await {
            Ok(job) => job,
            Err(plugin::PluginError::Finished { job, phase }) if target.is_selection() => {
                tally.skipped += 1;
                println!("LeasedJob {job} skipped: already {phase}");
                continue;
            }
            Err(e) => {
                tally.failed(&target, e)?;
                continue;
            }
        };
        tally.done += 1;
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
    }
    tally.finish(&target, &ns, "cancelled", "already finished")
}

/// The jobs a `retry` or `cancel` acts on: one named, or those a selection picks.
enum Target {
    Named(String),
    Selected(Selection),
}

impl Target {
    /// A name or a selection, not both, not neither.
    fn of(name: Option<String>, select: SelectArgs) -> anyhow::Result<Target> {
        let selection = select.selection()?;
        match (name, selection.is_empty()) {
            (Some(_), false) => bail!(
                "give a job's name or select jobs with -l, --queue or --phase, not both ({})",
                selection.describe()
            ),
            (Some(name), true) => Ok(Target::Named(name)),
            (None, false) => Ok(Target::Selected(selection)),
            (None, true) => {
                bail!("name a job, or select jobs with -l, --queue or --phase")
            }
        }
    }

    fn is_selection(&self) -> bool {
        matches!(self, Target::Selected(_))
    }

    /// The names to act on, in namespace `ns`.
    async fn names(&self, clients: &Clients, ns: &str) -> anyhow::Result<Vec<String>> {
        match self {
            Target::Named(name) => Ok(vec![name.clone()]),
            Target::Selected(selection) => Ok(plugin::selected(clients, ns, selection).await?),
        }
    }
}

/// What a `retry` or `cancel` of several jobs came to.
#[derive(Default)]
struct Tally {
    done: usize,
    skipped: usize,
    failures: usize,
}

impl Tally {
    /// One job's failure: the error itself for a named job; printed and counted for a
    /// selection, whose other jobs go on.
    fn failed(&mut self, target: &Target, e: plugin::PluginError) -> anyhow::Result<()> {
        if !target.is_selection() {
            return Err(e.into());
        }
        self.failures += 1;
        eprintln!("error: {e}");
        Ok(())
    }

    /// The summary line of a selection; an error when any job failed.
    fn finish(self, target: &Target, ns: &str, done: &str, skipped: &str) -> anyhow::Result<()> {
        let Target::Selected(selection) = target else {
            return Ok(());
        };
        let total = self.done + self.skipped + self.failures;
        if total == 0 {
            println!(
                "No LeasedJobs in namespace {ns} match ({})",
                selection.describe()
            );
            return Ok(());
        }
        println!(
            "{total} LeasedJobs matched ({}): {} {done}, {} skipped ({skipped}), {} failed",
            selection.describe(),
            self.done,
            self.skipped,
            self.failures
        );
        if self.failures > 0 {
            bail!(
                "{} of {total} LeasedJobs could not be {done}",
                self.failures
            );
        }
        Ok(())
    }
}

/// Pauses (`paused`) or resumes a queue and says what that means.
///
/// # Errors
/// Bad flags, an unreachable API server, or the API server's refusal, with the queue named.
pub async fn set_paused(args: QueueArgs, paused: bool) -> anyhow::Result<()> {
    let QueueArgs {
        queue,
        namespace,
        cluster,
    } = args;
    let clients = cluster.clients().await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traceparent_comes_from_the_flag_else_the_environment() {
        let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
        let given = |flag: Option<&str>, env: Option<&str>| {
            traceparent_given(flag.map(Into::into), env.map(Into::into))
        };
        assert_eq!(given(None, None).unwrap(), (None, None));
        assert_eq!(given(None, Some("")).unwrap(), (None, None));
        assert_eq!(
            given(Some(valid), Some(other)).unwrap().0.as_deref(),
            Some(valid)
        );
        assert_eq!(given(None, Some(other)).unwrap().0.as_deref(), Some(other));
        // A malformed flag is refused naming it; a malformed environment is ignored, said.
        let refused = given(Some("00-xyz"), Some(other)).unwrap_err().to_string();
        assert!(
            refused.starts_with("--traceparent: \"00-xyz\" is not a valid W3C traceparent"),
            "{refused}"
        );
        let (none, warning) = given(None, Some("00-xyz")).unwrap();
        assert_eq!(none, None);
        assert!(warning.unwrap().contains("TRACEPARENT is ignored"));
    }
}
