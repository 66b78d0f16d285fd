//! Row 2b, the bound: what two status writes per job, and nothing else, get from this API
//! server, against the same ceiling as rows 2, 2d and 2k.
//!
//! N claimers, each with its own kube-rs client, take the queued jobs of one list read before
//! the clock starts (dealt out in turn, so that none conflicts), and end each with the two
//! writes a short job costs in every other row: the claim (a status replace under the listed
//! resourceVersion, the status [`claim::claimed_status`] makes) and the completion (the
//! holder's status replace from the claim's answer, [`leasehold_kube::fence::apply_from`]).
//! No read, no watch, no controller (it is stopped once the jobs are Queued), no dispatcher:
//! any claim path with two writes per job pays at least this, so its ratio to the ceiling is
//! the most such a path can reach on this machine, the reference for row 2d's goal.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt as _};
use leasehold_core::claim;
use leasehold_core::crd::LeasedJob;
use leasehold_core::fence::Outcome;
use leasehold_core::token::Token;
use serde_json::json;
use tokio::task::JoinSet;

use crate::cluster::Bench;

/// The counts a run reads, shared with its claim loops.
#[derive(Clone, Default)]
pub struct Counts {
    /// Claims that landed.
    pub claimed: Arc<AtomicU64>,
    /// Jobs completed.
    pub completed: Arc<AtomicU64>,
    /// Writes that failed (should be 0).
    pub errors: Arc<AtomicU64>,
}

/// The queued jobs of `ns`, read in one list, dealt out to `claimers` in turn (job i to claimer
/// i mod N), each without its payload (a claim does not send it: docs/protocol.md).
///
/// # Errors
/// The list failed.
pub async fn deal(bench: &Bench, ns: &str, claimers: usize) -> anyhow::Result<Vec<Vec<LeasedJob>>> {
    let api: Api<LeasedJob> = Api::namespaced(bench.client.clone(), ns);
    let listed = api.list(&ListParams::default()).await?;
    let mut hands: Vec<Vec<LeasedJob>> = (0..claimers.max(1)).map(|_| Vec::new()).collect();
    let n = hands.len();
    for (i, mut job) in listed.items.into_iter().enumerate() {
        job.drop_payload_and_result();
        hands[i % n].push(job);
    }
    Ok(hands)
}

/// Starts one claim loop per hand of [`deal`], each with its own client from `bench`: claim,
/// then complete, job after job.
///
/// # Errors
/// A client could not be made.
pub fn start(
    bench: &Bench,
    ns: &str,
    hands: Vec<Vec<LeasedJob>>,
    counts: &Counts,
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<()> {
    for (i, hand) in hands.into_iter().enumerate() {
        let api: Api<LeasedJob> = Api::namespaced(bench.new_client()?, ns);
        let (ns, counts) = (ns.to_string(), counts.clone());
        tasks.spawn(async move {
            let holder = format!("claimer-{i}");
            for job in hand {
                two_writes(&api, &ns, &holder, &job, &counts).await;
            }
        });
    }
    Ok(())
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
