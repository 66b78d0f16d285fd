//! The heartbeat protocol: a worker's renewal, with its checkpoint and progress, and the checks
//! that keep an ended attempt from renewing.
//!
//! An attempt's first renewal writes its Lease ([`Worker::take_lease`]) and confirms it
//! against the job ([`Worker::confirm_first_renewal`]); it is not made once a whole lease
//! duration has passed since the claim. Later renewals are one JSON Patch on the Lease, fenced
//! by holderIdentity. Because the Lease of an ended attempt still names its token, a heartbeat
//! is checked against the attempts this process ended
//! ([`Inner::ended_here`](crate::Inner::ended_here)), the held-jobs watch cache
//! ([`moved_on`]) and, for a job that left that cache, a fresh read.
//!
//! The rules: docs/protocol.md, "Heartbeats and checkpoints", "The Lease is written by the first
//! renewal", "What fences what" and "Progress".

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::ListParams;
use kube::runtime::reflector::ObjectRef;
use kube::ResourceExt;
use serde_json::Value;
use tokio::time::Instant;
use tracing::warn;

use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::fence::{self, Refusal};
use leasehold_core::lease;
use leasehold_core::progress::Progress;
use leasehold_core::token::Token;
use leasehold_core::Category;
use leasehold_kube::api::error_chain;
use leasehold_kube::lease::LeaseError;

use crate::{call_bound, lost_message, Held, Renewal, Worker, WorkerError, LEASE_LOST};

impl Worker {
    /// Renews the lease now, storing `checkpoint` (any JSON up to
    /// [`lease::MAX_CHECKPOINT_BYTES`]) with it for the next attempt should this one not finish,
    /// and `progress` (the parts given; see [`leasehold_core::progress`]) for people to see. Writes only
    /// the Lease, never the LeasedJob, in one request whatever it carries. The progress is
    /// remembered and carried by every later renewal of the attempt, background ones included.
    ///
    /// # Errors
    /// [`WorkerError::InvalidToken`]; [`WorkerError::Invalid`] for progress that breaks its
    /// rules (nothing is written); [`WorkerError::TooLarge`]; [`WorkerError::LeaseLost`] or
    /// [`WorkerError::Refused`] when the token no longer holds the job;
    /// [`WorkerError::Unavailable`] when the API server failed (retry).
    pub async fn heartbeat(
        &self,
        name: &str,
        token: &str,
        checkpoint: Option<Value>,
        progress: Progress,
    ) -> Result<Renewal, WorkerError> {
        progress.validate().map_err(|e| WorkerError::Invalid {
            field: e.field,
            problem: e.problem,
        })?;
        let (me, n, t) = (self.clone(), name.to_string(), token.to_string());
        self.bounded(name, "heartbeat", async move {
            me.heartbeat_inner(&n, &t, checkpoint, progress).await
        })
        .await
        .map_err(|e| self.counted(e))
    }

    /// One renewal of `held`'s Lease, waiting at most [`call_bound`] of its lease duration. It
    /// carries the latest progress the worker sent for the attempt. The attempt's first
    /// renewal writes the Lease ([`Worker::take_lease`]) and then reads the job; the answer's
    /// flag says whether this renewal did (so the job, read after the write, was still Leased
    /// to the token).
    pub(crate) async fn renew_bounded(
        &self,
        held: &Held,
        checkpoint: Option<&Value>,
    ) -> Result<(Lease, bool), LeaseError> {
        let after = call_bound(held.duration);
        let (progress, taken) = {
            let st = held.state.lock().unwrap();
            (st.progress.clone(), st.lease_taken)
        };
        if let (false, Some(job)) = (taken, &held.claimed) {
            let lease = self.take_lease(held, job, checkpoint, &progress).await?;
            return Ok((lease, true));
        }
        let renew = leasehold_kube::lease::renew(
            &self.inner.leases,
            &held.lease_name,
            &held.token,
            checkpoint,
            Some(&progress),
        );
        let lease = tokio::time::timeout(after, renew)
            .await
            .unwrap_or(Err(LeaseError::Timeout { after }))?;
        Ok((lease, false))
    }

