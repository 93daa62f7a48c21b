//! Fixture data with a fixed clock for the screen snapshot tests: a deploy-day
//! spike, a restart, a late event, a ghost state, a claim in doubt, dead letters.

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, TimeZone, Utc};

use idemwatch_engine::store::Durability;
use idemwatch_monitor::alerts::{Alert, AlertKind, AlertObject, AlertRecord, Cause, Severity};
use idemwatch_monitor::db::{
    ConsumerInserts, CountMethod, DbStats, DeadLetterDetail, DeadLetterGroup, DeadLetterRow,
    DedupStats, DrillRunSummary, InDoubtClaim, RowEstimate, SourceStatus,
};
use idemwatch_monitor::markers::{MarkerSource, TimelineMarker};
use idemwatch_monitor::series::Point;
use idemwatch_monitor::targets::{
    BrokerKind, BrokerStatus, ConsumerStatus, CounterReading, Flow, IngressError, IngressReading,
    TargetStatus, Totals, WindowCounts,
};
use idemwatch_monitor::vehicles::{
    DetailEvent, HistoryEvent, StateRow, VehicleAnomalies, VehicleAnomaly, VehicleDetail,
};
use idemwatch_monitor::windows::{AgeReading, ConsumerWindows, WindowInputs};
use idemwatch_monitor::{BrokerChart, ConsumerChart, Snapshot};

/// The fixed "now" of every fixture: the field report's 04:12.
pub fn now() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 30, 4, 12, 3)
        .single()
        .unwrap_or(DateTime::UNIX_EPOCH)
}

fn reading(total: f64, per_second: f64) -> CounterReading {
    CounterReading {
        total,
        per_second: Some(per_second),
    }
}

fn consumer(name: &str, processed: f64, rate: f64, dups: f64, dup_rate: f64) -> ConsumerStatus {
    let mut side_effects = BTreeMap::new();
    if name == "zone-exit-sms" {
        side_effects.insert("sent".into(), reading(412.0, 0.2));
        side_effects.insert("suppressed".into(), reading(3.0, 0.0));
        side_effects.insert("failed".into(), reading(0.0, 0.0));
    }
    let window_1m = window(
        60.0,
        rate,
        dup_rate,
        if name == "vehicle-state" { 3.0 } else { 0.0 },
    );
    ConsumerStatus {
        target: "demo-engine".into(),
        consumer: name.into(),
        up: true,
        processed: reading(processed, rate),
        duplicate_dropped: reading(dups, dup_rate),
        duplicate_ratio: Some(dup_rate / (rate + dup_rate)),
        // What the monitor sets: the minute's ratio is the window's.
        duplicate_ratio_1m: window_1m.duplicate_ratio,
        redelivered: reading(dups + 2.0, dup_rate),
        out_of_order: reading(4.0, 0.0),
        dead_lettered: reading(2.0, 0.0),
        dead_lettered_by_reason: BTreeMap::from([("invalid_field".into(), 2.0)]),
        side_effects,
        claims_in_doubt: Some(if name == "zone-exit-sms" { 1.0 } else { 0.0 }),
        last_restart: Some(now() - Duration::seconds(95)),
        duplicates_quiet_seconds: None,
        duplicate_age: duplicate_age(name),
        window_1m,
        paused: None,
        provider_repeat_calls: BTreeMap::new(),
        waiting_seconds: None,
        window_5m: window(300.0, rate, dup_rate * 0.6, 2.0),
        totals: Totals {
            since: Some(now() - Duration::seconds(1200)),
            restarts: 3,
            processed: processed * 1.4,
            duplicate_dropped: dups * 1.5,
            redelivered: dups * 1.5 + 4.0,
            out_of_order: 6.0,
            dead_lettered: 5.0,
            side_effects: if name == "zone-exit-sms" {
                BTreeMap::from([
                    ("sent".to_string(), 590.0),
                    ("suppressed".to_string(), 5.0),
                    ("failed".to_string(), 0.0),
                ])
            } else {
                BTreeMap::new()
            },
        },
        flow: match name {
            "erp-webhook" => Flow::Quiet {
                last_processed_at: Some(now() - Duration::seconds(42)),
            },
            _ => Flow::Flowing,
        },
    }
}

