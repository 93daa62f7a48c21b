//! The database poller on every backend, against databases written by the engine's
//! own `Store`: the same figures from SQLite, PostgreSQL and MariaDB/MySQL.

mod common;

use std::time::Duration;

use chrono::Utc;
use common::backends::{Kind, TestDb};
use idemwatch::config::{ClaimsTable, DatabaseConfig};
use idemwatch::engine::envelope::{Envelope, Message, RejectReason};
use idemwatch::engine::store::{self, BusinessWrite, MarkerKind, Store};
use idemwatch::monitor::alerts::{self, AlertKind};
use idemwatch::monitor::db::{CountMethod, DbPoller, SourceStatus};
use idemwatch::monitor::vehicles::VehicleAnomaly;
use idemwatch_testkit::on_every_backend;

on_every_backend!(
    dedup_claims_dead_letters_markers_and_drills_are_polled,
    a_purge_that_stopped_shows,
    vehicle_anomalies_and_detail_come_from_history,
    snapshot_json_reads_the_database,
    a_users_claims_table_of_its_own_types_reads_through_the_mapping,
);

fn envelope(device: &str, seq: u64, event_type: &str) -> Envelope {
    let line = format!(
        r#"{{"device_id":"{device}","seq":{seq},"event_type":"{event_type}","occurred_at":"2026-11-30T04:12:{:02}Z","payload":{{"zone":"X","lat":41.0,"lon":29.0}}}}"#,
        seq % 60
    );
    Envelope::parse(line.as_bytes()).expect("a valid envelope")
}

async fn record(store: &dyn Store, consumer: &str, env: &Envelope) {
    store
        .record_once(
            consumer,
            &env.key(),
            &env.fingerprint(),
            &BusinessWrite::CountZoneExit {
                device_id: env.device_id.clone(),
            },
        )
        .await
        .expect("record_once");
}

struct Fixture {
    url: String,
    store: std::sync::Arc<dyn Store>,
}

impl Fixture {
    async fn open(db: &TestDb) -> Fixture {
        let store = store::open(&db.url).await.expect("open store");
        Fixture {
            url: db.url.clone(),
            store,
        }
    }
}

async fn dedup_claims_dead_letters_markers_and_drills_are_polled(db: &TestDb) {
    let f = Fixture::open(db).await;
    let s = f.store.as_ref();
    for seq in 1..=3 {
        record(s, "trip-counter", &envelope("34-ABC-123", seq, "zone_exit")).await;
    }
    // A redelivery writes nothing new.
    record(s, "trip-counter", &envelope("34-ABC-123", 1, "zone_exit")).await;
    let sms = envelope("34-ABC-123", 7, "zone_exit");
    s.claim_side_effect(
        "zone-exit-sms",
        &sms.key(),
        &sms.fingerprint(),
        "pk-7",
        Duration::from_secs(60),
    )
    .await
    .expect("claim");
    s.dead_letter("trip-counter", RejectReason::MalformedJson, "bad", b"{")
        .await
        .unwrap();
    s.dead_letter("trip-counter", RejectReason::MalformedJson, "bad", b"[")
        .await
        .unwrap();
    s.dead_letter("zone-exit-sms", RejectReason::KeyConflict, "x", b"{}")
        .await
        .unwrap();
    s.add_marker(MarkerKind::Deploy, "deploy v2.3.1", None)
        .await
        .unwrap();
    let run = s
        .start_drill_run("crash-before-ack", "idempotent")
        .await
        .unwrap();
    s.finish_drill_run(run, "pass", &serde_json::json!({"sms_sent": 1}))
        .await
        .unwrap();

    let mut settings = DatabaseConfig::with_url(&f.url);
    settings.claim_lease = Duration::ZERO;
    let poller = DbPoller::new(&settings).unwrap();
    let stats = poller.poll(Utc::now()).await;
    assert_eq!(stats.status, SourceStatus::Up);
    assert!(stats.failures.is_empty(), "{:?}", stats.failures);

    let dedup = stats.dedup.as_ref().expect("dedup stats");
    let inserts: Vec<(&str, i64)> = dedup
        .inserts
        .iter()
        .map(|i| (i.consumer.as_str(), i.last_minute))
        .collect();
    assert_eq!(inserts, vec![("trip-counter", 3), ("zone-exit-sms", 1)]);
    let total = dedup.total_rows.unwrap();
    assert_eq!((total.rows, total.method), (4, CountMethod::Exact));
    assert!(dedup.oldest_age_seconds.unwrap() < 60);
    assert!(!dedup.purge_stalled);

    assert_eq!(stats.claims_in_doubt_total, 1);
    let claim = &stats.claims_in_doubt[0];
    assert_eq!(claim.consumer, "zone-exit-sms");
    assert_eq!(claim.message_key, "34-ABC-123:7:zone_exit");
    assert_eq!(claim.attempts, 1);
    assert!(!claim.released);
    assert!(
        claim.age_seconds >= 0 && claim.age_seconds < 60,
        "{claim:?}"
    );

    let groups: Vec<(&str, &str, i64, i64)> = stats
        .dead_letters
        .iter()
        .map(|g| (g.consumer.as_str(), g.reason.as_str(), g.total, g.last_hour))
        .collect();
    assert_eq!(
        groups,
        vec![
            ("trip-counter", "malformed_json", 2, 2),
            ("zone-exit-sms", "key_conflict", 1, 1)
        ]
    );
    // Each group names its newest dead letter by id (an alert opens it even when it
    // is older than the listed ones), and the listed rows agree.
    for g in &stats.dead_letters {
        let newest = stats
            .recent_dead_letters
            .iter()
            .filter(|d| d.consumer == g.consumer && d.reason == g.reason)
            .map(|d| d.id)
            .max();
        assert_eq!(g.newest_id, newest, "{g:?}");
    }
    assert!(stats
        .markers
        .iter()
        .any(|m| m.label == "deploy v2.3.1" && m.kind == "deploy"));
    assert_eq!(stats.drill_runs.len(), 1);
    assert_eq!(stats.drill_runs[0].verdict.as_deref(), Some("pass"));

    let found = alerts::evaluate(&[], &[], Some(&stats));
    assert!(found
        .iter()
        .any(|a| a.kind == AlertKind::ClaimsInDoubt { count: 1 }));

    // Within the lease the claim is not in doubt.
    let poller = DbPoller::new(&DatabaseConfig::with_url(&f.url)).unwrap();
    assert_eq!(poller.poll(Utc::now()).await.claims_in_doubt_total, 0);

    // Given back after a provider timeout, it is in doubt at once, as `released`:
    // its claim time (the epoch) is no age to show.
    s.release_claim(
        "zone-exit-sms",
        &sms.key(),
        "provider did not answer in time",
    )
    .await
    .expect("release");
    let stats = poller.poll(Utc::now()).await;
    assert_eq!(stats.claims_in_doubt_total, 1);
    let claim = &stats.claims_in_doubt[0];
    assert!(claim.released, "{claim:?}");
    assert_eq!(claim.age_seconds, 0);
}

