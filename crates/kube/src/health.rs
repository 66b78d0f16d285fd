//! Liveness and readiness of one process: what `/healthz` and `/readyz` answer (the binary
//! serves them). Health tells the truth: ready only once the watches have synced and before
//! shutdown begins; not live once a background task has died.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use futures::FutureExt;

/// Liveness and readiness of one process.
#[derive(Default)]
pub struct Health {
    synced: AtomicBool,
    shutting_down: AtomicBool,
    dead: Mutex<Vec<String>>,
}

/// Why a process is not ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotReady {
    /// Shutdown began.
    ShuttingDown,
    /// The watches have not listed yet.
    NotSynced,
}

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NotReady::ShuttingDown => "shutting down",
            NotReady::NotSynced => "watches have not synced yet",
        })
    }
}

impl Health {
    /// A fresh, not yet ready, health.
    pub fn new() -> Arc<Health> {
        Arc::default()
    }

    /// Marks the watches synced.
    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::SeqCst);
    }

    /// Marks the start of shutdown: not ready from now on.
    pub fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// True once shutdown began.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Records that background task `name` died.
    pub fn task_died(&self, name: &str) {
        self.dead.lock().unwrap().push(name.to_string());
    }

    /// True once synced and before shutdown: what `/readyz` answers 200 for.
    pub fn is_ready(&self) -> bool {
        self.readiness().is_ok()
    }

    /// Ready, or why not (shutdown first).
    ///
    /// # Errors
    /// [`NotReady`] saying why.
    pub fn readiness(&self) -> Result<(), NotReady> {
        if self.is_shutting_down() {
            Err(NotReady::ShuttingDown)
        } else if !self.synced.load(Ordering::SeqCst) {
            Err(NotReady::NotSynced)
        } else {
            Ok(())
        }
    }

    /// The names of the background tasks that died, in order; empty while the process is live.
    pub fn dead_tasks(&self) -> Vec<String> {
        self.dead.lock().unwrap().clone()
    }

    /// Spawns `task` as `name`; a panic in it is recorded (and makes the process not live)
    /// instead of vanishing silently.
    pub fn spawn<F>(self: &Arc<Self>, name: String, task: F) -> tokio::task::JoinHandle<()>
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let health = Arc::clone(self);
        tokio::spawn(async move {
            if std::panic::AssertUnwindSafe(task)
                .catch_unwind()
                .await
                .is_err()
            {
                tracing::error!(task = %name, "background task panicked");
                health.task_died(&name);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_follows_sync_and_shutdown() {
        let h = Health::new();
        assert_eq!(h.readiness(), Err(NotReady::NotSynced));
        h.set_synced();
        assert_eq!(h.readiness(), Ok(()));
        assert!(h.is_ready());
        h.set_shutting_down();
        assert_eq!(h.readiness(), Err(NotReady::ShuttingDown));
        assert!(h.dead_tasks().is_empty());
        h.task_died("renewer");
        assert_eq!(h.dead_tasks(), vec!["renewer".to_string()]);
    }

    #[tokio::test]
    async fn a_panicking_task_is_recorded_as_dead() {
        let h = Health::new();
        h.spawn("boom".into(), async { panic!("boom") })
            .await
            .unwrap();
        assert_eq!(h.dead_tasks(), vec!["boom".to_string()]);
    }
}
