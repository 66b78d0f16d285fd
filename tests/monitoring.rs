//! The chart's monitoring, with the real tools: its alert rules through `promtool check rules`
//! and `promtool test rules` (tests/monitoring/alerts.test.yaml, a case that fires and one
//! that does not for every alert, each proved able to fail); its PodMonitors, ServiceMonitor,
//! PrometheusRule, KEDA ScaledObject and PodDisruptionBudget through a server-side dry run
//! against the projects' own CRDs; and a real Prometheus scraping real controllers and
//! sidecars on the local control plane, which shows the queue depth, evaluates the KEDA
//! example's query and every dashboard query, and fires the stuck-job alerts for the stuck
//! jobs only.
//!
//! prometheus and promtool (v3.16.0, from the Go module proxy) are built by
//! tests/tools/prometheus/build.sh and the CRDs fetched by tests/tools/monitoring-crds/fetch.sh;
//! scripts/test does both and exports where they are.

mod chart_support;
mod monitoring_support;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chart_support::*;
use leasehold_testkit::*;
use monitoring_support::*;
use serde_json::{json, Value};

const ALERTS: [(&str, &str); 9] = [
    ("LeaseholdJobsPastLease", "jobsPastLease"),
    ("LeaseholdAttemptRunningLong", "attemptRunningLong"),
    ("LeaseholdHighExpiryRate", "highExpiryRate"),
    ("LeaseholdHighFailureRate", "highFailureRate"),
    ("LeaseholdNoLeader", "noLeader"),
    ("LeaseholdControllerNotReady", "controllerNotReady"),
    ("LeaseholdClaimConflicts", "claimConflicts"),
    ("LeaseholdQueuePausedLong", "queuePausedLong"),
    ("LeaseholdKeyStarved", "keyStarved"),
];

