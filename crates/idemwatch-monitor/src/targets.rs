//! What the dashboard remembers about one scrape target between polls: counter
//! readings (for rates), the process start time (for restarts), per-consumer series.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::db::SourceStatus;
use super::markers::{restart_marker, TimelineMarker};
use super::prometheus::{ByName, ScrapeResult};
use super::rates::{
    duplicate_ratio, CounterRate, RateObservation, RestartCause, RestartDetector, WindowedCounter,
    WINDOW_1M, WINDOW_5M,
};
use super::series::Series;
use crate::config::MetricNames;
use idemwatch_engine::store::Durability;

/// How long the duplicate counter may stay flat under traffic before the parachute
/// alert ("the dedup path is never exercised").
pub const PARACHUTE_QUIET: Duration = Duration::from_secs(3600);
/// A consumer with nothing processed in the last minute is *stalled* (not merely
/// quiet) when the rate before that minute promised at least this many.
pub const STALLED_EXPECTED_PER_MINUTE: f64 = 3.0;

/// The names RabbitMQ's own exporter serves (the `rabbitmq_prometheus` plugin, 3.10+,
/// on `:15692/metrics`): a target exposing them is a broker, charted beside the
/// consumers. Global counters, summed over `protocol` and `queue_type`.
pub const RABBITMQ_REDELIVERED: &str = "rabbitmq_global_messages_redelivered_total";
pub const RABBITMQ_ACKNOWLEDGED: &str = "rabbitmq_global_messages_acknowledged_total";
pub const RABBITMQ_READY: &str = "rabbitmq_queue_messages_ready";
pub const RABBITMQ_UNACKED: &str = "rabbitmq_queue_messages_unacked";

/// Which broker a [`BrokerStatus`] describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BrokerKind {
    /// A RabbitMQ exporter among the scrape targets.
    RabbitMq,
    /// A NATS server's JetStream monitoring (`[[jetstream]]`, see `jetstream.rs`).
    JetStream,
}

/// A broker's view: how often it redelivers, beside what the consumers drop.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BrokerStatus {
    pub target: String,
    pub kind: BrokerKind,
    pub up: bool,
    /// Deliveries the broker flagged `redelivered` (after a nack or a dead consumer).
    pub redelivered: CounterReading,
    pub acknowledged: CounterReading,
    pub messages_ready: Option<f64>,
    pub messages_unacked: Option<f64>,
    /// JetStream: each stream's `duplicate_window` in seconds (`account/stream`), a
    /// dedup window of its own (`windows.rs`). Empty for RabbitMQ.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub duplicate_windows: BTreeMap<String, f64>,
}

#[derive(Debug, Clone)]
struct BrokerTrack {
    status: BrokerStatus,
    redelivered_per_s: Series,
}

/// One target's state in a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TargetStatus {
    pub name: String,
    /// Redacted (see [`idemwatch_base::redact::redact_url`]).
    pub url: String,
    #[serde(flatten)]
    pub status: SourceStatus,
    pub scraped_at: Option<DateTime<Utc>>,
    /// The first failed scrape of the current outage; None while up.
    pub down_since: Option<DateTime<Utc>>,
    pub scrape_ms: Option<u64>,
    pub samples: usize,
    pub process_start_time: Option<f64>,
    pub last_restart: Option<DateTime<Utc>>,
    /// How the engine behind this target commits, from its `idem_engine_info`; None
    /// for an exporter that does not say (not idemwatch, or an older one). A target
    /// that goes down keeps the last value it reported.
    pub durability: Option<Durability>,
    /// The HTTP edge's requests by route, then outcome (executed, replayed,
    /// conflict, mismatch, missing_key…): replays and conflicts are the edge's
    /// duplicate_dropped. Empty for a target without a write API.
    pub http: BTreeMap<String, BTreeMap<String, CounterReading>>,
    /// `idem_seen_set_bypassed_total` by consumer: messages a fail-open seen-set
    /// handled unchecked while its Redis was down. Empty for an engine without it.
    pub seen_set_bypassed: BTreeMap<String, f64>,
    /// `idem_seen_set_ttl_seconds` when above 0: the engine's consumers run in
    /// seen-set mode over Redis, whose keys live this long.
    pub seen_set_ttl_seconds: Option<f64>,
    /// `idem_ingress_messages_total` by `source` (mqtt…): device messages taken in,
    /// and those that arrived with the DUP flag. Empty for a target without ingress.
    pub ingress: BTreeMap<String, IngressReading>,
}

/// One ingress source: its link to the broker, its messages and what it
/// dead-lettered at its door.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct IngressReading {
    /// Every message taken in, with or without the flag.
    pub received: CounterReading,
    /// Those flagged DUP on arrival (a broker's own redelivery to the ingress).
    pub dup_flagged: CounterReading,
    /// Holds its broker connection (`idem_ingress_connected`); None from an ingress
    /// that does not say.
    pub connected: Option<bool>,
    /// When the current state (connected or not) began.
    pub state_since: Option<DateTime<Utc>>,
    /// Its newest failure: the kind and when.
    pub last_error: Option<IngressError>,
    /// Messages dead-lettered at the door, by reason (`too_large`, `malformed_json`).
    pub dead_lettered: BTreeMap<String, f64>,
}

/// An ingress's newest failure (`idem_ingress_error_last_seconds`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IngressError {
    /// connect, login_refused, tls, protocol, queue, store.
    pub kind: String,
    pub at: DateTime<Utc>,
    /// Failures of that kind so far.
    pub count: f64,
}

/// A counter's total and its current rate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CounterReading {
    pub total: f64,
    pub per_second: Option<f64>,
}

