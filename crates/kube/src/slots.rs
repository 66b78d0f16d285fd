//! Taking the slots of a limited claim ([`leasehold_core::slots`]): list a scope's slot
//! Leases, judge the claims they name by reading those jobs, and take a free one by a
//! conditional write (an update under the slot's resourceVersion, or a create, which fails if
//! another claimer made it first). The API server arbitrates every take: two claimers never
//! both take one version of a slot.
//!
//! Reads come from the API server's watch cache (a list at any resourceVersion; a job read
//! not older than the resourceVersion its slot names): a stale list costs a refused write, and
//! a job copy only needs to be that recent (see the core module).

use std::collections::{HashMap, HashSet};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{GetParams, ListParams, PostParams};
use kube::{Api, Resource, ResourceExt};
use thiserror::Error;

use crate::api::is_status;
use leasehold_core::crd::LeasedJob;
use leasehold_core::queue::LeasedQueue;
use leasehold_core::slots::{
    self, Chain, Listed, Named, Preferred, Scope, SlotHolder, SlotState, SlotsTaken,
    CLAIMS_ANNOTATION, SLOT_OF_LABEL, SLOT_SCOPE_LABEL,
};
use leasehold_core::token::Token;

/// A slot a claim took (or found already naming it).
#[derive(Clone, Debug)]
pub struct Taken {
    /// The slot Lease's name.
    pub name: String,
    /// Its resourceVersion after the take (to release it conditionally); None when the claim
    /// reused a slot already naming its copy (another claim of that copy may use it).
    pub written: Option<String>,
    /// Its scope.
    pub scope: Scope,
    /// Its index.
    pub index: u32,
    /// The slot as this take wrote it, which its claimer may swap once it has ended the
    /// attempt itself ([`Own`]); None for a reuse, and for a copy of the LeasedQueue without a
    /// uid or generation.
    pub own: Option<Own>,
    /// Whether it was taken by a swap ([`slots::may_swap`]): the claim then records the
    /// LeasedQueue's generation with its limits
    /// ([`leasehold_core::adoption::obeyed_at_generation`]).
    pub swapped: bool,
}

/// What a claimer keeps of a slot it wrote itself (the [`Taken`] that carries it names the
/// scope and index): once the attempt it took the slot for has ended by the claimer's own
/// write (answered 200), the slot is free by the busy rule, and the claimer knows it without a
/// read. A replace conditional on the resourceVersion here then takes it for the claimer's
/// next claim in the same scope with no list and no judging read, if nobody wrote the slot
/// since (docs/protocol.md, "Limits": swapping one's own slot).
#[derive(Clone, Debug)]
pub struct Own {
    /// The slot Lease as the API server answered the write that took it.
    pub lease: Box<Lease>,
    /// Where its chain of swaps began.
    pub chain: Chain,
    /// When the take that began the chain listed the scope ([`slots::MAX_CHAIN_AGE`]).
    pub listed_at: std::time::Instant,
}

/// What a claim's slots are taken with, besides the claim itself.
#[derive(Clone, Debug, Default)]
pub struct Hints {
    /// The slot of each scope to try first (the dispatcher's suggestion;
    /// [`Preferred::NONE`] for the claimer's own order).
    pub prefer: Preferred,
    /// The slot of each scope the dispatcher suggested as the claimer's own, to swap.
    pub swap: Preferred,
    /// Slots the claimer took itself (each with its [`Own`]) and whose attempts it has ended
    /// since: the one of a scope is swapped, with no list or judging read, where
    /// [`slots::may_swap`] allows it (given `swap`), and the scope is taken as usual when it
    /// does not or the swap loses (the slot was written since). Others are dropped.
    pub own: Vec<Taken>,
}

/// The slot writes one [`acquire`] made, by kind and by the API server's answer: what a
/// sidecar counts in `leasehold_slot_writes_total`. Each is one conditional write; a refused
/// one is a lost race (409, or 404 for a swap of a slot deleted since), never a broken limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Writes {
    /// Takes applied: a free slot updated or a new one created for the claim, or the mark
    /// added to a slot already naming the claim's copy.
    pub taken: u32,
    /// Takes refused: another claimer wrote or made that slot first.
    pub takes_refused: u32,
    /// Swaps of the claimer's own free slot applied (no list, no judging read).
    pub swapped: u32,
    /// Swaps refused: the slot was written since the claimer's own write (409), or is gone
    /// (404); the scope was then taken as usual.
    pub swaps_refused: u32,
}

