//! A LeasedQueue's limits against the real control plane: `maxLeasedPerKey` and `maxLeased`
//! hold at every instant as the API server's own watch shows it, with claimers racing through
//! the dispatcher and without it, holders SIGKILLed (their slots come back when their leases
//! expire, never earlier) and the dispatcher SIGKILLed; a lowered limit stops new claims until
//! the jobs above it have ended; a deleted LeasedQueue takes its limits with it; a full key at
//! the head of the queue does not hold back the other keys; a claim that lost to a claim of a
//! newer copy of its job leaves no slot busy; jobs Leased before a limit existed count against
//! it from its first claim; a slot left pending by a claimer that died before its claim write
//! is freed by the controller; a dispatcher that suggests a busy slot, or marks one as the
//! claimer's own to swap, breaks no limit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::queue::LeasedQueue;
use leasehold_core::slots::{Preferred, Scope, SlotHolder};
use leasehold_core::token::Token;
use leasehold_kube::claim::{claim_with, ClaimError};
use leasehold_kube::slots::{self, Acquired};
use leasehold_testkit::dispatcher::{advertised, dispatcher_sees, fake_dispatcher, wait_queued};
use leasehold_testkit::*;
use serde_json::json;

fn queue_manifest(ns: &str, spec: serde_json::Value) -> LeasedQueue {
    serde_json::from_value(json!({
        "apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedQueue",
        "metadata": {"name": "q", "namespace": ns},
        "spec": spec,
    }))
    .unwrap()
}

async fn apply_queue(client: &kube::Client, ns: &str, spec: serde_json::Value) {
    let api: Api<LeasedQueue> = Api::namespaced(client.clone(), ns);
    api.patch(
        "q",
        &PatchParams::apply("limits-test").force(),
        &Patch::Apply(&queue_manifest(ns, spec)),
    )
    .await
    .unwrap();
}

async fn create_keyed(client: &kube::Client, ns: &str, name: &str, key: &str) {
    create_job(
        client,
        ns,
        json!({"metadata": {"name": name},
               "spec": {"queue": "q", "concurrencyKey": key, "leaseDurationSeconds": 5}}),
    )
    .await;
}

/// Claims and completes jobs, holding each for `hold`, until `stop`.
async fn work(sidecar: Sidecar, hold: Duration, stop: Arc<AtomicBool>) -> Sidecar {
    while !stop.load(Ordering::SeqCst) {
        let (status, claim) = sidecar.claim(1).await;
        if status != 200 {
            continue;
        }
        tokio::time::sleep(hold).await;
        let name = claim["name"].as_str().unwrap().to_string();
        let token = token_of(&claim);
        let _ = sidecar.complete(&name, &token, json!("done")).await;
    }
    sidecar
}

/// A sidecar holding a job it claimed: the sidecar, the job's name, its token.
type Held = (Sidecar, String, String);

/// `n` sidecars named `holder-<i>`, each holding a job of queue q it claimed.
async fn hold(ns: &str, n: usize) -> Vec<Held> {
    let mut holders = Vec::new();
    for i in 0..n {
        let sidecar = Sidecar::start(ns, "q", &format!("holder-{i}"), &[]).await;
        let (claim, token) = sidecar.claim_ok(20).await;
        holders.push((sidecar, claim["name"].as_str().unwrap().to_string(), token));
    }
    holders
}

/// Completes the job `held` holds.
async fn end((sidecar, name, token): Held) {
    let (s, b) = sidecar.complete(&name, &token, json!("done")).await;
    assert_eq!(s, 200, "{b}");
}

