//! The CRD as committed, as installed, and as it judges manifests (the API server's own
//! validation and kubectl's strict field validation).

use std::process::Command;

use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};
use leasehold_core::crd::{LeasedJob, LeasedJobStatus, Phase};
use leasehold_testkit::*;
use serde_json::json;

#[test]
fn committed_crd_equals_leasehold_crd_output() {
    let out = Command::new(leasehold_bin()).arg("crd").output().unwrap();
    assert!(out.status.success());
    assert!(
        committed_crds() == String::from_utf8(out.stdout).unwrap(),
        "charts/leasehold/crds/leasedjob.yaml or leasedqueue.yaml is stale: regenerate them with `scripts/gen-crd`"
    );
}

fn manifest(name: &str, spec: &str) -> String {
    format!("apiVersion: leasehold.dev/v1alpha1\nkind: LeasedJob\nmetadata:\n  name: {name}\nspec:\n{spec}\n")
}

/// Bad manifests are rejected with messages naming the field.
#[tokio::test]
async fn bad_manifests_are_rejected() {
    let Fixture { client, ns } = fixture!("crd-bad");
    let cases = [
        (
            "zero-lease",
            "  leaseDurationSeconds: 0",
            "spec.leaseDurationSeconds",
        ),
        (
            "negative-lease",
            "  leaseDurationSeconds: -5",
            "spec.leaseDurationSeconds",
        ),
        (
            "long-lease",
            "  leaseDurationSeconds: 86401",
            "spec.leaseDurationSeconds",
        ),
        ("zero-attempts", "  maxAttempts: 0", "spec.maxAttempts"),
        (
            "string-attempts",
            "  maxAttempts: three",
            "spec.maxAttempts",
        ),
        ("string-priority", "  priority: high", "spec.priority"),
        ("bad-queue", "  queue: Not_A_Label", "spec.queue"),
        ("unknown-field", "  leaseDuration: 30", "leaseDuration"),
        (
            "year-9999",
            "  notBefore: \"9999-12-31T00:00:00Z\"",
            "spec.notBefore",
        ),
        (
            "long-fraction",
            "  notBefore: \"2026-12-01T00:00:00.123456789012Z\"",
            "spec.notBefore",
        ),
        (
            "backoff-inverted",
            "  backoff: {initialSeconds: 60, maxSeconds: 10}",
            "initialSeconds must not exceed",
        ),
    ];
    for (name, spec, field) in cases {
        let (ok, out) = kubectl(
            &["apply", "--validate=strict", "-n", &ns.name, "-f", "-"],
            &manifest(name, spec),
        );
        assert!(!ok, "{name} was accepted: {out}");
        assert!(
            out.contains(field),
            "{name}: message does not name {field}: {out}"
        );
    }
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    assert!(
        jobs.list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty(),
        "a rejected manifest was half-written"
    );
}

#[tokio::test]
async fn the_queue_of_a_job_cannot_change() {
    let Fixture { ns, .. } = fixture!("crd-queue");
    let (ok, out) = kubectl(
        &["apply", "-n", &ns.name, "-f", "-"],
        &manifest("q", "  queue: a"),
    );
    assert!(ok, "{out}");
    let (ok, out) = kubectl(
        &[
            "patch",
            "ljob",
            "q",
            "-n",
            &ns.name,
            "--type",
            "merge",
            "-p",
            r#"{"spec":{"queue":"b"}}"#,
        ],
        "",
    );
    assert!(!ok, "the queue changed: {out}");
    assert!(out.contains("spec.queue is immutable"), "{out}");
}

