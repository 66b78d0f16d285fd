//! The CustomResourceDefinitions that leasehold installs for its types ([`crate::crd`],
//! [`crate::queue`]): what kube derives from them, with every description reflowed into
//! paragraphs, and their YAML.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
    JSONSchemaPropsOrStringArray,
};
use kube::CustomResourceExt;

use crate::crd::LeasedJob;
use crate::queue::LeasedQueue;

/// The CustomResourceDefinition of LeasedJob as leasehold installs it: what kube derives from
/// these types, with every description reflowed into paragraphs ([`paragraphs`]), so that
/// `kubectl explain ljob.spec` wraps whole sentences instead of breaking them where a doc
/// comment's source line ended. Everything that installs or compares the CRD uses this, never
/// `LeasedJob::crd()` directly.
pub fn definition() -> CustomResourceDefinition {
    with_beta(reflowed(LeasedJob::crd()))
}

/// The CustomResourceDefinition of LeasedQueue as leasehold installs it, reflowed as
/// [`definition`]'s, with the same two versions.
pub fn queue_definition() -> CustomResourceDefinition {
    with_beta(reflowed(LeasedQueue::crd()))
}

/// The version leasehold stores objects in (`spec.versions[].storage`).
pub const STORAGE_VERSION: &str = "v1alpha1";

/// The annotation on leasehold's CRDs naming the release that made them (its SemVer version),
/// so that `leasehold crd --apply` never replaces a CRD of a newer release with an older one.
pub const VERSION_ANNOTATION: &str = "leasehold.dev/version";

/// The second version served, beside [`STORAGE_VERSION`].
pub const BETA_VERSION: &str = "v1beta1";

/// `crd` (one version, `v1alpha1`, as kube derives it), stamped with [`VERSION_ANNOTATION`],
/// serving [`BETA_VERSION`] too, with the
/// same schema, subresources, printer columns and selectable fields, and no conversion
/// webhook (`conversion.strategy: None`): the API server converts between two identical
/// schemas by rewriting `apiVersion`. `v1alpha1` stays the storage version, so a cluster can
/// go back to a release that knows only it. docs/versioning.md says how a later schema change
/// lands in v1beta1 alone, with a conversion webhook.
fn with_beta(mut crd: CustomResourceDefinition) -> CustomResourceDefinition {
    crd.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(
            VERSION_ANNOTATION.to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        );
    let Some(alpha) = crd.spec.versions.first_mut() else {
        return crd;
    };
    alpha.storage = true;
    let mut beta = alpha.clone();
    beta.name = BETA_VERSION.to_string();
    beta.storage = false;
    crd.spec.versions.push(beta);
    crd
}

/// `crd` with every description reflowed into paragraphs ([`paragraphs`]).
fn reflowed(mut crd: CustomResourceDefinition) -> CustomResourceDefinition {
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            reflow_descriptions(schema);
        }
    }
    crd
}

/// A description written as paragraphs: the lines of one paragraph joined by single spaces,
/// paragraphs separated by one blank line. schemars copies a doc comment line by line, so a
/// sentence that spans two source lines would carry a hard line break into the CRD, which
/// `kubectl explain` prints as is, mid-sentence. A line that starts a list item (`- `, `* `)
/// keeps its line break.
pub fn paragraphs(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut blank_before = false;
    for line in text.lines().map(str::trim) {
        if line.is_empty() {
            blank_before = !out.is_empty();
            continue;
        }
        if blank_before {
            out.push_str("\n\n");
        } else if line.starts_with("- ") || line.starts_with("* ") {
            if !out.is_empty() {
                out.push('\n');
            }
        } else if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(line);
        blank_before = false;
    }
    out
}

/// Applies [`paragraphs`] to the description of `schema` and of every schema nested in it.
fn reflow_descriptions(schema: &mut JSONSchemaProps) {
    if let Some(d) = schema.description.as_mut() {
        *d = paragraphs(d);
    }
    let maps = [
        schema.properties.as_mut(),
        schema.pattern_properties.as_mut(),
        schema.definitions.as_mut(),
    ];
    for map in maps.into_iter().flatten() {
        map.values_mut().for_each(reflow_descriptions);
    }
    let lists = [
        schema.all_of.as_mut(),
        schema.any_of.as_mut(),
        schema.one_of.as_mut(),
    ];
    for list in lists.into_iter().flatten() {
        list.iter_mut().for_each(reflow_descriptions);
    }
    if let Some(not) = schema.not.as_mut() {
        reflow_descriptions(not);
    }
    match schema.items.as_mut() {
        Some(JSONSchemaPropsOrArray::Schema(s)) => reflow_descriptions(s),
        Some(JSONSchemaPropsOrArray::Schemas(list)) => {
            list.iter_mut().for_each(reflow_descriptions)
        }
        None => {}
    }
    for more in [
        schema.additional_properties.as_mut(),
        schema.additional_items.as_mut(),
    ] {
        if let Some(JSONSchemaPropsOrBool::Schema(s)) = more {
            reflow_descriptions(s);
        }
    }
    for dependency in schema.dependencies.iter_mut().flat_map(|m| m.values_mut()) {
        if let JSONSchemaPropsOrStringArray::Schema(s) = dependency {
            reflow_descriptions(s);
        }
    }
}

