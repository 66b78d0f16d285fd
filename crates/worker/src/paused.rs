//! A paused queue: no new claims ([`leasehold_core::queue`], docs/protocol.md "Flow
//! control"). Every way a sidecar claims (the dispatcher's offer, its own list, its copy of
//! the queue) waits here before it chooses, and [`Worker::paused_now`] is asked once more just
//! before the claim's write, so that a pause seen meanwhile stops it: a claim whose write was
//! sent before this sidecar saw the pause is the only one that lands after it, which bounds a
//! pause's effect by the watch's delay (milliseconds; under a second).
//!
//! A queue whose LeasedQueue sets limits the controller has not confirmed yet (its
//! `status.slotsAdopted`: [`leasehold_core::adoption::adopted`]) holds claims the same way: the
//! jobs Leased before those limits may hold no slot until then.
//!
//! The pause is read from this sidecar's own watch of its LeasedQueue, never from the
//! dispatcher: a dispatcher that offers a paused queue's job (stale or lying) gets it declined.

use tokio::sync::watch;
use tokio::time::Instant;

use crate::{Worker, WorkerError};

impl Worker {
    /// The queue's LeasedQueue as this worker's watch of it last read it; None while it is
    /// absent, unreadable or not read yet.
    pub fn queue_object(&self) -> Option<std::sync::Arc<leasehold_core::queue::LeasedQueue>> {
        self.inner.queue_object.borrow().queue().cloned()
    }

    /// True while the queue's LeasedQueue pauses claims or waits for its limits' adoption, or
    /// is not read yet.
    pub fn paused_now(&self) -> bool {
        self.inner.queue_object.borrow().held() != Some(false)
    }

    /// Waits until claims of the queue may go on: `Ok(true)` at once when they may, or when
    /// the queue is resumed; `Ok(false)` when `deadline` passes or the caller goes (`gone`)
    /// first. Claims also wait out a hold after the API server refused one as outside the
    /// limits under this copy of the LeasedQueue (`limited::OutsideLimits`), until it ends or
    /// the copy changes, so that no path reads or writes meanwhile.
    ///
    /// # Errors
    /// [`WorkerError::ShuttingDown`] once draining began.
    pub(crate) async fn wait_unpaused(
        &self,
        deadline: Instant,
        gone: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
        draining: &mut watch::Receiver<bool>,
    ) -> Result<bool, WorkerError> {
        loop {
            let mut known = self.inner.queue_object.clone();
            known.borrow_and_update();
            if !self.paused_now() {
                // Running now: go on at once, even when the deadline has passed (a claim with
                // wait=0 still gets its one look; select! would pick among ready branches at
                // random).
                let Some(until) = self.outside_limits_hold() else {
                    return Ok(true);
                };
                tokio::select! {
                    biased;
                    () = gone.as_mut() => return Ok(false),
                    _ = draining.wait_for(|d| *d) => return Err(WorkerError::ShuttingDown),
                    () = tokio::time::sleep_until(deadline), if deadline <= until => {
                        return Ok(false)
                    }
                    () = tokio::time::sleep_until(until) => {}
                    changed = known.changed() => {
                        if changed.is_err() {
                            return Ok(false);
                        }
                    }
                }
                continue;
            }
            tokio::select! {
                biased;
                running = known.wait_for(|k| k.held() == Some(false)) => {
                    if running.is_err() {
                        return Ok(false);
                    }
                }
                () = gone.as_mut() => return Ok(false),
                _ = draining.wait_for(|d| *d) => return Err(WorkerError::ShuttingDown),
                () = tokio::time::sleep_until(deadline) => return Ok(false),
            }
        }
    }
}