    /// The first renewal of an attempt this process claimed (`job`, the claim's answer): writes
    /// its Lease ([`lease::acquire`]) with `checkpoint` and `progress`, waiting at most
    /// [`call_bound`] of its lease duration.
    ///
    /// Not made once a whole lease duration has passed since the claim was sent (this process
    /// was frozen, or every try failed): no renewal reached the API server, so the controller
    /// may have requeued the job, and a Lease written now could name an attempt that ended.
    /// The attempt is lost then. A Lease name taken by something else undoes the claim
    /// ([`Worker::undo_for_conflict`]) and the attempt is lost with that reason.
    ///
    /// # Errors
    /// [`LeaseError::Lost`] (lost as above, or the Lease names a newer attempt);
    /// [`LeaseError::NotOurs`]; [`LeaseError::Timeout`] and [`LeaseError::Api`] (retry).
    async fn take_lease(
        &self,
        held: &Held,
        job: &LeasedJob,
        checkpoint: Option<&Value>,
        progress: &Progress,
    ) -> Result<Lease, LeaseError> {
        let job_ref = job.reference();
        let since = held.state.lock().unwrap().last_renewed.elapsed();
        if !first_renewal_allowed(since, held.duration) {
            let why = format!(
                "no renewal got through in {}s since the claim, a whole lease duration",
                since.as_secs()
            );
            warn!(job = %job_ref, attempt = held.token.attempt(), "Stopped renewing LeasedJob {job_ref}: {why}");
            self.lose(held, LEASE_LOST, lost_message(&job_ref, &why));
            return Err(LeaseError::Lost {
                lease: held.lease_name.clone(),
            });
        }
        let after = call_bound(held.duration);
        let first = leasehold_kube::lease::FirstRenewal {
            checkpoint,
            progress,
        };
        held.state.lock().unwrap().first_renewal_sent = true;
        let acquired = tokio::time::timeout(after, async {
            let lease =
                leasehold_kube::lease::acquire(&self.inner.leases, job, &held.token, &first)
                    .await?;
            self.confirm_first_renewal(&job.name_any(), &held.token)
                .await?;
            Ok(lease)
        })
        .await
        .unwrap_or(Err(LeaseError::Timeout { after }));
        match &acquired {
            Ok(_) => held.state.lock().unwrap().lease_taken = true,
            Err(e @ LeaseError::NotOurs { .. }) => {
                let message = self.undo_for_conflict(job, &held.token, e).await;
                self.lose(held, LEASE_LOST, message);
            }
            Err(LeaseError::Ended { why, code }) => {
                let message = lost_message(&job_ref, why);
                self.lose(held, code, message);
            }
            Err(_) => {}
        }
        acquired
    }

    /// After a first renewal wrote the Lease of `name` for `token`: reads the job afresh, and
    /// when it is no longer Leased to the token, clears the Lease's holderIdentity (fenced by
    /// the token) and says so. The controller ends an attempt (expiry, cancel) before it
    /// clears that attempt's Lease, and before the first renewal there was no Lease to clear;
    /// so a Lease written after that clear would name the ended token and accept its renewals.
    /// A read after the write that still shows the job Leased to the token proves the write
    /// came first, and the controller's clear will find it.
    ///
    /// # Errors
    /// [`LeaseError::Ended`] when the attempt ended (the Lease cleared, or left to a newer
    /// attempt); [`LeaseError::Api`] when the job could not be read (the renewal is retried).
    async fn confirm_first_renewal(&self, name: &str, token: &Token) -> Result<(), LeaseError> {
        let job = self.read_by_name(name).await.map_err(LeaseError::Api)?;
        let Some(refusal) = fence::refusal(&self.job_ref(name), job.as_ref(), token) else {
            return Ok(());
        };
        let lease_name = lease::lease_name(name);
        if let Err(e) =
            leasehold_kube::lease::release(&self.inner.leases, &lease_name, token.as_str()).await
        {
            warn!(job = %self.job_ref(name), error = %error_chain(&e), "Clearing the Lease a first renewal wrote for an ended attempt failed; the job's status still fences it");
        }
        let code = ended_code(&refusal);
        Err(LeaseError::Ended {
            why: refusal.to_string(),
            code,
        })
    }

