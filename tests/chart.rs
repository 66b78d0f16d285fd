//! The Helm chart: lint, a server-side dry run of everything it renders (with the admission
//! webhook's certificate checked against its Service name and CA), and a real install,
//! upgrade across a CRD change (keeping the webhook's certificate), and uninstall against the
//! local API server; and the controller's refusal to start against an out-of-date CRD.
//!
//! Two tests here replace or delete the cluster's one LeasedJob CRD, so every test here that
//! uses the cluster holds [`CRD_LOCK`], and those two put the committed CRD back when they end
//! (test binaries run one after another, so no other binary's tests see the old CRD).

mod chart_support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use chart_support::*;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::DeleteParams;
use kube::Api;
use leasehold_controller::crd_check::{CRD_NAME, FIX_COMMAND};
use leasehold_testkit::*;
use serde_json::{json, Value};

static CRD_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Copies kept on purpose, each with its reason. The Python package's license file: PEP 639's
/// `license-files` are paths inside the package's directory, and a symbolic link there would
/// dangle in the example worker's image build (tests/version.rs checks the two are equal).
const INTENDED_COPIES: &[(&str, &str)] = &[("clients/python/LICENSE", "LICENSE")];

/// No file in the repository (tracked, or untracked and not ignored) is a byte-for-byte copy
/// of another: the chart carries no copy of the CRD, of the example worker or of the Python
/// client, and nothing else is kept equal by hand.
#[test]
fn no_file_in_the_repository_is_a_copy_of_another() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("git")
        .args(["ls-files", "-z", "-co", "--exclude-standard"])
        .current_dir(root)
        .output()
        .expect("git");
    assert!(
        out.status.success(),
        "git ls-files: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut seen: std::collections::HashMap<Vec<u8>, String> = Default::default();
    let mut copies = Vec::new();
    let mut files = 0;
    for name in String::from_utf8(out.stdout)
        .unwrap()
        .split_terminator('\0')
    {
        let path = root.join(name);
        // A symbolic link names its target rather than copying it; a file deleted from the
        // work tree but not yet from the index is gone.
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_file() => {}
            _ => continue,
        }
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        if bytes.is_empty() {
            continue;
        }
        files += 1;
        if let Some(first) = seen.insert(bytes, name.to_string()) {
            if !INTENDED_COPIES.contains(&(name, first.as_str()))
                && !INTENDED_COPIES.contains(&(first.as_str(), name))
            {
                copies.push(format!("{name} is a copy of {first}"));
            }
        }
    }
    assert!(files > 100, "only {files} files listed");
    assert!(copies.is_empty(), "{}", copies.join("\n"));
    assert!(
        !root.join("crds").exists() && !chart_dir().join("files").exists(),
        "the CRD lives in charts/leasehold/crds/ only, and the chart ships no files/"
    );
}

/// The example worker runs its own image (examples/Dockerfile), from the values' repository,
/// tag (default: the chart's appVersion) and pull policy: `python3 /app/worker.py`, where the
/// Dockerfile puts examples/worker.py, with the client installed in the image, so the pod has
/// no ConfigMap, no PYTHONPATH and no volume of its own (the injected sidecar brings its
/// tokens).
#[test]
fn example_worker_runs_its_own_image() {
    require_control_plane!();
    let chart = chart_dir();
    let render = |extra: &[&str]| {
        let mut args = vec![
            "template",
            "r",
            chart.to_str().unwrap(),
            "--set",
            "workers.namespaces={jobs}",
            "--set",
            "exampleWorker.enabled=true",
        ];
        for set in extra {
            args.extend(["--set", set]);
        }
        documents(&helm_ok(&args))
    };
    let worker_of = |docs: &[Value]| -> Value {
        let deployment = docs
            .iter()
            .find(|d| {
                d["kind"] == "Deployment" && d["metadata"]["name"] == "r-leasehold-example-worker"
            })
            .expect("the example worker's Deployment")
            .clone();
        let pod = &deployment["spec"]["template"]["spec"];
        assert!(pod["volumes"].is_null(), "{pod}");
        let containers = pod["containers"].as_array().unwrap();
        assert_eq!(containers.len(), 1, "{pod}");
        containers[0].clone()
    };

    let app_version = repo("charts/leasehold/Chart.yaml")
        .lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .map(|v| v.trim().trim_matches('"').to_string())
        .expect("appVersion");
    let docs = render(&[]);
    for d in &docs {
        assert!(
            d["kind"] != "ConfigMap"
                || d["metadata"]["labels"]["app.kubernetes.io/component"] != "example-worker",
            "a ConfigMap for the example worker: {d}"
        );
    }
    let worker = worker_of(&docs);
    assert_eq!(
        worker["image"],
        format!("leasehold-example-worker:{app_version}")
    );
    assert_eq!(worker["imagePullPolicy"], "IfNotPresent");
    assert!(worker.get("volumeMounts").is_none(), "{worker}");
    let env = worker["env"].as_array().cloned().unwrap_or_default();
    assert!(env.iter().all(|e| e["name"] != "PYTHONPATH"), "{worker}");
    assert_eq!(worker["command"], json!(["python3", "/app/worker.py"]));

    let worker = worker_of(&render(&[
        "exampleWorker.image.repository=registry.example.com/team/worker",
        "exampleWorker.image.tag=1.2.3",
        "exampleWorker.image.pullPolicy=Always",
    ]));
    assert_eq!(worker["image"], "registry.example.com/team/worker:1.2.3");
    assert_eq!(worker["imagePullPolicy"], "Always");

    // The script the command names is the one examples/Dockerfile copies there, and the
    // image's client is installed by pip from clients/python (tests/image.rs runs the image).
    let dockerfile = repo("examples/Dockerfile");
    let instructions: Vec<&str> = dockerfile
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect();
    assert!(
        instructions.contains(&"COPY examples/worker.py /app/worker.py"),
        "{dockerfile}"
    );
    assert!(
        instructions
            .iter()
            .any(|l| l.contains("pip install") && l.contains("/tmp/leasehold-client")),
        "{dockerfile}"
    );
    assert!(
        instructions.contains(&"COPY clients/python /tmp/leasehold-client"),
        "{dockerfile}"
    );
}