async fn a_purge_that_stopped_shows(db: &TestDb) {
    let f = Fixture::open(db).await;
    record(
        f.store.as_ref(),
        "trip-counter",
        &envelope("v", 1, "zone_exit"),
    )
    .await;
    record(
        f.store.as_ref(),
        "trip-counter",
        &envelope("v", 2, "zone_exit"),
    )
    .await;
    let poller = DbPoller::new(&DatabaseConfig::with_url(&f.url)).unwrap();
    assert!(!poller.poll(Utc::now()).await.dedup.unwrap().purge_stalled);
    let long_ago = match db.kind {
        Kind::Sqlite => "'2020-01-01T00:00:00.000000Z'",
        Kind::Postgres | Kind::Mysql => "'2020-01-01 00:00:00'",
    };
    db.exec(
        &format!("UPDATE processed_messages SET processed_at = {long_ago} WHERE message_key = 'v:1:zone_exit'"),
    )
    .await;
    let stats = poller.poll(Utc::now()).await;
    let dedup = stats.dedup.as_ref().unwrap();
    assert!(dedup.purge_stalled);
    assert!(dedup.oldest_age_seconds.unwrap() > 8 * 86400);
    let found = alerts::evaluate(&[], &[], Some(&stats));
    assert!(found
        .iter()
        .any(|a| matches!(a.kind, AlertKind::PurgeStalled { .. })));
}

async fn vehicle_anomalies_and_detail_come_from_history(db: &TestDb) {
    let f = Fixture::open(db).await;
    let s = f.store.as_ref();
    for (seq, event) in [(10, "ignition_on"), (12, "ignition_off"), (9, "position")] {
        let env = envelope("34-ABC-123", seq, event);
        s.apply_vehicle_event(&Message::new(env), true)
            .await
            .unwrap();
    }
    let poller = DbPoller::new(&DatabaseConfig::with_url(&f.url)).unwrap();
    let v = poller
        .poll(Utc::now())
        .await
        .vehicles
        .expect("vehicle scan");
    assert_eq!(v.rows_examined, 3);
    assert_eq!(v.late_events_in_window, 1);
    assert!(v.anomalies.contains(&VehicleAnomaly::SequenceGap {
        device_id: "34-ABC-123".into(),
        after_seq: 10,
        before_seq: 12,
        missing: 1
    }));
    assert!(v
        .anomalies
        .iter()
        .any(|a| matches!(a, VehicleAnomaly::LateEvent { seq: 9, .. })));
    assert!(!v
        .anomalies
        .iter()
        .any(|a| matches!(a, VehicleAnomaly::StateBehind { .. })));

    // A state that went backwards (what a naive consumer does) is caught.
    db.exec("UPDATE vehicle_state SET last_seq = 10").await;
    let stats = poller.poll(Utc::now()).await;
    assert!(stats
        .vehicles
        .as_ref()
        .unwrap()
        .anomalies
        .contains(&VehicleAnomaly::StateBehind {
            device_id: "34-ABC-123".into(),
            state_seq: 10,
            newest_applied_seq: 12
        }));

    let detail = poller.vehicle_detail("34-ABC-123", 100).await.unwrap();
    assert_eq!(
        detail.state.as_ref().unwrap().last_event_type,
        "ignition_off"
    );
    let arrival: Vec<(i64, bool)> = detail
        .history
        .iter()
        .map(|d| (d.event.seq, d.late))
        .collect();
    assert_eq!(arrival, vec![(10, false), (12, false), (9, true)]);
}

