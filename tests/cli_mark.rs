//! `idemwatch mark deploy|incident|note`: the CD pipeline's marker, on every backend,
//! read back by `snapshot`; its exit codes; and the one grant it needs.

mod common;

use std::process::Command;

use common::backends::{Kind, TestDb};
use common::idemwatch_bin;
use idemwatch::engine::store;
use sqlx::Connection;

/// Run idemwatch without the environment's database and with an empty config home.
fn idemwatch(db: &TestDb, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(idemwatch_bin())
        .args(args)
        .env("XDG_CONFIG_HOME", db.env.path("config"))
        .env("IDEMWATCH_LOG_FILE", db.env.path("idemwatch.log"))
        .env_remove("IDEMWATCH_DB")
        .output()
        .expect("run idemwatch");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn snapshot_markers(db: &TestDb, url: &str) -> Vec<serde_json::Value> {
    let (code, out, err) = idemwatch(
        db,
        &[
            "snapshot",
            "--json",
            "--db",
            url,
            "--spacing",
            "50ms",
            "--target",
            "edge=http://127.0.0.1:1/metrics",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("one JSON document");
    doc["markers"].as_array().cloned().unwrap_or_default()
}

async fn deploy_incident_and_note_reach_the_snapshot(kind: Kind) {
    let Some(db) = TestDb::new(kind).await else {
        return;
    };
    drop(store::open(&db.url).await.expect("schema"));
    let (code, out, err) = idemwatch(
        &db,
        &[
            "mark",
            "deploy",
            "--label",
            "v2.4.1 by pipeline #812",
            "--db",
            &db.url,
            "--json",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let written: serde_json::Value = serde_json::from_str(&out).expect("only JSON on stdout");
    assert_eq!(written["kind"], "deploy");
    assert_eq!(written["label"], "v2.4.1 by pipeline #812");
    for (kind, label, at) in [
        ("incident", "SMS provider paging", "2026-11-30T04:12:00Z"),
        ("note", "the 04:12 window", "2026-11-30T04:13:00Z"),
    ] {
        let args = ["mark", kind, "--label", label, "--at", at, "--db", &db.url];
        let (code, _, err) = idemwatch(&db, &args);
        assert_eq!(code, 0, "{kind}: {err}");
    }
    let markers = snapshot_markers(&db, &db.url);
    let find = |label: &str| {
        markers
            .iter()
            .find(|m| m["label"] == label)
            .unwrap_or_else(|| panic!("{label} not in {markers:?}"))
            .clone()
    };
    let deploy = find("v2.4.1 by pipeline #812");
    assert_eq!(deploy["kind"], "deploy");
    assert_eq!(deploy["source"], "database");
    let incident = find("SMS provider paging");
    assert_eq!(incident["kind"], "incident");
    assert_eq!(incident["at"], "2026-11-30T04:12:00Z");
    assert_eq!(find("the 04:12 window")["kind"], "note");
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mark_reaches_the_snapshot_on_sqlite() {
    deploy_incident_and_note_reach_the_snapshot(Kind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mark_reaches_the_snapshot_on_postgres() {
    deploy_incident_and_note_reach_the_snapshot(Kind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mark_reaches_the_snapshot_on_mysql() {
    deploy_incident_and_note_reach_the_snapshot(Kind::Mysql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_time_or_label_is_usage_and_an_absent_database_is_unavailable() {
    let db = TestDb::new(Kind::Sqlite).await.unwrap();
    drop(store::open(&db.url).await.expect("schema"));
    for args in [
        ["mark", "deploy", "--label", "v2", "--at", "yesterday-ish"],
        ["mark", "deploy", "--label", "   ", "--at", "now"],
        ["mark", "deploy", "--label", "v2\u{1b}[2J", "--at", "now"],
        ["mark", "release", "--label", "v2", "--at", "now"],
    ] {
        let (code, out, _) = idemwatch(&db, &[&args[..], &["--db", &db.url]].concat());
        assert_eq!(code, 2, "{args:?}");
        assert!(out.is_empty(), "{args:?}: {out}");
    }
    assert!(snapshot_markers(&db, &db.url).is_empty());
    // A SQLite file that does not exist is not created: the pipeline named a wrong one.
    let missing = format!("sqlite://{}", db.env.path("nowhere/idemwatch.db").display());
    let (code, _, err) = idemwatch(&db, &["mark", "deploy", "--label", "v2", "--db", &missing]);
    assert_eq!(code, 3, "{err}");
    // A server that does not listen.
    let (code, _, err) = idemwatch(
        &db,
        &[
            "mark",
            "note",
            "--label",
            "v2",
            "--db",
            "postgres://deployer:s3cret@127.0.0.1:1/fleet",
        ],
    );
    assert_eq!(code, 3, "{err}");
    assert!(
        !err.contains("s3cret"),
        "the password is never printed: {err}"
    );
}

/// The README's grant for a pipeline: INSERT on `markers` (and USAGE on its id
/// sequence, which an INSERT into a serial column needs). Nothing else: the role
/// cannot read the table it writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_only_postgres_role_can_mark() {
    let Some(db) = TestDb::new(Kind::Postgres).await else {
        return;
    };
    drop(store::open(&db.url).await.expect("schema"));
    let (role, cd_url) = db
        .pg_role(
            "cd",
            &[
                "GRANT INSERT ON markers",
                "GRANT USAGE ON SEQUENCE markers_id_seq",
            ],
        )
        .await;
    let (code, out, err) = idemwatch(
        &db,
        &["mark", "deploy", "--label", "v3", "--db", &cd_url, "--json"],
    );
    assert_eq!(code, 0, "{err}");
    let written: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        written["id"],
        serde_json::Value::Null,
        "nothing is read back"
    );
    let mut cd = sqlx::PgConnection::connect(&cd_url).await.unwrap();
    assert!(
        sqlx::query("SELECT label FROM markers")
            .fetch_all(&mut cd)
            .await
            .is_err(),
        "the pipeline's role cannot read"
    );
    cd.close().await.unwrap();
    let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let labels: Vec<String> = sqlx::query_scalar("SELECT label FROM markers")
        .fetch_all(&mut admin)
        .await
        .unwrap();
    assert_eq!(labels, vec!["v3".to_string()]);
    admin.close().await.unwrap();
    db.cleanup().await;
    common::backends::drop_pg_role(&role).await;
}
