//! The Helm chart on a real node: the kubelet, containerd and runc of `tests/node` run the
//! chart's pods from the image `scripts/image` built, as users deploy it. Two controller
//! replicas (one leads), the example worker Deployment with its native sidecar, in-cluster
//! credentials (the kubelet's projected tokens) reaching the API server through the
//! `kubernetes` Service, the admission webhook served by the controller pods.
//!
//! Every test here is `#[ignore]`d in a plain `cargo test`: `scripts/test` starts the node
//! (root needed) after the other tests and then runs this binary with `--include-ignored`.
//! Without the node they fail; `scripts/test` skips them, saying why, only on a host that
//! cannot run a node (not root).

mod chart_support;
mod node_support;

use std::time::{Duration, Instant};

use chart_support::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::ListParams;
use kube::Api;
use leasehold_core::crd::Phase;
use leasehold_testkit::*;
use node_support::*;
use serde_json::{json, Value};

/// One test at a time: they share the node (two cores) and the one CRD.
static NODE_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The chart runs two controllers, one leading, and workers finish the example jobs.
#[tokio::test]
#[ignore = "needs the test node: run by `scripts/test --test node` (root)"]
async fn chart_runs_on_a_node() {
    let _lock = NODE_LOCK.lock().await;
    let inst = Install::new("node-demo", 2, &[]).await;

    // Both replicas Ready; exactly one of them holds the leader Lease.
    let controllers: Vec<String> = inst
        .pods(&inst.release.namespace, "controller")
        .await
        .into_iter()
        .map(|p| p.metadata.name.unwrap())
        .collect();
    assert_eq!(controllers.len(), 2, "{controllers:?}");
    let leader = wait_for("a leader", Duration::from_secs(30), || inst.leader()).await;
    assert!(
        controllers.contains(&leader),
        "leader {leader} is none of {controllers:?}"
    );

    // The pods run the image's binary as 65532 with the chart's read-only root filesystem:
    // what the kubelet reports for each container.
    // The example worker's Deployment has no sidecar of its own, only the annotation
    // leasehold.dev/queue: the controllers' webhook injected each pod's.
    let deployments: Api<Deployment> = Api::namespaced(inst.client.clone(), &inst.workers.name);
    let template = deployments
        .get(&inst.worker_deployment())
        .await
        .unwrap()
        .spec
        .template;
    assert!(
        template.spec.unwrap().init_containers.is_none(),
        "the example worker writes its sidecar out"
    );
    let annotations = template.metadata.unwrap().annotations.unwrap_or_default();
    assert_eq!(
        annotations.get("leasehold.dev/queue").map(String::as_str),
        Some("demo")
    );
    let workers = inst.pods(&inst.workers.name, "example-worker").await;
    for p in &workers {
        let injected = p
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(leasehold::inject::INJECTED_ANNOTATION));
        assert_eq!(
            injected.map(String::as_str),
            Some(env!("CARGO_PKG_VERSION")),
            "{:?}",
            p.metadata.name
        );
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("leasehold-worker")
        );
        let sidecar = &spec.init_containers.as_ref().unwrap()[0];
        assert_eq!(sidecar.name, leasehold::inject::SIDECAR_NAME);
        assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
        let st = p.status.as_ref().unwrap();
        let sc = &st.init_container_statuses.as_ref().unwrap()[0];
        assert!(
            sc.started == Some(true) && sc.ready,
            "sidecar of {:?}: {sc:?}",
            p.metadata.name
        );
    }

    // The example jobs, applied as the docs say.
    let (ok, out) = kubectl(
        &[
            "apply",
            "-n",
            &inst.workers.name,
            "-f",
            repo_path("examples/jobs").to_str().unwrap(),
        ],
        "",
    );
    assert!(ok, "{out}");
    let names = [
        "wordcount-gpl3",
        "sha256-apache",
        "gzip-lgpl",
        "wordcount-mpl2-urgent",
        "sha256-gfdl-slow",
    ];
    let done = inst.wait_succeeded(&names, Duration::from_secs(240)).await;
    let worker_names: Vec<String> = workers
        .iter()
        .map(|p| p.metadata.name.clone().unwrap())
        .collect();
    for j in &done {
        let s = j.status.as_ref().unwrap();
        let holder = s.holder.clone().unwrap_or_default();
        assert!(
            worker_names.contains(&holder),
            "{:?} was finished by {holder}, not a worker pod {worker_names:?}",
            j.metadata.name
        );
        assert!(s.result.is_some(), "{:?} has no result", j.metadata.name);
    }
    // A real result, checked against the file the worker read in its container (the same
    // Debian license text as on this host).
    let wc = done
        .iter()
        .find(|j| j.metadata.name.as_deref() == Some("wordcount-gpl3"))
        .unwrap();
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3").unwrap();
    let words = text.split_ascii_whitespace().count() as u64;
    let result = wc.status.as_ref().unwrap().result.clone().unwrap();
    assert_eq!(result["words"].as_u64(), Some(words), "{result}");

    // `kubectl logs` reaches the kubelet: the sidecar logged the claims, Kubernetes style.
    let (mut claims, mut offered) = (0, 0);
    for w in &worker_names {
        let (ok, log) = kubectl(
            &[
                "logs",
                "-n",
                &inst.workers.name,
                w,
                "-c",
                "leasehold-sidecar",
            ],
            "",
        );
        assert!(ok, "kubectl logs {w}: {log}");
        claims += log.matches("Claimed LeasedJob").count();
        offered += log.matches("offered by the dispatcher").count();
    }
    assert!(
        claims >= names.len(),
        "{claims} claims logged by the sidecars"
    );
    // The sidecars found the leading controller's dispatcher (its advert Lease, the projected
    // token for its audience, pod to pod on the node) and claimed what it offered.
    assert!(
        offered > 0,
        "no claim was offered by the dispatcher ({claims} claims logged)"
    );

    // `helm test`: a pod whose sidecar is injected runs one job through the installation
    // (`leasehold smoke-test` exits 0 only when every step passed; the pod is deleted then).
    let out = helm_ok(&[
        "test",
        &inst.release.name,
        "--namespace",
        &inst.release.namespace,
        "--timeout",
        "3m",
    ]);
    let suite = format!("TEST SUITE:     {}-smoke-test", inst.release.fullname());
    let pod_phase = out
        .split(&suite)
        .filter_map(|section| section.lines().find(|l| l.starts_with("Phase:")))
        .last();
    assert_eq!(
        pod_phase
            .map(str::split_whitespace)
            .and_then(|mut w| w.nth(1)),
        Some("Succeeded"),
        "{out}"
    );

    // The controller pods' size webhook answers the API server: an oversized job is refused
    // with its 413 before anything is stored.
    let big = "x".repeat(1_100_000);
    let (ok, out) = kubectl(
        &["create", "-n", &inst.workers.name, "-f", "-"],
        &serde_json::to_string(&json!({"apiVersion": "leasehold.dev/v1alpha1",
            "kind": "LeasedJob", "metadata": {"name": "too-big"},
            "spec": {"queue": "elsewhere", "payload": {"blob": big}}}))
        .unwrap(),
    );
    assert!(
        !ok && out.contains("over leasehold's limit"),
        "the webhook did not refuse an oversized job: {out}"
    );
}

