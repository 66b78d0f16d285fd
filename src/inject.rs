//! Sidecar injection: a mutating admission webhook, served by the controller's admission
//! server, that adds leasehold's native sidecar to every pod created with the annotation
//! [`QUEUE_ANNOTATION`] (`leasehold.dev/queue: <queue>`), so that a worker Deployment needs
//! that one annotation instead of a hand-written sidecar (as Linkerd's `linkerd.io/inject` or
//! Vault's `vault.hashicorp.com/agent-inject` do for theirs).
//!
//! What is added comes from a [`Sidecar`] template (a JSON file the chart renders from its
//! values: image, probes, resources, identity, the dispatcher's namespace); the webhook only
//! sets what differs per pod:
//! - the sidecar container, appended to `spec.initContainers` (a native sidecar: it starts
//!   after the pod's own init containers and before its containers, and stops after them),
//!   with `LEASEHOLD_QUEUE` set to the annotation's value and the resources of
//!   [`RESOURCE_ANNOTATIONS`] when the pod sets them;
//! - the template's volumes;
//! - the template's worker environment (`LEASEHOLD_SIDECAR`) in each container that does not
//!   set it;
//! - the template's ServiceAccount, when the pod runs as `default` (the sidecar's RBAC and
//!   the admission policies are bound to it);
//! - the annotation [`INJECTED_ANNOTATION`], with the version that injected it.
//!
//! A pod that already has a container named [`SIDECAR_NAME`] is left as it is (a hand-written
//! sidecar, or a second call). A pod without the annotation, or any other request, is allowed
//! unchanged. A bad annotation value, or a pod volume named like one of the template's, is
//! refused with 422 naming the pod, the annotation or volume, the value and the rule: the pod
//! is not created half-injected. The protocol is `admission.k8s.io/v1` AdmissionReview with a
//! `JSONPatch` (RFC 6902) response ("Dynamic Admission Control", kubernetes.io).

use std::path::Path;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use base64::Engine as _;
use k8s_openapi::api::core::v1::{Container, EnvVar, Volume};
use leasehold_core::crd::is_dns_label;
use leasehold_core::Category;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use thiserror::Error;
use tokio::sync::Semaphore;

use crate::review::{self, deny, envelope, ReviewError, MAX_REVIEW_BYTES};

/// The path the injection webhook serves (POST, `Content-Type: application/json`).
pub const PATH: &str = "/mutate/pods";

pub use leasehold_core::injection::{INJECTED_ANNOTATION, QUEUE_ANNOTATION, SIDECAR_NAME};

/// Annotations that set the injected sidecar's resources for one pod, each a Kubernetes
/// quantity: (annotation, `requests` or `limits`, resource).
pub const RESOURCE_ANNOTATIONS: [(&str, &str, &str); 4] = [
    ("leasehold.dev/sidecar-cpu-request", "requests", "cpu"),
    ("leasehold.dev/sidecar-cpu-limit", "limits", "cpu"),
    ("leasehold.dev/sidecar-memory-request", "requests", "memory"),
    ("leasehold.dev/sidecar-memory-limit", "limits", "memory"),
];

