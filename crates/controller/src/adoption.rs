//! The leader's adoption of the jobs Leased before a limit existed
//! ([`leasehold_kube::adopt`]): on every status pass, each LeasedQueue that sets a limit has
//! its Leased jobs checked against its slots, and each one no slot counts is given one; slots
//! above a limit are tidied. A pass that leaves every job counted confirms the queue's limits
//! in its status (`slotsAdopted`), which lets sidecars claim under them.
//!
//! The Leased jobs are listed afresh from the API server for each pass (a consistent read,
//! made after the LeasedQueue was seen with its limits), not taken from the controller's
//! cache: the cache's watch and the LeasedQueue's are separate streams, and a job whose claim
//! the cache had not brought yet would be missed. The confirmation is written only by a pass
//! that found every job counted, by a patch conditional on the LeasedQueue's resourceVersion
//! the pass read, so that a pass on a stale copy writes nothing. A LeasedQueue seen without
//! limits has its confirmation removed at once ([`clear`]), so that limits set again wait for
//! an adoption of their own.
//!
//! Passes go on after the confirmation: a job claimed without a slot by a sidecar that had
//! not seen the limit yet is adopted at the next one (docs/protocol.md, "Limits").

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use std::time::Instant;
use tracing::{info, warn};

use super::Context;
use leasehold_core::adoption;
use leasehold_core::crd::LeasedJob;
use leasehold_core::job_cache::JobKey;
use leasehold_core::queue::LeasedQueue;
use leasehold_kube::adopt::Freeing;
use leasehold_kube::api::{error_chain, is_status};

/// Adopts the Leased jobs of `q` (a LeasedQueue that sets limits) and tidies its slots; when
/// every Leased job is counted and the status does not say so yet, writes `slotsAdopted`
/// conditional on `q`'s resourceVersion. Writes only while this replica leads; failures are
/// logged and the next pass tries again.
pub(super) async fn pass(ctx: &Context, q: &LeasedQueue) {
    let Some(wanted) = adoption::adoption_of(q) else {
        return;
    };
    if !ctx.leadership.is_leader() {
        return;
    }
    let ns = q.namespace().unwrap_or_default();
    let name = q.name_any();
    let queue = format!("{ns}/{name}");
    let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), &ns);
    let jobs: Api<LeasedJob> = Api::namespaced(ctx.client.clone(), &ns);
    let params = ListParams::default().fields(&format!("spec.queue={name},status.phase=Leased"));
    let leased = match jobs.list(&params).await {
        Ok(list) => list.items,
        Err(e) => {
            warn!(queue = %queue, error = %error_chain(&e), "Listing the Leased jobs of queue {queue} failed; its new limits allow no claim until a pass succeeds; retrying");
            return;
        }
    };
    let done = match leasehold_kube::adopt::adopt(&leases, &jobs, q, &leased, &ctx.field_manager)
        .await
    {
        Ok(done) => done,
        Err(e) => {
            warn!(queue = %queue, error = %error_chain(&e), "Giving slots to the Leased jobs of queue {queue} failed; its new limits allow no claim until a pass succeeds; retrying");
            return;
        }
    };
    free_stalled(ctx, q, &jobs, &done.named).await;
    if done.adopted > 0 || done.moved > 0 {
        info!(queue = %queue, adopted = done.adopted, moved = done.moved, "Queue {queue}: gave slots to {} Leased jobs that held none (Leased before its limit, or by a sidecar that had not seen it), moved {} below the limit", done.adopted, done.moved);
    }
    let confirmed = q.status.as_ref().and_then(|s| s.slots_adopted.as_deref());
    if !done.complete || confirmed == Some(&*wanted) || !ctx.leadership.is_leader() {
        return;
    }
    let patch = json!({
        "metadata": {"resourceVersion": q.metadata.resource_version},
        "status": {"slotsAdopted": wanted},
    });
    match write(ctx, &ns, &name, &patch).await {
        Ok(()) => {
            info!(queue = %queue, "Queue {queue}: every Leased job holds a slot of its limits; claims under them go on")
        }
        // The LeasedQueue changed since this pass read it: the next pass judges the new one.
        Err(e) if is_status(&e, 409) || is_status(&e, 404) => {}
        Err(e) => {
            warn!(queue = %queue, error = %error_chain(&e), "Confirming the limits of queue {queue} failed; retrying")
        }
    }
}

