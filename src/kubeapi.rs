//! What the controller and the sidecar share about talking to the API server, below both
//! roles: clients whose every request has a deadline, the backoff of every watch, classifying
//! API errors, telling when a watch cache is ready, and turning an error chain into one line
//! fit for a log or an HTTP answer (tokens redacted).

use std::time::Duration;

use kube::runtime::reflector::Store;
use kube::{Client, Config};

/// Longest wait for a TCP and TLS connection to the API server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for the answer to one request (not a watch), and for sending one. A request
/// through a network that holds bytes without resetting the connection fails after this long
/// instead of after the operating system's TCP timeouts (minutes). Calls a worker makes are
/// bounded more tightly still, by the sidecar (see [`crate::worker`]).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The two clients every role uses: one for requests, each with a deadline
/// ([`CONNECT_TIMEOUT`], [`REQUEST_TIMEOUT`]), and one for watches, which stay open for minutes
/// and are bounded instead by kube's watcher idle timeout (the server-side `timeoutSeconds`
/// plus a margin) and re-established with [`WatchBackoff`].
#[derive(Clone)]
pub struct Clients {
    /// For GET, LIST, PUT, PATCH, POST and DELETE.
    pub requests: Client,
    /// For watches.
    pub watches: Client,
}

impl Clients {
    /// Finds the cluster the standard way (KUBECONFIG or ~/.kube/config, then the in-cluster
    /// service account) and builds both clients from it.
    ///
    /// # Errors
    /// When no configuration is found or a client cannot be built.
    pub async fn infer() -> Result<Clients, ClientsError> {
        let config = Config::infer().await?;
        Clients::from_config(config)
    }

    /// Both clients from one configuration; its timeouts are replaced.
    ///
    /// # Errors
    /// When a client cannot be built from `config` (e.g. unreadable certificates).
    pub fn from_config(mut config: Config) -> Result<Clients, ClientsError> {
        config.connect_timeout = Some(CONNECT_TIMEOUT);
        // kube's retry layer honours an API server's Retry-After (5 s from a kube-apiserver
        // that is starting or shutting down) up to 15 times, below any backoff of ours: a
        // watch's re-list after a restart waited 5 s or more for it. Retries are leasehold's
        // own: WatchBackoff for watches, the caller (worker or reconcile) for requests.
        config.default_retry = false;
        config.write_timeout = Some(REQUEST_TIMEOUT);
        let mut watches = config.clone();
        watches.read_timeout = None;
        config.read_timeout = Some(REQUEST_TIMEOUT);
        // The deadline counts from when a request is sent, not from when its pooled
        // connection went idle.
        config.reset_reader_on_write = true;
        Ok(Clients {
            requests: Client::try_from(config)?,
            watches: Client::try_from(watches)?,
        })
    }
}

/// One client for both uses, for callers that manage their own (tests, the benchmark).
impl From<Client> for Clients {
    fn from(client: Client) -> Clients {
        Clients {
            requests: client.clone(),
            watches: client,
        }
    }
}

/// Errors of [`Clients::infer`].
#[derive(Debug, thiserror::Error)]
pub enum ClientsError {
    /// No usable kubeconfig or in-cluster configuration.
    #[error("no Kubernetes cluster found: set KUBECONFIG, or run in a pod with a service account")]
    Config(#[from] kube::config::InferConfigError),
    /// The configuration was found but a client could not be built from it.
    #[error("cannot build a Kubernetes client")]
    Client(#[from] kube::Error),
}

/// True once a reflector store has received its first complete listing.
pub fn store_ready<K: kube::Resource + Clone>(store: &Store<K>) -> bool
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    use futures::FutureExt;
    store
        .wait_until_ready()
        .now_or_never()
        .is_some_and(|r| r.is_ok())
}

/// True when the API server refused a write because the object or request would be too large
/// (413, or etcd's "request is too large" behind a 500).
pub fn is_too_large(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == 413
        || s.message.contains("too large")
        || s.message.contains("Too long")
        || s.reason == "RequestEntityTooLarge")
}

/// True when `err` is an API error with HTTP status `code`.
pub fn is_status(err: &kube::Error, code: u16) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == code)
}

/// True when the API server answered with success but its answer could not be decoded (one
/// object leasehold cannot read; see [`crate::watch`]): the request itself was carried out.
pub fn is_undecodable(err: &kube::Error) -> bool {
    matches!(err, kube::Error::SerdeError(_))
}

/// An error and its sources, joined with ": ". An API server's answer ends the chain as its
/// message and HTTP status (not kube's debug dump of the whole Status).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = Vec::new();
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = current {
        if let Some(kube::Error::Api(status)) = err.downcast_ref::<kube::Error>() {
            parts.push(format!(
                "the API server answered {}: {}",
                status.code, status.message
            ));
            break;
        }
        parts.push(err.to_string());
        current = err.source();
    }
    crate::token::redact(&parts.join(": "))
}

/// The backoff between a failed watch (or re-list) and the next try, for every watch leasehold
/// runs: 100 ms doubling to at most [`WATCH_BACKOFF_MAX`], each delay drawn uniformly from its
/// upper half (jitter, so that many sidecars do not retry in step), and back to 100 ms after
/// any event arrives.
///
/// Why not kube's `DefaultBackoff` (client-go's reflector: 0.8 s doubling to 30 s, reset only
/// after 120 s without errors): an API-server restart or an etcd compaction makes every watch
/// fail a few times in a row, and that backoff then grows across the outage and is applied to
/// the re-list after it, so jobs created or leases expired after the API server is back went
/// unseen for tens of seconds. Here the delay after the outage ends is at most one second,
/// while a watcher still makes at most about one request a second against an API server that
/// is down.
#[derive(Clone, Debug)]
pub struct WatchBackoff {
    next: std::time::Duration,
}

/// Longest delay of [`WatchBackoff`].
pub const WATCH_BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(1);
const WATCH_BACKOFF_MIN: std::time::Duration = std::time::Duration::from_millis(100);

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff {
            next: WATCH_BACKOFF_MIN,
        }
    }
}

impl Iterator for WatchBackoff {
    type Item = std::time::Duration;

    fn next(&mut self) -> Option<std::time::Duration> {
        let full = self.next;
        self.next = (full * 2).min(WATCH_BACKOFF_MAX);
        Some(full.mul_f64(0.5 + rand::random::<f64>() / 2.0))
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = WATCH_BACKOFF_MIN;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::utils::Backoff as _;

    #[test]
    fn watch_backoff_is_capped_at_a_second_and_resets() {
        let mut b = WatchBackoff::default();
        let delays: Vec<_> = b.by_ref().take(12).collect();
        assert!(delays[0] <= WATCH_BACKOFF_MIN && delays[0] >= WATCH_BACKOFF_MIN / 2);
        assert!(delays.iter().all(|d| *d <= WATCH_BACKOFF_MAX));
        assert!(delays[11] >= WATCH_BACKOFF_MAX / 2, "{delays:?}");
        b.reset();
        assert!(b.next().unwrap() <= WATCH_BACKOFF_MIN);
    }
}
