//! Traces across the queue: the producer's W3C trace context, carried by a job's annotations
//! from the submit to the claim, so that a worker's span can be linked to the producer's.
//!
//! A producer sets [`TRACEPARENT_ANNOTATION`] (and, optionally, [`TRACESTATE_ANNOTATION`]) on
//! the LeasedJob it creates; the sidecar's claim answer carries them as `traceparent` and
//! `tracestate` ([`carried`]); the SDKs start the worker's span with that parent. The values
//! are the HTTP headers of the W3C Trace Context Recommendation
//! (<https://www.w3.org/TR/trace-context/>, sections 3.2 "traceparent Header" and 3.3
//! "tracestate Header"), checked by [`parse_traceparent`] and [`check_tracestate`].
//!
//! A value that breaks the rules is never an error of the job: the claim simply carries no
//! trace context (the spec's own rule for a receiver of a malformed header: ignore it and start
//! a new trace), and the tracestate goes with its traceparent (3.3: a tracestate is discarded
//! when its traceparent is).
//!
//! The annotations are not part of the spec, so they are not part of the idempotency key's
//! spec hash ([`crate::submit`]): the same submission retried from another trace is still the
//! same submission.
//!
//! Pure: the callers read the annotations and log.

use std::collections::BTreeMap;
use std::fmt;

use thiserror::Error;

/// The annotation holding the producer's W3C `traceparent`
/// (`00-<32 hex trace-id>-<16 hex parent-id>-<2 hex trace-flags>`).
pub const TRACEPARENT_ANNOTATION: &str = "leasehold.dev/traceparent";
/// The annotation holding the producer's W3C `tracestate`, if any (vendor-specific trace data
/// that goes with the traceparent).
pub const TRACESTATE_ANNOTATION: &str = "leasehold.dev/tracestate";
/// Longest tracestate carried, in bytes: the Recommendation's 512-character propagation limit
/// (section 3.3.1.5, "tracestate Limits").
pub const MAX_TRACESTATE_BYTES: usize = 512;
/// Most list-members of a tracestate (section 3.3.1.1).
pub const MAX_TRACESTATE_MEMBERS: usize = 32;

/// A valid W3C traceparent, version `00` (section 3.2.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace-id: 16 bytes, not all zero.
    pub trace_id: [u8; 16],
    /// The parent-id (the producer's span id): 8 bytes, not all zero.
    pub parent_id: [u8; 8],
    /// The trace-flags: bit 0 (`0x01`) is `sampled`; the other bits are kept as given.
    pub flags: u8,
}

impl TraceParent {
    /// Whether the producer sampled its span (trace-flags bit 0).
    pub fn sampled(&self) -> bool {
        self.flags & 0x01 != 0
    }
}

impl fmt::Display for TraceParent {
    /// The header's text: `00-<trace-id>-<parent-id>-<flags>`, lowercase hex.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        for b in self.trace_id {
            write!(f, "{b:02x}")?;
        }
        f.write_str("-")?;
        for b in self.parent_id {
            write!(f, "{b:02x}")?;
        }
        write!(f, "-{:02x}", self.flags)
    }
}

impl std::str::FromStr for TraceParent {
    type Err = TraceParentError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_traceparent(s)
    }
}

/// A traceparent or tracestate that breaks the W3C Trace Context rules.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{shown:?} is not a valid W3C {header}: {problem}")]
pub struct TraceParentError {
    /// `traceparent` or `tracestate`.
    pub header: &'static str,
    /// The value, cut to 80 characters.
    pub shown: String,
    /// What is wrong, and the rule.
    pub problem: String,
}

fn refuse(header: &'static str, value: &str, problem: impl Into<String>) -> TraceParentError {
    TraceParentError {
        header,
        shown: value.chars().take(80).collect(),
        problem: problem.into(),
    }
}

