//! The sidecar and the controller as real processes, driven over HTTP as a worker drives them,
//! with real faults: SIGKILL and SIGSTOP.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, ResourceExt};
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::fence::REASON_LEASE_EXPIRED;
use leasehold_core::lease;
use leasehold_testkit::*;
use serde_json::{json, Value};

/// The sidecar refuses bad tokens, unknown jobs and bad bodies, and keeps serving.
#[tokio::test]
async fn refuses_bad_requests_and_keeps_serving() {
    let Fixture { client, ns } = fixture!("refusals");
    let _controller = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    // x carries its producer's trace context; y's traceparent is malformed (uppercase hex),
    // which must not break its claim: the claim carries no trace context then.
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "x", "annotations": {
            "leasehold.dev/traceparent": traceparent,
            "leasehold.dev/tracestate": "rojo=00f067aa0ba902b7",
        }}, "spec": {"queue": "q"}}),
    )
    .await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "y", "annotations": {
            "leasehold.dev/traceparent": "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "leasehold.dev/tracestate": "rojo=00f067aa0ba902b7",
        }}, "spec": {"queue": "q"}}),
    )
    .await;
    let (s, cx) = sc.claim(10).await;
    assert_eq!(s, 200, "{cx}");
    let (s, cy) = sc.claim(10).await;
    assert_eq!(s, 200, "{cy}");
    let traced = |c: &Value| {
        if c["name"] == "x" {
            assert_eq!(c["traceparent"], traceparent, "{c}");
            assert_eq!(c["tracestate"], "rojo=00f067aa0ba902b7", "{c}");
        } else {
            let claimed = c.as_object().unwrap();
            assert!(!claimed.contains_key("traceparent"), "{c}");
            assert!(!claimed.contains_key("tracestate"), "{c}");
        }
    };
    traced(&cx);
    traced(&cy);
    let (x, y) = (
        cx["name"].as_str().unwrap().to_string(),
        cy["name"].as_str().unwrap().to_string(),
    );
    let (tx, ty) = (token_of(&cx), token_of(&cy));
    assert_ne!(x, y);
    assert_eq!(cx["attempt"], 1);
    assert_eq!(cx["leaseDurationSeconds"], 60);

    // Release x and claim it again: tx is now stale.
    let (s, _) = sc
        .post(&format!("/v1/jobs/{x}/release"), json!({"token": tx}))
        .await;
    assert_eq!(s, 200);
    let (s, cx2) = sc.claim(10).await;
    assert_eq!((s, cx2["name"].as_str().unwrap()), (200, x.as_str()));
    assert_eq!(cx2["attempt"], 2);
    traced(&cx2);
    let tx2 = token_of(&cx2);

    let hb = |name: &str| format!("/v1/jobs/{name}/heartbeat");
    let cases: Vec<(String, Vec<u8>, u16, &str)> = vec![
        (hb(&x), br#"{}"#.to_vec(), 400, "invalid_token"),
        (hb(&x), br#"{"token": ""}"#.to_vec(), 400, "invalid_token"),
        (
            hb(&x),
            br#"{"token": "not-a-token"}"#.to_vec(),
            400,
            "invalid_token",
        ),
        (
            hb(&x),
            json!({"token": tx}).to_string().into_bytes(),
            409,
            "lease_lost",
        ),
        (
            hb(&x),
            json!({"token": ty}).to_string().into_bytes(),
            409,
            "lease_lost",
        ),
        (
            hb("no-such-job"),
            json!({"token": tx2}).to_string().into_bytes(),
            404,
            "job_not_found",
        ),
        (hb(&x), b"this is not json".to_vec(), 400, "invalid_json"),
        (
            hb("Bad_Name"),
            json!({"token": tx2}).to_string().into_bytes(),
            400,
            "invalid_name",
        ),
        (
            format!("/v1/jobs/{x}/complete"),
            json!({"token": tx, "result": "stale"})
                .to_string()
                .into_bytes(),
            409,
            "lease_lost",
        ),
        (
            format!("/v1/jobs/{x}/complete"),
            json!({"token": ty, "result": "other job"})
                .to_string()
                .into_bytes(),
            409,
            "lease_lost",
        ),
        (
            format!("/v1/jobs/{x}/fail"),
            json!({"token": tx2, "reason": "has space", "message": "m", "retryable": true})
                .to_string()
                .into_bytes(),
            400,
            "invalid_request",
        ),
        (
            hb(&x),
            json!({"token": tx2, "checkpoint": "a".repeat(70_000)})
                .to_string()
                .into_bytes(),
            413,
            "too_large",
        ),
        (
            hb(&x),
            vec![b' '; leasehold::sidecar::MAX_BODY_BYTES + 1024],
            413,
            "too_large",
        ),
        (
            "/v1/claim?wait=forever".to_string(),
            vec![],
            400,
            "invalid_request",
        ),
    ];
    for (path, body, want_status, want_code) in cases {
        let (status, answer) = sc.post_raw(&path, body).await;
        assert_eq!(status, want_status, "{path}: {answer}");
        assert_eq!(answer["error"], want_code, "{path}: {answer}");
        let text = answer.to_string();
        for secret in [&tx2, &ty] {
            assert!(
                !text.contains(secret.as_str()),
                "{path}: a refusal revealed a current token: {text}"
            );
        }
        assert!(
            answer["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{answer}"
        );
    }
    // Still serving; the rightful holders still work, and nothing refused was written.
    let (s, r) = sc
        .heartbeat(&x, json!({"token": tx2, "checkpoint": {"offset": 1}}))
        .await;
    assert_eq!(s, 200, "{r}");
    assert!(r["expiresAt"].is_string() && r["renewTime"].is_string());
    let (s, r) = sc.complete(&y, &ty, json!({"ok": "y"})).await;
    assert_eq!((s, r["phase"].as_str()), (200, Some("Succeeded")), "{r}");
    let (s, r) = sc.complete(&y, &ty, json!({"again": true})).await;
    assert_eq!((s, r["error"].as_str()), (409, Some("job_finished")), "{r}");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let xj = jobs.get(&x).await.unwrap();
    assert_eq!(xj.phase(), Phase::Leased);
    assert!(xj.status.unwrap().result.is_none());
    assert_eq!(
        jobs.get(&y).await.unwrap().status.unwrap().result,
        Some(json!({"ok": "y"}))
    );
}

/// Heartbeats keep a 30 s job alive without touching the job.
#[tokio::test]
async fn heartbeats_keep_a_job_alive() {
    let Fixture { client, ns } = fixture!("alive");
    let _controller = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "long"}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
    )
    .await;
    let (_, token) = sc.claim_leased(10).await;
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let rv_after_claim = jobs.get("long").await.unwrap().metadata.resource_version;
    let first_renew = leases
        .get(&lease::lease_name("long"))
        .await
        .unwrap()
        .spec
        .unwrap()
        .renew_time;
    // 30 s of work: a heartbeat with a checkpoint every 2 s from the worker, and the
    // sidecar's own background renewals in between.
    for step in 0..15 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (s, r) = sc
            .heartbeat(
                "long",
                json!({"token": token, "checkpoint": {"step": step}}),
            )
            .await;
        assert_eq!(s, 200, "step {step}: {r}");
    }
    let job = jobs.get("long").await.unwrap();
    assert_eq!(job.phase(), Phase::Leased);
    assert_eq!(job.attempt(), 1);
    assert!(job.status.as_ref().unwrap().failures.is_empty());
    assert_eq!(
        job.metadata.resource_version, rv_after_claim,
        "heartbeats wrote to the LeasedJob"
    );
    let l = leases.get(&lease::lease_name("long")).await.unwrap();
    assert_ne!(l.spec.as_ref().unwrap().renew_time, first_renew);
    assert_eq!(lease::checkpoint(&l), Some(json!({"step": 14})));
    let (s, _) = sc.complete("long", &token, json!("done")).await;
    assert_eq!(s, 200);
}

