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
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use leasehold_core::claim_index::Change;
use leasehold_core::crd::LeasedJob;
use leasehold_core::dispatch::{
    key_of, Dispatch, Hint, OwnSlot, QueueKey, ADDRESS_ANNOTATION, ADVERT_LEASE,
};

use crate::leader::Leadership;

/// The longest a worker's poll waits for an offer, whatever it asks: polls are answered
/// empty at least this often, so that a sidecar notices a failover in its own time.
pub const MAX_POLL_WAIT: Duration = Duration::from_secs(30);

/// How long the controller holds back the initial status write of a job that may be claimed
/// through an offer ([`Dispatcher::may_claim_soon`]): an offer's life
/// ([`leasehold_core::dispatch::OFFER_TTL_MS`]). A job claimed meanwhile needs no initial
/// status; one not claimed gets it this late.
pub const INITIAL_HOLD: Duration =
    Duration::from_millis(leasehold_core::dispatch::OFFER_TTL_MS.unsigned_abs());

/// The most waiting polls [`Dispatcher::may_claim_soon`] counts: a job further back than this
/// many offers is initialised at once. Telling the next W offers looks at the head of every
/// lane (concurrency key) of the queue W times, each head passing over the jobs already told
/// or offered, under the dispatcher's lock; it stops at the job asked about, which in a queue
/// whose waiting polls take each new job is the first.
pub const HELD_FOR_AT_MOST: usize = 64;

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
    /// This replica leads but its last check of its path to the API server failed
    /// ([`probe_path`]): its view may be stale (jobs created meanwhile missing from it);
    /// choose on your own until a check passes.
    Stale,
}

/// The dispatcher of one controller replica.
pub struct Dispatcher {
    state: Mutex<Dispatch>,
    /// Per queue, the line of its waiting polls: a change of one of its jobs wakes the one
    /// that has waited longest, not all of them ([`Dispatcher::poll`]).
    lines: Mutex<HashMap<QueueKey, Arc<Notify>>>,
    /// Bumped on every (re-)list's end, which may change any queue.
    relists: watch::Sender<u64>,
    /// The replica's leadership, once its controller runs ([`crate::run`] sets it).
    leadership: OnceLock<Arc<Leadership>>,
    /// False while [`probe_path`]'s last check of the path to the API server failed.
    fresh: watch::Sender<bool>,
    /// How many times a poll has read the view (a count, for tests).
    looks: std::sync::atomic::AtomicU64,
}

impl Default for Dispatcher {
    fn default() -> Self {
        Self::new()
    }
}

