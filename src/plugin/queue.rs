//! `kubectl leasehold pause|resume QUEUE`: sets spec.paused of the queue's LeasedQueue
//! ([`leasehold_core::queue`]).

use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::json;

use super::{api_error, PluginError};
use leasehold_core::queue::LeasedQueue;
use leasehold_kube::api::Clients;

/// The field manager of the plugin's writes to LeasedQueues.
pub const FIELD_MANAGER: &str = "kubectl-leasehold";

/// What [`set_paused`] did.
#[derive(Debug)]
pub enum Outcome {
    /// The LeasedQueue as written (created if it did not exist, for a pause).
    Written(Box<LeasedQueue>),
    /// A resume of a queue with no LeasedQueue: it is not paused; nothing was written.
    NoObject,
}

/// Pauses (`paused`) or resumes queue `queue` of `namespace`: a server-side apply of
/// spec.paused, owned by [`FIELD_MANAGER`], which creates the LeasedQueue when a pause finds
/// none. A resume of a queue with no LeasedQueue writes nothing ([`Outcome::NoObject`]).
///
/// # Errors
/// [`PluginError::Api`], with the API server's refusal (a name that is not a DNS label is
/// refused by the CRD's rule, which names the field).
pub async fn set_paused(
    clients: &Clients,
    namespace: &str,
    queue: &str,
    paused: bool,
) -> Result<Outcome, PluginError> {
    let api: Api<LeasedQueue> = Api::namespaced(clients.requests.clone(), namespace);
    let what = |doing: &str| format!("{doing} LeasedQueue {namespace}/{queue}");
    if !paused
        && api
            .get_opt(queue)
            .await
            .map_err(|e| api_error(what("reading"), &e))?
            .is_none()
    {
        return Ok(Outcome::NoObject);
    }
    let patch = json!({
        "apiVersion": "leasehold.dev/v1alpha1",
        "kind": "LeasedQueue",
        "metadata": {"name": queue, "namespace": namespace},
        "spec": {"paused": paused},
    });
    let written = api
        .patch(
            queue,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(|e| api_error(what(if paused { "pausing" } else { "resuming" }), &e))?;
    Ok(Outcome::Written(Box::new(written)))
}
