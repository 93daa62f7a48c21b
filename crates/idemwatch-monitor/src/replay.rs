//! The alerts of a past window, for `idemwatch report`: the dashboard's rules
//! ([`super::alerts::evaluate_at`], their one home) run again at every step of the
//! window over what the window left behind, and [`AlertLog`] turns the steps into
//! records with a start and an end, as a dashboard watching at the time would have
//! listed them.
//!
//! What the past keeps: the Prometheus history (per-consumer processed, duplicate
//! and redelivery rates at the fetch's step), the database's dead letters (each with
//! its arrival time, consumer and reason) and the markers (deploys and restarts open
//! the deploy window, drills the drill window) and drill runs. So the duplicate-rate
//! and dead-letter rules are replayed; the rules that read live state only (a target
//! down, a pause, claims in doubt, vehicle anomalies) are not, and the report keeps
//! those of its own poll when the window reaches it.
//!
//! A consumer the history names is judged as a watched one (dead letters by reason
//! over five minutes); without a history every consumer is unwatched and its dead
//! letters are judged over the last hour from the database, as a dashboard without
//! metrics judges them.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::alerts::{evaluate_at, AlertInputs, AlertLog, AlertRecord};
use super::db::{DbStats, DeadLetterArrival, DeadLetterGroup, DrillRunSummary};
use super::history::{ConsumerHistory, History, HistoryPoint};
use super::markers::TimelineMarker;
use super::rates::{WINDOW_1M, WINDOW_5M};
use super::targets::{ConsumerStatus, WindowCounts};
use crate::config::AlertRules;

/// How far back the database's dead-letter rule counts (its "last hour").
pub const DEAD_LETTER_LOOKBACK: Duration = Duration::from_secs(3600);
/// Steps of a replay without a history (with one, the history's grid).
pub const REPLAY_POINTS: i64 = 2_000;

/// The alert kinds a replay judges (the others read live state only).
pub const REPLAYED_KINDS: [&str; 2] = ["duplicate_rate_high", "dead_letter_burst"];

/// What a replay reads.
#[derive(Debug, Clone, Copy)]
pub struct ReplayInputs<'a> {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    /// The Prometheus history of the window, when there is one.
    pub history: Option<&'a History>,
    /// Dead letters that arrived from [`DEAD_LETTER_LOOKBACK`] before `from` to `to`.
    pub dead_letters: &'a [DeadLetterArrival],
    pub markers: &'a [TimelineMarker],
    pub drill_runs: &'a [DrillRunSummary],
    pub rules: &'a AlertRules,
    /// The database as its alerts name it (any password as `***`).
    pub database_url: &'a str,
}

/// Arrival times per (consumer, reason), sorted, for counts over a window.
struct Arrivals(BTreeMap<(String, String), Vec<DateTime<Utc>>>);

impl Arrivals {
    fn new(list: &[DeadLetterArrival]) -> Arrivals {
        let mut by: BTreeMap<(String, String), Vec<DateTime<Utc>>> = BTreeMap::new();
        for a in list {
            by.entry((a.consumer.clone(), a.reason.clone()))
                .or_default()
                .push(a.received_at);
        }
        for times in by.values_mut() {
            times.sort_unstable();
        }
        Arrivals(by)
    }

    /// Arrivals in `(t - span, t]`.
    fn count(times: &[DateTime<Utc>], t: DateTime<Utc>, span: Duration) -> usize {
        let start = t - chrono::Duration::from_std(span).unwrap_or_default();
        times.partition_point(|a| *a <= t) - times.partition_point(|a| *a <= start)
    }

    /// The groups a database poll at `t` would have found (only those with any
    /// arrival so far): `last_hour` counted back from `t`.
    fn groups_at(&self, t: DateTime<Utc>) -> Vec<DeadLetterGroup> {
        self.0
            .iter()
            .filter_map(|((consumer, reason), times)| {
                let seen = times.partition_point(|a| *a <= t);
                (seen > 0).then(|| DeadLetterGroup {
                    consumer: consumer.clone(),
                    reason: reason.clone(),
                    total: i64::try_from(seen).unwrap_or(i64::MAX),
                    last_hour: i64::try_from(Self::count(times, t, DEAD_LETTER_LOOKBACK))
                        .unwrap_or(i64::MAX),
                    newest_at: times.get(seen - 1).copied(),
                    newest_id: None,
                })
            })
            .collect()
    }

