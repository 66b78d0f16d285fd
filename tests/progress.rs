//! Progress people can see, and `kubectl leasehold` (get, get -w, retry, cancel), against the
//! real control plane: the controller and a sidecar as processes, driven over HTTP as a worker
//! drives them, and the plugin run through the real kubectl, found on PATH as
//! `kubectl-leasehold` (a symlink to the leasehold binary, as users install it).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::lease;
use leasehold_core::progress::{MESSAGE_ANNOTATION, PROGRESS_ANNOTATION};
use leasehold_testkit::*;
use serde_json::json;

/// A directory holding only `kubectl-leasehold`, a symlink to the leasehold binary under test.
fn plugin_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kubectl-plugin");
    std::fs::create_dir_all(&dir).unwrap();
    let link = dir.join("kubectl-leasehold");
    if std::fs::read_link(&link).ok() != Some(leasehold_bin()) {
        // Tests run in parallel: build the link beside it, then rename it into place, so that
        // no test ever finds the name missing.
        let tmp = dir.join(format!("kubectl-leasehold.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(leasehold_bin(), &tmp).unwrap();
        std::fs::rename(&tmp, &link).unwrap();
    }
    dir
}

/// `kubectl leasehold ARGS` through the real kubectl: (success, stdout and stderr).
fn kubectl_leasehold(args: &[&str]) -> (bool, String) {
    let mut all = vec!["leasehold"];
    all.extend_from_slice(args);
    let dir = plugin_dir();
    run(&kubectl_path(), &all, "", &[("PATH", &dir)])
}

async fn lease_of(client: &kube::Client, ns: &str, job: &str) -> Lease {
    let api: Api<Lease> = Api::namespaced(client.clone(), ns);
    api.get(&lease::lease_name(job))
        .await
        .expect("the job's Lease")
}

async fn job_of(client: &kube::Client, ns: &str, name: &str) -> LeasedJob {
    let api: Api<LeasedJob> = Api::namespaced(client.clone(), ns);
    api.get(name).await.expect("the job")
}

/// The line of `table` that starts with `name` (or, with -A, has it second).
fn row<'a>(table: &'a str, name: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.split_whitespace().take(2).any(|w| w == name))
        .unwrap_or_else(|| panic!("no row for {name} in:\n{table}"))
}

/// GET shows the progress a heartbeat sent, and the job is not written.
#[tokio::test]
async fn get_shows_heartbeat_progress() {
    let Fixture { client, ns } = fixture!("progress-get");
    let _controller = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "media", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "transcode"}, "spec": {"queue": "media", "leaseDurationSeconds": 60}}),
    )
    .await;
    let (_, token) = sc.claim_leased(10).await;
    let before = job_of(&client, &ns.name, "transcode").await;
    let lease_before = lease_of(&client, &ns.name, "transcode").await;

    let (s, r) = sc
        .heartbeat(
            "transcode",
            json!({"token": token, "progress": 0.42, "message": "chunk 42 of 100"}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    let l = lease_of(&client, &ns.name, "transcode").await;
    let annotations = l.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations.get(PROGRESS_ANNOTATION).map(String::as_str),
        Some("0.42")
    );
    assert_eq!(
        annotations.get(MESSAGE_ANNOTATION).map(String::as_str),
        Some("chunk 42 of 100")
    );
    // One write: the Lease's resourceVersion moved once (a single PATCH carried renewTime and
    // the progress), and the LeasedJob was not written at all.
    let rv = |l: &Lease| {
        l.metadata
            .resource_version
            .clone()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    assert!(rv(&l) > rv(&lease_before));
    let after = job_of(&client, &ns.name, "transcode").await;
    assert_eq!(
        after.metadata.resource_version, before.metadata.resource_version,
        "a heartbeat wrote the LeasedJob"
    );

    let (ok, out) = kubectl_leasehold(&["get", "-n", &ns.name]);
    assert!(ok, "{out}");
    let header = out.lines().next().unwrap();
    for column in [
        "NAME",
        "QUEUE",
        "PHASE",
        "ATTEMPT",
        "HOLDER",
        "HEARTBEAT",
        "EXPIRES",
        "PROGRESS",
    ] {
        assert!(header.contains(column), "{header}");
    }
    let line = row(&out, "transcode");
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        &words[..5],
        ["transcode", "media", "Leased", "1", "pod-a"],
        "{line}"
    );
    assert!(line.contains("[####......]  42% chunk 42 of 100"), "{line}");
    assert!(line.contains("s ago") && line.contains("in "), "{line}");

    // A heartbeat with only a message keeps the fraction; every namespace shows the namespace.
    let (s, r) = sc
        .heartbeat("transcode", json!({"token": token, "message": "muxing"}))
        .await;
    assert_eq!(s, 200, "{r}");
    let (ok, out) = kubectl_leasehold(&["get", "-A"]);
    assert!(ok, "{out}");
    // Other namespaces (earlier runs', other tests') may hold a job of the same name.
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("{} ", ns.name)))
        .unwrap_or_else(|| panic!("no row in {} in:\n{out}", ns.name));
    assert!(line.contains("transcode"), "{line}");
    assert!(line.contains("42% muxing"), "{line}");

    // get -w prints the table, then the job's row again at each heartbeat.
    let dir = plugin_dir();
    let mut watch = Command::new(kubectl_path())
        .args(["leasehold", "get", "-w", "-n", &ns.name])
        .env("KUBECONFIG", kubeconfig_path())
        .env("PATH", &dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kubectl leasehold get -w");
    let (tx, rx) = mpsc::channel();
    let stdout = watch.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let first = rx.recv_timeout(Duration::from_secs(20)).expect("a header");
    assert!(first.starts_with("NAME"), "{first}");
    let listed = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the job's row");
    assert!(listed.contains("42% muxing"), "{listed}");
    let (s, r) = sc
        .heartbeat(
            "transcode",
            json!({"token": token, "progress": 0.9, "message": "almost"}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains("[#########.]  90% almost") => break,
            Ok(line) => seen.push(line),
            Err(_) => panic!("get -w printed no row with the new progress; it printed {seen:?}"),
        }
    }
    let _ = watch.kill();
    let _ = watch.wait();
}