/// The chart's alert rules pass `promtool check rules` and their unit tests.
#[test]
fn alert_rules_pass_promtool() {
    require_control_plane!();
    let dir = scratch("check");
    let rules = rule_file("leasehold-system", &[]);
    std::fs::write(dir.join("rules.yaml"), &rules).unwrap();
    let (ok, out) = promtool(&dir, &["check", "rules", "rules.yaml"]);
    assert!(ok, "promtool check rules:\n{out}\n{rules}");
    assert!(out.contains("SUCCESS: 9 rules found"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
    // Every option set differently still renders rules promtool accepts.
    let dir = scratch("check-options");
    let rules = rule_file(
        "ops",
        &[
            "metrics.prometheusRule.controllerSelector=",
            "metrics.prometheusRule.additionalAlertLabels.team=batch",
            "metrics.prometheusRule.alerts.highExpiryRate.window=1h",
            "metrics.prometheusRule.alerts.noLeader.for=30s",
            "metrics.prometheusRule.alerts.claimConflicts.enabled=false",
        ],
    );
    std::fs::write(dir.join("rules.yaml"), &rules).unwrap();
    let (ok, out) = promtool(&dir, &["check", "rules", "rules.yaml"]);
    assert!(
        ok && out.contains("SUCCESS: 8 rules found"),
        "{out}\n{rules}"
    );
    assert!(
        rules.contains("team: batch") && !rules.contains("namespace=\"ops\""),
        "{rules}"
    );
    let _ = std::fs::remove_dir_all(&dir);

    let (ok, out) = unit_test_rules(&[]);
    assert!(
        ok,
        "promtool test rules tests/monitoring/alerts.test.yaml:\n{out}"
    );
}

/// Every alert unit test fails when the alert is gone or looser.
///
/// Each unit test can fail: without the alert its firing case fails, and with its threshold
/// (or `for`, or minimum count) loosened its silent cases fire.
#[test]
fn alert_tests_catch_looser_alerts() {
    require_control_plane!();
    let loosened: &[(&str, &[&str])] = &[
        (
            "LeaseholdJobsPastLease",
            &["jobsPastLease.overdueSeconds=1", "jobsPastLease.for=1m"],
        ),
        (
            "LeaseholdAttemptRunningLong",
            &[
                "attemptRunningLong.seconds=3600",
                "attemptRunningLong.for=1m",
            ],
        ),
        (
            "LeaseholdHighExpiryRate",
            &["highExpiryRate.ratio=0", "highExpiryRate.minExpired=1"],
        ),
        (
            "LeaseholdHighFailureRate",
            &["highFailureRate.ratio=0", "highFailureRate.minFailed=1"],
        ),
        ("LeaseholdNoLeader", &["noLeader.for=10s"]),
        (
            "LeaseholdControllerNotReady",
            &["controllerNotReady.for=1m"],
        ),
        (
            "LeaseholdClaimConflicts",
            &["claimConflicts.ratio=0", "claimConflicts.minConflicts=1"],
        ),
        (
            "LeaseholdQueuePausedLong",
            &["queuePausedLong.seconds=1800", "queuePausedLong.for=1m"],
        ),
        (
            "LeaseholdKeyStarved",
            &["keyStarved.seconds=1800", "keyStarved.for=1m"],
        ),
    ];
    for (alert, key) in ALERTS {
        let off = format!("metrics.prometheusRule.alerts.{key}.enabled=false");
        let (ok, out) = unit_test_rules(&[&off]);
        assert!(
            !ok && out.contains(&format!("alertname: {alert}")),
            "the unit tests pass without {alert}:\n{out}"
        );
        let changes = loosened.iter().find(|(a, _)| *a == alert).unwrap().1;
        for change in changes {
            let set = format!("metrics.prometheusRule.alerts.{change}");
            let (ok, out) = unit_test_rules(&[&set]);
            assert!(
                !ok && out.contains(&format!("alertname: {alert}")),
                "the unit tests pass with {set}:\n{out}"
            );
        }
    }
}

/// Every alert has a runbook section and unit tests that fire and stay silent.
#[test]
fn every_alert_has_runbook_and_tests() {
    require_control_plane!();
    let rules = rule_file("leasehold-system", &[]);
    let names = alert_names(&rules);
    let expected: Vec<String> = ALERTS.iter().map(|(a, _)| a.to_string()).collect();
    assert_eq!(names, expected);
    let runbook = repo("docs/alerts.md");
    let headings: BTreeSet<String> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .map(|h| h.trim().to_string())
        .collect();
    let tests: Value = serde_yaml::from_str(&repo("tests/monitoring/alerts.test.yaml")).unwrap();
    let cases: Vec<&Value> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["alert_rule_test"].as_array().unwrap().iter())
        .collect();
    let parsed: Value = serde_yaml::from_str(&rules).unwrap();
    for rule in parsed["groups"][0]["rules"].as_array().unwrap() {
        let alert = rule["alert"].as_str().unwrap();
        // The runbook: a section named after the alert, which runbook_url points at, saying
        // what it means, how to confirm it and what to do.
        assert!(
            headings.contains(alert),
            "docs/alerts.md has no section ### {alert}"
        );
        let url = rule["annotations"]["runbook_url"].as_str().unwrap();
        assert_eq!(url, format!("docs/alerts.md#{}", alert.to_lowercase()));
        let section: String = runbook
            .split("\n### ")
            .find(|s| s.starts_with(alert))
            .unwrap()
            .to_string();
        for part in ["**Means.**", "**Confirm.**", "**Do.**"] {
            assert!(
                section.contains(part),
                "the runbook of {alert} lacks {part}"
            );
        }
        for key in ["summary", "description"] {
            assert!(rule["annotations"][key].is_string(), "{alert} has no {key}");
        }
        assert!(rule["labels"]["severity"].is_string(), "{alert}");
        // The unit tests: a case where it fires and one where it does not.
        let of_alert: Vec<&&Value> = cases.iter().filter(|c| c["alertname"] == alert).collect();
        let fires = of_alert
            .iter()
            .any(|c| !c["exp_alerts"].as_array().unwrap().is_empty());
        let silent = of_alert
            .iter()
            .any(|c| c["exp_alerts"].as_array().unwrap().is_empty());
        assert!(
            fires && silent,
            "{alert}: firing case {fires}, silent case {silent}"
        );
    }
}

/// The dashboard ConfigMap carries the dashboard file and every panel has a query.
#[test]
fn dashboard_configmap_is_complete() {
    require_control_plane!();
    let file = repo("charts/leasehold/dashboards/leasehold.json");
    let dashboard: Value = serde_json::from_str(&file).expect("dashboard JSON");
    assert_eq!(dashboard["uid"], "leasehold");
    let docs = render(
        "mon",
        &[
            "metrics.grafanaDashboard.enabled=true",
            "metrics.grafanaDashboard.namespace=grafana",
        ],
    );
    let cm = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "leasehold-dashboard")
        .expect("the dashboard's ConfigMap");
    assert_eq!(cm["metadata"]["namespace"], "grafana");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let carried: Value =
        serde_json::from_str(cm["data"]["leasehold.json"].as_str().unwrap()).unwrap();
    assert_eq!(carried, dashboard);
    let panels = dashboard["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    for panel in panels {
        assert!(
            ids.insert(panel["id"].as_i64().unwrap()),
            "duplicate panel id: {panel}"
        );
        if panel["type"] == "row" {
            continue;
        }
        let title = panel["title"].as_str().unwrap();
        assert!(
            !panel["description"].as_str().unwrap_or_default().is_empty(),
            "{title}: no description"
        );
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no query");
    }
    // Off by default, like every monitoring object but the PodDisruptionBudget.
    let kinds: Vec<String> = render("mon", &[])
        .iter()
        .map(|d| d["kind"].as_str().unwrap().to_string())
        .collect();
    for kind in [
        "PodMonitor",
        "ServiceMonitor",
        "PrometheusRule",
        "ScaledObject",
    ] {
        assert!(
            !kinds.contains(&kind.to_string()),
            "{kind} rendered by default"
        );
    }
    assert!(kinds.contains(&"PodDisruptionBudget".to_string()));
    assert!(!render("mon", &[])
        .iter()
        .any(|d| d["metadata"]["name"] == "leasehold-dashboard"));
}