#[tokio::test]
async fn defaults_apply_and_the_payload_comes_back_unchanged() {
    let Fixture { client, ns } = fixture!("crd-payload");
    let payload = json!({
        "nested": {"deeper": {"list": [1, 2.5, -3, 1e300, {"k": null}], "flag": true}},
        "unicode": "전사 — transcription ✓ 🎧",
        "empty": {},
        "array": [[], [[]], "x"],
        "big": 9007199254740991i64
    });
    let manifest = json!({
        "apiVersion": "leasehold.dev/v1alpha1",
        "kind": "LeasedJob",
        "metadata": {"name": "payload"},
        "spec": {"payload": payload}
    });
    // `kubectl create`, not `apply`: client-side apply reads a null as "delete this key".
    let (ok, out) = kubectl(
        &["create", "--validate=strict", "-n", &ns.name, "-f", "-"],
        &manifest.to_string(),
    );
    assert!(ok, "{out}");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let job = jobs.get("payload").await.unwrap();
    assert_eq!(job.spec.payload, payload);
    assert_eq!(job.spec.queue, "default");
    // Unset stays unset: the queue's defaults (or leasehold's) apply at each claim
    // (tests/defaults.rs), so the stored spec says only what its author wrote.
    assert_eq!(job.spec.lease_duration_seconds, None);
    assert_eq!(job.spec.max_attempts, None);
    assert_eq!(job.spec.priority, 0);
    let (ok, out) = kubectl(&["explain", "leasedjob.spec.leaseDurationSeconds"], "");
    assert!(ok && out.contains("heartbeat"), "{out}");
    // An explicit null is pruned, not stored: binaries from before these fields became
    // optional read them as integers, and would skip a job holding a null as undecodable.
    let nulls = json!({
        "apiVersion": "leasehold.dev/v1alpha1",
        "kind": "LeasedJob",
        "metadata": {"name": "nulls"},
        "spec": {"leaseDurationSeconds": null, "maxAttempts": null}
    });
    let (ok, out) = kubectl(&["create", "-n", &ns.name, "-f", "-"], &nulls.to_string());
    assert!(ok, "{out}");
    let (ok, out) = kubectl(&["get", "ljob", "nulls", "-n", &ns.name, "-o", "json"], "");
    assert!(ok, "{out}");
    let stored: serde_json::Value = serde_json::from_str(&out).unwrap();
    let spec = stored["spec"].as_object().unwrap();
    for field in ["leaseDurationSeconds", "maxAttempts"] {
        assert!(!spec.contains_key(field), "{field} stored: {spec:?}");
    }
}

/// `status.phase`, `spec.queue` and `status.holder` are selectable fields: the API server
/// itself filters jobs by them, for `kubectl get ljob --field-selector status.phase=Failed` as
/// for a sidecar's two watches (its queue's jobs, a new one without a status included, and the
/// jobs it holds); a field that is not declared selectable is refused.
#[tokio::test]
async fn jobs_are_selected_by_phase_and_queue_on_the_api_server() {
    let Fixture { client, ns } = fixture!("crd-select");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    let cases = [
        ("a", "q", Phase::Queued),
        ("b", "q", Phase::Failed),
        ("c", "q", Phase::Succeeded),
        ("d", "other", Phase::Failed),
        ("e", "q", Phase::Failed),
    ];
    for (name, queue, phase) in cases {
        let mut job = create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": name}, "spec": {"queue": queue}}),
        )
        .await;
        job.status = Some(LeasedJobStatus {
            phase: Some(phase),
            holder: (name == "c" || name == "d").then(|| "pod-a".to_string()),
            ..LeasedJobStatus::default()
        });
        jobs.replace_status(name, &PostParams::default(), &job)
            .await
            .unwrap();
    }
    let (ok, out) = kubectl(
        &[
            "get",
            "ljob",
            "-n",
            &ns.name,
            "--field-selector",
            "status.phase=Failed",
            "-o",
            "name",
        ],
        "",
    );
    assert!(ok, "{out}");
    let mut names: Vec<&str> = out.lines().filter(|l| l.starts_with("leasedjob")).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "leasedjob.leasehold.dev/b",
            "leasedjob.leasehold.dev/d",
            "leasedjob.leasehold.dev/e"
        ],
        "{out}"
    );
    let listed = |fields: String| {
        let jobs = jobs.clone();
        async move {
            let mut names: Vec<String> = jobs
                .list(&ListParams::default().fields(&fields))
                .await
                .unwrap()
                .items
                .iter()
                .map(ResourceExt::name_any)
                .collect();
            names.sort_unstable();
            names
        }
    };
    assert_eq!(
        listed("status.phase=Failed,spec.queue=q".into()).await,
        ["b", "e"]
    );
    assert_eq!(
        listed("status.phase!=Failed,spec.queue=q".into()).await,
        ["a", "c"]
    );
    assert_eq!(listed("spec.queue=other".into()).await, ["d"]);
    // A job just created has no status yet: both watches must treat it right.
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "f"}, "spec": {"queue": "q"}}),
    )
    .await;
    let queue = leasehold_kube::queue_watch::queue_selector("q");
    assert_eq!(listed(queue).await, ["a", "b", "c", "e", "f"]);
    let held = leasehold_kube::queue_watch::held_selector("q", "pod-a");
    assert_eq!(
        listed(held).await,
        ["c"],
        "d is pod-a's too, in another queue"
    );
    let (ok, out) = kubectl(
        &[
            "get",
            "ljob",
            "-n",
            &ns.name,
            "--field-selector",
            "spec.priority=0",
        ],
        "",
    );
    assert!(!ok, "a field that is not selectable was accepted: {out}");
    assert!(out.contains("spec.priority"), "{out}");
}

