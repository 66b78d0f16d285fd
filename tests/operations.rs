//! Running leasehold in production: metrics that move with what they count (every documented
//! one), health that tells the truth, JSON logs, and a sidecar that shuts down without losing
//! or doubling a job.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Patch, PatchParams};
use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::lease;
use leasehold_metrics::{
    JobLabels, Metrics, OutcomeLabels, QueueLabel, QueueObjectLabels, SlotWriteLabels,
};
use leasehold_testkit::*;
use serde_json::json;

/// Every metric the tests below prove to move when what it counts happens. Adding a metric
/// means adding it here, to docs/protocol.md, and to a test that moves it.
const MOVED: [&str; 23] = [
    "leasehold_jobs",
    "leasehold_lease_expiries_total",
    "leasehold_leader",
    "leasehold_controller_ready",
    "leasehold_oldest_attempt_seconds",
    "leasehold_attempts_ended_total",
    // Moved by tests/monitoring.rs: a controller that cannot take an expired job back.
    "leasehold_lease_overdue_seconds",
    "leasehold_claims_total",
    "leasehold_claim_conflicts_total",
    "leasehold_stale_token_refusals_total",
    "leasehold_heartbeats_total",
    "leasehold_queue_wait_seconds",
    "leasehold_run_seconds",
    // Moved by tests/poison.rs: an object that cannot be decoded.
    "leasehold_undecodable_objects_total",
    // Moved by tests/queue_watch.rs: a busy sidecar of a queue that keeps changing.
    "leasehold_queue_watch_running",
    "leasehold_queue_watch_stops_total",
    // Moved by tests/dispatch.rs: claims offered by the dispatcher, and not.
    "leasehold_claims_offered_total",
    // Moved by tests/queues.rs: a queue paused and resumed.
    "leasehold_queue_paused",
    "leasehold_queue_paused_seconds",
    "leasehold_queue_oldest_queued_seconds",
    // Moved by tests/limits.rs: a swap refused under a dispatcher's lie.
    "leasehold_slot_writes_total",
    // Moved by tests/limits.rs: a key at its limit.
    "leasehold_queue_at_limit",
    "leasehold_queue_keys_at_limit",
];

async fn metrics_of(port: u16) -> String {
    let (status, body) = http_get(port, "/metrics").await.expect("metrics served");
    assert_eq!(status, 200);
    body
}