impl Dispatcher {
    /// A dispatcher that answers once its controller runs, while the replica leads.
    pub fn new() -> Dispatcher {
        Dispatcher {
            state: Mutex::new(Dispatch::new()),
            lines: Mutex::new(HashMap::new()),
            relists: watch::Sender::new(0),
            leadership: OnceLock::new(),
            fresh: watch::Sender::new(true),
            looks: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Records the result of a check of the path to the API server; true when it changed
    /// the dispatcher's mind. Polls waiting end at once when it turns false.
    pub fn set_fresh(&self, fresh: bool) -> bool {
        self.fresh
            .send_if_modified(|f| std::mem::replace(f, fresh) != fresh)
    }

    /// False while the last check of the path to the API server failed.
    pub fn is_fresh(&self) -> bool {
        *self.fresh.borrow()
    }

    /// Whether any poll waits (on any queue).
    fn polls_wait(&self) -> bool {
        self.lines
            .lock()
            .unwrap()
            .values()
            .any(|line| Arc::strong_count(line) > 1)
    }

    /// Whether `job`, a job the controller has not initialised yet, may be claimed through an
    /// offer of this dispatcher in a moment: this replica answers (it leads, its view is
    /// listed and fresh), the job is claimable now (not cancelled, being deleted, or before
    /// its notBefore), and it stands offered, or it is among the next W offers, W being the
    /// polls of its queue that wait (at most [`HELD_FOR_AT_MOST`]): the controller's watch fed
    /// it here before the job's reconcile, and woke a poll, which wakes the next when it gets
    /// an offer, so jobs created together go to as many waiting polls. A job behind those in
    /// claim order, or in a scope at its limit, is not: a claim of it may be far off. The
    /// controller then holds its initial status write back ([`INITIAL_HOLD`]), so that the
    /// claim, not that write, is the job's first. W may count a poll that has just been
    /// answered and not yet left: a job held for it gets its initial status 2 s late.
    ///
    /// Advice only: a wrong answer costs an initial status written up to [`INITIAL_HOLD`]
    /// late, or one 409 for the claim or that write (both are guarded by the job's
    /// resourceVersion).
    pub fn may_claim_soon(&self, job: &LeasedJob) -> bool {
        let (Some(queue), Some(name)) = (key_of(job), job.metadata.name.as_deref()) else {
            return false;
        };
        if !self.leading()
            || !self.is_fresh()
            || !leasehold_core::claim::claimable(job, &queue.queue, Timestamp::now())
        {
            return false;
        }
        // A poll holds its place in line until it has recorded its offer: the line is looked
        // at first, so that a poll leaving between the two looks has left its offer behind.
        let waiting = self
            .lines
            .lock()
            .unwrap()
            .get(&queue)
            .map_or(0, |line| Arc::strong_count(line) - 1)
            .min(HELD_FOR_AT_MOST);
        let state = self.state.lock().unwrap();
        let now = Timestamp::now();
        state.has_listed()
            && (state.offered(&queue, name, now) || state.offers_within(&queue, name, now, waiting))
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
                    self.wake_one(&key);
                }
            }
            watcher::Event::InitDone => self.relists.send_modify(|n| *n += 1),
            watcher::Event::Init | watcher::Event::InitApply(_) => {}
        }
    }

    /// Waits up to `wait` (at most [`MAX_POLL_WAIT`]) for a job of `queue` to offer `worker`.
    ///
    /// The polls of a queue wait in line: a change of one of its jobs wakes the poll that has
    /// waited longest, which looks at the view, and a poll that gets an offer wakes the next
    /// one in line, which looks for another job. Every poll of a queue would be offered the
    /// same job ([`Dispatch::offer`] does not depend on who asks), so one poll looking after a
    /// change is enough, where waking them all made each of 500 waiting polls take the view's
    /// lock on each of a job's four events (benchmark row 11: the controller's CPU per job grew
    /// fivefold from 8 to 500 waiting sidecars). A poll woken but gone before it looked
    /// passes its turn on (tokio's `Notify`).
    ///
    /// A reopening no change announces (a notBefore or retryAfter passing, an offer lapsing:
    /// [`Dispatch::next_offer_at`]) is known only to the polls that looked since it was
    /// foreseen, often one. A poll that knows one and leaves without an offer (its wait ended,
    /// or its caller went away) therefore wakes the next in line, which looks and waits for
    /// it in its place. The end of a (re-)list, and a change of the path check,
    /// still wake every poll.
    pub async fn poll(
        &self,
        queue: &QueueKey,
        worker: &str,
        wait: Duration,
        own: &[OwnSlot],
    ) -> Answer {
        let deadline = Instant::now() + wait.min(MAX_POLL_WAIT);
        let line = self.line(queue);
        let mut relisted = self.relists.subscribe();
        let mut fresh = self.fresh.subscribe();
        // Dropped last, once this poll's own place in line is gone: so it wakes another.
        let mut pass_on = PassOn {
            line: &line,
            armed: false,
        };
        let answer = loop {
            if !self.leading() {
                break Answer::NotLeading;
            }
            if !*fresh.borrow_and_update() {
                break Answer::Stale;
            }
            // In line before the view is read, so that no change after the read is missed.
            let turn = line.notified();
            tokio::pin!(turn);
            turn.as_mut().enable();
            relisted.borrow_and_update();
            let now = Timestamp::now();
            let next = {
                let mut state = self.state.lock().unwrap();
                self.looks
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if !state.has_listed() {
                    break Answer::NotListed;
                }
                if let Some(hint) = state.offer_fitting(queue, worker, now, own) {
                    // More jobs may wait: the next poll in line looks.
                    pass_on.armed = true;
                    break Answer::Offer(hint);
                }
                state.next_offer_at(queue, now)
            };
            pass_on.armed = next.is_some();
            let wake = next
                .map(|t| {
                    Instant::now() + Duration::try_from(t.duration_since(now)).unwrap_or_default()
                })
                .map_or(deadline, |t| t.min(deadline));
            tokio::select! {
                () = &mut turn => {}
                _ = relisted.changed() => {}
                _ = fresh.changed() => {}
                () = tokio::time::sleep_until(wake), if wake < deadline => {}
                () = tokio::time::sleep_until(deadline) => break Answer::Empty,
            }
        };
        answer
    }

    /// Sets what `queue`'s LeasedQueue says (None: it has none): weights and limits. Its polls
    /// wake, so a raised limit is offered at once.
    pub fn set_policy(&self, queue: &QueueKey, policy: Option<leasehold_core::dispatch::Policy>) {
        self.state.lock().unwrap().set_policy(queue, policy);
        self.wake_one(queue);
    }

    /// `worker` could not claim the job `name` of `queue` it was offered: offer it to others
    /// (a waiting poll wakes), if that offer stood for `worker`; otherwise nothing changes.
    pub fn declined(&self, queue: &QueueKey, name: &str, worker: &str) {
        let ended = self.state.lock().unwrap().declined(queue, name, worker);
        if ended {
            self.wake_one(queue);
        }
    }

    /// Wakes the poll of `queue` that has waited longest, if one waits; if it gets an offer,
    /// it wakes the next.
    fn wake_one(&self, queue: &QueueKey) {
        if let Some(line) = self.lines.lock().unwrap().get(queue) {
            line.notify_one();
        }
    }

    /// The line of `queue`'s waiting polls, for a poll to join.
    fn line(&self, queue: &QueueKey) -> Arc<Notify> {
        let mut lines = self.lines.lock().unwrap();
        // Forget queues no poll waits on any more.
        lines.retain(|_, line| Arc::strong_count(line) > 1);
        Arc::clone(
            lines
                .entry(queue.clone())
                .or_insert_with(|| Arc::new(Notify::new())),
        )
    }
}

