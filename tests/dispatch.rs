//! The dispatcher against the real control plane: the leading controller advertises where it
//! answers, offers a queue's jobs in claim order and never one job to two workers while the
//! offer stands, and answers only callers whose audience-bound service-account token the API
//! server accepts and who may claim in the namespace asked about.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::PostParams;
use kube::Api;
use leasehold_core::crd::LeasedJob;
use leasehold_testkit::*;
use serde_json::{json, Value};

use leasehold_testkit::dispatcher::{advertised, dispatcher_sees, fake_dispatcher, wait_queued};

async fn create_job(client: &kube::Client, ns: &str, name: &str, priority: i32) {
    create_job_in(client, ns, "q", name, priority).await;
}

async fn create_job_in(client: &kube::Client, ns: &str, queue: &str, name: &str, priority: i32) {
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), ns);
    let job: LeasedJob = serde_json::from_value(json!({
        "apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedJob",
        "metadata": {"name": name},
        "spec": {"queue": queue, "priority": priority, "payload": {"n": name}},
    }))
    .unwrap();
    jobs.create(&PostParams::default(), &job).await.unwrap();
}

/// Polls the dispatcher at `address`; the answer's status and JSON body (Null when empty).
async fn poll(
    address: &str,
    token: Option<&str>,
    ns: &str,
    worker: &str,
    wait_ms: u64,
) -> (u16, Value) {
    post(
        address,
        "/v1/dispatch/poll",
        token,
        json!({"namespace": ns, "queue": "q", "worker": worker, "waitMs": wait_ms}),
    )
    .await
}

async fn post(address: &str, path: &str, token: Option<&str>, body: Value) -> (u16, Value) {
    let mut request = reqwest::Client::new()
        .post(format!("http://{address}{path}"))
        .json(&body);
    if let Some(t) = token {
        request = request.bearer_auth(t);
    }
    let response = request.send().await.expect("dispatcher reachable");
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let body = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    };
    (status, body)
}

fn name(answer: &(u16, Value)) -> &str {
    assert_eq!(answer.0, 200, "an offer: {answer:?}");
    answer.1["name"].as_str().expect("name")
}

/// A token of `sa` for the dispatcher's audience, bound to a new pod `pod` of that
/// ServiceAccount (a pod object only: nothing runs it), as the kubelet projects one.
fn pod_bound_token(ns: &str, sa: &str, pod: &str) -> String {
    let manifest = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod, "namespace": ns},
        "spec": {"serviceAccountName": sa, "automountServiceAccountToken": false,
            "containers": [{"name": "worker", "image": "worker:never-pulled"}]}});
    let (ok, out) = kubectl(&["create", "-f", "-"], &manifest.to_string());
    assert!(ok, "kubectl create pod: {out}");
    let args = [
        "create",
        "token",
        sa,
        "--namespace",
        ns,
        "--duration",
        "1h",
        "--audience",
        "leasehold-dispatcher",
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        pod,
    ];
    let (ok, out) = kubectl(&args, "");
    assert!(ok, "kubectl create token: {out}");
    out.trim().to_string()
}

