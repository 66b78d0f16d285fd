//! The dispatcher's decisions: which waiting job is offered to which waiting worker, so that
//! no two workers are offered the same job while an offer stands.
//!
//! The dispatcher keeps one view of every queue's claimable jobs, in claim order (the
//! [`ClaimIndex`] of each queue: priority, highest first, then age, honouring notBefore and
//! retryAfter), and answers a worker that asks for work with a [`Hint`]: the first job in that
//! order that stands offered to nobody else. The offer stands for [`OFFER_TTL_MS`]; it ends
//! early when the job leaves the queue's claimable jobs (the worker's claim arrived in the
//! watch, or anyone else's change did) or when the worker says it could not claim it
//! ([`Dispatch::declined`]). A lapsed offer is offered again.
//!
//! A hint is advice, never a grant. The worker claims the job itself, with the claim write
//! of [`crate::claim`] made from a copy it reads from the API server, guarded by that copy's
//! resourceVersion. A stale, doubled or invented hint therefore costs the worker at most one
//! read and one refused write, never a second holder: every safety argument of
//! docs/protocol.md holds with a dispatcher that is wrong, slow or lying. The shape is that of
//! Temporal's matching service, which hands a task to a long-polling worker ("sync match"),
//! with the API server's conditional write as the arbiter instead of the matching service's
//! own.
//!
//! Pure: the caller passes the time, and feeds the watch events of every job it sees with
//! [`Dispatch::observe`] (the jobs of every queue of every namespace it watches).

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::claim_index::{Change, ClaimIndex, Place};
use crate::crd::LeasedJob;
use crate::queue;
use crate::slots::Preferred;

/// Name of the Lease through which the leading replica tells sidecars where its dispatcher
/// answers (in the leader Lease's namespace; with `--leader-elect false`, in the controller's
/// namespace). Its annotation [`ADDRESS_ANNOTATION`] holds `host:port`, its holderIdentity
/// the leading replica's identity. Sidecars read it; they never write it.
pub const ADVERT_LEASE: &str = "leasehold-dispatcher";

/// The annotation of [`ADVERT_LEASE`] holding the dispatcher's `host:port` (plain HTTP).
pub const ADDRESS_ANNOTATION: &str = "leasehold.dev/dispatcher-address";

/// How long an offer withholds its job from every other worker, in milliseconds: long enough
/// for the worker to read the job and write its claim (two API calls, tens of milliseconds;
/// a second on a loaded API server), short enough that a worker that vanished with its hint
/// delays the job by little.
pub const OFFER_TTL_MS: i64 = 2_000;

/// A queue, as the dispatcher names it: its namespace and `spec.queue`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueKey {
    /// The jobs' namespace.
    pub namespace: String,
    /// Their `spec.queue`.
    pub queue: String,
}

/// A job offered to a worker: its name and the resourceVersion the dispatcher saw. The worker
/// claims from the copy it reads itself; the resourceVersion only lets it tell that the
/// dispatcher's view was older than its read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hint {
    /// metadata.name of the job, in the queue's namespace.
    pub name: String,
    /// metadata.resourceVersion of the job as the dispatcher saw it.
    pub resource_version: String,
    /// In a queue with limits, the slot of each limited scope of the job to try first: one
    /// that no Leased job holds as far as the view knows and no other standing offer was
    /// suggested (advice, as the rest: [`Preferred`]; the order: `suggest`).
    pub slots: Preferred,
    /// Those of `slots` suggested as the asker's own free slot, which it may swap
    /// ([`OwnSlot`]); the others it takes as usual.
    pub swaps: Preferred,
}

/// A free slot a worker names when it asks: one it took itself and whose attempt it has
/// since ended by its own write, which it may swap for its next claim in that scope
/// ([`crate::slots::may_swap`]; docs/protocol.md, "Limits": swapping one's own slot). Advice
/// about which job and slot to offer it, never more: a wrong one costs its claim the usual
/// take (a list and a read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnSlot {
    /// The slot's concurrency key; None for the queue's scope (`maxLeased`).
    pub key: Option<String>,
    /// Its index.
    pub index: u32,
}