/// The Lease of `job` as it is now: (holderIdentity, renewTime, leaseTransitions).
async fn lease_now(leases: &Api<Lease>, job: &str) -> (Option<String>, String, Option<i32>) {
    let l = leases.get(&lease::lease_name(job)).await.unwrap();
    let spec = l.spec.unwrap_or_default();
    (
        spec.holder_identity,
        format!("{:?}", spec.renew_time),
        spec.lease_transitions,
    )
}

/// An ended attempt's lease is left as is and its token stays refused.
///
/// An attempt its holder ended leaves its Lease naming the ended token (no Lease write after a
/// complete or a release: the job's status fences the attempt), and that Lease fences nothing:
/// the ended token's heartbeats are refused without a write, by the sidecar that ended it and
/// by one that never held it, the controller leaves the Lease alone past its old release grace,
/// and the next claim takes the Lease over.
#[tokio::test]
async fn ended_attempts_lease_is_left_alone() {
    let Fixture { client, ns } = fixture!("ended-lease");
    let _controller = controller(&ns.name);
    let a = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "done"}, "spec": {"queue": "q"}}),
    )
    .await;
    let (_, t1) = a.claim_ok(10).await;
    let (s, r) = a.heartbeat("done", json!({"token": t1})).await;
    assert_eq!(s, 200, "{r}");
    let (s, r) = a.complete("done", &t1, json!("ok")).await;
    assert_eq!((s, r["phase"].as_str()), (200, Some("Succeeded")), "{r}");
    let left = lease_now(&leases, "done").await;
    assert_eq!(
        left.0.as_deref(),
        Some(t1.as_str()),
        "the Lease was written"
    );
    // The sidecar that ended the attempt refuses its token at once.
    let (s, r) = a.heartbeat("done", json!({"token": t1})).await;
    assert_eq!((s, r["error"].as_str()), (409, Some("job_finished")), "{r}");
    // So does a sidecar that never held it (a restarted one), although the Lease would accept
    // the renewal: it asks the job first.
    let b = Sidecar::start(&ns.name, "q", "pod-b", &[]).await;
    let (s, r) = b.heartbeat("done", json!({"token": t1})).await;
    assert_eq!((s, r["error"].as_str()), (409, Some("job_finished")), "{r}");
    // Past the 5 s in which the controller used to release it on the holder's behalf, nothing
    // has written the Lease.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        lease_now(&leases, "done").await,
        left,
        "the Lease was written"
    );

    // A release: the job is Queued again with its Lease still naming attempt 1.
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "back"}, "spec": {"queue": "q"}}),
    )
    .await;
    let (c, t1) = a.claim_leased(10).await;
    assert_eq!(c["name"].as_str(), Some("back"), "{c}");
    let (s, r) = a.post("/v1/jobs/back/release", json!({"token": t1})).await;
    assert_eq!((s, r["phase"].as_str()), (200, Some("Queued")), "{r}");
    let left = lease_now(&leases, "back").await;
    assert_eq!(left.0.as_deref(), Some(t1.as_str()));
    for sc in [&a, &b] {
        let (s, r) = sc.heartbeat("back", json!({"token": t1})).await;
        assert_eq!((s, r["error"].as_str()), (409, Some("lease_lost")), "{r}");
    }
    assert_eq!(
        lease_now(&leases, "back").await,
        left,
        "a refused heartbeat wrote the Lease"
    );
    // The next claim's first renewal takes the Lease over from the ended attempt, and the
    // claim holds the job.
    let (c, t2) = b.claim_leased(10).await;
    assert_eq!(
        (c["name"].as_str(), c["attempt"].as_i64()),
        (Some("back"), Some(2)),
        "{c}"
    );
    let taken = lease_now(&leases, "back").await;
    assert_eq!(taken.0.as_deref(), Some(t2.as_str()));
    assert_eq!(taken.2, Some(left.2.unwrap_or(0) + 1));
    let (s, r) = a.heartbeat("back", json!({"token": t1})).await;
    assert_eq!((s, r["error"].as_str()), (409, Some("lease_lost")), "{r}");
    let (s, r) = b.complete("back", &t2, json!("ok")).await;
    assert_eq!((s, r["phase"].as_str()), (200, Some("Succeeded")), "{r}");
}

