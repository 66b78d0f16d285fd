//! A sidecar's watch of its queue stops while its worker is busy and the queue keeps changing,
//! and comes back for the next claim (crates/kube/src/queue_watch.rs); the jobs it holds stay watched all
//! along. Real processes (controller, sidecars) against the real control plane.

use std::time::Duration;

use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_testkit::*;
use serde_json::json;

/// `leasehold_queue_watch_running` and `leasehold_queue_watch_stops_total` of `sc`.
async fn queue_watch_of(sc: &Sidecar) -> (f64, f64) {
    let body = http_client()
        .get(format!("{}/metrics", sc.base))
        .send()
        .await
        .expect("sidecar reachable")
        .text()
        .await
        .unwrap();
    let running = sample(&body, "leasehold_queue_watch_running").expect("gauge rendered");
    let stops = sample(&body, "leasehold_queue_watch_stops_total").expect("counter rendered");
    (running, stops)
}

async fn create_queued(client: &kube::Client, ns: &str, names: impl Iterator<Item = String>) {
    for name in names {
        create_job(
            client,
            ns,
            json!({"metadata": {"name": name}, "spec": {"queue": "q"}}),
        )
        .await;
    }
}

/// A busy sidecar stops watching its queue and still hears of its own job.
#[tokio::test]
async fn busy_sidecar_still_hears_its_own_job() {
    let Fixture { client, ns } = fixture!("queue-watch-busy");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let _controller = controller(&ns.name);
    let busy = Sidecar::start(&ns.name, "q", "pod-busy", &[]).await;
    create_queued(&client, &ns.name, std::iter::once("mine".to_string())).await;
    let (claimed, token) = busy.claim_ok(10).await;
    assert_eq!(claimed["name"], "mine");
    assert_eq!(queue_watch_of(&busy).await, (1.0, 0.0));

    // The worker is busy with "mine"; the queue keeps changing (a creation and an
    // initialisation per job): more changes than a fresh list of the queue would bring.
    create_queued(&client, &ns.name, (0..20).map(|i| format!("other-{i}"))).await;
    wait_for(
        "the busy sidecar to stop watching its queue",
        Duration::from_secs(20),
        || async { (queue_watch_of(&busy).await == (0.0, 1.0)).then_some(()) },
    )
    .await;
    // Its own job is still watched: heartbeats go on, and a cancel reaches the worker.
    let (s, r) = busy.heartbeat("mine", json!({"token": token})).await;
    assert_eq!(s, 200, "{r}");
    jobs.patch(
        "mine",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"cancel": true}})),
    )
    .await
    .unwrap();
    wait_for(
        "the cancel at the holder's heartbeat",
        Duration::from_secs(10),
        || async {
            let (s, r) = busy.heartbeat("mine", json!({"token": token})).await;
            (s == 409 && r["error"] == "cancelled").then_some(())
        },
    )
    .await;

    // The next claim lists the queue again and gets the oldest job at once, even with wait=0.
    let (s, next) = busy.claim(0).await;
    assert_eq!(s, 200, "{next}");
    assert!(
        next["name"].as_str().unwrap().starts_with("other-"),
        "{next}"
    );
    assert_eq!(queue_watch_of(&busy).await, (1.0, 1.0));
    let (s, r) = busy
        .complete(
            next["name"].as_str().unwrap(),
            &token_of(&next),
            json!("done"),
        )
        .await;
    assert_eq!(s, 200, "{r}");
}

/// A waiting claim keeps the queue watch however busy the queue.
#[tokio::test]
async fn waiting_claim_keeps_the_queue_watch() {
    let Fixture { client, ns } = fixture!("queue-watch-wait");
    let _controller = controller(&ns.name);
    let waiting = Sidecar::start(&ns.name, "w", "pod-waiting", &[]).await;
    let claim = {
        let base = waiting.base.clone();
        tokio::spawn(async move {
            let r = http_client()
                .post(format!("{base}/v1/claim?wait=30"))
                .send()
                .await
                .unwrap();
            (
                r.status().as_u16(),
                r.json::<serde_json::Value>().await.unwrap(),
            )
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    // While the claim waits, the queue changes far more than a list of it would cost: 20 jobs
    // created and initialised, none claimable for an hour. The watch must stay, since it is
    // what will wake the claim.
    let later = (k8s_openapi::jiff::Timestamp::now()
        + k8s_openapi::jiff::SignedDuration::from_hours(1))
    .to_string();
    for i in 0..20 {
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": format!("later-{i:02}")},
                   "spec": {"queue": "w", "notBefore": later}}),
        )
        .await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        queue_watch_of(&waiting).await,
        (1.0, 0.0),
        "no stop while a claim waits"
    );
    assert!(!claim.is_finished(), "nothing claimable yet");
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "now"}, "spec": {"queue": "w"}}),
    )
    .await;
    let (s, got) = claim.await.unwrap();
    assert_eq!((s, got["name"].as_str()), (200, Some("now")), "{got}");
}

/// A superseded attempt is refused though its lease still names it.
///
/// A job claimed by another holder leaves this sidecar's held-jobs watch; its heartbeat must
/// then read the job and be refused, even while the Lease still names the old token (here the
/// new attempt is written straight to the status, as if its holder had not taken the Lease
/// over yet).
#[tokio::test]
async fn superseded_attempt_is_refused() {
    let Fixture { client, ns } = fixture!("queue-watch-superseded");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let a = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_queued(&client, &ns.name, std::iter::once("s".to_string())).await;
    let (_, token) = a.claim_ok(10).await;
    let (s, r) = a.heartbeat("s", json!({"token": token})).await;
    assert_eq!(s, 200, "{r}");
    let mut job = jobs.get("s").await.unwrap();
    let status = job.status.as_mut().unwrap();
    assert_eq!(status.phase, Some(Phase::Leased));
    status.attempt = 2;
    status.holder = Some("pod-b".into());
    status.token = Some(format!("2.{}", "0123456789abcdef".repeat(2)));
    jobs.replace_status("s", &PostParams::default(), &job)
        .await
        .unwrap();
    wait_for(
        "pod-a's heartbeat refused",
        Duration::from_secs(10),
        || async {
            let (s, r) = a.heartbeat("s", json!({"token": token})).await;
            (s == 409 && r["error"] == "lease_lost").then_some(())
        },
    )
    .await;
    // Every later call with the old token is refused too.
    let (s, r) = a.complete("s", &token, json!("late")).await;
    assert_eq!((s, r["error"].as_str()), (409, Some("lease_lost")), "{r}");
}
