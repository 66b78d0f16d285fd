//! Queues as objects (LeasedQueue) against the real control plane: a pause stops new claims
//! within a second, through the dispatcher and without it, and a resume starts them within a
//! second; the pause is read by each sidecar itself, so a dispatcher that offers a paused
//! queue's job is not even asked; the controller reports the queue in its status, metrics and
//! Events; bad LeasedQueues are refused at admission naming the field and the rule; a sidecar
//! that may not read its LeasedQueue claims nothing.

use std::time::{Duration, Instant};

use k8s_openapi::api::events::v1::Event;
use kube::api::ListParams;
use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::queue::LeasedQueue;
use leasehold_testkit::*;
use serde_json::json;

use leasehold_testkit::dispatcher::{advertised, fake_dispatcher};

/// `kubectl leasehold pause|resume QUEUE -n NS` (the binary, as the plugin runs it).
fn plugin(verb: &str, queue: &str, ns: &str) -> String {
    let (ok, out) = run(&leasehold_bin(), &[verb, queue, "-n", ns], "", &[]);
    assert!(ok, "leasehold {verb} {queue}: {out}");
    out
}

async fn create(client: &kube::Client, ns: &str, name: &str) {
    create_job(
        client,
        ns,
        json!({"metadata": {"name": name}, "spec": {"queue": "q", "payload": {"n": name}}}),
    )
    .await;
}

/// The reasons of the Events regarding LeasedQueue `name`.
async fn queue_events(client: &kube::Client, ns: &str, name: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let list = events.list(&ListParams::default()).await.unwrap();
    list.items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().is_some_and(|r| {
                r.kind.as_deref() == Some("LeasedQueue") && r.name.as_deref() == Some(name)
            })
        })
        .filter_map(|e| e.reason)
        .collect()
}

#[tokio::test]
async fn a_pause_stops_claims_within_a_second_and_a_resume_starts_them_within_a_second() {
    let Fixture { client, ns } = fixture!("queue-pause");
    let controller = controller(&ns.name);
    let ctl_port = controller.port.unwrap();
    advertised(&client, &ns.name).await;
    let token = dispatch_token_file(&ns.name);
    // One sidecar claims through the dispatcher, the other from its own copy of the queue.
    let dispatched = Sidecar::start(
        &ns.name,
        "q",
        "pod-d",
        &["--dispatch-token-file", token.to_str().unwrap()],
    )
    .await;
    let watching = Sidecar::start(&ns.name, "q", "pod-w", &[]).await;

    let out = plugin("pause", "q", &ns.name);
    assert!(out.contains("paused"), "{out}");
    let paused_at = Instant::now();
    let claims: Vec<_> = [dispatched, watching]
        .into_iter()
        .map(|sidecar| {
            tokio::spawn(async move {
                let answer = sidecar.claim(30).await;
                (answer, Instant::now(), sidecar)
            })
        })
        .collect();
    // Jobs created a second after the pause are not claimed, however long they wait.
    tokio::time::sleep(Duration::from_secs(1).saturating_sub(paused_at.elapsed())).await;
    for name in ["a", "b"] {
        create(&client, &ns.name, name).await;
    }
    let queues: Api<LeasedQueue> = Api::namespaced(client.clone(), &ns.name);
    let status = wait_for("the queue's status", Duration::from_secs(10), || async {
        let status = queues.get("q").await.ok()?.status?;
        (status.paused && status.queued == 2).then_some(status)
    })
    .await;
    assert!(status.paused_time.is_some(), "{status:?}");
    assert_eq!(status.leased, 0);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        claims.iter().all(|c| !c.is_finished()),
        "a claim was answered while the queue was paused"
    );
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    for name in ["a", "b"] {
        assert_eq!(jobs.get(name).await.unwrap().phase(), Phase::Queued);
    }
    let m = http_get(ctl_port, "/metrics").await.unwrap().1;
    let labels = format!("{{queue_namespace=\"{}\",queue=\"q\"}}", ns.name);
    assert_eq!(
        sample(&m, &format!("leasehold_queue_paused{labels}")),
        Some(1.0)
    );
    let paused_for = sample(&m, &format!("leasehold_queue_paused_seconds{labels}")).unwrap();
    assert!(paused_for >= 2.0, "paused for {paused_for} s");
    let waited = sample(
        &m,
        &format!("leasehold_queue_oldest_queued_seconds{labels}"),
    )
    .unwrap();
    assert!(waited >= 2.0, "the oldest job waited {waited} s");
    assert_eq!(queue_events(&client, &ns.name, "q").await, vec!["Paused"]);

    let out = plugin("resume", "q", &ns.name);
    assert!(out.contains("resumed"), "{out}");
    let resumed_at = Instant::now();
    let mut claimed = Vec::new();
    for claim in claims {
        let ((status, answer), at, _sidecar) = claim.await.unwrap();
        assert_eq!(status, 200, "{answer}");
        let after = at.duration_since(resumed_at);
        eprintln!("{} claimed {after:?} after the resume", answer["name"]);
        assert!(
            after < Duration::from_secs(1),
            "claimed {after:?} after the resume"
        );
        claimed.push(answer["name"].as_str().unwrap().to_string());
    }
    claimed.sort();
    assert_eq!(claimed, ["a", "b"]);
    wait_for(
        "the Resumed Event and status",
        Duration::from_secs(10),
        || async {
            let status = queues.get("q").await.ok()?.status?;
            let events = queue_events(&client, &ns.name, "q").await;
            (!status.paused
                && status.paused_time.is_none()
                && status.leased == 2
                && events.contains(&"Resumed".to_string()))
            .then_some(())
        },
    )
    .await;
    let m = http_get(ctl_port, "/metrics").await.unwrap().1;
    assert_eq!(
        sample(&m, &format!("leasehold_queue_paused{labels}")),
        Some(0.0)
    );
    assert_eq!(
        sample(&m, &format!("leasehold_queue_paused_seconds{labels}")),
        Some(0.0)
    );
}

