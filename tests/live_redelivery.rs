//! `drill live-redelivery` against a running `idemwatch serve`, as an operator runs
//! it: pass against the idempotent service under a steady live load (its own traffic
//! moves every counter; the verdict reads only the drill's keys), refuse to
//! re-publish a message whose dedup row was purged, and fail — naming the duplicated
//! side effects — against the same service started in naive mode. On the embedded
//! queue and SQLite, and on RabbitMQ and PostgreSQL when they are reachable.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::amqp::amqp_url;
use common::backends::{Kind, TestDb};
use common::{idemwatch_bin, run_cli, KillOnDrop, TempEnv};
use idemwatch::engine::consumers::FLEET_CONSUMERS;
use idemwatch::engine::queue::Queue;
use idemwatch::sim::fleet::{FleetConfig, FleetSim};
use idemwatch::sim::sandbox_provider;

/// Start `serve` on a free port; returns the process and its metrics URL.
fn serve(env: &TempEnv, db: &str, queue: &str, sms: &str, mode: &str) -> (KillOnDrop, String) {
    let mut child = Command::new(idemwatch_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--db",
            db,
            "--queue",
            queue,
        ])
        .args(["--sms-url", sms, "--mode", mode])
        .env("IDEMWATCH_LOG_FILE", env.path("serve.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start serve");
    let stderr = child.stderr.take().expect("stderr");
    let guard = KillOnDrop(child);
    let mut line = String::new();
    BufReader::new(stderr)
        .read_line(&mut line)
        .expect("serve banner");
    let url = line
        .split_whitespace()
        .map(|w| w.trim_end_matches([';', ',']))
        .find(|w| w.starts_with("http://") && w.ends_with("/metrics"))
        .unwrap_or_else(|| panic!("no metrics URL in {line:?}"))
        .to_string();
    (guard, url)
}

