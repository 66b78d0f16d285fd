//! What `kubectl leasehold describe NAME` prints: one job's spec as it runs, its current
//! attempt and who holds it, its Lease (heartbeat, expiry, progress), and the history of its
//! attempts (every failure, with its reason, holder and time). Pure: the caller reads the job,
//! its Lease and the clock.
//!
//! The fencing token is never printed whole: its attempt number tells which attempt holds the
//! Lease, and the secret part stays with the worker that holds it.

use std::fmt::Write as _;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::lease;
use leasehold_core::progress::{self, Progress};

use super::view::age;

/// The description of `job`, with `lease` its Lease if it exists, at `now`.
pub fn describe(job: &LeasedJob, lease: Option<&Lease>, now: Timestamp) -> String {
    let mut out = String::new();
    let status = job.status.clone().unwrap_or_default();
    let policy = job.policy();
    let since = |t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time| {
        format!(
            "{} ({} ago)",
            t.0,
            age(now.duration_since(t.0).as_secs().max(0))
        )
    };
    let mut field = |name: &str, value: String| {
        let _ = writeln!(out, "{:<18}{value}", format!("{name}:"));
    };
    field("Name", job.name_any());
    field("Namespace", job.namespace().unwrap_or_default());
    field("Queue", job.spec.queue.clone());
    field("Priority", job.spec.priority.to_string());
    field(
        "Concurrency key",
        job.spec
            .concurrency_key
            .clone()
            .unwrap_or_else(|| "-".into()),
    );
    field("Phase", job.phase().to_string());
    field(
        "Attempt",
        format!(
            "{} (failed so far: {}; maxAttempts {}; lease {} s{})",
            status.attempt,
            job.failed_attempts(),
            policy.max_attempts,
            policy.lease_duration_seconds,
            if status.policy.is_some() {
                ", as its claim recorded them"
            } else {
                ""
            }
        ),
    );
    if let Some(t) = &status.queued_time {
        field("Queued", since(t));
    }
    if let Some(t) = &status.claimed_time {
        field("Claimed", since(t));
    }
    if let Some(t) = &status.retry_after {
        field("Claimable after", t.0.to_string());
    }
    if let Some(t) = &status.finished_time {
        field("Finished", since(t));
    }
    if job.phase() == Phase::Leased {
        field(
            "Holder",
            status.holder.clone().unwrap_or_else(|| "-".into()),
        );
    }
    field("Lease", lease_line(job, lease, now));
    field(
        "Checkpoint",
        match &status.checkpoint {
            None => "none".into(),
            Some(c) => format!(
                "{} bytes of JSON (handed to the next claim)",
                c.to_string().len()
            ),
        },
    );
    if job.phase() == Phase::Succeeded {
        field(
            "Result",
            format!(
                "{} bytes of JSON (kubectl get ljob {} -o jsonpath='{{.status.result}}')",
                status.result.as_ref().map_or(0, |r| r.to_string().len()),
                job.name_any()
            ),
        );
    }
    if status.failures.is_empty() {
        let _ = writeln!(out, "Failures:         none");
    } else {
        let _ = writeln!(out, "Failures:");
        let mut rows = vec![["ATTEMPT", "REASON", "HOLDER", "WHEN", "MESSAGE"]
            .map(str::to_string)
            .to_vec()];
        for f in &status.failures {
            rows.push(vec![
                f.attempt.to_string(),
                f.reason.clone(),
                if f.holder.is_empty() {
                    "-".into()
                } else {
                    f.holder.clone()
                },
                format!("{} ago", age(now.duration_since(f.time.0).as_secs().max(0))),
                one_line(&f.message),
            ]);
        }
        for line in super::view::table(&rows).lines() {
            let _ = writeln!(out, "  {line}");
        }
    }
    if !status.conditions.is_empty() {
        let _ = writeln!(out, "Conditions:");
        for c in &status.conditions {
            let _ = writeln!(
                out,
                "  {} {} ({}): {}",
                c.type_,
                c.status,
                c.reason,
                one_line(&c.message)
            );
        }
    }
    out
}