/// One standing offer.
#[derive(Clone, Debug)]
struct Offer {
    /// The job's concurrency key (the empty key for none).
    key: String,
    /// The worker the job was offered to, as the dispatcher's HTTP edge names it: the name the
    /// poll gave, bound to the caller's credentials.
    worker: String,
    /// Until when the offer withholds the job from the others.
    until: Timestamp,
    /// The slots suggested with it.
    slots: Preferred,
}

/// A Leased job, as the dispatcher follows it for the limits.
#[derive(Clone, Debug)]
struct Held {
    /// Its concurrency key (the empty key for none).
    key: String,
    /// The list epoch that saw it last.
    seen: u32,
    /// The attempt it is Leased at (`status.attempt`).
    attempt: i32,
    /// The slots suggested with the offer this attempt was claimed from, if it was offered:
    /// the slots it most likely holds (its claimer may have taken others).
    slots: Preferred,
    /// The worker that offer was made to, if it was offered.
    worker: Option<String>,
}

/// The claimable jobs of one concurrency key of a queue, and its turn.
#[derive(Debug)]
struct Lane {
    index: ClaimIndex,
    /// Its pass in the queue's stride schedule: the lane with the lowest (not below the
    /// queue's [`QueueView::vtime`]) is offered next, and advances by [`STRIDE`] / weight.
    pass: u64,
}

/// A weight of 1 advances a key's pass by this much per offer; a weight of w by this / w.
const STRIDE: u64 = 1_000_000;

/// One queue's view: its claimable jobs, by concurrency key, and the offers standing on them.
#[derive(Debug)]
struct QueueView {
    queue: String,
    /// spec.concurrencyKey (the empty key for none) -> its jobs and turn.
    lanes: HashMap<String, Lane>,
    /// Job name -> the offer standing on it.
    offers: HashMap<String, Offer>,
    /// The pass of the last key offered: a key that had no waiting job for a while starts
    /// from here, so it takes its turn but does not burst to catch up.
    vtime: u64,
}

impl QueueView {
    fn new(queue: &str) -> QueueView {
        QueueView {
            queue: queue.to_string(),
            lanes: HashMap::new(),
            offers: HashMap::new(),
            vtime: 0,
        }
    }

    /// The lane of `key`, made (and brought into a re-list under way) if need be.
    fn lane(&mut self, key: &str, relisting: bool) -> &mut Lane {
        let queue = &self.queue;
        self.lanes.entry(key.to_string()).or_insert_with(|| {
            let mut index = ClaimIndex::new(queue);
            if relisting {
                index.observe(Change::RelistBegan);
            }
            Lane { index, pass: 0 }
        })
    }

    /// Forgets the lane of `key` if it has no waiting job and its turn has come (its pass is
    /// not ahead of the queue's): a key whose only job was just claimed keeps its place in
    /// the turns, so refilling it one job at a time does not jump the queue; one idle long
    /// enough costs nothing.
    fn forget_if_idle(&mut self, key: &str) {
        let vtime = self.vtime;
        if self
            .lanes
            .get(key)
            .is_some_and(|l| l.index.is_empty() && l.pass <= vtime)
        {
            self.lanes.remove(key);
        }
    }

    /// Forgets offers on jobs that are no longer claimable candidates of the queue.
    fn prune(&mut self) {
        let lanes = &self.lanes;
        self.offers
            .retain(|name, _| lanes.values().any(|l| l.index.contains(name)));
    }

    fn len(&self) -> usize {
        self.lanes.values().map(|l| l.index.len()).sum()
    }
}

/// The concurrency key of `job` (the empty key for none).
fn lane_key(job: &LeasedJob) -> &str {
    job.spec.concurrency_key.as_deref().unwrap_or_default()
}

