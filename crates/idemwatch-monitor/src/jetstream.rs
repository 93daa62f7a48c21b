//! NATS JetStream's own view, from its monitoring endpoint (`nats-server -m PORT`,
//! `GET /jsz?accounts=true&streams=true&consumers=true`): how often it redelivers,
//! charted beside what the consumers drop, as RabbitMQ's exporter is.
//!
//! JetStream has no cumulative redelivery counter: a consumer's `num_redelivered` is
//! the messages redelivered *and still unacked* (a gauge). What it does count is
//! every delivery: a consumer's `delivered.consumer_seq` rises by one per delivery,
//! redeliveries included. On a stream where each subject has one consumer (the
//! engine's layout: a work-queue stream per namespace, a filtered consumer per
//! subject), first deliveries = messages stored − messages not delivered yet, so
//!
//! ```text
//! redeliveries = Σ consumer_seq − (last_seq − Σ num_pending)
//! ```
//!
//! up to a constant (messages on a subject nobody consumes, a purge) that a rate does
//! not see. Its increases are summed per stream, only while the stream keeps the same
//! consumers (a new consumer starts at sequence 0) and never below zero, into a total
//! that only rises. Acknowledged, on a work-queue stream, is what left it:
//! `last_seq − messages`.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;

use super::rates::CounterRate;
use super::series::Series;
use super::targets::{BrokerKind, BrokerStatus, CounterReading};

/// The monitoring page read each poll.
pub const JSZ_PATH: &str = "/jsz?accounts=true&streams=true&consumers=true&config=true";

/// One stream's counts in one answer.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamReading {
    /// `account/stream`.
    pub key: String,
    /// Its consumers' names, sorted.
    pub consumers: Vec<String>,
    /// Σ `delivered.consumer_seq`: every delivery, redeliveries included.
    pub deliveries: f64,
    /// Σ `num_pending`: stored, not delivered yet.
    pub pending: f64,
    /// Σ `num_ack_pending`: delivered, not acked.
    pub ack_pending: f64,
    /// Σ `num_redelivered`: redelivered and not acked yet.
    pub in_redelivery: f64,
    pub last_seq: f64,
    pub messages: f64,
    /// The stream's `duplicate_window` in seconds: a message published again with the
    /// same `Nats-Msg-Id` within it is dropped by the server, after it stored again.
    pub duplicate_window: Option<f64>,
}

impl StreamReading {
    /// Redeliveries up to a constant (see the module doc).
    fn redeliveries(&self) -> f64 {
        self.deliveries + self.pending - self.last_seq
    }

    /// Messages that left a work-queue stream: acked.
    fn removed(&self) -> f64 {
        self.last_seq - self.messages
    }
}

#[derive(Deserialize)]
struct Jsz {
    #[serde(default)]
    account_details: Vec<Account>,
}

#[derive(Deserialize)]
struct Account {
    #[serde(default)]
    name: String,
    #[serde(default)]
    stream_detail: Vec<Stream>,
}

#[derive(Deserialize)]
struct Stream {
    name: String,
    #[serde(default)]
    state: StreamState,
    /// Present with `config=true` (see [`JSZ_PATH`]).
    #[serde(default)]
    config: Option<StreamConfig>,
    #[serde(default)]
    consumer_detail: Vec<ConsumerInfo>,
}

/// The part of a stream's configuration read here; `duplicate_window` is a Go
/// duration in nanoseconds.
#[derive(Deserialize, Default)]
struct StreamConfig {
    #[serde(default)]
    duplicate_window: Option<u64>,
}

#[derive(Deserialize, Default)]
struct StreamState {
    #[serde(default)]
    messages: u64,
    #[serde(default)]
    last_seq: u64,
}

#[derive(Deserialize)]
struct ConsumerInfo {
    name: String,
    #[serde(default)]
    delivered: Sequences,
    #[serde(default)]
    num_ack_pending: u64,
    #[serde(default)]
    num_redelivered: u64,
    #[serde(default)]
    num_pending: u64,
}

#[derive(Deserialize, Default)]
struct Sequences {
    #[serde(default)]
    consumer_seq: u64,
}

