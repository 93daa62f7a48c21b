//! HTTP client for the external side effects: the SMS provider and the customer's
//! ERP webhook (docs/CONTRACT.md §4). Real HTTP through reqwest.

use std::time::{Duration, SystemTime};

use idemwatch_base::vocab::{InfraKind, PauseCause};
use serde_json::Value;

use super::idempotency_key::{self, IdempotencyKey};

/// The provider's answer to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderReply {
    pub status: u16,
    /// The provider recognised the Idempotency-Key and replayed its first answer:
    /// nothing was sent this time.
    pub replayed: bool,
    pub body: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// Network error: the request may or may not have reached the provider.
    #[error("provider unreachable: {0}")]
    Transport(String),
    /// No answer within the client's deadline (connect or the whole call): the
    /// request may or may not have reached the provider. Counted as `timeout`.
    #[error("provider did not answer in time: {0}")]
    TimedOut(String),
    /// 5xx: the provider failed; retrying (with the same key) is safe.
    #[error("provider error {status}: {body}")]
    Unavailable { status: u16, body: String },
    /// 408, 425, 429: the provider asks us to come back later (`retry_after`, from
    /// its `Retry-After` header, when it said): a retry, never a loss.
    #[error("provider throttled the request ({status}): {body}")]
    Throttled {
        status: u16,
        retry_after: Option<Duration>,
        body: String,
    },
    /// Any other 4xx: the provider refused the request; retrying will not help.
    #[error("provider rejected the request ({status}): {body}")]
    Rejected { status: u16, body: String },
}

/// The most of a provider's answer we keep (docs/CONTRACT.md §8: a `provider_rejected` detail
/// holds at most 4 KiB of the body). The answer is stored and shown: a provider that
/// answers with megabytes must not put them in `dead_letters` or the log.
pub const MAX_PROVIDER_BODY: usize = 4096;

/// The first `max` bytes of a response's body as text (invalid UTF-8 replaced, a
/// character cut at the cap dropped); the rest is never read.
async fn read_capped(mut resp: reqwest::Response, max: usize) -> Result<String, reqwest::Error> {
    let mut body = Vec::new();
    while body.len() < max {
        match resp.chunk().await? {
            Some(piece) => body.extend_from_slice(&piece[..piece.len().min(max - body.len())]),
            None => break,
        }
    }
    let text = match std::str::from_utf8(&body) {
        Ok(text) => text.to_string(),
        // Cut inside a character: keep what is whole.
        Err(e) if e.error_len().is_none() => {
            String::from_utf8_lossy(&body[..e.valid_up_to()]).into_owned()
        }
        Err(_) => String::from_utf8_lossy(&body).into_owned(),
    };
    Ok(text)
}

impl ProviderError {
    /// Whose fault: `Some` for a provider that could not do it now (the message is
    /// retried without counting against it), `None` for a final refusal.
    pub fn infra_kind(&self) -> Option<InfraKind> {
        match self {
            ProviderError::Transport(_) => Some(InfraKind::ProviderUnreachable),
            ProviderError::TimedOut(_) => Some(InfraKind::Timeout(PauseCause::Provider)),
            ProviderError::Unavailable { .. } => Some(InfraKind::ProviderUnavailable),
            ProviderError::Throttled { .. } => Some(InfraKind::ProviderThrottled),
            ProviderError::Rejected { .. } => None,
        }
    }

    /// When the provider asked to be called again.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ProviderError::Throttled { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// A request that got no answer: timed out (a deadline, docs/CONTRACT.md §9) or not (refused,
/// reset); the words redacted either way.
fn transport(e: reqwest::Error) -> ProviderError {
    let words = idemwatch_base::redact::redact_text(&e.to_string());
    if e.is_timeout() {
        ProviderError::TimedOut(words)
    } else {
        ProviderError::Transport(words)
    }
}

/// Statuses that mean "not now" rather than "no": request timeout, too early, too
/// many requests.
fn is_throttling(status: u16) -> bool {
    matches!(status, 408 | 425 | 429)
}

/// A `Retry-After` value: delay-seconds or an HTTP date (RFC 9110 §10.2.3); a date
/// in the past is "now". Anything else is ignored (the back-off decides).
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Where side effects go.
#[derive(Debug, Clone)]
pub struct ProviderClient {
    http: reqwest::Client,
    sms_url: String,
    webhook_url: String,
}

impl ProviderClient {
    pub fn new(sms_url: &str, webhook_url: &str) -> Self {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .connect_timeout(Duration::from_secs(3))
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        ProviderClient {
            http,
            sms_url: sms_url.trim_end_matches('/').to_string(),
            webhook_url: webhook_url.trim_end_matches('/').to_string(),
        }
    }

    pub fn sms_url(&self) -> &str {
        &self.sms_url
    }

    pub fn webhook_url(&self) -> &str {
        &self.webhook_url
    }

    /// `POST {sms_url}/sms`.
    pub async fn send_sms(
        &self,
        to: &str,
        text: &str,
        idempotency_key: Option<&str>,
    ) -> Result<ProviderReply, ProviderError> {
        let body = serde_json::json!({ "to": to, "text": text });
        self.post(&format!("{}/sms", self.sms_url), &body, idempotency_key)
            .await
    }

    /// `POST {webhook_url}/erp`.
    pub async fn post_webhook(
        &self,
        body: &Value,
        idempotency_key: Option<&str>,
    ) -> Result<ProviderReply, ProviderError> {
        self.post(&format!("{}/erp", self.webhook_url), body, idempotency_key)
            .await
    }

    async fn post(
        &self,
        url: &str,
        body: &Value,
        idempotency_key: Option<&str>,
    ) -> Result<ProviderReply, ProviderError> {
        let mut req = self.http.post(url).json(body);
        if let Some(key) = idempotency_key {
            // A key the rule refuses is refused here with the 400 the provider would
            // answer, without sending it (ours are derived hex: this is a bug).
            let key = IdempotencyKey::new(key).map_err(|e| ProviderError::Rejected {
                status: 400,
                body: e.to_string(),
            })?;
            req = req.header(idempotency_key::HEADER, key.header_value());
        }
        let resp = req.send().await.map_err(transport)?;
        let status = resp.status().as_u16();
        let replayed = idempotency_key::is_replayed(resp.headers());
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        let body = read_capped(resp, MAX_PROVIDER_BODY)
            .await
            .map_err(transport)?;
        match status {
            200..=299 => Ok(ProviderReply {
                status,
                replayed,
                body,
            }),
            s if is_throttling(s) => Err(ProviderError::Throttled {
                status,
                retry_after,
                body,
            }),
            400..=499 => Err(ProviderError::Rejected { status, body }),
            _ => Err(ProviderError::Unavailable { status, body }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        let now = httpdate::parse_http_date("Tue, 01 Dec 2026 04:00:00 GMT").unwrap();
        assert_eq!(parse_retry_after("3", now), Some(Duration::from_secs(3)));
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("Tue, 01 Dec 2026 04:00:07 GMT", now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            parse_retry_after("Tue, 01 Dec 2026 03:59:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-1", now), None);
    }

    #[test]
    fn throttling_is_408_425_and_429_only() {
        assert!([408, 425, 429].into_iter().all(is_throttling));
        assert!(!is_throttling(400) && !is_throttling(503));
    }
}
