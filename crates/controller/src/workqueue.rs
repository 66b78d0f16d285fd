//! The queue of jobs to reconcile, with client-go's workqueue rules: a key waits at most once
//! however often it is added; a key being reconciled is never handed out a second time until
//! that reconcile is done (added meanwhile, it waits and is handed out after); a key may be
//! added after a delay. Its memory is given back after a burst (a controller that starts with
//! 100,000 jobs adds every one at once), which kube-runtime's scheduler does not do.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// Keys to work on (see the module doc).
pub(crate) struct WorkQueue<K> {
    state: Mutex<State<K>>,
    /// Wakes a taker when a key is ready, and the timer when an earlier delay is added.
    ready: Notify,
    timer: Notify,
}

struct State<K> {
    /// Ready keys, in the order they became ready.
    queue: VecDeque<K>,
    /// Keys waiting in `queue` or, while being worked on, to be queued again when done.
    dirty: HashSet<K>,
    /// Keys being worked on.
    processing: HashSet<K>,
    /// Delayed keys by when they are due (with a sequence number, so that times may repeat).
    delayed: BTreeMap<(Instant, u64), K>,
    /// When each delayed key is due (its earliest).
    due: HashMap<K, (Instant, u64)>,
    sequence: u64,
    shut: bool,
}

