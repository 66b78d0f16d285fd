//! Row 2b, the bound: what two status writes per job, and nothing else, get from this API
//! server, against the same ceiling as rows 2, 2d and 2k.
//!
//! N claimers, each with its own kube-rs client, take the queued jobs of one list read before
//! the clock starts (dealt out in turn, so that none conflicts), and end each with the two
//! writes a short job costs in every other row: the claim (a status replace under the listed
//! resourceVersion, the status [`claim::claimed_status`] makes) and the completion (the
//! holder's status replace from the claim's answer, [`leasehold_kube::fence::apply_from`]).
//! No read, no watch, no controller (it is stopped once the jobs are Queued), no dispatcher:
//! a reference for the claim paths of rows 2, 2d and 2k, which make the same two writes per
//! job and more besides. It is not a strict ceiling: a round of another row can beat the
//! bound's round on this noisy machine.
//!
//! Row 2bk, the keyed bound, is the same with the third write each job of row 2k costs,
//! before its claim: a slot. Each claimer replaces a Lease of its own under the resourceVersion
//! its last write returned, naming the job as a slot names its claim (`<job>@<R0>#<a>`), so
//! that, like the bound's claims, none conflicts.

use std::sync::atomic::Ordering;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::{Api, ResourceExt as _};
use leasehold_core::claim;
use leasehold_core::crd::LeasedJob;
use leasehold_core::fence::Outcome;
use leasehold_core::token::Token;
use serde_json::json;
use tokio::task::JoinSet;

use crate::claims::Counts;
use crate::cluster::Bench;
use crate::counted::CountedClients;

/// One claimer of the bound: its own client, warmed, and its jobs.
pub struct Claimer {
    api: Api<LeasedJob>,
    ns: String,
    holder: String,
    hand: Vec<LeasedJob>,
    /// The keyed bound's: the claimer's own Lease, as its last write returned it.
    slot: Option<(Api<Lease>, Lease)>,
}

/// The claimers of a bound run in `ns`: the queued jobs, read in one list, dealt out to
/// `claimers` in turn (job i to claimer i mod N, so that none conflicts), each job without its
/// payload (a claim does not send it: docs/protocol.md); each claimer with its own client,
/// which has read its first job once so that its connection is made before the clock, as the
/// Workers' are, and counts its requests in `counted`, as theirs do. With `slots` (the keyed
/// bound), each claimer also creates a Lease of its own (`bench-slot-<i>`) to write before
/// each claim.
///
/// # Errors
/// The list or a read failed, or a client could not be made.
pub async fn ready(
    bench: &Bench,
    ns: &str,
    claimers: usize,
    counted: &CountedClients,
    slots: bool,
) -> anyhow::Result<Vec<Claimer>> {
    let api: Api<LeasedJob> = Api::namespaced(bench.client.clone(), ns);
    let listed = api.list(&ListParams::default()).await?;
    let mut hands: Vec<Vec<LeasedJob>> = (0..claimers.max(1)).map(|_| Vec::new()).collect();
    let n = hands.len();
    for (i, mut job) in listed.items.into_iter().enumerate() {
        job.drop_payload_and_result();
        hands[i % n].push(job);
    }
    let mut ready = Vec::with_capacity(n);
    for (i, hand) in hands.into_iter().enumerate() {
        let client = counted.client(bench.new_client()?);
        let api: Api<LeasedJob> = Api::namespaced(client.clone(), ns);
        if let Some(first) = hand.first() {
            api.get_metadata(&first.name_any()).await?;
        }
        let holder = format!("claimer-{i}");
        let slot = if slots {
            let leases: Api<Lease> = Api::namespaced(client, ns);
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(format!("bench-slot-{i}")),
                    ..Default::default()
                },
                spec: Some(LeaseSpec::default()),
            };
            let lease = leases.create(&PostParams::default(), &lease).await?;
            Some((leases, lease))
        } else {
            None
        };
        ready.push(Claimer {
            api,
            ns: ns.to_string(),
            holder,
            hand,
            slot,
        });
    }
    Ok(ready)
}

/// Starts one claim loop per claimer of [`ready`]: (its slot, then) claim, then complete, job
/// after job, counted in `counts`.
pub fn start(claimers: Vec<Claimer>, counts: &Counts, tasks: &mut JoinSet<()>) {
    for mut c in claimers {
        let counts = counts.clone();
        tasks.spawn(async move {
            for job in &c.hand {
                if let Some(slot) = c.slot.as_mut() {
                    if !take_slot(slot, job, &counts).await {
                        continue;
                    }
                }
                two_writes(&c.api, &c.ns, &c.holder, job, &counts).await;
            }
        });
    }
}

/// Names `job`'s claim on the claimer's own Lease, by a replace under the resourceVersion its
/// last write returned (the write a slot's take makes); false, counted as an error, if it
/// failed.
async fn take_slot(
    (api, lease): &mut (Api<Lease>, Lease),
    job: &LeasedJob,
    counts: &Counts,
) -> bool {
    let named = format!(
        "{}@{}#{}",
        job.name_any(),
        job.resource_version().unwrap_or_default(),
        job.attempt() + 1
    );
    if let Some(spec) = lease.spec.as_mut() {
        spec.holder_identity = Some(named);
    }
    match api
        .replace(&lease.name_any(), &PostParams::default(), lease)
        .await
    {
        Ok(written) => {
            *lease = written;
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "keyed bound: slot write failed");
            counts.errors.fetch_add(1, Ordering::Relaxed);
            false
        }
    }
}

/// Claims `job` and completes it, counting what landed and what failed.
async fn two_writes(
    api: &Api<LeasedJob>,
    ns: &str,
    holder: &str,
    job: &LeasedJob,
    counts: &Counts,
) {
    let name = job.name_any();
    let token = Token::issue(job.attempt() + 1);
    let mut claimed = job.clone();
    claimed.status = Some(claim::claimed_status(
        job,
        &token,
        holder,
        k8s_openapi::jiff::Timestamp::now(),
        None,
    ));
    let stored = match api
        .replace_status(&name, &PostParams::default(), &claimed)
        .await
    {
        Ok(stored) => stored,
        Err(e) => {
            tracing::warn!(error = %e, "bound: claim failed");
            counts.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    counts.claimed.fetch_add(1, Ordering::Relaxed);
    let done = Outcome::Complete {
        result: json!({"ok": true}),
    };
    match leasehold_kube::fence::apply_from(api, ns, &name, &token, &done, Some(&stored)).await {
        Ok(_) => {
            counts.completed.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            tracing::warn!(error = %e, "bound: complete failed");
            counts.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}