#[test]
fn helm_lint_passes_with_defaults_and_with_every_option_on() {
    require_control_plane!();
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();
    let out = helm_ok(&["lint", "--strict", chart]);
    assert!(out.contains("0 chart(s) failed"), "{out}");
    let out = helm_ok(&[
        "lint",
        "--strict",
        chart,
        "--set",
        "workers.namespaces={jobs,batch}",
        "--set",
        "exampleWorker.enabled=true",
        "--set",
        "admissionPolicy.extraWorkerUsernames={system:serviceaccount:x:y}",
        "--set",
        "controller.extraArgs={--namespace,jobs}",
        "--set",
        "admissionWebhook.failurePolicy=Fail",
        "--set",
        "admissionWebhook.namespaceSelector.matchLabels.team=jobs",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.podMonitor.enabled=true",
        "--set",
        "metrics.workerPodMonitor.enabled=true",
        "--set",
        "metrics.prometheusRule.enabled=true",
        "--set",
        "metrics.grafanaDashboard.enabled=true",
        "--set",
        "exampleWorker.keda.enabled=true",
        "--set",
        "controller.podDisruptionBudget.enabled=false",
    ]);
    assert!(out.contains("0 chart(s) failed"), "{out}");
    let out = helm_ok(&[
        "lint",
        "--strict",
        chart,
        "--set",
        "admissionWebhook.enabled=false",
        "--set",
        "sidecar.injection.enabled=false",
    ]);
    assert!(out.contains("0 chart(s) failed"), "{out}");
    // Injection is served by the admission server: without it, a clear refusal.
    let (ok, out) = helm(&[
        "template",
        "r",
        chart,
        "--set",
        "workers.namespaces={jobs}",
        "--set",
        "admissionWebhook.enabled=false",
    ]);
    assert!(
        !ok && out.contains("sidecar.injection.enabled needs admissionWebhook.enabled"),
        "{out}"
    );
    let (ok, out) = helm(&[
        "template",
        "r",
        chart,
        "--set",
        "workers.namespaces={jobs}",
        "--set",
        "sidecar.injection.failurePolicy=Sometimes",
    ]);
    assert!(
        !ok && out.contains("sidecar.injection.failurePolicy must be Ignore or Fail"),
        "{out}"
    );
    // A release made before sidecar.resources keeps its exampleWorker.sidecarResources (what
    // `--reuse-values` brings along): accepted, and it wins.
    let out = helm_ok(&[
        "template",
        "r",
        chart,
        "--set",
        "workers.namespaces={jobs}",
        "--set",
        "exampleWorker.sidecarResources.limits.memory=96Mi",
    ]);
    let template = sidecar_template(&documents(&out));
    assert_eq!(
        template["container"]["resources"],
        json!({"limits": {"memory": "96Mi"}})
    );
    // Only the two failure policies the API server knows.
    let (ok, out) = helm(&[
        "template",
        "r",
        chart,
        "--set",
        "admissionWebhook.failurePolicy=Sometimes",
    ]);
    assert!(
        !ok && out.contains("admissionWebhook.failurePolicy must be Ignore or Fail"),
        "{out}"
    );
    // values.schema.json: a typo in a key, or a value of the wrong type, fails the install
    // with the key named, instead of being ignored.
    for (set, says) in [
        (
            "controller.replcas=3",
            "at '/controller': additional properties 'replcas' not allowed",
        ),
        ("controller.replicas=two", "at '/controller/replicas'"),
        (
            "metrics.prometheusRule.alerts.noLeader.for=soon",
            "at '/metrics/prometheusRule/alerts/noLeader/for'",
        ),
        ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
    ] {
        let (ok, out) = helm(&["template", "r", chart, "--set", set]);
        assert!(!ok && out.contains(says), "--set {set}: {out}");
    }
    // The chart refuses an example worker outside the worker namespaces (at render time:
    // helm lint reports a template's `fail` only as information).
    let (ok, out) = helm(&[
        "template",
        "r",
        chart,
        "--set",
        "workers.namespaces={jobs}",
        "--set",
        "exampleWorker.enabled=true",
        "--set",
        "exampleWorker.namespace=elsewhere",
    ]);
    assert!(
        !ok && out.contains("exampleWorker.namespace must be one of"),
        "{out}"
    );
}

