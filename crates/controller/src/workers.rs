//! The controller's loops: the job watch keeps the slim cache ([`Context::jobs`]) and queues
//! every job that changes, the Lease watch queues the job of every Lease that changes, and
//! [`RECONCILE_CONCURRENCY`](crate::RECONCILE_CONCURRENCY) workers reconcile what the queue
//! hands out.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::{watcher, WatchStreamExt};
use tracing::warn;

use leasehold_core::crd::LeasedJob;
use leasehold_core::job_cache::JobKey;
use leasehold_kube::watch;

use crate::workqueue::WorkQueue;
use crate::{error_policy, reconcile, Action, Context, ERROR_REQUEUE};

/// Keeps [`Context::jobs`] from the job watch and queues every job added or changed for a
/// reconcile.
pub(crate) async fn follow_jobs(
    stream: impl futures::Stream<Item = Result<watcher::Event<LeasedJob>, watcher::Error>>
        + Send
        + 'static,
    ctx: Arc<Context>,
    queue: Arc<WorkQueue<JobKey>>,
) {
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                watch::log_error("LeasedJob", &e);
                continue;
            }
        };
        let mut jobs = ctx.jobs.lock().unwrap();
        match event {
            watcher::Event::Apply(job) | watcher::Event::InitApply(job) => {
                if let Some(key) = jobs.apply(&job) {
                    drop(jobs);
                    queue.add(key);
                }
            }
            watcher::Event::Delete(job) => jobs.delete(&job),
            watcher::Event::Init => jobs.relist_began(),
            watcher::Event::InitDone => {
                jobs.relist_done();
            }
        }
    }
}

/// Queues the job owning each Lease added or changed (the Lease cache itself is kept by the
/// stream's reflector): a renewal may change what its job's expiry is judged on.
pub(crate) async fn follow_leases(
    stream: impl futures::Stream<Item = Result<watcher::Event<Lease>, watcher::Error>> + Send + 'static,
    ctx: Arc<Context>,
    queue: Arc<WorkQueue<JobKey>>,
) {
    let stream = watch::errors_logged("Lease", stream.applied_objects());
    let mut stream = std::pin::pin!(stream);
    while let Some(lease) = stream.next().await {
        let Ok(lease) = lease else { continue };
        let Some(ns) = lease.metadata.namespace.as_deref() else {
            continue;
        };
        for owner in leasehold_core::lease::job_owners(&lease) {
            let key = ctx.jobs.lock().unwrap().key(ns, &owner.name);
            queue.add(key);
        }
    }
}

/// One of [`RECONCILE_CONCURRENCY`] workers: reconciles the jobs the queue hands out, one at
/// a time, from the slim cache's copy, and queues each again as its reconcile asks. A
/// reconcile runs as a task of its own, so that one that panics (a bug) is logged and retried
/// like a failed one instead of taking the worker, and the job's place in the queue, with it.
pub(crate) async fn work(queue: Arc<WorkQueue<JobKey>>, ctx: Arc<Context>) {
    while let Some(key) = queue.take().await {
        let job = ctx.jobs.lock().unwrap().job(&key);
        if let Some(job) = job.map(Arc::new) {
            let run = tokio::spawn(reconcile(Arc::clone(&job), Arc::clone(&ctx)));
            let next = match run.await {
                Ok(Ok(action)) => action,
                Ok(Err(e)) => error_policy(&job, &e),
                Err(e) => {
                    warn!(job = %job.reference(), error = %e, "reconcile panicked; retrying");
                    Action::requeue(ERROR_REQUEUE)
                }
            };
            if let Action::Requeue(after) = next {
                queue.add_after(key.clone(), after);
            }
        }
        queue.done(&key);
    }
}