#[tokio::test]
async fn limits_hold_at_every_instant_through_killed_holders_and_a_killed_dispatcher() {
    let Fixture { client, ns } = fixture!("limits");
    let mut controller = controller(&ns.name);
    apply_queue(
        &client,
        &ns.name,
        json!({"maxLeasedPerKey": 2, "maxLeased": 5}),
    )
    .await;
    let (peaks, watching) =
        leasehold_testkit::peaks::follow(Api::namespaced(client.clone(), &ns.name), Some(2));
    for key in ["a", "b", "c"] {
        for i in 0..12 {
            create_keyed(&client, &ns.name, &format!("{key}-{i:02}"), key).await;
        }
    }
    let token = dispatch_token_file(&ns.name);
    let token = token.to_str().unwrap().to_string();
    // Two holders that never finish: SIGKILLed below, their leases expire.
    let mut doomed = Vec::new();
    for i in 0..2 {
        let sidecar = Sidecar::start(&ns.name, "q", &format!("doomed-{i}"), &[]).await;
        let (claim, _) = sidecar.claim_ok(20).await;
        eprintln!("doomed-{i} holds {}", claim["name"]);
        doomed.push(sidecar);
    }
    // Eight claimers racing: four through the dispatcher, four choosing on their own.
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for i in 0..8 {
        let extra: Vec<&str> = if i % 2 == 0 {
            vec!["--dispatch-token-file", &token]
        } else {
            vec![]
        };
        let sidecar = Sidecar::start(&ns.name, "q", &format!("pod-{i}"), &extra).await;
        workers.push(tokio::spawn(work(
            sidecar,
            Duration::from_millis(150),
            Arc::clone(&stop),
        )));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    for sidecar in &doomed {
        sidecar.proc.signal("KILL");
    }
    // The dispatcher dies too (the controller: expiry waits for its successor).
    tokio::time::sleep(Duration::from_secs(1)).await;
    controller.signal("KILL");
    tokio::time::sleep(Duration::from_secs(2)).await;
    controller = controller_with(&ns.name, "test-controller-2", &[]);
    wait_for("every job done", Duration::from_secs(120), || async {
        (peaks.lock().unwrap().done == 36).then_some(())
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }
    watching.abort();
    drop(controller);
    let peaks = peaks.lock().unwrap();
    eprintln!("peaks: {peaks:?}");
    assert!(
        peaks.over.is_empty(),
        "over the per-key limit of 2: {:?}",
        peaks.over
    );
    for (key, peak) in &peaks.per_key {
        assert!(*peak <= 2, "key {key}: {peak} Leased at once, limit 2");
    }
    assert!(peaks.all <= 5, "{} Leased at once, limit 5", peaks.all);
    // The limits were reached, so they were what held the claims back.
    assert_eq!(peaks.all, 5, "{peaks:?}");
    assert!(peaks.per_key.values().all(|p| *p == 2), "{peaks:?}");
}

#[tokio::test]
async fn a_lowered_limit_waits_for_the_jobs_above_it_and_a_deleted_queue_lifts_it() {
    let Fixture { client, ns } = fixture!("limits-lower");
    let controller = controller(&ns.name);
    let ctl_port = controller.port.unwrap();
    apply_queue(&client, &ns.name, json!({"maxLeasedPerKey": 3})).await;
    for i in 0..6 {
        create_keyed(&client, &ns.name, &format!("a-{i}"), "a").await;
    }
    let mut holders = hold(&ns.name, 3).await;
    // The controller says so.
    let queues: Api<LeasedQueue> = Api::namespaced(client.clone(), &ns.name);
    let labels = format!("{{queue_namespace=\"{}\",queue=\"q\"}}", ns.name);
    wait_for(
        "key a reported at its limit",
        Duration::from_secs(15),
        || async {
            let status = queues.get("q").await.ok()?.status?;
            let m = http_get(ctl_port, "/metrics").await?.1;
            (status.keys_at_limit == 1
                && status.keys_at_limit_shown == ["a"]
                && sample(&m, &format!("leasehold_queue_keys_at_limit{labels}")) == Some(1.0)
                && sample(&m, &format!("leasehold_queue_at_limit{labels}")) == Some(0.0))
            .then_some(())
        },
    )
    .await;
    // A fourth claimer finds the key full.
    let waiter = Sidecar::start(&ns.name, "q", "waiter", &[]).await;
    let (status, answer) = waiter.claim(2).await;
    assert_eq!(status, 204, "a fourth job of key a was claimed: {answer}");
    // Lowered to 1 with 3 Leased: two ending leaves 1, which is not below 1: no claim.
    apply_queue(&client, &ns.name, json!({"maxLeasedPerKey": 1})).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for held in holders.drain(..2) {
        end(held).await;
    }
    let (status, answer) = waiter.claim(2).await;
    assert_eq!(
        status, 204,
        "claimed while 1 of key a was Leased, limit 1: {answer}"
    );
    // The last one ends: one claim.
    end(holders.pop().unwrap()).await;
    let (claim, _) = waiter.claim_ok(5).await;
    eprintln!("claimed {} once the key was below its limit", claim["name"]);
    let other = Sidecar::start(&ns.name, "q", "other", &[]).await;
    let (status, answer) = other.claim(2).await;
    assert_eq!(status, 204, "a second job of key a, limit 1: {answer}");
    // The LeasedQueue deleted: no limit.
    queues.delete("q", &Default::default()).await.unwrap();
    let (claim, _) = other.claim_ok(5).await;
    eprintln!("claimed {} with the limit gone", claim["name"]);
}

/// Jobs Leased before their queue had a limit count against it from its first claim: the
/// controller gives each a slot, and only then confirms the limit (status.slotsAdopted), which
/// sidecars wait for; with no controller running, a new limit allows no claim at all.
#[tokio::test]
async fn jobs_leased_before_a_limit_count_against_it_from_its_first_claim() {
    let Fixture { client, ns } = fixture!("limits-adopt");
    let controller = controller(&ns.name);
    for i in 0..6 {
        create_keyed(&client, &ns.name, &format!("a-{i}"), "a").await;
    }
    // Three of key a Leased while the queue has no LeasedQueue: no slots.
    let mut holders = hold(&ns.name, 3).await;
    // With no controller, a limit set now allows no claim: neither a fourth of key a (three
    // Leased, limit 2) nor one of key b (none Leased), since nothing has counted the three.
    controller.signal("KILL");
    drop(controller);
    apply_queue(&client, &ns.name, json!({"maxLeasedPerKey": 2})).await;
    create_keyed(&client, &ns.name, "b-0", "b").await;
    let waiter = Sidecar::start(&ns.name, "q", "waiter", &[]).await;
    let (status, answer) = waiter.claim(2).await;
    assert_eq!(
        status, 204,
        "claimed before the Leased jobs had slots: {answer}"
    );
    // A controller gives them slots and confirms the limit: key b's job is claimed, and no
    // fourth of key a.
    let _controller = controller_with(&ns.name, "test-controller-2", &[]);
    let queues: Api<LeasedQueue> = Api::namespaced(client.clone(), &ns.name);
    wait_for("the limit confirmed", Duration::from_secs(30), || async {
        let q = queues.get("q").await.ok()?;
        leasehold_core::adoption::adopted(&q).then_some(())
    })
    .await;
    let (claim, _b_token) = waiter.claim_ok(5).await;
    assert_eq!(claim["name"], "b-0", "{claim}");
    let other = Sidecar::start(&ns.name, "q", "other", &[]).await;
    let (status, answer) = other.claim(2).await;
    assert_eq!(status, 204, "a fourth job of key a, limit 2: {answer}");
    // Each of the three holds a slot of key a.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let scope = leasehold_core::slots::Scope::Key("a".into()).label();
    let selector = format!("leasehold.dev/slot-of=q,leasehold.dev/slot-scope={scope}");
    // (index, the job it names) of each slot of key a.
    let named: Vec<(u32, String)> = leases
        .list(&kube::api::ListParams::default().labels(&selector))
        .await
        .unwrap()
        .items
        .iter()
        .filter_map(|l| {
            let index = l.name_any().rsplit('-').next()?.parse().ok()?;
            let holder = l.spec.as_ref()?.holder_identity.clone()?;
            Some((index, holder.split('@').next()?.to_string()))
        })
        .collect();
    for (_, job, _) in &holders {
        assert!(
            named.iter().any(|(_, j)| j == job),
            "no slot names {job}: {named:?}"
        );
    }
    // Three jobs, two slots below the limit: one was adopted above it.
    let (_, above) = named
        .iter()
        .find(|(i, _)| *i >= 2)
        .unwrap_or_else(|| panic!("no slot above the limit: {named:?}"))
        .clone();
    // The two below it end, the one above goes on: one of key a Leased, below the limit of 2.
    // One more is claimed once the controller has moved that job to a slot below the limit
    // (its next pass), never before the second ends.
    holders.sort_by_key(|(_, job, _)| *job != above);
    end(holders.pop().unwrap()).await;
    let (status, answer) = other.claim(2).await;
    assert_eq!(
        status, 204,
        "claimed with 2 of key a Leased, limit 2: {answer}"
    );
    end(holders.pop().unwrap()).await;
    let (claim, _) = other.claim_ok(15).await;
    assert!(claim["name"].as_str().unwrap().starts_with("a-"), "{claim}");
    assert_eq!(
        holders.len(),
        1,
        "the job adopted above the limit still runs"
    );
}

/// A LeasedQueue deleted and made again: the slots of the old one (which garbage collection
/// deletes) count nothing for the new one, whose limit waits until the controller gave the
/// Leased jobs slots of its own.
#[tokio::test]
async fn a_leased_queue_made_again_counts_its_leased_jobs_in_slots_of_its_own() {
    let Fixture { client, ns } = fixture!("limits-again");
    let _controller = controller(&ns.name);
    apply_queue(&client, &ns.name, json!({"maxLeased": 2})).await;
    for i in 0..5 {
        create_keyed(&client, &ns.name, &format!("a-{i}"), "a").await;
    }
    let holders = hold(&ns.name, 2).await;
    let queues: Api<LeasedQueue> = Api::namespaced(client.clone(), &ns.name);
    let old = queues.get("q").await.unwrap().uid().unwrap();
    queues.delete("q", &Default::default()).await.unwrap();
    wait_for("the LeasedQueue gone", Duration::from_secs(30), || async {
        queues.get_opt("q").await.ok()?.is_none().then_some(())
    })
    .await;
    apply_queue(&client, &ns.name, json!({"maxLeased": 2})).await;
    let new = queues.get("q").await.unwrap().uid().unwrap();
    assert_ne!(old, new);
    wait_for(
        "the new limit confirmed",
        Duration::from_secs(30),
        || async {
            let q = queues.get("q").await.ok()?;
            leasehold_core::adoption::adopted(&q).then_some(())
        },
    )
    .await;
    // The old slots go (garbage collection); the two Leased jobs still fill the limit.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    wait_for("the old slots deleted", Duration::from_secs(60), || async {
        let list = leases
            .list(&kube::api::ListParams::default().labels("leasehold.dev/slot-of=q"))
            .await
            .ok()?;
        list.items
            .iter()
            .all(|l| l.owner_references().iter().all(|o| o.uid != old))
            .then_some(())
    })
    .await;
    let waiter = Sidecar::start(&ns.name, "q", "waiter", &[]).await;
    let (status, answer) = waiter.claim(2).await;
    assert_eq!(status, 204, "a third job Leased, limit 2: {answer}");
    for held in holders {
        end(held).await;
    }
    let (claim, _) = waiter.claim_ok(15).await;
    eprintln!("claimed {} once the two had ended", claim["name"]);
}

