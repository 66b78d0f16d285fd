//! The chart's credentials and admission policies against the real API server.
//!
//! Every test installs its own release of the chart into its own namespace (which is also
//! the release's one worker namespace) and acts with credentials made as a cluster makes
//! them for pods: TokenRequest tokens of the chart's ServiceAccounts bound to Pod objects
//! `pod-a` and `pod-b` (Pending forever: no kubelet). The hostile requests are made by hand,
//! as raw HTTP, so that nothing but the API server stands between them and the objects; each
//! is shown refused with the rule's name, and the same kind of request from the right pod is
//! shown accepted.

mod chart_support;

use std::path::PathBuf;
use std::time::Duration;

use chart_support::*;
use futures::FutureExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client, ResourceExt};
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::fence::{Outcome, REASON_LEASE_EXPIRED};
use leasehold_core::lease;
use leasehold_core::queue::LeasedQueue;
use leasehold_core::token::Token;
use leasehold_testkit::*;
use serde_json::{json, Value};

const WORKER_SA: &str = "leasehold-worker";

/// One test's world: its namespace, its release, an admin client, and the clients of two
/// worker pods.
struct World {
    ns: TestNamespace,
    release: Release,
    admin: Client,
    a: Client,
    b: Client,
    kc_a: PathBuf,
    kc_b: PathBuf,
}

impl World {
    async fn new(fixture: Fixture, extra_sets: &[&str]) -> World {
        let Fixture { client: admin, ns } = fixture;
        let workers = format!("workers.namespaces={{{}}}", ns.name);
        let mut sets = vec![workers.as_str()];
        sets.extend_from_slice(extra_sets);
        let release = Release::install(&ns.name, &ns.name, &sets);
        let mut kcs = Vec::new();
        for pod in ["pod-a", "pod-b"] {
            create_pod(&admin, &ns.name, pod, WORKER_SA).await;
            let token = pod_token(&ns.name, WORKER_SA, pod);
            kcs.push(token_kubeconfig(
                &format!("{}-{pod}", ns.name),
                &token,
                &ns.name,
            ));
        }
        let (a, b) = (client_from(&kcs[0]).await, client_from(&kcs[1]).await);
        let world = World {
            ns,
            release,
            admin,
            a,
            b,
            kc_a: kcs[0].clone(),
            kc_b: kcs[1].clone(),
        };
        if !extra_sets.contains(&"admissionPolicy.enabled=false") {
            world.wait_for_policies().await;
        }
        world
    }

    /// The API server loads new admission policies a moment after they are created: wait
    /// until a write only they refuse (a Lease that is not a job's) is refused.
    async fn wait_for_policies(&self) {
        let path = self.leases_path();
        let leases: Api<Lease> = Api::namespaced(self.admin.clone(), &self.ns.name);
        wait_for(
            "admission policies in force",
            Duration::from_secs(30),
            || async {
                let body = json!({"metadata": {"name": "policy-probe"}, "spec": {}});
                match raw(&self.a, "POST", &path, "application/json", &body).await {
                    Err((422, m)) if m.contains("leasehold rule job-leases-only") => Some(()),
                    Ok(_) => {
                        let _ = leases.delete("policy-probe", &Default::default()).await;
                        None
                    }
                    Err(_) => None,
                }
            },
        )
        .await;
    }

    fn job_path(&self, name: &str) -> String {
        format!(
            "/apis/leasehold.dev/v1alpha1/namespaces/{}/leasedjobs/{name}",
            self.ns.name
        )
    }

    fn status_path(&self, name: &str) -> String {
        format!("{}/status", self.job_path(name))
    }

    fn leases_path(&self) -> String {
        format!(
            "/apis/coordination.k8s.io/v1/namespaces/{}/leases",
            self.ns.name
        )
    }

    fn lease_path(&self, name: &str) -> String {
        format!("{}/{name}", self.leases_path())
    }

    fn jobs(&self, client: &Client) -> Api<LeasedJob> {
        Api::namespaced(client.clone(), &self.ns.name)
    }

    fn leases(&self, client: &Client) -> Api<Lease> {
        Api::namespaced(client.clone(), &self.ns.name)
    }

    async fn job(&self, name: &str) -> LeasedJob {
        self.jobs(&self.admin).get(name).await.unwrap()
    }

    async fn create_job(&self, name: &str) -> LeasedJob {
        create_job(
            &self.admin,
            &self.ns.name,
            json!({"metadata": {"name": name}, "spec": {"queue": "q"}}),
        )
        .await
    }

    /// The job as JSON with `status` replaced: the body of a claim by PUT.
    async fn with_status(&self, name: &str, status: Value) -> Value {
        let mut job = serde_json::to_value(self.job(name).await).unwrap();
        job["status"] = status;
        job
    }
}

/// Asserts that `result` is the API server's refusal by the leasehold rule `rule`.
fn assert_refused(result: Result<Value, (u16, String)>, rule: &str) {
    match result {
        Err((422, message)) => assert!(
            message.contains(&format!("leasehold rule {rule}:")),
            "refused, but not by rule {rule}: {message}"
        ),
        Err((code, message)) => panic!("expected rule {rule}, got HTTP {code}: {message}"),
        Ok(v) => panic!("the API server accepted what rule {rule} forbids: {v}"),
    }
}

fn hex_token(attempt: i32) -> String {
    Token::issue(attempt).as_str().to_string()
}