/// Counts over a window at these rates (a redelivery burst in the last minute).
fn window(seconds: f64, rate: f64, dup_rate: f64, burst: f64) -> WindowCounts {
    let processed = (rate * seconds).round();
    let dups = (dup_rate * seconds).round();
    WindowCounts {
        seconds,
        processed,
        duplicate_dropped: dups,
        redelivered: dups + burst,
        out_of_order: burst.min(1.0),
        dead_lettered: if seconds > 60.0 { 2.0 } else { 0.0 },
        dead_lettered_by_reason: if seconds > 60.0 {
            BTreeMap::from([("invalid_field".to_string(), 2.0)])
        } else {
            BTreeMap::new()
        },
        processed_per_second: Some(processed / seconds),
        duplicate_dropped_per_second: Some(dups / seconds),
        duplicate_ratio: idemwatch_monitor::rates::duplicate_ratio(processed, dups),
    }
}

fn alert(
    severity: Severity,
    kind: AlertKind,
    object: AlertObject,
    message: &str,
    since: i64,
) -> Alert {
    Alert {
        severity,
        kind,
        message: message.into(),
        object,
        cause: Cause::Incident,
        since: Some(now() - Duration::seconds(since)),
    }
}

/// The raw bytes of the fixture's dead letter #7 (a key conflict).
pub fn conflict_raw() -> Vec<u8> {
    br#"{"device_id":"34-SIM-0003","seq":311,"event_type":"zone_exit","occurred_at":"2026-11-30T04:10:03Z","payload":{"zone":"Y","phone":"+905551112233"}}"#.to_vec()
}

/// A duplicate-ratio series: quiet, a spike at the deploy, a gap where a scrape
/// failed, quiet again.
fn ratio_series(peak: f64) -> Vec<Point> {
    (0..180)
        .map(|i| {
            let at = now() - Duration::seconds(900 - i * 5);
            let value = match i {
                60..=66 => Some(peak * (1.0 - (i - 60) as f64 / 8.0)),
                100..=104 => None,
                _ => Some(0.0001),
            };
            Point { at, value }
        })
        .collect()
}

/// A per-second rate series with the same deploy spike as [`ratio_series`].
fn rate_series(peak: f64) -> Vec<Point> {
    ratio_series(peak)
        .into_iter()
        .map(|p| Point {
            at: p.at,
            value: p.value.map(|v| if v > 0.001 { v } else { 0.0 }),
        })
        .collect()
}

fn marker(seconds_ago: i64, kind: &str, label: &str) -> TimelineMarker {
    TimelineMarker {
        at: now() - Duration::seconds(seconds_ago),
        kind: kind.into(),
        label: label.into(),
        detail: None,
        source: MarkerSource::Database,
    }
}

fn history(seq: i64, event_type: &str, received: i64, applied: bool) -> HistoryEvent {
    HistoryEvent {
        device_id: "34-SIM-0007".into(),
        seq,
        event_type: event_type.into(),
        occurred_at: Some(now() - Duration::seconds(700 - seq)),
        received_at: now() - Duration::seconds(received),
        applied,
    }
}

/// The duplicate ages of the demo's consumers: trip-counter's oldest copy came
/// 3 h 12 m late (the brief's example), zone-exit-sms's 30 h late (past a 24 h provider
/// key); the others dropped none with a known age.
fn duplicate_age(name: &str) -> Option<AgeReading> {
    let ages: &[f64] = match name {
        "trip-counter" => &[2.0, 4.0, 40.0, 11_520.0],
        "zone-exit-sms" => &[5.0, 108_000.0],
        _ => return None,
    };
    let bounds = idemwatch_engine::metrics::DUPLICATE_AGE_BUCKETS;
    let buckets = bounds
        .iter()
        .chain([f64::INFINITY].iter())
        .map(|&le| (le, ages.iter().filter(|a| **a <= le).count() as f64))
        .collect();
    Some(AgeReading {
        buckets,
        count: ages.len() as f64,
        max_seconds: ages.iter().copied().reduce(f64::max),
    })
}

/// Each consumer's windows as the monitor computes them: the 7-day retention, a
/// 24 h provider key lifetime.
fn windows(consumers: &[ConsumerStatus], targets: &[TargetStatus]) -> Vec<ConsumerWindows> {
    idemwatch_monitor::windows::evaluate(&WindowInputs {
        consumers,
        targets,
        brokers: &[],
        stored_max: &BTreeMap::new(),
        retention: Some(std::time::Duration::from_secs(7 * 86_400)),
        provider_key_lifetime: std::time::Duration::from_secs(86_400),
    })
}

