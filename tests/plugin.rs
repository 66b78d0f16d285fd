//! `kubectl leasehold` choosing its cluster and its jobs, against the real control plane:
//! `--kubeconfig` and `--context`; `get` filtered by `--queue`, `--phase` and `-l` (the API
//! server selects) and printed `-o json|yaml|wide`; `retry` and `cancel` of every job a
//! selection picks; `describe` of one job; bad flags refused, naming the flag and the rule.

use std::path::PathBuf;
use std::time::Duration;

use kube::Api;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_testkit::*;
use serde_json::{json, Value};

/// A kubeconfig whose current context points at a server nobody listens on, beside the
/// test control plane's context `leasehold-local`: a command that reaches the control plane
/// with it used `--context`.
fn two_context_kubeconfig() -> PathBuf {
    let read = kube::config::Kubeconfig::read_from(kubeconfig_path()).unwrap();
    let mut config: Value = serde_json::to_value(read).unwrap();
    let clusters = config["clusters"].as_array_mut().unwrap();
    clusters.push(json!({"name": "nowhere", "cluster": {"server": "https://127.0.0.1:9"}}));
    let contexts = config["contexts"].as_array_mut().unwrap();
    contexts.push(json!({"name": "nowhere", "context": {"cluster": "nowhere", "user": "admin"}}));
    config["current-context"] = json!("nowhere");
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("plugin-two-contexts.kubeconfig");
    std::fs::write(&path, serde_yaml::to_string(&config).unwrap()).unwrap();
    path
}

/// `leasehold ARGS` (the plugin's commands), with the test kubeconfig in KUBECONFIG.
fn leasehold(args: &[&str]) -> (bool, String) {
    run(&leasehold_bin(), args, "", &[])
}

fn names_in(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn the_plugin_selects_its_cluster_and_its_jobs() {
    let Fixture { client, ns } = fixture!("plugin-select");
    let _controller = controller(&ns.name);
    let n = ns.name.as_str();
    for (name, queue, labels) in [
        ("a-1", "a", json!({"team": "x"})),
        ("a-2", "a", json!({})),
        ("b-1", "b", json!({"team": "x"})),
    ] {
        create_job(
            &client,
            n,
            json!({"metadata": {"name": name, "labels": labels},
                   "spec": {"queue": queue, "priority": 7}}),
        )
        .await;
    }
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), n);
    wait_for("every job Queued", Duration::from_secs(30), || async {
        let list = jobs.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .all(|j| j.status.as_ref().and_then(|s| s.phase) == Some(Phase::Queued))
            .then_some(())
    })
    .await;

    // The cluster: --kubeconfig and --context, not the kubeconfig's current context.
    let file = two_context_kubeconfig();
    let file = file.to_str().unwrap();
    let (ok, out) = leasehold(&[
        "get",
        "-n",
        n,
        "--kubeconfig",
        file,
        "--context",
        "leasehold-local",
        "-o",
        "json",
    ]);
    assert!(ok, "{out}");
    let list: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(list["kind"], "List");
    assert_eq!(names_in(&list), ["a-1", "a-2", "b-1"]);
    assert_eq!(list["items"][0]["kind"], "LeasedJob");
    let (ok, out) = leasehold(&["get", "-n", n, "--kubeconfig", file]);
    assert!(!ok, "the current context (nowhere) answered: {out}");
    let (ok, out) = leasehold(&["get", "-n", n, "--kubeconfig", file, "--context", "gone"]);
    assert!(
        !ok && out.contains("--context \"gone\"") && out.contains("leasehold-local, nowhere"),
        "{out}"
    );

    // The jobs: the API server selects by queue, phase and labels.
    let json_of = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["get", "-n", n, "-o", "json"];
        all.extend_from_slice(args);
        let (ok, out) = leasehold(&all);
        assert!(ok, "{all:?}: {out}");
        names_in(&serde_json::from_str(&out).unwrap())
    };
    assert_eq!(json_of(&["--queue", "a"]), ["a-1", "a-2"]);
    assert_eq!(json_of(&["-l", "team=x"]), ["a-1", "b-1"]);
    assert_eq!(json_of(&["--queue", "a", "-l", "team=x"]), ["a-1"]);
    assert_eq!(json_of(&["--phase", "Queued", "--queue", "b"]), ["b-1"]);
    assert!(json_of(&["--phase", "Failed"]).is_empty());
    let (ok, out) = leasehold(&["get", "-n", n, "-o", "yaml", "--queue", "b"]);
    assert!(
        ok && out.contains("kind: List") && out.contains("name: b-1"),
        "{out}"
    );
    let (ok, out) = leasehold(&["get", "-n", n, "-o", "wide", "--queue", "b"]);
    assert!(ok, "{out}");
    let header = out.lines().next().unwrap();
    assert!(
        header.contains("PRIORITY") && header.contains("KEY") && header.contains("MAX-ATTEMPTS"),
        "{out}"
    );
    assert!(out.lines().nth(1).unwrap().contains(" 7 "), "{out}");

    // Cancel, then retry, every job a selection picks.
    let (ok, out) = leasehold(&["cancel", "-n", n, "--queue", "a"]);
    assert!(
        ok && out.contains("2 LeasedJobs matched (queue a): 2 cancelled"),
        "{out}"
    );
    wait_for("a's jobs Cancelled", Duration::from_secs(30), || async {
        (json_of(&["--phase", "Cancelled"]) == ["a-1", "a-2"]).then_some(())
    })
    .await;
    let (ok, out) = leasehold(&["retry", "-n", n, "-l", "team=x"]);
    assert!(
        ok && out.contains("2 LeasedJobs matched (label selector team=x): 1 retried, 1 skipped"),
        "b-1 is Queued, not retried: {out}"
    );
    assert_eq!(json_of(&["--phase", "Cancelled"]), ["a-2"]);
    let (ok, out) = leasehold(&["retry", "-n", n, "--queue", "nothing-here"]);
    assert!(ok && out.contains("No LeasedJobs in namespace"), "{out}");

    // One job described; one that is not there named.
    let (ok, out) = leasehold(&["describe", "-n", n, "b-1"]);
    assert!(ok, "{out}");
    for part in [
        "Name:             b-1",
        "Queue:            b",
        "Priority:         7",
        "Phase:            Queued",
        "Failures:         none",
    ] {
        assert!(out.contains(part), "no {part:?} in:\n{out}");
    }
    let (ok, out) = leasehold(&["describe", "-n", n, "nope"]);
    assert!(
        !ok && out.contains(&format!("LeasedJob {n}/nope not found")),
        "{out}"
    );

    // Bad flags: named, with the rule.
    for (args, says) in [
        (
            vec!["cancel", "-n", n],
            "name a job, or select jobs with -l, --queue or --phase",
        ),
        (vec!["cancel", "-n", n, "a-1", "--queue", "a"], "not both"),
        (
            vec!["get", "-n", n, "--phase", "done"],
            "--phase \"done\" is not a phase",
        ),
        (
            vec!["get", "-n", n, "--queue", "Not_A_Label"],
            "--queue \"Not_A_Label\" is not a DNS label",
        ),
        (
            vec!["get", "-n", n, "-o", "wide", "-w"],
            "cannot be used with",
        ),
    ] {
        let (ok, out) = leasehold(&args);
        assert!(!ok && out.contains(says), "{args:?}: {out}");
    }
}

