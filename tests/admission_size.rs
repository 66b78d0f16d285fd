//! The controller's admission webhook (`leasehold controller --admission-listen`) against the
//! real API server: a LeasedJob too large to store is refused with a 413 that names the job,
//! the field and the limit, before anything is stored, whether the write is a create, a
//! worker's result through the sidecar, or a status patch; jobs under the limit go through
//! every step as before; a job whose trace annotations break the W3C Trace Context rules is
//! refused with a 422 naming the annotation, the value and the rule, while a job stored with
//! one before can still be updated; and a rotated serving certificate is served without a
//! restart.
//!
//! Each test makes its own CA and serving certificate for 127.0.0.1 with the `openssl` CLI,
//! starts a controller serving the webhook on a free loopback port, and registers a
//! ValidatingWebhookConfiguration of its own whose namespaceSelector matches only the test's
//! namespace, so that no other test sharing the API server ever calls it; it is deleted when
//! the test ends. Its failurePolicy is Fail, so a webhook the API server cannot reach shows as
//! an error here instead of a silent pass.

mod webhook_support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::ByteString;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use leasehold_core::crd::{LeasedJob, Phase, MAX_JOB_BYTES};
use leasehold_testkit::*;
use serde_json::{json, Value};
use webhook_support::{make_certs, scratch};

const MIB: usize = 1024 * 1024;

/// A controller serving the webhook, and the ValidatingWebhookConfiguration that sends the
/// test namespace's LeasedJob writes to it (deleted on drop).
struct Webhook {
    controller: Proc,
    configuration: String,
    dir: PathBuf,
}

impl Webhook {
    async fn start(client: &Client, ns: &str) -> Webhook {
        let dir = scratch(&format!("admission-{ns}"));
        let ca = make_certs(&dir, "");
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        let controller = controller_with(
            ns,
            "webhook",
            &[
                "--admission-listen",
                &listen,
                "--admission-cert",
                cert.to_str().unwrap(),
                "--admission-key",
                key.to_str().unwrap(),
            ],
        );
        let configuration = format!("leasehold-test-size-{ns}");
        let vwc: ValidatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": {"name": configuration},
            "webhooks": [{
                "name": "leasedjob-size.leasehold.dev",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 5,
                "clientConfig": {
                    "url": format!("https://127.0.0.1:{port}{}", leasehold::admission::PATH),
                    "caBundle": ByteString(ca.into_bytes()),
                },
                "rules": [{
                    "apiGroups": ["leasehold.dev"],
                    "apiVersions": ["*"],
                    "operations": ["CREATE", "UPDATE"],
                    "resources": ["leasedjobs", "leasedjobs/status"],
                    "scope": "Namespaced",
                }],
                // Only this test's namespace: other tests share the API server.
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            }]
        }))
        .unwrap();
        let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        api.create(&PostParams::default(), &vwc)
            .await
            .expect("create ValidatingWebhookConfiguration");
        Webhook {
            controller,
            configuration,
            dir,
        }
    }

    /// Points the configuration at another CA.
    async fn set_ca(&self, client: &Client, ca: &str) {
        let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        let mut vwc = api.get(&self.configuration).await.unwrap();
        let webhooks = vwc.webhooks.as_mut().unwrap();
        webhooks[0].client_config.ca_bundle = Some(ByteString(ca.as_bytes().to_vec()));
        api.replace(&self.configuration, &PostParams::default(), &vwc)
            .await
            .unwrap();
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        // Synchronously, so that it is gone even when the test panics.
        let _ = kubectl(
            &[
                "delete",
                "validatingwebhookconfiguration",
                &self.configuration,
                "--ignore-not-found",
            ],
            "",
        );
    }
}

/// A LeasedJob whose payload is `{"data": "<payload_bytes x's>"}`.
fn job(name: &str, queue: &str, payload_bytes: usize) -> LeasedJob {
    serde_json::from_value(json!({
        "apiVersion": "leasehold.dev/v1alpha1",
        "kind": "LeasedJob",
        "metadata": {"name": name},
        "spec": {"queue": queue, "payload": {"data": "x".repeat(payload_bytes)}},
    }))
    .unwrap()
}

/// Creates the job; the refusal's HTTP status and message on failure.
async fn try_create(api: &Api<LeasedJob>, job: &LeasedJob) -> Result<LeasedJob, (u16, String)> {
    api.create(&PostParams::default(), job)
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) => (s.code, s.message),
            other => panic!("create: {other}"),
        })
}

