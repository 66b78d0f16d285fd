//! A real outage of the API server: kube-apiserver is killed and stays down longer than a
//! lease. Kept in its own test binary, since every test sharing the control plane would see
//! the outage.

use std::time::Duration;

use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::fence::REASON_LEASE_EXPIRED;
use leasehold_testkit::*;
use serde_json::json;

/// Renewals failing for a whole lease lose the lease and the system recovers.
#[tokio::test]
async fn renewals_failing_for_a_lease_lose_it() {
    let Fixture { client, ns } = fixture!("outage");
    let _controller = controller(&ns.name);
    let a = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "j"}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
    )
    .await;
    let (s, c) = a.claim(10).await;
    assert_eq!(s, 200, "{c}");
    let token = c["token"].as_str().unwrap().to_string();

    // kube-apiserver crashes and stays down for longer than the lease.
    restart_apiserver("KILL", Duration::from_secs(7));

    // The sidecar's renewals failed for a whole lease duration: it says the lease is lost,
    // without asking anyone, even though the Lease may still name the token.
    let (s, r) = a.heartbeat("j", json!({"token": token})).await;
    assert_eq!((s, r["error"].as_str()), (409, Some("lease_lost")), "{r}");
    assert!(
        r["message"]
            .as_str()
            .unwrap()
            .contains("a whole lease duration"),
        "{r}"
    );

    // The controller and the watches recover: the job is requeued once, another worker claims
    // it, and the old holder's result is refused.
    let client = leasehold_testkit::client().await;
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let b = Sidecar::start(&ns.name, "q", "pod-b", &[]).await;
    let (s, c2) = b.claim(30).await;
    assert_eq!(s, 200, "{c2}");
    assert_eq!(c2["attempt"], 2);
    let (s, _) = a.complete("j", &token, json!("late")).await;
    assert_eq!(s, 409);
    let (s, _) = b
        .complete("j", c2["token"].as_str().unwrap(), json!("b"))
        .await;
    assert_eq!(s, 200);
    let job = jobs.get("j").await.unwrap();
    assert_eq!(job.phase(), Phase::Succeeded);
    let status = job.status.unwrap();
    assert_eq!(status.result, Some(json!("b")));
    assert_eq!(status.failures.len(), 1);
    assert_eq!(status.failures[0].reason, REASON_LEASE_EXPIRED);
}
