//! The controller's start-up check that the installed LeasedJob CRD is the one it needs.
//!
//! Helm installs the files of a chart's `crds/` directory on the first install only and never
//! upgrades them, so after `helm upgrade` a newer controller can meet an older CRD. The API
//! server prunes every field the installed schema does not declare: the controller would then
//! write fields that silently vanish. So before it starts, the controller reads the installed
//! CustomResourceDefinition and compares it with the one this binary generates (what
//! `leasehold crd` prints): every version this binary uses must be served with every field,
//! every unpruned (`x-kubernetes-preserve-unknown-fields`) value, the status subresource and
//! the selectable fields. If anything is missing it refuses to start, naming what is missing
//! and the command that upgrades the CRD ([`FIX_COMMAND`]).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionVersion, JSONSchemaProps,
    JSONSchemaPropsOrArray,
};
use kube::{Api, Client};
use thiserror::Error;

use leasehold_core::crd::definition;
use leasehold_kube::api::is_status;

/// Name of the LeasedJob CustomResourceDefinition.
pub const CRD_NAME: &str = "leasedjobs.leasehold.dev";

/// The command that installs or upgrades the CRD to the one this binary needs. Server-side
/// apply, because a CRD is too large for client-side apply's last-applied annotation;
/// `--force-conflicts`, because the fields it takes over are owned by whoever installed the
/// CRD before (Helm, an older apply).
pub const FIX_COMMAND: &str = "leasehold crd | kubectl apply --server-side --force-conflicts -f -";

/// One thing the installed CRD lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    /// A version this binary reads and writes is absent or not served.
    Version(String),
    /// A field the binary writes is not declared, so the API server would prune it.
    Field {
        /// The CRD version.
        version: String,
        /// Path of the field, e.g. `status.checkpoint` (`[]` stands for list items).
        path: String,
    },
    /// A field holding arbitrary JSON is declared without
    /// `x-kubernetes-preserve-unknown-fields: true`, so its contents would be pruned.
    Unpruned {
        /// The CRD version.
        version: String,
        /// Path of the field.
        path: String,
    },
    /// The status subresource is not enabled.
    StatusSubresource(String),
    /// A selectable field (a field selector the sidecar's watch uses) is not declared.
    SelectableField {
        /// The CRD version.
        version: String,
        /// JSON path of the field, e.g. `.spec.queue`.
        json_path: String,
    },
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Missing::Version(v) => write!(f, "served version {v}"),
            Missing::Field { version, path } => write!(f, "field {path} (version {version})"),
            Missing::Unpruned { version, path } => write!(
                f,
                "x-kubernetes-preserve-unknown-fields on field {path} (version {version})"
            ),
            Missing::StatusSubresource(v) => write!(f, "the status subresource (version {v})"),
            Missing::SelectableField { version, json_path } => {
                write!(f, "selectable field {json_path} (version {version})")
            }
        }
    }
}

/// Why the controller may not start.
#[derive(Debug, Error)]
pub enum CrdCheckError {
    /// There is no LeasedJob CRD at all.
    #[error(
        "the CustomResourceDefinition {CRD_NAME} is not installed; install it with: {FIX_COMMAND}"
    )]
    NotInstalled,
    /// The controller's credentials may not read the CRD.
    #[error(
        "cannot read the CustomResourceDefinition {CRD_NAME} (403 Forbidden): the controller's \
         role needs `get` on customresourcedefinitions.apiextensions.k8s.io named {CRD_NAME}"
    )]
    Forbidden,
    /// The API server could not be asked.
    #[error("reading the CustomResourceDefinition {CRD_NAME} failed")]
    Api(#[source] kube::Error),
    /// The installed CRD lacks what this binary needs.
    #[error(
        "the installed CustomResourceDefinition {CRD_NAME} is out of date for leasehold {binary}: \
         it lacks {}; the API server would silently drop what leasehold writes there. \
         Refusing to start. Upgrade the CRD, then restart the controller: {FIX_COMMAND}",
        list(.missing)
    )]
    OutOfDate {
        /// This binary's version.
        binary: &'static str,
        /// Everything missing, in schema order; never empty.
        missing: Vec<Missing>,
    },
    /// The installed LeasedQueue CRD lacks what this binary needs: a limit or weight it
    /// declares would be pruned, and silently not applied.
    #[error(
        "the installed CustomResourceDefinition {QUEUE_CRD_NAME} is out of date for leasehold          {binary}: it lacks {}; the API server would silently drop those fields of every          LeasedQueue (its limits, its weights). Refusing to start. Upgrade the CRDs, then          restart the controller: {FIX_COMMAND}",
        list(.missing)
    )]
    QueueOutOfDate {
        /// This binary's version.
        binary: &'static str,
        /// Everything missing, in schema order; never empty.
        missing: Vec<Missing>,
    },
}

/// Name of the LeasedQueue CustomResourceDefinition.
pub const QUEUE_CRD_NAME: &str = "leasedqueues.leasehold.dev";