/// Frees the slots of `q` (`named`: each slot naming a claim, as the pass left them) that have
/// waited [`adoption::PENDING_GRACE`] for a claim write never made, judged from the
/// controller's job cache ([`adoption::pending_claim`]): each by a write to its job guarded by
/// the version the slot names ([`leasehold_kube::adopt::free_pending`]), which the API server
/// refuses if the claim landed, or anything else moved the job, meanwhile. A slot is timed
/// from when a pass first saw it pending at its own resourceVersion, so a claimer that reuses
/// it (adding its mark) or takes it anew starts the grace again. So a claimer that died
/// between its slot and its claim holds a unit of the limit for the grace and a pass or two,
/// not until its job is claimed again (docs/protocol.md, "Limits").
async fn free_stalled(
    ctx: &Context,
    q: &LeasedQueue,
    jobs: &Api<LeasedJob>,
    named: &[leasehold_kube::adopt::NamedSlot],
) {
    let ns = q.namespace().unwrap_or_default();
    let queue = format!("{ns}/{}", q.name_any());
    let pending: Vec<(String, String)> = {
        let cache = ctx.jobs.lock().unwrap();
        named
            .iter()
            .filter(|slot| {
                let key = JobKey {
                    namespace: ns.as_str().into(),
                    name: slot.named.holder.job.as_str().into(),
                };
                cache
                    .job(&key)
                    .is_some_and(|job| adoption::pending_claim(q, &slot.scope, &slot.named, &job))
            })
            .map(|slot| {
                let what = format!("{} {}", slot.named.holder.render(), slot.version);
                (slot.name.clone(), what)
            })
            .collect()
    };
    let due = ctx
        .stalled
        .lock()
        .unwrap()
        .observe(&queue, &pending, Instant::now());
    for slot in named.iter().filter(|slot| due.contains(&slot.name)) {
        if !ctx.leadership.is_leader() {
            return;
        }
        let (name, job) = (&slot.name, &slot.named.holder.job);
        match leasehold_kube::adopt::free_pending(jobs, name, &slot.named, &ctx.field_manager).await
        {
            Ok(Freeing::Freed) => {
                info!(queue = %queue, slot = %name, job = %job, "Queue {queue}: freed slot {name}, left pending on LeasedJob {ns}/{job} by a claimer that never made its claim; no claim from that copy of the job can land now")
            }
            Ok(Freeing::MovedOn) => {}
            Ok(Freeing::NotStored) => {
                warn!(queue = %queue, slot = %name, job = %job, "Freeing slot {name} of queue {queue} stored nothing: the installed LeasedJob CRD lacks status.pendingSlotFreed (upgrade it: {}); the slot stays busy until LeasedJob {ns}/{job} is claimed", crate::crd_check::FIX_COMMAND)
            }
            Err(e) => {
                warn!(queue = %queue, slot = %name, error = %error_chain(&e), "Freeing slot {name} of queue {queue} failed; the next pass retries")
            }
        }
    }
}

/// Removes the confirmation of `q`, a LeasedQueue seen without limits whose status still has
/// one, whatever it became since (limits set again wait for a pass of their own: removing it
/// only holds claims back until then). Only while this replica leads.
pub(super) async fn clear(ctx: &Context, q: &LeasedQueue) {
    let confirmed = q.status.as_ref().and_then(|s| s.slots_adopted.as_ref());
    if adoption::adoption_of(q).is_some() || confirmed.is_none() || !ctx.leadership.is_leader() {
        return;
    }
    let (ns, name) = (q.namespace().unwrap_or_default(), q.name_any());
    let patch = json!({"status": {"slotsAdopted": null}});
    if let Err(e) = write(ctx, &ns, &name, &patch).await {
        if !is_status(&e, 404) {
            warn!(queue = %format!("{ns}/{name}"), error = %error_chain(&e), "Removing the limits' confirmation of queue {ns}/{name} failed; the next pass retries");
        }
    }
}

/// A merge patch of the status of LeasedQueue `ns/name`.
async fn write(
    ctx: &Context,
    ns: &str,
    name: &str,
    patch: &serde_json::Value,
) -> Result<(), kube::Error> {
    let api: Api<LeasedQueue> = Api::namespaced(ctx.client.clone(), ns);
    let params = PatchParams {
        field_manager: Some(ctx.field_manager.clone()),
        ..PatchParams::default()
    };
    api.patch_status(name, &params, &Patch::Merge(patch))
        .await
        .map(|_| ())
}
