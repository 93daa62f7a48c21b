//! A frozen instance (issue 39, item 4): `serve` stopped with SIGSTOP past its claims'
//! lease and its queue lease while its calls to a slow provider are in flight, beside
//! a second `serve` on the same store and queue; then SIGCONT.
//!
//! The second instance takes the work over; the provider is called again only for
//! the calls physically in flight when the first froze (the second instance's
//! `idem_provider_repeat_calls_total` counts exactly those); the woken instance sends
//! none of the calls it had not started (its claims are another's now), records none
//! of its answers over the new owner's, and goes on handling new messages.
//!
//! On the embedded queue the frozen instance's messages come back when their
//! visibility timeout runs out; on RabbitMQ (the field report's stack, with
//! PostgreSQL) when the broker misses two heartbeats of the frozen connection, closes
//! it and redelivers what it held unacked — and the woken instance finds its channel
//! gone, so its acks are refused and it dials again.

mod common;

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::backends::{Kind, TestDb};
use common::{idemwatch_bin, wait_for, KillOnDrop};
use idemwatch::engine::consumers::zone_exit_sms;
use idemwatch::engine::envelope::{Envelope, MessageKey};
use idemwatch::engine::store::{self, ClaimState, Store};
use idemwatch::engine::{Engine, EngineConfig};
use idemwatch::sim::sandbox_provider::{self, SandboxHandle};

const SMS: &str = zone_exit_sms::NAME;
/// The claims' lease and the queue's visibility timeout of both instances.
const LEASE_MS: u64 = 1500;

fn zone_exit_line(device: &str) -> Vec<u8> {
    format!(
        r#"{{"device_id":"{device}","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X","phone":"+905551112233"}}}}"#
    )
    .into_bytes()
}

fn key_of(body: &[u8]) -> MessageKey {
    Envelope::parse(body).unwrap().key()
}

/// `serve --consumer zone-exit-sms` on `db` and `queue`, its calls to `sandbox` 4 at
/// a time; on RabbitMQ with a 1 s heartbeat, so the broker finds a frozen link in ~2 s.
fn serve(db: &TestDb, queue: &str, sandbox: &SandboxHandle, port: u16, log: &str) -> KillOnDrop {
    let lease = LEASE_MS.to_string();
    let heartbeat: &[&str] = if queue.starts_with("amqp") {
        &["--heartbeat", "1s"]
    } else {
        &[]
    };
    KillOnDrop(
        Command::new(idemwatch_bin())
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--db", &db.url, "--queue", queue])
            .args(heartbeat)
            .args(["--sms-url", &sandbox.url(), "--consumer", SMS])
            .args(["--claim-lease-ms", &lease, "--visibility-ms", &lease])
            .args(["--retry-ms", "100", "--batch", "16", "--no-pipeline"])
            .args(["--provider-concurrency", "4"])
            .env("IDEMWATCH_LOG_FILE", db.env.path(log))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start serve"),
    )
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig}");
}

/// `idem_provider_repeat_calls_total` of zone-exit-sms on `port`, by reason.
async fn repeat_calls(port: u16) -> BTreeMap<String, f64> {
    let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with("idem_provider_repeat_calls_total{"))
        .filter(|l| l.contains(&format!("consumer=\"{SMS}\"")))
        .filter_map(|l| {
            let reason = l.split("reason=\"").nth(1)?.split('"').next()?;
            let value = l.rsplit(' ').next()?.parse().ok()?;
            Some((reason.to_string(), value))
        })
        .collect()
}

/// Calls the provider received, per Idempotency-Key.
fn calls_per_key(sandbox: &SandboxHandle) -> BTreeMap<String, usize> {
    let mut calls = BTreeMap::new();
    for r in sandbox.state().sms_requests() {
        *calls
            .entry(r.idempotency_key.unwrap_or_default())
            .or_default() += 1;
    }
    calls
}

async fn all_sent(store: &dyn Store, bodies: &[Vec<u8>]) -> bool {
    for b in bodies {
        match store.claim(SMS, &key_of(b)).await {
            Ok(Some(c)) if c.state == ClaimState::Sent => {}
            _ => return false,
        }
    }
    true
}

async fn wait_sent(store: &dyn Store, bodies: &[Vec<u8>], what: &str) {
    for _ in 0..600 {
        if all_sent(store, bodies).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what}: not every claim sent within 60 s");
}

/// Which queue the two instances share.
enum Queue {
    Embedded,
    RabbitMq,
}

