//! The watch of the jobs this process holds, run only while attempts are renewed.
//!
//! Heartbeats and ends of attempts check what this watch caches (the held-jobs cache: a job
//! expired, cancelled or claimed by another holder since). A watch costs the API server on
//! every change of the namespace's LeasedJobs, matched or not: its watch cache matches each
//! event against every open watch of the resource, since no index serves a field selector of a
//! custom resource. With 500 sidecars waiting for work, their 500 watches of nothing made each
//! claimed job cost the API server 1.42 times the CPU it cost with 8 sidecars
//! (docs/benchmarks.md, row 11b). So a sidecar watches only from an attempt's first renewal
//! until a slice of the watch passes with nothing held and no new claim.
//!
//! A claim does not start the watch. A held job the cache does not show is read afresh after
//! a heartbeat's renewal and before each background renewal (`read_if_uncached` in
//! heartbeat.rs), as a LIST by name, which the API server answers from the one key with the
//! revision it read at. That read, when it shows this process as the holder, goes to the watch
//! (`HeldWatch::renewing`): it starts the watch when none runs, from that revision
//! ([`leasehold_kube::watch::watch_from`]), so the watch replays nothing, with no LIST of the
//! queue (a LIST with this selector makes the API server walk every job of the namespace). A
//! job that ends before its first renewal costs no watch, and so no connection: a WATCH holds
//! an HTTP/1.1 connection of its own, and a sidecar that waited long for its claim (its other
//! connections busy with its long watches) would open a new TLS connection for it.
//!
//! While the watch runs, a read goes into the cache when the cache does not show its job, it
//! was read no earlier than the watch's start, and the watch has sent no change of its job:
//! every change after the read is then still to come, and one no newer than the read is passed
//! over (per job, the read's revision is its floor), so the cache never goes back. A job the
//! watch has sent a change of is not cached from a read (the read may be older than that
//! change); it is read at each renewal until its next change. The watch runs in slices that
//! the API server ends (`Slices`): the first of [`FIRST_SLICE`], each next one twice as long up
//! to [`MAX_SLICE`] while attempts are held or claims come, none after a slice without either.
//! A watch the server ends leaves its connection to the client's next request, where one the
//! client dropped would cost a new TLS connection.
//!
//! After the watch failed (a 410 Gone, a lost connection), the watch lists as every other
//! watch does ([`leasehold_kube::watch::watch`]); the cache keeps what it had until that list
//! ends. A watch that lists never ends by itself: it is dropped once nothing has been held for
//! 1 to 2 s (three checks half a [`LINGER`] apart).
//!
//! While no watch runs the cache is empty: a renewal reads the job, and a heartbeat of a token
//! this process does not hold reads the job ([`crate::Worker`]'s `check_unheld`).

use std::collections::{HashMap, HashSet};
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

/// The first slice of a watch from a read, in seconds.
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
    said: mpsc::UnboundedSender<Said>,
}

/// What the worker tells the watch task.
enum Said {
    /// An attempt is held (claimed here, or found at a heartbeat after a restart).
    Held,
    /// A held job the cache did not show, as just read, showing this process as its holder
    /// (payload and result dropped), and the revision it was read at.
    Read(Box<LeasedJob>, u64),
}

impl HeldWatch {
    /// The cache, and the task that runs its watch from a renewal's read until a slice (from a
    /// read) or three checks half a [`LINGER`] apart (listing) pass with no attempt held and no
    /// claim. `holds(Some(name))` tells whether the attempt on job `name` is held still,
    /// `holds(None)` whether any attempt is. The task runs until aborted.
    pub(crate) fn start(
        api: Api<LeasedJob>,
        queue: &str,
        identity: &str,
        metrics: Arc<dyn Recorder>,
        holds: impl Fn(Option<&str>) -> bool + Send + Sync + 'static,
    ) -> (
        HeldWatch,
        impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let (store, writer) = reflector::store();
        let (said, rx) = mpsc::unbounded_channel();
        let watched = Watched {
            api,
            selector: queue_watch::held_selector(queue, identity),
            metrics,
            store: store.clone(),
            writer,
            holds: Arc::new(holds),
            slices: Arc::default(),
            floors: HashMap::new(),
            changed: HashSet::new(),
            started_at: 0,
            trimmed_at: 0,
            seen: 0,
        };
        let task = watched.run(rx);
        (HeldWatch { store, said }, task)
    }