/// One consumer of one target, as the overview shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerStatus {
    pub target: String,
    pub consumer: String,
    /// The target answered the last scrape; when false the numbers are the last known
    /// totals and every rate is None.
    pub up: bool,
    pub processed: CounterReading,
    pub duplicate_dropped: CounterReading,
    /// Duplicate rate of the last scrape interval (docs/CONTRACT.md §5); None without traffic.
    pub duplicate_ratio: Option<f64>,
    /// Duplicate rate over the last minute: what the alert threshold reads.
    pub duplicate_ratio_1m: Option<f64>,
    /// Counts and mean rates over the last minute and the last five: the dashboard's
    /// default columns (the `per_second` values are the last poll's, on demand).
    pub window_1m: WindowCounts,
    pub window_5m: WindowCounts,
    /// Sums over every incarnation the dashboard saw: unlike the counters, they do
    /// not drop back at a restart.
    pub totals: Totals,
    /// Flowing, quiet, stalled, down, or no data yet.
    pub flow: Flow,
    pub redelivered: CounterReading,
    pub out_of_order: CounterReading,
    pub dead_lettered: CounterReading,
    pub dead_lettered_by_reason: BTreeMap<String, f64>,
    /// `idem_side_effects_total` by `result` (sent / suppressed / failed).
    pub side_effects: BTreeMap<String, CounterReading>,
    pub claims_in_doubt: Option<f64>,
    /// The consumer stopped leasing because its store or provider is unhealthy.
    pub paused: Option<PausedReading>,
    /// `idem_provider_repeat_calls_total` by `reason` (lease_takeover,
    /// sweeper_redrive, provider_retry, unexpected): the provider called twice for one
    /// key. Empty for
    /// a consumer without side effects.
    pub provider_repeat_calls: BTreeMap<String, f64>,
    /// The batch in hand has waited this long (seconds) for a peer that has not
    /// answered yet, once that is [`WAITING_AFTER`] or more: the stall before a
    /// deadline fires and pauses it.
    pub waiting_seconds: Option<i64>,
    pub last_restart: Option<DateTime<Utc>>,
    /// How long messages have flowed without a single duplicate being dropped, once
    /// that reaches [`PARACHUTE_QUIET`]; None otherwise.
    pub duplicates_quiet_seconds: Option<i64>,
    /// `idem_duplicate_age_seconds` and its maximum; None when the engine exports
    /// neither (an engine older than them, or not idemwatch).
    pub duplicate_age: Option<AgeReading>,
}

impl ConsumerStatus {
    /// A consumer seen for the first time: up, nothing counted, no data yet. The
    /// tracker fills it from scrapes; the alert replay of a past window from the
    /// Prometheus history and the dead letters (`super::replay`).
    pub fn new(target: &str, consumer: &str) -> ConsumerStatus {
        ConsumerStatus {
            target: target.to_string(),
            consumer: consumer.to_string(),
            up: true,
            processed: CounterReading::default(),
            duplicate_dropped: CounterReading::default(),
            duplicate_ratio: None,
            duplicate_ratio_1m: None,
            window_1m: WindowCounts::default(),
            window_5m: WindowCounts::default(),
            totals: Totals::default(),
            flow: Flow::NoDataYet,
            redelivered: CounterReading::default(),
            out_of_order: CounterReading::default(),
            dead_lettered: CounterReading::default(),
            dead_lettered_by_reason: BTreeMap::new(),
            side_effects: BTreeMap::new(),
            claims_in_doubt: None,
            paused: None,
            provider_repeat_calls: BTreeMap::new(),
            waiting_seconds: None,
            last_restart: None,
            duplicates_quiet_seconds: None,
            duplicate_age: None,
        }
    }
}

/// One consumer's duplicate ages as its engine exports them.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AgeReading {
    /// `(le, cumulative count)` of `idem_duplicate_age_seconds`, by bound, `+Inf`
    /// last (as `f64::INFINITY`; not in JSON).
    #[serde(skip)]
    pub buckets: Vec<(f64, f64)>,
    /// Duplicates with a known age.
    pub count: f64,
    /// `idem_duplicate_age_max_seconds`: the oldest this process has dropped.
    pub max_seconds: Option<f64>,
}

/// A batch held this long (seconds) is shown as waiting: a batch commits in
/// milliseconds and one with provider calls in a few seconds (60 SMS at 1 s each,
/// 32 at a time); ten seconds of one batch is a peer that stopped answering, and
/// the consumer sits still without a word until its deadline fires (30 s by
/// default) unless the dashboard says so.
pub const WAITING_AFTER: i64 = 10;

/// A paused consumer as its engine reports it (`idem_consumer_paused` and kin):
/// messages wait in the queue, none is lost, and it resumes by itself.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PausedReading {
    /// What is unhealthy: `store`, `queue`, `provider` or `seen_set`.
    pub cause: String,
    pub since: Option<DateTime<Utc>>,
    /// The kind of the newest infrastructure failure (`timeout`, `store`,
    /// `provider_throttled`…).
    pub last_error_kind: Option<String>,
    /// Failed tries since the pause began (`idem_consumer_pause_retries`), when the
    /// engine says.
    pub retries: Option<u64>,
    /// All of it in one line ([`PausedReading::summary`]), as the dashboard shows it.
    pub summary: String,
}

impl PausedReading {
    /// What is wrong, since when, how often it was tried and what failed last, in
    /// one line: `store not answering since 04:12:07, 3 retries, last: timeout`. A
    /// deadline that fired last is a part "not answering"; any other failure, one
    /// "failing".
    pub fn summarize(&self) -> String {
        let state = match self.last_error_kind.as_deref() {
            Some("timeout") => "not answering",
            _ => "failing",
        };
        let mut line = format!("{} {state}", self.cause);
        if let Some(t) = self.since {
            line.push_str(&format!(" since {}", idemwatch_base::clock::clock(t)));
        }
        if let Some(n) = self.retries.filter(|n| *n > 0) {
            let word = if n == 1 { "retry" } else { "retries" };
            line.push_str(&format!(", {n} {word}"));
        }
        if let Some(kind) = &self.last_error_kind {
            line.push_str(&format!(", last: {kind}"));
        }
        line
    }
}