#[tokio::test]
async fn only_the_caller_an_offer_stands_for_can_decline_it() {
    let Fixture { client, ns } = fixture!("declines");
    let controller = controller(&ns.name);
    let address = advertised(&client, &ns.name).await;
    service_account(&ns.name, "claimer", true);
    service_account(&ns.name, "rival", true);
    // Two pods of one ServiceAccount, and another ServiceAccount that may claim too.
    let a = pod_bound_token(&ns.name, "claimer", "pod-a");
    let b = pod_bound_token(&ns.name, "claimer", "pod-b");
    let rival = sa_token(&ns.name, "rival", Some("leasehold-dispatcher"));
    create_job(&client, &ns.name, "only", 0).await;
    wait_queued(&client, &ns.name, &["only"]).await;
    dispatcher_sees(controller.port.unwrap(), 1).await;
    // Each token reviewed before the offer (a poll of another queue), so that what follows
    // takes well under the offer's 2 s.
    for token in [&a, &b, &rival] {
        let warm = post(
            &address,
            "/v1/dispatch/poll",
            Some(token),
            json!({"namespace": ns.name, "queue": "warm", "worker": "w", "waitMs": 1}),
        )
        .await;
        assert_eq!(warm.0, 204, "{warm:?}");
    }

    let offered = Instant::now();
    assert_eq!(
        name(&poll(&address, Some(&a), &ns.name, "w", 2000).await),
        "only"
    );
    // Declines of w's offer by the other pod of the same ServiceAccount, and by another
    // ServiceAccount, each giving w's name: answered as any decline is, and ignored.
    let decline = |token: String| {
        let (address, ns) = (address.clone(), ns.name.clone());
        async move {
            post(
                &address,
                "/v1/dispatch/declined",
                Some(&token),
                json!({"namespace": ns, "queue": "q", "worker": "w", "name": "only"}),
            )
            .await
        }
    };
    for other in [&b, &rival] {
        let forged = decline(other.clone()).await;
        assert_eq!(forged.0, 204, "{forged:?}");
    }
    let withheld = poll(&address, Some(&b), &ns.name, "w2", 300).await;
    assert_eq!(
        withheld.0, 204,
        "the offer to pod-a's w still stands: {withheld:?}"
    );
    // Its own caller's decline ends it: the job goes to the next worker at once, not when
    // the offer lapses (2 s after it was made).
    assert_eq!(decline(a.clone()).await.0, 204);
    let at_once = poll(&address, Some(&b), &ns.name, "w2", 2000).await;
    assert_eq!(name(&at_once), "only");
    assert!(
        offered.elapsed() < Duration::from_millis(1900),
        "the job came {:?} after its offer: from the offer's lapse, not the decline",
        offered.elapsed()
    );
}