/// Every queue's view, and the offers standing on their jobs (see the module doc).
#[derive(Debug, Default)]
pub struct Dispatch {
    queues: HashMap<QueueKey, QueueView>,
    /// Whether a (re-)list is under way: queues first seen during it start one too.
    relisting: bool,
    /// Whether a list has ended once: before that the view is not the API server's, and
    /// nothing is offered from it.
    listed: bool,
    /// What the LeasedQueues of the queues that have one set: weights and limits.
    policies: HashMap<QueueKey, Policy>,
    /// The Leased jobs of every queue, by name, to keep offers within the limits and suggest
    /// slots (advice: the slots are what holds them).
    leased: HashMap<QueueKey, HashMap<String, Held>>,
    /// Bumped at each (re-)list: entries of `leased` not seen by the list are dropped at its end.
    epoch: u32,
    /// Who took each slot of each queue last: a worker naming a free slot of its own is
    /// suggested it only while nobody else took it since (else its swap would be refused),
    /// and other workers are suggested such slots last.
    owners: HashMap<QueueKey, Owners>,
    /// Claims seen so far (the clock of [`Owner::seen`]).
    claims_seen: u64,
}

/// Who took each slot of a queue last, as far as the view knows ([`Dispatch`]'s `owners`), by
/// scope (its concurrency key, or the empty key for the queue's own, `maxLeased`: keys are
/// never empty) and index: the worker whose claim from an offer took it (None for a claim
/// made without one), and when, by the count of claims the view had seen.
type Owners = HashMap<String, HashMap<u32, Owner>>;

/// Who took a slot last ([`Owners`]).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Owner {
    /// The worker of the claim, if it came from an offer.
    worker: Option<String>,
    /// The view's count of claims seen when it saw this one.
    seen: u64,
}

/// The most scopes whose slots' last workers the view keeps per queue ([`Dispatch`]'s
/// `owners`; each has at most [`crate::slots::MAX_LIMIT`] slots); past it they are forgotten
/// at once, which costs swaps, never a limit.
const MAX_OWNER_SCOPES: usize = 10_000;

/// What a queue's LeasedQueue sets that the dispatcher follows ([`crate::queue`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// spec.weights.
    pub weights: BTreeMap<String, i32>,
    /// spec.maxLeased.
    pub max_leased: Option<u32>,
    /// spec.maxLeasedPerKey.
    pub max_leased_per_key: Option<u32>,
}

impl Policy {
    /// The policy `spec` sets.
    pub fn of(spec: &queue::LeasedQueueSpec) -> Policy {
        let limit = |l: Option<i32>| l.and_then(|l| u32::try_from(l).ok());
        Policy {
            weights: spec.weights.clone(),
            max_leased: limit(spec.max_leased),
            max_leased_per_key: limit(spec.max_leased_per_key),
        }
    }
}

impl Dispatch {
    /// An empty view.
    pub fn new() -> Dispatch {
        Dispatch::default()
    }

