//! What the dashboard remembers about one scrape target between polls: counter
//! readings (for rates), the process start time (for restarts), per-consumer series.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::db::SourceStatus;
use super::markers::{restart_marker, TimelineMarker};
use super::prometheus::{Exposition, ScrapeResult};
use super::series::{duplicate_ratio, CounterRate, RestartDetector, Series};
use crate::config::MetricNames;
use crate::engine::store::Durability;

/// How long the duplicate counter may stay flat under traffic before the parachute
/// alert ("the dedup path is never exercised").
pub const PARACHUTE_QUIET: Duration = Duration::from_secs(3600);
/// The span of the smoothed duplicate ratio used for alerts.
pub const RATIO_SPAN: Duration = Duration::from_secs(60);

/// The names RabbitMQ's own exporter serves (the `rabbitmq_prometheus` plugin, 3.10+,
/// on `:15692/metrics`): a target exposing them is a broker, charted beside the
/// consumers. Global counters, summed over `protocol` and `queue_type`.
pub const RABBITMQ_REDELIVERED: &str = "rabbitmq_global_messages_redelivered_total";
pub const RABBITMQ_ACKNOWLEDGED: &str = "rabbitmq_global_messages_acknowledged_total";
pub const RABBITMQ_READY: &str = "rabbitmq_queue_messages_ready";
pub const RABBITMQ_UNACKED: &str = "rabbitmq_queue_messages_unacked";

/// A RabbitMQ broker's view: how often it redelivers, beside what the consumers drop.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BrokerStatus {
    pub target: String,
    pub up: bool,
    /// Deliveries the broker flagged `redelivered` (after a nack or a dead consumer).
    pub redelivered: CounterReading,
    pub acknowledged: CounterReading,
    pub messages_ready: Option<f64>,
    pub messages_unacked: Option<f64>,
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
    pub url: String,
    #[serde(flatten)]
    pub status: SourceStatus,
    pub scraped_at: Option<DateTime<Utc>>,
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
    /// Duplicate rate of the last scrape interval (SPEC §5); None without traffic.
    pub duplicate_ratio: Option<f64>,
    /// Duplicate rate over the last minute: what the alert threshold reads.
    pub duplicate_ratio_1m: Option<f64>,
    pub redelivered: CounterReading,
    pub out_of_order: CounterReading,
    pub dead_lettered: CounterReading,
    pub dead_lettered_by_reason: BTreeMap<String, f64>,
    /// `idem_side_effects_total` by `result` (sent / suppressed / failed).
    pub side_effects: BTreeMap<String, CounterReading>,
    pub claims_in_doubt: Option<f64>,
    pub last_restart: Option<DateTime<Utc>>,
    /// How long messages have flowed without a single duplicate being dropped, once
    /// that reaches [`PARACHUTE_QUIET`]; None otherwise.
    pub duplicates_quiet_seconds: Option<i64>,
}

/// The chartable series of one consumer (rates per second; gaps where a scrape
/// failed).
#[derive(Debug, Clone, Default)]
pub struct ConsumerSeries {
    pub processed_per_s: Series,
    pub duplicates_per_s: Series,
    pub duplicate_ratio: Series,
    pub redelivered_per_s: Series,
    pub out_of_order_per_s: Series,
    pub dead_lettered_per_s: Series,
}

