//! The sidecar's HTTP edge, driven with raw TCP as a broken or hostile client drives it: every
//! answer of the worker API is JSON, and nothing a client sends (or does not send) makes the
//! sidecar wait without bound.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What a raw exchange got back.
#[derive(Debug)]
struct Answer {
    /// The status code, when an HTTP answer came.
    status: Option<u16>,
    /// The response headers, lowercased, one per line.
    headers: String,
    /// The body parsed as JSON (Null when empty or not JSON).
    json: Value,
    /// The raw bytes read.
    raw: String,
    /// The server closed the connection (EOF) within the wait.
    closed: bool,
    /// How long after sending until EOF, or until the wait ran out.
    elapsed: Duration,
}

/// Sends `bytes` on a fresh connection to `port`, then reads until the server closes the
/// connection or `wait` passes.
async fn exchange(port: u16, bytes: &[u8], wait: Duration) -> Answer {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    read_until_closed(&mut stream, wait).await
}

async fn read_until_closed(stream: &mut (impl AsyncRead + Unpin), wait: Duration) -> Answer {
    let start = Instant::now();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = loop {
        let left = wait.saturating_sub(start.elapsed());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(n)) => raw.extend_from_slice(&buf[..n]),
            Err(_) => break false,
        }
    };
    let elapsed = start.elapsed();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.strip_prefix("HTTP/1.1 "))
        .and_then(|l| l.get(..3))
        .and_then(|s| s.parse().ok());
    let headers = lines.map(str::to_lowercase).collect::<Vec<_>>().join("\n");
    Answer {
        status,
        headers,
        json: serde_json::from_str(body).unwrap_or(Value::Null),
        raw,
        closed,
        elapsed,
    }
}

fn port(sc: &Sidecar) -> u16 {
    sc.proc.port.expect("the sidecar's port")
}

/// Asserts a JSON error answer `{error: code, message}` with `status`.
fn assert_json_error(a: &Answer, status: u16, code: &str) {
    assert_eq!(a.status, Some(status), "{a:?}");
    assert!(
        a.headers.contains("content-type: application/json"),
        "{a:?}"
    );
    assert_eq!(a.json["error"], code, "{a:?}");
    assert!(
        a.json["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{a:?}"
    );
}

#[tokio::test]
async fn every_refusal_of_the_worker_api_is_json_and_comes_without_waiting_for_the_body() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "edge-json").await;
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &["--body-timeout", "1"]).await;
    let port = port(&sc);
    let wait = Duration::from_secs(5);

    // A name that is not UTF-8 once percent-decoded.
    let a = exchange(
        port,
        b"POST /v1/jobs/%ff%fe/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        wait,
    )
    .await;
    assert_json_error(&a, 400, "invalid_name");

    // 50 GB announced, 2 bytes sent: refused at once, and the connection is closed.
    let a = exchange(
        port,
        b"POST /v1/jobs/x/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000000\r\n\r\n{}",
        wait,
    )
    .await;
    assert_json_error(&a, 413, "too_large");
    assert!(a.closed && a.elapsed < Duration::from_secs(2), "{a:?}");

    // 20 bytes announced, 2 sent: answered once the body timeout (1 s) has passed.
    let a = exchange(
        port,
        b"POST /v1/jobs/x/complete HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n{}",
        wait,
    )
    .await;
    assert_json_error(&a, 408, "body_timeout");
    assert!(a.closed && a.elapsed < Duration::from_secs(3), "{a:?}");

    // A chunked body that trickles, one byte a little under the timeout apart, is bounded as
    // a whole, not per chunk.
    let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    writer
        .write_all(
            b"POST /v1/jobs/x/release HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        )
        .await
        .unwrap();
    let start = Instant::now();
    let trickle = tokio::spawn(async move {
        for _ in 0..8 {
            tokio::time::sleep(Duration::from_millis(700)).await;
            if writer.write_all(b"1\r\n \r\n").await.is_err() {
                return;
            }
        }
    });
    let a = read_until_closed(&mut reader, wait).await;
    trickle.abort();
    assert_json_error(&a, 408, "body_timeout");
    assert!(start.elapsed() < Duration::from_secs(3), "{a:?}");

    // Query, route and method refusals.
    let a = exchange(
        port,
        b"POST /v1/claim?wait=%ff HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        wait,
    )
    .await;
    assert_json_error(&a, 400, "invalid_request");
    let a = exchange(
        port,
        b"POST /v1/nothing/%ff HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        wait,
    )
    .await;
    assert_json_error(&a, 404, "not_found");
    let a = exchange(
        port,
        b"GET /v1/jobs/%ff/heartbeat HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        wait,
    )
    .await;
    assert_json_error(&a, 405, "method_not_allowed");

    // And the sidecar still serves.
    let (s, body) = sc.heartbeat("x", json!({})).await;
    assert_eq!(
        (s, &body["error"]),
        (400, &json!("invalid_token")),
        "{body}"
    );
}

