//! Isolation: one object never hurts another, and leasehold never writes what is not its own.
//! Leases that are not the job's (a long name's twin, another application's, a leftover), a
//! Lease that lost its label, a checkpoint held only by the Lease, a claimer that went away, a
//! drain after a lost lease, and a lease duration changed under a holder. Each against the real
//! control plane, with the real binaries.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use leasehold_core::crd::{LeasedJob, Phase, CONDITION_LEASE_CONFLICT};
use leasehold_core::lease;
use leasehold_testkit::*;
use serde_json::{json, Value};

async fn job(client: &kube::Client, ns: &str, name: &str) -> LeasedJob {
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), ns);
    jobs.get(name).await.expect("job")
}

async fn events_of(client: &kube::Client, ns: &str, name: &str, reason: &str) -> Vec<Event> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let all = events.list(&ListParams::default()).await.expect("events");
    all.items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
        })
        .collect()
}

/// Creates the Lease `name` as an admin would: `manifest` is merged into a bare Lease.
async fn create_lease(client: &kube::Client, ns: &str, name: &str, manifest: Value) -> Lease {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let mut body = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": name, "namespace": ns}});
    json_patch::merge(&mut body, &manifest);
    let lease: Lease = serde_json::from_value(body).unwrap();
    leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("create Lease")
}

/// Waits until `name` shows the LeaseConflict condition with `reason`, and returns the job.
async fn conflicted(client: &kube::Client, ns: &str, name: &str, reason: &str) -> LeasedJob {
    wait_for(
        "the LeaseConflict condition",
        Duration::from_secs(20),
        || async {
            let j = job(client, ns, name).await;
            let c = j
                .status
                .as_ref()?
                .conditions
                .iter()
                .find(|c| c.type_ == CONDITION_LEASE_CONFLICT)?;
            (c.reason == reason).then_some(j)
        },
    )
    .await
}

/// A Lease named `ljob-foo` that another application owns is never written; the
/// claim of `foo` is undone by its first renewal (not a failed attempt), the worker is told why
/// at that heartbeat, and other jobs are unaffected.
#[tokio::test]
async fn a_foreign_lease_is_never_written_and_only_its_job_waits() {
    let Fixture { client, ns } = fixture!("foreign-lease");
    let _controller = controller(&ns.name);
    let foreign = create_lease(
        &client,
        &ns.name,
        "ljob-foo",
        json!({"spec": {"holderIdentity": "some-other-app", "leaseDurationSeconds": 15}}),
    )
    .await;
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &["--spread", "1"]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "foo"}, "spec": {"queue": "q"}}),
    )
    .await;
    // The claim's write starts the lease; its first renewal would write the Lease, finds the
    // name taken, and undoes the claim.
    let (claimed, token) = sc.claim_ok(3).await;
    assert_eq!(claimed["name"].as_str(), Some("foo"), "{claimed}");
    let (s, body) = sc.heartbeat("foo", json!({"token": token})).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (409, Some("lease_lost")),
        "{body}"
    );
    let told = body["message"].as_str().unwrap();
    assert!(
        told.contains("ljob-foo") && told.contains("undone"),
        "{told}"
    );
    assert!(!told.contains("some-other-app"), "{told}");
    let foo = conflicted(&client, &ns.name, "foo", "LeaseNotOurs").await;
    // The other job of the queue is claimed and completed as usual.
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "bar"}, "spec": {"queue": "q"}}),
    )
    .await;
    let (s, claimed) = sc.claim(10).await;
    assert_eq!(
        (s, claimed["name"].as_str()),
        (200, Some("bar")),
        "{claimed}"
    );
    let (s, body) = sc.complete("bar", &token_of(&claimed), json!(1)).await;
    assert_eq!(s, 200, "{body}");
    // foo waits out its retryAfter instead of being claimed again and again.
    let (s, body) = sc.claim(2).await;
    assert_eq!(s, 204, "{body}");

    let status = foo.status.clone().unwrap();
    assert_eq!(foo.phase(), Phase::Queued);
    assert!(
        status.failures.is_empty(),
        "an undone claim is not a failed attempt: {status:?}"
    );
    assert!(status.retry_after.is_some(), "{status:?}");
    let condition = status
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_LEASE_CONFLICT)
        .unwrap();
    assert!(
        condition.message.contains("ljob-foo"),
        "{}",
        condition.message
    );
    assert!(
        !condition.message.contains("some-other-app"),
        "never show another's holderIdentity"
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let after = leases.get("ljob-foo").await.unwrap();
    assert_eq!(
        after.resource_version(),
        foreign.resource_version(),
        "the foreign Lease was written"
    );
    assert!(after.owner_references().is_empty());
    assert!(after.labels().is_empty());
    wait_for(
        "a LeaseConflict Event on foo",
        Duration::from_secs(20),
        || async {
            (!events_of(&client, &ns.name, "foo", "LeaseConflict")
                .await
                .is_empty())
            .then_some(())
        },
    )
    .await;
}

