//! The `Idempotency-Key` header rule, written once for every side of it: the write
//! API (`http_api`) and the sandbox provider read it, the provider client and the
//! `client-retry` drill send it.
//!
//! The IETF httpapi draft defines the header as a Structured Field String
//! (RFC 8941: `Idempotency-Key: "8e03978e-40d5"`), while most clients and
//! providers (Stripe, Adyen…) send the bare value (`Idempotency-Key: 8e03978e-40d5`).
//! Both are accepted and name the same key. A key that is present but unusable
//! (empty, not ASCII, too long, a broken quoted string) is an error of its own —
//! reporting it as "missing" would send the client looking for the wrong bug.

use axum::http::{HeaderMap, HeaderValue};

/// Request header carrying the key (lower case, as HTTP/2 and `HeaderMap` use it).
pub const HEADER: &str = "idempotency-key";
/// Response header set to `true` on a stored response returned for a repeated key,
/// so a caller (and a drill) can tell "done now" from "already done before".
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// Longest accepted key, in bytes once unquoted (the limit common providers use).
pub const MAX_LEN: usize = 255;

/// A key that follows the rule: 1 to [`MAX_LEN`] printable ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a present key is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidKey {
    #[error("Idempotency-Key is empty")]
    Empty,
    #[error("Idempotency-Key is {0} bytes, limit {MAX_LEN}")]
    TooLong(usize),
    #[error("Idempotency-Key must be printable ASCII (a bare value or a quoted string)")]
    NotAscii,
    #[error("Idempotency-Key is malformed: {0}")]
    Malformed(&'static str),
    #[error("Idempotency-Key sent more than once")]
    Repeated,
}

impl IdempotencyKey {
    /// A key as the caller means it (already unquoted). Spaces are allowed inside
    /// (the quoted form can carry them); control characters and non-ASCII are not.
    pub fn new(key: &str) -> Result<IdempotencyKey, InvalidKey> {
        if key.is_empty() {
            return Err(InvalidKey::Empty);
        }
        if !key.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
            return Err(InvalidKey::NotAscii);
        }
        if key.len() > MAX_LEN {
            return Err(InvalidKey::TooLong(key.len()));
        }
        Ok(IdempotencyKey(key.to_string()))
    }

    /// Read a header value: `"quoted"` (RFC 8941 sf-string) or a bare value of
    /// visible ASCII. Surrounding spaces are not part of it.
    pub fn parse(raw: &[u8]) -> Result<IdempotencyKey, InvalidKey> {
        let raw = raw.trim_ascii();
        match raw.split_first() {
            None => Err(InvalidKey::Empty),
            Some((b'"', quoted)) => IdempotencyKey::new(&unquote(quoted)?),
            Some(_) if raw.iter().all(|b| (0x21..=0x7e).contains(b)) => {
                // Visible ASCII is valid UTF-8.
                IdempotencyKey::new(std::str::from_utf8(raw).map_err(|_| InvalidKey::NotAscii)?)
            }
            Some(_) if raw.is_ascii() && !raw.iter().any(u8::is_ascii_control) => Err(
                InvalidKey::Malformed("a bare value has no spaces (quote it: \"a b\")"),
            ),
            Some(_) => Err(InvalidKey::NotAscii),
        }
    }

    /// The request's key: `Ok(None)` when the header is absent, an error when it is
    /// present but unusable (or repeated: two keys for one request are ambiguous).
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, InvalidKey> {
        let mut values = headers.get_all(HEADER).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(InvalidKey::Repeated);
        }
        IdempotencyKey::parse(first.as_bytes()).map(Some)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The value to send: bare when it reads the same bare (what every provider
    /// understands), else the quoted string form.
    pub fn header_value(&self) -> HeaderValue {
        let bare = !self.0.starts_with('"') && !self.0.contains(' ');
        let text = if bare {
            self.0.clone()
        } else {
            let mut q = String::with_capacity(self.0.len() + 2);
            q.push('"');
            for c in self.0.chars() {
                if c == '"' || c == '\\' {
                    q.push('\\');
                }
                q.push(c);
            }
            q.push('"');
            q
        };
        // Printable ASCII only (checked in `new`): always a valid header value.
        HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
    }
}

