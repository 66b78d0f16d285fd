//! The final invariants: no job lost, each attempt ended once, no superseded write accepted,
//! results right, no job blocked by its Lease, processes healthy.

use crate::*;

/// What the worker's result must hold for `task` over `file` (examples/worker.py: wordcount
/// agrees with `LC_ALL=C wc`; sha256 reports the whole file's digest and the digest of the
/// concatenated per-chunk hex digests).
pub(crate) fn expected_result(task: &str, file: &str) -> Value {
    let bytes = std::fs::read(format!("{DATA_DIR}/{file}")).expect("license text");
    match task {
        "wordcount" => {
            let ws = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r');
            let words = bytes.split(ws).filter(|w| !w.is_empty()).count();
            let lines = bytes.iter().filter(|b| **b == b'\n').count();
            json!({"task": task, "file": file, "lines": lines, "words": words, "bytes": bytes.len()})
        }
        "sha256" => {
            let chunks: Vec<String> = bytes
                .chunks(CHUNK_BYTES)
                .map(|c| format!("{:x}", Sha256::digest(c)))
                .collect();
            json!({"task": task, "file": file, "bytes": bytes.len(), "chunkBytes": CHUNK_BYTES,
                "chunks": chunks.len(), "sha256": format!("{:x}", Sha256::digest(&bytes)),
                "chunkListSha256": format!("{:x}", Sha256::digest(chunks.concat().as_bytes()))})
        }
        _ => unreachable!("{task}"),
    }
}