/// What [`acquire`] got.
#[derive(Debug)]
pub enum Acquired {
    /// A slot of every scope the claim falls in (none when the queue sets no limit for it).
    All(Vec<Taken>),
    /// `scope` has no free slot: the limit is reached. Slots taken in other scopes were given
    /// back (best effort).
    Full(Scope),
}

/// A slot could not be judged or taken.
#[derive(Debug, Error)]
#[error("{what} failed: {source}")]
pub struct SlotError {
    /// What was done, naming the Lease or job.
    pub what: String,
    /// The API server's answer.
    #[source]
    pub source: kube::Error,
}

/// Takes, for a claim of `job` (the copy the claim will be guarded by) that will write
/// `token`, a slot of every scope `queue` limits it in ([`slots::scopes`]), through `leases`
/// and `jobs` (the job's namespace), each marked with the token's [`slots::mark_of`]. `holder`
/// is the claimer's pod, recorded on the slots it writes. `hints`: the slots to try first and
/// to swap ([`Hints`]).
///
/// Returns what it got, and the slot writes it made ([`Writes`]) whatever it got, failures
/// included.
///
/// # Errors
/// [`SlotError`] when a list, read or write failed for another reason than a lost race;
/// slots already taken are given back first (best effort).
pub async fn acquire(
    leases: &Api<Lease>,
    jobs: &Api<LeasedJob>,
    queue: &LeasedQueue,
    job: &LeasedJob,
    holder: &str,
    token: &Token,
    hints: Hints,
) -> (Result<Acquired, SlotError>, Writes) {
    let Hints {
        prefer,
        swap: swaps,
        own,
    } = hints;
    let Some(mine) = SlotHolder::of_claim(job) else {
        // A copy without a name or resourceVersion is never claimed: the claim refuses it
        // before any write (`ClaimError::Unversioned`). No slot is taken for it.
        return (Ok(Acquired::All(Vec::new())), Writes::default());
    };
    let claim = Claim {
        mine,
        mark: slots::mark_of(token.as_str()),
        pod: holder,
        writes: std::sync::Mutex::default(),
    };
    let acquired = take_scopes(leases, jobs, queue, job, &claim, (prefer, swaps, own)).await;
    let writes = *claim.writes.lock().unwrap();
    (acquired, writes)
}

/// [`acquire`]'s work, for `claim`: a slot of every scope, swapped from `own` where `swaps`
/// allows it, else taken (trying `prefer` first).
async fn take_scopes(
    leases: &Api<Lease>,
    jobs: &Api<LeasedJob>,
    queue: &LeasedQueue,
    job: &LeasedJob,
    claim: &Claim<'_>,
    (prefer, swaps, mut own): (Preferred, Preferred, Vec<Taken>),
) -> Result<Acquired, SlotError> {
    let mut taken = Vec::new();
    for (scope, limit) in slots::scopes(queue, job) {
        let mine = own
            .iter()
            .position(|t| t.scope == scope)
            .map(|i| own.swap_remove(i))
            .filter(|t| {
                t.own.as_ref().is_some_and(|o| {
                    let chain = (&o.chain, o.listed_at.elapsed());
                    slots::may_swap(chain, t.index, limit, queue, swaps.of(&scope))
                })
            });
        if let Some(mine) = mine {
            match swap(leases, queue, mine, claim).await {
                Ok(Some(t)) => {
                    taken.push(t);
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    release(leases, &taken).await;
                    return Err(e);
                }
            }
        }
        let mut took = Ok(Take::ListAgain);
        for _ in 0..REUSE_TRIES {
            let first = prefer.of(&scope);
            took = take_one(leases, jobs, queue, (&scope, limit, first), claim).await;
            if !matches!(took, Ok(Take::ListAgain)) {
                break;
            }
        }
        match took {
            Ok(Take::Done(Some(t))) => taken.push(t),
            Ok(Take::Done(None) | Take::ListAgain) => {
                release(leases, &taken).await;
                return Ok(Acquired::Full(scope));
            }
            Err(e) => {
                release(leases, &taken).await;
                return Err(e);
            }
        }
    }
    Ok(Acquired::All(taken))
}

