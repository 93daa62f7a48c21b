//! Whose fault a store error is, read from each backend's real answers: an outage, a
//! lock or a deadlock is infrastructure (retry, never dead-letter); a row the
//! database refuses for its content is content (`store_rejected`).

use std::time::Duration;

use idemwatch_engine::envelope::{Envelope, Message, RejectReason};
use idemwatch_engine::store::{self, Failure, StoreError};
use idemwatch_testkit::backends::{Kind, TestDb};
use idemwatch_testkit::on_every_backend;
use sqlx::{ConnectOptions, Connection};

on_every_backend!(
    a_row_the_database_refuses_is_a_content_failure,
    an_unreachable_database_is_an_infrastructure_failure,
    a_lock_that_cannot_be_had_is_an_infrastructure_failure,
    a_deadlock_is_an_infrastructure_failure,
);

fn failure<T>(r: Result<T, StoreError>) -> Failure {
    let Err(e) = r else {
        panic!("the store did not refuse")
    };
    eprintln!("{e}");
    e.failure()
}

fn db_failure<T>(r: Result<T, sqlx::Error>) -> Failure {
    failure(r.map_err(StoreError::from))
}

async fn a_row_the_database_refuses_is_a_content_failure(db: &TestDb) {
    let s = store::open(&db.url).await.unwrap();
    let refused = match db.kind {
        // SQLite stores any text: a trigger plays the database refusing the row.
        Kind::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
            sqlx::query(
                "CREATE TRIGGER refuse BEFORE INSERT ON dead_letters
                 WHEN NEW.consumer = 'refused' BEGIN SELECT RAISE(ABORT, 'refused'); END",
            )
            .execute(&mut c)
            .await
            .unwrap();
            "refused".to_string()
        }
        // A NUL byte is not valid in PostgreSQL text.
        Kind::Postgres => "nul\0byte".to_string(),
        // `dead_letters.consumer` is VARCHAR(64) (strict mode: refused, not cut).
        Kind::Mysql => "c".repeat(65),
    };
    let r = s
        .dead_letter(&refused, RejectReason::MalformedJson, "", b"{")
        .await;
    assert_eq!(failure(r), Failure::Content);
    // The neighbours are unharmed: the same call with a plain consumer works.
    s.dead_letter("fine", RejectReason::MalformedJson, "", b"{")
        .await
        .unwrap();

    // A seq beyond what any backend stores is refused before the database.
    let mut env: Envelope = serde_json::from_str(
        r#"{"device_id":"D1","seq":1,"event_type":"ignition_on","occurred_at":"2026-11-30T04:12:03Z","payload":{}}"#,
    )
    .unwrap();
    env.seq = u64::MAX;
    let r = s.apply_vehicle_event(&Message::new(env), true).await;
    assert_eq!(failure(r), Failure::Content);
}

fn port_1(url: &str) -> String {
    let mut url = url::Url::parse(url).unwrap();
    url.set_port(Some(1)).unwrap();
    url.to_string()
}

