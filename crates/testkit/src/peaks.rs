//! The most Leased jobs at once, per concurrency key and in all, as the API server's own watch
//! of a namespace's jobs shows them: what the tests of a queue's limits assert on.
//!
//! Counted at every live event (each one state of the API server, in resourceVersion order).
//! A re-list (after a restart or a 410) is counted once, whole, at its end: the objects it
//! brings one by one mix states of different moments.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use leasehold_core::crd::{LeasedJob, Phase};

/// What [`follow`] saw.
#[derive(Clone, Debug, Default)]
pub struct Peaks {
    /// Key (the empty key for none) -> the most Leased at once.
    pub per_key: BTreeMap<String, usize>,
    /// The most Leased at once, all keys.
    pub all: usize,
    /// Jobs Succeeded now.
    pub done: usize,
    /// Every moment a key had more than `limit` Leased: (key, count, the job whose event
    /// showed it).
    pub over: Vec<(String, usize, String)>,
}

/// Follows every job of `api` (a namespace) into the returned [`Peaks`], flagging a key over
/// `per_key_limit` (None: flag nothing). The task runs until aborted.
pub fn follow(
    api: Api<LeasedJob>,
    per_key_limit: Option<usize>,
) -> (Arc<Mutex<Peaks>>, tokio::task::JoinHandle<()>) {
    let peaks = Arc::new(Mutex::new(Peaks::default()));
    let task = {
        let peaks = Arc::clone(&peaks);
        tokio::spawn(async move {
            let mut now: HashMap<String, (String, Phase)> = HashMap::new();
            let mut relist: Option<HashMap<String, (String, Phase)>> = None;
            // Backed off, so that a down API server is not asked in a tight loop.
            let mut events =
                std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
            while let Some(event) = events.next().await {
                let Ok(event) = event else { continue };
                let entry = |job: &LeasedJob| {
                    let key = job.spec.concurrency_key.clone().unwrap_or_default();
                    (job.name_any(), (key, job.phase()))
                };
                let changed = match event {
                    watcher::Event::Init => {
                        relist = Some(HashMap::new());
                        continue;
                    }
                    watcher::Event::InitApply(job) => {
                        if let Some(r) = relist.as_mut() {
                            let (name, state) = entry(&job);
                            r.insert(name, state);
                        }
                        continue;
                    }
                    watcher::Event::InitDone => {
                        now = relist.take().unwrap_or_default();
                        String::from("(re-list)")
                    }
                    watcher::Event::Apply(job) => {
                        let (name, state) = entry(&job);
                        now.insert(name.clone(), state);
                        name
                    }
                    watcher::Event::Delete(job) => {
                        now.remove(&job.name_any());
                        job.name_any()
                    }
                };
                let mut leased: BTreeMap<&str, usize> = BTreeMap::new();
                for (key, phase) in now.values() {
                    if *phase == Phase::Leased {
                        *leased.entry(key).or_default() += 1;
                    }
                }
                let mut p = peaks.lock().unwrap();
                for (key, n) in &leased {
                    let peak = p.per_key.entry(key.to_string()).or_default();
                    *peak = (*peak).max(*n);
                    if per_key_limit.is_some_and(|l| *n > l) && !key.is_empty() {
                        p.over.push((key.to_string(), *n, changed.clone()));
                    }
                }
                p.all = p.all.max(leased.values().sum());
                p.done = now
                    .values()
                    .filter(|(_, ph)| *ph == Phase::Succeeded)
                    .count();
            }
        })
    };
    (peaks, task)
}