/// The first renewal writes the lease and a quick job writes none.
///
/// The claim's write starts the lease and the attempt's first renewal writes its Lease
/// (docs/protocol.md, "The Lease is written by the first renewal"): a job done before then
/// leaves no Lease (two writes in all), and the background renewal a third of the lease after
/// the claim writes it when the worker does not heartbeat.
#[tokio::test]
async fn first_renewal_writes_the_lease() {
    let Fixture { client, ns } = fixture!("first-renewal");
    let _controller = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "quick"}, "spec": {"queue": "q", "leaseDurationSeconds": 30}}),
    )
    .await;
    let (_, token) = sc.claim_ok(10).await;
    let (s, r) = sc.complete("quick", &token, json!("done")).await;
    assert_eq!((s, r["phase"].as_str()), (200, Some("Succeeded")), "{r}");
    assert!(
        leases
            .get_opt(&lease::lease_name("quick"))
            .await
            .unwrap()
            .is_none(),
        "a job done before its first renewal wrote a Lease"
    );

    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "slow"}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
    )
    .await;
    let (_, token) = sc.claim_ok(10).await;
    let l = wait_for(
        "the background renewal to write the Lease",
        Duration::from_secs(3),
        || async { leases.get_opt(&lease::lease_name("slow")).await.ok()? },
    )
    .await;
    assert_eq!(lease::holder_identity(&l), Some(token.as_str()));
    assert_eq!(lease::holder_pod(&l), Some("pod-a"));
    let job = jobs.get("slow").await.unwrap();
    assert_eq!(
        l.owner_references()[0].uid,
        job.metadata.uid.clone().unwrap()
    );
    // Well past the lease, the background renewals keep it.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(jobs.get("slow").await.unwrap().phase(), Phase::Leased);
    let (s, r) = sc.complete("slow", &token, json!("done")).await;
    assert_eq!(s, 200, "{r}");

    // Two first renewals at once (a worker's background heartbeater and its chunk loop): the
    // one that finds the Lease taken by the other still writes its checkpoint.
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "twice"}, "spec": {"queue": "q", "leaseDurationSeconds": 60}}),
    )
    .await;
    let (_, t) = sc.claim_ok(10).await;
    let (plain, carrying) = tokio::join!(
        sc.heartbeat("twice", json!({"token": t})),
        sc.heartbeat("twice", json!({"token": t, "checkpoint": {"chunk": 1}})),
    );
    assert_eq!((plain.0, carrying.0), (200, 200), "{plain:?} {carrying:?}");
    let l = leases.get(&lease::lease_name("twice")).await.unwrap();
    assert_eq!(lease::checkpoint(&l), Some(json!({"chunk": 1})));
    let (s, r) = sc.complete("twice", &t, json!("done")).await;
    assert_eq!(s, 200, "{r}");
}

