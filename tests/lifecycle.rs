//! Production behaviours of a job's life, against the real control plane with the real
//! controller and sidecar processes: backoff, delayed start, cancellation, deletion and TTL.

use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_testkit::*;
use serde_json::json;

/// A retryable failure with backoff is not claimable before retryAfter.
#[tokio::test]
async fn backoff_delays_the_retry() {
    let Fixture { client, ns } = fixture!("backoff");
    let _controller = controller(&ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "flaky"}, "spec": {"queue": "q", "maxAttempts": 3,
            "backoff": {"initialSeconds": 4, "maxSeconds": 4}}}),
    )
    .await;
    let (s, c) = sc.claim(10).await;
    assert_eq!(s, 200, "{c}");
    let (s, r) = sc
        .post(
            "/v1/jobs/flaky/fail",
            json!({"token": token_of(&c), "reason": "ProviderTimeout", "message": "upstream timed out", "retryable": true}),
        )
        .await;
    let failed_at = Timestamp::now();
    assert_eq!((s, r["phase"].as_str()), (200, Some("Queued")), "{r}");
    let job = jobs.get("flaky").await.unwrap();
    let retry_after = job
        .status
        .as_ref()
        .unwrap()
        .retry_after
        .clone()
        .expect("status.retryAfter")
        .0;
    // Equal jitter over 4 s: between 2 and 4 s from the failure (rounded up to a second).
    let delay = retry_after.duration_since(failed_at).as_secs_f64();
    assert!(
        (1.0..=5.0).contains(&delay),
        "retryAfter is {delay:.2}s after the failure"
    );
    // A long poll started now returns the job only once retryAfter has passed.
    let (s, c2) = sc.claim(15).await;
    let claimed_at = Timestamp::now();
    assert_eq!(s, 200, "{c2}");
    assert_eq!(c2["attempt"], 2);
    assert!(
        claimed_at >= retry_after,
        "claimed at {claimed_at}, before retryAfter {retry_after}"
    );
    assert!(
        claimed_at.duration_since(retry_after) < SignedDuration::from_secs(2),
        "claimed {} after retryAfter",
        claimed_at.duration_since(retry_after)
    );
}

