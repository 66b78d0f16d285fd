//! The claim window of a claimer choosing on its own ([`crate::pick`]): how many of the
//! oldest top-priority claimable jobs it chooses among. A 409 widens it (the snapshot was
//! stale: other claimers are near), a success narrows it, never below
//! [`WorkerConfig::spread`](crate::WorkerConfig::spread). Also the average claim-write time
//! the claimer keeps.

use std::sync::atomic::Ordering;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use crate::Worker;

/// The claim window never widens past this many times [`WorkerConfig::spread`](crate::WorkerConfig::spread).
pub(crate) const MAX_WINDOW_FACTOR: usize = 64;

impl Worker {
    /// After a 409: widens the claim window fourfold, if more jobs are claimable than it holds
    /// (with fewer, a wider window would not spread claimers any further).
    pub(crate) fn widen_window(&self) {
        let spread = self.inner.config.spread;
        let window = self.inner.window.load(Ordering::Relaxed);
        let Some(queue) = self
            .inner
            .queue
            .as_ref()
            .filter(|_| may_widen(window, spread))
        else {
            return;
        };
        let more = queue
            .index
            .lock()
            .unwrap()
            .claimable_more_than(Timestamp::now(), window);
        if let Some(wider) = widened_window(window, spread, more) {
            self.inner.window.store(wider, Ordering::Relaxed);
        }
        tracing::debug!(
            window,
            more_claimable = more,
            "Claim conflict (409); claim window was {window}"
        );
    }

    /// Folds the time one claim write took into
    /// [`Inner::claim_write_ms`](crate::Inner::claim_write_ms).
    pub(crate) fn note_claim_write(&self, took: Duration) {
        let took = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
        let average = &self.inner.claim_write_ms;
        let was = average.load(Ordering::Relaxed);
        average.store(claim_write_average(was, took), Ordering::Relaxed);
    }

    /// After a successful claim: narrows the claim window by 1/32, not below spread.
    pub(crate) fn narrow_window(&self) {
        let spread = self.inner.config.spread;
        let window = self.inner.window.load(Ordering::Relaxed);
        if let Some(narrower) = narrowed_window(window, spread) {
            self.inner.window.store(narrower, Ordering::Relaxed);
        }
    }
}

/// Whether a 409 may widen the claim window `window` of a claimer with `spread`: never with
/// spread 1 (strict FIFO), nor past [`MAX_WINDOW_FACTOR`] times spread.
pub(crate) fn may_widen(window: usize, spread: usize) -> bool {
    spread > 1 && window < spread * MAX_WINDOW_FACTOR
}

/// The claim window after a 409, when [`may_widen`] allows it: four times wider (at most
/// [`MAX_WINDOW_FACTOR`] times spread) if `more_claimable` (more jobs are claimable than it
/// holds), else unchanged (`None`): with fewer, a wider window would not spread claimers any
/// further.
pub(crate) fn widened_window(window: usize, spread: usize, more_claimable: bool) -> Option<usize> {
    more_claimable.then(|| (window * 4).min(spread * MAX_WINDOW_FACTOR))
}

/// The claim window after a successful claim: 1/32 narrower (at least one), not below spread;
/// `None` when it is at spread already.
pub(crate) fn narrowed_window(window: usize, spread: usize) -> Option<usize> {
    (window > spread).then(|| window.saturating_sub((window / 32).max(1)).max(spread))
}

/// The moving average of claim-write times, in ms, after one that took `took_ms`: the first
/// answer's time, then 1/4 of each new one's.
pub(crate) fn claim_write_average(was_ms: u64, took_ms: u64) -> u64 {
    if was_ms == 0 {
        took_ms
    } else {
        (3 * was_ms + took_ms) / 4
    }
}
