//! A sidecar's view of its queue's `LeasedQueue` ([`leasehold_core::queue`]): whether claims
//! are paused. One watch of one object (a field selector on its name), so it costs the API
//! server nothing per job.
//!
//! The view is `None` until the watch has listed once; then `Some(paused)`. A queue with no
//! LeasedQueue is not paused. When the LeasedQueue API cannot be read at all (its CRD is not
//! installed: 404; the sidecar's Role does not grant it: 403), the view is `Some(false)` and
//! the reason is logged once as a warning: a pause is then not honoured by this sidecar, which
//! docs/protocol.md ("Flow control") states. The watch retries under
//! [`crate::api::WatchBackoff`] meanwhile and takes the pause into account once it can.

use std::sync::Arc;

use futures::StreamExt;
use kube::runtime::watcher;
use kube::Api;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::recorder::Recorder;
use leasehold_core::queue::LeasedQueue;

/// Follows the LeasedQueue named `queue` through `api` (the queue's namespace) into the
/// returned receiver: `None` until first known, then whether it pauses claims. The future runs
/// until dropped.
pub fn follow(
    api: Api<LeasedQueue>,
    queue: &str,
    metrics: Arc<dyn Recorder>,
) -> (
    watch::Receiver<Option<bool>>,
    impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (tx, rx) = watch::channel(None);
    let config = watcher::Config::default().fields(&format!("metadata.name={queue}"));
    let queue = queue.to_string();
    let task = async move {
        let events = crate::watch::watch(&api, config, metrics, |_| {});
        let mut events = std::pin::pin!(events);
        // Whether the (re-)list under way has brought the object.
        let mut listed = false;
        let mut warned = false;
        while let Some(event) = events.next().await {
            let paused = match event {
                Ok(watcher::Event::Init) => {
                    listed = false;
                    continue;
                }
                Ok(watcher::Event::InitApply(q)) => {
                    listed = true;
                    q.is_paused()
                }
                Ok(watcher::Event::InitDone) if !listed => false,
                Ok(watcher::Event::InitDone) => continue,
                Ok(watcher::Event::Apply(q)) => q.is_paused(),
                Ok(watcher::Event::Delete(_)) => false,
                Err(e) => {
                    if let Some(code) = unreadable(&e) {
                        if !warned {
                            warned = true;
                            warn!(
                                queue = %queue,
                                code,
                                "The LeasedQueue API cannot be read (404: its CRD is not installed; 403: this sidecar's Role does not grant get, list and watch on leasedqueues): a pause of this queue is not honoured here until it can be; retrying"
                            );
                        }
                        if tx.borrow().is_none() {
                            tx.send_replace(Some(false));
                        }
                    } else {
                        crate::watch::log_error("LeasedQueue", &e);
                    }
                    continue;
                }
            };
            let changed = tx.send_if_modified(|was| {
                let changed = *was != Some(paused);
                *was = Some(paused);
                changed
            });
            if changed {
                info!(queue = %queue, paused, "Queue {}", if paused { "paused: no new claims" } else { "running" });
            }
        }
    };
    (rx, task)
}

/// The HTTP status when `err` says the LeasedQueue API cannot be read at all (404 or 403).
pub fn unreadable(err: &watcher::Error) -> Option<u16> {
    let kube::Error::Api(status) = (match err {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => e,
        _ => return None,
    }) else {
        return None;
    };
    matches!(status.code, 403 | 404).then_some(status.code)
}
