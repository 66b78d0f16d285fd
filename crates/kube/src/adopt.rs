//! Adopting the jobs Leased before a limit existed: when a LeasedQueue first limits a scope
//! (or is made again), the jobs of that scope already Leased were claimed without a slot. The
//! leading controller gives each a slot of every limited scope it falls in, naming its attempt
//! and marked with its token ([`leasehold_core::adoption::adopting`]), and only then writes the
//! queue's `status.slotsAdopted`; sidecars make no claim under limits that status does not
//! name ([`leasehold_core::adoption::adopted`]). So from the first claim a limit allows, every
//! Leased job of its scope is counted by a slot, and the limit holds as for jobs claimed after
//! it (docs/protocol.md, "Limits").
//!
//! A slot is taken as a claim takes one (a free one below the limit, by a write conditional on
//! its resourceVersion, or a create); when none is free it is made above the limit, where a
//! claim counts it too (the slots of a lowered limit: [`leasehold_core::slots::Plan::above`]).
//! While any slot above a limit is busy no claim takes a slot, so each pass also tidies them:
//! a free one is emptied, and the job of a busy one is moved to a free slot below the limit
//! (named there first, then emptied above). Every write is conditional; adopting never frees a
//! slot whose job may still hold it: a pass that raced a claim, or read a stale copy, counts
//! one attempt too much, never too little.
//!
//! Slots owned by an earlier LeasedQueue of the same name are neither counted nor written
//! (`slots::foreign_to`): garbage collection deletes them.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};

use crate::api::is_status;
use crate::slots::{foreign_to, named, new_slot, stamp, state, SlotError};
use leasehold_core::adoption;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::queue::LeasedQueue;
use leasehold_core::slots::{self, Listed, Named, SlotState, SLOT_OF_LABEL, SLOT_SCOPE_LABEL};

/// What one adoption pass came to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Adoption {
    /// Slots written for jobs no slot counted.
    pub adopted: usize,
    /// Jobs moved from a slot above their limit to one below it.
    pub moved: usize,
    /// Free slots above a limit emptied.
    pub emptied: usize,
    /// Whether every job given is now counted in every limited scope it falls in: false when
    /// a write lost a race (the next pass lists again).
    pub complete: bool,
    /// Every slot of this LeasedQueue that names a claim after the pass, for the caller to
    /// find those left pending ([`leasehold_core::adoption::pending_claim`]) and
    /// [`free_pending`] them.
    pub named: Vec<NamedSlot>,
}

/// A slot Lease that names a claim, as an adoption pass left it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedSlot {
    /// The Lease's name.
    pub name: String,
    /// Its scope's label ([`leasehold_core::slots::Scope::label`]).
    pub scope: String,
    /// Its resourceVersion: a take, a reuse that adds a mark, or a give-back changes it.
    pub version: String,
    /// The claim it names.
    pub named: Named,
}

/// What [`free_pending`] came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freeing {
    /// The job moved past the version the slot names: no claim from it can land.
    Freed,
    /// The job had moved on already (its claim landed, or anything else changed it), or is
    /// gone: nothing was written, and the slot is judged afresh.
    MovedOn,
    /// The API server answered without storing anything (the job is still at that version):
    /// the installed LeasedJob CRD lacks `status.pendingSlotFreed`, so it pruned the field.
    NotStored,
}

/// The slots of one scope as listed, by index, with the Lease objects to write over.
#[derive(Default)]
struct ScopeSlots {
    /// What each slot of this LeasedQueue names (None: nothing).
    named: BTreeMap<u32, Option<Named>>,
    leases: BTreeMap<u32, Lease>,
    /// Indices of slots owned by an earlier LeasedQueue: never counted nor written.
    foreign: HashSet<u32>,
    /// Indices written in this pass (each holds one adopted job now).
    written: HashSet<u32>,
    /// Slots judged in this pass.
    judged: HashMap<u32, SlotState>,
}

impl ScopeSlots {
    /// Whether a slot of this scope counts `job`.
    fn counts(&self, job: &LeasedJob) -> bool {
        self.named
            .values()
            .flatten()
            .any(|n| adoption::counts(n, job))
    }

    /// Whether a slot at `index` may be written for an adoption or a move: not foreign, not
    /// written in this pass, and naming nothing or judged free.
    async fn usable(&mut self, jobs: &Api<LeasedJob>, index: u32) -> Result<bool, SlotError> {
        if self.foreign.contains(&index) || self.written.contains(&index) {
            return Ok(false);
        }
        Ok(self.judge(jobs, index).await? == SlotState::Free)
    }