/// One poll of the demo at `at`, every tab's data, assembled from the parts below
/// (each one what a screen test needs of one source).
pub fn snapshot(at: DateTime<Utc>) -> Snapshot {
    let names = [
        "vehicle-state",
        "trip-counter",
        "zone-exit-sms",
        "erp-webhook",
    ];
    let markers = vec![
        marker(20, "drill", "drill crash-before-ack (idempotent): pass"),
        marker(95, "restart", "demo-engine restarted"),
        marker(600, "deploy", "demo deploy #1"),
    ];
    let consumers = vec![
        consumer(names[0], 5120.0, 8.0, 21.0, 0.001),
        consumer(names[1], 410.0, 0.6, 3.0, 0.0),
        consumer(names[2], 410.0, 0.6, 3.0, 0.003),
        consumer(names[3], 201.0, 0.3, 1.0, 0.0),
    ];
    let targets = targets(at);
    Snapshot {
        poll: 42,
        taken_at: at,
        windows: windows(&consumers, &targets),
        targets,
        consumers,
        database: database(at, &names, &markers),
        alerts: alerts(),
        ended_alerts: ended_alerts(),
        dead_letter: Some(DeadLetterDetail {
            id: 7,
            consumer: "trip-counter".into(),
            reason: "key_conflict".into(),
            received_at: now() - Duration::seconds(50),
            detail: Some("same key 34-SIM-0003:311:zone_exit, different payload".into()),
            raw: conflict_raw(),
        }),
        deploys: deploys(&markers, &charts(&names), at),
        markers,
        history: None,
        history_source: None,
        vehicle: vehicle(),
        charts: charts(&names),
        brokers: vec![BrokerStatus {
            target: "rabbitmq".into(),
            kind: BrokerKind::RabbitMq,
            up: true,
            redelivered: reading(1930.0, 2.1),
            acknowledged: reading(120_433.0, 41.0),
            messages_ready: Some(12.0),
            messages_unacked: Some(64.0),
            duplicate_windows: BTreeMap::new(),
        }],
        broker_charts: vec![BrokerChart {
            target: "rabbitmq".into(),
            redelivered_per_s: rate_series(2.6),
        }],
    }
}

/// The deploy and the restart of the markers, their budgets read from the charts'
/// rates as the monitor reads its series.
fn deploys(
    markers: &[TimelineMarker],
    charts: &[ConsumerChart],
    at: DateTime<Utc>,
) -> Vec<idemwatch_monitor::deploys::DeployBudget> {
    use idemwatch_monitor::deploys::{budgets, steps_from_rates, ConsumerSteps};
    let steps: Vec<ConsumerSteps> = charts
        .iter()
        .map(|c| ConsumerSteps {
            target: c.target.clone(),
            consumer: c.consumer.clone(),
            steps: steps_from_rates(&c.processed_per_s, &c.duplicates_per_s, None),
        })
        .collect();
    budgets(
        markers,
        &steps,
        &idemwatch_monitor::config::AlertRules::default(),
        at,
    )
}

/// One engine, up, with an HTTP edge and an MQTT ingress.
fn targets(at: DateTime<Utc>) -> Vec<TargetStatus> {
    vec![TargetStatus {
        name: "demo-engine".into(),
        url: "http://127.0.0.1:40123/metrics".into(),
        status: SourceStatus::Up,
        scraped_at: Some(at),
        down_since: None,
        scrape_ms: Some(2),
        samples: 131,
        process_start_time: Some(1_700_000_000.0),
        last_restart: Some(now() - Duration::seconds(95)),
        durability: Some(Durability::Durable),
        http: BTreeMap::from([(
            "/v1/trips/{device}/notes".to_string(),
            BTreeMap::from([
                ("executed".to_string(), reading(120.0, 0.5)),
                ("replayed".to_string(), reading(4.0, 0.02)),
                ("conflict".to_string(), reading(1.0, 0.0)),
            ]),
        )]),
        seen_set_bypassed: BTreeMap::new(),
        seen_set_ttl_seconds: None,
        ingress: BTreeMap::from([(
            "mqtt".to_string(),
            IngressReading {
                received: reading(48_210.0, 40.2),
                dup_flagged: reading(31.0, 0.1),
                connected: Some(true),
                state_since: Some(now() - Duration::seconds(380)),
                last_error: Some(IngressError {
                    kind: "connect".into(),
                    at: now() - Duration::seconds(385),
                    count: 3.0,
                }),
                dead_lettered: BTreeMap::from([
                    ("malformed_json".to_string(), 0.0),
                    ("too_large".to_string(), 2.0),
                ]),
            },
        )]),
    }]
}

