//! The duplicate budget per deploy on a scraped trace: two deploys (each a restart
//! of the consumer process, its counters starting again from zero) of known
//! duplicate counts, read the way the dashboard reads them — scrape by scrape
//! through a `TargetTracker`, its series turned into counts, the scraped restarts
//! merged into the deploy markers — and every figure asserted exactly, then the
//! `deploy_over_budget` alert of the newest closed window.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idemwatch_monitor::alerts::{evaluate_at, AlertInputs, AlertKind, AlertObject};
use idemwatch_monitor::config::{AlertRules, MetricNames};
use idemwatch_monitor::deploys::{
    budgets, steps_from_series, BaselineSource, ConsumerSteps, Verdict, WindowEnd,
};
use idemwatch_monitor::markers::{merge, MarkerSource, TimelineMarker};
use idemwatch_monitor::prometheus::{parse, Format, ScrapeResult};
use idemwatch_monitor::targets::TargetTracker;

fn t(s: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
}

/// The process's counters at second `s`: 10 messages a second per consumer; the
/// process restarts at 301 and 601 (the deploys' marks at 300 and 600).
/// `zone-exit-sms` drops one duplicate at 100 (a normal day), 2 right after deploy
/// #1, and 6 + 3 + 1 (at 601, 605, 650) after deploy #2; `trip-counter` 4 at 601.
fn exposition(s: i64) -> String {
    let (start, born) = match s {
        ..=300 => (1_799_990_000, 0),
        301..=600 => (1_800_000_301, 300),
        _ => (1_800_000_601, 600),
    };
    let processed = 10 * (s - born);
    let sms = match s {
        ..=99 => 0,
        100..=300 => 1,
        301..=600 => 2,
        601..=604 => 6,
        605..=649 => 9,
        _ => 10,
    };
    let trip = if s > 600 { 4 } else { 0 };
    format!(
        "# TYPE idem_messages_processed counter\n\
         idem_messages_processed_total{{consumer=\"zone-exit-sms\"}} {processed}\n\
         idem_messages_processed_total{{consumer=\"trip-counter\"}} {processed}\n\
         # TYPE idem_duplicate_dropped counter\n\
         idem_duplicate_dropped_total{{consumer=\"zone-exit-sms\"}} {sms}\n\
         idem_duplicate_dropped_total{{consumer=\"trip-counter\"}} {trip}\n\
         process_start_time_seconds {start}\n# EOF\n"
    )
}

fn deploy(s: i64, label: &str) -> TimelineMarker {
    TimelineMarker {
        at: t(s),
        kind: "deploy".into(),
        label: label.into(),
        detail: None,
        source: MarkerSource::Database,
    }
}