/// The LeasedJob CustomResourceDefinition as YAML, exactly what
/// `charts/leasehold/crds/leasedjob.yaml` holds (`scripts/gen-crd` writes it).
///
/// # Errors
/// Only if serialization fails, which would be a bug.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    generated(&definition())
}

/// The LeasedQueue CustomResourceDefinition as YAML, exactly what
/// `charts/leasehold/crds/leasedqueue.yaml` holds (`scripts/gen-crd` writes it).
///
/// # Errors
/// As [`crd_yaml`].
pub fn queue_crd_yaml() -> Result<String, serde_yaml::Error> {
    generated(&queue_definition())
}

/// Every CustomResourceDefinition leasehold installs, as one YAML stream (documents separated
/// by `---`): what `leasehold crd` prints, [`crd_yaml`] then [`queue_crd_yaml`].
///
/// # Errors
/// As [`crd_yaml`].
pub fn all_crds_yaml() -> Result<String, serde_yaml::Error> {
    Ok(format!("{}---\n{}", crd_yaml()?, queue_crd_yaml()?))
}

fn generated(crd: &CustomResourceDefinition) -> Result<String, serde_yaml::Error> {
    let yaml = serde_yaml::to_string(crd)?;
    Ok(format!(
        "# Generated by `leasehold crd`; do not edit by hand.\n{yaml}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paragraphs_join_wrapped_lines_and_keep_blank_lines_and_list_items() {
        let cases = [
            ("one line", "one line"),
            (
                "a sentence\nthat wraps\n  here.",
                "a sentence that wraps here.",
            ),
            (
                "first.\n\nsecond\nparagraph.",
                "first.\n\nsecond paragraph.",
            ),
            ("first.\n\n\n\nsecond.\n", "first.\n\nsecond."),
            ("\n\nleading blank lines", "leading blank lines"),
            (
                "Either:\n- this\n- that, which\n  wraps",
                "Either:\n- this\n- that, which wraps",
            ),
            ("", ""),
        ];
        for (text, want) in cases {
            assert_eq!(paragraphs(text), want, "{text:?}");
        }
    }

    /// Every description in the CRD, with its path.
    fn descriptions(schema: &JSONSchemaProps, path: &str, out: &mut Vec<(String, String)>) {
        if let Some(d) = &schema.description {
            out.push((path.to_string(), d.clone()));
        }
        for (name, p) in schema.properties.iter().flatten() {
            descriptions(p, &format!("{path}.{name}"), out);
        }
        if let Some(JSONSchemaPropsOrArray::Schema(items)) = &schema.items {
            descriptions(items, &format!("{path}[]"), out);
        }
        if let Some(JSONSchemaPropsOrBool::Schema(more)) = &schema.additional_properties {
            descriptions(more, &format!("{path}{{}}"), out);
        }
    }

    #[test]
    fn no_description_breaks_a_line_inside_a_paragraph() {
        let crd = definition();
        let root = crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .unwrap();
        let mut all = Vec::new();
        descriptions(root, "", &mut all);
        // Every field of spec and status has one (the conditions' fields come from
        // Kubernetes' own Condition type).
        assert!(all.len() > 30, "{} descriptions", all.len());
        let mut wrapped = Vec::new();
        for (path, text) in &all {
            // Paragraphs are separated by exactly one blank line; inside one, no line break.
            for paragraph in text.split("\n\n") {
                let lines: Vec<&str> = paragraph.lines().collect();
                let items = lines
                    .iter()
                    .skip(1)
                    .all(|l| l.starts_with("- ") || l.starts_with("* "));
                if paragraph.is_empty() || paragraph.trim() != paragraph || !items {
                    wrapped.push(format!("{path}: {paragraph:?}"));
                }
            }
        }
        assert!(
            wrapped.is_empty(),
            "descriptions with a line break inside a paragraph:\n{}",
            wrapped.join("\n")
        );
        // And the committed CRD is this one (tests/crd.rs checks it byte for byte).
        let committed: CustomResourceDefinition = serde_yaml::from_str(include_str!(
            "../../../charts/leasehold/crds/leasedjob.yaml"
        ))
        .unwrap();
        assert_eq!(committed, crd, "regenerate: `scripts/gen-crd`");
        let committed: CustomResourceDefinition = serde_yaml::from_str(include_str!(
            "../../../charts/leasehold/crds/leasedqueue.yaml"
        ))
        .unwrap();
        assert_eq!(
            committed,
            queue_definition(),
            "regenerate: `scripts/gen-crd`"
        );
    }
}
