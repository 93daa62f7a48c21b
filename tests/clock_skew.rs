//! A clock that jumps (issue 39, item 6): one `serve` whose clock is 10 minutes ahead
//! or behind (`faketime`) beside a live owner on the same PostgreSQL or MariaDB
//! database. Leases and retention are decided on the database's clock, so:
//!
//! - an instance running ahead takes over no claim its owner still holds (it renews
//!   it), neither through a redelivery nor through its claim sweeper;
//! - an owner running behind writes no claim that looks expired to everyone else: its
//!   slow call is not repeated by another instance's sweeper;
//! - `purge --older-than 1h` on a host running ahead keeps a row 55 minutes old.
//!
//! SQLite has no clock of its own: there every process on the file reads its host's
//! (ARCHITECTURE.md, "Clocks"), so it is not run here; for the same reason the
//! embedded queue the instances share decides visibility on its writer's clock, so
//! the message of the instance behind is published on its clock.

mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::backends::{Kind, TestDb};
use common::{idemwatch_bin, wait_for, KillOnDrop};
use idemwatch::engine::consumers::zone_exit_sms;
use idemwatch::engine::envelope::{Envelope, MessageKey};
use idemwatch::engine::store::{self, ClaimOutcome, ClaimRequest, ClaimState, Store};
use idemwatch::engine::{Engine, EngineConfig};
use idemwatch::sim::sandbox_provider::{self, SandboxHandle};

const SMS: &str = zone_exit_sms::NAME;
/// The claims' lease of every instance here: far shorter than the 10-minute jump.
const LEASE_MS: u64 = 4000;

fn zone_exit_line(device: &str) -> Vec<u8> {
    format!(
        r#"{{"device_id":"{device}","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X","phone":"+905551112233"}}}}"#
    )
    .into_bytes()
}

fn key_of(body: &[u8]) -> MessageKey {
    Envelope::parse(body).unwrap().key()
}

/// libfaketime, as Debian's `faketime` package installs it: loaded into idemwatch
/// itself (`LD_PRELOAD`), so the process a test starts and stops is idemwatch's own.
fn libfaketime() -> Option<std::path::PathBuf> {
    let found = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
    ]
    .into_iter()
    .map(std::path::PathBuf::from)
    .find(|p| p.is_file());
    if found.is_none() {
        assert!(
            !common::backends::required(),
            "libfaketime is required (IDEMWATCH_REQUIRE_SERVICES=1; .ci/run installs faketime)"
        );
        eprintln!("SKIP: libfaketime is not installed");
    }
    found
}

/// `idemwatch ARGS` with its clock `offset` (`+10m`, `-10m`) off.
fn skewed(lib: &std::path::Path, offset: &str, db: &TestDb, args: &[&str], log: &str) -> Command {
    let mut cmd = Command::new(idemwatch_bin());
    cmd.args(args)
        .env("LD_PRELOAD", lib)
        .env("FAKETIME", offset)
        // The wall clock jumps; the monotonic clock (durations, timers) does not, as
        // with a real jump (and a monotonic clock minus 10 minutes may be negative).
        .env("DONT_FAKE_MONOTONIC", "1")
        .env("IDEMWATCH_LOG_FILE", db.env.path(log))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cmd
}

/// `serve --consumer zone-exit-sms` with its clock `offset` off.
fn skewed_serve(
    lib: &std::path::Path,
    offset: &str,
    db: &TestDb,
    sandbox: &SandboxHandle,
    log: &str,
) -> KillOnDrop {
    let port = common::services::free_port().to_string();
    let lease = LEASE_MS.to_string();
    let args = [
        "serve",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--db",
        &db.url,
        "--queue",
        &db.queue_url(),
        "--sms-url",
        &sandbox.url(),
        "--consumer",
        SMS,
        "--claim-lease-ms",
        &lease,
        "--visibility-ms",
        "1000",
        "--retry-ms",
        "100",
    ];
    KillOnDrop(
        skewed(lib, offset, db, &args, log)
            .spawn()
            .expect("start serve under libfaketime"),
    )
}

async fn claim(store: &dyn Store, body: &[u8]) -> store::Claim {
    store
        .claim(SMS, &key_of(body))
        .await
        .unwrap()
        .expect("a claim")
}

