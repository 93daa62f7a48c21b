//! Alerts derived from scrapes over (simulated) time.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idemwatch::config::MetricNames;
use idemwatch::monitor::alerts::{evaluate, AlertKind};
use idemwatch::monitor::prometheus::{parse, ScrapeResult};
use idemwatch::monitor::targets::TargetTracker;

fn t(s: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
}

fn scrape(at: DateTime<Utc>, processed: u64, duplicates: u64) -> ScrapeResult {
    let text = format!(
        "# TYPE idem_messages_processed counter\n\
         idem_messages_processed_total{{consumer=\"trip-counter\"}} {processed}\n\
         # TYPE idem_duplicate_dropped counter\n\
         idem_duplicate_dropped_total{{consumer=\"trip-counter\"}} {duplicates}\n\
         process_start_time_seconds 1799990000\n# EOF\n"
    );
    ScrapeResult {
        target: "fleet".into(),
        url: "http://127.0.0.1:9464/metrics".into(),
        at,
        duration: Duration::from_millis(3),
        outcome: parse(&text).map_err(|e| e.to_string()),
    }
}

fn alerts_of(tracker: &TargetTracker) -> Vec<AlertKind> {
    let consumers: Vec<_> = tracker.consumers().cloned().collect();
    evaluate(&[tracker.status().clone()], &consumers, None)
        .into_iter()
        .map(|a| a.kind)
        .collect()
}

#[test]
fn an_hour_of_traffic_without_one_duplicate_means_the_parachute_is_untested() {
    let names = MetricNames::default();
    let mut tracker = TargetTracker::new("fleet", "http://127.0.0.1:9464/metrics");
    // One scrape a minute for 59 minutes: no alert yet.
    for minute in 0..60 {
        tracker.observe(&scrape(t(minute * 60), minute as u64 * 100, 0), &names);
    }
    assert!(alerts_of(&tracker).is_empty(), "{:?}", alerts_of(&tracker));
    tracker.observe(&scrape(t(61 * 60), 6100, 0), &names);
    let found = alerts_of(&tracker);
    assert!(
        found.iter().any(|a| matches!(a, AlertKind::ParachuteUntested { consumer, .. } if consumer == "trip-counter")),
        "{found:?}"
    );
    // One small jump and the parachute is known to open.
    tracker.observe(&scrape(t(62 * 60), 6200, 1), &names);
    assert!(!alerts_of(&tracker)
        .iter()
        .any(|a| matches!(a, AlertKind::ParachuteUntested { .. })));
}

#[test]
fn no_traffic_is_not_an_untested_parachute() {
    let names = MetricNames::default();
    let mut tracker = TargetTracker::new("fleet", "u");
    for minute in 0..90 {
        tracker.observe(&scrape(t(minute * 60), 5, 0), &names);
    }
    assert!(alerts_of(&tracker).is_empty());
}

#[test]
fn more_than_one_percent_duplicates_over_a_minute_alerts() {
    let names = MetricNames::default();
    let mut tracker = TargetTracker::new("fleet", "u");
    // 0.4% (a deploy day): no alert.
    let (mut processed, mut dups) = (0u64, 0u64);
    for s in 0..=60 {
        tracker.observe(&scrape(t(s), processed, dups), &names);
        processed += 249;
        dups += 1;
    }
    let ratio = tracker
        .consumers()
        .next()
        .unwrap()
        .duplicate_ratio_1m
        .unwrap();
    assert!((ratio - 0.004).abs() < 1e-9, "{ratio}");
    assert!(alerts_of(&tracker).is_empty());
    // 2%: alert.
    for s in 61..=130 {
        tracker.observe(&scrape(t(s), processed, dups), &names);
        processed += 98;
        dups += 2;
    }
    assert!(alerts_of(&tracker).iter().any(
        |a| matches!(a, AlertKind::DuplicateRateHigh { ratio, .. } if (*ratio - 0.02).abs() < 1e-9)
    ));
}

#[test]
fn a_counter_reset_alone_is_a_restart_marker() {
    let names = MetricNames::default();
    let mut tracker = TargetTracker::new("fleet", "u");
    assert!(tracker.observe(&scrape(t(0), 500, 3), &names).is_none());
    assert!(tracker.observe(&scrape(t(1), 510, 3), &names).is_none());
    // Same start time (an exporter that does not refresh it), counters back near 0.
    let marker = tracker
        .observe(&scrape(t(2), 4, 0), &names)
        .expect("a restart marker");
    assert_eq!(marker.kind, "restart");
    assert!(marker.detail.unwrap().contains("went down"));
    let c = tracker.consumers().next().unwrap();
    assert_eq!(
        c.processed.per_second,
        Some(4.0),
        "counted from zero after the reset"
    );
    assert_eq!(c.last_restart, Some(t(2)));
}