/// The pauses an exposition reports, by consumer.
/// What an ingress says of its link and its door, beside its message counts: a
/// source seen only here still gets its reading.
fn ingress_link(
    exposition: &ByName<'_>,
    names: &MetricNames,
    ingress: &mut BTreeMap<String, IngressReading>,
) {
    let source = |s: &super::prometheus::Sample| s.label("source").unwrap_or("unknown").to_string();
    for s in exposition.named(&names.ingress_connected) {
        ingress.entry(source(s)).or_default().connected = Some(s.value > 0.0);
    }
    for s in exposition
        .named(&names.ingress_state_since)
        .filter(|s| s.value > 0.0)
    {
        ingress.entry(source(s)).or_default().state_since =
            DateTime::from_timestamp(s.value as i64, 0);
    }
    for s in exposition.named(&names.ingress_dead_lettered) {
        let reason = s
            .label(&names.reason_label)
            .unwrap_or("unknown")
            .to_string();
        ingress
            .entry(source(s))
            .or_default()
            .dead_lettered
            .insert(reason, s.value);
    }
    let counts: FastMap<(String, String), f64> = exposition
        .named(&names.ingress_errors)
        .map(|s| {
            let kind = s.label("kind").unwrap_or("unknown").to_string();
            ((source(s), kind), s.value)
        })
        .collect();
    for s in exposition
        .named(&names.ingress_error_last)
        .filter(|s| s.value > 0.0)
    {
        let Some(at) = DateTime::from_timestamp(s.value as i64, 0) else {
            continue;
        };
        let kind = s.label("kind").unwrap_or("unknown").to_string();
        let slot = ingress.entry(source(s)).or_default();
        if slot.last_error.as_ref().is_none_or(|e| at > e.at) {
            let count = counts
                .get(&(source(s), kind.clone()))
                .copied()
                .unwrap_or(0.0);
            slot.last_error = Some(IngressError { kind, at, count });
        }
    }
}

/// Each consumer's `idem_duplicate_age_seconds` buckets (cumulative, by bound) and
/// `idem_duplicate_age_max_seconds`.
fn duplicate_ages(
    exposition: &ByName<'_>,
    names: &MetricNames,
    target: &str,
) -> FastMap<String, AgeReading> {
    let mut out: FastMap<String, AgeReading> = FastMap::default();
    let bucket = format!("{}_bucket", names.duplicate_age);
    for s in exposition.named(&bucket) {
        let Some(le) = s.label("le").and_then(|le| le.parse::<f64>().ok()) else {
            continue;
        };
        let reading = out
            .entry(consumer_of(s, names, target).to_string())
            .or_default();
        reading.buckets.push((le, s.value));
        if le.is_infinite() {
            reading.count = s.value;
        }
    }
    for r in out.values_mut() {
        r.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    for s in exposition.named(&names.duplicate_age_max) {
        out.entry(consumer_of(s, names, target).to_string())
            .or_default()
            .max_seconds = Some(s.value);
    }
    out
}

fn pauses_of(
    exposition: &ByName<'_>,
    names: &MetricNames,
    target: &str,
) -> FastMap<String, PausedReading> {
    let mut out: FastMap<String, PausedReading> = FastMap::default();
    for s in exposition.named(&names.paused).filter(|s| s.value > 0.0) {
        out.insert(
            consumer_of(s, names, target).to_string(),
            PausedReading {
                cause: s.label("cause").unwrap_or("unknown").to_string(),
                since: None,
                last_error_kind: None,
                retries: None,
                summary: String::new(),
            },
        );
    }
    for s in exposition
        .named(&names.paused_since)
        .filter(|s| s.value > 0.0)
    {
        if let Some(p) = out.get_mut(consumer_of(s, names, target)) {
            p.since = DateTime::from_timestamp(s.value as i64, 0);
        }
    }
    for s in exposition.named(&names.pause_retries) {
        if let Some(p) = out.get_mut(consumer_of(s, names, target)) {
            p.retries = Some(s.value.max(0.0) as u64);
        }
    }
    let mut newest: FastMap<&str, f64> = FastMap::default();
    for s in exposition
        .named(&names.infra_error_last)
        .filter(|s| s.value > 0.0)
    {
        let consumer = consumer_of(s, names, target);
        let Some(p) = out.get_mut(consumer) else {
            continue;
        };
        if newest.get(consumer).is_none_or(|t| s.value > *t) {
            newest.insert(consumer, s.value);
            p.last_error_kind = s.label("kind").map(str::to_string);
        }
    }
    for p in out.values_mut() {
        p.summary = p.summarize();
    }
    out
}

/// One consumer's counts over a window, summed across restarts.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WindowCounts {
    /// How much of the window the dashboard has watched (shorter at first).
    pub seconds: f64,
    pub processed: f64,
    pub duplicate_dropped: f64,
    pub redelivered: f64,
    pub out_of_order: f64,
    pub dead_lettered: f64,
    pub dead_lettered_by_reason: BTreeMap<String, f64>,
    pub processed_per_second: Option<f64>,
    pub duplicate_dropped_per_second: Option<f64>,
    /// dup / (processed + dup) over the window; None without traffic.
    pub duplicate_ratio: Option<f64>,
}

impl WindowCounts {
    /// A count of this window per second; None before the window has any length.
    pub fn per_second(&self, count: f64) -> Option<f64> {
        (self.seconds > 0.0).then(|| count / self.seconds)
    }

    /// Fill the mean rates and the duplicate ratio from the counts (the one place
    /// they are derived, for the live windows and the replayed ones alike).
    pub fn with_rates(mut self) -> WindowCounts {
        self.processed_per_second = self.per_second(self.processed);
        self.duplicate_dropped_per_second = self.per_second(self.duplicate_dropped);
        self.duplicate_ratio = duplicate_ratio(self.processed, self.duplicate_dropped);
        self
    }
}

/// Sums over every incarnation since the dashboard started watching (the first
/// reading included), so a restart does not hide what the consumer did before it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Totals {
    pub since: Option<DateTime<Utc>>,
    /// Restarts seen since then.
    pub restarts: u32,
    pub processed: f64,
    pub duplicate_dropped: f64,
    pub redelivered: f64,
    pub out_of_order: f64,
    pub dead_lettered: f64,
    /// `idem_side_effects_total` by result.
    pub side_effects: BTreeMap<String, f64>,
}

