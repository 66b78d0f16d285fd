//! Serving HTTP with bounded waits: the one accept loop behind every HTTP server leasehold runs
//! (the sidecar's worker API, its `--metrics-addr`, the controller's `--metrics-addr` and its
//! admission webhook).
//!
//! What a client can make the server wait for, and for how long:
//! - a TLS handshake ([`serve_tls`] only): [`Limits::header_timeout`] from the accept;
//! - a request's head (request line and headers), and the next head on an idle keep-alive
//!   connection: [`Limits::header_timeout`]; then hyper closes the connection. hyper starts
//!   this timer whenever it begins reading a head, so it covers a connection that never sends
//!   a byte, one that trickles its headers, and one left idle after an answer;
//! - a request's body: [`Limits::body_timeout`] from the moment its head was read, for the whole
//!   body, not per chunk (a body read after that fails with [`BodyTimeout`], which a handler
//!   turns into its own answer);
//! - the number of open connections: at most [`Limits::max_connections`]; past it, new
//!   connections wait in the kernel's accept queue until one closes (each closes within the
//!   timeouts above once idle).
//!
//! How long a *handler* may take is the handler's business (the sidecar bounds every route
//! but the long poll of a claim).
//!
//! Only HTTP/1.1 is served: the clients are a worker on loopback, Prometheus, the kubelet and
//! (over TLS, [`serve_tls`]) the API server calling the controller's admission webhook.
//! A request hyper cannot parse (a request line with a raw non-ASCII byte, a malformed header)
//! is answered by hyper itself, with an empty-bodied 400 (431 for headers over its buffer, 414
//! for an over-long URI), before any handler runs, and the connection is closed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::Router;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};
use tower::ServiceExt as _;

/// Default for [`Limits::header_timeout`]: 10 seconds.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default for [`Limits::body_timeout`]: 10 seconds.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// Default for [`Limits::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Pause after a failed accept (e.g. out of file descriptors) before trying again.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// The accept queue asked for by [`bind`] (the kernel caps it at `net.core.somaxconn`, 4096 on
/// current kernels).
pub const ACCEPT_BACKLOG: u32 = 4096;

/// Binds `addr` for a server that many clients reach at once, with an accept queue of
/// [`ACCEPT_BACKLOG`] connections.
///
/// Why: `TcpListener::bind` (tokio, like the standard library) asks for 128. When 500
/// sidecars connect to the dispatcher in the same moment (all starting their first poll, or
/// all turning to a new leader), the connections past 128 that the server has not accepted
/// yet are dropped by the kernel and retried a second later, past the sidecars' 500 ms
/// connect bound, so they fell back to choosing on their own (benchmark row 11).
///
/// # Errors
/// The address is in use or cannot be bound.
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As the standard library's bind does on Unix: a restarted server can bind again while
    // the connections of the last one linger in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}

/// The waits a client can impose on a server, each bounded.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest wait for a request's head, on a new connection or an idle keep-alive one.
    pub header_timeout: Duration,
    /// Longest wait for a whole request body, counted from the end of its head.
    pub body_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// The error a request body's read returns once [`Limits::body_timeout`] has passed; found in
/// the source chain of the body error a handler sees.
#[derive(Debug, Error)]
#[error("the request body did not arrive in full within {0:?} of its head")]
pub struct BodyTimeout(pub Duration);

/// Serves `router` on `listener` with `limits` until `shutdown` resolves; then stops
/// accepting, lets every request in flight finish, closes idle connections, and returns once
/// every connection has closed.
///
/// Errors: none from connections (a client's failure is logged at debug level and ends only
/// its connection); failed accepts are retried after a short pause. The result is `io::Result`
/// so the signature stays that of a server whose accept loop may one day fail for good.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    serve_on(listener, router, limits, None, shutdown).await
}