    /// One consumer's arrivals by reason in `(t - span, t]`, the non-zero ones.
    fn by_reason(&self, consumer: &str, t: DateTime<Utc>, span: Duration) -> BTreeMap<String, f64> {
        self.0
            .iter()
            .filter(|((c, _), _)| c == consumer)
            .map(|((_, reason), times)| (reason.clone(), Self::count(times, t, span) as f64))
            .filter(|(_, n)| *n > 0.0)
            .collect()
    }
}

/// A consumer's counts over `span` before the history point at index `at`, from
/// the history's rates: a rate over a range at least as long as the span gives the
/// count directly (rate × span); a longer span sums the steps it covers (each step's
/// rate × the step). Steps without a sample count nothing and shorten the window.
fn window_from_history(
    points: &[HistoryPoint],
    at: usize,
    step: i64,
    range: i64,
    span: Duration,
) -> WindowCounts {
    let span_s = i64::try_from(span.as_secs()).unwrap_or(i64::MAX);
    let (steps, each) = if span_s <= range {
        (1, span_s)
    } else {
        ((span_s / step.max(1)).max(1), step)
    };
    let first = at.saturating_sub(usize::try_from(steps - 1).unwrap_or(usize::MAX));
    let mut w = WindowCounts::default();
    for p in &points[first..=at] {
        let Some(processed) = p.processed_per_second else {
            continue;
        };
        let each = each as f64;
        w.seconds += each;
        w.processed += processed * each;
        w.duplicate_dropped += p.duplicate_dropped_per_second.unwrap_or(0.0) * each;
        w.redelivered += p.redelivered_per_second.unwrap_or(0.0) * each;
        w.dead_lettered += p.dead_lettered_per_second.unwrap_or(0.0) * each;
    }
    w
}

/// One history consumer as a dashboard would have seen it at the point `at`.
fn consumer_at(
    c: &ConsumerHistory,
    at: usize,
    t: DateTime<Utc>,
    history: &History,
    arrivals: &Arrivals,
) -> ConsumerStatus {
    let step = i64::try_from(history.step_seconds)
        .unwrap_or(i64::MAX)
        .max(1);
    // The history's rates are over at least a minute (see `HistoryClient::queries`).
    let range = step.max(i64::try_from(super::history::MIN_RATE_RANGE.as_secs()).unwrap_or(60));
    let mut status = ConsumerStatus::new(&c.target, &c.consumer);
    let mut w1 = window_from_history(&c.points, at, step, range, WINDOW_1M);
    let mut w5 = window_from_history(&c.points, at, step, range, WINDOW_5M);
    w1.dead_lettered_by_reason = arrivals.by_reason(&c.consumer, t, WINDOW_1M);
    w5.dead_lettered_by_reason = arrivals.by_reason(&c.consumer, t, WINDOW_5M);
    status.window_1m = w1.with_rates();
    status.window_5m = w5.with_rates();
    status.duplicate_ratio_1m = status.window_1m.duplicate_ratio;
    status
}

/// The steps of the replay: the history's grid, else [`REPLAY_POINTS`] over the
/// window (at least a second apart).
fn grid(input: &ReplayInputs<'_>) -> Vec<DateTime<Utc>> {
    if let Some(h) = input.history {
        let step = i64::try_from(h.step_seconds).unwrap_or(i64::MAX).max(1);
        let mut out = Vec::new();
        let mut t = h.from;
        while t <= h.to {
            out.extend(DateTime::from_timestamp(t, 0));
            t += step;
        }
        return out;
    }
    let span = (input.to - input.from).num_seconds().max(0);
    let step = (span / REPLAY_POINTS).max(1);
    let mut out = Vec::new();
    let mut t = input.from;
    while t <= input.to {
        out.push(t);
        t += chrono::Duration::seconds(step);
    }
    if out.last() != Some(&input.to) {
        out.push(input.to);
    }
    out
}