#[tokio::test]
async fn offers_go_in_claim_order_never_twice_and_only_to_those_who_may_claim() {
    let Fixture { client, ns } = fixture!("dispatch");
    let controller = controller(&ns.name);
    let address = advertised(&client, &ns.name).await;
    service_account(&ns.name, "claimer", true);
    service_account(&ns.name, "reader", false);
    let claimer = sa_token(&ns.name, "claimer", Some("leasehold-dispatcher"));
    create_job(&client, &ns.name, "low-old", 0).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    create_job(&client, &ns.name, "low-new", 0).await;
    create_job(&client, &ns.name, "high", 5).await;
    wait_queued(&client, &ns.name, &["low-old", "low-new", "high"]).await;
    dispatcher_sees(controller.port.unwrap(), 3).await;

    // Claim order: priority first, then age; each job to one worker while its offer stands.
    let c = Some(claimer.as_str());
    assert_eq!(name(&poll(&address, c, &ns.name, "w1", 2000).await), "high");
    assert_eq!(
        name(&poll(&address, c, &ns.name, "w2", 2000).await),
        "low-old"
    );
    assert_eq!(
        name(&poll(&address, c, &ns.name, "w3", 2000).await),
        "low-new"
    );
    assert_eq!(poll(&address, c, &ns.name, "w4", 300).await.0, 204);
    // w2 could not claim low-old: it goes to the next worker at once.
    let declined = post(
        &address,
        "/v1/dispatch/declined",
        c,
        json!({"namespace": ns.name, "queue": "q", "worker": "w2", "name": "low-old"}),
    )
    .await;
    assert_eq!(declined.0, 204, "{declined:?}");
    assert_eq!(
        name(&poll(&address, c, &ns.name, "w4", 2000).await),
        "low-old"
    );

    // A waiting worker gets a job the moment it is created.
    let waiting = {
        let (address, token, ns) = (address.clone(), claimer.clone(), ns.name.clone());
        tokio::spawn(async move { poll(&address, Some(&token), &ns, "w5", 20_000).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    create_job(&client, &ns.name, "fresh", 0).await;
    let fresh = waiting.await.unwrap();
    assert_eq!(name(&fresh), "fresh");

    // With keepAliveMs, a waiting poll streams newlines, then its answer: `{}` for none, the
    // job when one comes (a queue of its own: the offers above lapse after 2 s).
    let streamed = |wait_ms: u64| {
        let (address, token, ns) = (address.clone(), claimer.clone(), ns.name.clone());
        async move {
            let response = reqwest::Client::new()
                .post(format!("http://{address}/v1/dispatch/poll"))
                .bearer_auth(token)
                .json(&json!({"namespace": ns, "queue": "s", "worker": "w6",
                    "waitMs": wait_ms, "keepAliveMs": 100}))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            response.text().await.unwrap()
        }
    };
    let none = streamed(700).await;
    assert!(
        none.starts_with("\n\n") && none.trim() == "{}",
        "newlines, then {{}}: {none:?}"
    );
    let waiting = tokio::spawn(streamed(20_000));
    tokio::time::sleep(Duration::from_millis(500)).await;
    create_job_in(&client, &ns.name, "s", "streamed", 0).await;
    let offer: Value = serde_json::from_str(waiting.await.unwrap().trim()).unwrap();
    assert_eq!(offer["name"], "streamed");

    // Refusals name the rule and never a job.
    let no_token = poll(&address, None, &ns.name, "x", 100).await;
    assert_eq!(no_token.0, 401, "{no_token:?}");
    let api_audience = sa_token(&ns.name, "claimer", None);
    let wrong_audience = poll(&address, Some(&api_audience), &ns.name, "x", 100).await;
    assert_eq!(wrong_audience.0, 401, "{wrong_audience:?}");
    let reader = sa_token(&ns.name, "reader", Some("leasehold-dispatcher"));
    let not_allowed = poll(&address, Some(&reader), &ns.name, "x", 100).await;
    assert_eq!(not_allowed.0, 403, "{not_allowed:?}");
    let other_ns = poll(&address, c, "kube-system", "x", 100).await;
    assert_eq!(other_ns.0, 403, "{other_ns:?}");
    for refusal in [&no_token, &wrong_audience, &not_allowed, &other_ns] {
        let text = refusal.1.to_string();
        for job in ["high", "low-old", "low-new", "fresh", "streamed"] {
            assert!(!text.contains(job), "a refusal named job {job}: {text}");
        }
    }
    // Bad bodies: refused with the rule, nothing offered.
    let bad_bodies = [
        (
            json!({"namespace": "Not A Namespace", "queue": "q", "worker": "x", "waitMs": 1}),
            400,
            "invalid_request",
        ),
        (
            json!({"namespace": ns.name, "queue": "Q!", "worker": "x", "waitMs": 1}),
            400,
            "invalid_request",
        ),
        (
            json!({"namespace": ns.name, "queue": "q", "worker": "x", "waitMs": 1, "extra": true}),
            400,
            "invalid_request",
        ),
        (
            json!({"namespace": ns.name, "queue": "q", "waitMs": 1}),
            400,
            "invalid_request",
        ),
        (
            json!({"namespace": ns.name, "queue": "q", "worker": "x", "waitMs": 1, "keepAliveMs": 5}),
            400,
            "invalid_request",
        ),
        (
            json!({"namespace": ns.name, "queue": "q", "worker": "x".repeat(20_000), "waitMs": 1}),
            413,
            "too_large",
        ),
    ];
    // A poll's ownSlots: at most 16, keys of 1 to 128 characters, indices below 1,000, and no
    // other field.
    let own = |slots: serde_json::Value| json!({"namespace": ns.name, "queue": "q", "worker": "x", "waitMs": 1, "ownSlots": slots});
    let many: Vec<_> = (0..17).map(|i| json!({"index": i})).collect();
    let bad_bodies: Vec<_> = bad_bodies
        .into_iter()
        .chain(
            [
                json!(many),
                json!([{"key": "", "index": 0}]),
                json!([{"key": "k".repeat(129), "index": 0}]),
                json!([{"key": "a", "index": 1000}]),
                json!([{"key": "a", "index": -1}]),
                json!([{"key": "a", "index": 0, "extra": 1}]),
                json!({"key": "a", "index": 0}),
            ]
            .into_iter()
            .map(|slots| (own(slots), 400, "invalid_request")),
        )
        .collect();
    for (body, status, code) in bad_bodies {
        let answer = post(&address, "/v1/dispatch/poll", c, body.clone()).await;
        assert_eq!(
            (answer.0, answer.1["error"].as_str()),
            (status, Some(code)),
            "{body}: {answer:?}"
        );
    }

    // The advert names the leading replica; nobody else writes it.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let advert = leases
        .get(leasehold_core::dispatch::ADVERT_LEASE)
        .await
        .unwrap();
    assert_eq!(
        advert.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("test-controller")
    );
}

/// Claims through `sidecar` and returns the job's name (completing it at once).
async fn claim_name(sidecar: &Sidecar) -> String {
    let (claim, token) = sidecar.claim_ok(10).await;
    let name = claim["name"].as_str().unwrap().to_string();
    let (status, body) = sidecar.complete(&name, &token, json!("done")).await;
    assert_eq!(status, 200, "{body}");
    name
}

#[tokio::test]
async fn sidecars_claim_in_the_dispatchers_global_order() {
    let Fixture { client, ns } = fixture!("dispatch-order");
    let controller = controller(&ns.name);
    advertised(&client, &ns.name).await;
    let token = dispatch_token_file(&ns.name);
    let token = token.to_str().unwrap();
    let mut sidecars = Vec::new();
    for i in 0..3 {
        sidecars.push(
            Sidecar::start(
                &ns.name,
                "q",
                &format!("pod-{i}"),
                &["--dispatch-token-file", token],
            )
            .await,
        );
    }
    // 12 jobs of three priorities, created while nobody claims: without the dispatcher each
    // sidecar picks at random among the oldest 16 (--spread), so an exact order would be luck.
    let mut names = Vec::new();
    for i in 0..12 {
        let name = format!("job-{i:02}");
        create_job(&client, &ns.name, &name, [0, 3, 7][i % 3]).await;
        names.push(name);
    }
    wait_queued(
        &client,
        &ns.name,
        &names.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    dispatcher_sees(controller.port.unwrap(), 12).await;
    let expected = in_claim_order(&client, &ns.name, &names).await;
    let mut claimed = Vec::new();
    for i in 0..12 {
        claimed.push(claim_name(&sidecars[i % 3]).await);
    }
    assert_eq!(
        claimed, expected,
        "claims follow the dispatcher's one order"
    );
}

/// Once the dispatcher of `ns` is advertised, a sidecar of queue "q" (pod-0) that claims
/// through it.
async fn dispatched_sidecar(client: &kube::Client, ns: &str) -> Sidecar {
    advertised(client, ns).await;
    let token = dispatch_token_file(ns);
    Sidecar::start(
        ns,
        "q",
        "pod-0",
        &["--dispatch-token-file", token.to_str().unwrap()],
    )
    .await
}

/// The field managers that wrote the status of job `name`.
async fn status_writers(client: &kube::Client, ns: &str, name: &str) -> Vec<String> {
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), ns);
    let job = jobs.get(name).await.unwrap();
    job.metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter(|f| f.subresource.as_deref() == Some("status"))
        .filter_map(|f| f.manager)
        .collect()
}

#[tokio::test]
async fn a_job_created_while_a_worker_waits_is_claimed_with_no_initial_status_write() {
    let Fixture { client, ns } = fixture!("dispatch-hold");
    let _controller = controller(&ns.name);
    let sidecar = dispatched_sidecar(&client, &ns.name).await;
    let controller_wrote = |writers: &[String]| {
        writers
            .iter()
            .any(|m| m.starts_with("leasehold-controller/"))
    };
    // The sidecar claims through the dispatcher (it has found it).
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0.. {
        let warm = format!("warm-{i}");
        create_job(&client, &ns.name, &warm, 0).await;
        wait_queued(&client, &ns.name, &[&warm]).await;
        assert_eq!(claim_name(&sidecar).await, warm);
        if claim_counts(&sidecar).await.1 > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "never offered a job");
    }
    // A worker waits through the dispatcher when the job is created: the controller holds
    // its initial status back, and the claim is the job's first status write.
    let (claimed, ()) = tokio::join!(sidecar.claim_ok(10), async {
        // Time for the claim's poll to reach the dispatcher (one request on loopback).
        tokio::time::sleep(Duration::from_secs(1)).await;
        create_job(&client, &ns.name, "waited-for", 0).await;
    });
    assert_eq!(claimed.0["name"], "waited-for");
    let writers = status_writers(&client, &ns.name, "waited-for").await;
    assert!(!controller_wrote(&writers), "status written by {writers:?}");
    // Nor does the controller write it after the hold: the job has a status.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let writers = status_writers(&client, &ns.name, "waited-for").await;
    assert!(!controller_wrote(&writers), "status written by {writers:?}");
    let (status, body) = sidecar
        .complete("waited-for", &claimed.1, json!("done"))
        .await;
    assert_eq!(status, 200, "{body}");
    // With no worker waiting, the controller initialises a new job itself.
    create_job(&client, &ns.name, "unwaited", 0).await;
    wait_queued(&client, &ns.name, &["unwaited"]).await;
    let writers = status_writers(&client, &ns.name, "unwaited").await;
    assert!(controller_wrote(&writers), "status written by {writers:?}");
}

#[tokio::test]
async fn claims_fall_back_while_the_dispatcher_is_frozen_and_use_it_again_after() {
    let Fixture { client, ns } = fixture!("dispatch-frozen");
    let controller = controller(&ns.name);
    let sidecar = dispatched_sidecar(&client, &ns.name).await;
    create_job(&client, &ns.name, "before", 0).await;
    wait_queued(&client, &ns.name, &["before"]).await;
    assert_eq!(claim_name(&sidecar).await, "before");

    // The dispatcher is frozen (SIGSTOP): its TCP port still accepts, nothing answers. (A
    // job the frozen controller has not initialised has no status yet: it is Queued.)
    controller.signal("STOP");
    let started = Instant::now();
    create_job(&client, &ns.name, "during", 0).await;
    let during = tokio::spawn(async move {
        let name = claim_name(&sidecar).await;
        (name, sidecar)
    });
    let (name, sidecar) = during.await.unwrap();
    assert_eq!(name, "during");
    eprintln!(
        "claimed with the dispatcher frozen after {} ms",
        started.elapsed().as_millis()
    );
    controller.signal("CONT");
    // Once the dispatcher's 5 s aside are over, claims go through it again: six jobs of one
    // priority are claimed in exactly their order, which a sidecar choosing on its own (at
    // random among the oldest 16) would do once in 720 runs.
    tokio::time::sleep(Duration::from_millis(5500)).await;
    let names: Vec<String> = (0..6).map(|i| format!("after-{i}")).collect();
    for name in &names {
        create_job(&client, &ns.name, name, 0).await;
    }
    wait_queued(
        &client,
        &ns.name,
        &names.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    let mut claimed = Vec::new();
    for _ in &names {
        claimed.push(claim_name(&sidecar).await);
    }
    assert_eq!(claimed, in_claim_order(&client, &ns.name, &names).await);
}

/// The sidecar's `leasehold_claims_total` and `leasehold_claims_offered_total`.
async fn claim_counts(sidecar: &Sidecar) -> (u64, u64) {
    let text = sidecar.metrics().await;
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0)
    };
    (
        value("leasehold_claims_total"),
        value("leasehold_claims_offered_total"),
    )
}