/// An attempt without a lease yet expires a lease after its claim.
///
/// Before its first renewal the claim is the attempt's only renewal: a worker killed then loses
/// its job a lease duration after the claim (the controller's clock starts when it sees the
/// claim), and a sidecar frozen past the lease before its first renewal never writes a Lease
/// for the attempt that ended meanwhile.
#[tokio::test]
async fn leaseless_attempt_expires() {
    let Fixture { client, ns } = fixture!("no-lease-yet");
    let _controller = controller(&ns.name);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "k"}, "spec": {"queue": "q", "leaseDurationSeconds": 6}}),
    )
    .await;
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    let before = Timestamp::now();
    sc.claim_ok(10).await;
    let claimed = Timestamp::now();
    sc.proc.signal("KILL");
    drop(sc);
    let (job, seen_at) = wait_for("the expiry", Duration::from_secs(20), || async {
        let j = jobs.get("k").await.ok()?;
        (j.failed_attempts() == 1).then(|| (j, Timestamp::now()))
    })
    .await;
    assert_eq!(job.status.unwrap().failures[0].reason, REASON_LEASE_EXPIRED);
    let (early, late) = (
        seen_at.duration_since(claimed).as_secs_f64(),
        seen_at.duration_since(before).as_secs_f64(),
    );
    println!("requeued {early:.2}s after the claim's answer (lease 6s)");
    assert!(early >= 6.0 - 0.1, "requeued early: {early:.2}s");
    assert!(late <= 6.0 + 1.0, "requeued late: {late:.2}s");
    assert!(leases
        .get_opt(&lease::lease_name("k"))
        .await
        .unwrap()
        .is_none());

    // Frozen right after the claim, for longer than the lease.
    let sc = Sidecar::start(&ns.name, "q", "pod-b", &[]).await;
    let (c, token) = sc.claim_ok(10).await;
    assert_eq!(c["attempt"].as_i64(), Some(2), "{c}");
    sc.proc.signal("STOP");
    wait_for("the second expiry", Duration::from_secs(20), || async {
        let j = jobs.get("k").await.ok()?;
        (j.failed_attempts() == 2).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    sc.proc.signal("CONT");
    let (s, r) = sc.heartbeat("k", json!({"token": token})).await;
    assert_eq!((s, r["error"].as_str()), (409, Some("lease_lost")), "{r}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let l = leases.get_opt(&lease::lease_name("k")).await.unwrap();
    assert!(
        l.as_ref().and_then(lease::holder_identity) != Some(token.as_str()),
        "the woken sidecar wrote a Lease for its ended attempt: {l:?}"
    );
}

/// A restarted sidecar writes the lease at the first heartbeat.
///
/// A sidecar restarted before its attempt's first renewal (the worker kept its token) writes
/// the Lease at the worker's first heartbeat: the job names it as the holder.
#[tokio::test]
async fn restarted_sidecar_writes_the_lease() {
    let Fixture { client, ns } = fixture!("restart-first");
    let _controller = controller(&ns.name);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "r"}, "spec": {"queue": "q", "leaseDurationSeconds": 60}}),
    )
    .await;
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    let (_, token) = sc.claim_ok(10).await;
    sc.proc.signal("KILL");
    drop(sc);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    let (s, r) = sc
        .heartbeat("r", json!({"token": token, "checkpoint": {"at": 1}}))
        .await;
    assert_eq!(s, 200, "{r}");
    let l = leases.get(&lease::lease_name("r")).await.unwrap();
    assert_eq!(lease::holder_identity(&l), Some(token.as_str()));
    assert_eq!(lease::checkpoint(&l), Some(json!({"at": 1})));
    let (s, r) = sc.complete("r", &token, json!(1)).await;
    assert_eq!(s, 200, "{r}");
}