/// A long name and its lease name twin keep their own leases.
///
/// Two jobs whose derived Lease names collided under the old naming (a 253-character
/// name, and a 248-character name equal to the first one's old shortened Lease name without the
/// prefix) now get different Leases, and even a Lease of the twin's name owned by the first job
/// is never taken: both holders keep their leases through several lease durations.
#[tokio::test]
async fn lease_name_twins_keep_their_own_leases() {
    let Fixture { client, ns } = fixture!("lease-twins");
    let _controller = controller(&ns.name);
    let x = "h".repeat(253);
    // The old scheme: ljob-<first 231 characters>-<16 hex>; its twin drops the prefix.
    let old_hash = {
        use sha2::{Digest, Sha256};
        let d = Sha256::digest(x.as_bytes());
        d.iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let y = format!("{}-{old_hash}", &x[..231]);
    assert_eq!(y.len(), 248);
    assert_ne!(lease::lease_name(&x), lease::lease_name(&y));
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    for name in [&x, &y] {
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": name}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
        )
        .await;
    }
    let (s1, c1) = sc.claim(10).await;
    let (s2, c2) = sc.claim(10).await;
    assert_eq!((s1, s2), (200, 200), "{c1} {c2}");
    let tokens = [
        (c1["name"].as_str().unwrap().to_string(), token_of(&c1)),
        (c2["name"].as_str().unwrap().to_string(), token_of(&c2)),
    ];
    // Heartbeat both for three lease durations: neither loses its lease to the other.
    let until = Instant::now() + Duration::from_secs(15);
    while Instant::now() < until {
        for (name, token) in &tokens {
            let (s, body) = sc.heartbeat(name, json!({"token": token})).await;
            assert_eq!(s, 200, "{name}: {body}");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for (name, token) in &tokens {
        let (s, body) = sc.complete(name, token, json!(name.len())).await;
        assert_eq!(s, 200, "{body}");
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    for name in [&x, &y] {
        let j = job(&client, &ns.name, name).await;
        assert!(
            j.status.as_ref().unwrap().failures.is_empty(),
            "{:?}",
            j.status
        );
        let l = leases.get(&lease::lease_name(name)).await.unwrap();
        assert_eq!(
            l.owner_references()[0].uid,
            j.uid().unwrap(),
            "{name}'s Lease is its own"
        );
    }

    // A Lease of a third job's name that belongs to x (as if written by an older version) is
    // never taken by that job.
    let xj = job(&client, &ns.name, &x).await;
    let z = "z-twin";
    let planted = create_lease(
        &client,
        &ns.name,
        &lease::lease_name(z),
        json!({
            "metadata": {"labels": {"app.kubernetes.io/managed-by": "leasehold"},
                "ownerReferences": [{"apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedJob",
                    "name": x, "uid": xj.uid().unwrap()}]},
            "spec": {"holderIdentity": "1.0123456789abcdef0123456789abcdef", "leaseDurationSeconds": 5}
        }),
    )
    .await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": z}, "spec": {"queue": "q"}}),
    )
    .await;
    let (claimed, token) = sc.claim_ok(3).await;
    assert_eq!(claimed["name"].as_str(), Some(z), "{claimed}");
    let (s, body) = sc.heartbeat(z, json!({"token": token})).await;
    assert_eq!(s, 409, "{body}");
    conflicted(&client, &ns.name, z, "LeaseNotOurs").await;
    let after = leases.get(&lease::lease_name(z)).await.unwrap();
    assert_eq!(after.resource_version(), planted.resource_version());
}

/// A leftover Lease labelled as leasehold's but owned by no LeasedJob (holder from
/// attempt 5) makes the claim undo itself at its first renewal (here the background one, a
/// third of the lease after the claim): the job is never failed for it. A Lease left by an
/// earlier job of the same name (another uid) is recognised as stale and the job runs once
/// garbage collection removed it.
#[tokio::test]
async fn a_leftover_lease_never_fails_a_job_that_never_ran() {
    let Fixture { client, ns } = fixture!("leftover-lease");
    let _controller = controller(&ns.name);
    create_lease(
        &client,
        &ns.name,
        "ljob-j",
        json!({
            "metadata": {"labels": {"app.kubernetes.io/managed-by": "leasehold"}},
            "spec": {"holderIdentity": "5.0123456789abcdef0123456789abcdef", "leaseDurationSeconds": 5}
        }),
    )
    .await;
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "j"}, "spec": {"queue": "q", "maxAttempts": 1, "leaseDurationSeconds": 5}}),
    )
    .await;
    let start = Instant::now();
    let (claimed, token) = sc.claim_ok(3).await;
    assert_eq!(claimed["name"].as_str(), Some("j"), "{claimed}");
    let j = conflicted(&client, &ns.name, "j", "LeaseNotOurs").await;
    let (s, body) = sc.heartbeat("j", json!({"token": token})).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (409, Some("lease_lost")),
        "{body}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    // Well past the lease duration it is still Queued, never Failed.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let j2 = job(&client, &ns.name, "j").await;
    assert_eq!(j2.phase(), Phase::Queued, "{:?}", j2.status);
    assert!(j2.status.as_ref().unwrap().failures.is_empty());
    assert_eq!(j.attempt(), 1);

    // A stale Lease: owned by an earlier LeasedJob `k` (another uid, long gone).
    create_lease(
        &client,
        &ns.name,
        "ljob-k",
        json!({
            "metadata": {"labels": {"app.kubernetes.io/managed-by": "leasehold"},
                "ownerReferences": [{"apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedJob",
                    "name": "k", "uid": "00000000-0000-0000-0000-000000000001"}]},
            "spec": {"holderIdentity": "3.0123456789abcdef0123456789abcdef", "leaseDurationSeconds": 5}
        }),
    )
    .await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "k"}, "spec": {"queue": "q", "maxAttempts": 1}}),
    )
    .await;
    // Claimed, its first renewal finds the stale Lease and undoes the claim (StaleLease,
    // retried after 3 s), until garbage collection has removed the Lease.
    let claimed = wait_for(
        "k runs once the stale Lease is collected",
        Duration::from_secs(60),
        || async {
            let (s, c) = sc.claim(2).await;
            if s != 200 {
                return None;
            }
            let (s, _) = sc.heartbeat("k", json!({"token": token_of(&c)})).await;
            (s == 200).then_some(c)
        },
    )
    .await;
    assert_eq!(claimed["name"].as_str(), Some("k"));
    let (s, body) = sc.complete("k", &token_of(&claimed), json!("done")).await;
    assert_eq!(s, 200, "{body}");
    let k = job(&client, &ns.name, "k").await;
    assert_eq!(k.phase(), Phase::Succeeded);
    assert!(k
        .status
        .unwrap()
        .conditions
        .iter()
        .all(|c| c.type_ != CONDITION_LEASE_CONFLICT));
}