#[tokio::test]
async fn claims_are_made_only_in_the_requesting_pods_name() {
    let w = World::new(fixture!("adm-claim"), &[]).await;
    w.create_job("j").await;
    let claim = |holder: &str, attempt: i32, token: String| {
        json!({"phase": "Leased", "attempt": attempt, "holder": holder, "token": token,
               "leaseName": "ljob-j"})
    };

    // Claiming with holder set to another pod.
    let body = w.with_status("j", claim("pod-b", 1, hex_token(1))).await;
    assert_refused(
        raw(&w.a, "PUT", &w.status_path("j"), "application/json", &body).await,
        "claim",
    );
    // Skipping an attempt, or a token that is not the new attempt's.
    let body = w.with_status("j", claim("pod-a", 2, hex_token(2))).await;
    assert_refused(
        raw(&w.a, "PUT", &w.status_path("j"), "application/json", &body).await,
        "claim",
    );
    let body = w.with_status("j", claim("pod-a", 1, hex_token(7))).await;
    assert_refused(
        raw(&w.a, "PUT", &w.status_path("j"), "application/json", &body).await,
        "claim",
    );
    // A worker token bound to no pod claims in no one's name.
    let unbound = client_from(&token_kubeconfig(
        &format!("{}-unbound", w.ns.name),
        &unbound_token(&w.ns.name, WORKER_SA),
        &w.ns.name,
    ))
    .await;
    let body = w.with_status("j", claim("pod-a", 1, hex_token(1))).await;
    assert_refused(
        raw(
            &unbound,
            "PUT",
            &w.status_path("j"),
            "application/json",
            &body,
        )
        .await,
        "claim",
    );
    assert!(w.job("j").await.status.is_none(), "a refused claim wrote");

    // The same claim in the requesting pod's own name is accepted.
    let t1 = hex_token(1);
    let body = w.with_status("j", claim("pod-a", 1, t1.clone())).await;
    raw(&w.a, "PUT", &w.status_path("j"), "application/json", &body)
        .await
        .expect("a valid claim by pod-a");
    let job = w.job("j").await;
    assert_eq!(job.phase(), Phase::Leased);
    assert_eq!(job.token(), Some(t1.as_str()));

    // Claiming a job that is not Queued, even in one's own name.
    let body = w.with_status("j", claim("pod-b", 2, hex_token(2))).await;
    assert_refused(
        raw(&w.b, "PUT", &w.status_path("j"), "application/json", &body).await,
        "claim",
    );

    // A claim keeps the job's history: failures cannot be wiped on the way.
    w.create_job("k").await;
    let (k, tk) = leasehold_kube::claim::claim(&w.jobs(&w.a), &w.job("k").await, "pod-a", None)
        .await
        .expect("claim through the library, as pod-a");
    let failed = Outcome::Fail {
        reason: "Boom".into(),
        message: String::new(),
        retryable: true,
        checkpoint: None,
        retry_after_seconds: None,
    };
    leasehold_kube::fence::apply(&w.jobs(&w.a), &w.ns.name, &k.name_any(), &tk, &failed)
        .await
        .expect("pod-a fails its attempt");
    let mut status = serde_json::to_value(w.job("k").await.status).unwrap();
    status["phase"] = json!("Leased");
    status["attempt"] = json!(2);
    status["holder"] = json!("pod-b");
    status["token"] = json!(hex_token(2));
    status["failures"] = json!([]);
    let body = w.with_status("k", status.clone()).await;
    assert_refused(
        raw(&w.b, "PUT", &w.status_path("k"), "application/json", &body).await,
        "claim-keeps-history",
    );
    let kept = w.job("k").await.status.unwrap().failures;
    status["failures"] = serde_json::to_value(&kept).unwrap();
    let body = w.with_status("k", status).await;
    raw(&w.b, "PUT", &w.status_path("k"), "application/json", &body)
        .await
        .expect("the same claim, keeping the failures");
}