#[test]
fn two_deploys_of_known_duplicate_counts_read_from_scrapes() {
    let names = MetricNames::default();
    let mut tracker = TargetTracker::new("fleet", "http://127.0.0.1:9464/metrics");
    let mut scraped = Vec::new();
    let now = 1300;
    for s in 0..=now {
        let result = ScrapeResult {
            target: "fleet".into(),
            url: "http://127.0.0.1:9464/metrics".into(),
            at: t(s),
            duration: Duration::from_millis(2),
            outcome: parse(&exposition(s), Format::OpenMetrics).map_err(|e| e.to_string()),
        };
        scraped.extend(tracker.observe(&result, &names));
    }
    assert_eq!(scraped.len(), 2, "both restarts seen: {scraped:?}");
    let markers = merge(&[deploy(300, "v2"), deploy(600, "v3")], &scraped, 50);
    assert_eq!(
        markers.len(),
        2,
        "the restarts are the deploys': {markers:?}"
    );

    let steps: Vec<ConsumerSteps> = tracker
        .consumer_names()
        .map(|c| ConsumerSteps {
            target: "fleet".into(),
            consumer: c.to_string(),
            steps: steps_from_series(
                tracker.series(c).unwrap(),
                t(now),
                Duration::from_secs(1400),
                tracker
                    .consumers()
                    .find(|s| s.consumer == c)
                    .and_then(|s| s.totals.since),
            ),
        })
        .collect();
    let mut rules = AlertRules::default();
    rules
        .deploy_duplicate_budget_by_consumer
        .insert("zone-exit-sms".into(), 0.001);
    let out = budgets(&markers, &steps, &rules, t(now));
    assert_eq!(out.len(), 2);
    let (v3, v2) = (&out[0], &out[1]);

    // Deploy #1: (300, 600], ended by deploy #2.
    assert_eq!((v2.label.as_str(), v2.ends), ("v2", WindowEnd::NextMarker));
    assert_eq!(v2.window_seconds, 300);
    assert_eq!((v2.processed, v2.duplicates), (6000.0, 2.0));
    assert_eq!(v2.verdict, Verdict::Within);
    let [sms, trip] = [&v2.consumers[1], &v2.consumers[0]];
    assert_eq!(sms.consumer, "zone-exit-sms");
    assert_eq!((sms.processed, sms.duplicates), (3000.0, 2.0));
    assert_eq!(sms.ratio, Some(2.0 / 3002.0));
    assert_eq!((sms.budget, sms.verdict), (0.001, Verdict::Within));
    // Its baseline: the 300 s before the mark (from the first reading at 0), 3000
    // processed and the normal day's 1 duplicate.
    assert_eq!(sms.baseline_source, BaselineSource::BeforeMarker);
    assert_eq!(sms.baseline_ratio, 1.0 / 3001.0);
    assert_eq!(
        (sms.peak_ratio, sms.peak_at),
        (Some(2.0 / 602.0), Some(t(301)))
    );
    assert_eq!(
        sms.settle_seconds,
        Some(61),
        "the minute after 301 is clean at 361"
    );
    assert_eq!((trip.processed, trip.duplicates), (3000.0, 0.0));
    assert_eq!(
        (trip.verdict, trip.settle_seconds),
        (Verdict::Within, Some(0))
    );

    // Deploy #2: (600, 1200], the settle time (10 min) passed.
    assert_eq!((v3.label.as_str(), v3.ends), ("v3", WindowEnd::SettleTime));
    assert_eq!((v3.until, v3.window_seconds), (t(1200), 600));
    assert_eq!((v3.processed, v3.duplicates), (12000.0, 14.0));
    assert_eq!(v3.verdict, Verdict::Over);
    let [sms, trip] = [&v3.consumers[1], &v3.consumers[0]];
    assert_eq!((sms.processed, sms.duplicates), (6000.0, 10.0));
    assert_eq!(sms.ratio, Some(10.0 / 6010.0));
    assert_eq!(sms.verdict, Verdict::Over, "0.17 % against its own 0.1 %");
    assert_eq!(
        (sms.peak_ratio, sms.peak_at),
        (Some(10.0 / 610.0), Some(t(650)))
    );
    // Back at baseline (none since it settled at 361) once 650 left the minute.
    assert_eq!(
        (sms.baseline_ratio, sms.baseline_source),
        (0.0, BaselineSource::BeforeMarker)
    );
    assert_eq!(sms.settle_seconds, Some(110));
    assert_eq!((trip.processed, trip.duplicates), (6000.0, 4.0));
    assert_eq!((trip.budget, trip.verdict), (0.004, Verdict::Within));
    assert_eq!(trip.settle_seconds, Some(61));

    // The alert: the newest closed window, its over-budget consumer only, since
    // the window closed.
    let consumers: Vec<_> = tracker.consumers().cloned().collect();
    let alerts = evaluate_at(&AlertInputs {
        now: t(now),
        targets: &[tracker.status().clone()],
        consumers: &consumers,
        database: None,
        markers: &markers,
        deploys: &out,
        rules: &rules,
        windows: &[],
    });
    let over: Vec<_> = alerts
        .iter()
        .filter(|a| a.kind.name() == "deploy_over_budget")
        .collect();
    assert_eq!(over.len(), 1, "{alerts:?}");
    assert_eq!(
        over[0].object,
        AlertObject::Deploy {
            target: "fleet".into(),
            consumer: "zone-exit-sms".into(),
            at: t(600)
        }
    );
    assert_eq!(over[0].since, Some(t(1200)));
    assert!(matches!(
        &over[0].kind,
        AlertKind::DeployOverBudget { duplicates, budget, .. } if *duplicates == 10.0 && *budget == 0.001
    ));
    assert_eq!(
        over[0].message,
        "fleet/zone-exit-sms: \"v3\" cost 10 duplicates, 0.17% of its 10m window (budget 0.10%)"
    );
    // An hour after the window closed the verdict is the panel's and the report's.
    let later = evaluate_at(&AlertInputs {
        now: t(1200 + 3601),
        targets: &[],
        consumers: &[],
        database: None,
        markers: &markers,
        deploys: &out,
        rules: &rules,
        windows: &[],
    });
    assert!(!later.iter().any(|a| a.kind.name() == "deploy_over_budget"));
}