/// Parses a traceparent of version `00`: exactly 55 characters,
/// `00-<32 hex>-<16 hex>-<2 hex>`, lowercase hex only, neither id all zeros (W3C Trace
/// Context, section 3.2.2). Other versions are refused: `ff` is forbidden by the
/// Recommendation, and later ones are not defined yet, so their fields cannot be trusted.
///
/// # Errors
/// [`TraceParentError`] naming the value and the rule it breaks.
pub fn parse_traceparent(value: &str) -> Result<TraceParent, TraceParentError> {
    let bad = |problem: &str| refuse("traceparent", value, problem);
    let fields: Vec<&str> = value.split('-').collect();
    if fields.len() != 4 || value.len() != 55 {
        return Err(bad("the rule is 00-<32 hex trace-id>-<16 hex parent-id>-<2 hex trace-flags>, 55 characters"));
    }
    let lower_hex = |s: &str| s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    match fields[0] {
        "00" => {}
        "ff" => return Err(bad("version ff is forbidden")),
        v if v.len() == 2 && lower_hex(v) => return Err(bad("only version 00 is accepted")),
        _ => return Err(bad("the version must be 2 lowercase hex digits, 00")),
    }
    let (trace, parent, flags) = (fields[1], fields[2], fields[3]);
    if trace.len() != 32 || parent.len() != 16 || flags.len() != 2 {
        return Err(bad("the rule is 00-<32 hex trace-id>-<16 hex parent-id>-<2 hex trace-flags>, 55 characters"));
    }
    if !(lower_hex(trace) && lower_hex(parent) && lower_hex(flags)) {
        return Err(bad(
            "the ids and flags must be lowercase hex digits (0-9, a-f)",
        ));
    }
    let mut parsed = TraceParent {
        trace_id: [0; 16],
        parent_id: [0; 8],
        flags: 0,
    };
    decode(trace, &mut parsed.trace_id);
    decode(parent, &mut parsed.parent_id);
    let mut f = [0u8; 1];
    decode(flags, &mut f);
    parsed.flags = f[0];
    if parsed.trace_id == [0; 16] {
        return Err(bad("the trace-id is all zeros, which is invalid"));
    }
    if parsed.parent_id == [0; 8] {
        return Err(bad("the parent-id is all zeros, which is invalid"));
    }
    Ok(parsed)
}

/// Decodes checked lowercase hex into `out` (which is half its length).
fn decode(hex: &str, out: &mut [u8]) {
    let nibble = |b: u8| match b {
        b'0'..=b'9' => b - b'0',
        _ => b - b'a' + 10,
    };
    for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
        out[i] = nibble(pair[0]) << 4 | nibble(pair[1]);
    }
}

/// Checks a tracestate (W3C Trace Context, section 3.3.1): at most [`MAX_TRACESTATE_BYTES`]
/// bytes, at most [`MAX_TRACESTATE_MEMBERS`] comma-separated list-members (empty ones and
/// spaces or tabs around them allowed), each `key=value` where the key is `lcalpha
/// 0*255(lcalpha / DIGIT / "_" / "-" / "*" / "/")` or `tenant@system` (a tenant of 1 to 241
/// such characters starting with lcalpha or a digit, a system of 1 to 14 starting with
/// lcalpha), and the value is 1 to 256 printable ASCII characters other than `,` and `=`, not
/// ending in a space. The same key twice is refused.
///
/// # Errors
/// [`TraceParentError`] naming the value and the rule it breaks.
pub fn check_tracestate(value: &str) -> Result<(), TraceParentError> {
    let bad = |problem: String| refuse("tracestate", value, problem);
    if value.len() > MAX_TRACESTATE_BYTES {
        return Err(bad(format!(
            "it is {} bytes, over the limit of {MAX_TRACESTATE_BYTES}",
            value.len()
        )));
    }
    let mut keys = Vec::new();
    for member in value.split(',') {
        let member = member.trim_matches([' ', '\t']);
        if member.is_empty() {
            continue;
        }
        let Some((key, val)) = member.split_once('=') else {
            return Err(bad(format!("the list-member {member:?} is not key=value")));
        };
        if !valid_key(key) {
            return Err(bad(format!("the key {key:?} is not lcalpha followed by lcalpha, digits, _ - * /, optionally tenant@system")));
        }
        let value_ok = (1..=256).contains(&val.len())
            && val
                .bytes()
                .all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
            && !val.ends_with(' ');
        if !value_ok {
            return Err(bad(format!("the value of {key:?} must be 1 to 256 printable ASCII characters other than , and =, not ending in a space")));
        }
        if keys.contains(&key) {
            return Err(bad(format!("the key {key:?} appears twice")));
        }
        keys.push(key);
    }
    if keys.len() > MAX_TRACESTATE_MEMBERS {
        return Err(bad(format!(
            "it has {} list-members, over the limit of {MAX_TRACESTATE_MEMBERS}",
            keys.len()
        )));
    }
    Ok(())
}

/// A tracestate key (section 3.3.1.3.1).
fn valid_key(key: &str) -> bool {
    let rest_ok = |s: &str| {
        s.bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'*' | b'/'))
    };
    match key.split_once('@') {
        None => {
            key.len() <= 256
                && key.as_bytes().first().is_some_and(u8::is_ascii_lowercase)
                && rest_ok(key)
        }
        Some((tenant, system)) => {
            (1..=241).contains(&tenant.len())
                && tenant
                    .as_bytes()
                    .first()
                    .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
                && rest_ok(tenant)
                && (1..=14).contains(&system.len())
                && system
                    .as_bytes()
                    .first()
                    .is_some_and(u8::is_ascii_lowercase)
                && rest_ok(system)
        }
    }
}

