//! Sidecar injection (`leasehold controller --inject-sidecar`) against the real API server and
//! kube-controller-manager, with the chart's own sidecar template, webhook rules and policy:
//! a plain Deployment with the annotation `leasehold.dev/queue` gets pods with the sidecar;
//! pods without it are untouched; a bad annotation is refused naming it; and while no
//! controller answers, an annotated pod is refused (not created without its sidecar) and the
//! Deployment's pods come once a controller is back.
//!
//! The chart is rendered with `helm template` for the test's namespace. Its
//! MutatingWebhookConfiguration is registered with the Service reference replaced by the
//! loopback URL of a controller started here (with a CA and certificate of the test's own),
//! and its ValidatingAdmissionPolicy as rendered; both select only the test's namespace. The
//! test control plane has no kubelet: pods stay Pending, which is all admission needs.

mod chart_support;
mod webhook_support;

use std::time::Duration;

use chart_support::helm_ok;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use leasehold::inject::{INJECTED_ANNOTATION, PATH, SIDECAR_NAME};
use leasehold_testkit::*;
use serde_json::{json, Value};
use webhook_support::{make_certs, scratch};

/// The chart's documents for a release whose workers live in `ns`.
fn rendered(ns: &str) -> Vec<Value> {
    let chart = repo_root().join("charts/leasehold");
    let out = helm_ok(&[
        "template",
        "inj",
        chart.to_str().unwrap(),
        "--namespace",
        "leasehold-system",
        "--set",
        &format!("workers.namespaces={{{ns}}}"),
        "--set",
        &format!("fullnameOverride=inj-{ns}"),
    ]);
    documents(&out)
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"].as_str().unwrap().contains("sidecar"))
        .unwrap_or_else(|| panic!("the chart renders no {kind} for the sidecar"))
}

/// A controller serving the injection webhook with the chart's template, and the chart's
/// webhook configuration and policy for the test's namespace (deleted on drop).
struct Injector {
    controller: Proc,
    objects: Vec<(String, String)>,
    args: Vec<String>,
    ns: String,
}

impl Injector {
    fn start(ns: &str) -> Injector {
        let docs = rendered(ns);
        let dir = scratch(&format!("injection-{ns}"));
        let ca = make_certs(&dir, "");
        let template = find(&docs, "ConfigMap")["data"]["sidecar.json"]
            .as_str()
            .unwrap()
            .to_string();
        std::fs::write(dir.join("sidecar.json"), template).unwrap();
        let port = free_port();
        let args: Vec<String> = [
            "--admission-listen".to_string(),
            format!("127.0.0.1:{port}"),
            "--admission-cert".to_string(),
            dir.join("tls.crt").display().to_string(),
            "--admission-key".to_string(),
            dir.join("tls.key").display().to_string(),
            "--inject-sidecar".to_string(),
            dir.join("sidecar.json").display().to_string(),
        ]
        .into();
        let mut mwc = find(&docs, "MutatingWebhookConfiguration").clone();
        mwc["webhooks"][0]["clientConfig"] = json!({
            "url": format!("https://127.0.0.1:{port}{PATH}"),
            "caBundle": base64_of(&ca),
        });
        let mut objects = Vec::new();
        for object in [
            mwc,
            find(&docs, "ValidatingAdmissionPolicy").clone(),
            find(&docs, "ValidatingAdmissionPolicyBinding").clone(),
        ] {
            let (ok, out) = kubectl(&["apply", "--server-side", "-f", "-"], &object.to_string());
            assert!(ok, "kubectl apply {}: {out}", object["kind"]);
            objects.push((
                object["kind"].as_str().unwrap().to_lowercase(),
                object["metadata"]["name"].as_str().unwrap().to_string(),
            ));
        }
        Injector {
            controller: spawn(ns, &args),
            objects,
            args,
            ns: ns.to_string(),
        }
    }

    /// Starts the controller again (after a kill), on the same port and files.
    fn restart(&mut self) {
        self.controller.signal("KILL");
        self.controller = spawn(&self.ns, &self.args);
    }
}

fn spawn(ns: &str, args: &[String]) -> Proc {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    controller_with(ns, "injector", &args)
}

impl Drop for Injector {
    fn drop(&mut self) {
        for (kind, name) in &self.objects {
            let _ = kubectl(&["delete", kind, name, "--ignore-not-found"], "");
        }
    }
}

fn base64_of(text: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// A pod manifest of `ns` with `annotations`.
fn pod(ns: &str, name: &str, annotations: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "annotations": annotations},
        "spec": {"containers": [{"name": "worker", "image": "registry.example/worker:1"}]}})
}