    /// Follows one watch event of the jobs the dispatcher watches (every queue). A job that
    /// stops being a claimable candidate (claimed, cancelled, deleted) takes its offer with it.
    pub fn observe(&mut self, change: Change<'_>) {
        match change {
            Change::Deleted(job) => {
                if let (Some(q), Some(name)) = (key_of(job), job.metadata.name.as_deref()) {
                    if let Some(l) = self.leased.get_mut(&q) {
                        l.remove(name);
                    }
                }
                let Some(view) = key_of(job).and_then(|k| self.queues.get_mut(&k)) else {
                    return;
                };
                if let Some(lane) = view.lanes.get_mut(lane_key(job)) {
                    lane.index.observe(change);
                }
                if !self.relisting {
                    view.forget_if_idle(lane_key(job));
                }
                if let Some(name) = job.metadata.name.as_deref() {
                    view.offers.remove(name);
                }
            }
            Change::Applied(job) | Change::Relisted(job) => {
                self.note_leased(job);
                let Some(key) = key_of(job) else {
                    return;
                };
                // A job the controller has not initialised yet (no status.phase) is Queued,
                // and offered at once: the controller holds its initial status write back
                // while the job may be claimed through an offer (`Dispatch::offered`), so
                // that a waiting worker gets a new job one write and one watch event sooner,
                // and the two writes rarely meet (one of them would be answered 409).
                let relisting = self.relisting;
                let queued = job.phase() == crate::crd::Phase::Queued;
                let lane_key = lane_key(job);
                let view = match self.queues.get_mut(&key) {
                    Some(view) => view,
                    None if queued => self
                        .queues
                        .entry(key)
                        .or_insert_with(|| QueueView::new(&job.spec.queue)),
                    None => return,
                };
                // A lane is made for a Queued job only: other jobs leave or pass it by.
                let lane = match view.lanes.contains_key(lane_key) {
                    true => view.lanes.get_mut(lane_key),
                    false if queued => Some(view.lane(lane_key, relisting)),
                    false => None,
                };
                if let Some(lane) = lane {
                    lane.index.observe(change);
                }
                if let Some(name) = job.metadata.name.as_deref() {
                    let lane = view.lanes.get(lane_key);
                    if !lane.is_some_and(|l| l.index.contains(name)) {
                        view.offers.remove(name);
                    }
                }
                if !relisting {
                    view.forget_if_idle(lane_key);
                }
            }
            Change::RelistBegan => {
                self.relisting = true;
                self.epoch = self.epoch.wrapping_add(1);
                for lane in self.queues.values_mut().flat_map(|v| v.lanes.values_mut()) {
                    lane.index.observe(change);
                }
            }
            Change::RelistDone => {
                self.relisting = false;
                self.listed = true;
                let epoch = self.epoch;
                for l in self.leased.values_mut() {
                    l.retain(|_, held| held.seen == epoch);
                }
                self.leased.retain(|_, l| !l.is_empty());
                for view in self.queues.values_mut() {
                    for lane in view.lanes.values_mut() {
                        lane.index.observe(change);
                    }
                    let vtime = view.vtime;
                    view.lanes
                        .retain(|_, l| !l.index.is_empty() || l.pass > vtime);
                    view.prune();
                }
                // Queues left with no job and no offer cost nothing to forget.
                self.queues
                    .retain(|_, v| !v.lanes.is_empty() || !v.offers.is_empty());
                let (queues, leased) = (&self.queues, &self.leased);
                self.owners
                    .retain(|q, _| queues.contains_key(q) || leased.contains_key(q));
            }
        }
    }

    /// Whether the view has been complete once (a list of the jobs ended): a dispatcher
    /// restarted with an empty view must not answer "no job" while it lists.
    pub fn has_listed(&self) -> bool {
        self.listed
    }

    /// What [`Dispatch::offer`] would offer at `now` from `queue`, recording nothing: the
    /// concurrency key, the job's name and the key's pass.
    fn next_offer(
        &self,
        queue: &QueueKey,
        now: Timestamp,
        asker: (&str, &[OwnSlot]),
    ) -> Option<(String, String, u64)> {
        self.next_offers(queue, now, 1, None, asker).pop()
    }

