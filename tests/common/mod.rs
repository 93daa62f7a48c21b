//! Shared test plumbing of the end-to-end tests: the binary, its commands, the
//! engine-level helpers. The scratch directory and the test databases every crate's
//! tests use live in `idemwatch-testkit`, re-exported here under their old names.
#![allow(dead_code)]

use std::path::PathBuf;

pub use idemwatch_testkit::{backends, TempEnv};

/// The idemwatch binary built for this test run.
pub fn idemwatch_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_idemwatch"))
}

/// Run the binary with args; returns (exit code, stdout, stderr).
pub fn run_cli(env: &TempEnv, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(idemwatch_bin())
        .args(args)
        .env("IDEMWATCH_LOG_FILE", env.path("idemwatch.log"))
        .env("IDEMWATCH_DB", env.db_url())
        .env("IDEMWATCH_QUEUE", env.queue_url())
        .output()
        .expect("run idemwatch");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
/// `bench engine --json` of 300 messages (10 % redeliveries), batch 10, one pair, on
/// the env's SQLite database and `queue`; the report, once the command succeeded.
pub fn bench_engine_on_queue(env: &TempEnv, queue: &str) -> serde_json::Value {
    let db = env.db_url();
    let args = [
        "bench",
        "engine",
        "--db",
        &db,
        "--json",
        "--queue",
        queue,
        "--messages",
        "300",
        "--dup-rate",
        "0.1",
        "--batch",
        "10",
        "--runs",
        "1",
    ];
    let (code, out, err) = run_cli(env, &args);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// What one consumer counted between two summaries (`after` − `before`, field by
/// field), compared whole so that a count nobody expected to move shows up too.
pub fn counted_since(
    before: &idemwatch::engine::metrics::ConsumerCounts,
    after: &idemwatch::engine::metrics::ConsumerCounts,
) -> idemwatch::engine::metrics::ConsumerCounts {
    idemwatch::engine::metrics::ConsumerCounts {
        processed: after.processed - before.processed,
        duplicate_dropped: after.duplicate_dropped - before.duplicate_dropped,
        out_of_order: after.out_of_order - before.out_of_order,
        dead_lettered: after.dead_lettered - before.dead_lettered,
        redelivered: after.redelivered - before.redelivered,
        side_effects_sent: after.side_effects_sent - before.side_effects_sent,
        side_effects_suppressed: after.side_effects_suppressed - before.side_effects_suppressed,
        side_effects_failed: after.side_effects_failed - before.side_effects_failed,
        provider_repeat_calls: after.provider_repeat_calls - before.provider_repeat_calls,
    }
}

pub mod amqp;
pub mod flaky_store;
pub mod mqtt;
pub mod services;
pub mod tmux;

/// A `zone_exit` of `device` with sequence number `seq` (zone X, one phone number).
pub fn zone_exit(device: &str, seq: u64) -> idemwatch::engine::envelope::Envelope {
    idemwatch::engine::envelope::Envelope::parse(
        format!(
            r#"{{"device_id":"{device}","seq":{seq},"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X","phone":"+905551112233"}}}}"#
        )
        .as_bytes(),
    )
    .expect("a valid zone_exit")
}
pub mod jepsen;
pub mod outage;
pub mod proxy;

/// A child process killed (and reaped) when the test ends, pass or fail.
pub struct KillOnDrop(pub std::process::Child);

impl KillOnDrop {
    pub fn stop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `idemwatch serve` on 127.0.0.1:`port`, with the env's database and queue, its log
/// in the env: the exporter the dashboard and Prometheus scrape.
pub fn serve(env: &TempEnv, port: u16) -> KillOnDrop {
    KillOnDrop(
        std::process::Command::new(idemwatch_bin())
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--db", &env.db_url(), "--queue", &env.queue_url()])
            .env("IDEMWATCH_LOG_FILE", env.path("serve.log"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start serve"),
    )
}

/// The short chaos run both broker suites make: 3 `serve` processes, a SIGKILL every
/// 600 deliveries taken off the queues, 2,000 messages with ~10 % duplicates and late
/// events, seed 2026. Returns the exit code and the JSON report.
pub fn chaos_short(
    env: &TempEnv,
    queue: &str,
    db: &str,
    timeout: &str,
) -> (i32, serde_json::Value) {
    let (code, stdout, stderr) = run_cli(
        env,
        &[
            "chaos",
            "--instances",
            "3",
            "--events",
            "2000",
            "--dup-rate",
            "0.1",
            "--kill-every-messages",
            "600",
            "--seed",
            "2026",
            "--timeout",
            timeout,
            "--queue",
            queue,
            "--db",
            db,
            "--json",
        ],
    );
    let report = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("chaos printed no JSON report ({e}): {stdout}\n{stderr}"));
    (code, report)
}

/// Wait (at most `limit`) for `done`, checking every 20 ms.
pub async fn wait_for(what: &str, limit: std::time::Duration, mut done: impl FnMut() -> bool) {
    tokio::time::timeout(limit, async {
        while !done() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: not within {limit:?}"));
}

/// The end of a store-outage test: stop the worker, then `n` zone exits of the devices
/// `{prefix}0…` each counted once, none dropped as a duplicate, none dead-lettered.
pub async fn stop_and_assert_each_once(
    engine: &idemwatch::engine::Engine,
    consumer: &str,
    stop: tokio::sync::watch::Sender<bool>,
    running: tokio::task::JoinHandle<Result<(), idemwatch::engine::crash::Crashed>>,
    prefix: &str,
    n: u64,
) {
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(60), running)
        .await
        .expect("the worker stops")
        .unwrap()
        .unwrap();
    let c = &engine.summary().consumers[consumer];
    assert_eq!(
        (c.processed, c.duplicate_dropped, c.dead_lettered),
        (n, 0, 0),
        "{c:?}"
    );
    assert!(engine.store.dead_letters(10).await.unwrap().is_empty());
    for i in 0..n {
        let device = format!("{prefix}{i}");
        assert_eq!(
            engine.store.zone_exits(&device).await.unwrap(),
            1,
            "{device}"
        );
    }
}
