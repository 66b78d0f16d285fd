//! Claims in a queue with limits (`maxLeased`, `maxLeasedPerKey` of its LeasedQueue): before
//! its claim write, a claim takes a slot of every scope it falls in
//! ([`leasehold_kube::slots`]); a full scope means no claim. docs/protocol.md, "Limits".
//!
//! Slots taken for a claim whose write is then not sent are given back. Those of a claim
//! whose write was sent are kept whatever its answer: a write that failed without an answer
//! may have landed, and its job then holds the slot; one that did not land leaves the job at
//! the version the slot names, where the next claim of that job uses the same slot.

use leasehold_core::crd::LeasedJob;
use leasehold_kube::api::error_chain;
use leasehold_kube::slots::{self, Acquired, Taken};
use tracing::debug;

use crate::{Worker, WorkerError};

impl Worker {
    /// The slots a claim of `snapshot` needs, taken: `Ok(Some(taken))` to go on with the
    /// claim write (empty when the queue sets no limit for the job); `Ok(None)` when a limit
    /// is reached.
    ///
    /// # Errors
    /// [`WorkerError::Unavailable`] when the slots could not be listed, judged or written.
    pub(crate) async fn take_slots(
        &self,
        snapshot: &LeasedJob,
    ) -> Result<Option<Vec<Taken>>, WorkerError> {
        let Some(queue) = self.queue_object().filter(|q| q.spec.limits()) else {
            return Ok(Some(Vec::new()));
        };
        let acquired = slots::acquire(
            &self.inner.leases,
            &self.inner.jobs,
            &queue,
            snapshot,
            &self.inner.config.identity,
        )
        .await
        .map_err(|e| {
            WorkerError::unavailable(
                format!("slots of LeasedJob {}", snapshot.reference()),
                error_chain(&e),
            )
        })?;
        match acquired {
            Acquired::All(taken) => Ok(Some(taken)),
            Acquired::Full(scope) => {
                debug!(job = %snapshot.reference(), ?scope, "Limit reached; not claiming");
                Ok(None)
            }
        }
    }

    /// Gives back `taken`, for a claim whose write was not sent.
    pub(crate) async fn give_back_slots(&self, taken: &[Taken]) {
        if !taken.is_empty() {
            slots::release(&self.inner.leases, taken).await;
        }
    }
}