    /// The state of the slot at `index` (free when it names nothing or does not exist),
    /// judged once per pass.
    async fn judge(&mut self, jobs: &Api<LeasedJob>, index: u32) -> Result<SlotState, SlotError> {
        let Some(Some(n)) = self.named.get(&index) else {
            return Ok(SlotState::Free);
        };
        if let Some(s) = self.judged.get(&index) {
            return Ok(*s);
        }
        let s = state(jobs, n).await?;
        self.judged.insert(index, s);
        Ok(s)
    }

    /// Records a write of `named` at `index` (None: emptied).
    fn wrote(&mut self, index: u32, named: Option<Named>, lease: Lease) {
        let busy = named.is_some();
        self.named.insert(index, named);
        self.leases.insert(index, lease);
        self.written.insert(index);
        self.judged.insert(
            index,
            if busy {
                SlotState::Busy
            } else {
                SlotState::Free
            },
        );
    }
}

/// Where an adoption pass reads and writes: the slot Leases and the jobs of the queue's
/// namespace, the queue, and the pod recorded on the slots written.
struct Writer<'a> {
    leases: &'a Api<Lease>,
    jobs: &'a Api<LeasedJob>,
    queue: &'a LeasedQueue,
    pod: &'a str,
}

/// Gives every job of `leased` (the queue's Leased jobs, read afresh) that no slot counts a
/// slot of each scope `queue` limits it in, then tidies the slots above each limit, through
/// `leases` and `jobs` (the queue's namespace); `pod` is recorded on the slots written.
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
    let mut by_scope = grouped(&items, queue);
    let to = Writer {
        leases,
        jobs,
        queue,
        pod,
    };
    let mut outcome = Adoption {
        complete: true,
        ..Adoption::default()
    };
    for job in leased.iter().filter(|j| j.phase() == Phase::Leased) {
        for (scope, limit) in slots::scopes(queue, job) {
            let known = by_scope.entry(scope.label()).or_default();
            if known.counts(job) {
                continue;
            }
            match adopt_one(&to, (&scope.label(), limit), job, known).await? {
                true => outcome.adopted += 1,
                false => outcome.complete = false,
            }
        }
    }
    for (label, known) in &mut by_scope {
        if let Some(limit) = slots::limit_of(queue, label) {
            tidy_above(&to, (label, limit), known, &mut outcome).await?;
        }
    }
    for (label, known) in &by_scope {
        for (index, named) in &known.named {
            let version = known.leases.get(index).and_then(|l| l.resource_version());
            if let (Some(named), Some(version), false) =
                (named, version, known.foreign.contains(index))
            {
                outcome.named.push(NamedSlot {
                    name: slots::slot_name(&queue_name, label, *index),
                    scope: label.clone(),
                    version,
                    named: named.clone(),
                });
            }
        }
    }
    Ok(outcome)
}

/// Frees the slot `slot`, which names `named`, left pending by a claimer that never made its
/// claim write ([`leasehold_core::adoption::pending_claim`]): writes the job's
/// `status.pendingSlotFreed` by a merge patch guarded by the resourceVersion the slot names,
/// through `jobs` (the queue's namespace) as `field_manager`. Once it lands the job is past that
/// version, so no claim guarded by it can succeed and the slot is free by the busy rule
/// ([`leasehold_core::slots::state_of`]); nothing else of the job changes. See [`Freeing`]
/// for the other outcomes.
///
/// # Errors
/// [`SlotError`] when the write failed for another reason.
pub async fn free_pending(
    jobs: &Api<LeasedJob>,
    slot: &str,
    named: &Named,
    field_manager: &str,
) -> Result<Freeing, SlotError> {
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": named.holder.resource_version},
        "status": {"pendingSlotFreed": format!("{slot} {}", named.holder.render())},
    });
    let params = PatchParams {
        field_manager: Some(field_manager.to_string()),
        ..PatchParams::default()
    };
    match jobs
        .patch_status(&named.holder.job, &params, &Patch::Merge(&patch))
        .await
    {
        Ok(job) if job.resource_version() == Some(named.holder.resource_version.clone()) => {
            Ok(Freeing::NotStored)
        }
        Ok(_) => Ok(Freeing::Freed),
        Err(e) if is_status(&e, 409) || is_status(&e, 404) => Ok(Freeing::MovedOn),
        Err(source) => Err(SlotError {
            what: format!(
                "freeing slot Lease {slot}, left pending on LeasedJob {}",
                named.holder.job
            ),
            source,
        }),
    }
}

