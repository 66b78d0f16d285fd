//! Adopting the jobs Leased before a limit existed: when a LeasedQueue first limits a scope
//! (or is made again), the jobs of that scope already Leased were claimed without a slot. The
//! leading controller gives each a slot of every limited scope it falls in, naming its attempt
//! and marked with its token ([`leasehold_core::slots::adopting`]), and only then writes the
//! queue's `status.slotsAdopted`; sidecars make no claim under limits that status does not
//! name ([`leasehold_core::slots::adopted`]). So from the first claim a limit allows, every
//! Leased job of its scope is counted by a slot, and the limit holds as for jobs claimed after
//! it (docs/protocol.md, "Limits").
//!
//! A slot is taken as a claim takes one (a free one below the limit, by a write conditional on
//! its resourceVersion, or a create); when none is free it is made above the limit, where a
//! claim counts it too (the slots of a lowered limit: [`leasehold_core::slots::Plan::above`]).
//! Adopting never frees a slot: an adoption that raced a claim, or read a stale copy, counts
//! too much for one attempt, never too little.

use std::collections::{BTreeMap, HashSet};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::PostParams;
use kube::{Api, ResourceExt};

use crate::api::is_status;
use crate::slots::{new_slot, stamp, state, SlotError};
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::queue::LeasedQueue;
use leasehold_core::slots::{
    self, Listed, Named, Scope, SlotState, SLOT_OF_LABEL, SLOT_SCOPE_LABEL,
};

/// What one adoption pass came to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Adoption {
    /// Slots written for jobs no slot counted.
    pub adopted: usize,
    /// Whether every job given is now counted in every limited scope it falls in: false when
    /// a write lost a race (the next pass lists again).
    pub complete: bool,
}

/// The slots of one scope as listed, by index, with the Lease objects to write over.
#[derive(Default)]
struct ScopeSlots {
    named: BTreeMap<u32, Option<Named>>,
    leases: BTreeMap<u32, Lease>,
    /// Indices written in this pass (each holds one adopted job now).
    written: HashSet<u32>,
}

/// Gives every job of `leased` (copies of `queue`'s Leased jobs, as the controller's cache
/// holds them) that no slot counts a slot of each scope `queue` limits it in, through `leases`
/// and `jobs` (the queue's namespace); `pod` is recorded on the slots written.
///
/// # Errors
/// [`SlotError`] when the slots could not be listed, a job they name could not be read, or a
/// write failed for another reason than a lost race.
pub async fn adopt(
    leases: &Api<Lease>,
    jobs: &Api<LeasedJob>,
    queue: &LeasedQueue,
    leased: &[LeasedJob],
    pod: &str,
) -> Result<Adoption, SlotError> {
    let queue_name = queue.name_any();
    let selector = format!("{SLOT_OF_LABEL}={queue_name}");
    let items = crate::slots::list(leases, &queue_name, &selector).await?;
    let to = Writer {
        leases,
        jobs,
        queue,
        pod,
    };
    let mut by_scope: BTreeMap<String, ScopeSlots> = BTreeMap::new();
    let mut outcome = Adoption {
        adopted: 0,
        complete: true,
    };
    for job in leased.iter().filter(|j| j.phase() == Phase::Leased) {
        for (scope, limit) in slots::scopes(queue, job) {
            let label = scope.label();
            if !by_scope.contains_key(&label) {
                by_scope.insert(label.clone(), listed(&items, &queue_name, &scope));
            }
            let known = by_scope.get_mut(&label).expect("inserted above");
            if known
                .named
                .values()
                .flatten()
                .any(|n| slots::counts(n, job))
            {
                continue;
            }
            match adopt_one(&to, (&scope, limit), job, known).await? {
                true => outcome.adopted += 1,
                false => outcome.complete = false,
            }
        }
    }
    Ok(outcome)
}

/// The slots of `scope` among `items` (a queue's slot Leases).
fn listed(items: &[Lease], queue: &str, scope: &Scope) -> ScopeSlots {
    let label = scope.label();
    let mut out = ScopeSlots::default();
    for lease in items {
        if lease.labels().get(SLOT_SCOPE_LABEL) != Some(&label) {
            continue;
        }
        let Some(index) = slots::index_of(&lease.name_any(), queue, scope) else {
            continue;
        };
        out.named.insert(index, crate::slots::named(lease));
        out.leases.insert(index, lease.clone());
    }
    out
}

/// Where an adoption pass reads and writes: the slot Leases and the jobs of the queue's
/// namespace, the queue, and the pod recorded on the slots written.
struct Writer<'a> {
    leases: &'a Api<Lease>,
    jobs: &'a Api<LeasedJob>,
    queue: &'a LeasedQueue,
    pod: &'a str,
}

/// Takes a slot of `scope` (limit `limit`) for `job`: a free one below the limit (those
/// naming no claim first), else a free one above it, else a new one at the first index above
/// the limit not made yet. `Ok(false)` when the write lost a race.
async fn adopt_one(
    to: &Writer<'_>,
    (scope, limit): (&Scope, u32),
    job: &LeasedJob,
    known: &mut ScopeSlots,
) -> Result<bool, SlotError> {
    let Writer {
        leases,
        jobs,
        queue,
        pod,
    } = *to;
    let Some(mine) = slots::adopting(job) else {
        return Ok(true);
    };
    let named = Named {
        holder: mine.clone(),
        // A Leased job has its claim's token; one without would be counted by any claim of
        // its attempt.
        marks: job.token().map(|t| vec![slots::mark_of(t)]),
    };
    let as_listed: Vec<Listed> = known
        .named
        .iter()
        .map(|(index, holder)| Listed {
            index: *index,
            holder: holder.clone(),
        })
        .collect();
    let mut order: Vec<u32> = slots::plan(&mine, limit, &as_listed)
        .candidates
        .into_iter()
        .map(|(index, _)| index)
        .collect();
    order.extend(known.named.keys().copied().filter(|i| *i >= limit));
    order.extend((limit..).find(|i| !known.named.contains_key(i)));
    for index in order {
        if known.written.contains(&index) {
            continue;
        }
        if let Some(Some(other)) = known.named.get(&index) {
            if state(jobs, other).await? == SlotState::Busy {
                continue;
            }
        }
        let name = slots::slot_name(&queue.name_any(), scope, index);
        let written = match known.leases.get(&index) {
            Some(lease) => {
                let mut lease = lease.clone();
                stamp(&mut lease, queue, &named, pod);
                leases.replace(&name, &PostParams::default(), &lease).await
            }
            None => {
                let lease = new_slot(queue, scope, &name, &named, pod);
                leases.create(&PostParams::default(), &lease).await
            }
        };
        return match written {
            Ok(lease) => {
                known.named.insert(index, Some(named));
                known.leases.insert(index, lease);
                known.written.insert(index);
                Ok(true)
            }
            Err(e) if is_status(&e, 409) => Ok(false),
            Err(source) => Err(SlotError {
                what: format!("adopting LeasedJob {} into slot Lease {name}", mine.job),
                source,
            }),
        };
    }
    Ok(false)
}