/// Shell completion scripts: for `leasehold`, or with `--plugin` for `kubectl-leasehold`;
/// bash's parses, and completes the subcommands and their flags.
#[test]
fn completion_scripts_name_the_commands_and_parse() {
    let script = |args: &[&str]| -> String {
        let out = std::process::Command::new(leasehold_bin())
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let bash = script(&["completion", "bash"]);
    for word in [
        "_leasehold()",
        "describe",
        "--queue",
        "--phase",
        "--kubeconfig",
    ] {
        assert!(bash.contains(word), "no {word} in the bash script");
    }
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("leasehold.bash");
    std::fs::write(&path, &bash).unwrap();
    let parsed = std::process::Command::new("bash")
        .arg("-n")
        .arg(&path)
        .status()
        .unwrap();
    assert!(parsed.success(), "bash -n refused the script");
    assert!(script(&["completion", "zsh", "--plugin"]).starts_with("#compdef kubectl-leasehold"));
    let out = std::process::Command::new(leasehold_bin())
        .args(["completion", "tcsh"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("invalid value 'tcsh'"),
        "{err}"
    );
}

/// `submit`: the same key twice is one job; the same key with another spec is refused naming
/// the field; `--wait` prints the worker's result, or the failures with exit 1; bad flags are
/// refused naming them.
#[tokio::test]
async fn submit_is_idempotent_by_key_and_waits_for_the_outcome() {
    let Fixture { client: _, ns } = fixture!("plugin-submit");
    let _controller = controller(&ns.name);
    let n = ns.name.clone();
    let submit = |extra: &[&str]| {
        let mut args = vec!["submit", "media", "-n", n.as_str()];
        args.extend_from_slice(extra);
        leasehold(&args)
    };
    // The producer's trace context rides on an annotation, outside the spec's hash: the
    // resubmissions below, without it, are the same submission.
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (ok, first) = submit(&[
        "--key",
        "order-1",
        "--payload",
        r#"{"n": 1}"#,
        "--traceparent",
        traceparent,
        "-o",
        "name",
    ]);
    assert!(ok, "{first}");
    let name = first.trim().to_string();
    assert!(
        name.starts_with("media-") && name.len() == "media-".len() + 16,
        "{name}"
    );
    let (ok, again) = submit(&["--key", "order-1", "--payload", r#"{ "n":1 }"#]);
    assert!(
        ok && again.contains("already submitted with this key"),
        "{again}"
    );
    let (ok, other) = submit(&[
        "--key",
        "order-1",
        "--payload",
        r#"{"n": 2}"#,
        "--priority",
        "3",
    ]);
    assert!(!ok, "{other}");
    assert!(
        other.contains("different spec (spec.payload, spec.priority)") && other.contains(&name),
        "{other}"
    );
    let (ok, list) = leasehold(&["get", "-n", &n, "-o", "json"]);
    assert!(ok, "{list}");
    let list: Value = serde_json::from_str(&list).unwrap();
    assert_eq!(names_in(&list), vec![name.clone()]);
    assert_eq!(
        list["items"][0]["metadata"]["annotations"]["leasehold.dev/traceparent"], traceparent,
        "{list}"
    );

    // --wait: a worker completes it; then one that fails it.
    let sc = Sidecar::start(&n, "audio", "pod-a", &[]).await;
    // Its trace context comes from the environment (TRACEPARENT, as OpenTelemetry passes it
    // to a command) and reaches the worker with the claim.
    let from_env = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    let waiter = {
        let n = n.clone();
        tokio::task::spawn_blocking(move || {
            run(
                &leasehold_bin(),
                &[
                    "submit",
                    "audio",
                    "-n",
                    &n,
                    "--key",
                    "order-2",
                    "--payload",
                    "[2]",
                    "--wait",
                    "--timeout",
                    "60",
                ],
                "",
                &[("TRACEPARENT", std::path::Path::new(from_env))],
            )
        })
    };
    let (s, c) = sc.claim(20).await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(c["payload"], json!([2]));
    assert_eq!(c["traceparent"], from_env, "{c}");
    let (s, r) = sc
        .post(
            &format!("/v1/jobs/{}/complete", c["name"].as_str().unwrap()),
            json!({"token": c["token"], "result": {"words": 612}}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    let (ok, out) = waiter.await.unwrap();
    assert!(ok, "{out}");
    assert_eq!(out.trim(), r#"{"words":612}"#);

    let waiter = {
        let n = n.clone();
        tokio::task::spawn_blocking(move || {
            leasehold(&["submit", "audio", "-n", &n, "--max-attempts", "1", "--wait"])
        })
    };
    let (s, c) = sc.claim(20).await;
    assert_eq!(s, 200, "{c}");
    let (s, r) = sc
        .post(
            &format!("/v1/jobs/{}/fail", c["name"].as_str().unwrap()),
            json!({"token": c["token"], "reason": "BadAudio", "message": "no audio stream", "retryable": false}),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    let (ok, out) = waiter.await.unwrap();
    assert!(!ok, "{out}");
    assert!(
        out.contains("Failed") && out.contains("attempt 1 on pod-a: BadAudio: no audio stream"),
        "{out}"
    );

    // Timeout: nothing claims it.
    let (ok, out) = submit(&["--wait", "--timeout", "1"]);
    assert!(!ok && out.contains("did not finish within 1s"), "{out}");

    // Bad input, each refused naming what is wrong; nothing is created.
    for (args, says) in [
        (
            vec!["submit", "Media"],
            "queue \"Media\" is not a DNS label",
        ),
        (
            vec!["submit", "media", "--payload", "{n: 1}"],
            "--payload is not JSON",
        ),
        (
            vec!["submit", "media", "--key", ""],
            "idempotency key \"\" is empty",
        ),
        (
            vec!["submit", "media", "--name", "Bad_Name"],
            "--name \"Bad_Name\" is not a valid LeasedJob name",
        ),
        (
            vec!["submit", "media", "--lease-duration", "1"],
            "leaseDurationSeconds",
        ),
        (
            vec!["submit", "media", "--label", "team"],
            "--label \"team\" is not KEY=VALUE",
        ),
        (vec!["submit", "media", "--timeout", "5"], "--wait"),
        // Not RFC 3339: refused by the API server, naming the field (never dropped, which
        // would make the job claimable at once).
        (
            vec!["submit", "media", "--not-before", "tomorrow"],
            "notBefore",
        ),
        (
            vec!["submit", "media", "--traceparent", "00-xyz"],
            "--traceparent: \"00-xyz\" is not a valid W3C traceparent",
        ),
        (
            vec![
                "submit",
                "media",
                "--traceparent",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            ],
            "the trace-id is all zeros",
        ),
    ] {
        let mut args = args.clone();
        args.extend(["-n", n.as_str()]);
        let (ok, out) = leasehold(&args);
        assert!(!ok, "{args:?}: {out}");
        assert!(out.contains(says), "{args:?}: {out}");
    }
    let (_, list) = leasehold(&["get", "-n", &n, "-o", "json"]);
    let list: Value = serde_json::from_str(&list).unwrap();
    assert_eq!(names_in(&list).len(), 4, "{list}");
}
