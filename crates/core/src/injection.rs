//! Sidecar injection's names and the one rule the controller applies to pods: which pods were
//! created without the sidecar they asked for. The webhook that adds it lives in the binary
//! (`leasehold::inject`); the controller evicts the pods that escaped it
//! (`leasehold_controller::reinject`).

use k8s_openapi::api::core::v1::Pod;

/// The annotation that asks for the sidecar; its value is the queue the sidecar serves
/// (`spec.queue` of the LeasedJobs: a DNS label, 1 to 63 characters).
pub const QUEUE_ANNOTATION: &str = "leasehold.dev/queue";

/// The annotation the webhook adds to a pod it injected; its value is leasehold's version.
pub const INJECTED_ANNOTATION: &str = "leasehold.dev/sidecar-injected";

/// The sidecar container's name, in the webhook's template and in pods.
pub const SIDECAR_NAME: &str = "leasehold-sidecar";

/// The kinds of owner that make an evicted pod again, as it was meant to be: a Deployment's
/// ReplicaSet, a StatefulSet, a DaemonSet. (A Job counts an evicted pod as a failure, and a
/// bare pod has nothing to make it again.)
pub const REMAKING_OWNERS: [&str; 3] = ["ReplicaSet", "StatefulSet", "DaemonSet"];

/// Whether `pod` escaped injection and can be made again with it: it carries
/// [`QUEUE_ANNOTATION`], has no container named [`SIDECAR_NAME`] (init or not), is neither
/// being deleted nor finished (`Succeeded`, `Failed`), and its controller is one of
/// [`REMAKING_OWNERS`], which makes it again once it is evicted.
///
/// Such a pod was created while the webhook and the policy that refuses it were not yet
/// configured: the chart creates them after its Deployments (Helm installs webhook
/// configurations last), so an example worker installed in the same release races them.
pub fn escaped(pod: &Pod) -> bool {
    let asks = pod
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(QUEUE_ANNOTATION));
    let owned = pod
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && REMAKING_OWNERS.contains(&o.kind.as_str()));
    let deleting = pod.metadata.deletion_timestamp.is_some();
    let finished = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|phase| phase == "Succeeded" || phase == "Failed");
    let carries = pod.spec.as_ref().is_some_and(|spec| {
        spec.containers.iter().any(|c| c.name == SIDECAR_NAME)
            || spec
                .init_containers
                .iter()
                .flatten()
                .any(|c| c.name == SIDECAR_NAME)
    });
    asks && owned && !deleting && !finished && !carries
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn only_owned_pods_that_asked_and_lack_the_sidecar_escaped() {
        let owner = json!([{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "w-1",
            "uid": "u", "controller": true}]);
        let asks = json!({"leasehold.dev/queue": "q"});
        let bare = json!({"containers": [{"name": "worker"}]});
        let injected = json!({"initContainers": [{"name": "leasehold-sidecar"}],
            "containers": [{"name": "worker"}]});
        let cases = [
            (
                json!({"annotations": asks, "ownerReferences": owner}),
                bare.clone(),
                true,
            ),
            (
                json!({"annotations": asks, "ownerReferences": owner}),
                injected,
                false,
            ),
            (json!({"annotations": asks}), bare.clone(), false),
            (json!({"ownerReferences": owner}), bare.clone(), false),
            (
                json!({"annotations": asks, "ownerReferences": owner,
                    "deletionTimestamp": "2026-12-05T10:00:00Z"}),
                bare.clone(),
                false,
            ),
            (
                json!({"annotations": asks, "ownerReferences": [{"apiVersion": "v1",
                    "kind": "ConfigMap", "name": "c", "uid": "u"}]}),
                bare.clone(),
                false,
            ),
            (
                json!({"annotations": asks, "ownerReferences": [{"apiVersion": "batch/v1",
                    "kind": "Job", "name": "j", "uid": "u", "controller": true}]}),
                bare.clone(),
                false,
            ),
        ];
        for (metadata, spec, expected) in cases {
            let p = pod(json!({"metadata": metadata, "spec": spec}));
            assert_eq!(escaped(&p), expected, "{p:?}");
        }
        // A finished pod is left as it is.
        for phase in ["Succeeded", "Failed"] {
            let p = pod(
                json!({"metadata": {"annotations": asks, "ownerReferences": owner},
                "spec": bare, "status": {"phase": phase}}),
            );
            assert!(!escaped(&p), "{phase}");
        }
    }
}
