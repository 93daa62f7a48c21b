//! A JetStream message whose headers `async-nats` cannot read, made readable
//! (issue 39: poison at every ingress costs only itself).
//!
//! NATS headers are bytes to the server: a foreign producer can store a message whose
//! header block is not UTF-8 or has a line that is not `Name: value`. `async-nats`
//! parses every header block it receives on the connection itself, and one it cannot
//! parse ends the connection: the client reconnects, the fetch that was receiving it
//! never ends, and the message, never acked, is delivered again after `AckWait` —
//! and ends the next connection, forever (the consumer has no delivery limit; the
//! runner dead-letters poison itself, but never sees this one). Measured before this
//! module: `consume` on such a stream sat still with the message pending.
//!
//! What is ours here, by hand, is small: after a lease that failed or ran out of time,
//! the messages the consumer has delivered and not had acked are read through the
//! stream's JSON API (`STREAM.MSG.GET`, headers and body in base64: read by serde, not
//! by the connection's parser), and each whose headers would not parse is replaced:
//! a copy with the readable header lines only (and `Idemwatch-Headers-Dropped`) is
//! stored under a fresh `Nats-Msg-Id`, then the original is deleted. The copy is an
//! ordinary message: the consumer handles its body like any other (processes it, or
//! dead-letters it for what it says).

use std::str::FromStr;

use async_nats::jetstream::{self, consumer};
use async_nats::{HeaderMap, HeaderName};
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use bytes::Bytes;
use serde_json::{json, Value};

use super::{QueueError, QueueResult};

/// Header set on a copy that lost header lines no client could read.
pub const HEADERS_DROPPED: &str = "Idemwatch-Headers-Dropped";
/// Delivered messages looked at per repair, at most (a consumer's pending window).
const MOST_PENDING: u64 = 4096;

fn nats_err(e: impl std::fmt::Display) -> QueueError {
    QueueError::Nats(e.to_string())
}

/// Replace every delivered, unacked message of `consumer` (on `stream`) whose headers
/// `async-nats` cannot read; returns how many were. `queue` names the copies'
/// `Nats-Msg-Id`.
pub(super) async fn repair_unreadable_headers(
    js: &jetstream::Context,
    stream: &jetstream::stream::Stream,
    consumer: &consumer::PullConsumer,
    queue: &str,
) -> QueueResult<usize> {
    let info = consumer.get_info().await.map_err(nats_err)?;
    let (floor, last) = (
        info.ack_floor.stream_sequence,
        info.delivered.stream_sequence,
    );
    let first = (floor + 1).max(last.saturating_sub(MOST_PENDING));
    let name = stream.cached_info().config.name.clone();
    let mut repaired = 0;
    for seq in first..=last {
        let got: Value = js
            .request(format!("STREAM.MSG.GET.{name}"), &json!({ "seq": seq }))
            .await
            .map_err(nats_err)?;
        // Acked (gone from a work queue) or deleted: nothing to look at.
        let Some(message) = got.get("message") else {
            continue;
        };
        let Some(raw_headers) = message.get("hdrs").and_then(Value::as_str) else {
            continue;
        };
        let raw_headers = STANDARD.decode(raw_headers).map_err(nats_err)?;
        let (kept, dropped) = readable_lines(&raw_headers);
        if dropped == 0 {
            continue;
        }
        let subject = message
            .get("subject")
            .and_then(Value::as_str)
            .ok_or_else(|| QueueError::Nats(format!("stored message {seq} without a subject")))?;
        let body = STANDARD
            .decode(message.get("data").and_then(Value::as_str).unwrap_or(""))
            .map_err(nats_err)?;
        let mut headers = kept;
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("{queue}:h{seq}").as_str(),
        );
        headers.insert(HEADERS_DROPPED, dropped.to_string().as_str());
        js.publish_with_headers(subject.to_string(), headers, Bytes::from(body))
            .await
            .map_err(nats_err)?
            .await
            .map_err(nats_err)?;
        // Stored: the original goes. A crash in between leaves both; the original
        // kills a connection once more and is replaced again under the same id,
        // which the duplicate window drops.
        stream.delete_message(seq).await.map_err(nats_err)?;
        tracing::warn!(
            queue,
            seq,
            dropped,
            "a JetStream message with header lines no client can read was replaced by a copy without them"
        );
        repaired += 1;
    }
    Ok(repaired)
}

/// The header lines of a stored block that `async-nats` reads (UTF-8, `Name: value`
/// with a valid name, continuation lines), and how many others there were.
fn readable_lines(raw: &[u8]) -> (HeaderMap, usize) {
    let mut headers = HeaderMap::new();
    let mut dropped = 0;
    let mut lines = raw
        .split(|b| *b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    // The version line ("NATS/1.0"): a copy gets its own.
    if !lines.next().is_some_and(|l| l.starts_with(b"NATS/1.0")) {
        dropped += 1;
    }
    let mut last: Option<(HeaderName, String)> = None;
    for line in lines {
        if line.is_empty() {
            continue;
        }
        let Ok(line) = std::str::from_utf8(line) else {
            dropped += 1;
            continue;
        };
        if line.starts_with([' ', '\t']) {
            match &mut last {
                Some((_, value)) => value.push_str(line),
                None => dropped += 1,
            }
            continue;
        }
        if let Some((name, value)) = last.take() {
            headers.append(name, value.trim());
        }
        match line.split_once(':') {
            Some((name, value)) => match HeaderName::from_str(name) {
                Ok(name) => last = Some((name, value.trim_start().to_string())),
                Err(_) => dropped += 1,
            },
            None => dropped += 1,
        }
    }
    if let Some((name, value)) = last {
        headers.append(name, value.trim());
    }
    (headers, dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_lines_a_client_cannot_read_are_dropped() {
        let raw = b"NATS/1.0\r\nNats-Msg-Id: a1\r\nX-Trace: \xff\xfe\r\nno colon here\r\nX-Long: one\r\n two\r\n\r\n";
        let (kept, dropped) = readable_lines(raw);
        assert_eq!(dropped, 2);
        assert_eq!(kept.get("Nats-Msg-Id").map(|v| v.as_str()), Some("a1"));
        assert_eq!(kept.get("X-Long").map(|v| v.as_str()), Some("one two"));
        assert_eq!(kept.get("X-Trace"), None);
        let (_, none) = readable_lines(b"NATS/1.0\r\nA: b\r\n\r\n");
        assert_eq!(none, 0);
    }
}
