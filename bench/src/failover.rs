//! Row 12, the dispatcher killed: two controller replicas (leader election on, each with its
//! dispatcher), S sidecar processes with a dispatcher token on one queue, every one waiting in
//! a claim and completing each job at once. Jobs are created at a steady rate; the leading
//! replica is SIGKILLed, and jobs go on being created for longer than the leader Lease.
//!
//! Measured: creation to claim of the jobs created between the kill and the moment the
//! standby, now leading, advertises its dispatcher (claims the fallback answers), how long
//! that took, and creation to claim after it; and, from the sidecars' own
//! `leasehold_claims_total` and `leasehold_claims_offered_total`, which share of the claims of
//! each stretch the dispatcher offered.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use leasehold_testkit::ControllerArgs;

use crate::cluster::{self, Bench};
use crate::fleet::{self, ClaimLoops};
use crate::procs::{self, Proc};

/// Jobs created per second.
pub const RATE: f64 = 10.0;
/// The controller's default leader Lease (`--leader-lease-duration`), in which a standby leads.
pub const LEADER_LEASE: Duration = Duration::from_secs(15);
/// The controller's default `--leader-retry-period`: a standby tries this often.
pub const RETRY_PERIOD: Duration = Duration::from_secs(2);
/// Time allowed for the new leader's writes (its leader Lease, its advert) on this machine.
pub const WRITES: Duration = Duration::from_secs(1);

/// The documented failover of dispatch (docs/protocol.md, "Dispatch"): the last renewal the
/// standby saw was up to one retry period before the kill, it sees it up to one retry period
/// late, takes the Lease at its first try after the leader Lease ran out, and advertises at
/// once: [`LEADER_LEASE`] + 2 x [`RETRY_PERIOD`], plus [`WRITES`].
pub fn failover_bound() -> Duration {
    LEADER_LEASE + RETRY_PERIOD * 2 + WRITES
}

/// What the kill did.
pub struct Failover {
    /// Sidecars waiting on the queue.
    pub sidecars: usize,
    /// From the SIGKILL to the new leader's address in the advert Lease.
    pub advertised_after: Duration,
    /// Creation to claim, ms, of each job created between the kill and the new advert.
    pub during_ms: Vec<f64>,
    /// Claims and offered claims over the sidecars in that stretch.
    pub during: Counts,
    /// Creation to claim, ms, of each job created after the new advert.
    pub after_ms: Vec<f64>,
    /// Claims and offered claims from the new advert to the end.
    pub after: Counts,
}

/// Sums of the sidecars' claim counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    /// `leasehold_claims_total`.
    pub claims: f64,
    /// `leasehold_claims_offered_total`.
    pub offered: f64,
}

impl Counts {
    fn since(self, before: Counts) -> Counts {
        Counts {
            claims: self.claims - before.claims,
            offered: self.offered - before.offered,
        }
    }

    /// The share of the claims the dispatcher offered (NaN without claims).
    pub fn offered_share(&self) -> f64 {
        self.offered / self.claims
    }
}