#[tokio::test]
async fn metrics_move_when_the_events_they_count_happen() {
    let Fixture { client, ns } = fixture!("metrics");
    let ctl = controller(&ns.name);
    let ctl_port = ctl.port.unwrap();
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    let sc_port = sc.proc.port.unwrap();
    let before = metrics_of(sc_port).await;
    assert_eq!(
        sample(&before, "leasehold_claims_total"),
        Some(0.0),
        "{before}"
    );

    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "m1"}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
    )
    .await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "m2"}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
    )
    .await;
    let queued = "leasehold_jobs{queue=\"q\",phase=\"Queued\"}";
    wait_for("2 Queued jobs counted", Duration::from_secs(15), || async {
        (sample(&http_get(ctl_port, "/metrics").await?.1, queued)? == 2.0).then_some(())
    })
    .await;

    let (s, c1) = sc.claim(10).await;
    assert_eq!(s, 200);
    // The controller's own: it leads, it is ready, and the claimed attempt's age grows.
    wait_for(
        "the attempt's age counted",
        Duration::from_secs(15),
        || async {
            let m = http_get(ctl_port, "/metrics").await?.1;
            let age = sample(&m, "leasehold_oldest_attempt_seconds{queue=\"q\"}")?;
            (age >= 1.0
                && sample(&m, "leasehold_leader")? == 1.0
                && sample(&m, "leasehold_controller_ready")? == 1.0)
                .then_some(())
        },
    )
    .await;
    let (s, _) = sc
        .heartbeat(
            c1["name"].as_str().unwrap(),
            json!({"token": token_of(&c1)}),
        )
        .await;
    assert_eq!(s, 200);
    let (s, _) = sc
        .heartbeat(
            c1["name"].as_str().unwrap(),
            json!({"token": "1.00000000000000000000000000000000"}),
        )
        .await;
    assert_eq!(s, 409);
    let m = metrics_of(sc_port).await;
    assert_eq!(sample(&m, "leasehold_claims_total"), Some(1.0), "{m}");
    assert!(
        sample(&m, "leasehold_heartbeats_total{result=\"ok\"}").unwrap_or(0.0) >= 1.0,
        "{m}"
    );
    assert_eq!(
        sample(&m, "leasehold_stale_token_refusals_total"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, "leasehold_queue_wait_seconds_count"),
        Some(1.0),
        "{m}"
    );

    let (s, c2) = sc.claim(10).await;
    assert_eq!(s, 200);
    let (s, _) = sc
        .complete(c2["name"].as_str().unwrap(), &token_of(&c2), json!(2))
        .await;
    assert_eq!(s, 200);
    let m = metrics_of(sc_port).await;
    assert_eq!(sample(&m, "leasehold_run_seconds_count"), Some(1.0), "{m}");
    let ended = |outcome: &str| {
        format!("leasehold_attempts_ended_total{{queue=\"q\",outcome=\"{outcome}\"}}")
    };
    wait_for("the completion counted", Duration::from_secs(5), || async {
        let m = http_get(ctl_port, "/metrics").await?.1;
        (sample(&m, &ended("succeeded"))? == 1.0 && sample(&m, &ended("expired"))? == 0.0)
            .then_some(())
    })
    .await;

    // Another holder takes the held job's Lease: the next renewal fails and is counted.
    let leased_name = c1["name"].as_str().unwrap().to_string();
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    leases
        .patch(
            &lease::lease_name(&leased_name),
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"holderIdentity": "1.ffffffffffffffffffffffffffffffff"}}),
            ),
        )
        .await
        .unwrap();
    let (s, _) = sc
        .heartbeat(&leased_name, json!({"token": token_of(&c1)}))
        .await;
    assert_eq!(s, 409);
    wait_for(
        "a failed renewal counted",
        Duration::from_secs(5),
        || async {
            let m = http_get(sc_port, "/metrics").await?.1;
            (sample(&m, "leasehold_heartbeats_total{result=\"failed\"}")? >= 1.0).then_some(())
        },
    )
    .await;

    // The held job's sidecar dies; the controller counts the expiry.
    sc.proc.signal("KILL");
    drop(sc);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    wait_for("the expiry", Duration::from_secs(20), || async {
        (jobs.get(&leased_name).await.ok()?.failed_attempts() == 1).then_some(())
    })
    .await;
    wait_for("expiry counted", Duration::from_secs(5), || async {
        (sample(
            &http_get(ctl_port, "/metrics").await?.1,
            "leasehold_lease_expiries_total",
        )? == 1.0)
            .then_some(())
    })
    .await;
    // The gauges and the attempts-ended counts come from the controller's look every second,
    // so they may trail the expiry counter by a second.
    let m = wait_for("phases counted", Duration::from_secs(5), || async {
        let m = http_get(ctl_port, "/metrics").await?.1;
        let succeeded = sample(&m, "leasehold_jobs{queue=\"q\",phase=\"Succeeded\"}")?;
        (succeeded == 1.0 && sample(&m, &ended("expired"))? == 1.0).then_some(m)
    })
    .await;
    assert!(m.contains("leasehold_lease_expiries_total 1"), "{m}");
    assert_eq!(sample(&m, &ended("expired")), Some(1.0), "{m}");
    assert_eq!(sample(&m, &ended("succeeded")), Some(1.0), "{m}");
}

