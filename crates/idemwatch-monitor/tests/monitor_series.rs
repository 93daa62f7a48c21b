//! Rates, resets, restarts, duplicate ratio, gaps and zoom.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idemwatch_monitor::rates::{duplicate_ratio, CounterRate, RestartCause, RestartDetector};
use idemwatch_monitor::series::{Series, RAW_RETENTION};
use idemwatch_monitor::zoom::Zoom;

fn t(seconds: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
}

#[test]
fn counter_rate_is_the_increase_per_second() {
    let mut c = CounterRate::default();
    assert_eq!(c.observe(t(0), 100.0).rate, None, "one reading has no rate");
    let o = c.observe(t(2), 110.0);
    assert_eq!(o.rate, Some(5.0));
    assert!(!o.reset);
}

#[test]
fn counter_going_down_is_a_reset_counted_from_zero() {
    let mut c = CounterRate::default();
    c.observe(t(0), 1000.0);
    // The process restarted: it counted 30 since its start.
    let o = c.observe(t(10), 30.0);
    assert!(o.reset);
    assert_eq!(o.increase, Some(30.0));
    assert_eq!(o.rate, Some(3.0));
    // And afterwards rates are normal again.
    let o = c.observe(t(20), 50.0);
    assert!(!o.reset);
    assert_eq!(o.rate, Some(2.0));
}

#[test]
fn restart_seen_through_a_new_start_time() {
    let mut r = RestartDetector::default();
    assert_eq!(
        r.observe(Some(1000.0), None),
        None,
        "first sight is no restart"
    );
    assert_eq!(
        r.observe(Some(1000.2), None),
        None,
        "sub-second noise is no restart"
    );
    assert_eq!(
        r.observe(Some(5000.0), None),
        Some(RestartCause::StartTimeChanged {
            before: 1000.2,
            after: 5000.0
        })
    );
    assert_eq!(r.observe(Some(5000.0), None), None);
}

#[test]
fn restart_seen_through_a_counter_reset_without_start_time() {
    let mut r = RestartDetector::default();
    assert_eq!(r.observe(None, None), None);
    assert_eq!(
        r.observe(None, Some("idem_messages_processed_total")),
        Some(RestartCause::CounterReset {
            metric: "idem_messages_processed_total".into()
        })
    );
}

#[test]
fn duplicate_ratio_follows_spec_and_zero_traffic_is_none() {
    assert_eq!(duplicate_ratio(99.0, 1.0), Some(0.01));
    assert_eq!(duplicate_ratio(0.0, 4.0), Some(1.0));
    assert_eq!(duplicate_ratio(10.0, 0.0), Some(0.0));
    assert_eq!(duplicate_ratio(0.0, 0.0), None, "no traffic is not 0%");
    assert_eq!(duplicate_ratio(f64::NAN, 1.0), None);
    let r = duplicate_ratio(9999.0, 1.0).unwrap();
    assert!((r - 0.0001).abs() < 1e-12, "0.01% of a normal day: {r}");
}

#[test]
fn failed_collection_is_a_gap_not_a_zero() {
    let mut s = Series::new(Duration::from_secs(7 * 86400));
    s.push(t(0), Some(5.0));
    s.push_gap(t(1));
    s.push(t(2), Some(7.0));
    let w = s.window(t(2), Duration::from_secs(60));
    let values: Vec<_> = w.iter().map(|p| p.value).collect();
    assert_eq!(values, vec![Some(5.0), None, Some(7.0)]);
    assert_eq!(s.mean_over(t(2), Duration::from_secs(60)), Some(6.0));
}

#[test]
fn a_clock_that_went_back_still_gets_every_point_of_the_window() {
    let mut s = Series::new(Duration::from_secs(7 * 86400));
    for (at, v) in [(0, 1.0), (100, 2.0), (50, 4.0), (101, 8.0), (30, 16.0)] {
        s.push(t(at), Some(v));
    }
    // 60 s before t(101): 100, 50, 101 — not 0 nor 30, wherever they stand.
    let w = s.window(t(101), Duration::from_secs(60));
    let values: Vec<_> = w.iter().map(|p| p.value).collect();
    assert_eq!(values, vec![Some(2.0), Some(4.0), Some(8.0)]);
    assert_eq!(
        s.mean_over(t(101), Duration::from_secs(60)),
        Some(14.0 / 3.0)
    );
    // In order again once those points are pruned.
    let mut s = Series::new(Duration::from_secs(7 * 86400));
    s.push(t(10), Some(1.0));
    s.push(t(5), Some(1.0));
    s.push(t(10_000), Some(3.0));
    s.push(t(10_001), Some(5.0));
    assert_eq!(s.mean_over(t(10_001), Duration::from_secs(60)), Some(4.0));
    assert_eq!(s.latest().map(|p| p.value), Some(Some(5.0)));
}

