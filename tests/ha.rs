//! Two controller replicas against the real API server: one leader writes; a killed leader is
//! replaced and no job is expired twice; a frozen leader writes nothing when it wakes; a
//! leader stopped with SIGTERM hands over within seconds; a leader killed and restarted under
//! its own identity (a container restart) leads again at once.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, ResourceExt};
use leasehold_controller::leader::HOLDER_POD_ANNOTATION;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::fence::REASON_LEASE_EXPIRED;
use leasehold_testkit::*;
use serde_json::json;

const FAST: &[&str] = &[
    "--leader-lease-duration",
    "3",
    "--leader-renew-deadline",
    "2",
    "--leader-retry-period",
    "0.5",
];

/// A long leader lease: waiting it out would take 20 s, so a test that passes quickly shows
/// the lease was not waited out.
const SLOW: &[&str] = &[
    "--leader-lease-duration",
    "20",
    "--leader-renew-deadline",
    "15",
    "--leader-retry-period",
    "0.5",
];

async fn leader_of(leases: &Api<Lease>) -> Option<String> {
    let l = leases.get_opt("leasehold-controller").await.ok()??;
    l.spec.as_ref()?.holder_identity.as_ref()?;
    l.annotations().get(HOLDER_POD_ANNOTATION).cloned()
}

/// Field managers of the controller replicas that wrote `job`.
fn writers(job: &LeasedJob) -> Vec<String> {
    job.metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|m| m.manager.clone())
        .filter(|m| m.starts_with("leasehold-controller/"))
        .collect()
}

