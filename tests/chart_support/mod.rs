//! Helpers of the chart tests: helm and kubectl against the test control plane, releases of
//! the chart, and credentials made the way a cluster makes them for pods: TokenRequest tokens
//! for the chart's ServiceAccounts, bound to Pod objects (which stay Pending: the test control
//! plane has no kubelet and no scheduler).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use serde_json::{json, Value};

use leasehold_testkit::{kubectl, leasehold_bin, run, wait_for, Proc};

/// The chart's directory in the repository.
pub fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/leasehold")
}

/// The helm binary that scripts/test builds from the Go module proxy.
pub fn helm_path() -> PathBuf {
    match std::env::var_os("LEASEHOLD_HELM") {
        Some(p) => PathBuf::from(p),
        None => panic!("LEASEHOLD_HELM is not set: the chart tests run under `scripts/test`"),
    }
}

/// helm with the admin kubeconfig and its own config, cache and data directories (never the
/// user's).
pub fn helm(args: &[&str]) -> (bool, String) {
    let home = Path::new(env!("CARGO_TARGET_TMPDIR")).join("helm-home");
    let (config, cache, data) = (home.join("config"), home.join("cache"), home.join("data"));
    run(
        &helm_path(),
        args,
        "",
        &[
            ("HELM_CONFIG_HOME", &config),
            ("HELM_CACHE_HOME", &cache),
            ("HELM_DATA_HOME", &data),
        ],
    )
}

/// helm, which must succeed; returns its output.
pub fn helm_ok(args: &[&str]) -> String {
    let (ok, out) = helm(args);
    assert!(ok, "helm {} failed:\n{out}", args.join(" "));
    out
}

/// A release of the chart, uninstalled (synchronously) on drop.
pub struct Release {
    pub name: String,
    pub namespace: String,
}

impl Release {
    /// `helm install NAME chart -n NAMESPACE --set ...`, skipping crds/ (the tests install the
    /// CRD themselves, and a release must not own the one CRD that all tests share).
    ///
    /// The admission webhook is off unless `sets` turn it on: no controller pod runs here (no
    /// kubelet), so the API server could not reach it, and its configuration is cluster-wide:
    /// every LeasedJob write of every test would wait for its timeout. Sidecar injection,
    /// which it serves, is off with it.
    pub fn install(name: &str, namespace: &str, sets: &[&str]) -> Release {
        let chart = chart_dir();
        Release::install_from(name, namespace, &[chart.to_str().unwrap()], sets)
    }

    /// [`Release::install`] of the chart that `chart` names: helm's arguments for it, e.g.
    /// `["oci://HOST/charts/leasehold", "--version", "0.1.0", "--plain-http"]`.
    pub fn install_from(name: &str, namespace: &str, chart: &[&str], sets: &[&str]) -> Release {
        let mut args = vec!["install", name];
        args.extend_from_slice(chart);
        args.extend_from_slice(&[
            "--namespace",
            namespace,
            "--skip-crds",
            "--set",
            "admissionWebhook.enabled=false",
            "--set",
            "sidecar.injection.enabled=false",
            // No kubelet runs here to run the pre-upgrade hook Job: `helm upgrade` would wait.
            "--set",
            "crds.upgradeJob.enabled=false",
        ]);
        for s in sets {
            args.extend_from_slice(&["--set", s]);
        }
        helm_ok(&args);
        Release {
            name: name.to_string(),
            namespace: namespace.to_string(),
        }
    }

    /// The release's resource-name prefix (the chart's `leasehold.fullname`).
    pub fn fullname(&self) -> String {
        if self.name.contains("leasehold") {
            self.name.clone()
        } else {
            format!("{}-leasehold", self.name)
        }
    }

    /// The controller's ServiceAccount.
    pub fn controller_sa(&self) -> String {
        format!("{}-controller", self.fullname())
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        let _ = helm(&["uninstall", &self.name, "--namespace", &self.namespace]);
    }
}

/// Creates a Pod named `name` running as ServiceAccount `sa`, to bind tokens to. It stays
/// Pending.
pub async fn create_pod(client: &Client, ns: &str, name: &str, sa: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"leasehold-test": "token-holder"}},
        "spec": {
            "serviceAccountName": sa,
            "automountServiceAccountToken": false,
            "containers": [{"name": "main", "image": "leasehold:test"}]
        }
    }))
    .unwrap();
    // The ServiceAccount admission plugin refuses the Pod until its ServiceAccount exists.
    wait_for(
        &format!("pod {ns}/{name} created"),
        Duration::from_secs(30),
        || {
            let (pods, pod) = (pods.clone(), pod.clone());
            async move { pods.create(&PostParams::default(), &pod).await.ok() }
        },
    )
    .await
}

/// A TokenRequest token of ServiceAccount `sa` bound to Pod `pod`, made by `kubectl create
/// token`. The API server adds the pod's name to the token's user info
/// (`authentication.kubernetes.io/pod-name`).
pub fn pod_token(ns: &str, sa: &str, pod: &str) -> String {
    let (ok, out) = kubectl(
        &[
            "create",
            "token",
            sa,
            "--namespace",
            ns,
            "--bound-object-kind",
            "Pod",
            "--bound-object-name",
            pod,
            "--duration",
            "1h",
        ],
        "",
    );
    assert!(ok, "kubectl create token: {out}");
    out.trim().to_string()
}

/// A token of ServiceAccount `sa` bound to no object (what a leaked or hand-made worker
/// credential looks like).
pub fn unbound_token(ns: &str, sa: &str) -> String {
    let (ok, out) = kubectl(
        &["create", "token", sa, "--namespace", ns, "--duration", "1h"],
        "",
    );
    assert!(ok, "kubectl create token: {out}");
    out.trim().to_string()
}

/// A client that authenticates with the kubeconfig at `path`.
pub async fn client_from(path: &Path) -> Client {
    let kc = Kubeconfig::read_from(path).expect("kubeconfig");
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("kubeconfig");
    Client::try_from(config).expect("client")
}

/// Starts `leasehold args` with the kubeconfig at `kubeconfig` (never the admin one).
pub fn spawn_leasehold<A: AsRef<std::ffi::OsStr>>(
    name: &str,
    args: &[A],
    kubeconfig: &Path,
) -> Proc {
    Proc::spawn_as(name, &leasehold_bin(), args, Stdio::null(), kubeconfig)
}

/// A JSON merge patch made by hand (see [`raw`]).
pub async fn merge_patch(
    client: &Client,
    path: &str,
    body: &Value,
) -> Result<Value, (u16, String)> {
    raw(client, "PATCH", path, "application/merge-patch+json", body).await
}

/// An API request made by hand: method, path, JSON body and its content type. Returns the
/// answer's JSON, or the refusal's HTTP status and message.
pub async fn raw(
    client: &Client,
    method: &str,
    path: &str,
    content_type: &str,
    body: &Value,
) -> Result<Value, (u16, String)> {
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("Content-Type", content_type)
        .body(serde_json::to_vec(body).unwrap())
        .unwrap();
    match client.request_text(req).await {
        Ok(text) => Ok(serde_json::from_str(&text).unwrap_or(Value::String(text))),
        Err(kube::Error::Api(s)) => Err((s.code, s.message)),
        Err(e) => panic!("{method} {path}: {e}"),
    }
}