/// Only the holding pod writes status and stale tokens are refused.
#[tokio::test]
async fn only_the_holder_writes_status() {
    let w = World::new(fixture!("adm-holder"), &[]).await;
    let (jobs_a, jobs_b) = (w.jobs(&w.a), w.jobs(&w.b));
    w.create_job("j").await;
    let (_, t1) = leasehold_kube::claim::claim(&jobs_a, &w.job("j").await, "pod-a", None)
        .await
        .unwrap();

    // Writing to a job another pod holds.
    let complete = json!({"status": {"phase": "Succeeded", "result": "from b"}});
    assert_refused(
        merge_patch(&w.b, &w.status_path("j"), &complete).await,
        "holder-only",
    );

    // pod-a gives attempt 1 back; pod-b claims attempt 2.
    leasehold_kube::fence::apply(
        &jobs_a,
        &w.ns.name,
        "j",
        &t1,
        &Outcome::Release { checkpoint: None },
    )
    .await
    .unwrap();
    let (_, t2) = leasehold_kube::claim::claim(&jobs_b, &w.job("j").await, "pod-b", None)
        .await
        .unwrap();
    assert_eq!(t2.attempt(), 2);

    // Completing with the stale token: without the fencing `test`, by hand.
    let stale = json!([
        {"op": "replace", "path": "/status/phase", "value": "Succeeded"},
        {"op": "replace", "path": "/status/token", "value": t1.as_str()},
        {"op": "add", "path": "/status/result", "value": "stale"},
    ]);
    assert_refused(
        raw(
            &w.a,
            "PATCH",
            &w.status_path("j"),
            "application/json-patch+json",
            &stale,
        )
        .await,
        "claim",
    );
    // Or leaving the (current) token alone: still not pod-a's job.
    let complete_a = json!({"status": {"phase": "Succeeded", "result": "stale"}});
    assert_refused(
        merge_patch(&w.a, &w.status_path("j"), &complete_a).await,
        "holder-only",
    );
    let job = w.job("j").await;
    assert_eq!(
        (job.phase(), job.token()),
        (Phase::Leased, Some(t2.as_str()))
    );

    // The holder's own complete is accepted.
    let complete_b = json!({"status": {"phase": "Succeeded", "result": "from b"}});
    merge_patch(&w.b, &w.status_path("j"), &complete_b)
        .await
        .expect("pod-b completes the job it holds");
    assert_eq!(w.job("j").await.phase(), Phase::Succeeded);

    // A finished job is final, even for the pod that finished it.
    let again = json!({"status": {"result": "rewritten"}});
    assert_refused(
        merge_patch(&w.b, &w.status_path("j"), &again).await,
        "finished-is-final",
    );
    assert_eq!(
        w.job("j").await.status.unwrap().result,
        Some(json!("from b"))
    );

    // The holder itself may add to the failures, never rewrite them.
    w.create_job("m").await;
    let (_, m1) = leasehold_kube::claim::claim(&jobs_a, &w.job("m").await, "pod-a", None)
        .await
        .unwrap();
    let failed = Outcome::Fail {
        reason: "Boom".into(),
        message: "first".into(),
        retryable: true,
        checkpoint: None,
        retry_after_seconds: None,
    };
    leasehold_kube::fence::apply(&jobs_a, &w.ns.name, "m", &m1, &failed)
        .await
        .unwrap();
    leasehold_kube::claim::claim(&jobs_a, &w.job("m").await, "pod-a", None)
        .await
        .unwrap();
    let wipe = json!({"status": {"failures": []}});
    assert_refused(
        merge_patch(&w.a, &w.status_path("m"), &wipe).await,
        "failures-append-only",
    );
    assert_eq!(w.job("m").await.failed_attempts(), 1);
    // Nor grant itself more attempts, or a longer lease, than its claim recorded.
    let recorded = w
        .job("m")
        .await
        .status
        .unwrap()
        .policy
        .expect("status.policy");
    let more = json!({"status": {"policy": {"maxAttempts": 100}}});
    assert_refused(
        merge_patch(&w.a, &w.status_path("m"), &more).await,
        "policy-fixed-by-claim",
    );
    assert_eq!(w.job("m").await.status.unwrap().policy, Some(recorded));
}

/// A claim records in status.policy the spec's own values where the spec sets them: a worker
/// cannot grant its attempt a longer lease, or its job more attempts, than the job's author
/// wrote.
#[tokio::test]
async fn a_claim_records_the_policy_its_job_s_spec_sets() {
    let w = World::new(fixture!("adm-policy"), &[]).await;
    create_job(
        &w.admin,
        &w.ns.name,
        json!({"metadata": {"name": "p"},
               "spec": {"queue": "q", "leaseDurationSeconds": 30, "maxAttempts": 2,
                        "backoff": {"initialSeconds": 2}}}),
    )
    .await;
    let backoff = json!({"initialSeconds": 2, "maxSeconds": 300});
    let claim = |policy: Value| {
        json!({"phase": "Leased", "attempt": 1, "holder": "pod-a", "token": hex_token(1),
               "leaseName": "ljob-p", "policy": policy})
    };
    for forged in [
        json!({"leaseDurationSeconds": 86400, "maxAttempts": 2, "backoff": backoff}),
        json!({"leaseDurationSeconds": 30, "maxAttempts": 50, "backoff": backoff}),
        json!({"leaseDurationSeconds": 30, "maxAttempts": 2}),
        json!({"leaseDurationSeconds": 30, "maxAttempts": 2,
               "backoff": {"initialSeconds": 0, "maxSeconds": 0}}),
    ] {
        let body = w.with_status("p", claim(forged.clone())).await;
        assert_refused(
            raw(&w.a, "PUT", &w.status_path("p"), "application/json", &body).await,
            "policy-follows-spec",
        );
    }
    assert!(w.job("p").await.status.is_none(), "a refused claim wrote");
    // The spec's own values, as the sidecar's claim records them.
    let (job, _) = leasehold_kube::claim::claim(&w.jobs(&w.a), &w.job("p").await, "pod-a", None)
        .await
        .expect("a claim recording the spec's policy");
    let policy = job.status.unwrap().policy.expect("status.policy");
    assert_eq!(
        (policy.lease_duration_seconds, policy.max_attempts),
        (30, 2)
    );
}