/// Whether messages flow, so "0" can be told from "not yet" and from "stopped".
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Flow {
    /// Fewer than two readings: no rate to show yet.
    NoDataYet,
    /// Something was processed in the last minute.
    Flowing,
    /// Nothing in the last minute, and the rate before did not promise anything: a
    /// low-rate consumer between messages.
    Quiet {
        last_processed_at: Option<DateTime<Utc>>,
    },
    /// Nothing in the last minute although the rate before it promised at least
    /// [`STALLED_EXPECTED_PER_MINUTE`].
    Stalled {
        last_processed_at: Option<DateTime<Utc>>,
        expected_per_minute: f64,
    },
    /// The target did not answer its last scrape.
    Down,
}

impl Flow {
    pub fn as_str(&self) -> &'static str {
        match self {
            Flow::NoDataYet => "no data yet",
            Flow::Flowing => "flowing",
            Flow::Quiet { .. } => "quiet",
            Flow::Stalled { .. } => "STALLED",
            Flow::Down => "DOWN",
        }
    }
}

/// The counters of one consumer over windows and incarnations.
#[derive(Debug, Clone, Default)]
struct ConsumerWindows {
    roles: [WindowedCounter; ROLES],
    dead_by_reason: BTreeMap<String, WindowedCounter>,
    /// `idem_side_effects_total` by result, for the totals across restarts.
    effects: BTreeMap<String, WindowedCounter>,
}

/// The chartable series of one consumer (rates per second; gaps where a scrape
/// failed). The duplicate ratio is kept per poll and over the table's one- and
/// five-minute windows, so the chart plots the very number the Overview shows
/// beside it (a 1-second ratio swings from 0 to 11 % on one duplicate).
#[derive(Debug, Clone, Default)]
pub struct ConsumerSeries {
    pub processed_per_s: Series,
    pub duplicates_per_s: Series,
    pub duplicate_ratio: Series,
    pub duplicate_ratio_1m: Series,
    pub duplicate_ratio_5m: Series,
    pub redelivered_per_s: Series,
    pub out_of_order_per_s: Series,
    pub dead_lettered_per_s: Series,
}

impl ConsumerSeries {
    fn all_mut(&mut self) -> [&mut Series; 8] {
        [
            &mut self.processed_per_s,
            &mut self.duplicates_per_s,
            &mut self.duplicate_ratio,
            &mut self.duplicate_ratio_1m,
            &mut self.duplicate_ratio_5m,
            &mut self.redelivered_per_s,
            &mut self.out_of_order_per_s,
            &mut self.dead_lettered_per_s,
        ]
    }
}

#[derive(Debug, Clone)]
struct ConsumerTrack {
    status: ConsumerStatus,
    series: ConsumerSeries,
    windows: ConsumerWindows,
    first_seen: DateTime<Utc>,
    duplicate_last_rose: Option<DateTime<Utc>>,
    processed_last_rose: Option<DateTime<Utc>>,
}

/// The memory of one target across scrapes.
#[derive(Debug, Clone)]
pub struct TargetTracker {
    status: TargetStatus,
    counters: Counters,
    restarts: RestartDetector,
    consumers: BTreeMap<String, ConsumerTrack>,
    broker: Option<BrokerTrack>,
    /// The last scrape that answered: a label set first seen after it was born in
    /// between, at zero.
    last_answer: Option<DateTime<Utc>>,
    restarts_seen: u32,
}

/// Which consumer a sample belongs to: its consumer label, else the target itself
/// (an exporter of a single consumer may not label it).
fn consumer_of<'a>(
    sample: &'a super::prometheus::Sample,
    names: &MetricNames,
    target: &'a str,
) -> &'a str {
    sample.label(&names.consumer_label).unwrap_or(target)
}

impl TargetTracker {
    /// A target not scraped yet: down with "not scraped yet" until its first answer.
    /// The status keeps the URL as it may be shown (userinfo and secret parameters
    /// masked): snapshot text, `--json` and the dashboard all print it.
    pub fn new(name: &str, url: &str) -> TargetTracker {
        TargetTracker {
            status: TargetStatus {
                name: name.to_string(),
                url: idemwatch_base::redact::redact_url(url),
                status: SourceStatus::Down {
                    error: "not scraped yet".into(),
                },
                scraped_at: None,
                down_since: None,
                scrape_ms: None,
                samples: 0,
                process_start_time: None,
                last_restart: None,
                durability: None,
                http: BTreeMap::new(),
                seen_set_bypassed: BTreeMap::new(),
                seen_set_ttl_seconds: None,
                ingress: BTreeMap::new(),
            },
            counters: Counters::default(),
            restarts: RestartDetector::default(),
            consumers: BTreeMap::new(),
            broker: None,
            last_answer: None,
            restarts_seen: 0,
        }
    }

    /// The broker's status when this target is RabbitMQ's exporter.
    pub fn broker(&self) -> Option<&BrokerStatus> {
        self.broker.as_ref().map(|b| &b.status)
    }

    /// The broker's redeliveries per second, for the chart.
    pub fn broker_redelivered_series(&self) -> Option<&Series> {
        self.broker.as_ref().map(|b| &b.redelivered_per_s)
    }

    /// Up/down, error text and last restart as of the last scrape.
    pub fn status(&self) -> &TargetStatus {
        &self.status
    }

    /// Every consumer this target ever exposed, sorted by name; those of a target that
    /// is down keep their last totals with `up = false`.
    pub fn consumers(&self) -> impl Iterator<Item = &ConsumerStatus> {
        self.consumers.values().map(|c| &c.status)
    }

    /// The series of one consumer, for charts.
    pub fn series(&self, consumer: &str) -> Option<&ConsumerSeries> {
        self.consumers.get(consumer).map(|c| &c.series)
    }

    /// Consumer names in order, for chart selection.
    pub fn consumer_names(&self) -> impl Iterator<Item = &str> {
        self.consumers.keys().map(|k| k.as_str())
    }

