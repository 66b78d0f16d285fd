//! Row 2, claim throughput: M queued jobs, N claimers each with its own `Worker` (the library
//! the sidecar serves, with its own client and watch, as N sidecars would have), claiming and
//! completing as fast as they can while the real controller runs (but in bound runs, below).
//! Conflicts are counted by the API server: the share of claim writes (PUT leasedjobs/status,
//! the completions' own PUTs aside) answered 409.
//!
//! Dispatched runs (row 2d) are the same with the dispatcher: each `Worker` has a dispatcher
//! token, keeps no copy of the queue and claims what the controller's dispatcher offers it.
//!
//! Limited runs (row 2k) are dispatched runs in a queue with limits: its LeasedQueue sets
//! `maxLeasedPerKey` ([`PER_KEY`]) and every job has one of [`KEYS`] concurrency keys, so
//! every claim first takes a slot Lease of its key (docs/protocol.md, "Limits").
//!
//! Bound runs (row 2b) make the same two writes per job and nothing else, with no Worker, and
//! the controller stopped once the jobs are Queued ([`crate::bound`]); keyed bound runs (row
//! 2bk) make row 2k's three: a slot's, then the same two.
//!
//! Before its clock starts, every run counts the API server's requests for [`IDLE`] while its
//! claimers wait, ready and idle: the writes counted by the second, not by the job.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use futures::{StreamExt as _, TryStreamExt as _};
use kube::api::{Api, PostParams};
use leasehold_core::crd::{LeasedJob, Phase};
use leasehold_core::queue::{LeasedQueue, LeasedQueueSpec};
use leasehold_worker::dispatched::DispatchConfig;
use leasehold_worker::{Worker, WorkerConfig, DEFAULT_SPREAD, DEFAULT_WORKER_TIMEOUT};
use serde_json::json;
use tokio::task::JoinSet;

use crate::claim_mode::{Counts, Mode};
use crate::cluster::{wait_until, Bench, JobWatch};
use crate::conflicts::{claim_writes, part_claim_writes, share};
use crate::counted::CountedClients;
use crate::metrics::{self, Key, Requests};
use crate::procs::{self, CpuWindow};

/// Limited runs: the jobs' concurrency keys, `tenant-0` to `tenant-9`, in turn ...
pub const KEYS: usize = 10;
/// ... and the queue's `maxLeasedPerKey`: 40 slots in all, more than the most claimers (32),
/// so that the run measures what the slots cost rather than claimers waiting for a key.
pub const PER_KEY: i32 = 4;

/// How long a run's claimers wait, ready and idle, before its clock starts, while the API
/// server's requests are counted: the writes it counts by the second whether or not a claim
/// runs ([`Claims::background`]).
pub const IDLE: Duration = Duration::from_secs(4);