#[tokio::test]
async fn a_paused_queue_is_not_asked_of_a_dispatcher_even_one_that_offers_it() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let Fixture { client, ns } = fixture!("queue-pause-liar");
    let _controller = controller_with(&ns.name, "test-controller", &["--dispatch", "false"]);
    plugin("pause", "q", &ns.name);
    create(&client, &ns.name, "j").await;
    // A dispatcher that offers the job whoever asks, paused or not.
    let polls = Arc::new(AtomicUsize::new(0));
    let router = {
        let polls = Arc::clone(&polls);
        axum::Router::new().route(
            "/v1/dispatch/poll",
            axum::routing::post(move || {
                polls.fetch_add(1, Ordering::SeqCst);
                async { axum::Json(json!({"name": "j", "resourceVersion": "1"})) }
            }),
        )
    };
    let token = fake_dispatcher(&client, &ns.name, router).await;
    let sidecar = Sidecar::start(
        &ns.name,
        "q",
        "pod-0",
        &["--dispatch-token-file", token.to_str().unwrap()],
    )
    .await;
    let (status, answer) = sidecar.claim(2).await;
    assert_eq!(status, 204, "nothing claimed from a paused queue: {answer}");
    assert_eq!(polls.load(Ordering::SeqCst), 0, "the dispatcher was asked");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    assert_eq!(jobs.get("j").await.unwrap().phase(), Phase::Queued);
    plugin("resume", "q", &ns.name);
    let (claimed, _token) = sidecar.claim_ok(10).await;
    assert_eq!(claimed["name"], "j");
    assert!(polls.load(Ordering::SeqCst) >= 1, "asked once resumed");
}

