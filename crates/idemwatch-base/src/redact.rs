//! What may be shown of a secret-bearing value: the one place that decides.
//!
//! Database, queue, provider and scrape-target URLs carry passwords in their
//! userinfo (`postgres://user:pw@host/db`) or in query parameters
//! (`?password=…`, `?token=…`), and the write API's callers send tokens in headers.
//! Every surface that shows one of those (the terminal, `--json`, the log file, the
//! dashboard, error messages that quote a URL) goes through this module, so a new
//! surface cannot forget a rule the others keep. docs/CONTRACT.md §6: `postgres://user:***@host/db`.
//!
//! The same module strips control characters from text a remote peer chose (label
//! values, error bodies) before a text output prints it: an escape sequence in a
//! scraped label must not reach the operator's terminal.

use std::borrow::Cow;

/// What replaces a secret.
pub const MASK: &str = "***";

/// Query parameters whose value is a secret, compared case-insensitively after
/// `-` is read as `_`. An exact name, or a name ending in one of these
/// (`sslpassword`, `db_password`, `x_api_key`, `access_token`…).
const SECRET_PARAMS: [&str; 12] = [
    "password",
    "passwd",
    "pwd",
    "pass",
    "secret",
    "token",
    "api_key",
    "apikey",
    "key",
    "auth",
    "signature",
    "credentials",
];

/// Parameters that end like a secret but name a file path, not the secret itself.
const NOT_SECRET_PARAMS: [&str; 2] = ["sslkey", "ssl_key"];

/// Is a query parameter with this name a secret?
fn is_secret_param(name: &str) -> bool {
    let name = name.to_ascii_lowercase().replace('-', "_");
    if NOT_SECRET_PARAMS.contains(&name.as_str()) {
        return false;
    }
    SECRET_PARAMS.iter().any(|s| name.ends_with(s))
}

/// A URL with its password and secret query parameters replaced by `***`
/// (`postgres://user:***@host/db?sslmode=require&password=***`). A string the URL
/// parser refuses is still masked between `://` and the last `@` of its authority,
/// and in its query.
pub fn redact_url(raw: &str) -> String {
    match url::Url::parse(raw) {
        Ok(u) if u.has_host() || u.password().is_some() || u.query().is_some() => {
            redact_parsed(raw, u)
        }
        _ => redact_unparsed(raw),
    }
}

fn redact_parsed(raw: &str, mut u: url::Url) -> String {
    let mut changed = false;
    if u.password().is_some() {
        let _ = u.set_password(Some(MASK));
        changed = true;
    }
    if let Some(query) = u.query() {
        let masked = redact_query(query);
        if masked != query {
            u.set_query(Some(&masked));
            changed = true;
        }
    }
    // Unchanged: the text as given (the parser normalises, e.g. adds a `/`).
    if changed {
        u.to_string()
    } else {
        raw.to_string()
    }
}

/// The fallback for text that is not a URL the parser accepts but may still hold
/// credentials (`mysql://root:pw@[bad`).
fn redact_unparsed(raw: &str) -> String {
    let (head, query) = match raw.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (raw, None),
    };
    let mut out = match head.find("://") {
        Some(scheme_end) => {
            let authority_end = head[scheme_end + 3..]
                .find('/')
                .map_or(head.len(), |i| scheme_end + 3 + i);
            match head[..authority_end].rfind('@') {
                Some(at) if at > scheme_end => {
                    let userinfo = &head[scheme_end + 3..at];
                    let user = userinfo.split(':').next().unwrap_or("");
                    let shown = if userinfo.contains(':') {
                        format!("{user}:{MASK}")
                    } else {
                        user.to_string()
                    };
                    format!("{}://{shown}@{}", &head[..scheme_end], &head[at + 1..])
                }
                _ => head.to_string(),
            }
        }
        None => head.to_string(),
    };
    if let Some(q) = query {
        out.push('?');
        out.push_str(&redact_query(q));
    }
    out
}

/// `a=1&password=x` → `a=1&password=***`, other parameters byte for byte.
fn redact_query(query: &str) -> String {
    query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, value)) if !value.is_empty() && is_secret_param(&percent_decoded(name)) => {
                format!("{name}={MASK}")
            }
            _ => pair.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&")
}

fn percent_decoded(text: &str) -> String {
    url::form_urlencoded::parse(format!("{text}=").as_bytes())
        .next()
        .map(|(k, _)| k.into_owned())
        .unwrap_or_else(|| text.to_string())
}

