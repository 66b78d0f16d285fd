//! One object leasehold cannot decode never stops the queue: against the real control plane,
//! with objects an admin wrote that the API server accepts but leasehold cannot read (a
//! payload nested deeper than serde_json's recursion limit of 128, times in year 9999), a
//! freshly started controller and sidecar sync, every other job keeps moving, and the odd
//! object is skipped and reported.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::fence::REASON_LEASE_EXPIRED;
use leasehold_core::lease;
use leasehold_testkit::*;
use serde_json::{json, Value};

/// `kubectl create` of an object given as JSON text, as an admin would (the typed client
/// cannot even read back what it creates).
fn kubectl_create(text: &str) {
    let (ok, out) = kubectl(&["create", "-f", "-"], text);
    assert!(ok, "kubectl create: {out}");
}

/// A merge patch of `kind/name`'s `subresource` (or the object when "") as an admin.
fn kubectl_merge_patch(ns: &str, kind: &str, name: &str, subresource: &str, patch: Value) {
    let patch = patch.to_string();
    let mut args = vec![
        "-n", ns, "patch", kind, name, "--type", "merge", "-p", &patch,
    ];
    if !subresource.is_empty() {
        args.push("--subresource");
        args.push(subresource);
    }
    let (ok, out) = kubectl(&args, "");
    assert!(ok, "kubectl patch {kind}/{name}: {out}");
}

/// Deletes the objects named (`-n NS KIND NAME` each) when dropped, pass or fail: objects no
/// binary can decode must not outlive their test (namespaces are deleted only at best).
struct DeleteOnDrop(Vec<[String; 3]>);

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        for [ns, kind, name] in &self.0 {
            let _ = kubectl(&["-n", ns, "delete", kind, name, "--wait=false"], "");
        }
    }
}

async fn wait_ready(port: u16, what: &str) {
    wait_for(what, Duration::from_secs(30), || async {
        (http_get(port, "/readyz").await?.0 == 200).then_some(())
    })
    .await;
}

/// The value of `leasehold_undecodable_objects_total{kind="KIND"}` at `port`, once above 0.
async fn undecodable_counted(port: u16, kind: &str) -> f64 {
    let name = format!("leasehold_undecodable_objects_total{{kind=\"{kind}\"}}");
    wait_for(&name.clone(), Duration::from_secs(10), || {
        let name = name.clone();
        async move {
            let n = sample(&http_get(port, "/metrics").await?.1, &name)?;
            (n > 0.0).then_some(n)
        }
    })
    .await
}

/// Claims `job` (alone in `queue`) with a fresh sidecar (its first heartbeat writes the
/// Lease), SIGKILLs the sidecar, and returns
/// once the controller has requeued the job after its 5 s lease. When `poison_lease` is set,
/// the job's Lease is first given a renewTime of year 9999 (after the kill), as an admin
/// might: the controller can no longer read it, and must still requeue the job.
async fn killed_holders_job_is_requeued(ns: &str, queue: &str, job: &str, poison_lease: bool) {
    let client = client().await;
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), ns);
    let sc = Sidecar::start(ns, queue, &format!("{job}-holder"), &[]).await;
    let (c, _) = sc.claim_leased(15).await;
    assert_eq!(c["name"].as_str(), Some(job), "{c}");
    sc.proc.signal("KILL");
    drop(sc);
    if poison_lease {
        kubectl_merge_patch(
            ns,
            "lease",
            &lease::lease_name(job),
            "",
            json!({"spec": {"renewTime": "9999-12-31T23:59:59.000000Z"}}),
        );
    }
    let requeued = wait_for("the expiry requeue", Duration::from_secs(30), || async {
        let j = jobs.get(job).await.ok()?;
        (j.failed_attempts() == 1).then_some(j)
    })
    .await;
    assert_eq!(requeued.phase(), Phase::Queued);
    let failure = &requeued.status.unwrap().failures[0];
    assert_eq!(failure.reason, REASON_LEASE_EXPIRED);
}

