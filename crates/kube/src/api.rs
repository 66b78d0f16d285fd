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
            requests: client(config)?,
            watches: client(watches)?,
        })
    }
}

/// A client built from `config` as kube builds one (its TLS, authentication, extra headers
/// and timeouts, with the connect, read and write timeouts of `config`), except that every
/// connection sets TCP_NODELAY, and without kube's tracing layer (its debug span per request
/// and its error line per failed one: leasehold logs its own) and retry layer
/// (`config.default_retry` is not read: leasehold retries on its own, [`Clients::from_config`]).
///
/// Why: kube's connector leaves Nagle's algorithm on. A request written while an earlier
/// small write of the same connection is not yet acknowledged then waits for that
/// acknowledgement, which the API server delays by up to 40 ms (delayed ACK): with 500
/// sidecars waiting, 30 % of the reads of an offered job took 45 ms instead of 3 ms
/// (benchmark row 11c). Every request is written whole, so nothing is gained by coalescing.
///
/// # Errors
/// When the TLS configuration or the credentials of `config` cannot be loaded; when `config`
/// names a proxy (a kubeconfig's `proxy-url`, or `HTTPS_PROXY` read along with a kubeconfig;
/// an in-cluster configuration has none): kube's proxy features are not built in, and the
/// error is the one kube itself gives, naming the feature; or when it names an `https`
/// server while no TLS backend is built in ([`kube::Error::TlsRequired`]).
pub fn client(config: Config) -> Result<Client, kube::Error> {
    use kube::client::ConfigExt;

    if let Some(proxy_url) = config.proxy_url.as_ref() {
        let protocol_feature = match proxy_url.scheme_str() {
            Some("socks5") => "kube/socks5",
            Some("http" | "https") => "kube/http-proxy",
            _ => {
                return Err(kube::Error::ProxyProtocolUnsupported {
                    proxy_url: Box::new(proxy_url.clone()),
                })
            }
        };
        return Err(kube::Error::ProxyProtocolDisabled {
            proxy_url: Box::new(proxy_url.clone()),
            protocol_feature,
        });
    }
    let mut tcp = hyper_util::client::legacy::connect::HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_nodelay(true);
    #[cfg(feature = "rustls-tls")]
    let tls = config.rustls_https_connector_with_connector(tcp)?;
    #[cfg(all(not(feature = "rustls-tls"), feature = "openssl-tls"))]
    let tls = config.openssl_https_connector_with_connector(tcp)?;
    #[cfg(all(not(feature = "rustls-tls"), not(feature = "openssl-tls")))]
    let tls = if config.cluster_url.scheme_str() == Some("https") {
        return Err(kube::Error::TlsRequired);
    } else {
        tcp
    };
    let mut connector = hyper_timeout::TimeoutConnector::new(tls);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let http: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(connector);
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(http);
    Ok(Client::new(service, config.default_namespace))
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server on loopback that reads one request head, hands it over, and answers with
    /// `answer` (or never, when None).
    async fn one_request_server(
        answer: Option<&'static str>,
    ) -> (String, tokio::sync::oneshot::Receiver<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = stream.read(&mut buf).await.unwrap();
                if n == 0 {
                    return;
                }
                head.extend_from_slice(&buf[..n]);
            }
            let _ = tx.send(String::from_utf8_lossy(&head).into_owned());
            match answer {
                Some(body) => {
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    stream.write_all(reply.as_bytes()).await.unwrap();
                }
                None => std::future::pending::<()>().await,
            }
        });
        (url, rx)
    }

    fn config_for(url: &str) -> Config {
        let mut config = Config::new(url.parse().unwrap());
        config.auth_info.token = Some("sekret".to_string().into());
        config.headers = vec![(
            http::HeaderName::from_static("x-extra"),
            http::HeaderValue::from_static("yes"),
        )];
        config
    }

    #[tokio::test]
    async fn the_client_sends_to_the_configured_server_with_its_credentials_and_headers() {
        let (url, head) =
            one_request_server(Some(r#"{"major":"1","minor":"37","gitVersion":"v1.37.2"}"#)).await;
        let client = client(config_for(&url)).unwrap();
        let version = client.apiserver_version().await.unwrap();
        assert_eq!(version.git_version, "v1.37.2");
        let head = head.await.unwrap().to_ascii_lowercase();
        assert!(head.starts_with("get /version"), "{head}");
        assert!(head.contains("authorization: bearer sekret"), "{head}");
        assert!(head.contains("x-extra: yes"), "{head}");
    }

    #[test]
    fn a_proxy_is_refused_as_kube_refuses_it_without_its_proxy_features() {
        let mut config = config_for("https://127.0.0.1:6443");
        config.proxy_url = Some("http://proxy.example:3128".parse().unwrap());
        let refused = client(config.clone()).err().expect("refused");
        assert!(
            matches!(&refused, kube::Error::ProxyProtocolDisabled { protocol_feature, .. } if *protocol_feature == "kube/http-proxy"),
            "{refused:?}"
        );
        config.proxy_url = Some("socks5://proxy.example:1080".parse().unwrap());
        let refused = client(config).err().expect("refused");
        assert!(refused.to_string().contains("kube/socks5"), "{refused}");
    }

    #[tokio::test]
    async fn a_request_not_answered_fails_after_the_configured_read_timeout() {
        let (url, _head) = one_request_server(None).await;
        let mut config = config_for(&url);
        config.read_timeout = Some(Duration::from_millis(200));
        let client = client(config).unwrap();
        let started = std::time::Instant::now();
        let answer =
            tokio::time::timeout(Duration::from_secs(10), client.apiserver_version()).await;
        let answer = answer.expect("the read timeout ends the request, not the test's bound");
        assert!(answer.is_err(), "{answer:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

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
