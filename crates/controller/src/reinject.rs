//! Pods that escaped sidecar injection are evicted, so that their owners make them again with
//! the sidecar.
//!
//! The webhook adds the sidecar to pods annotated `leasehold.dev/queue`, and a
//! ValidatingAdmissionPolicy refuses annotated pods without one when the webhook cannot be
//! reached. Both are configured by the chart, and Helm creates webhook configurations and
//! policies after Deployments: a worker Deployment installed in the same release (the
//! chart's example worker), or applied at the same moment (a GitOps sync), can get its pods
//! before either exists. Those pods run a worker with no sidecar to talk to, forever. So
//! each time a replica begins to lead, it lists the pods of the worker namespaces and evicts
//! those [`escaped`] injection (the Eviction API, which respects PodDisruptionBudgets); their
//! ReplicaSet makes them again, now injected. Once the policy exists no such pod can be made,
//! so one pass per term suffices.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{EvictParams, ListParams};
use kube::{Api, Client};

use tokio::time::Instant;

use crate::leader::Leadership;
use leasehold_core::injection::escaped;
use leasehold_core::token::Token;
use leasehold_kube::api::{error_chain, is_status};
use leasehold_kube::health::Health;

/// How often a replica looks whether it began a new term.
const LOOK_EVERY: Duration = Duration::from_secs(1);
/// Wait before a pass that failed is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// How often a leading replica passes again within one term: pods can escape whenever the
/// policy is off (`sidecar.injection.requireInjected=false`) and no controller answers.
pub const PASS_EVERY: Duration = Duration::from_secs(600);

/// How long this replica must have been ready before a pass: an evicted pod is made again at
/// once, and must find the webhook reachable, which needs a ready controller pod behind the
/// admission Service (the kubelet's readiness probe runs every 10 s, then the endpoints
/// propagate). A pod refused meanwhile would leave its ReplicaSet backing off, up to about 16
/// minutes.
pub const READY_FOR: Duration = Duration::from_secs(20);

/// Runs forever: a pass over `namespaces` at the start of each of this replica's terms, then
/// every [`PASS_EVERY`] while it leads, each once it has been ready for [`READY_FOR`] (a
/// failed pass is tried again every 5 s).
pub async fn run(
    client: Client,
    namespaces: Vec<String>,
    leadership: Arc<Leadership>,
    health: Arc<Health>,
) {
    let mut done: Option<(Token, Instant)> = None;
    let mut ready_since: Option<Instant> = None;
    loop {
        tokio::time::sleep(LOOK_EVERY).await;
        if !health.is_ready() {
            ready_since = None;
            continue;
        }
        if ready_since.get_or_insert_with(Instant::now).elapsed() < READY_FOR {
            continue;
        }
        let Some(term) = leadership.token() else {
            continue;
        };
        let due = match &done {
            Some((t, at)) => *t != term || at.elapsed() >= PASS_EVERY,
            None => true,
        };
        if !due {
            continue;
        }
        match pass(&client, &namespaces, &leadership).await {
            Ok(evicted) => {
                if evicted > 0 {
                    tracing::info!(
                        evicted,
                        "Evicted {evicted} pod(s) created without the sidecar they asked for"
                    );
                }
                done = Some((term, Instant::now()));
            }
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "Could not look for pods that escaped sidecar injection; trying again in {} s", RETRY_AFTER.as_secs());
                tokio::time::sleep(RETRY_AFTER).await;
            }
        }
    }
}

/// One pass: evicts the escaped pods of `namespaces` while this replica leads; how many.
///
/// # Errors
/// The first list or eviction that failed (a pod already gone, or whose eviction a
/// PodDisruptionBudget refuses for now (429), is not an error: the next term looks again).
pub async fn pass(
    client: &Client,
    namespaces: &[String],
    leadership: &Leadership,
) -> Result<usize, kube::Error> {
    let mut evicted = 0;
    for ns in namespaces {
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        let listed = pods.list(&ListParams::default()).await?;
        for pod in listed.items.iter().filter(|p| escaped(p)) {
            if !leadership.is_leader() {
                return Ok(evicted);
            }
            let name = pod.metadata.name.clone().unwrap_or_default();
            match pods.evict(&name, &EvictParams::default()).await {
                Ok(_) => {
                    evicted += 1;
                    tracing::info!(pod = %format!("{ns}/{name}"), "Evicted pod {ns}/{name}: it asks for the sidecar (annotation leasehold.dev/queue) but was created without it, before the injection webhook was configured; its owner makes it again, injected");
                }
                Err(e) if is_status(&e, 404) => {}
                Err(e) if is_status(&e, 429) => {
                    tracing::info!(pod = %format!("{ns}/{name}"), "A PodDisruptionBudget holds back the eviction of pod {ns}/{name}, created without its sidecar; the next term tries again");
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok(evicted)
}
