//! Expiry after real kube-apiserver restarts: kept in its own test binary, since every test
//! sharing the control plane would see the restarts.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use leasehold_core::crd::LeasedJob;
use leasehold_core::fence::REASON_LEASE_EXPIRED;
use leasehold_core::lease::lease_name;
use leasehold_testkit::*;
use serde_json::json;

/// After API-server restarts, a dead holder is requeued within its lease plus one second.
///
/// Expiry after kube-apiserver restarts, and after a compaction and restart (issue: "expiry <= LD + 1 s once the API server is
/// ready, for TERM and KILL, in the controller, leader and standbys"). Two controller replicas
/// and a sidecar ride through each restart; then a job is claimed and its holder killed, and
/// the time from the Lease's last renewTime to the requeue must stay within
/// leaseDurationSeconds + 1 s.
#[tokio::test]
async fn dead_holder_requeued_after_apiserver_restarts() {
    const LD: u64 = 5;
    let Fixture { ns, .. } = fixture!("restart-expiry");
    let election = [
        "--leader-lease-duration",
        "3",
        "--leader-renew-deadline",
        "2",
        "--leader-retry-period",
        "0.5",
    ];
    let _a = controller_with(&ns.name, "ctl-a", &election);
    let _b = controller_with(&ns.name, "ctl-b", &election);
    let mut figures = Vec::new();
    // (how the API server goes down, signal, seconds down); "compaction" compacts etcd first,
    // so that every watch resumed after the restart is answered 410 Gone.
    let rounds = [
        ("TERM", "TERM", 0),
        ("KILL", "KILL", 3),
        ("compaction", "TERM", 0),
        ("TERM", "TERM", 0),
        ("KILL", "KILL", 3),
        ("compaction", "TERM", 0),
    ];
    for (round, (fault, signal, down)) in rounds.into_iter().enumerate() {
        let queue = format!("q{round}");
        let holder = Sidecar::start(&ns.name, &queue, &format!("holder-{round}"), &[]).await;
        // Let both watches of every process settle before the restart.
        tokio::time::sleep(Duration::from_secs(2)).await;
        if fault == "compaction" {
            let c = faults::compact_etcd().await;
            assert!(c.old_read_error.contains("compacted"), "{c:?}");
        }
        restart_apiserver(signal, Duration::from_secs(down));
        let client = leasehold_testkit::client().await;
        let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
        let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
        let name = format!("j{round}");
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": name}, "spec": {"queue": queue, "leaseDurationSeconds": LD}}),
        )
        .await;
        let (c, _) = holder.claim_leased(30).await;
        assert_eq!(c["name"].as_str(), Some(name.as_str()), "{c}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        holder.proc.signal("KILL");
        // A renewal in flight at the kill may still land.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let renewed = leases.get(&lease_name(&name)).await.unwrap();
        let renewed = renewed.spec.unwrap().renew_time.unwrap().0;
        let took = wait_for(
            "the dead holder's job to be requeued",
            Duration::from_secs(4 * LD),
            || async {
                let job = jobs.get(&name).await.ok()?;
                let expired = job
                    .status
                    .as_ref()?
                    .failures
                    .iter()
                    .any(|f| f.reason == REASON_LEASE_EXPIRED);
                expired.then(|| Timestamp::now().duration_since(renewed).as_secs_f64())
            },
        )
        .await;
        println!("{fault} restart (down {down} s): requeued {took:.2} s after the last renewal");
        figures.push((fault, took));
    }
    for (fault, took) in figures {
        assert!(
            took <= (LD + 1) as f64,
            "after a {fault} restart the dead holder's job was requeued {took:.2} s after its last renewal; bound {} s",
            LD + 1
        );
    }
}