/// As [`serve`], over TLS (HTTP/1.1 only, announced by ALPN): the certificate is whatever
/// `tls` resolves at each handshake (see [`crate::tls`] for one that follows rotated files).
/// The handshake must finish within [`Limits::header_timeout`] of the connection's accept;
/// one that fails or is too slow closes only its connection, and is logged at info level (a
/// peer that refuses the certificate shows up there).
pub async fn serve_tls(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    tls: Arc<rustls::ServerConfig>,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    serve_on(listener, router, limits, Some(acceptor), shutdown).await
}

async fn serve_on(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = Arc::clone(&permits).acquire_owned() => permit.expect("the semaphore is never closed"),
        };
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "Failed to accept an HTTP connection; retrying");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            },
        };
        // Without TCP_NODELAY, a small write that follows another small one not yet
        // acknowledged waits for that acknowledgement (Nagle's algorithm), which the peer may
        // delay by up to 40 ms (delayed ACK): a poll's offer written just after a keep-alive
        // newline could reach its sidecar that late. The API client had exactly this stall
        // (leasehold_kube::api::client). Every answer here is written whole, so nothing is
        // gained by coalescing.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "Could not set TCP_NODELAY on the connection from {peer}");
        }
        let router = router.clone();
        let body_timeout = limits.body_timeout;
        // Router's error type is Infallible: every failure is an answer.
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let request = request.map(|body| DeadlineBody::new(body, body_timeout));
            router.clone().oneshot(request)
        });
        let (builder, watcher, tls) = (builder.clone(), graceful.watcher(), tls.clone());
        let handshake_timeout = limits.header_timeout;
        tokio::spawn(async move {
            let served = match tls {
                None => {
                    let connection = builder.serve_connection(TokioIo::new(stream), service);
                    watcher.watch(connection).await
                }
                Some(acceptor) => {
                    match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            let connection =
                                builder.serve_connection(TokioIo::new(stream), service);
                            watcher.watch(connection).await
                        }
                        Ok(Err(e)) => {
                            tracing::info!(%peer, error = %e, "TLS handshake with {peer} failed");
                            Ok(())
                        }
                        Err(_) => {
                            tracing::info!(%peer, "TLS handshake with {peer} did not finish within {handshake_timeout:?}");
                            Ok(())
                        }
                    }
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// The [`BodyTimeout`] in the source chain of `err`, if the error is one: how a handler tells a
/// body that took too long from one that could not be read for another reason.
pub fn body_timeout_in<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a BodyTimeout> {
    let mut source = Some(err);
    while let Some(cause) = source {
        if let Some(timeout) = cause.downcast_ref::<BodyTimeout>() {
            return Some(timeout);
        }
        source = cause.source();
    }
    None
}

/// A request body that fails with [`BodyTimeout`] once its deadline has passed.
struct DeadlineBody {
    body: Incoming,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl DeadlineBody {
    fn new(body: Incoming, timeout: Duration) -> Self {
        DeadlineBody {
            body,
            timeout,
            deadline: Box::pin(tokio::time::sleep_until(Instant::now() + timeout)),
        }
    }
}

impl Body for DeadlineBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTimeout(self.timeout))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_bound_listener_queues_hundreds_of_connections_before_its_first_accept() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        // None is accepted yet: with the default queue of 128, the rest would hang in SYN
        // retries (a second and more) instead of connecting at once.
        let connects = (0..400).map(|_| async move {
            tokio::time::timeout(
                Duration::from_millis(800),
                tokio::net::TcpStream::connect(addr),
            )
            .await
        });
        let results = futures::future::join_all(connects).await;
        let connected = results.iter().filter(|r| matches!(r, Ok(Ok(_)))).count();
        // The kernel caps the queue at net.core.somaxconn (4096 on Linux since 5.4; 128
        // before), and queues one more than it.
        let cap = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .map_or(400, |max| (max + 1).min(400));
        assert_eq!(connected, cap, "connections queued before the first accept");
        let (_first, _) = listener.accept().await.unwrap();
    }
}