/// The Lease of the current attempt: who holds it (the attempt of its token), its last
/// heartbeat, when it runs out by this machine's clock, and the progress sent with it.
fn lease_line(job: &LeasedJob, lease: Option<&Lease>, now: Timestamp) -> String {
    let Some(lease) = lease else {
        return "none".into();
    };
    let name = lease.name_any();
    let held = lease::holder_identity(lease);
    let current = job.token().is_some() && held == job.token();
    let attempt = held
        .and_then(|h| h.split_once('.'))
        .map(|(a, _)| a.to_string());
    let mut text = match (held, attempt) {
        (None, _) => format!("{name}, released"),
        (Some(_), Some(a)) if current => format!("{name}, held for attempt {a}"),
        (Some(_), Some(a)) => format!("{name}, left by attempt {a}"),
        (Some(_), None) => format!("{name}, held by an identity that is not a fencing token"),
    };
    if let Some(spec) = lease.spec.as_ref().filter(|_| current) {
        if let Some(renewed) = &spec.renew_time {
            let ago = now.duration_since(renewed.0).as_secs().max(0);
            let _ = write!(text, "; heartbeat {} ago", age(ago));
            if let Some(d) = spec.lease_duration_seconds {
                let left = i64::from(d) - ago;
                if left >= 0 {
                    let _ = write!(text, ", runs out in {}", age(left));
                } else {
                    let _ = write!(text, ", ran out {} ago", age(-left));
                }
            }
        }
    }
    if current || job.phase() != Phase::Queued {
        let p = Progress::of_lease(lease);
        if p.fraction.is_some() || p.message.as_deref().is_some_and(|m| !m.is_empty()) {
            let _ = write!(
                text,
                "; progress {}",
                progress::bar(p.fraction, super::view::BAR_WIDTH).trim_end()
            );
            if let Some(m) = p.message.filter(|m| !m.is_empty()) {
                let _ = write!(text, " {}", one_line(&m));
            }
        }
    }
    text
}

/// `text` on one line, at most 120 characters.
fn one_line(text: &str) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() > 120 {
        let cut: String = flat.chars().take(117).collect();
        format!("{cut}...")
    } else {
        flat
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
    use leasehold_core::crd::{AttemptFailure, LeasedJobSpec, LeasedJobStatus};

    #[test]
    fn a_leased_job_with_a_failure_is_described_without_its_token() {
        let now: Timestamp = "2026-12-05T10:00:00Z".parse().unwrap();
        let token = "2.0123456789abcdef0123456789abcdef";
        let mut job = LeasedJob::new("j", LeasedJobSpec::default());
        job.metadata.namespace = Some("ns".into());
        job.spec.concurrency_key = Some("acme".into());
        job.status = Some(LeasedJobStatus {
            phase: Some(Phase::Leased),
            attempt: 2,
            holder: Some("pod-b".into()),
            token: Some(token.into()),
            failures: vec![AttemptFailure {
                attempt: 1,
                holder: "pod-a".into(),
                reason: "LeaseExpired".into(),
                message: "no heartbeat\nfor 60 s".into(),
                time: Time("2026-12-05T09:55:00Z".parse().unwrap()),
            }],
            ..LeasedJobStatus::default()
        });
        let lease = Lease {
            metadata: kube::api::ObjectMeta {
                name: Some("ljob-j".into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(token.into()),
                lease_duration_seconds: Some(60),
                renew_time: Some(MicroTime("2026-12-05T09:59:50Z".parse().unwrap())),
                ..LeaseSpec::default()
            }),
        };
        let text = describe(&job, Some(&lease), now);
        assert!(
            !text.contains("0123456789abcdef"),
            "the token shown:\n{text}"
        );
        for part in [
            "Concurrency key:  acme",
            "Phase:            Leased",
            "Attempt:          2 (failed so far: 1; maxAttempts 3; lease 60 s)",
            "Holder:           pod-b",
            "ljob-j, held for attempt 2; heartbeat 10s ago, runs out in 50s",
            "LeaseExpired",
            "pod-a",
            "5m0s ago",
        ] {
            assert!(text.contains(part), "no {part:?} in:\n{text}");
        }
        assert!(!text.contains("\nfor"), "a message broke its line:\n{text}");
        // Without a Lease, and Queued.
        job.status = None;
        let text = describe(&job, None, now);
        assert!(text.contains("Lease:            none"), "{text}");
        assert!(text.contains("Failures:         none"), "{text}");
    }
}
