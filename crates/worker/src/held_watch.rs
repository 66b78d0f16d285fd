//! The watch of the jobs this process holds, run only while an attempt is renewed.
//!
//! Heartbeats and ends of attempts check what this watch caches (the held-jobs cache: a job
//! expired, cancelled or claimed by another holder since). A watch costs the API server on
//! every change of the namespace's LeasedJobs, matched or not: its watch cache matches each
//! event against every open watch of the resource, since no index serves a field selector of a
//! custom resource. With 500 sidecars waiting for work, their 500 watches of nothing made each
//! claimed job cost the API server 1.42 times the CPU it cost with 8 sidecars
//! (docs/benchmarks.md, row 11b). So a sidecar watches only while it renews an attempt, until a
//! slice of the watch passes with nothing held and no new claim.
//!
//! A claim does not start the watch: its answer is kept as a seed. The first renewal of an
//! attempt (a heartbeat's, or the sidecar's own in the background) that finds no watch running
//! starts one (`HeldWatch::renewing`). A job that ends before its first renewal costs no
//! watch at all, and so no connection: a WATCH holds an HTTP/1.1 connection of its own, and a
//! sidecar that claimed after waiting long (its last connection closed by the API server's idle
//! timeout) would open a new TLS connection for it. That renewal reads the job afresh, since
//! the cache was empty when it looked (`read_if_uncached` in heartbeat.rs), and what it read
//! replaces the claim's answer as that job's seed when this process still holds it there: the
//! watch then need not replay from the claim, which the API server may no longer keep when the
//! first renewal comes late (a third of a long lease).
//!
//! A watch starts from the seeds: every held attempt's seed goes into the cache, and the watch
//! goes on from the oldest of their resourceVersions
//! ([`leasehold_kube::watch::watch_from`]), with no LIST (a LIST with this selector makes the
//! API server walk every job of the namespace). Changes of a job no newer than its own seed are
//! passed over, so the cache never goes back while the watch replays from the oldest. It runs
//! in slices that the API server ends (`Slices`): the first of [`FIRST_SLICE`], each next one
//! twice as long up to [`MAX_SLICE`] while attempts are held or claims come, none after a
//! slice without either. A watch the server ends leaves its connection to the client's next
//! request, where one the client dropped would cost a new TLS connection.
//!
//! A claim made while the watch runs adds nothing to the cache. Its change comes through the
//! watch when it is newer than the watch's start; when it is older (two claims whose answers
//! came back out of order), the job stays out of the cache until its next change. A held job
//! the cache does not show is read afresh after a heartbeat's renewal and before each
//! background renewal (`read_if_uncached` in heartbeat.rs): that costs a read, never a missed
//! change.
//!
//! Started for an attempt this process did not claim (the first heartbeat after a restart), or
//! after the watch failed (a 410 Gone, a lost connection), or from seeds whose versions are not
//! numbers, the watch lists as every other watch does ([`leasehold_kube::watch::watch`]); the
//! cache keeps what it had until that list ends. A watch that lists never ends by itself: it
//! is dropped once nothing has been held for 1 to 2 s (three checks half a [`LINGER`] apart).
//!
//! While no watch runs the cache is empty: a renewal reads the job, and a heartbeat of a token
//! this process does not hold reads the job ([`crate::Worker`]'s `check_unheld`).

use std::collections::HashMap;
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

/// The first slice of a watch from the seeds, in seconds.
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
    /// An attempt was claimed here; the claim's answer (payload and result dropped).
    Claimed(Box<LeasedJob>),
    /// An attempt this process did not claim is held (found at a heartbeat after a restart).
    Found,
    /// A held attempt is being renewed and the cache does not show it; the job as just read,
    /// when it was read and this process holds it (payload and result dropped).
    Renewing(Option<Box<LeasedJob>>),
}

impl HeldWatch {
    /// The cache, and the task that runs its watch from an attempt's first renewal (or an
    /// attempt found) until a slice (from the seeds) or three checks half a [`LINGER`] apart
    /// (listing) pass with `holding()` (whether this process holds an attempt now) false and
    /// no claim. `holds(name)` tells whether the attempt on job `name` is held still: a seed
    /// of one that ended is dropped. The task runs until aborted.
    pub(crate) fn start(
        api: Api<LeasedJob>,
        queue: &str,
        identity: &str,
        metrics: Arc<dyn Recorder>,
        holding: impl Fn() -> bool + Send + Sync + 'static,
        holds: impl Fn(&str) -> bool + Send + Sync + 'static,
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
            writer,
            holding: Arc::new(holding),
            holds: Box::new(holds),
            slices: Arc::default(),
            floors: HashMap::new(),
        };
        let task = watched.run(rx);
        (HeldWatch { store, said }, task)
    }

    /// Tells the watch an attempt was claimed here with the answer `claimed` (payload and
    /// result dropped): a seed for the next watch, or, while one runs, a claim that keeps it
    /// running.
    pub(crate) fn claimed(&self, claimed: &LeasedJob) {
        self.say(Said::Claimed(Box::new(claimed.clone())));
    }

    /// Tells the watch this process holds an attempt it did not claim: a watch that lists
    /// starts if none runs.
    pub(crate) fn found(&self) {
        self.say(Said::Found);
    }

    /// Tells the watch a held attempt is being renewed and the cache does not show it: a
    /// watch starts if none runs. `read`: the job as the renewal just read it, if this process
    /// holds it there; a fresher seed than the claim's answer, so that the watch need not
    /// replay from the claim (which the API server may no longer keep after a long lease).
    pub(crate) fn renewing(&self, read: Option<&LeasedJob>) {
        let read = read.map(|job| {
            let mut job = job.clone();
            LeasedJob::drop_payload_and_result(&mut job);
            Box::new(job)
        });
        self.say(Said::Renewing(read));
    }

    fn say(&self, said: Said) {
        // The receiver lives as long as the worker's watch task; after that nothing watches.
        let _ = self.said.send(said);
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
    /// Whether the attempt on a job (by name) is held still.
    holds: Box<dyn Fn(&str) -> bool + Send + Sync>,
    /// The slices of the watch from the seeds, shared with that watch.
    slices: Arc<Mutex<Slices>>,
    /// Per seeded job, its seed's resourceVersion: the watch replays from the oldest seed, and
    /// a change of a job no newer than its own seed is passed over. A job's entry goes once a
    /// newer change of it came.
    floors: HashMap<String, u64>,
}