/// `kubectl create` of `object`: the stored object, or the refusal.
fn create(object: &Value) -> Result<Value, String> {
    let (ok, out) = kubectl(&["create", "-o", "json", "-f", "-"], &object.to_string());
    if ok {
        Ok(serde_json::from_str(&out).unwrap())
    } else {
        Err(out)
    }
}

/// Checks that `pod` carries the injected sidecar for `queue`.
fn assert_injected(pod: &Value, queue: &str) {
    let spec = &pod["spec"];
    let init = spec["initContainers"].as_array().expect("initContainers");
    let sidecar = init.last().unwrap();
    assert_eq!(sidecar["name"], SIDECAR_NAME, "{pod}");
    assert_eq!(sidecar["restartPolicy"], "Always");
    let env = sidecar["env"].as_array().unwrap();
    assert!(
        env.contains(&json!({"name": "LEASEHOLD_QUEUE", "value": queue})),
        "{env:?}"
    );
    assert_eq!(spec["serviceAccountName"], "leasehold-worker");
    assert!(spec["containers"][0]["env"]
        .as_array()
        .unwrap()
        .contains(&json!({"name": "LEASEHOLD_SIDECAR", "value": "http://127.0.0.1:7070"})));
    let volumes: Vec<&str> = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert!(
        volumes.contains(&"leasehold-dispatcher-token")
            && volumes.contains(&"leasehold-api-access"),
        "{volumes:?}"
    );
    assert_eq!(
        pod["metadata"]["annotations"][INJECTED_ANNOTATION],
        env!("CARGO_PKG_VERSION")
    );
}

/// Waits until the webhook injects pods created in `ns` (probe pods, one per try).
async fn injecting(ns: &str) {
    let tries = std::sync::atomic::AtomicU32::new(0);
    wait_for("the webhook to inject", Duration::from_secs(30), || async {
        let n = tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let created = create(&pod(
            ns,
            &format!("probe-{n}"),
            json!({"leasehold.dev/queue": "q"}),
        ));
        created
            .ok()
            .filter(|p| p["spec"]["initContainers"].is_array())
    })
    .await;
}

async fn pods_of(client: &Client, ns: &str, app: &str) -> Vec<Value> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pods = api
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await
        .unwrap();
    pods.items
        .iter()
        .map(|p| serde_json::to_value(p).unwrap())
        .collect()
}

/// A Deployment with only the annotation gets its sidecar; a pod without it is untouched; a
/// bad annotation is refused naming it.
#[tokio::test]
async fn one_annotation_gives_a_deployments_pods_their_sidecar() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "inject").await;
    let ns = ns.name.clone();
    let (ok, out) = kubectl(
        &["create", "serviceaccount", "leasehold-worker", "-n", &ns],
        "",
    );
    assert!(ok, "{out}");
    let _injector = Injector::start(&ns);
    injecting(&ns).await;

    let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "transcribers", "namespace": ns},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "transcribers"}},
            "template": {
                "metadata": {"labels": {"app": "transcribers"},
                    "annotations": {"leasehold.dev/queue": "transcribe",
                        "leasehold.dev/sidecar-memory-limit": "96Mi"}},
                "spec": {"containers": [{"name": "worker", "image": "registry.example/worker:1"}]}}}});
    create(&deployment).expect("the Deployment");
    let pods = wait_for("two pods", Duration::from_secs(30), || async {
        let pods = pods_of(&client, &ns, "transcribers").await;
        (pods.len() == 2).then_some(pods)
    })
    .await;
    for pod in &pods {
        assert_injected(pod, "transcribe");
        let sidecar = pod["spec"]["initContainers"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .clone();
        assert_eq!(sidecar["resources"]["limits"]["memory"], "96Mi");
        assert_eq!(sidecar["resources"]["requests"]["memory"], "24Mi");
    }

    let plain = create(&pod(&ns, "plain", json!({"team": "a"}))).expect("a plain pod");
    assert!(plain["spec"]["initContainers"].is_null(), "{plain}");
    assert_eq!(plain["spec"]["serviceAccountName"], "default");
    assert!(plain["metadata"]["annotations"][INJECTED_ANNOTATION].is_null());

    let refused = create(&pod(
        &ns,
        "bad",
        json!({"leasehold.dev/queue": "q", "leasehold.dev/sidecar-memory-limit": "64 MB"}),
    ))
    .expect_err("a bad quantity is refused");
    assert!(
        refused.contains(&format!("pod {ns}/bad: annotation leasehold.dev/sidecar-memory-limit is \"64 MB\": must be a Kubernetes quantity")),
        "{refused}"
    );
    let refused = create(&pod(
        &ns,
        "bad-queue",
        json!({"leasehold.dev/queue": "Fast_Lane"}),
    ))
    .expect_err("a bad queue is refused");
    assert!(
        refused.contains("annotation leasehold.dev/queue is \"Fast_Lane\""),
        "{refused}"
    );
}

