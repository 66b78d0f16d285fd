//! A sidecar's view of its queue's `LeasedQueue` ([`leasehold_core::queue`]): whether claims
//! are paused, and the limits its claims take slots for. One watch of one object (a field
//! selector on its name), so it costs the API server nothing per job.
//!
//! The view is [`Known::Unknown`] until the watch has listed once; then the object, or
//! [`Known::Absent`]: a queue with no LeasedQueue is not paused and has no limits. When the
//! LeasedQueue API cannot be read, the reason is logged once as a warning, and the view says
//! what can be concluded (docs/protocol.md, "Flow control"):
//! - 404, its CRD is not installed: no LeasedQueue can exist, so the view is `Absent`, exactly.
//! - 403, the sidecar's Role does not grant it: a LeasedQueue may exist and limit or pause the
//!   queue, so the view is `Unknown` (fail closed: the sidecar claims nothing and is not
//!   ready), also when it had read one before. A limit is exact only if every claimer honours
//!   it.
//!
//! The watch starts over with a fresh list ([`crate::api::WATCH_BACKOFF_MAX`] later) after such
//! an answer, so that the LeasedQueue is taken into account once it can be read, also when the
//! answer came at a watch's restart (a watcher refused there would otherwise resume from its
//! old resourceVersion and bring nothing until the object changed).

use std::sync::Arc;

use futures::StreamExt;
use kube::runtime::watcher;
use kube::Api;
use tokio::sync::watch;
use tracing::{info, warn};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::value::RawValue;

use crate::recorder::Recorder;
use crate::watch::FromParts;
use leasehold_core::queue::LeasedQueue;

/// A sidecar's view of its queue's LeasedQueue.
#[derive(Clone, Debug, Default)]
pub enum Known {
    /// Not read yet.
    #[default]
    Unknown,
    /// There is none (or it cannot be read: see the module doc).
    Absent,
    /// The object as last seen.
    Present(Arc<LeasedQueue>),
}

impl Known {
    /// Whether claims are paused; `None` while not known.
    pub fn paused(&self) -> Option<bool> {
        match self {
            Known::Unknown => None,
            Known::Absent => Some(false),
            Known::Present(q) => Some(q.is_paused()),
        }
    }

    /// Whether claims must wait: the queue is paused, or it sets limits that the controller
    /// has not confirmed yet (the jobs Leased before them may hold no slot:
    /// [`leasehold_core::adoption::adopted`]); `None` while not known.
    pub fn held(&self) -> Option<bool> {
        match self {
            Known::Present(q) => Some(q.is_paused() || !leasehold_core::adoption::adopted(q)),
            other => other.paused(),
        }
    }

    /// The object, when there is one.
    pub fn queue(&self) -> Option<&Arc<LeasedQueue>> {
        match self {
            Known::Present(q) => Some(q),
            _ => None,
        }
    }

    fn version(&self) -> Option<Option<&str>> {
        match self {
            Known::Unknown => None,
            Known::Absent => Some(None),
            Known::Present(q) => Some(q.metadata.resource_version.as_deref()),
        }
    }
}