/// Every metric registered and documented is one the tests move.
#[test]
fn every_metric_is_exercised() {
    let mut moved: Vec<String> = MOVED.iter().map(|m| m.to_string()).collect();
    moved.sort();
    // docs/protocol.md, "Metrics and health": one table row per metric.
    let protocol =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/protocol.md")).unwrap();
    let mut documented: Vec<String> = protocol
        .lines()
        .filter_map(|l| l.strip_prefix("| `leasehold_"))
        .map(|rest| {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            format!("leasehold_{name}")
        })
        .collect();
    documented.sort();
    assert_eq!(documented, moved, "docs/protocol.md's metrics table");
    // The registry (a controller's, which has every metric): counters are exposed with the
    // suffix _total; a family only once it has a member.
    let metrics = Metrics::controller();
    let queue = QueueLabel { queue: "q".into() };
    metrics
        .controller
        .oldest_attempt_seconds
        .get_or_create(&queue)
        .set(1.0);
    metrics
        .controller
        .lease_overdue_seconds
        .get_or_create(&queue)
        .set(0.0);
    metrics
        .controller
        .attempts_ended
        .get_or_create(&OutcomeLabels {
            queue: "q".into(),
            outcome: "failed",
        })
        .inc();
    let object = QueueObjectLabels {
        queue_namespace: "ns".into(),
        queue: "q".into(),
    };
    let c = &metrics.controller;
    c.queue_paused.get_or_create(&object).set(1);
    c.queue_paused_seconds.get_or_create(&object).set(1.0);
    c.queue_oldest_queued_seconds
        .get_or_create(&object)
        .set(1.0);
    c.queue_at_limit.get_or_create(&object).set(0);
    c.queue_keys_at_limit.get_or_create(&object).set(0);
    metrics.heartbeat(true);
    metrics.undecodable("LeasedJob");
    metrics
        .slot_writes
        .get_or_create(&SlotWriteLabels {
            kind: "swap",
            result: "refused",
        })
        .inc();
    metrics
        .jobs
        .get_or_create(&JobLabels {
            queue: "q".into(),
            phase: "Queued".into(),
        })
        .set(1);
    let text = metrics.render();
    let mut registered: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| match l.split_once(' ') {
            Some((name, "counter")) => format!("{name}_total"),
            Some((name, _)) => name.to_string(),
            None => l.to_string(),
        })
        .collect();
    registered.sort();
    assert_eq!(registered, moved, "the metrics crates/metrics registers");
}

/// The sample `metric` summed over the sidecars serving on `ports`.
async fn summed(ports: &[u16], metric: &str) -> f64 {
    let mut sum = 0.0;
    for &port in ports {
        sum += sample(&metrics_of(port).await, metric).unwrap_or(0.0);
    }
    sum
}

