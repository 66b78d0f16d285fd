//! Chaos: many jobs run by real Python workers (examples/worker.py) beside real sidecars, under
//! two controller replicas, while workers, sidecars and the leader are frozen (SIGSTOP) and
//! killed (SIGKILL), the API server restarts after SIGTERM and after SIGKILL, etcd restarts,
//! etcd is compacted so that watches resumed from an old resourceVersion get 410 Gone, one
//! sidecar's connection to the API server stalls (bytes held, no reset) for longer than a lease,
//! and the dispatcher is hit: the sidecars claim through it (each controller's dispatcher is
//! reached through a relay), so the leader's SIGSTOP and SIGKILL are its faults too, and besides
//! them its path from the sidecars stalls, and both controllers are killed and restarted, so
//! the new leader starts with an empty view.
//!
//! One job in four carries a concurrency key (two keys) of a queue limited to one Leased job
//! per key: the limit is asserted at every event of the API server's watch of the jobs.
//!
//! It asserts: no job lost (every job Succeeded), no result accepted twice, no write accepted
//! from a superseded attempt (each attempt ends exactly once: one accepted complete, fail or
//! release, or one expiry), every result equal to what the payload determines, no job Lease left
//! naming a token its job still holds or a newer attempt than its job's (nothing blocks a claim),
//! every process still healthy; every busy insisting worker frozen past its lease either ended
//! its attempt (answered 200) before the attempt expired or, once it expired, wrote anyway and
//! had a write of that attempt refused with 409 (the fencing exercised); and after each fault
//! ends, once the API
//! server is ready and accepts writes, a controller leader renews its Lease within the leader
//! Lease + 1 s (a fault that cost the leader its term shows how long that took), and then:
//! dispatch (create -> claimed by a worker waiting in a long poll) <= 1 s and
//! expiry (last renewTime of a killed holder -> requeue seen) <= leaseDurationSeconds + 1 s;
//! and while a dispatcher fault holds (the leader frozen or killed, the dispatcher's path
//! stalled, both replicas dead), dispatch <= 1 s too: claims do not wait on the dispatcher.
//!
//! Sizes: by default (CI) 80 jobs, four pods, one pass over the fault schedule, about three
//! and a half minutes. LEASEHOLD_CHAOS_LONG=1: 1200 jobs, six pods, three passes. LEASEHOLD_CHAOS_JOBS
//! sets the number of jobs. The schedule comes from a seeded RNG; the seed is printed first,
//! and LEASEHOLD_CHAOS_SEED replays it. The figures table is printed to stdout (shown on failure, or
//! with `-- --nocapture`) and written to chaos-figures.txt in the test log directory.
//!
//! A test binary of its own: every fault hits the control plane all tests share.

mod chaos_support;

use chaos_support::*;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, WatchEvent, WatchParams};
use kube::{Api, Client, ResourceExt};
use leasehold_controller::leader::HOLDER_POD_ANNOTATION;
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::fence::REASON_LEASE_EXPIRED;
use leasehold_core::lease::lease_name;
use leasehold_testkit::faults::{compact_etcd, restart_etcd, Relay};
use leasehold_testkit::workers::{spawn_worker, EventLog, WorkerEvent};
use leasehold_testkit::*;
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
/// The concurrency keys of the limited jobs, and the queue's maxLeasedPerKey: the limit binds
/// (the pods outnumber it), and is asserted at every event of the API server's watch.
const KEYS: usize = 2;
const PER_KEY: usize = 1;
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
    DispatcherStall,
    DispatchersRestart,
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
    Fault::DispatcherStall,
    Fault::DispatchersRestart,
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
            Fault::DispatcherStall => "dispatcher stall",
            Fault::DispatchersRestart => "dispatchers restart",
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
    /// Create -> claimed, for a probe job created while a dispatcher fault held.
    during: Option<Duration>,
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
    /// Per controller replica (same index): the port its dispatcher listens on, and the relay
    /// in front of it, which is the address it advertises.
    dispatchers: Vec<(u16, Relay)>,
    /// Every sidecar's flags (the dispatcher token among them).
    sidecar_flags: Vec<String>,
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
    /// A compaction's checks still to make once its probes ran: the count of 410 lines per
    /// process before it, the revision compacted, and a resourceVersion from before it.
    pending_gone_check: Option<(std::collections::BTreeMap<String, usize>, i64, String)>,
    /// The dispatch probe made during the fault being injected, for its row.
    during: Option<Duration>,
    /// Busy `--insist` workers frozen past their lease, each judged at the end by what its
    /// attempt became ([`Zombie`]).
    zombies: Vec<Zombie>,
    started: Instant,
}

/// An `--insist` worker frozen past its lease while it seemed to hold `job`'s `attempt`.
/// If the attempt expired meanwhile, the worker's late result is a superseded write, and the
/// sidecar and the API server must refuse it with 409. If the worker ended the attempt itself
/// (the freeze caught it sending its result), there is nothing to refuse.
struct Zombie {
    /// The worker's `--name`.
    worker: String,
    job: String,
    attempt: i64,
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

