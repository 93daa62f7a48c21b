//! How late duplicates arrive against every dedup window the dashboard can know
//! (issue 41): each layer forgets a key after a while — the dedup table after its
//! retention, a Redis seen-set after its TTL, JetStream after its stream's
//! `duplicate_window`, a provider after its Idempotency-Key lifetime — and a copy that
//! arrives after a layer forgot its key gets through that layer. The engine exports how
//! old each dropped duplicate was (`idem_duplicate_age_seconds`, its maximum in
//! `idem_duplicate_age_max_seconds` and the store's `duplicate_ages`); here that age is
//! set beside each window as a margin, "oldest duplicate 3 h 12 m; retention 7 d:
//! margin 52×", and a window shorter than twice the oldest duplicate is short (the
//! `dedup_window_short` WARN): the field has already shown copies half that late.
//!
//! Pure: the snapshot's parts in, [`ConsumerWindows`] out.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

pub use crate::targets::AgeReading;
use crate::targets::{BrokerStatus, ConsumerStatus, TargetStatus};

/// A window shorter than this many times the oldest duplicate is short: copies half
/// as late as the window have arrived already, and nothing says the next will not
/// be later.
pub const SAFE_MARGIN: f64 = 2.0;

/// What each window is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layer {
    /// The dedup table's retention (`[database] retention`: what `purge` keeps).
    Retention,
    /// A Redis seen-set's key TTL (the engine's `--seen-set-ttl`, as it exports it).
    SeenSetTtl,
    /// A JetStream stream's `duplicate_window`, read from the server.
    JetStreamDuplicateWindow,
    /// How long a provider keeps an Idempotency-Key (`[dedup_windows]
    /// provider_key_lifetime`), for consumers with side effects.
    ProviderKeyLifetime,
}

impl Layer {
    pub fn as_str(self) -> &'static str {
        match self {
            Layer::Retention => "retention",
            Layer::SeenSetTtl => "seen-set TTL",
            Layer::JetStreamDuplicateWindow => "JetStream duplicate window",
            Layer::ProviderKeyLifetime => "provider key lifetime",
        }
    }
}

/// One dedup window beside one consumer's oldest duplicate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DedupWindow {
    pub layer: Layer,
    /// `retention`, `seen-set TTL`, `JetStream duplicate window (FLEET)`, …
    pub name: String,
    /// Where the length was read: `config`, `engine`, `server`.
    pub source: &'static str,
    pub seconds: f64,
    /// Window over the oldest duplicate; None before any duplicate with an age.
    pub margin: Option<f64>,
    /// Shorter than [`SAFE_MARGIN`] times the oldest duplicate.
    pub short: bool,
}

/// One consumer's duplicate ages against every window it has.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerWindows {
    pub target: String,
    pub consumer: String,
    /// Duplicates with a known age this process dropped.
    pub count: f64,
    pub p50_seconds: Option<f64>,
    pub p99_seconds: Option<f64>,
    /// The oldest duplicate: the larger of the process's maximum and the store's
    /// `duplicate_ages` row (which outlives restarts).
    pub max_seconds: Option<f64>,
    pub windows: Vec<DedupWindow>,
    /// "oldest duplicate 3 h 12 m; retention 7 d: margin 52×; …".
    pub summary: String,
}

impl ConsumerWindows {
    /// The windows shorter than [`SAFE_MARGIN`] times the oldest duplicate.
    pub fn short(&self) -> impl Iterator<Item = &DedupWindow> {
        self.windows.iter().filter(|w| w.short)
    }
}

/// What the windows are computed from.
#[derive(Debug, Clone, Copy)]
pub struct WindowInputs<'a> {
    pub consumers: &'a [ConsumerStatus],
    pub targets: &'a [TargetStatus],
    pub brokers: &'a [BrokerStatus],
    /// The store's `duplicate_ages` by consumer, when the database has that table.
    pub stored_max: &'a BTreeMap<String, f64>,
    /// `[database] retention`, when a database is configured.
    pub retention: Option<Duration>,
    pub provider_key_lifetime: Duration,
}

