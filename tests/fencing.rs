//! The claim and the fenced writes, against the real API server: exactly one claimer wins, a
//! stale token is refused by the API server itself, and a result racing the controller's
//! requeue lands exactly once.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::fence::{self, Outcome, REASON_LEASE_EXPIRED};
use leasehold_core::lease;
use leasehold_core::Category;
use leasehold_kube::claim::ClaimError;
use leasehold_kube::fence::FenceError;
use leasehold_testkit::*;
use serde_json::json;

/// Claim race: 20 claimers, 1 job; exactly one wins, in each of 50 rounds.
#[tokio::test]
async fn claim_race_has_one_winner() {
    let Fixture { client, ns } = fixture!("claim-race");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    for round in 0..50 {
        let name = format!("race-{round}");
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": name}, "spec": {"payload": round}}),
        )
        .await;
        // Every claimer reads its own snapshot, then all write at once.
        let barrier = Arc::new(tokio::sync::Barrier::new(20));
        let mut tasks = Vec::new();
        for c in 0..20 {
            let jobs = jobs.clone();
            let name = name.clone();
            let barrier = Arc::clone(&barrier);
            tasks.push(tokio::spawn(async move {
                let snapshot = jobs.get(&name).await.unwrap();
                barrier.wait().await;
                leasehold_kube::claim::claim(&jobs, &snapshot, &format!("claimer-{c}"), None).await
            }));
        }
        let mut winners = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Ok((job, token)) => winners.push((job, token)),
                Err(ClaimError::Conflict { .. }) => {}
                Err(e) => panic!("round {round}: unexpected claim error {e}"),
            }
        }
        assert_eq!(
            winners.len(),
            1,
            "round {round}: {} claimers won",
            winners.len()
        );
        let (won, token) = &winners[0];
        assert_eq!(token.attempt(), 1);
        let stored = jobs.get(&name).await.unwrap();
        assert_eq!(stored.attempt(), 1, "round {round}");
        assert_eq!(stored.phase(), Phase::Leased);
        assert_eq!(stored.token(), Some(token.as_str()));
        assert_eq!(
            stored.status.as_ref().unwrap().holder,
            won.status.as_ref().unwrap().holder
        );
    }
}

/// A stale token is refused by the API server, not only by memory.
#[tokio::test]
async fn stale_token_refused_by_the_api_server() {
    let Fixture { client, ns } = fixture!("stale");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let job = create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "j"}, "spec": {}}),
    )
    .await;
    let (job, t1) = leasehold_kube::claim::claim(&jobs, &job, "a", None)
        .await
        .unwrap();
    leasehold_kube::lease::acquire(&leases, &job, &t1, &Default::default())
        .await
        .unwrap();
    // Attempt 1 is given back; attempt 2 is claimed by b.
    leasehold_kube::fence::apply(
        &jobs,
        &ns.name,
        "j",
        &t1,
        &Outcome::Release { checkpoint: None },
    )
    .await
    .unwrap();
    let job = jobs.get("j").await.unwrap();
    let (job, t2) = leasehold_kube::claim::claim(&jobs, &job, "b", None)
        .await
        .unwrap();
    leasehold_kube::lease::acquire(&leases, &job, &t2, &Default::default())
        .await
        .unwrap();

    // The raw conditional patch a stale holder would send, straight to the API server.
    let stale_patch = fence::end_attempt_patch(
        &job,
        &t1,
        "a",
        &Outcome::Complete { result: json!("a") },
        k8s_openapi::jiff::Timestamp::now(),
        0.5,
    );
    let err = jobs
        .patch_status(
            "j",
            &PatchParams::default(),
            &Patch::Json::<()>(stale_patch),
        )
        .await
        .expect_err("the API server accepted a stale token");
    assert!(leasehold_kube::api::is_status(&err, 422), "{err}");

    // Through the library: refused with a message naming both attempts and no token.
    match leasehold_kube::fence::apply(
        &jobs,
        &ns.name,
        "j",
        &t1,
        &Outcome::Complete { result: json!("a") },
    )
    .await
    {
        Err(FenceError::Refused(r)) => {
            let msg = r.to_string();
            assert_eq!(r.category(), "lease_lost");
            assert!(
                msg.contains("attempt 2") && msg.contains("attempt 1"),
                "{msg}"
            );
            assert!(
                !msg.contains(t2.as_str()),
                "refusal revealed the current token"
            );
        }
        other => panic!("stale complete was not refused: {other:?}"),
    }
    // The stale holder cannot renew the Lease either.
    assert!(matches!(
        leasehold_kube::lease::renew(&leases, &lease::lease_name("j"), &t1, None, None).await,
        Err(leasehold_kube::lease::LeaseError::Lost { .. })
    ));
    let l = leases.get(&lease::lease_name("j")).await.unwrap();
    assert_eq!(lease::holder_identity(&l), Some(t2.as_str()));
    assert_eq!(l.spec.as_ref().unwrap().lease_transitions, Some(1));
    assert_eq!(l.owner_references()[0].name, "j");
    // The current holder completes.
    let done = leasehold_kube::fence::apply(
        &jobs,
        &ns.name,
        "j",
        &t2,
        &Outcome::Complete { result: json!("b") },
    )
    .await
    .unwrap();
    assert_eq!(done.phase(), Phase::Succeeded);
    assert_eq!(done.status.unwrap().result, Some(json!("b")));
}

