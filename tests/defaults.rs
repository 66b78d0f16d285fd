//! A LeasedQueue's `spec.defaults` against the real control plane: a job that sets no
//! leaseDurationSeconds, maxAttempts or backoff gets its queue's, a job that sets one keeps
//! its own, and the claim records what its attempt runs under in `status.policy`, which the
//! sidecar's fence (a failure's next phase and backoff), the Lease and the controller's expiry
//! all read.

use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams};
use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::policy::Policy;
use leasehold_core::queue::LeasedQueue;
use leasehold_testkit::*;
use serde_json::json;

async fn policy_of(jobs: &Api<LeasedJob>, name: &str) -> Option<Policy> {
    jobs.get(name).await.unwrap().status.and_then(|s| s.policy)
}

#[tokio::test]
async fn a_queue_s_defaults_apply_where_a_job_sets_none_fixed_at_each_claim() {
    let Fixture { client, ns } = fixture!("queue-defaults");
    let _controller = controller(&ns.name);
    let queues: Api<LeasedQueue> = Api::namespaced(client.clone(), &ns.name);
    let queue: LeasedQueue = serde_json::from_value(json!({
        "apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedQueue",
        "metadata": {"name": "q", "namespace": ns.name},
        "spec": {"defaults": {"leaseDurationSeconds": 6, "maxAttempts": 1,
                              "backoff": {"initialSeconds": 40, "maxSeconds": 40}}},
    }))
    .unwrap();
    queues
        .patch(
            "q",
            &PatchParams::apply("defaults-test").force(),
            &Patch::Apply(&queue),
        )
        .await
        .unwrap();
    // Claimed in this order (priority first): one that sets nothing, one that sets its own
    // lease and attempts, one that sets nothing and is abandoned.
    for (name, priority, own) in [
        ("plain", 3, json!({})),
        (
            "own",
            2,
            json!({"leaseDurationSeconds": 20, "maxAttempts": 2}),
        ),
        ("abandoned", 1, json!({})),
    ] {
        let mut spec = json!({"queue": "q", "priority": priority});
        spec.as_object_mut()
            .unwrap()
            .extend(own.as_object().unwrap().clone());
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": name}, "spec": spec}),
        )
        .await;
    }
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    // The stored spec says what its author wrote: nothing, not a default.
    let plain = jobs.get("plain").await.unwrap();
    assert_eq!(
        (plain.spec.lease_duration_seconds, plain.spec.max_attempts),
        (None, None)
    );
    let sidecar = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;

    // "plain": the queue's lease, attempts and backoff, told to the worker, recorded at the
    // claim, and carried by the Lease.
    let (claim, token) = sidecar.claim_leased(10).await;
    assert_eq!(claim["name"], "plain", "{claim}");
    assert_eq!(claim["leaseDurationSeconds"], 6, "{claim}");
    let recorded = policy_of(&jobs, "plain").await.expect("status.policy");
    assert_eq!(
        (recorded.lease_duration_seconds, recorded.max_attempts),
        (6, 1)
    );
    assert_eq!(recorded.backoff.map(|b| b.initial_seconds), Some(40));
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), &ns.name);
    let lease_name = jobs.get("plain").await.unwrap().status.unwrap().lease_name;
    let lease = leases.get(&lease_name.unwrap()).await.unwrap();
    assert_eq!(lease.spec.unwrap().lease_duration_seconds, Some(6));
    // One retryable failure ends it: the queue allows 1 failed attempt.
    let (s, r) = sidecar
        .post(
            "/v1/jobs/plain/fail",
            json!({"token": token, "reason": "VendorDown", "message": "503", "retryable": true}),
        )
        .await;
    assert_eq!((s, r["phase"].as_str()), (200, Some("Failed")), "{r}");

    // "own": its own lease and attempts; the backoff it does not set is the queue's.
    let (claim, token) = sidecar.claim_ok(10).await;
    assert_eq!(claim["name"], "own", "{claim}");
    assert_eq!(claim["leaseDurationSeconds"], 20, "{claim}");
    let (s, r) = sidecar
        .post(
            "/v1/jobs/own/fail",
            json!({"token": token, "reason": "VendorDown", "message": "503", "retryable": true}),
        )
        .await;
    assert_eq!((s, r["phase"].as_str()), (200, Some("Queued")), "{r}");
    let own = jobs.get("own").await.unwrap();
    let status = own.status.unwrap();
    let delay = status
        .retry_after
        .expect("the queue's backoff")
        .0
        .duration_since(status.failures[0].time.0);
    assert!(
        (19..=41).contains(&delay.as_secs()),
        "retryAfter {delay:?} after the failure, not the queue's 20-40 s"
    );

    // "abandoned": its sidecar is SIGKILLed right after the claim, before its first renewal
    // (at 6 s / 3) could write a Lease; the controller expires it on the 6 s its claim
    // recorded, not on 60 s, and it ends Failed (the queue's 1 attempt).
    let (claim, _token) = sidecar.claim_ok(10).await;
    let claimed = Instant::now();
    sidecar.proc.signal("KILL");
    assert_eq!(claim["name"], "abandoned", "{claim}");
    let lease_name = jobs
        .get("abandoned")
        .await
        .unwrap()
        .status
        .unwrap()
        .lease_name;
    assert!(
        leases
            .get_opt(&lease_name.unwrap())
            .await
            .unwrap()
            .is_none(),
        "a Lease was written before the kill"
    );
    let job = wait_for(
        "the abandoned job to expire",
        Duration::from_secs(30),
        || async {
            let job = jobs.get("abandoned").await.unwrap();
            (job.phase() == Phase::Failed).then_some(job)
        },
    )
    .await;
    let took = claimed.elapsed();
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(20),
        "expired after {took:?}, where the recorded lease is 6 s"
    );
    let failures = job.status.unwrap().failures;
    assert_eq!(failures.len(), 1, "{failures:?}");

    let sidecar = Sidecar::start(&ns.name, "q", "pod-b", &[]).await;

    // A change of the queue's defaults applies from the next claim: a new job gets it.
    let mut changed = queue.clone();
    changed
        .spec
        .defaults
        .as_mut()
        .unwrap()
        .lease_duration_seconds = Some(9);
    queues
        .patch(
            "q",
            &PatchParams::apply("defaults-test").force(),
            &Patch::Apply(&changed),
        )
        .await
        .unwrap();
    // Each try makes a new job: the sidecar's watch may bring the change after a first claim.
    let mut n = 0;
    let got = wait_for(
        "a claim under the new default",
        Duration::from_secs(10),
        || {
            n += 1;
            let name = format!("later-{n}");
            let (client, ns, sidecar) = (&client, &ns.name, &sidecar);
            async move {
                create_job(
                    client,
                    ns,
                    json!({"metadata": {"name": name}, "spec": {"queue": "q", "priority": 5}}),
                )
                .await;
                let (claim, token) = sidecar.claim_ok(5).await;
                assert_eq!(claim["name"], name.as_str(), "{claim}");
                let _ = sidecar.complete(&name, &token, json!("ok")).await;
                (claim["leaseDurationSeconds"] == 9).then_some(n)
            }
        },
    )
    .await;
    assert!(got <= 3, "the new default took {got} claims to apply");
}