/// What the webhook adds to a pod, read from the JSON file `--inject-sidecar` names:
/// `{"container": Container, "volumes": [Volume], "serviceAccountName": string,
/// "workerEnv": [EnvVar], "namespaces": [string]}` (the shapes of `core/v1`; the chart
/// renders it from its values). `namespaces` are the worker namespaces, whose pods that
/// escaped injection the leading controller evicts (`leasehold_controller::reinject`).
#[derive(Clone, Debug)]
pub struct Sidecar {
    container: Value,
    volumes: Vec<Value>,
    volume_names: Vec<String>,
    service_account_name: String,
    worker_env: Vec<Value>,
    namespaces: Vec<String>,
    ports: Vec<i32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SidecarFile {
    container: Container,
    #[serde(default)]
    volumes: Vec<Volume>,
    service_account_name: String,
    #[serde(default)]
    worker_env: Vec<EnvVar>,
    #[serde(default)]
    namespaces: Vec<String>,
}

/// Why a sidecar template cannot be used.
#[derive(Debug, Error)]
pub enum TemplateError {
    /// The file could not be read.
    #[error("cannot read the sidecar template {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The text is not a template of the documented shape.
    #[error("the sidecar template is not {{\"container\", \"volumes\", \"serviceAccountName\", \"workerEnv\", \"namespaces\"}} of core/v1 shapes: {0}")]
    Shape(#[source] serde_json::Error),
    /// A field breaks a rule.
    #[error("the sidecar template's {field} is {value:?}: {rule}")]
    Field {
        /// The field, e.g. `container.name`.
        field: &'static str,
        /// Its value.
        value: String,
        /// The rule it breaks.
        rule: &'static str,
    },
}

impl Sidecar {
    /// Reads and checks the template file at `path`.
    ///
    /// # Errors
    /// [`TemplateError`] naming the file, or the field, its value and the rule.
    pub fn load(path: &Path) -> Result<Sidecar, TemplateError> {
        let text = std::fs::read(path).map_err(|source| TemplateError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Sidecar::from_json(&text)
    }

    /// Checks a template given as JSON text: the container is named [`SIDECAR_NAME`] with
    /// `restartPolicy: Always` (a native sidecar, Kubernetes 1.29 or later), volume names
    /// are distinct, and the ServiceAccount's name is a DNS subdomain.
    ///
    /// # Errors
    /// [`TemplateError::Shape`] or [`TemplateError::Field`].
    pub fn from_json(text: &[u8]) -> Result<Sidecar, TemplateError> {
        let file: SidecarFile = serde_json::from_slice(text).map_err(TemplateError::Shape)?;
        if file.container.name != SIDECAR_NAME {
            return Err(TemplateError::Field {
                field: "container.name",
                value: file.container.name,
                rule: "must be leasehold-sidecar, the name the webhook and the admission policy look for",
            });
        }
        let restart = file.container.restart_policy.clone().unwrap_or_default();
        if restart != "Always" {
            return Err(TemplateError::Field {
                field: "container.restartPolicy",
                value: restart,
                rule: "must be Always: the sidecar is a native sidecar, which starts before the pod's containers and stops after them",
            });
        }
        let mut volume_names: Vec<String> = Vec::new();
        for volume in &file.volumes {
            if volume_names.contains(&volume.name) {
                return Err(TemplateError::Field {
                    field: "volumes[].name",
                    value: volume.name.clone(),
                    rule: "must be distinct",
                });
            }
            volume_names.push(volume.name.clone());
        }
        let account = &file.service_account_name;
        if account.is_empty() || account.len() > 253 || !account.split('.').all(is_dns_label) {
            return Err(TemplateError::Field {
                field: "serviceAccountName",
                value: account.clone(),
                rule: "must be a DNS subdomain (RFC 1123), the name of the workers' ServiceAccount",
            });
        }
        if let Some(bad) = file.namespaces.iter().find(|ns| !is_dns_label(ns)) {
            return Err(TemplateError::Field {
                field: "namespaces[]",
                value: bad.clone(),
                rule: "must be a namespace name (a DNS label)",
            });
        }
        let mut ports: Vec<i32> = file
            .container
            .ports
            .iter()
            .flatten()
            .map(|p| p.container_port)
            .collect();
        for env in file.container.env.iter().flatten() {
            let port = env
                .value
                .as_deref()
                .and_then(|v| v.rsplit_once(':'))
                .and_then(|(_, port)| port.parse::<i32>().ok());
            if let (true, Some(port)) = (
                env.name.ends_with("_LISTEN") || env.name.ends_with("_ADDR"),
                port,
            ) {
                ports.push(port);
            }
        }
        ports.sort_unstable();
        ports.dedup();
        Ok(Sidecar {
            ports,
            namespaces: file.namespaces,
            container: encode(&file.container),
            volumes: file.volumes.iter().map(encode).collect(),
            volume_names,
            service_account_name: file.service_account_name,
            worker_env: file.worker_env.iter().map(encode).collect(),
        })
    }
}

impl Sidecar {
    /// The worker namespaces the template names (maybe none).
    pub fn namespaces(&self) -> &[String] {
        &self.namespaces
    }
}

/// A typed `core/v1` value as JSON (k8s-openapi's types always encode).
fn encode<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).expect("a core/v1 value always encodes")
}

/// What the webhook decided about one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Not a pod create with [`QUEUE_ANNOTATION`]: allowed unchanged.
    NotAsked,
    /// The pod already has a container named [`SIDECAR_NAME`]: allowed unchanged.
    AlreadyThere,
    /// The sidecar is added by `patch` (RFC 6902 operations).
    Injected {
        /// `<namespace>/<name>` of the pod (for a generated name, the prefix and `*`).
        pod: String,
        /// The queue the sidecar serves.
        queue: String,
        /// The JSON Patch.
        patch: Vec<Value>,
    },
    /// The pod is refused.
    Refused(Refusal),
}