/// Makes the LeasedQueue `name` with `spec` and confirms its limits `fields` (as the leading
/// controller does once every Leased job holds a slot): the object as made.
async fn confirmed_queue(
    queues: &Api<LeasedQueue>,
    name: &str,
    spec: Value,
    fields: &str,
) -> LeasedQueue {
    let made: LeasedQueue = serde_json::from_value(json!({
        "apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedQueue",
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap();
    let made = queues
        .create(&kube::api::PostParams::default(), &made)
        .await
        .unwrap();
    let confirm = json!({"status": {"slotsAdopted": format!("{}:{fields}", made.uid().unwrap())}});
    queues
        .patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&confirm),
        )
        .await
        .unwrap();
    made
}

/// A claim that swapped a slot of its claimer's own records the LeasedQueue's generation with
/// its limits (`<uid>/<generation>:...`), and the API server accepts it only while its own
/// copy of the LeasedQueue is at that generation: a copy from before any change of the spec
/// is refused, even when the limits came back to the same values (`limits-obeyed`), since a
/// swap skips the list that would have shown slots taken under the limits in between.
#[tokio::test]
async fn a_swapped_claim_is_accepted_only_at_the_generation_it_records() {
    let w = World::new(fixture!("adm-swap"), &[]).await;
    let queues: Api<LeasedQueue> = Api::namespaced(w.admin.clone(), &w.ns.name);
    let spec = json!({"maxLeasedPerKey": 2});
    let made = confirmed_queue(&queues, "q", spec, "maxLeasedPerKey").await;
    let uid = made.uid().unwrap();
    let swapped = |copy: LeasedQueue, job: String| {
        let w = &w;
        async move {
            w.create_job(&job).await;
            let snapshot = w.job(&job).await;
            let token = Token::issue(snapshot.attempt() + 1);
            let jobs = w.jobs(&w.a);
            let taken = leasehold_core::slots::SlotsTaken {
                swapped: true,
                key: Some(0),
                queue: None,
            };
            leasehold_kube::claim::claim_taking(
                &jobs,
                &snapshot,
                "pod-a",
                Some(&copy),
                token,
                taken,
            )
            .await
        }
    };
    // Accepted at its generation, once the API server's copy shows the confirmation.
    let first = made.metadata.generation.unwrap();
    let mut probes = 0;
    let (claimed, _) = wait_for(
        "the swapped claim accepted",
        Duration::from_secs(30),
        || {
            probes += 1;
            swapped(made.clone(), format!("ok-{probes}")).map(|r| r.ok())
        },
    )
    .await;
    assert_eq!(
        claimed.status.unwrap().limits.unwrap(),
        format!("{uid}/{first}:maxLeasedPerKey=2")
    );
    // The limit raised and lowered back: the same values at a later generation.
    for limit in [4, 2] {
        queues
            .patch(
                "q",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&json!({"spec": {"maxLeasedPerKey": limit}})),
            )
            .await
            .unwrap();
    }
    let now = queues.get("q").await.unwrap();
    assert_eq!(now.metadata.generation, Some(first + 2));
    let refused = wait_for(
        "the old generation refused",
        Duration::from_secs(30),
        || {
            probes += 1;
            swapped(made.clone(), format!("old-{probes}")).map(|r| match r {
                Err(leasehold_kube::claim::ClaimError::OutsideLimits { message, .. }) => {
                    Some(message)
                }
                _ => None,
            })
        },
    )
    .await;
    assert!(
        refused.contains("leasehold rule limits-obeyed"),
        "{refused}"
    );
    assert!(
        w.job(&format!("old-{probes}")).await.status.is_none(),
        "a refused claim wrote"
    );
    // The copy at the present generation is accepted, and so is the plain form (a claim that
    // listed the scope) from the old copy, whose values are the present ones.
    let (claimed, _) = swapped(now, "new".into())
        .await
        .expect("a swap at the present generation");
    let recorded = claimed.status.unwrap().limits.unwrap();
    assert_eq!(recorded, format!("{uid}/{}:maxLeasedPerKey=2", first + 2));
    w.create_job("plain").await;
    let jobs = w.jobs(&w.a);
    leasehold_kube::claim::claim(&jobs, &w.job("plain").await, "pod-a", Some(&made))
        .await
        .expect("a claim that listed, under the same values");
}