/// Reads the installed LeasedQueue CRD and compares it with this binary's
/// ([`leasehold_core::crd::queue_definition`]). LeasedQueues are optional: a CRD that is not
/// installed, or that the controller may not read, is a warning (queues cannot be paused or
/// limited until it is), not a refusal.
///
/// # Errors
/// [`CrdCheckError::QueueOutOfDate`] naming everything missing and [`FIX_COMMAND`];
/// [`CrdCheckError::Api`] when the API server could not be asked.
pub async fn check_queues(client: &Client) -> Result<(), CrdCheckError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let installed = match api.get(QUEUE_CRD_NAME).await {
        Ok(crd) => crd,
        Err(e) if is_status(&e, 404) || is_status(&e, 403) => {
            tracing::warn!(
                "The CustomResourceDefinition {QUEUE_CRD_NAME} is not installed (or not readable): \
                 LeasedQueues, and with them pauses, weights and limits, are off until it is: \
                 {FIX_COMMAND}"
            );
            return Ok(());
        }
        Err(e) => return Err(CrdCheckError::Api(e)),
    };
    let missing = missing(&leasehold_core::crd::queue_definition(), &installed);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CrdCheckError::QueueOutOfDate {
            binary: env!("CARGO_PKG_VERSION"),
            missing,
        })
    }
}