/// A refused pod: which one, what is wrong and the rule.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("pod {pod}: {what} is {value:?}: {rule}")]
pub struct Refusal {
    /// `<namespace>/<name>` of the pod.
    pub pod: String,
    /// The annotation or field, e.g. `annotation leasehold.dev/queue`.
    pub what: String,
    /// Its value.
    pub value: String,
    /// The rule it breaks.
    pub rule: String,
}

/// The answer to an AdmissionReview about a pod: the response's JSON and the decision.
#[derive(Debug)]
pub struct Reviewed {
    /// The AdmissionReview to send back.
    pub response: Value,
    /// What was decided.
    pub decision: Decision,
}

/// Decides the AdmissionReview `body` (JSON) with the template `sidecar` (see the module's
/// documentation for the rule). An injection answers `allowed: true` with
/// `patchType: JSONPatch` and the patch in base64; a refusal `allowed: false` with code 422,
/// reason `Invalid`, and the [`Refusal`] as message.
///
/// # Errors
/// [`ReviewError`] when `body` is not an AdmissionReview with a request.
pub fn review(body: &[u8], sidecar: &Sidecar) -> Result<Reviewed, ReviewError> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Review {
        api_version: String,
        request: Option<PodRequest>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct PodRequest {
        uid: String,
        #[serde(default)]
        kind: Kind,
        #[serde(default)]
        sub_resource: String,
        #[serde(default)]
        namespace: String,
        #[serde(default)]
        operation: String,
        #[serde(default)]
        object: Value,
    }
    #[derive(Default, Deserialize)]
    struct Kind {
        #[serde(default)]
        group: String,
        #[serde(default)]
        kind: String,
    }
    let review: Review = serde_json::from_slice(body).map_err(ReviewError::NotAReview)?;
    let request = review.request.ok_or(ReviewError::NoRequest)?;
    let is_pod_create = request.kind.group.is_empty()
        && request.kind.kind == "Pod"
        && request.sub_resource.is_empty()
        && request.operation == "CREATE";
    let decision = if is_pod_create {
        decide(&request.object, &request.namespace, sidecar)
    } else {
        Decision::NotAsked
    };
    let mut response = json!({"uid": request.uid, "allowed": true});
    match &decision {
        Decision::Injected { patch, .. } => {
            let text = serde_json::to_vec(patch).expect("a patch always encodes");
            response["patchType"] = json!("JSONPatch");
            response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(text));
        }
        Decision::Refused(refusal) => {
            deny(&mut response, 422, "Invalid", refusal.to_string());
        }
        Decision::NotAsked | Decision::AlreadyThere => {}
    }
    Ok(Reviewed {
        response: envelope(&review.api_version, response),
        decision,
    })
}