/// Status replaces (PUT leasedjobs/status: claims, and completions sent as a PUT) the API
/// server answered 409, by its own counter; a superset of the claim conflicts.
async fn apiserver_claim_conflicts(client: &kube::Client) -> f64 {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.expect("API server metrics");
    text.lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{")
                && [
                    "code=\"409\"",
                    "resource=\"leasedjobs\"",
                    "subresource=\"status\"",
                    "verb=\"PUT\"",
                ]
                .iter()
                .all(|label| l.contains(label))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Claim writes answered 409 are counted as claim conflicts.
#[tokio::test]
async fn claim_conflicts_are_counted() {
    let Fixture { client, ns } = fixture!("conflicts");
    let _ctl = controller(&ns.name);
    // Strict FIFO: every claimer goes for the same oldest job, so all but one lose.
    let mut sidecars = Vec::new();
    for i in 0..4 {
        sidecars.push(Sidecar::start(&ns.name, "q", &format!("pod-{i}"), &["--spread", "1"]).await);
    }
    let ports: Vec<u16> = sidecars.iter().map(|s| s.proc.port.unwrap()).collect();
    assert_eq!(summed(&ports, "leasehold_claim_conflicts_total").await, 0.0);
    let before = apiserver_claim_conflicts(&client).await;
    let sidecars = std::sync::Arc::new(sidecars);
    let mut claimed = 0;
    for round in 0..10 {
        // Two long polls per sidecar wait; then jobs appear all at once.
        let waiting: Vec<_> = (0..8)
            .map(|i| {
                let sidecars = std::sync::Arc::clone(&sidecars);
                tokio::spawn(async move { sidecars[i % 4].claim(5).await.0 })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        for j in 0..3 {
            create_job(
                &client,
                &ns.name,
                json!({"metadata": {"name": format!("r{round}-{j}")}, "spec": {"queue": "q"}}),
            )
            .await;
        }
        for w in waiting {
            if w.await.unwrap() == 200 {
                claimed += 1;
            }
        }
        if summed(&ports, "leasehold_claim_conflicts_total").await > 0.0 {
            break;
        }
    }
    let counted = summed(&ports, "leasehold_claim_conflicts_total").await;
    let answered = apiserver_claim_conflicts(&client).await - before;
    assert!(
        counted > 0.0,
        "no claim conflict counted in {claimed} claims; the API server answered {answered} claim writes with 409"
    );
    // Every conflict the sidecars counted, the API server really answered (other tests may
    // add their own 409s to the API server's count meanwhile, never remove any).
    assert!(
        counted <= answered,
        "sidecars counted {counted} conflicts, the API server answered {answered} claim writes with 409"
    );
    let claims = summed(&ports, "leasehold_claims_total").await;
    assert_eq!(claims, f64::from(claimed));
}

/// Readiness follows the watch and shutdown, and logs can be JSON.
#[tokio::test]
async fn readiness_and_json_logs() {
    let Fixture { client, ns } = fixture!("health");
    let ctl = controller_with(&ns.name, "json-controller", &["--log-format", "json"]);
    let port = ctl.port.unwrap();
    wait_for("controller ready", Duration::from_secs(20), || async {
        (http_get(port, "/readyz").await?.0 == 200).then_some(())
    })
    .await;
    assert_eq!(http_get(port, "/healthz").await.unwrap().0, 200);
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "j"}, "spec": {}}),
    )
    .await;
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    wait_for("initialised", Duration::from_secs(10), || async {
        (jobs.get("j").await.ok()?.status?.phase? == Phase::Queued).then_some(())
    })
    .await;
    // Every line is a JSON object; the job's lines carry its reference. The controller logs
    // the initialisation after the API server's answer, which may come after the test's read:
    // wait for the line (the assertion below still needs it).
    let job_ref = format!("{}/j", ns.name);
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while !ctl.log_text().contains(&format!("\"job\":\"{job_ref}\"")) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let log = ctl.log_text();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(
        lines.iter().any(|l| l["job"] == job_ref.as_str()),
        "no line carries job={job_ref}: {log}"
    );
    // A sidecar is not ready until its watch synced, and stops being ready once draining.
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &["--drain-timeout", "30"]).await;
    let create = json!({"metadata": {"name": "held"}, "spec": {"queue": "q"}});
    create_job(&client, &ns.name, create).await;
    let (s, c) = sc.claim(10).await;
    assert_eq!(s, 200);
    // A long poll waiting when SIGTERM comes ends with 503 and claims nothing after it.
    let base = sc.base.clone();
    let waiting = tokio::spawn(async move {
        let r = http_client()
            .post(format!("{base}/v1/claim?wait=60"))
            .send()
            .await
            .unwrap();
        (
            r.status().as_u16(),
            r.json::<serde_json::Value>().await.unwrap_or_default(),
        )
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    sc.proc.signal("TERM");
    let (s, r) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the long poll ended at SIGTERM")
        .unwrap();
    assert_eq!(
        (s, r["error"].as_str()),
        (503, Some("shutting_down")),
        "{r}"
    );
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "late"}, "spec": {"queue": "q"}}),
    )
    .await;
    let sc_port = sc.proc.port.unwrap();
    wait_for("sidecar not ready", Duration::from_secs(5), || async {
        (http_get(sc_port, "/readyz").await?.0 == 503).then_some(())
    })
    .await;
    let (s, r) = sc.claim(0).await;
    assert_eq!(
        (s, r["error"].as_str()),
        (503, Some("shutting_down")),
        "{r}"
    );
    let (s, _) = sc.complete("held", &token_of(&c), json!("ok")).await;
    assert_eq!(s, 200);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        jobs_phase(&client, &ns.name, "late").await,
        Phase::Queued,
        "claimed while draining"
    );
}