/// A trace annotation a write must not store: which one, and what is wrong with its value.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("annotation {annotation} {error} (W3C Trace Context, section {section})")]
pub struct BadTraceAnnotation {
    /// [`TRACEPARENT_ANNOTATION`] or [`TRACESTATE_ANNOTATION`].
    pub annotation: &'static str,
    /// The section of the Recommendation whose rule it breaks: `3.2` or `3.3`.
    pub section: &'static str,
    /// The value and the rule.
    pub error: TraceParentError,
}

/// Judges the trace annotations of a job about to be stored with `annotations`, which had
/// `before` (None for a create): each of [`TRACEPARENT_ANNOTATION`] and
/// [`TRACESTATE_ANNOTATION`] that the write sets or changes must be valid
/// ([`parse_traceparent`], [`check_tracestate`]). One left as it was is not judged, so that a
/// job stored before the rule can still be updated, cancelled or retried.
///
/// # Errors
/// [`BadTraceAnnotation`] for the first annotation that breaks its rule.
pub fn check_annotations(
    annotations: &BTreeMap<String, String>,
    before: Option<&BTreeMap<String, String>>,
) -> Result<(), BadTraceAnnotation> {
    let changed = |name: &str| {
        let value = annotations.get(name)?;
        let same = before.and_then(|b| b.get(name)) == Some(value);
        (!same).then_some(value.as_str())
    };
    type Check = fn(&str) -> Result<(), TraceParentError>;
    let rules: [(&'static str, &'static str, Check); 2] = [
        (TRACEPARENT_ANNOTATION, "3.2", |v| {
            parse_traceparent(v).map(|_| ())
        }),
        (TRACESTATE_ANNOTATION, "3.3", check_tracestate),
    ];
    for (annotation, section, check) in rules {
        if let Some(value) = changed(annotation) {
            check(value).map_err(|error| BadTraceAnnotation {
                annotation,
                section,
                error,
            })?;
        }
    }
    Ok(())
}

/// The trace context a job carries to its claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Carried {
    /// The traceparent, valid, as annotated.
    pub traceparent: String,
    /// The tracestate, when annotated and valid.
    pub tracestate: Option<String>,
}