/// The decision about a pod being created in `namespace`.
fn decide(pod: &Value, namespace: &str, sidecar: &Sidecar) -> Decision {
    let annotations = pod["metadata"]["annotations"].as_object();
    let Some(queue) = annotations.and_then(|a| a.get(QUEUE_ANNOTATION)) else {
        return Decision::NotAsked;
    };
    let name = pod_ref(pod, namespace);
    let refuse = |what: String, value: &str, rule: &str| {
        Decision::Refused(Refusal {
            pod: name.clone(),
            what,
            value: value.to_string(),
            rule: rule.to_string(),
        })
    };
    let queue = queue.as_str().unwrap_or_default();
    if !is_dns_label(queue) {
        return refuse(
            format!("annotation {QUEUE_ANNOTATION}"),
            queue,
            "must be a queue name (spec.queue of its LeasedJobs): a DNS label of 1 to 63 lowercase letters, digits and '-', starting and ending with a letter or digit",
        );
    }
    let spec = &pod["spec"];
    let named = |list: &str, wanted: &str| {
        spec[list]
            .as_array()
            .is_some_and(|items| items.iter().any(|c| c["name"] == wanted))
    };
    if named("initContainers", SIDECAR_NAME) || named("containers", SIDECAR_NAME) {
        return Decision::AlreadyThere;
    }
    let mut container = sidecar.container.clone();
    for (annotation, section, resource) in RESOURCE_ANNOTATIONS {
        let Some(value) = annotations.and_then(|a| a.get(annotation)) else {
            continue;
        };
        let value = value.as_str().unwrap_or_default();
        if !is_quantity(value) {
            return refuse(
                format!("annotation {annotation}"),
                value,
                "must be a Kubernetes quantity, such as 50m, 0.5, 64Mi or 1G",
            );
        }
        let resources = object_at(&mut container, "resources");
        let section = resources
            .entry(section)
            .and_modify(|v| {
                if !v.is_object() {
                    *v = json!({});
                }
            })
            .or_insert_with(|| json!({}));
        section[resource] = json!(value);
    }
    if spec["hostNetwork"] == true {
        return refuse(
            "spec.hostNetwork".to_string(),
            "true",
            &format!(
                "the injected sidecar listens on ports {:?}, which would be the node's: run workers without hostNetwork",
                sidecar.ports
            ),
        );
    }
    for list in ["initContainers", "containers"] {
        for c in spec[list].as_array().into_iter().flatten() {
            let taken = c["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["containerPort"].as_i64())
                .find(|p| sidecar.ports.iter().any(|s| i64::from(*s) == *p));
            if let Some(port) = taken {
                return refuse(
                    format!("container {} port", c["name"].as_str().unwrap_or_default()),
                    &port.to_string(),
                    &format!(
                        "the injected sidecar listens on ports {:?} of the pod: give the container another port",
                        sidecar.ports
                    ),
                );
            }
        }
    }
    if let Some(clash) = sidecar.volume_names.iter().find(|v| named("volumes", v)) {
        return refuse(
            "volume".to_string(),
            clash,
            "the injected sidecar brings a volume of this name: rename the pod's volume",
        );
    }
    let env = array_at(&mut container, "env");
    env.retain(|e| e["name"] != "LEASEHOLD_QUEUE");
    env.push(json!({"name": "LEASEHOLD_QUEUE", "value": queue}));

    let mut patch = Vec::new();
    append(&mut patch, spec, "/spec", "initContainers", vec![container]);
    append(
        &mut patch,
        spec,
        "/spec",
        "volumes",
        sidecar.volumes.clone(),
    );
    if let Some(containers) = spec["containers"].as_array() {
        for (i, c) in containers.iter().enumerate() {
            let missing: Vec<Value> = sidecar
                .worker_env
                .iter()
                .filter(|e| !named_in(&c["env"], &e["name"]))
                .cloned()
                .collect();
            append(
                &mut patch,
                c,
                &format!("/spec/containers/{i}"),
                "env",
                missing,
            );
        }
    }
    let account = spec["serviceAccountName"].as_str().unwrap_or_default();
    if account.is_empty() || account == "default" {
        patch.push(json!({"op": "add", "path": "/spec/serviceAccountName", "value": sidecar.service_account_name}));
        if spec.get("serviceAccount").is_some() {
            patch.push(json!({"op": "add", "path": "/spec/serviceAccount", "value": sidecar.service_account_name}));
        }
    }
    patch.push(json!({
        "op": "add",
        "path": format!("/metadata/annotations/{}", INJECTED_ANNOTATION.replace('~', "~0").replace('/', "~1")),
        "value": env!("CARGO_PKG_VERSION"),
    }));
    Decision::Injected {
        pod: name,
        queue: queue.to_string(),
        patch,
    }
}

/// Adds `items` to the array `parent[key]` at `path`: one `add` of the whole array when there
/// is none, else one `add` at `-` per item.
fn append(patch: &mut Vec<Value>, parent: &Value, path: &str, key: &str, items: Vec<Value>) {
    if items.is_empty() {
        return;
    }
    if parent[key].is_array() {
        for item in items {
            patch.push(json!({"op": "add", "path": format!("{path}/{key}/-"), "value": item}));
        }
    } else {
        patch.push(json!({"op": "add", "path": format!("{path}/{key}"), "value": items}));
    }
}

/// Whether the array `list` has a member whose `name` is `name`.
fn named_in(list: &Value, name: &Value) -> bool {
    list.as_array()
        .is_some_and(|items| items.iter().any(|i| &i["name"] == name))
}

/// `value[key]` as an object, made one if it is not.
fn object_at<'a>(value: &'a mut Value, key: &str) -> &'a mut Map<String, Value> {
    let slot = &mut value[key];
    if !slot.is_object() {
        *slot = json!({});
    }
    slot.as_object_mut().expect("just made an object")
}

