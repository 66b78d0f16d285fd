//! The watch of the jobs this process holds, run only while it holds one.
//!
//! Heartbeats and ends of attempts check what this watch caches (the held-jobs cache: a job
//! expired, cancelled or claimed by another holder since). A watch costs the API server on
//! every change of the namespace's LeasedJobs, matched or not: its watch cache matches each
//! event against every open watch of the resource, since no index serves a field selector of a
//! custom resource. With 500 sidecars waiting for work, their 500 watches of nothing made each
//! claimed job cost the API server 1.42 times the CPU it cost with 8 sidecars
//! (docs/benchmarks.md, row 11b). So a sidecar watches only from a claim until a slice of the
//! watch passes with nothing held and no new claim.
//!
//! A watch starts from the claim's own answer: it seeds the cache, and the watch goes on from
//! its resourceVersion ([`leasehold_kube::watch::watch_from`]), with no LIST (a LIST with this
//! selector makes the API server walk every job of the namespace). It runs in slices that the
//! API server ends (`Slices`): the first of [`FIRST_SLICE`], each next one twice as long up
//! to [`MAX_SLICE`] while attempts are held or claims come, none after a slice without either.
//! A watch the server ends leaves its connection to the client's next request, where one the
//! client dropped would cost a new TLS connection for every claim of a sidecar that waits long
//! between jobs.
//!
//! The cache is never made to go back: a claim made while the watch runs adds nothing to it.
//! Its change comes through the watch when it is newer than the watch's start; when it is
//! older (two claims whose answers came back out of order), the job stays out of the cache
//! until its next change. A held job the cache does not show is read afresh after a
//! heartbeat's renewal and before each background renewal (`read_if_uncached` in
//! heartbeat.rs): that costs a read, never a missed change.
//!
//! Started for an attempt this process did not claim (the first heartbeat after a restart), or
//! after the watch failed (a 410 Gone, a lost connection), the watch lists as every other watch
//! does ([`leasehold_kube::watch::watch`]); the cache keeps what it had until that list ends. A
//! watch that lists never ends by itself: it is dropped once nothing has been held for 1 to
//! 2 s (three checks half a [`LINGER`] apart).
//!
//! While no watch runs the cache is empty: nothing is held, and a heartbeat of a token this
//! process does not hold reads the job ([`crate::Worker`]'s `check_unheld`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::reflector::store::Writer;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use tokio::sync::mpsc;

use leasehold_core::crd::LeasedJob;
use leasehold_kube::queue_watch;
use leasehold_kube::recorder::Recorder;

/// How long a watch that lists runs on after the last held attempt ended: at least this long,
/// checked every half of it (three checks in a row with nothing held end it).
pub const LINGER: Duration = Duration::from_secs(1);

/// The first slice of a watch from a claim, in seconds.
pub const FIRST_SLICE: u32 = 1;

/// The longest slice, in seconds: after a long stretch of held attempts, the watch may run on
/// this long after the last one ends.
pub const MAX_SLICE: u32 = 64;

/// The held-jobs cache and the way to start its watch. Cheap to clone.
#[derive(Clone)]
pub(crate) struct HeldWatch {
    /// The jobs of the queue whose `status.holder` is this process's identity, in any phase,
    /// as far as the watch has seen them while it runs; empty while it does not.
    pub(crate) store: Store<LeasedJob>,
    starts: mpsc::UnboundedSender<Option<LeasedJob>>,
}

impl HeldWatch {
    /// The cache, and the task that runs its watch from each claim (or attempt found) until a
    /// slice (from a claim) or three checks half a [`LINGER`] apart (listing) pass with
    /// `holding()` (whether this process holds an attempt now) false and no claim. The task
    /// runs until aborted.
    pub(crate) fn start(
        api: Api<LeasedJob>,
        queue: &str,
        identity: &str,
        metrics: Arc<dyn Recorder>,
        holding: impl Fn() -> bool + Send + Sync + 'static,
    ) -> (
        HeldWatch,
        impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let (store, writer) = reflector::store();
        let (starts, rx) = mpsc::unbounded_channel();
        let watched = Watched {
            api,
            selector: queue_watch::held_selector(queue, identity),
            metrics,
            writer,
            holding: Arc::new(holding),
            slices: Arc::default(),
        };
        let task = watched.run(rx);
        (HeldWatch { store, starts }, task)
    }

    /// Tells the watch this process now holds an attempt: claimed with the answer `claimed`
    /// (payload and result dropped), or `None` for one it did not claim. Starts the watch if
    /// none runs.
    pub(crate) fn held(&self, claimed: Option<&LeasedJob>) {
        // The receiver lives as long as the worker's watch task; after that nothing watches.
        let _ = self.starts.send(claimed.cloned());
    }
}

/// What the watch task owns.
struct Watched {
    api: Api<LeasedJob>,
    selector: String,
    metrics: Arc<dyn Recorder>,
    writer: Writer<LeasedJob>,
    /// Whether this process holds an attempt now.
    holding: Arc<dyn Fn() -> bool + Send + Sync>,
    /// The slices of the watch from a claim, shared with that watch.
    slices: Arc<Mutex<Slices>>,
}