/// Kills the sidecar (and so the pod's worker) with SIGKILL; returns the renewTime of the last
/// heartbeat the Lease recorded.
async fn kill_holder(sc: Sidecar, leases: &Api<Lease>, job: &str) -> Timestamp {
    sc.proc.signal("KILL");
    drop(sc);
    let l = leases.get(&lease::lease_name(job)).await.unwrap();
    l.spec.unwrap().renew_time.unwrap().0
}

/// A killed worker loses its job within the lease and maxAttempts deaths fail it.
#[tokio::test]
async fn killed_worker_loses_its_job() {
    let Fixture { client, ns } = fixture!("death");
    let _controller = controller(&ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    create_job(&client, &ns.name, json!({"metadata": {"name": "doomed"}, "spec": {"queue": "q", "leaseDurationSeconds": 5, "maxAttempts": 2}})).await;
    for death in 1..=2 {
        let sc = Sidecar::start(&ns.name, "q", &format!("pod-{death}"), &[]).await;
        let (s, c) = sc.claim(15).await;
        assert_eq!((s, c["attempt"].as_i64()), (200, Some(death)), "{c}");
        tokio::time::sleep(Duration::from_secs(3)).await; // a background renewal or two
        let last_heartbeat = kill_holder(sc, &leases, "doomed").await;
        // status.failures[].time is a metav1.Time, stored to the second: time the requeue
        // on this side instead, polling every 50 ms.
        let (job, seen_at) = wait_for("the expiry", Duration::from_secs(20), || async {
            let j = jobs.get("doomed").await.ok()?;
            (j.failed_attempts() as i64 == death).then(|| (j, Timestamp::now()))
        })
        .await;
        let status = job.status.clone().unwrap();
        let failure = status.failures.last().unwrap();
        assert_eq!(failure.reason, REASON_LEASE_EXPIRED);
        assert_eq!(failure.attempt as i64, death);
        let waited = seen_at.duration_since(last_heartbeat).as_secs_f64();
        println!("death {death}: requeued {waited:.2}s after the last heartbeat (lease 5s)");
        assert!(
            waited <= 5.0 + 2.0,
            "requeued {waited:.2}s after the last heartbeat"
        );
        assert!(
            waited >= 5.0 - 0.1,
            "requeued early: {waited:.2}s after the last heartbeat"
        );
        if death == 1 {
            assert_eq!(job.phase(), Phase::Queued);
        } else {
            assert_eq!(job.phase(), Phase::Failed);
            let cond = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Failed")
                .expect("Failed condition");
            assert_eq!(cond.reason, "AttemptsExhausted");
            assert!(cond.message.contains("LeaseExpired"), "{}", cond.message);
        }
    }
}

#[tokio::test]
async fn a_checkpoint_written_by_attempt_1_reaches_attempt_2() {
    let Fixture { client, ns } = fixture!("checkpoint");
    let _controller = controller(&ns.name);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "resume"}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
    )
    .await;
    let a = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    let (_, c1) = a.claim(10).await;
    assert_eq!(c1["checkpoint"], Value::Null);
    let checkpoint = json!({"offset": 4096, "state": {"words": 612, "inWord": true}, "note": "ü"});
    let (s, _) = a
        .heartbeat(
            "resume",
            json!({"token": token_of(&c1), "checkpoint": checkpoint}),
        )
        .await;
    assert_eq!(s, 200);
    // Attempt 1 dies; the controller moves the checkpoint to the job as it requeues.
    kill_holder(a, &leases, "resume").await;
    let b = Sidecar::start(&ns.name, "q", "pod-b", &[]).await;
    let (s, c2) = b.claim(20).await;
    assert_eq!(s, 200, "{c2}");
    assert_eq!(c2["attempt"], 2);
    assert_eq!(c2["checkpoint"], checkpoint);
    // The expiry is in the history the claim hands over.
    assert_eq!(c2["failures"][0]["reason"], "LeaseExpired", "{c2}");
    assert_eq!(c2["failures"][0]["holder"], "pod-a", "{c2}");
    assert_eq!(
        (&c2["maxAttempts"], &c2["lastAttempt"]),
        (&json!(3), &json!(false))
    );
}