/// `value[key]` as an array, made one if it is not.
fn array_at<'a>(value: &'a mut Value, key: &str) -> &'a mut Vec<Value> {
    let slot = &mut value[key];
    if !slot.is_array() {
        *slot = json!([]);
    }
    slot.as_array_mut().expect("just made an array")
}

/// `<namespace>/<name>` of a pod being created: its name, else its `generateName` and `*`.
fn pod_ref(pod: &Value, namespace: &str) -> String {
    let metadata = &pod["metadata"];
    let text = |key: &str| metadata[key].as_str().filter(|s| !s.is_empty());
    let name = text("name")
        .map(str::to_string)
        .or_else(|| text("generateName").map(|prefix| format!("{prefix}*")))
        .unwrap_or_else(|| "(unnamed)".to_string());
    let namespace = Some(namespace)
        .filter(|n| !n.is_empty())
        .or_else(|| text("namespace"))
        .unwrap_or_default();
    format!("{namespace}/{name}")
}

/// Whether `text` is a non-negative Kubernetes quantity (k8s.io/apimachinery
/// `resource.Quantity`): a decimal number, then a binary suffix (Ki to Ei), a decimal one
/// (n, u, m, k, M, G, T, P, E) or a decimal exponent (e3, E-2); at most 63 characters.
pub fn is_quantity(text: &str) -> bool {
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    let number = number.strip_prefix('+').unwrap_or(number);
    let digits_ok = {
        let mut parts = number.splitn(2, '.');
        let whole = parts.next().unwrap_or_default();
        let fraction = parts.next();
        let all_digits = |s: &str| s.chars().all(|c| c.is_ascii_digit());
        all_digits(whole)
            && fraction.is_none_or(all_digits)
            && (!whole.is_empty() || fraction.is_some_and(|f| !f.is_empty()))
    };
    let suffix_ok = match suffix {
        "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "n" | "u" | "m" | "k" | "M" | "G" | "T"
        | "P" | "E" => true,
        exponent => exponent
            .strip_prefix(['e', 'E'])
            .map(|e| e.strip_prefix(['+', '-']).unwrap_or(e))
            .is_some_and(|e| !e.is_empty() && e.chars().all(|c| c.is_ascii_digit())),
    };
    text.len() <= 63 && digits_ok && suffix_ok
}

/// The injection webhook's route, sharing `turns` ([`review::turns`]) with the size webhook: `POST` [`PATH`] answers an AdmissionReview (200), or 400, 408, 413 as
/// [`crate::admission::router`] does. Injections are logged at info level with the pod and its
/// queue, refusals with the rule.
pub fn router(turns: Arc<Semaphore>, sidecar: Arc<Sidecar>) -> Router {
    Router::new()
        .route(PATH, post(answer))
        .layer(DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .with_state((turns, sidecar))
}

async fn answer(
    State((turns, sidecar)): State<(Arc<Semaphore>, Arc<Sidecar>)>,
    request: Request,
) -> Response {
    let (_turn, body) = match review::receive(&turns, request).await {
        Ok(received) => received,
        Err(refused) => return refused,
    };
    match review(&body, &sidecar) {
        Ok(reviewed) => {
            match &reviewed.decision {
                Decision::Injected { pod, queue, .. } => {
                    tracing::info!(%pod, %queue, "Injected the sidecar into pod {pod} for queue {queue}");
                }
                Decision::Refused(refusal) => {
                    tracing::info!(pod = %refusal.pod, category = refusal.category(), "Refused {refusal}");
                }
                Decision::NotAsked | Decision::AlreadyThere => {}
            }
            axum::Json(reviewed.response).into_response()
        }
        Err(e) => review::unreadable(&e),
    }
}

impl Category for Refusal {
    /// Stable category, for logs.
    fn category(&self) -> &'static str {
        "injection_refused"
    }
}

#[cfg(test)]
mod tests;
