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

use crate::claim_index::{Change, ClaimIndex};
use crate::crd::LeasedJob;
use crate::queue;

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
}

/// One standing offer.
#[derive(Clone, Debug)]
struct Offer {
    /// The worker (its identity) the job was offered to.
    worker: String,
    /// Until when the offer withholds the job from the others.
    until: Timestamp,
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

    fn contains(&self, name: &str) -> bool {
        self.lanes.values().any(|l| l.index.contains(name))
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
    /// Queues whose LeasedQueue pauses claims: nothing of theirs is offered
    /// ([`crate::queue`]).
    paused: HashSet<QueueKey>,
    /// The weights of the concurrency keys of the queues whose LeasedQueue sets any.
    weights: HashMap<QueueKey, BTreeMap<String, i32>>,
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
                let Some(view) = key_of(job).and_then(|k| self.queues.get_mut(&k)) else {
                    return;
                };
                if let Some(lane) = view.lanes.get_mut(lane_key(job)) {
                    lane.index.observe(change);
                    if lane.index.is_empty() && !self.relisting {
                        view.lanes.remove(lane_key(job));
                    }
                }
                if let Some(name) = job.metadata.name.as_deref() {
                    view.offers.remove(name);
                }
            }
            Change::Applied(job) | Change::Relisted(job) => {
                let Some(key) = key_of(job) else {
                    return;
                };
                // A job the controller has not initialised yet (no status.phase) is not
                // offered: its initial status write, moments away, would meet the claim and
                // one of the two would be answered 409. Its next change brings it.
                if job.status.as_ref().and_then(|s| s.phase).is_none() {
                    return;
                }
                let relisting = self.relisting;
                let view = self
                    .queues
                    .entry(key)
                    .or_insert_with(|| QueueView::new(&job.spec.queue));
                let lane = view.lane(lane_key(job), relisting);
                lane.index.observe(change);
                let empty = lane.index.is_empty();
                if let Some(name) = job.metadata.name.as_deref() {
                    if !view.contains(name) {
                        view.offers.remove(name);
                    }
                }
                // A key whose last waiting job was claimed costs nothing until it has another.
                if empty && !relisting {
                    view.lanes.remove(lane_key(job));
                }
            }
            Change::RelistBegan => {
                self.relisting = true;
                for lane in self.queues.values_mut().flat_map(|v| v.lanes.values_mut()) {
                    lane.index.observe(change);
                }
            }
            Change::RelistDone => {
                self.relisting = false;
                self.listed = true;
                for view in self.queues.values_mut() {
                    for lane in view.lanes.values_mut() {
                        lane.index.observe(change);
                    }
                    view.lanes.retain(|_, l| !l.index.is_empty());
                    view.prune();
                }
                // Queues left with no job and no offer cost nothing to forget.
                self.queues
                    .retain(|_, v| !v.lanes.is_empty() || !v.offers.is_empty());
            }
        }
    }

    /// Whether the view has been complete once (a list of the jobs ended): a dispatcher
    /// restarted with an empty view must not answer "no job" while it lists.
    pub fn has_listed(&self) -> bool {
        self.listed
    }

    /// The job to offer `worker` from `queue` at `now`, and the offer recorded: the first
    /// claimable job in claim order on which no offer stands. Not even the worker a job stands
    /// offered to gets it again: a worker asks again right after claiming its offer, before
    /// the claim has come through the watch, and would be offered the job it has just
    /// claimed. (An offer whose answer was lost lapses after [`OFFER_TTL_MS`].) `None` when
    /// every claimable job stands offered, or none is claimable.
    pub fn offer(&mut self, queue: &QueueKey, worker: &str, now: Timestamp) -> Option<Hint> {
        if self.paused.contains(queue) {
            return None;
        }
        let weights = self.weights.get(queue);
        let view = self.queues.get_mut(queue)?;
        let (key, name, pass) = {
            let offers = &view.offers;
            let taken = |name: &str, _rv: &str| offers.get(name).is_some_and(|o| o.until > now);
            let vtime = view.vtime;
            // The key whose turn it is: the lowest pass (a key back from idle at the queue's
            // vtime), ties going to the head first in claim order (priority, then age), so a
            // queue of one key is offered in plain claim order.
            view.lanes
                .iter()
                .filter_map(|(key, lane)| {
                    let (name, place) = lane.index.head(now, taken)?;
                    Some((lane.pass.max(vtime), place, key, name))
                })
                .min_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)))
                .map(|(pass, _, key, name)| (key.clone(), name.to_string(), pass))?
        };
        let weight = weights.map_or(1, |w| queue::weight_of(w, &key));
        let lane = view.lanes.get_mut(&key)?;
        lane.pass = pass + STRIDE / u64::from(weight.max(1));
        view.vtime = pass;
        let resource_version = lane.index.resource_version(&name)?.to_string();
        view.offers.insert(
            name.clone(),
            Offer {
                worker: worker.to_string(),
                until: now + SignedDuration::from_millis(OFFER_TTL_MS),
            },
        );
        Some(Hint {
            name,
            resource_version,
        })
    }

    /// `worker` could not claim the job `name` of `queue` it was offered (it was no longer
    /// claimable when read, or the claim was refused): the offer ends, so the job is offered
    /// to others at once. An offer standing for another worker is left alone (a worker can
    /// only give back its own).
    pub fn declined(&mut self, queue: &QueueKey, name: &str, worker: &str) {
        if let Some(view) = self.queues.get_mut(queue) {
            if view.offers.get(name).is_some_and(|o| o.worker == worker) {
                view.offers.remove(name);
            }
        }
    }

    /// When a worker of `queue` that got no offer at `now` should ask again, if before its
    /// wait ends: when a job not claimable yet becomes claimable (notBefore, retryAfter), or
    /// when an offer to another worker lapses. New jobs are not foreseen: the caller wakes its
    /// waiting workers on every change of the queue.
    pub fn next_offer_at(&self, queue: &QueueKey, now: Timestamp) -> Option<Timestamp> {
        if self.paused.contains(queue) {
            return None;
        }
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

    /// Pauses (`true`) or resumes `queue`: while paused nothing of it is offered, and
    /// [`Dispatch::next_offer_at`] foresees nothing (its polls wait for the resume). True when
    /// that changed the queue's state. The sidecars read the pause themselves too: this only
    /// spares them offers they would decline.
    pub fn set_paused(&mut self, queue: &QueueKey, paused: bool) -> bool {
        if paused {
            self.paused.insert(queue.clone())
        } else {
            self.paused.remove(queue)
        }
    }

    /// Sets the weights of `queue`'s concurrency keys (its LeasedQueue's spec.weights; empty:
    /// every key weighs 1).
    pub fn set_weights(&mut self, queue: &QueueKey, weights: BTreeMap<String, i32>) {
        if weights.is_empty() {
            self.weights.remove(queue);
        } else {
            self.weights.insert(queue.clone(), weights);
        }
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

/// The queue of `job`: its namespace and `spec.queue` (`None` without a namespace, which a
/// namespaced object always has).
pub fn key_of(job: &LeasedJob) -> Option<QueueKey> {
    Some(QueueKey {
        namespace: job.metadata.namespace.clone()?,
        queue: job.spec.queue.clone(),
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;
    use crate::crd::{LeasedJobSpec, LeasedJobStatus, Phase};

    fn at_ms(ms: i64) -> Timestamp {
        Timestamp::from_millisecond(1_800_000_000_000 + ms).unwrap()
    }

    fn job(ns: &str, name: &str, priority: i32, created_s: i64, phase: Phase) -> LeasedJob {
        let mut j = LeasedJob::new(
            name,
            LeasedJobSpec {
                queue: "q".into(),
                priority,
                ..LeasedJobSpec::default()
            },
        );
        j.metadata.namespace = Some(ns.into());
        j.metadata.creation_timestamp = Some(Time(at_ms(created_s * 1000)));
        j.metadata.resource_version = Some(format!("rv-{name}-{phase:?}"));
        j.status = Some(LeasedJobStatus {
            phase: Some(phase),
            ..LeasedJobStatus::default()
        });
        j
    }

    fn q(ns: &str) -> QueueKey {
        QueueKey {
            namespace: ns.into(),
            queue: "q".into(),
        }
    }

    fn names(hint: Option<Hint>) -> Option<String> {
        hint.map(|h| h.name)
    }

    #[test]
    fn offers_go_in_claim_order_and_never_twice_while_they_stand() {
        let mut d = Dispatch::new();
        d.observe(Change::Applied(&job("ns", "old", 0, 1, Phase::Queued)));
        d.observe(Change::Applied(&job("ns", "new", 0, 2, Phase::Queued)));
        d.observe(Change::Applied(&job("ns", "urgent", 5, 3, Phase::Queued)));
        let now = at_ms(10_000);
        assert_eq!(names(d.offer(&q("ns"), "w1", now)), Some("urgent".into()));
        assert_eq!(names(d.offer(&q("ns"), "w2", now)), Some("old".into()));
        assert_eq!(names(d.offer(&q("ns"), "w3", now)), Some("new".into()));
        // Every job stands offered.
        assert_eq!(d.offer(&q("ns"), "w4", now), None);
        // Not even to the worker it stands offered to: it asks again right after its claim,
        // before the claim has come through the watch.
        assert_eq!(d.offer(&q("ns"), "w2", now), None);
        assert_eq!(d.next_offer_at(&q("ns"), now), Some(at_ms(12_000)));
    }

    fn keyed(name: &str, key: &str, created_s: i64) -> LeasedJob {
        let mut j = job("ns", name, 0, created_s, Phase::Queued);
        j.spec.concurrency_key = Some(key.into());
        j
    }

    /// Offers `n` times to distinct workers, each claim arriving before the next offer.
    fn offer_all(d: &mut Dispatch, n: usize, now: Timestamp) -> Vec<String> {
        (0..n)
            .map_while(|i| {
                let hint = d.offer(&q("ns"), &format!("w{i}"), now)?;
                let mut claimed = keyed(&hint.name, "", 0);
                claimed.status.as_mut().unwrap().phase = Some(Phase::Leased);
                // The claim's watch event: its key routes it, so set the job's own.
                claimed.spec.concurrency_key = Some(hint.name[..1].to_string());
                d.observe(Change::Applied(&claimed));
                Some(hint.name)
            })
            .collect()
    }

    #[test]
    fn keys_take_turns_so_a_small_key_is_not_stuck_behind_a_large_one() {
        let mut d = Dispatch::new();
        // Key a: 6 jobs, all older than key b's 2.
        for i in 0..6 {
            d.observe(Change::Applied(&keyed(&format!("a{i}"), "a", i)));
        }
        for i in 0..2 {
            d.observe(Change::Applied(&keyed(&format!("b{i}"), "b", 100 + i)));
        }
        let got = offer_all(&mut d, 8, at_ms(1_000_000));
        assert_eq!(got, ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]);
    }

    #[test]
    fn weights_share_offers_in_proportion() {
        let mut d = Dispatch::new();
        for i in 0..6 {
            d.observe(Change::Applied(&keyed(&format!("a{i}"), "a", i)));
            d.observe(Change::Applied(&keyed(&format!("b{i}"), "b", i)));
        }
        d.set_weights(&q("ns"), [("a".to_string(), 2)].into());
        let got = offer_all(&mut d, 9, at_ms(1_000_000));
        let a = got.iter().filter(|n| n.starts_with('a')).count();
        assert_eq!(a, 6, "a has twice b's share: {got:?}");
        assert_eq!(&got[..3].iter().filter(|n| n.starts_with('a')).count(), &2);
    }

    #[test]
    fn a_key_back_from_idle_takes_its_turn_without_bursting() {
        let mut d = Dispatch::new();
        for i in 0..8 {
            d.observe(Change::Applied(&keyed(&format!("a{i}"), "a", i)));
        }
        let now = at_ms(1_000_000);
        assert_eq!(offer_all(&mut d, 4, now), ["a0", "a1", "a2", "a3"]);
        // Key b arrives after a had the queue to itself for four offers: it alternates
        // with a from now on, it is not owed those four.
        for i in 0..3 {
            d.observe(Change::Applied(&keyed(&format!("b{i}"), "b", 100 + i)));
        }
        assert_eq!(offer_all(&mut d, 4, now), ["b0", "a4", "b1", "a5"]);
    }

    #[test]
    fn a_paused_queue_offers_nothing_until_resumed_and_other_queues_go_on() {
        let mut d = Dispatch::new();
        d.observe(Change::Applied(&job("ns", "a", 0, 1, Phase::Queued)));
        d.observe(Change::Applied(&job("other", "b", 0, 1, Phase::Queued)));
        let now = at_ms(10_000);
        assert!(d.set_paused(&q("ns"), true));
        assert!(!d.set_paused(&q("ns"), true), "already paused");
        assert_eq!(d.offer(&q("ns"), "w1", now), None);
        assert_eq!(d.next_offer_at(&q("ns"), now), None);
        assert_eq!(names(d.offer(&q("other"), "w2", now)), Some("b".into()));
        assert!(d.set_paused(&q("ns"), false));
        assert_eq!(names(d.offer(&q("ns"), "w1", now)), Some("a".into()));
    }

    #[test]
    fn an_offer_lapses_after_its_ttl_and_ends_with_a_claim_or_a_decline() {
        let mut d = Dispatch::new();
        d.observe(Change::Applied(&job("ns", "a", 0, 1, Phase::Queued)));
        d.observe(Change::Applied(&job("ns", "b", 0, 2, Phase::Queued)));
        let now = at_ms(0);
        assert_eq!(names(d.offer(&q("ns"), "w1", now)), Some("a".into()));
        // w1 vanished with its hint: a lapses after the TTL and goes to the next worker.
        let later = now + SignedDuration::from_millis(OFFER_TTL_MS - 1);
        assert_eq!(names(d.offer(&q("ns"), "w2", later)), Some("b".into()));
        let lapsed = now + SignedDuration::from_millis(OFFER_TTL_MS);
        assert_eq!(names(d.offer(&q("ns"), "w3", lapsed)), Some("a".into()));
        // w3 says it could not claim a: it is offered at once to the next one.
        d.declined(&q("ns"), "a", "w3");
        assert_eq!(names(d.offer(&q("ns"), "w4", lapsed)), Some("a".into()));
        // Another worker cannot end w4's offer.
        d.declined(&q("ns"), "a", "w3");
        assert_eq!(d.offer(&q("ns"), "w5", lapsed), None);
        // w4's claim arrives in the watch: a is no longer claimable, its offer is gone.
        d.observe(Change::Applied(&job("ns", "a", 0, 1, Phase::Leased)));
        assert_eq!(d.offers(), 1, "only b's offer stands");
        assert_eq!(d.queued(&q("ns")), 1);
    }

    #[test]
    fn queues_and_namespaces_are_kept_apart() {
        let mut d = Dispatch::new();
        d.observe(Change::Applied(&job("team-a", "a1", 0, 1, Phase::Queued)));
        let mut other = job("team-a", "x1", 0, 0, Phase::Queued);
        other.spec.queue = "other".into();
        d.observe(Change::Applied(&other));
        let now = at_ms(5_000);
        assert_eq!(d.offer(&q("team-b"), "w", now), None);
        assert_eq!(names(d.offer(&q("team-a"), "w", now)), Some("a1".into()));
        assert_eq!(d.queued(&q("team-a")), 1);
    }

    #[test]
    fn not_before_and_retry_after_hold_a_job_back_until_their_time() {
        let mut d = Dispatch::new();
        let mut later = job("ns", "later", 9, 1, Phase::Queued);
        later.spec.not_before = Some(Time(at_ms(60_000)));
        d.observe(Change::Applied(&later));
        d.observe(Change::Applied(&job("ns", "now", 0, 2, Phase::Queued)));
        let now = at_ms(10_000);
        assert_eq!(names(d.offer(&q("ns"), "w", now)), Some("now".into()));
        assert_eq!(d.offer(&q("ns"), "w2", now), None);
        assert_eq!(d.next_offer_at(&q("ns"), now), Some(at_ms(12_000)));
        let due = at_ms(60_000);
        assert_eq!(names(d.offer(&q("ns"), "w2", due)), Some("later".into()));
    }

    #[test]
    fn a_job_is_offered_only_once_the_controller_has_initialised_it() {
        let mut d = Dispatch::new();
        let mut fresh = job("ns", "fresh", 0, 1, Phase::Queued);
        fresh.status = None;
        d.observe(Change::Applied(&fresh));
        let now = at_ms(10_000);
        assert_eq!(
            d.offer(&q("ns"), "w", now),
            None,
            "its initial status is on its way"
        );
        d.observe(Change::Applied(&job("ns", "fresh", 0, 1, Phase::Queued)));
        assert_eq!(names(d.offer(&q("ns"), "w", now)), Some("fresh".into()));
    }

    #[test]
    fn the_view_counts_as_listed_from_its_first_lists_end_on() {
        let mut d = Dispatch::new();
        assert!(!d.has_listed(), "a new view is empty, not the queue");
        d.observe(Change::RelistBegan);
        d.observe(Change::Relisted(&job("ns", "a", 0, 1, Phase::Queued)));
        assert!(!d.has_listed(), "not while the first list runs");
        d.observe(Change::RelistDone);
        assert!(d.has_listed());
        d.observe(Change::RelistBegan);
        assert!(d.has_listed(), "a re-list keeps the old view answering");
    }

    #[test]
    fn a_relist_replaces_the_view_and_forgets_offers_on_jobs_gone_meanwhile() {
        let mut d = Dispatch::new();
        d.observe(Change::Applied(&job("ns", "a", 0, 1, Phase::Queued)));
        d.observe(Change::Applied(&job("ns", "b", 0, 2, Phase::Queued)));
        let now = at_ms(10_000);
        assert_eq!(names(d.offer(&q("ns"), "w1", now)), Some("a".into()));
        assert_eq!(names(d.offer(&q("ns"), "w2", now)), Some("b".into()));
        // The watch expired (410) and re-listed: a was claimed meanwhile, c is new, and a
        // queue of another namespace appears during the list.
        d.observe(Change::RelistBegan);
        d.observe(Change::Relisted(&job("ns", "a", 0, 1, Phase::Leased)));
        d.observe(Change::Relisted(&job("ns", "b", 0, 2, Phase::Queued)));
        d.observe(Change::Relisted(&job("ns", "c", 0, 3, Phase::Queued)));
        d.observe(Change::Relisted(&job("ns2", "z", 0, 3, Phase::Queued)));
        // Until the list ends, the old view answers.
        assert_eq!(d.queued(&q("ns")), 2);
        d.observe(Change::RelistDone);
        assert_eq!(d.queued(&q("ns")), 2);
        assert_eq!(d.queued(&q("ns2")), 1);
        assert_eq!(d.offers(), 1, "b's offer stands, a's went with it");
        assert_eq!(names(d.offer(&q("ns"), "w3", now)), Some("c".into()));
        assert_eq!(names(d.offer(&q("ns2"), "w3", now)), Some("z".into()));
    }

    #[test]
    fn a_queue_emptied_by_a_relist_is_forgotten() {
        let mut d = Dispatch::new();
        d.observe(Change::Applied(&job("ns", "a", 0, 1, Phase::Queued)));
        d.observe(Change::RelistBegan);
        d.observe(Change::RelistDone);
        assert_eq!(d.queued(&q("ns")), 0);
        assert!(d.queues.is_empty());
    }
}
