//! A provider's answer is never thrown away (issue 43): when the store fails between a
//! send the provider accepted and its record — a test store that fails the record N
//! times, the database cut through a proxy at that moment, SQLite on a full tmpfs — the
//! record is retried, never the send: exactly one provider call per key, the claim
//! `sent` once the store is back, the message acked only after that. On SQLite,
//! PostgreSQL and MariaDB, through the batch path and the per-message path.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::backends::{Kind, TestDb};
use common::flaky_store::FlakyRecord;
use common::proxy::{server_addr, FaultProxy};
use common::wait_for;
use idemwatch::engine::consumers::zone_exit_sms;
use idemwatch::engine::crash::{CrashPlan, CrashPoint, CrashStyle};
use idemwatch::engine::envelope::{Envelope, MessageKey};
use idemwatch::engine::metrics::Metrics;
use idemwatch::engine::runner::{DeliveryEvent, DeliveryOutcome, EventSink, RunnerSettings};
use idemwatch::engine::store::{self, ClaimState, Store};
use idemwatch::engine::{queue, Engine, EngineConfig};
use idemwatch::sim::sandbox_provider::{self, SandboxHandle};
use idemwatch_testkit::on_every_backend;

on_every_backend!(
    a_sent_sms_whose_record_fails_is_recorded_later_never_sent_again,
    a_redriven_sms_whose_record_fails_is_recorded_by_a_later_sweep_never_sent_again,
);

const SMS: &str = zone_exit_sms::NAME;

fn zone_exit_line(device: &str) -> Vec<u8> {
    format!(
        r#"{{"device_id":"{device}","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X","phone":"+905551112233"}}}}"#
    )
    .into_bytes()
}