impl ConsumerSeries {
    fn all_mut(&mut self) -> [&mut Series; 6] {
        [
            &mut self.processed_per_s,
            &mut self.duplicates_per_s,
            &mut self.duplicate_ratio,
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
    first_seen: DateTime<Utc>,
    duplicate_last_rose: Option<DateTime<Utc>>,
    processed_last_rose: Option<DateTime<Utc>>,
}

/// The memory of one target across scrapes.
#[derive(Debug, Clone)]
pub struct TargetTracker {
    status: TargetStatus,
    counters: HashMap<(String, String), CounterRate>,
    restarts: RestartDetector,
    consumers: BTreeMap<String, ConsumerTrack>,
    broker: Option<BrokerTrack>,
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
    pub fn new(name: &str, url: &str) -> TargetTracker {
        TargetTracker {
            status: TargetStatus {
                name: name.to_string(),
                url: url.to_string(),
                status: SourceStatus::Down {
                    error: "not scraped yet".into(),
                },
                scraped_at: None,
                scrape_ms: None,
                samples: 0,
                process_start_time: None,
                last_restart: None,
                durability: None,
                http: BTreeMap::new(),
            },
            counters: HashMap::new(),
            restarts: RestartDetector::default(),
            consumers: BTreeMap::new(),
            broker: None,
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
                self.status.samples = exposition.samples.len();
                self.observe_broker(exposition, scrape.at);
                self.observe_exposition(exposition, scrape.at, names)
            }
        }
    }

    /// Read RabbitMQ's counters when the exposition has them.
    fn observe_broker(&mut self, exposition: &Exposition, at: DateTime<Utc>) {
        if exposition.named(RABBITMQ_REDELIVERED).next().is_none() {
            return;
        }
        let mut reading = |metric: &str| {
            let total: f64 = exposition.named(metric).map(|s| s.value).sum();
            let obs = self
                .counters
                .entry((metric.to_string(), String::new()))
                .or_default()
                .observe(at, total);
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
                up: true,
                redelivered,
                acknowledged,
                messages_ready: None,
                messages_unacked: None,
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
        exposition: &Exposition,
        at: DateTime<Utc>,
        names: &MetricNames,
    ) -> Option<TimelineMarker> {
        let target = self.status.name.clone();
        let mut reset_metric: Option<String> = None;
        // consumer → role → reading (summed over extra labels such as reason).
        let mut readings: BTreeMap<String, BTreeMap<&str, CounterReading>> = BTreeMap::new();
        let mut by_reason: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
        let mut effects: BTreeMap<String, BTreeMap<String, CounterReading>> = BTreeMap::new();
        let roles: [(&str, &str); 6] = [
            ("processed", &names.processed),
            ("duplicate_dropped", &names.duplicate_dropped),
            ("redelivered", &names.redelivered),
            ("out_of_order", &names.out_of_order),
            ("dead_lettered", &names.dead_lettered),
            ("side_effects", &names.side_effects),
        ];
        for (role, metric) in roles {
            for sample in exposition.named(metric) {
                let consumer = consumer_of(sample, names, &target).to_string();
                let key = (
                    metric.to_string(),
                    sample
                        .labels
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(","),
                );
                let obs = self
                    .counters
                    .entry(key)
                    .or_default()
                    .observe(at, sample.value);
                if obs.reset && reset_metric.is_none() {
                    reset_metric = Some(metric.to_string());
                }
                let reading = CounterReading {
                    total: sample.value,
                    per_second: obs.rate,
                };
                let slot = readings
                    .entry(consumer.clone())
                    .or_default()
                    .entry(role)
                    .or_default();
                add_reading(slot, reading);
                if role == "dead_lettered" {
                    let reason = sample.label(&names.reason_label).unwrap_or("unknown");
                    *by_reason
                        .entry(consumer.clone())
                        .or_default()
                        .entry(reason.to_string())
                        .or_default() += sample.value;
                }
                if role == "side_effects" {
                    let result = sample.label(&names.result_label).unwrap_or("unknown");
                    add_reading(
                        effects
                            .entry(consumer)
                            .or_default()
                            .entry(result.to_string())
                            .or_default(),
                        reading,
                    );
                }
            }
        }
        let mut http: BTreeMap<String, BTreeMap<String, CounterReading>> = BTreeMap::new();
        for sample in exposition.named(&names.http_requests) {
            let route = sample.label("route").unwrap_or("unknown").to_string();
            let outcome = sample.label("outcome").unwrap_or("unknown").to_string();
            let key = (
                names.http_requests.clone(),
                format!("route={route},outcome={outcome}"),
            );
            let obs = self
                .counters
                .entry(key)
                .or_default()
                .observe(at, sample.value);
            http.entry(route).or_default().insert(
                outcome,
                CounterReading {
                    total: sample.value,
                    per_second: obs.rate,
                },
            );
        }
        self.status.http = http;
        self.status.durability = exposition
            .named(&names.engine_info)
            .filter(|s| s.value > 0.0)
            .find_map(|s| s.label("durability").and_then(Durability::parse));
        let in_doubt: BTreeMap<String, f64> = exposition
            .named(&names.claims_in_doubt)
            .map(|s| (consumer_of(s, names, &target).to_string(), s.value))
            .collect();

        let start = exposition.first(&names.process_start_time);
        self.status.process_start_time = start.or(self.status.process_start_time);
        let marker = self
            .restarts
            .observe(start, reset_metric.as_deref())
            .map(|cause| {
                self.status.last_restart = Some(at);
                restart_marker(&target, at, &cause.to_string())
            });

        for (consumer, roles) in readings {
            let track = self
                .consumers
                .entry(consumer.clone())
                .or_insert_with(|| new_track(&target, &consumer, at));
            let get = |r: &str| roles.get(r).copied().unwrap_or_default();
            let s = &mut track.status;
            s.up = true;
            s.processed = get("processed");
            s.duplicate_dropped = get("duplicate_dropped");
            s.redelivered = get("redelivered");
            s.out_of_order = get("out_of_order");
            s.dead_lettered = get("dead_lettered");
            s.dead_lettered_by_reason = by_reason.remove(&consumer).unwrap_or_default();
            s.side_effects = effects.remove(&consumer).unwrap_or_default();
            s.claims_in_doubt = in_doubt.get(&consumer).copied();
            s.last_restart = self.status.last_restart;
            s.duplicate_ratio = match (s.processed.per_second, s.duplicate_dropped.per_second) {
                (Some(p), Some(d)) => duplicate_ratio(p, d),
                _ => None,
            };
            update_series(track, at);
        }
        marker
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
        status: ConsumerStatus {
            target: target.to_string(),
            consumer: consumer.to_string(),
            up: true,
            processed: CounterReading::default(),
            duplicate_dropped: CounterReading::default(),
            duplicate_ratio: None,
            duplicate_ratio_1m: None,
            redelivered: CounterReading::default(),
            out_of_order: CounterReading::default(),
            dead_lettered: CounterReading::default(),
            dead_lettered_by_reason: BTreeMap::new(),
            side_effects: BTreeMap::new(),
            claims_in_doubt: None,
            last_restart: None,
            duplicates_quiet_seconds: None,
        },
        series: ConsumerSeries::default(),
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
    for series in track.series.all_mut() {
        series.push_gap(at);
    }
}

fn update_series(track: &mut ConsumerTrack, at: DateTime<Utc>) {
    let s = &track.status;
    // The first scrape of a consumer has totals but no rates yet: nothing to chart.
    if s.processed.per_second.is_some() || s.duplicate_dropped.per_second.is_some() {
        let series = &mut track.series;
        series.processed_per_s.push(at, s.processed.per_second);
        series
            .duplicates_per_s
            .push(at, s.duplicate_dropped.per_second);
        series.duplicate_ratio.push(at, s.duplicate_ratio);
        series.redelivered_per_s.push(at, s.redelivered.per_second);
        series
            .out_of_order_per_s
            .push(at, s.out_of_order.per_second);
        series
            .dead_lettered_per_s
            .push(at, s.dead_lettered.per_second);
    }
    let rose = |r: &CounterReading| r.per_second.is_some_and(|v| v > 0.0);
    if rose(&s.duplicate_dropped) {
        track.duplicate_last_rose = Some(at);
    }
    if rose(&s.processed) {
        track.processed_last_rose = Some(at);
    }
    let processed_mean = track.series.processed_per_s.mean_over(at, RATIO_SPAN);
    let duplicate_mean = track.series.duplicates_per_s.mean_over(at, RATIO_SPAN);
    let quiet_since = track.duplicate_last_rose.unwrap_or(track.first_seen);
    let quiet = at - quiet_since;
    let traffic_recently = track.processed_last_rose.is_some_and(|t| {
        t > quiet_since && (at - t).to_std().unwrap_or_default() < PARACHUTE_QUIET
    });
    let s = &mut track.status;
    s.duplicate_ratio_1m = match (processed_mean, duplicate_mean) {
        (Some(p), Some(d)) => duplicate_ratio(p, d),
        _ => None,
    };
    s.duplicates_quiet_seconds = (traffic_recently
        && quiet.to_std().unwrap_or_default() >= PARACHUTE_QUIET)
        .then(|| quiet.num_seconds());
}
