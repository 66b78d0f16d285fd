//! What the controller and the sidecar share about talking to the API server, below both
//! roles: clients whose every request has a deadline, the backoff of every watch, classifying
//! API errors, telling when a watch cache is ready, and turning an error chain into one line
//! fit for a log or an HTTP answer (tokens redacted).

use std::time::Duration;

use kube::{Client, Config};

/// Longest wait for a TCP and TLS connection to the API server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for the answer to one request (not a watch), and for sending one. A request
/// through a network that holds bytes without resetting the connection fails after this long
/// instead of after the operating system's TCP timeouts (minutes). Calls a worker makes are
/// bounded more tightly still, by the worker library (the crate `leasehold-worker`).
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

/// True when the API server refused a write because the object or request would be too large:
/// 413 (the controller's admission webhook past [`leasehold_core::crd::MAX_JOB_BYTES`], or the API
/// server's own request limit), or etcd's "request is too large" behind a 500 where no webhook
/// answered.
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
    leasehold_core::token::redact(&parts.join(": "))
}

/// The backoff between a failed watch (or re-list) and the next try, for every watch leasehold
/// runs: 100 ms doubling to at most [`WATCH_BACKOFF_MAX`], each delay drawn uniformly from its
/// upper half (jitter, so that many sidecars do not retry in step), and back to 100 ms once
/// the watch has run for [`WATCH_BACKOFF_RESET_AFTER`] without an error.
///
/// Why not kube's `DefaultBackoff` (client-go's reflector: 0.8 s doubling to 30 s, reset only
/// after 120 s without errors): an API-server restart or an etcd compaction makes every watch
/// fail a few times in a row, and that backoff then grows across the outage and is applied to
/// the re-list after it, so jobs created or leases expired after the API server is back went
/// unseen for tens of seconds. Here the delay after the outage ends is at most one second,
/// while a watcher makes at most about one request a second against an API server that is
/// down. (The reset waits for a healthy stretch because kube's watcher yields an event at the
/// start of every re-list, before the list itself fails: resetting on that would retry ten
/// times a second through an outage.)
#[derive(Clone, Debug)]
pub struct WatchBackoff {
    next: Duration,
    last_failure: Option<std::time::Instant>,
}

/// Longest delay of [`WatchBackoff`].
pub const WATCH_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// How long a watch must run without an error before [`WatchBackoff`] starts again from its
/// shortest delay.
pub const WATCH_BACKOFF_RESET_AFTER: Duration = Duration::from_secs(2);
const WATCH_BACKOFF_MIN: Duration = Duration::from_millis(100);

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff {
            next: WATCH_BACKOFF_MIN,
            last_failure: None,
        }
    }
}

impl WatchBackoff {
    /// The delay after a failure at `now` (see the type's documentation for the rule).
    fn delay_at(&mut self, now: std::time::Instant, jitter: f64) -> Duration {
        if self
            .last_failure
            .is_some_and(|t| now.saturating_duration_since(t) >= WATCH_BACKOFF_RESET_AFTER)
        {
            self.next = WATCH_BACKOFF_MIN;
        }
        self.last_failure = Some(now);
        let full = self.next;
        self.next = (full * 2).min(WATCH_BACKOFF_MAX);
        full.mul_f64(0.5 + jitter.clamp(0.0, 1.0) / 2.0)
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.delay_at(std::time::Instant::now(), rand::random::<f64>()))
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    /// Called on every event the watch yields; the backoff restarts from its shortest delay
    /// only after a healthy stretch (see [`WATCH_BACKOFF_RESET_AFTER`]), judged at the next
    /// failure.
    fn reset(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::utils::Backoff as _;

    #[test]
    fn watch_backoff_grows_through_an_outage_and_restarts_after_a_healthy_stretch() {
        let mut b = WatchBackoff::default();
        let t0 = std::time::Instant::now();
        // Failures in quick succession (an outage): 100 ms doubling, capped at a second, even
        // though the watcher yields an event (reset) between them.
        let mut at = t0;
        let mut delays = Vec::new();
        for _ in 0..8 {
            b.reset();
            let d = b.delay_at(at, 1.0);
            delays.push(d);
            at += d;
        }
        assert_eq!(delays[0], WATCH_BACKOFF_MIN);
        assert_eq!(delays[1], WATCH_BACKOFF_MIN * 2);
        assert!(delays.iter().all(|d| *d <= WATCH_BACKOFF_MAX), "{delays:?}");
        assert_eq!(delays[7], WATCH_BACKOFF_MAX);
        // Jitter takes off at most half.
        assert!(b.delay_at(at, 0.0) >= WATCH_BACKOFF_MAX / 2);
        // After a healthy stretch, the next failure starts again from the shortest delay.
        let later = at + WATCH_BACKOFF_RESET_AFTER + Duration::from_millis(1);
        assert_eq!(b.delay_at(later, 1.0), WATCH_BACKOFF_MIN);
    }
}
