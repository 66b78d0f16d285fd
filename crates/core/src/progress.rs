//! A job's progress as people see it: how far the current attempt is (a fraction from 0 to 1)
//! and a short message, sent by the worker with its heartbeats and kept on the job's Lease
//! (annotations [`PROGRESS_ANNOTATION`] and [`MESSAGE_ANNOTATION`]), written by the same
//! renewal PATCH that moves renewTime. A heartbeat therefore still writes the Lease only, once:
//! progress costs no LeasedJob write and no extra API request.
//!
//! Pure: the rules, the annotation text, and the progress bar `kubectl leasehold get` draws.
//! Its rules live here; the Lease writes in `leasehold_kube::lease`, the reads in the kubectl plugin.

use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;
use serde_json::Value;
use thiserror::Error;

/// Annotation on the Lease holding the latest progress, a decimal fraction from 0 to 1 (e.g.
/// `0.42`), as the holder last sent it.
pub const PROGRESS_ANNOTATION: &str = "leasehold.dev/progress";
/// Annotation on the Lease holding the latest progress message, as the holder last sent it.
pub const MESSAGE_ANNOTATION: &str = "leasehold.dev/progress-message";
/// Longest progress message accepted, in bytes of UTF-8: enough for "chunk 41 of 97:
/// transcribing speaker 2", short enough for a table row and for every heartbeat to carry it.
pub const MAX_MESSAGE_BYTES: usize = 256;

/// What a heartbeat may say about how far the attempt is. Either part may be absent: an
/// absent part leaves the value last stored on the Lease as it is.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Progress {
    /// Fraction done, from 0.0 to 1.0 inclusive.
    pub fraction: Option<f64>,
    /// A short message: at most [`MAX_MESSAGE_BYTES`] bytes of UTF-8, no control characters.
    /// Empty clears the message shown.
    pub message: Option<String>,
}

/// A progress field that breaks its rule; the text names the field, the value and the rule.
#[derive(Debug, Error, PartialEq)]
#[error("{field} {problem}")]
pub struct InvalidProgress {
    /// `progress` or `message`.
    pub field: &'static str,
    /// The value (shortened) and the rule it breaks.
    pub problem: String,
}

impl Progress {
    /// True when the heartbeat said nothing about progress.
    pub fn is_empty(&self) -> bool {
        self.fraction.is_none() && self.message.is_none()
    }

    /// Checks both parts against their rules (see [`Progress::from_json`]): for a `Progress`
    /// built in code rather than read from JSON.
    ///
    /// # Errors
    /// [`InvalidProgress`] naming the first field that breaks its rule.
    pub fn validate(&self) -> Result<(), InvalidProgress> {
        if let Some(f) = self.fraction {
            if !(0.0..=1.0).contains(&f) {
                return Err(InvalidProgress {
                    field: "progress",
                    problem: format!(
                        "{f} is out of range: expected a number from 0 to 1 (the fraction done)"
                    ),
                });
            }
        }
        self.message.as_deref().map_or(Ok(()), check_message)
    }

    /// Reads the `progress` and `message` fields of a heartbeat body as JSON values (absent or
    /// null: not given) and checks them: `progress` a number from 0 to 1, `message` a string of
    /// at most [`MAX_MESSAGE_BYTES`] bytes without control characters (it is shown on one line
    /// of a table).
    ///
    /// # Errors
    /// [`InvalidProgress`] naming the first field that breaks its rule, its value and the rule.
    pub fn from_json(
        progress: Option<&Value>,
        message: Option<&Value>,
    ) -> Result<Progress, InvalidProgress> {
        let fraction = match progress {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) => match n.as_f64() {
                Some(f) if (0.0..=1.0).contains(&f) => Some(f),
                _ => {
                    return Err(InvalidProgress {
                        field: "progress",
                        problem: format!(
                        "{n} is out of range: expected a number from 0 to 1 (the fraction done)"
                    ),
                    })
                }
            },
            Some(other) => {
                return Err(InvalidProgress {
                    field: "progress",
                    problem: format!(
                        "{} is not a number: expected a number from 0 to 1 (the fraction done)",
                        shorten(&other.to_string())
                    ),
                })
            }
        };
        let message = match message {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => {
                check_message(s)?;
                Some(s.clone())
            }
            Some(other) => {
                return Err(InvalidProgress {
                    field: "message",
                    problem: format!(
                        "{} is not a string: expected text of at most {MAX_MESSAGE_BYTES} bytes",
                        shorten(&other.to_string())
                    ),
                })
            }
        };
        Ok(Progress { fraction, message })
    }

    /// The annotations a renewal writes: (name, text) for each part given. The fraction is
    /// written with at most 4 decimals (0.0001 is finer than any bar shows).
    pub fn annotations(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(f) = self.fraction {
            out.push((PROGRESS_ANNOTATION, fraction_text(f)));
        }
        if let Some(m) = &self.message {
            out.push((MESSAGE_ANNOTATION, m.clone()));
        }
        out
    }

    /// Merges a later heartbeat's progress into this one: parts it gives replace ours.
    pub fn update(&mut self, later: &Progress) {
        if later.fraction.is_some() {
            self.fraction = later.fraction;
        }
        if later.message.is_some() {
            self.message.clone_from(&later.message);
        }
    }

    /// The progress stored on a Lease: unreadable or out-of-range values read as absent
    /// (anyone with write access to Leases could have edited them).
    pub fn of_lease(lease: &Lease) -> Progress {
        let annotations = lease.annotations();
        let fraction = annotations
            .get(PROGRESS_ANNOTATION)
            .and_then(|t| t.parse::<f64>().ok())
            .filter(|f| (0.0..=1.0).contains(f));
        let message = annotations.get(MESSAGE_ANNOTATION).cloned();
        Progress { fraction, message }
    }
}