/// The engine's database: a claim in doubt, two dead letters (one a key conflict), drill runs, vehicle anomalies.
fn database(at: DateTime<Utc>, names: &[&str], markers: &[TimelineMarker]) -> Option<DbStats> {
    Some(DbStats {
        url: "sqlite:///home/op/.local/share/idemwatch/demo/demo.db".into(),
        status: SourceStatus::Up,
        polled_at: at,
        duration_ms: 3,
        dedup: Some(DedupStats {
            inserts: names
                .iter()
                .skip(1)
                .map(|c| ConsumerInserts {
                    consumer: c.to_string(),
                    last_minute: 36,
                })
                .collect(),
            total_rows: Some(RowEstimate {
                rows: 1021,
                method: CountMethod::Exact,
            }),
            oldest_processed_at: Some(now() - Duration::seconds(3600)),
            oldest_age_seconds: Some(3600),
            retention_seconds: 7 * 86_400,
            purge_stalled: false,
        }),
        claims_in_doubt_total: 1,
        claims_in_doubt: vec![InDoubtClaim {
            consumer: "zone-exit-sms".into(),
            message_key: "34-SIM-0003:311:zone_exit".into(),
            claimed_at: now() - Duration::seconds(140),
            age_seconds: 140,
            attempts: 2,
            released: false,
        }],
        dead_letters: vec![
            DeadLetterGroup {
                consumer: "vehicle-state".into(),
                reason: "invalid_field".into(),
                total: 2,
                last_hour: 2,
                newest_at: Some(now() - Duration::seconds(30)),
                newest_id: Some(8),
            },
            DeadLetterGroup {
                consumer: "trip-counter".into(),
                reason: "key_conflict".into(),
                total: 1,
                last_hour: 1,
                newest_at: Some(now() - Duration::seconds(50)),
                newest_id: Some(7),
            },
        ],
        recent_dead_letters: recent_dead_letters(),
        markers: markers.to_vec(),
        drill_runs: drill_runs(),
        vehicles: vehicle_anomalies(),
        failures: Vec::new(),
        duplicate_ages: None,
    })
}

/// The newest dead letters: a bad field, and the key conflict the raw view opens.
fn recent_dead_letters() -> Vec<DeadLetterRow> {
    vec![
        DeadLetterRow {
            id: 8,
            consumer: "vehicle-state".into(),
            reason: "invalid_field".into(),
            received_at: now() - Duration::seconds(30),
            detail: Some("seq: expected an unsigned integer".into()),
            size: 63,
            preview: r#"{"device_id":"34-SIM-0003","seq":"oops","event_type":"position"}"#.into(),
            message_key: None,
            device_id: Some("34-SIM-0003".into()),
        },
        DeadLetterRow {
            id: 7,
            consumer: "trip-counter".into(),
            reason: "key_conflict".into(),
            received_at: now() - Duration::seconds(50),
            detail: Some("same key 34-SIM-0003:311:zone_exit, different payload".into()),
            size: conflict_raw().len() as i64,
            preview: idemwatch_monitor::bytes::escaped(&conflict_raw())
                .chars()
                .take(80)
                .collect(),
            message_key: Some("34-SIM-0003:311:zone_exit".into()),
            device_id: Some("34-SIM-0003".into()),
        },
    ]
}

/// A passed drill and a failed naive one.
fn drill_runs() -> Vec<DrillRunSummary> {
    vec![
        DrillRunSummary {
            id: 2,
            scenario: "crash-before-ack".into(),
            mode: "idempotent".into(),
            started_at: Some(now() - Duration::seconds(22)),
            finished_at: Some(now() - Duration::seconds(20)),
            verdict: Some("pass".into()),
        },
        DrillRunSummary {
            id: 1,
            scenario: "out-of-order".into(),
            mode: "naive".into(),
            started_at: Some(now() - Duration::seconds(300)),
            finished_at: Some(now() - Duration::seconds(299)),
            verdict: Some("fail".into()),
        },
    ]
}