/// Reads the example worker's JSON events from its stdout.
fn spawn_events(stdout: std::process::ChildStdout) -> tokio::sync::mpsc::UnboundedReceiver<Value> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if tx.send(v).is_err() {
                    break;
                }
            }
        }
    });
    rx
}

async fn next_event(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Value>,
    pred: impl Fn(&Value) -> bool,
    what: &str,
) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let ev = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
            .unwrap_or_else(|| panic!("worker exited before {what}"));
        if pred(&ev) {
            return ev;
        }
    }
}

/// A zombie worker woken after its lease cannot overwrite the new owner.
#[tokio::test]
async fn zombie_worker_cannot_overwrite() {
    let Fixture { client, ns } = fixture!("zombie");
    // Every transition as an Event: the test counts the Completed ones.
    let _controller = controller_with(&ns.name, "test-controller", &["--events", "all"]);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    // Slow real work: 4 KiB chunks of the GPL-3 text, 0.5 s each (about 18 s in all).
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "zombie"}, "spec": {"queue": "q", "leaseDurationSeconds": 5,
            "payload": {"task": "wordcount", "file": "GPL-3", "chunkBytes": 2048, "chunkDelaySeconds": 0.5}}}),
    )
    .await;
    // Worker A: the example Python worker beside its own sidecar. --insist makes it send its
    // result even after it learns its lease is gone, as a buggy or naive worker would.
    let sidecar_a = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    let worker_py = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/worker.py");
    let mut worker_a = Proc::spawn(
        &format!("{}-worker-a", ns.name),
        std::path::Path::new("python3"),
        &[
            worker_py,
            "--sidecar",
            &sidecar_a.base,
            "--name",
            "worker-a",
            "--once",
            "--insist",
            "--wait",
            "10",
        ],
        Stdio::piped(),
    );
    let mut events = spawn_events(worker_a.child.stdout.take().unwrap());
    next_event(&mut events, |e| e["event"] == "claimed", "A's claim").await;
    next_event(
        &mut events,
        |e| e["event"] == "heartbeat" && e["status"] == 200 && e["offset"].as_i64() >= Some(4096),
        "A's progress",
    )
    .await;
    // Freeze A's whole pod: worker and sidecar.
    worker_a.signal("STOP");
    sidecar_a.proc.signal("STOP");
    let frozen_at = tokio::time::Instant::now();
    // The controller requeues; B claims, resumes from A's checkpoint and completes.
    let b = Sidecar::start(&ns.name, "q", "pod-b", &[]).await;
    let (s, c) = b.claim(20).await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(c["attempt"], 2);
    assert!(
        c["checkpoint"]["offset"].as_i64().unwrap_or(0) >= 4096,
        "B did not get A's checkpoint: {c}"
    );
    let (s, r) = b
        .complete("zombie", &token_of(&c), json!({"by": "B"}))
        .await;
    assert_eq!(s, 200, "{r}");
    tokio::time::sleep_until(frozen_at + Duration::from_secs(12)).await;
    sidecar_a.proc.signal("CONT");
    worker_a.signal("CONT");
    // A wakes believing it still holds the job: its heartbeat and its result are refused.
    let hb = next_event(
        &mut events,
        |e| e["event"] == "heartbeat" && e["status"] != 200,
        "A's refused heartbeat",
    )
    .await;
    assert_eq!(hb["status"], 409, "{hb}");
    let done = next_event(
        &mut events,
        |e| e["event"] == "complete",
        "A's late complete",
    )
    .await;
    assert_eq!(done["status"], 409, "{done}");
    let job = jobs.get("zombie").await.unwrap();
    let status = job.status.clone().unwrap();
    assert_eq!(job.phase(), Phase::Succeeded);
    assert_eq!(status.result, Some(json!({"by": "B"})));
    assert_eq!(status.attempt, 2);
    assert_eq!(status.failures.len(), 1);
    assert_eq!(status.failures[0].reason, REASON_LEASE_EXPIRED);
    assert_eq!(
        status
            .conditions
            .iter()
            .filter(|c| c.type_ == "Complete")
            .count(),
        1
    );
    // Exactly one completion was recorded as an Event.
    let events_api: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), &ns.name);
    let completed = wait_for("the Completed event", Duration::from_secs(10), || async {
        let list = events_api.list(&Default::default()).await.ok()?;
        let n = list
            .items
            .iter()
            .filter(|e| e.reason.as_deref() == Some("Completed"))
            .count();
        (n >= 1).then_some(n)
    })
    .await;
    assert_eq!(completed, 1);
}

#[tokio::test]
async fn a_silent_worker_stops_being_renewed_and_loses_its_job() {
    let Fixture { client, ns } = fixture!("silent");
    let _controller = controller(&ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    // The effective silence limit is max(--worker-timeout, leaseDurationSeconds) = 5 s.
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &["--worker-timeout", "1"]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "hung"}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
    )
    .await;
    let (s, c) = sc.claim(10).await;
    assert_eq!(s, 200, "{c}");
    // The worker hangs: no call at all. Background renewal stops, and the lease runs out.
    let job = wait_for("the expiry", Duration::from_secs(25), || async {
        let j = jobs.get("hung").await.ok()?;
        (j.failed_attempts() == 1).then_some(j)
    })
    .await;
    assert_eq!(job.phase(), Phase::Queued);
    let (s, r) = sc.heartbeat("hung", json!({"token": token_of(&c)})).await;
    assert_eq!((s, r["error"].as_str()), (409, Some("lease_lost")), "{r}");
}