/// Follows the LeasedQueue named `queue` through `api` (the queue's namespace) into `tx`
/// (made with [`Known::Unknown`]; its receivers are the view). The future runs until dropped.
pub fn follow(
    api: Api<LeasedQueue>,
    queue: &str,
    metrics: Arc<dyn Recorder>,
    tx: watch::Sender<Known>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let config = watcher::Config::default().fields(&format!("metadata.name={queue}"));
    let queue = queue.to_string();
    let task = async move {
        // The code of the last unreadable answer warned about; forgotten once a list succeeds.
        let mut warned = None;
        loop {
            let events = crate::watch::watch(&api, config.clone(), Arc::clone(&metrics), |_| {});
            let mut events = std::pin::pin!(events);
            // Whether the (re-)list under way has brought the object.
            let mut listed = false;
            while let Some(event) = events.next().await {
                let now = match event {
                    Ok(watcher::Event::Init) => {
                        listed = false;
                        continue;
                    }
                    Ok(watcher::Event::InitApply(q)) => {
                        listed = true;
                        Known::Present(Arc::new(q))
                    }
                    Ok(watcher::Event::InitDone) if !listed => {
                        warned = None;
                        Known::Absent
                    }
                    Ok(watcher::Event::InitDone) => {
                        warned = None;
                        continue;
                    }
                    Ok(watcher::Event::Apply(q)) => Known::Present(Arc::new(q)),
                    Ok(watcher::Event::Delete(_)) => Known::Absent,
                    Err(e) => {
                        let Some(code) = unreadable(&e) else {
                            crate::watch::log_error("LeasedQueue", &e);
                            continue;
                        };
                        if warned != Some(code) {
                            warned = Some(code);
                            warn_unreadable(&queue, code);
                        }
                        let now = after_unreadable(&tx.borrow(), code);
                        if let Some(now) = now {
                            tx.send_replace(now);
                        }
                        // Start over with a fresh list: a watch refused at its restart would
                        // otherwise resume from its old resourceVersion once allowed again, and
                        // bring nothing until the object changed, leaving the view Unknown.
                        break;
                    }
                };
                let (was, held) = (tx.borrow().held(), now.held());
                let why = match now.queue() {
                    _ if held != Some(true) => "running",
                    Some(q) if q.is_paused() => "paused: no new claims",
                    _ => "limited: no new claims until the controller has given the jobs Leased before the limits their slots",
                };
                tx.send_if_modified(|known| {
                    let changed = known.version() != now.version();
                    *known = now;
                    changed
                });
                if was != held {
                    info!(queue = %queue, held = held == Some(true), "Queue {why}");
                }
            }
            tokio::time::sleep(crate::api::WATCH_BACKOFF_MAX).await;
        }
    };
    task
}

/// Says once why the LeasedQueue of `queue` cannot be read (`code` 403 or 404) and what the
/// sidecar does meanwhile.
fn warn_unreadable(queue: &str, code: u16) {
    if code == 403 {
        warn!(
            queue = %queue,
            code,
            "This sidecar's Role does not grant get, list and watch on leasedqueues (403), so it cannot know whether queue {queue} is paused or limited: it makes no claims until it can read it (and is not ready if it never could); retrying"
        );
    } else {
        warn!(
            queue = %queue,
            code,
            "The LeasedQueue CRD is not installed (404): queue {queue} has no pause and no limits until it is; retrying"
        );
    }
}

/// What the view becomes when the LeasedQueue API answers `code` (403 or 404, see
/// [`unreadable`]) while the view is `known`; None: it stays. A 403 forgets what was known
/// (fail closed: a LeasedQueue this sidecar may not read may pause or limit the queue); a
/// 404 means there is no LeasedQueue API, so none exists.
pub fn after_unreadable(known: &Known, code: u16) -> Option<Known> {
    match (code, known) {
        (403, Known::Unknown) => None,
        (403, _) => Some(Known::Unknown),
        (_, Known::Absent) => None,
        _ => Some(Known::Absent),
    }
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

/// A LeasedQueue as [`crate::watch::watch`] decodes it: a missing spec is the default one.
impl FromParts for LeasedQueue {
    fn from_parts(
        metadata: ObjectMeta,
        spec: Option<&RawValue>,
        status: Option<&RawValue>,
    ) -> Result<Self, String> {
        Ok(LeasedQueue {
            metadata,
            spec: spec
                .map(|s| crate::watch::part("spec", s))
                .transpose()?
                .unwrap_or_default(),
            status: status
                .map(|s| crate::watch::part("status", s))
                .transpose()?
                .flatten(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forbidden_queue_object_fails_closed_and_a_missing_api_means_none() {
        let present = Known::Present(Arc::new(LeasedQueue::new("q", Default::default())));
        for known in [Known::Unknown, Known::Absent, present] {
            let forbidden = after_unreadable(&known, 403);
            let after = forbidden.as_ref().unwrap_or(&known);
            assert!(
                matches!(after, Known::Unknown),
                "403 after {known:?}: {after:?}"
            );
            assert_eq!(after.paused(), None, "not known: no claims");
            let missing = after_unreadable(&known, 404);
            let after = missing.as_ref().unwrap_or(&known);
            assert!(
                matches!(after, Known::Absent),
                "404 after {known:?}: {after:?}"
            );
            assert_eq!(after.paused(), Some(false));
        }
    }
}