impl Chaos {
    /// Waits for every workload job to finish; the jobs as last read.
    pub(crate) async fn drain(&mut self, within: Duration) -> Vec<LeasedJob> {
        let deadline = Instant::now() + within;
        loop {
            let list =
                tokio::time::timeout(Duration::from_secs(10), self.jobs.list(&Default::default()))
                    .await;
            if let Ok(Ok(list)) = list {
                let work: Vec<LeasedJob> = list
                    .items
                    .into_iter()
                    .filter(|j| self.expected.contains_key(&j.name_any()))
                    .collect();
                let open: Vec<&LeasedJob> =
                    work.iter().filter(|j| !j.phase().is_finished()).collect();
                if open.is_empty() && work.len() == self.expected.len() {
                    return work;
                }
                if Instant::now() > deadline {
                    let shown: Vec<String> = open
                        .iter()
                        .take(20)
                        .map(|j| {
                            let s = j.status.clone().unwrap_or_default();
                            format!(
                                "{} {} attempt {} holder {:?}",
                                j.name_any(),
                                j.phase().as_str(),
                                s.attempt,
                                s.holder
                            )
                        })
                        .collect();
                    self.violations.push(format!(
                        "jobs lost: {} of {} workload jobs not finished {within:?} after the last \
                         fault ({} exist); e.g. {}",
                        open.len(),
                        self.expected.len(),
                        work.len(),
                        shown.join("; ")
                    ));
                    return work;
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// The final invariants over the jobs and the workers' events. (Events are not counted:
    /// the controllers record only problems here, and a new leader may record a transition
    /// its predecessor recorded already; a result accepted twice shows in the job's
    /// conditions and in the workers' endings.)
    pub(crate) async fn check_jobs(&mut self, jobs: &[LeasedJob]) {
        let events = self.events.all();
        let mut by_job: HashMap<&str, Vec<&WorkerEvent>> = HashMap::new();
        for e in &events {
            if let Some(j) = e.job() {
                by_job.entry(j).or_default().push(e);
            }
        }
        let (mut refused, mut transient, mut superseded_refused) = (0, 0, 0);
        for job in jobs {
            let name = job.name_any();
            let status = job.status.clone().unwrap_or_default();
            let phase = job.phase();
            if phase != Phase::Succeeded {
                self.violations.push(format!(
                    "job {name} ended {} (attempt {}), not Succeeded; failures {:?}",
                    phase.as_str(),
                    status.attempt,
                    status
                        .failures
                        .iter()
                        .map(|f| format!("{} {}", f.attempt, f.reason))
                        .collect::<Vec<_>>()
                ));
                continue;
            }
            // The result is what the payload determines.
            let expected = &self.expected[&name];
            let result = status.result.clone().unwrap_or(Value::Null);
            for (k, v) in expected.as_object().unwrap() {
                if result.get(k) != Some(v) {
                    self.violations.push(format!(
                        "job {name}: result.{k} is {}, expected {v} (result {result})",
                        result.get(k).unwrap_or(&Value::Null)
                    ));
                }
            }
            let conditions = status
                .conditions
                .iter()
                .filter(|c| c.type_ == "Complete")
                .count();
            if conditions != 1 {
                self.violations.push(format!(
                    "job {name}: {conditions} Complete conditions, expected 1"
                ));
            }
            // Each attempt ends once: one accepted complete, fail or release, or one expiry.
            let mut endings: BTreeMap<i64, Vec<String>> = BTreeMap::new();
            for f in &status.failures {
                if f.reason == REASON_LEASE_EXPIRED {
                    endings
                        .entry(f.attempt.into())
                        .or_default()
                        .push("expired".into());
                }
            }
            let final_attempt = i64::from(status.attempt);
            for e in by_job.get(name.as_str()).into_iter().flatten() {
                let kind = e.kind();
                if !matches!(kind, "complete" | "fail" | "release") {
                    continue;
                }
                match e.status() {
                    Some(200) => {
                        endings
                            .entry(e.attempt())
                            .or_default()
                            .push(format!("{kind} by {}", e.worker));
                        if kind == "complete" && e.attempt() != final_attempt {
                            self.violations.push(format!(
                                "job {name}: {} got 200 for the result of attempt {}, but attempt \
                                 {final_attempt} is the one that succeeded: a superseded \
                                 attempt's write was accepted",
                                e.worker,
                                e.attempt()
                            ));
                        }
                    }
                    Some(409) => {
                        refused += 1;
                        if e.attempt() < final_attempt {
                            superseded_refused += 1;
                        }
                    }
                    Some(s) if s >= 500 => transient += 1,
                    other => self.violations.push(format!(
                        "job {name}: {}'s {kind} of attempt {} answered {other:?} {}: a refused \
                         late write must be 409",
                        e.worker,
                        e.attempt(),
                        e.event
                    )),
                }
            }
            for (attempt, ends) in &endings {
                if ends.len() > 1 {
                    self.violations.push(format!(
                        "job {name}: attempt {attempt} ended {} times: {}",
                        ends.len(),
                        ends.join(", ")
                    ));
                }
            }
            let completes = endings
                .values()
                .flatten()
                .filter(|e| e.starts_with("complete"))
                .count();
            if completes > 1 {
                self.violations
                    .push(format!("job {name}: {completes} results accepted"));
            }
        }
        self.log(&format!(
            "worker writes refused with 409: {refused} ({superseded_refused} from superseded \
             attempts); answered 5xx and retried: {transient}"
        ));
        self.check_zombies(jobs, &by_job);
    }

    /// Each busy `--insist` worker frozen past its lease: if the attempt it held expired, a
    /// late complete, fail or release of that attempt by that worker must be seen refused with
    /// 409 (the fencing check exercised, per worker); if the worker ended the attempt itself
    /// (one answered 200), the freeze came too late to make a zombie; an attempt that did
    /// neither outlived a worker frozen past its lease, which is a violation.
    fn check_zombies(&mut self, jobs: &[LeasedJob], by_job: &HashMap<&str, Vec<&WorkerEvent>>) {
        let verdicts: Vec<Result<Option<String>, String>> = self
            .zombies
            .iter()
            .map(|z| judge_zombie(z, jobs, by_job))
            .collect();
        let mut exercised = 0;
        for verdict in verdicts {
            match verdict {
                Ok(None) => exercised += 1,
                Ok(Some(line)) => self.log(&line),
                Err(violation) => self.violations.push(violation),
            }
        }
        self.log(&format!(
            "fencing of superseded writes: {exercised} of {} frozen busy insisting worker(s) \
             wrote after their attempt expired and had a write refused with 409 (by the \
             sidecar, which had stopped renewing, or by the API server)",
            self.zombies.len()
        ));
    }

    /// No job is left blocked by its Lease: every job Lease that names a holder names a token
    /// of an attempt no newer than its job's (so the next claim could take it over), and not
    /// one the job still holds as Leased once every job finished. The holder no longer clears
    /// the Lease of an attempt it ended (the job's status fences it; docs/protocol.md, "What
    /// fences what"), so a finished job's Lease may well still name its last token: that is
    /// the rule, not a leak. Leases whose job is gone are garbage collection's business.
    pub(crate) async fn check_no_lease_blocks_its_job(&mut self) {
        let lp = ListParams::default().labels("app.kubernetes.io/managed-by=leasehold");
        let (leases, jobs) = match (
            self.leases.list(&lp).await,
            self.jobs.list(&ListParams::default()).await,
        ) {
            (Ok(l), Ok(j)) => (l.items, j.items),
            (l, j) => {
                self.violations.push(format!(
                    "could not list Leases and jobs for the final Lease check: {:?} {:?}",
                    l.err(),
                    j.err()
                ));
                return;
            }
        };
        let by_lease: HashMap<String, &LeasedJob> = jobs
            .iter()
            .map(|j| (leasehold_core::lease::lease_name(&j.name_any()), j))
            .collect();
        let (mut stale, mut orphans) = (0, 0);
        for l in leases
            .iter()
            .filter(|l| l.name_any() != "leasehold-controller")
        {
            let Some(held) = leasehold_core::lease::holder_identity(l).filter(|h| !h.is_empty())
            else {
                continue;
            };
            let Some(job) = by_lease.get(&l.name_any()) else {
                orphans += 1;
                continue;
            };
            let name = job.name_any();
            match leasehold_core::token::Token::parse(held) {
                Err(_) => self.violations.push(format!(
                    "Lease of {name} names {held:?}, which is not a leasehold token"
                )),
                Ok(t) if t.attempt() > job.attempt() => self.violations.push(format!(
                    "Lease of {name} names attempt {}, newer than the job's attempt {}: the next \
                     claim could not take it over",
                    t.attempt(),
                    job.attempt()
                )),
                Ok(_) if job.phase() == Phase::Leased && job.token() == Some(held) => {
                    self.violations.push(format!(
                        "Lease of {name} is still held by attempt {} of a job left Leased at the end",
                        job.attempt()
                    ))
                }
                Ok(_) => stale += 1,
            }
        }
        self.log(&format!(
            "job Leases at the end: {} in all; {stale} still name an ended attempt (left for \
             the next claim or garbage collection, as the rule says); {orphans} of deleted jobs",
            leases.len()
        ));
    }

    /// Every process the test started is alive and says so.
    pub(crate) async fn check_health(&mut self) {
        for (id, c) in &mut self.controllers {
            let port = c.port.unwrap();
            if let Ok(Some(s)) = c.child.try_wait() {
                self.violations.push(format!("controller {id} exited: {s}"));
            } else if http_get(port, "/healthz").await.map(|r| r.0) != Some(200) {
                self.violations
                    .push(format!("controller {id} /healthz is not 200"));
            }
        }
        for pod in &mut self.pods {
            if let Ok(Some(s)) = pod.worker.child.try_wait() {
                self.violations.push(format!(
                    "worker-{} exited: {s} (see {})",
                    pod.id,
                    pod.worker.log.display()
                ));
            }
            if !pod.sidecar.healthy().await {
                self.violations
                    .push(format!("sidecar of {} /healthz is not 200", pod.id));
            }
        }
        if !self.probe.healthy().await {
            self.violations
                .push("the dispatch probe sidecar's /healthz is not 200".into());
        }
    }
}

/// The verdict on one frozen busy insisting worker, from its job at the end and the workers'
/// events of that job: Ok(None) when its attempt expired and a late write of it was refused
/// with 409 (the fencing exercised); Ok(Some(line to log)) when the worker ended the attempt
/// itself before it expired; Err(violation) otherwise.
fn judge_zombie(
    z: &Zombie,
    jobs: &[LeasedJob],
    by_job: &HashMap<&str, Vec<&WorkerEvent>>,
) -> Result<Option<String>, String> {
    let what = format!(
        "{} (frozen holding {} attempt {})",
        z.worker, z.job, z.attempt
    );
    let Some(job) = jobs.iter().find(|j| j.name_any() == z.job) else {
        return Err(format!(
            "{what}: the job is gone, so its attempt cannot be judged"
        ));
    };
    let expired = job.status.as_ref().is_some_and(|s| {
        s.failures
            .iter()
            .any(|f| i64::from(f.attempt) == z.attempt && f.reason == REASON_LEASE_EXPIRED)
    });
    let writes: Vec<&WorkerEvent> = by_job
        .get(z.job.as_str())
        .into_iter()
        .flatten()
        .copied()
        .filter(|e| {
            e.worker == z.worker
                && e.attempt() == z.attempt
                && matches!(e.kind(), "complete" | "fail" | "release")
        })
        .collect();
    let answered = |code| writes.iter().any(|e| e.status() == Some(code));
    if expired {
        if answered(409) {
            Ok(None)
        } else {
            Err(format!(
                "{what}: the attempt expired, yet no late write of the insisting worker \
                 was seen refused with 409 (its writes: {:?})",
                writes.iter().map(|e| &e.event).collect::<Vec<_>>()
            ))
        }
    } else if answered(200) {
        Ok(Some(format!(
            "{what}: the worker ended the attempt itself (its complete, fail or release \
             landed before the attempt expired, and stands), so there was no superseded \
             write to refuse"
        )))
    } else {
        Err(format!(
            "{what}: frozen past its lease, yet the attempt neither expired nor was \
             ended by the worker"
        ))
    }
}