/// Swaps the slot `mine` (taken by this claimer, with its [`Own`]) for `claim`: replaces it,
/// as the claimer's own last write left it, conditional on that write's resourceVersion.
/// `Ok(None)` when it was written since (409) or is gone (404), or carries no [`Own`]: the
/// scope is then taken as usual.
async fn swap(
    leases: &Api<Lease>,
    queue: &LeasedQueue,
    mine: Taken,
    claim: &Claim<'_>,
) -> Result<Option<Taken>, SlotError> {
    let Taken {
        name,
        scope,
        index,
        own: Some(Own {
            mut lease,
            chain,
            listed_at,
        }),
        ..
    } = mine
    else {
        return Ok(None);
    };
    let taken = Named::taken(claim.mine.clone(), claim.mark.clone());
    stamp(&mut lease, queue, &taken, claim.pod);
    match leases.replace(&name, &PostParams::default(), &lease).await {
        Ok(written) => {
            claim.count(|w| w.swapped += 1);
            tracing::debug!(slot = %name, pod = claim.pod, "Swapped slot Lease {name} for the claim {}", claim.mine.render());
            Ok(Some(Taken {
                name,
                written: written.metadata.resource_version.clone(),
                scope,
                index,
                own: Some(Own {
                    lease: Box::new(written),
                    chain,
                    listed_at,
                }),
                swapped: true,
            }))
        }
        Err(e) if is_status(&e, 409) || is_status(&e, 404) => {
            claim.count(|w| w.swaps_refused += 1);
            tracing::debug!(slot = %name, pod = claim.pod, "Slot Lease {name} was written since this claimer's own write: not swapped; taking a slot as usual");
            Ok(None)
        }
        Err(source) => Err(SlotError {
            what: format!("swapping slot Lease {name}"),
            source,
        }),
    }
}

/// What a claim write records of the slots `taken` ([`SlotsTaken`]).
pub fn summary(taken: &[Taken]) -> SlotsTaken {
    let mut out = SlotsTaken::default();
    for t in taken {
        match t.scope {
            Scope::Queue => out.queue = Some(t.index),
            Scope::Key(_) => out.key = Some(t.index),
        }
        out.swapped |= t.swapped;
    }
    out
}

/// Gives back the slots `taken` wrote (an update to no holder, conditional on the version
/// the take wrote): for a claim that will not be made. Best effort: a slot not given back
/// names a claim whose job has moved on or will, and is judged free then (the core module).
pub async fn release(leases: &Api<Lease>, taken: &[Taken]) {
    for t in taken {
        let Some(rv) = &t.written else { continue };
        let Ok(mut lease) = leases.get(&t.name).await else {
            continue;
        };
        if lease.metadata.resource_version.as_deref() != Some(rv) {
            continue;
        }
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
        }
        lease.annotations_mut().remove(CLAIMS_ANNOTATION);
        let _ = leases
            .replace(&t.name, &PostParams::default(), &lease)
            .await;
    }
}

/// One claim's part in its slots: the claim its slots name, the mark of its token, the
/// claimer's pod.
struct Claim<'a> {
    mine: SlotHolder,
    mark: String,
    pod: &'a str,
    /// The writes made so far (locked only to count, never across an await).
    writes: std::sync::Mutex<Writes>,
}

impl Claim<'_> {
    /// Counts one slot write with `count`.
    fn count(&self, count: impl FnOnce(&mut Writes)) {
        count(&mut self.writes.lock().unwrap());
    }
}

/// How often a claim lists a scope again after a reuse lost its race (the slot changed
/// between the list and the write).
const REUSE_TRIES: usize = 3;

/// What one listing of a scope came to.
enum Take {
    /// A slot taken or reused, or none free.
    Done(Option<Taken>),
    /// The slot naming this claim's copy changed before this claim marked it: list again
    /// ([`REUSE_TRIES`] times in all; then the scope counts as full for this claim).
    ListAgain,
}

