//! Which jobs a plugin command acts on when it is not given their names, and how `get` prints
//! them: a [`Selection`] the API server makes (a label selector, and the selectable fields
//! `spec.queue` and `status.phase` of the CRD), and a [`Format`]. Pure: the caller lists.

use kube::api::ListParams;
use kube::runtime::watcher;
use serde_json::{json, Value};

use leasehold_core::crd::{LeasedJob, Phase};

/// The phases `--phase` accepts, as written in status.phase.
pub const PHASES: [Phase; 5] = [
    Phase::Queued,
    Phase::Leased,
    Phase::Succeeded,
    Phase::Failed,
    Phase::Cancelled,
];

/// Jobs chosen by the API server: every condition given must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// A label selector (`-l`), as kubectl takes it (`app=x,tier!=y`).
    pub labels: Option<String>,
    /// spec.queue (`--queue`).
    pub queue: Option<String>,
    /// status.phase (`--phase`). A job the controller has not initialised yet has no phase,
    /// and is selected by no phase.
    pub phase: Option<Phase>,
}

impl Selection {
    /// True when nothing is selected on: every job.
    pub fn is_empty(&self) -> bool {
        self.labels.is_none() && self.queue.is_none() && self.phase.is_none()
    }

    /// The field selector: `spec.queue=Q,status.phase=P`, the parts given.
    pub fn fields(&self) -> Option<String> {
        let mut parts = Vec::new();
        if let Some(q) = &self.queue {
            parts.push(format!("spec.queue={q}"));
        }
        if let Some(p) = &self.phase {
            parts.push(format!("status.phase={p}"));
        }
        (!parts.is_empty()).then(|| parts.join(","))
    }

    /// A list of the jobs selected.
    pub fn list_params(&self) -> ListParams {
        let mut params = ListParams::default();
        if let Some(l) = &self.labels {
            params = params.labels(l);
        }
        if let Some(f) = self.fields() {
            params = params.fields(&f);
        }
        params
    }

    /// A watch of the jobs selected.
    pub fn watcher_config(&self) -> watcher::Config {
        let mut config = watcher::Config::default();
        if let Some(l) = &self.labels {
            config = config.labels(l);
        }
        if let Some(f) = self.fields() {
            config = config.fields(&f);
        }
        config
    }

    /// What was selected on, for messages: `label selector app=x, queue q, phase Failed`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(l) = &self.labels {
            parts.push(format!("label selector {l}"));
        }
        if let Some(q) = &self.queue {
            parts.push(format!("queue {q}"));
        }
        if let Some(p) = &self.phase {
            parts.push(format!("phase {p}"));
        }
        if parts.is_empty() {
            "every job".into()
        } else {
            parts.join(", ")
        }
    }
}

/// Reads `--phase`: one of [`PHASES`], as written in status.phase.
///
/// # Errors
/// A message naming the flag, the value and the phases there are.
pub fn parse_phase(value: &str) -> Result<Phase, String> {
    PHASES
        .into_iter()
        .find(|p| p.as_str() == value)
        .ok_or_else(|| {
            let all: Vec<&str> = PHASES.iter().map(|p| p.as_str()).collect();
            format!(
                "--phase {value:?} is not a phase: one of {} (as status.phase writes it)",
                all.join(", ")
            )
        })
}

/// How `get` prints jobs (`-o`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// The table (no `-o`).
    #[default]
    #[value(skip)]
    Table,
    /// The table with the spec's priority, concurrency key and lease duration, and the
    /// attempts the current one runs under.
    Wide,
    /// The jobs as a `v1` List, as `kubectl get -o json` prints it.
    Json,
    /// The same in YAML.
    Yaml,
}

/// `jobs` as kubectl prints a list of objects: `{"apiVersion": "v1", "kind": "List",
/// "items": [...]}`, each job with its apiVersion and kind.
pub fn as_list(jobs: &[&LeasedJob]) -> Value {
    let items: Vec<Value> = jobs
        .iter()
        .map(|j| {
            let mut v = serde_json::to_value(j).unwrap_or(Value::Null);
            if let Some(o) = v.as_object_mut() {
                o.insert("apiVersion".into(), json!("leasehold.dev/v1alpha1"));
                o.insert("kind".into(), json!("LeasedJob"));
            }
            v
        })
        .collect();
    json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""}, "items": items})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_selection_becomes_the_api_server_s_selectors() {
        let none = Selection::default();
        assert!(none.is_empty());
        assert_eq!(none.fields(), None);
        assert_eq!(none.describe(), "every job");
        let s = Selection {
            labels: Some("app=x".into()),
            queue: Some("q".into()),
            phase: Some(Phase::Failed),
        };
        assert_eq!(
            s.fields().as_deref(),
            Some("spec.queue=q,status.phase=Failed")
        );
        let p = s.list_params();
        assert_eq!(p.label_selector.as_deref(), Some("app=x"));
        assert_eq!(
            p.field_selector.as_deref(),
            Some("spec.queue=q,status.phase=Failed")
        );
        assert_eq!(s.describe(), "label selector app=x, queue q, phase Failed");
    }

    #[test]
    fn a_phase_is_read_as_status_phase_writes_it() {
        assert_eq!(parse_phase("Leased"), Ok(Phase::Leased));
        let e = parse_phase("leased").unwrap_err();
        assert!(
            e.contains("--phase \"leased\"") && e.contains("Queued, Leased"),
            "{e}"
        );
    }

    #[test]
    fn jobs_print_as_a_v1_list() {
        let job = LeasedJob::new("a", Default::default());
        let list = as_list(&[&job]);
        assert_eq!(list["kind"], "List");
        assert_eq!(list["items"][0]["kind"], "LeasedJob");
        assert_eq!(list["items"][0]["metadata"]["name"], "a");
    }
}
