//! What `kubectl leasehold get` prints: one row per LeasedJob, joined with its Lease. Pure: the
//! caller reads the objects and the clock.

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::lease;
use leasehold_core::progress::{self, Progress};

/// Cells of the progress bar (the percentage follows it).
pub const BAR_WIDTH: usize = 10;
/// Longest progress message shown in a row, in characters; longer ones end with `...`.
const SHOWN_MESSAGE_CHARS: usize = 60;

/// One job as a row of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// metadata.namespace.
    pub namespace: String,
    /// metadata.name.
    pub name: String,
    /// spec.queue.
    pub queue: String,
    /// status.phase (Queued for a job without status).
    pub phase: Phase,
    /// status.attempt.
    pub attempt: i32,
    /// status.holder while Leased, else empty (a finished job's holder owns nothing).
    pub holder: String,
    /// The progress of the latest attempt, from its Lease: shown while it is Leased and after
    /// it ended (where it stopped), never for a Queued job.
    pub progress: Progress,
    /// Seconds since the Lease's renewTime, by this machine's clock (Leased only).
    pub heartbeat_age: Option<i64>,
    /// Seconds until renewTime + leaseDurationSeconds, by this machine's clock; negative once
    /// past (Leased only). The controller judges expiry on its own clock, from when it saw the
    /// renewal (docs/protocol.md, Expiry), so this is a guide.
    pub expires_in: Option<i64>,
    /// spec.priority (`-o wide`).
    pub priority: i32,
    /// spec.concurrencyKey, or empty (`-o wide`).
    pub key: String,
    /// The lease duration and maxAttempts the latest claim recorded (status.policy), when it
    /// recorded one (`-o wide`).
    pub policy: Option<(i32, i32)>,
}

impl Row {
    /// The row of `job`, with `lease` the job's Lease if it exists, at `now`. The Lease counts
    /// only when its holderIdentity is the job's current token: a Lease left by an older attempt
    /// says nothing about this one.
    pub fn new(job: &LeasedJob, lease: Option<&Lease>, now: Timestamp) -> Row {
        let phase = job.phase();
        let current = lease.filter(|l| {
            job.token()
                .is_some_and(|t| lease::holder_identity(l) == Some(t))
        });
        let progress = match (phase, current) {
            (Phase::Queued, _) | (_, None) => Progress::default(),
            (_, Some(l)) => Progress::of_lease(l),
        };
        let (mut heartbeat_age, mut expires_in) = (None, None);
        if let (Phase::Leased, Some(spec)) = (phase, current.and_then(|l| l.spec.as_ref())) {
            if let Some(renewed) = spec.renew_time.as_ref() {
                let age = now.duration_since(renewed.0).as_secs();
                heartbeat_age = Some(age);
                let duration = i64::from(
                    spec.lease_duration_seconds
                        .unwrap_or_else(|| job.policy().lease_duration_seconds),
                );
                expires_in = Some(duration - age);
            }
        }
        let holder = match phase {
            Phase::Leased => job
                .status
                .as_ref()
                .and_then(|s| s.holder.clone())
                .unwrap_or_default(),
            _ => String::new(),
        };
        Row {
            namespace: job.namespace().unwrap_or_default(),
            name: job.name_any(),
            queue: job.spec.queue.clone(),
            phase,
            attempt: job.attempt(),
            holder,
            progress,
            heartbeat_age,
            expires_in,
            priority: job.spec.priority,
            key: job.spec.concurrency_key.clone().unwrap_or_default(),
            policy: job
                .status
                .as_ref()
                .and_then(|s| s.policy.as_ref())
                .map(|p| (p.lease_duration_seconds, p.max_attempts)),
        }
    }

    /// The cells of `-o wide`: [`Row::cells`], then priority, concurrency key, and the lease
    /// and maxAttempts of the latest attempt ([`wide_header`] order).
    pub fn wide_cells(&self, with_namespace: bool) -> Vec<String> {
        let mut cells = self.cells(with_namespace);
        cells.extend([
            self.priority.to_string(),
            dash_if_empty(&self.key),
            self.policy
                .map_or_else(|| "-".into(), |(lease, _)| format!("{lease}s")),
            self.policy
                .map_or_else(|| "-".into(), |(_, attempts)| attempts.to_string()),
        ]);
        cells
    }