/// A sidecar choosing on its own (no dispatcher) whose oldest claimable jobs all belong to a
/// key at its limit passes over that key and claims a job of another key at once, instead of
/// waiting behind the full key's jobs.
#[tokio::test]
async fn a_full_key_at_the_head_does_not_hold_back_the_other_keys() {
    let Fixture { client, ns } = fixture!("limits-head");
    let _controller = controller(&ns.name);
    apply_queue(&client, &ns.name, json!({"maxLeasedPerKey": 1})).await;
    // 40 jobs of key a, older than the one job of key b: every window a claimer picks from
    // starts with a's.
    for i in 0..40 {
        create_keyed(&client, &ns.name, &format!("a-{i:02}"), "a").await;
    }
    let holder = Sidecar::start(&ns.name, "q", "holder", &[]).await;
    let (claim, _token) = holder.claim_ok(10).await;
    assert!(claim["name"].as_str().unwrap().starts_with("a-"), "{claim}");
    // Made once key a is full (a claimer alone picks at random in its window, which could
    // otherwise be b-0 itself).
    create_keyed(&client, &ns.name, "b-0", "b").await;
    let other = Sidecar::start(&ns.name, "q", "other", &[]).await;
    let asked = std::time::Instant::now();
    let (status, claim) = other.claim(5).await;
    assert_eq!(
        (status, claim["name"].as_str()),
        (200, Some("b-0")),
        "the job of key b waited behind key a's: {claim}"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "b-0 claimed {:?} after asking",
        asked.elapsed()
    );
}

/// The slots of key `key` of queue q naming a claim: (index, the job it names).
async fn key_slots(client: &kube::Client, ns: &str, key: &str) -> Vec<(u32, String)> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let scope = Scope::Key(key.into()).label();
    let mut named: Vec<(u32, String)> = leases
        .list(&kube::api::ListParams::default().labels("leasehold.dev/slot-of=q"))
        .await
        .unwrap()
        .items
        .iter()
        .filter_map(|l| {
            let index = leasehold_core::slots::index_of(&l.name_any(), "q", &scope)?;
            let identity = l.spec.as_ref()?.holder_identity.as_deref()?;
            Some((index, SlotHolder::parse(identity)?.job))
        })
        .collect();
    named.sort();
    named
}