/// With no controller answering, a pod that asks for the sidecar is refused with a message
/// naming the webhook, others are created, and the Deployment's pods come, injected, once a
/// controller is back.
#[tokio::test]
async fn an_unreachable_webhook_refuses_annotated_pods_until_it_is_back() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "inject-down").await;
    let ns = ns.name.clone();
    let (ok, out) = kubectl(
        &["create", "serviceaccount", "leasehold-worker", "-n", &ns],
        "",
    );
    assert!(ok, "{out}");
    let mut injector = Injector::start(&ns);
    injecting(&ns).await;
    injector.controller.signal("KILL");

    // The API server puts a new policy in force within a few seconds of its creation; from
    // then on, no annotated pod is created without the sidecar.
    let tries = std::sync::atomic::AtomicU32::new(0);
    let refused = wait_for("the policy to refuse", Duration::from_secs(20), || async {
        let n = tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(200)).await;
        create(&pod(
            &ns,
            &format!("asks-{n}"),
            json!({"leasehold.dev/queue": "q"}),
        ))
        .err()
    })
    .await;
    assert!(
        refused.contains("sidecar-injected: pod asks-")
            && refused.contains(
                " has the annotation leasehold.dev/queue but no leasehold-sidecar container"
            ),
        "{refused}"
    );
    create(&pod(&ns, "plain", json!({}))).expect("a pod that does not ask is created");

    let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "late", "namespace": ns},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "late"}},
            "template": {
                "metadata": {"labels": {"app": "late"}, "annotations": {"leasehold.dev/queue": "late"}},
                "spec": {"containers": [{"name": "worker", "image": "registry.example/worker:1"}]}}}});
    create(&deployment).expect("the Deployment");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        pods_of(&client, &ns, "late").await.is_empty(),
        "a pod was created without its sidecar"
    );

    injector.restart();
    let pods = wait_for("the Deployment's pod", Duration::from_secs(60), || async {
        let pods = pods_of(&client, &ns, "late").await;
        (!pods.is_empty()).then_some(pods)
    })
    .await;
    assert_injected(&pods[0], "late");
}

/// Pods created with the annotation before the webhook and the policy existed (a worker
/// Deployment installed with the chart: Helm creates webhook configurations last) are
/// evicted by the leading controller, and their ReplicaSet makes them again, injected; a pod
/// nothing would make again is left alone.
#[tokio::test]
async fn pods_that_escaped_injection_are_made_again_with_it() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "inject-late").await;
    let ns = ns.name.clone();
    let (ok, out) = kubectl(
        &["create", "serviceaccount", "leasehold-worker", "-n", &ns],
        "",
    );
    assert!(ok, "{out}");
    wait_for(
        "the default ServiceAccount",
        Duration::from_secs(30),
        || async { create(&pod(&ns, "bare", json!({"leasehold.dev/queue": "early"}))).ok() },
    )
    .await;
    let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "early", "namespace": ns},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "early"}},
            "template": {
                "metadata": {"labels": {"app": "early"}, "annotations": {"leasehold.dev/queue": "early"}},
                "spec": {"containers": [{"name": "worker", "image": "registry.example/worker:1"}]}}}});
    create(&deployment).expect("the Deployment");
    let escaped = wait_for("the uninjected pod", Duration::from_secs(30), || async {
        pods_of(&client, &ns, "early").await.pop()
    })
    .await;
    assert!(escaped["spec"]["initContainers"].is_null(), "{escaped}");

    let _injector = Injector::start(&ns);
    let pods = wait_for("the pod made again", Duration::from_secs(60), || async {
        let pods = pods_of(&client, &ns, "early").await;
        (pods.len() == 1 && pods[0]["metadata"]["uid"] != escaped["metadata"]["uid"])
            .then_some(pods)
    })
    .await;
    assert_injected(&pods[0], "early");
    let bare: Api<Pod> = Api::namespaced(client.clone(), &ns);
    assert!(
        bare.get_opt("bare").await.unwrap().is_some(),
        "a pod without an owner was evicted"
    );
}