    /// The next `n` offers (at most) that [`Dispatch::offer`] would make at `now` from `queue`
    /// to `n` workers asking one after another, each offer standing when the next is made,
    /// recording nothing: (concurrency key, job name, the key's pass) of each, in order. Stops
    /// early after the job `until` when given. Among the keys whose turn it is (the lowest
    /// pass) with heads of the same priority, those the asker (`asker`: the worker and the
    /// free slots it names) names a free slot of that it took last come first:
    /// which of them goes first is free in the stride schedule, and the asker can then swap
    /// its slot. Exact shares and priorities stay as they are.
    fn next_offers(
        &self,
        queue: &QueueKey,
        now: Timestamp,
        n: usize,
        until: Option<&str>,
        asker: (&str, &[OwnSlot]),
    ) -> Vec<(String, String, u64)> {
        let mut next = Vec::new();
        let Some(view) = self.queues.get(queue) else {
            return next;
        };
        let policy = self.policies.get(queue);
        let leased = self.leased.get(queue);
        let offers = &view.offers;
        // Within the limits, counting the offers that stand as claims to come: a scope
        // at its limit is not offered (its sidecars would find no free slot). Counted
        // once per offer, by key, and only for a queue with limits.
        let (max, per_key) = policy.map_or((None, None), |p| (p.max_leased, p.max_leased_per_key));
        let limited = max.is_some() || per_key.is_some();
        let mut used: HashMap<&str, usize> = HashMap::new();
        if limited {
            let leased_keys = leased.into_iter().flat_map(|l| l.values().map(|h| &h.key));
            let offered_keys = offers.values().filter(|o| o.until > now).map(|o| &o.key);
            for key in leased_keys.chain(offered_keys) {
                *used.entry(key).or_default() += 1;
            }
        }
        let room = |max: Option<u32>, n: usize| max.is_none_or(|m| n < m as usize);
        // A key the asker names a free slot of, below the limit, that it took last (only keys
        // have slots of their own): the slot it could swap.
        let (worker, own) = asker;
        let owners = self.owners.get(queue);
        let fits = |key: &str| {
            !key.is_empty()
                && own.iter().any(|o| {
                    o.key.as_deref() == Some(key)
                        && per_key.is_some_and(|limit| o.index < limit)
                        && owners
                            .and_then(|w| w.get(key)?.get(&o.index))
                            .is_some_and(|o| o.worker.as_deref() == Some(worker))
                })
        };
        // The offers told so far, as `offer` would have recorded them.
        let mut told: HashSet<String> = HashSet::new();
        let mut passes: HashMap<&str, u64> = HashMap::new();
        let mut vtime = view.vtime;
        while next.len() < n && room(max, used.values().sum()) {
            let taken = |name: &str, _rv: &str| {
                told.contains(name) || offers.get(name).is_some_and(|o| o.until > now)
            };
            // The key whose turn it is: the lowest pass (a key back from idle at the queue's
            // vtime), ties going to the head first in claim order (priority, then age), so a
            // queue of one key is offered in plain claim order.
            let Some((pass, key, name)) = view
                .lanes
                .iter()
                .filter(|(key, _)| {
                    key.is_empty() || room(per_key, used.get(key.as_str()).copied().unwrap_or(0))
                })
                .filter_map(|(key, lane)| {
                    let (name, place) = lane.index.head(now, taken)?;
                    let pass = passes.get(key.as_str()).copied().unwrap_or(lane.pass);
                    Some((pass.max(vtime), place, key, name))
                })
                .min_by(|a, b| {
                    let order = |(pass, place, key, _): &(u64, &Place, &String, &str)| {
                        (
                            *pass,
                            std::cmp::Reverse(place.priority()),
                            !fits(key.as_str()),
                        )
                    };
                    order(a).cmp(&order(b)).then_with(|| a.1.cmp(b.1))
                })
                .map(|(pass, _, key, name)| (pass, key, name.to_string()))
            else {
                break;
            };
            let weight = policy.map_or(1, |p| queue::weight_of(&p.weights, key));
            passes.insert(key.as_str(), pass + STRIDE / u64::from(weight.max(1)));
            vtime = pass;
            if limited {
                *used.entry(key.as_str()).or_default() += 1;
            }
            let last = until == Some(name.as_str());
            told.insert(name.clone());
            next.push((key.clone(), name, pass));
            if last {
                break;
            }
        }
        next
    }

    /// Whether the job `name` is among the next `n` offers from `queue` at `now`: `n` workers
    /// asking now, one after another, would be offered it.
    pub fn offers_within(&self, queue: &QueueKey, name: &str, now: Timestamp, n: usize) -> bool {
        self.next_offers(queue, now, n, Some(name), ("", &[]))
            .iter()
            .any(|(_, next, _)| next == name)
    }

    /// The job to offer `worker` from `queue` at `now`, and the offer recorded: the first
    /// claimable job in claim order on which no offer stands. Not even the worker a job stands
    /// offered to gets it again: a worker asks again right after claiming its offer, before
    /// the claim has come through the watch, and would be offered the job it has just
    /// claimed. (An offer whose answer was lost lapses after [`OFFER_TTL_MS`].) `None` when
    /// every claimable job stands offered, or none is claimable.
    pub fn offer(&mut self, queue: &QueueKey, worker: &str, now: Timestamp) -> Option<Hint> {
        self.offer_fitting(queue, worker, now, &[])
    }

