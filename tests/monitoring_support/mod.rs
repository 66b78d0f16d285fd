//! Helpers of the monitoring tests (tests/monitoring.rs): the chart rendered and its rules
//! extracted, promtool, the monitoring CRDs installed for a dry run, a Prometheus process and
//! its HTTP API, and a leader Lease held by something that is no controller replica.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::{json, Value};

use crate::chart_support::{chart_dir, helm_ok};
use leasehold_testkit::{
    documents, free_port, http_client, http_get, kubectl, repo, wait_for, Proc,
};

/// The directory of prometheus and promtool, which scripts/test builds.
pub fn prometheus_bin() -> PathBuf {
    let Some(dir) = std::env::var_os("LEASEHOLD_PROMETHEUS_BIN") else {
        panic!(
            "LEASEHOLD_PROMETHEUS_BIN is not set: the monitoring tests need prometheus and \
             promtool, which scripts/test builds from the Go module proxy \
             (tests/tools/prometheus/build.sh); run `scripts/test --test monitoring`"
        )
    };
    let dir = PathBuf::from(dir);
    for tool in ["prometheus", "promtool"] {
        assert!(
            dir.join(tool).is_file(),
            "LEASEHOLD_PROMETHEUS_BIN={} has no {tool}: rebuild with tests/tools/prometheus/build.sh",
            dir.display()
        );
    }
    dir
}

/// The directory of the monitoring CRDs, which scripts/test fetches.
pub fn monitoring_crds() -> PathBuf {
    match std::env::var_os("LEASEHOLD_MONITORING_CRDS") {
        Some(dir) => PathBuf::from(dir),
        None => panic!(
            "LEASEHOLD_MONITORING_CRDS is not set: scripts/test fetches the Prometheus \
             Operator's and KEDA's CRDs from the Go module proxy \
             (tests/tools/monitoring-crds/fetch.sh); run `scripts/test --test monitoring`"
        ),
    }
}

/// A fresh scratch directory under the test target's tmpdir.
pub fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "monitoring-{name}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `helm template` of the chart as release `leasehold` in `namespace`, with `sets`.
pub fn render(namespace: &str, sets: &[&str]) -> Vec<Value> {
    let chart = chart_dir();
    let mut args = vec![
        "template",
        "leasehold",
        chart.to_str().unwrap(),
        "--namespace",
        namespace,
    ];
    for s in sets {
        args.extend_from_slice(&["--set", s]);
    }
    documents(&helm_ok(&args))
}

/// The rendered PrometheusRule's groups, as a Prometheus rule file.
pub fn rule_file(namespace: &str, sets: &[&str]) -> String {
    let mut all = vec!["metrics.prometheusRule.enabled=true"];
    all.extend_from_slice(sets);
    let docs = render(namespace, &all);
    let rule = docs
        .iter()
        .find(|d| d["kind"] == "PrometheusRule")
        .expect("a PrometheusRule rendered");
    serde_yaml::to_string(&json!({"groups": rule["spec"]["groups"]})).unwrap()
}