fn list(missing: &[Missing]) -> String {
    missing
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// What `installed` lacks of `expected`: versions, fields (recursively, through objects and
/// list items), unpruned values, the status subresource and selectable fields. Extra fields
/// in `installed` are fine (a newer CRD serves an older binary). Children of a node the
/// installed schema keeps unpruned are not required: nothing under it is pruned.
pub fn missing(
    expected: &CustomResourceDefinition,
    installed: &CustomResourceDefinition,
) -> Vec<Missing> {
    let mut out = Vec::new();
    for want in &expected.spec.versions {
        let Some(have) = installed
            .spec
            .versions
            .iter()
            .find(|v| v.name == want.name && v.served)
        else {
            out.push(Missing::Version(want.name.clone()));
            continue;
        };
        if let (Some(w), Some(h)) = (schema_of(want), schema_of(have)) {
            compare(&want.name, "", w, h, &mut out);
        } else if let Some(w) = schema_of(want) {
            // No schema installed at all: report every top-level field.
            compare(&want.name, "", w, &JSONSchemaProps::default(), &mut out);
        }
        let wants_status = want.subresources.as_ref().and_then(|s| s.status.as_ref());
        let has_status = have.subresources.as_ref().and_then(|s| s.status.as_ref());
        if wants_status.is_some() && has_status.is_none() {
            out.push(Missing::StatusSubresource(want.name.clone()));
        }
        for field in want.selectable_fields.iter().flatten() {
            let declared = have
                .selectable_fields
                .iter()
                .flatten()
                .any(|f| f.json_path == field.json_path);
            if !declared {
                out.push(Missing::SelectableField {
                    version: want.name.clone(),
                    json_path: field.json_path.clone(),
                });
            }
        }
    }
    out
}

fn schema_of(v: &CustomResourceDefinitionVersion) -> Option<&JSONSchemaProps> {
    v.schema.as_ref()?.open_api_v3_schema.as_ref()
}

fn preserves(s: &JSONSchemaProps) -> bool {
    s.x_kubernetes_preserve_unknown_fields == Some(true)
}

fn item_schema(s: &JSONSchemaProps) -> Option<&JSONSchemaProps> {
    match s.items.as_ref()? {
        JSONSchemaPropsOrArray::Schema(one) => Some(one),
        JSONSchemaPropsOrArray::Schemas(many) => many.first(),
    }
}

fn compare(
    version: &str,
    path: &str,
    want: &JSONSchemaProps,
    have: &JSONSchemaProps,
    out: &mut Vec<Missing>,
) {
    if preserves(want) && !preserves(have) {
        out.push(Missing::Unpruned {
            version: version.into(),
            path: path.into(),
        });
    }
    if preserves(have) {
        return;
    }
    for (name, w) in want.properties.iter().flatten() {
        let child = if path.is_empty() {
            name.clone()
        } else {
            format!("{path}.{name}")
        };
        match have.properties.as_ref().and_then(|p| p.get(name)) {
            Some(h) => compare(version, &child, w, h, out),
            None => out.push(Missing::Field {
                version: version.into(),
                path: child,
            }),
        }
    }
    if let Some(w) = item_schema(want) {
        let child = format!("{path}[]");
        match item_schema(have) {
            Some(h) => compare(version, &child, w, h, out),
            None => compare(version, &child, w, &JSONSchemaProps::default(), out),
        }
    }
}

/// Reads the installed CRD and compares it with [`LeasedJob::crd`](kube::CustomResourceExt::crd).
///
/// # Errors
/// [`CrdCheckError::OutOfDate`] naming everything missing and [`FIX_COMMAND`];
/// [`CrdCheckError::NotInstalled`]; [`CrdCheckError::Forbidden`] when the credentials may not
/// read it; [`CrdCheckError::Api`] for other failures.
pub async fn check(client: &Client) -> Result<(), CrdCheckError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let installed = match api.get(CRD_NAME).await {
        Ok(crd) => crd,
        Err(e) if is_status(&e, 404) => return Err(CrdCheckError::NotInstalled),
        Err(e) if is_status(&e, 403) => return Err(CrdCheckError::Forbidden),
        Err(e) => return Err(CrdCheckError::Api(e)),
    };
    let missing = missing(&definition(), &installed);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CrdCheckError::OutOfDate {
            binary: env!("CARGO_PKG_VERSION"),
            missing,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn installed() -> CustomResourceDefinition {
        definition()
    }

    fn props<'a>(crd: &'a mut CustomResourceDefinition, path: &[&str]) -> &'a mut JSONSchemaProps {
        let mut node = crd.spec.versions[0]
            .schema
            .as_mut()
            .unwrap()
            .open_api_v3_schema
            .as_mut()
            .unwrap();
        for p in path {
            node = node.properties.as_mut().unwrap().get_mut(*p).unwrap();
        }
        node
    }

    #[test]
    fn a_queue_crd_without_the_limits_is_out_of_date() {
        let mut old = leasehold_core::crd::queue_definition();
        props(&mut old, &["spec"])
            .properties
            .as_mut()
            .unwrap()
            .remove("maxLeasedPerKey");
        let got = missing(&leasehold_core::crd::queue_definition(), &old);
        assert_eq!(
            got,
            vec![Missing::Field {
                version: "v1alpha1".into(),
                path: "spec.maxLeasedPerKey".into()
            }]
        );
        let current = leasehold_core::crd::queue_definition();
        assert_eq!(missing(&current, &current), vec![]);
    }

    #[test]
    fn the_generated_crd_lacks_nothing() {
        assert_eq!(missing(&definition(), &installed()), vec![]);
    }

    #[test]
    fn a_missing_field_is_named_by_its_path() {
        let mut old = installed();
        props(&mut old, &["status"])
            .properties
            .as_mut()
            .unwrap()
            .remove("checkpoint");
        props(&mut old, &["spec"])
            .properties
            .as_mut()
            .unwrap()
            .remove("priority");
        let got = missing(&definition(), &old);
        assert_eq!(
            got,
            vec![
                Missing::Field {
                    version: "v1alpha1".into(),
                    path: "spec.priority".into()
                },
                Missing::Field {
                    version: "v1alpha1".into(),
                    path: "status.checkpoint".into()
                },
            ]
        );
        let msg = CrdCheckError::OutOfDate {
            binary: "9.9.9",
            missing: got,
        }
        .to_string();
        assert!(
            msg.contains("field spec.priority (version v1alpha1)"),
            "{msg}"
        );
        assert!(msg.contains(FIX_COMMAND), "{msg}");
    }

    #[test]
    fn list_items_fields_and_unpruned_values_are_checked() {
        let mut old = installed();
        let failures = props(&mut old, &["status", "failures"]);
        match failures.items.as_mut().unwrap() {
            JSONSchemaPropsOrArray::Schema(s) => {
                s.properties.as_mut().unwrap().remove("holder");
            }
            JSONSchemaPropsOrArray::Schemas(_) => unreachable!(),
        }
        props(&mut old, &["spec", "payload"]).x_kubernetes_preserve_unknown_fields = None;
        let got = missing(&definition(), &old);
        assert_eq!(
            got,
            vec![
                Missing::Unpruned {
                    version: "v1alpha1".into(),
                    path: "spec.payload".into()
                },
                Missing::Field {
                    version: "v1alpha1".into(),
                    path: "status.failures[].holder".into()
                },
            ]
        );
    }

    #[test]
    fn subresource_selectable_fields_and_versions_are_checked() {
        let mut old = installed();
        old.spec.versions[0].subresources = None;
        old.spec.versions[0].selectable_fields = None;
        assert_eq!(
            missing(&definition(), &old),
            vec![
                Missing::StatusSubresource("v1alpha1".into()),
                Missing::SelectableField {
                    version: "v1alpha1".into(),
                    json_path: ".spec.queue".into()
                },
                Missing::SelectableField {
                    version: "v1alpha1".into(),
                    json_path: ".status.phase".into()
                },
                Missing::SelectableField {
                    version: "v1alpha1".into(),
                    json_path: ".status.holder".into()
                },
            ]
        );
        let mut unserved = installed();
        unserved.spec.versions[0].served = false;
        assert_eq!(
            missing(&definition(), &unserved),
            vec![Missing::Version("v1alpha1".into())]
        );
    }

    #[test]
    fn extra_fields_and_unpruned_parents_are_accepted() {
        let mut newer = installed();
        props(&mut newer, &["status"])
            .properties
            .as_mut()
            .unwrap()
            .insert("fromTheFuture".into(), JSONSchemaProps::default());
        assert_eq!(missing(&definition(), &newer), vec![]);
        let mut loose = installed();
        let status = props(&mut loose, &["status"]);
        status.properties = None;
        status.x_kubernetes_preserve_unknown_fields = Some(true);
        assert_eq!(missing(&definition(), &loose), vec![]);
    }
}
