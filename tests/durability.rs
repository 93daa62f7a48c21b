//! Relaxed durability is opt-in and real: what the business database's connections
//! actually run with, on every backend, and the refusal where idemwatch would have
//! to change a server-global setting.

mod common;

use common::backends::{Kind, TestDb};
use common::{run_cli, TempEnv};
use idemwatch::engine::store::postgres::PostgresStore;
use idemwatch::engine::store::sqlite::SqliteStore;
use idemwatch::engine::store::{self, Durability, StoreError};
use idemwatch_testkit::on_every_backend;
use sqlx::Connection;

on_every_backend!(
    durable_is_the_default_and_keeps_the_servers_settings,
    relaxed_is_what_every_pooled_connection_runs,
);

/// Nothing listens on port 1: a refusal that reached the server would fail
/// differently (exit 3, a connection error).
const UNREACHABLE_MYSQL: &str = "mysql://root:hunter2@127.0.0.1:1/fleet";

/// What `$sql` (one setting) answers on each of 3 connections of `$pool` held at
/// once, so they are distinct sessions. A macro: the same loop over two sqlx
/// database types.
macro_rules! per_connection {
    ($pool:expr, $sql:literal) => {{
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push($pool.acquire().await.expect("connection"));
        }
        let mut values = Vec::new();
        for c in &mut held {
            values.push(
                sqlx::query_scalar($sql)
                    .fetch_one(&mut **c)
                    .await
                    .expect($sql),
            );
        }
        values
    }};
}

async fn durable_is_the_default_and_keeps_the_servers_settings(db: &TestDb) {
    let opened = store::open(&db.url).await.expect("open");
    assert_eq!(opened.durability(), Durability::Durable);
    match db.kind {
        // 2 = FULL: the WAL is fsynced at every commit.
        Kind::Sqlite => {
            let s = SqliteStore::open(&db.url, Durability::Durable)
                .await
                .unwrap();
            let synchronous: Vec<i64> = per_connection!(s.pool(), "PRAGMA synchronous");
            assert_eq!(synchronous, vec![2; 3]);
        }
        // Durable leaves the server's own setting alone: what a plain session sees.
        Kind::Postgres => {
            let mut plain = sqlx::PgConnection::connect(&db.url).await.unwrap();
            let server: String = sqlx::query_scalar("SHOW synchronous_commit")
                .fetch_one(&mut plain)
                .await
                .unwrap();
            let s = PostgresStore::open(&db.url, Durability::Durable)
                .await
                .unwrap();
            let commit: Vec<String> = per_connection!(s.pool(), "SHOW synchronous_commit");
            assert_eq!(commit, vec![server; 3]);
        }
        Kind::Mysql => {}
    }
}

async fn relaxed_is_what_every_pooled_connection_runs(db: &TestDb) {
    match db.kind {
        // 1 = NORMAL: fsync at checkpoints only.
        Kind::Sqlite => {
            let s = SqliteStore::open(&db.url, Durability::Relaxed)
                .await
                .unwrap();
            let synchronous: Vec<i64> = per_connection!(s.pool(), "PRAGMA synchronous");
            assert_eq!(synchronous, vec![1; 3]);
            let opened = store::open_with_edge_durability(&db.url, Durability::Relaxed)
                .await
                .unwrap();
            assert_eq!(opened.store.durability(), Durability::Relaxed);
        }
        Kind::Postgres => {
            let s = PostgresStore::open(&db.url, Durability::Relaxed)
                .await
                .unwrap();
            let commit: Vec<String> = per_connection!(s.pool(), "SHOW synchronous_commit");
            assert_eq!(commit, vec!["off"; 3]);
        }
        // Refused even with a reachable server: nothing was changed on it.
        Kind::Mysql => {
            let refused = store::open_with_edge_durability(&db.url, Durability::Relaxed).await;
            assert!(
                matches!(&refused, Err(StoreError::DurabilityUnsupported(m)) if m.contains("innodb_flush_log_at_trx_commit")),
                "{:?}",
                refused.err()
            );
        }
    }
}

#[test]
fn relaxed_on_mysql_is_bad_usage_on_every_command_that_takes_it() {
    let env = TempEnv::new();
    for command in [
        &["consume", "--until-idle"][..],
        &["serve", "--listen", "127.0.0.1:0"],
        &["bench", "engine", "--runs", "1"],
    ] {
        let args = [
            command,
            &["--db", UNREACHABLE_MYSQL, "--durability", "relaxed"],
        ]
        .concat();
        let (code, _out, err) = run_cli(&env, &args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains("innodb_flush_log_at_trx_commit"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
    }
}

#[test]
fn consume_runs_relaxed_on_sqlite() {
    let env = TempEnv::new();
    let (code, out, err) = run_cli(
        &env,
        &[
            "consume",
            "--until-idle",
            "--durability",
            "relaxed",
            "--json",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let summary: serde_json::Value = serde_json::from_str(&out).expect("one JSON document");
    assert_eq!(summary["processed"], 0, "{summary}");
}