#[tokio::test]
async fn claims_take_the_slots_the_dispatcher_suggests() {
    let Fixture { client, ns } = fixture!("limits-suggest");
    let controller = controller(&ns.name);
    advertised(&client, &ns.name).await;
    // Eight slots for two jobs: on its own, a claim starts at a place of its own job's.
    apply_queue(&client, &ns.name, json!({"maxLeasedPerKey": 8})).await;
    let token = dispatch_token_file(&ns.name);
    let token = token.to_str().unwrap();
    // The sidecars start first, so that they follow the advert before there is a job to
    // choose on their own.
    let mut sidecars = Vec::new();
    for i in 0..2 {
        let extra = ["--dispatch-token-file", token];
        sidecars.push(Sidecar::start(&ns.name, "q", &format!("pod-{i}"), &extra).await);
    }
    for i in 0..2 {
        create_keyed(&client, &ns.name, &format!("a-{i}"), "a").await;
    }
    wait_queued(&client, &ns.name, &["a-0", "a-1"]).await;
    dispatcher_sees(controller.port.unwrap(), 2).await;
    let mut claimed = Vec::new();
    for sidecar in &sidecars {
        let (claim, _) = sidecar.claim_ok(20).await;
        claimed.push(claim["name"].as_str().unwrap().to_string());
    }
    assert_eq!(claimed, ["a-0", "a-1"], "offered in claim order");
    let want: Vec<(u32, String)> = vec![(0, "a-0".into()), (1, "a-1".into())];
    assert_eq!(key_slots(&client, &ns.name, "a").await, want);
    // Both through the dispatcher (not the fallback, which suggests nothing).
    for sidecar in &sidecars {
        let metrics = sidecar.metrics().await;
        assert_eq!(
            sample(&metrics, "leasehold_claims_offered_total"),
            Some(1.0),
            "{metrics}"
        );
    }
}

