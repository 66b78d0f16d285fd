//! The leader's adoption of the jobs Leased before a limit existed
//! ([`leasehold_kube::adopt`]): on every status pass, each LeasedQueue that sets a limit has
//! its Leased jobs (from the controller's cache) checked against its slots, and each one no
//! slot counts is given one. A pass that leaves every job counted confirms the queue's limits
//! in its status (`slotsAdopted`), which lets sidecars claim under them.
//!
//! Passes go on after the confirmation: a job claimed without a slot by a sidecar that had
//! not seen the limit yet is adopted at the next one (docs/protocol.md, "Limits").

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, ResourceExt};
use tracing::{info, warn};

use super::Context;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::queue::LeasedQueue;
use leasehold_core::slots;

/// What a pass found for each of `queues`, in order: `Some(value)` for `status.slotsAdopted`
/// when the queue sets limits and every Leased job of it is counted by its slots now, `None`
/// otherwise (no limits, or not confirmed in this pass). Writes only while this replica leads.
pub(super) async fn pass(ctx: &Context, queues: &[Arc<LeasedQueue>]) -> Vec<Option<String>> {
    let mut out = vec![None; queues.len()];
    // namespace -> queue -> index, for the queues that set a limit.
    let mut index: HashMap<&str, HashMap<&str, usize>> = HashMap::new();
    for (i, q) in queues.iter().enumerate() {
        if let (Some(_), Some(ns), Some(name)) = (
            slots::adoption_of(q),
            q.metadata.namespace.as_deref(),
            q.metadata.name.as_deref(),
        ) {
            index.entry(ns).or_default().insert(name, i);
        }
    }
    if index.is_empty() {
        return out;
    }
    let mut leased: Vec<Vec<LeasedJob>> = vec![Vec::new(); queues.len()];
    {
        let jobs = ctx.jobs.lock().unwrap();
        for (key, record) in jobs.records() {
            if record.phase() != Phase::Leased {
                continue;
            }
            let found = index
                .get(&*key.namespace)
                .and_then(|q| q.get(record.queue()));
            if let (Some(&i), Some(job)) = (found, jobs.job(key)) {
                leased[i].push(job);
            }
        }
    }
    for (i, q) in queues.iter().enumerate() {
        let Some(wanted) = slots::adoption_of(q) else {
            continue;
        };
        if !ctx.leadership.is_leader() {
            break;
        }
        let ns = q.namespace().unwrap_or_default();
        let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), &ns);
        let jobs: Api<LeasedJob> = Api::namespaced(ctx.client.clone(), &ns);
        let queue = format!("{ns}/{}", q.name_any());
        match leasehold_kube::adopt::adopt(&leases, &jobs, q, &leased[i], &ctx.field_manager).await
        {
            Ok(done) => {
                if done.adopted > 0 {
                    info!(queue = %queue, adopted = done.adopted, "Gave slots to {} Leased jobs of queue {queue} that held none (Leased before its limit, or by a sidecar that had not seen it)", done.adopted);
                }
                if done.complete {
                    out[i] = Some(wanted);
                }
            }
            Err(e) => {
                warn!(queue = %queue, error = %leasehold_kube::api::error_chain(&e), "Giving slots to the Leased jobs of queue {queue} failed; its new limits allow no claim until a pass succeeds; retrying");
            }
        }
    }
    out
}