async fn a_frozen_instance_repeats_only_its_calls_in_flight(kind: Kind, queue: Queue) {
    let Some(db) = TestDb::new(kind).await else {
        return;
    };
    let queue_url = match queue {
        Queue::Embedded => db.queue_url(),
        Queue::RabbitMq => {
            let Some(url) = common::amqp::amqp_url().await else {
                return;
            };
            format!("{url}?prefix={}", common::amqp::namespace("frozen"))
        }
    };
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    sandbox.state().set_latency(Duration::from_secs(3));
    let mut cfg = EngineConfig::new(&db.url, &queue_url, &sandbox.url(), &sandbox.url());
    cfg.consumers = vec![SMS.into()];
    let publisher = Engine::open(&cfg).await.unwrap();
    let store: Arc<dyn Store> = store::open(&db.url).await.unwrap();
    let (port_a, port_b) = (common::services::free_port(), common::services::free_port());

    let mut a = serve(&db, &queue_url, &sandbox, port_a, "a.log");
    let bodies: Vec<Vec<u8>> = (0..8)
        .map(|i| zone_exit_line(&format!("FROZEN-{i}")))
        .collect();
    publisher.publish(&bodies).await.unwrap();
    let state = sandbox.state().clone();
    wait_for("4 calls of A in flight", Duration::from_secs(60), || {
        state.peak_in_flight() >= 4
    })
    .await;
    signal(&a.0, "-STOP");
    let frozen_at = std::time::Instant::now();
    // The keys whose calls were in flight when A froze: the sandbox logs a request when
    // it answers, 3 s later, so read the claims A's calls went out under later, from
    // the calls B repeats.
    let mut b = serve(&db, &queue_url, &sandbox, port_b, "b.log");
    wait_sent(store.as_ref(), &bodies, "B takes A's work over").await;
    assert!(
        frozen_at.elapsed() > Duration::from_millis(2 * LEASE_MS),
        "frozen past the lease and the queue's visibility"
    );
    signal(&a.0, "-CONT");

    // A wakes: its 4 answers come in, find the claims B's, and are not recorded over
    // them; its 4 calls not started are not made.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let calls = calls_per_key(&sandbox);
    assert_eq!(calls.len(), 8, "{calls:?}");
    let repeated: Vec<&String> = calls
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        repeated.len(),
        4,
        "only the calls in flight when A froze are repeated: {calls:?}"
    );
    assert!(calls.values().all(|n| *n <= 2), "{calls:?}");
    assert_eq!(sandbox.state().sent_sms().len(), 8, "one SMS per zone exit");
    let b_repeats = repeat_calls(port_b).await;
    assert_eq!(
        b_repeats.values().sum::<f64>(),
        4.0,
        "B counts the repeats it made: {b_repeats:?}"
    );
    assert_eq!(
        repeat_calls(port_a).await.values().sum::<f64>(),
        0.0,
        "A repeated nothing"
    );
    // And the dashboard's snapshot shows them, by reason.
    let snapshot = Command::new(idemwatch_bin())
        .args(["snapshot", "--json", "--spacing", "50ms", "--db", &db.url])
        .args(["--target", &format!("b=http://127.0.0.1:{port_b}/metrics")])
        .env("IDEMWATCH_LOG_FILE", db.env.path("snapshot.log"))
        .output()
        .unwrap();
    let snapshot: serde_json::Value = serde_json::from_slice(&snapshot.stdout).unwrap();
    let sms = snapshot["consumers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["consumer"] == SMS))
        .unwrap_or_else(|| panic!("{snapshot:#}"));
    let shown: f64 = sms["provider_repeat_calls"]
        .as_object()
        .map(|by_reason| by_reason.values().filter_map(|v| v.as_f64()).sum())
        .unwrap_or_default();
    assert_eq!(shown, 4.0, "{sms:#}");
    // Every claim ends sent. One whose call was in flight when A froze is B's by a
    // takeover (its second attempt). One that A claimed and had not called yet is
    // taken over too; on RabbitMQ a delivery that had not reached A's batch when it
    // froze goes to B with the rest of A's unacked ones when the broker closes A's
    // link, and B's claim is its first (seen once in a clean-clone CI run: the 8
    // zone exits reached A's runner in two batches).
    for body in &bodies {
        let claim = store.claim(SMS, &key_of(body)).await.unwrap().unwrap();
        assert_eq!(claim.state, ClaimState::Sent, "{claim:?}");
        let in_flight = repeated.contains(&&claim.provider_key);
        let attempts_ok = match (in_flight, &queue) {
            (true, _) | (false, Queue::Embedded) => claim.attempts == 2,
            (false, Queue::RabbitMq) => (1..=2).contains(&claim.attempts),
        };
        assert!(attempts_ok, "{claim:?}");
    }
    assert!(store.dead_letters(10).await.unwrap().is_empty());

    // A rejoined: with B gone, new zone exits are A's, sent once each.
    b.stop();
    sandbox.state().set_latency(Duration::ZERO);
    let later: Vec<Vec<u8>> = (0..3)
        .map(|i| zone_exit_line(&format!("AFTER-{i}")))
        .collect();
    publisher.publish(&later).await.unwrap();
    wait_sent(store.as_ref(), &later, "A handles new messages").await;
    let calls = calls_per_key(&sandbox);
    assert_eq!(calls.len(), 11);
    assert_eq!(calls.values().filter(|n| **n > 1).count(), 4, "{calls:?}");
    a.stop();
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_instance_on_sqlite_repeats_only_its_calls_in_flight() {
    a_frozen_instance_repeats_only_its_calls_in_flight(Kind::Sqlite, Queue::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_instance_on_postgres_repeats_only_its_calls_in_flight() {
    a_frozen_instance_repeats_only_its_calls_in_flight(Kind::Postgres, Queue::Embedded).await;
}

/// The issue's own run: RabbitMQ + PostgreSQL, the instance frozen past the broker's
/// heartbeat and the claims' lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_instance_on_rabbitmq_and_postgres_repeats_only_its_calls_in_flight() {
    a_frozen_instance_repeats_only_its_calls_in_flight(Kind::Postgres, Queue::RabbitMq).await;
}