#[tokio::test]
async fn a_request_line_hyper_cannot_parse_is_answered_400_and_closed() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "edge-raw").await;
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    // http::Uri refuses a raw 0xff byte, so hyper answers before any handler can: see
    // docs/protocol.md for why that answer has no JSON body.
    let a = exchange(
        port(&sc),
        b"POST /v1/jobs/\xff/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(a.status, Some(400), "{a:?}");
    assert!(a.closed && a.elapsed < Duration::from_secs(2), "{a:?}");
}

#[tokio::test]
async fn silent_trickling_and_idle_keep_alive_connections_are_closed_within_the_header_timeout() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "edge-idle").await;
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &["--header-timeout", "1"]).await;
    let port = port(&sc);
    let bound = Duration::from_millis(2500);
    let wait = Duration::from_secs(10);

    // Connects and never sends a byte.
    let a = exchange(port, b"", wait).await;
    assert!(a.closed && a.elapsed < bound, "{a:?}");
    assert_eq!(a.raw, "");

    // Sends half a head, then stops.
    let a = exchange(port, b"POST /v1/claim HTTP/1.1\r\nHo", wait).await;
    assert!(a.closed && a.elapsed < bound, "{a:?}");

    // Trickles its headers, one a little under the timeout apart: the bound is on the whole
    // head, not between bytes.
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let start = Instant::now();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\n")
        .await
        .unwrap();
    for i in 0..4 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let header = format!("X-Slow-{i}: 1\r\n");
        if stream.write_all(header.as_bytes()).await.is_err() {
            break;
        }
    }
    let a = read_until_closed(&mut stream, wait).await;
    assert!(a.closed && a.status.is_none(), "{a:?}");
    assert!(start.elapsed() < Duration::from_millis(3500), "{a:?}");

    // Gets an answer on a keep-alive connection, then stays idle.
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream
        .write_all(b"POST /v1/jobs/x/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        .await
        .unwrap();
    let a = read_until_closed(&mut stream, wait).await;
    assert_json_error(&a, 400, "invalid_token");
    assert!(!a.headers.contains("connection: close"), "{a:?}");
    assert!(a.closed && a.elapsed < bound, "{a:?}");
}

#[tokio::test]
async fn the_metrics_endpoints_of_the_controller_and_the_sidecar_close_silent_connections_too() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "edge-metrics").await;
    let controller = controller_with(&ns.name, "ctl", &["--header-timeout", "1"]);
    let metrics_port = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let _sc = Sidecar::start(
        &ns.name,
        "q",
        "pod-a",
        &["--header-timeout", "1", "--metrics-addr", &metrics_addr],
    )
    .await;
    let controller_port = controller.port.unwrap();
    for port in [controller_port, metrics_port] {
        wait_for("/healthz answered", Duration::from_secs(30), || {
            http_get(port, "/healthz")
        })
        .await;
        let a = exchange(
            port,
            b"GET /metrics HTTP/1.1\r\nHo",
            Duration::from_secs(10),
        )
        .await;
        assert!(
            a.closed && a.elapsed < Duration::from_millis(2500),
            "{port}: {a:?}"
        );
        let a = exchange(port, b"", Duration::from_secs(10)).await;
        assert!(
            a.closed && a.elapsed < Duration::from_millis(2500),
            "{port}: {a:?}"
        );
    }
}