    /// The cells of the row, in [`header`] order (with or without the namespace column).
    pub fn cells(&self, with_namespace: bool) -> Vec<String> {
        let mut progress = progress::bar(self.progress.fraction, BAR_WIDTH);
        if let Some(m) = self.progress.message.as_deref().filter(|m| !m.is_empty()) {
            progress.push(' ');
            progress.push_str(&shown_message(m));
        }
        let mut cells = Vec::new();
        if with_namespace {
            cells.push(self.namespace.clone());
        }
        cells.extend([
            self.name.clone(),
            self.queue.clone(),
            self.phase.to_string(),
            self.attempt.to_string(),
            dash_if_empty(&self.holder),
            self.heartbeat_age
                .map_or_else(|| "-".to_string(), |s| format!("{} ago", age(s))),
            self.expires_in.map_or_else(
                || "-".to_string(),
                |s| {
                    if s >= 0 {
                        format!("in {}", age(s))
                    } else {
                        format!("{} overdue", age(-s))
                    }
                },
            ),
            progress.trim_end().to_string(),
        ]);
        cells
    }
}

/// The column names, as `kubectl get` spells them.
pub fn header(with_namespace: bool) -> Vec<String> {
    let mut h = Vec::new();
    if with_namespace {
        h.push("NAMESPACE");
    }
    h.extend([
        "NAME",
        "QUEUE",
        "PHASE",
        "ATTEMPT",
        "HOLDER",
        "HEARTBEAT",
        "EXPIRES",
        "PROGRESS",
    ]);
    h.into_iter().map(str::to_string).collect()
}

/// The header of `-o wide`: [`header`], then the columns [`Row::wide_cells`] adds.
pub fn wide_header(with_namespace: bool) -> Vec<String> {
    let mut h = header(with_namespace);
    h.extend(["PRIORITY", "KEY", "LEASE", "MAX-ATTEMPTS"].map(str::to_string));
    h
}

/// Lays `rows` (the header first) out in columns separated by three spaces, as kubectl does;
/// the last column is not padded.
pub fn table(rows: &[Vec<String>]) -> String {
    let mut widths = widths(rows);
    rows.iter()
        .map(|r| format!("{}\n", line(r, &mut widths)))
        .collect()
}

/// The width of each column of `rows`, in characters.
pub fn widths(rows: &[Vec<String>]) -> Vec<usize> {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect()
}

/// One line of a table with columns `widths` wide (widened for a longer cell, so the lines
/// that follow stay aligned with this one: how `get -w` keeps printing rows under its header).
pub fn line(row: &[String], widths: &mut Vec<usize>) -> String {
    let mut out = String::new();
    for (c, cell) in row.iter().enumerate() {
        let len = cell.chars().count();
        if widths.len() <= c {
            widths.push(len);
        }
        widths[c] = widths[c].max(len);
        out.push_str(cell);
        if c + 1 < row.len() {
            out.push_str(&" ".repeat(widths[c] - len + 3));
        }
    }
    out.trim_end().to_string()
}

/// A duration in seconds the way kubectl prints ages: `45s`, `3m12s`, `2h5m`, `4d3h`.
pub fn age(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86400 => format!("{}h{}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{}h", s / 86400, (s % 86400) / 3600),
    }
}

fn dash_if_empty(s: &str) -> String {
    if s.is_empty() {
        "-".to_string()
    } else {
        s.to_string()
    }
}