#[tokio::test]
async fn bad_leased_queues_are_refused_naming_the_field_and_the_rule() {
    let Fixture { client, ns } = fixture!("queue-bad");
    let manifest = |name: &str, spec: &str| {
        format!("apiVersion: leasehold.dev/v1alpha1\nkind: LeasedQueue\nmetadata:\n  name: {name}\n  namespace: {}\nspec:\n{spec}\n", ns.name)
    };
    let cases = [
        ("typed", manifest("q", "  paused: \"yes\""), "spec.paused"),
        (
            "a name that is no queue's",
            manifest("a.b", "  paused: true"),
            "metadata.name is the queue's name",
        ),
        (
            "a limit of 0",
            manifest("q", "  maxLeasedPerKey: 0"),
            "spec.maxLeasedPerKey",
        ),
        (
            "a limit past 1000",
            manifest("q", "  maxLeased: 5000"),
            "spec.maxLeased",
        ),
        (
            "a weight of 0",
            manifest("q", "  weights: {tenant-a: 0}"),
            "spec.weights.tenant-a",
        ),
        (
            "a default lease under 5 s",
            manifest("q", "  defaults: {leaseDurationSeconds: 2}"),
            "spec.defaults.leaseDurationSeconds",
        ),
        (
            "default attempts of 0",
            manifest("q", "  defaults: {maxAttempts: 0}"),
            "spec.defaults.maxAttempts",
        ),
        (
            "an inverted default backoff",
            manifest(
                "q",
                "  defaults: {backoff: {initialSeconds: 60, maxSeconds: 10}}",
            ),
            "spec.defaults.backoff: Invalid value: initialSeconds must not exceed maxSeconds",
        ),
        (
            "an unknown field",
            manifest("q", "  pasued: true"),
            "unknown field \"spec.pasued\"",
        ),
    ];
    for (what, yaml, wanted) in cases {
        let (ok, out) = kubectl(&["apply", "-f", "-"], &yaml);
        assert!(!ok, "{what} was accepted: {out}");
        assert!(
            out.contains(wanted),
            "{what}: {out:?} does not name {wanted:?}"
        );
    }
    // A job's concurrency key is fixed once it exists.
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "keyed"}, "spec": {"queue": "q", "concurrencyKey": "a"}}),
    )
    .await;
    let (ok, out) = kubectl(
        &[
            "patch",
            "ljob",
            "keyed",
            "-n",
            &ns.name,
            "--type",
            "merge",
            "-p",
            r#"{"spec":{"concurrencyKey":"b"}}"#,
        ],
        "",
    );
    assert!(
        !ok && out.contains("spec.concurrencyKey is immutable"),
        "{out}"
    );
    // Nothing was half-written.
    let queues: Api<LeasedQueue> = Api::namespaced(client.clone(), &ns.name);
    assert!(queues
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .is_empty());
    // Resuming a queue that has no LeasedQueue writes nothing.
    let out = plugin("resume", "q", &ns.name);
    assert!(out.contains("has no LeasedQueue"), "{out}");
    assert!(queues.get_opt("q").await.unwrap().is_none());
    // A good one is shown by `kubectl get lq`.
    let (ok, out) = kubectl(&["apply", "-f", "-"], &manifest("q", "  paused: true"));
    assert!(ok, "{out}");
    let (ok, out) = kubectl(&["get", "lq", "-n", &ns.name], "");
    assert!(
        ok && out.contains("PAUSED") && out.contains("true"),
        "{out}"
    );
}

#[tokio::test]
async fn a_key_with_ten_jobs_is_not_stuck_behind_a_key_with_a_thousand() {
    use futures::StreamExt;
    let Fixture { client, ns } = fixture!("queue-fair");
    let _controller = controller(&ns.name);
    advertised(&client, &ns.name).await;
    // Key a's 1,000 jobs are all older than key b's 10.
    let jobs: Vec<(String, &str)> = (0..1000)
        .map(|i| (format!("a-{i:04}"), "a"))
        .chain((0..10).map(|i| (format!("b-{i:02}"), "b")))
        .collect();
    for chunk in jobs.chunks(500) {
        futures::stream::iter(chunk)
            .for_each_concurrent(16, |(name, key)| {
                let (client, ns) = (client.clone(), ns.name.clone());
                async move {
                    create_job(
                        &client,
                        &ns,
                        json!({"metadata": {"name": name},
                               "spec": {"queue": "q", "concurrencyKey": key}}),
                    )
                    .await;
                }
            })
            .await;
    }
    let api: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let queued = ListParams::default().fields("status.phase=Queued");
    wait_for("1,010 jobs Queued", Duration::from_secs(60), || async {
        (api.list_metadata(&queued).await.ok()?.items.len() == 1010).then_some(())
    })
    .await;
    let token = dispatch_token_file(&ns.name);
    let sidecar = Sidecar::start(
        &ns.name,
        "q",
        "pod-0",
        &["--dispatch-token-file", token.to_str().unwrap()],
    )
    .await;
    let mut claimed = Vec::new();
    for _ in 0..24 {
        let (claim, token) = sidecar.claim_ok(10).await;
        let name = claim["name"].as_str().unwrap().to_string();
        let (status, body) = sidecar.complete(&name, &token, json!("done")).await;
        assert_eq!(status, 200, "{body}");
        claimed.push(name);
    }
    let keys: String = claimed.iter().map(|n| &n[..1]).collect();
    assert_eq!(
        keys,
        format!("{}aaaa", "ab".repeat(10)),
        "the keys take turns until b has no job left: {claimed:?}"
    );
    // Within a key, claim order: oldest first.
    let b: Vec<&String> = claimed.iter().filter(|n| n.starts_with('b')).collect();
    let mut sorted = b.clone();
    sorted.sort();
    assert_eq!(b, sorted);
}