/// A claimer that ended its job swaps that job's slot for its next claim of the key, through
/// the dispatcher: no second slot is made, the claim records the LeasedQueue's generation
/// with its limits, and the key's limit holds with another claimer taking the other slot. A
/// change of the queue's spec (a new generation) ends the swaps: the next claim lists.
#[tokio::test]
async fn a_claimer_swaps_its_own_slot_for_its_next_job_of_the_key() {
    let Fixture { client, ns } = fixture!("limits-swap");
    let controller = controller(&ns.name);
    advertised(&client, &ns.name).await;
    apply_queue(&client, &ns.name, json!({"maxLeasedPerKey": 2})).await;
    let token = dispatch_token_file(&ns.name);
    let extra = ["--dispatch-token-file", token.to_str().unwrap()];
    let first = Sidecar::start(&ns.name, "q", "pod-0", &extra).await;
    let second = Sidecar::start(&ns.name, "q", "pod-1", &extra).await;
    let names: Vec<String> = (0..5).map(|i| format!("a-{i}")).collect();
    for name in &names[..4] {
        create_keyed(&client, &ns.name, name, "a").await;
    }
    let waiting: Vec<&str> = names[..4].iter().map(String::as_str).collect();
    wait_queued(&client, &ns.name, &waiting).await;
    dispatcher_sees(controller.port.unwrap(), 4).await;
    let queues: Api<LeasedQueue> = Api::namespaced(client.clone(), &ns.name);
    let queue = queues.get("q").await.unwrap();
    let (uid, generation) = (queue.uid().unwrap(), queue.metadata.generation.unwrap());
    let plain = format!("{uid}:maxLeasedPerKey=2");
    let swapped = format!("{uid}/{generation}:maxLeasedPerKey=2");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    // The first claim takes slot 0 (a list, a judging read if need be); its end frees it.
    let (job, token) = claim_named(&first).await;
    assert_eq!(
        (job.as_str(), limits_of(&jobs, &job).await),
        ("a-0", plain.clone())
    );
    completed(&first, &job, &token).await;
    // The next claim of the key swaps it: still one slot, now a-1's.
    let (job, token_1) = claim_named(&first).await;
    assert_eq!(
        (job.as_str(), limits_of(&jobs, &job).await),
        ("a-1", swapped.clone())
    );
    let want: Vec<(u32, String)> = vec![(0, "a-1".into())];
    assert_eq!(key_slots(&client, &ns.name, "a").await, want);
    // Another claimer takes the other slot; the key is full.
    let (job, token_2) = claim_named(&second).await;
    assert_eq!(
        (job.as_str(), limits_of(&jobs, &job).await),
        ("a-2", plain.clone())
    );
    let (status, answer) = second.claim(1).await;
    assert_eq!(
        status, 204,
        "a third job of key a under a limit of 2: {answer}"
    );
    // a-1 ends, and its claimer swaps its slot again for a-3.
    completed(&first, "a-1", &token_1).await;
    let (job, token_3) = claim_named(&first).await;
    assert_eq!(
        (job.as_str(), limits_of(&jobs, &job).await),
        ("a-3", swapped.clone())
    );
    let want: Vec<(u32, String)> = vec![(0, "a-3".into()), (1, "a-2".into())];
    assert_eq!(key_slots(&client, &ns.name, "a").await, want);
    // A change of the spec (a weight) is a new generation: a-3's slot is not swapped under it.
    queues
        .patch(
            "q",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"weights": {"a": 2}}})),
        )
        .await
        .unwrap();
    // The controller has seen the new generation (its status says so), and so, a moment after
    // it, has the sidecar's watch of the same LeasedQueue.
    let new_generation = generation + 1;
    wait_for("the new generation seen", Duration::from_secs(20), || {
        let queues = queues.clone();
        async move {
            let queue = queues.get("q").await.ok()?;
            let seen = queue.status.as_ref()?.observed_generation?;
            (seen >= new_generation).then_some(())
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    completed(&first, "a-3", &token_3).await;
    create_keyed(&client, &ns.name, "a-4", "a").await;
    let (job, _) = claim_named(&first).await;
    assert_eq!((job.as_str(), limits_of(&jobs, &job).await), ("a-4", plain));
    completed(&second, "a-2", &token_2).await;
    // The first claimer's slot writes: a-1's and a-3's swaps (their records above say so),
    // and a take for each of a-0 and a-4, or more: a claim write that loses (409) to a change
    // of its job is made again, after a take of its own.
    let metrics = first.metrics().await;
    let written = |kind: &str| {
        let series = format!(r#"leasehold_slot_writes_total{{kind="{kind}",result="written"}}"#);
        sample(&metrics, &series).unwrap_or(0.0)
    };
    assert_eq!(written("swap"), 2.0, "{metrics}");
    assert!(written("take") >= 2.0, "{metrics}");
}

/// Claims a job with `sidecar`: its name and token.
async fn claim_named(sidecar: &Sidecar) -> (String, String) {
    let (claim, token) = sidecar.claim_ok(20).await;
    (claim["name"].as_str().unwrap().to_string(), token)
}

/// Completes the job `name` that `sidecar` holds with `token`.
async fn completed(sidecar: &Sidecar, name: &str, token: &str) {
    let (status, body) = sidecar.complete(name, token, json!("done")).await;
    assert_eq!(status, 200, "{body}");
}

/// The limits the latest claim of job `name` recorded (`status.limits`).
async fn limits_of(jobs: &Api<LeasedJob>, name: &str) -> String {
    jobs.get(name)
        .await
        .unwrap()
        .status
        .unwrap()
        .limits
        .unwrap()
}

/// A fake dispatcher's state: the job it offers (none while empty), and how often it was
/// asked.
#[derive(Default)]
struct Liar {
    offers: std::sync::Mutex<String>,
    polls: std::sync::atomic::AtomicUsize,
}

/// Claims `name` through the fake dispatcher `liar` with `sidecar`: the claim is asked
/// first, the job made once the sidecar asks the liar (so that it cannot choose the job on
/// its own before it follows the advert), and offered once Queued.
async fn claim_through(
    client: &kube::Client,
    ns: &str,
    liar: &Arc<Liar>,
    sidecar: Sidecar,
    name: &str,
    wait: u64,
) -> (Sidecar, u16, serde_json::Value) {
    let asked = liar.polls.load(Ordering::SeqCst);
    let claim = tokio::spawn(async move {
        let (status, answer) = sidecar.claim(wait).await;
        (sidecar, status, answer)
    });
    wait_for(
        "the sidecar asks the dispatcher",
        Duration::from_secs(20),
        || async { (liar.polls.load(Ordering::SeqCst) > asked).then_some(()) },
    )
    .await;
    create_keyed(client, ns, name, "a").await;
    wait_queued(client, ns, &[name]).await;
    *liar.offers.lock().unwrap() = name.into();
    let got = claim.await.unwrap();
    liar.offers.lock().unwrap().clear();
    got
}

#[tokio::test]
async fn a_dispatcher_suggesting_a_busy_slot_does_not_break_a_limit() {
    let Fixture { client, ns } = fixture!("limits-liar");
    let _controller = controller_with(&ns.name, "test-controller", &["--dispatch", "false"]);
    apply_queue(&client, &ns.name, json!({"maxLeasedPerKey": 2})).await;
    // A dispatcher that offers the job the test names, always suggesting key slot 0, and
    // queue slot 3 (the queue has no such limit).
    let liar = Arc::new(Liar::default());
    let router = liar_router(&liar, json!({"keySlot": 0, "queueSlot": 3}));
    let token = fake_dispatcher(&client, &ns.name, router).await;
    let token = token.to_str().unwrap();
    let mut held = Vec::new();
    for (i, name) in ["a-0", "a-1"].into_iter().enumerate() {
        let extra = ["--dispatch-token-file", token];
        let sidecar = Sidecar::start(&ns.name, "q", &format!("pod-{i}"), &extra).await;
        let (sidecar, status, claim) =
            claim_through(&client, &ns.name, &liar, sidecar, name, 20).await;
        assert_eq!(
            (status, claim["name"].as_str()),
            (200, Some(name)),
            "{claim}"
        );
        held.push((sidecar, name.to_string(), token_of(&claim)));
    }
    // a-1's claim passed over slot 0, a-0's, for the free one.
    let want: Vec<(u32, String)> = vec![(0, "a-0".into()), (1, "a-1".into())];
    assert_eq!(key_slots(&client, &ns.name, "a").await, want);
    // The key is full: a-2, offered with the busy slot, is not claimed.
    let third = Sidecar::start(&ns.name, "q", "pod-2", &["--dispatch-token-file", token]).await;
    let (third, status, answer) = claim_through(&client, &ns.name, &liar, third, "a-2", 5).await;
    assert_eq!(
        status, 204,
        "a third job of key a claimed under a limit of 2: {answer}"
    );
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    assert_eq!(jobs.get("a-2").await.unwrap().phase(), Phase::Queued);
    // a-0 ends: its slot comes back, and a-2 takes it (offered, or found on its own).
    end(held.remove(0)).await;
    *liar.offers.lock().unwrap() = "a-2".into();
    let (claim, _) = third.claim_ok(20).await;
    assert_eq!(claim["name"], "a-2");
    let want: Vec<(u32, String)> = vec![(0, "a-2".into()), (1, "a-1".into())];
    assert_eq!(key_slots(&client, &ns.name, "a").await, want);
}

/// A dispatcher that marks every slot it suggests as the claimer's own, a lie once another
/// claimer took that slot, does not break a limit: the claimer's swap is refused (its own
/// write is no longer the slot's last), and it takes the key as usual and finds it full.
#[tokio::test]
async fn a_dispatcher_marking_a_busy_slot_as_the_claimers_own_does_not_break_a_limit() {
    let Fixture { client, ns } = fixture!("limits-own-liar");
    let _controller = controller_with(&ns.name, "test-controller", &["--dispatch", "false"]);
    apply_queue(&client, &ns.name, json!({"maxLeasedPerKey": 1})).await;
    let liar = Arc::new(Liar::default());
    let router = liar_router(&liar, json!({"keySlot": 0, "ownKeySlot": true}));
    let token = fake_dispatcher(&client, &ns.name, router).await;
    let token = token.to_str().unwrap();
    let mine = Sidecar::start(&ns.name, "q", "pod-w", &["--dispatch-token-file", token]).await;
    let other = Sidecar::start(&ns.name, "q", "pod-x", &[]).await;
    // Made first, so that the swap below comes well within a chain's 5 s: a-1 is the one the
    // other claimer, choosing on its own, takes first (the higher priority).
    for (name, priority) in [("a-1", 5), ("a-2", 0)] {
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": name},
                   "spec": {"queue": "q", "concurrencyKey": "a", "priority": priority,
                            "leaseDurationSeconds": 5}}),
        )
        .await;
    }
    wait_queued(&client, &ns.name, &["a-1", "a-2"]).await;
    // The claimer takes slot 0 for a-0 (it remembers no slot yet: a list), and ends a-0: slot 0
    // is its own, free.
    let (mine, status, claim) = claim_through(&client, &ns.name, &liar, mine, "a-0", 20).await;
    assert_eq!(
        (status, claim["name"].as_str()),
        (200, Some("a-0")),
        "{claim}"
    );
    completed(&mine, "a-0", &token_of(&claim)).await;
    // The other claimer takes slot 0 for a-1.
    let (claim, token_1) = other.claim_ok(20).await;
    assert_eq!(claim["name"], "a-1");
    let want: Vec<(u32, String)> = vec![(0, "a-1".into())];
    assert_eq!(key_slots(&client, &ns.name, "a").await, want);
    // Offered a-2 with slot 0 marked as its own, the claimer swaps it: refused, and the key is
    // full.
    *liar.offers.lock().unwrap() = "a-2".into();
    let (status, answer) = mine.claim(2).await;
    liar.offers.lock().unwrap().clear();
    assert_eq!(
        status, 204,
        "a second job of key a under a limit of 1: {answer}"
    );
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    assert_eq!(jobs.get("a-2").await.unwrap().phase(), Phase::Queued);
    assert_eq!(key_slots(&client, &ns.name, "a").await, want);
    let metrics = mine.metrics().await;
    let refused = r#"leasehold_slot_writes_total{kind="swap",result="refused"}"#;
    assert!(sample(&metrics, refused) >= Some(1.0), "{metrics}");
    // a-1 ends: the claimer takes the key's slot for a-2.
    completed(&other, "a-1", &token_1).await;
    *liar.offers.lock().unwrap() = "a-2".into();
    let (claim, _) = mine.claim_ok(20).await;
    assert_eq!(claim["name"], "a-2");
}