#[tokio::test]
async fn claims_fall_back_while_the_dispatchers_path_to_the_api_server_stalls() {
    let Fixture { client, ns } = fixture!("dispatch-stale");
    // The controller (never deposed: no election) reaches the API server through a relay;
    // the sidecar reaches both directly, as a sidecar on another node would.
    let relay = faults::Relay::start(faults::apiserver_port());
    let port = free_port();
    let _controller = Proc::spawn_as(
        &format!("{}-stale-controller", ns.name),
        &leasehold_bin(),
        &ControllerArgs::new(&ns.name)
            .identity("stale-controller")
            .leader_elect(false)
            .metrics_addr(&format!("127.0.0.1:{port}"))
            .to_args(),
        std::process::Stdio::null(),
        &relay.kubeconfig(&format!("{}-stale-controller", ns.name)),
    );
    let sidecar = dispatched_sidecar(&client, &ns.name).await;
    create_job(&client, &ns.name, "before", 0).await;
    wait_queued(&client, &ns.name, &["before"]).await;
    assert_eq!(claim_name(&sidecar).await, "before");
    assert_eq!(
        claim_counts(&sidecar).await,
        (1, 1),
        "offered by the dispatcher"
    );

    // The dispatcher's path to the API server holds every byte: its watch sees no new job,
    // while it still answers its polls' keep-alives. Its check of that path fails, so it
    // ends its polls and the sidecar chooses on its own: the claim does not wait for the
    // stall to end (it would have waited its whole 10 s).
    relay.stall();
    let started = Instant::now();
    create_job(&client, &ns.name, "during", 0).await;
    assert_eq!(claim_name(&sidecar).await, "during");
    let took = started.elapsed();
    eprintln!(
        "claimed with the dispatcher's API path stalled after {} ms",
        took.as_millis()
    );
    assert!(
        took < Duration::from_secs(3),
        "the claim waited {took:?} on a dispatcher that could not see the job"
    );
    assert_eq!(
        claim_counts(&sidecar).await,
        (2, 1),
        "chosen by the sidecar"
    );

    // Still stalled, after the sidecar's 1 s aside: asked again, the dispatcher says at once
    // that its view is stale (it has gone on checking its path with no poll waiting).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let started = Instant::now();
    create_job(&client, &ns.name, "during-2", 0).await;
    assert_eq!(claim_name(&sidecar).await, "during-2");
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "the second claim waited {took:?} on a dispatcher that could not see the job"
    );
    assert_eq!(
        claim_counts(&sidecar).await,
        (3, 1),
        "chosen by the sidecar"
    );

    // The path flows again: the dispatcher's next check passes, and once the sidecar's aside
    // is over (at most 2 s after two failures in a row) it offers again.
    relay.resume();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    create_job(&client, &ns.name, "after", 0).await;
    wait_queued(&client, &ns.name, &["after"]).await;
    assert_eq!(claim_name(&sidecar).await, "after");
    assert_eq!(claim_counts(&sidecar).await, (4, 2), "offered again");
}