    /// Take one scrape into account; returns a restart marker when the scrape reveals
    /// one.
    pub fn observe(
        &mut self,
        scrape: &ScrapeResult,
        names: &MetricNames,
    ) -> Option<TimelineMarker> {
        self.status.scraped_at = Some(scrape.at);
        self.status.scrape_ms =
            Some(u64::try_from(scrape.duration.as_millis()).unwrap_or(u64::MAX));
        match &scrape.outcome {
            Err(error) => {
                self.status.status = SourceStatus::Down {
                    error: error.clone(),
                };
                self.status.down_since.get_or_insert(scrape.at);
                self.status.samples = 0;
                for track in self.consumers.values_mut() {
                    mark_down(track, scrape.at);
                }
                if let Some(b) = &mut self.broker {
                    b.status.up = false;
                    b.status.redelivered.per_second = None;
                    b.status.acknowledged.per_second = None;
                    b.redelivered_per_s.push_gap(scrape.at);
                }
                None
            }
            Ok(exposition) => {
                self.status.status = SourceStatus::Up;
                self.status.down_since = None;
                self.status.samples = exposition.samples.len();
                let by_name = exposition.by_name();
                self.observe_broker(&by_name, scrape.at);
                let marker = self.observe_exposition(&by_name, scrape.at, names);
                self.last_answer = Some(scrape.at);
                marker
            }
        }
    }

    /// Read RabbitMQ's counters when the exposition has them.
    fn observe_broker(&mut self, exposition: &ByName<'_>, at: DateTime<Utc>) {
        if exposition.named(RABBITMQ_REDELIVERED).next().is_none() {
            return;
        }
        let mut reading = |metric: &str| {
            let total: f64 = exposition.named(metric).map(|s| s.value).sum();
            // Summed over every label: the unlabelled key.
            let obs = observe_rate(
                rates_of(&mut self.counters, metric),
                "",
                at,
                total,
                Born::Unknown,
            );
            CounterReading {
                total,
                per_second: obs.rate,
            }
        };
        let redelivered = reading(RABBITMQ_REDELIVERED);
        let acknowledged = reading(RABBITMQ_ACKNOWLEDGED);
        let gauge = |metric: &str| {
            let mut v = exposition.named(metric).map(|s| s.value).peekable();
            v.peek().is_some().then(|| v.sum())
        };
        let target = self.status.name.clone();
        let track = self.broker.get_or_insert_with(|| BrokerTrack {
            status: BrokerStatus {
                target,
                kind: BrokerKind::RabbitMq,
                up: true,
                redelivered,
                acknowledged,
                messages_ready: None,
                messages_unacked: None,
                duplicate_windows: BTreeMap::new(),
            },
            redelivered_per_s: Series::default(),
        });
        track.status.up = true;
        track.status.redelivered = redelivered;
        track.status.acknowledged = acknowledged;
        track.status.messages_ready = gauge(RABBITMQ_READY);
        track.status.messages_unacked = gauge(RABBITMQ_UNACKED);
        if redelivered.per_second.is_some() {
            track.redelivered_per_s.push(at, redelivered.per_second);
        }
    }