/// The fake dispatcher of `liar`: offers the job the test names (none while it names none),
/// with `hint`'s fields, at resourceVersion "1", to every poll.
fn liar_router(liar: &Arc<Liar>, hint: serde_json::Value) -> axum::Router {
    let liar = Arc::clone(liar);
    axum::Router::new()
        .route(
            "/v1/dispatch/poll",
            axum::routing::post(move || {
                liar.polls.fetch_add(1, Ordering::SeqCst);
                let name = liar.offers.lock().unwrap().clone();
                let mut offer = hint.clone();
                async move {
                    if name.is_empty() {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        return axum::Json(json!({}));
                    }
                    offer["name"] = json!(name);
                    offer["resourceVersion"] = json!("1");
                    axum::Json(offer)
                }
            }),
        )
        .route(
            "/v1/dispatch/declined",
            axum::routing::post(|| async { axum::http::StatusCode::NO_CONTENT }),
        )
}

/// Takes the slots of a claim of `copy` with a fresh token, as a sidecar does before its
/// claim write: the slot Leases taken (or reused), or None when a limit is reached.
async fn take(client: &kube::Client, ns: &str, copy: &LeasedJob, pod: &str) -> TakenFor {
    let queues: Api<LeasedQueue> = Api::namespaced(client.clone(), ns);
    let queue = queues.get("q").await.unwrap();
    let token = Token::issue(copy.attempt() + 1);
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), ns);
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let (acquired, _) = slots::acquire(
        &leases,
        &jobs,
        &queue,
        copy,
        pod,
        &token,
        slots::Hints::default(),
    )
    .await;
    let acquired = acquired.unwrap();
    match acquired {
        Acquired::All(taken) => TakenFor {
            slots: Some(taken.into_iter().map(|t| t.name).collect()),
            token,
        },
        Acquired::Full(_) => TakenFor { slots: None, token },
    }
}

/// Makes the claim write of `copy` for `pod` with `token`, which must succeed.
async fn claim_ok(jobs: &Api<LeasedJob>, copy: &LeasedJob, pod: &str, token: Token) {
    claim_with(jobs, copy, pod, None, token).await.unwrap();
}

/// What [`take`] got: the slots' names (None: full) and the claim's token.
struct TakenFor {
    slots: Option<Vec<String>>,
    token: Token,
}

