//! Kubernetes Events (`events.k8s.io/v1`) that the API server always accepts, whatever the
//! object they are about.
//!
//! The API server validates a new Event strictly (`pkg/apis/core/validation/events.go`):
//! `metadata.name` a DNS subdomain of at most 253 characters, `note` at most 1024 bytes,
//! `reason` and `action` 1..128 bytes, `reportingInstance` 1..128 bytes, `reportingController`
//! a qualified name. An Event that breaks any of them is refused whole, so a job with a long
//! name or a long failure message would have no Events at all. Everything here is built to fit:
//! - the name is the object's name and 16 hex digits of the time in nanoseconds (client-go's
//!   `<name>.<hex>` shape), with the object's name cut short so that the whole fits in 253
//!   characters ([`event_name`]);
//! - the note is cut at a character boundary to at most 1024 bytes and then ends with
//!   [`SHORTENED`] ([`shorten_note`]); the full text stays where it came from (the job's
//!   status);
//! - reason, action and reportingInstance are cut to 128 bytes ([`cut_bytes`]).
//!
//! [`Publisher`] is the one place that builds and creates Events. It creates a new Event for
//! every call (no series aggregation), so each transition keeps its own note.

use std::borrow::Cow;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as KubeEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};
use leasehold_core::Category;
use thiserror::Error;

/// Longest Event name the API server accepts (a DNS subdomain, RFC 1123), in characters.
pub const NAME_MAX: usize = 253;
/// Longest `note` the API server accepts, in bytes (`NoteLengthLimit`).
pub const NOTE_MAX_BYTES: usize = 1024;
/// Longest `reason`, `action` and `reportingInstance` the API server accepts, in bytes.
pub const FIELD_MAX_BYTES: usize = 128;
/// How a shortened note ends.
pub const SHORTENED: &str = "… (shortened; see status)";
/// Hex digits of the unique suffix of an Event name.
const SUFFIX_HEX: usize = 16;

/// Severity of an Event (`type`), as `kubectl describe` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    /// Something happened as it should.
    Normal,
    /// Something went wrong or was taken away.
    Warning,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// What one Event says, before it is fitted to the API server's limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// Normal or Warning.
    pub type_: EventType,
    /// CamelCase reason, e.g. `Claimed`; cut to 128 bytes.
    pub reason: String,
    /// What was done, e.g. `Claim`; cut to 128 bytes.
    pub action: String,
    /// Human-readable text of any length; shortened to 1024 bytes.
    pub text: String,
}

/// Errors of [`Publisher::publish`].
#[derive(Debug, Error)]
pub enum EventError {
    /// The API server refused the Event or could not be reached.
    #[error("recording Event {reason} on {kind} {object} failed")]
    Create {
        /// The Event's reason.
        reason: String,
        /// Kind of the object the Event is about.
        kind: String,
        /// `namespace/name` of the object the Event is about.
        object: String,
        /// The underlying error.
        #[source]
        source: kube::Error,
    },
}

impl Category for EventError {
    /// Stable category, for logs.
    fn category(&self) -> &'static str {
        match self {
            EventError::Create { .. } => "event_write",
        }
    }
}

/// A valid Event name for an Event about the object named `object`: `<object>.<suffix as 16
/// hex digits>`, with `object` cut short (and trimmed so that each dot-separated label still
/// starts and ends with an alphanumeric character) when the whole would exceed 253
/// characters. Characters a DNS subdomain may not hold are lowercased or replaced by `-`, so
/// the result is valid for any input. `suffix` makes names unique; the caller passes the time
/// in nanoseconds, so an object's Events sort by time.
pub fn event_name(object: &str, suffix: u64) -> String {
    let suffix = format!("{suffix:0width$x}", width = SUFFIX_HEX);
    let room = NAME_MAX - 1 - suffix.len();
    let mapped: String = object
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' | '.' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '-',
        })
        .take(room)
        .collect();
    let base = mapped
        .split('.')
        .map(|label| label.trim_matches('-'))
        .filter(|label| !label.is_empty())
        .collect::<Vec<_>>()
        .join(".");
    if base.is_empty() {
        suffix
    } else {
        format!("{base}.{suffix}")
    }
}

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary.
pub fn cut_bytes(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `text` unchanged when it fits in [`NOTE_MAX_BYTES`]; else cut at a character boundary and
/// ended with [`SHORTENED`], at most [`NOTE_MAX_BYTES`] bytes in all.
pub fn shorten_note(text: &str) -> Cow<'_, str> {
    if text.len() <= NOTE_MAX_BYTES {
        return Cow::Borrowed(text);
    }
    let kept = cut_bytes(text, NOTE_MAX_BYTES - SHORTENED.len());
    Cow::Owned(format!("{kept}{SHORTENED}"))
}