impl<K: Clone + Eq + Hash> WorkQueue<K> {
    /// An empty queue.
    pub(crate) fn new() -> WorkQueue<K> {
        WorkQueue {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                dirty: HashSet::new(),
                processing: HashSet::new(),
                delayed: BTreeMap::new(),
                due: HashMap::new(),
                sequence: 0,
                shut: false,
            }),
            ready: Notify::new(),
            timer: Notify::new(),
        }
    }

    /// Makes `key` ready, unless it already waits.
    pub(crate) fn add(&self, key: K) {
        let mut st = self.state.lock().unwrap();
        if st.shut || !st.dirty.insert(key.clone()) {
            return;
        }
        if !st.processing.contains(&key) {
            st.queue.push_back(key);
            drop(st);
            self.ready.notify_one();
        }
    }

    /// Makes `key` ready after `delay` (at the earliest of the delays it was given).
    pub(crate) fn add_after(&self, key: K, delay: Duration) {
        if delay.is_zero() {
            return self.add(key);
        }
        let at = Instant::now() + delay;
        let mut st = self.state.lock().unwrap();
        if st.shut {
            return;
        }
        if let Some(&(was, seq)) = st.due.get(&key) {
            if was <= at {
                return;
            }
            st.delayed.remove(&(was, seq));
        }
        st.sequence += 1;
        let slot = (at, st.sequence);
        st.delayed.insert(slot, key.clone());
        st.due.insert(key, slot);
        let earliest = st.delayed.keys().next() == Some(&slot);
        drop(st);
        if earliest {
            self.timer.notify_one();
        }
    }

    /// The next ready key, waiting for one; None once the queue is shut down. The caller must
    /// call [`WorkQueue::done`] with it.
    pub(crate) async fn take(&self) -> Option<K> {
        loop {
            let notified = self.ready.notified();
            {
                let mut st = self.state.lock().unwrap();
                if st.shut {
                    return None;
                }
                if let Some(key) = st.queue.pop_front() {
                    st.dirty.remove(&key);
                    st.processing.insert(key.clone());
                    // Another key may be ready for another taker.
                    if !st.queue.is_empty() {
                        self.ready.notify_one();
                    }
                    return Some(key);
                }
                st.give_back_spare();
            }
            notified.await;
        }
    }

    /// The work on `key` is done: if it was added meanwhile, it is ready again.
    pub(crate) fn done(&self, key: &K) {
        let mut st = self.state.lock().unwrap();
        st.processing.remove(key);
        if st.dirty.contains(key) && !st.shut {
            st.queue.push_back(key.clone());
            drop(st);
            self.ready.notify_one();
        }
    }

    /// Moves the delayed keys that are due to the ready ones, for ever (run it as a task).
    pub(crate) async fn run_timer(&self) {
        loop {
            let notified = self.timer.notified();
            let next = {
                let mut st = self.state.lock().unwrap();
                let now = Instant::now();
                let mut due = Vec::new();
                while let Some(entry) = st.delayed.first_entry() {
                    if entry.key().0 > now {
                        break;
                    }
                    let key = entry.remove();
                    st.due.remove(&key);
                    due.push(key);
                }
                let next = st.delayed.keys().next().map(|(at, _)| *at);
                drop(st);
                for key in due {
                    self.add(key);
                }
                next
            };
            match next {
                Some(at) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(at) => {}
                        () = notified => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Stops handing out keys: every [`WorkQueue::take`] answers None from now on.
    pub(crate) fn shut_down(&self) {
        self.state.lock().unwrap().shut = true;
        self.ready.notify_waiters();
    }

    /// Keys ready, being worked on, and delayed.
    #[cfg(test)]
    fn lens(&self) -> (usize, usize, usize) {
        let st = self.state.lock().unwrap();
        (st.queue.len(), st.processing.len(), st.delayed.len())
    }
}

impl<K: Eq + Hash> State<K> {
    /// With nothing ready, gives back the room a burst left behind.
    fn give_back_spare(&mut self) {
        const KEEP: usize = 1024;
        if self.queue.capacity() > KEEP {
            self.queue.shrink_to(KEEP);
        }
        if self.dirty.capacity() > 2 * self.dirty.len() + KEEP {
            self.dirty.shrink_to_fit();
        }
        if self.processing.capacity() > 2 * self.processing.len() + KEEP {
            self.processing.shrink_to_fit();
        }
        if self.due.capacity() > 2 * self.due.len() + KEEP {
            self.due.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn a_key_waits_once_and_is_never_handed_out_twice_at_once() {
        let q = WorkQueue::new();
        q.add("a");
        q.add("a");
        q.add("b");
        assert_eq!(q.lens(), (2, 0, 0), "added twice, waits once");
        let a = q.take().await.unwrap();
        assert_eq!(a, "a");
        q.add("a");
        assert_eq!(
            q.take().await,
            Some("b"),
            "a is being worked on: not handed out again"
        );
        assert_eq!(q.lens(), (0, 2, 0));
        q.done(&"a");
        assert_eq!(
            q.take().await,
            Some("a"),
            "added while worked on: ready once done"
        );
        q.done(&"a");
        q.done(&"b");
        assert_eq!(q.lens(), (0, 0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_delayed_key_is_ready_at_its_earliest_delay() {
        let q = Arc::new(WorkQueue::new());
        let timer = tokio::spawn({
            let q = Arc::clone(&q);
            async move { q.run_timer().await }
        });
        let start = Instant::now();
        q.add_after("a", Duration::from_secs(10));
        q.add_after("a", Duration::from_secs(3));
        q.add_after("a", Duration::from_secs(20));
        assert_eq!(q.lens(), (0, 0, 1), "one delay per key");
        assert_eq!(q.take().await, Some("a"));
        assert_eq!(start.elapsed().as_secs(), 3);
        q.done(&"a");
        timer.abort();
    }

    #[tokio::test]
    async fn after_shut_down_nothing_is_handed_out() {
        let q = Arc::new(WorkQueue::new());
        let waiting = tokio::spawn({
            let q = Arc::clone(&q);
            async move { q.take().await }
        });
        tokio::task::yield_now().await;
        q.shut_down();
        assert_eq!(waiting.await.unwrap(), None::<&str>);
        q.add("a");
        assert_eq!(q.take().await, None);
    }

    #[tokio::test]
    async fn a_burst_gives_its_room_back() {
        let q = WorkQueue::new();
        for i in 0..100_000u32 {
            q.add(i);
        }
        while let Some(k) = tokio::time::timeout(Duration::from_millis(10), q.take())
            .await
            .ok()
            .flatten()
        {
            q.done(&k);
        }
        let st = q.state.lock().unwrap();
        assert!(
            st.queue.capacity() <= 1024 && st.dirty.capacity() < 4096,
            "{} {}",
            st.queue.capacity(),
            st.dirty.capacity()
        );
    }
}