/// Removing the Lease's managed-by label (which takes it out of the controller's
/// label-filtered cache) must not make a dead holder's job immortal.
#[tokio::test]
async fn a_lease_that_lost_its_label_still_expires() {
    let Fixture { client, ns } = fixture!("unlabelled-lease");
    let _controller = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "x"}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
    )
    .await;
    sc.claim_leased(10).await;
    let (ok, out) = kubectl(
        &[
            "label",
            "lease",
            "ljob-x",
            "-n",
            &ns.name,
            "app.kubernetes.io/managed-by-",
        ],
        "",
    );
    assert!(ok, "{out}");
    let unlabelled = Instant::now();
    sc.proc.signal("KILL");
    let requeued = wait_for(
        "x requeued after its lease",
        Duration::from_secs(30),
        || async {
            let j = job(&client, &ns.name, "x").await;
            (j.phase() == Phase::Queued && !j.status.as_ref()?.failures.is_empty()).then_some(j)
        },
    )
    .await;
    let took = unlabelled.elapsed();
    assert!(
        took <= Duration::from_secs(10),
        "requeued {took:?} after the label went (lease 5 s): the controller must ask the API server, not wait for the cache"
    );
    assert_eq!(requeued.status.unwrap().failures[0].reason, "LeaseExpired");
}

/// A release after a sidecar restart carries the checkpoint the Lease holds.
#[tokio::test]
async fn a_release_after_a_sidecar_restart_keeps_the_checkpoint() {
    let Fixture { client, ns } = fixture!("release-checkpoint");
    let _controller = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "x"}, "spec": {"queue": "q"}}),
    )
    .await;
    let (_, token) = sc.claim_ok(10).await;
    let (s, body) = sc
        .heartbeat("x", json!({"token": token, "checkpoint": {"offset": 5}}))
        .await;
    assert_eq!(s, 200, "{body}");
    drop(sc);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    let (s, body) = sc.post("/v1/jobs/x/release", json!({"token": token})).await;
    assert_eq!(s, 200, "{body}");
    let j = job(&client, &ns.name, "x").await;
    assert_eq!(
        j.status.as_ref().unwrap().checkpoint,
        Some(json!({"offset": 5}))
    );
    let (s, again) = sc.claim(10).await;
    assert_eq!(
        (s, &again["checkpoint"]),
        (200, &json!({"offset": 5})),
        "{again}"
    );
}

