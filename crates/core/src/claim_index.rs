//! An index of a queue's watch cache for claiming, kept up to date from the watch's events, so
//! that choosing a job costs the size of the claim window, not the length of the queue.
//!
//! The rules stay those of [`crate::claim`]: the claimable jobs ([`claim::claimable`]) of the
//! highest priority present, in FIFO order (creationTimestamp, then name), and the claimers
//! seen claiming in the last [`claim::RECENT_CLAIM_SECONDS`]. Scanning the whole cache for
//! them on every pick cost a sidecar milliseconds per pick with 100,000 jobs queued, and ten
//! sidecars claiming at once then took the CPU the API server needed (benchmark row 10). The
//! index keeps:
//! - the Queued jobs of the queue that are not cancelled or being deleted, ordered by
//!   (priority, highest first; creationTimestamp; name): a pick walks them from the front and
//!   stops after the window;
//! - those with a notBefore or retryAfter, by that time, for [`ClaimIndex::next_claimable_at`];
//! - each holder's latest claimTime seen.
//!
//! It holds names and sort keys only, each name allocated once and shared by its maps (the
//! dispatcher keeps one index per queue, so this is per-job memory of the controller); the jobs
//! themselves stay in the reflector's store, which is updated before the index sees the same
//! event, so the store is never older than the index.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::claim;
use crate::crd::{LeasedJob, Phase};
use crate::share;

/// Where a job stands among the claimable: highest priority first, then oldest, then by name.
/// Compared across the indexes of one queue's concurrency keys by the dispatcher
/// ([`crate::dispatch`]). 32 bytes: the creationTimestamp is kept as its second and
/// nanosecond ([`created_key`]) where an `Option<Timestamp>` takes 24.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Place {
    priority: Reverse<i32>,
    /// creationTimestamp's second, then its nanosecond ([`created_key`]).
    created_second: i64,
    created_nanosecond: i32,
    /// Shared with the index's other maps: one allocation per job.
    name: Arc<str>,
}

impl Place {
    /// The job's spec.priority.
    pub(crate) fn priority(&self) -> i32 {
        self.priority.0
    }
}

/// A creationTimestamp as a sort key in the order of `Option<Timestamp>`: none first, then by
/// second and nanosecond.
fn created_key(created: Option<Timestamp>) -> (i64, i32) {
    created.map_or((i64::MIN, i32::MIN), |t| {
        (t.as_second(), t.subsec_nanosecond())
    })
}

/// A [`Place`] in the index's map by name: hashed and compared by the name alone, so that the
/// map needs no second copy of the name as its key.
#[derive(Debug)]
struct ByName(Place);

impl PartialEq for ByName {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for ByName {}

impl std::hash::Hash for ByName {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.name.hash(state);
    }
}

impl std::borrow::Borrow<str> for ByName {
    fn borrow(&self) -> &str {
        &self.0.name
    }
}

/// What a pick reads of one Queued job of the queue, beside its place (so that walking the
/// window costs no lookup by name). 24 bytes, no allocation for the usual resourceVersion.
#[derive(Clone, Debug)]
struct Slot {
    /// The later of notBefore and retryAfter ([`Due`]).
    claimable_at: Due,
    /// metadata.resourceVersion, so a pick can skip a snapshot already tried.
    resource_version: Version,
}

/// An optional time as nanoseconds since the Unix epoch, 8 bytes where an `Option<Timestamp>`
/// takes 24. Saturates outside the years 1678 to 2262 (the range of `i64` nanoseconds), where
/// comparing with any time inside that range still answers as the time itself would:
/// [`Due::is_after`] is exact for every `now` in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Due(i64);

impl Due {
    const NONE: Due = Due(i64::MIN);

    fn of(at: Option<Timestamp>) -> Due {
        at.map_or(Due::NONE, |t| {
            let nanos = t.as_nanosecond();
            let saturated =
                i64::try_from(nanos).unwrap_or(if nanos < 0 { i64::MIN } else { i64::MAX });
            // i64::MIN is NONE.
            Due(saturated.max(i64::MIN + 1))
        })
    }