/// A claimer's own free slot, swapped: refused when anyone wrote the slot since (the claim
/// then takes another slot, listing the scope as usual), and taken when nobody did.
#[tokio::test]
async fn a_swap_of_a_slot_written_since_is_refused_and_the_claim_takes_another() {
    let Fixture { client, ns } = fixture!("limits-swap-stale");
    apply_queue(&client, &ns.name, json!({"maxLeasedPerKey": 2})).await;
    for name in ["j", "k", "m", "n"] {
        create_keyed(&client, &ns.name, name, "a").await;
    }
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let queues: Api<LeasedQueue> = Api::namespaced(client.clone(), &ns.name);
    let queue = queues.get("q").await.unwrap();
    let slot = |i| Preferred {
        queue: None,
        key: Some(i),
    };
    // Takes the slots of a claim of job `name`, as pod `pod` with its free slots `own`.
    let acquire = |name: &'static str, pod: &'static str, prefer: Preferred, own| {
        let (jobs, leases, queue) = (jobs.clone(), leases.clone(), queue.clone());
        async move {
            let copy = jobs.get(name).await.unwrap();
            let token = Token::issue(copy.attempt() + 1);
            let hints = slots::Hints {
                prefer,
                swap: prefer,
                own,
            };
            let (got, writes) =
                slots::acquire(&leases, &jobs, &queue, &copy, pod, &token, hints).await;
            let Acquired::All(taken) = got.unwrap() else {
                panic!("{name}: the key is full")
            };
            (copy, token, taken, writes)
        }
    };
    // Claims `copy` with `token` after taking `taken`, then ends the attempt.
    let claim_and_end = |copy: LeasedJob, token: Token, taken: Vec<slots::Taken>| {
        let (jobs, queue) = (jobs.clone(), queue.clone());
        async move {
            let summary = slots::summary(&taken);
            let queue = Some(&queue);
            let pod = "pod-a";
            leasehold_kube::claim::claim_taking(&jobs, &copy, pod, queue, token, summary)
                .await
                .unwrap();
            let done = json!({"status": {"phase": "Succeeded"}});
            let name = copy.name_any();
            jobs.patch_status(&name, &PatchParams::default(), &Patch::Merge(&done))
                .await
                .unwrap();
        }
    };
    // pod-a takes slot 0 for j, claims j, and j ends: slot 0 is pod-a's, free.
    let took = |taken, takes_refused, swapped, swaps_refused| slots::Writes {
        taken,
        takes_refused,
        swapped,
        swaps_refused,
    };
    let (j, token, taken, writes) = acquire("j", "pod-a", slot(0), Vec::new()).await;
    assert_eq!((taken[0].index, taken[0].swapped), (0, false));
    assert_eq!(writes, took(1, 0, 0, 0));
    let own = taken[0].clone();
    assert!(own.own.is_some(), "a take is kept to swap");
    claim_and_end(j, token, taken).await;
    // pod-b takes that very slot for k (free, and judged so): pod-a's copy of it is stale.
    let (_, _, taken, writes) = acquire("k", "pod-b", slot(0), Vec::new()).await;
    assert_eq!((taken[0].index, writes), (0, took(1, 0, 0, 0)));
    // pod-a's swap of slot 0 for m is refused (409), and m's claim takes slot 1 instead.
    let (m, token, taken, writes) = acquire("m", "pod-a", slot(0), vec![own]).await;
    assert_eq!((taken[0].index, taken[0].swapped), (1, false));
    assert_eq!(writes, took(1, 0, 0, 1), "the swap refused, then a take");
    let want: Vec<(u32, String)> = vec![(0, "k".into()), (1, "m".into())];
    assert_eq!(key_slots(&client, &ns.name, "a").await, want);
    // m is claimed and ends; pod-a swaps slot 1, unwritten since, for n.
    let own = taken[0].clone();
    claim_and_end(m, token, taken).await;
    let (_, _, taken, writes) = acquire("n", "pod-a", slot(1), vec![own]).await;
    assert_eq!((taken[0].index, taken[0].swapped), (1, true));
    assert_eq!(writes, took(0, 0, 1, 0), "a swap alone");
    let want: Vec<(u32, String)> = vec![(0, "k".into()), (1, "n".into())];
    assert_eq!(key_slots(&client, &ns.name, "a").await, want);
}