impl std::fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// RFC 8941 §4.2.5: the rest of an sf-string after its opening quote.
fn unquote(rest: &[u8]) -> Result<String, InvalidKey> {
    let mut out = String::with_capacity(rest.len());
    let mut bytes = rest.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(char::from(e)),
                _ => {
                    return Err(InvalidKey::Malformed(
                        "a quoted string escapes only \\ and \"",
                    ))
                }
            },
            // The closing quote ends the value: nothing may follow.
            b'"' if bytes.as_slice().is_empty() => return Ok(out),
            b'"' => return Err(InvalidKey::Malformed("text after the closing quote")),
            0x20..=0x7e => out.push(char::from(b)),
            // A control character or a byte beyond ASCII (one arm: both are the
            // same refusal, and a second arm would be a branch no test can tell).
            _ => return Err(InvalidKey::NotAscii),
        }
    }
    Err(InvalidKey::Malformed(
        "a quoted string without its closing quote",
    ))
}

/// The answer carries `Idempotent-Replayed: true`: the server recognised the key
/// and returned its stored first response, nothing was done this time.
pub fn is_replayed(headers: &HeaderMap) -> bool {
    headers
        .get(REPLAYED_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str) -> Result<String, InvalidKey> {
        IdempotencyKey::parse(raw.as_bytes()).map(|k| k.0)
    }

    #[test]
    fn bare_and_quoted_forms_name_the_same_key() {
        assert_eq!(parse("abc").unwrap(), "abc");
        assert_eq!(parse("\"abc\"").unwrap(), "abc");
        assert_eq!(
            parse("  8e03978e-40d5-43e8  ").unwrap(),
            "8e03978e-40d5-43e8"
        );
        assert_eq!(
            parse("34-ABC-123:48211:zone_exit").unwrap(),
            "34-ABC-123:48211:zone_exit"
        );
        assert_eq!(parse(r#""a \"b\" \\c""#).unwrap(), r#"a "b" \c"#);
    }

    #[test]
    fn present_but_unusable_keys_are_invalid_not_missing() {
        assert_eq!(parse(""), Err(InvalidKey::Empty));
        assert_eq!(parse("   "), Err(InvalidKey::Empty));
        assert_eq!(parse("\"\""), Err(InvalidKey::Empty));
        assert_eq!(parse(&"k".repeat(256)), Err(InvalidKey::TooLong(256)));
        assert_eq!(parse(&"k".repeat(255)).map(|k| k.len()), Ok(255));
        // `"a"b"`: an unescaped quote inside ends the string, the rest is extra.
        for malformed in ["\"abc", "\"ab\"c", r#""a"b""#, r#""a\zb""#, "two words"] {
            assert!(
                matches!(parse(malformed), Err(InvalidKey::Malformed(_))),
                "{malformed}"
            );
        }
        assert_eq!(
            IdempotencyKey::parse("clé".as_bytes()),
            Err(InvalidKey::NotAscii)
        );
        assert_eq!(IdempotencyKey::parse(b"a\x01b"), Err(InvalidKey::NotAscii));
    }

    #[test]
    fn header_value_reads_back_as_the_same_key() {
        for key in ["abc", "a b", "\"q\"", "back\\slash", "idemwatch-0123abcd"] {
            let k = IdempotencyKey::new(key).unwrap();
            let v = k.header_value();
            assert_eq!(IdempotencyKey::parse(v.as_bytes()).unwrap(), k, "{key}");
        }
        assert_eq!(IdempotencyKey::new("abc").unwrap().header_value(), "abc");
        assert_eq!(
            IdempotencyKey::new("a b").unwrap().header_value(),
            "\"a b\""
        );
        // Shown (logs, errors) as the caller meant it: unquoted.
        assert_eq!(
            IdempotencyKey::new("a \"b\"").unwrap().to_string(),
            "a \"b\""
        );
    }

    #[test]
    fn headers_absent_present_and_repeated() {
        let mut h = HeaderMap::new();
        assert_eq!(IdempotencyKey::from_headers(&h), Ok(None));
        h.insert(HEADER, HeaderValue::from_static("\"k-1\""));
        assert_eq!(
            IdempotencyKey::from_headers(&h).unwrap().unwrap().as_str(),
            "k-1"
        );
        h.append(HEADER, HeaderValue::from_static("k-2"));
        assert_eq!(IdempotencyKey::from_headers(&h), Err(InvalidKey::Repeated));
        let mut r = HeaderMap::new();
        assert!(!is_replayed(&r));
        r.insert(REPLAYED_HEADER, HeaderValue::from_static("True"));
        assert!(is_replayed(&r));
    }
}