/// Bad progress or message is refused with 400 and nothing is written.
#[tokio::test]
async fn bad_progress_is_refused() {
    let Fixture { client, ns } = fixture!("progress-bad");
    let _controller = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "x"}, "spec": {"queue": "q"}}),
    )
    .await;
    let (_, token) = sc.claim_ok(10).await;
    let (s, r) = sc
        .heartbeat(
            "x",
            json!({"token": token, "progress": 0.1, "message": "ok"}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    let before = lease_of(&client, &ns.name, "x").await;

    let cases = [
        (
            json!({"progress": 1.5}),
            "progress 1.5 is out of range: expected a number from 0 to 1",
        ),
        (json!({"progress": -0.25}), "progress -0.25 is out of range"),
        (
            json!({"progress": "half"}),
            "progress \"half\" is not a number",
        ),
        (
            json!({"progress": 0.5, "message": "a".repeat(257)}),
            "is 257 bytes: at most 256 bytes",
        ),
        (
            json!({"progress": 0.5, "message": "two\nlines"}),
            "contains a control character",
        ),
        (json!({"message": 7}), "message 7 is not a string"),
    ];
    for (extra, says) in cases {
        let mut body = extra.clone();
        body["token"] = json!(token);
        let (s, r) = sc.heartbeat("x", body).await;
        assert_eq!(
            (s, r["error"].as_str()),
            (400, Some("invalid_request")),
            "{extra}: {r}"
        );
        let message = r["message"].as_str().unwrap();
        assert!(message.contains(says), "{extra}: {message}");
    }
    // Nothing was written: not the progress, not even renewTime.
    let after = lease_of(&client, &ns.name, "x").await;
    assert_eq!(
        after.metadata.resource_version,
        before.metadata.resource_version
    );
    let annotations = after.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations.get(PROGRESS_ANNOTATION).map(String::as_str),
        Some("0.1")
    );
    assert_eq!(
        annotations.get(MESSAGE_ANNOTATION).map(String::as_str),
        Some("ok")
    );
    // The attempt is unharmed.
    let (s, r) = sc.complete("x", &token, json!(1)).await;
    assert_eq!(s, 200, "{r}");
}