/// The claim throughput at one N.
pub struct Claims {
    /// Concurrent claimers.
    pub claimers: usize,
    /// The round (0-based): each round has a namespace and queue of its own.
    pub round: usize,
    /// How the claimers found their jobs.
    pub mode: Mode,
    /// Jobs claimed and completed.
    pub jobs: usize,
    /// Jobs claimed (and completed) per second.
    pub per_second: f64,
    /// Share of claim writes answered 409 Conflict.
    pub conflict_share: f64,
    /// The same over the first quarter of the jobs (claimers start cold, their claim windows
    /// at spread), the middle half, the last quarter but the last N jobs (the queue draining
    /// below what the windows had grown to) and the last N jobs (claimers outnumber the jobs),
    /// where a part's claim writes are the claims that landed in it and its 409s
    /// ([`part_claim_writes`]): a part in which no claim landed reads 100 % from one 409.
    /// NaN when the run ended before the metrics were scraped at those marks (a fast run with
    /// few claimers: they are scraped between jobs).
    pub conflict_split: [f64; 4],
    /// How long each of those four parts of the run took (the scrape at a mark falls between
    /// jobs, so a part's time includes the scrape's); NaN where its marks were not reached.
    pub split_seconds: [f64; 4],
    /// All requests counted by the API server during the run.
    pub requests: Requests,
    /// All requests counted by the API server in the [`IDLE`] window just before the run,
    /// while its claimers waited and nothing was claimed.
    pub idle: Requests,
    /// That window's length, in seconds.
    pub idle_seconds: f64,
    /// The requests the claimers' own clients sent during the run ([`crate::counted`]): all
    /// of them and nothing else, whatever else the API server counted meanwhile.
    pub by_claimers: Requests,
    /// Claims and completions that failed (should be 0).
    pub errors: u64,
    /// CPU by process during the run, in cores.
    pub cpu: Vec<(String, f64)>,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl Claims {
    /// Of the requests matching `matches` counted during the run, about how many the API
    /// server would have counted in that time with no claim running: their rate in the idle
    /// window before the run ([`IDLE`]) times the run's length. 0 without such a window.
    pub fn background(&self, matches: impl Fn(&Key) -> bool) -> f64 {
        if self.idle_seconds <= 0.0 {
            return 0.0;
        }
        self.idle.sum(matches) / self.idle_seconds * self.elapsed.as_secs_f64()
    }
}

/// Runs M = `jobs` jobs through N = `claimers` claimers, in the namespace
/// `bench-claim<N>-<round>` (`bench-claimd…` dispatched, `bench-claimk…` limited,
/// `bench-claimb…` the bound, `bench-claimbk…` the keyed bound).
pub async fn run(
    bench: &Bench,
    claimers: usize,
    jobs: usize,
    round: usize,
    mode: Mode,
) -> anyhow::Result<Claims> {
    let ns = bench
        .namespace(&format!("bench-claim{}{claimers}-{round}", mode.part()))
        .await?;
    let queue = "claim";
    let dispatched = matches!(mode, Mode::Dispatched | Mode::Limited);
    let bound = matches!(mode, Mode::Bound | Mode::BoundKeyed);
    let dispatch = if dispatched {
        Some(DispatchConfig {
            token_file: crate::fleet::dispatch_token(bench, &ns).await?,
            advert_namespace: ns.clone(),
        })
    } else {
        None
    };
    let mut controller = procs::controller(&bench.leasehold, &bench.kubeconfig, &bench.logs, &ns)?;
    if dispatched {
        crate::fleet::wait_for_advert(bench, &ns).await?;
    }
    if mode == Mode::Limited {
        limit_keys(bench, &ns, queue).await?;
        create_keyed_jobs(bench, &ns, queue, jobs).await?;
    } else {
        bench.create_jobs(&ns, queue, "j", jobs, 60, 16).await?;
    }
    {
        let watch = JobWatch::start(bench.client.clone(), &ns).await?;
        let queued = watch.wait_phase(jobs, Phase::Queued, Duration::from_secs(300));
        controller.while_running(queued).await?;
    }
    // The bound's claimers need nothing of the controller once the jobs are Queued; they
    // list the jobs after the idle window below, when no write of the controller is in flight.
    if bound {
        controller.kill().await;
    }
    let counted = CountedClients::default();
    let mut workers = Vec::new();
    // Aborted when dropped, as the claim loops' JoinSet is: a run that fails half-way leaves
    // no claimer or watch running into the next measurement.
    let mut watches = procs::AbortOnDrop::default();
    for i in 0..if bound { 0 } else { claimers } {
        let (w, task) = Worker::start(
            counted.client(bench.new_client()?),
            WorkerConfig {
                namespace: ns.clone(),
                queue: queue.into(),
                identity: format!("claimer-{i}"),
                spread: DEFAULT_SPREAD,
                worker_timeout: DEFAULT_WORKER_TIMEOUT,
                dispatch: dispatch.clone(),
            },
            std::sync::Arc::new(leasehold_kube::recorder::NoRecorder),
        );
        workers.push(w);
        watches.0.push(task);
    }
    wait_until(
        "the claimers' watches",
        Duration::from_secs(120),
        || async { workers.iter().all(Worker::is_ready).then_some(()) },
    )
    .await?;
    if mode == Mode::Limited {
        // A claimer that had not read the LeasedQueue, or the controller's confirmation of its
        // limits, would wait for them: every one sees both first.
        wait_until(
            "the claimers to read the LeasedQueue",
            Duration::from_secs(60),
            || async {
                workers
                    .iter()
                    .all(|w| {
                        w.queue_object().is_some_and(|q| {
                            q.spec.limits() && leasehold_core::adoption::adopted(&q)
                        })
                    })
                    .then_some(())
            },
        )
        .await?;
    }

    // What the API server counts while no claim runs (the control plane's own Leases and the
    // controller's leader Lease, renewed by the second): writes by the second, not by the
    // job, which a longer run would otherwise count as more writes per job.
    let idle_from = metrics::scrape(&bench.client).await?;
    let idle_start = Instant::now();
    tokio::time::sleep(IDLE).await;
    let idle = metrics::scrape(&bench.client).await?.since(&idle_from);
    let idle_seconds = idle_start.elapsed().as_secs_f64();
    let bound_claimers = if bound {
        crate::bound::ready(bench, &ns, claimers, &counted, mode).await?
    } else {
        Vec::new()
    };

    let m0 = metrics::scrape(&bench.client).await?;
    let mut groups = bench.controlplane.groups();
    groups.push(("leasehold controller".into(), vec![controller.pid()]));
    groups.push((
        "claimers (leasehold-bench)".into(),
        vec![std::process::id()],
    ));
    let cpu = CpuWindow::start(groups);
    let counts = Counts::default();
    let sent_before = counted.read();
    let t0 = Instant::now();
    let total = jobs as u64;
    let mut tasks = JoinSet::new();
    crate::bound::start(bound_claimers, &counts, &mut tasks);
    start_workers(&workers, total, &counts, &mut tasks);
    let deadline = Duration::from_secs(600);
    let marks = [
        total / 4,
        total * 3 / 4,
        total.saturating_sub(claimers as u64).max(total * 3 / 4),
    ];
    let mut at_marks: Vec<Requests> = Vec::new();
    let mut mark_times: Vec<Duration> = Vec::new();
    // Claims landed when each mark was scraped: a part's claim writes are those and its 409s.
    let mut mark_claimed: Vec<u64> = Vec::new();
    while counts.completed.load(Ordering::Relaxed) < total {
        let done = counts.completed.load(Ordering::Relaxed);
        while at_marks.len() < marks.len() && done >= marks[at_marks.len()] {
            // Read just before the scrape: the API server counts a request as it answers it,
            // and renders its counters as the scrape begins, before the page is sent and read.
            mark_times.push(t0.elapsed());
            mark_claimed.push(counts.claimed.load(Ordering::Relaxed));
            at_marks.push(metrics::scrape(&bench.client).await?);
        }
        if bound {
            // A bound claimer does not try a job again: a failed write would leave the run
            // waiting for it.
            if counts.errors.load(Ordering::Relaxed) > 0 {
                bail!("bound run with {claimers} claimers: a claim or completion failed");
            }
        } else {
            controller.check_running()?;
        }
        if t0.elapsed() > deadline {
            bail!(
                "claim run with {claimers} claimers: only {} of {jobs} jobs done after {deadline:?}",
                counts.completed.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = t0.elapsed();
    let claimed = counts.claimed.load(Ordering::Relaxed);
    let cpu = cpu.finish();
    // The claimers' count first: a write of theirs answered between the two readings is then
    // in the API server's count only, so everyone else's (the difference) errs high, never
    // low.
    let by_claimers = counted.read().since(&sent_before);
    let m1 = metrics::scrape(&bench.client).await?;
    let requests = m1.since(&m0);
    while let Some(t) = tasks.join_next().await {
        t?;
    }
    drop(watches);
    drop(workers);
    controller.kill().await;
    let whole = claim_writes(&requests, total as f64);
    let mut conflict_split = [f64::NAN; 4];
    let mut split_seconds = [f64::NAN; 4];
    if mark_times.len() == 3 {
        let points = [
            Duration::ZERO,
            mark_times[0],
            mark_times[1],
            mark_times[2],
            elapsed,
        ];
        for (i, split) in split_seconds.iter_mut().enumerate() {
            *split = (points[i + 1] - points[i]).as_secs_f64();
        }
    }
    if at_marks.len() == 3 {
        let points = [&m0, &at_marks[0], &at_marks[1], &at_marks[2], &m1];
        let landed = [
            0,
            mark_claimed[0],
            mark_claimed[1],
            mark_claimed[2],
            claimed,
        ];
        for (i, split) in conflict_split.iter_mut().enumerate() {
            let part = points[i + 1].since(points[i]);
            *split = share(part_claim_writes(&part, (landed[i + 1] - landed[i]) as f64));
        }
    }
    Ok(Claims {
        claimers,
        round,
        mode,
        jobs,
        per_second: jobs as f64 / elapsed.as_secs_f64(),
        conflict_split,
        split_seconds,
        conflict_share: share(whole),
        requests,
        idle,
        idle_seconds,
        by_claimers,
        errors: counts.errors.load(Ordering::Relaxed),
        cpu,
        elapsed,
    })
}

/// Starts one claim loop per Worker of `workers`: claim (waiting up to 1 s for a job), then
/// complete, until `total` jobs are completed, counted in `counts`.
fn start_workers(workers: &[Worker], total: u64, counts: &Counts, tasks: &mut JoinSet<()>) {
    for w in workers {
        let (w, counts) = (w.clone(), counts.clone());
        tasks.spawn(async move {
            while counts.completed.load(Ordering::Relaxed) < total {
                match w.claim(Duration::from_secs(1)).await {
                    Ok(Some(c)) => {
                        counts.claimed.fetch_add(1, Ordering::Relaxed);
                        match w
                            .complete(&c.name, c.token.as_str(), json!({"ok": true}))
                            .await
                        {
                            Ok(_) => {
                                counts.completed.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "complete failed");
                                counts.errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "claim failed");
                        counts.errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
    }
}

/// Creates the LeasedQueue `queue` of a limited run: [`PER_KEY`] Leased jobs per key.
async fn limit_keys(bench: &Bench, ns: &str, queue: &str) -> anyhow::Result<()> {
    let api: Api<LeasedQueue> = Api::namespaced(bench.client.clone(), ns);
    let object = LeasedQueue::new(
        queue,
        LeasedQueueSpec {
            max_leased_per_key: Some(PER_KEY),
            ..Default::default()
        },
    );
    api.create(&PostParams::default(), &object)
        .await
        .with_context(|| format!("create LeasedQueue {ns}/{queue}"))?;
    Ok(())
}

/// Creates `jobs` jobs `j-<i>` of `queue`, job i with the key `tenant-<i mod KEYS>`.
async fn create_keyed_jobs(
    bench: &Bench,
    ns: &str,
    queue: &str,
    jobs: usize,
) -> anyhow::Result<()> {
    let api: Api<LeasedJob> = Api::namespaced(bench.client.clone(), ns);
    futures::stream::iter(0..jobs)
        .map(|i| {
            let api = api.clone();
            async move {
                let mut job = crate::cluster::job(&format!("j-{i}"), queue, 60);
                job.spec.concurrency_key = Some(format!("tenant-{}", i % KEYS));
                crate::cluster::create_with_retry(&api, &job).await
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease_puts(n: u32) -> Requests {
        Requests::parse(&format!(
            "apiserver_request_total{{code=\"200\",group=\"coordination.k8s.io\",resource=\"leases\",scope=\"resource\",subresource=\"\",verb=\"PUT\",version=\"v1\"}} {n}\n"
        ))
    }

    fn run(requests: Requests, idle: Requests, idle_seconds: f64, seconds: f64) -> Claims {
        Claims {
            claimers: 8,
            round: 0,
            mode: Mode::Limited,
            jobs: 1000,
            per_second: 1000.0 / seconds,
            conflict_share: 0.0,
            conflict_split: [f64::NAN; 4],
            split_seconds: [f64::NAN; 4],
            requests,
            idle,
            idle_seconds,
            by_claimers: Requests::default(),
            errors: 0,
            cpu: Vec::new(),
            elapsed: Duration::from_secs_f64(seconds),
        }
    }

    #[test]
    fn writes_counted_by_the_second_while_idle_are_taken_as_the_runs_background() {
        // 2 Lease writes in a 4 s idle window: 0.5 a second, so 5 in a 10 s run.
        let c = run(lease_puts(1005), lease_puts(2), 4.0, 10.0);
        assert!((c.background(Key::is_write) - 5.0).abs() < 1e-9);
        // Only what matches is counted; without an idle window there is no background.
        assert_eq!(c.background(|k| k.resource == "leasedjobs"), 0.0);
        assert_eq!(
            run(lease_puts(1005), lease_puts(2), 0.0, 10.0).background(Key::is_write),
            0.0
        );
    }

    #[test]
    fn writes_per_job_net_of_the_background_add_up_over_rounds() {
        // Two rounds of 1000 jobs, each with one Lease write per job and some by the second: 3
        // (0.5/s for 6 s) and 2 (0.25/s for 8 s).
        let first = run(lease_puts(1003), lease_puts(2), 4.0, 6.0);
        let mut second = run(lease_puts(1002), lease_puts(1), 4.0, 8.0);
        second.round = 1;
        let runs = [&first, &second];
        let at = crate::paired::at_each_n(&[], &runs);
        assert_eq!(at.len(), 1);
        assert!((at[0].background(Key::is_write) - 5.0).abs() < 1e-9);
        assert!((at[0].net_per_job(Key::is_write) - 1.0).abs() < 1e-9);
        // Without the correction the longer runs seem to cost more per job.
        assert!(at[0].requests.sum(Key::is_write) / 2000.0 > 1.002);
    }
}