/// `names` sorted as the dispatcher offers them: priority (highest first), then creation
/// time (whole seconds), then name.
async fn in_claim_order(client: &kube::Client, ns: &str, names: &[String]) -> Vec<String> {
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), ns);
    let mut found: Vec<LeasedJob> = Vec::new();
    for name in names {
        found.push(jobs.get(name).await.unwrap());
    }
    found.sort_by_key(|j| {
        (
            std::cmp::Reverse(j.spec.priority),
            j.metadata.creation_timestamp.clone().map(|t| t.0),
            j.metadata.name.clone(),
        )
    });
    found
        .into_iter()
        .map(|j| j.metadata.name.unwrap())
        .collect()
}

/// A dispatcher that answers every poll with `offer()`, whoever asks, and counts in `declines`
/// the offers the sidecars say they declined.
fn scripted_dispatcher(
    offer: impl Fn() -> Value + Clone + Send + Sync + 'static,
    declines: Arc<AtomicUsize>,
) -> axum::Router {
    axum::Router::new()
        .route(
            "/v1/dispatch/poll",
            axum::routing::post(move || {
                let offer = offer();
                async move { axum::Json(offer) }
            }),
        )
        .route(
            "/v1/dispatch/declined",
            axum::routing::post(move || {
                declines.fetch_add(1, Ordering::SeqCst);
                async { axum::http::StatusCode::NO_CONTENT }
            }),
        )
}