/// The controller's pods as operators expect them: spread over nodes by default, their
/// security contexts and volumes set from values, and their ServiceAccount their own or one
/// brought along.
#[test]
fn controller_pods_spread_and_take_their_security_context_volumes_and_account_from_values() {
    require_control_plane!();
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();
    let render = |extra: &[&str]| {
        let mut args = vec!["template", "r", chart, "--set", "workers.namespaces={jobs}"];
        for set in extra {
            args.extend(["--set", set]);
        }
        documents(&helm_ok(&args))
    };
    let pod_of = |docs: &[Value]| -> Value {
        docs.iter()
            .find(|d| {
                d["kind"] == "Deployment" && d["metadata"]["name"] == "r-leasehold-controller"
            })
            .expect("the controller's Deployment")["spec"]["template"]["spec"]
            .clone()
    };
    let docs = render(&[]);
    let pod = pod_of(&docs);
    let spread = &pod["topologySpreadConstraints"][0];
    assert_eq!(spread["topologyKey"], "kubernetes.io/hostname", "{pod}");
    assert_eq!(spread["whenUnsatisfiable"], "ScheduleAnyway", "{pod}");
    assert_eq!(
        spread["labelSelector"]["matchLabels"]["app.kubernetes.io/component"],
        "controller"
    );
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{pod}");
    assert_eq!(
        pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"], true,
        "{pod}"
    );
    assert_eq!(pod["serviceAccountName"], "r-leasehold-controller");
    // The release's own accounts (not the CRD upgrade hook's, which lives only while it runs).
    let accounts = |docs: &[Value]| -> Vec<String> {
        docs.iter()
            .filter(|d| {
                d["kind"] == "ServiceAccount"
                    && d["metadata"]["annotations"]["helm.sh/hook"].is_null()
            })
            .map(|d| d["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        accounts(&docs),
        ["r-leasehold-controller", "leasehold-worker"]
    );
    // Options: no spread, other contexts, an extra volume, accounts brought along.
    let docs = render(&[
        "controller.topologySpread.enabled=false",
        "controller.podSecurityContext.runAsUser=4242",
        "controller.securityContext.privileged=false",
        "controller.extraVolumes[0].name=ca",
        "controller.extraVolumes[0].configMap.name=ca",
        "controller.extraVolumeMounts[0].name=ca",
        "controller.extraVolumeMounts[0].mountPath=/etc/ca",
        "controller.serviceAccount.create=false",
        "controller.serviceAccount.name=platform-controller",
        "workers.createServiceAccount=false",
    ]);
    let pod = pod_of(&docs);
    assert!(pod.get("topologySpreadConstraints").is_none(), "{pod}");
    assert_eq!(pod["securityContext"]["runAsUser"], 4242, "{pod}");
    assert_eq!(pod["containers"][0]["securityContext"]["privileged"], false);
    assert!(
        pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == "ca"),
        "{pod}"
    );
    assert!(
        pod["containers"][0]["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["mountPath"] == "/etc/ca"),
        "{pod}"
    );
    assert_eq!(pod["serviceAccountName"], "platform-controller");
    assert!(accounts(&docs).is_empty(), "{:?}", accounts(&docs));
    let bound = docs.iter().any(|d| {
        d["kind"] == "ClusterRoleBinding" && d["subjects"][0]["name"] == "platform-controller"
    });
    assert!(
        bound,
        "the controller's roles are not bound to its own ServiceAccount"
    );
    // Brought along, but not named: refused with what to set.
    let (ok, out) = helm(&[
        "template",
        "r",
        chart,
        "--set",
        "controller.serviceAccount.create=false",
    ]);
    assert!(
        !ok && out.contains("controller.serviceAccount.name must name your own ServiceAccount"),
        "{out}"
    );
}

/// With `admissionWebhook.certManager.enabled`, cert-manager issues the webhook's certificate
/// into the Secret the controller mounts, and injects its CA: the chart renders no key of its
/// own, and the same every time (rendered here; no cert-manager runs in these tests).
#[test]
fn the_webhook_certificate_can_come_from_cert_manager() {
    require_control_plane!();
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();
    let render = |extra: &[&str]| {
        let mut args = vec!["template", "r", chart, "-n", "lh"];
        for set in extra {
            args.extend(["--set", set]);
        }
        helm_ok(&args)
    };
    let on = "admissionWebhook.certManager.enabled=true";
    let text = render(&[on, "workers.namespaces={jobs}"]);
    assert_eq!(
        text,
        render(&[on, "workers.namespaces={jobs}"]),
        "two renders differ"
    );
    let docs = documents(&text);
    let kind = |k: &str| {
        docs.iter()
            .filter(|d| d["kind"] == k)
            .cloned()
            .collect::<Vec<_>>()
    };
    assert!(
        kind("Secret")
            .iter()
            .all(|d| d["type"] != "kubernetes.io/tls"),
        "the chart made a key pair of its own"
    );
    let cert = &kind("Certificate")[0];
    assert_eq!(cert["spec"]["secretName"], "r-leasehold-admission-tls");
    assert_eq!(
        cert["spec"]["issuerRef"]["name"],
        "r-leasehold-admission-selfsigned"
    );
    let names = cert["spec"]["dnsNames"].as_array().unwrap();
    assert!(
        names.contains(&json!("r-leasehold-admission.lh.svc")),
        "{cert}"
    );
    assert_eq!(kind("Issuer")[0]["spec"], json!({"selfSigned": {}}));
    // Both webhooks: the size check and the sidecar injection.
    let webhooks = [
        kind("ValidatingWebhookConfiguration"),
        kind("MutatingWebhookConfiguration"),
    ]
    .concat();
    assert_eq!(webhooks.len(), 2);
    for webhook in &webhooks {
        assert_eq!(
            webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
            "lh/r-leasehold-admission"
        );
        assert!(
            webhook["webhooks"][0]["clientConfig"]
                .get("caBundle")
                .is_none(),
            "{webhook}"
        );
    }
    // An issuer of one's own: no self-signed one.
    let docs = documents(&render(&[
        on,
        "admissionWebhook.certManager.issuerRef.name=corp-ca",
        "admissionWebhook.certManager.issuerRef.kind=ClusterIssuer",
    ]));
    assert!(!docs.iter().any(|d| d["kind"] == "Issuer"));
    let cert = docs.iter().find(|d| d["kind"] == "Certificate").unwrap();
    assert_eq!(
        cert["spec"]["issuerRef"],
        json!({"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"})
    );
}

/// Everything the chart renders passes a server-side dry run.
#[tokio::test]
async fn rendered_chart_passes_a_dry_run() {
    // TestNamespace::new applies the CRD, which must not happen while another test has
    // replaced or deleted it.
    let _lock = CRD_LOCK.lock().await;
    let Fixture {
        client,
        ns: release_ns,
    } = fixture!("dry-run");
    let w1 = TestNamespace::new(&client, "dry-run-w1").await;
    let w2 = TestNamespace::new(&client, "dry-run-w2").await;
    let workers = format!("workers.namespaces={{{},{}}}", w1.name, w2.name);
    let chart = chart_dir();
    // The chart with its example worker, and `extra` values; without the `helm test` pod,
    // whose ServiceAccount a dry run does not make (the node test runs `helm test`).
    let render = |extra: &[&str]| {
        let mut args = vec![
            "template",
            "dry",
            chart.to_str().unwrap(),
            "--namespace",
            &release_ns.name,
            "--set",
            &workers,
            "--set",
            "exampleWorker.enabled=true",
            "--skip-tests",
        ];
        for set in extra {
            args.extend(["--set", set]);
        }
        helm_ok(&args)
    };
    let rendered = render(&[]);
    let (ok, out) = kubectl(&["apply", "--dry-run=server", "-f", "-"], &rendered);
    assert!(ok, "server-side dry run refused the chart:\n{out}");
    let docs = documents(&rendered);
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    for kind in [
        "ServiceAccount",
        "Deployment",
        "Service",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ValidatingWebhookConfiguration",
        "Secret",
        "PodDisruptionBudget",
    ] {
        assert!(kinds.contains(&kind), "no {kind} rendered: {kinds:?}");
    }
    for doc in &docs {
        let kind = doc["kind"].as_str().unwrap();
        let name = doc["metadata"]["name"].as_str().unwrap();
        assert!(
            out.contains(&format!("{name} created (server dry run)")),
            "{kind} {name} missing from the dry run:\n{out}"
        );
    }
    // The example worker: a plain Deployment with the annotation; the injection webhook's
    // template is the native sidecar, with the pod's name from the downward API.
    let worker = docs
        .iter()
        .find(|d| {
            d["kind"] == "Deployment" && d["metadata"]["name"] == "dry-leasehold-example-worker"
        })
        .expect("example worker Deployment");
    let pod = &worker["spec"]["template"];
    assert_eq!(
        pod["metadata"]["annotations"]["leasehold.dev/queue"],
        "demo"
    );
    assert!(pod["spec"]["initContainers"].is_null(), "{pod}");
    let template = sidecar_template(&docs);
    let sidecar = &template["container"];
    assert_eq!(sidecar["restartPolicy"], "Always", "{sidecar}");
    assert_eq!(sidecar["args"][0], "sidecar");
    let env = sidecar["env"].as_array().unwrap();
    let from_field = |name: &str| {
        env.iter()
            .find(|e| e["name"] == name)
            .map(|e| e["valueFrom"]["fieldRef"]["fieldPath"].clone())
    };
    assert_eq!(from_field("POD_NAME"), Some("metadata.name".into()));
    assert_eq!(
        from_field("POD_NAMESPACE"),
        Some("metadata.namespace".into())
    );
    assert_eq!(template["serviceAccountName"], "leasehold-worker");
    let mwc = docs
        .iter()
        .find(|d| d["kind"] == "MutatingWebhookConfiguration")
        .expect("the injection webhook");
    let injector = &mwc["webhooks"][0];
    assert_eq!(
        injector["clientConfig"]["service"]["path"],
        leasehold::inject::PATH
    );
    assert_eq!(
        injector["namespaceSelector"]["matchExpressions"][0]["values"],
        json!([w1.name, w2.name])
    );

    check_admission_webhook(&docs, &release_ns.name);

    // Without injection, the example worker writes the same sidecar out, for its queue.
    let manual = render(&["sidecar.injection.enabled=false"]);
    let manual_docs = documents(&manual);
    assert!(
        !manual_docs
            .iter()
            .any(|d| d["kind"] == "MutatingWebhookConfiguration"),
        "injection off renders no webhook"
    );
    let written = manual_docs
        .iter()
        .find(|d| {
            d["kind"] == "Deployment" && d["metadata"]["name"] == "dry-leasehold-example-worker"
        })
        .unwrap();
    let mut written_sidecar = written["spec"]["template"]["spec"]["initContainers"][0].clone();
    let written_env = written_sidecar["env"].as_array_mut().unwrap();
    assert_eq!(
        written_env.remove(0),
        json!({"name": "LEASEHOLD_QUEUE", "value": "demo"})
    );
    assert_eq!(
        &written_sidecar, sidecar,
        "the written sidecar is the injected one"
    );
    assert_eq!(
        written["spec"]["template"]["spec"]["volumes"],
        template["volumes"]
    );

    // The examples in the docs are manifests of their own: they must pass the same dry run.
    for file in [
        "docs/example-worker.yaml",
        "docs/example-worker-manual.yaml",
    ] {
        let example = repo(file);
        let (ok, out) = kubectl(
            &["apply", "--dry-run=server", "-n", &w1.name, "-f", "-"],
            &example,
        );
        assert!(ok, "{file} refused:\n{out}");
    }
    let example = documents(&repo("docs/example-worker.yaml"));
    let deployment = example
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("a Deployment in docs/example-worker.yaml");
    assert!(
        deployment["spec"]["template"]["metadata"]["annotations"]["leasehold.dev/queue"]
            .is_string()
    );
    assert!(deployment["spec"]["template"]["spec"]["initContainers"].is_null());
    let example = documents(&repo("docs/example-worker-manual.yaml"));
    let deployment = example
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("a Deployment in docs/example-worker-manual.yaml");
    let written = &deployment["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(written["restartPolicy"], "Always");
    // Its sidecar's resources are the chart's measured defaults (docs/scaling.md).
    assert_eq!(
        &written["resources"], &sidecar["resources"],
        "docs/example-worker-manual.yaml and the chart's sidecar.resources differ"
    );
    assert_eq!(sidecar["resources"]["limits"]["memory"], "64Mi");
}

/// The injection webhook's sidecar template, as the chart renders it (checked by the
/// controller's own loader).
fn sidecar_template(docs: &[Value]) -> Value {
    let text = docs
        .iter()
        .find(|d| {
            d["kind"] == "ConfigMap"
                && d["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with("-leasehold-sidecar"))
        })
        .expect("the sidecar template ConfigMap")["data"]["sidecar.json"]
        .as_str()
        .unwrap()
        .to_string();
    leasehold::inject::Sidecar::from_json(text.as_bytes()).expect("the controller loads it");
    serde_json::from_str(&text).unwrap()
}

/// The rendered webhook hangs together: the configuration calls the Service on the path the
/// controller serves, the Service reaches the controller's `admission` port, the Deployment
/// mounts the Secret and passes the flags, and the Secret's certificate is valid for the
/// Service's name, signed by the CA the configuration trusts, and loadable by the controller.
fn check_admission_webhook(docs: &[Value], ns: &str) {
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
            .clone()
    };
    let vwc = find("ValidatingWebhookConfiguration", "dry-leasehold-job-size");
    let webhook = &vwc["webhooks"][0];
    assert_eq!(webhook["failurePolicy"], "Ignore", "{webhook}");
    assert_eq!(webhook["sideEffects"], "None");
    let rule = &webhook["rules"][0];
    assert_eq!(
        rule["resources"],
        json!(["leasedjobs", "leasedjobs/status"])
    );
    assert_eq!(rule["operations"], json!(["CREATE", "UPDATE"]));
    let service = &webhook["clientConfig"]["service"];
    assert_eq!(service["path"], leasehold::admission::PATH);
    assert_eq!(service["namespace"], ns);
    let name = service["name"].as_str().unwrap();
    let svc = find("Service", name);
    assert_eq!(svc["spec"]["ports"][0]["port"], service["port"]);
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "admission");

    let deployment = find("Deployment", "dry-leasehold-controller");
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.contains(&"--admission-listen=0.0.0.0:9443")
            && args.contains(&"--admission-cert=/etc/leasehold/admission/tls.crt")
            && args.contains(&"--admission-key=/etc/leasehold/admission/tls.key"),
        "{args:?}"
    );
    assert!(container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["name"] == "admission" && p["containerPort"] == 9443));
    assert_eq!(
        container["volumeMounts"][0]["mountPath"],
        "/etc/leasehold/admission"
    );
    let secret_name = pod["volumes"][0]["secret"]["secretName"].as_str().unwrap();

    let secret = find("Secret", secret_name);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("chart-certs-{ns}"));
    std::fs::create_dir_all(&dir).unwrap();
    for (key, file) in [
        ("ca.crt", "ca.crt"),
        ("tls.crt", "tls.crt"),
        ("tls.key", "tls.key"),
    ] {
        let pem = decode_base64(secret["data"][key].as_str().unwrap());
        std::fs::write(dir.join(file), pem).unwrap();
    }
    assert_eq!(
        webhook["clientConfig"]["caBundle"], secret["data"]["ca.crt"],
        "the configuration trusts another CA than the Secret's"
    );
    let dns = format!("{name}.{ns}.svc");
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "openssl {args:?}: {text}");
        text
    };
    openssl(&[
        "verify",
        "-CAfile",
        "ca.crt",
        "-verify_hostname",
        &dns,
        "-purpose",
        "sslserver",
        "tls.crt",
    ]);
    leasehold::tls::server_config(&dir.join("tls.crt"), &dir.join("tls.key"))
        .expect("the controller loads the chart's certificate and key");
}