/// Every consumer's windows, in the consumers' order.
pub fn evaluate(inputs: &WindowInputs<'_>) -> Vec<ConsumerWindows> {
    let stream_windows: Vec<(String, f64)> = inputs
        .brokers
        .iter()
        .flat_map(|b| b.duplicate_windows.iter())
        .map(|(stream, seconds)| (stream.clone(), *seconds))
        .collect();
    inputs
        .consumers
        .iter()
        .map(|c| {
            let ttl = inputs
                .targets
                .iter()
                .find(|t| t.name == c.target)
                .and_then(|t| t.seen_set_ttl_seconds);
            let mut windows = Vec::new();
            let mut add = |layer: Layer, name: String, source, seconds: f64| {
                windows.push(DedupWindow {
                    layer,
                    name,
                    source,
                    seconds,
                    margin: None,
                    short: false,
                })
            };
            if let Some(r) = inputs.retention {
                add(
                    Layer::Retention,
                    "retention".into(),
                    "config",
                    r.as_secs_f64(),
                );
            }
            if let Some(ttl) = ttl {
                add(Layer::SeenSetTtl, "seen-set TTL".into(), "engine", ttl);
            }
            for (stream, seconds) in &stream_windows {
                let name = format!("JetStream duplicate window ({stream})");
                add(Layer::JetStreamDuplicateWindow, name, "server", *seconds);
            }
            if !c.side_effects.is_empty() {
                let lifetime = inputs.provider_key_lifetime.as_secs_f64();
                let name = "provider key lifetime".into();
                add(Layer::ProviderKeyLifetime, name, "config", lifetime);
            }
            let stored = inputs.stored_max.get(&c.consumer).copied();
            consumer_windows(c, stored, windows)
        })
        .collect()
}

/// One consumer's figures and margins.
fn consumer_windows(
    c: &ConsumerStatus,
    stored_max: Option<f64>,
    mut windows: Vec<DedupWindow>,
) -> ConsumerWindows {
    let reading = c.duplicate_age.clone().unwrap_or_default();
    let max = match (reading.max_seconds.filter(|m| *m > 0.0), stored_max) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    // A quantile cannot be above the oldest duplicate seen (the histogram's
    // interpolation would put it anywhere in its bucket).
    let capped = |q: Option<f64>| q.map(|v| max.map_or(v, |m| v.min(m)));
    let p50 = capped(quantile(&reading.buckets, 0.5));
    let p99 = capped(quantile(&reading.buckets, 0.99));
    for w in &mut windows {
        if let Some(m) = max.filter(|m| *m > 0.0) {
            w.margin = Some(w.seconds / m);
            w.short = w.seconds < SAFE_MARGIN * m;
        }
    }
    let summary = match max {
        // Duplicates were dropped, none with an age: a dedup that does not keep when a
        // key was first processed (vehicle-state's seq guard), or old seen-set values.
        None if c.duplicate_dropped.total > 0.0 => format!(
            "{} duplicates dropped, none with a known age",
            c.duplicate_dropped.total
        ),
        _ => summarize(max, &windows),
    };
    ConsumerWindows {
        target: c.target.clone(),
        consumer: c.consumer.clone(),
        count: reading.count,
        p50_seconds: p50,
        p99_seconds: p99,
        max_seconds: max,
        windows,
        summary,
    }
}

/// "oldest duplicate 3 h 12 m; retention 7 d: margin 52×; …", or what is missing.
pub fn summarize(max: Option<f64>, windows: &[DedupWindow]) -> String {
    let Some(max) = max else {
        return "no duplicate with a known age yet".into();
    };
    let mut parts = vec![format!("oldest duplicate {}", short_duration(max))];
    for w in windows {
        let margin = w.margin.map_or_else(|| "-".into(), format_margin);
        let flag = if w.short { " SHORT" } else { "" };
        parts.push(format!(
            "{} {}: margin {margin}{flag}",
            w.name,
            short_duration(w.seconds)
        ));
    }
    parts.join("; ")
}

/// `52×` from ten up, `1.5×` below (floored: a margin is never shown larger than it is).
pub fn format_margin(m: f64) -> String {
    if !m.is_finite() {
        "∞".into()
    } else if m >= 10.0 {
        format!("{}×", m.floor() as u64)
    } else {
        format!("{:.1}×", (m * 10.0).floor() / 10.0)
    }
}