/// Under a LeasedQueue's limits the API server refuses a worker's claim that does not record
/// them (its sidecar had not seen them: `limits-obeyed`), and one made before the controller
/// confirmed them (`limits-adopted`); the claim that records them, once confirmed, is
/// accepted, and a queue without a LeasedQueue needs nothing. The claim library reads the
/// refusal as `OutsideLimits`, which the sidecar waits out as a limit.
#[tokio::test]
async fn claims_under_limits_record_them_once_they_are_confirmed() {
    let w = World::new(fixture!("adm-limits"), &[]).await;
    // A LeasedQueue whose limits are explicit nulls (stored as such) sets none; made first,
    // so that the API server has it once it has the limited one below.
    raw(
        &w.admin,
        "POST",
        &format!(
            "/apis/leasehold.dev/v1alpha1/namespaces/{}/leasedqueues",
            w.ns.name
        ),
        "application/json",
        &json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedQueue",
                "metadata": {"name": "nulls"},
                "spec": {"maxLeased": null, "maxLeasedPerKey": null}}),
    )
    .await
    .expect("a LeasedQueue with null limits");
    let queues: Api<LeasedQueue> = Api::namespaced(w.admin.clone(), &w.ns.name);
    // Queues with maxLeased alone and with both, confirmed at once (as the controller would):
    // a claim through the library, recording what leasehold_core::adoption::obeyed makes of
    // them, must be what the policy makes of them.
    for (name, spec, fields) in [
        ("ql", json!({"maxLeased": 3}), "maxLeased"),
        (
            "qb",
            json!({"maxLeased": 10, "maxLeasedPerKey": 2}),
            "maxLeased,maxLeasedPerKey",
        ),
    ] {
        confirmed_queue(&queues, name, spec, fields).await;
    }
    let queue: LeasedQueue = serde_json::from_value(json!({
        "apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedQueue",
        "metadata": {"name": "q"}, "spec": {"maxLeasedPerKey": 2},
    }))
    .unwrap();
    let queue = queues
        .create(&kube::api::PostParams::default(), &queue)
        .await
        .unwrap();
    // What a claim records (the values too), and what the confirmation names (the fields).
    let limits = format!("{}:maxLeasedPerKey=2", queue.uid().unwrap());
    let fields = format!("{}:maxLeasedPerKey", queue.uid().unwrap());
    let claim = |job: &str, limits: Option<&str>| {
        let mut status = json!({"phase": "Leased", "attempt": 1, "holder": "pod-a",
                                "token": hex_token(1), "leaseName": format!("ljob-{job}")});
        if let Some(limits) = limits {
            status["limits"] = json!(limits);
        }
        status
    };
    // The API server's copy of the LeasedQueue comes a moment later: until then a claim that
    // records no limits goes through (each probe is a job of its own).
    let mut probes = 0;
    let refused = wait_for("the limits judged", Duration::from_secs(30), || {
        probes += 1;
        let name = format!("probe-{probes}");
        let w = &w;
        let body = claim(&name, None);
        async move {
            w.create_job(&name).await;
            let body = w.with_status(&name, body).await;
            match raw(
                &w.a,
                "PUT",
                &w.status_path(&name),
                "application/json",
                &body,
            )
            .await
            {
                Ok(_) => None,
                refused => Some(refused),
            }
        }
    })
    .await;
    assert_refused(refused, "limits-obeyed");
    w.create_job("j").await;
    // Another object's limits, or the same limit with another value (a copy from before
    // it was lowered).
    let stale = format!("{}:maxLeasedPerKey=3", queue.uid().unwrap());
    for recorded in ["another-uid:maxLeasedPerKey=2", stale.as_str()] {
        let body = w.with_status("j", claim("j", Some(recorded))).await;
        assert_refused(
            raw(&w.a, "PUT", &w.status_path("j"), "application/json", &body).await,
            "limits-obeyed",
        );
    }
    let body = w.with_status("j", claim("j", Some(&limits))).await;
    assert_refused(
        raw(&w.a, "PUT", &w.status_path("j"), "application/json", &body).await,
        "limits-adopted",
    );
    // Through the claim library, as a sidecar whose copy shows no LeasedQueue.
    let outside =
        leasehold_kube::claim::claim(&w.jobs(&w.a), &w.job("j").await, "pod-a", None).await;
    assert!(
        matches!(&outside, Err(leasehold_kube::claim::ClaimError::OutsideLimits { message, .. })
            if message.contains("limits-obeyed")),
        "{outside:?}"
    );
    assert!(w.job("j").await.status.is_none(), "a refused claim wrote");

    // Confirmed (as the leading controller confirms them): the claim that records them is
    // accepted once the API server's copy shows the confirmation.
    let confirm = json!({"status": {"slotsAdopted": fields}});
    queues
        .patch_status(
            "q",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&confirm),
        )
        .await
        .unwrap();
    wait_for(
        "the confirmation judged",
        Duration::from_secs(30),
        || async {
            let body = w.with_status("j", claim("j", Some(&limits))).await;
            match raw(&w.a, "PUT", &w.status_path("j"), "application/json", &body).await {
                Ok(_) => Some(()),
                Err((422, m)) if m.contains("leasehold rule limits-adopted") => None,
                other => panic!("the claim recording the confirmed limits: {other:?}"),
            }
        },
    )
    .await;
    assert_eq!(
        w.job("j").await.status.unwrap().limits.as_deref(),
        Some(&*limits)
    );
    create_job(
        &w.admin,
        &w.ns.name,
        json!({"metadata": {"name": "n"}, "spec": {"queue": "nulls"}}),
    )
    .await;
    // The library's record of each other queue's limits is the policy's.
    for (name, job, want) in [
        ("ql", "l", "maxLeased=3"),
        ("qb", "b", "maxLeased=10,maxLeasedPerKey=2"),
    ] {
        create_job(
            &w.admin,
            &w.ns.name,
            json!({"metadata": {"name": job}, "spec": {"queue": name}}),
        )
        .await;
        let read = queues.get(name).await.unwrap();
        let (claimed, _) =
            leasehold_kube::claim::claim(&w.jobs(&w.a), &w.job(job).await, "pod-a", Some(&read))
                .await
                .unwrap_or_else(|e| panic!("a claim in queue {name}, recording its limits: {e}"));
        let recorded = claimed.status.unwrap().limits.unwrap();
        assert_eq!(recorded, format!("{}:{want}", read.uid().unwrap()));
    }
    // The queue whose limits are null (stored as null): nothing to record.
    let stored = raw(
        &w.admin,
        "GET",
        &format!(
            "/apis/leasehold.dev/v1alpha1/namespaces/{}/leasedqueues/nulls",
            w.ns.name
        ),
        "application/json",
        &json!(null),
    )
    .await
    .unwrap();
    assert_eq!(stored["spec"]["maxLeased"], Value::Null, "{stored}");
    assert!(
        stored["spec"].get("maxLeased").is_some(),
        "stored as null: {stored}"
    );
    let body = w.with_status("n", claim("n", None)).await;
    raw(&w.a, "PUT", &w.status_path("n"), "application/json", &body)
        .await
        .expect("a claim in a queue whose limits are null");
    // A queue without a LeasedQueue: nothing to record.
    create_job(
        &w.admin,
        &w.ns.name,
        json!({"metadata": {"name": "free"}, "spec": {"queue": "unlimited"}}),
    )
    .await;
    let body = w.with_status("free", claim("free", None)).await;
    raw(
        &w.a,
        "PUT",
        &w.status_path("free"),
        "application/json",
        &body,
    )
    .await
    .expect("a claim in a queue without a LeasedQueue");
}

