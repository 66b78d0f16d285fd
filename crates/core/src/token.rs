//! The fencing token: proof of one claim.
//!
//! A token is `<attempt>.<32 lowercase hex digits>`: the attempt number it was issued for, then
//! 128 bits from a cryptographically secure generator. The random part makes it unguessable; the
//! attempt part lets any outside system that receives writes from workers order them: a write
//! carrying a token of a higher attempt comes from a newer owner, and a store that remembers the
//! highest attempt it has seen can refuse older ones (the fencing-token rule of distributed
//! locking). The token is a secret: its `Debug` form hides the random part, and no error message
//! ever includes a token.

use std::fmt;

use rand::RngCore;
use thiserror::Error;

/// Number of random bits in a token.
pub const RANDOM_BITS: usize = 128;
const HEX_LEN: usize = RANDOM_BITS / 4;
/// Longest token text accepted: a 10-digit attempt, a dot and the hex digits.
pub const MAX_LEN: usize = 10 + 1 + HEX_LEN;

/// A fencing token. Compare tokens with `==`; order owners with [`Token::attempt`].
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Token {
    attempt: i32,
    text: String,
}

/// Why a string is not a token.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TokenError {
    /// The field was absent or empty.
    #[error("token is missing")]
    Missing,
    /// The field was present but not of the form `<attempt>.<32 hex digits>`.
    #[error("token is malformed: expected <attempt>.<32 lowercase hex digits>")]
    Malformed,
}

impl Token {
    /// A fresh token for `attempt` (>= 1), with 128 bits from `rand`'s thread-local
    /// cryptographically secure generator (ChaCha, seeded and reseeded from the OS).
    pub fn issue(attempt: i32) -> Token {
        let mut bytes = [0u8; RANDOM_BITS / 8];
        rand::rng().fill_bytes(&mut bytes);
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Token {
            attempt,
            text: format!("{attempt}.{hex}"),
        }
    }

    /// Parses a token as a worker presents it.
    ///
    /// # Errors
    /// [`TokenError::Missing`] for an empty string, [`TokenError::Malformed`] for anything not of
    /// the form `<attempt>.<32 lowercase hex digits>` with attempt >= 1.
    pub fn parse(text: &str) -> Result<Token, TokenError> {
        if text.is_empty() {
            return Err(TokenError::Missing);
        }
        if text.len() > MAX_LEN {
            return Err(TokenError::Malformed);
        }
        let (attempt, hex) = text.split_once('.').ok_or(TokenError::Malformed)?;
        let digits_ok = !attempt.is_empty()
            && attempt.bytes().all(|b| b.is_ascii_digit())
            && !attempt.starts_with('0');
        let hex_ok =
            hex.len() == HEX_LEN && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !digits_ok || !hex_ok {
            return Err(TokenError::Malformed);
        }
        let attempt: i32 = attempt.parse().map_err(|_| TokenError::Malformed)?;
        Ok(Token {
            attempt,
            text: text.to_string(),
        })
    }

    /// The attempt this token was issued for.
    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    /// The token's text, as stored in status.token and the Lease's holderIdentity.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// A token serialises as its text, `<attempt>.<32 hex digits>`: the only place it is shown is
/// the claim's answer to the worker that holds it.
impl serde::Serialize for Token {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({}.<redacted>)", self.attempt)
    }
}

/// `text` with everything that looks like a token (`<digits>.<32 hex digits>`) replaced by
/// `<token>`: for error texts that may quote API objects (a watch's decode error can carry a
/// whole LIST body), before they are logged.
pub fn redact(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        if let Some(len) = token_at(&bytes[i..]) {
            out.push_str("<token>");
            i += len;
        } else {
            let ch = text[i..].chars().next().expect("in bounds");
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

/// Length of a token starting at the beginning of `b`, if one does.
fn token_at(b: &[u8]) -> Option<usize> {
    let digits = b.iter().take_while(|c| c.is_ascii_digit()).count();
    if digits == 0 || b.get(digits) != Some(&b'.') {
        return None;
    }
    let hex = &b[digits + 1..];
    let n = hex
        .iter()
        .take_while(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
        .count();
    (n >= HEX_LEN).then_some(digits + 1 + n)
}

#[cfg(test)]
mod tests {
    #[test]
    fn redaction_hides_every_token_and_keeps_the_rest() {
        let a = Token::issue(3);
        let b = Token::issue(12);
        let text = format!(
            "list failed: {{\"token\":\"{}\"}} and ü {} end 1.5 v1.2.3",
            a.as_str(),
            b.as_str()
        );
        let r = redact(&text);
        assert!(!r.contains(a.as_str()) && !r.contains(b.as_str()), "{r}");
        assert_eq!(
            r,
            "list failed: {\"token\":\"<token>\"} and ü <token> end 1.5 v1.2.3"
        );
    }

    use super::*;

    #[test]
    fn issued_tokens_parse_back_and_carry_their_attempt() {
        let t = Token::issue(7);
        assert_eq!(t.attempt(), 7);
        assert_eq!(Token::parse(t.as_str()), Ok(t.clone()));
        assert!(t.as_str().starts_with("7."));
        assert_eq!(t.as_str().len(), 2 + 32);
    }

    #[test]
    fn issued_tokens_differ() {
        let a = Token::issue(1);
        let b = Token::issue(1);
        assert_ne!(a, b);
    }

    #[test]
    fn debug_form_hides_the_secret() {
        let t = Token::issue(3);
        let shown = format!("{t:?}");
        assert!(!shown.contains(&t.as_str()[2..]), "{shown}");
        assert!(shown.contains('3'));
    }

    #[test]
    fn malformed_tokens_are_refused() {
        let hex = "0123456789abcdef0123456789abcdef";
        let cases = [
            ("", TokenError::Missing),
            ("abc", TokenError::Malformed),
            (hex, TokenError::Malformed),
            (&format!(".{hex}"), TokenError::Malformed),
            (&format!("0.{hex}"), TokenError::Malformed),
            (&format!("01.{hex}"), TokenError::Malformed),
            (&format!("-1.{hex}"), TokenError::Malformed),
            (&format!("1.{}", &hex[1..]), TokenError::Malformed),
            (&format!("1.{hex}0"), TokenError::Malformed),
            (&format!("1.{}", hex.to_uppercase()), TokenError::Malformed),
            (&format!("99999999999.{hex}"), TokenError::Malformed),
            (&format!("1.{hex}\n"), TokenError::Malformed),
        ];
        for (text, want) in cases {
            assert_eq!(Token::parse(text).unwrap_err(), want, "{text:?}");
        }
        assert_eq!(Token::parse(&format!("12.{hex}")).unwrap().attempt(), 12);
    }
}