    fn observe_exposition(
        &mut self,
        exposition: &ByName<'_>,
        at: DateTime<Utc>,
        names: &MetricNames,
    ) -> Option<TimelineMarker> {
        let target = self.status.name.clone();
        // The start time first: a restarted process's counters start again from zero
        // even when they already climbed past their old values.
        let start = exposition.first(&names.process_start_time);
        let new_start = self.restarts.observe(start, None);
        let born = match (self.last_answer, new_start.is_some()) {
            (_, true) => Born::Restarted,
            (Some(at), false) => Born::Since(at),
            (None, false) => Born::Unknown,
        };
        let mut reset_metric: Option<&str> = None;
        // What this scrape says per consumer, borrowing the names from the exposition.
        let mut consumers: FastMap<&str, ConsumerScrape<'_>> = FastMap::default();
        let mut roles: [&str; ROLES] = Default::default();
        roles[PROCESSED] = &names.processed;
        roles[DUPLICATE_DROPPED] = &names.duplicate_dropped;
        roles[REDELIVERED] = &names.redelivered;
        roles[OUT_OF_ORDER] = &names.out_of_order;
        roles[DEAD_LETTERED] = &names.dead_lettered;
        roles[SIDE_EFFECTS] = &names.side_effects;
        for (role, metric) in roles.into_iter().enumerate() {
            let mut samples = exposition.named(metric).peekable();
            if samples.peek().is_none() {
                continue;
            }
            let rates = rates_of(&mut self.counters, metric);
            for sample in samples {
                let consumer = consumer_of(sample, names, &target);
                let obs = observe_rate(rates, sample.labels.as_key(), at, sample.value, born);
                if obs.reset && reset_metric.is_none() {
                    reset_metric = Some(metric);
                }
                let reading = CounterReading {
                    total: sample.value,
                    per_second: obs.rate,
                };
                let scrape = consumers.entry(consumer).or_default();
                add_reading(&mut scrape.roles[role], reading);
                scrape.steps[role].add(sample.value, obs.increase);
                if role == DEAD_LETTERED {
                    let reason = sample.label(&names.reason_label).unwrap_or("unknown");
                    *scrape.by_reason.entry(reason).or_default() += sample.value;
                    scrape
                        .reason_steps
                        .entry(reason)
                        .or_default()
                        .add(sample.value, obs.increase);
                }
                if role == SIDE_EFFECTS {
                    let result = sample.label(&names.result_label).unwrap_or("unknown");
                    add_reading(scrape.effects.entry(result).or_default(), reading);
                    scrape
                        .effect_steps
                        .entry(result)
                        .or_default()
                        .add(sample.value, obs.increase);
                }
            }
        }
        let mut http: BTreeMap<String, BTreeMap<String, CounterReading>> = BTreeMap::new();
        let mut http_samples = exposition.named(&names.http_requests).peekable();
        if http_samples.peek().is_some() {
            let rates = rates_of(&mut self.counters, &names.http_requests);
            for sample in http_samples {
                let route = sample.label("route").unwrap_or("unknown").to_string();
                let outcome = sample.label("outcome").unwrap_or("unknown").to_string();
                // The key of a sample labelled exactly (route, outcome), see `Labels::as_key`.
                let key = format!("route\0{route}\0outcome\0{outcome}\0");
                let obs = observe_rate(rates, &key, at, sample.value, born);
                http.entry(route).or_default().insert(
                    outcome,
                    CounterReading {
                        total: sample.value,
                        per_second: obs.rate,
                    },
                );
            }
        }
        self.status.http = http;
        let mut ingress: BTreeMap<String, IngressReading> = BTreeMap::new();
        let mut ingress_samples = exposition.named(&names.ingress_messages).peekable();
        if ingress_samples.peek().is_some() {
            let rates = rates_of(&mut self.counters, &names.ingress_messages);
            for sample in ingress_samples {
                let source = sample.label("source").unwrap_or("unknown").to_string();
                let obs = observe_rate(rates, sample.labels.as_key(), at, sample.value, born);
                let reading = CounterReading {
                    total: sample.value,
                    per_second: obs.rate,
                };
                let slot = ingress.entry(source).or_default();
                add_reading(&mut slot.received, reading);
                if sample.label("dup_flag") == Some("true") {
                    add_reading(&mut slot.dup_flagged, reading);
                }
            }
        }
        ingress_link(exposition, names, &mut ingress);
        self.status.ingress = ingress;
        self.status.durability = exposition
            .named(&names.engine_info)
            .filter(|s| s.value > 0.0)
            .find_map(|s| s.label("durability").and_then(Durability::parse));
        self.status.seen_set_bypassed = exposition
            .named(&names.seen_set_bypassed)
            .map(|s| (consumer_of(s, names, &target).to_string(), s.value))
            .collect();
        let in_doubt: FastMap<&str, f64> = exposition
            .named(&names.claims_in_doubt)
            .map(|s| (consumer_of(s, names, &target), s.value))
            .collect();
        let mut pauses = pauses_of(exposition, names, &target);
        let mut repeats: FastMap<&str, BTreeMap<String, f64>> = FastMap::default();
        for s in exposition.named(&names.provider_repeat_calls) {
            let reason = s.label(&names.reason_label).unwrap_or("unknown");
            repeats
                .entry(consumer_of(s, names, &target))
                .or_default()
                .insert(reason.to_string(), s.value);
        }
        self.status.seen_set_ttl_seconds = exposition
            .first(&names.seen_set_ttl)
            .filter(|ttl| *ttl > 0.0);
        let mut ages = duplicate_ages(exposition, names, &target);
        let busy_since: FastMap<&str, f64> = exposition
            .named(&names.busy_since)
            .filter(|s| s.value > 0.0)
            .map(|s| (consumer_of(s, names, &target), s.value))
            .collect();

        self.status.process_start_time = start.or(self.status.process_start_time);
        let cause = new_start.or_else(|| {
            reset_metric.map(|m| RestartCause::CounterReset {
                metric: m.to_string(),
            })
        });
        let marker = cause.map(|cause| {
            self.status.last_restart = Some(at);
            self.restarts_seen += 1;
            restart_marker(&target, at, &cause.to_string())
        });

        for (consumer, scrape) in consumers {
            let track = match self.consumers.get_mut(consumer) {
                Some(track) => track,
                None => self
                    .consumers
                    .entry(consumer.to_string())
                    .or_insert_with(|| new_track(&target, consumer, at)),
            };
            let s = &mut track.status;
            s.up = true;
            s.processed = scrape.roles[PROCESSED];
            s.duplicate_dropped = scrape.roles[DUPLICATE_DROPPED];
            s.redelivered = scrape.roles[REDELIVERED];
            s.out_of_order = scrape.roles[OUT_OF_ORDER];
            s.dead_lettered = scrape.roles[DEAD_LETTERED];
            replace_map(&mut s.dead_lettered_by_reason, &scrape.by_reason);
            replace_map(&mut s.side_effects, &scrape.effects);
            s.claims_in_doubt = in_doubt.get(consumer).copied();
            s.paused = pauses.remove(consumer);
            s.provider_repeat_calls = repeats.remove(consumer).unwrap_or_default();
            s.duplicate_age = ages.remove(consumer);
            s.waiting_seconds = busy_since
                .get(consumer)
                .map(|since| at.timestamp() - *since as i64)
                .filter(|held| *held >= WAITING_AFTER);
            s.last_restart = self.status.last_restart;
            s.duplicate_ratio = match (s.processed.per_second, s.duplicate_dropped.per_second) {
                (Some(p), Some(d)) => duplicate_ratio(p, d),
                _ => None,
            };
            track.windows.take(&scrape, at);
            s.totals.restarts = self.restarts_seen;
            update_windows(track, at);
            update_series(track, at);
        }
        marker
    }
}

/// The counters of [`MetricNames`] read per consumer, by index (`roles` in
/// `observe_exposition`).
const ROLES: usize = 6;
const PROCESSED: usize = 0;
const DUPLICATE_DROPPED: usize = 1;
const REDELIVERED: usize = 2;
const OUT_OF_ORDER: usize = 3;
const DEAD_LETTERED: usize = 4;
const SIDE_EFFECTS: usize = 5;

/// One consumer's readings in one scrape, summed over extra labels (reason…).
#[derive(Debug, Default)]
struct ConsumerScrape<'e> {
    roles: [CounterReading; ROLES],
    by_reason: BTreeMap<&'e str, f64>,
    effects: BTreeMap<&'e str, CounterReading>,
    /// What each role and dead-letter reason rose by since the last scrape.
    steps: [Step; ROLES],
    reason_steps: BTreeMap<&'e str, Step>,
    effect_steps: BTreeMap<&'e str, Step>,
}

/// One scrape's increase of a counter summed over its label sets, and the values of
/// label sets read for the first time (the work before the dashboard looked).
#[derive(Debug, Default, Clone, Copy)]
struct Step {
    increase: f64,
    first_values: f64,
}

impl Step {
    fn add(&mut self, value: f64, increase: Option<f64>) {
        match increase {
            Some(i) => self.increase += i,
            None => self.first_values += value,
        }
    }

    fn feed(self, counter: &mut WindowedCounter, at: DateTime<Utc>) {
        if self.first_values > 0.0 || counter.watched_since().is_none() {
            counter.first(at, self.first_values);
        }
        counter.add(at, self.increase);
    }
}