#[tokio::test]
async fn workers_renew_and_release_only_the_leases_they_hold() {
    let w = World::new(fixture!("adm-lease"), &[]).await;
    let (jobs_a, jobs_b) = (w.jobs(&w.a), w.jobs(&w.b));
    let (leases_a, leases_b) = (w.leases(&w.a), w.leases(&w.b));
    w.create_job("j").await;
    let (job, t1) = leasehold_kube::claim::claim(&jobs_a, &w.job("j").await, "pod-a", None)
        .await
        .unwrap();
    let acquired = leasehold_kube::lease::acquire(&leases_a, &job, &t1, &Default::default())
        .await
        .expect("pod-a acquires");
    assert_eq!(lease::holder_pod(&acquired), Some("pod-a"));
    let name = lease::lease_name("j");

    // Renewing someone else's Lease (pod-b can read the token: it is no secret to workers),
    // with a checkpoint and progress, as a heartbeat carries them.
    let progress = leasehold_core::progress::Progress {
        fraction: Some(0.5),
        message: Some("halfway".into()),
    };
    let renew = serde_json::to_value(lease::renew_patch(
        &t1,
        k8s_openapi::jiff::Timestamp::now(),
        Some("{\"stolen\":true}"),
        Some(&progress),
    ))
    .unwrap();
    assert_refused(
        raw(
            &w.b,
            "PATCH",
            &w.lease_path(&name),
            "application/json-patch+json",
            &renew,
        )
        .await,
        "lease-holder-only",
    );
    // Releasing it.
    let release = serde_json::to_value(lease::release_patch(t1.as_str())).unwrap();
    assert_refused(
        raw(
            &w.b,
            "PATCH",
            &w.lease_path(&name),
            "application/json-patch+json",
            &release,
        )
        .await,
        "lease-holder-only",
    );
    // Changing its holderIdentity to another token of the same attempt, naming oneself.
    let redirect = json!({
        "metadata": {"annotations": {"leasehold.dev/holder": "pod-b"}},
        "spec": {"holderIdentity": hex_token(1)}
    });
    assert_refused(
        merge_patch(&w.b, &w.lease_path(&name), &redirect).await,
        "lease-take-over",
    );
    // ...or to anything without naming oneself as the holder.
    let redirect = json!({"spec": {"holderIdentity": hex_token(9)}});
    assert_refused(
        merge_patch(&w.b, &w.lease_path(&name), &redirect).await,
        "lease-acquire",
    );
    // Not even the holder may swap in another token of its attempt.
    let swap = json!({"spec": {"holderIdentity": hex_token(1)}});
    assert_refused(
        merge_patch(&w.a, &w.lease_path(&name), &swap).await,
        "lease-take-over",
    );
    // Nor hand the Lease to another pod, nor stretch it beyond the rules.
    let hand_over = json!({"metadata": {"annotations": {"leasehold.dev/holder": "pod-b"}}});
    assert_refused(
        merge_patch(&w.a, &w.lease_path(&name), &hand_over).await,
        "lease-holder-only",
    );
    let stretch = json!({"spec": {"leaseDurationSeconds": 999999}});
    assert_refused(
        merge_patch(&w.a, &w.lease_path(&name), &stretch).await,
        "lease-holder-only",
    );
    let l = w.leases(&w.admin).get(&name).await.unwrap();
    assert_eq!(lease::holder_identity(&l), Some(t1.as_str()));
    assert_eq!(lease::checkpoint(&l), None);

    assert_eq!(
        leasehold_core::progress::Progress::of_lease(&l),
        Default::default()
    );

    // The holder's own renewal is accepted, progress included.
    raw(
        &w.a,
        "PATCH",
        &w.lease_path(&name),
        "application/json-patch+json",
        &renew,
    )
    .await
    .expect("pod-a renews its Lease");
    let l = w.leases(&w.admin).get(&name).await.unwrap();
    assert_eq!(leasehold_core::progress::Progress::of_lease(&l), progress);

    // Attempt 1 ends without its Lease being released; pod-b claims attempt 2 and takes the
    // Lease over (a later attempt, naming itself): accepted.
    leasehold_kube::fence::apply(
        &jobs_a,
        &w.ns.name,
        "j",
        &t1,
        &Outcome::Release { checkpoint: None },
    )
    .await
    .unwrap();
    let (job, t2) = leasehold_kube::claim::claim(&jobs_b, &w.job("j").await, "pod-b", None)
        .await
        .unwrap();
    let taken = leasehold_kube::lease::acquire(&leases_b, &job, &t2, &Default::default())
        .await
        .expect("pod-b takes over");
    assert_eq!(lease::holder_pod(&taken), Some("pod-b"));
    assert_eq!(lease::holder_identity(&taken), Some(t2.as_str()));
    // The old holder cannot take it back with its older attempt.
    let back = json!({
        "metadata": {"annotations": {"leasehold.dev/holder": "pod-a"}},
        "spec": {"holderIdentity": t1.as_str()}
    });
    assert_refused(
        merge_patch(&w.a, &w.lease_path(&name), &back).await,
        "lease-take-over",
    );
    // And the holder releases its own Lease.
    leasehold_kube::lease::release(&leases_b, &name, t2.as_str())
        .await
        .unwrap();
    let l = w.leases(&w.admin).get(&name).await.unwrap();
    assert_eq!(lease::holder_identity(&l), None);

    // Leases that are not jobs' are not workers' business; nor is stripping a job Lease's
    // label (the controller would stop seeing it).
    let other = json!({"metadata": {"name": "someone-elses"}, "spec": {"holderIdentity": "x"}});
    assert_refused(
        raw(&w.a, "POST", &w.leases_path(), "application/json", &other).await,
        "job-leases-only",
    );
    // The slots of a queue's limits are theirs to take, naming a claim.
    let slot = json!({
        "metadata": {"name": "lhq-q-q-0", "labels": {"leasehold.dev/slot-of": "q", "leasehold.dev/slot-scope": "q"}},
        "spec": {"holderIdentity": "j@123#1"}
    });
    raw(&w.a, "POST", &w.leases_path(), "application/json", &slot)
        .await
        .expect("a worker takes a slot");
    let garbage = json!({"spec": {"holderIdentity": "not a claim"}});
    assert_refused(
        merge_patch(&w.b, &w.lease_path("lhq-q-q-0"), &garbage).await,
        "job-leases-only",
    );
    let unlabel = json!({"metadata": {"labels": {"app.kubernetes.io/managed-by": null}}});
    assert_refused(
        merge_patch(&w.b, &w.lease_path(&name), &unlabel).await,
        "job-leases-only",
    );
    // A worker token bound to no pod can acquire nothing.
    let unbound = client_from(&token_kubeconfig(
        &format!("{}-unbound", w.ns.name),
        &unbound_token(&w.ns.name, WORKER_SA),
        &w.ns.name,
    ))
    .await;
    let fresh = json!({
        "metadata": {"name": "ljob-fresh", "labels": {"app.kubernetes.io/managed-by": "leasehold"},
                     "annotations": {"leasehold.dev/holder": "pod-a"}},
        "spec": {"holderIdentity": hex_token(1), "leaseDurationSeconds": 60}
    });
    assert_refused(
        raw(
            &unbound,
            "POST",
            &w.leases_path(),
            "application/json",
            &fresh,
        )
        .await,
        "lease-acquire",
    );
    raw(&w.a, "POST", &w.leases_path(), "application/json", &fresh)
        .await
        .expect("the same Lease created by pod-a, which it names");
}