/// Secret data (standard base64), decoded.
fn decode_base64(text: &str) -> Vec<u8> {
    let bytes: k8s_openapi::ByteString = serde_json::from_value(json!(text)).expect("base64");
    bytes.0
}

/// The committed CRD without `status.checkpoint`: what an older release installed.
fn old_crd() -> String {
    let mut crd: Value =
        serde_yaml::from_str(&repo("charts/leasehold/crds/leasedjob.yaml")).unwrap();
    // From every version: an older release's versions share one schema. (The API server
    // refuses versions whose schemas differ while their selectableFields are the same.)
    for version in crd["spec"]["versions"].as_array_mut().unwrap() {
        let status =
            &mut version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"];
        assert!(status
            .as_object_mut()
            .unwrap()
            .remove("checkpoint")
            .is_some());
    }
    serde_yaml::to_string(&crd).unwrap()
}

fn crd_has_checkpoint(crd: &CustomResourceDefinition) -> bool {
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .unwrap();
    schema.properties.as_ref().unwrap()["status"]
        .properties
        .as_ref()
        .unwrap()
        .contains_key("checkpoint")
}

/// Puts the committed CRD back when a test that replaced it ends, however it ends.
struct RestoreCrd;

impl Drop for RestoreCrd {
    fn drop(&mut self) {
        let (ok, out) = kubectl(
            &["apply", "--server-side", "--force-conflicts", "-f", "-"],
            &repo("charts/leasehold/crds/leasedjob.yaml"),
        );
        assert!(ok || std::thread::panicking(), "restoring the CRD: {out}");
    }
}