#[tokio::test]
async fn a_killed_leader_is_replaced_and_no_job_is_expired_twice() {
    let Fixture { client, ns } = fixture!("ha-kill");
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let a = controller_with(&ns.name, "ctl-a", FAST);
    let leader = wait_for("a leader", Duration::from_secs(15), || leader_of(&leases)).await;
    assert_eq!(leader, "ctl-a");
    let b = controller_with(&ns.name, "ctl-b", FAST);
    // A job whose holder dies: it must be expired exactly once, across the failover.
    let sc = Sidecar::start(&ns.name, "q", "pod-w", &[]).await;
    create_job(&client, &ns.name, json!({"metadata": {"name": "j"}, "spec": {"queue": "q", "leaseDurationSeconds": 5, "maxAttempts": 3}})).await;
    let (s, _) = sc.claim(10).await;
    assert_eq!(s, 200);
    sc.proc.signal("KILL");
    drop(sc);
    a.signal("KILL");
    let killed = tokio::time::Instant::now();
    let leader = wait_for("a new leader", Duration::from_secs(15), || async {
        leader_of(&leases).await.filter(|l| l == "ctl-b")
    })
    .await;
    assert_eq!(leader, "ctl-b");
    println!(
        "ctl-b took over {:?} after the leader was killed",
        killed.elapsed()
    );
    let job = wait_for("the expiry", Duration::from_secs(20), || async {
        let j = jobs.get("j").await.ok()?;
        (j.failed_attempts() >= 1).then_some(j)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let job_later = jobs.get("j").await.unwrap();
    let failures = job_later.status.as_ref().unwrap().failures.clone();
    assert_eq!(failures.len(), 1, "expired more than once: {failures:?}");
    assert_eq!(failures[0].reason, REASON_LEASE_EXPIRED);
    assert_eq!(job.phase(), Phase::Queued);
    // ctl-a may have initialised the job before it was killed; it must not have expired it.
    let expired_by_a = job_later.metadata.managed_fields.iter().flatten().any(|m| {
        m.manager.as_deref() == Some("leasehold-controller/ctl-a")
            && m.fields_v1
                .as_ref()
                .is_some_and(|f| f.0.to_string().contains("f:failures"))
    });
    assert!(!expired_by_a, "the killed leader expired the job");
    drop(b);
}

#[tokio::test]
async fn a_frozen_leader_writes_nothing_when_it_wakes() {
    let Fixture { client, ns } = fixture!("ha-freeze");
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let a = controller_with(&ns.name, "ctl-a", FAST);
    wait_for("ctl-a leads", Duration::from_secs(15), || async {
        leader_of(&leases).await.filter(|l| l == "ctl-a")
    })
    .await;
    let b = controller_with(&ns.name, "ctl-b", FAST);
    wait_for("ctl-b ready", Duration::from_secs(15), || async {
        (http_get(b.port.unwrap(), "/readyz").await?.0 == 200).then_some(())
    })
    .await;
    a.signal("STOP");
    // While ctl-a is frozen, new jobs arrive: only a leader may initialise them.
    for i in 0..5 {
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": format!("f{i}")}, "spec": {}}),
        )
        .await;
    }
    wait_for("ctl-b leads", Duration::from_secs(15), || async {
        leader_of(&leases).await.filter(|l| l == "ctl-b")
    })
    .await;
    wait_for(
        "jobs initialised by ctl-b",
        Duration::from_secs(15),
        || async {
            let list = jobs.list(&Default::default()).await.ok()?;
            list.items
                .iter()
                .all(|j| j.status.as_ref().and_then(|s| s.phase).is_some())
                .then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await; // frozen well past its lease
    a.signal("CONT");
    // Give the woken replica time to act on everything its watch now delivers.
    for i in 5..8 {
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": format!("f{i}")}, "spec": {}}),
        )
        .await;
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    for job in jobs.list(&Default::default()).await.unwrap().items {
        let w = writers(&job);
        assert!(
            !w.contains(&"leasehold-controller/ctl-a".to_string()),
            "the frozen leader wrote to {} after its term: {w:?}",
            job.name_any()
        );
        assert!(
            w.contains(&"leasehold-controller/ctl-b".to_string()),
            "{}: {w:?}",
            job.name_any()
        );
    }
    assert_eq!(leader_of(&leases).await.as_deref(), Some("ctl-b"));
    assert!(a.log_text().contains("Lost leadership"), "{}", a.log_text());
}

#[tokio::test]
async fn a_leader_stopped_with_sigterm_hands_over_within_seconds() {
    let Fixture { client, ns } = fixture!("ha-term");
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let mut a = controller_with(&ns.name, "ctl-a", SLOW);
    wait_for("ctl-a leads", Duration::from_secs(15), || async {
        leader_of(&leases).await.filter(|l| l == "ctl-a")
    })
    .await;
    let _b = controller_with(&ns.name, "ctl-b", SLOW);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stopped = tokio::time::Instant::now();
    a.signal("TERM");
    wait_for("ctl-b leads", Duration::from_secs(10), || async {
        leader_of(&leases).await.filter(|l| l == "ctl-b")
    })
    .await;
    let took = stopped.elapsed();
    println!("handover after SIGTERM took {took:?}");
    assert!(took < Duration::from_secs(5), "handover took {took:?}");
    let status = wait_for("ctl-a exit", Duration::from_secs(10), || {
        let done = a.child.try_wait().unwrap();
        async move { done }
    })
    .await;
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn a_leader_restarted_in_its_pod_leads_again_at_once() {
    let Fixture { client, ns } = fixture!("ha-restart");
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let a = controller_with(&ns.name, "ctl-a", SLOW);
    wait_for("ctl-a leads", Duration::from_secs(15), || {
        leader_of(&leases)
    })
    .await;
    let term = |l: &Lease| l.spec.as_ref().and_then(|s| s.holder_identity.clone());
    let first = term(&leases.get("leasehold-controller").await.unwrap());
    let sc = Sidecar::start(&ns.name, "q", "pod-w", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "j"}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
    )
    .await;
    let (s, _) = sc.claim(10).await;
    assert_eq!(s, 200);
    sc.proc.signal("KILL");
    drop(sc);
    // The container restarts: the process is killed and started again under the same name.
    a.signal("KILL");
    drop(a);
    let restarted = tokio::time::Instant::now();
    let _a = controller_with(&ns.name, "ctl-a", SLOW);
    wait_for("a new term of ctl-a", Duration::from_secs(10), || async {
        let l = leases.get("leasehold-controller").await.ok()?;
        (term(&l) != first
            && l.annotations()
                .get(HOLDER_POD_ANNOTATION)
                .map(String::as_str)
                == Some("ctl-a"))
        .then_some(())
    })
    .await;
    let took = restarted.elapsed();
    println!("ctl-a led again {took:?} after its restart");
    assert!(took < Duration::from_secs(5), "re-election took {took:?}");
    // And it acts: the dead worker's job is expired within its lease and a second.
    wait_for("the expiry", Duration::from_secs(10), || async {
        let j = jobs.get("j").await.ok()?;
        (j.failed_attempts() >= 1 && j.phase() == Phase::Queued).then_some(())
    })
    .await;
}