    /// Creates a job, retrying for up to 30 s; returns when the successful create started.
    async fn create(&self, manifest: Value) -> Instant {
        let api = self.jobs.clone();
        let mut manifest = manifest;
        manifest["apiVersion"] = json!("leasehold.dev/v1alpha1");
        manifest["kind"] = json!("LeasedJob");
        let job: LeasedJob = serde_json::from_value(manifest).expect("job manifest");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let sent = Instant::now();
            match api.create(&Default::default(), &job).await {
                // Dispatch counts from when the job exists: the answer to its create (the API
                // server's own latency for the create is not dispatch).
                Ok(_) => return Instant::now(),
                Err(kube::Error::Api(s)) if s.code == 409 => return sent,
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
            let mut manifest = json!({
                "metadata": {"name": name},
                "spec": {"queue": "work", "leaseDurationSeconds": LEASE_SECONDS, "maxAttempts": 50,
                    "payload": {"task": task, "file": file, "chunkBytes": CHUNK_BYTES,
                        "chunkDelaySeconds": CHUNK_DELAY}}
            });
            // One job in four is limited: KEYS keys, at most PER_KEY Leased each.
            if k % 4 == 1 {
                manifest["spec"]["concurrencyKey"] = json!(format!("key-{}", (k / 4) % KEYS));
            }
            self.create(manifest).await;
            self.expected.insert(name, expected_result(task, file));
        }
    }

    fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "{:<19} {:>8} {:>11} {:>12} {:>10} {:>9}  detail",
            "fault", "lasted s", "recover s", "dispatch ms", "during ms", "expiry s"
        );
        for f in &self.figures {
            let _ = writeln!(
                t,
                "{:<19} {:>8} {:>11} {:>12} {:>10} {:>9}  {}",
                f.fault,
                secs(f.lasted),
                opt_s(f.recover),
                opt_ms(f.dispatch),
                opt_ms(f.during),
                opt_s(f.expiry),
                f.detail
            );
        }
        let _ = writeln!(
            t,
            "bounds: dispatch (after a fault, and during a dispatcher fault) <= {} ms, expiry <= {} s (leaseDurationSeconds {} + {} s)",
            DISPATCH_BOUND.as_millis(),
            LEASE_SECONDS as u64 + EXPIRY_SLACK.as_secs(),
            LEASE_SECONDS,
            EXPIRY_SLACK.as_secs()
        );
        t
    }
}

/// Starts the controller replica `id`, its dispatcher listening on `dispatcher`'s port and
/// advertising its relay.
fn spawn_controller(ns: &str, id: &str, dispatcher: &(u16, Relay)) -> Proc {
    let listen = format!("127.0.0.1:{}", dispatcher.0);
    let advertise = format!("127.0.0.1:{}", dispatcher.1.port);
    let mut args: Vec<&str> = ELECTION.to_vec();
    args.extend([
        "--dispatch-listen",
        &listen,
        "--dispatch-advertise",
        &advertise,
    ]);
    controller_with(ns, id, &args)
}

/// Under chaos, no job is lost or accepted twice, and dispatch and expiry recover.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_job_lost_or_accepted_twice_under_chaos() {
    let size = Size::from_env();
    println!(
        "chaos: seed {} (LEASEHOLD_CHAOS_SEED={} replays it), {} jobs, {} pods, {} pass(es)",
        size.seed, size.seed, size.jobs, size.pods, size.rounds
    );
    let Fixture { client, ns } = fixture!("chaos");
    // The queue's limit, and a watch that checks it at every state the API server shows.
    let queue: leasehold_core::queue::LeasedQueue = serde_json::from_value(json!({
        "apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedQueue",
        "metadata": {"name": "work", "namespace": ns.name},
        "spec": {"maxLeasedPerKey": PER_KEY},
    }))
    .unwrap();
    Api::<leasehold_core::queue::LeasedQueue>::namespaced(client.clone(), &ns.name)
        .create(&Default::default(), &queue)
        .await
        .unwrap();
    let (peaks, peaks_task) =
        leasehold_testkit::peaks::follow(Api::namespaced(client.clone(), &ns.name), Some(PER_KEY));
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

    let dispatchers: Vec<(u16, Relay)> = (0..2)
        .map(|_| {
            let port = free_port();
            (port, Relay::start(port))
        })
        .collect();
    let controllers = ["ctl-a", "ctl-b"]
        .iter()
        .zip(&dispatchers)
        .map(|(id, d)| (id.to_string(), spawn_controller(&ns.name, id, d)))
        .collect();
    let token = dispatch_token_file(&ns.name);
    let mut sidecar_flags: Vec<String> = SIDECAR_FLAGS.iter().map(|f| f.to_string()).collect();
    sidecar_flags.extend(["--dispatch-token-file".into(), token.display().to_string()]);
    let flags: Vec<&str> = sidecar_flags.iter().map(String::as_str).collect();
    let relay = Relay::start(leasehold_testkit::faults::apiserver_port());
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
            &flags,
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
    let probe = Sidecar::start(&ns.name, "dispatch-probe", "probe-dispatch", &flags[2..]).await;
    let mut chaos = Chaos {
        jobs: Api::namespaced(client.clone(), &ns.name),
        leases: Api::namespaced(client.clone(), &ns.name),
        client: client.clone(),
        ns: ns.name.clone(),
        controllers,
        dispatchers,
        sidecar_flags,
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
        pending_gone_check: None,
        during: None,
        zombies: Vec::new(),
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
        chaos.finish_gone_check().await;
    }

    let within = Duration::from_secs(90 + (size.jobs / size.pods) as u64 * 2);
    chaos.log(&format!("waiting up to {within:?} for every job to finish"));
    let jobs = chaos.drain(within).await;
    chaos.check_jobs(&jobs).await;
    chaos.check_no_lease_blocks_its_job().await;
    chaos.check_health().await;
    for line in &chaos.gone_checks {
        chaos.log(line);
    }
    peaks_task.abort();
    let peaks = peaks.lock().unwrap().clone();
    for (key, n, job) in &peaks.over {
        chaos.violations.push(format!(
            "{n} jobs of key {key} Leased at once (maxLeasedPerKey {PER_KEY}), at the event of {job}"
        ));
    }
    chaos.log(&format!(
        "limits: at most {:?} Leased at once per key (limit {PER_KEY})",
        peaks.per_key
    ));
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