#[test]
fn series_is_pruned_by_time() {
    let mut s = Series::new(Duration::from_secs(2 * 3600));
    for i in 0..(3 * 3600) {
        s.push(t(i), Some(1.0));
    }
    let raw = s.window(t(3 * 3600 - 1), Duration::from_secs(3600));
    assert!(raw.len() <= RAW_RETENTION.as_secs() as usize + 1);
    // Raw hour + two hours of minute means, not three hours of seconds.
    assert!(s.len() < 3600 + 2 * 60 + 2, "held {}", s.len());
    let long = s.window(t(3 * 3600 - 1), Duration::from_secs(2 * 3600));
    assert!(long.len() >= 119 && long.len() <= 122, "{}", long.len());
    assert!(long.iter().all(|p| p.value == Some(1.0)));
}

#[test]
fn zoom_stops_at_one_minute_and_at_the_retention() {
    let week = Duration::from_secs(7 * 86400);
    let mut z = Zoom::new(Duration::from_secs(15 * 60), week);
    assert_eq!(z.span(), Duration::from_secs(15 * 60));
    for _ in 0..20 {
        z.zoom_in();
    }
    assert_eq!(z.span(), Duration::from_secs(60));
    for _ in 0..20 {
        z.zoom_out();
    }
    assert_eq!(z.span(), week);
    let mut short = Zoom::new(Duration::from_secs(15 * 60), Duration::from_secs(3600));
    short.zoom_out();
    short.zoom_out();
    assert_eq!(
        short.zoom_out(),
        Duration::from_secs(3600),
        "clamped to retention"
    );
    assert_eq!(
        Zoom::new(Duration::from_secs(30 * 86400), week).span(),
        week,
        "a window beyond the retention is clamped"
    );
}

proptest::proptest! {
    /// Whatever the spacing of the points (repeated times, long stretches, windows
    /// wider than what is held), a raw window holds exactly the points at or after its
    /// start, and a mean is theirs.
    #[test]
    fn a_window_holds_exactly_the_points_at_or_after_its_start(
        steps in proptest::collection::vec((0i64..40, proptest::option::of(-5.0f64..5.0)), 1..300),
        span in 0u64..=RAW_RETENTION.as_secs(),
    ) {
        let mut s = Series::new(Duration::from_secs(7 * 86400));
        let mut pushed = Vec::new();
        let mut at = 0;
        for (step, value) in steps {
            at += step;
            s.push(t(at), value);
            pushed.push((at, value));
        }
        let from = at - span as i64;
        let expected: Vec<_> = pushed.iter().filter(|(p, _)| *p >= from).map(|(p, v)| (t(*p), *v)).collect();
        let window: Vec<_> = s.window(t(at), Duration::from_secs(span)).iter().map(|p| (p.at, p.value)).collect();
        proptest::prop_assert_eq!(&window, &expected);
        let expected: Vec<_> = expected.into_iter().map(|(_, v)| v).collect();
        let values: Vec<f64> = expected.iter().flatten().copied().collect();
        let mean = (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64);
        let got = s.mean_over(t(at), Duration::from_secs(span));
        proptest::prop_assert!(
            match (got, mean) {
                (Some(a), Some(b)) => (a - b).abs() < 1e-9,
                (a, b) => a == b,
            },
            "mean {:?} against {:?}", got, mean
        );
    }
}

#[test]
fn times_come_back_to_the_nanosecond() {
    let mut s = Series::new(Duration::from_secs(7 * 86400));
    let times: Vec<DateTime<Utc>> = [0, 1, 999_999_999, 1_000_000_001, 59_123_456_789]
        .iter()
        .map(|n| t(0) + chrono::Duration::nanoseconds(*n))
        .collect();
    for (i, at) in times.iter().enumerate() {
        s.push(*at, Some(i as f64));
    }
    let window: Vec<_> = s
        .window(times[4], Duration::from_secs(60))
        .iter()
        .map(|p| p.at)
        .collect();
    assert_eq!(window, times);
    assert_eq!(s.latest().map(|p| p.at), Some(times[4]));
    // The window's start is inclusive to the nanosecond.
    let from_second = s.window(times[4], Duration::from_nanos(59_123_456_789 - 1));
    assert_eq!(from_second.first().map(|p| p.at), Some(times[1]));
}