/// The claim tells a handler its attempt history, and a retryable failure may set its own
/// delay: capped at the backoff's maxSeconds, refused without retryable, none on the last
/// attempt.
#[tokio::test]
async fn a_failure_sets_its_own_delay_and_the_claim_shows_the_history() {
    let Fixture { client, ns } = fixture!("retry-after");
    let _controller = controller(&ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "vendor"}, "spec": {"queue": "q", "maxAttempts": 3,
            "backoff": {"initialSeconds": 60, "maxSeconds": 120}}}),
    )
    .await;
    let (s, c) = sc.claim(10).await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(
        (&c["maxAttempts"], &c["failures"], &c["lastAttempt"]),
        (&json!(3), &json!([]), &json!(false)),
        "{c}"
    );
    let fail = |c: &serde_json::Value, extra: serde_json::Value| {
        let mut body = json!({"token": token_of(c), "reason": "RateLimited", "message": "429", "retryable": true});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    // Refused, nothing written: a delay for a failure that is not retried, one out of range.
    let (s, r) = sc
        .post(
            "/v1/jobs/vendor/fail",
            json!({"token": token_of(&c), "reason": "Bad", "retryable": false, "retryAfterSeconds": 5}),
        )
        .await;
    assert_eq!(
        (s, r["error"].as_str()),
        (400, Some("invalid_request")),
        "{r}"
    );
    assert!(
        r["message"].as_str().unwrap().contains("retryAfterSeconds"),
        "{r}"
    );
    let (s, r) = sc
        .post(
            "/v1/jobs/vendor/fail",
            fail(&c, json!({"retryAfterSeconds": 86401})),
        )
        .await;
    assert_eq!(
        (s, r["error"].as_str()),
        (400, Some("invalid_request")),
        "{r}"
    );
    assert_eq!(jobs.get("vendor").await.unwrap().phase(), Phase::Leased);
    // 2 s instead of the backoff's 30 to 60 s.
    let (s, r) = sc
        .post(
            "/v1/jobs/vendor/fail",
            fail(&c, json!({"retryAfterSeconds": 2})),
        )
        .await;
    let failed_at = Timestamp::now();
    assert_eq!((s, r["phase"].as_str()), (200, Some("Queued")), "{r}");
    let retry_after: Timestamp = r["retryAfter"]
        .as_str()
        .expect("retryAfter")
        .parse()
        .unwrap();
    let delay = retry_after.duration_since(failed_at).as_secs_f64();
    assert!(
        (0.0..=3.5).contains(&delay),
        "retryAfter is {delay:.2}s after the failure"
    );
    let (s, c2) = sc.claim(10).await;
    assert_eq!(s, 200, "{c2}");
    assert!(Timestamp::now() >= retry_after);
    assert_eq!(c2["failures"][0]["reason"], "RateLimited", "{c2}");
    assert_eq!(c2["failures"][0]["attempt"], 1, "{c2}");
    assert_eq!(c2["lastAttempt"], false, "{c2}");
    // A day is capped at maxSeconds (120 s).
    let (s, r) = sc
        .post(
            "/v1/jobs/vendor/fail",
            fail(&c2, json!({"retryAfterSeconds": 86400})),
        )
        .await;
    let failed_at = Timestamp::now();
    assert_eq!((s, r["phase"].as_str()), (200, Some("Queued")), "{r}");
    let retry_after: Timestamp = r["retryAfter"].as_str().unwrap().parse().unwrap();
    let delay = retry_after.duration_since(failed_at).as_secs_f64();
    assert!(
        (118.0..=121.5).contains(&delay),
        "retryAfter is {delay:.2}s after the failure"
    );
    // Make it claimable now (as `kubectl leasehold retry` would not: it is Queued) to see the
    // last attempt.
    jobs.patch_status(
        "vendor",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"retryAfter": null}})),
    )
    .await
    .unwrap();
    let (s, c3) = sc.claim(10).await;
    assert_eq!(s, 200, "{c3}");
    assert_eq!(
        (&c3["attempt"], &c3["lastAttempt"]),
        (&json!(3), &json!(true)),
        "{c3}"
    );
    assert_eq!(c3["failures"].as_array().unwrap().len(), 2, "{c3}");
    let (s, r) = sc
        .post(
            "/v1/jobs/vendor/fail",
            fail(&c3, json!({"retryAfterSeconds": 5})),
        )
        .await;
    assert_eq!((s, r["phase"].as_str()), (200, Some("Failed")), "{r}");
    assert!(r.get("retryAfter").is_none(), "{r}");
}

#[tokio::test]
async fn a_job_is_not_claimable_before_not_before() {
    let Fixture { client, ns } = fixture!("notbefore");
    let _controller = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    let not_before = Timestamp::from_second(Timestamp::now().as_second() + 4).unwrap();
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "later"}, "spec": {"queue": "q", "notBefore": not_before.to_string()}}),
    )
    .await;
    let (s, _) = sc.claim(1).await;
    assert_eq!(s, 204, "claimed before notBefore");
    let (s, c) = sc.claim(10).await;
    let claimed_at = Timestamp::now();
    assert_eq!(s, 200, "{c}");
    assert!(
        claimed_at >= not_before,
        "claimed at {claimed_at}, before notBefore {not_before}"
    );
    assert!(claimed_at.duration_since(not_before) < SignedDuration::from_secs(2));
}

async fn set_cancel(jobs: &Api<LeasedJob>, name: &str) {
    jobs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"cancel": true}})),
    )
    .await
    .unwrap();
}

/// Cancelling a queued job ends it at once, and no one claims it.
#[tokio::test]
async fn cancel_a_queued_job() {
    let Fixture { client, ns } = fixture!("cancel-queued");
    let _controller = controller(&ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "c"}, "spec": {"queue": "q"}}),
    )
    .await;
    wait_for("Queued", Duration::from_secs(10), || async {
        (jobs.get("c").await.ok()?.status?.phase? == Phase::Queued).then_some(())
    })
    .await;
    set_cancel(&jobs, "c").await;
    let job = wait_for("Cancelled", Duration::from_secs(10), || async {
        let j = jobs.get("c").await.ok()?;
        (j.phase() == Phase::Cancelled).then_some(j)
    })
    .await;
    let status = job.status.unwrap();
    assert_eq!(status.attempt, 0);
    assert!(status.finished_time.is_some());
    assert!(status
        .conditions
        .iter()
        .any(|c| c.type_ == "Cancelled" && c.status == "True"));
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    assert_eq!(sc.claim(1).await.0, 204);
}