/// A force-deleted worker pod's job is requeued and finished by another pod.
#[tokio::test]
#[ignore = "needs the test node: run by `scripts/test --test node` (root)"]
async fn force_deleted_pods_job_is_requeued() {
    let _lock = NODE_LOCK.lock().await;
    let inst = Install::new("node-force", 2, &[]).await;
    inst.slow_job("slow", 0.5).await;
    let holder = inst.wait_in_progress("slow").await;
    let (ok, out) = kubectl(
        &[
            "delete",
            "pod",
            &holder,
            "-n",
            &inst.workers.name,
            "--grace-period=0",
            "--force",
        ],
        "",
    );
    assert!(ok, "{out}");
    let done = inst
        .wait_succeeded(&["slow"], Duration::from_secs(180))
        .await;
    let s = done[0].status.clone().unwrap();
    let finisher = s.holder.unwrap();
    assert_ne!(finisher, holder, "the deleted pod finished the job");
    assert!(
        s.attempt >= 2,
        "the job was not claimed again: attempt {}",
        s.attempt
    );
}

/// A deleted worker pod drains worker first, then sidecar, within its grace period.
#[tokio::test]
#[ignore = "needs the test node: run by `scripts/test --test node` (root)"]
async fn deleted_pod_drains_in_order() {
    let _lock = NODE_LOCK.lock().await;
    let inst = Install::new("node-drain", 2, &[]).await;
    inst.slow_job("slow", 0.5).await;
    let holder = inst.wait_in_progress("slow").await;
    let pods: Api<Pod> = Api::namespaced(inst.client.clone(), &inst.workers.name);
    let grace = pods
        .get(&holder)
        .await
        .unwrap()
        .spec
        .unwrap()
        .termination_grace_period_seconds
        .unwrap();
    // Follow both containers' logs (with the kubelet's timestamps) through the pod's end.
    let worker_log = LogFollower::start(&inst.workers.name, &holder, "worker");
    let sidecar_log = LogFollower::start(&inst.workers.name, &holder, "leasehold-sidecar");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = Instant::now();
    let (ok, out) = kubectl(
        &[
            "delete",
            "pod",
            &holder,
            "-n",
            &inst.workers.name,
            "--wait=false",
        ],
        "",
    );
    assert!(ok, "{out}");
    // Watch the pod go: when each container terminated, as the kubelet reports it.
    let (mut worker_done, mut sidecar_done) = (None, None);
    let mut sidecar_running_after_worker = false;
    loop {
        let Some(p) = pods.get_opt(&holder).await.unwrap() else {
            break;
        };
        let st = p.status.unwrap_or_default();
        let finished = |s: &k8s_openapi::api::core::v1::ContainerStatus| {
            s.state
                .as_ref()
                .and_then(|st| st.terminated.as_ref())
                .map(|t| t.finished_at.clone())
        };
        if let Some(w) = st
            .container_statuses
            .iter()
            .flatten()
            .find(|c| c.name == "worker")
        {
            if let Some(t) = finished(w) {
                worker_done = t.or(worker_done);
            }
        }
        if let Some(s) = st.init_container_statuses.iter().flatten().next() {
            match finished(s) {
                Some(t) => sidecar_done = t.or(sidecar_done),
                None if worker_done.is_some() => sidecar_running_after_worker = true,
                None => {}
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(grace as u64 + 10),
            "pod {holder} still exists {:?} after its deletion (grace {grace}s)",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(grace as u64),
        "the pod took {took:?} to go, over its terminationGracePeriodSeconds {grace}"
    );
    eprintln!(
        "pod {holder} gone after {took:?}: worker finished at {worker_done:?}, sidecar at \
         {sidecar_done:?}, sidecar seen running after the worker: {sidecar_running_after_worker}"
    );
    let worker_done = worker_done.expect("the kubelet reported the worker container terminated");
    if let Some(sidecar_done) = sidecar_done {
        assert!(
            sidecar_done.0 >= worker_done.0,
            "the sidecar ({}) stopped before the worker ({})",
            sidecar_done.0,
            worker_done.0
        );
    } else {
        assert!(
            sidecar_running_after_worker,
            "the sidecar's stop was never seen, nor the sidecar running after the worker"
        );
    }
    // The documented order, from the containers' own logs: the worker released its job (at a
    // chunk boundary, keeping its checkpoint) and exited; only then was the sidecar told to
    // stop, and it found nothing held.
    let worker_lines = worker_log.finish();
    let sidecar_lines = sidecar_log.finish();
    let (released_at, _) = worker_lines
        .iter()
        .find(|(_, l)| l.contains(r#""event": "release""#) || l.contains(r#""event":"release""#))
        .unwrap_or_else(|| panic!("the worker never released its job:\n{worker_lines:#?}"));
    let (worker_last, _) = worker_lines.last().unwrap();
    let (draining_at, draining) = sidecar_lines
        .iter()
        .find(|(_, l)| l.contains("Draining leasehold sidecar"))
        .unwrap_or_else(|| panic!("the sidecar never drained:\n{sidecar_lines:#?}"));
    assert!(
        draining_at >= worker_last && draining_at >= released_at,
        "the sidecar began draining at {draining_at}, before the worker's last line at \
         {worker_last} (release at {released_at})"
    );
    assert!(
        draining.contains("held=0") || draining.contains(r#""held":0"#),
        "the sidecar still held jobs when told to stop: {draining}"
    );
    assert!(
        sidecar_lines
            .iter()
            .any(|(_, l)| l.contains("Stopped leasehold sidecar")),
        "{sidecar_lines:#?}"
    );

    // Nothing lost: the worker released the job at a chunk boundary (its checkpoint kept) or
    // finished it, and it ends Succeeded.
    let done = inst
        .wait_succeeded(&["slow"], Duration::from_secs(180))
        .await;
    let s = done[0].status.clone().unwrap();
    if s.holder.as_deref() != Some(holder.as_str()) {
        assert!(s.attempt >= 2, "{s:?}");
    }
}

/// Deleting the leading controller pod hands the lead to another replica within seconds.
#[tokio::test]
#[ignore = "needs the test node: run by `scripts/test --test node` (root)"]
async fn leading_controller_pod_deleted() {
    let _lock = NODE_LOCK.lock().await;
    let inst = Install::new("node-leader", 1, &[]).await;
    let leader = wait_for("a leader", Duration::from_secs(30), || inst.leader()).await;
    let others: Vec<String> = inst
        .pods(&inst.release.namespace, "controller")
        .await
        .into_iter()
        .map(|p| p.metadata.name.unwrap())
        .filter(|n| *n != leader)
        .collect();
    assert_eq!(others.len(), 1, "{others:?}");
    let start = Instant::now();
    let (ok, out) = kubectl(
        &[
            "delete",
            "pod",
            &leader,
            "-n",
            &inst.release.namespace,
            "--wait=false",
        ],
        "",
    );
    assert!(ok, "{out}");
    let new = wait_for("a new leader", Duration::from_secs(30), || async {
        inst.leader().await.filter(|l| *l != leader)
    })
    .await;
    let took = start.elapsed();
    // The standby, or the replacement pod the ReplicaSet starts at once: whichever retries
    // first after the Lease is given up (both are live replicas; the deleted one never again).
    let live: Vec<String> = inst
        .pods(&inst.release.namespace, "controller")
        .await
        .into_iter()
        .map(|p| p.metadata.name.unwrap())
        .collect();
    assert!(
        live.contains(&new),
        "the lead went to {new}, not a live replica {live:?}"
    );
    eprintln!(
        "the lead went from {leader} to {new} ({}) in {took:?}",
        if new == others[0] {
            "the standby"
        } else {
            "the replacement pod"
        }
    );
    // And the new leader works: a job runs to the end.
    inst.slow_job("after-failover", 0.0).await;
    inst.wait_succeeded(&["after-failover"], Duration::from_secs(60))
        .await;
}

/// A worker pod's projected token may claim and write its own job but no other.
#[tokio::test]
#[ignore = "needs the test node: run by `scripts/test --test node` (root)"]
async fn projected_token_writes_only_its_job() {
    let _lock = NODE_LOCK.lock().await;
    let node = Node::get();
    let inst = Install::new("node-token", 1, &[]).await;
    let pod = inst
        .pods(&inst.workers.name, "example-worker")
        .await
        .remove(0);
    let pod_name = pod.metadata.name.clone().unwrap();
    let token = node.projected_token(&pod);
    let kc = token_kubeconfig("node-worker-pod", &token, &inst.workers.name);
    let as_pod = client_from(&kc).await;
    let ns = inst.workers.name.clone();
    // Jobs on a queue no worker serves, so only this test writes them.
    for name in ["mine", "theirs"] {
        create_job(
            &inst.client,
            &ns,
            json!({"metadata": {"name": name}, "spec": {"queue": "manual"}}),
        )
        .await;
    }
    let status_path =
        |job: &str| format!("/apis/leasehold.dev/v1alpha1/namespaces/{ns}/leasedjobs/{job}/status");
    // Wait until the controller has given both jobs their Queued status.
    for job in ["mine", "theirs"] {
        let jobs = inst.jobs();
        wait_for("job Queued", Duration::from_secs(30), || async {
            let s = jobs.get(job).await.ok()?.status?;
            (s.phase == Some(Phase::Queued)).then_some(())
        })
        .await;
    }
    let claim = |holder: &str| {
        json!({"status": {"phase": "Leased", "attempt": 1, "holder": holder,
            "token": "1.0123456789abcdef0123456789abcdef"}})
    };
    // Legitimate: the pod claims a Queued job for itself, then writes its checkpoint.
    merge_patch(&as_pod, &status_path("mine"), &claim(&pod_name))
        .await
        .unwrap_or_else(|e| panic!("the pod's own claim was refused: {e:?}"));
    merge_patch(
        &as_pod,
        &status_path("mine"),
        &json!({"status": {"checkpoint": {"offset": 1}}}),
    )
    .await
    .unwrap_or_else(|e| panic!("the holder's checkpoint was refused: {e:?}"));
    // Refused: claiming for another pod, and writing a job another pod holds.
    let err = merge_patch(&as_pod, &status_path("theirs"), &claim("someone-else"))
        .await
        .expect_err("a claim for another pod was accepted");
    assert!(err.1.contains("leasehold rule claim"), "{err:?}");
    merge_patch(&inst.client, &status_path("theirs"), &claim("someone-else"))
        .await
        .expect("the admin's write");
    let err = merge_patch(
        &as_pod,
        &status_path("theirs"),
        &json!({"status": {"phase": "Succeeded", "result": {"stolen": true}}}),
    )
    .await
    .expect_err("a write to another pod's job was accepted");
    assert!(
        err.1.contains("leasehold rule holder-only") && err.1.contains(&pod_name),
        "{err:?}"
    );
    let theirs = inst.jobs().get("theirs").await.unwrap().status.unwrap();
    assert_eq!(theirs.phase, Some(Phase::Leased));
    assert!(theirs.result.is_none());
}

/// Helm upgrade across a CRD change and uninstall lose no job and leave no orphans.
#[tokio::test]
#[ignore = "needs the test node: run by `scripts/test --test node` (root)"]
async fn helm_upgrade_and_uninstall_on_a_node() {
    let _lock = NODE_LOCK.lock().await;
    let inst = Install::new("node-upgrade", 2, &[]).await;
    let names: Vec<String> = (0..6).map(|i| format!("job-{i}")).collect();
    for n in &names {
        inst.slow_job(n, 0.5).await;
    }
    inst.wait_in_progress("job-0").await;

    // The cluster has the previous release's CRD (v1alpha1 only); `helm upgrade` alone
    // brings the new one: its pre-upgrade hook Job applies it from the new image before the
    // controllers (which refuse to start on an older CRD) roll. Every pod rolls too.
    let _restore = put_previous_crd();
    let args = vec![
        "upgrade".to_string(),
        inst.release.name.clone(),
        chart_dir().to_str().unwrap().to_string(),
        "--namespace".into(),
        inst.release.namespace.clone(),
        "--reuse-values".into(),
        "--set".into(),
        "controller.logLevel=debug".into(),
        "--set".into(),
        "exampleWorker.resources.requests.cpu=40m".into(),
    ];
    let args_ref: Vec<&str> = args.iter().map(String::as_str).collect();
    helm_ok(&args_ref);
    assert_new_crd(&inst).await;
    inst.wait_ready(&inst.controller_deployment(), &inst.release.namespace, 2)
        .await;
    inst.wait_ready(&inst.worker_deployment(), &inst.workers.name, 2)
        .await;
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    inst.wait_succeeded(&refs, Duration::from_secs(300)).await;

    // Uninstall: every object of the release goes, pods included; every job stays.
    helm_ok(&[
        "uninstall",
        &inst.release.name,
        "--namespace",
        &inst.release.namespace,
        "--wait",
    ]);
    let selector = format!("app.kubernetes.io/instance={}", inst.release.name);
    let pods: Api<Pod> = Api::all(inst.client.clone());
    wait_for(
        "the release's pods gone",
        Duration::from_secs(120),
        || async {
            pods.list(&ListParams::default().labels(&selector))
                .await
                .unwrap()
                .items
                .is_empty()
                .then_some(())
        },
    )
    .await;
    let (ok, left) = kubectl(
        &[
            "get",
            "deployments,replicasets,services,serviceaccounts,configmaps,secrets,roles,rolebindings,\
             clusterroles,clusterrolebindings,validatingadmissionpolicies,\
             validatingadmissionpolicybindings,validatingwebhookconfigurations,\
             mutatingwebhookconfigurations,jobs,poddisruptionbudgets",
            "-l",
            &selector,
            "--all-namespaces",
            "-o",
            "name",
        ],
        "",
    );
    assert!(ok, "{left}");
    assert!(
        left.trim().is_empty(),
        "left behind by helm uninstall:\n{left}"
    );
    let jobs = inst
        .jobs()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert_eq!(jobs.len(), names.len(), "jobs lost");
    assert!(jobs
        .iter()
        .all(|j| j.status.as_ref().and_then(|s| s.phase) == Some(Phase::Succeeded)));
}

/// The chart and the images from an OCI registry, as a cluster installs a release: the node's
/// registry (plain HTTP on loopback) gets the images and `helm push` of the packaged chart;
/// `helm install oci://…` installs it with the images referenced there, which the kubelet
/// pulls (none of them was imported). A newer release pushed there the same way (chart,
/// appVersion and image tags all bumped) is then `helm upgrade`d to with nothing else done:
/// the CRD hook Job and every pod run the new images, and jobs still complete.
#[tokio::test]
#[ignore = "needs the test node: run by `scripts/test --test node` (root)"]
async fn install_and_upgrade_from_a_registry() {
    let _lock = NODE_LOCK.lock().await;
    let node = Node::get();
    let registry = node.registry();
    let image = std::env::var("LEASEHOLD_IMAGE").expect("LEASEHOLD_IMAGE (scripts/test)");
    let worker =
        std::env::var("LEASEHOLD_WORKER_IMAGE").expect("LEASEHOLD_WORKER_IMAGE (scripts/test)");
    let v1 = chart_version();
    let v2 = bump_patch(&v1);

    // Release v1: the images, tagged with the chart's version, then the chart.
    let release = |v: &str| {
        let image = registry.push_image(&image, "leasehold", v);
        let worker = registry.push_image(&worker, "leasehold-example-worker", v);
        (image, worker, registry.push_chart(v))
    };
    let (image_v1, worker_v1, chart_v1) = release(&v1);
    let held = node.images();
    assert!(
        !held.contains(&image_v1) && !held.contains(&worker_v1),
        "the node holds the registry's images before the install: {held:?}"
    );
    // Only the repositories: the tags are the chart's appVersion, so that the upgrade (with
    // --reset-then-reuse-values, as docs/install.md says) takes the newer chart's.
    let sets = vec![
        format!("image.repository={}/leasehold", registry.host),
        "image.pullPolicy=IfNotPresent".into(),
        "exampleWorker.enabled=true".into(),
        format!(
            "exampleWorker.image.repository={}/leasehold-example-worker",
            registry.host
        ),
        "exampleWorker.image.pullPolicy=IfNotPresent".into(),
    ];
    let chart: Vec<&str> = chart_v1.iter().map(String::as_str).collect();
    let inst = Install::from_chart("node-registry", 2, &chart, sets, &[]).await;
    let ns = inst.release.namespace.clone();
    let wns = inst.workers.name.clone();

    // The kubelet pulled both images from the registry.
    let held = node.images();
    assert!(
        held.contains(&image_v1) && held.contains(&worker_v1),
        "{image_v1} and {worker_v1} are not both on the node: {held:?}"
    );
    assert_pulled(&ns, &image_v1);
    assert_pulled(&wns, &worker_v1);
    assert_runs(&inst, &ns, "controller", &image_v1).await;
    assert_runs(&inst, &wns, "example-worker", &worker_v1).await;
    let first: Vec<String> = (0..3).map(|i| format!("before-{i}")).collect();
    for n in &first {
        inst.slow_job(n, 0.0).await;
    }
    let refs: Vec<&str> = first.iter().map(String::as_str).collect();
    inst.wait_succeeded(&refs, Duration::from_secs(120)).await;

    // Release v2, pushed the same way; `helm upgrade` from the registry alone, with jobs in
    // flight and a CRD change: the cluster has the previous release's CRD (v1alpha1 only),
    // which the new chart's hook Job replaces before its controllers roll.
    let (image_v2, worker_v2, chart_v2) = release(&v2);
    let during: Vec<String> = (0..3).map(|i| format!("during-{i}")).collect();
    for n in &during {
        inst.slow_job(n, 0.3).await;
    }
    let _restore = put_previous_crd();
    let mut args = vec!["upgrade".to_string(), inst.release.name.clone()];
    args.extend(chart_v2.iter().cloned());
    args.extend([
        "--namespace".to_string(),
        ns.clone(),
        "--reset-then-reuse-values".into(),
    ]);
    let args_ref: Vec<&str> = args.iter().map(String::as_str).collect();
    helm_ok(&args_ref);
    let (_, history) = helm(&["history", &inst.release.name, "--namespace", &ns]);
    assert!(
        history.contains(&format!("leasehold-{v2}")),
        "the release is not on chart {v2}:\n{history}"
    );
    assert_new_crd(&inst).await;
    inst.wait_ready(&inst.controller_deployment(), &ns, 2).await;
    inst.wait_ready(&inst.worker_deployment(), &wns, 2).await;
    let held = node.images();
    assert!(
        held.contains(&image_v2) && held.contains(&worker_v2),
        "{image_v2} and {worker_v2} are not both on the node: {held:?}"
    );
    assert_pulled(&ns, &image_v2);
    assert_runs(&inst, &ns, "controller", &image_v2).await;
    assert_runs(&inst, &wns, "example-worker", &worker_v2).await;
    let after: Vec<String> = (0..3).map(|i| format!("after-{i}")).collect();
    for n in &after {
        inst.slow_job(n, 0.0).await;
    }
    let refs: Vec<&str> = during.iter().chain(&after).map(String::as_str).collect();
    inst.wait_succeeded(&refs, Duration::from_secs(300)).await;
}

/// Puts the previous release's LeasedJob CRD (v1alpha1 only) in place of the chart's, as a
/// cluster on that release has it; the guard puts the chart's back when dropped.
fn put_previous_crd() -> impl Drop {
    let mut crd: Value = serde_yaml::from_str(
        &std::fs::read_to_string(repo_path("charts/leasehold/crds/leasedjob.yaml")).unwrap(),
    )
    .unwrap();
    crd["spec"]["versions"].as_array_mut().unwrap().truncate(1);
    let (ok, out) = kubectl(
        &["apply", "--server-side", "--force-conflicts", "-f", "-"],
        &serde_yaml::to_string(&crd).unwrap(),
    );
    assert!(ok, "{out}");
    struct RestoreCrd;
    impl Drop for RestoreCrd {
        fn drop(&mut self) {
            let _ = kubectl(
                &["apply", "--server-side", "--force-conflicts", "-f", "-"],
                &std::fs::read_to_string(repo_path("charts/leasehold/crds/leasedjob.yaml"))
                    .unwrap(),
            );
        }
    }
    RestoreCrd
}

/// The cluster's LeasedJob CRD is the chart's again: v1alpha1 stored, v1beta1 served.
async fn assert_new_crd(inst: &Install) {
    let crds: Api<CustomResourceDefinition> = Api::all(inst.client.clone());
    let upgraded = crds.get("leasedjobs.leasehold.dev").await.unwrap();
    assert_eq!(
        crd_versions(&upgraded),
        [
            ("v1alpha1".to_string(), true),
            ("v1beta1".to_string(), false)
        ],
        "the upgrade did not bring the new CRD"
    );
}

/// `version` with its patch number one higher (and no pre-release part).
fn bump_patch(version: &str) -> String {
    let core = version.split(['-', '+']).next().unwrap();
    let parts: Vec<u64> = core.split('.').map(|p| p.parse().unwrap()).collect();
    format!("{}.{}.{}", parts[0], parts[1], parts[2] + 1)
}

/// An Event in `ns` says the kubelet pulled `image` (reason `Pulled`, "Successfully pulled
/// image …"): not found on the node, fetched from the registry.
fn assert_pulled(ns: &str, image: &str) {
    let (ok, out) = kubectl(
        &[
            "get",
            "events",
            "-n",
            ns,
            "--field-selector",
            "reason=Pulled",
            "-o",
            "jsonpath={range .items[*]}{.message}{\"\\n\"}{end}",
        ],
        "",
    );
    assert!(ok, "{out}");
    let pulled = format!("Successfully pulled image \"{image}\"");
    assert!(
        out.lines().any(|l| l.starts_with(&pulled)),
        "no event in {ns} says {pulled}:\n{out}"
    );
}

/// Every running pod of `component` runs `image` in its first container.
async fn assert_runs(inst: &Install, ns: &str, component: &str, image: &str) {
    let pods = inst.pods(ns, component).await;
    assert!(!pods.is_empty(), "no {component} pod in {ns}");
    for p in &pods {
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(
            spec.containers[0].image.as_deref(),
            Some(image),
            "{:?}",
            p.metadata.name
        );
    }
}