/// Who reports Events: `reportingController` (a qualified name, e.g. `leasehold-controller`)
/// and `reportingInstance` (this replica, e.g. its pod name; cut to 128 bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reporter {
    /// reportingController.
    pub controller: String,
    /// reportingInstance.
    pub instance: String,
}

/// The Event `note` about `regarding`, reported by `reporter` at `now`, fitted to every limit
/// the API server checks. Cluster-scoped objects get their Events in `default`, as kubectl
/// and client-go do.
pub fn build(
    reporter: &Reporter,
    regarding: &ObjectReference,
    note: &Note,
    now: Timestamp,
) -> KubeEvent {
    let suffix = u64::try_from(now.as_nanosecond()).unwrap_or_default();
    let instance = match cut_bytes(&reporter.instance, FIELD_MAX_BYTES) {
        "" => reporter.controller.as_str(),
        cut => cut,
    };
    KubeEvent {
        metadata: ObjectMeta {
            name: Some(event_name(
                regarding.name.as_deref().unwrap_or(&reporter.controller),
                suffix,
            )),
            namespace: Some(
                regarding
                    .namespace
                    .clone()
                    .unwrap_or_else(|| "default".into()),
            ),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(now)),
        type_: Some(note.type_.as_str().into()),
        reason: Some(cut_bytes(&note.reason, FIELD_MAX_BYTES).into()),
        action: Some(cut_bytes(&note.action, FIELD_MAX_BYTES).into()),
        note: Some(shorten_note(&note.text).into_owned()),
        regarding: Some(regarding.clone()),
        reporting_controller: Some(reporter.controller.clone()),
        reporting_instance: Some(instance.into()),
        ..KubeEvent::default()
    }
}

/// Creates Events; the only place leasehold writes one. Needs `create` on
/// `events.k8s.io/events` in the object's namespace.
#[derive(Clone)]
pub struct Publisher {
    client: Client,
    reporter: Reporter,
    field_manager: String,
}

impl Publisher {
    /// A publisher reporting as `reporter`, writing with `field_manager`.
    pub fn new(client: Client, reporter: Reporter, field_manager: String) -> Publisher {
        Publisher {
            client,
            reporter,
            field_manager,
        }
    }