#[tokio::test]
async fn workers_cannot_edit_spec_nor_create_or_delete_jobs() {
    let w = World::new(fixture!("adm-spec"), &[]).await;
    w.create_job("j").await;
    let edit = json!({"spec": {"priority": 100}});
    // The chart's worker Role does not allow it at all.
    match merge_patch(&w.a, &w.job_path("j"), &edit).await {
        Err((403, m)) => assert!(m.contains("forbidden"), "{m}"),
        other => panic!("the worker Role let a worker patch a LeasedJob: {other:?}"),
    }
    // And if someone grants workers more than the chart does, the policy still refuses.
    let grant = format!(
        r#"apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: too-much, namespace: {ns}}}
rules:
- apiGroups: [leasehold.dev]
  resources: [leasedjobs]
  verbs: [create, update, patch, delete]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: too-much, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: too-much}}
subjects: [{{kind: ServiceAccount, name: {WORKER_SA}, namespace: {ns}}}]
"#,
        ns = w.ns.name
    );
    let (ok, out) = kubectl(&["apply", "-f", "-"], &grant);
    assert!(ok, "{out}");
    let refused = wait_for(
        "the wider grant in force",
        Duration::from_secs(30),
        || async {
            match merge_patch(&w.a, &w.job_path("j"), &edit).await {
                Err((403, _)) => None,
                other => Some(other),
            }
        },
    )
    .await;
    assert_refused(refused, "status-only");
    assert_refused(
        raw(
            &w.a,
            "DELETE",
            &w.job_path("j"),
            "application/json",
            &json!({}),
        )
        .await,
        "status-only",
    );
    let new_job = json!({
        "apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedJob",
        "metadata": {"name": "by-worker"}, "spec": {"queue": "q"}
    });
    let collection = format!(
        "/apis/leasehold.dev/v1alpha1/namespaces/{}/leasedjobs",
        w.ns.name
    );
    assert_refused(
        raw(&w.a, "POST", &collection, "application/json", &new_job).await,
        "status-only",
    );
    assert_eq!(w.job("j").await.spec.priority, 0);
    // The same edit by someone who is not a worker is accepted.
    merge_patch(&w.admin, &w.job_path("j"), &edit)
        .await
        .expect("an admin edits the spec");
    assert_eq!(w.job("j").await.spec.priority, 100);
}

/// Without the admission policies, RBAC alone lets a worker forge claims.
///
/// Shows what the rules above are worth: with the policies off, RBAC alone lets a worker
/// claim in another pod's name and complete a job another pod holds.
#[tokio::test]
async fn rbac_alone_lets_a_worker_forge_claims() {
    let w = World::new(fixture!("adm-off"), &["admissionPolicy.enabled=false"]).await;
    w.create_job("j").await;
    let forged = json!({"phase": "Leased", "attempt": 1, "holder": "pod-b", "token": hex_token(1)});
    let body = w.with_status("j", forged).await;
    raw(&w.a, "PUT", &w.status_path("j"), "application/json", &body)
        .await
        .expect("without the policy, the forged claim goes through");
    let complete = json!({"status": {"phase": "Succeeded", "result": "forged"}});
    merge_patch(&w.a, &w.status_path("j"), &complete)
        .await
        .expect("without the policy, a non-holder completes");
    assert_eq!(w.job("j").await.phase(), Phase::Succeeded);
}

/// A sidecar process run with a worker pod's credentials.
struct Worker {
    _proc: Proc,
    base: String,
    http: reqwest::Client,
}