/// A sidecar whose Role does not grant `leasedqueues` cannot know whether its queue is paused
/// or limited, so it claims nothing (fail closed: a limit is exact only if every claimer
/// honours it) and is not ready; once its Role grants them, it reads the LeasedQueue and
/// claims within the queue's limit.
#[tokio::test]
async fn a_sidecar_that_may_not_read_its_leased_queue_claims_nothing_until_it_may() {
    let Fixture { client, ns } = fixture!("queue-forbidden");
    let _controller = controller(&ns.name);
    // The chart's worker Role, without leasedqueues.
    let mut rules = vec![
        json!({"apiGroups": ["leasehold.dev"], "resources": ["leasedjobs"],
               "verbs": ["get", "list", "watch"]}),
        json!({"apiGroups": ["leasehold.dev"], "resources": ["leasedjobs/status"],
               "verbs": ["update", "patch"]}),
        json!({"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
               "verbs": ["get", "list", "create", "update", "patch"]}),
    ];
    let role = |rules: &[serde_json::Value]| {
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "narrow", "namespace": ns.name}, "rules": rules})
    };
    let apply = |object: serde_json::Value| {
        let (ok, out) = kubectl(&["apply", "--server-side", "-f", "-"], &object.to_string());
        assert!(ok, "kubectl apply: {out}");
    };
    apply(json!({"apiVersion": "v1", "kind": "ServiceAccount",
                 "metadata": {"name": "narrow", "namespace": ns.name}}));
    apply(role(&rules));
    apply(
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                 "metadata": {"name": "narrow", "namespace": ns.name},
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "narrow"},
                 "subjects": [{"kind": "ServiceAccount", "name": "narrow", "namespace": ns.name}]}),
    );
    apply(
        json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedQueue",
                 "metadata": {"name": "q", "namespace": ns.name}, "spec": {"maxLeased": 1}}),
    );
    create(&client, &ns.name, "a").await;
    create(&client, &ns.name, "b").await;
    let token = sa_token(&ns.name, "narrow", None);
    let kubeconfig = token_kubeconfig(&format!("{}-narrow", ns.name), &token, &ns.name);
    let sc = Sidecar::start_serving(&ns.name, "q", "pod-a", &[], &kubeconfig).await;
    let (s, body) = sc.claim(2).await;
    assert_ne!(s, 200, "claimed without reading the LeasedQueue: {body}");
    let (ready, _) = http_get(sc.proc.port.unwrap(), "/readyz").await.unwrap();
    assert_ne!(ready, 200, "ready without reading the LeasedQueue");
    assert!(
        sc.proc
            .log_text()
            .contains("does not grant get, list and watch on leasedqueues"),
        "{}",
        sc.proc.log_text()
    );
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    for name in ["a", "b"] {
        assert_eq!(jobs.get(name).await.unwrap().attempt(), 0, "{name} claimed");
    }
    // Granted: it claims, and the limit it now reads holds.
    rules.push(
        json!({"apiGroups": ["leasehold.dev"], "resources": ["leasedqueues"],
                      "verbs": ["get", "list", "watch"]}),
    );
    apply(role(&rules));
    let granted = Instant::now();
    wait_for("a claim once granted", Duration::from_secs(20), || async {
        (sc.claim(1).await.0 == 200).then_some(())
    })
    .await;
    assert!(
        granted.elapsed() < Duration::from_secs(10),
        "claimed {:?} after the grant (the watch retries within 1 s)",
        granted.elapsed()
    );
    let (s, body) = sc.claim(2).await;
    assert_ne!(s, 200, "a second job Leased under maxLeased 1: {body}");
}
