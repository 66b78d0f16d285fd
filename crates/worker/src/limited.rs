//! Claims in a queue with limits (`maxLeased`, `maxLeasedPerKey` of its LeasedQueue): before
//! its claim write, a claim takes a slot of every scope it falls in
//! ([`leasehold_kube::slots`]); a full scope means no claim. docs/protocol.md, "Limits".
//!
//! A claimer choosing on its own remembers the keys it found full for [`HELD_BACK_PAUSE`]
//! ([`FullKeys`]) and passes over their jobs meanwhile, so a full key at the head of the
//! queue does not hold back the jobs of other keys behind it.
//!
//! Slots taken for a claim whose write is then not sent are given back. Those of a claim
//! whose write was sent are kept whatever its answer: a write that failed without an answer
//! may have landed, and its job then holds the slot; one that did not land leaves the job at
//! the version the slot names, where the next claim of that job uses the same slot.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use kube::runtime::reflector::ObjectRef;
use leasehold_core::crd::LeasedJob;
use leasehold_core::queue::LeasedQueue;
use leasehold_core::slots::{Preferred, Scope};
use leasehold_core::token::Token;
use leasehold_kube::api::error_chain;
use leasehold_kube::slots::{self, Acquired, Taken};
use tracing::debug;

use crate::{QueueCopy, Worker, WorkerError};

/// The concurrency keys this claimer found at their limit lately, each until
/// [`HELD_BACK_PAUSE`] after it was found so; its picks pass over their jobs meanwhile. Only
/// advice about where to look: the slots decide every claim.
#[derive(Default)]
pub(crate) struct FullKeys {
    until: Mutex<HashMap<String, Instant>>,
    /// Bumped each time a key is found full: a claim held back by a full key (rather than by
    /// a pause or a full queue) may pick again at once.
    marks: AtomicU64,
}

impl FullKeys {
    /// Notes that `key` was found at its limit at `now`.
    pub(crate) fn mark(&self, key: &str, now: Instant) {
        let mut until = self.until.lock().unwrap();
        until.retain(|_, t| *t > now);
        until.insert(key.to_string(), now + HELD_BACK_PAUSE);
        drop(until);
        self.marks.fetch_add(1, Ordering::Relaxed);
    }

    /// How many times a key was found full so far.
    pub(crate) fn marks(&self) -> u64 {
        self.marks.load(Ordering::Relaxed)
    }

    /// When the first key now passed over is tried again: a claimer that found nothing else to
    /// pick looks again then.
    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        self.until.lock().unwrap().values().min().copied()
    }

    /// The keys found full within [`HELD_BACK_PAUSE`] of `now` (the others are forgotten);
    /// empty unless a limit per key was met lately.
    pub(crate) fn at(&self, now: Instant) -> HashSet<String> {
        let mut until = self.until.lock().unwrap();
        until.retain(|_, t| *t > now);
        until.keys().cloned().collect()
    }
}

/// How long a claimer whose claim was held back by a limit waits before it looks again (a
/// slot comes back when a job of the scope ends, which its copy of the queue may not show).
pub(crate) const HELD_BACK_PAUSE: Duration = Duration::from_millis(500);

/// How long claims wait after the API server refused one as outside its copy of the queue's
/// limits (rules `limits-obeyed`, `limits-adopted`), unless this sidecar's copy of the
/// LeasedQueue changes first: the first time under a copy, [`OUTSIDE_LIMITS_FIRST_HOLD`]
/// (the API server's copy may only trail this one by a moment), doubling with each refusal
/// under the same copy up to this (this copy lags: its watch is broken or slow, and each try
/// under it costs a slot write and a refused claim).
pub(crate) const OUTSIDE_LIMITS_HOLD: Duration = Duration::from_secs(2);
/// The first hold after a refusal under a copy ([`OUTSIDE_LIMITS_HOLD`]).
pub(crate) const OUTSIDE_LIMITS_FIRST_HOLD: Duration = Duration::from_millis(100);

/// The refusals of claims as outside the limits under the present copy of the LeasedQueue:
/// which copy (its resourceVersion; None for none), how many in a row, and until when claims
/// under that copy wait.
#[derive(Default)]
pub(crate) struct OutsideLimits {
    last: Mutex<Option<(Option<String>, u32, Instant)>>,
}

