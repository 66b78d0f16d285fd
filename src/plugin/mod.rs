//! `kubectl leasehold`: the leasehold binary as a kubectl plugin (installed under the name
//! `kubectl-leasehold`, see README "Watch jobs from kubectl"), for people watching jobs.
//!
//! - `get` lists LeasedJobs with queue, phase, attempt, holder, last heartbeat, time until the
//!   lease runs out, and the progress the holder sent with its heartbeats (a bar and a message,
//!   read from the job's Lease: [`leasehold_core::progress`]); `-w` keeps watching.
//! - `retry` gives a Failed or Cancelled job a new attempt, keeping its history
//!   ([`retry`](fn@retry)).
//! - `cancel` sets spec.cancel; the controller ends the job (docs/protocol.md).
//! - `pause` and `resume` set spec.paused of a queue's LeasedQueue ([`queue`]).
//! - `describe` prints one job: its attempts, failures, holder, Lease and progress
//!   ([`describe`](mod@describe)).
//!
//! This module does the reads and writes; what is printed ([`view`]) and what a retry writes
//! ([`retry`](fn@retry)) are pure functions beside it.

pub mod describe;
pub mod queue;
pub mod retry;
pub mod select;
pub mod submit;
pub mod view;

use std::collections::HashMap;
use std::io::Write;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use serde_json::json;
use thiserror::Error;

use leasehold_core::crd::{LeasedJob, Phase, MANAGED_BY, MANAGED_BY_LABEL};
use leasehold_core::lease;
use leasehold_core::Category;
use leasehold_kube::api::{error_chain, is_status, Clients};
use select::{Format, Selection};
use view::Row;