/// A test namespace with a controller and a sidecar on queue `q`, and the job `name` in it,
/// claimed through the sidecar.
struct HeldJob {
    _ns: TestNamespace,
    _controller: Proc,
    jobs: Api<LeasedJob>,
    sidecar: Sidecar,
    token: String,
}

async fn held_job(fixture: Fixture, name: &str) -> HeldJob {
    let Fixture { client, ns } = fixture;
    let controller = controller(&ns.name);
    let sidecar = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": name}, "spec": {"queue": "q"}}),
    )
    .await;
    let (s, c) = sidecar.claim(10).await;
    assert_eq!(s, 200, "{c}");
    HeldJob {
        jobs: Api::namespaced(client, &ns.name),
        _ns: ns,
        _controller: controller,
        sidecar,
        token: token_of(&c),
    }
}

/// Cancelling a leased job stops its holder at the next heartbeat.
#[tokio::test]
async fn cancel_a_leased_job() {
    // Bind the whole HeldJob: its namespace and controller must live to the end.
    let held = held_job(fixture!("cancel-leased"), "c").await;
    let (jobs, sc, token) = (&held.jobs, &held.sidecar, &held.token);
    set_cancel(jobs, "c").await;
    wait_for("Cancelled", Duration::from_secs(10), || async {
        (jobs.get("c").await.ok()?.phase() == Phase::Cancelled).then_some(())
    })
    .await;
    let (s, r) = sc.heartbeat("c", json!({"token": token})).await;
    assert_eq!((s, r["error"].as_str()), (409, Some("cancelled")), "{r}");
    let (s, r) = sc.complete("c", token, json!("too late")).await;
    assert_eq!((s, r["error"].as_str()), (409, Some("cancelled")), "{r}");
    let job = jobs.get("c").await.unwrap();
    assert_eq!(job.phase(), Phase::Cancelled);
    assert!(job.status.unwrap().result.is_none());
}

#[tokio::test]
async fn deleting_a_leased_job_stops_its_holder() {
    // Bind the whole HeldJob: its namespace and controller must live to the end.
    let held = held_job(fixture!("delete-leased"), "d").await;
    let (jobs, sc, token) = (&held.jobs, &held.sidecar, &held.token);
    jobs.delete("d", &DeleteParams::default()).await.unwrap();
    let (s, r) = wait_for("the heartbeat refused", Duration::from_secs(10), || async {
        let (s, r) = sc.heartbeat("d", json!({"token": token})).await;
        (s != 200).then_some((s, r))
    })
    .await;
    assert!(
        (s == 404 && r["error"] == "job_not_found") || (s == 409 && r["error"] == "lease_lost"),
        "{s} {r}"
    );
}

/// Finished jobs are deleted after ttlSecondsAfterFinished.
#[tokio::test]
async fn ttl_deletes_finished_jobs() {
    let Fixture { client, ns } = fixture!("ttl");
    let _controller = controller(&ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(&client, &ns.name, json!({"metadata": {"name": "short"}, "spec": {"queue": "q", "ttlSecondsAfterFinished": 3}})).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "kept"}, "spec": {"queue": "q"}}),
    )
    .await;
    for _ in 0..2 {
        let (s, c) = sc.claim(10).await;
        assert_eq!(s, 200, "{c}");
        let (s, _) = sc
            .complete(c["name"].as_str().unwrap(), &token_of(&c), json!(1))
            .await;
        assert_eq!(s, 200);
    }
    let finished = Timestamp::now();
    wait_for("TTL deletion", Duration::from_secs(15), || async {
        jobs.get_opt("short").await.ok()?.is_none().then_some(())
    })
    .await;
    let after = Timestamp::now().duration_since(finished).as_secs_f64();
    assert!(
        after >= 2.0,
        "deleted {after:.1}s after finishing, before its TTL of 3s"
    );
    assert!(
        jobs.get_opt("kept").await.unwrap().is_some(),
        "a job without TTL was deleted"
    );
}