/// Bytes of the job as the API server stores and returns it.
async fn stored_size(client: &Client, ns: &str, name: &str) -> usize {
    let req = http::Request::get(format!(
        "/apis/leasehold.dev/v1alpha1/namespaces/{ns}/leasedjobs/{name}"
    ))
    .body(Vec::new())
    .unwrap();
    let text = client.request_text(req).await.expect("GET job");
    let value: Value = serde_json::from_str(&text).unwrap();
    serde_json::to_vec(&value).unwrap().len()
}

/// Asserts that a refusal is the webhook's: 413, naming the job, the field and the limit, and
/// pointing at an object store.
fn assert_refused(refusal: &(u16, String), job: &str, field: &str) {
    let (code, message) = refusal;
    assert_eq!(*code, 413, "{message}");
    for part in [
        format!("LeasedJob {job} "),
        " bytes as JSON".to_string(),
        format!("largest field is {field}"),
        // A status write may go admission::status_headroom past the limit.
        format!(
            "limit of {} bytes",
            if field.starts_with("status.") {
                MAX_JOB_BYTES + leasehold::admission::status_headroom(MAX_JOB_BYTES)
            } else {
                MAX_JOB_BYTES
            }
        ),
        "object store".to_string(),
    ] {
        assert!(
            message.contains(&part),
            "{part:?} missing from the refusal: {message}"
        );
    }
}

/// Jobs too large to store are refused with 413, naming the field and the limit.
#[tokio::test]
async fn oversized_jobs_are_refused_with_413() {
    let Fixture { client, ns } = fixture!("size-limit");
    let api: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let (mb_1_6, mb_2_5) = (MIB * 16 / 10, MIB * 25 / 10);

    // Without the webhook, etcd refuses such a job behind the API server: a 5xx that names no
    // limit and no field.
    let before = try_create(&api, &job("before", "q", mb_1_6))
        .await
        .expect_err("etcd stores no 1.6 MiB object");
    assert!(before.0 >= 500, "{before:?}");

    let webhook = Webhook::start(&client, &ns.name).await;
    // The API server loads a new configuration, and the controller starts listening, a moment
    // later: until then the create fails with a 5xx (etcd, or the webhook unreachable).
    let refused = wait_for("the webhook in force", Duration::from_secs(30), || async {
        match try_create(&api, &job("big-1-6", "q", mb_1_6)).await {
            Err(r) if r.0 == 413 => Some(r),
            Err(r) if r.0 >= 500 => None,
            other => panic!("a 1.6 MiB job was not refused: {other:?}"),
        }
    })
    .await;
    let name = format!("{}/big-1-6", ns.name);
    assert_refused(&refused, &name, "spec.payload");
    assert!(
        refused.1.contains(&format!("LeasedJob {name} is ")),
        "{}",
        refused.1
    );
    assert!(api.get_opt("big-1-6").await.unwrap().is_none());

    // Near the API server's own 3 MiB request limit: still the webhook's clear 413.
    let refused = try_create(&api, &job("big-2-5", "q", mb_2_5))
        .await
        .expect_err("a 2.5 MiB job is refused");
    assert_refused(&refused, &format!("{}/big-2-5", ns.name), "spec.payload");
    assert!(api.get_opt("big-2-5").await.unwrap().is_none());

    // Just under the limit: accepted, and the controller's own status write still fits.
    try_create(&api, &job("just-under", "elsewhere", MAX_JOB_BYTES - 4096))
        .await
        .expect("a job just under the limit is stored");
    wait_for("just-under Queued", Duration::from_secs(30), || async {
        let job = api.get("just-under").await.ok()?;
        (job.phase() == Phase::Queued && job.status.is_some()).then_some(())
    })
    .await;
    let size = stored_size(&client, &ns.name, "just-under").await;
    assert!(
        size <= MAX_JOB_BYTES && size > MAX_JOB_BYTES - 8192,
        "{size}"
    );

    // A worker's result that would take its job past the limit: the sidecar answers 413
    // too_large, and nothing is written.
    let sidecar = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    let half = MAX_JOB_BYTES * 6 / 10;
    try_create(&api, &job("half", "q", half)).await.unwrap();
    let (status, claim) = sidecar.claim(10).await;
    assert_eq!(status, 200, "{claim}");
    assert_eq!(claim["name"], "half");
    let token = claim["token"].as_str().unwrap().to_string();
    let (status, answer) = sidecar
        .complete("half", &token, json!({"data": "r".repeat(half)}))
        .await;
    assert_eq!(status, 413, "{answer}");
    assert_eq!(answer["error"], "too_large", "{answer}");
    assert!(
        answer["message"]
            .as_str()
            .unwrap()
            .contains(&MAX_JOB_BYTES.to_string()),
        "{answer}"
    );
    let stored = api.get("half").await.unwrap();
    assert_eq!(stored.phase(), Phase::Leased);
    assert!(stored.status.unwrap().result.is_none());

    // The same status write made directly: the webhook's own refusal.
    let patch = json!({"status": {"result": {"data": "r".repeat(half)}}});
    let refused = api
        .patch_status("half", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) => (s.code, s.message),
            other => panic!("patch: {other}"),
        })
        .expect_err("a status update past the limit is refused");
    assert_refused(&refused, &format!("{}/half", ns.name), "status.result");
    assert!(
        refused
            .1
            .contains("this status update would make LeasedJob"),
        "{}",
        refused.1
    );

    // A normal job goes through claim and complete, every write of it admitted.
    try_create(&api, &job("normal", "q", 100)).await.unwrap();
    let (status, claim) = sidecar.claim(10).await;
    assert_eq!(status, 200, "{claim}");
    assert_eq!(claim["name"], "normal");
    let token = claim["token"].as_str().unwrap().to_string();
    let (status, answer) = sidecar
        .complete("normal", &token, json!({"words": 3}))
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(api.get("normal").await.unwrap().phase(), Phase::Succeeded);

    let log = webhook.controller.log_text();
    assert!(
        log.contains(&format!("Refused CREATE of LeasedJob {}/big-1-6", ns.name)),
        "{log}"
    );
    drop(webhook);
}

