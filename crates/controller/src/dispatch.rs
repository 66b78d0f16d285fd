//! The dispatcher's running half: the controller feeds every event of its LeasedJob watch to
//! [`leasehold_core::dispatch::Dispatch`], and workers' long polls wait here for an offer.
//!
//! Only the leading replica answers (a standby's view is as warm, but two replicas offering
//! would offer one job twice); a standby answers [`Answer::NotLeading`] and the sidecar falls
//! back to choosing on its own. Offers are advice: docs/protocol.md, "Dispatch".

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::runtime::watcher;
use tokio::sync::watch;
use tokio::time::Instant;

use leasehold_core::claim_index::Change;
use leasehold_core::crd::LeasedJob;
use leasehold_core::dispatch::{
    key_of, Dispatch, Hint, QueueKey, ADDRESS_ANNOTATION, ADVERT_LEASE,
};

use crate::leader::Leadership;

/// The longest a worker's poll waits for an offer, whatever it asks: polls are answered
/// empty at least this often, so that a sidecar notices a failover in its own time.
pub const MAX_POLL_WAIT: Duration = Duration::from_secs(30);

/// A dispatcher and where it is advertised ([`crate::Config::dispatch`]).
#[derive(Clone)]
pub struct Setup {
    /// The dispatcher the controller feeds.
    pub dispatcher: Arc<Dispatcher>,
    /// Namespace of the [`ADVERT_LEASE`].
    pub advert_namespace: String,
    /// `host:port` where its HTTP edge answers.
    pub address: String,
}

impl std::fmt::Debug for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Setup")
            .field("advert_namespace", &self.advert_namespace)
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

/// What a poll got.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// This job: claim it (from a copy read from the API server).
    Offer(Hint),
    /// No job came within the wait.
    Empty,
    /// This replica does not lead: ask the leader, or choose on your own.
    NotLeading,
    /// This replica leads but has not listed the jobs yet (it has just started): its view is
    /// empty, not the queue; choose on your own meanwhile.
    NotListed,
}

/// The dispatcher of one controller replica.
#[derive(Default)]
pub struct Dispatcher {
    state: Mutex<Dispatch>,
    /// Per queue, a counter bumped on every change of one of its jobs, which wakes its polls.
    changes: Mutex<HashMap<QueueKey, watch::Sender<u64>>>,
    /// Bumped on every (re-)list's end, which may change any queue.
    relists: watch::Sender<u64>,
    /// The replica's leadership, once its controller runs ([`crate::run`] sets it).
    leadership: OnceLock<Arc<Leadership>>,
}

impl Dispatcher {
    /// A dispatcher that answers once its controller runs, while the replica leads.
    pub fn new() -> Dispatcher {
        Dispatcher {
            state: Mutex::new(Dispatch::new()),
            changes: Mutex::new(HashMap::new()),
            relists: watch::Sender::new(0),
            leadership: OnceLock::new(),
        }
    }

    /// Answers from now on while `leadership` leads (once; later calls are ignored).
    pub(crate) fn lead_with(&self, leadership: Arc<Leadership>) {
        let _ = self.leadership.set(leadership);
    }

    fn leading(&self) -> bool {
        self.leadership.get().is_some_and(|l| l.is_leader())
    }

    /// Follows one event of the controller's LeasedJob watch.
    pub fn observe(&self, event: &watcher::Event<LeasedJob>) {
        let change = match event {
            watcher::Event::Apply(job) => Change::Applied(job),
            watcher::Event::Delete(job) => Change::Deleted(job),
            watcher::Event::Init => Change::RelistBegan,
            watcher::Event::InitApply(job) => Change::Relisted(job),
            watcher::Event::InitDone => Change::RelistDone,
        };
        self.state.lock().unwrap().observe(change);
        match event {
            watcher::Event::Apply(job) | watcher::Event::Delete(job) => {
                if let Some(key) = key_of(job) {
                    if let Some(tx) = self.changes.lock().unwrap().get(&key) {
                        tx.send_modify(|n| *n += 1);
                    }
                }
            }
            watcher::Event::InitDone => self.relists.send_modify(|n| *n += 1),
            watcher::Event::Init | watcher::Event::InitApply(_) => {}
        }
    }

