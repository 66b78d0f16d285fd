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
//! before its claim: a slot's take. Each claimer replaces a Lease of its own (so that, like the
//! bound's claims, none conflicts) under the resourceVersion its last write returned, written
//! as a slot is (`leasehold_core::slots`: its labels, its holderIdentity naming the claim, the
//! claim's token's mark, the claimer, acquireTime), but with no owner (a slot's is its
//! LeasedQueue; there is none here) and without the list of the scope's slots and the read
//! that judges one, which a take makes before its write: the bound of the writes alone.

use std::sync::atomic::Ordering;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::{Api, ResourceExt as _};
use leasehold_core::claim;
use leasehold_core::crd::LeasedJob;
use leasehold_core::fence::Outcome;
use leasehold_core::slots::{self, Named, SlotHolder};
use leasehold_core::token::Token;
use serde_json::json;
use tokio::task::JoinSet;

use crate::claim_mode::{Counts, Mode};
use crate::cluster::Bench;
use crate::counted::CountedClients;

/// One claimer of the bound: its own client, warmed, its jobs, and in the keyed bound its
/// slot.
pub struct Claimer {
    api: Api<LeasedJob>,
    ns: String,
    holder: String,
    hand: Vec<LeasedJob>,
    slot: Option<Slot>,
}

/// The keyed bound's stand-in for a slot: a Lease of the claimer's own, as its last write
/// returned it.
struct Slot {
    leases: Api<Lease>,
    lease: Lease,
}

/// The claimers of a bound run in `ns`: the queued jobs, read in one list, dealt out to
/// `claimers` in turn (job i to claimer i mod N, so that none conflicts), each job without its
/// payload (a claim does not send it: docs/protocol.md); each claimer with its own client,
/// which has read its first job once so that its connection is made before the clock, as the
/// Workers' are, and counts its requests in `counted`, as theirs do. In the keyed bound
/// ([`Mode::BoundKeyed`]), each claimer also creates a Lease of its own (`bench-slot-<i>`),
/// labelled as a slot of queue `claim` is, to write before each claim.
///
/// # Errors
/// The list or a read failed, or a client could not be made.
pub async fn ready(
    bench: &Bench,
    ns: &str,
    claimers: usize,
    counted: &CountedClients,
    mode: Mode,
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
        let slot = if mode.takes_slots() {
            let leases: Api<Lease> = Api::namespaced(client, ns);
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(format!("bench-slot-{i}")),
                    labels: Some(
                        [
                            (slots::SLOT_OF_LABEL.to_string(), "claim".to_string()),
                            (slots::SLOT_SCOPE_LABEL.to_string(), format!("k{i:012x}")),
                        ]
                        .into(),
                    ),
                    ..Default::default()
                },
                spec: Some(LeaseSpec::default()),
            };
            let lease = leases.create(&PostParams::default(), &lease).await?;
            Some(Slot { leases, lease })
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
                let token = Token::issue(job.attempt() + 1);
                if let Some(slot) = c.slot.as_mut() {
                    if !take(slot, job, &token, &c.holder, &counts).await {
                        continue;
                    }
                }
                two_writes(&c.api, &c.ns, &c.holder, job, &token, &counts).await;
            }
        });
    }
}

/// Names the claim of `job` with `token` on `slot`, written as a slot's take writes it, by a
/// replace under the resourceVersion its last write returned; false, counted as an error, if
/// it failed.
async fn take(
    slot: &mut Slot,
    job: &LeasedJob,
    token: &Token,
    holder: &str,
    counts: &Counts,
) -> bool {
    let Some(claim) = SlotHolder::of_claim(job) else {
        counts.errors.fetch_add(1, Ordering::Relaxed);
        return false;
    };
    let named = Named::taken(claim, slots::mark_of(token.as_str()));
    let lease = &mut slot.lease;
    if let Some(spec) = lease.spec.as_mut() {
        spec.holder_identity = Some(named.holder.render());
        spec.acquire_time = Some(leasehold_core::lease::micro_time(
            k8s_openapi::jiff::Timestamp::now(),
        ));
    }
    let annotations = lease.annotations_mut();
    if let Some(text) = named.annotation() {
        annotations.insert(slots::CLAIMS_ANNOTATION.into(), text);
    }
    annotations.insert(slots::TAKEN_BY_ANNOTATION.into(), holder.into());
    match slot
        .leases
        .replace(&lease.name_any(), &PostParams::default(), lease)
        .await
    {
        Ok(written) => {
            slot.lease = written;
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "keyed bound: slot write failed");
            counts.errors.fetch_add(1, Ordering::Relaxed);
            false
        }
    }
}

/// Claims `job` with `token` and completes it, counting what landed and what failed.
async fn two_writes(
    api: &Api<LeasedJob>,
    ns: &str,
    holder: &str,
    job: &LeasedJob,
    token: &Token,
    counts: &Counts,
) {
    let name = job.name_any();
    let mut claimed = job.clone();
    claimed.status = Some(claim::claimed_status(
        job,
        token,
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
    match leasehold_kube::fence::apply_from(api, ns, &name, token, &done, Some(&stored)).await {
        Ok(_) => {
            counts.completed.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            tracing::warn!(error = %e, "bound: complete failed");
            counts.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}