/// Retry of a failed job runs a new attempt and keeps its failures.
#[tokio::test]
async fn retry_keeps_past_failures() {
    let Fixture { client, ns } = fixture!("progress-retry");
    let _controller = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "x"}, "spec": {"queue": "q", "maxAttempts": 1}}),
    )
    .await;
    let (_, t1) = sc.claim_ok(10).await;
    let (s, r) = sc
        .heartbeat(
            "x",
            json!({"token": t1, "checkpoint": {"offset": 7}, "progress": 0.3}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    let (s, r) = sc
        .post(
            "/v1/jobs/x/fail",
            json!({"token": t1, "reason": "DiskFull", "message": "no space", "retryable": true}),
        )
        .await;
    assert_eq!((s, r["phase"].as_str()), (200, Some("Failed")), "{r}");

    // Not yet finished jobs and succeeded ones are not retried.
    let (ok, out) = kubectl_leasehold(&["retry", "nosuch", "-n", &ns.name]);
    assert!(!ok && out.contains("not found"), "{out}");

    let (ok, out) = kubectl_leasehold(&["retry", "x", "-n", &ns.name]);
    assert!(ok, "{out}");
    assert!(out.contains("its next claim is attempt 2"), "{out}");
    let job = job_of(&client, &ns.name, "x").await;
    let status = job.status.clone().unwrap();
    assert_eq!(job.phase(), Phase::Queued);
    assert_eq!(
        job.spec.max_attempts,
        Some(2),
        "raised so the new attempt may fail and retry"
    );
    assert_eq!(status.attempt, 1);
    assert_eq!(status.failures.len(), 1);
    assert_eq!(status.finished_time, None);
    assert_eq!(status.checkpoint, Some(json!({"offset": 7})));
    let failed = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Failed")
        .unwrap();
    assert_eq!(
        (failed.status.as_str(), failed.reason.as_str()),
        ("False", "Retried")
    );
    let (ok, out) = kubectl_leasehold(&["get", "-n", &ns.name]);
    assert!(ok, "{out}");
    let line = row(&out, "x");
    assert!(line.contains("Queued") && !line.contains('%'), "{line}");

    // The new attempt resumes from the checkpoint and succeeds; the old token stays refused.
    let (s, c) = sc.claim(10).await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(c["attempt"], 2);
    assert_eq!(c["checkpoint"], json!({"offset": 7}));
    let t2 = token_of(&c);
    let (s, r) = sc.heartbeat("x", json!({"token": t1})).await;
    assert_eq!(s, 409, "{r}");
    let (s, r) = sc.complete("x", &t2, json!({"words": 3})).await;
    assert_eq!((s, r["phase"].as_str()), (200, Some("Succeeded")), "{r}");
    let job = job_of(&client, &ns.name, "x").await;
    let status = job.status.unwrap();
    assert_eq!(status.attempt, 2);
    assert_eq!(status.failures.len(), 1);
    assert_eq!(status.failures[0].attempt, 1);
    assert_eq!(status.failures[0].reason, "DiskFull");

    let (ok, out) = kubectl_leasehold(&["retry", "x", "-n", &ns.name]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("is Succeeded: only a Failed or Cancelled job can be retried"),
        "{out}"
    );
}

#[tokio::test]
async fn cancel_ends_a_leased_job_and_retry_brings_it_back() {
    let Fixture { client, ns } = fixture!("progress-cancel");
    let _controller = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    create_job(
        &client,
        &ns.name,
        json!({"metadata": {"name": "x"}, "spec": {"queue": "q"}}),
    )
    .await;
    let (_, t1) = sc.claim_ok(10).await;

    let (ok, out) = kubectl_leasehold(&["cancel", "x", "-n", &ns.name]);
    assert!(ok, "{out}");
    assert!(out.contains("cancel requested"), "{out}");
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    wait_for("the job Cancelled", Duration::from_secs(10), || async {
        let j = jobs.get("x").await.ok()?;
        (j.phase() == Phase::Cancelled).then_some(())
    })
    .await;
    let (s, r) = sc.heartbeat("x", json!({"token": t1})).await;
    assert_eq!((s, r["error"].as_str()), (409, Some("cancelled")), "{r}");
    let (ok, out) = kubectl_leasehold(&["cancel", "x", "-n", &ns.name]);
    assert!(ok && out.contains("is Cancelled"), "{out}");

    let (ok, out) = kubectl_leasehold(&["retry", "x", "-n", &ns.name]);
    assert!(ok, "{out}");
    let job = jobs.get("x").await.unwrap();
    assert_eq!(job.phase(), Phase::Queued);
    assert!(!job.spec.cancel);
    let (s, c) = sc.claim(10).await;
    assert_eq!((s, c["attempt"].as_i64()), (200, Some(2)), "{c}");
    let (s, r) = sc.complete("x", &token_of(&c), json!("done")).await;
    assert_eq!((s, r["phase"].as_str()), (200, Some("Succeeded")), "{r}");
    let status = jobs.get("x").await.unwrap().status.unwrap();
    let cancelled = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Cancelled")
        .unwrap();
    assert_eq!(
        (cancelled.status.as_str(), cancelled.reason.as_str()),
        ("False", "Retried")
    );

    let (ok, out) = kubectl_leasehold(&["cancel", "x", "-n", &ns.name]);
    assert!(
        !ok && out.contains("is already Succeeded; there is nothing to cancel"),
        "{out}"
    );
}