    /// The time, saturated as kept.
    fn time(self) -> Option<Timestamp> {
        (self != Due::NONE)
            .then(|| Timestamp::from_nanosecond(i128::from(self.0)).ok())
            .flatten()
    }

    /// True when there is a time and it is after `now` (a time, as [`Due::of`] keeps it:
    /// made once per walk of the index, not once per job).
    fn is_after(self, now: Due) -> bool {
        self > now
    }
}

/// A resourceVersion as read, in 16 bytes: the API server's usual decimal number without an
/// allocation, any other text as it is. [`Version::with_str`] gives it back byte for byte.
#[derive(Clone, Debug)]
enum Version {
    Number(u64),
    /// A thin pointer keeps the enum at 16 bytes.
    #[allow(clippy::redundant_allocation)]
    Text(Box<Box<str>>),
}

impl Version {
    fn of(text: &str) -> Version {
        match text.parse::<u64>() {
            Ok(n) if n.to_string() == text => Version::Number(n),
            _ => Version::Text(Box::new(text.into())),
        }
    }

    /// Calls `f` with the text, written into a buffer on the stack for a number.
    fn with_str<T>(&self, f: impl FnOnce(&str) -> T) -> T {
        match self {
            Version::Text(text) => f(text),
            Version::Number(n) => {
                let mut buf = [0u8; 20];
                let mut at = buf.len();
                let mut n = *n;
                loop {
                    at -= 1;
                    buf[at] = b'0' + (n % 10) as u8;
                    n /= 10;
                    if n == 0 {
                        break;
                    }
                }
                f(std::str::from_utf8(&buf[at..]).unwrap_or_default())
            }
        }
    }
}