/// Wait until the service has handled everything published so far.
async fn drained(queue_url: &str) {
    let q = idemwatch::engine::queue::open(queue_url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut empty_in_a_row = 0;
    while empty_in_a_row < 3 {
        assert!(
            Instant::now() < deadline,
            "the service never drained its queues"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut empty = true;
        for c in FLEET_CONSUMERS {
            empty &= q
                .depth(c)
                .await
                .is_ok_and(|d| d.ready == 0 && d.in_flight == 0);
        }
        empty_in_a_row = if empty { empty_in_a_row + 1 } else { 0 };
    }
    q.close().await;
}

/// A steady live load: fleet traffic of devices of its own, a few messages every
/// 50 ms to every consumer's queue, until `stop`. Returns how many it published.
fn live_load(queue_url: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let q = idemwatch::engine::queue::open(&queue_url).await.unwrap();
        let queues: Vec<String> = FLEET_CONSUMERS.iter().map(|c| c.to_string()).collect();
        let trace = FleetSim::new(FleetConfig {
            vehicles: 4,
            seed: 11,
            device_prefix: format!("LOAD-{:04x}-", rand::random::<u16>()),
            ..FleetConfig::default()
        })
        .take_n(6000);
        let mut published = 0;
        for chunk in trace.chunks(2) {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let bodies: Vec<Vec<u8>> = chunk.iter().map(|m| m.raw.clone()).collect();
            q.publish(&queues, &bodies).await.unwrap();
            published += bodies.len();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        q.close().await;
        published
    })
}

/// Forget one dedup row behind the engine's back, as an over-eager retention would.
async fn purge_dedup_row(db: &str, consumer: &str, key: &str) {
    use sqlx::Connection;
    let sql = format!(
        "DELETE FROM processed_messages WHERE consumer = '{consumer}' AND message_key = '{key}'"
    );
    if db.starts_with("sqlite:") {
        let mut c = sqlx::SqliteConnection::connect(db).await.unwrap();
        sqlx::query(&sql).execute(&mut c).await.unwrap();
    } else {
        let mut c = sqlx::PgConnection::connect(db).await.unwrap();
        sqlx::query(&sql).execute(&mut c).await.unwrap();
    }
}

fn drill(
    env: &TempEnv,
    db: &str,
    queue: &str,
    sms: &str,
    metrics: &str,
) -> (i32, serde_json::Value) {
    let (code, stdout, stderr) = run_cli(
        env,
        &[
            "drill",
            "live-redelivery",
            "--yes-live",
            "--k",
            "3",
            "--timeout",
            "20s",
            "--metrics-url",
            metrics,
            "--db",
            db,
            "--queue",
            queue,
            "--sms-url",
            sms,
            "--json",
        ],
    );
    let r = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
    (code, r)
}

async fn live_drill_against_serve(env: &TempEnv, db: &str, queue: &str) {
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let sms = sandbox.url();
    let (mut service, metrics) = serve(env, db, queue, &sms, "idempotent");
    let trace: Vec<u8> = FleetSim::new(FleetConfig {
        vehicles: 5,
        seed: 3,
        device_prefix: format!("LIVE-{:04x}-", rand::random::<u16>()),
        ..FleetConfig::default()
    })
    .take_n(300)
    .into_iter()
    .flat_map(|m| [m.raw, b"\n".to_vec()].concat())
    .collect();
    let file = env.path("trace.jsonl");
    std::fs::write(&file, trace).unwrap();
    let (code, _, stderr) = run_cli(
        env,
        &[
            "publish",
            file.to_str().unwrap(),
            "--db",
            db,
            "--queue",
            queue,
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    drained(queue).await;

    // Without permission it does not run at all.
    let (code, _, stderr) = run_cli(
        env,
        &[
            "drill",
            "live-redelivery",
            "--metrics-url",
            &metrics,
            "--db",
            db,
            "--queue",
            queue,
        ],
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--yes-live"));

    // Under a steady live load: its traffic moves processed counters, trip counters
    // and SMS all along; the verdict reads only the drill's own keys.
    let stop = Arc::new(AtomicBool::new(false));
    let load = live_load(queue.to_string(), stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The drill blocks this thread; the load keeps running on the runtime's other one.
    let (code, r) = tokio::task::block_in_place(|| drill(env, db, queue, &sms, &metrics));
    stop.store(true, Ordering::SeqCst);
    let published = load.await.unwrap();
    assert!(published > 0);
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["verdict"], "pass", "{r:#}");
    assert_eq!(r["deliveries"], 3);
    assert!(
        r["details"]["deltas"]["zone-exit-sms"]["duplicate_dropped"].as_f64() >= Some(3.0),
        "{r:#}"
    );
    let moved: f64 = FLEET_CONSUMERS
        .iter()
        .filter_map(|c| r["details"]["deltas"][c]["processed"].as_f64())
        .sum();
    assert!(
        moved > 0.0,
        "the live load moved the processed counters during the drill: {r:#}"
    );
    assert_eq!(r["sms_sent"], 0);
    drained(queue).await;

    // A message whose dedup row is gone is never re-published: the drill says so and
    // picks another.
    let store = idemwatch::engine::store::open(db).await.unwrap();
    let newest = store.recent_history(Some("zone_exit"), 1).await.unwrap();
    let purged = format!(
        "{}:{}:{}",
        newest[0].device_id, newest[0].seq, newest[0].event_type
    );
    purge_dedup_row(db, "trip-counter", &purged).await;
    let (code, r) = drill(env, db, queue, &sms, &metrics);
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["verdict"], "pass", "{r:#}");
    let skipped = r["details"]["skipped"].to_string();
    assert!(skipped.contains(&purged), "{r:#}");
    assert!(skipped.contains("no dedup row"), "{skipped}");
    let republished = r["details"]["republished"].to_string();
    assert!(
        !republished.contains(&format!("\"{purged}\"")),
        "{republished}"
    );
    assert_eq!(r["deliveries"], 3, "another message was picked: {r:#}");

    // The same system without the pattern: the drill fails and names the harm.
    service.stop();
    let (_naive, metrics) = serve(env, db, queue, &sms, "naive");
    let (code, r) = drill(env, db, queue, &sms, &metrics);
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(r["verdict"], "fail");
    assert_eq!(r["sms_sent"], 3, "{r:#}");
    assert_eq!(r["counter_delta"], 3, "{r:#}");
    assert!(!r["details"]["republished"]
        .to_string()
        .contains(&format!("\"{purged}\"")));
    let notes = r["details"]["notes"].to_string();
    assert!(notes.contains("zone-exit-sms sent 3 SMS again"), "{notes}");
    assert!(notes.contains("trip_counters.zone_exits"), "{notes}");
    // Every drill leaves a marker, live ones too.
    let store = idemwatch::engine::store::open(db).await.unwrap();
    let markers = store.markers(10).await.unwrap();
    assert!(markers.iter().any(|m| m.label.contains("live-redelivery")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_redelivery_on_the_embedded_queue_passes_idempotent_fails_naive() {
    let env = TempEnv::new();
    let (db, queue) = (env.db_url(), env.queue_url());
    live_drill_against_serve(&env, &db, &queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_redelivery_on_rabbitmq_and_postgres_passes_idempotent_fails_naive() {
    let Some(amqp) = amqp_url().await else { return };
    let Some(db) = TestDb::new(Kind::Postgres).await else {
        return;
    };
    // Its own exchange and queues on the broker: the live queues of this test only.
    let queue = format!("{amqp}?prefix=idw_live_{}", std::process::id());
    live_drill_against_serve(&db.env, &db.url, &queue).await;
    let q = idemwatch::engine::queue::amqp::AmqpQueue::open(&queue)
        .await
        .unwrap();
    for c in FLEET_CONSUMERS {
        let _ = q.remove_queue(c).await;
    }
    q.remove_topology().await.unwrap();
    db.cleanup().await;
}