/// Runs it with `sidecars` sidecars.
pub async fn run(bench: &Bench, sidecars: usize) -> anyhow::Result<Failover> {
    let ns = bench.namespace("bench-failover").await?;
    let queue = "failover";
    let token = fleet::dispatch_token(bench, &ns).await?;
    let mut controllers = Vec::new();
    for id in ["a", "b"] {
        let metrics = procs::free_addr()?;
        let proc = Proc::spawn(
            &bench.leasehold,
            &ControllerArgs::new(&ns)
                .identity(&format!("bench-controller-{id}"))
                .metrics_addr(&metrics)
                .to_args(),
            &bench.kubeconfig,
            &bench.logs,
            &format!("{ns}-controller-{id}"),
        )?;
        controllers.push((proc, format!("http://{metrics}/metrics")));
    }
    fleet::wait_for_advert(bench, &ns).await?;
    let http = procs::sidecar_http();
    let leader = cluster::wait_until("a leading replica", Duration::from_secs(60), || async {
        for (i, (_, metrics)) in controllers.iter().enumerate() {
            let text = http.get(metrics).send().await.ok()?.text().await.ok()?;
            if text.lines().any(|l| l == "leasehold_leader 1") {
                return Some(i);
            }
        }
        None
    })
    .await?;
    let leases: Api<Lease> = Api::namespaced(bench.client.clone(), &ns);
    let old_address = advertised(&leases).await?;
    let token_arg = token.display().to_string();
    let mut scs = Vec::with_capacity(sidecars);
    for i in 0..sidecars {
        scs.push(procs::sidecar_with(
            &bench.leasehold,
            &bench.kubeconfig,
            &bench.logs,
            (&ns, queue, &format!("sidecar-{i}")),
            &["--dispatch-token-file", &token_arg],
        )?);
    }
    for s in &mut scs {
        s.ready(&http, Duration::from_secs(120)).await?;
    }
    let jobs_api: Api<leasehold_core::crd::LeasedJob> = Api::namespaced(bench.client.clone(), &ns);
    let warm = 20;
    let stretch = failover_bound() + Duration::from_secs(8);
    let measured = (stretch.as_secs_f64() * RATE) as usize;
    let loops = ClaimLoops::start(&http, &scs, warm + measured);
    create_paced(&jobs_api, queue, "w", 0..warm).await?;
    loops.wait(warm, Duration::from_secs(60)).await?;
    let before = counts(&http, &scs).await?;

    let killed = Instant::now();
    controllers[leader].0.kill().await;
    let watch_advert = {
        let (leases, http, bases) = (
            leases.clone(),
            http.clone(),
            scs.iter().map(|s| s.base.clone()).collect::<Vec<_>>(),
        );
        tokio::spawn(async move {
            let at =
                cluster::wait_until("a new dispatcher's advert", Duration::from_secs(60), || {
                    let leases = leases.clone();
                    let old = old_address.clone();
                    async move {
                        let now = advertised(&leases).await.ok()?;
                        (!now.is_empty() && now != old).then(Instant::now)
                    }
                })
                .await?;
            let counts = counts_at(&http, &bases).await?;
            anyhow::Ok((at, counts))
        })
    };
    let created = create_paced(&jobs_api, queue, "f", 0..measured).await?;
    loops
        .wait(warm + measured, Duration::from_secs(120))
        .await?;
    let (advertised_at, at_advert) = watch_advert.await.context("the advert watch")??;
    let end = counts(&http, &scs).await?;
    for (c, _) in &mut controllers {
        c.kill().await;
    }
    let claimed_at = loops.claimed_at();
    let (mut during_ms, mut after_ms) = (Vec::new(), Vec::new());
    for (name, at) in &created {
        let Some(claimed) = claimed_at.get(name) else {
            continue;
        };
        let ms = claimed.saturating_duration_since(*at).as_secs_f64() * 1000.0;
        if *at < advertised_at {
            during_ms.push(ms);
        } else {
            after_ms.push(ms);
        }
    }
    Ok(Failover {
        sidecars,
        advertised_after: advertised_at.saturating_duration_since(killed),
        during_ms,
        during: at_advert.since(before),
        after_ms,
        after: end.since(at_advert),
    })
}

/// The address the advert Lease names ("" when none).
async fn advertised(leases: &Api<Lease>) -> anyhow::Result<String> {
    let lease = leases
        .get_opt(leasehold_core::dispatch::ADVERT_LEASE)
        .await
        .context("read the advert Lease")?;
    Ok(lease
        .and_then(|l| l.metadata.annotations)
        .and_then(|a| a.get(leasehold_core::dispatch::ADDRESS_ANNOTATION).cloned())
        .unwrap_or_default())
}

/// Creates `{prefix}-{i}` for each i at [`RATE`]; when each create was answered.
async fn create_paced(
    api: &Api<leasehold_core::crd::LeasedJob>,
    queue: &str,
    prefix: &str,
    range: std::ops::Range<usize>,
) -> anyhow::Result<HashMap<String, Instant>> {
    let start = tokio::time::Instant::now();
    let every = Duration::from_secs_f64(1.0 / RATE);
    let mut created = HashMap::new();
    for (k, i) in range.enumerate() {
        tokio::time::sleep_until(start + every * u32::try_from(k).unwrap_or(u32::MAX)).await;
        let name = format!("{prefix}-{i}");
        cluster::create_with_retry(api, &cluster::job(&name, queue, 60)).await?;
        created.insert(name, Instant::now());
    }
    Ok(created)
}

async fn counts(http: &reqwest::Client, scs: &[procs::Sidecar]) -> anyhow::Result<Counts> {
    let bases: Vec<String> = scs.iter().map(|s| s.base.clone()).collect();
    counts_at(http, &bases).await
}

/// The sidecars' claim counters, summed.
async fn counts_at(http: &reqwest::Client, bases: &[String]) -> anyhow::Result<Counts> {
    let mut sum = Counts::default();
    for base in bases {
        let text = http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .context("a sidecar's /metrics")?
            .text()
            .await?;
        sum.claims += counter(&text, "leasehold_claims_total");
        sum.offered += counter(&text, "leasehold_claims_offered_total");
    }
    Ok(sum)
}

/// The value of an unlabelled counter in a text exposition (0 when absent).
fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_by_their_exact_name() {
        let text = "# TYPE leasehold_claims counter\nleasehold_claims_total 7\n\
                    leasehold_claims_offered_total 5\nleasehold_claims_total_x 9\n";
        assert_eq!(counter(text, "leasehold_claims_total"), 7.0);
        assert_eq!(counter(text, "leasehold_claims_offered_total"), 5.0);
        assert_eq!(counter(text, "leasehold_missing_total"), 0.0);
        let after = Counts {
            claims: 17.0,
            offered: 14.0,
        };
        let share = after
            .since(Counts {
                claims: 7.0,
                offered: 5.0,
            })
            .offered_share();
        assert!((share - 0.9).abs() < 1e-12);
    }
}