    /// [`Dispatch::offer`] to a worker that names `own`, free slots it may swap
    /// ([`OwnSlot`]): among the keys whose turn it is (with heads of equal priority), a job
    /// of a key it names a slot of that it took last (below the limit) first, and that slot
    /// suggested to swap ([`Hint::swaps`]) where the view has it held for no other worker's
    /// job or standing offer.
    pub fn offer_fitting(
        &mut self,
        queue: &QueueKey,
        worker: &str,
        now: Timestamp,
        own: &[OwnSlot],
    ) -> Option<Hint> {
        let (key, name, pass) = self.next_offer(queue, now, (worker, own))?;
        let policy = self.policies.get(queue);
        let leased = self.leased.get(queue);
        let view = self.queues.get_mut(queue)?;
        let weight = policy.map_or(1, |p| queue::weight_of(&p.weights, &key));
        let lane = view.lanes.get_mut(&key)?;
        lane.pass = pass + STRIDE / u64::from(weight.max(1));
        view.vtime = pass;
        let resource_version = lane.index.resource_version(&name)?;
        let no_owners = Owners::new();
        let owners = self.owners.get(queue).unwrap_or(&no_owners);
        let (slots, swaps) = match policy {
            Some(p) => suggest(p, leased, &view.offers, (&key, worker, own, owners), now),
            None => (Preferred::NONE, Preferred::NONE),
        };

        // Lanes kept only for their place in the turns, whose turn has now come, go.
        view.lanes
            .retain(|_, l| !l.index.is_empty() || l.pass > pass);
        view.offers.insert(
            name.clone(),
            Offer {
                key,
                worker: worker.to_string(),
                until: now + SignedDuration::from_millis(OFFER_TTL_MS),
                slots,
            },
        );
        Some(Hint {
            name,
            resource_version,
            slots,
            swaps,
        })
    }

    /// `worker` could not claim the job `name` of `queue` it was offered (it was no longer
    /// claimable when read, or the claim was refused): the offer ends, so the job is offered
    /// to others at once. An offer standing for another worker is left alone. `worker` is the
    /// identity [`Dispatch::offer`] was given: the dispatcher's HTTP edge binds the name a
    /// request gives to the credentials it came with (the caller's user, and the pod its token
    /// is bound to), so a caller cannot end an offer made to another's worker, unless both use
    /// tokens of one ServiceAccount bound to no pod (one caller). Even then it costs what a
    /// doubled offer costs (the job is offered to another worker at once, and one of the two
    /// loses the race: a read or a 409, and a decline), never a second holder. Returns whether
    /// an offer ended.
    pub fn declined(&mut self, queue: &QueueKey, name: &str, worker: &str) -> bool {
        let Some(view) = self.queues.get_mut(queue) else {
            return false;
        };
        if view.offers.get(name).is_some_and(|o| o.worker == worker) {
            view.offers.remove(name);
            return true;
        }
        false
    }

