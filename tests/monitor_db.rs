//! The database poller against a real SQLite database written by the engine.

use std::time::Duration;

use chrono::Utc;
use idemwatch::config::DatabaseConfig;
use idemwatch::engine::envelope::{Envelope, RejectReason};
use idemwatch::engine::store::{self, BusinessWrite, MarkerKind, Store};
use idemwatch::monitor::alerts::{self, AlertKind};
use idemwatch::monitor::db::{CountMethod, DbPoller, SourceStatus};
use idemwatch::monitor::vehicles::VehicleAnomaly;

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
    _dir: tempfile::TempDir,
    url: String,
    store: std::sync::Arc<dyn Store>,
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("fleet.db").display());
    let store = store::open(&url).await.expect("open store");
    Fixture {
        _dir: dir,
        url,
        store,
    }
}

async fn raw_sql(url: &str, sql: &str) {
    let pool = sqlx::SqlitePool::connect(url).await.expect("connect");
    sqlx::query(sql).execute(&pool).await.expect(sql);
    pool.close().await;
}

#[tokio::test]
async fn dedup_claims_dead_letters_markers_and_drills_are_polled() {
    let f = fixture().await;
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
}

#[tokio::test]
async fn a_purge_that_stopped_shows() {
    let f = fixture().await;
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
    raw_sql(
        &f.url,
        "UPDATE processed_messages SET processed_at = '2020-01-01T00:00:00.000000Z' WHERE message_key = 'v:1:zone_exit'",
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

#[tokio::test]
async fn vehicle_anomalies_and_detail_come_from_history() {
    let f = fixture().await;
    let s = f.store.as_ref();
    for (seq, event) in [(10, "ignition_on"), (12, "ignition_off"), (9, "position")] {
        let env = envelope("34-ABC-123", seq, event);
        s.apply_vehicle_event(&env, &env.fingerprint(), true)
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
    raw_sql(&f.url, "UPDATE vehicle_state SET last_seq = 10").await;
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

#[tokio::test]
async fn a_late_event_far_behind_does_not_fake_a_gap() {
    let f = fixture().await;
    let s = f.store.as_ref();
    for seq in 1..=30 {
        let env = envelope("v7", seq, "position");
        s.apply_vehicle_event(&env, &env.fingerprint(), true)
            .await
            .unwrap();
    }
    // Seqs 1..=20 were received long ago; only 21..=30 are in the scan window.
    raw_sql(
        &f.url,
        "UPDATE vehicle_history SET received_at = '2020-01-01T00:00:00.000000Z' WHERE seq <= 20",
    )
    .await;
    // Then seq 3 is redelivered... as a new row on a table without the unique key
    // we cannot make; instead move seq 3's arrival into the window.
    raw_sql(
        &f.url,
        "UPDATE vehicle_history SET received_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE seq = 3",
    )
    .await;
    let poller = DbPoller::new(&DatabaseConfig::with_url(&f.url)).unwrap();
    let v = poller.poll(Utc::now()).await.vehicles.unwrap();
    assert!(
        !v.anomalies
            .iter()
            .any(|a| matches!(a, VehicleAnomaly::SequenceGap { .. })),
        "{:?}",
        v.anomalies
    );
}

#[tokio::test]
async fn a_users_own_dedup_table_is_watched_through_the_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("shop.db").display());
    let now = chrono::Utc::now()
        .format("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string();
    raw_sql(
        &url,
        "CREATE TABLE inbox (handler TEXT, msg_id TEXT, done_at TEXT, PRIMARY KEY (handler, msg_id))",
    )
    .await;
    raw_sql(
        &url,
        &format!("INSERT INTO inbox VALUES ('billing', 'a', '{now}'), ('billing', 'b', '{now}')"),
    )
    .await;
    let toml = format!(
        "[database]\nurl = \"{url}\"\n[database.tables.processed_messages]\ntable = \"inbox\"\nconsumer = \"handler\"\nmessage_key = \"msg_id\"\nprocessed_at = \"done_at\"\n"
    );
    let config =
        idemwatch::config::Config::from_toml(&toml, std::path::Path::new("inline.toml")).unwrap();
    let poller = DbPoller::new(config.database.as_ref().unwrap()).unwrap();
    let stats = poller.poll(Utc::now()).await;
    let dedup = stats.dedup.expect("dedup from the mapped table");
    assert_eq!(dedup.inserts[0].consumer, "billing");
    assert_eq!(dedup.inserts[0].last_minute, 2);
    assert_eq!(dedup.total_rows.unwrap().rows, 2);
    // The idemwatch-only tables are missing there: reported per query, not fatal.
    assert!(stats.failures.iter().any(|f| f.query == "markers"));
}

#[tokio::test]
async fn a_database_that_is_down_is_reported_and_picked_up_later() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("later.db").display());
    let poller = DbPoller::new(&DatabaseConfig::with_url(&url)).unwrap();
    let stats = poller.poll(Utc::now()).await;
    match &stats.status {
        SourceStatus::Down { error } => assert!(error.contains("unable to open"), "{error}"),
        SourceStatus::Up => panic!("a missing database file must be down"),
    }
    assert!(
        !dir.path().join("later.db").exists(),
        "the poller never creates it"
    );
    let _store = store::open(&url).await.unwrap();
    assert_eq!(poller.poll(Utc::now()).await.status, SourceStatus::Up);
}
