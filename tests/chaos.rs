//! Chaos: many jobs run by real Python workers (examples/worker.py) beside real sidecars, under
//! two controller replicas, while workers, sidecars and the leader are frozen (SIGSTOP) and
//! killed (SIGKILL), the API server restarts after SIGTERM and after SIGKILL, etcd restarts,
//! etcd is compacted so that watches resumed from an old resourceVersion get 410 Gone, and one
//! sidecar's connection to the API server stalls (bytes held, no reset) for longer than a lease.
//!
//! It asserts: no job lost (every job Succeeded), no result accepted twice, no write accepted
//! from a superseded attempt (each attempt ends exactly once: one accepted complete, fail or
//! release, or one expiry), every result equal to what the payload determines, every job Lease
//! released at the end, every process still healthy; and after each fault ends, once the API
//! server is ready: dispatch (create -> claimed by a worker waiting in a long poll) <= 1 s and
//! expiry (last renewTime of a killed holder -> requeue seen) <= leaseDurationSeconds + 1 s.
//!
//! Sizes: by default (CI) 80 jobs, four pods, one pass over the fault schedule, about four
//! minutes. LEASEHOLD_CHAOS_LONG=1: 1200 jobs, six pods, three passes. LEASEHOLD_CHAOS_JOBS
//! sets the number of jobs. The schedule comes from a seeded RNG; the seed is printed first,
//! and LEASEHOLD_CHAOS_SEED replays it. The figures table is printed to stdout and written to
//! chaos-figures.txt in the test log directory.
//!
//! A test binary of its own: every fault hits the control plane all tests share.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::faults::{compact_etcd, restart_etcd, Relay};
use common::workers::{spawn_worker, EventLog, WorkerEvent};
use common::*;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, WatchEvent, WatchParams};
use kube::{Api, Client, ResourceExt};
use leasehold::crd::{LeasedJob, Phase};
use leasehold::fence::REASON_LEASE_EXPIRED;
use leasehold::leader::HOLDER_POD_ANNOTATION;
use leasehold::lease::lease_name;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// leaseDurationSeconds of every job.
const LEASE_SECONDS: i32 = 6;
/// The dispatch bound after a fault ends (the "dispatch <= 1 s").
const DISPATCH_BOUND: Duration = Duration::from_secs(1);
/// What expiry may take beyond leaseDurationSeconds after a fault ends ("<= LD + 1 s").
const EXPIRY_SLACK: Duration = Duration::from_secs(1);
/// Leader election as in tests/ha.rs: a lost leader is replaced within seconds.
const ELECTION: &[&str] = &[
    "--leader-lease-duration",
    "3",
    "--leader-renew-deadline",
    "2",
    "--leader-retry-period",
    "0.5",
];
/// Seconds of the leader's lease (--leader-lease-duration above).
const LEADER_LEASE: Duration = Duration::from_secs(3);
/// The sidecars' --worker-timeout: a worker silent for max(1, LD) = LD seconds loses its jobs,
/// so a frozen worker's job is requeued.
const SIDECAR_FLAGS: &[&str] = &["--worker-timeout", "1"];
/// License texts the workers process (under the worker's default --data-dir).
const FILES: &[&str] = &[
    "Apache-2.0",
    "GPL-1",
    "GPL-2",
    "MPL-2.0",
    "LGPL-3",
    "CC0-1.0",
    "Artistic",
];
const DATA_DIR: &str = "/usr/share/common-licenses";
const CHUNK_BYTES: usize = 4096;
/// Seconds of simulated work per chunk: a job takes 0.6 to 1.5 s.
const CHUNK_DELAY: f64 = 0.3;

/// How big a run is.
struct Size {
    jobs: usize,
    pods: usize,
    rounds: usize,
    seed: u64,
}

impl Size {
    fn from_env() -> Size {
        let long = std::env::var("LEASEHOLD_CHAOS_LONG").is_ok_and(|v| v == "1");
        let jobs = std::env::var("LEASEHOLD_CHAOS_JOBS")
            .ok()
            .map(|v| v.parse().expect("LEASEHOLD_CHAOS_JOBS: a number of jobs"))
            .unwrap_or(if long { 1200 } else { 80 });
        let seed = std::env::var("LEASEHOLD_CHAOS_SEED")
            .ok()
            .map(|v| v.parse().expect("LEASEHOLD_CHAOS_SEED: a u64"))
            .unwrap_or_else(rand::random);
        Size {
            jobs,
            pods: if long { 6 } else { 4 },
            rounds: if long { 3 } else { 1 },
            seed,
        }
    }
}