/// A claim whose client has gone by the time the claim write lands is given back at
/// once (Queued, not a failed attempt), not left Leased to nobody for a whole lease. The claim
/// write is held in a stalled relay until the client has timed out.
#[tokio::test]
async fn a_claim_whose_client_went_away_is_given_back_at_once() {
    let Fixture { client, ns } = fixture!("lost-claim");
    let _controller = controller(&ns.name);
    let relay = faults::Relay::start(faults::apiserver_port());
    let kubeconfig = relay.kubeconfig(&format!("{}-relayed", ns.name));
    let sc = Sidecar::start_as(&ns.name, "q", "pod-a", &[], &kubeconfig).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "x"}, "spec": {"queue": "q", "leaseDurationSeconds": 60}}),
    )
    .await;
    // Let the controller queue x and the sidecar's watch bring it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    relay.stall();
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(700))
        .build()
        .unwrap();
    let gone = impatient
        .post(format!("{}/v1/claim?wait=5", sc.base))
        .send()
        .await;
    assert!(
        gone.is_err(),
        "the claim was answered while the API server was cut off"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    relay.resume();
    let resumed = Instant::now();
    let back = wait_for("x given back", Duration::from_secs(30), || async {
        let j = job(&client, &ns.name, "x").await;
        (j.attempt() >= 1 && j.phase() == Phase::Queued).then_some(j)
    })
    .await;
    assert!(
        resumed.elapsed() < Duration::from_secs(10),
        "given back {:?} after the network healed (lease 60 s)",
        resumed.elapsed()
    );
    assert!(
        back.status.unwrap().failures.is_empty(),
        "a given-back claim is not a failed attempt"
    );
}

/// A sidecar whose only job's lease was lost does not wait out its drain timeout.
#[tokio::test]
async fn a_drain_does_not_wait_for_a_lost_lease() {
    let Fixture { client, ns } = fixture!("drain-lost");
    let _controller = controller(&ns.name);
    let mut sc = Sidecar::start(&ns.name, "q", "pod-a", &["--drain-timeout", "25"]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "x"}, "spec": {"queue": "q"}}),
    )
    .await;
    let (_, token) = sc.claim_leased(10).await;
    // Someone else takes the Lease: the holder's next heartbeat is refused.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    leases
        .patch(
            "ljob-x",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"holderIdentity": "9.0123456789abcdef0123456789abcdef"}}),
            ),
        )
        .await
        .unwrap();
    let (s, body) = sc.heartbeat("x", json!({"token": token})).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (409, Some("lease_lost")),
        "{body}"
    );
    let start = Instant::now();
    sc.proc.signal("TERM");
    wait_for("the sidecar exits", Duration::from_secs(30), || {
        let done = sc.proc.child.try_wait().ok().flatten().is_some();
        async move { done.then_some(()) }
    })
    .await;
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "drained in {:?}",
        start.elapsed()
    );
}

/// Spec.leaseDurationSeconds is fixed while a holder has the lease; it can change while
/// Queued.
#[tokio::test]
async fn the_lease_duration_of_a_leased_job_cannot_change() {
    let Fixture { client, ns } = fixture!("lease-duration");
    let _controller = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "x"}, "spec": {"queue": "q"}}),
    )
    .await;
    wait_for("x Queued", Duration::from_secs(20), || async {
        (job(&client, &ns.name, "x").await.status.is_some()).then_some(())
    })
    .await;
    let patch = |secs: i32| {
        kubectl(
            &[
                "patch",
                "ljob",
                "x",
                "-n",
                &ns.name,
                "--type",
                "merge",
                "-p",
                &json!({"spec": {"leaseDurationSeconds": secs}}).to_string(),
            ],
            "",
        )
    };
    let (ok, out) = patch(30);
    assert!(ok, "a Queued job's lease duration can change: {out}");
    let (s, claimed) = sc.claim(10).await;
    assert_eq!(
        (s, &claimed["leaseDurationSeconds"]),
        (200, &json!(30)),
        "{claimed}"
    );
    let (ok, out) = patch(300);
    assert!(!ok, "a Leased job's lease duration changed: {out}");
    assert!(
        out.contains("leaseDurationSeconds cannot change while the job is Leased"),
        "{out}"
    );
    assert_eq!(
        job(&client, &ns.name, "x")
            .await
            .spec
            .lease_duration_seconds,
        Some(30)
    );
}