fn check_message(s: &str) -> Result<(), InvalidProgress> {
    if s.len() > MAX_MESSAGE_BYTES {
        return Err(InvalidProgress {
            field: "message",
            problem: format!(
                "{} is {} bytes: at most {MAX_MESSAGE_BYTES} bytes of UTF-8 are accepted",
                shorten(&format!("{s:?}")),
                s.len()
            ),
        });
    }
    if s.chars().any(char::is_control) {
        return Err(InvalidProgress {
            field: "message",
            problem: format!(
                "{} contains a control character (a line break, a tab, ...): it is shown on one line",
                shorten(&format!("{s:?}"))
            ),
        });
    }
    Ok(())
}

fn shorten(text: &str) -> String {
    const KEEP: usize = 60;
    if text.chars().count() <= KEEP {
        text.to_string()
    } else {
        format!("{}...", text.chars().take(KEEP).collect::<String>())
    }
}

/// `f` as annotation text: at most 4 decimals, trailing zeros dropped (`0.5`, `1`, `0.3333`).
pub fn fraction_text(f: f64) -> String {
    let text = format!("{:.4}", f.clamp(0.0, 1.0));
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text.is_empty() {
        "0".to_string()
    } else {
        text.to_string()
    }
}

/// A progress bar `width` cells wide and the percentage, rounded down so that 100% means done:
/// `[#####.....]  50%`. No fraction: blanks of the same width.
pub fn bar(fraction: Option<f64>, width: usize) -> String {
    let Some(f) = fraction else {
        return " ".repeat(width + 7);
    };
    let f = f.clamp(0.0, 1.0);
    // Rounded down, with a small allowance for fractions like 0.29 stored as 0.28999...
    let filled = ((f * width as f64) + 1e-9).floor() as usize;
    let percent = ((f * 100.0) + 1e-9).floor() as u32;
    format!(
        "[{}{}] {percent:>3}%",
        "#".repeat(filled),
        ".".repeat(width - filled.min(width))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn progress_and_message_follow_their_rules() {
        let ok = [
            (json!(0), json!(null), Some(0.0), None),
            (json!(1), json!("done"), Some(1.0), Some("done".to_string())),
            (json!(0.25), json!(""), Some(0.25), Some(String::new())),
            // 256 bytes exactly, in two-byte characters.
            (
                json!(null),
                json!("é".repeat(128)),
                None,
                Some("é".repeat(128)),
            ),
        ];
        for (p, m, fraction, message) in ok {
            let got = Progress::from_json(Some(&p), Some(&m)).unwrap();
            assert_eq!(got.fraction, fraction, "{p}");
            assert_eq!(got.message, message, "{m}");
        }
        let bad = [
            (json!(1.5), json!(null), "progress", "1.5 is out of range"),
            (json!(-0.1), json!(null), "progress", "-0.1 is out of range"),
            (
                json!("half"),
                json!(null),
                "progress",
                "\"half\" is not a number",
            ),
            (json!(true), json!(null), "progress", "true is not a number"),
            (json!(0.5), json!(7), "message", "7 is not a string"),
            (
                json!(0.5),
                json!("a".repeat(257)),
                "message",
                "is 257 bytes",
            ),
            (
                json!(0.5),
                json!("two\nlines"),
                "message",
                "control character",
            ),
        ];
        for (p, m, field, says) in bad {
            let e = Progress::from_json(Some(&p), Some(&m)).unwrap_err();
            assert_eq!(e.field, field, "{p} {m}");
            assert!(e.to_string().contains(says), "{e}");
            assert!(e.to_string().starts_with(field), "{e}");
        }
        assert!(Progress::from_json(None, None).unwrap().is_empty());
    }

    #[test]
    fn fractions_are_written_short_and_read_back() {
        let cases = [
            (0.0, "0"),
            (1.0, "1"),
            (0.5, "0.5"),
            (1.0 / 3.0, "0.3333"),
            (0.29, "0.29"),
        ];
        for (f, text) in cases {
            assert_eq!(fraction_text(f), text);
        }
        let mut lease = Lease::default();
        let p = Progress {
            fraction: Some(0.29),
            message: Some("chunk 3".into()),
        };
        lease.metadata.annotations = Some(
            p.annotations()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        );
        assert_eq!(Progress::of_lease(&lease), p);
        // Edited by hand out of range: not shown.
        lease
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(PROGRESS_ANNOTATION.into(), "7".into());
        assert_eq!(Progress::of_lease(&lease).fraction, None);
    }

    #[test]
    fn later_heartbeats_replace_only_what_they_give() {
        let mut p = Progress {
            fraction: Some(0.1),
            message: Some("a".into()),
        };
        p.update(&Progress {
            fraction: Some(0.2),
            message: None,
        });
        assert_eq!((p.fraction, p.message.as_deref()), (Some(0.2), Some("a")));
        p.update(&Progress {
            fraction: None,
            message: Some(String::new()),
        });
        assert_eq!((p.fraction, p.message.as_deref()), (Some(0.2), Some("")));
    }

    #[test]
    fn bars_round_down_so_full_means_done() {
        assert_eq!(bar(Some(0.0), 10), "[..........]   0%");
        assert_eq!(bar(Some(0.5), 10), "[#####.....]  50%");
        assert_eq!(bar(Some(0.999), 10), "[#########.]  99%");
        assert_eq!(bar(Some(0.29), 10), "[##........]  29%");
        assert_eq!(bar(Some(1.0), 10), "[##########] 100%");
        assert_eq!(bar(None, 10).len(), bar(Some(1.0), 10).len());
    }
}