/// Wakes the next poll in a queue's line when a poll leaves (answered, timed out or dropped)
/// while `armed`: it got an offer (more jobs may wait), or it knew of a reopening to come
/// that no change will announce ([`Dispatcher::poll`]).
struct PassOn<'a> {
    line: &'a Notify,
    armed: bool,
}

impl Drop for PassOn<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.line.notify_one();
        }
    }
}

/// How often the leading dispatcher checks its path to the API server while polls wait.
pub const PROBE_EVERY: Duration = Duration::from_millis(200);
/// The longest that check may take. A dispatcher that cannot read one small object within it
/// cannot trust its watch to be current either (a stalled path holds both), so a stall is
/// noticed within [`PROBE_EVERY`] + [`PROBE_BOUND`] = 800 ms, and the polls are answered
/// [`Answer::Stale`]: their sidecars choose on their own within a claim's 1 s.
pub const PROBE_BOUND: Duration = Duration::from_millis(600);

/// Checks, while `leadership` leads and polls wait, that the path to the API server flows:
/// one read of the [`ADVERT_LEASE`] through `leases` (the same client as the job watch) every
/// [`PROBE_EVERY`], answered within [`PROBE_BOUND`] or the dispatcher counts its view as
/// stale until a read is (and reads on until then, polls or not). With a fresh view and no
/// waiting poll it reads nothing. Runs until `stop` resolves.
///
/// Why: a dispatcher whose watch stalls (a held TCP path, a hung API server) still answers
/// its polls' keep-alives, so its sidecars would wait on a view that no longer sees new jobs,
/// for as long as the stall, or the leader election's renew deadline, lasts.
pub async fn probe_path(
    leases: kube::Api<k8s_openapi::api::coordination::v1::Lease>,
    dispatcher: Arc<Dispatcher>,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut stop = std::pin::pin!(stop);
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = &mut stop => return,
            _ = tick.tick() => {}
        }
        // A stale view is checked until a read passes, polls or not: a stale dispatcher
        // answers its polls at once, so none would be waiting to bring the check back.
        if !dispatcher.leading() || (dispatcher.is_fresh() && !dispatcher.polls_wait()) {
            continue;
        }
        let read = tokio::time::timeout(PROBE_BOUND, leases.get_opt(ADVERT_LEASE)).await;
        let ok = matches!(read, Ok(Ok(_)));
        if dispatcher.set_fresh(ok) {
            if ok {
                tracing::info!("The dispatcher reaches the API server again: it offers jobs again");
            } else {
                let why = match read {
                    Ok(Err(e)) => leasehold_kube::api::error_chain(&e),
                    _ => format!("no answer within {} ms", PROBE_BOUND.as_millis()),
                };
                tracing::warn!(error = %why, "The dispatcher could not read from the API server ({why}): its view of the jobs may be stale, so it offers none until it can; sidecars choose on their own meanwhile");
            }
        }
    }
}

/// How often the leader checks that the advert still names it (a deposed leader's late write
/// could have replaced it), and a standby that it leads now.
pub const ADVERT_CHECK: Duration = Duration::from_secs(2);