/// A claim from a stale copy takes a slot and loses its write to a claim from a newer copy of
/// the same job, at the same attempt. Its slot is free again (it marks a token the job does
/// not carry), so the job counts once. Two claims of one copy share one slot, and whichever
/// wins holds it.
#[tokio::test]
async fn a_claim_lost_to_a_newer_copy_frees_its_slot_and_a_shared_slot_counts_the_winner() {
    let Fixture { client, ns } = fixture!("limits-stale");
    apply_queue(&client, &ns.name, json!({"maxLeasedPerKey": 2})).await;
    for name in ["j", "k", "m", "n"] {
        create_keyed(&client, &ns.name, name, "a").await;
    }
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let stale = jobs.get("j").await.unwrap();
    let label = json!({"metadata": {"labels": {"touched": "yes"}}});
    jobs.patch("j", &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();
    let fresh = jobs.get("j").await.unwrap();
    assert_ne!(stale.resource_version(), fresh.resource_version());

    let lost = take(&client, &ns.name, &stale, "pod-a").await;
    let conflict = claim_with(&jobs, &stale, "pod-a", None, lost.token).await;
    assert!(
        matches!(conflict, Err(ClaimError::Conflict { .. })),
        "{conflict:?}"
    );
    let won = take(&client, &ns.name, &fresh, "pod-b").await;
    assert_ne!(
        won.slots, lost.slots,
        "each copy's claim has a slot of its own"
    );
    claim_ok(&jobs, &fresh, "pod-b", won.token).await;
    // Key a holds one Leased job of two: a claim of k finds a slot, the lost claim's one.
    let k = jobs.get("k").await.unwrap();
    let k_taken = take(&client, &ns.name, &k, "pod-c").await;
    assert_eq!(
        k_taken.slots, lost.slots,
        "the slot of the claim that lost to a newer copy is free"
    );
    claim_ok(&jobs, &k, "pod-c", k_taken.token).await;
    // The key is full now, with a slot per Leased job.
    let m = jobs.get("m").await.unwrap();
    assert_eq!(take(&client, &ns.name, &m, "pod-d").await.slots, None);

    // Two claims of one copy: the second reuses the first's slot and wins; the slot counts
    // it. (k ends first, to make room for exactly one.)
    let k = jobs.get("k").await.unwrap();
    let mut done = k.clone();
    let status = done.status.as_mut().unwrap();
    status.phase = Some(Phase::Succeeded);
    jobs.replace_status("k", &PostParams::default(), &done)
        .await
        .unwrap();
    let first = take(&client, &ns.name, &m, "pod-e").await;
    let second = take(&client, &ns.name, &m, "pod-f").await;
    assert!(first.slots.is_some());
    assert_eq!(first.slots, second.slots, "one copy's claims share a slot");
    claim_ok(&jobs, &m, "pod-f", second.token).await;
    let late = claim_with(&jobs, &m, "pod-e", None, first.token).await;
    assert!(matches!(late, Err(ClaimError::Conflict { .. })), "{late:?}");
    let n = jobs.get("n").await.unwrap();
    assert_eq!(
        take(&client, &ns.name, &n, "pod-g").await.slots,
        None,
        "j and m are Leased: key a is full"
    );
}

/// A claimer that took a slot and died before its claim write leaves the slot pending on a job
/// that no claimer will pick soon (its notBefore is an hour away), holding the key's only unit.
/// The controller frees it once it has seen it pending for the grace, by a write to the job
/// guarded by the version the slot names (so no claim from that version can land), and the
/// key's other job is claimed.
#[tokio::test]
async fn a_slot_left_pending_by_a_dead_claimer_is_freed_by_the_controller() {
    let Fixture { client, ns } = fixture!("limits-pending");
    let _controller = controller(&ns.name);
    apply_queue(&client, &ns.name, json!({"maxLeasedPerKey": 1})).await;
    let queues: Api<LeasedQueue> = Api::namespaced(client.clone(), &ns.name);
    wait_for("the limit confirmed", Duration::from_secs(30), || async {
        let q = queues.get("q").await.ok()?;
        leasehold_core::adoption::adopted(&q).then_some(())
    })
    .await;
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    let not_before = k8s_openapi::jiff::Timestamp::from_second(now + 3600).unwrap();
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "later"},
               "spec": {"queue": "q", "concurrencyKey": "a", "notBefore": not_before.to_string()}}),
    )
    .await;
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let copy = wait_for("later Queued", Duration::from_secs(10), || async {
        let j = jobs.get("later").await.ok()?;
        (j.phase() == Phase::Queued && j.status.is_some()).then_some(j)
    })
    .await;
    let sidecar = Sidecar::start(&ns.name, "q", "worker", &[]).await;
    // The dead claimer's slot: taken as a sidecar takes it, its claim write never sent.
    let taken_at = std::time::Instant::now();
    let dead = take(&client, &ns.name, &copy, "dead-pod").await;
    let slot = dead.slots.expect("key a had a free slot").pop().unwrap();
    create_keyed(&client, &ns.name, "now", "a").await;
    let (status, answer) = sidecar.claim(2).await;
    assert_eq!(
        status, 204,
        "claimed while the pending slot held key a's only unit: {answer}"
    );
    let (claim, _) = sidecar.claim_ok(30).await;
    assert_eq!(claim["name"], "now", "{claim}");
    let waited = taken_at.elapsed();
    assert!(
        waited >= leasehold_core::adoption::PENDING_GRACE,
        "the slot was freed {waited:?} after it was taken, before the grace"
    );
    let later = jobs.get("later").await.unwrap();
    assert_ne!(
        later.resource_version(),
        copy.resource_version(),
        "moved past the version the slot names"
    );
    let status = later.status.unwrap();
    assert_eq!(
        status.pending_slot_freed,
        Some(format!(
            "{slot} later@{}#1",
            copy.resource_version().unwrap()
        ))
    );
    assert_eq!((status.phase, status.attempt), (Some(Phase::Queued), 0));
    assert_eq!(status.token, None, "nothing else of the job changed");
    // The dead claimer's write, guarded by the version its slot names, cannot land now.
    let mut late_claim = copy.clone();
    late_claim.status = Some(leasehold_core::claim::claimed_status(
        &copy,
        &dead.token,
        "dead-pod",
        k8s_openapi::jiff::Timestamp::now(),
        None,
    ));
    let refused = jobs
        .replace_status("later", &PostParams::default(), &late_claim)
        .await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 409),
        "{refused:?}"
    );

    // A slot whose claim landed is never freed: the write guarded by its version is refused,
    // and the job stays Leased.
    create_keyed(&client, &ns.name, "held", "b").await;
    let held = wait_for("held Queued", Duration::from_secs(10), || async {
        let j = jobs.get("held").await.ok()?;
        (j.status.is_some()).then_some(j)
    })
    .await;
    let took = take(&client, &ns.name, &held, "live-pod").await;
    let slot = took.slots.expect("key b had a free slot").pop().unwrap();
    claim_ok(&jobs, &held, "live-pod", took.token).await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let lease = leases.get(&slot).await.unwrap();
    let named = leasehold_core::slots::Named::read(
        leasehold_core::lease::holder_identity(&lease),
        lease
            .annotations()
            .get(leasehold_core::slots::CLAIMS_ANNOTATION)
            .map(String::as_str),
    )
    .unwrap();
    let freeing = leasehold_kube::adopt::free_pending(&jobs, &slot, &named, "limits-test")
        .await
        .unwrap();
    assert_eq!(freeing, leasehold_kube::adopt::Freeing::MovedOn);
    let held = jobs.get("held").await.unwrap();
    assert_eq!(held.phase(), Phase::Leased);
    assert_eq!(held.status.unwrap().pending_slot_freed, None);
}
