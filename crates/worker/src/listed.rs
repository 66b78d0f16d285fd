//! Choosing on its own with no copy of the queue: how a sidecar with a dispatcher claims while
//! that dispatcher cannot be used (none advertised, set aside after a failure, frozen, or
//! failing over).
//!
//! Each round lists the queue's Queued jobs (the field selector [`queued_selector`], served by
//! the API server from the CRD's selectable fields) a page of [`PAGE`] at a time, at most
//! [`MAX_PAGES`] pages, until a page holds a claimable job, and tries one chosen by
//! [`claim::pick`]: the highest priority, then the oldest, at random among the first
//! `spread`. Nothing is kept between rounds, so memory is bounded by one page whatever the
//! queue's length. A round with nothing claimable pauses ([`list_pause`]: [`LIST_EVERY`],
//! doubling with each such round in a row to [`LIST_EVERY_MAX`], drawn from the upper half), or
//! until a notBefore or retryAfter it saw passes, and lists again; a claim answered 409 lists
//! again at once. The pause grows so that a fleet waiting on an empty queue while its
//! dispatcher is away does not list in step, nor five times a second each: 500 waiting sidecars
//! list about 830 times a second once the pause is at its longest, and a job created meanwhile
//! is still found within [`LIST_EVERY_MAX`] by every one of them.
//!
//! What is lost meanwhile (docs/protocol.md, "Dispatch"): the API server lists in key order
//! (namespace, then name), so the order is global only within the pages read; a queue with more
//! Queued jobs than [`PAGE`] × [`MAX_PAGES`], whose claimable ones all sort after that, waits for
//! the dispatcher. Claimers choosing this way meet more 409s than offered ones, as before the
//! dispatcher.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::api::ListParams;
use tokio::time::Instant;

use leasehold_core::claim;
use leasehold_core::crd::LeasedJob;
use leasehold_kube::api::error_chain;
use leasehold_kube::queue_watch::queued_selector;

use crate::{Claimed, Worker, WorkerError, MAX_CALL_BOUND};

/// Jobs per page of a fallback list.
pub const PAGE: u32 = 50;
/// Pages read in one round at most, while none holds a claimable job.
pub const MAX_PAGES: usize = 4;
/// The pause after the first round in a row that found nothing claimable.
pub const LIST_EVERY: Duration = Duration::from_millis(200);
/// The longest pause between rounds, however long nothing was claimable; a bound on how late a
/// sidecar choosing on its own sees a new job.
pub const LIST_EVERY_MAX: Duration = Duration::from_millis(800);

/// The pause after `idle` rounds in a row (1 for the first) that found nothing claimable:
/// [`LIST_EVERY`] doubled for each round after the first, at most [`LIST_EVERY_MAX`], scaled by
/// `jitter` (in 0..=1) into its upper half.
pub fn list_pause(idle: u32, jitter: f64) -> Duration {
    let full = LIST_EVERY
        .saturating_mul(1 << idle.saturating_sub(1).min(8))
        .min(LIST_EVERY_MAX);
    full.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
}