/// Read a `/jsz` answer (accounts, streams and consumers detailed).
pub fn parse_jsz(body: &[u8]) -> Result<Vec<StreamReading>, String> {
    let jsz: Jsz = serde_json::from_slice(body).map_err(|e| format!("not a /jsz answer: {e}"))?;
    Ok(jsz
        .account_details
        .into_iter()
        .flat_map(|a| {
            let account = a.name;
            a.stream_detail.into_iter().map(move |s| {
                let mut consumers: Vec<String> =
                    s.consumer_detail.iter().map(|c| c.name.clone()).collect();
                consumers.sort();
                let sum = |f: fn(&ConsumerInfo) -> u64| -> f64 {
                    s.consumer_detail.iter().map(|c| f(c) as f64).sum()
                };
                StreamReading {
                    key: format!("{account}/{}", s.name),
                    deliveries: sum(|c| c.delivered.consumer_seq),
                    pending: sum(|c| c.num_pending),
                    ack_pending: sum(|c| c.num_ack_pending),
                    in_redelivery: sum(|c| c.num_redelivered),
                    last_seq: s.state.last_seq as f64,
                    messages: s.state.messages as f64,
                    duplicate_window: s
                        .config
                        .as_ref()
                        .and_then(|c| c.duplicate_window)
                        .map(|ns| ns as f64 / 1e9),
                    consumers,
                }
            })
        })
        .collect())
}

/// Fetch and read one server's `/jsz`, within `timeout` and `max_bytes`.
pub async fn fetch(
    client: &reqwest::Client,
    base_url: &str,
    max_bytes: u64,
) -> Result<Vec<StreamReading>, String> {
    let url = format!("{}{JSZ_PATH}", base_url.trim_end_matches('/'));
    let mut response = client
        .get(&url)
        .send()
        .await
        .map_err(|e| idemwatch_base::exposition::error_chain(&e))?;
    if !response.status().is_success() {
        return Err(format!("HTTP {}", response.status()));
    }
    let mut body = Vec::new();
    while let Some(piece) = response
        .chunk()
        .await
        .map_err(|e| idemwatch_base::exposition::error_chain(&e))?
    {
        if (body.len() + piece.len()) as u64 > max_bytes {
            return Err(format!(
                "{}: more than {max_bytes} bytes",
                idemwatch_base::exposition::TOO_LARGE
            ));
        }
        body.extend_from_slice(&piece);
    }
    parse_jsz(&body)
}

/// An HTTP client for the monitoring endpoints: one timeout for the whole request.
pub fn client(timeout: Duration) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout)
        .user_agent(concat!("idemwatch/", env!("CARGO_PKG_VERSION")))
        .build()
}

/// What the dashboard remembers of one JetStream server between polls.
#[derive(Debug, Clone)]
pub struct JetStreamTracker {
    url: String,
    /// Per stream: its consumers and the two derived counts at the last answer.
    last: BTreeMap<String, (Vec<String>, f64, f64)>,
    redelivered_total: f64,
    acknowledged_total: f64,
    redelivered_rate: CounterRate,
    acknowledged_rate: CounterRate,
    status: BrokerStatus,
    redelivered_per_s: Series,
}

impl JetStreamTracker {
    pub fn new(name: &str, url: &str) -> Self {
        JetStreamTracker {
            url: url.to_string(),
            last: BTreeMap::new(),
            redelivered_total: 0.0,
            acknowledged_total: 0.0,
            redelivered_rate: CounterRate::default(),
            acknowledged_rate: CounterRate::default(),
            status: BrokerStatus {
                target: name.to_string(),
                kind: BrokerKind::JetStream,
                up: false,
                redelivered: CounterReading::default(),
                acknowledged: CounterReading::default(),
                messages_ready: None,
                messages_unacked: None,
                duplicate_windows: BTreeMap::new(),
            },
            redelivered_per_s: Series::default(),
        }
    }

    /// The base URL as configured (for fetching; never shown: see `status`).
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn status(&self) -> &BrokerStatus {
        &self.status
    }

    pub fn redelivered_series(&self) -> &Series {
        &self.redelivered_per_s
    }