/// `items` (a queue's slot Leases) by scope label.
fn grouped(items: &[Lease], queue: &LeasedQueue) -> BTreeMap<String, ScopeSlots> {
    let queue_name = queue.name_any();
    let mut out: BTreeMap<String, ScopeSlots> = BTreeMap::new();
    for lease in items {
        let Some(label) = lease.labels().get(SLOT_SCOPE_LABEL) else {
            continue;
        };
        let Some(index) = slots::index_of(&lease.name_any(), &queue_name, label) else {
            continue;
        };
        let known = out.entry(label.clone()).or_default();
        if foreign_to(lease, queue) {
            known.foreign.insert(index);
            known.named.insert(index, None);
        } else {
            known.named.insert(index, named(lease));
        }
        known.leases.insert(index, lease.clone());
    }
    out
}

/// Writes `named` into the slot at `index` of the scope labelled `scope` (an update under
/// the version listed, or a create when there is none): `Ok(false)` when that lost a race.
async fn put(
    to: &Writer<'_>,
    scope: &str,
    index: u32,
    named: Option<&Named>,
    known: &mut ScopeSlots,
) -> Result<bool, SlotError> {
    let name = slots::slot_name(&to.queue.name_any(), scope, index);
    let written = match (known.leases.get(&index), named) {
        (Some(lease), Some(n)) => {
            let mut lease = lease.clone();
            stamp(&mut lease, to.queue, n, to.pod);
            to.leases
                .replace(&name, &PostParams::default(), &lease)
                .await
        }
        (Some(lease), None) => {
            let mut lease = lease.clone();
            if let Some(spec) = lease.spec.as_mut() {
                spec.holder_identity = None;
            }
            lease.annotations_mut().remove(slots::CLAIMS_ANNOTATION);
            to.leases
                .replace(&name, &PostParams::default(), &lease)
                .await
        }
        (None, Some(n)) => {
            let lease = new_slot(to.queue, scope, &name, n, to.pod);
            to.leases.create(&PostParams::default(), &lease).await
        }
        (None, None) => return Ok(true),
    };
    match written {
        Ok(lease) => {
            known.wrote(index, named.cloned(), lease);
            Ok(true)
        }
        Err(e) if is_status(&e, 409) => Ok(false),
        Err(source) => Err(SlotError {
            what: format!("writing slot Lease {name} (adopting the jobs Leased before a limit)"),
            source,
        }),
    }
}

/// Takes a slot of the scope labelled `scope` (limit `limit`) for `job`: a free one below the
/// limit (those naming no claim first), else a free one above it, else a new one at the first
/// index above the limit not made yet. `Ok(false)` when the write lost a race.
async fn adopt_one(
    to: &Writer<'_>,
    (scope, limit): (&str, u32),
    job: &LeasedJob,
    known: &mut ScopeSlots,
) -> Result<bool, SlotError> {
    let Some(mine) = adoption::adopting(job) else {
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
    let mut order: Vec<u32> = slots::plan(&mine, limit, &as_listed, None)
        .candidates
        .into_iter()
        .map(|(index, _)| index)
        .collect();
    order.extend(known.named.keys().copied().filter(|i| *i >= limit));
    order.extend((limit..).find(|i| !known.named.contains_key(i)));
    for index in order {
        if known.usable(to.jobs, index).await? {
            return put(to, scope, index, Some(&named), known).await;
        }
    }
    Ok(false)
}

/// The slots of the scope labelled `scope` at or above its limit `limit`: a free one is
/// emptied (claims then need not judge it); a busy one's job is named in a free slot below the
/// limit, then the one above is emptied, so that claims go on once fewer jobs than the limit
/// are Leased. A lost race leaves it for the next pass.
async fn tidy_above(
    to: &Writer<'_>,
    (scope, limit): (&str, u32),
    known: &mut ScopeSlots,
    outcome: &mut Adoption,
) -> Result<(), SlotError> {
    let above: Vec<u32> = known
        .named
        .iter()
        .filter(|(i, n)| **i >= limit && n.is_some() && !known.foreign.contains(i))
        .map(|(i, _)| *i)
        .collect();
    for index in above {
        if known.judge(to.jobs, index).await? == SlotState::Free {
            if put(to, scope, index, None, known).await? {
                outcome.emptied += 1;
            }
            continue;
        }
        let Some(Some(named)) = known.named.get(&index).cloned() else {
            continue;
        };
        let mut below = None;
        for i in 0..limit {
            if known.usable(to.jobs, i).await? {
                below = Some(i);
                break;
            }
        }
        let Some(below) = below else {
            // Every slot below the limit is busy: the scope is at its limit or above it.
            return Ok(());
        };
        if !put(to, scope, below, Some(&named), known).await? {
            return Ok(());
        }
        // Named twice now, then once: counted all along.
        if put(to, scope, index, None, known).await? {
            outcome.moved += 1;
        }
    }
    Ok(())
}