    /// Records `note` about `regarding` as a new Event (see [`build`]).
    ///
    /// # Errors
    /// [`EventError::Create`] when the API server refused it or could not be reached.
    pub async fn publish(
        &self,
        regarding: &ObjectReference,
        note: &Note,
    ) -> Result<(), EventError> {
        let event = build(&self.reporter, regarding, note, Timestamp::now());
        let ns = event.metadata.namespace.clone().unwrap_or_default();
        let api: Api<KubeEvent> = Api::namespaced(self.client.clone(), &ns);
        let params = PostParams {
            field_manager: Some(self.field_manager.clone()),
            ..PostParams::default()
        };
        api.create(&params, &event)
            .await
            .map(|_| ())
            .map_err(|source| EventError::Create {
                reason: note.reason.clone(),
                kind: regarding.kind.clone().unwrap_or_default(),
                object: format!("{ns}/{}", regarding.name.as_deref().unwrap_or_default()),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The API server's rule for metadata.name (IsDNS1123Subdomain).
    fn is_dns_subdomain(s: &str) -> bool {
        let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
        !s.is_empty()
            && s.len() <= NAME_MAX
            && s.split('.').all(|label| {
                !label.is_empty()
                    && label.starts_with(alnum)
                    && label.ends_with(alnum)
                    && label.chars().all(|c| alnum(c) || c == '-')
            })
    }

    #[test]
    fn event_names_are_valid_whatever_the_object_name() {
        let long = |n: usize, tail: &str| format!("{}{tail}", "a".repeat(n - tail.len()));
        // (object name, expected prefix before the suffix)
        let cases: Vec<(String, String)> = vec![
            ("transcode-42".into(), "transcode-42".into()),
            (long(236, ""), long(236, "")),
            (long(237, ""), long(236, "")),
            (long(248, ""), long(236, "")),
            (long(253, ""), long(236, "")),
            // The cut lands right after a '-' or a '.': trimmed, so the label ends alphanumeric.
            (
                format!("{}-b{}", "a".repeat(235), "c".repeat(16)),
                "a".repeat(235),
            ),
            (
                format!("{}.b{}", "a".repeat(235), "c".repeat(16)),
                "a".repeat(235),
            ),
            (format!("{}.-b", "a".repeat(234)), "a".repeat(234)),
            ("abc.-b".into(), "abc.b".into()),
            // Not a DNS subdomain at all (another kind's name): still a valid Event name.
            ("system:Node/x".into(), "system-node-x".into()),
            ("-.-".into(), String::new()),
            ("".into(), String::new()),
        ];
        for (object, prefix) in cases {
            let name = event_name(&object, 0x1234);
            assert!(is_dns_subdomain(&name), "{object:?} -> {name:?}");
            assert!(name.ends_with("0000000000001234"), "{name}");
            let expected = if prefix.is_empty() {
                "0000000000001234".to_string()
            } else {
                format!("{prefix}.0000000000001234")
            };
            assert_eq!(name, expected, "{object:?}");
        }
        assert_eq!(event_name(&"a".repeat(253), u64::MAX).len(), NAME_MAX);
    }

    #[test]
    fn notes_fit_in_1024_bytes_and_say_they_were_shortened() {
        let room = NOTE_MAX_BYTES - SHORTENED.len();
        // (note, expected bytes kept before the marker; None = unchanged)
        let cases: Vec<(String, Option<usize>)> = vec![
            ("Claimed by pod-a (attempt 1)".into(), None),
            ("x".repeat(NOTE_MAX_BYTES), None),
            ("x".repeat(NOTE_MAX_BYTES + 1), Some(room)),
            ("x".repeat(4096), Some(room)),
            // Two-byte characters: the cut may not split one.
            ("é".repeat(2048), Some(room - room % 2)),
            // A four-byte character straddling the cut is dropped whole.
            (
                format!("{}{}", "x".repeat(room - 1), "🦀".repeat(10)),
                Some(room - 1),
            ),
            (
                format!("{}{}", "x".repeat(room), "🦀".repeat(10)),
                Some(room),
            ),
        ];
        for (note, kept) in cases {
            let out = shorten_note(&note);
            assert!(out.len() <= NOTE_MAX_BYTES, "{} bytes", out.len());
            match kept {
                None => assert_eq!(out, note),
                Some(k) => {
                    assert!(out.ends_with(SHORTENED), "{out}");
                    assert_eq!(out.len() - SHORTENED.len(), k);
                    assert!(note.starts_with(&out[..k]));
                }
            }
        }
    }

    #[test]
    fn built_events_carry_bounded_fields() {
        let reporter = Reporter {
            controller: "leasehold-controller".into(),
            instance: "p".repeat(253),
        };
        let regarding = ObjectReference {
            api_version: Some("leasehold.dev/v1alpha1".into()),
            kind: Some("LeasedJob".into()),
            name: Some("j".repeat(253)),
            namespace: Some("jobs".into()),
            ..ObjectReference::default()
        };
        let note = Note {
            type_: EventType::Warning,
            reason: "R".repeat(200),
            action: "é".repeat(100),
            text: "m".repeat(4096),
        };
        let e = build(&reporter, &regarding, &note, Timestamp::now());
        assert!(is_dns_subdomain(e.metadata.name.as_deref().unwrap()));
        assert_eq!(e.metadata.namespace.as_deref(), Some("jobs"));
        assert_eq!(e.reason.as_ref().unwrap().len(), FIELD_MAX_BYTES);
        assert_eq!(e.action.as_ref().unwrap().len(), FIELD_MAX_BYTES);
        assert_eq!(
            e.reporting_instance.as_ref().unwrap().len(),
            FIELD_MAX_BYTES
        );
        assert_eq!(
            e.reporting_controller.as_deref(),
            Some("leasehold-controller")
        );
        assert!(e.note.as_ref().unwrap().len() <= NOTE_MAX_BYTES);
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!(e.regarding.as_ref(), Some(&regarding));
        assert!(e.event_time.is_some());
        // A cluster-scoped object's Events go to `default`; an empty instance falls back to
        // the controller's name.
        let cluster = ObjectReference {
            namespace: None,
            ..regarding
        };
        let bare = Reporter {
            instance: String::new(),
            ..reporter
        };
        let e = build(&bare, &cluster, &note, Timestamp::now());
        assert_eq!(e.metadata.namespace.as_deref(), Some("default"));
        assert_eq!(
            e.reporting_instance.as_deref(),
            Some("leasehold-controller")
        );
    }
}