async fn jobs_phase(client: &kube::Client, ns: &str, name: &str) -> Phase {
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), ns);
    jobs.get(name).await.unwrap().phase()
}

/// On SIGTERM, the sidecar lets its worker finish and the result is accepted.
#[tokio::test]
async fn sigterm_lets_the_worker_finish() {
    let Fixture { client, ns } = fixture!("drain");
    let _ctl = controller(&ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let mut sc = Sidecar::start(&ns.name, "q", "pod-a", &["--drain-timeout", "30"]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "j"}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
    )
    .await;
    let (_, token) = sc.claim_ok(10).await;
    sc.proc.signal("TERM");
    // The worker keeps going for longer than a lease: the sidecar keeps the lease alive.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (s, r) = sc.heartbeat("j", json!({"token": token})).await;
        assert_eq!(s, 200, "{r}");
    }
    let (s, r) = sc.complete("j", &token, json!({"by": "pod-a"})).await;
    assert_eq!(s, 200, "{r}");
    // With nothing held, the sidecar exits promptly and cleanly.
    let exited = wait_for("sidecar exit", Duration::from_secs(5), || {
        let done = sc.proc.child.try_wait().unwrap();
        async move { done }
    })
    .await;
    assert!(exited.success(), "{exited:?}");
    let job = jobs.get("j").await.unwrap();
    assert_eq!(job.phase(), Phase::Succeeded);
    assert_eq!(job.attempt(), 1);
    assert!(job.status.unwrap().failures.is_empty());
}

/// A native sidecar stopped after its worker requeues the job at once.
#[tokio::test]
async fn native_sidecar_stop_requeues_at_once() {
    let Fixture { client, ns } = fixture!("native");
    let _ctl = controller(&ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let a = Sidecar::start(&ns.name, "q", "pod-a", &["--release-on-shutdown"]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "j"}, "spec": {"queue": "q", "leaseDurationSeconds": 60}}),
    )
    .await;
    let (s, c) = a.claim(10).await;
    assert_eq!(s, 200);
    let (s, _) = a
        .heartbeat(
            "j",
            json!({"token": token_of(&c), "checkpoint": {"offset": 7}}),
        )
        .await;
    assert_eq!(s, 200);
    // The worker container has exited; Kubernetes now stops the native sidecar.
    let b = Sidecar::start(&ns.name, "q", "pod-b", &[]).await;
    let stopped = tokio::time::Instant::now();
    a.proc.signal("TERM");
    let (s, c2) = b.claim(10).await;
    assert_eq!(s, 200, "{c2}");
    assert!(
        stopped.elapsed() < Duration::from_secs(5),
        "requeued after {:?}, not at once",
        stopped.elapsed()
    );
    assert_eq!(c2["attempt"], 2);
    assert_eq!(c2["checkpoint"], json!({"offset": 7}));
    let job = jobs.get("j").await.unwrap();
    assert!(
        job.status.unwrap().failures.is_empty(),
        "a release is not a failed attempt"
    );
    // Never both at once: A's token no longer works anywhere.
    let (s, _) = b.complete("j", &token_of(&c), json!("a")).await;
    assert_eq!(s, 409);
}