/// Every alert that held at some step of the window, oldest first, with when it
/// started and ended (`ended: None`: it still held at the window's end).
pub fn replay(input: &ReplayInputs<'_>) -> Vec<AlertRecord> {
    let arrivals = Arrivals::new(input.dead_letters);
    let mut log = AlertLog::default();
    for (i, t) in grid(input).into_iter().enumerate() {
        let consumers: Vec<ConsumerStatus> = input
            .history
            .map(|h| {
                h.consumers
                    .iter()
                    .filter(|c| c.points.len() > i)
                    .map(|c| consumer_at(c, i, t, h, &arrivals))
                    .collect()
            })
            .unwrap_or_default();
        let mut db = DbStats::empty(input.database_url, t);
        db.dead_letters = arrivals.groups_at(t);
        db.drill_runs = input.drill_runs.to_vec();
        let markers: Vec<TimelineMarker> = input
            .markers
            .iter()
            .filter(|m| m.at <= t)
            .cloned()
            .collect();
        let mut alerts = evaluate_at(&AlertInputs {
            windows: &[],
            now: t,
            targets: &[],
            consumers: &consumers,
            database: Some(&db),
            markers: &markers,
            // A deploy's verdict is the report's own section (`deploys`), read
            // from the same history: not replayed as an alert.
            deploys: &[],
            rules: input.rules,
        });
        log.track(t, &mut alerts);
    }
    log.between(input.from, input.to)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alerts::AlertKind;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap_or_default()
    }

    fn arrival(consumer: &str, reason: &str, at: i64) -> DeadLetterArrival {
        DeadLetterArrival {
            consumer: consumer.into(),
            reason: reason.into(),
            received_at: t(at),
        }
    }

    fn point(at: i64, processed: f64, duplicates: f64) -> HistoryPoint {
        HistoryPoint {
            t: 1_800_000_000 + at,
            duplicate_ratio: None,
            processed_per_second: Some(processed),
            duplicate_dropped_per_second: Some(duplicates),
            redelivered_per_second: Some(0.0),
            dead_lettered_per_second: Some(0.0),
        }
    }

    /// A key conflict in a window without metrics: the database rule, from its
    /// arrival until an hour later (the window ends first: it still holds).
    #[test]
    fn a_key_conflict_of_the_past_is_an_alert_from_its_arrival() {
        let dead = [arrival("trip-counter", "key_conflict", 600)];
        let rules = AlertRules::default();
        let records = replay(&ReplayInputs {
            from: t(0),
            to: t(1800),
            history: None,
            dead_letters: &dead,
            markers: &[],
            drill_runs: &[],
            rules: &rules,
            database_url: "sqlite://x",
        });
        assert_eq!(records.len(), 1, "{records:#?}");
        let r = &records[0];
        assert!(matches!(
            &r.alert.kind,
            AlertKind::DeadLetterBurst { reason, .. } if reason == "key_conflict"
        ));
        assert_eq!(r.started, t(600));
        assert_eq!(r.ended, None);
    }

    /// A duplicate spike in the history: an alert that starts when the one-minute
    /// rate passes 1 % and ends when it falls back; the 5-minute dead letters of a
    /// watched consumer make a burst that ends five minutes after the last one.
    #[test]
    fn a_duplicate_spike_and_a_burst_in_the_history_start_and_end() {
        let points: Vec<HistoryPoint> = (0..=60)
            .map(|i| {
                let at = i * 30;
                let dups = if (600..=720).contains(&at) { 1.0 } else { 0.0 };
                point(at, 10.0, dups)
            })
            .collect();
        let history = History {
            source: "prometheus",
            from: 1_800_000_000,
            to: 1_800_001_800,
            step_seconds: 30,
            consumers: vec![ConsumerHistory {
                target: "fleet".into(),
                consumer: "trip-counter".into(),
                points,
            }],
            restarts: Vec::new(),
        };
        let dead: Vec<DeadLetterArrival> = (0..6)
            .map(|i| arrival("trip-counter", "invalid_field", 900 + i))
            .collect();
        let rules = AlertRules::default();
        let records = replay(&ReplayInputs {
            from: t(0),
            to: t(1800),
            history: Some(&history),
            dead_letters: &dead,
            markers: &[],
            drill_runs: &[],
            rules: &rules,
            database_url: "sqlite://x",
        });
        let spike = records
            .iter()
            .find(|r| r.alert.kind.name() == "duplicate_rate_high")
            .unwrap_or_else(|| panic!("{records:#?}"));
        assert_eq!((spike.started, spike.ended), (t(600), Some(t(750))));
        let burst = records
            .iter()
            .find(|r| r.alert.kind.name() == "dead_letter_burst")
            .unwrap_or_else(|| panic!("{records:#?}"));
        assert_eq!((burst.started, burst.ended), (t(930), Some(t(1230))));
    }
}