type Events =
    futures::stream::BoxStream<'static, Result<watcher::Event<LeasedJob>, watcher::Error>>;

impl Watched {
    async fn run(mut self, mut starts: mpsc::UnboundedReceiver<Option<LeasedJob>>) {
        while let Some(seed) = starts.recv().await {
            *self.slices.lock().unwrap() = Slices::started();
            // Whether the watch goes on from a version (else it lists).
            let (mut events, mut from_version) = self.begin(seed);
            let mut tick = tokio::time::interval(LINGER / 2);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut idle_ticks = 0;
            loop {
                tokio::select! {
                    event = events.next() => match event {
                        Some(Ok(event)) => self.writer.apply_watcher_event(&event),
                        Some(Err(e)) => {
                            leasehold_kube::watch::log_error("LeasedJob", &e);
                            if std::mem::replace(&mut from_version, false) {
                                (events, from_version) = self.begin(None);
                            }
                        }
                        // A watch from a version whose last slice passed with nothing held (one
                        // that failed was replaced at its error).
                        None => break,
                    },
                    // A claim while the watch runs: its change comes through the watch, or
                    // (answered before the watch's start) the job is read until its next one.
                    Some(_) = starts.recv() => self.slices.lock().unwrap().held = true,
                    // A listing watch: an attempt that began and ended between two ticks counts
                    // as held.
                    _ = tick.tick(), if !from_version => {
                        let held = std::mem::take(&mut self.slices.lock().unwrap().held);
                        idle_ticks = if held || (self.holding)() { 0 } else { idle_ticks + 1 };
                        if idle_ticks > 2 {
                            break;
                        }
                    }
                }
            }
            self.writer.apply_watcher_event(&watcher::Event::Init);
            self.writer.apply_watcher_event(&watcher::Event::InitDone);
        }
    }

    /// A watch starting now: from `seed`'s version with the cache holding only `seed` (true),
    /// or listing (`seed` `None`, or one without a version), the cache kept as it is until the
    /// list ends (false).
    fn begin(&mut self, seed: Option<LeasedJob>) -> (Events, bool) {
        match seed.and_then(|job| Some((job.resource_version()?, job))) {
            Some((version, job)) => {
                self.writer.apply_watcher_event(&watcher::Event::Init);
                self.writer
                    .apply_watcher_event(&watcher::Event::InitApply(job));
                self.writer.apply_watcher_event(&watcher::Event::InitDone);
                (self.from(&version), true)
            }
            None => {
                // The attempt that made it list counts as held at the first check.
                self.slices.lock().unwrap().held = true;
                (self.listing(), false)
            }
        }
    }

    fn from(&self, version: &str) -> Events {
        let (slices, holding) = (Arc::clone(&self.slices), Arc::clone(&self.holding));
        leasehold_kube::watch::watch_from(
            &self.api,
            &self.selector,
            version,
            move || slices.lock().unwrap().next(holding()),
            Arc::clone(&self.metrics),
        )
        .modify(LeasedJob::drop_payload_and_result)
        .boxed()
    }

    /// The held jobs' watch that lists first.
    fn listing(&self) -> Events {
        leasehold_kube::watch::watch(
            &self.api,
            watcher::Config::default().fields(&self.selector),
            Arc::clone(&self.metrics),
            |_| {},
        )
        .modify(LeasedJob::drop_payload_and_result)
        .boxed()
    }
}

/// The slices of a watch from a claim: how long the next one lasts, or that none follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Slices {
    /// The last slice's length in seconds; 0 before the first.
    last: u32,
    /// Whether a claim came since the last slice began (from a claim), or since the last check
    /// (listing).
    held: bool,
}

impl Slices {
    /// A watch starting for a claim. The claim itself does not count as held during the first
    /// slice: a sidecar that waits long between short jobs watches for one slice per claim.
    fn started() -> Slices {
        Slices::default()
    }

    /// The next slice, in seconds, given whether an attempt is held now: none when none is and
    /// no claim came since the last slice began; else twice the last, from [`FIRST_SLICE`] up
    /// to [`MAX_SLICE`].
    fn next(&mut self, holding: bool) -> Option<u32> {
        let held = std::mem::replace(&mut self.held, false) || holding;
        if !held {
            return None;
        }
        self.last = (self.last * 2).clamp(FIRST_SLICE, MAX_SLICE);
        Some(self.last)
    }
}

#[cfg(test)]
mod tests {
    use super::{Slices, MAX_SLICE};

    #[test]
    fn slices_double_while_attempts_are_held_and_stop_after_one_without() {
        // The claim that started the watch ended before it began: no slice at all.
        assert_eq!(Slices::started().next(false), None);
        let mut s = Slices::started();
        // The claim that started the watch is held.
        assert_eq!(s.next(true), Some(1));
        assert_eq!(s.next(true), Some(2));
        assert_eq!(s.next(true), Some(4));
        s.held = true; // a claim came and ended during the slice
        assert_eq!(s.next(false), Some(8));
        for _ in 0..10 {
            s.next(true);
        }
        assert_eq!(s.next(true), Some(MAX_SLICE));
        // A slice with nothing held: no more.
        assert_eq!(s.next(false), None);
    }
}