/// Lists the slots of `scope` (limit `limit`) once and takes one for `claim`, trying the slot
/// `first` first.
async fn take_one(
    leases: &Api<Lease>,
    jobs: &Api<LeasedJob>,
    queue: &LeasedQueue,
    (scope, limit, first): (&Scope, u32, Option<u32>),
    claim: &Claim<'_>,
) -> Result<Take, SlotError> {
    let queue_name = queue.name_any();
    let selector = format!(
        "{SLOT_OF_LABEL}={queue_name},{SLOT_SCOPE_LABEL}={}",
        scope.label()
    );
    let listed_at = std::time::Instant::now();
    let mut existing: HashMap<u32, Lease> = HashMap::new();
    let mut listed = Vec::new();
    let mut foreign = HashSet::new();
    for lease in list(leases, &queue_name, &selector).await? {
        let Some(index) = slots::index_of(&lease.name_any(), &queue_name, &scope.label()) else {
            continue;
        };
        // A slot of an earlier LeasedQueue of this name is neither counted nor taken: garbage
        // collection deletes it (a take could be deleted after it), and the jobs it names were
        // given slots of this object before its limits were confirmed (crate::adopt).
        let holder = if foreign_to(&lease, queue) {
            foreign.insert(index);
            None
        } else {
            named(&lease)
        };
        listed.push(Listed { index, holder });
        existing.insert(index, lease);
    }
    let plan = slots::plan(&claim.mine, limit, &listed, first);
    if let Some((index, named)) = plan.reuse {
        let name = slots::slot_name(&queue_name, &scope.label(), index);
        let reused = Taken {
            name: name.clone(),
            written: None,
            scope: scope.clone(),
            index,
            own: None,
            swapped: false,
        };
        // Marked too, before the claim write, so that the slot counts this claim if it wins.
        let (Some(marked), Some(mut lease)) =
            (named.reused_by(&claim.mark), existing.remove(&index))
        else {
            return Ok(Take::Done(Some(reused)));
        };
        mark(&mut lease, &marked);
        return match leases.replace(&name, &PostParams::default(), &lease).await {
            Ok(_) => {
                claim.count(|w| w.taken += 1);
                Ok(Take::Done(Some(reused)))
            }
            Err(e) if is_status(&e, 409) => {
                claim.count(|w| w.takes_refused += 1);
                Ok(Take::ListAgain)
            }
            Err(source) => Err(SlotError {
                what: format!("marking slot Lease {name}"),
                source,
            }),
        };
    }
    for (_, named) in &plan.above {
        if state(jobs, named).await? == SlotState::Busy {
            return Ok(Take::Done(None));
        }
    }
    for (index, named) in plan.candidates {
        if foreign.contains(&index) {
            continue;
        }
        if let Some(named) = &named {
            if state(jobs, named).await? == SlotState::Busy {
                continue;
            }
        }
        let name = slots::slot_name(&queue_name, &scope.label(), index);
        let taken = Named::taken(claim.mine.clone(), claim.mark.clone());
        let written = match existing.remove(&index) {
            Some(mut lease) => {
                stamp(&mut lease, queue, &taken, claim.pod);
                leases.replace(&name, &PostParams::default(), &lease).await
            }
            None => {
                let lease = new_slot(queue, &scope.label(), &name, &taken, claim.pod);
                leases.create(&PostParams::default(), &lease).await
            }
        };
        match written {
            Ok(lease) => {
                claim.count(|w| w.taken += 1);
                tracing::debug!(slot = %name, pod = claim.pod, suggested = ?first, "Took slot Lease {name} for the claim {}", claim.mine.render());
                let own = Chain::of(queue).map(|chain| Own {
                    lease: Box::new(lease.clone()),
                    chain,
                    listed_at,
                });
                return Ok(Take::Done(Some(Taken {
                    name,
                    written: lease.metadata.resource_version,
                    scope: scope.clone(),
                    index,
                    own,
                    swapped: false,
                })));
            }
            // Another claimer took or made it first: the next one.
            Err(e) if is_status(&e, 409) => {
                claim.count(|w| w.takes_refused += 1);
                tracing::debug!(slot = %name, pod = claim.pod, suggested = ?first, "Slot Lease {name} was taken or made by another claimer first; trying the next");
                continue;
            }
            Err(source) => {
                return Err(SlotError {
                    what: format!("taking slot Lease {name}"),
                    source,
                })
            }
        }
    }
    Ok(Take::Done(None))
}