/// Keeps [`ADVERT_LEASE`] naming `address` while `leadership` leads, until `stop` resolves:
/// at once when a term begins, then at every check.
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
            // A new leader advertises at once, not at its next check.
            () = leadership.began() => {}
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use leasehold_core::crd::{LeasedJobSpec, LeasedJobStatus, Phase};

    fn queued(name: &str) -> LeasedJob {
        let mut j = LeasedJob::new(
            name,
            LeasedJobSpec {
                queue: "q".into(),
                ..LeasedJobSpec::default()
            },
        );
        j.metadata.namespace = Some("ns".into());
        j.metadata.creation_timestamp = Some(Time(Timestamp::now()));
        j.metadata.resource_version = Some("1".into());
        j.status = Some(LeasedJobStatus {
            phase: Some(Phase::Queued),
            ..LeasedJobStatus::default()
        });
        j
    }

    fn leading() -> Arc<Dispatcher> {
        let d = Arc::new(Dispatcher::new());
        d.lead_with(Arc::new(Leadership::always()));
        d.observe(&watcher::Event::Init);
        d.observe(&watcher::Event::InitDone);
        d
    }

    fn q() -> QueueKey {
        QueueKey {
            namespace: "ns".into(),
            queue: "q".into(),
        }
    }

    /// `n` polls of `q()` waiting, each as its own task, in the order started.
    async fn waiting(d: &Arc<Dispatcher>, n: usize) -> Vec<tokio::task::JoinHandle<Answer>> {
        let mut polls = Vec::new();
        for i in 0..n {
            polls.push(spawned(d, &format!("w{i}"), Duration::from_secs(20)).await);
        }
        polls
    }

    /// A poll of `q()` by `worker` waiting up to `wait`, as its own task, in line once this
    /// returns.
    async fn spawned(
        d: &Arc<Dispatcher>,
        worker: &str,
        wait: Duration,
    ) -> tokio::task::JoinHandle<Answer> {
        let (d, worker) = (Arc::clone(d), worker.to_string());
        let poll = tokio::spawn(async move { d.poll(&q(), &worker, wait, &[]).await });
        tokio::task::yield_now().await;
        poll
    }

    /// The names offered to the polls that have answered, and the polls still waiting.
    async fn settle(
        polls: Vec<tokio::task::JoinHandle<Answer>>,
    ) -> (Vec<String>, Vec<tokio::task::JoinHandle<Answer>>) {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        let mut offered = Vec::new();
        let mut still = Vec::new();
        for poll in polls {
            if poll.is_finished() {
                match poll.await.unwrap() {
                    Answer::Offer(hint) => offered.push(hint.name),
                    other => panic!("a poll answered {other:?}"),
                }
            } else {
                still.push(poll);
            }
        }
        offered.sort();
        (offered, still)
    }

    #[tokio::test]
    async fn a_new_job_wakes_the_longest_waiting_poll_only() {
        let d = leading();
        let polls = waiting(&d, 3).await;
        d.observe(&watcher::Event::Apply(queued("a")));
        let (offered, polls) = settle(polls).await;
        assert_eq!(offered, ["a"]);
        assert_eq!(polls.len(), 2);
        // A change that offers nothing (the job claimed) is looked at by one poll, which
        // waits again; the others were not woken and still wait.
        let looks = || d.looks.load(std::sync::atomic::Ordering::Relaxed);
        let before = looks();
        let mut claimed = queued("a");
        claimed.status.as_mut().unwrap().phase = Some(Phase::Leased);
        d.observe(&watcher::Event::Apply(claimed));
        let (offered, polls) = settle(polls).await;
        assert!(offered.is_empty());
        assert_eq!(polls.len(), 2);
        assert_eq!(looks() - before, 1, "one poll looked");
        d.observe(&watcher::Event::Apply(queued("b")));
        let (offered, polls) = settle(polls).await;
        assert_eq!(offered, ["b"]);
        assert_eq!(polls.len(), 1);
    }

    #[tokio::test]
    async fn jobs_seen_together_are_offered_to_as_many_waiting_polls() {
        let d = leading();
        let polls = waiting(&d, 4).await;
        for name in ["a", "b", "c"] {
            d.observe(&watcher::Event::Apply(queued(name)));
        }
        let (offered, polls) = settle(polls).await;
        assert_eq!(offered, ["a", "b", "c"]);
        assert_eq!(polls.len(), 1);
    }

    #[tokio::test]
    async fn a_poll_that_gets_an_offer_wakes_the_next_in_line() {
        // A limit raised from 1 to 3 makes two jobs offerable in one change: the poll it wakes
        // takes one, and wakes the next, which takes the other.
        let d = leading();
        let limit = |n| {
            Some(leasehold_core::dispatch::Policy {
                max_leased: Some(n),
                ..Default::default()
            })
        };
        d.set_policy(&q(), limit(1));
        for name in ["a", "b", "c"] {
            d.observe(&watcher::Event::Apply(queued(name)));
        }
        let polls = waiting(&d, 4).await;
        let (offered, polls) = settle(polls).await;
        assert_eq!(offered, ["a"], "one offer within the limit of 1");
        d.set_policy(&q(), limit(3));
        let (offered, polls) = settle(polls).await;
        assert_eq!(offered, ["b", "c"]);
        assert_eq!(polls.len(), 1);
    }

    #[tokio::test]
    async fn a_poll_woken_but_gone_passes_its_turn_on() {
        let d = leading();
        let mut polls = waiting(&d, 2).await;
        // The longest waiting poll's caller goes away as its turn comes.
        d.observe(&watcher::Event::Apply(queued("a")));
        polls.remove(0).abort();
        let (offered, polls) = settle(polls).await;
        assert_eq!(offered, ["a"]);
        assert!(polls.is_empty());
    }

    #[tokio::test]
    async fn a_reopening_known_to_a_poll_that_leaves_is_handed_to_the_next_in_line() {
        // Only the poll woken by the job's arrival knows when its notBefore passes; it leaves
        // before that, and the poll behind it, never woken by a change, must get the job.
        let d = leading();
        let short = spawned(&d, "short", Duration::from_millis(100)).await;
        let long = spawned(&d, "long", Duration::from_secs(10)).await;
        let mut later = queued("later");
        later.spec.not_before = Some(Time(
            Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_millis(400),
        ));
        d.observe(&watcher::Event::Apply(later));
        assert_eq!(short.await.unwrap(), Answer::Empty);
        let answer = tokio::time::timeout(Duration::from_secs(3), long)
            .await
            .expect("offered once its notBefore passes, not at the end of the wait")
            .unwrap();
        assert!(
            matches!(&answer, Answer::Offer(h) if h.name == "later"),
            "{answer:?}"
        );
    }

    #[tokio::test]
    async fn a_waiting_poll_ends_stale_when_the_path_check_fails_and_offers_after_it_passes() {
        let d = leading();
        let waiting = spawned(&d, "w", Duration::from_secs(20)).await;
        assert!(d.polls_wait());
        assert!(d.set_fresh(false));
        assert!(!d.set_fresh(false), "no change, no news");
        let answer = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the waiting poll ends at once")
            .unwrap();
        assert_eq!(answer, Answer::Stale);
        // A job it sees meanwhile is not offered while the path is in doubt ...
        d.observe(&watcher::Event::Apply(queued("j")));
        assert_eq!(d.poll(&q(), "w", Duration::ZERO, &[]).await, Answer::Stale);
        // ... and is once a check passes.
        assert!(d.set_fresh(true));
        assert!(matches!(
            d.poll(&q(), "w", Duration::ZERO, &[]).await,
            Answer::Offer(h) if h.name == "j"
        ));
    }

    #[tokio::test]
    async fn a_new_job_may_be_claimed_soon_while_a_poll_waits_for_it_or_its_offer_stands() {
        let d = leading();
        let unqueued = |name: &str| {
            let mut j = queued(name);
            j.status = None;
            j
        };
        let (a, b, c) = (unqueued("a"), unqueued("b"), unqueued("c"));
        // Two polls wait when three jobs come together: the first two are the ones those polls
        // are to be offered (woken, they have not looked yet); the third is not.
        let polls = waiting(&d, 2).await;
        for job in [&a, &b, &c] {
            d.observe(&watcher::Event::Apply(job.clone()));
        }
        assert!(d.may_claim_soon(&a));
        assert!(d.may_claim_soon(&b));
        assert!(!d.may_claim_soon(&c), "behind what the waiting polls get");
        let (offered, _) = settle(polls).await;
        assert_eq!(offered, ["a", "b"]);
        // Offered, with no poll waiting: the offers stand.
        assert!(d.may_claim_soon(&a) && d.may_claim_soon(&b));
        assert!(!d.may_claim_soon(&c), "no poll waits");
        // Offered, but declined: no claim is coming from that offer.
        d.declined(&q(), "a", "w0");
        assert!(!d.may_claim_soon(&a));
        // Offered again; but not held for once not claimable (a copy cancelled), nor by a
        // replica whose view may be stale.
        let poll = spawned(&d, "w", Duration::from_secs(20)).await;
        let (offered, _) = settle(vec![poll]).await;
        assert_eq!(offered, ["a"]);
        assert!(d.may_claim_soon(&a));
        let mut cancelled = a.clone();
        cancelled.spec.cancel = true;
        assert!(!d.may_claim_soon(&cancelled), "not claimable");
        d.set_fresh(false);
        assert!(!d.may_claim_soon(&a), "its view may be stale");
    }
}