/// Errors of the plugin's commands.
#[derive(Debug, Error)]
pub enum PluginError {
    /// The API server could not be asked, or refused the request.
    #[error("{what} failed: {detail}")]
    Api {
        /// What was being done, naming the object.
        what: String,
        /// The cause chain.
        detail: String,
    },
    /// No such LeasedJob.
    #[error("LeasedJob {0} not found")]
    NotFound(String),
    /// The job cannot be retried (wrong phase, bad --attempts).
    #[error(transparent)]
    NotRetryable(#[from] retry::NotRetryable),
    /// The job changed between the read and a conditional write (its resourceVersion no
    /// longer matched): nothing was written by that write.
    #[error("LeasedJob {job} changed while it was being {doing} (resourceVersion {seen} no longer current); nothing was written by that step: run the command again")]
    Changed {
        /// `namespace/name`.
        job: String,
        /// `retried`, `cancelled`.
        doing: &'static str,
        /// The resourceVersion the write was conditional on.
        seen: String,
    },
    /// The job has finished; there is nothing to cancel.
    #[error("LeasedJob {job} is already {phase}; there is nothing to cancel")]
    Finished {
        /// `namespace/name`.
        job: String,
        /// Its phase.
        phase: Phase,
    },
    /// Writing the table failed (a closed pipe).
    #[error("writing the output failed")]
    Output(#[from] std::io::Error),
    /// The idempotency key breaks its rule.
    #[error(transparent)]
    Key(#[from] leasehold_core::submit::KeyError),
    /// The traceparent breaks the W3C Trace Context rules.
    #[error(transparent)]
    TraceParent(#[from] leasehold_core::trace::TraceParentError),
    /// The key's job exists and is not this submission.
    #[error(transparent)]
    Submit(#[from] leasehold_core::submit::SubmitConflict),
    /// The job was deleted while it was awaited.
    #[error("LeasedJob {0} was deleted while it was awaited")]
    Deleted(String),
    /// The job did not finish in time (`--wait --timeout`).
    #[error("LeasedJob {job} did not finish within {}s; it goes on (kubectl leasehold get {name} -n {namespace})",
        waited.as_secs_f64(),
        name = job.rsplit('/').next().unwrap_or(job),
        namespace = job.split('/').next().unwrap_or(job))]
    Timeout {
        /// `namespace/name`.
        job: String,
        /// How long was waited.
        waited: std::time::Duration,
    },
}

impl Category for PluginError {
    /// Stable category, a short word.
    fn category(&self) -> &'static str {
        match self {
            PluginError::Api { .. } => "api",
            PluginError::NotFound(_) => "not_found",
            PluginError::NotRetryable(_) => "not_retryable",
            PluginError::Changed { .. } => "conflict",
            PluginError::Finished { .. } => "finished",
            PluginError::Output(_) => "output",
            PluginError::Key(_) => "invalid_key",
            PluginError::TraceParent(_) => "invalid_traceparent",
            PluginError::Submit(_) => "idempotency_conflict",
            PluginError::Timeout { .. } => "timeout",
            PluginError::Deleted(_) => "not_found",
        }
    }
}

fn api_error(what: impl Into<String>, e: &kube::Error) -> PluginError {
    PluginError::Api {
        what: what.into(),
        detail: error_chain(e),
    }
}

/// Which namespaces a command sees.
#[derive(Clone, Debug)]
pub enum Scope {
    /// One namespace.
    Namespace(String),
    /// Every namespace (`-A`).
    All,
}

impl Scope {
    fn api<K>(&self, client: &kube::Client) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        match self {
            Scope::Namespace(ns) => Api::namespaced(client.clone(), ns),
            Scope::All => Api::all(client.clone()),
        }
    }
}

/// The Leases leasehold manages, as a label selector.
fn managed_leases() -> String {
    format!("{MANAGED_BY_LABEL}={MANAGED_BY}")
}

/// (namespace, Lease name) of a job's Lease.
fn lease_key(job: &LeasedJob) -> (String, String) {
    let name = job
        .status
        .as_ref()
        .and_then(|s| s.lease_name.clone())
        .unwrap_or_else(|| lease::lease_name(&job.name_any()));
    (job.namespace().unwrap_or_default(), name)
}

fn lease_key_of(l: &Lease) -> (String, String) {
    (l.namespace().unwrap_or_default(), l.name_any())
}

/// The rows of `jobs` (those named in `names`, or all when it is empty) joined with `leases`,
/// sorted by namespace and name, at `now`.
fn rows(
    jobs: &HashMap<(String, String), LeasedJob>,
    leases: &HashMap<(String, String), Lease>,
    names: &[String],
    now: Timestamp,
) -> Vec<Row> {
    let mut rows: Vec<Row> = jobs
        .values()
        .filter(|j| names.is_empty() || names.contains(&j.name_any()))
        .map(|j| Row::new(j, leases.get(&lease_key(j)), now))
        .collect();
    rows.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    rows
}

/// `kubectl leasehold get [NAME...]`: prints the table of the jobs in `scope` (only those
/// named, when names are given) to `out`. Two requests: one LIST of LeasedJobs and one of the
/// Leases leasehold manages.
///
/// # Errors
/// [`PluginError::Api`] when a LIST fails; [`PluginError::Output`].
pub async fn get(
    clients: &Clients,
    scope: &Scope,
    names: &[String],
    selection: &Selection,
    format: Format,
    out: &mut impl Write,
) -> Result<(), PluginError> {
    let jobs_api: Api<LeasedJob> = scope.api(&clients.requests);
    let leases_api: Api<Lease> = scope.api(&clients.requests);
    let jobs = jobs_api
        .list(&selection.list_params())
        .await
        .map_err(|e| api_error("listing LeasedJobs", &e))?;
    if matches!(format, Format::Json | Format::Yaml) {
        let mut chosen: Vec<&LeasedJob> = jobs
            .items
            .iter()
            .filter(|j| names.is_empty() || names.contains(&j.name_any()))
            .collect();
        chosen.sort_by_key(|j| (j.namespace(), j.name_any()));
        let list = select::as_list(&chosen);
        let text = match format {
            Format::Json => {
                serde_json::to_string_pretty(&list).map_err(std::io::Error::other)? + "\n"
            }
            _ => serde_yaml::to_string(&list).map_err(std::io::Error::other)?,
        };
        out.write_all(text.as_bytes())?;
        return Ok(());
    }
    let leases = leases_api
        .list(&ListParams::default().labels(&managed_leases()))
        .await
        .map_err(|e| api_error("listing Leases", &e))?;
    let jobs: HashMap<_, _> = jobs
        .into_iter()
        .map(|j| ((j.namespace().unwrap_or_default(), j.name_any()), j))
        .collect();
    let leases: HashMap<_, _> = leases.into_iter().map(|l| (lease_key_of(&l), l)).collect();
    let rows = rows(&jobs, &leases, names, Timestamp::now());
    let with_ns = matches!(scope, Scope::All);
    if rows.is_empty() {
        match scope {
            Scope::Namespace(ns) => writeln!(out, "No LeasedJobs found in namespace {ns}.")?,
            Scope::All => writeln!(out, "No LeasedJobs found.")?,
        }
        return Ok(());
    }
    let wide = format == Format::Wide;
    let mut lines = vec![if wide {
        view::wide_header(with_ns)
    } else {
        view::header(with_ns)
    }];
    lines.extend(rows.iter().map(|r| {
        if wide {
            r.wide_cells(with_ns)
        } else {
            r.cells(with_ns)
        }
    }));
    out.write_all(view::table(&lines).as_bytes())?;
    Ok(())
}

enum Change {
    Job(Box<watcher::Event<LeasedJob>>),
    Lease(Box<watcher::Event<Lease>>),
}

/// `kubectl leasehold get -w`: prints the table once both watches have listed, then one row
/// each time a job or its Lease changes (a heartbeat moves the heartbeat, expiry and progress
/// columns), as `kubectl get -w` does. Watches, never polls; a watch that fails is resumed
/// with kube's backoff, and its errors are written to stderr. Runs until interrupted.
///
/// # Errors
/// [`PluginError::Output`] when the output is closed.
pub async fn watch(
    clients: &Clients,
    scope: &Scope,
    names: &[String],
    selection: &Selection,
    out: &mut impl Write,
) -> Result<(), PluginError> {
    let jobs_api: Api<LeasedJob> = scope.api(&clients.watches);
    let leases_api: Api<Lease> = scope.api(&clients.watches);
    let job_events = watcher(jobs_api, selection.watcher_config())
        .default_backoff()
        .map(|e| e.map(|e| Change::Job(Box::new(e))));
    let lease_events = watcher(
        leases_api,
        watcher::Config::default().labels(&managed_leases()),
    )
    .default_backoff()
    .map(|e| e.map(|e| Change::Lease(Box::new(e))));
    let mut events = std::pin::pin!(futures::stream::select(job_events, lease_events));
    let with_ns = matches!(scope, Scope::All);
    let mut jobs: HashMap<(String, String), LeasedJob> = HashMap::new();
    let mut leases: HashMap<(String, String), Lease> = HashMap::new();
    let (mut jobs_listed, mut leases_listed, mut printed) = (false, false, false);
    let mut widths: Vec<usize> = Vec::new();
    while let Some(event) = events.next().await {
        let changed: Option<(String, String)> = match event {
            Err(e) => {
                eprintln!("watch failed, resuming: {}", error_chain(&e));
                None
            }
            Ok(Change::Job(e)) => match *e {
                watcher::Event::Apply(j) | watcher::Event::InitApply(j) => {
                    let key = (j.namespace().unwrap_or_default(), j.name_any());
                    jobs.insert(key.clone(), j);
                    Some(key)
                }
                watcher::Event::Delete(j) => {
                    jobs.remove(&(j.namespace().unwrap_or_default(), j.name_any()));
                    None
                }
                watcher::Event::Init => None,
                watcher::Event::InitDone => {
                    jobs_listed = true;
                    None
                }
            },
            Ok(Change::Lease(e)) => match *e {
                watcher::Event::Apply(l) | watcher::Event::InitApply(l) => {
                    let key = lease_key_of(&l);
                    let job = jobs
                        .values()
                        .find(|j| lease_key(j) == key)
                        .map(|j| (j.namespace().unwrap_or_default(), j.name_any()));
                    leases.insert(key, l);
                    job
                }
                watcher::Event::Delete(l) => {
                    leases.remove(&lease_key_of(&l));
                    None
                }
                watcher::Event::Init => None,
                watcher::Event::InitDone => {
                    leases_listed = true;
                    None
                }
            },
        };
        if !(jobs_listed && leases_listed) {
            continue;
        }
        let now = Timestamp::now();
        if !printed {
            printed = true;
            let mut lines = vec![view::header(with_ns)];
            lines.extend(
                rows(&jobs, &leases, names, now)
                    .iter()
                    .map(|r| r.cells(with_ns)),
            );
            widths = view::widths(&lines);
            for line in &lines {
                writeln!(out, "{}", view::line(line, &mut widths))?;
            }
            out.flush()?;
            continue;
        }
        let Some(key) = changed else { continue };
        let Some(job) = jobs.get(&key) else { continue };
        if !names.is_empty() && !names.contains(&job.name_any()) {
            continue;
        }
        let row = Row::new(job, leases.get(&lease_key(job)), now);
        writeln!(out, "{}", view::line(&row.cells(with_ns), &mut widths))?;
        out.flush()?;
    }
    Ok(())
}

/// `kubectl leasehold retry NAME`: gives the Failed or Cancelled job `name` a new attempt,
/// keeping its history, with `more_attempts` failed attempts allowed from now (see
/// [`retry`](fn@retry) for exactly what is written). Every write is conditional on the resourceVersion of the
/// snapshot it was built from. Returns the job as written.
///
/// # Errors
/// [`PluginError::NotFound`]; [`PluginError::NotRetryable`] for a job that is not Failed or
/// Cancelled; [`PluginError::Changed`] when the job changed in between (run again);
/// [`PluginError::Api`].
pub async fn retry(
    clients: &Clients,
    namespace: &str,
    name: &str,
    more_attempts: i32,
) -> Result<LeasedJob, PluginError> {
    let api: Api<LeasedJob> = Api::namespaced(clients.requests.clone(), namespace);
    let job_ref = format!("{namespace}/{name}");
    let job = read_job(&api, &job_ref, name).await?;
    let job = match retry::spec_patch(&job, more_attempts)? {
        None => job,
        Some(patch) => conditional(
            api.patch(name, &PatchParams::default(), &Patch::Json::<()>(patch))
                .await,
            &job,
            "retried",
        )?,
    };
    let patch = retry::status_patch(&job, Timestamp::now(), "kubectl leasehold retry")?;
    conditional(
        api.patch_status(name, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await,
        &job,
        "retried",
    )
}

/// The result of a write conditional on `job`'s resourceVersion: a refused `test` (422) or a
/// conflict (409) is [`PluginError::Changed`].
fn conditional(
    written: Result<LeasedJob, kube::Error>,
    job: &LeasedJob,
    doing: &'static str,
) -> Result<LeasedJob, PluginError> {
    written.map_err(|e| {
        if is_status(&e, 409) || is_status(&e, 422) {
            PluginError::Changed {
                job: job.reference(),
                doing,
                seen: job.metadata.resource_version.clone().unwrap_or_default(),
            }
        } else if is_status(&e, 404) {
            PluginError::NotFound(job.reference())
        } else {
            api_error(format!("writing LeasedJob {}", job.reference()), &e)
        }
    })
}

/// `kubectl leasehold cancel NAME`: sets spec.cancel on a job that has not finished (a merge
/// patch, conditional on the resourceVersion read), for the controller to end it: a Queued
/// job at once, a Leased one with its holder told at its next heartbeat. A job already
/// Cancelled is left as it is. Returns the job as written.
///
/// # Errors
/// [`PluginError::NotFound`]; [`PluginError::Finished`] for a Succeeded or Failed job;
/// [`PluginError::Changed`] when the job changed in between (run again); [`PluginError::Api`].
pub async fn cancel(
    clients: &Clients,
    namespace: &str,
    name: &str,
) -> Result<LeasedJob, PluginError> {
    let api: Api<LeasedJob> = Api::namespaced(clients.requests.clone(), namespace);
    let job_ref = format!("{namespace}/{name}");
    let job = read_job(&api, &job_ref, name).await?;
    match job.phase() {
        Phase::Cancelled => return Ok(job),
        phase @ (Phase::Succeeded | Phase::Failed) => {
            return Err(PluginError::Finished {
                job: job_ref,
                phase,
            })
        }
        Phase::Queued | Phase::Leased => {}
    }
    let patch = json!({
        "metadata": {"resourceVersion": job.metadata.resource_version},
        "spec": {"cancel": true},
    });
    conditional(
        api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await,
        &job,
        "cancelled",
    )
}

/// The names of the jobs of namespace `namespace` that `selection` picks, sorted.
///
/// # Errors
/// [`PluginError::Api`] when they cannot be listed.
pub async fn selected(
    clients: &Clients,
    namespace: &str,
    selection: &Selection,
) -> Result<Vec<String>, PluginError> {
    let api: Api<LeasedJob> = Api::namespaced(clients.requests.clone(), namespace);
    let jobs = api.list(&selection.list_params()).await.map_err(|e| {
        api_error(
            format!(
                "listing the LeasedJobs of namespace {namespace} ({})",
                selection.describe()
            ),
            &e,
        )
    })?;
    let mut names: Vec<String> = jobs.items.iter().map(ResourceExt::name_any).collect();
    names.sort();
    Ok(names)
}

/// `kubectl leasehold describe NAME`: the description of job `name` of `namespace`
/// ([`describe`](mod@describe)), with its Lease.
///
/// # Errors
/// [`PluginError::NotFound`]; [`PluginError::Api`].
pub async fn describe_job(
    clients: &Clients,
    namespace: &str,
    name: &str,
) -> Result<String, PluginError> {
    let jobs: Api<LeasedJob> = Api::namespaced(clients.requests.clone(), namespace);
    let leases: Api<Lease> = Api::namespaced(clients.requests.clone(), namespace);
    let job_ref = format!("{namespace}/{name}");
    let job = read_job(&jobs, &job_ref, name).await?;
    let (_, lease_name) = lease_key(&job);
    let lease = leases
        .get_opt(&lease_name)
        .await
        .map_err(|e| api_error(format!("reading Lease {namespace}/{lease_name}"), &e))?;
    Ok(describe::describe(&job, lease.as_ref(), Timestamp::now()))
}

/// The job `name` through `api`, `job_ref` (`namespace/name`) naming it in errors.
///
/// # Errors
/// [`PluginError::NotFound`]; [`PluginError::Api`].
async fn read_job(
    api: &Api<LeasedJob>,
    job_ref: &str,
    name: &str,
) -> Result<LeasedJob, PluginError> {
    api.get_opt(name)
        .await
        .map_err(|e| api_error(format!("reading LeasedJob {job_ref}"), &e))?
        .ok_or_else(|| PluginError::NotFound(job_ref.to_string()))
}