    async fn heartbeat_inner(
        &self,
        name: &str,
        token: &str,
        checkpoint: Option<Value>,
        progress: Progress,
    ) -> Result<Renewal, WorkerError> {
        let token = Token::parse(token)?;
        if let Some(c) = &checkpoint {
            lease::checkpoint_text(c).map_err(|e| WorkerError::TooLarge(e.to_string()))?;
        }
        let held = self.held_for(name, &token)?;
        // The job as read for a token this process does not hold.
        let mut unheld = None;
        // The Lease alone proves nothing: the Lease of an attempt that ended still names its
        // token. A token whose attempt is known to have ended is refused before any write.
        match &held {
            Some(h) => {
                if let Some((code, why)) = self.cached_job_moved_on(name, &token) {
                    let message = lost_message(&self.job_ref(name), &why);
                    self.lose(h, code, message.clone());
                    return Err(WorkerError::LeaseLost { code, message });
                }
            }
            None => unheld = Some(self.check_unheld(name, &token).await?),
        }
        // A first renewal ends with a read of the job made after its Lease write
        // ([`Worker::confirm_first_renewal`]): what a read after the renewal would tell, it
        // told.
        let mut confirmed = false;
        let renewed = match &held {
            Some(h) => {
                h.state.lock().unwrap().progress.update(&progress);
                self.renew_bounded(h, checkpoint.as_ref())
                    .await
                    .map(|(lease, first)| {
                        confirmed = first;
                        lease
                    })
            }
            // Not held by this process (it restarted since the claim), and the job says the
            // token holds it: the Lease decides.
            None => {
                let lease_name = lease::lease_name(name);
                let renewed = leasehold_kube::lease::renew(
                    &self.inner.leases,
                    &lease_name,
                    &token,
                    checkpoint.as_ref(),
                    Some(&progress),
                )
                .await;
                match (renewed, &unheld) {
                    // Its Lease is not written yet (the first renewal writes it, and this
                    // process restarted before that) or names an older attempt: this is the
                    // first renewal, made for the holder the job names, which is this process.
                    (Err(LeaseError::Lost { .. }), Some(job))
                        if job.status.as_ref().and_then(|s| s.holder.as_deref())
                            == Some(self.inner.config.identity.as_str()) =>
                    {
                        let first = leasehold_kube::lease::FirstRenewal {
                            checkpoint: checkpoint.as_ref(),
                            progress: &progress,
                        };
                        let acquired = match leasehold_kube::lease::acquire(
                            &self.inner.leases,
                            job,
                            &token,
                            &first,
                        )
                        .await
                        {
                            Ok(lease) => self
                                .confirm_first_renewal(name, &token)
                                .await
                                .map(|()| lease),
                            e => e,
                        };
                        confirmed = true;
                        if let Err(e @ LeaseError::NotOurs { .. }) = &acquired {
                            let message = self.undo_for_conflict(job, &token, e).await;
                            return Err(WorkerError::LeaseLost {
                                code: LEASE_LOST,
                                message,
                            });
                        }
                        acquired
                    }
                    (renewed, _) => renewed,
                }
            }
        };
        if !matches!(renewed, Err(LeaseError::CheckpointTooLarge { .. })) {
            self.inner.metrics.heartbeat(renewed.is_ok());
        }
        match renewed {
            Ok(lease) => {
                // The attempt may have ended while the renewal was on its way (a complete sent
                // meanwhile, an expiry, a cancel): the job itself must still be Leased to this
                // token.
                if let Some(r) = self.ended_refusal(name, &token) {
                    return Err(WorkerError::Refused(r));
                }
                let moved_on = match self.cached_job_moved_on(name, &token) {
                    None if confirmed => None,
                    // Not in the held-jobs cache: deleted, or claimed by another holder since
                    // (superseded); a fresh read tells.
                    None => match self.read_if_uncached(name).await {
                        Some(None) => {
                            Some(("job_not_found", "the LeasedJob was deleted".to_string()))
                        }
                        Some(Some(job)) => {
                            if let Some(r) = fence::refusal(&self.job_ref(name), Some(&job), &token)
                            {
                                if let Some(h) = &held {
                                    self.lose(h, r.category(), r.to_string());
                                }
                                return Err(WorkerError::Refused(r));
                            }
                            None
                        }
                        None => None,
                    },
                    other => other,
                };
                if let Some((code, why)) = moved_on {
                    let message = lost_message(&self.job_ref(name), &why);
                    if let Some(h) = &held {
                        self.lose(h, code, message.clone());
                    }
                    return Err(WorkerError::LeaseLost { code, message });
                }
                let duration_s = lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.lease_duration_seconds)
                    .unwrap_or(60);
                let held = held.unwrap_or_else(|| {
                    self.hold(name, token.clone(), duration_s, None, Instant::now())
                });
                let renew_time = lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.renew_time.as_ref())
                    .map_or_else(Timestamp::now, |t| t.0);
                {
                    let mut st = held.state.lock().unwrap();
                    st.last_renewed = Instant::now();
                    st.renew_time = renew_time;
                    if checkpoint.is_some() {
                        st.checkpoint = checkpoint;
                    }
                    st.progress.update(&progress);
                }
                Ok(Renewal {
                    renew_time,
                    expires_at: renew_time + SignedDuration::from_secs(i64::from(duration_s)),
                    lease_duration_seconds: duration_s,
                })
            }
            Err(LeaseError::Ended { why, code }) => Err(WorkerError::LeaseLost {
                code,
                message: lost_message(&self.job_ref(name), &why),
            }),
            Err(e @ (LeaseError::Lost { .. } | LeaseError::NotOurs { .. })) => {
                // Lost before any write (a first renewal too late), or its claim undone for a
                // Lease name taken by something else: the reason is already known.
                if let Some(h) = &held {
                    let lost = h.state.lock().unwrap().lost.clone();
                    if let (Some((code, message)), true) = (
                        lost,
                        matches!(e, LeaseError::NotOurs { .. }) || !h.lease_taken(),
                    ) {
                        return Err(WorkerError::LeaseLost { code, message });
                    }
                }
                let err = self.explain_lost(name, &token).await;
                if let Some(h) = &held {
                    self.lose(h, err.category(), err.to_string());
                }
                Err(err)
            }
            Err(LeaseError::CheckpointTooLarge { size }) => Err(WorkerError::TooLarge(format!(
                "checkpoint is {size} bytes of JSON; at most {} are accepted",
                lease::MAX_CHECKPOINT_BYTES
            ))),
            Err(e @ (LeaseError::Api(_) | LeaseError::Timeout { .. })) => {
                let unavailable = || {
                    WorkerError::unavailable(
                        format!("heartbeat of LeasedJob {}", self.job_ref(name)),
                        error_chain(&e),
                    )
                };
                if let Some(h) = &held {
                    if self.renewals_failed_too_long(&self.job_ref(name), h) {
                        return Err(self
                            .held_for(name, &token)
                            .err()
                            .unwrap_or_else(unavailable));
                    }
                }
                Err(unavailable())
            }
        }
    }

    /// The refusal `token` earns when this process ended its attempt (see
    /// [`Inner::ended_here`](crate::Inner::ended_here)).
    fn ended_refusal(&self, name: &str, token: &Token) -> Option<Refusal> {
        ended_refusal_in(&self.inner.ended_here.lock().unwrap(), name, token)
    }

    /// Before a renewal for a token this process does not hold: refuses it when this process
    /// ended its attempt, else asks the API server whether the job is still Leased to it. (This
    /// process may have restarted since the claim; the Lease of an ended attempt would accept
    /// the renewal, so only the job can tell.) One read, for the first heartbeat of an attempt
    /// after a restart; a successful renewal makes the attempt held again.
    ///
    /// Returns the job read, Leased to the token.
    ///
    /// # Errors
    /// [`WorkerError::Refused`] with the job's refusal; [`WorkerError::Unavailable`] when the
    /// job could not be read.
    async fn check_unheld(&self, name: &str, token: &Token) -> Result<LeasedJob, WorkerError> {
        if let Some(r) = self.ended_refusal(name, token) {
            return Err(WorkerError::Refused(r));
        }
        let job_ref = self.job_ref(name);
        let job = self.inner.jobs.get_opt(name).await.map_err(|e| {
            WorkerError::unavailable(format!("heartbeat of LeasedJob {job_ref}"), error_chain(&e))
        })?;
        match (fence::refusal(&job_ref, job.as_ref(), token), job) {
            (None, Some(job)) => Ok(job),
            (Some(r), _) => Err(WorkerError::Refused(r)),
            (None, None) => Err(WorkerError::Refused(Refusal::NotFound { job: job_ref })),
        }
    }

    /// Why the watch cache says the job no longer belongs to `token`, if it does: (error code,
    /// reason).
    pub(crate) fn cached_job_moved_on(
        &self,
        name: &str,
        token: &Token,
    ) -> Option<(&'static str, String)> {
        let key = ObjectRef::new(name).within(&self.inner.config.namespace);
        // Not in the cache: deleted, or claimed by another holder since; the caller asks the
        // API server.
        let job = self.inner.held_watch.store.get(&key)?;
        moved_on(&job, token)
    }

    /// The job `name` as the API server has it now (`Some(None)`: deleted), read when the
    /// held-jobs cache does not show it: a job claimed by another holder since has left that
    /// cache (its `status.holder` changed), and only a fresh read tells this process its
    /// attempt was superseded. The cache may also lack it for want of a watch (none runs, one
    /// is listing, or the job was claimed before the running watch began and not read since);
    /// the read then costs one request, and goes to the watch ([`Worker::read_by_name`]).
    /// `None` when the cache shows the job, or the read failed: nothing is known beyond the
    /// cache, and the Lease decides.
    pub(crate) async fn read_if_uncached(&self, name: &str) -> Option<Option<LeasedJob>> {
        let key = ObjectRef::new(name).within(&self.inner.config.namespace);
        if self.inner.held_watch.store.get(&key).is_some() {
            return None;
        }
        self.read_by_name(name).await.ok()
    }

    /// Reads the job `name` afresh (`None`: deleted) as a LIST by name: the API server reads the
    /// one key, and the list's resourceVersion is the revision it read at, from which a watch
    /// misses nothing of this job. When the read shows this process as the job's holder, it
    /// goes to the held-jobs watch ([`crate::held_watch`]): it starts the watch if none runs,
    /// and is cached if one runs and may take it.
    ///
    /// # Errors
    /// The API server's, when the read failed.
    async fn read_by_name(&self, name: &str) -> Result<Option<LeasedJob>, kube::Error> {
        let by_name = ListParams::default().fields(&format!("metadata.name={name}"));
        let list = self.inner.jobs.list(&by_name).await?;
        let revision = list
            .metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse::<u64>().ok());
        let read = list.items.into_iter().find(|j| j.name_any() == name);
        let identity = Some(self.inner.config.identity.as_str());
        if let (Some(job), Some(revision)) = (&read, revision) {
            if job.status.as_ref().and_then(|s| s.holder.as_deref()) == identity {
                self.inner.held_watch.renewing(job, revision);
            }
        }
        Ok(read)
    }

    /// After the Lease refused a renewal: the refusal as the job explains it.
    async fn explain_lost(&self, name: &str, token: &Token) -> WorkerError {
        let job_ref = self.job_ref(name);
        match self.inner.jobs.get_opt(name).await {
            Ok(job) => match fence::refusal(&job_ref, job.as_ref(), token) {
                Some(r) => WorkerError::Refused(r),
                None => WorkerError::LeaseLost {
                    code: LEASE_LOST,
                    message: lost_message(&job_ref, "its Lease no longer names this token"),
                },
            },
            Err(e) => WorkerError::LeaseLost {
                code: LEASE_LOST,
                message: lost_message(
                    &job_ref,
                    &format!("its Lease no longer names this token ({})", error_chain(&e)),
                ),
            },
        }
    }
}

