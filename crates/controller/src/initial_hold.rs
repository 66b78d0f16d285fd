//! The jobs whose initial status write the controller holds back while a waiting worker is
//! about to claim them through this replica's dispatcher (docs/protocol.md, "Dispatch"), and
//! since when. Bookkeeping only: whether a job may be claimed soon is the dispatcher's advice
//! ([`crate::dispatch::Dispatcher::may_claim_soon`]), and both writes stay guarded by the job's
//! resourceVersion, so a wrong answer here costs an initial status up to
//! [`INITIAL_HOLD`] late, never a second holder.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::dispatch::INITIAL_HOLD;

/// The number of holds at which those long over (twice [`INITIAL_HOLD`]) are forgotten: holds
/// of jobs deleted while held back are not forgotten otherwise.
pub const PRUNED_AT: usize = 4096;

/// Holds of initial status writes, by job.
#[derive(Debug)]
pub struct InitialHolds<K> {
    since: Mutex<HashMap<K, Instant>>,
}

impl<K> Default for InitialHolds<K> {
    fn default() -> Self {
        InitialHolds {
            since: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash> InitialHolds<K> {
    /// How long to hold back `key`'s initial status write at `now`, if at all.
    ///
    /// - Not `claimable` (cancelled, being deleted, before its notBefore): none, and any hold
    ///   is forgotten.
    /// - Held already: what is left of [`INITIAL_HOLD`] from the first hold; none once it is
    ///   over (the hold is forgotten, and not taken again by this call).
    /// - Otherwise, when `may_claim_soon()` says so: a new hold of [`INITIAL_HOLD`].
    ///
    /// A job is held again only after its hold was forgotten, by a later call that finds it
    /// without status again (its initial write failed) and claimable soon.
    pub fn hold_for(
        &self,
        key: K,
        claimable: bool,
        may_claim_soon: impl FnOnce() -> bool,
        now: Instant,
    ) -> Option<Duration> {
        let mut since = self.since.lock().unwrap();
        if !claimable {
            since.remove(&key);
            return None;
        }
        if let Some(first) = since.get(&key) {
            let left = INITIAL_HOLD.saturating_sub(now.saturating_duration_since(*first));
            if left.is_zero() {
                since.remove(&key);
                return None;
            }
            return Some(left);
        }
        if !may_claim_soon() {
            return None;
        }
        if since.len() >= PRUNED_AT {
            since.retain(|_, first| now.saturating_duration_since(*first) < INITIAL_HOLD * 2);
        }
        since.insert(key, now);
        Some(INITIAL_HOLD)
    }

    /// Forgets `key`'s hold, if any: the job has a status now (a claim made during the hold,
    /// or the initial write).
    ///
    /// `key` is called only while some hold is kept: most calls find none, and build no key.
    pub fn forget(&self, key: impl FnOnce() -> K) {
        let mut since = self.since.lock().unwrap();
        if !since.is_empty() {
            since.remove(&key());
        }
    }

    /// The holds kept.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.since.lock().unwrap().len()
    }

    /// Whether no hold is kept.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_lasts_its_time_from_the_first_reconcile_and_is_not_taken_again() {
        let holds = InitialHolds::default();
        let t0 = Instant::now();
        assert_eq!(holds.hold_for("a", true, || true, t0), Some(INITIAL_HOLD));
        let later = t0 + Duration::from_millis(500);
        // The dispatcher is not asked again while the hold stands.
        let left = holds.hold_for("a", true, || panic!("asked again"), later);
        assert_eq!(left, Some(INITIAL_HOLD - Duration::from_millis(500)));
        // Over: written now, and forgotten.
        assert_eq!(holds.hold_for("a", true, || true, t0 + INITIAL_HOLD), None);
        assert!(holds.is_empty());
    }

    #[test]
    fn no_hold_without_the_dispatchers_word_or_for_a_job_not_claimable() {
        let holds = InitialHolds::default();
        let t0 = Instant::now();
        assert_eq!(holds.hold_for("a", true, || false, t0), None);
        assert_eq!(
            holds.hold_for("a", false, || panic!("asked about a job not claimable"), t0),
            None
        );
        assert!(holds.is_empty());
        // A held job that stops being claimable (cancelled) is written at once.
        assert!(holds.hold_for("b", true, || true, t0).is_some());
        assert_eq!(holds.hold_for("b", false, || true, t0), None);
        assert!(holds.is_empty());
    }

    #[test]
    fn a_job_that_got_its_status_is_forgotten_at_once() {
        let holds = InitialHolds::default();
        let t0 = Instant::now();
        holds.hold_for("claimed-while-held", true, || true, t0);
        holds.hold_for("other", true, || true, t0);
        holds.forget(|| "claimed-while-held");
        assert_eq!(holds.len(), 1);
        // Forgetting a job never held changes nothing.
        holds.forget(|| "never-held");
        assert_eq!(holds.len(), 1);
        // Without any hold, no key is built.
        let none: InitialHolds<&str> = InitialHolds::default();
        none.forget(|| panic!("a key was built with no hold kept"));
    }

    #[test]
    fn holds_long_over_are_pruned_when_many_are_kept() {
        let holds = InitialHolds::default();
        let t0 = Instant::now();
        for i in 0..PRUNED_AT {
            holds.hold_for(i, true, || true, t0);
        }
        let late = t0 + INITIAL_HOLD * 2;
        holds.hold_for(PRUNED_AT, true, || true, late);
        assert_eq!(holds.len(), 1, "only the new hold is left");
        // Below the threshold nothing is pruned.
        holds.hold_for(PRUNED_AT + 1, true, || true, late + INITIAL_HOLD * 3);
        assert_eq!(holds.len(), 2);
    }
}
