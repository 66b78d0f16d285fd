//! A sidecar's watch of its queue, kept only while it pays for itself.
//!
//! To choose a job in milliseconds a sidecar keeps its queue's jobs in a watch cache
//! ([`leasehold_core::claim_index`]). It needs that cache only while its worker claims:
//! a worker busy with one job for minutes or hours has no use for every change of every other
//! job of the queue, and with S sidecars on one queue each change is sent S times (benchmark
//! row 9). So this watch follows the rent-or-buy rule of competitive snoopy caching (Karlin,
//! Manasse, Rudolph and Sleator, "Competitive Snoopy Caching", FOCS 1986; the ski-rental
//! problem): while no claim is in progress it counts the changes it receives (the rent); once
//! they outnumber what a fresh list would bring (the jobs it caches, plus [`RELIST_EVENTS`] for
//! the list and watch requests themselves: the price of buying), it stops watching and empties
//! its cache, and the next claim lists the queue again (waiting at least [`RELIST_WAIT`] for it). Whatever the pattern
//! of claims, that costs at most about twice the cheaper of watching all along and listing
//! afresh for every claim. A watch caching more than [`MAX_RELIST_JOBS`] never stops: the
//! price of buying is also the next claim's wait, and a list of a long queue takes seconds.
//!
//! The jobs a sidecar holds are watched apart from this one, whenever it holds one (the field
//! selector `status.holder=<identity>`: see [`held_selector`]), so stopping this watch never
//! hides a cancel, an expiry or a deletion of a held job from its heartbeats.
//!
//! [`Interest`] is the rule, a plain value; [`QueueWatch`] shares it between the claims and
//! the watch task ([`run`]), which does the IO.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::reflector::{store::Writer, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Api;
use tokio::sync::{watch, Notify};
use tracing::info;

use crate::recorder::Recorder;
use crate::watch::Synced;
use leasehold_core::claim_index::{Change, ClaimIndex};
use leasehold_core::crd::{LeasedJob, Phase};

/// The fixed part of what listing the queue again costs, counted in watch events: a LIST
/// request and a new WATCH request, each about as costly for the API server as sending a few
/// events. An estimate; it only sets how soon an idle sidecar of an almost empty queue stops.
pub const RELIST_EVENTS: usize = 8;

/// A queue watch whose cache holds more jobs than this never stops: listing them again would
/// make the next claim wait too long (about 0.25 s per 1,000 jobs, in pages of 100:
/// docs/scaling.md), however much traffic stopping would save.
pub const MAX_RELIST_JOBS: usize = 1000;

/// How long a claim that finds the queue watch stopped waits for the new list at least,
/// whatever its own `wait` (a `wait=0` claim too; a longer `wait` waits that long): a list of a
/// few hundred jobs takes tens of milliseconds, and a watch caching more than
/// [`MAX_RELIST_JOBS`] never stops. Past it the claim is answered 503 and the list goes on.
pub const RELIST_WAIT: Duration = Duration::from_secs(10);

/// The rent-or-buy rule (see the module doc): whether the queue watch should run.
#[derive(Debug)]
pub struct Interest {
    /// Claims in progress.
    claims: usize,
    /// Changes received since the last claim ended (or since the watch started) while no
    /// claim was in progress.
    idle_events: usize,
    /// True while the watch runs (or is starting).
    watching: bool,
}

impl Default for Interest {
    /// Watching: a sidecar's first claim usually comes right after it starts.
    fn default() -> Self {
        Interest {
            claims: 0,
            idle_events: 0,
            watching: true,
        }
    }
}

impl Interest {
    /// A claim begins. True when the watch had stopped and must start again.
    pub fn claim_began(&mut self) -> bool {
        self.claims += 1;
        self.idle_events = 0;
        !std::mem::replace(&mut self.watching, true)
    }

    /// A claim ended (with a job or without): the idle count starts again from zero.
    pub fn claim_ended(&mut self) {
        self.claims = self.claims.saturating_sub(1);
        self.idle_events = 0;
    }

    /// The watch delivered a change (an added, modified or deleted job; not a list) while the
    /// cache holds `cached` jobs. True when the watch should stop now: no claim in progress,
    /// at most [`MAX_RELIST_JOBS`] cached, and more changes since the last claim (counted
    /// while that held) than `cached` + [`RELIST_EVENTS`].
    pub fn changed(&mut self, cached: usize) -> bool {
        if self.claims > 0 || !self.watching {
            return false;
        }
        if cached > MAX_RELIST_JOBS {
            self.idle_events = 0;
            return false;
        }
        self.idle_events += 1;
        if self.idle_events > cached.saturating_add(RELIST_EVENTS) {
            self.watching = false;
            self.idle_events = 0;
            return true;
        }
        false
    }

    /// True while the watch runs or is starting.
    pub fn is_watching(&self) -> bool {
        self.watching
    }
}

/// What the claims and the watch task share.
#[derive(Debug)]
pub struct QueueWatch {
    interest: Mutex<Interest>,
    /// Wakes a stopped watch task ([`Notify::notify_one`] keeps the wake for a task not yet
    /// waiting).
    start: Notify,
    /// Set while the cache holds a complete list of the queue.
    synced: Synced,
    /// Set once the cache has been complete at least once (readiness).
    ever_synced: Synced,
}