/// Runs the documented fix, exactly as the controller's refusal prints it, with `leasehold`
/// and `kubectl` on PATH.
fn run_fix_command() {
    let dirs = [
        leasehold_bin().parent().unwrap().to_path_buf(),
        kubectl_path().parent().unwrap().to_path_buf(),
    ];
    let path = std::env::join_paths(
        dirs.iter()
            .cloned()
            .chain(std::env::split_paths(&std::env::var_os("PATH").unwrap())),
    )
    .unwrap();
    let out = Command::new("sh")
        .args(["-c", FIX_COMMAND])
        .env("PATH", path)
        .env("KUBECONFIG", kubeconfig_path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{FIX_COMMAND} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Waits for a `leasehold controller` process to exit; returns its exit success and log.
async fn exit_of(mut proc: Proc) -> (bool, String) {
    let status = wait_for("controller exit", Duration::from_secs(30), || {
        let st = proc.child.try_wait().unwrap();
        async move { st }
    })
    .await;
    (status.success(), proc.log_text())
}

/// Waits until the controller logged its start, then checks it is still running.
async fn assert_runs(proc: &mut Proc) {
    wait_for("controller started", Duration::from_secs(30), || {
        let started = proc.log_text().contains("Started leasehold controller");
        async move { started.then_some(()) }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        proc.child.try_wait().unwrap().is_none(),
        "the controller exited:\n{}",
        proc.log_text()
    );
}

/// The controller refuses an out-of-date CRD, naming the field and the fix.
#[tokio::test]
async fn controller_refuses_an_old_crd() {
    let _lock = CRD_LOCK.lock().await;
    let Fixture { ns, .. } = fixture!("crd-check");
    let _restore = RestoreCrd;
    let (ok, out) = kubectl(
        &["apply", "--server-side", "--force-conflicts", "-f", "-"],
        &old_crd(),
    );
    assert!(ok, "{out}");

    let proc = Proc::spawn(
        &format!("{}-controller-old-crd", ns.name),
        &leasehold_bin(),
        &ControllerArgs::new(&ns.name).identity("t").to_args(),
        std::process::Stdio::null(),
    );
    let (ok, log) = exit_of(proc).await;
    assert!(!ok, "the controller started against an old CRD:\n{log}");
    for needle in [
        CRD_NAME,
        "field status.checkpoint (version v1alpha1)",
        "Refusing to start",
        FIX_COMMAND,
    ] {
        assert!(log.contains(needle), "refusal lacks {needle:?}:\n{log}");
    }
    assert!(
        !log.contains("Started leasehold controller"),
        "it refused only after starting:\n{log}"
    );

    run_fix_command();
    let mut proc = Proc::spawn(
        &format!("{}-controller-fixed-crd", ns.name),
        &leasehold_bin(),
        &ControllerArgs::new(&ns.name).identity("t").to_args(),
        std::process::Stdio::null(),
    );
    assert_runs(&mut proc).await;
}

/// Objects of `release` of the given kinds, as `kubectl get` lists them (empty when none).
fn release_objects(release: &str, kinds: &str, all_namespaces: bool) -> String {
    let selector = format!("app.kubernetes.io/instance={release}");
    let mut args = vec!["get", kinds, "-l", &selector, "-o", "name"];
    if all_namespaces {
        args.push("--all-namespaces");
    }
    let (ok, out) = kubectl(&args, "");
    assert!(ok, "{out}");
    out.trim().to_string()
}

/// Helm install, upgrade across a CRD change, and uninstall leave no orphans.
#[tokio::test]
async fn helm_install_upgrade_uninstall() {
    let _lock = CRD_LOCK.lock().await;
    let Fixture { client, ns } = fixture!("helm-life");
    let workers = TestNamespace::new(&client, "helm-life-w").await;
    let _restore = RestoreCrd;

    // An older chart, whose crds/ holds the older CRD, installed on a cluster without the
    // CRD: Helm installs crds/ on that first install.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let _ = crds.delete(CRD_NAME, &DeleteParams::default()).await;
    wait_for("CRD deleted", Duration::from_secs(60), || async {
        crds.get_opt(CRD_NAME)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    let old_chart = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chart-0.0.9");
    let _ = std::fs::remove_dir_all(&old_chart);
    copy_dir(&chart_dir(), &old_chart);
    std::fs::write(old_chart.join("crds/leasedjob.yaml"), old_crd()).unwrap();
    let chart_yaml = std::fs::read_to_string(old_chart.join("Chart.yaml"))
        .unwrap()
        .replace("\nversion: 0.1.0", "\nversion: 0.0.9");
    std::fs::write(old_chart.join("Chart.yaml"), chart_yaml).unwrap();

    let rel = "helm-life";
    let workers_set = format!("workers.namespaces={{{}}}", workers.name);
    // The webhook's configuration is cluster-wide and no controller pod runs here: scoped to
    // the workers' namespace, where this test writes no LeasedJob, it never delays another
    // test's writes.
    let webhook_scope = format!(
        "admissionWebhook.namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name={}",
        workers.name
    );
    helm_ok(&[
        "install",
        rel,
        old_chart.to_str().unwrap(),
        "--namespace",
        &ns.name,
        "--set",
        &workers_set,
        "--set",
        &webhook_scope,
        "--set",
        "crds.upgradeJob.enabled=false",
    ]);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
    let secret_name = format!("{rel}-leasehold-admission-tls");
    let first_secret = secrets.get(&secret_name).await.unwrap().data.unwrap();
    let installed = wait_for("CRD installed by helm", Duration::from_secs(30), || async {
        crds.get_opt(CRD_NAME).await.unwrap()
    })
    .await;
    assert!(
        !crd_has_checkpoint(&installed),
        "helm installed the wrong CRD"
    );

    // Upgrade to this chart with its CRD upgrade Job off (no kubelet runs it here; the node
    // test does): Helm itself leaves the CRD as it was.
    let chart = chart_dir();
    helm_ok(&[
        "upgrade",
        rel,
        chart.to_str().unwrap(),
        "--namespace",
        &ns.name,
        "--set",
        &workers_set,
        "--set",
        &webhook_scope,
        "--set",
        "crds.upgradeJob.enabled=false",
    ]);
    assert!(
        !crd_has_checkpoint(&crds.get(CRD_NAME).await.unwrap()),
        "helm upgraded the CRD after all: the documented upgrade path is wrong"
    );

    // The controller, with exactly the chart's credentials, refuses the old CRD...
    let release = Release {
        name: rel.to_string(),
        namespace: ns.name.clone(),
    };
    create_pod(&client, &ns.name, "controller-0", &release.controller_sa()).await;
    let token = pod_token(&ns.name, &release.controller_sa(), "controller-0");
    let kc = token_kubeconfig(&format!("{}-controller", ns.name), &token, &ns.name);
    let args = ControllerArgs::new(&workers.name)
        .identity("controller-0")
        .to_args();
    let (ok, log) = exit_of(spawn_leasehold(
        &format!("{}-controller-1", ns.name),
        &args,
        &kc,
    ))
    .await;
    assert!(!ok, "{log}");
    assert!(
        log.contains("field status.checkpoint") && log.contains(FIX_COMMAND),
        "{log}"
    );
    // ...until the CRD is upgraded the documented way; then it starts.
    run_fix_command();
    assert!(crd_has_checkpoint(&crds.get(CRD_NAME).await.unwrap()));
    let mut controller = spawn_leasehold(&format!("{}-controller-2", ns.name), &args, &kc);
    assert_runs(&mut controller).await;
    drop(controller);

    // An upgrade that changes values reaches the Deployment.
    helm_ok(&[
        "upgrade",
        rel,
        chart.to_str().unwrap(),
        "--namespace",
        &ns.name,
        "--set",
        &workers_set,
        "--set",
        "controller.replicas=3",
        "--set",
        "controller.logLevel=debug",
        "--set",
        "controller.extraArgs={--namespace,jobs}",
        "--set",
        &webhook_scope,
        "--set",
        "crds.upgradeJob.enabled=false",
    ]);
    // Upgrades keep the webhook's CA and certificate (looked up, not made again), and the
    // configuration trusts that CA.
    let kept = secrets.get(&secret_name).await.unwrap().data.unwrap();
    assert!(
        kept == first_secret,
        "an upgrade replaced the webhook's certificate"
    );
    let configurations: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let vwc = configurations
        .get(&format!("{rel}-leasehold-job-size"))
        .await
        .unwrap();
    let webhook = &vwc.webhooks.unwrap()[0];
    assert_eq!(webhook.client_config.ca_bundle.as_ref(), kept.get("ca.crt"));
    assert_eq!(
        webhook.namespace_selector.as_ref().unwrap().match_labels,
        Some(
            [(
                "kubernetes.io/metadata.name".to_string(),
                workers.name.clone()
            )]
            .into()
        )
    );
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns.name);
    let d = deployments
        .get(&format!("{}-controller", release.fullname()))
        .await
        .unwrap();
    let spec = d.spec;
    assert_eq!(spec.replicas, Some(3));
    let c = &spec.template.spec.unwrap().containers[0];
    assert_eq!(
        c.args.clone().unwrap(),
        [
            "controller",
            "--metrics-addr=0.0.0.0:9090",
            "--admission-listen=0.0.0.0:9443",
            "--admission-cert=/etc/leasehold/admission/tls.crt",
            "--admission-key=/etc/leasehold/admission/tls.key",
            "--inject-sidecar=/etc/leasehold/sidecar/sidecar.json",
            "--namespace",
            "jobs"
        ]
    );
    let log_level = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == "RUST_LOG");
    assert_eq!(log_level.unwrap().value.as_deref(), Some("debug"));
    // The Deployment's controller made ReplicaSets and Pods (Pending: no kubelet); they must
    // go too.
    wait_for("pods of the release", Duration::from_secs(60), || async {
        let pods = release_objects(rel, "pods", true);
        (!pods.is_empty()).then_some(())
    })
    .await;

    std::mem::forget(release); // uninstalled by hand below
    helm_ok(&["uninstall", rel, "--namespace", &ns.name, "--wait"]);
    let namespaced = "deployments,replicasets,pods,services,serviceaccounts,configmaps,roles,rolebindings,secrets,poddisruptionbudgets";
    let cluster = "clusterroles,clusterrolebindings,validatingadmissionpolicies,validatingadmissionpolicybindings,validatingwebhookconfigurations,mutatingwebhookconfigurations";
    wait_for(
        "no objects of the release left",
        Duration::from_secs(60),
        || async {
            let left = format!(
                "{}{}",
                release_objects(rel, namespaced, true),
                release_objects(rel, cluster, false)
            );
            left.is_empty().then_some(())
        },
    )
    .await;
    let (ok, out) = kubectl(
        &[
            "get",
            "secrets",
            "-n",
            &ns.name,
            "-l",
            &format!("owner=helm,name={rel}"),
            "-o",
            "name",
        ],
        "",
    );
    assert!(
        ok && out.trim().is_empty(),
        "helm's release records remain: {out}"
    );
    // Helm keeps CRDs on uninstall (deleting one deletes every LeasedJob): documented.
    assert!(crds.get_opt(CRD_NAME).await.unwrap().is_some());
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// `leasehold crd --apply` (the chart's pre-upgrade hook Job runs it) upgrades an older CRD so
/// that the controller starts, says what it added, and leaves a newer CRD as it is.
#[tokio::test]
async fn crd_apply_upgrades_an_older_crd_and_leaves_a_newer_one() {
    let _lock = CRD_LOCK.lock().await;
    let Fixture { client, ns } = fixture!("crd-apply");
    let _restore = RestoreCrd;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let apply = || {
        let out = Command::new(leasehold_bin())
            .args(["crd", "--apply"])
            .env("KUBECONFIG", kubeconfig_path())
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "leasehold crd --apply failed:\n{text}"
        );
        text
    };

    // An older CRD: no status.checkpoint, and no v1beta1 (what the previous release shipped).
    let mut old: Value = serde_yaml::from_str(&old_crd()).unwrap();
    old["spec"]["versions"].as_array_mut().unwrap().truncate(1);
    let (ok, out) = kubectl(
        &["apply", "--server-side", "--force-conflicts", "-f", "-"],
        &old.to_string(),
    );
    assert!(ok, "{out}");
    let out = apply();
    assert!(
        out.contains("CustomResourceDefinition leasedjobs.leasehold.dev: upgraded: added field status.checkpoint (version v1alpha1), served version v1beta1"),
        "{out}"
    );
    assert!(
        out.contains("CustomResourceDefinition leasedqueues.leasehold.dev: already current"),
        "{out}"
    );
    let installed = crds.get(CRD_NAME).await.unwrap();
    assert!(crd_has_checkpoint(&installed));
    assert_eq!(
        crd_versions(&installed),
        [
            ("v1alpha1".to_string(), true),
            ("v1beta1".to_string(), false)
        ]
    );
    let mut controller = Proc::spawn(
        &format!("{}-controller-applied", ns.name),
        &leasehold_bin(),
        &ControllerArgs::new(&ns.name).identity("t").to_args(),
        std::process::Stdio::null(),
    );
    assert_runs(&mut controller).await;
    drop(controller);

    // A newer release's CRD (one more field, and its release's stamp): left as it is.
    let mut newer: Value =
        serde_yaml::from_str(&repo("charts/leasehold/crds/leasedjob.yaml")).unwrap();
    newer["metadata"]["annotations"]["leasehold.dev/version"] = json!("99.0.0");
    for version in newer["spec"]["versions"].as_array_mut().unwrap() {
        version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["futureField"] =
            json!({"type": "string"});
    }
    let (ok, out) = kubectl(
        &["apply", "--server-side", "--force-conflicts", "-f", "-"],
        &newer.to_string(),
    );
    assert!(ok, "{out}");
    let out = apply();
    assert!(
        out.contains("CustomResourceDefinition leasedjobs.leasehold.dev: left as it is: leasehold 99.0.0 made it, newer than this leasehold"),
        "{out}"
    );
    let installed = serde_json::to_value(crds.get(CRD_NAME).await.unwrap()).unwrap();
    assert!(
        installed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["futureField"]
            .is_object(),
        "the newer CRD lost its field"
    );
}