/// Whether the first renewal of an attempt claimed `since_claim` ago (monotonic clock, from
/// when the claim's write was sent) may still be made, for a lease of `duration`: not once a
/// whole lease duration has passed, since no renewal reached the API server in that time and
/// the controller may have requeued the job (docs/protocol.md, "The Lease is written by the
/// first renewal").
pub(crate) fn first_renewal_allowed(since_claim: Duration, duration: Duration) -> bool {
    !crate::renew::outlived(since_claim, duration)
}

/// Why `job` (a copy of the held-jobs watch cache) no longer belongs to `token`, if it does not:
/// (error code, reason). A newer attempt has taken it (`lease_lost`), or the token's attempt
/// ended: `cancelled` for a cancelled job, `lease_lost` otherwise.
pub(crate) fn moved_on(job: &LeasedJob, token: &Token) -> Option<(&'static str, String)> {
    if job.attempt() > token.attempt() {
        let why = format!(
            "is on attempt {}, your token is from attempt {}",
            job.attempt(),
            token.attempt()
        );
        return Some((LEASE_LOST, why));
    }
    if job.token() == Some(token.as_str()) && job.phase() != Phase::Leased {
        let code = if job.phase() == Phase::Cancelled {
            "cancelled"
        } else {
            LEASE_LOST
        };
        let why = format!(
            "attempt {} ended: the job is {}",
            token.attempt(),
            job.phase()
        );
        return Some((code, why));
    }
    None
}

/// The code a worker's call gets when a first renewal finds its attempt ended with `refusal`:
/// the same code the held-jobs cache would give ([`moved_on`]), so a cancel seen first by a
/// fresh read is still `cancelled`, not a lost lease.
pub(crate) fn ended_code(refusal: &Refusal) -> &'static str {
    match refusal {
        Refusal::Cancelled { .. } => "cancelled",
        _ => LEASE_LOST,
    }
}

/// The refusal `token` earns from `ended` (the attempt this process ended last per job name,
/// with its refusal), if it is the token of the attempt ended for job `name`.
pub(crate) fn ended_refusal_in(
    ended: &HashMap<String, (Token, Refusal)>,
    name: &str,
    token: &Token,
) -> Option<Refusal> {
    ended
        .get(name)
        .filter(|(t, _)| t == token)
        .map(|(_, r)| r.clone())
}