    /// Waits up to `wait` (at most [`MAX_POLL_WAIT`]) for a job of `queue` to offer `worker`.
    pub async fn poll(&self, queue: &QueueKey, worker: &str, wait: Duration) -> Answer {
        let deadline = Instant::now() + wait.min(MAX_POLL_WAIT);
        let mut changed = self.subscribe(queue);
        let mut relisted = self.relists.subscribe();
        loop {
            if !self.leading() {
                return Answer::NotLeading;
            }
            // Marked seen before the view is read, so that no change after the read is missed.
            changed.borrow_and_update();
            relisted.borrow_and_update();
            let now = Timestamp::now();
            let next = {
                let mut state = self.state.lock().unwrap();
                if !state.has_listed() {
                    return Answer::NotListed;
                }
                if let Some(hint) = state.offer(queue, worker, now) {
                    return Answer::Offer(hint);
                }
                state.next_offer_at(queue, now)
            };
            let wake = next
                .map(|t| {
                    Instant::now() + Duration::try_from(t.duration_since(now)).unwrap_or_default()
                })
                .map_or(deadline, |t| t.min(deadline));
            tokio::select! {
                _ = changed.changed() => {}
                _ = relisted.changed() => {}
                () = tokio::time::sleep_until(wake), if wake < deadline => {}
                () = tokio::time::sleep_until(deadline) => return Answer::Empty,
            }
        }
    }

    /// `worker` could not claim the job `name` of `queue` it was offered: offer it to others.
    pub fn declined(&self, queue: &QueueKey, name: &str, worker: &str) {
        self.state.lock().unwrap().declined(queue, name, worker);
        if let Some(tx) = self.changes.lock().unwrap().get(queue) {
            tx.send_modify(|n| *n += 1);
        }
    }

    fn subscribe(&self, queue: &QueueKey) -> watch::Receiver<u64> {
        let mut changes = self.changes.lock().unwrap();
        // Forget queues no poll waits on any more.
        changes.retain(|_, tx| tx.receiver_count() > 0);
        changes
            .entry(queue.clone())
            .or_insert_with(|| watch::Sender::new(0))
            .subscribe()
    }
}

/// How often the leader checks that the advert still names it (a deposed leader's late write
/// could have replaced it), and a standby that it leads now.
pub const ADVERT_CHECK: Duration = Duration::from_secs(2);

/// Keeps [`ADVERT_LEASE`] naming `address` while `leadership` leads, until `stop` resolves.
/// One read per [`ADVERT_CHECK`] while leading, and a write only when the advert names another
/// address or holder; nothing while standing by. Failures are logged and tried again.
pub async fn advertise(
    leases: kube::Api<k8s_openapi::api::coordination::v1::Lease>,
    identity: String,
    address: String,
    leadership: Arc<Leadership>,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut stop = std::pin::pin!(stop);
    let mut tick = tokio::time::interval(ADVERT_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = &mut stop => return,
            _ = tick.tick() => {}
        }
        if !leadership.is_leader() {
            continue;
        }
        let current = match leases.get_opt(ADVERT_LEASE).await {
            Ok(current) => current,
            Err(e) => {
                tracing::warn!(error = %e, "Could not read the dispatcher's advert Lease {ADVERT_LEASE}; trying again");
                continue;
            }
        };
        let names_us = current.as_ref().is_some_and(|l| {
            l.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ADDRESS_ANNOTATION))
                == Some(&address)
                && l.spec.as_ref().and_then(|s| s.holder_identity.as_ref()) == Some(&identity)
        });
        if names_us || !leadership.is_leader() {
            continue;
        }
        let advert = serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": ADVERT_LEASE,
                "annotations": {ADDRESS_ANNOTATION: address},
            },
            "spec": {"holderIdentity": identity},
        });
        let params = kube::api::PatchParams::apply("leasehold-controller").force();
        match leases
            .patch(ADVERT_LEASE, &params, &kube::api::Patch::Apply(&advert))
            .await
        {
            Ok(_) => {
                tracing::info!(address = %address, "Advertised the dispatcher at {address} (Lease {ADVERT_LEASE})")
            }
            Err(e) => {
                tracing::warn!(error = %e, "Could not write the dispatcher's advert Lease {ADVERT_LEASE}; trying again")
            }
        }
    }
}