impl Worker {
    async fn start(ns: &str, pod: &str, kubeconfig: &std::path::Path) -> Worker {
        let listen = format!("127.0.0.1:{}", free_port());
        let proc = spawn_leasehold(
            &format!("{ns}-{pod}"),
            &SidecarArgs::new(ns, "q", pod).listen(&listen).to_args(),
            kubeconfig,
        );
        let worker = Worker {
            _proc: proc,
            base: format!("http://{listen}"),
            http: http_client(),
        };
        wait_for("sidecar ready", Duration::from_secs(30), || async {
            let r = worker
                .http
                .get(format!("{}/healthz", worker.base))
                .send()
                .await
                .ok()?;
            r.status().is_success().then_some(())
        })
        .await;
        worker
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .expect("sidecar reachable");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn claim(&self) -> Value {
        let (s, c) = self.post("/v1/claim?wait=20", Value::Null).await;
        assert_eq!(s, 200, "claim: {c}");
        c
    }
}

#[tokio::test]
async fn job_lifecycle_runs_with_exactly_the_charts_credentials() {
    let w = World::new(fixture!("adm-life"), &[]).await;
    let ns = w.ns.name.clone();
    let controller_sa = w.release.controller_sa();
    create_pod(&w.admin, &ns, "controller-0", &controller_sa).await;
    let kc_controller = token_kubeconfig(
        &format!("{ns}-controller"),
        &pod_token(&ns, &controller_sa, "controller-0"),
        &ns,
    );
    let controller = spawn_leasehold(
        &format!("{ns}-controller"),
        &ControllerArgs::new(&ns)
            .identity("controller-0")
            .events("all")
            .to_args(),
        &kc_controller,
    );
    let a = Worker::start(&ns, "pod-a", &w.kc_a).await;
    let b = Worker::start(&ns, "pod-b", &w.kc_b).await;
    for name in ["x", "y"] {
        create_job(
            &w.admin,
            &ns,
            json!({"metadata": {"name": name}, "spec": {"queue": "q", "leaseDurationSeconds": 5}}),
        )
        .await;
    }
    let jobs = w.jobs(&w.admin);
    // The controller initialises them (its status writes are not workers').
    wait_for("jobs initialised", Duration::from_secs(30), || async {
        let list = jobs.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .all(|j| j.status.as_ref().and_then(|s| s.phase) == Some(Phase::Queued))
            .then_some(())
    })
    .await;

    let ca = a.claim().await;
    let cb = b.claim().await;
    let (xa, yb) = (ca["name"].as_str().unwrap(), cb["name"].as_str().unwrap());
    assert_ne!(xa, yb);
    // pod-a heartbeats with a checkpoint and completes.
    let (s, r) = a
        .post(
            &format!("/v1/jobs/{xa}/heartbeat"),
            json!({"token": token_of(&ca), "checkpoint": {"n": 1}}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    let (s, r) = a
        .post(
            &format!("/v1/jobs/{xa}/complete"),
            json!({"token": token_of(&ca), "result": "done"}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    // pod-b saves a checkpoint, then dies.
    let (s, r) = b
        .post(
            &format!("/v1/jobs/{yb}/heartbeat"),
            json!({"token": token_of(&cb), "checkpoint": {"step": 7}}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    b._proc.signal("KILL");
    // The controller expires pod-b's lease and requeues the job with its checkpoint.
    wait_for("expiry requeue", Duration::from_secs(30), || async {
        let j = jobs.get(yb).await.ok()?;
        let s = j.status.clone()?;
        (j.phase() == Phase::Queued && s.failures.iter().any(|f| f.reason == REASON_LEASE_EXPIRED))
            .then_some(())
    })
    .await;
    // pod-a claims it (attempt 2), resumes from pod-b's checkpoint, fails it once, claims it
    // again (attempt 3) and completes.
    let c2 = a.claim().await;
    assert_eq!(
        (c2["name"].as_str(), c2["attempt"].as_i64()),
        (Some(yb), Some(2))
    );
    assert_eq!(c2["checkpoint"], json!({"step": 7}));
    // Its first heartbeat takes over pod-b's Lease, under the chart's policy.
    let (s, r) = a
        .post(
            &format!("/v1/jobs/{yb}/heartbeat"),
            json!({"token": token_of(&c2), "checkpoint": {"step": 8}}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    let (s, r) = a
        .post(
            &format!("/v1/jobs/{yb}/fail"),
            json!({"token": token_of(&c2), "reason": "Flaky", "message": "once", "retryable": true}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    let c3 = a.claim().await;
    assert_eq!(c3["attempt"], 3);
    let (s, r) = a
        .post(
            &format!("/v1/jobs/{yb}/heartbeat"),
            json!({"token": token_of(&c3)}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    let (s, r) = a
        .post(
            &format!("/v1/jobs/{yb}/complete"),
            json!({"token": token_of(&c3), "result": "done"}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    for name in [xa, yb] {
        let j = jobs.get(name).await.unwrap();
        assert_eq!(j.phase(), Phase::Succeeded, "{name}");
        // The holder leaves its Lease as it is: the job's status fences the ended attempt
        // (docs/protocol.md, "What fences what"). It names the last attempt, which the next
        // claim, were there one, would take over.
        let l = w
            .leases(&w.admin)
            .get(&lease::lease_name(name))
            .await
            .unwrap();
        assert_eq!(
            lease::holder_identity(&l),
            j.token(),
            "Lease of {name} does not name the job's last attempt"
        );
    }
    // The controller recorded Events with its credentials.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(w.admin.clone(), &ns);
    wait_for(
        "the controller's Events",
        Duration::from_secs(30),
        || async {
            let list = events.list(&Default::default()).await.ok()?;
            let reasons: Vec<String> = list
                .items
                .iter()
                .filter(|e| e.reporting_controller.as_deref() == Some("leasehold-controller"))
                .filter_map(|e| e.reason.clone())
                .collect();
            [
                "Claimed",
                "Completed",
                REASON_LEASE_EXPIRED,
                "AttemptFailed",
            ]
            .iter()
            .all(|r| reasons.iter().any(|x| x == r))
            .then_some(())
        },
    )
    .await;
    for log in [controller.log_text(), a._proc.log_text()] {
        assert!(
            !log.contains("forbidden"),
            "a request was forbidden:\n{log}"
        );
        assert!(
            !log.contains("leasehold rule"),
            "a policy refused a legitimate write:\n{log}"
        );
    }
}
