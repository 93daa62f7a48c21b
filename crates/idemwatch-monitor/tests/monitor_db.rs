//! The database poller against SQLite-only situations (a user's mapped table, a
//! file that does not exist yet). The figures every backend must agree on are in
//! `monitor_db_backends.rs`.

use chrono::Utc;
use idemwatch_engine::envelope::{Envelope, Message};
use idemwatch_engine::store::{self, Store};
use idemwatch_monitor::config::DatabaseConfig;
use idemwatch_monitor::db::{DbPoller, SourceStatus};
use idemwatch_monitor::vehicles::VehicleAnomaly;

fn envelope(device: &str, seq: u64, event_type: &str) -> Envelope {
    let line = format!(
        r#"{{"device_id":"{device}","seq":{seq},"event_type":"{event_type}","occurred_at":"2026-11-30T04:12:{:02}Z","payload":{{"zone":"X","lat":41.0,"lon":29.0}}}}"#,
        seq % 60
    );
    Envelope::parse(line.as_bytes()).expect("a valid envelope")
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
async fn a_late_event_far_behind_does_not_fake_a_gap() {
    let f = fixture().await;
    let s = f.store.as_ref();
    for seq in 1..=30 {
        let env = envelope("v7", seq, "position");
        s.apply_vehicle_event(&Message::new(env), true)
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
        idemwatch_monitor::config::Config::from_toml(&toml, std::path::Path::new("inline.toml"))
            .unwrap();
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