    /// Tells the watch an attempt is held (claimed here, or found): while one runs, it keeps
    /// running. Starts none.
    pub(crate) fn held(&self) {
        self.say(Said::Held);
    }

    /// Tells the watch a held job the cache does not show was just read, as `read`, at the
    /// API server's `revision` (the resourceVersion of the list that answered the read), and
    /// that it shows this process as its holder: a watch starts from that revision if none
    /// runs, and one that runs caches the read if it started no later and has sent no change of
    /// that job.
    pub(crate) fn renewing(&self, read: &LeasedJob, revision: u64) {
        let mut read = read.clone();
        LeasedJob::drop_payload_and_result(&mut read);
        self.say(Said::Read(Box::new(read), revision));
    }

    fn say(&self, said: Said) {
        // The receiver lives as long as the worker's watch task; after that nothing watches.
        let _ = self.said.send(said);
    }
}

/// At most this many names of jobs the running watch sent a change of are kept beyond the
/// held ones: past it, those of jobs no longer held are forgotten.
const CHANGED_KEPT: usize = 4096;

/// Whether the attempt on a job (by name) is held still; with no name, whether any is.
type Holds = dyn Fn(Option<&str>) -> bool + Send + Sync;

/// What the watch task owns.
struct Watched {
    api: Api<LeasedJob>,
    selector: String,
    metrics: Arc<dyn Recorder>,
    store: Store<LeasedJob>,
    writer: Writer<LeasedJob>,
    /// Whether the attempt on a job (by name) is held still; with no name, whether any is.
    holds: Arc<Holds>,
    /// The slices of the watch from a read, shared with that watch.
    slices: Arc<Mutex<Slices>>,
    /// Per job cached from a read, the revision it was read at: a change of the job no newer
    /// is passed over. A job's entry goes once a newer change of it came.
    floors: HashMap<String, u64>,
    /// The jobs the running watch sent a change of: a read of one of them is not cached.
    changed: HashSet<String>,
    /// The revision the running watch started from: an older read is not cached (changes
    /// between the two would never come).
    started_at: u64,
    /// The newest version the running watch had sent when `changed` was last trimmed: an
    /// older read is not cached (a change of its job may have been forgotten).
    trimmed_at: u64,
    /// The newest version the running watch sent.
    seen: u64,
}

type Events =
    futures::stream::BoxStream<'static, Result<watcher::Event<LeasedJob>, watcher::Error>>;

impl Watched {
    async fn run(mut self, mut said: mpsc::UnboundedReceiver<Said>) {
        while let Some(what) = said.recv().await {
            // An attempt held while none runs starts nothing: its first renewal reads it.
            let Said::Read(read, revision) = what else {
                continue;
            };
            *self.slices.lock().unwrap() = Slices::started();
            // Whether the watch goes on from a version (else it lists).
            let (mut events, mut from_version) = self.begin(*read, revision);
            let mut tick = tokio::time::interval(LINGER / 2);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut idle_ticks = 0;
            loop {
                tokio::select! {
                    event = events.next() => match event {
                        Some(Ok(event)) => self.apply(&event),
                        Some(Err(e)) => {
                            leasehold_kube::watch::log_error("LeasedJob", &e);
                            if std::mem::replace(&mut from_version, false) {
                                (events, from_version) = (self.listing(), false);
                            }
                        }
                        // A watch from a version whose last slice passed with nothing held (one
                        // that failed was replaced at its error).
                        None => break,
                    },
                    Some(what) = said.recv() => match what {
                        // A claim while the watch runs: its change comes through the watch
                        // when newer than the watch's start, else its first renewal reads it.
                        Said::Held => self.slices.lock().unwrap().held = true,
                        // A listing watch brings every held job itself.
                        Said::Read(read, revision) if from_version => {
                            self.cache_read(*read, revision);
                        }
                        Said::Read(..) => {}
                    },
                    // A listing watch: an attempt that began and ended between two ticks counts
                    // as held.
                    _ = tick.tick(), if !from_version => {
                        let held = std::mem::take(&mut self.slices.lock().unwrap().held);
                        idle_ticks = if held || (self.holds)(None) { 0 } else { idle_ticks + 1 };
                        if idle_ticks > 2 {
                            break;
                        }
                    }
                }
            }
            self.floors.clear();
            self.changed.clear();
            self.writer.apply_watcher_event(&watcher::Event::Init);
            self.writer.apply_watcher_event(&watcher::Event::InitDone);
        }
    }