/// A job too deep to decode is skipped and reported while every other job moves.
#[tokio::test]
async fn undecodable_job_is_skipped() {
    let Fixture { client, ns } = fixture!("poison-job");
    let ns = ns.name.clone();
    // A payload nested 130 levels deep: valid JSON the API server stores, deeper than
    // serde_json's recursion limit of 128.
    let deep = format!("{}{}", "[".repeat(130), "]".repeat(130));
    let _cleanup = DeleteOnDrop(vec![[ns.clone(), "leasedjob".into(), "deep".into()]]);
    kubectl_create(&format!(
        r#"{{"apiVersion":"leasehold.dev/v1alpha1","kind":"LeasedJob","metadata":{{"name":"deep","namespace":"{ns}"}},"spec":{{"queue":"q","payload":{deep}}}}}"#
    ));
    create_job(
        &client,
        &ns,
        json!({"metadata": {"name": "plain"}, "spec": {"queue": "q", "payload": {"n": 1}}}),
    )
    .await;
    // A job carrying a condition an admin dated in year 9999.
    create_job(
        &client,
        &ns,
        json!({"metadata": {"name": "odd-condition"}, "spec": {"queue": "q"}}),
    )
    .await;
    kubectl_merge_patch(
        &ns,
        "leasedjob",
        "odd-condition",
        "status",
        json!({"status": {"phase": "Queued", "leaseName": lease::lease_name("odd-condition"),
            "conditions": [{"type": "Reviewed", "status": "True", "reason": "Admin",
            "message": "checked by hand", "lastTransitionTime": "9999-12-31T23:59:59Z"}]}}),
    );
    // A job of another queue, whose holder is about to die.
    create_job(
        &client,
        &ns,
        json!({"metadata": {"name": "victim"}, "spec": {"queue": "other", "leaseDurationSeconds": 5}}),
    )
    .await;

    // A controller started now, with the odd objects already there, becomes ready.
    let ctl = controller(&ns);
    let ctl_port = ctl.port.unwrap();
    wait_ready(ctl_port, "a fresh controller ready despite the odd jobs").await;

    // The other queue keeps moving: a killed holder's job is requeued after its lease.
    killed_holders_job_is_requeued(&ns, "other", "victim", false).await;

    // A fresh sidecar on the odd job's queue syncs and claims every job of it it can read.
    let sc = Sidecar::start(&ns, "q", "pod-q", &[]).await;
    let mut claimed = Vec::new();
    for _ in 0..2 {
        let (s, c) = sc.claim(10).await;
        assert_eq!(s, 200, "{c}");
        claimed.push(c["name"].as_str().unwrap().to_string());
        if c["name"] == "plain" {
            assert_eq!(c["payload"], json!({"n": 1}));
        }
    }
    claimed.sort();
    assert_eq!(claimed, ["odd-condition", "plain"]);
    let (s, c) = sc.claim(1).await;
    assert_eq!(s, 204, "the job it cannot read was claimed: {c}");

    // The skipped job is reported: by both metrics, and by a Warning Event on it.
    undecodable_counted(ctl_port, "LeasedJob").await;
    undecodable_counted(sc.proc.port.unwrap(), "LeasedJob").await;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
    let note = wait_for("the Undecodable Event", Duration::from_secs(30), || async {
        let list = events.list(&Default::default()).await.ok()?;
        list.items.into_iter().find_map(|e| {
            (e.reason.as_deref() == Some("Undecodable")
                && e.regarding.as_ref()?.name.as_deref() == Some("deep"))
            .then_some((e.type_, e.note))
        })
    })
    .await;
    assert_eq!(note.0.as_deref(), Some("Warning"));
    let text = note.1.unwrap_or_default();
    assert!(text.contains("recursion limit"), "{text}");
}

/// A Lease renewed in year 9999 does not stop the controller.
#[tokio::test]
async fn lease_renewed_in_year_9999() {
    let Fixture { client, ns } = fixture!("poison-lease");
    let ns = ns.name.clone();
    let _cleanup = DeleteOnDrop(vec![
        [ns.clone(), "lease".into(), "odd".into()],
        [ns.clone(), "lease".into(), lease::lease_name("second")],
    ]);
    // A Lease labelled as leasehold's that no leasehold binary can decode: the API server
    // accepts any four-digit year, but the timestamps k8s-openapi's MicroTime holds end a day
    // before the year 9999 does.
    kubectl_create(&format!(
        r#"{{"apiVersion":"coordination.k8s.io/v1","kind":"Lease","metadata":{{"name":"odd","namespace":"{ns}","labels":{{"app.kubernetes.io/managed-by":"leasehold"}}}},"spec":{{"holderIdentity":"someone","renewTime":"9999-12-31T23:59:59.000000Z","leaseDurationSeconds":5}}}}"#
    ));
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    assert!(
        leases.get("odd").await.is_err(),
        "this test needs a Lease the typed client cannot read"
    );
    for name in ["first", "second"] {
        create_job(
            &client,
            &ns,
            json!({"metadata": {"name": name}, "spec": {"queue": name, "leaseDurationSeconds": 5}}),
        )
        .await;
    }
    let ctl = controller(&ns);
    let ctl_port = ctl.port.unwrap();
    wait_ready(ctl_port, "a fresh controller ready despite the odd Lease").await;
    undecodable_counted(ctl_port, "Lease").await;
    killed_holders_job_is_requeued(&ns, "first", "first", false).await;
    // The same when the Lease that becomes unreadable is the dead holder's own.
    killed_holders_job_is_requeued(&ns, "second", "second", true).await;
    // ... and its Lease released, although the API server's answer to the release (the Lease,
    // still dated 9999) cannot be decoded.
    let lease_name = lease::lease_name("second");
    wait_for(
        "the odd Lease released",
        Duration::from_secs(10),
        || async {
            let (ok, holder) = kubectl(
                &[
                    "-n",
                    &ns,
                    "get",
                    "lease",
                    &lease_name,
                    "-o",
                    "jsonpath={.spec.holderIdentity}",
                ],
                "",
            );
            (ok && holder.trim().is_empty()).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let log = ctl.log_text();
    assert!(log.contains(&format!("Skipped Lease {ns}/odd")), "{log}");
    assert!(
        !log.contains("release after expiry failed"),
        "a release whose answer could not be read was taken as failed: {log}"
    );
}