fn key_of(body: &[u8]) -> MessageKey {
    Envelope::parse(body).unwrap().key()
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

/// One call per key for `n` keys, each accepted and sent once.
fn assert_one_call_per_key(sandbox: &SandboxHandle, n: usize) {
    let calls = calls_per_key(sandbox);
    assert_eq!(calls.len(), n, "{calls:?}");
    assert!(
        calls.values().all(|c| *c == 1),
        "a key called twice: {calls:?}"
    );
    assert_eq!(sandbox.state().sent_sms().len(), n);
}

async fn assert_each_claim_sent(store: &dyn Store, bodies: &[Vec<u8>]) {
    for body in bodies {
        let claim = store.claim(SMS, &key_of(body)).await.unwrap();
        assert_eq!(claim.expect("a claim").state, ClaimState::Sent);
    }
}

/// The zone-exit-sms consumer on `store` (its queue the test's), batches of 16, every
/// delivery its only one (`max_deliveries` 1: a counted retry would be a dead letter),
/// claims leased for `lease`.
fn sms_engine(
    db: &TestDb,
    store: Arc<dyn Store>,
    queue: Arc<dyn queue::Queue>,
    sandbox: &SandboxHandle,
    lease: Duration,
) -> Engine {
    sms_engine_with(db, store, queue, sandbox, lease, 1)
}

/// [`sms_engine`] with `max_deliveries`.
fn sms_engine_with(
    db: &TestDb,
    store: Arc<dyn Store>,
    queue: Arc<dyn queue::Queue>,
    sandbox: &SandboxHandle,
    lease: Duration,
    max_deliveries: u32,
) -> Engine {
    let mut cfg = EngineConfig::new(&db.url, &db.queue_url(), &sandbox.url(), &sandbox.url());
    cfg.consumers = vec![SMS.into()];
    cfg.claim_lease = lease;
    cfg.runner = RunnerSettings {
        lease_batch: 16,
        max_deliveries,
        retry_delay: Duration::from_millis(20),
        max_pause: Duration::from_millis(300),
        visibility_timeout: Duration::from_millis(500),
        idle_poll: Duration::from_millis(5),
        ..RunnerSettings::default()
    };
    Engine::from_parts(store, queue, Arc::new(Metrics::new()), &cfg).unwrap()
}

/// Every delivery event, in order.
fn recorder() -> (Arc<Mutex<Vec<DeliveryEvent>>>, EventSink) {
    let events: Arc<Mutex<Vec<DeliveryEvent>>> = Arc::default();
    let sink = {
        let events = events.clone();
        Arc::new(move |e| events.lock().unwrap().push(e)) as EventSink
    };
    (events, sink)
}

async fn drain(engine: &Engine, sink: Option<EventSink>) {
    tokio::time::timeout(
        Duration::from_secs(120),
        engine.run_until_idle(Arc::new(CrashPlan::none()), sink),
    )
    .await
    .expect("the queue drains")
    .unwrap();
}

/// A batch of 8 zone exits whose SMS the provider accepts; recording the answers
/// fails 3 times (the store gone between the send and the record). Each SMS is sent
/// once: the answers are recorded when the store is back, never resent, not even
/// under their keys once the claims' lease (2 s) is over. Every delivery is given
/// back (retry, uncounted) until its answer is recorded, then processed and acked.
async fn a_sent_sms_whose_record_fails_is_recorded_later_never_sent_again(db: &TestDb) {
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let flaky = FlakyRecord::new(store::open(&db.url).await.unwrap(), 3);
    let queue = queue::open(&db.queue_url()).await.unwrap();
    let engine = sms_engine(db, flaky.clone(), queue, &sandbox, Duration::from_secs(2));
    let bodies: Vec<Vec<u8>> = (0..8)
        .map(|i| zone_exit_line(&format!("REC-{i}")))
        .collect();
    engine.publish(&bodies).await.unwrap();
    let (events, sink) = recorder();
    drain(&engine, Some(sink)).await;

    assert_eq!(flaky.failed(), 3);
    assert_one_call_per_key(&sandbox, 8);
    assert_each_claim_sent(flaky.as_ref(), &bodies).await;
    assert!(engine.store.dead_letters(10).await.unwrap().is_empty());
    let c = &engine.summary().consumers[SMS];
    assert_eq!((c.processed, c.side_effects_sent), (8, 8), "{c:?}");
    for reason in [
        "lease_takeover",
        "sweeper_redrive",
        "provider_retry",
        "unexpected",
    ] {
        let series =
            format!("idem_provider_repeat_calls_total{{consumer=\"{SMS}\",reason=\"{reason}\"}} 0");
        assert!(engine.metrics.encode().contains(&series), "{series}");
    }
    // Acked only once recorded: each key given back until then, processed once.
    let events = events.lock().unwrap();
    for body in &bodies {
        let key = key_of(body);
        let fates: Vec<DeliveryOutcome> = events
            .iter()
            .filter(|e| e.key.as_ref() == Some(&key))
            .map(|e| e.outcome)
            .collect();
        let (last, before) = fates.split_last().expect("delivered");
        assert_eq!(*last, DeliveryOutcome::Processed, "{key}: {fates:?}");
        assert!(
            before.iter().all(|f| *f == DeliveryOutcome::Retry),
            "{key}: {fates:?}"
        );
    }
    assert!(events.iter().any(|e| e.outcome == DeliveryOutcome::Retry));
}

/// The per-message path: a zone exit whose consumer died after its claim (no call
/// made) is re-driven by the claim sweeper from the message kept beside the claim; the
/// SMS goes out and recording it fails twice. The sweeps after it record the answer
/// the process kept, and never call the provider again; the message's own delivery
/// comes back and is acked as a duplicate only then.
async fn a_redriven_sms_whose_record_fails_is_recorded_by_a_later_sweep_never_sent_again(
    db: &TestDb,
) {
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let flaky = FlakyRecord::new(store::open(&db.url).await.unwrap(), 0);
    let queue = queue::open(&db.queue_url()).await.unwrap();
    let lease = Duration::from_millis(300);
    // The delivery that died counts as one: a second one must not be the last.
    let engine = sms_engine_with(db, flaky.clone(), queue, &sandbox, lease, 5);
    let body = zone_exit_line("REDRIVE-0");
    engine.publish(std::slice::from_ref(&body)).await.unwrap();
    let dies = Arc::new(CrashPlan::at(CrashPoint::AfterClaim, 1, CrashStyle::Unwind));
    let worker = engine.worker(SMS, dies, None).unwrap();
    assert!(
        worker.run_until_idle().await.is_err(),
        "died after its claim"
    );
    assert!(calls_per_key(&sandbox).is_empty());
    tokio::time::sleep(lease * 2).await;

    flaky.fail_next(2);
    let mut sweeps = Vec::new();
    for _ in 0..4 {
        sweeps.push(engine.sweep_claims().await.map(|r| r.finished));
        tokio::time::sleep(lease).await;
    }
    assert_eq!(flaky.failed(), 2);
    assert!(
        sweeps[..2].iter().all(|s| s.is_err()),
        "the failed records are the store's failure: {sweeps:?}"
    );
    assert_eq!(sweeps[2].as_ref().ok(), Some(&1), "{sweeps:?}");
    assert_eq!(sweeps[3].as_ref().ok(), Some(&0), "{sweeps:?}");
    assert_one_call_per_key(&sandbox, 1);
    assert_each_claim_sent(flaky.as_ref(), std::slice::from_ref(&body)).await;

    let (events, sink) = recorder();
    drain(&engine, Some(sink)).await;
    let fates: Vec<DeliveryOutcome> = events.lock().unwrap().iter().map(|e| e.outcome).collect();
    assert_eq!(fates, [DeliveryOutcome::Duplicate]);
    assert_one_call_per_key(&sandbox, 1);
    // The owner that died never called: the sweeper's call was the key's only one.
    assert!(engine.metrics.encode().contains(&format!(
        "idem_provider_repeat_calls_total{{consumer=\"{SMS}\",reason=\"sweeper_redrive\"}} 0"
    )));
}

/// The database cut through a proxy while 8 SMS calls are in flight (each takes 1 s at
/// the provider): the claims are committed, the answers come back, and recording them
/// meets the cut. Once the way is back, each answer is recorded: one call per key, no
/// dead letter, the consumer resumed by itself.
async fn a_database_cut_between_the_sends_and_their_record_sends_once(kind: Kind, port: u16) {
    let Some(db) = TestDb::new(kind).await else {
        return;
    };
    let proxy = FaultProxy::start(server_addr(&db.url, port).await).await;
    let url = proxy.url_through(&db.url);
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    sandbox.state().set_latency(Duration::from_secs(1));
    let store = store::open(&url).await.unwrap();
    let queue = queue::open(&db.queue_url()).await.unwrap();
    let engine = Arc::new(sms_engine(
        &db,
        store,
        queue,
        &sandbox,
        Duration::from_secs(3),
    ));
    let bodies: Vec<Vec<u8>> = (0..8)
        .map(|i| zone_exit_line(&format!("CUT-{i}")))
        .collect();
    engine.publish(&bodies).await.unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.run(1, Arc::new(CrashPlan::none()), stopped).await })
    };
    let state = sandbox.state().clone();
    wait_for("8 calls in flight", Duration::from_secs(60), || {
        state.peak_in_flight() >= 8
    })
    .await;
    proxy.cut();
    wait_for(
        "the record to meet the cut",
        Duration::from_secs(60),
        || engine.pause(SMS).is_some_and(|p| p.failures >= 2),
    )
    .await;
    assert_eq!(state.sms_requests().len(), 8, "every call answered");
    proxy.restore();
    let direct = store::open(&db.url).await.unwrap();
    let mut recorded = false;
    for _ in 0..600 {
        let mut sent = 0;
        for body in &bodies {
            if let Ok(Some(c)) = direct.claim(SMS, &key_of(body)).await {
                sent += usize::from(c.state == ClaimState::Sent);
            }
        }
        if sent == bodies.len() {
            recorded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(recorded, "every answer recorded once the way is back");
    wait_for("the queue to drain", Duration::from_secs(60), || {
        engine.summary().consumers[SMS].processed
            + engine.summary().consumers[SMS].duplicate_dropped
            >= 8
    })
    .await;
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("stops")
        .unwrap()
        .unwrap();
    assert_one_call_per_key(&sandbox, 8);
    assert!(direct.dead_letters(10).await.unwrap().is_empty());
    assert!(engine.pause(SMS).is_none(), "resumed by itself");
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_cut_between_the_sends_and_their_record_sends_once() {
    a_database_cut_between_the_sends_and_their_record_sends_once(Kind::Postgres, 5432).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_cut_between_the_sends_and_their_record_sends_once() {
    a_database_cut_between_the_sends_and_their_record_sends_once(Kind::Mysql, 3306).await;
}

/// A small tmpfs, unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    /// `None` (skipped) where mounting is not allowed, unless services are required.
    fn mount(dir: &std::path::Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            assert!(
                !common::backends::required(),
                "mounting a tmpfs needs root (IDEMWATCH_REQUIRE_SERVICES=1)"
            );
            eprintln!("SKIP: cannot mount a tmpfs here (not root?)");
            return None;
        }
        Some(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Fill the file system of `path` with a ballast file until it is full.
fn fill(path: &std::path::Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0u8; 16 * 1024];
    while f.write_all(&chunk).is_ok() {}
    let _ = f.sync_all();
}

/// SQLite on a 4 MB tmpfs that fills up while 8 SMS calls are in flight: recording the
/// answers fails (SQLITE_FULL), the consumer pauses as for an outage, nothing is
/// dead-lettered; once space is freed each answer is recorded, one call per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_on_a_full_disk_records_the_answers_once_space_is_freed_never_resends() {
    let env = common::TempEnv::new();
    let Some(disk) = Tmpfs::mount(&env.path("disk"), "4m") else {
        return;
    };
    let db_url = format!("sqlite://{}", disk.0.join("store.db").display());
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    sandbox.state().set_latency(Duration::from_secs(1));
    let store = store::open(&db_url).await.unwrap();
    let queue = queue::open(&env.queue_url()).await.unwrap();
    let mut cfg = EngineConfig::new(&db_url, &env.queue_url(), &sandbox.url(), &sandbox.url());
    cfg.consumers = vec![SMS.into()];
    cfg.claim_lease = Duration::from_secs(3);
    cfg.runner = RunnerSettings {
        lease_batch: 16,
        max_deliveries: 1,
        retry_delay: Duration::from_millis(20),
        max_pause: Duration::from_millis(300),
        idle_poll: Duration::from_millis(5),
        ..RunnerSettings::default()
    };
    let engine =
        Arc::new(Engine::from_parts(store, queue, Arc::new(Metrics::new()), &cfg).unwrap());
    let bodies: Vec<Vec<u8>> = (0..8)
        .map(|i| zone_exit_line(&format!("FULL-{i}")))
        .collect();
    engine.publish(&bodies).await.unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.run(1, Arc::new(CrashPlan::none()), stopped).await })
    };
    let state = sandbox.state().clone();
    wait_for("8 calls in flight", Duration::from_secs(60), || {
        state.peak_in_flight() >= 8
    })
    .await;
    let ballast = disk.0.join("ballast");
    fill(&ballast);
    wait_for(
        "the record to meet the full disk",
        Duration::from_secs(60),
        || engine.pause(SMS).is_some_and(|p| p.failures >= 2),
    )
    .await;
    assert_eq!(state.sms_requests().len(), 8, "every call answered");
    std::fs::remove_file(&ballast).unwrap();
    wait_for("every answer recorded", Duration::from_secs(60), || {
        engine.summary().consumers[SMS].processed >= 8
    })
    .await;
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("stops")
        .unwrap()
        .unwrap();
    assert_one_call_per_key(&sandbox, 8);
    assert_each_claim_sent(engine.store.as_ref(), &bodies).await;
    assert!(engine.store.dead_letters(10).await.unwrap().is_empty());
    drop(engine);
}