impl OutsideLimits {
    /// Notes a refusal under the copy `copy` at `now`: the hold it starts, and whether it is
    /// the first under that copy (worth a warning; the rest are repeats).
    pub(crate) fn refused(&self, copy: Option<&str>, now: Instant) -> (Duration, bool) {
        let mut last = self.last.lock().unwrap();
        let repeats = match last.as_ref() {
            Some((c, n, _)) if c.as_deref() == copy => Some(*n + 1),
            _ => None,
        };
        let n = repeats.unwrap_or(0);
        let hold = OUTSIDE_LIMITS_FIRST_HOLD
            .saturating_mul(1 << n.min(8))
            .min(OUTSIDE_LIMITS_HOLD);
        *last = Some((copy.map(str::to_string), n, now + hold));
        (hold, repeats.is_none())
    }

    /// Until when claims under the copy `copy` wait at `now`, if they do.
    pub(crate) fn holds(&self, copy: Option<&str>, now: Instant) -> Option<Instant> {
        let last = self.last.lock().unwrap();
        let (c, _, until) = last.as_ref()?;
        (c.as_deref() == copy && *until > now).then_some(*until)
    }
}

/// Whether `job` belongs to one of the keys in `full`.
pub(crate) fn of_full_key(job: &LeasedJob, full: &HashSet<String>) -> bool {
    job.spec
        .concurrency_key
        .as_ref()
        .is_some_and(|k| full.contains(k))
}

/// Jobs of full keys one pick passes over at most: past them the pick takes jobs as they come
/// (a claim of one then finds its key full again), so that a backlog of a full key costs a
/// pick at most this many lookups, not one per job of that key.
pub(crate) const MAX_PASSED_OVER: usize = 256;

/// One pick's filter of the jobs of full keys, by name, in a queue copy.
pub(crate) struct PassOver<'a> {
    queue: &'a QueueCopy,
    ns: &'a str,
    full: HashSet<String>,
    left: std::cell::Cell<usize>,
}

impl<'a> PassOver<'a> {
    /// The filter for a pick from `queue` (of namespace `ns`) at `now`.
    pub(crate) fn new(worker: &Worker, queue: &'a QueueCopy, ns: &'a str, now: Instant) -> Self {
        PassOver {
            queue,
            ns,
            full: worker.inner.full_keys.at(now),
            left: std::cell::Cell::new(MAX_PASSED_OVER),
        }
    }

    /// Whether to pass over the job `name`: it belongs to a full key, and fewer than
    /// [`MAX_PASSED_OVER`] were passed over so far.
    pub(crate) fn skips(&self, name: &str) -> bool {
        let left = self.left.get();
        if self.full.is_empty() || left == 0 {
            return false;
        }
        let full = self
            .queue
            .store
            .get(&ObjectRef::new(name).within(self.ns))
            .is_some_and(|job| of_full_key(&job, &self.full));
        if full {
            self.left.set(left - 1);
        }
        full
    }
}

