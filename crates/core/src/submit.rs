//! Submitting a job with an idempotency key: the rule every producer follows (`kubectl
//! leasehold submit`, the Python client's `Producer.submit`), so that resubmitting with the same
//! key, from any of them, returns the same job.
//!
//! - The job's name is derived from its queue and the key ([`name_for_key`]): the API server's
//!   own uniqueness of names within a namespace is what makes a resubmission find the first job,
//!   atomically, whoever submitted first. (SQS FIFO's deduplication ID, Stripe's
//!   `Idempotency-Key`; here the window is the job's lifetime: once it is deleted, by
//!   `ttlSecondsAfterFinished` or by hand, the key may be used again.)
//! - The job carries the key in the annotation [`KEY_ANNOTATION`] and the SHA-256 of the spec as
//!   submitted, in canonical JSON ([`canonical_json`]), in [`SPEC_HASH_ANNOTATION`]. A create
//!   that meets an existing job of that name compares them ([`judge_existing`]): the same key
//!   and spec is the same submission (the existing job is returned, whatever its phase); a
//!   different spec, or a job that was not submitted with that key, is refused naming the job,
//!   the key and what differs.
//!
//! Pure: the callers create and read.

use std::fmt::Write as _;

use serde_json::Value;
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::crd::LeasedJob;

/// Annotation holding the idempotency key a job was submitted with.
pub const KEY_ANNOTATION: &str = "leasehold.dev/idempotency-key";
/// Annotation holding the SHA-256 (hex) of the spec as submitted, in canonical JSON.
pub const SPEC_HASH_ANNOTATION: &str = "leasehold.dev/spec-sha256";
/// Longest idempotency key, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 512;
/// Hex digits of the key's SHA-256 in a job name: 64 bits, so two keys of one queue share a
/// name with a chance of about n²/2⁶⁵ (one in 3.7·10⁷ at a million keys), and a shared name is
/// refused as a different key ([`SubmitConflict::OtherKey`]), never taken for the same job.
pub const NAME_HASH_HEX: usize = 16;

/// An idempotency key that breaks its rule.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("idempotency key {shown:?} {problem}")]
pub struct KeyError {
    /// The key, cut to 80 characters.
    pub shown: String,
    /// What is wrong, and the rule.
    pub problem: String,
}

/// Checks an idempotency key: 1 to [`MAX_KEY_BYTES`] bytes of UTF-8 without control characters
/// (it is stored in an annotation and shown by `kubectl describe`).
///
/// # Errors
/// [`KeyError`] naming the key and the rule.
pub fn check_key(key: &str) -> Result<(), KeyError> {
    let problem = if key.is_empty() {
        "is empty: give a key that names the submission (an order ID, a file's hash)".to_string()
    } else if key.len() > MAX_KEY_BYTES {
        format!(
            "is {} bytes: at most {MAX_KEY_BYTES} bytes of UTF-8 are accepted",
            key.len()
        )
    } else if key.chars().any(char::is_control) {
        "contains a control character (a line break, a tab, ...)".to_string()
    } else {
        return Ok(());
    };
    Err(KeyError {
        shown: key.chars().take(80).collect(),
        problem,
    })
}

/// The name of the job submitted to `queue` with `key`: `<queue>-<first 16 hex digits of
/// SHA-256(key)>` (a queue is a DNS label of at most 63 characters, so the name is at most 80
/// and a valid object name).
pub fn name_for_key(queue: &str, key: &str) -> String {
    let digest = hex(&Sha256::digest(key.as_bytes()));
    format!("{queue}-{}", &digest[..NAME_HASH_HEX])
}