type Events =
    futures::stream::BoxStream<'static, Result<watcher::Event<LeasedJob>, watcher::Error>>;

impl Watched {
    async fn run(mut self, mut said: mpsc::UnboundedReceiver<Said>) {
        // The answers of the claims made while no watch runs: the next watch's seeds.
        let mut seeds: HashMap<String, LeasedJob> = HashMap::new();
        while let Some(what) = said.recv().await {
            *self.slices.lock().unwrap() = Slices::started();
            seeds.retain(|name, _| (self.holds)(name));
            // Whether the watch goes on from a version (else it lists).
            let (mut events, mut from_version) = match what {
                Said::Claimed(answer) => {
                    seeds.insert(answer.name_any(), *answer);
                    continue;
                }
                Said::Renewing(read) => {
                    if let Some(job) = read {
                        seeds.insert(job.name_any(), *job);
                    }
                    if seeds.is_empty() && !(self.holding)() {
                        continue;
                    }
                    self.begin(seeds.drain().map(|(_, job)| job).collect())
                }
                Said::Found => {
                    seeds.clear();
                    self.begin(Vec::new())
                }
            };
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
                                (events, from_version) = self.begin(Vec::new());
                            }
                        }
                        // A watch from a version whose last slice passed with nothing held (one
                        // that failed was replaced at its error).
                        None => break,
                    },
                    // A claim while the watch runs: its change comes through the watch, or
                    // (answered before the watch's start) the job is read until its next one.
                    // Renewals and attempts found change nothing while it runs.
                    Some(what) = said.recv() => if let Said::Claimed(_) = what {
                        self.slices.lock().unwrap().held = true;
                    },
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
            self.floors.clear();
            self.writer.apply_watcher_event(&watcher::Event::Init);
            self.writer.apply_watcher_event(&watcher::Event::InitDone);
        }
    }

    /// A watch starting now: from the oldest of the `seeds`' versions with the cache holding
    /// only the seeds (true), or listing (no seeds, or one without a numeric version), the
    /// cache kept as it is until the list ends (false).
    fn begin(&mut self, seeds: Vec<LeasedJob>) -> (Events, bool) {
        self.floors.clear();
        let versions: Option<Vec<u64>> = seeds
            .iter()
            .map(|job| job.resource_version()?.parse().ok())
            .collect();
        match versions.as_deref().and_then(|v| v.iter().min()) {
            Some(&oldest) => {
                self.writer.apply_watcher_event(&watcher::Event::Init);
                for (job, version) in seeds.into_iter().zip(versions.unwrap_or_default()) {
                    self.floors.insert(job.name_any(), version);
                    self.writer
                        .apply_watcher_event(&watcher::Event::InitApply(job));
                }
                self.writer.apply_watcher_event(&watcher::Event::InitDone);
                (self.from(&oldest.to_string()), true)
            }
            None => {
                // The attempt that made it list counts as held at the first check.
                self.slices.lock().unwrap().held = true;
                (self.listing(), false)
            }
        }
    }

    /// Applies a watch event to the cache, but a change of a seeded job no newer than its
    /// seed (the watch replays from the oldest seed).
    fn apply(&mut self, event: &watcher::Event<LeasedJob>) {
        let job = match event {
            watcher::Event::Apply(job) | watcher::Event::Delete(job) => Some(job),
            _ => None,
        };
        if let Some(job) = job.filter(|_| !self.floors.is_empty()) {
            let name = job.name_any();
            if let Some(&floor) = self.floors.get(&name) {
                let version = job.resource_version().and_then(|v| v.parse::<u64>().ok());
                if version.is_some_and(|v| v <= floor) {
                    return;
                }
                self.floors.remove(&name);
            }
        }
        self.writer.apply_watcher_event(event);
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

/// The slices of a watch from the seeds: how long the next one lasts, or that none follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Slices {
    /// The last slice's length in seconds; 0 before the first.
    last: u32,
    /// Whether a claim came since the last slice began (from the seeds), or since the last
    /// check (listing).
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