/// The slot Leases of queue `queue` that `selector` (a label selector) picks, from the watch
/// cache.
pub(crate) async fn list(
    leases: &Api<Lease>,
    queue: &str,
    selector: &str,
) -> Result<Vec<Lease>, SlotError> {
    let list = leases
        .list(&ListParams::default().labels(selector).match_any())
        .await
        .map_err(|source| SlotError {
            what: format!("listing the slots of queue {queue} ({selector})"),
            source,
        })?;
    Ok(list.items)
}

/// Whether the slot `lease` is owned by another LeasedQueue object than `queue` (an earlier
/// one of the same name, deleted: garbage collection deletes the slot). A slot owned by none
/// is not.
pub(crate) fn foreign_to(lease: &Lease, queue: &LeasedQueue) -> bool {
    let Some(uid) = queue.metadata.uid.as_deref() else {
        return false;
    };
    lease.owner_references().iter().any(|o| {
        o.kind == LeasedQueue::kind(&())
            && o.api_version.starts_with("leasehold.dev/")
            && o.uid != uid
    })
}

/// What the slot `lease` names: its holderIdentity, with the marks of its
/// [`CLAIMS_ANNOTATION`]; `None` when it names no claim.
pub(crate) fn named(lease: &Lease) -> Option<Named> {
    let claims = lease
        .annotations()
        .get(CLAIMS_ANNOTATION)
        .map(String::as_str);
    Named::read(leasehold_core::lease::holder_identity(lease), claims)
}

/// The state of a slot naming `named`, from a read of that job not older than the version it
/// names.
pub(crate) async fn state(jobs: &Api<LeasedJob>, named: &Named) -> Result<SlotState, SlotError> {
    let params = GetParams {
        resource_version: Some(named.holder.resource_version.clone()),
    };
    match jobs.get_with(&named.holder.job, &params).await {
        Ok(job) => Ok(slots::state_of(named, Some(&job))),
        Err(e) if is_status(&e, 404) => Ok(slots::state_of(named, None)),
        Err(source) => Err(SlotError {
            what: format!("reading LeasedJob {} named by a slot", named.holder.job),
            source,
        }),
    }
}

/// A new slot Lease: labelled with its queue and scope (its label, [`Scope::label`]),
/// [`stamp`]ed with `named` by `pod`.
pub(crate) fn new_slot(
    queue: &LeasedQueue,
    scope: &str,
    name: &str,
    named: &Named,
    pod: &str,
) -> Lease {
    let mut lease = Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                [
                    (SLOT_OF_LABEL.to_string(), queue.name_any()),
                    (SLOT_SCOPE_LABEL.to_string(), scope.to_string()),
                ]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        spec: None,
    };
    stamp(&mut lease, queue, named, pod);
    lease
}

/// Makes `lease` name `named` (for a claim: its copy, marked with its mark alone), taken now by
/// `pod`, and owned by `queue` as it is now (deleting that LeasedQueue deletes its slots; a slot left by an
/// earlier object of the same name is owned by the new one from its next take, so garbage
/// collection of the old one does not delete it).
pub(crate) fn stamp(lease: &mut Lease, queue: &LeasedQueue, named: &Named, pod: &str) {
    mark(lease, named);
    if let Some(spec) = lease.spec.as_mut() {
        spec.acquire_time = Some(leasehold_core::lease::micro_time(
            k8s_openapi::jiff::Timestamp::now(),
        ));
    }
    lease
        .annotations_mut()
        .insert(slots::TAKEN_BY_ANNOTATION.into(), pod.into());
    lease.metadata.owner_references = queue.uid().map(|uid| {
        vec![OwnerReference {
            api_version: LeasedQueue::api_version(&()).into(),
            kind: LeasedQueue::kind(&()).into(),
            name: queue.name_any(),
            uid,
            ..OwnerReference::default()
        }]
    });
}

/// Makes `lease` name `named`: its holderIdentity and, when it has marks, its
/// [`CLAIMS_ANNOTATION`] (removed otherwise).
fn mark(lease: &mut Lease, named: &Named) {
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    spec.holder_identity = Some(named.holder.render());
    match named.annotation() {
        Some(text) => {
            lease
                .annotations_mut()
                .insert(CLAIMS_ANNOTATION.into(), text);
        }
        None => {
            lease.annotations_mut().remove(CLAIMS_ANNOTATION);
        }
    }
}