/// `value` as canonical JSON: object keys sorted (by code point, which is UTF-8 byte order),
/// no whitespace, strings as serde_json escapes them (non-ASCII characters as they are), numbers
/// as serde_json writes them. Python's `json.dumps(value, sort_keys=True, separators=(",",
/// ":"), ensure_ascii=False)` writes the same for every 64-bit integer, string, bool, null,
/// array and object; floats agree for the usual ones (`0.5`, `1.25`), not necessarily for
/// exponents (`1e-7`) or `-0`: a keyed payload should carry such numbers as strings. Integers
/// beyond 64 bits are refused by every producer ([`out_of_range_number`]).
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(&map[key], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// The first number in `value` that a JSON parser without arbitrary precision (serde_json's, the
/// API server's) cannot keep as written: an integral value of magnitude at least 2^63 parsed
/// as a float (`18446744073709551616` becomes `1.8446744073709552e19`). None when every number
/// is kept. Producers refuse such payloads, naming the number: it would be stored other than
/// as sent, and hashed differently by each producer.
pub fn out_of_range_number(value: &Value) -> Option<String> {
    match value {
        Value::Number(n) => {
            let lossy = n.is_f64()
                && n.as_f64()
                    .is_some_and(|f| f.fract() == 0.0 && f.abs() >= 9.223_372_036_854_776e18);
            lossy.then(|| n.to_string())
        }
        Value::Array(items) => items.iter().find_map(out_of_range_number),
        Value::Object(map) => map.values().find_map(out_of_range_number),
        _ => None,
    }
}

/// SHA-256 (lowercase hex) of `spec` as canonical JSON: the value of [`SPEC_HASH_ANNOTATION`].
pub fn spec_hash(spec: &Value) -> String {
    hex(&Sha256::digest(canonical_json(spec).as_bytes()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Why a submission that met an existing job of its name is not the same submission.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SubmitConflict {
    /// The job was submitted with this key and another spec.
    #[error("LeasedJob {job} was submitted with idempotency key {key:?} and a different spec ({differs}): a key names one submission; use a new key for a new job")]
    OtherSpec {
        /// `namespace/name`.
        job: String,
        /// The key.
        key: String,
        /// The spec fields whose values differ, or "the spec" when none can be named.
        differs: String,
    },
    /// A job of that name exists but was not submitted with this key (made by hand, or, with
    /// a chance of about one in 10⁷ at a million keys, another key's hash).
    #[error("LeasedJob {job} exists and was not submitted with idempotency key {key:?}: delete it, or submit under another key")]
    OtherKey {
        /// `namespace/name`.
        job: String,
        /// The key.
        key: String,
    },
}

/// Whether `existing`, found where the submission of `spec` with `key` would create its job,
/// is that same submission: Ok when its annotations carry `key` and the hash of `spec`.
///
/// # Errors
/// [`SubmitConflict`] naming the job, the key and the differing spec fields.
pub fn judge_existing(existing: &LeasedJob, key: &str, spec: &Value) -> Result<(), SubmitConflict> {
    let annotations = existing.metadata.annotations.clone().unwrap_or_default();
    let job = existing.reference();
    if annotations.get(KEY_ANNOTATION).map(String::as_str) != Some(key) {
        return Err(SubmitConflict::OtherKey {
            job,
            key: key.to_string(),
        });
    }
    if annotations.get(SPEC_HASH_ANNOTATION) == Some(&spec_hash(spec)) {
        return Ok(());
    }
    let stored = serde_json::to_value(&existing.spec).unwrap_or(Value::Null);
    let given = spec.as_object().cloned().unwrap_or_default();
    let mut differs: Vec<String> = given
        .iter()
        .filter(|(field, value)| stored.get(field.as_str()) != Some(*value))
        .map(|(field, _)| format!("spec.{field}"))
        .collect();
    // Fields the job sets that this submission leaves out (the API server's defaults aside:
    // cancel, and a priority of 0).
    for (field, value) in stored.as_object().into_iter().flatten() {
        let defaulted = matches!((field.as_str(), value), ("cancel", Value::Bool(false)))
            || (field == "priority" && value == &serde_json::json!(0));
        if !given.contains_key(field) && !defaulted && !value.is_null() {
            differs.push(format!("spec.{field} (not given now)"));
        }
    }
    differs.sort();
    Err(SubmitConflict::OtherSpec {
        job,
        key: key.to_string(),
        differs: if differs.is_empty() {
            "the spec".to_string()
        } else {
            differs.join(", ")
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_json_sorts_keys_and_drops_whitespace() {
        let v = json!({"b": [1, {"z": null, "a": "ü\n"}], "a": true, "é": 0.5});
        assert_eq!(
            canonical_json(&v),
            r#"{"a":true,"b":[1,{"a":"ü\n","z":null}],"é":0.5}"#
        );
        // The value Python's json.dumps(sort_keys=True, separators=(",", ":"),
        // ensure_ascii=False) hashes to, for this spec (computed with it).
        let spec =
            json!({"queue": "media", "payload": {"url": "s3://a/b.wav", "n": 3}, "priority": 5});
        assert_eq!(
            spec_hash(&spec),
            "a622cc5917f5481ef313a06639739304144aee563e607bcb93eb01f11e9f4970"
        );
    }

    #[test]
    fn integers_beyond_64_bits_are_found() {
        let parsed: Value =
            serde_json::from_str(r#"{"a": [1, -9223372036854775808, 18446744073709551615]}"#)
                .unwrap();
        assert_eq!(out_of_range_number(&parsed), None);
        for text in [
            "18446744073709551616",
            "-9223372036854775809",
            "1e19",
            r#"{"x": [2e30]}"#,
        ] {
            let parsed: Value = serde_json::from_str(text).unwrap();
            assert!(out_of_range_number(&parsed).is_some(), "{text}");
        }
        assert_eq!(out_of_range_number(&json!(0.5)), None);
    }

    #[test]
    fn names_come_from_queue_and_key() {
        let a = name_for_key("media", "order-123");
        assert_eq!(a, name_for_key("media", "order-123"));
        assert_ne!(a, name_for_key("media", "order-124"));
        assert!(a.starts_with("media-") && a.len() == "media-".len() + NAME_HASH_HEX);
        assert!(crate::crd::is_dns_subdomain(&name_for_key(
            &"q".repeat(63),
            "k"
        )));
    }

    #[test]
    fn keys_are_checked() {
        assert!(check_key("order-123").is_ok());
        assert!(check_key(&"ü".repeat(MAX_KEY_BYTES / 2)).is_ok());
        for bad in ["", "a\nb", &"k".repeat(MAX_KEY_BYTES + 1)] {
            let e = check_key(bad).unwrap_err();
            assert!(e.to_string().starts_with("idempotency key"), "{e}");
        }
    }

    #[test]
    fn an_existing_job_is_the_same_submission_only_with_its_key_and_spec() {
        let spec = json!({"queue": "q", "payload": {"n": 1}});
        let mut job: LeasedJob = serde_json::from_value(json!({
            "apiVersion": "leasehold.dev/v1alpha1", "kind": "LeasedJob",
            "metadata": {"name": "q-1", "namespace": "ns", "annotations": {
                KEY_ANNOTATION: "k", SPEC_HASH_ANNOTATION: spec_hash(&spec)}},
            "spec": {"queue": "q", "payload": {"n": 1}, "priority": 0}
        }))
        .unwrap();
        assert_eq!(judge_existing(&job, "k", &spec), Ok(()));
        let other = json!({"queue": "q", "payload": {"n": 2}});
        let e = judge_existing(&job, "k", &other).unwrap_err();
        assert!(e.to_string().contains("(spec.payload)"), "{e}");
        job.spec.max_attempts = Some(3);
        let e = judge_existing(&job, "k", &other).unwrap_err();
        assert!(
            e.to_string()
                .contains("(spec.maxAttempts (not given now), spec.payload)"),
            "{e}"
        );
        job.spec.max_attempts = None;
        assert!(e.to_string().contains("ns/q-1"), "{e}");
        assert!(matches!(
            judge_existing(&job, "j", &spec),
            Err(SubmitConflict::OtherKey { .. })
        ));
        job.metadata.annotations = None;
        assert!(matches!(
            judge_existing(&job, "k", &spec),
            Err(SubmitConflict::OtherKey { .. })
        ));
    }
}