/// The kinds of fault; each pass of the schedule injects every one once, in a seeded order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    WorkerStop,
    WorkerKill,
    SidecarStop,
    SidecarKill,
    LeaderStop,
    LeaderKill,
    ApiserverTerm,
    ApiserverKill,
    EtcdRestart,
    Compaction,
    RelayStall,
}

const ALL_FAULTS: &[Fault] = &[
    Fault::WorkerStop,
    Fault::WorkerKill,
    Fault::SidecarStop,
    Fault::SidecarKill,
    Fault::LeaderStop,
    Fault::LeaderKill,
    Fault::ApiserverTerm,
    Fault::ApiserverKill,
    Fault::EtcdRestart,
    Fault::Compaction,
    Fault::RelayStall,
];

impl Fault {
    fn label(self) -> &'static str {
        match self {
            Fault::WorkerStop => "worker SIGSTOP",
            Fault::WorkerKill => "worker SIGKILL",
            Fault::SidecarStop => "sidecar SIGSTOP",
            Fault::SidecarKill => "sidecar SIGKILL",
            Fault::LeaderStop => "leader SIGSTOP",
            Fault::LeaderKill => "leader SIGKILL",
            Fault::ApiserverTerm => "apiserver TERM",
            Fault::ApiserverKill => "apiserver KILL",
            Fault::EtcdRestart => "etcd restart",
            Fault::Compaction => "compaction+410",
            Fault::RelayStall => "relay stall",
        }
    }
}

/// One row of the figures table.
struct Figure {
    fault: String,
    detail: String,
    /// From the start of the injection to its end (process resumed or restarted, API server
    /// ready again).
    lasted: Duration,
    /// From the fault's end to the dispatch probe's job claimed.
    recover: Option<Duration>,
    /// Create -> claimed, for the probe job created once the fault had ended.
    dispatch: Option<Duration>,
    /// Last renewTime of a killed holder -> its job's requeue seen.
    expiry: Option<Duration>,
}

/// A worker pod: a sidecar and the example worker beside it.
struct Pod {
    id: String,
    port: u16,
    kubeconfig: PathBuf,
    relayed: bool,
    sidecar: Sidecar,
    worker: Proc,
    worker_flags: Vec<&'static str>,
    restarts: usize,
}

struct Chaos {
    client: Client,
    ns: String,
    jobs: Api<LeasedJob>,
    leases: Api<Lease>,
    /// (identity, process) of each controller replica.
    controllers: Vec<(String, Proc)>,
    controller_restarts: usize,
    pods: Vec<Pod>,
    relay: Relay,
    probe: Sidecar,
    events: EventLog,
    rng: StdRng,
    /// Workload job name -> the fields its result must have.
    expected: BTreeMap<String, Value>,
    probes: usize,
    figures: Vec<Figure>,
    violations: Vec<String>,
    /// Compaction revision and what proved a watch got 410.
    gone_checks: Vec<String>,
    /// Busy `--insist` workers frozen past their lease (each should write as a zombie).
    zombies: usize,
    /// Writes of superseded attempts refused with 409.
    superseded_refused: usize,
    started: Instant,
}

/// What the worker's result must hold for `task` over `file` (examples/worker.py: wordcount
/// agrees with `LC_ALL=C wc`; sha256 reports the whole file's digest and the digest of the
/// concatenated per-chunk hex digests).
fn expected_result(task: &str, file: &str) -> Value {
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

fn secs(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64())
}

fn opt_ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{}", d.as_millis()))
}

fn opt_s(d: Option<Duration>) -> String {
    d.map_or("-".into(), secs)
}