    /// When a worker of `queue` that got no offer at `now` should ask again, if before its
    /// wait ends: when a job not claimable yet becomes claimable (notBefore, retryAfter), or
    /// when an offer to another worker lapses. New jobs are not foreseen: the caller has a
    /// waiting worker look again on every change of the queue.
    pub fn next_offer_at(&self, queue: &QueueKey, now: Timestamp) -> Option<Timestamp> {
        let view = self.queues.get(queue)?;
        let lapse = view
            .offers
            .values()
            .filter(|o| o.until > now)
            .map(|o| o.until)
            .min();
        let opens = view
            .lanes
            .values()
            .filter_map(|l| l.index.next_claimable_at(now))
            .min();
        match (opens, lapse) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Sets what `queue`'s LeasedQueue says (None: it has none): its keys' weights and its
    /// limits.
    pub fn set_policy(&mut self, queue: &QueueKey, policy: Option<Policy>) {
        match policy {
            Some(p) => self.policies.insert(queue.clone(), p),
            None => self.policies.remove(queue),
        };
    }

    /// Follows which jobs are Leased, for the limits, and the slots suggested with the offer a
    /// job was claimed from (called before the offer is forgotten).
    fn note_leased(&mut self, job: &LeasedJob) {
        let (Some(queue), Some(name)) = (key_of(job), job.metadata.name.as_deref()) else {
            return;
        };
        if job.phase() == crate::crd::Phase::Leased {
            let offer = self.queues.get(&queue).and_then(|v| v.offers.get(name));
            // The worker the offer stood for, if its claim is that worker's: a job offered to
            // one sidecar may be claimed by another choosing on its own. The HTTP edge names a
            // worker `<caller>|<name>`, the name being the sidecar's, which its claim records
            // as the holder.
            let status = job.status.as_ref();
            let holder = status.and_then(|s| s.holder.as_deref());
            let worker = offer.map(|o| o.worker.clone()).filter(|w| {
                holder.is_none_or(|h| w == h || w.strip_suffix(h).is_some_and(|c| c.ends_with('|')))
            });
            // The slots its claim recorded taking, else those its offer suggested.
            let index = |i: Option<i32>| i.and_then(|i| u32::try_from(i).ok());
            let recorded = Preferred {
                queue: index(status.and_then(|s| s.queue_slot)),
                key: index(status.and_then(|s| s.key_slot)),
            };
            let offered = match recorded {
                Preferred::NONE => offer.map(|o| o.slots),
                recorded => Some(recorded),
            };
            // Whose they are now, once per attempt: the claim's worker if it came from an offer.
            let attempt = job.attempt();
            let new_attempt = self
                .leased
                .get(&queue)
                .and_then(|l| l.get(name))
                .is_none_or(|h| h.attempt != attempt);
            if let (Some(slots), true) = (offered, new_attempt) {
                self.claims_seen += 1;
                let key = lane_key(job);
                let owner = Owner {
                    worker: worker.clone(),
                    seen: self.claims_seen,
                };
                let owners = self.owners.entry(queue.clone()).or_default();
                if owners.len() >= MAX_OWNER_SCOPES {
                    owners.clear();
                }
                if let Some(i) = slots.queue {
                    owners
                        .entry(String::new())
                        .or_default()
                        .insert(i, owner.clone());
                }
                if let (Some(i), false) = (slots.key, key.is_empty()) {
                    owners.entry(key.to_string()).or_default().insert(i, owner);
                }
            }
            let epoch = self.epoch;
            let held = self
                .leased
                .entry(queue)
                .or_default()
                .entry(name.to_string())
                .or_insert_with(|| Held {
                    key: lane_key(job).to_string(),
                    seen: epoch,
                    attempt,
                    slots: offered.unwrap_or_default(),
                    worker: worker.clone(),
                });
            // Leased again at a later attempt without a change seen in between (a re-list
            // spanned it): the slots of that attempt's offer, if any.
            if held.attempt != attempt {
                held.attempt = attempt;
                held.slots = offered.unwrap_or_default();
                held.worker = worker;
            }
            held.seen = epoch;
            held.key = lane_key(job).to_string();
        } else if let Some(l) = self.leased.get_mut(&queue) {
            l.remove(name);
        }
    }

    /// Whether an offer of the job `name` of `queue` stands at `now` (made, not lapsed,
    /// declined or ended by a change of the job).
    pub fn offered(&self, queue: &QueueKey, name: &str, now: Timestamp) -> bool {
        self.queues
            .get(queue)
            .and_then(|v| v.offers.get(name))
            .is_some_and(|o| o.until > now)
    }

    /// Claimable candidates of `queue` (Queued, not cancelled or being deleted), claimable now
    /// or later.
    pub fn queued(&self, queue: &QueueKey) -> usize {
        self.queues.get(queue).map_or(0, QueueView::len)
    }

    /// Offers standing or lapsed but not yet forgotten, over every queue.
    pub fn offers(&self) -> usize {
        self.queues.values().map(|v| v.offers.len()).sum()
    }
}

/// The slots to suggest with an offer of a job of concurrency key `key` (the empty key for
/// none) to `worker`, which names the free slots `own`, under `policy`, `owners` saying who
/// took each slot last. In each limited scope, among the indices below the limit that no
/// Leased job of the scope holds (`leased`: by the slots its claim recorded, else those its
/// offer suggested) and no offer standing at `now` was suggested (`offers`): the worker's own
/// free slot if it names one that it took last (its own Leased job may still hold it in the
/// view, which learns of the job's end after the worker does); else one it took last; else
/// the one taken longest ago (never, first; then the lowest index). None where every index is
/// so taken (jobs Leased without a recorded slot hold slots the dispatcher cannot place: the
/// claimer finds the free one itself). Returns the slots, and those of them suggested as the
/// worker's own, to swap ([`Hint::swaps`]): the worker swaps only those, so a slot it names
/// that another took since is taken as usual if suggested, never swapped and refused.
fn suggest(
    policy: &Policy,
    leased: Option<&HashMap<String, Held>>,
    offers: &HashMap<String, Offer>,
    (key, worker, own, owners): (&str, &str, &[OwnSlot], &Owners),
    now: Timestamp,
) -> (Preferred, Preferred) {
    let held = leased.into_iter().flat_map(|l| {
        l.values()
            .map(|h| (h.key.as_str(), h.slots, h.worker.as_deref() == Some(worker)))
    });
    let offered = offers
        .values()
        .filter(|o| o.until > now)
        .map(|o| (o.key.as_str(), o.slots, false));
    // Taken by anyone, and by anyone but this worker's Leased jobs.
    let (mut in_queue, mut in_key) = (HashSet::new(), HashSet::new());
    let (mut others_queue, mut others_key) = (HashSet::new(), HashSet::new());
    for (k, slots, its_own) in held.chain(offered) {
        in_queue.extend(slots.queue);
        if !its_own {
            others_queue.extend(slots.queue);
        }
        if k == key {
            in_key.extend(slots.key);
            if !its_own {
                others_key.extend(slots.key);
            }
        }
    }
    let cap = |limit: Option<u32>| limit.map(|l| l.min(crate::slots::MAX_LIMIT.unsigned_abs()));
    let pick =
        |limit: Option<u32>, scope: Option<&str>, taken: &HashSet<u32>, others: &HashSet<u32>| {
            let limit = cap(limit)?;
            let of_scope = owners.get(scope.unwrap_or_default());
            let owner = |i: u32| of_scope?.get(&i);
            let its = |i: u32| owner(i).is_some_and(|o| o.worker.as_deref() == Some(worker));
            let mine = own
                .iter()
                .filter(|o| o.key.as_deref() == scope)
                .map(|o| o.index)
                .find(|i| *i < limit && !others.contains(i) && its(*i));
            // Else a free one it took last itself, else the one taken longest ago (never is
            // longest): its taker is the least likely to come back for it now, and the API
            // server's watch cache has long shown its last write to the claimer's list.
            let free = || (0..limit).filter(|i| !taken.contains(i));
            let other = free()
                .find(|i| its(*i))
                .or_else(|| free().min_by_key(|i| (owner(*i).map_or(0, |o| o.seen), *i)));
            Some(match mine {
                Some(i) => (Some(i), Some(i)),
                None => (other, None),
            })
        };
    let (queue, queue_swap) =
        pick(policy.max_leased, None, &in_queue, &others_queue).unwrap_or_default();
    let (key, key_swap) = match key {
        "" => None,
        _ => pick(policy.max_leased_per_key, Some(key), &in_key, &others_key),
    }
    .unwrap_or_default();
    (
        Preferred { queue, key },
        Preferred {
            queue: queue_swap,
            key: key_swap,
        },
    )
}

/// The queue of `job`: its namespace and `spec.queue` (`None` without a namespace, which a
/// namespaced object always has).
pub fn key_of(job: &LeasedJob) -> Option<QueueKey> {
    Some(QueueKey {
        namespace: job.metadata.namespace.clone()?,
        queue: job.spec.queue.clone(),
    })
}

#[cfg(test)]
mod tests;