/// A duration in its two largest units: `7 d`, `3 h 12 m`, `2 m`, `2.5 s`.
pub fn short_duration(seconds: f64) -> String {
    if seconds < 10.0 {
        return format!("{:.1} s", seconds.max(0.0));
    }
    let s = seconds as u64;
    let units = [(86_400, "d"), (3600, "h"), (60, "m"), (1, "s")];
    let i = units.iter().position(|(size, _)| s >= *size).unwrap_or(3);
    let (size, name) = units[i];
    let mut out = format!("{} {name}", s / size);
    if let Some((next, next_name)) = units.get(i + 1) {
        let n = (s % size) / next;
        if n > 0 {
            out.push_str(&format!(" {n} {next_name}"));
        }
    }
    out
}

/// A quantile of a cumulative histogram as Prometheus' `histogram_quantile` computes
/// it: linear within the bucket that holds the rank (from 0 for the first), the
/// largest finite bound when the rank is in `+Inf`. None without observations.
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut below = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(below.0);
            }
            let inside = count - below.1;
            if inside <= 0.0 {
                return Some(le);
            }
            return Some(below.0 + (le - below.0) * (rank - below.1) / inside);
        }
        below = (le, count);
    }
    Some(below.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: [f64; 9] = [
        1.0, 10.0, 60.0, 600.0, 3600.0, 21600.0, 86400.0, 604800.0, 2592000.0,
    ];

    /// Cumulative buckets of `ages`, as the engine's histogram keeps them.
    fn buckets(ages: &[f64]) -> Vec<(f64, f64)> {
        BOUNDS
            .iter()
            .chain([f64::INFINITY].iter())
            .map(|&le| (le, ages.iter().filter(|a| **a <= le).count() as f64))
            .collect()
    }

    fn consumer(ages: &[f64], max: f64, side_effects: bool) -> ConsumerStatus {
        let mut c = ConsumerStatus::new("local", "trip-counter");
        c.duplicate_age = Some(AgeReading {
            buckets: buckets(ages),
            count: ages.len() as f64,
            max_seconds: Some(max),
        });
        if side_effects {
            c.side_effects.insert("sent".into(), Default::default());
        }
        c
    }

    #[test]
    fn the_brief_s_line_reads_as_written() {
        let oldest = 3.0 * 3600.0 + 12.0 * 60.0;
        let c = consumer(&[oldest], oldest, false);
        let w = evaluate(&WindowInputs {
            consumers: &[c],
            targets: &[],
            brokers: &[],
            stored_max: &BTreeMap::new(),
            retention: Some(Duration::from_secs(7 * 86_400)),
            provider_key_lifetime: Duration::from_secs(86_400),
        });
        assert_eq!(
            w[0].summary,
            "oldest duplicate 3 h 12 m; retention 7 d: margin 52×"
        );
        assert!(!w[0].windows[0].short);
    }

    /// Quantiles as `histogram_quantile` computes them: linear within the bucket,
    /// the first from 0, +Inf read as the largest finite bound; none without data.
    #[test]
    fn quantiles_interpolate_within_their_bucket() {
        let b = buckets(&[2.0, 3.0, 4.0, 5.0]);
        // Rank 2 of 4 in (1, 10], which holds all 4: 1 + 9 × 2/4.
        assert_eq!(quantile(&b, 0.5), Some(5.5));
        let b = buckets(&[0.5, 0.5, 30.0, 30.0]);
        assert_eq!(quantile(&b, 0.5), Some(1.0));
        assert_eq!(quantile(&b, 0.75), Some(10.0 + 50.0 * 0.5));
        let huge = buckets(&[1e9]);
        assert_eq!(quantile(&huge, 0.99), Some(2592000.0));
        assert_eq!(quantile(&buckets(&[]), 0.5), None);
        assert_eq!(quantile(&[], 0.5), None);
    }

    /// A seen-set TTL shorter than twice the oldest duplicate is short (the WARN);
    /// the retention, long enough, is not; each window's margin is window / oldest;
    /// the provider's key lifetime applies only to a consumer with side effects, a
    /// JetStream stream's window to every consumer; the store's maximum (which
    /// outlives a restart) wins over a younger process maximum, and the quantiles
    /// never exceed the maximum.
    #[test]
    fn a_seen_set_ttl_shorter_than_twice_the_oldest_duplicate_is_short() {
        let tracker = crate::targets::TargetTracker::new("local", "http://127.0.0.1:9464/metrics");
        let mut target = tracker.status().clone();
        target.seen_set_ttl_seconds = Some(3600.0);
        let nats = crate::jetstream::JetStreamTracker::new("nats", "http://127.0.0.1:8222");
        let mut jetstream = nats.status().clone();
        jetstream.duplicate_windows.insert("$G/FLEET".into(), 120.0);
        let sms = {
            let mut c = consumer(&[40.0, 70.0], 70.0, true);
            c.consumer = "zone-exit-sms".into();
            c
        };
        let stored = BTreeMap::from([("trip-counter".to_string(), 2400.0)]);
        let w = evaluate(&WindowInputs {
            consumers: &[consumer(&[1800.0, 1900.0], 1900.0, false), sms],
            targets: &[target],
            brokers: &[jetstream],
            stored_max: &stored,
            retention: Some(Duration::from_secs(7 * 86_400)),
            provider_key_lifetime: Duration::from_secs(86_400),
        });
        let trips = &w[0];
        assert_eq!(trips.max_seconds, Some(2400.0));
        assert!(trips.p99_seconds.unwrap() <= 2400.0);
        let layers: Vec<(Layer, bool)> = trips.windows.iter().map(|w| (w.layer, w.short)).collect();
        assert_eq!(
            layers,
            [
                (Layer::Retention, false),
                (Layer::SeenSetTtl, true),
                (Layer::JetStreamDuplicateWindow, true),
            ]
        );
        assert_eq!(trips.windows[1].margin, Some(1.5));
        assert_eq!(trips.short().count(), 2);
        assert!(
            trips
                .summary
                .contains("seen-set TTL 1 h: margin 1.5× SHORT"),
            "{}",
            trips.summary
        );
        let sms = &w[1];
        assert_eq!(sms.max_seconds, Some(70.0));
        let provider = sms
            .windows
            .iter()
            .find(|w| w.layer == Layer::ProviderKeyLifetime);
        assert_eq!(
            provider.map(|w| (w.short, w.margin)),
            Some((false, Some(86_400.0 / 70.0)))
        );
        // 120 s against 70 s: more than the age, less than twice it.
        let js = sms
            .windows
            .iter()
            .find(|w| w.layer == Layer::JetStreamDuplicateWindow);
        assert_eq!(js.map(|w| w.short), Some(true));
    }

    /// Without a duplicate of known age nothing is short and the line says so.
    #[test]
    fn no_duplicate_yet_is_no_margin_and_no_warning() {
        let alone = |c: ConsumerStatus| {
            evaluate(&WindowInputs {
                consumers: &[c],
                targets: &[],
                brokers: &[],
                stored_max: &BTreeMap::new(),
                retention: Some(Duration::from_secs(3600)),
                provider_key_lifetime: Duration::from_secs(86_400),
            })
        };
        let w = alone(ConsumerStatus::new("local", "trip-counter"));
        assert_eq!(w[0].max_seconds, None);
        assert_eq!(w[0].windows[0].margin, None);
        assert_eq!(w[0].short().count(), 0);
        assert_eq!(w[0].summary, "no duplicate with a known age yet");
        // Duplicates without an age are said to be so, not hidden as none.
        let mut c = ConsumerStatus::new("local", "vehicle-state");
        c.duplicate_dropped.total = 3.0;
        let w = alone(c);
        assert_eq!(w[0].summary, "3 duplicates dropped, none with a known age");
        assert_eq!(w[0].short().count(), 0);
    }

    #[test]
    fn durations_and_margins_read_short() {
        assert_eq!(short_duration(7.0 * 86_400.0), "7 d");
        assert_eq!(short_duration(3.0 * 3600.0 + 12.0 * 60.0 + 5.0), "3 h 12 m");
        assert_eq!(short_duration(120.0), "2 m");
        assert_eq!(short_duration(2.5), "2.5 s");
        assert_eq!(short_duration(86_400.0 + 59.0), "1 d");
        assert_eq!(format_margin(52.5), "52×");
        assert_eq!(format_margin(1.99), "1.9×");
    }
}