async fn an_unreachable_database_is_an_infrastructure_failure(db: &TestDb) {
    match db.kind {
        Kind::Sqlite => {
            // The database's directory cannot be created: a file stands in its way.
            std::fs::write(db.env.path("file"), b"").unwrap();
            let url = format!("sqlite://{}", db.env.path("file/sub/x.db").display());
            assert_eq!(failure(store::open(&url).await), Failure::Infrastructure);
        }
        // Nothing listens on port 1 (one connection: the store's pool would retry
        // for its whole acquire timeout, then fail as a pool timeout).
        Kind::Postgres => {
            let r = sqlx::PgConnection::connect(&port_1(&db.url)).await;
            assert_eq!(db_failure(r), Failure::Infrastructure);
        }
        Kind::Mysql => {
            let r = sqlx::MySqlConnection::connect(&port_1(&db.url)).await;
            assert_eq!(db_failure(r), Failure::Infrastructure);
        }
    }
    // A store whose server drops its connections mid-flight.
    let s = store::open(&db.url).await.unwrap();
    s.add_marker(store::MarkerKind::Manual, "before", None)
        .await
        .unwrap();
    match db.kind {
        Kind::Sqlite => return,
        Kind::Postgres => {
            let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .execute(&mut admin)
            .await
            .unwrap();
        }
        Kind::Mysql => {
            let mut admin = sqlx::MySqlConnection::connect(&db.url).await.unwrap();
            let ids: Vec<i64> = sqlx::query_scalar(
                "SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST
                 WHERE DB = DATABASE() AND ID <> CONNECTION_ID()",
            )
            .fetch_all(&mut admin)
            .await
            .unwrap();
            for id in ids {
                let _ = sqlx::query(&format!("KILL {id}")).execute(&mut admin).await;
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = s.add_marker(store::MarkerKind::Manual, "after", None).await;
    assert_eq!(failure(r), Failure::Infrastructure);
}

async fn a_lock_that_cannot_be_had_is_an_infrastructure_failure(db: &TestDb) {
    let s = store::open(&db.url).await.unwrap();
    s.apply_unguarded(&store::BusinessWrite::CountZoneExit {
        device_id: "D1".into(),
    })
    .await
    .unwrap();
    let lock = "UPDATE trip_counters SET zone_exits = zone_exits + 1 WHERE device_id = 'D1'";
    let waited = match db.kind {
        Kind::Sqlite => {
            let mut holder = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
            sqlx::query("BEGIN IMMEDIATE")
                .execute(&mut holder)
                .await
                .unwrap();
            // SQLITE_BUSY at once: no busy timeout on this connection.
            let opts: sqlx::sqlite::SqliteConnectOptions = db.url.parse().unwrap();
            let mut other = opts.busy_timeout(Duration::ZERO).connect().await.unwrap();
            db_failure(sqlx::query("BEGIN IMMEDIATE").execute(&mut other).await)
        }
        Kind::Postgres => {
            let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
            let mut other = sqlx::PgConnection::connect(&db.url).await.unwrap();
            sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
            sqlx::query(lock).execute(&mut holder).await.unwrap();
            sqlx::query("SET lock_timeout = '100ms'")
                .execute(&mut other)
                .await
                .unwrap();
            db_failure(sqlx::query(lock).execute(&mut other).await)
        }
        Kind::Mysql => {
            let mut holder = sqlx::MySqlConnection::connect(&db.url).await.unwrap();
            let mut other = sqlx::MySqlConnection::connect(&db.url).await.unwrap();
            sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
            sqlx::query(lock).execute(&mut holder).await.unwrap();
            sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
                .execute(&mut other)
                .await
                .unwrap();
            db_failure(sqlx::query(lock).execute(&mut other).await)
        }
    };
    assert_eq!(waited, Failure::Infrastructure);
}

/// Two transactions each hold the row the other wants next.
macro_rules! deadlock {
    ($conn:ty, $url:expr) => {{
        let mut a = <$conn>::connect($url).await.unwrap();
        let mut b = <$conn>::connect($url).await.unwrap();
        let bump = |d: &str| {
            format!("UPDATE trip_counters SET zone_exits = zone_exits + 1 WHERE device_id = '{d}'")
        };
        for (c, first) in [(&mut a, "D1"), (&mut b, "D2")] {
            sqlx::query("BEGIN").execute(&mut *c).await.unwrap();
            sqlx::query(&bump(first)).execute(&mut *c).await.unwrap();
        }
        let (to_b, to_a) = (bump("D2"), bump("D1"));
        let (ra, rb) = tokio::join!(
            sqlx::query(&to_b).execute(&mut a),
            sqlx::query(&to_a).execute(&mut b)
        );
        match (ra, rb) {
            (Err(e), _) | (_, Err(e)) => StoreError::from(e).failure(),
            _ => panic!("no deadlock"),
        }
    }};
}

async fn a_deadlock_is_an_infrastructure_failure(db: &TestDb) {
    let s = store::open(&db.url).await.unwrap();
    for d in ["D1", "D2"] {
        s.apply_unguarded(&store::BusinessWrite::CountZoneExit {
            device_id: d.into(),
        })
        .await
        .unwrap();
    }
    let failure = match db.kind {
        // SQLite has one writer: no deadlock, the lock test covers it.
        Kind::Sqlite => return,
        Kind::Postgres => deadlock!(sqlx::PgConnection, &db.url),
        Kind::Mysql => deadlock!(sqlx::MySqlConnection, &db.url),
    };
    assert_eq!(failure, Failure::Infrastructure);
}

#[tokio::test]
async fn a_serialization_failure_is_an_infrastructure_failure() {
    let Some(db) = TestDb::new(Kind::Postgres).await else {
        return;
    };
    store::open(&db.url).await.unwrap();
    let mut a = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut b = sqlx::PgConnection::connect(&db.url).await.unwrap();
    for c in [&mut a, &mut b] {
        sqlx::query("BEGIN ISOLATION LEVEL SERIALIZABLE")
            .execute(&mut *c)
            .await
            .unwrap();
        sqlx::query("SELECT count(*) FROM trip_counters")
            .execute(&mut *c)
            .await
            .unwrap();
    }
    sqlx::query("INSERT INTO trip_counters VALUES ('A', 1)")
        .execute(&mut a)
        .await
        .unwrap();
    sqlx::query("INSERT INTO trip_counters VALUES ('B', 1)")
        .execute(&mut b)
        .await
        .unwrap();
    sqlx::query("COMMIT").execute(&mut a).await.unwrap();
    let r = sqlx::query("COMMIT").execute(&mut b).await;
    assert_eq!(db_failure(r), Failure::Infrastructure);
    drop((a, b));
    db.cleanup().await;
}