/// A late result against expiry: exactly one side wins, 200 times over.
///
/// A holder that stopped heartbeating sends its result at about the moment the controller
/// expires its lease, 200 times. Each time exactly one side wins.
#[tokio::test]
async fn late_result_against_expiry() {
    let Fixture { client, ns } = fixture!("late-result");
    let _controller = controller(&ns.name);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let n = 200;
    for i in 0..n {
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": format!("late-{i}")}, "spec": {"leaseDurationSeconds": 5, "maxAttempts": 5}}),
        )
        .await;
    }
    // Wait for the controller to initialise them all, so claims do not race its writes.
    wait_for("jobs initialised", Duration::from_secs(60), || async {
        let list = jobs.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .all(|j| j.status.as_ref().and_then(|s| s.phase) == Some(Phase::Queued))
            .then_some(())
    })
    .await;
    let mut tasks = Vec::new();
    for i in 0..n {
        let (jobs, leases, ns) = (jobs.clone(), leases.clone(), ns.name.clone());
        tasks.push(tokio::spawn(async move {
            let name = format!("late-{i}");
            let snapshot = jobs.get(&name).await.unwrap();
            let (job, token) = leasehold_kube::claim::claim(&jobs, &snapshot, "holder", None)
                .await
                .unwrap();
            leasehold_kube::lease::acquire(&leases, &job, &token, &Default::default())
                .await
                .unwrap();
            let claimed_at = tokio::time::Instant::now();
            // Spread the result over 4.7 s .. 5.5 s after the claim: around the expiry.
            let offset_ms = 4700 + (i as u64 * 800) / n as u64;
            tokio::time::sleep_until(claimed_at + Duration::from_millis(offset_ms)).await;
            let accepted = leasehold_kube::fence::apply(
                &jobs,
                &ns,
                &name,
                &token,
                &Outcome::Complete { result: json!(i) },
            )
            .await
            .is_ok();
            (name, accepted)
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap());
    }
    // Let any requeue still in flight land, then judge twice, a little apart.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut accepted_count = 0;
    for pass in 0..2 {
        accepted_count = 0;
        for (name, accepted) in &outcomes {
            let job = jobs.get(name).await.unwrap();
            let status = job.status.clone().unwrap();
            let expired = status
                .failures
                .iter()
                .any(|f| f.reason == REASON_LEASE_EXPIRED);
            if *accepted {
                accepted_count += 1;
                assert_eq!(
                    job.phase(),
                    Phase::Succeeded,
                    "{name} pass {pass}: result accepted but job is {}",
                    job.phase()
                );
                assert!(!expired, "{name}: result accepted AND requeued");
                assert_eq!(status.attempt, 1);
            } else {
                assert!(expired, "{name}: result refused but no requeue recorded");
                assert_ne!(
                    job.phase(),
                    Phase::Succeeded,
                    "{name}: refused result yet Succeeded"
                );
                assert!(status.result.is_none(), "{name}: refused result was stored");
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    println!(
        "late results accepted: {accepted_count} of {n}; requeued first: {}",
        n - accepted_count
    );
    assert!(
        accepted_count > 0 && accepted_count < n,
        "the race was not exercised: {accepted_count} of {n} accepted"
    );
}