impl Worker {
    /// The slots a claim of `snapshot` that will write `token` needs under `queue` (the
    /// LeasedQueue as the claim reads it, whose limits its write records), taken and marked with
    /// it: `Ok(Some(taken))` to go on with the
    /// claim write (empty when the queue sets no limit for the job); `Ok(None)` when a limit
    /// is reached, or when the queue was paused (or its LeasedQueue became unreadable) while
    /// they were taken: then they are given back. `prefer`: the slots to try first (the
    /// dispatcher's suggestion with its offer); `swap`: those of them suggested as this
    /// claimer's own free slots, which it swaps where [`leasehold_core::slots::may_swap`]
    /// allows it ([`crate::own_slots`]).
    ///
    /// # Errors
    /// [`WorkerError::Unavailable`] when the slots could not be listed, judged or written.
    pub(crate) async fn take_slots(
        &self,
        queue: Option<&LeasedQueue>,
        snapshot: &LeasedJob,
        token: &Token,
        prefer: Preferred,
        swap: Preferred,
    ) -> Result<Option<Vec<Taken>>, WorkerError> {
        let Some(queue) = queue.filter(|q| q.spec.limits()) else {
            return Ok(Some(Vec::new()));
        };
        let scopes: Vec<Scope> = leasehold_core::slots::scopes(queue, snapshot)
            .into_iter()
            .map(|(scope, _)| scope)
            .collect();
        let hints = slots::Hints {
            prefer,
            swap,
            own: self.inner.own_slots.take(&scopes, swap),
        };
        let (acquired, writes) = slots::acquire(
            &self.inner.leases,
            &self.inner.jobs,
            queue,
            snapshot,
            &self.inner.config.identity,
            token,
            hints,
        )
        .await;
        // Counted before a failure is answered: the writes made before it were made.
        self.inner.metrics.slot_writes(&writes);
        let acquired = acquired.map_err(|e| {
            WorkerError::unavailable(
                format!("slots of LeasedJob {}", snapshot.reference()),
                error_chain(&e),
            )
        })?;
        match acquired {
            // Paused, or the LeasedQueue became unreadable, while the slots were taken.
            Acquired::All(taken) if self.paused_now() => {
                self.give_back_slots(&taken).await;
                Ok(None)
            }
            Acquired::All(taken) => Ok(Some(taken)),
            Acquired::Full(scope) => {
                debug!(job = %snapshot.reference(), ?scope, "Limit reached; not claiming");
                if let Scope::Key(key) = &scope {
                    self.inner.full_keys.mark(key, Instant::now());
                }
                Ok(None)
            }
        }
    }

    /// Until when claims wait because the API server refused one as outside the limits under
    /// this sidecar's present copy of the LeasedQueue ([`OutsideLimits`]), if they do.
    pub(crate) fn outside_limits_hold(&self) -> Option<Instant> {
        let copy = self.queue_object();
        let copy = copy
            .as_ref()
            .and_then(|q| q.metadata.resource_version.as_deref());
        self.inner.outside_limits.holds(copy, Instant::now())
    }

    /// Gives back `taken`, for a claim whose write was not sent.
    pub(crate) async fn give_back_slots(&self, taken: &[Taken]) {
        if !taken.is_empty() {
            slots::release(&self.inner.leases, taken).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_outside_the_limits_holds_claims_under_that_copy_only() {
        let outside = OutsideLimits::default();
        let t0 = Instant::now();
        assert_eq!(outside.holds(None, t0), None);
        let first = OUTSIDE_LIMITS_FIRST_HOLD;
        assert_eq!(
            outside.refused(Some("5"), t0),
            (first, true),
            "the first under 5"
        );
        assert_eq!(outside.holds(Some("5"), t0), Some(t0 + first));
        assert_eq!(
            outside.refused(Some("5"), t0),
            (first * 2, false),
            "a repeat"
        );
        assert_eq!(outside.holds(Some("5"), t0), Some(t0 + first * 2));
        assert_eq!(
            outside.holds(Some("6"), t0),
            None,
            "a new copy claims at once"
        );
        assert_eq!(outside.holds(None, t0), None);
        assert_eq!(outside.holds(Some("5"), t0 + first * 2), None, "then again");
        for _ in 0..20 {
            outside.refused(Some("5"), t0);
        }
        let most = Some(t0 + OUTSIDE_LIMITS_HOLD);
        assert_eq!(outside.holds(Some("5"), t0), most, "at most");
        assert_eq!(
            outside.refused(None, t0),
            (first, true),
            "the first under none"
        );
    }

    #[test]
    fn a_key_found_full_is_passed_over_for_one_pause_then_tried_again() {
        let full = FullKeys::default();
        let t0 = Instant::now();
        assert!(full.at(t0).is_empty());
        full.mark("a", t0);
        assert_eq!(full.marks(), 1);
        assert_eq!(full.at(t0), HashSet::from(["a".to_string()]));
        let mut job = LeasedJob::new("j", Default::default());
        assert!(!of_full_key(&job, &full.at(t0)), "a job without a key");
        job.spec.concurrency_key = Some("a".into());
        assert!(of_full_key(&job, &full.at(t0)));
        job.spec.concurrency_key = Some("b".into());
        assert!(!of_full_key(&job, &full.at(t0)));
        assert_eq!(full.next_expiry(), Some(t0 + HELD_BACK_PAUSE));
        assert!(full.at(t0 + HELD_BACK_PAUSE).is_empty(), "forgotten");
        assert_eq!(full.next_expiry(), None);
    }
}