/// Creates or changes that set a malformed `leasehold.dev/traceparent` or `tracestate` are
/// refused with 422, naming the job, the annotation, the value and the rule; valid ones are
/// stored; a job stored with a malformed one before the webhook can still be cancelled.
#[tokio::test]
async fn malformed_trace_annotations_are_refused_with_422() {
    let Fixture { client, ns } = fixture!("trace-annotations");
    let api: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let traced = |name: &str, annotations: Value| -> LeasedJob {
        let mut j = job(name, "q", 10);
        j.metadata.annotations = Some(serde_json::from_value(annotations).unwrap());
        j
    };
    let bad = json!({"leasehold.dev/traceparent": "00-abc-def-01"});
    try_create(&api, &traced("stored-before", bad.clone()))
        .await
        .expect("no webhook yet");

    let _webhook = Webhook::start(&client, &ns.name).await;
    wait_for("the webhook in force", Duration::from_secs(30), || async {
        match try_create(&api, &job("probe", "q", MIB * 16 / 10)).await {
            Err(r) if r.0 == 413 => Some(()),
            Err(r) if r.0 >= 500 => None,
            other => panic!("a 1.6 MiB job was not refused: {other:?}"),
        }
    })
    .await;

    let refused = try_create(&api, &traced("bad-parent", bad.clone()))
        .await
        .expect_err("a malformed traceparent is refused");
    assert_eq!(refused.0, 422, "{}", refused.1);
    for part in [
        format!("LeasedJob {}/bad-parent", ns.name),
        "annotation leasehold.dev/traceparent \"00-abc-def-01\" is not a valid W3C traceparent"
            .to_string(),
        "section 3.2".to_string(),
    ] {
        assert!(refused.1.contains(&part), "{part:?} missing: {}", refused.1);
    }
    assert!(api.get_opt("bad-parent").await.unwrap().is_none());
    let refused = try_create(
        &api,
        &traced(
            "bad-state",
            json!({"leasehold.dev/traceparent": VALID, "leasehold.dev/tracestate": "Vendor=1"}),
        ),
    )
    .await
    .expect_err("a malformed tracestate is refused");
    assert_eq!(refused.0, 422, "{}", refused.1);
    assert!(
        refused.1.contains("annotation leasehold.dev/tracestate")
            && refused.1.contains("section 3.3"),
        "{}",
        refused.1
    );

    // Valid ones are stored; changing one to a malformed value is refused as well.
    try_create(
        &api,
        &traced(
            "good",
            json!({"leasehold.dev/traceparent": VALID, "leasehold.dev/tracestate": "vendor=1"}),
        ),
    )
    .await
    .expect("valid trace annotations are stored");
    let retrace = json!({"metadata": {"annotations": {"leasehold.dev/traceparent": "01-x"}}});
    let err = api
        .patch("good", &PatchParams::default(), &Patch::Merge(&retrace))
        .await
        .expect_err("a malformed traceparent set by an update is refused");
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422),
        "{err}"
    );

    // The job stored before keeps its annotation and can still be cancelled.
    let cancel = json!({"spec": {"cancel": true}});
    api.patch(
        "stored-before",
        &PatchParams::default(),
        &Patch::Merge(&cancel),
    )
    .await
    .expect("an update that keeps a stored annotation goes on");
}