#[tokio::test]
async fn a_lying_dispatcher_costs_a_read_never_a_second_holder() {
    let Fixture { client, ns } = fixture!("dispatch-lies");
    // The real controller initialises and expires; it advertises no dispatcher.
    let _controller = controller_with(&ns.name, "test-controller", &["--dispatch", "false"]);
    let holder = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(&client, &ns.name, "taken", 9).await;
    let (claim, _token) = holder.claim_ok(10).await;
    assert_eq!(claim["name"], "taken");

    // A dispatcher that offers, by turns, the job another worker holds and a job that does
    // not exist, whoever asks.
    let polls = Arc::new(AtomicUsize::new(0));
    let declines = Arc::new(AtomicUsize::new(0));
    let router = {
        let polls = Arc::clone(&polls);
        scripted_dispatcher(
            move || {
                let n = polls.fetch_add(1, Ordering::SeqCst);
                let name = if n % 2 == 0 { "taken" } else { "invented" };
                json!({"name": name, "resourceVersion": "1"})
            },
            Arc::clone(&declines),
        )
    };
    let token = fake_dispatcher(&client, &ns.name, router).await;
    let asker = Sidecar::start(
        &ns.name,
        "q",
        "pod-b",
        &["--dispatch-token-file", token.to_str().unwrap()],
    )
    .await;
    // The claim waits while the liar is asked and its lies declined (the sidecar follows the
    // advert Lease, which may reach it a moment after it starts); only then is there a real
    // job, which the sidecar, having set the liar aside, finds on its own.
    let claim = tokio::spawn(async move {
        let claimed = asker.claim_ok(30).await;
        (claimed, asker)
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while declines.load(Ordering::SeqCst) < 2 {
        assert!(
            Instant::now() < deadline,
            "the liar was not asked and declined twice: {} polls, {} declines",
            polls.load(Ordering::SeqCst),
            declines.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    create_job(&client, &ns.name, "free", 0).await;
    let ((claim, _token), _asker) = claim.await.unwrap();
    assert_eq!(
        claim["name"], "free",
        "the lies were declined, the real job claimed"
    );
    assert!(polls.load(Ordering::SeqCst) >= 2, "the liar was asked");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let taken = jobs.get("taken").await.unwrap().status.unwrap();
    assert_eq!(taken.holder.as_deref(), Some("pod-a"));
    assert_eq!(taken.attempt, 1, "nobody else claimed the held job");
}

#[tokio::test]
async fn an_offer_ahead_of_the_api_server_costs_a_second_and_two_set_the_dispatcher_aside() {
    let Fixture { client, ns } = fixture!("dispatch-ahead");
    let _controller = controller_with(&ns.name, "test-controller", &["--dispatch", "false"]);

    // A read not older than a resourceVersion the API server has not reached waits for its
    // cache (3 s, then 504): five offers at such a version held a claim for 15 s before the
    // sidecar chose on its own. Now such a read is cut at 1 s, and two in one round set the
    // dispatcher aside, whatever comes between them. The dispatcher's script, by stage:
    // 0: a job that does not exist (declined at once: the read finds nothing);
    // 1: "one" at a version far ahead, then "one" at an old version (a sound offer);
    // 2: "two" at a version far ahead, every time;
    // 3: "three" far ahead and the job that does not exist, by turns.
    const AHEAD: &str = "999999999999";
    let stage = Arc::new(AtomicUsize::new(0));
    let [probes, ahead, sound, stage3, declines] =
        std::array::from_fn(|_| Arc::new(AtomicUsize::new(0)));
    let router = {
        let [stage, probes, ahead, sound, stage3] =
            [&stage, &probes, &ahead, &sound, &stage3].map(Arc::clone);
        scripted_dispatcher(
            move || match stage.load(Ordering::SeqCst) {
                0 => {
                    probes.fetch_add(1, Ordering::SeqCst);
                    json!({"name": "invented", "resourceVersion": "1"})
                }
                1 if ahead.load(Ordering::SeqCst) == 0 => {
                    ahead.fetch_add(1, Ordering::SeqCst);
                    json!({"name": "one", "resourceVersion": AHEAD})
                }
                1 => {
                    sound.fetch_add(1, Ordering::SeqCst);
                    json!({"name": "one", "resourceVersion": "1"})
                }
                2 => {
                    ahead.fetch_add(1, Ordering::SeqCst);
                    json!({"name": "two", "resourceVersion": AHEAD})
                }
                _ if stage3.fetch_add(1, Ordering::SeqCst) % 2 == 0 => {
                    json!({"name": "three", "resourceVersion": AHEAD})
                }
                _ => json!({"name": "invented", "resourceVersion": "1"}),
            },
            Arc::clone(&declines),
        )
    };
    let token = fake_dispatcher(&client, &ns.name, router).await;
    let sidecar = Sidecar::start(
        &ns.name,
        "q",
        "pod-a",
        &["--dispatch-token-file", token.to_str().unwrap()],
    )
    .await;
    // Claims that do not wait, each asking the dispatcher once, until one asks it (the sidecar
    // follows the advert Lease, which may reach it a moment after it starts; a dispatcher set
    // aside is not asked for 1 s): one decline per claim never sets it aside.
    let asked_again = || {
        stage.store(0, Ordering::SeqCst);
        let (probes, sidecar) = (Arc::clone(&probes), &sidecar);
        async move {
            let before = probes.load(Ordering::SeqCst);
            let deadline = Instant::now() + Duration::from_secs(20);
            while probes.load(Ordering::SeqCst) == before {
                assert!(Instant::now() < deadline, "the dispatcher was not asked");
                let (status, answer) = sidecar.claim(0).await;
                assert_ne!(status, 200, "no job is queued: {answer}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let claim_in_stage = |n: usize, job: &'static str| {
        let (client, ns, stage) = (client.clone(), ns.name.clone(), Arc::clone(&stage));
        async move {
            create_job(&client, &ns, job, 0).await;
            wait_queued(&client, &ns, &[job]).await;
            stage.store(n, Ordering::SeqCst);
        }
    };

    // One offer ahead, then a sound one: the claim goes through the dispatcher, a second late.
    asked_again().await;
    claim_in_stage(1, "one").await;
    let (claim, _token) = sidecar.claim_ok(10).await;
    assert_eq!(claim["name"], "one");
    assert_eq!(ahead.load(Ordering::SeqCst), 1);
    assert_eq!(
        sound.load(Ordering::SeqCst),
        1,
        "after one slow read the dispatcher was asked again, not set aside"
    );

    // Offers ahead, every time: two set the dispatcher aside, and the claim goes on alone.
    claim_in_stage(2, "two").await;
    ahead.store(0, Ordering::SeqCst);
    let asked = Instant::now();
    let (claim, _token) = sidecar.claim_ok(10).await;
    let took = asked.elapsed();
    assert_eq!(claim["name"], "two", "claimed on its own");
    assert_eq!(
        ahead.load(Ordering::SeqCst),
        2,
        "two offers ahead of the API server set the dispatcher aside"
    );
    // Two reads cut at 1 s each; the claim on its own is one list and one write.
    assert!(took < Duration::from_secs(6), "the claim took {took:?}");

    // Offers ahead with a refused one between them: the two still set the dispatcher aside.
    asked_again().await;
    claim_in_stage(3, "three").await;
    let (claim, _token) = sidecar.claim_ok(10).await;
    assert_eq!(claim["name"], "three", "claimed on its own");
    assert_eq!(
        stage3.load(Ordering::SeqCst),
        3,
        "ahead, refused, ahead: the dispatcher was set aside after the third offer"
    );

    // Every offer not claimed was declined once: the inventions, and the five ahead (those
    // declined in the background too).
    let expected = probes.load(Ordering::SeqCst) + 6;
    let deadline = Instant::now() + Duration::from_secs(5);
    while declines.load(Ordering::SeqCst) < expected {
        assert!(
            Instant::now() < deadline,
            "{declines:?} declines of {expected}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(declines.load(Ordering::SeqCst), expected);
}

/// Resident memory of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS")
}

#[tokio::test]
async fn a_dispatched_sidecar_keeps_no_copy_of_its_queue() {
    use futures::StreamExt;
    const JOBS: usize = 6000;
    let Fixture { client, ns } = fixture!("dispatch-memory");
    let _controller = controller(&ns.name);
    advertised(&client, &ns.name).await;
    let token = dispatch_token_file(&ns.name);
    let dispatched = Sidecar::start(
        &ns.name,
        "q",
        "pod-d",
        &["--dispatch-token-file", token.to_str().unwrap()],
    )
    .await;
    // The same sidecar without the dispatcher keeps its queue in a watch cache: the contrast
    // shows the measure can fail.
    let watching = Sidecar::start(&ns.name, "q", "pod-w", &["--dispatch", "false"]).await;
    create_job(&client, &ns.name, "warm-0", 0).await;
    create_job(&client, &ns.name, "warm-1", 0).await;
    wait_queued(&client, &ns.name, &["warm-0", "warm-1"]).await;
    claim_name(&dispatched).await;
    claim_name(&watching).await;
    let before = (rss_kib(dispatched.proc.pid()), rss_kib(watching.proc.pid()));

    futures::stream::iter(0..JOBS)
        .map(|i| {
            let client = client.clone();
            let ns = ns.name.clone();
            async move { create_job(&client, &ns, &format!("bulk-{i:05}"), 0).await }
        })
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
    // Both sidecars are answered once the controller has initialised every job.
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let queued = jobs
            .list_metadata(&kube::api::ListParams::default().fields("status.phase=Queued"))
            .await
            .unwrap()
            .items
            .len();
        if queued >= JOBS {
            break;
        }
        assert!(Instant::now() < deadline, "{queued} of {JOBS} Queued");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let claimed = claim_name(&dispatched).await;
    claim_name(&watching).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = (rss_kib(dispatched.proc.pid()), rss_kib(watching.proc.pid()));
    let grew = (
        after.0.saturating_sub(before.0),
        after.1.saturating_sub(before.1),
    );
    eprintln!(
        "with {JOBS} jobs queued: the dispatched sidecar grew {} KiB ({} -> {}), the watching \
         one {} KiB ({} -> {})",
        grew.0, before.0, after.0, grew.1, before.1, after.1
    );
    assert!(claimed.starts_with("bulk-"), "claimed {claimed}");
    assert!(
        grew.1 > 5 * 1024,
        "the watching sidecar caches its queue (about 1.8 KiB per job): grew {} KiB",
        grew.1
    );
    assert!(
        grew.0 < 3 * 1024,
        "the dispatched sidecar holds only its own jobs: grew {} KiB",
        grew.0
    );
}