impl ConsumerWindows {
    fn take(&mut self, scrape: &ConsumerScrape<'_>, at: DateTime<Utc>) {
        for (counter, step) in self.roles.iter_mut().zip(scrape.steps) {
            step.feed(counter, at);
        }
        for (reason, step) in &scrape.reason_steps {
            match self.dead_by_reason.get_mut(*reason) {
                Some(counter) => step.feed(counter, at),
                None => step.feed(
                    self.dead_by_reason.entry(reason.to_string()).or_default(),
                    at,
                ),
            }
        }
        for (result, step) in &scrape.effect_steps {
            match self.effects.get_mut(*result) {
                Some(counter) => step.feed(counter, at),
                None => step.feed(self.effects.entry(result.to_string()).or_default(), at),
            }
        }
        // A reason not in this scrape still ages out of the windows.
        for (reason, counter) in &mut self.dead_by_reason {
            if !scrape.reason_steps.contains_key(reason.as_str()) {
                counter.add(at, 0.0);
            }
        }
    }

    fn counts(&self, now: DateTime<Utc>, span: Duration) -> WindowCounts {
        let processed = &self.roles[PROCESSED];
        let count = |role: usize| self.roles[role].count(span);
        let w = WindowCounts {
            seconds: processed.covered(now, span).as_secs_f64(),
            processed: count(PROCESSED),
            duplicate_dropped: count(DUPLICATE_DROPPED),
            redelivered: count(REDELIVERED),
            out_of_order: count(OUT_OF_ORDER),
            dead_lettered: count(DEAD_LETTERED),
            dead_lettered_by_reason: self
                .dead_by_reason
                .iter()
                .map(|(r, c)| (r.clone(), c.count(span)))
                .filter(|(_, n)| *n > 0.0)
                .collect(),
            ..WindowCounts::default()
        };
        w.with_rates()
    }
}

/// Counter readings kept between scrapes: metric → label set
/// ([`Labels::as_key`](idemwatch_base::exposition::Labels::as_key)) → rate. Looked up for
/// every counter sample of every scrape, hence foldhash rather than SipHash (the
/// keys come from the targets this dashboard was configured to watch).
type Counters = FastMap<String, FastMap<Box<str>, CounterRate>>;

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// What is known of a counter's life before this reading.
#[derive(Debug, Clone, Copy)]
enum Born {
    /// Nothing (the target's first answer, or a broker's global counter).
    Unknown,
    /// The target answered at this time without it: a label set new now was born
    /// in between, at zero.
    Since(DateTime<Utc>),
    /// The process restarted since the last reading: every counter started again.
    Restarted,
}

/// The rates of one metric's label sets: looked up once per metric and scrape, not
/// once per sample.
fn rates_of<'c>(
    counters: &'c mut Counters,
    metric: &str,
) -> &'c mut FastMap<Box<str>, CounterRate> {
    // One small allocation per metric and scrape: `get_mut` then `entry` would not
    // borrow-check as the returned reference.
    counters.entry(metric.to_string()).or_default()
}

/// Feed one reading to the rate of one label set; a known one is found with one
/// lookup and no allocation.
fn observe_rate(
    rates: &mut FastMap<Box<str>, CounterRate>,
    labels: &str,
    at: DateTime<Utc>,
    value: f64,
    born: Born,
) -> RateObservation {
    let restarted = matches!(born, Born::Restarted);
    match rates.get_mut(labels) {
        Some(rate) => rate.observe_with(at, value, restarted),
        None => {
            let rate = match born {
                Born::Since(then) => CounterRate::born_at(then),
                // Its previous process did not have it: all of it is new.
                Born::Restarted => CounterRate::born_at(at - chrono::Duration::seconds(1)),
                Born::Unknown => CounterRate::default(),
            };
            rates
                .entry(labels.into())
                .or_insert(rate)
                .observe(at, value)
        }
    }
}

/// Make `map` equal `new`; when the keys are the same as last scrape (the usual
/// case) only the values are written, nothing is allocated.
fn replace_map<V: Copy>(map: &mut BTreeMap<String, V>, new: &BTreeMap<&str, V>) {
    let same_keys = map.len() == new.len() && map.keys().zip(new.keys()).all(|(a, b)| a == b);
    if same_keys {
        for (slot, value) in map.values_mut().zip(new.values()) {
            *slot = *value;
        }
    } else {
        *map = new.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    }
}

/// Sum readings of one role over extra labels (dead letters of every reason).
fn add_reading(slot: &mut CounterReading, reading: CounterReading) {
    slot.total += reading.total;
    slot.per_second = match (slot.per_second, reading.per_second) {
        (Some(a), Some(b)) => Some(a + b),
        (a, b) => a.or(b),
    };
}

fn new_track(target: &str, consumer: &str, at: DateTime<Utc>) -> ConsumerTrack {
    ConsumerTrack {
        status: ConsumerStatus::new(target, consumer),
        series: ConsumerSeries::default(),
        windows: ConsumerWindows::default(),
        first_seen: at,
        duplicate_last_rose: None,
        processed_last_rose: None,
    }
}

fn mark_down(track: &mut ConsumerTrack, at: DateTime<Utc>) {
    let s = &mut track.status;
    s.up = false;
    for reading in [
        &mut s.processed,
        &mut s.duplicate_dropped,
        &mut s.redelivered,
        &mut s.out_of_order,
        &mut s.dead_lettered,
    ] {
        reading.per_second = None;
    }
    s.duplicate_ratio = None;
    s.flow = Flow::Down;
    for series in track.series.all_mut() {
        series.push_gap(at);
    }
}