async fn no_takeover_of_a_live_claim_and_no_early_purge(kind: Kind) {
    let Some(lib) = libfaketime() else {
        return;
    };
    let Some(db) = TestDb::new(kind).await else {
        return;
    };
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let lease = Duration::from_millis(LEASE_MS);
    let mut cfg = EngineConfig::new(&db.url, &db.queue_url(), &sandbox.url(), &sandbox.url());
    cfg.consumers = vec![SMS.into()];
    cfg.claim_lease = lease;
    let here = Engine::open(&cfg).await.unwrap();
    let store: Arc<dyn Store> = here.store.clone();

    // 1. Ahead: this test owns a claim and keeps it (renewing, as a live owner whose
    //    call is slow); an instance 10 minutes ahead gets its message redelivered and
    //    runs its sweeper for more than a lease.
    let ahead = zone_exit_line("SKEW-AHEAD");
    let env = Envelope::parse(&ahead).unwrap();
    let request = ClaimRequest {
        key: env.key(),
        fingerprint: env.fingerprint(),
        provider_key: "pk-skew-ahead".into(),
        message: ahead.clone(),
    };
    let mine = store.claim_batch(SMS, &[request], lease).await.unwrap();
    assert!(matches!(&mine[..], [ClaimOutcome::Fresh(_)]), "{mine:?}");
    here.publish(std::slice::from_ref(&ahead)).await.unwrap();
    let mut instance = skewed_serve(&lib, "+10m", &db, &sandbox, "ahead.log");
    for _ in 0..8 {
        tokio::time::sleep(lease / 4).await;
        let held = store
            .renew_claims(SMS, &[(key_of(&ahead), 1)])
            .await
            .unwrap();
        assert_eq!(held.len(), 1, "the live owner still holds its claim");
    }
    instance.stop();
    assert!(
        sandbox.state().sms_requests().is_empty(),
        "a live claim taken over by the instance ahead"
    );
    let c = claim(store.as_ref(), &ahead).await;
    assert_eq!((c.state, c.attempts), (ClaimState::Claimed, 1), "{c:?}");
    // The live owner's call ends: it records it, as its owner.
    let done = store::ClaimResult::owned(
        key_of(&ahead),
        store::ClaimFinish::Done {
            state: ClaimState::Sent,
            detail: "sent (200)".into(),
        },
        1,
    );
    assert!(store.finish_batch(SMS, &[done]).await.unwrap().is_empty());

    // 2. Behind: an instance 10 minutes behind owns a claim whose call takes 6 s
    //    (longer than the lease: it renews it); this test's sweeper, on time, must not
    //    find it expired.
    sandbox.state().set_latency(Duration::from_secs(6));
    let behind = zone_exit_line("SKEW-BEHIND");
    // Published by a process on the owner's clock: the embedded queue (SQLite, one
    // host) decides visibility on its writer's clock, as it has no other.
    let file = db.env.path("behind.jsonl");
    std::fs::write(&file, [behind.clone(), b"\n".to_vec()].concat()).unwrap();
    let file = file.display().to_string();
    let published = skewed(
        &lib,
        "-10m",
        &db,
        &[
            "publish",
            "--db",
            &db.url,
            "--queue",
            &db.queue_url(),
            "--consumer",
            SMS,
            &file,
        ],
        "publish.log",
    )
    .status()
    .unwrap();
    assert!(published.success());
    let mut owner = skewed_serve(&lib, "-10m", &db, &sandbox, "behind.log");
    let state = sandbox.state().clone();
    wait_for(
        "the call of the instance behind",
        Duration::from_secs(60),
        || state.peak_in_flight() >= 1,
    )
    .await;
    for _ in 0..6 {
        here.sweep_claims().await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut sent = false;
    for _ in 0..200 {
        let c = store.claim(SMS, &key_of(&behind)).await.unwrap();
        if c.is_some_and(|c| c.state == ClaimState::Sent) {
            sent = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    owner.stop();
    assert!(sent, "the owner behind records its call");
    let requests: Vec<_> = sandbox
        .state()
        .sms_requests()
        .into_iter()
        .filter(|r| r.text.as_deref().is_some_and(|t| t.contains("SKEW-BEHIND")))
        .collect();
    assert_eq!(
        requests.len(),
        1,
        "the slow call was not repeated: {requests:?}"
    );
    let c = claim(store.as_ref(), &behind).await;
    assert_eq!(c.attempts, 1, "{c:?}");

    // 3. Retention: a row 55 minutes old (by the database) outlives `purge
    //    --older-than 1h` run on a host 10 minutes ahead.
    let aged = match kind {
        Kind::Postgres => "now() - interval '55 minutes'",
        _ => "UTC_TIMESTAMP(6) - INTERVAL 55 MINUTE",
    };
    db.exec(&format!(
        "INSERT INTO processed_messages (consumer, message_key, payload_hash, processed_at)
         VALUES ('trip-counter', 'SKEW-AGED:1:zone_exit', 'h', {aged})"
    ))
    .await;
    let purged = skewed(
        &lib,
        "+10m",
        &db,
        &["purge", "--older-than", "1h", "--db", &db.url, "--json"],
        "purge.log",
    )
    .status()
    .unwrap();
    assert!(purged.success());
    let kept = store
        .processed_keys("trip-counter", "SKEW-AGED")
        .await
        .unwrap();
    assert_eq!(
        kept.len(),
        1,
        "purged within its retention by a clock ahead"
    );
    drop(here);
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_skewed_clock_on_postgres_takes_over_no_live_claim_and_purges_nothing_early() {
    no_takeover_of_a_live_claim_and_no_early_purge(Kind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_skewed_clock_on_mariadb_takes_over_no_live_claim_and_purges_nothing_early() {
    no_takeover_of_a_live_claim_and_no_early_purge(Kind::Mysql).await;
}