/// A claim through `sidecar`, retried on 204 (nothing yet) and 503 (watch not synced yet)
/// until `within` has passed; each request bounded, so a hung sidecar cannot hang the test.
/// Ok((claim, when it arrived)) or Err(what went wrong).
async fn claim_within(sidecar: &Sidecar, within: Duration) -> Result<(Value, Instant), String> {
    let deadline = Instant::now() + within;
    let mut last = String::from("no answer");
    while Instant::now() < deadline {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .as_secs()
            .clamp(1, 10);
        let answer = tokio::time::timeout(Duration::from_secs(wait + 5), sidecar.claim(wait)).await;
        match answer {
            Ok((200, body)) => return Ok((body, Instant::now())),
            Ok((204, _)) => last = "204 (nothing claimable)".into(),
            Ok((s, body)) => {
                last = format!("{s} {body}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(_) => last = format!("claim?wait={wait} did not answer within {}s", wait + 5),
        }
    }
    Err(format!("no claim within {within:?}; last answer: {last}"))
}

impl Chaos {
    fn log(&self, line: &str) {
        println!(
            "[chaos {:>6.1}s] {line}",
            self.started.elapsed().as_secs_f64()
        );
    }

    async fn leader(&self) -> Option<String> {
        let l = self.leases.get_opt("leasehold-controller").await.ok()??;
        l.spec.as_ref()?.holder_identity.as_ref()?;
        let who = l.annotations().get(HOLDER_POD_ANNOTATION).cloned()?;
        self.controllers
            .iter()
            .any(|(id, _)| *id == who)
            .then_some(who)
    }

    /// Waits until the API server answers /readyz with 200.
    async fn api_ready(&self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            let req = http::Request::get("/readyz").body(Vec::new()).unwrap();
            let r = tokio::time::timeout(Duration::from_secs(5), self.client.request_text(req));
            if let Ok(Ok(_)) = r.await {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("the API server was not ready within {within:?}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Creates a job, retrying for up to 30 s; returns when the successful create started.
    async fn create(&self, manifest: Value) -> Instant {
        let api = self.jobs.clone();
        let mut manifest = manifest;
        manifest["apiVersion"] = json!("leasehold.dev/v1alpha1");
        manifest["kind"] = json!("LeasedJob");
        let job: LeasedJob = serde_json::from_value(manifest).expect("job manifest");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let t0 = Instant::now();
            match api.create(&Default::default(), &job).await {
                Ok(_) => return t0,
                Err(kube::Error::Api(s)) if s.code == 409 => return t0,
                Err(e) if Instant::now() < deadline => {
                    self.log(&format!("create {}: {e}; retrying", job.name_any()));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("creating {} failed for 30 s: {e}", job.name_any()),
            }
        }
    }

    /// Creates the next `n` workload jobs.
    async fn create_wave(&mut self, n: usize) {
        for _ in 0..n {
            let k = self.expected.len();
            let name = format!("w-{k:04}");
            let file = FILES[k % FILES.len()];
            let task = if k % 3 == 0 { "sha256" } else { "wordcount" };
            self.create(json!({
                "metadata": {"name": name},
                "spec": {"queue": "work", "leaseDurationSeconds": LEASE_SECONDS, "maxAttempts": 50,
                    "payload": {"task": task, "file": file, "chunkBytes": CHUNK_BYTES,
                        "chunkDelaySeconds": CHUNK_DELAY}}
            }))
            .await;
            self.expected.insert(name, expected_result(task, file));
        }
    }

    /// A random pod whose worker holds a job right now (its last event is a claim or a
    /// heartbeat), among the `--insist` ones when `insisting`; any pod when none is busy.
    /// Returns the pod and whether it was busy.
    fn pick_pod(&mut self, insisting: bool) -> (usize, bool) {
        let events = self.events.all();
        let busy: Vec<usize> = (0..self.pods.len())
            .filter(|&i| !insisting || self.pods[i].worker_flags.contains(&"--insist"))
            .filter(|&i| {
                let worker = format!("worker-{}", self.pods[i].id);
                let last = events
                    .iter()
                    .rev()
                    .find(|e| e.worker == worker && e.kind() != "error");
                last.is_some_and(|e| matches!(e.kind(), "claimed" | "heartbeat"))
            })
            .collect();
        match busy.choose(&mut self.rng) {
            Some(&i) => (i, true),
            None => (self.rng.random_range(0..self.pods.len()), false),
        }
    }

    /// Lines of each leasehold process's log that report a watch answered 410 Gone.
    fn gone_lines(&self) -> BTreeMap<String, usize> {
        let mut logs: Vec<(String, String)> = self
            .controllers
            .iter()
            .map(|(id, c)| (id.clone(), c.log_text()))
            .collect();
        logs.extend(
            self.pods
                .iter()
                .map(|p| (p.id.clone(), p.sidecar.proc.log_text())),
        );
        logs.push(("probe-dispatch".into(), self.probe.proc.log_text()));
        logs.into_iter()
            .map(|(who, text)| {
                let n = text
                    .lines()
                    .filter(|l| l.contains("too old resource version") || l.contains("410 Gone"))
                    .count();
                (who, n)
            })
            .collect()
    }

    fn respawn_worker(&mut self, i: usize) {
        let ns = self.ns.clone();
        let pod = &mut self.pods[i];
        pod.restarts += 1;
        pod.worker = spawn_worker(
            &format!("{ns}-{}-worker-{}", pod.id, pod.restarts),
            &format!("worker-{}", pod.id),
            &pod.sidecar.base,
            &pod.worker_flags,
            &self.events,
        );
    }

    /// Injects `fault`; returns a description and the moment it ended.
    async fn inject(&mut self, fault: Fault) -> (String, Instant) {
        let ld = Duration::from_secs(LEASE_SECONDS as u64);
        match fault {
            Fault::WorkerStop | Fault::SidecarStop => {
                // A frozen insisting worker completes anyway when it wakes: a superseded write.
                let (i, busy) = self.pick_pod(fault == Fault::WorkerStop);
                if busy && fault == Fault::WorkerStop {
                    self.zombies += 1;
                }
                let pod = &self.pods[i];
                let target = if fault == Fault::WorkerStop {
                    &pod.worker
                } else {
                    &pod.sidecar.proc
                };
                let hold = ld + Duration::from_secs(self.rng.random_range(2..=4));
                target.signal("STOP");
                tokio::time::sleep(hold).await;
                target.signal("CONT");
                let busy = if busy { "busy" } else { "idle" };
                (
                    format!("{} ({busy}) frozen {}s", target.name, hold.as_secs()),
                    Instant::now(),
                )
            }
            Fault::WorkerKill => {
                let (i, _) = self.pick_pod(false);
                self.pods[i].worker.signal("KILL");
                let _ = self.pods[i].worker.child.wait();
                tokio::time::sleep(Duration::from_secs(1)).await;
                self.respawn_worker(i);
                (
                    format!("worker-{} killed, restarted", self.pods[i].id),
                    Instant::now(),
                )
            }
            Fault::SidecarKill => {
                let (i, _) = self.pick_pod(false);
                let ns = self.ns.clone();
                let pod = &mut self.pods[i];
                pod.sidecar.proc.signal("KILL");
                let _ = pod.sidecar.proc.child.wait();
                pod.restarts += 1;
                let id = format!("{}-r{}", pod.id, pod.restarts);
                pod.sidecar = Sidecar::start_at(
                    &ns,
                    "work",
                    &id,
                    pod.port,
                    &pod.kubeconfig,
                    SIDECAR_FLAGS,
                    Duration::from_secs(60),
                )
                .await;
                (
                    format!("sidecar of {} killed, restarted as {id}", pod.id),
                    Instant::now(),
                )
            }
            Fault::LeaderStop | Fault::LeaderKill => {
                let leader = self.wait_leader(None).await;
                let i = self
                    .controllers
                    .iter()
                    .position(|(id, _)| *id == leader)
                    .unwrap();
                if fault == Fault::LeaderStop {
                    self.controllers[i].1.signal("STOP");
                    let new = self.wait_leader(Some(&leader)).await;
                    tokio::time::sleep(LEADER_LEASE).await;
                    self.controllers[i].1.signal("CONT");
                    (
                        format!("{leader} frozen until {new} led, +3s"),
                        Instant::now(),
                    )
                } else {
                    self.controllers[i].1.signal("KILL");
                    let _ = self.controllers[i].1.child.wait();
                    let new = self.wait_leader(Some(&leader)).await;
                    let ended = Instant::now();
                    self.controller_restarts += 1;
                    let id = format!("ctl-r{}", self.controller_restarts);
                    self.controllers[i] = (id.clone(), controller_with(&self.ns, &id, ELECTION));
                    (
                        format!("{leader} killed, {new} took over; {id} started"),
                        ended,
                    )
                }
            }
            Fault::ApiserverTerm | Fault::ApiserverKill => {
                let sig = if fault == Fault::ApiserverTerm {
                    "TERM"
                } else {
                    "KILL"
                };
                let down = Duration::from_secs(self.rng.random_range(1..=3));
                tokio::task::spawn_blocking(move || restart_apiserver(sig, down))
                    .await
                    .unwrap();
                (format!("down {}s", down.as_secs()), Instant::now())
            }
            Fault::EtcdRestart => {
                let sig = if self.rng.random_bool(0.5) {
                    "TERM"
                } else {
                    "KILL"
                };
                let down = Duration::from_secs(self.rng.random_range(1..=3));
                tokio::task::spawn_blocking(move || restart_etcd(sig, down))
                    .await
                    .unwrap();
                let ready = self.api_ready(Duration::from_secs(60)).await;
                if let Err(e) = ready {
                    self.violations.push(format!("after etcd restart: {e}"));
                }
                (format!("{sig}, down {}s", down.as_secs()), Instant::now())
            }
            Fault::Compaction => {
                // A resourceVersion from before the compaction, to resume a watch from.
                let old_rv = self
                    .jobs
                    .list_metadata(&ListParams::default().limit(1))
                    .await
                    .expect("list jobs")
                    .metadata
                    .resource_version
                    .expect("list resourceVersion");
                tokio::time::sleep(Duration::from_millis(500)).await;
                let before = self.gone_lines();
                let c = compact_etcd().await;
                if !c.old_read_error.contains("compacted") {
                    self.violations.push(format!(
                        "compaction at revision {} did not take: a read at the revision before \
                         answered {:?}",
                        c.revision, c.old_read_error
                    ));
                }
                // A restart empties the API server's watch cache, so every resumed watch
                // must be served from the compacted etcd: 410 Gone.
                tokio::task::spawn_blocking(|| restart_apiserver("TERM", Duration::ZERO))
                    .await
                    .unwrap();
                let ended = Instant::now();
                let gone = self.watch_is_gone(&old_rv).await;
                self.gone_checks.push(format!(
                    "compacted etcd at revision {}; a watch of LeasedJobs from resourceVersion \
                     {old_rv} then got: {gone}",
                    c.revision
                ));
                if !gone.contains("410") {
                    self.violations.push(format!(
                        "after compaction at revision {}: a watch from resourceVersion {old_rv} \
                         did not get 410 Gone but {gone}",
                        c.revision
                    ));
                }
                // The leasehold processes' own watches must have met the 410 too.
                let seen = tokio::time::timeout(Duration::from_secs(15), async {
                    loop {
                        let after = self.gone_lines();
                        let who: Vec<String> = after
                            .iter()
                            .filter(|(w, n)| before.get(*w).is_some_and(|b| *n > b))
                            .map(|(w, n)| format!("{w} ({})", n - before[w]))
                            .collect();
                        if !who.is_empty() {
                            return who;
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                })
                .await;
                match seen {
                    Ok(who) => self.gone_checks.push(format!(
                        "leasehold processes that logged a watch answered 410 after it: {}",
                        who.join(", ")
                    )),
                    Err(_) => self.violations.push(format!(
                        "after compaction at revision {}: no leasehold process logged a watch \
                         answered 410 Gone (\"too old resource version\") within 15 s of the \
                         API server's restart: the fault did not reach them",
                        c.revision
                    )),
                }
                (
                    format!("revision {}, apiserver restarted", c.revision),
                    ended,
                )
            }
            Fault::RelayStall => {
                let hold = ld + Duration::from_secs(self.rng.random_range(2..=4));
                let pod = self.pods.iter().find(|p| p.relayed).unwrap();
                let id = pod.id.clone();
                self.relay.stall();
                tokio::time::sleep(hold).await;
                self.relay.resume();
                (
                    format!("{id}'s API connections held {}s", hold.as_secs()),
                    Instant::now(),
                )
            }
        }
    }

    /// Waits (up to 30 s) for a leader among the replicas, other than `not` when given.
    async fn wait_leader(&self, not: Option<&str>) -> String {
        wait_for(
            &format!("a controller leader other than {not:?}"),
            Duration::from_secs(30),
            || async { self.leader().await.filter(|l| Some(l.as_str()) != not) },
        )
        .await
    }

    /// Resumes a watch of LeasedJobs from `rv`; says what the first answer was.
    async fn watch_is_gone(&self, rv: &str) -> String {
        let wp = WatchParams::default().timeout(5);
        match self.jobs.watch(&wp, rv).await {
            Err(kube::Error::Api(s)) => format!("HTTP {} {}", s.code, s.message),
            Err(e) => format!("error {e}"),
            Ok(stream) => {
                let mut stream = stream.boxed();
                match tokio::time::timeout(Duration::from_secs(8), stream.try_next()).await {
                    Ok(Ok(Some(WatchEvent::Error(e)))) => {
                        format!("watch event ERROR {} {}", e.code, e.message)
                    }
                    Ok(Ok(Some(_))) => "an object event (no 410)".into(),
                    Ok(Ok(None)) => "the end of the stream (no 410)".into(),
                    Ok(Err(e)) => format!("stream error {e}"),
                    Err(_) => "nothing within 8 s".into(),
                }
            }
        }
    }

    /// Dispatch probe: a claim already waiting in the probe sidecar's long poll, a job
    /// created for it; (create -> claimed, fault end -> claimed).
    async fn dispatch_probe(
        &self,
        n: usize,
        ended: Instant,
    ) -> Result<(Duration, Duration), String> {
        let name = format!("probe-d-{n}");
        let claimer = claim_within(&self.probe, Duration::from_secs(30));
        let creator = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            self.create(
                json!({"metadata": {"name": name}, "spec": {"queue": "dispatch-probe",
                "leaseDurationSeconds": LEASE_SECONDS}}),
            )
            .await
        };
        let (claimed, t0) = tokio::join!(claimer, creator);
        let (claim, at) = claimed?;
        if claim["name"] != name {
            return Err(format!(
                "the probe claimed {} instead of {name}",
                claim["name"]
            ));
        }
        let token = claim["token"].as_str().unwrap_or_default();
        let (s, r) = self.probe.complete(&name, token, json!("probe")).await;
        if s != 200 {
            return Err(format!("completing {name} answered {s} {r}"));
        }
        Ok((at.saturating_duration_since(t0), at - ended))
    }

    /// Expiry probe: a fresh sidecar claims a job, is killed; the time from the Lease's last
    /// renewTime to the requeue seen.
    async fn expiry_probe(&self, n: usize) -> Result<Duration, String> {
        let name = format!("probe-e-{n}");
        let queue = format!("expiry-probe-{n}");
        self.create(json!({"metadata": {"name": name}, "spec": {"queue": queue,
            "leaseDurationSeconds": LEASE_SECONDS, "maxAttempts": 100}}))
            .await;
        let holder = Sidecar::start(&self.ns, &queue, &format!("probe-holder-{n}"), &[]).await;
        let (claim, _) = claim_within(&holder, Duration::from_secs(30)).await?;
        if claim["name"] != name {
            return Err(format!(
                "the holder claimed {} instead of {name}",
                claim["name"]
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        holder.proc.signal("KILL");
        drop(holder);
        // A renewal in flight at the kill may still land.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let lease =
            tokio::time::timeout(Duration::from_secs(10), self.leases.get(&lease_name(&name)))
                .await
                .map_err(|_| format!("reading the Lease of {name} took over 10 s"))?
                .map_err(|e| format!("reading the Lease of {name}: {e}"))?;
        let renewed = lease
            .spec
            .and_then(|s| s.renew_time)
            .ok_or_else(|| format!("the Lease of {name} has no renewTime"))?
            .0;
        let limit = Duration::from_secs(3 * LEASE_SECONDS as u64 + 20);
        let start = Instant::now();
        loop {
            if let Ok(Ok(j)) =
                tokio::time::timeout(Duration::from_secs(5), self.jobs.get(&name)).await
            {
                let expired = j.status.as_ref().is_some_and(|s| {
                    s.failures
                        .iter()
                        .any(|f| f.attempt == 1 && f.reason == REASON_LEASE_EXPIRED)
                });
                if expired {
                    let took = Timestamp::now().duration_since(renewed).as_secs_f64();
                    return Ok(Duration::from_secs_f64(took.max(0.0)));
                }
            }
            if start.elapsed() > limit {
                return Err(format!(
                    "{name} was not requeued within {limit:?} of its holder's death"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Both probes at once, recorded as a row of the table; bounds checked.
    async fn probe_after(&mut self, fault: &str, detail: String, began: Instant, ended: Instant) {
        if let Err(e) = self.api_ready(Duration::from_secs(60)).await {
            self.violations.push(format!("after {fault}: {e}"));
        }
        self.probes += 1;
        let n = self.probes;
        let (dispatch, expiry) = tokio::join!(self.dispatch_probe(n, ended), self.expiry_probe(n));
        let mut fig = Figure {
            fault: fault.to_string(),
            detail,
            lasted: ended - began,
            recover: None,
            dispatch: None,
            expiry: None,
        };
        let ld = Duration::from_secs(LEASE_SECONDS as u64);
        match dispatch {
            Ok((d, r)) => {
                fig.dispatch = Some(d);
                fig.recover = Some(r);
                if d > DISPATCH_BOUND {
                    self.violations.push(format!(
                        "after {fault}: dispatch took {} ms, bound {} ms (probe-d-{n}: create -> \
                         claimed by a worker waiting in a long poll)",
                        d.as_millis(),
                        DISPATCH_BOUND.as_millis()
                    ));
                }
            }
            Err(e) => self
                .violations
                .push(format!("after {fault}: dispatch probe probe-d-{n}: {e}")),
        }
        match expiry {
            Ok(e) => {
                fig.expiry = Some(e);
                if e > ld + EXPIRY_SLACK {
                    self.violations.push(format!(
                        "after {fault}: expiry took {} s, bound {} s = leaseDurationSeconds + {} s \
                         (probe-e-{n}: last renewTime of the killed holder -> requeue seen)",
                        secs(e),
                        (ld + EXPIRY_SLACK).as_secs(),
                        EXPIRY_SLACK.as_secs()
                    ));
                }
            }
            Err(e) => self
                .violations
                .push(format!("after {fault}: expiry probe probe-e-{n}: {e}")),
        }
        self.log(&format!(
            "{fault} ({}): lasted {}s, recover {}s, dispatch {} ms, expiry {}s",
            fig.detail,
            secs(fig.lasted),
            opt_s(fig.recover),
            opt_ms(fig.dispatch),
            opt_s(fig.expiry)
        ));
        self.figures.push(fig);
    }

    fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "{:<16} {:>8} {:>11} {:>12} {:>9}  detail",
            "fault", "lasted s", "recover s", "dispatch ms", "expiry s"
        );
        for f in &self.figures {
            let _ = writeln!(
                t,
                "{:<16} {:>8} {:>11} {:>12} {:>9}  {}",
                f.fault,
                secs(f.lasted),
                opt_s(f.recover),
                opt_ms(f.dispatch),
                opt_s(f.expiry),
                f.detail
            );
        }
        let _ = writeln!(
            t,
            "bounds: dispatch <= {} ms, expiry <= {} s (leaseDurationSeconds {} + {} s)",
            DISPATCH_BOUND.as_millis(),
            LEASE_SECONDS as u64 + EXPIRY_SLACK.as_secs(),
            LEASE_SECONDS,
            EXPIRY_SLACK.as_secs()
        );
        t
    }

    /// Waits for every workload job to finish; the jobs as last read.
    async fn drain(&mut self, within: Duration) -> Vec<LeasedJob> {
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

    /// The final invariants over the jobs, the workers' events and the Events.
    async fn check_jobs(&mut self, jobs: &[LeasedJob]) {
        let events = self.events.all();
        let mut by_job: HashMap<&str, Vec<&WorkerEvent>> = HashMap::new();
        for e in &events {
            if let Some(j) = e.job() {
                by_job.entry(j).or_default().push(e);
            }
        }
        let completed_events: Vec<Event> = Api::<Event>::namespaced(self.client.clone(), &self.ns)
            .list(&Default::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("Completed"))
            .collect();
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
            let n_events = completed_events
                .iter()
                .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(&name))
                .count();
            if n_events > 1 {
                self.violations.push(format!(
                    "job {name}: {n_events} Completed Events: a result accepted twice"
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
        self.superseded_refused = superseded_refused;
        self.log(&format!(
            "worker writes refused with 409: {refused} ({superseded_refused} from superseded \
             attempts); answered 5xx and retried: {transient}"
        ));
    }

    /// Every job Lease's holderIdentity is empty (the holder's release, or the controller's
    /// after its grace).
    async fn check_leases_released(&mut self) {
        let lp = ListParams::default().labels("app.kubernetes.io/managed-by=leasehold");
        let held = || async {
            let list = self.leases.list(&lp).await.ok()?;
            let held: Vec<String> = list
                .items
                .iter()
                .filter(|l| l.name_any() != "leasehold-controller")
                .filter(|l| {
                    l.spec
                        .as_ref()
                        .and_then(|s| s.holder_identity.as_deref())
                        .is_some_and(|h| !h.is_empty())
                })
                .map(|l| l.name_any())
                .collect();
            Some(held)
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let now = held().await;
            match now {
                Some(h) if h.is_empty() => return,
                Some(h) if Instant::now() > deadline => {
                    self.violations.push(format!(
                        "{} Leases still held 30 s after the last job finished: {}",
                        h.len(),
                        h.join(", ")
                    ));
                    return;
                }
                _ => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }

    /// Every process the test started is alive and says so.
    async fn check_health(&mut self) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_chaos_no_job_is_lost_or_accepted_twice_and_dispatch_and_expiry_recover() {
    let size = Size::from_env();
    println!(
        "chaos: seed {} (LEASEHOLD_CHAOS_SEED={} replays it), {} jobs, {} pods, {} pass(es)",
        size.seed, size.seed, size.jobs, size.pods, size.rounds
    );
    let client = client().await;
    let ns = TestNamespace::new(&client, "chaos").await;
    let mut rng = StdRng::seed_from_u64(size.seed);
    let mut schedule = Vec::new();
    for _ in 0..size.rounds {
        let mut pass = ALL_FAULTS.to_vec();
        pass.shuffle(&mut rng);
        schedule.extend(pass);
    }
    println!(
        "chaos: schedule {:?}",
        schedule.iter().map(|f| f.label()).collect::<Vec<_>>()
    );

    let controllers = vec![
        (
            "ctl-a".to_string(),
            controller_with(&ns.name, "ctl-a", ELECTION),
        ),
        (
            "ctl-b".to_string(),
            controller_with(&ns.name, "ctl-b", ELECTION),
        ),
    ];
    let relay = Relay::start(common::faults::apiserver_port());
    let events = EventLog::default();
    let mut pods = Vec::new();
    for i in 0..size.pods {
        let id = format!("pod-{i}");
        let relayed = i + 1 == size.pods;
        let kubeconfig = if relayed {
            relay.kubeconfig(&format!("{}-{id}", ns.name))
        } else {
            kubeconfig_path()
        };
        let port = free_port();
        let sidecar = Sidecar::start_at(
            &ns.name,
            "work",
            &id,
            port,
            &kubeconfig,
            SIDECAR_FLAGS,
            Duration::from_secs(30),
        )
        .await;
        // Every other worker insists: it completes even after it learnt its lease was lost,
        // so the fencing of superseded writes is exercised, not only the worker's manners.
        let worker_flags = if i % 2 == 1 {
            vec!["--wait", "5", "--insist"]
        } else {
            vec!["--wait", "5"]
        };
        let worker = spawn_worker(
            &format!("{}-{id}-worker-0", ns.name),
            &format!("worker-{id}"),
            &sidecar.base,
            &worker_flags,
            &events,
        );
        pods.push(Pod {
            id,
            port,
            kubeconfig,
            relayed,
            sidecar,
            worker,
            worker_flags,
            restarts: 0,
        });
    }
    let probe = Sidecar::start(&ns.name, "dispatch-probe", "probe-dispatch", &[]).await;
    let mut chaos = Chaos {
        jobs: Api::namespaced(client.clone(), &ns.name),
        leases: Api::namespaced(client.clone(), &ns.name),
        client: client.clone(),
        ns: ns.name.clone(),
        controllers,
        controller_restarts: 0,
        pods,
        relay,
        probe,
        events,
        rng,
        expected: BTreeMap::new(),
        probes: 0,
        figures: Vec::new(),
        violations: Vec::new(),
        gone_checks: Vec::new(),
        zombies: 0,
        superseded_refused: 0,
        started: Instant::now(),
    };
    let leader = chaos.wait_leader(None).await;
    for (id, c) in &chaos.controllers {
        let port = c.port.unwrap();
        wait_for(
            &format!("controller {id} ready"),
            Duration::from_secs(30),
            || async { (http_get(port, "/readyz").await?.0 == 200).then_some(()) },
        )
        .await;
    }
    chaos.log(&format!("{leader} leads; {} pods ready", size.pods));

    // Baseline figures, before any fault.
    let now = Instant::now();
    chaos
        .probe_after("none (baseline)", "no fault".into(), now, now)
        .await;

    let waves = schedule.len();
    for (k, fault) in schedule.iter().enumerate() {
        let n = size.jobs / waves + usize::from(k < size.jobs % waves);
        chaos.create_wave(n).await;
        // Let the workers claim part of the wave, so the fault hits jobs in flight.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        chaos.log(&format!(
            "injecting {} ({} jobs created so far)",
            fault.label(),
            chaos.expected.len()
        ));
        let began = Instant::now();
        let (detail, ended) = chaos.inject(*fault).await;
        chaos.probe_after(fault.label(), detail, began, ended).await;
    }

    let within = Duration::from_secs(90 + (size.jobs / size.pods) as u64 * 2);
    chaos.log(&format!("waiting up to {within:?} for every job to finish"));
    let jobs = chaos.drain(within).await;
    chaos.check_jobs(&jobs).await;
    chaos.check_leases_released().await;
    chaos.check_health().await;
    for line in &chaos.gone_checks {
        chaos.log(line);
    }
    if chaos.zombies > 0 && chaos.superseded_refused == 0 {
        chaos.violations.push(format!(
            "{} busy insisting worker(s) were frozen past their lease, yet no write of a \
             superseded attempt was seen refused: the fencing check was not exercised",
            chaos.zombies
        ));
    }

    let table = chaos.table();
    println!("\n{table}");
    let _ = std::fs::write(log_dir().join("chaos-figures.txt"), &table);
    assert!(
        chaos.violations.is_empty(),
        "chaos run with seed {} (replay: LEASEHOLD_CHAOS_SEED={}) found {} violation(s):\n  - {}\n\n{table}",
        size.seed,
        size.seed,
        chaos.violations.len(),
        chaos.violations.join("\n  - ")
    );
}