/// Free text that may quote URLs (an HTTP client's error names the URL it failed
/// on): every `scheme://…` word in it redacted as [`redact_url`] does.
pub fn redact_text(text: &str) -> String {
    if !text.contains("://") {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(sep) = rest.find("://") {
        // The URL starts at its scheme: the letters (and `+-.`) before `://`.
        let start = rest[..sep]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
            .map_or(0, |i| i + 1);
        let end = rest[sep..]
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '`'))
            .map_or(rest.len(), |i| sep + i);
        // A URL quoted as `(http://…)` keeps its closing parenthesis outside.
        let end = if rest[start..end].ends_with(')') && !rest[start..end].contains('(') {
            end - 1
        } else {
            end
        };
        out.push_str(&rest[..start]);
        out.push_str(&redact_url(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Request headers whose value is a credential.
const SECRET_HEADERS: [&str; 5] = [
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "cookie",
    "set-cookie",
];

/// A header's value as it may be shown: a credential keeps only its scheme
/// (`Bearer ***`), everything else is shown as sent (with URLs in it redacted).
pub fn redact_header(name: &str, value: &str) -> String {
    if SECRET_HEADERS.iter().any(|h| name.eq_ignore_ascii_case(h)) {
        return match value.trim().split_once(' ') {
            Some((scheme, _)) if name.to_ascii_lowercase().ends_with("authorization") => {
                format!("{scheme} {MASK}")
            }
            _ => MASK.to_string(),
        };
    }
    redact_text(value)
}

/// Text from a remote peer (a label value, a target's error, a provider's body) as
/// a text output may print it: control characters (C0, DEL, C1 — the escape
/// sequences a terminal obeys) dropped, tabs and newlines shown as a space.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(
        text.chars()
            .filter_map(|c| match c {
                '\t' | '\n' | '\r' => Some(' '),
                c if c.is_control() => None,
                c => Some(c),
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userinfo_passwords_are_masked() {
        assert_eq!(
            redact_url("postgres://user:secret@db.example:5432/fleet"),
            "postgres://user:***@db.example:5432/fleet"
        );
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("redis://:hunter2@cache:6379"),
            "redis://:***@cache:6379"
        );
    }

    #[test]
    fn urls_without_secrets_are_shown_as_given() {
        for url in [
            "sqlite:///tmp/x.db",
            "sqlite://rel/x.db?mode=rwc",
            "postgres://postgres@127.0.0.1:5432/test",
            "http://127.0.0.1:9464/metrics",
            "postgres://u@h/db?sslmode=require&sslkey=/etc/k.pem",
        ] {
            assert_eq!(redact_url(url), url);
        }
    }

    #[test]
    fn secret_query_parameters_are_masked() {
        assert_eq!(
            redact_url("postgres://u@h/db?sslmode=require&password=hunter2"),
            "postgres://u@h/db?sslmode=require&password=***"
        );
        assert_eq!(
            redact_url("https://api.example/sms?Access-Token=abc&x=1"),
            "https://api.example/sms?Access-Token=***&x=1"
        );
        for name in [
            "sslpassword",
            "api_key",
            "apikey",
            "key",
            "auth",
            "PWD",
            "secret",
        ] {
            let shown = redact_url(&format!("mysql://h/db?{name}=hunter2"));
            assert!(!shown.contains("hunter2"), "{name}: {shown}");
        }
        // Percent-encoded name.
        assert!(!redact_url("http://h/?pass%77ord=hunter2").contains("hunter2"));
    }

    #[test]
    fn unparseable_urls_are_still_masked() {
        for raw in [
            "mysql://root:hunter2@[bad",
            "postgres://u:hunter2@h:notaport/db",
            "weird://u:hunter2@h/?password=hunter2",
            "x://h/?token=hunter2",
        ] {
            let shown = redact_url(raw);
            assert!(!shown.contains("hunter2"), "{raw} → {shown}");
        }
        assert_eq!(
            redact_url("postgres://u:hunter2@h:notaport/db"),
            "postgres://u:***@h:notaport/db"
        );
    }

    #[test]
    fn urls_inside_text_are_masked() {
        let text =
            "error sending request for url (http://admin:hunter2@10.0.0.1:9100/metrics): refused";
        assert_eq!(
            redact_text(text),
            "error sending request for url (http://admin:***@10.0.0.1:9100/metrics): refused"
        );
        assert_eq!(
            redact_text("db \"postgres://a:hunter2@h/d?password=hunter2\" down"),
            "db \"postgres://a:***@h/d?password=***\" down"
        );
        assert_eq!(redact_text("no url here"), "no url here");
    }

    #[test]
    fn credential_headers_keep_only_their_scheme() {
        assert_eq!(
            redact_header("Authorization", "Bearer tok-123"),
            "Bearer ***"
        );
        assert_eq!(redact_header("x-api-key", "tok-123"), "***");
        assert_eq!(redact_header("Idempotency-Key", "k-1"), "k-1");
    }

    #[test]
    fn control_characters_never_reach_the_terminal() {
        assert_eq!(printable("plain"), Cow::Borrowed("plain"));
        assert_eq!(printable("a\u{1b}[2Jb\u{7}c\u{9b}d"), "a[2Jbcd");
        assert_eq!(printable("two\nlines\tand\rtab"), "two lines and tab");
        assert_eq!(printable("zone ü ✓"), "zone ü ✓");
    }
}