#[tokio::test]
async fn two_hundred_idle_connections_are_all_closed_and_a_claim_is_served_meanwhile() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "edge-many").await;
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &["--header-timeout", "3"]).await;
    let port = port(&sc);
    let mut idle = Vec::new();
    for i in 0..200 {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        if i % 2 == 0 {
            stream
                .write_all(b"POST /v1/claim HTTP/1.1\r\n")
                .await
                .unwrap();
        }
        idle.push(stream);
    }
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "x"}, "spec": {"queue": "q"}}),
    )
    .await;
    let start = Instant::now();
    let (s, claimed) = sc.claim(10).await;
    assert_eq!((s, &claimed["name"]), (200, &json!("x")), "{claimed}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );

    let closed = futures::future::join_all(
        idle.iter_mut()
            .map(|s| read_until_closed(s, Duration::from_secs(8))),
    )
    .await;
    let open = closed.iter().filter(|a| !a.closed).count();
    assert_eq!(
        open, 0,
        "{open} of 200 idle connections still open after 8 s"
    );
}

/// A TCP relay to the API server that can stop moving bytes (both ways) without closing
/// anything: an API server that is reachable but does not answer.
struct Relay {
    port: u16,
    frozen: Arc<AtomicBool>,
}

impl Relay {
    async fn start(upstream: String) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let frozen = Arc::new(AtomicBool::new(false));
        let f = Arc::clone(&frozen);
        tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let Ok(up) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (dr, dw) = down.into_split();
                let (ur, uw) = up.into_split();
                tokio::spawn(pump(dr, uw, Arc::clone(&f)));
                tokio::spawn(pump(ur, dw, Arc::clone(&f)));
            }
        });
        Relay { port, frozen }
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while frozen.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test]
async fn a_heartbeat_the_api_server_does_not_answer_gets_504_within_the_request_timeout() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "edge-slow").await;
    // The sidecar reaches the API server through a relay the test can freeze.
    let kubeconfig = std::fs::read_to_string(kubeconfig_path()).unwrap();
    let server = kubeconfig
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: "))
        .expect("the kubeconfig names a server")
        .trim_matches('"')
        .to_string();
    let upstream = server
        .strip_prefix("https://")
        .expect("an https server")
        .to_string();
    let relay = Relay::start(upstream).await;
    let relayed = kubeconfig.replace(&server, &format!("https://127.0.0.1:{}", relay.port));
    let path = log_dir().join(format!("{}-relayed.kubeconfig", ns.name));
    std::fs::write(&path, relayed).unwrap();
    let sc = Sidecar::start_as(&ns.name, "q", "pod-a", &["--request-timeout", "2"], &path).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "x"}, "spec": {"queue": "q"}}),
    )
    .await;
    let (s, claimed) = sc.claim(10).await;
    assert_eq!(s, 200, "{claimed}");
    let token = claimed["token"].as_str().unwrap().to_string();

    relay.frozen.store(true, Ordering::SeqCst);
    let start = Instant::now();
    let answered = tokio::time::timeout(
        Duration::from_secs(10),
        sc.heartbeat("x", json!({"token": token})),
    )
    .await;
    let (s, body) =
        answered.expect("a heartbeat answered within 10 s while the API server is silent");
    assert_eq!((s, &body["error"]), (504, &json!("timeout")), "{body}");
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );

    // Once the API server answers again, so do heartbeats with the same token.
    relay.frozen.store(false, Ordering::SeqCst);
    let (s, body) = sc.heartbeat("x", json!({"token": token})).await;
    assert_eq!(s, 200, "{body}");
}