/// The monitors refuse settings under which they would scrape nothing.
#[test]
fn monitors_refuse_empty_scrapes() {
    require_control_plane!();
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();
    let (ok, out) = helm(&[
        "template",
        "r",
        chart,
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.service.enabled=false",
    ]);
    assert!(
        !ok && out.contains("metrics.serviceMonitor scrapes the metrics Service"),
        "{out}"
    );
    let (ok, out) = helm(&[
        "template",
        "r",
        chart,
        "--set",
        "metrics.workerPodMonitor.enabled=true",
    ]);
    assert!(
        !ok && out.contains("workers.namespaces, which is empty"),
        "{out}"
    );
}

/// The monitoring objects pass a server-side dry run against their CRDs.
#[tokio::test]
async fn monitoring_objects_pass_a_dry_run() {
    let Fixture {
        client,
        ns: release_ns,
    } = fixture!("mon-dry");
    let workers = TestNamespace::new(&client, "mon-dry-w").await;
    let _crds = MonitoringCrds::install();
    let chart = chart_dir();
    let workers_set = format!("workers.namespaces={{{}}}", workers.name);
    let rendered = helm_ok(&[
        "template",
        "mon",
        chart.to_str().unwrap(),
        "--namespace",
        &release_ns.name,
        "--set",
        &workers_set,
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.serviceMonitor.labels.release=prometheus",
        "--set",
        "metrics.podMonitor.enabled=true",
        "--set",
        "metrics.workerPodMonitor.enabled=true",
        "--set",
        "metrics.workerPodMonitor.podSelector.matchLabels.app=worker",
        "--set",
        "metrics.prometheusRule.enabled=true",
        "--set",
        "metrics.prometheusRule.additionalAlertLabels.team=batch",
        "--set",
        "metrics.grafanaDashboard.enabled=true",
        "--set",
        "exampleWorker.enabled=true",
        "--set",
        "exampleWorker.keda.enabled=true",
        // No controller pod answers here: keep every test's LeasedJob writes off the webhook,
        // and write the example worker's sidecar out (injection needs the webhook).
        "--set",
        "admissionWebhook.enabled=false",
        "--set",
        "sidecar.injection.enabled=false",
    ]);
    let docs = documents(&rendered);
    let wanted = [
        ("ServiceMonitor", "mon-leasehold-controller"),
        ("PodMonitor", "mon-leasehold-controller"),
        ("PodMonitor", "mon-leasehold-sidecars"),
        ("PrometheusRule", "mon-leasehold"),
        ("ScaledObject", "mon-leasehold-example-worker"),
        ("PodDisruptionBudget", "mon-leasehold-controller"),
        ("ConfigMap", "mon-leasehold-dashboard"),
    ];
    for (kind, name) in wanted {
        assert!(
            docs.iter()
                .any(|d| d["kind"] == kind && d["metadata"]["name"] == name),
            "no {kind} {name} rendered"
        );
    }
    let (ok, out) = kubectl(
        &["apply", "--dry-run=server", "--validate=strict", "-f", "-"],
        &rendered,
    );
    assert!(ok, "server-side dry run refused the chart:\n{out}");
    for (kind, name) in wanted {
        let (lower, created) = (
            kind.to_lowercase(),
            format!("/{name} created (server dry run)"),
        );
        assert!(
            out.lines()
                .any(|l| l.starts_with(&lower) && l.ends_with(&created)),
            "{kind} {name} missing from the dry run:\n{out}"
        );
    }
    // The API server validates against the schemas: a field the CRD does not know is refused
    // (strict field validation), so the dry run above proves every field the chart sets.
    let mut bad = docs
        .iter()
        .find(|d| d["kind"] == "PodMonitor")
        .unwrap()
        .clone();
    bad["spec"]["podMetricsEndpoints"][0]["portName"] = json!("metrics");
    let (ok, out) = kubectl(
        &["apply", "--dry-run=server", "--validate=strict", "-f", "-"],
        &serde_json::to_string(&bad).unwrap(),
    );
    assert!(
        !ok && out.contains("portName"),
        "an unknown field passed:\n{out}"
    );

    // The PodDisruptionBudget selects exactly the controller pods.
    let pdb = docs
        .iter()
        .find(|d| d["kind"] == "PodDisruptionBudget")
        .unwrap();
    let deployment = docs
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "mon-leasehold-controller")
        .unwrap();
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    assert_eq!(pdb["spec"]["unhealthyPodEvictionPolicy"], "AlwaysAllow");
    // The monitors find the pods: the controller's by its labels and named port, the sidecars'
    // by the container name and port the example worker's sidecar has.
    let pod = &deployment["spec"]["template"];
    for monitor in docs
        .iter()
        .filter(|d| d["kind"] == "PodMonitor" || d["kind"] == "ServiceMonitor")
    {
        if monitor["metadata"]["name"] == "mon-leasehold-sidecars" {
            continue;
        }
        for (k, v) in monitor["spec"]["selector"]["matchLabels"]
            .as_object()
            .unwrap()
        {
            assert_eq!(&pod["metadata"]["labels"][k], v, "{monitor}");
        }
    }
    assert!(pod["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["name"] == "metrics"));
    let sidecars = docs
        .iter()
        .find(|d| d["metadata"]["name"] == "mon-leasehold-sidecars")
        .unwrap();
    assert_eq!(
        sidecars["spec"]["namespaceSelector"]["matchNames"],
        json!([workers.name])
    );
    let endpoint = &sidecars["spec"]["podMetricsEndpoints"][0];
    let worker = docs
        .iter()
        .find(|d| {
            d["kind"] == "Deployment" && d["metadata"]["name"] == "mon-leasehold-example-worker"
        })
        .unwrap();
    let sidecar = &worker["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(endpoint["relabelings"][0]["regex"], sidecar["name"]);
    assert!(sidecar["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["name"] == endpoint["port"]));
    // KEDA scales the example worker: its replicas are KEDA's, not the chart's.
    let scaled = docs.iter().find(|d| d["kind"] == "ScaledObject").unwrap();
    assert_eq!(
        scaled["spec"]["scaleTargetRef"]["name"],
        worker["metadata"]["name"]
    );
    assert_eq!(
        scaled["metadata"]["namespace"],
        worker["metadata"]["namespace"]
    );
    assert!(worker["spec"]["replicas"].is_null(), "{worker}");
}

/// A real Prometheus shows the queue depth and fires the stuck-job alerts for stuck jobs only.
#[tokio::test]
async fn prometheus_sees_depth_and_stuck_jobs() {
    // Two installations: a healthy one (two controller replicas, workers), and one whose
    // controller never leads, behind a leader Lease held by something else.
    let Fixture { client, ns } = fixture!("prom");
    let wedged = TestNamespace::new(&client, "prom-wedged").await;
    let stop = Arc::new(AtomicBool::new(false));
    let holder = hold_leadership(&client, &wedged.name, Arc::clone(&stop)).await;
    let ctl_a = controller_with(&ns.name, "ctl-a", &[]);
    let ctl_b = controller_with(&ns.name, "ctl-b", &[]);
    let ctl_w = controller_with(&wedged.name, "ctl-w", &[]);
    let controller_ports = [ctl_a.port.unwrap(), ctl_b.port.unwrap()];
    for port in controller_ports.iter().chain([&ctl_w.port.unwrap()]) {
        wait_for("controller ready", Duration::from_secs(30), || async {
            (http_get(*port, "/readyz").await?.0 == 200).then_some(())
        })
        .await;
    }
    wait_for(
        "one of ctl-a and ctl-b leads",
        Duration::from_secs(30),
        || async {
            let mut leaders = 0.0;
            for port in controller_ports {
                leaders += sample(&http_get(port, "/metrics").await?.1, "leasehold_leader")?;
            }
            (leaders == 1.0).then_some(())
        },
    )
    .await;
    let work = Sidecar::start(&ns.name, "work", "worker-work", &[]).await;
    let stuck = Sidecar::start(&ns.name, "stuck", "worker-stuck", &[]).await;
    let orphan = Sidecar::start(&wedged.name, "orphan", "worker-orphan", &[]).await;

    // The rules as the chart renders them, with thresholds of seconds: a stuck attempt is one
    // running for more than 8 s; a job 2 s past its lease is overdue. The controllers of both
    // installations are this scrape job's, told apart by the namespace label.
    let rules = rule_file(
        &ns.name,
        &[
            "metrics.prometheusRule.controllerSelector=job=\"leasehold-controller\"",
            "metrics.prometheusRule.alerts.attemptRunningLong.seconds=8",
            "metrics.prometheusRule.alerts.attemptRunningLong.for=1s",
            "metrics.prometheusRule.alerts.jobsPastLease.overdueSeconds=2",
            "metrics.prometheusRule.alerts.jobsPastLease.for=1s",
            "metrics.prometheusRule.alerts.noLeader.for=3s",
            "metrics.prometheusRule.alerts.controllerNotReady.for=3s",
        ],
    );
    let target = |p: u16| format!("127.0.0.1:{p}");
    let config = serde_yaml::to_string(&json!({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            {
                "job_name": "leasehold-controller",
                "static_configs": [
                    {"targets": controller_ports.map(target), "labels": {"namespace": ns.name}},
                    {"targets": [target(ctl_w.port.unwrap())], "labels": {"namespace": wedged.name}},
                ]
            },
            {
                "job_name": "leasehold-sidecar",
                "static_configs": [
                    {"targets": [target(work.proc.port.unwrap()), target(stuck.proc.port.unwrap())], "labels": {"namespace": ns.name}},
                    {"targets": [target(orphan.proc.port.unwrap())], "labels": {"namespace": wedged.name}},
                ]
            }
        ]
    }))
    .unwrap();
    let prometheus = Prometheus::start(&format!("{}-prometheus", ns.name), &config, &rules).await;
    wait_for("every target scraped", Duration::from_secs(30), || async {
        let targets = prometheus.targets().await;
        (targets.len() == 6 && targets.iter().all(|(_, h)| h == "up")).then_some(())
    })
    .await;

    // A backlog nobody serves: the queue depth.
    for i in 0..3 {
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": format!("backlog-{i}")}, "spec": {"queue": "backlog"}}),
        )
        .await;
    }
    // A stuck job: its worker holds it and heartbeats forever.
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "stuck-1"}, "spec": {"queue": "stuck", "leaseDurationSeconds": 5}}),
    )
    .await;
    let (s, claim) = stuck.claim(10).await;
    assert_eq!(s, 200, "{claim}");
    let token = claim["token"].as_str().unwrap().to_string();
    let stuck = Arc::new(stuck);
    let heartbeats = {
        let (stuck, stop) = (Arc::clone(&stuck), Arc::clone(&stop));
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let (s, r) = stuck.heartbeat("stuck-1", json!({"token": token})).await;
                assert_eq!(s, 200, "{r}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    // Healthy work: jobs claimed, heartbeated and completed within about a second, one after
    // another, all along.
    let completed = Arc::new(AtomicU32::new(0));
    let work = Arc::new(work);
    let worker = {
        let (work, stop, completed, client, ns) = (
            Arc::clone(&work),
            Arc::clone(&stop),
            Arc::clone(&completed),
            client.clone(),
            ns.name.clone(),
        );
        tokio::spawn(async move {
            for i in 0.. {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let name = format!("work-{i}");
                create_job(
                    &client,
                    &ns,
                    json!({"metadata": {"name": name}, "spec": {"queue": "work", "leaseDurationSeconds": 5}}),
                )
                .await;
                let (s, c) = work.claim(10).await;
                assert_eq!(s, 200, "{c}");
                let token = c["token"].as_str().unwrap().to_string();
                tokio::time::sleep(Duration::from_millis(500)).await;
                let (s, r) = work.heartbeat(&name, json!({"token": token})).await;
                assert_eq!(s, 200, "{r}");
                tokio::time::sleep(Duration::from_millis(500)).await;
                let (s, r) = work.complete(&name, &token, json!({"i": i})).await;
                assert_eq!(s, 200, "{r}");
                completed.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    // A job whose worker dies in the installation whose controller cannot take it back.
    create_job(
        &client,
        &wedged.name,
        json!({"metadata": {"name": "orphan-1"}, "spec": {"queue": "orphan", "leaseDurationSeconds": 5}}),
    )
    .await;
    let (s, claim) = orphan.claim(10).await;
    assert_eq!(s, 200, "{claim}");
    orphan.proc.signal("KILL");

    // The queue depth, from each of the two replicas, and the KEDA example's query on it:
    // once per queue, not once per replica.
    wait_for(
        "the backlog's queue depth in Prometheus",
        Duration::from_secs(30),
        || async {
            let depth = prometheus
                .query(&format!(
                    "leasehold_jobs{{namespace=\"{}\",queue=\"backlog\",phase=\"Queued\"}}",
                    ns.name
                ))
                .await;
            (depth.len() == 2 && depth.iter().all(|(_, v)| *v == 3.0)).then_some(())
        },
    )
    .await;
    for (queue, want) in [("backlog", 3.0), ("stuck", 1.0)] {
        let set = format!("exampleWorker.queue={queue}");
        let docs = render(
            &ns.name,
            &[
                "workers.namespaces={jobs}",
                "exampleWorker.enabled=true",
                "exampleWorker.keda.enabled=true",
                &set,
            ],
        );
        let scaled = docs.iter().find(|d| d["kind"] == "ScaledObject").unwrap();
        let query = scaled["spec"]["triggers"][0]["metadata"]["query"]
            .as_str()
            .unwrap();
        let got = prometheus.query(query).await;
        assert_eq!(got.len(), 1, "{query}: {got:?}");
        assert_eq!(got[0].1, want, "{query}");
    }

    // The stuck jobs' alerts fire: the attempt running for too long, the job past its lease
    // that nobody takes back, and the installation without a leader.
    let firing = wait_for(
        "the stuck-job alerts firing",
        Duration::from_secs(60),
        || async {
            let alerts = prometheus.alerts().await;
            let all = [
                ("LeaseholdAttemptRunningLong", "queue", "stuck"),
                ("LeaseholdJobsPastLease", "queue", "orphan"),
                ("LeaseholdNoLeader", "namespace", wedged.name.as_str()),
            ]
            .iter()
            .all(|(name, k, v)| alerts.iter().any(|a| is_alert(a, name, "firing", k, v)));
            all.then_some(alerts)
        },
    )
    .await;
    // And nothing else, pending or firing: not for the healthy queue (whose attempts are
    // Leased a second at a time), the backlog, or the healthy installation.
    for alert in &firing {
        let labels = &alert["labels"];
        // The orphaned job's attempt runs on too: it is as stuck as the other.
        let expected = [
            ("LeaseholdAttemptRunningLong", "stuck"),
            ("LeaseholdAttemptRunningLong", "orphan"),
            ("LeaseholdJobsPastLease", "orphan"),
        ]
        .iter()
        .any(|(name, queue)| labels["alertname"] == *name && labels["queue"] == *queue)
            || (labels["alertname"] == "LeaseholdNoLeader"
                && labels["namespace"] == wedged.name.as_str());
        assert!(expected, "unexpected alert: {alert}\nall: {firing:#?}");
    }
    let stuck_alert = firing
        .iter()
        .find(|a| is_alert(a, "LeaseholdAttemptRunningLong", "firing", "queue", "stuck"))
        .unwrap();
    assert_eq!(
        stuck_alert["annotations"]["runbook_url"],
        "docs/alerts.md#leaseholdattemptrunninglong"
    );
    assert!(
        completed.load(Ordering::SeqCst) >= 3,
        "the healthy queue completed only {} jobs meanwhile",
        completed.load(Ordering::SeqCst)
    );
    let overdue = prometheus
        .query(&format!(
            "leasehold_lease_overdue_seconds{{namespace=\"{}\",queue=\"orphan\"}}",
            wedged.name
        ))
        .await;
    assert!(overdue.len() == 1 && overdue[0].1 > 2.0, "{overdue:?}");

    // Every dashboard query is one Prometheus accepts, and the panels about what happened here
    // show it.
    let dashboard: Value =
        serde_json::from_str(&repo("charts/leasehold/dashboards/leasehold.json")).unwrap();
    let mut empty = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$namespace", &ns.name)
                .replace("$worker_namespace", &ns.name)
                .replace("$queue", ".*")
                .replace("$__rate_interval", "1m");
            if prometheus.query(&expr).await.is_empty() {
                empty.push(panel["title"].as_str().unwrap().to_string());
            }
        }
    }
    for title in [
        "Leading replicas",
        "Queued jobs",
        "Jobs by phase",
        "Queue depth (Queued)",
        "Oldest running attempt",
        "Attempts ended by outcome",
        "Claims and conflicts",
        "Heartbeats",
    ] {
        assert!(
            !empty.contains(&title.to_string()),
            "the panel {title:?} shows nothing"
        );
    }

    // Every completed attempt of the healthy queue was counted once, as seen by either replica.
    stop.store(true, Ordering::SeqCst);
    worker.await.unwrap();
    heartbeats.await.unwrap();
    holder.await.unwrap();
    let done = f64::from(completed.load(Ordering::SeqCst));
    let query = format!(
        "max(leasehold_attempts_ended_total{{namespace=\"{}\",queue=\"work\",outcome=\"succeeded\"}})",
        ns.name
    );
    wait_for(
        "every completion counted",
        Duration::from_secs(15),
        || async {
            let got = prometheus.query(&query).await;
            (got.len() == 1 && got[0].1 == done).then_some(())
        },
    )
    .await;
    drop(prometheus);
}
