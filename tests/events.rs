//! Events on the real control plane: every job gets its Events, however long its name (up to
//! the 253 characters Kubernetes allows) and however long the messages they carry.

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::events::v1::Event;
use kube::Api;
use leasehold_controller::REPORTER;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_kube::events::{NAME_MAX, NOTE_MAX_BYTES, SHORTENED};
use leasehold_testkit::*;
use serde_json::json;

/// The Events the leasehold controller recorded about each job: name -> [(reason, note)].
async fn events_by_job(events: &Api<Event>) -> Option<HashMap<String, Vec<(String, String)>>> {
    let mut by_job: HashMap<String, Vec<(String, String)>> = HashMap::new();
    for e in events.list(&Default::default()).await.ok()?.items {
        if e.reporting_controller.as_deref() != Some(REPORTER) {
            continue;
        }
        let name = e.metadata.name.clone().unwrap_or_default();
        assert!(name.len() <= NAME_MAX, "{name}");
        let job = e.regarding.and_then(|r| r.name).unwrap_or_default();
        by_job
            .entry(job)
            .or_default()
            .push((e.reason.unwrap_or_default(), e.note.unwrap_or_default()));
    }
    Some(by_job)
}

/// Waits until every job in `names` has an Event with `reason`; returns their notes.
async fn wait_for_reason(events: &Api<Event>, names: &[String], reason: &str) -> Vec<String> {
    wait_for(
        &format!("a {reason} Event on each of {} jobs", names.len()),
        Duration::from_secs(30),
        || async {
            let by_job = events_by_job(events).await?;
            names
                .iter()
                .map(|n| {
                    by_job
                        .get(n)?
                        .iter()
                        .find(|(r, _)| r == reason)
                        .map(|(_, note)| note.clone())
                })
                .collect::<Option<Vec<_>>>()
        },
    )
    .await
}

/// Claims every job once through the sidecar (all held at once, so none is claimed twice),
/// then fails each attempt with `message`.
async fn claim_and_fail_each(sc: &Sidecar, names: &[String], message: &str, retryable: bool) {
    let mut claims = Vec::new();
    for _ in names {
        let (s, c) = sc.claim(10).await;
        assert_eq!(s, 200, "{c}");
        claims.push(c);
    }
    let mut failed = Vec::new();
    for c in claims {
        let name = c["name"].as_str().unwrap().to_string();
        let body = json!({"token": c["token"], "reason": "Broken", "message": message, "retryable": retryable});
        let (s, r) = sc.post(&format!("/v1/jobs/{name}/fail"), body).await;
        assert_eq!(s, 200, "{name}: {r}");
        failed.push(name);
    }
    failed.sort();
    let mut expected = names.to_vec();
    expected.sort();
    assert_eq!(failed, expected, "each job claimed once");
}

/// Jobs with names up to 253 characters and 4 KiB messages get their events.
#[tokio::test]
async fn long_names_and_messages_get_events() {
    let Fixture { client, ns } = fixture!("events");
    let _ctl = controller_with(&ns.name, "test-controller", &["--events", "all"]);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    // 248..=253 characters, one whose cut for the Event name lands on a dot, and a short one
    // (whose Events fail only on the note's length).
    let mut names: Vec<String> = (248..=253)
        .map(|n| {
            let head = format!("long-{n}-");
            format!("{head}{}", "x".repeat(n - head.len()))
        })
        .collect();
    names.push(format!("{}.{}", "d".repeat(235), "e".repeat(17)));
    names.push("short".into());
    for name in &names {
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": name}, "spec": {"queue": "q", "maxAttempts": 3}}),
        )
        .await;
    }
    // 4096 bytes (the most a worker may send) of two-byte characters.
    let message = "é".repeat(2048);
    let events: Api<Event> = Api::namespaced(client.clone(), &ns.name);

    // A retryable failure: Claimed, then AttemptFailed carrying the message.
    claim_and_fail_each(&sc, &names, &message, true).await;
    wait_for_reason(&events, &names, "Claimed").await;
    for note in wait_for_reason(&events, &names, "AttemptFailed").await {
        assert!(note.len() <= NOTE_MAX_BYTES, "{} bytes", note.len());
        assert!(note.ends_with(SHORTENED), "{note}");
        assert!(note.contains("Broken: éé"), "{note}");
    }

    // A final failure: the job Failed, the Event shortened, the status whole.
    claim_and_fail_each(&sc, &names, &message, false).await;
    for note in wait_for_reason(&events, &names, "Failed").await {
        assert!(note.len() <= NOTE_MAX_BYTES, "{} bytes", note.len());
        assert!(note.ends_with(SHORTENED), "{note}");
    }
    let jobs: Api<LeasedJob> = Api::namespaced(client.clone(), &ns.name);
    for name in &names {
        let status = jobs.get(name).await.unwrap().status.unwrap();
        assert_eq!(status.phase, Some(Phase::Failed), "{name}");
        assert_eq!(status.failures.len(), 2, "{name}");
        for f in &status.failures {
            assert_eq!(
                f.message, message,
                "{name}: the full message stays in status"
            );
        }
    }
    let by_job = events_by_job(&events).await.unwrap();
    for name in &names {
        let claimed = by_job[name].iter().filter(|(r, _)| r == "Claimed").count();
        assert_eq!(claimed, 2, "{name}: one Claimed Event per attempt");
    }
}

/// By default only problems are Events: a claim, a completion and a release write none (two
/// writes per job saved), while a failure still gets its Warning.
#[tokio::test]
async fn the_happy_path_records_no_events_by_default() {
    let Fixture { client, ns } = fixture!("quiet-events");
    let _ctl = controller(&ns.name);
    let sc = Sidecar::start(&ns.name, "q", "pod-a", &[]).await;
    for name in ["ok", "released", "bad"] {
        create_job(
            &client,
            &ns.name,
            json!({"metadata": {"name": name}, "spec": {"queue": "q", "maxAttempts": 1}}),
        )
        .await;
    }
    let mut done = 0;
    while done < 3 {
        let (s, c) = sc.claim(10).await;
        assert_eq!(s, 200, "{c}");
        let (name, token) = (c["name"].as_str().unwrap(), c["token"].as_str().unwrap());
        let (s, body) = match name {
            "ok" => sc.complete(name, token, json!(1)).await,
            "released" if c["attempt"] == 1 => {
                sc.post(&format!("/v1/jobs/{name}/release"), json!({"token": token}))
                    .await
            }
            "released" => sc.complete(name, token, json!(2)).await,
            _ => {
                sc.post(
                    &format!("/v1/jobs/{name}/fail"),
                    json!({"token": token, "reason": "Broken", "retryable": false}),
                )
                .await
            }
        };
        assert_eq!(s, 200, "{body}");
        if !(name == "released" && c["attempt"] == 1) {
            done += 1;
        }
    }
    let events: Api<Event> = Api::namespaced(client.clone(), &ns.name);
    let names = vec!["bad".to_string()];
    wait_for_reason(&events, &names, "Failed").await;
    // Give the controller time to record anything else it would.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let by_job = events_by_job(&events).await.unwrap_or_default();
    for (job, list) in &by_job {
        for (reason, _) in list {
            assert!(
                !["Claimed", "Completed", "Released"].contains(&reason.as_str()),
                "{job}: a happy-path Event {reason} was recorded by default"
            );
        }
    }
}