/// One event of a queue's watch, as the index follows it (the watcher's events, without the
/// watcher: this crate has no IO).
#[derive(Clone, Copy, Debug)]
pub enum Change<'a> {
    /// A job was added or changed in a live watch.
    Applied(&'a LeasedJob),
    /// A job was deleted.
    Deleted(&'a LeasedJob),
    /// A (re-)list began.
    RelistBegan,
    /// A job of the (re-)list.
    Relisted(&'a LeasedJob),
    /// The (re-)list ended: its jobs replace the index's.
    RelistDone,
}

/// The index of one queue (see the module doc). Feed it every event of the queue's watch with
/// [`ClaimIndex::observe`].
#[derive(Debug, Default)]
pub struct ClaimIndex {
    queue: String,
    /// The places of the Queued jobs of the queue that are not cancelled or being deleted,
    /// found by name.
    entries: HashSet<ByName>,
    /// The same jobs in claim order.
    order: BTreeMap<Place, Slot>,
    /// Those with a claimable_at, by it.
    waiting: BTreeSet<(Due, Arc<str>)>,
    /// holderIdentity -> the latest claimTime seen from it.
    claims: HashMap<String, Timestamp>,
    /// holderIdentity -> when a claim or an end of attempt of its last arrived in a live watch
    /// event, on this process's clock (claimTime has whole seconds only; activity needs
    /// milliseconds).
    active: HashMap<String, Timestamp>,
    /// During a re-list (between `Init` and `InitDone`): the index being rebuilt.
    relisting: Option<Box<ClaimIndex>>,
}

impl ClaimIndex {
    /// An empty index of `queue`.
    pub fn new(queue: &str) -> ClaimIndex {
        ClaimIndex {
            queue: queue.to_string(),
            ..ClaimIndex::default()
        }
    }

    /// Follows one watch event: a job added, changed or deleted, or a (re-)list. A re-list
    /// replaces the jobs at its end ([`Change::RelistDone`]), as the reflector's store does;
    /// claims seen stay.
    pub fn observe(&mut self, change: Change<'_>) {
        match change {
            Change::Applied(job) => {
                self.note_activity(job, Timestamp::now());
                self.apply(job);
            }
            Change::Deleted(job) => {
                self.note_claim(job);
                if let Some(name) = job.metadata.name.as_deref() {
                    self.remove(name);
                }
            }
            Change::RelistBegan => self.relisting = Some(Box::new(ClaimIndex::new(&self.queue))),
            Change::Relisted(job) => match self.relisting.as_mut() {
                Some(next) => next.apply(job),
                None => self.apply(job),
            },
            Change::RelistDone => {
                if let Some(next) = self.relisting.take() {
                    let next = *next;
                    self.entries = next.entries;
                    self.order = next.order;
                    self.waiting = next.waiting;
                    for (holder, at) in next.claims {
                        self.record_claim(holder, at);
                    }
                }
            }
        }
    }

    /// Adds, moves or removes `job` by what it now is.
    pub fn apply(&mut self, job: &LeasedJob) {
        self.note_claim(job);
        let Some(name) = job.metadata.name.as_deref() else {
            return;
        };
        self.remove(name);
        let eligible = job.phase() == Phase::Queued
            && job.spec.queue == self.queue
            && !job.spec.cancel
            && job.metadata.deletion_timestamp.is_none();
        if !eligible {
            return;
        }
        let name: Arc<str> = Arc::from(name);
        let (created_second, created_nanosecond) =
            created_key(job.metadata.creation_timestamp.as_ref().map(|t| t.0));
        let place = Place {
            priority: Reverse(job.spec.priority),
            created_second,
            created_nanosecond,
            name: Arc::clone(&name),
        };
        let slot = Slot {
            claimable_at: Due::of(job.claimable_at()),
            resource_version: Version::of(
                job.metadata.resource_version.as_deref().unwrap_or_default(),
            ),
        };
        if slot.claimable_at != Due::NONE {
            self.waiting.insert((slot.claimable_at, name));
        }
        self.entries.insert(ByName(place.clone()));
        self.order.insert(place, slot);
    }

    fn remove(&mut self, name: &str) {
        if let Some(ByName(place)) = self.entries.take(name) {
            if let Some(slot) = self.order.remove(&place) {
                if slot.claimable_at != Due::NONE {
                    self.waiting.remove(&(slot.claimable_at, place.name));
                }
            }
        }
    }

    fn note_claim(&mut self, job: &LeasedJob) {
        if job.spec.queue != self.queue {
            return;
        }
        let Some(status) = job.status.as_ref() else {
            return;
        };
        if let (Some(holder), Some(at)) = (status.holder.as_ref(), status.claimed_time.as_ref()) {
            self.record_claim(holder.clone(), at.0);
        }
    }

    /// Notes that `job`'s holder was seen at work at `at` if `job` arrived claimed or ended
    /// (Leased, Succeeded or Failed) in a live event: see [`ClaimIndex::active_until_ms`].
    pub fn note_activity(&mut self, job: &LeasedJob, at: Timestamp) {
        if job.spec.queue != self.queue
            || !matches!(
                job.phase(),
                Phase::Leased | Phase::Succeeded | Phase::Failed
            )
        {
            return;
        }
        if let Some(holder) = job.status.as_ref().and_then(|s| s.holder.as_ref()) {
            self.active.insert(holder.clone(), at);
        }
    }

    /// Until when (milliseconds since the Unix epoch) `holder` counts as an active claimer:
    /// [`share::ACTIVE_MS`] after a claim or end of attempt of its last arrived live in the
    /// watch; `None` if none did, or if its latest claim is older than
    /// [`claim::RECENT_CLAIM_SECONDS`] (then the others no longer count it among the claimers).
    pub fn active_until_ms(&self, holder: &str) -> Option<u64> {
        // Only a claimer the others count among the claimers seen (a claim within
        // RECENT_CLAIM_SECONDS) is active: one back from a long job is not, even at its end,
        // so it takes turns until its next claim is seen instead of claiming as an owner
        // whom the others do not count.
        let recent = Timestamp::now() - SignedDuration::from_secs(claim::RECENT_CLAIM_SECONDS);
        if self.claims.get(holder).is_none_or(|t| *t < recent) {
            return None;
        }
        let at = self.active.get(holder)?;
        let ms = u64::try_from(at.as_millisecond()).unwrap_or_default();
        Some(ms.saturating_add(share::ACTIVE_MS))
    }

    fn record_claim(&mut self, holder: String, at: Timestamp) {
        let newest = self.claims.entry(holder).or_insert(at);
        if at > *newest {
            *newest = at;
        }
        // Holders come and go with pods: forget the long gone now and then.
        if self.claims.len() > 4096 {
            let since = at - SignedDuration::from_secs(claim::RECENT_CLAIM_SECONDS);
            self.claims.retain(|_, t| *t >= since);
            self.active.retain(|h, _| self.claims.contains_key(h));
        }
    }

    /// Queued jobs of the queue that are not cancelled or being deleted.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no job of the queue is waiting.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True when the job `name` is one of the queue's Queued jobs that are not cancelled or
    /// being deleted (claimable now or later).
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains(name)
    }

    /// The resourceVersion last seen of the job `name`, if [`ClaimIndex::contains`] it.
    pub fn resource_version(&self, name: &str) -> Option<String> {
        let ByName(place) = self.entries.get(name)?;
        self.order
            .get(place)
            .map(|s| s.resource_version.with_str(str::to_string))
    }

    /// The names of at most `limit` jobs claimable at `now` that `skip` (name, resourceVersion)
    /// lets through, all of the highest priority among those, oldest first: the candidates of
    /// [`claim::pick`] (what a linear scan of the queue would find), without reading the whole
    /// queue.
    /// Costs the jobs walked: the window, plus those not claimable yet or skipped ahead of it,
    /// one `skip` call each and no copy (the names are borrowed from the index: at 32 claimers
    /// a window holds 1,024 jobs, and copying them on every pick was a fifth of the claimers'
    /// CPU in benchmark row 2).
    pub fn candidates(
        &self,
        now: Timestamp,
        limit: usize,
        skip: impl Fn(&str, &str) -> bool,
    ) -> Vec<&str> {
        let mut out = Vec::new();
        let mut top = None;
        let now = Due::of(Some(now));
        for (place, slot) in &self.order {
            if out.len() >= limit {
                break;
            }
            if top.is_some_and(|p| p != place.priority) {
                break;
            }
            if slot.claimable_at.is_after(now) {
                continue;
            }
            if slot.resource_version.with_str(|rv| skip(&place.name, rv)) {
                continue;
            }
            top = Some(place.priority);
            out.push(&*place.name);
        }
        out
    }

    /// The first job claimable at `now` that `skip` (name, resourceVersion) lets through, and
    /// its place in claim order: [`ClaimIndex::candidates`] with a limit of 1, with the place
    /// for comparing heads across indexes.
    pub(crate) fn head(
        &self,
        now: Timestamp,
        skip: impl Fn(&str, &str) -> bool,
    ) -> Option<(&str, &Place)> {
        let name = *self.candidates(now, 1, skip).first()?;
        Some((name, &self.entries.get(name)?.0))
    }

    /// True when more than `n` jobs of the queue are claimable at `now` (any priority).
    pub fn claimable_more_than(&self, now: Timestamp, n: usize) -> bool {
        let now = Due::of(Some(now));
        self.order
            .values()
            .filter(|s| !s.claimable_at.is_after(now))
            .nth(n)
            .is_some()
    }

    /// The earliest time after `now` at which a Queued job of the queue becomes claimable (by
    /// notBefore or retryAfter); see [`claim::next_claimable_at`].
    pub fn next_claimable_at(&self, now: Timestamp) -> Option<Timestamp> {
        let after = Due(Due::of(Some(now)).0.saturating_add(1));
        self.waiting
            .range((after, Arc::<str>::from(""))..)
            .next()
            .and_then(|(t, _)| t.time())
    }

    /// True when any claim from the queue (by anyone, this claimer included) was seen since
    /// `now` minus [`claim::RECENT_CLAIM_SECONDS`]; false at a cold start.
    pub fn claimed_lately(&self, now: Timestamp) -> bool {
        let since = now - SignedDuration::from_secs(claim::RECENT_CLAIM_SECONDS);
        self.claims.values().any(|t| *t >= since)
    }

    /// The holders seen claiming from the queue since `now` minus
    /// [`claim::RECENT_CLAIM_SECONDS`], and `me`; see [`claim::recent_claimers`].
    pub fn recent_claimers(&self, me: &str, now: Timestamp) -> HashSet<String> {
        let since = now - SignedDuration::from_secs(claim::RECENT_CLAIM_SECONDS);
        let mut claimers: HashSet<String> = self
            .claims
            .iter()
            .filter(|(_, t)| **t >= since)
            .map(|(h, _)| h.clone())
            .collect();
        claimers.insert(me.to_string());
        claimers
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use rand::SeedableRng;

    use super::*;
    use crate::crd::{LeasedJobSpec, LeasedJobStatus};

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn job(name: &str, queue: &str, priority: i32, created: i64, phase: Phase) -> LeasedJob {
        let mut j = LeasedJob::new(
            name,
            LeasedJobSpec {
                queue: queue.into(),
                priority,
                ..LeasedJobSpec::default()
            },
        );
        j.metadata.creation_timestamp = Some(Time(at(created)));
        j.metadata.resource_version = Some(format!("rv-{name}"));
        j.status = Some(LeasedJobStatus {
            phase: Some(phase),
            ..LeasedJobStatus::default()
        });
        j
    }

    /// What the linear scans of `claim` answer, to compare with the index.
    fn scanned(jobs: &[Arc<LeasedJob>], now: Timestamp, limit: usize) -> Vec<String> {
        claim::top_candidates(jobs, "q", now, limit)
            .into_iter()
            .map(|j| j.metadata.name.clone().unwrap())
            .collect()
    }

    #[test]
    fn the_created_key_keeps_the_order_of_the_timestamps() {
        let times = [
            None,
            Some(Timestamp::MIN),
            Some(Timestamp::from_second(-5).unwrap()),
            Some(Timestamp::new(-5, 500).unwrap()),
            Some(Timestamp::UNIX_EPOCH),
            Some(Timestamp::new(1_700_000_000, 1).unwrap()),
            Some(Timestamp::MAX),
        ];
        for pair in times.windows(2) {
            assert!(pair[0] < pair[1]);
            assert!(created_key(pair[0]) < created_key(pair[1]), "{pair:?}");
        }
    }

    #[test]
    fn a_version_gives_back_its_text_byte_for_byte() {
        for text in [
            "0",
            "7",
            "123456",
            "18446744073709551615",
            "18446744073709551616",
            "007",
            "-1",
            "+5",
            "rv-a",
            "",
        ] {
            assert_eq!(Version::of(text).with_str(str::to_string), text);
        }
        assert!(matches!(Version::of("123456"), Version::Number(123_456)));
        assert!(matches!(Version::of("007"), Version::Text(_)));
        assert_eq!(std::mem::size_of::<Slot>(), 24);
        assert_eq!(std::mem::size_of::<Place>(), 32);
    }

    #[test]
    fn a_due_time_compares_with_now_as_the_time_itself_would() {
        let now = Timestamp::new(1_800_000_000, 500).unwrap();
        let times = [
            Timestamp::MIN,
            Timestamp::from_second(-20_000_000_000).unwrap(),
            Timestamp::new(1_800_000_000, 499).unwrap(),
            now,
            Timestamp::new(1_800_000_000, 501).unwrap(),
            Timestamp::from_second(40_000_000_000).unwrap(),
            Timestamp::MAX,
        ];
        for t in times {
            assert_eq!(
                Due::of(Some(t)).is_after(Due::of(Some(now))),
                t > now,
                "{t}"
            );
        }
        assert!(!Due::NONE.is_after(Due::of(Some(Timestamp::MIN))));
        assert_eq!(Due::of(Some(now)).time(), Some(now));
        assert_eq!(Due::NONE.time(), None);
    }

    #[test]
    fn candidates_match_the_linear_scan_under_random_changes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut index = ClaimIndex::new("q");
        let mut cache: HashMap<String, Arc<LeasedJob>> = HashMap::new();
        let now = at(500);
        for step in 0..4000 {
            let name = format!("j{}", rand::Rng::random_range(&mut rng, 0..300));
            let r = rand::Rng::random_range(&mut rng, 0..10);
            if r == 0 {
                if let Some(old) = cache.remove(&name) {
                    index.observe(Change::Deleted(&old));
                }
                continue;
            }
            let phase = [
                Phase::Queued,
                Phase::Queued,
                Phase::Leased,
                Phase::Succeeded,
            ][rand::Rng::random_range(&mut rng, 0..4)];
            let queue = if r == 1 { "other" } else { "q" };
            let mut j = job(
                &name,
                queue,
                rand::Rng::random_range(&mut rng, 0..3),
                rand::Rng::random_range(&mut rng, 0..100),
                phase,
            );
            j.spec.cancel = r == 2;
            if r == 3 {
                // Not claimable before a time, past or future.
                j.status.as_mut().unwrap().retry_after =
                    Some(Time(at(rand::Rng::random_range(&mut rng, 400..600))));
            }
            j.metadata.resource_version = Some(format!("{step}"));
            index.observe(Change::Applied(&j));
            cache.insert(name, Arc::new(j));
            if step % 50 == 0 {
                let jobs: Vec<Arc<LeasedJob>> = cache.values().cloned().collect();
                for limit in [1, 5, 64] {
                    assert_eq!(
                        index.candidates(now, limit, |_, _| false),
                        scanned(&jobs, now, limit),
                        "step {step}, limit {limit}"
                    );
                }
                assert_eq!(
                    index.next_claimable_at(now),
                    claim::next_claimable_at(&jobs, "q", now)
                );
                let claimable = jobs
                    .iter()
                    .filter(|j| claim::claimable(j, "q", now))
                    .count();
                assert_eq!(index.claimable_more_than(now, 10), claimable > 10);
            }
        }
    }

    #[test]
    fn skip_applies_before_the_top_priority_is_chosen() {
        let mut index = ClaimIndex::new("q");
        index.apply(&job("high", "q", 5, 1, Phase::Queued));
        index.apply(&job("low-old", "q", 0, 1, Phase::Queued));
        index.apply(&job("low-new", "q", 0, 2, Phase::Queued));
        let now = at(10);
        assert_eq!(index.candidates(now, 5, |_, _| false), ["high"]);
        // The high-priority job's snapshot was tried: the next priority's jobs are the
        // candidates, as claim::pick has it.
        let skip = |n: &str, rv: &str| n == "high" && rv == "rv-high";
        assert_eq!(index.candidates(now, 5, skip), ["low-old", "low-new"]);
        let jobs: Vec<Arc<LeasedJob>> = ["high", "low-old", "low-new"]
            .iter()
            .map(|n| {
                let (p, c) = if *n == "high" {
                    (5, 1)
                } else {
                    (0, 1 + i64::from(*n == "low-new"))
                };
                Arc::new(job(n, "q", p, c, Phase::Queued))
            })
            .collect();
        let untried: Vec<Arc<LeasedJob>> = jobs
            .into_iter()
            .filter(|j| j.metadata.name.as_deref() != Some("high"))
            .collect();
        let picked = claim::pick(
            &untried,
            "q",
            now,
            1,
            &mut rand::rngs::StdRng::seed_from_u64(1),
        )
        .unwrap();
        assert_eq!(picked.metadata.name.as_deref(), Some("low-old"));
    }

    #[test]
    fn a_relist_replaces_the_jobs_and_keeps_the_claims() {
        let mut index = ClaimIndex::new("q");
        index.apply(&job("gone", "q", 0, 1, Phase::Queued));
        let mut claimed = job("held", "q", 0, 2, Phase::Leased);
        let status = claimed.status.as_mut().unwrap();
        status.holder = Some("pod-a".into());
        status.claimed_time = Some(Time(at(100)));
        index.observe(Change::Applied(&claimed));
        index.observe(Change::RelistBegan);
        index.observe(Change::Relisted(&job("new", "q", 0, 3, Phase::Queued)));
        // Until InitDone, picks still see the old jobs.
        assert_eq!(index.candidates(at(105), 5, |_, _| false), ["gone"]);
        index.observe(Change::RelistDone);
        assert_eq!(index.candidates(at(105), 5, |_, _| false), ["new"]);
        assert_eq!(index.len(), 1);
        let claimers = index.recent_claimers("me", at(105));
        assert_eq!(
            claimers,
            HashSet::from(["me".to_string(), "pod-a".to_string()])
        );
        // Ten seconds later pod-a is no longer a recent claimer: the queue is cold again.
        assert!(index.claimed_lately(at(105)));
        assert_eq!(index.recent_claimers("me", at(111)).len(), 1);
        assert!(!index.claimed_lately(at(111)));
        assert!(!ClaimIndex::new("q").claimed_lately(at(105)));
    }

    #[test]
    fn claimers_are_active_for_a_while_after_a_live_claim_or_end() {
        let mut index = ClaimIndex::new("q");
        let claimed_ago = |name: &str, phase: Phase, holder: &str, seconds: i64| {
            let mut j = job(name, "q", 0, 1, phase);
            let status = j.status.as_mut().unwrap();
            status.holder = Some(holder.into());
            status.claimed_time = Some(Time(Timestamp::now() - SignedDuration::from_secs(seconds)));
            j
        };
        let held = |name: &str, phase: Phase, holder: &str| claimed_ago(name, phase, holder, 1);
        let ms = |t: Timestamp| u64::try_from(t.as_millisecond()).unwrap();
        let seen = |index: &mut ClaimIndex, job: LeasedJob, at: Timestamp| {
            index.apply(&job);
            index.note_activity(&job, at);
        };
        // A claim and an end count; a requeue (Queued) and another queue's jobs do not.
        seen(&mut index, held("a", Phase::Leased, "pod-a"), at(10));
        seen(&mut index, held("b", Phase::Succeeded, "pod-b"), at(11));
        seen(&mut index, held("c", Phase::Queued, "pod-c"), at(12));
        let mut other = held("d", Phase::Leased, "pod-d");
        other.spec.queue = "other".into();
        seen(&mut index, other, at(12));
        // The end of a long attempt: its holder is no claimer the others count, so not active.
        let stale = claim::RECENT_CLAIM_SECONDS + 5;
        seen(
            &mut index,
            claimed_ago("g", Phase::Succeeded, "pod-g", stale),
            at(12),
        );
        assert_eq!(index.active_until_ms("pod-g"), None);
        assert_eq!(
            index.active_until_ms("pod-a"),
            Some(ms(at(10)) + share::ACTIVE_MS)
        );
        assert_eq!(
            index.active_until_ms("pod-b"),
            Some(ms(at(11)) + share::ACTIVE_MS)
        );
        assert_eq!(index.active_until_ms("pod-c"), None);
        assert_eq!(index.active_until_ms("pod-d"), None);
        // Only live events count: a (re-)listed claim says nothing about when it was made.
        index.observe(Change::Relisted(&held("e", Phase::Leased, "pod-e")));
        index.observe(Change::RelistDone);
        assert_eq!(index.active_until_ms("pod-e"), None);
        let before = ms(Timestamp::now());
        index.observe(Change::Applied(&held("f", Phase::Failed, "pod-f")));
        let until = index.active_until_ms("pod-f").unwrap();
        assert!(until >= before + share::ACTIVE_MS, "{until} {before}");
    }
}