    /// A watch starting now for a renewal's `read` at `revision`: from that revision, with
    /// the cache holding only the read (true). The read's attempt counts as held at the first
    /// slice (it may not be registered as held yet: the first heartbeat after a restart).
    fn begin(&mut self, read: LeasedJob, revision: u64) -> (Events, bool) {
        self.floors.clear();
        self.changed.clear();
        (self.started_at, self.trimmed_at, self.seen) = (revision, 0, revision);
        self.floors.insert(read.name_any(), revision);
        self.writer.apply_watcher_event(&watcher::Event::Init);
        self.writer
            .apply_watcher_event(&watcher::Event::InitApply(read));
        self.writer.apply_watcher_event(&watcher::Event::InitDone);
        self.slices.lock().unwrap().held = true;
        (self.from(&revision.to_string()), true)
    }

    /// Caches a renewal's `read` at `revision` while the watch runs from a version, when the
    /// cache does not show the job, the read is no older than the watch's start nor than the
    /// last trim of `changed`, and the watch sent no change of that job: every change after
    /// the read is then still to come, and its floor passes over those no newer.
    fn cache_read(&mut self, read: LeasedJob, revision: u64) {
        let name = read.name_any();
        let shown = self
            .store
            .get(&reflector::ObjectRef::new(&name).within(&read.namespace().unwrap_or_default()))
            .is_some();
        if shown
            || revision < self.started_at
            || revision < self.trimmed_at
            || self.changed.contains(&name)
        {
            return;
        }
        self.floors.insert(name, revision);
        self.writer
            .apply_watcher_event(&watcher::Event::Apply(read));
        self.slices.lock().unwrap().held = true;
    }

    /// Applies a watch event to the cache, but a change of a job cached from a read no newer
    /// than that read; notes the job as changed.
    fn apply(&mut self, event: &watcher::Event<LeasedJob>) {
        if let watcher::Event::Apply(job) | watcher::Event::Delete(job) = event {
            let name = job.name_any();
            let version = numeric_version(job);
            self.seen = self.seen.max(version.unwrap_or_default());
            if let Some(&floor) = self.floors.get(&name) {
                if version.is_some_and(|v| v <= floor) {
                    return;
                }
                self.floors.remove(&name);
            }
            if self.changed.len() >= CHANGED_KEPT {
                let holds = &self.holds;
                self.changed.retain(|n| holds(Some(n)));
                self.trimmed_at = self.seen;
            }
            self.changed.insert(name);
        }
        self.writer.apply_watcher_event(event);
    }

    fn from(&self, version: &str) -> Events {
        let (slices, holds) = (Arc::clone(&self.slices), Arc::clone(&self.holds));
        leasehold_kube::watch::watch_from(
            &self.api,
            &self.selector,
            version,
            move || slices.lock().unwrap().next(holds(None)),
            Arc::clone(&self.metrics),
        )
        .modify(LeasedJob::drop_payload_and_result)
        .boxed()
    }

    /// The held jobs' watch that lists first. The attempt that made it list counts as held at
    /// the first check.
    fn listing(&mut self) -> Events {
        self.floors.clear();
        self.changed.clear();
        self.slices.lock().unwrap().held = true;
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

/// A job's resourceVersion as a number (the API server's are; their order is only defined
/// for those), if it is one.
fn numeric_version(job: &LeasedJob) -> Option<u64> {
    job.resource_version()?.parse().ok()
}

/// The slices of a watch from a read: how long the next one lasts, or that none follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Slices {
    /// The last slice's length in seconds; 0 before the first.
    last: u32,
    /// Whether a claim came since the last slice began (from a read), or since the last check
    /// (listing).
    held: bool,
}

impl Slices {
    /// A watch starting. The attempts it starts for count as held through `holding` only: one
    /// that ended before the first slice began leaves no slice at all.
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
        // The attempt that started the watch ended before it began: no slice at all.
        assert_eq!(Slices::started().next(false), None);
        let mut s = Slices::started();
        // The attempt that started the watch is held.
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