impl Default for QueueWatch {
    fn default() -> Self {
        QueueWatch {
            interest: Mutex::default(),
            start: Notify::new(),
            synced: Synced::default(),
            ever_synced: Synced::default(),
        }
    }
}

/// A claim in progress ([`QueueWatch::claiming`]); ends it when dropped.
#[derive(Debug)]
pub struct Claiming<'a>(&'a QueueWatch);

impl Drop for Claiming<'_> {
    fn drop(&mut self) {
        self.0.interest.lock().unwrap().claim_ended();
    }
}

impl QueueWatch {
    /// Marks a claim in progress until the returned guard is dropped, starting the watch again
    /// if it had stopped.
    pub fn claiming(&self) -> Claiming<'_> {
        if self.interest.lock().unwrap().claim_began() {
            info!("Watching the queue again for a claim");
            self.start.notify_one();
        }
        Claiming(self)
    }

    /// True once the cache has been complete at least once.
    pub fn ever_synced(&self) -> bool {
        self.ever_synced.is_synced()
    }

    /// Waits until the cache holds a complete list of the queue (at once if it does).
    pub async fn wait_synced(&self) {
        self.synced.wait().await;
    }

    /// Waits until the cache has been complete once.
    pub async fn wait_ever_synced(&self) {
        self.ever_synced.wait().await;
    }
}

/// The field selector of a queue watch: every job of the queue, in any phase.
///
/// Why not also `status.phase!=Succeeded,...`, which would keep finished jobs out of the
/// cache: on the real API server it made claiming slower and far more contended (benchmark
/// row 2 at 32 claimers: 14 to 25 % of claim writes answered 409 and 0.5x the ceiling's write
/// rate, against 0.7 % and 0.8x with this selector, same binary otherwise). Finished jobs are
/// kept out of the cache by their TTL instead (`spec.ttlSecondsAfterFinished`).
pub fn queue_selector(queue: &str) -> String {
    format!("spec.queue={}", escape_field_value(queue))
}

/// The field selector of a queue's Queued jobs (claimable now or later): what a sidecar with
/// no copy of its queue lists when it chooses on its own. Written as "no other phase", so that
/// a job the controller has not initialised yet (no status: Queued, [`LeasedJob::phase`]) is
/// listed too.
pub fn queued_selector(queue: &str) -> String {
    let mut selector = queue_selector(queue);
    for phase in [
        Phase::Leased,
        Phase::Succeeded,
        Phase::Failed,
        Phase::Cancelled,
    ] {
        selector.push_str(",status.phase!=");
        selector.push_str(phase.as_str());
    }
    selector
}

/// The field selector of the watch of the jobs `identity` holds or last held in `queue`, in
/// any phase (`status.holder` stays after the attempt ends, until the next claim).
pub fn held_selector(queue: &str, identity: &str) -> String {
    format!(
        "spec.queue={},status.holder={}",
        escape_field_value(queue),
        escape_field_value(identity)
    )
}

/// `value` escaped for a field selector: `\`, `,` and `=` get a backslash (apimachinery's
/// `fields.EscapeValue`).
pub fn escape_field_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        if matches!(c, '\\' | ',' | '=') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// What the queue watch keeps up to date.
pub struct Cache {
    /// Writes the store the claims read.
    pub writer: Writer<LeasedJob>,
    /// That store (its size is what a fresh list would bring).
    pub store: Store<LeasedJob>,
    /// The claim index, fed every event after the store.
    pub index: Arc<Mutex<ClaimIndex>>,
    /// Bumped after every event, to wake waiting claims.
    pub changes: watch::Sender<u64>,
}