/// promtool with `args` in `dir`: success and the combined output.
pub fn promtool(dir: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(prometheus_bin().join("promtool"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool runs");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Runs `promtool test rules` of the committed unit tests against the rules rendered with
/// `sets` (release namespace leasehold-system, as the unit tests expect).
pub fn unit_test_rules(sets: &[&str]) -> (bool, String) {
    let dir = scratch("promtool");
    std::fs::write(dir.join("rules.yaml"), rule_file("leasehold-system", sets)).unwrap();
    std::fs::write(
        dir.join("alerts.test.yaml"),
        repo("tests/monitoring/alerts.test.yaml"),
    )
    .unwrap();
    let result = promtool(&dir, &["test", "rules", "alerts.test.yaml"]);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The alert names of a rule file.
pub fn alert_names(rules: &str) -> Vec<String> {
    let rules: Value = serde_yaml::from_str(rules).unwrap();
    rules["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
        .filter_map(|r| r["alert"].as_str().map(str::to_string))
        .collect()
}

/// Installs the fetched CRDs (server-side apply) and deletes them again on drop.
pub struct MonitoringCrds {
    files: Vec<PathBuf>,
}

impl MonitoringCrds {
    pub fn install() -> MonitoringCrds {
        let dir = monitoring_crds();
        let files: Vec<PathBuf> = [
            "monitoring.coreos.com_podmonitors.yaml",
            "monitoring.coreos.com_servicemonitors.yaml",
            "monitoring.coreos.com_prometheusrules.yaml",
            "keda.sh_scaledobjects.yaml",
        ]
        .iter()
        .map(|f| dir.join(f))
        .collect();
        for file in &files {
            let text =
                std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let (ok, out) = kubectl(&["apply", "--server-side", "-f", "-"], &text);
            assert!(ok, "applying {}: {out}", file.display());
        }
        for name in [
            "podmonitors.monitoring.coreos.com",
            "servicemonitors.monitoring.coreos.com",
            "prometheusrules.monitoring.coreos.com",
            "scaledobjects.keda.sh",
        ] {
            let (ok, out) = kubectl(
                &[
                    "wait",
                    "--for=condition=Established",
                    "--timeout=60s",
                    &format!("crd/{name}"),
                ],
                "",
            );
            assert!(ok, "{out}");
        }
        MonitoringCrds { files }
    }
}

impl Drop for MonitoringCrds {
    fn drop(&mut self) {
        for file in &self.files {
            let text = std::fs::read_to_string(file).unwrap_or_default();
            let _ = kubectl(&["delete", "--wait=false", "-f", "-"], &text);
        }
    }
}

/// A Prometheus process the test started, with its HTTP API on `port`; killed on drop.
pub struct Prometheus {
    proc: Proc,
    port: u16,
    dir: PathBuf,
    http: reqwest::Client,
}

impl Prometheus {
    /// Starts prometheus with `config` and `rules` written into a directory of its own, and
    /// waits until it is ready.
    pub async fn start(name: &str, config: &str, rules: &str) -> Prometheus {
        let dir = scratch(name);
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        std::fs::write(dir.join("rules.yaml"), rules).unwrap();
        let (ok, out) = promtool(&dir, &["check", "config", "prometheus.yml"]);
        assert!(ok, "promtool check config:\n{out}\n{config}");
        let port = free_port();
        let listen = format!("--web.listen-address=127.0.0.1:{port}");
        let config_file = format!("--config.file={}", dir.join("prometheus.yml").display());
        let data = format!("--storage.tsdb.path={}", dir.join("data").display());
        let proc = Proc::spawn(
            name,
            &prometheus_bin().join("prometheus"),
            &[
                &config_file,
                &data,
                &listen,
                "--storage.tsdb.retention.time=1h",
            ],
            Stdio::null(),
        );
        let prometheus = Prometheus {
            proc,
            port,
            dir,
            http: http_client(),
        };
        wait_for("prometheus ready", Duration::from_secs(60), || async {
            (http_get(port, "/-/ready").await?.0 == 200).then_some(())
        })
        .await;
        prometheus
    }

    /// GETs an API path; the `data` of a success.
    pub async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let r = self
            .http
            .get(format!("http://127.0.0.1:{}{path}", self.port))
            .query(query)
            .send()
            .await
            .expect("prometheus answers");
        let body: Value = r.json().await.expect("JSON");
        assert_eq!(body["status"], "success", "{path} {query:?}: {body}");
        body["data"].clone()
    }

    /// An instant query: its result vector as (labels, value) pairs.
    pub async fn query(&self, expr: &str) -> Vec<(Value, f64)> {
        let data = self.api("/api/v1/query", &[("query", expr)]).await;
        match data["resultType"].as_str() {
            Some("vector") => data["result"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| {
                    let v: f64 = s["value"][1].as_str().unwrap().parse().unwrap();
                    (s["metric"].clone(), v)
                })
                .collect(),
            Some("scalar") => {
                let v: f64 = data["result"][1].as_str().unwrap().parse().unwrap();
                vec![(json!({}), v)]
            }
            other => panic!("{expr}: result type {other:?}"),
        }
    }

    /// The alerts, pending or firing, as Prometheus evaluates them now.
    pub async fn alerts(&self) -> Vec<Value> {
        self.api("/api/v1/alerts", &[]).await["alerts"]
            .as_array()
            .unwrap()
            .clone()
    }

    /// The health of every scrape target, by scrape URL.
    pub async fn targets(&self) -> Vec<(String, String)> {
        self.api("/api/v1/targets", &[]).await["activeTargets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["scrapeUrl"].as_str().unwrap().to_string(),
                    t["health"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.proc.signal("KILL");
        let _ = self.proc.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Whether `alert` (labels and state, from the alerts API) is `name` in state `state` with
/// label `key` = `value`.
pub fn is_alert(alert: &Value, name: &str, state: &str, key: &str, value: &str) -> bool {
    alert["labels"]["alertname"] == name && alert["state"] == state && alert["labels"][key] == value
}

/// Creates a Lease `leasehold-controller` in `ns` held by a holder that is no leasehold
/// replica, and keeps renewing it until `stop` is set: the controllers of `ns` stay standbys,
/// as behind a leader that renews its Lease but cannot write.
pub async fn hold_leadership(
    client: &kube::Client,
    ns: &str,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let now = || leasehold_core::lease::micro_time(k8s_openapi::jiff::Timestamp::now());
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "leasehold-controller", "namespace": ns},
        "spec": {
            "holderIdentity": "1.0123456789abcdef0123456789abcdef",
            "leaseDurationSeconds": 15,
            "renewTime": now(),
            "acquireTime": now(),
            "leaseTransitions": 0
        }
    }))
    .unwrap();
    leases.create(&PostParams::default(), &lease).await.unwrap();
    tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let patch = json!({"spec": {"renewTime": now()}});
            let _ = leases
                .patch(
                    "leasehold-controller",
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await;
        }
    })
}
