//! Choosing on its own with no copy of the queue: how a sidecar with a dispatcher claims while
//! that dispatcher cannot be used (none advertised, set aside after a failure, frozen, or
//! failing over).
//!
//! Each round lists the queue's Queued jobs (the field selector [`queued_selector`], served by
//! the API server from the CRD's selectable fields) a page of [`PAGE`] at a time, at most
//! [`MAX_PAGES`] pages, until a page holds a claimable job, and tries one chosen by
//! [`claim::pick`]: the highest priority, then the oldest, at random among the first
//! `spread`. Nothing is kept between rounds, so memory is bounded by one page whatever the
//! queue's length. A round with nothing claimable waits [`LIST_EVERY`] (or until a notBefore or
//! retryAfter it saw passes) and lists again; a claim answered 409 lists again at once.
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
/// How often a claim waiting on its own lists the queue again when it found nothing
/// claimable.
pub const LIST_EVERY: Duration = Duration::from_millis(200);

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
        loop {
            if dispatched.is_some_and(|d| d.usable().is_some()) {
                return Ok(None);
            }
            let round = self.list_and_pick().await?;
            if let Round::Picked(job) = &round {
                if *draining.borrow() {
                    return Err(WorkerError::ShuttingDown);
                }
                if let Some(claimed) = self.try_claim(job, false).await? {
                    return Ok(Some(claimed));
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            // After a lost race list again at once (a short pause, so that nothing can make
            // this loop spin); otherwise after LIST_EVERY or when a job it saw opens.
            let wake = match round {
                Round::Picked(_) => now + Duration::from_millis(10),
                Round::Nothing { opens: None } => now + LIST_EVERY,
                Round::Nothing { opens: Some(at) } => {
                    let until =
                        Duration::try_from(at.duration_since(Timestamp::now())).unwrap_or_default();
                    now + until.min(LIST_EVERY)
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