impl Worker {
    /// Claims by choosing on its own from bounded lists of the queue (see the module doc),
    /// until `deadline`, until the caller goes (`gone`), or until the dispatcher can be asked
    /// again (`Ok(None)` in those cases).
    ///
    /// # Errors
    /// [`WorkerError::Unavailable`] when a list or a claim write failed;
    /// [`WorkerError::ShuttingDown`] once draining began.
    pub(crate) async fn claim_listed(
        &self,
        deadline: Instant,
        gone: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
        draining: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<Option<Claimed>, WorkerError> {
        let dispatched = self.inner.dispatched.as_ref();
        let mut idle = 0u32;
        let mut held_back = false;
        loop {
            if dispatched.is_some_and(|d| d.usable().is_some()) {
                return Ok(None);
            }
            if !self.wait_unpaused(deadline, gone, draining).await? {
                return Ok(None);
            }
            let round = self.list_and_pick().await?;
            if let Round::Picked(job) = &round {
                if *draining.borrow() {
                    return Err(WorkerError::ShuttingDown);
                }
                let marks = self.inner.full_keys.marks();
                match self.try_claim(job, None).await? {
                    crate::pick::Tried::Claimed(claimed) => return Ok(Some(*claimed)),
                    // A key found full is passed over from now on: list again at once.
                    crate::pick::Tried::HeldBack => {
                        held_back = self.inner.full_keys.marks() == marks;
                    }
                    crate::pick::Tried::Lost => {}
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            // After a lost race list again at once (a short pause, so that nothing can make
            // this loop spin); otherwise after LIST_EVERY or when a job it saw opens.
            let wake = match round {
                // Held back by a limit: the same job would be picked again at once.
                Round::Picked(_) if std::mem::take(&mut held_back) => {
                    now + crate::limited::HELD_BACK_PAUSE
                }
                Round::Picked(_) => {
                    idle = 0;
                    now + Duration::from_millis(10)
                }
                Round::Nothing { opens } => {
                    idle = idle.saturating_add(1);
                    let pause = list_pause(idle, rand::random());
                    let until = opens.map_or(pause, |at| {
                        Duration::try_from(at.duration_since(Timestamp::now())).unwrap_or_default()
                    });
                    let wake = now + until.min(pause);
                    // Jobs passed over because their key was full: look again when it may not be.
                    self.inner
                        .full_keys
                        .next_expiry()
                        .map_or(wake, |t| wake.min(t.max(now)))
                }
            };
            let advert = async {
                match dispatched {
                    Some(d) => d.advert_changed().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = gone.as_mut() => return Ok(None),
                _ = draining.wait_for(|d| *d) => return Err(WorkerError::ShuttingDown),
                // A new leader: ask it at once.
                () = advert => return Ok(None),
                () = tokio::time::sleep_until(wake.min(deadline)) => {}
            }
        }
    }

    /// One round: lists the queue's Queued jobs a page at a time (see the module doc) and
    /// answers the job to try, or what the round saw of the next one to open.
    async fn list_and_pick(&self) -> Result<Round, WorkerError> {
        let queue = &self.inner.config.queue;
        let mut params = ListParams::default()
            .fields(&queued_selector(queue))
            .limit(PAGE);
        let mut opens: Option<Timestamp> = None;
        for _ in 0..MAX_PAGES {
            let listed = tokio::time::timeout(MAX_CALL_BOUND, self.inner.jobs.list(&params)).await;
            let page = match listed {
                Ok(Ok(page)) => page,
                Ok(Err(e)) => {
                    return Err(WorkerError::unavailable(
                        format!("list of queue {queue}"),
                        error_chain(&e),
                    ))
                }
                Err(_) => {
                    return Err(WorkerError::unavailable(
                        format!("list of queue {queue}"),
                        format!(
                            "the API server did not answer within {} ms",
                            MAX_CALL_BOUND.as_millis()
                        ),
                    ))
                }
            };
            let more = page.metadata.continue_.filter(|c| !c.is_empty());
            // Slimmed at once: a page's payloads are let go before the next page is read.
            let jobs: Vec<Arc<LeasedJob>> = page
                .items
                .into_iter()
                .map(|mut job| {
                    job.drop_payload_and_result();
                    Arc::new(job)
                })
                .collect();
            // Jobs of a key found full lately are passed over (crate::limited::FullKeys).
            let full = self.inner.full_keys.at(Instant::now());
            let jobs: Vec<Arc<LeasedJob>> = if full.is_empty() {
                jobs
            } else {
                jobs.into_iter()
                    .filter(|j| !crate::limited::of_full_key(j, &full))
                    .collect()
            };
            let now = Timestamp::now();
            let spread = self.inner.config.spread;
            if let Some(job) = claim::pick(&jobs, queue, now, spread, &mut rand::rng()) {
                return Ok(Round::Picked(job));
            }
            if let Some(at) = claim::next_claimable_at(&jobs, queue, now) {
                opens = Some(opens.map_or(at, |o| o.min(at)));
            }
            match more {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
        Ok(Round::Nothing { opens })
    }
}

/// What one round of lists found.
enum Round {
    /// A claimable job to try.
    Picked(Arc<LeasedJob>),
    /// Nothing claimable; `opens`: the earliest notBefore or retryAfter it saw, if any.
    Nothing { opens: Option<Timestamp> },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pause_doubles_from_list_every_to_its_bound_within_its_upper_half() {
        let ms = |idle, jitter| list_pause(idle, jitter).as_millis();
        assert_eq!((ms(1, 0.0), ms(1, 1.0)), (100, 200), "the first pause");
        assert_eq!((ms(2, 0.0), ms(2, 1.0)), (200, 400));
        assert_eq!((ms(3, 0.0), ms(3, 1.0)), (400, 800));
        for idle in [4, 10, 1000, u32::MAX] {
            assert_eq!(
                ms(idle, 1.0),
                800,
                "bounded by LIST_EVERY_MAX after {idle} rounds"
            );
            assert_eq!(ms(idle, 0.0), 400);
        }
        assert_eq!(ms(0, 1.0), 200, "no idle round yet counts as the first");
        assert_eq!(ms(2, 7.0), 400, "a jitter out of range is clamped");
    }
}