/// The queue watch task: runs the watch of [`queue_selector`] in `api` into `cache`, and stops
/// and starts by `shared`'s [`Interest`]. Runs until aborted.
pub async fn run(
    api: Api<LeasedJob>,
    queue: String,
    metrics: Arc<dyn Recorder>,
    cache: Cache,
    shared: Arc<QueueWatch>,
) {
    let Cache {
        mut writer,
        store,
        index,
        changes,
    } = cache;
    let selector = queue_selector(&queue);
    let mut cached = 0;
    loop {
        metrics.queue_watch_running(true);
        // Each job is decoded on its own: one this binary cannot read is skipped and reported
        // (log, metric), and the rest of the queue is served. The cache keeps what choosing
        // and claiming a job need, not its payload or result: a sidecar's memory then does not
        // grow with the bytes of the queue. The claim's answer brings the payload.
        let stream = crate::watch::watch(
            &api,
            watcher::Config::default().fields(&selector),
            Arc::clone(&metrics),
            |_| {},
        )
        .modify(LeasedJob::drop_payload_and_result);
        // Pinned on the heap, so that it can be dropped (closing the watch request) before
        // the wait below: a watch kept but not read still has every change sent to it.
        let mut stream = Box::pin(stream);
        while let Some(event) = stream.next().await {
            let event = match event {
                Ok(event) => event,
                Err(e) => {
                    crate::watch::log_error("LeasedJob", &e);
                    continue;
                }
            };
            writer.apply_watcher_event(&event);
            index.lock().unwrap().observe(change(&event));
            let stop = match &event {
                watcher::Event::InitDone => {
                    shared.synced.set(true);
                    shared.ever_synced.set(true);
                    false
                }
                watcher::Event::Apply(_) | watcher::Event::Delete(_) => {
                    let mut interest = shared.interest.lock().unwrap();
                    cached = store.len();
                    let stop = interest.changed(cached);
                    if stop {
                        // Under the same lock as the decision: a claim that begins from
                        // now on waits for the next list.
                        shared.synced.set(false);
                    }
                    stop
                }
                watcher::Event::Init | watcher::Event::InitApply(_) => false,
            };
            changes.send_modify(|n| *n = n.wrapping_add(1));
            if stop {
                break;
            }
        }
        // Stopped: close the watch, forget the queue (an empty list), keep the claims seen,
        // and wait for a claim. (The stream itself never ends: kube's watcher retries on its
        // own.)
        drop(stream);
        for e in [watcher::Event::Init, watcher::Event::InitDone] {
            writer.apply_watcher_event(&e);
            index.lock().unwrap().observe(change(&e));
        }
        crate::memory::release_freed();
        metrics.queue_watch_running(false);
        metrics.queue_watch_stopped();
        info!(queue = %queue, cached, "Stopped watching queue {queue}: no claim while more of its jobs changed than the {cached} a fresh list would bring; the next claim lists it again");
        changes.send_modify(|n| *n = n.wrapping_add(1));
        shared.start.notified().await;
    }
}

/// A watcher event as the claim index follows it.
fn change(event: &watcher::Event<LeasedJob>) -> Change<'_> {
    match event {
        watcher::Event::Apply(job) => Change::Applied(job),
        watcher::Event::Delete(job) => Change::Deleted(job),
        watcher::Event::Init => Change::RelistBegan,
        watcher::Event::InitApply(job) => Change::Relisted(job),
        watcher::Event::InitDone => Change::RelistDone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_watch_stops_once_changes_outnumber_a_fresh_list() {
        let mut i = Interest::default();
        assert!(i.is_watching());
        for _ in 0..(10 + RELIST_EVENTS) {
            assert!(!i.changed(10), "not yet: a list would cost as much");
        }
        assert!(i.changed(10), "one more than a list of 10 jobs would cost");
        assert!(!i.is_watching());
        assert!(!i.changed(10), "a stopped watch decides nothing more");
    }

    #[test]
    fn a_claim_in_progress_keeps_the_watch_whatever_the_changes() {
        let mut i = Interest::default();
        assert!(!i.claim_began(), "already watching: nothing to start");
        for _ in 0..10_000 {
            assert!(!i.changed(0));
        }
        i.claim_ended();
        for _ in 0..RELIST_EVENTS {
            assert!(!i.changed(0), "the count starts from the claim's end");
        }
        assert!(i.changed(0));
    }

    #[test]
    fn a_claim_starts_a_stopped_watch_once() {
        let mut i = Interest::default();
        while !i.changed(0) {}
        assert!(i.claim_began(), "stopped: the claim must start it");
        assert!(!i.claim_began(), "a second claim finds it starting");
        i.claim_ended();
        i.claim_ended();
        i.claim_ended(); // one too many does not underflow
        assert!(i.is_watching());
    }

    #[test]
    fn each_claim_resets_the_idle_count() {
        let mut i = Interest::default();
        for _ in 0..100 {
            for _ in 0..RELIST_EVENTS {
                assert!(!i.changed(0));
            }
            i.claim_began();
            i.claim_ended();
        }
        assert!(
            i.is_watching(),
            "never more than a list's worth between claims"
        );
    }

    #[test]
    fn a_longer_queue_earns_a_longer_watch() {
        let (mut short, mut long) = (Interest::default(), Interest::default());
        let count = |i: &mut Interest, cached| (0..).take_while(|_| !i.changed(cached)).count();
        assert_eq!(count(&mut short, 0), RELIST_EVENTS);
        assert_eq!(count(&mut long, 1000), 1000 + RELIST_EVENTS);
    }

    #[test]
    fn a_long_queue_keeps_its_watch_since_a_list_would_take_too_long() {
        let mut i = Interest::default();
        for _ in 0..100_000 {
            assert!(!i.changed(MAX_RELIST_JOBS + 1));
        }
        // Shrunk to the limit: counting starts from there.
        let n = (0..).take_while(|_| !i.changed(MAX_RELIST_JOBS)).count();
        assert_eq!(n, MAX_RELIST_JOBS + RELIST_EVENTS);
    }

    #[test]
    fn selectors_name_the_queue_and_holder_escaped() {
        assert_eq!(queue_selector("media"), "spec.queue=media");
        assert_eq!(
            held_selector("media", "pod,a=b\\c"),
            "spec.queue=media,status.holder=pod\\,a\\=b\\\\c"
        );
    }
}