    /// Take one answer (or why there was none) into account.
    pub fn observe(&mut self, at: DateTime<Utc>, answer: Result<Vec<StreamReading>, String>) {
        let streams = match answer {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(target = %self.status.target, error = %e, "JetStream monitoring did not answer");
                self.status.up = false;
                self.status.redelivered.per_second = None;
                self.status.acknowledged.per_second = None;
                self.redelivered_per_s.push_gap(at);
                return;
            }
        };
        let mut next = BTreeMap::new();
        for s in &streams {
            let (redelivered, removed) = (s.redeliveries(), s.removed());
            if let Some((consumers, r0, a0)) = self.last.get(&s.key) {
                if *consumers == s.consumers {
                    self.redelivered_total += (redelivered - r0).max(0.0);
                    self.acknowledged_total += (removed - a0).max(0.0);
                }
            }
            next.insert(s.key.clone(), (s.consumers.clone(), redelivered, removed));
        }
        self.last = next;
        let r = self.redelivered_rate.observe(at, self.redelivered_total);
        let a = self.acknowledged_rate.observe(at, self.acknowledged_total);
        self.status.up = true;
        self.status.redelivered = CounterReading {
            total: self.redelivered_total,
            per_second: r.rate,
        };
        self.status.acknowledged = CounterReading {
            total: self.acknowledged_total,
            per_second: a.rate,
        };
        self.status.duplicate_windows = streams
            .iter()
            .filter_map(|s| s.duplicate_window.map(|w| (s.key.clone(), w)))
            .collect();
        self.status.messages_ready = Some(streams.iter().map(|s| s.pending).sum());
        self.status.messages_unacked = Some(streams.iter().map(|s| s.ack_pending).sum());
        if r.rate.is_some() {
            self.redelivered_per_s.push(at, r.rate);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jsz(consumer_seq: u64, pending: u64, last_seq: u64, messages: u64) -> Vec<u8> {
        format!(
            r#"{{"server_id":"X","account_details":[{{"name":"$G","stream_detail":[{{"name":"idemwatch-ns",
            "state":{{"messages":{messages},"last_seq":{last_seq}}},
            "consumer_detail":[{{"name":"trip-counter","delivered":{{"consumer_seq":{consumer_seq},"stream_seq":1}},
            "num_ack_pending":1,"num_redelivered":1,"num_pending":{pending}}}]}}]}}]}}"#
        )
        .into_bytes()
    }

    /// A stream's `duplicate_window` (Go nanoseconds, in its config with
    /// `config=true`) reads as seconds per `account/stream`, a dedup window of its own;
    /// an answer without the config has none rather than a made-up one.
    #[test]
    fn a_stream_s_duplicate_window_is_read_from_its_config() {
        let body = br#"{"account_details":[{"name":"$G","stream_detail":[
            {"name":"FLEET","config":{"name":"FLEET","duplicate_window":120000000000},
             "state":{"messages":0,"last_seq":0},"consumer_detail":[]},
            {"name":"OLD","state":{"messages":0,"last_seq":0},"consumer_detail":[]}]}]}"#;
        let streams = parse_jsz(body).unwrap();
        assert_eq!(streams[0].duplicate_window, Some(120.0));
        assert_eq!(streams[1].duplicate_window, None);
        let mut t = JetStreamTracker::new("nats", "http://127.0.0.1:8222");
        t.observe(Utc::now(), Ok(streams));
        assert_eq!(
            t.status().duplicate_windows,
            BTreeMap::from([("$G/FLEET".to_string(), 120.0)])
        );
        assert!(JSZ_PATH.contains("config=true"));
    }

    #[test]
    fn redeliveries_are_deliveries_beyond_the_first_of_each_message() {
        let t0 = Utc::now();
        let mut t = JetStreamTracker::new("nats", "http://127.0.0.1:8222");
        // 10 stored, 4 delivered once each, 6 waiting.
        t.observe(t0, parse_jsz(&jsz(4, 6, 10, 10)));
        assert_eq!(t.status().redelivered.total, 0.0);
        // 2 more first deliveries and 3 redeliveries; 5 acked.
        t.observe(
            t0 + chrono::Duration::seconds(1),
            parse_jsz(&jsz(9, 4, 10, 5)),
        );
        let s = t.status();
        assert_eq!(
            (s.redelivered.total, s.redelivered.per_second),
            (3.0, Some(3.0))
        );
        assert_eq!(s.acknowledged.total, 5.0);
        assert_eq!(
            (s.messages_ready, s.messages_unacked),
            (Some(4.0), Some(1.0))
        );
        // 20 new messages published and delivered once: no redelivery.
        t.observe(
            t0 + chrono::Duration::seconds(2),
            parse_jsz(&jsz(29, 4, 30, 25)),
        );
        assert_eq!(t.status().redelivered.total, 3.0);
        // Down: a gap, the totals kept.
        t.observe(t0 + chrono::Duration::seconds(3), Err("refused".into()));
        assert!(!t.status().up);
        assert_eq!(t.status().redelivered.total, 3.0);
    }

    #[test]
    fn a_malformed_answer_is_an_error() {
        assert!(parse_jsz(b"<html>").is_err());
        assert_eq!(parse_jsz(b"{}").unwrap(), vec![]);
    }
}