/// A message as shown: control characters (which the sidecar refuses, but a Lease may have
/// been edited by hand) replaced by spaces, cut to [`SHOWN_MESSAGE_CHARS`].
fn shown_message(m: &str) -> String {
    let clean: String = m
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if clean.chars().count() <= SHOWN_MESSAGE_CHARS {
        clean
    } else {
        let cut: String = clean.chars().take(SHOWN_MESSAGE_CHARS - 3).collect();
        format!("{cut}...")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use leasehold_core::crd::{LeasedJobSpec, LeasedJobStatus};
    use leasehold_core::progress::{MESSAGE_ANNOTATION, PROGRESS_ANNOTATION};

    fn job(phase: Phase, token: &str) -> LeasedJob {
        let mut j = LeasedJob::new(
            "transcode-42",
            LeasedJobSpec {
                queue: "media".into(),
                lease_duration_seconds: Some(60),
                ..Default::default()
            },
        );
        j.metadata.namespace = Some("jobs".into());
        j.status = Some(LeasedJobStatus {
            phase: Some(phase),
            attempt: 2,
            holder: Some("pod-a".into()),
            token: Some(token.into()),
            ..Default::default()
        });
        j
    }

    fn lease(holder: &str, renewed: Timestamp, progress: &str, message: &str) -> Lease {
        let mut l = Lease::default();
        l.metadata.annotations = Some(
            [
                (PROGRESS_ANNOTATION.to_string(), progress.to_string()),
                (MESSAGE_ANNOTATION.to_string(), message.to_string()),
            ]
            .into(),
        );
        l.spec = Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            renew_time: Some(MicroTime(renewed)),
            lease_duration_seconds: Some(60),
            ..Default::default()
        });
        l
    }

    #[test]
    fn a_leased_job_shows_its_holder_heartbeat_expiry_and_progress() {
        let now: Timestamp = "2026-12-01T10:00:00Z".parse().unwrap();
        let renewed = now - k8s_openapi::jiff::SignedDuration::from_secs(15);
        let l = lease("2.abc", renewed, "0.5", "chunk 5 of 10");
        let row = Row::new(&job(Phase::Leased, "2.abc"), Some(&l), now);
        assert_eq!(
            row.cells(false),
            [
                "transcode-42",
                "media",
                "Leased",
                "2",
                "pod-a",
                "15s ago",
                "in 45s",
                "[#####.....]  50% chunk 5 of 10"
            ]
        );
        // Past its expiry by this clock.
        let late = now + k8s_openapi::jiff::SignedDuration::from_secs(60);
        let row = Row::new(&job(Phase::Leased, "2.abc"), Some(&l), late);
        assert_eq!(row.cells(true)[0], "jobs");
        assert_eq!(row.cells(false)[6], "15s overdue");
    }

    #[test]
    fn a_lease_of_another_attempt_shows_nothing() {
        let now = Timestamp::UNIX_EPOCH;
        let l = lease("1.old", now, "0.9", "old");
        let row = Row::new(&job(Phase::Leased, "2.abc"), Some(&l), now);
        assert_eq!(row.progress, Progress::default());
        assert_eq!((row.heartbeat_age, row.expires_in), (None, None));
        // A finished job keeps showing where its last attempt stopped, without a holder.
        let l = lease("2.abc", now, "0.9", "stopped here");
        let row = Row::new(&job(Phase::Failed, "2.abc"), Some(&l), now);
        assert_eq!(row.progress.fraction, Some(0.9));
        assert_eq!((row.holder.as_str(), row.heartbeat_age), ("", None));
        // A Queued job shows no progress: its next attempt has not started.
        let row = Row::new(&job(Phase::Queued, "2.abc"), Some(&l), now);
        assert_eq!(row.progress, Progress::default());
    }

    #[test]
    fn ages_read_like_kubectls() {
        let cases = [
            (0, "0s"),
            (59, "59s"),
            (60, "1m0s"),
            (192, "3m12s"),
            (7500, "2h5m"),
            (356_400, "4d3h"),
        ];
        for (s, want) in cases {
            assert_eq!(age(s), want);
        }
    }

    #[test]
    fn tables_align_columns() {
        let t = table(&[
            vec!["NAME".into(), "PHASE".into()],
            vec!["a-long-name".into(), "Queued".into()],
        ]);
        assert_eq!(t, "NAME          PHASE\na-long-name   Queued\n");
        assert_eq!(shown_message("a\tb"), "a b");
        assert_eq!(shown_message(&"x".repeat(70)).chars().count(), 60);
    }
}