/// What a claim carries of a job's trace context, from its annotations: `Ok(None)` when it has
/// no [`TRACEPARENT_ANNOTATION`]; the traceparent and, when valid, the tracestate otherwise.
/// The second item is the reason a value was skipped (a malformed tracestate beside a valid
/// traceparent), for the caller's log.
///
/// # Errors
/// A malformed traceparent: the claim carries no trace context (and no tracestate).
pub fn carried(
    annotations: &BTreeMap<String, String>,
) -> Result<(Option<Carried>, Option<TraceParentError>), TraceParentError> {
    let Some(traceparent) = annotations.get(TRACEPARENT_ANNOTATION) else {
        return Ok((None, None));
    };
    parse_traceparent(traceparent)?;
    let (tracestate, skipped) = match annotations.get(TRACESTATE_ANNOTATION) {
        None => (None, None),
        Some(state) => match check_tracestate(state) {
            Ok(()) => (Some(state.clone()), None),
            Err(e) => (None, Some(e)),
        },
    };
    Ok((
        Some(Carried {
            traceparent: traceparent.clone(),
            tracestate,
        }),
        skipped,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_write_may_not_set_a_malformed_trace_annotation_but_may_keep_one() {
        let with = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let good = with(&[
            (TRACEPARENT_ANNOTATION, VALID),
            (TRACESTATE_ANNOTATION, "a=1"),
        ]);
        assert_eq!(check_annotations(&good, None), Ok(()));
        assert_eq!(check_annotations(&with(&[]), None), Ok(()));
        let bad_parent = with(&[(TRACEPARENT_ANNOTATION, "00-xyz")]);
        let e = check_annotations(&bad_parent, None).unwrap_err();
        assert_eq!((e.annotation, e.section), (TRACEPARENT_ANNOTATION, "3.2"));
        let text = e.to_string();
        assert!(
            text.starts_with(
                "annotation leasehold.dev/traceparent \"00-xyz\" is not a valid W3C traceparent: "
            ),
            "{text}"
        );
        assert!(text.ends_with("(W3C Trace Context, section 3.2)"), "{text}");
        let bad_state = with(&[
            (TRACEPARENT_ANNOTATION, VALID),
            (TRACESTATE_ANNOTATION, "A=1"),
        ]);
        let e = check_annotations(&bad_state, None).unwrap_err();
        assert_eq!((e.annotation, e.section), (TRACESTATE_ANNOTATION, "3.3"));
        // Kept as stored: not judged. Changed to another malformed value: judged.
        assert_eq!(check_annotations(&bad_parent, Some(&bad_parent)), Ok(()));
        assert_eq!(check_annotations(&bad_state, Some(&bad_state)), Ok(()));
        let worse = with(&[(TRACEPARENT_ANNOTATION, "00-abc")]);
        assert!(check_annotations(&worse, Some(&bad_parent)).is_err());
        assert_eq!(check_annotations(&good, Some(&bad_parent)), Ok(()));
    }

    #[test]
    fn a_valid_traceparent_is_parsed_and_written_back_unchanged() {
        let parsed = parse_traceparent(VALID).unwrap();
        assert_eq!(parsed.trace_id[0], 0x4b);
        assert_eq!(parsed.parent_id[7], 0xb7);
        assert!(parsed.sampled());
        assert_eq!(parsed.to_string(), VALID);
        let unsampled: TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
            .parse()
            .unwrap();
        assert!(!unsampled.sampled());
    }

    #[test]
    fn malformed_traceparents_are_refused_naming_the_rule() {
        let cases = [
            ("", "55 characters"),
            ("garbage", "55 characters"),
            // Uppercase hex (the Recommendation allows lowercase only).
            (
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                "lowercase hex",
            ),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "trace-id is all zeros",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                "parent-id is all zeros",
            ),
            (
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "version ff",
            ),
            (
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "only version 00",
            ),
            (
                "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "2 lowercase hex",
            ),
            // Too long (version 00 is exactly 55 characters), fields of the wrong width.
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
                "55 characters",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e47366-0f067aa0ba902b7-01",
                "55 characters",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0z",
                "lowercase hex",
            ),
            (
                " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "55 characters",
            ),
        ];
        for (value, rule) in cases {
            let err = parse_traceparent(value).unwrap_err();
            let message = err.to_string();
            assert!(
                message.contains(rule) && message.contains("traceparent"),
                "{value:?}: {message}"
            );
        }
    }

    #[test]
    fn tracestates_follow_the_list_member_rules() {
        for ok in [
            "",
            "rojo=00f067aa0ba902b7",
            "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
            " rojo=1 ,\tcongo=2, ,",
            "tenant1@vendor=x",
            "a/b*c_d-e=va lue",
        ] {
            check_tracestate(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        for (bad, rule) in [
            ("rojo", "not key=value"),
            ("Rojo=1", "the key"),
            ("1rojo=1", "the key"),
            ("rojo=", "the value"),
            ("rojo=a=b", "the value"),
            ("rojo=tab\there", "the value"),
            ("rojo=1,rojo=2", "appears twice"),
            ("t@toolongsystemname=1", "the key"),
        ] {
            let message = check_tracestate(bad).unwrap_err().to_string();
            assert!(message.contains(rule), "{bad:?}: {message}");
        }
        let many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        assert!(check_tracestate(&many.join(","))
            .unwrap_err()
            .to_string()
            .contains("33 list-members"));
        let long = format!("k={}", "v".repeat(MAX_TRACESTATE_BYTES));
        assert!(check_tracestate(&long)
            .unwrap_err()
            .to_string()
            .contains("over the limit of 512"));
    }

    #[test]
    fn a_claim_carries_a_valid_context_and_skips_a_bad_one() {
        let mut annotations = BTreeMap::new();
        assert_eq!(carried(&annotations), Ok((None, None)));
        annotations.insert(TRACESTATE_ANNOTATION.to_string(), "rojo=1".to_string());
        // A tracestate alone carries nothing.
        assert_eq!(carried(&annotations), Ok((None, None)));
        annotations.insert(TRACEPARENT_ANNOTATION.to_string(), VALID.to_string());
        let (found, skipped) = carried(&annotations).unwrap();
        assert_eq!(
            found,
            Some(Carried {
                traceparent: VALID.into(),
                tracestate: Some("rojo=1".into())
            })
        );
        assert_eq!(skipped, None);
        // A bad tracestate is dropped, the traceparent kept.
        annotations.insert(TRACESTATE_ANNOTATION.to_string(), "Bad".to_string());
        let (found, skipped) = carried(&annotations).unwrap();
        assert_eq!(found.unwrap().tracestate, None);
        assert!(skipped.unwrap().to_string().contains("tracestate"));
        // A bad traceparent carries nothing, its tracestate neither.
        annotations.insert(TRACEPARENT_ANNOTATION.to_string(), "00-xyz".to_string());
        let err = carried(&annotations).unwrap_err();
        assert!(err.to_string().contains("\"00-xyz\""), "{err}");
    }
}