#[tokio::test]
async fn a_rotated_certificate_is_served_without_a_restart() {
    let Fixture { client, ns } = fixture!("size-rotate");
    let api: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let webhook = Webhook::start(&client, &ns.name).await;
    let too_big = job("too-big", "q", MAX_JOB_BYTES + 1);
    wait_for("the webhook in force", Duration::from_secs(30), || async {
        let refused = try_create(&api, &too_big).await.err()?;
        (refused.0 == 413).then_some(())
    })
    .await;

    // A new CA and certificate, swapped in the way the kubelet updates a mounted Secret
    // (written beside, then renamed over), and the API server told to trust only the new CA.
    let ca2 = make_certs(&webhook.dir, "new-");
    for file in ["tls.crt", "tls.key"] {
        std::fs::rename(
            webhook.dir.join(format!("new-{file}")),
            webhook.dir.join(file),
        )
        .unwrap();
    }
    webhook.set_ca(&client, &ca2).await;
    // Once the API server uses the new CA, only the new certificate passes its check: a 413
    // now comes from a handshake with the reloaded certificate.
    let start = std::time::Instant::now();
    loop {
        let served = match try_create(&api, &too_big).await {
            Err(r) if r.0 == 413 => true,
            Err(r) => {
                // The API server still on the old CA for a moment, or a handshake that
                // fails, which is what a missed reload would give forever.
                assert!(r.1.contains("failed calling webhook"), "{r:?}");
                false
            }
            Ok(j) => panic!("stored {j:?}"),
        };
        if served && start.elapsed() > Duration::from_secs(3) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the rotated certificate was not served: {}",
            webhook.controller.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        webhook
            .controller
            .log_text()
            .contains("Loaded the rotated TLS certificate"),
        "{}",
        webhook.controller.log_text()
    );
}

/// Runs `leasehold controller` with `args` (no cluster is needed to refuse them); returns
/// whether it failed and its stderr.
fn refused(args: &[&str]) -> (bool, String) {
    let out = Command::new(leasehold_bin())
        .arg("controller")
        .args(args)
        .env("KUBECONFIG", "/nonexistent")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        !out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Bad admission flags are refused at start, naming the problem.
#[test]
fn bad_admission_flags_are_refused() {
    let dir = scratch("admission-bad-flags");
    let ca = dir.join("ca.crt");
    make_certs(&dir, "");
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "not PEM at all").unwrap();
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let (cert, key, ca, junk) = (
        cert.to_str().unwrap(),
        key.to_str().unwrap(),
        ca.to_str().unwrap(),
        junk.to_str().unwrap(),
    );
    // (arguments, what the error must say)
    let cases: [(Vec<&str>, &str); 5] = [
        (
            vec!["--admission-listen", "127.0.0.1:0"],
            "--admission-cert <FILE>",
        ),
        (
            vec!["--admission-cert", cert, "--admission-key", key],
            "--admission-listen <ADDR>",
        ),
        (
            vec![
                "--admission-listen",
                "127.0.0.1:0",
                "--admission-cert",
                junk,
                "--admission-key",
                key,
            ],
            "holds no PEM certificate",
        ),
        (
            vec![
                "--admission-listen",
                "127.0.0.1:0",
                "--admission-cert",
                cert,
                "--admission-key",
                "/nonexistent/tls.key",
            ],
            "cannot read /nonexistent/tls.key",
        ),
        // The CA's certificate with the serving certificate's key: not a pair.
        (
            vec![
                "--admission-listen",
                "127.0.0.1:0",
                "--admission-cert",
                ca,
                "--admission-key",
                key,
            ],
            "cannot serve the certificate",
        ),
    ];
    for (args, expected) in cases {
        let (failed, stderr) = refused(&args);
        assert!(
            failed && stderr.contains(expected),
            "{args:?}: expected {expected:?} in:\n{stderr}"
        );
    }
}