/// The window counts, totals and flow state after a scrape.
fn update_windows(track: &mut ConsumerTrack, at: DateTime<Utc>) {
    let w = &track.windows;
    let s = &mut track.status;
    s.window_1m = w.counts(at, WINDOW_1M);
    s.window_5m = w.counts(at, WINDOW_5M);
    s.duplicate_ratio_1m = s.window_1m.duplicate_ratio;
    let total = |role: usize| w.roles[role].total();
    s.totals.since = w.roles[PROCESSED].watched_since();
    s.totals.processed = total(PROCESSED);
    s.totals.duplicate_dropped = total(DUPLICATE_DROPPED);
    s.totals.redelivered = total(REDELIVERED);
    s.totals.out_of_order = total(OUT_OF_ORDER);
    s.totals.dead_lettered = total(DEAD_LETTERED);
    s.totals.side_effects = w
        .effects
        .iter()
        .map(|(result, c)| (result.clone(), c.total()))
        .collect();
    s.flow = flow(&s.window_1m, &s.window_5m, w.roles[PROCESSED].last_rise());
}

/// Flowing, quiet or stalled, from the last minute and the four before it.
fn flow(one: &WindowCounts, five: &WindowCounts, last: Option<DateTime<Utc>>) -> Flow {
    if one.seconds <= 0.0 {
        return Flow::NoDataYet;
    }
    if one.processed > 0.0 || one.duplicate_dropped > 0.0 {
        return Flow::Flowing;
    }
    let before_seconds = five.seconds - one.seconds;
    let expected_per_minute = if before_seconds > 0.0 {
        (five.processed - one.processed) / before_seconds * 60.0
    } else {
        0.0
    };
    if expected_per_minute >= STALLED_EXPECTED_PER_MINUTE {
        Flow::Stalled {
            last_processed_at: last,
            expected_per_minute,
        }
    } else {
        Flow::Quiet {
            last_processed_at: last,
        }
    }
}

fn update_series(track: &mut ConsumerTrack, at: DateTime<Utc>) {
    let s = &track.status;
    // The first scrape of a consumer has totals but no rates yet: nothing to chart.
    if s.processed.per_second.is_some() || s.duplicate_dropped.per_second.is_some() {
        // In the order of `ConsumerSeries::all_mut`.
        let values = [
            s.processed.per_second,
            s.duplicate_dropped.per_second,
            s.duplicate_ratio,
            s.window_1m.duplicate_ratio,
            s.window_5m.duplicate_ratio,
            s.redelivered.per_second,
            s.out_of_order.per_second,
            s.dead_lettered.per_second,
        ];
        for (series, value) in track.series.all_mut().into_iter().zip(values) {
            series.push(at, value);
        }
    }
    let rose = |r: &CounterReading| r.per_second.is_some_and(|v| v > 0.0);
    if rose(&s.duplicate_dropped) {
        track.duplicate_last_rose = Some(at);
    }
    if rose(&s.processed) {
        track.processed_last_rose = Some(at);
    }
    let quiet_since = track.duplicate_last_rose.unwrap_or(track.first_seen);
    let quiet = at - quiet_since;
    let traffic_recently = track.processed_last_rose.is_some_and(|t| {
        t > quiet_since && (at - t).to_std().unwrap_or_default() < PARACHUTE_QUIET
    });
    let s = &mut track.status;
    s.duplicates_quiet_seconds = (traffic_recently
        && quiet.to_std().unwrap_or_default() >= PARACHUTE_QUIET)
        .then(|| quiet.num_seconds());
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemwatch_base::exposition::{parse, Format};

    fn scrape(seconds: i64, text: &str) -> ScrapeResult {
        ScrapeResult {
            target: "t".into(),
            url: "u".into(),
            at: DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap_or_default(),
            duration: Duration::ZERO,
            outcome: parse(text, Format::PrometheusText).map_err(|e| e.to_string()),
        }
    }

    #[test]
    fn label_values_with_commas_keep_their_own_counters() {
        let names = MetricNames::default();
        let mut tracker = TargetTracker::new("t", "u");
        // Joined as `k=v,…` these two label sets would read the same.
        let at = |s: i64, a: u32, b: u32| {
            scrape(
                s,
                &format!(
                    "idem_dead_lettered_total{{consumer=\"c\",reason=\"x,y=z\"}} {a}\n\
                     idem_dead_lettered_total{{consumer=\"c\",reason=\"x\",y=\"z\"}} {b}\n"
                ),
            )
        };
        tracker.observe(&at(0, 10, 1000), &names);
        let marker = tracker.observe(&at(10, 20, 1010), &names);
        assert!(marker.is_none(), "no counter went down: {marker:?}");
        let c = tracker
            .consumers()
            .next()
            .cloned()
            .unwrap_or_else(|| panic!("no consumer"));
        assert_eq!(c.dead_lettered.total, 1030.0);
        assert_eq!(c.dead_lettered.per_second, Some(2.0));
        assert_eq!(c.dead_lettered_by_reason.get("x,y=z"), Some(&20.0));
        assert_eq!(c.dead_lettered_by_reason.get("x"), Some(&1010.0));
    }

    /// The Overview's Σ sent/suppr/fail: every incarnation's side effects, across a
    /// restart that starts the counters again from zero (it read 0/0/0 while the
    /// target exported hundreds).
    #[test]
    fn side_effect_totals_sum_every_incarnation() {
        let names = MetricNames::default();
        let mut tracker = TargetTracker::new("t", "u");
        let at = |s: i64, start: u32, sent: u32, suppressed: u32| {
            scrape(
                s,
                &format!(
                    "idem_side_effects_total{{consumer=\"sms\",result=\"sent\"}} {sent}\n\
                     idem_side_effects_total{{consumer=\"sms\",result=\"suppressed\"}} {suppressed}\n\
                     process_start_time_seconds {start}\n"
                ),
            )
        };
        tracker.observe(&at(0, 100, 50, 1), &names);
        tracker.observe(&at(10, 100, 54, 2), &names);
        let marker = tracker.observe(&at(20, 200, 3, 1), &names);
        assert!(marker.is_some(), "the new start time is a restart");
        let c = tracker
            .consumers()
            .next()
            .cloned()
            .unwrap_or_else(|| panic!("no consumer"));
        assert_eq!(
            c.totals.side_effects.get("sent"),
            Some(&57.0),
            "{:?}",
            c.totals
        );
        assert_eq!(c.totals.side_effects.get("suppressed"), Some(&3.0));
        assert_eq!(c.totals.restarts, 1);
    }
}