/// `kubectl explain` prints descriptions as filled paragraphs.
///
/// `kubectl explain` fills each description's paragraphs to its 80 columns: no line ends
/// early where the next line's first word would have fit, which is what a hard line break
/// inside a description (a doc comment's source line ending) looks like in its output. A
/// line that ends a sentence may be followed by a short one: for a list field, kubectl prints
/// the items' own description on the next line.
#[tokio::test]
async fn kubectl_explain_fills_paragraphs() {
    require_control_plane!();
    let client = client().await;
    install_crd(&client).await;
    for path in [
        "ljob.spec",
        "ljob.status",
        "ljob.status.failures",
        "ljob.spec.backoff",
    ] {
        let (ok, out) = kubectl(&["explain", path], "");
        assert!(ok, "{out}");
        let lines: Vec<&str> = out.lines().collect();
        let early: Vec<String> = lines
            .windows(2)
            .filter(|w| {
                let (a, b) = (w[0], w[1]);
                let text = |l: &str| l.starts_with("    ") && !l.trim().is_empty();
                let next_word = b.split_whitespace().next().unwrap_or_default();
                let new_sentence = a.trim_end().ends_with('.')
                    && next_word.starts_with(|c: char| c.is_ascii_uppercase());
                text(a)
                    && text(b)
                    && !new_sentence
                    && a.trim_end().len() + 1 + next_word.len() <= 80
            })
            .map(|w| format!("{:?} / {:?}", w[0], w[1]))
            .collect();
        assert!(
            early.is_empty(),
            "kubectl explain {path}: lines broken before the wrap width:\n{}\n\n{out}",
            early.join("\n")
        );
    }
}

/// `v1beta1` is served beside `v1alpha1`, which stays the storage version: a job stored as
/// v1alpha1 is read through v1beta1, written through it (spec and status), and read back
/// through v1alpha1 with nothing lost. The conversion is `None`: the schemas are the same.
#[tokio::test]
async fn a_job_stored_as_v1alpha1_is_read_and_written_through_v1beta1() {
    let Fixture { client, ns } = fixture!("crd-beta");
    let ns = ns.name.clone();
    let (ok, out) = kubectl(
        &["apply", "-n", &ns, "-f", "-"],
        &manifest(
            "b",
            "  queue: beta\n  priority: 1\n  payload: {\"file\": \"a.wav\"}",
        ),
    );
    assert!(ok, "{out}");
    let get = |version: &str| {
        let (ok, out) = kubectl(
            &[
                "get",
                &format!("leasedjobs.{version}.leasehold.dev"),
                "b",
                "-n",
                &ns,
                "-o",
                "json",
            ],
            "",
        );
        assert!(ok, "{out}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let beta = get("v1beta1");
    assert_eq!(beta["apiVersion"], "leasehold.dev/v1beta1");
    assert_eq!(beta["spec"]["payload"], json!({"file": "a.wav"}));
    assert_eq!(beta["spec"]["priority"], 1);

    // Written through v1beta1: the spec, and the status subresource.
    let patch = |subresource: &[&str], body: &str| {
        let mut args = vec!["patch", "leasedjobs.v1beta1.leasehold.dev", "b", "-n", &ns];
        args.extend(subresource);
        args.extend(["--type", "merge", "-p", body]);
        let (ok, out) = kubectl(&args, "");
        assert!(ok, "{out}");
    };
    patch(
        &[],
        r#"{"spec":{"priority":7},"metadata":{"labels":{"written-as":"v1beta1"}}}"#,
    );
    patch(
        &["--subresource", "status"],
        r#"{"status":{"checkpoint":{"offset":42}}}"#,
    );

    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns);
    let alpha = jobs.get("b").await.unwrap();
    assert_eq!(alpha.spec.priority, 7);
    assert_eq!(
        alpha.labels().get("written-as").map(String::as_str),
        Some("v1beta1")
    );
    assert_eq!(alpha.spec.payload, json!({"file": "a.wav"}));
    let raw = serde_json::to_value(&alpha).unwrap();
    assert_eq!(raw["status"]["checkpoint"], json!({"offset": 42}), "{raw}");

    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client.clone());
    let crd = crds.get("leasedjobs.leasehold.dev").await.unwrap();
    assert_eq!(
        crd.status.unwrap().stored_versions,
        Some(vec!["v1alpha1".to_string()]),
        "objects are stored as v1alpha1 only"
    );
}