async fn snapshot_json_reads_the_database(db: &TestDb) {
    let f = Fixture::open(db).await;
    record(
        f.store.as_ref(),
        "trip-counter",
        &envelope("34-ABC-123", 1, "zone_exit"),
    )
    .await;
    f.store
        .dead_letter("trip-counter", RejectReason::UnknownEventType, "x", b"{}")
        .await
        .unwrap();
    f.store
        .add_marker(MarkerKind::Deploy, "deploy v9", None)
        .await
        .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemwatch"))
        .args(["snapshot", "--json", "--db", &f.url, "--spacing", "50ms"])
        .args(["--target", "edge=http://127.0.0.1:1/metrics"])
        .env("XDG_CONFIG_HOME", db.env.path("config"))
        .env("IDEMWATCH_LOG_FILE", db.env.path("idemwatch.log"))
        .env_remove("IDEMWATCH_DB")
        .output()
        .expect("run idemwatch");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is exactly one JSON document");
    let database = &doc["database"];
    assert_eq!(database["status"], "up", "{database}");
    assert_eq!(database["failures"], serde_json::json!([]));
    assert_eq!(database["dedup"]["total_rows"]["rows"], 1);
    assert_eq!(database["dedup"]["total_rows"]["method"], "exact");
    assert_eq!(database["dedup"]["inserts"][0]["consumer"], "trip-counter");
    assert_eq!(database["dead_letters"][0]["reason"], "unknown_event_type");
    assert_eq!(database["markers"][0]["label"], "deploy v9");
}

/// A user's own claims table mapped onto the dashboard, in the types a shop might have
/// chosen: a numeric message id, a small or unsigned attempts counter, a time without
/// a zone. Each column reads through the backend's cast: PostgreSQL's `::text`,
/// `::bigint`, `::timestamptz` (so the `smallint` reaches the driver as a `bigint`);
/// MariaDB's `CAST(… AS CHAR)` and `CAST(… AS SIGNED)`, without which the driver
/// refuses a `BIGINT UNSIGNED` as text and a `TINYINT UNSIGNED` as `i64`.
async fn a_users_claims_table_of_its_own_types_reads_through_the_mapping(db: &TestDb) {
    let f = Fixture::open(db).await;
    db.exec(match db.kind {
        Kind::Sqlite => {
            "CREATE TABLE outbox (handler TEXT, msg_id TEXT, status TEXT, taken_at TEXT, tries INTEGER)"
        }
        Kind::Postgres => {
            "CREATE TABLE outbox (handler varchar(40), msg_id bigint, status varchar(10), taken_at timestamp, tries smallint)"
        }
        Kind::Mysql => {
            "CREATE TABLE outbox (handler VARCHAR(40), msg_id BIGINT UNSIGNED, status VARCHAR(10), taken_at DATETIME(6), tries TINYINT UNSIGNED)"
        }
    })
    .await;
    db.exec(
        "INSERT INTO outbox VALUES ('billing', 1234, 'claimed', '2020-01-01 00:00:00', 3),
                                   ('billing', 1235, 'sent', '2020-01-01 00:00:00', 1)",
    )
    .await;
    let mut settings = DatabaseConfig::with_url(&f.url);
    settings.tables.side_effect_claims = ClaimsTable {
        table: "outbox".into(),
        consumer: "handler".into(),
        message_key: "msg_id".into(),
        state: "status".into(),
        claimed_at: "taken_at".into(),
        attempts: "tries".into(),
    };
    let stats = DbPoller::new(&settings).unwrap().poll(Utc::now()).await;
    assert!(stats.failures.is_empty(), "{:?}", stats.failures);
    assert_eq!(stats.claims_in_doubt_total, 1);
    let claims: Vec<(&str, &str, String, i64)> = stats
        .claims_in_doubt
        .iter()
        .map(|c| {
            let at = c.claimed_at.to_rfc3339();
            (c.consumer.as_str(), c.message_key.as_str(), at, c.attempts)
        })
        .collect();
    let at = "2020-01-01T00:00:00+00:00".to_string();
    assert_eq!(claims, vec![("billing", "1234", at, 3)]);
}