/// One of each ordering anomaly.
fn vehicle_anomalies() -> Option<VehicleAnomalies> {
    Some(VehicleAnomalies {
        rows_examined: 5120,
        truncated: false,
        late_events_in_window: 1,
        anomalies: vec![
            VehicleAnomaly::LateEvent {
                device_id: "34-SIM-0007".into(),
                seq: 318,
                event_type: "ignition_on".into(),
                received_at: now() - Duration::seconds(40),
            },
            VehicleAnomaly::StateBehind {
                device_id: "DRILL-1-ab12".into(),
                state_seq: 900,
                newest_applied_seq: 901,
            },
            VehicleAnomaly::SequenceGap {
                device_id: "34-SIM-0011".into(),
                after_seq: 40,
                before_seq: 43,
                missing: 2,
            },
        ],
    })
}

/// Two incidents (a claim in doubt, a key-conflict burst) and a drill's own alert.
fn alerts() -> Vec<Alert> {
    vec![
        alert(
            Severity::Critical,
            AlertKind::ClaimsInDoubt { count: 1 },
            AlertObject::Claim {
                consumer: "zone-exit-sms".into(),
                message_key: "34-SIM-0003:311:zone_exit".into(),
            },
            "1 side-effect claim(s) in doubt: the send may or may not have happened",
            80,
        ),
        alert(
            Severity::Critical,
            AlertKind::DeadLetterBurst {
                consumer: "trip-counter".into(),
                reason: "key_conflict".into(),
                count: 1.0,
                window_seconds: 300,
            },
            AlertObject::DeadLetters {
                consumer: "trip-counter".into(),
                reason: "key_conflict".into(),
            },
            "trip-counter: 1 key_conflict dead letter(s) in 5 min: same key, different payload",
            50,
        ),
        Alert {
            cause: Cause::Drill {
                what: "a drill's own device".into(),
            },
            ..alert(
                Severity::Critical,
                AlertKind::StateBehind { devices: 1 },
                AlertObject::Device {
                    device_id: "DRILL-1-ab12".into(),
                },
                "1 vehicle state(s) behind their applied history",
                300,
            )
        },
    ]
}

/// An alert that held and ended in the window.
fn ended_alerts() -> Vec<AlertRecord> {
    vec![AlertRecord {
        alert: alert(
            Severity::Warning,
            AlertKind::DuplicateRateHigh {
                target: "demo-engine".into(),
                consumer: "vehicle-state".into(),
                ratio: 0.012,
                window_seconds: 60,
                deploy_window: false,
            },
            AlertObject::Consumer {
                target: "demo-engine".into(),
                consumer: "vehicle-state".into(),
            },
            "demo-engine/vehicle-state: 1.20% duplicates over the last minute",
            560,
        ),
        started: now() - Duration::seconds(560),
        ended: Some(now() - Duration::seconds(470)),
    }]
}

/// A vehicle whose late ignition_on was not applied.
fn vehicle() -> Option<VehicleDetail> {
    Some(VehicleDetail {
        device_id: "34-SIM-0007".into(),
        state: Some(StateRow {
            device_id: "34-SIM-0007".into(),
            last_seq: 319,
            last_event_type: "ignition_off".into(),
            ignition: Some("off".into()),
            occurred_at: Some(now() - Duration::seconds(381)),
            updated_at: Some(now() - Duration::seconds(45)),
        }),
        history: vec![
            DetailEvent {
                event: history(317, "position", 50, true),
                late: false,
            },
            DetailEvent {
                event: history(319, "ignition_off", 45, true),
                late: false,
            },
            DetailEvent {
                event: history(318, "ignition_on", 40, false),
                late: true,
            },
        ],
        truncated: false,
    })
}

/// Each consumer's 15-minute chart, each a little higher than the last.
fn charts(names: &[&str]) -> Vec<ConsumerChart> {
    names
        .iter()
        .enumerate()
        .map(|(i, c)| ConsumerChart {
            target: "demo-engine".into(),
            consumer: c.to_string(),
            span_seconds: 900,
            span_fitted: false,
            history_until: None,
            processed_per_s: ratio_series(0.0)
                .into_iter()
                .map(|p| Point {
                    at: p.at,
                    value: p.value.map(|_| 8.0),
                })
                .collect(),
            duplicates_per_s: rate_series(0.5 + i as f64 * 0.2),
            duplicate_ratio: ratio_series(0.004 + i as f64 * 0.001),
            duplicate_ratio_1m: ratio_series(0.004 + i as f64 * 0.001),
            duplicate_ratio_5m: ratio_series(0.004 + i as f64 * 0.001),
            redelivered_per_s: rate_series(0.8 + i as f64 * 0.2),
            dead_lettered_per_s: rate_series(0.0),
        })
        .collect()
}
