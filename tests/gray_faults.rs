//! Gray failures (issue 39): the way to a peer freezes, black-holes or resets while
//! a producer publishes under load, through the tests' own TCP fault proxy
//! (`common/proxy.rs`) in front of the shared PostgreSQL, MariaDB, RabbitMQ, NATS and
//! Redis. After the way heals every message is checked in Jepsen's terms (lost,
//! duplicated, recovered, ok-fraction) and the time to recover is measured: nothing
//! lost, nothing doubled, nothing dead-lettered, and the consumer working again by
//! itself — never waiting for the old sockets to move.
//!
//! The CI versions hold each fault for seconds, with deadlines to match (statement
//! 2 s, heartbeat 1 s); `scripts/faults.sh` runs the same with the defaults and
//! minutes of fault, for `docs/FAULTS.md`.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::backends::{Kind, TestDb};
use common::jepsen::{Publish, Tally};
use common::proxy::{Fault, FaultProxy};
use idemwatch::engine::consumers::{trip_counter, zone_exit_sms, ConsumerMode};
use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::deadlines::Deadlines;
use idemwatch::engine::health::{InfraKind, PauseCause};
use idemwatch::engine::runner::RunnerSettings;
use idemwatch::engine::seen_set::SeenSetConfig;
use idemwatch::engine::{Engine, EngineConfig};
use idemwatch::sim::sandbox_provider;

/// The peer the fault stands in front of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peer {
    Postgres,
    Mariadb,
    RabbitMq,
    Nats,
    Redis,
}

impl Peer {
    /// What a consumer pauses for when this peer goes silent.
    fn cause(self) -> PauseCause {
        match self {
            Peer::Postgres | Peer::Mariadb => PauseCause::Store,
            Peer::RabbitMq | Peer::Nats => PauseCause::Queue,
            Peer::Redis => PauseCause::SeenSet,
        }
    }
}

/// How long each CI fault lasts: longer than every deadline below and than three
/// heartbeats (what a broker client takes to give up on a silent link), so a frozen
/// way is found out while it is still frozen. A freeze lasts twice that: finding a
/// silent link out takes a deadline, a reconnect and a fresh fetch, and on two loaded
/// cores that was seen taking 10 s for NATS (its pings, then the reconnect).
const FAULT: Duration = Duration::from_secs(6);

fn fault_length(fault: Fault) -> Duration {
    match fault {
        Fault::Freeze => FAULT * 2,
        _ => FAULT,
    }
}

/// Deliveries per batch (and per lease).
const BATCH: usize = 8;

/// Short deadlines for seconds of fault (the defaults are for minutes).
fn ci_deadlines() -> Deadlines {
    Deadlines {
        statement_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(1),
        acquire_timeout: Duration::from_secs(1),
        heartbeat: Duration::from_secs(1),
    }
}

fn zone_exit_line(device: &str) -> Vec<u8> {
    format!(
        r#"{{"device_id":"{device}","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X","phone":"+905551112233"}}}}"#
    )
    .into_bytes()
}

/// The device an SMS was sent for (`zone_exit_sms::sms_text`).
fn device_of(text: &str) -> String {
    text.strip_prefix("Your vehicle ")
        .and_then(|t| t.split(" left zone").next())
        .unwrap_or_default()
        .to_string()
}

/// One fault run's setting: the engine behind the proxy and what it needs kept alive.
struct Setting {
    engine: Arc<Engine>,
    proxy: FaultProxy,
    sandbox: sandbox_provider::SandboxHandle,
    /// The consumers whose effects are counted.
    consumers: Vec<&'static str>,
    db: TestDb,
    /// Broker topology to remove at the end.
    cleanup: Option<Cleanup>,
}

enum Cleanup {
    Amqp(String),
    Nats(String, String),
}

/// The engine of `peer`'s test behind a fault proxy; `None` when the service is not
/// there (skipped, or a panic in CI).
async fn setting(peer: Peer) -> Option<Setting> {
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let tag = format!("{}{:04x}", std::process::id(), rand::random::<u16>());
    let db_kind = match peer {
        Peer::Postgres => Kind::Postgres,
        Peer::Mariadb => Kind::Mysql,
        _ => Kind::Sqlite,
    };
    let db = TestDb::new(db_kind).await?;
    let mut db_url = db.url.clone();
    let mut queue_url = db.queue_url();
    let mut seen_set = SeenSetConfig::default();
    let mut mode = ConsumerMode::Idempotent;
    let mut namespace = None;
    let mut cleanup = None;
    let proxy = match peer {
        Peer::Postgres => {
            let p = FaultProxy::in_front_of(&db.url, 5432).await;
            db_url = p.url_through(&db.url);
            p
        }
        Peer::Mariadb => {
            let p = FaultProxy::in_front_of(&db.url, 3306).await;
            db_url = p.url_through(&db.url);
            p
        }
        Peer::RabbitMq => {
            let url = common::amqp::amqp_url().await?;
            let p = FaultProxy::in_front_of(&url, 5672).await;
            let prefix = format!("idw_fault_{tag}");
            queue_url = format!("{}?prefix={prefix}", p.url_through(&url));
            cleanup = Some(Cleanup::Amqp(format!("{url}?prefix={prefix}")));
            p
        }
        Peer::Nats => {
            let url = common::services::nats_url()?;
            let p = FaultProxy::in_front_of(&url, 4222).await;
            let ns = format!("fault-{tag}");
            queue_url = p.url_through(&url);
            namespace = Some(ns.clone());
            cleanup = Some(Cleanup::Nats(url, ns));
            p
        }
        Peer::Redis => {
            let url = common::services::redis_url()?;
            let p = FaultProxy::in_front_of(&url, 6379).await;
            seen_set.url = Some(p.url_through(&url));
            mode = ConsumerMode::SeenSet;
            p
        }
    };
    let on_a_database = matches!(peer, Peer::Postgres | Peer::Mariadb);
    let consumers = if on_a_database {
        vec![trip_counter::NAME, zone_exit_sms::NAME]
    } else {
        vec![trip_counter::NAME]
    };
    let mut cfg = EngineConfig::new(&db_url, &queue_url, &sandbox.url(), &sandbox.url());
    cfg.consumers = consumers.iter().map(|c| c.to_string()).collect();
    cfg.mode = mode;
    cfg.seen_set = seen_set;
    cfg.namespace = namespace;
    cfg.deadlines = ci_deadlines();
    cfg.claim_lease = Duration::from_secs(3);
    cfg.runner = RunnerSettings {
        lease_batch: BATCH,
        prefetch: BATCH,
        // The embedded queue gives a message its budget back only for the store's
        // and the provider's faults: one counted failure is a dead letter here. A
        // broker counts a delivery whose link was lost, as it counts a crash.
        max_deliveries: if on_a_database || peer == Peer::Redis {
            1
        } else {
            RunnerSettings::default().max_deliveries
        },
        retry_delay: Duration::from_millis(100),
        max_retry_delay: Duration::from_secs(3),
        max_pause: Duration::from_secs(1),
        visibility_timeout: Duration::from_secs(10),
        idle_poll: Duration::from_millis(20),
        ..RunnerSettings::default()
    };
    let engine = Arc::new(Engine::open(&cfg).await.expect("the engine opens"));
    Some(Setting {
        engine,
        proxy,
        sandbox,
        consumers,
        db,
        cleanup,
    })
}

/// What one run measured.
#[derive(Debug)]
struct Outcome {
    fault: Fault,
    peer: Peer,
    /// Per consumer.
    tallies: Vec<(&'static str, Tally)>,
    /// From the fault's start to the first message processed after it.
    stalled_for: Duration,
    /// From the way healing to the first message processed after it (zero when it
    /// was processing again before).
    recovered_after_heal: Duration,
    dead_letters: usize,
    /// Provider calls beyond the first for one key (the same key each time).
    provider_repeat_calls: usize,
    /// The pause seen while the fault lasted, if any.
    pause: Option<idemwatch::engine::health::Pause>,
    timeouts: u64,
    /// Infrastructure failures counted of the kinds the peer's cause pauses for
    /// (its own, and `timeout`).
    peer_failures: u64,
}

/// Publish under load, inject `fault` for its [`fault_length`], heal, drain; count.
async fn run(peer: Peer, fault: Fault) -> Option<Outcome> {
    if std::env::var("GRAY_LOG").is_ok() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(std::env::var("GRAY_LOG").unwrap())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let s = setting(peer).await?;
    let engine = s.engine.clone();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = {
        let engine = engine.clone();
        tokio::spawn(async move {
            engine
                .run(1, Arc::new(CrashPlan::none()), stopped)
                .await
                .expect("no crash")
        })
    };
    let prefix = format!("GRAY-{:04x}-", rand::random::<u16>());
    let published: Arc<Mutex<Vec<(String, Publish)>>> = Arc::default();
    let publishing = Arc::new(AtomicBool::new(true));
    let publisher = {
        let (engine, published, publishing, prefix) = (
            engine.clone(),
            published.clone(),
            publishing.clone(),
            prefix.clone(),
        );
        tokio::spawn(async move {
            let mut i = 0u64;
            while publishing.load(Ordering::SeqCst) {
                let device = format!("{prefix}{i}");
                let sent = tokio::time::timeout(
                    Duration::from_secs(3),
                    engine.publish(&[zone_exit_line(&device)]),
                )
                .await;
                let how = match sent {
                    Ok(Ok(())) => Publish::Acked,
                    _ => Publish::Indeterminate,
                };
                published.lock().unwrap().push((device, how));
                i += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let processed = {
        let engine = engine.clone();
        move || engine.summary().consumers[trip_counter::NAME].processed
    };
    common::wait_for("warm-up", Duration::from_secs(60), || processed() >= 20).await;

    let before = processed();
    let injected = Instant::now();
    s.proxy.inject(fault);
    // Watch for the first message processed after the fault began, and the pause.
    let mut resumed: Option<Instant> = None;
    let mut pause = None;
    let grace = Duration::from_millis(300);
    let mut healed = None;
    let mut baseline = before;
    while healed.is_none() || resumed.is_none() {
        let now = Instant::now();
        if now.duration_since(injected) < grace {
            // Batches committed just before the fault may still be counted.
            baseline = processed();
        } else if resumed.is_none() && processed() > baseline {
            resumed = Some(now);
        }
        if pause.is_none() {
            pause = engine.pause(trip_counter::NAME);
        }
        if healed.is_none() && now.duration_since(injected) >= fault_length(fault) {
            s.proxy.heal();
            healed = Some(now);
        }
        assert!(
            now.duration_since(injected) < fault_length(fault) + Duration::from_secs(90),
            "{peer:?} {fault:?}: never processed again"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let (resumed, healed) = (resumed.unwrap(), healed.unwrap());
    tokio::time::sleep(Duration::from_secs(1)).await;
    publishing.store(false, Ordering::SeqCst);
    publisher.await.unwrap();

    // Drain: every acked message's effects, within a minute and a half.
    let published = published.lock().unwrap().clone();
    let acked: Vec<&String> = published
        .iter()
        .filter(|(_, p)| *p == Publish::Acked)
        .map(|(d, _)| d)
        .collect();
    let drained = Instant::now() + Duration::from_secs(90);
    let mut counted = std::collections::HashSet::new();
    let sms_too = s.consumers.contains(&zone_exit_sms::NAME);
    loop {
        let sent: std::collections::HashSet<String> = if sms_too {
            s.sandbox
                .state()
                .sent_sms()
                .iter()
                .map(|sms| device_of(&sms.text))
                .collect()
        } else {
            Default::default()
        };
        for d in &acked {
            if !counted.contains(*d)
                && engine.store.zone_exits(d).await.unwrap_or(0) > 0
                && (!sms_too || sent.contains(*d))
            {
                counted.insert((*d).clone());
            }
        }
        if counted.len() == acked.len() {
            break;
        }
        assert!(
            Instant::now() < drained,
            "{peer:?} {fault:?}: {} of {} acked messages still without their effects",
            acked.len() - counted.len(),
            acked.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Let what is still in flight (a recovered publish) settle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("the engine stops")
        .unwrap();

    let mut tallies = Vec::new();
    let mut counts = HashMap::new();
    for (device, _) in &published {
        let n = engine.store.zone_exits(device).await.unwrap();
        counts.insert(device.clone(), u64::try_from(n).unwrap_or(0));
    }
    tallies.push((trip_counter::NAME, Tally::of(&published, &counts)));
    let mut provider_repeat_calls = 0;
    if s.consumers.contains(&zone_exit_sms::NAME) {
        let state = s.sandbox.state();
        let mut sent: HashMap<String, u64> = HashMap::new();
        for sms in state.sent_sms() {
            *sent.entry(device_of(&sms.text)).or_default() += 1;
        }
        tallies.push((zone_exit_sms::NAME, Tally::of(&published, &sent)));
        let mut calls: HashMap<Option<String>, usize> = HashMap::new();
        for r in state.sms_requests() {
            *calls.entry(r.idempotency_key).or_default() += 1;
        }
        provider_repeat_calls = calls.values().map(|n| n - 1).sum();
    }
    let dead_letters = engine.store.dead_letters(100).await.unwrap().len();
    let timeouts = s
        .consumers
        .iter()
        .map(|c| {
            engine
                .metrics
                .infra_errors(c, InfraKind::Timeout(PauseCause::Store))
        })
        .sum();
    let peer_failures = s
        .consumers
        .iter()
        .map(|c| {
            InfraKind::ALL
                .iter()
                .filter(|k| matches!(k, InfraKind::Timeout(_)) || k.cause() == peer.cause())
                .map(|k| engine.metrics.infra_errors(c, *k))
                .sum::<u64>()
        })
        .sum();
    for c in &s.consumers {
        assert!(engine.pause(c).is_none(), "{c}: resumed by itself");
    }
    match s.cleanup {
        Some(Cleanup::Amqp(url)) => {
            let q = idemwatch::engine::queue::amqp::AmqpQueue::open(&url)
                .await
                .unwrap();
            for c in &s.consumers {
                let _ = q.delete(c).await;
            }
            let _ = q.remove_topology().await;
        }
        Some(Cleanup::Nats(url, ns)) => {
            let q = idemwatch::engine::queue::nats::NatsQueue::open(&url)
                .await
                .unwrap();
            let _ = q.delete_namespace(&ns).await;
        }
        None => {}
    }
    if peer == Peer::Redis {
        // This run's seen-set keys only (the shared Redis is never flushed).
        if let Some(url) = common::services::redis_url() {
            if let Ok(client) = redis::Client::open(url.as_str()) {
                if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                    let keys: Vec<String> = redis::cmd("KEYS")
                        .arg(format!("idemwatch:seen:*:{prefix}*"))
                        .query_async(&mut c)
                        .await
                        .unwrap_or_default();
                    if !keys.is_empty() {
                        let _: Result<(), _> =
                            redis::cmd("DEL").arg(keys).query_async(&mut c).await;
                    }
                }
            }
        }
    }
    drop(s.proxy);
    s.db.cleanup().await;
    Some(Outcome {
        fault,
        peer,
        tallies,
        stalled_for: resumed.duration_since(injected),
        recovered_after_heal: resumed.saturating_duration_since(healed),
        dead_letters,
        provider_repeat_calls,
        pause,
        timeouts,
        peer_failures,
    })
}

impl Outcome {
    /// Nothing lost, nothing doubled, nothing dead-lettered, every acked message
    /// there; the consumer paused for the peer that failed (a fault longer than the
    /// deadlines is always seen), and back within seconds of the way healing.
    fn assert_kept_the_promise(&self) {
        eprintln!("{self}");
        for (consumer, t) in &self.tallies {
            assert_eq!(t.lost, 0, "{consumer}: {self}");
            if self.peer == Peer::Redis {
                // Seen-set mode's own window (module doc of `engine/seen_set.rs`):
                // the key is recorded after the effect, so an effect whose record
                // the fault cut off runs again — at most the batch in flight.
                assert!(t.duplicated <= BATCH, "{consumer}: {self}");
            } else {
                assert_eq!(t.duplicated, 0, "{consumer}: {self}");
            }
            assert_eq!(
                t.ok + t.duplicated,
                t.acked + t.recovered,
                "{consumer}: {self}"
            );
        }
        assert_eq!(self.dead_letters, 0, "{self}");
        assert!(
            self.recovered_after_heal < Duration::from_secs(15),
            "{self}"
        );
    }

    /// Paused for the peer that failed: the pause as sampled, or (a pause over
    /// between two samples on a loaded machine) the failures it counted.
    fn assert_paused_for_its_peer(&self) {
        match &self.pause {
            Some(pause) => assert_eq!(pause.cause, self.peer.cause(), "{self}"),
            None => assert!(self.peer_failures > 0, "no pause and no failure: {self}"),
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} {} for {:?}: stalled {:.1}s, back {:.1}s after the heal; dead letters {}, provider repeat calls {}, store timeouts {}, pause {:?}",
            self.peer,
            self.fault.name(),
            fault_length(self.fault),
            self.stalled_for.as_secs_f64(),
            self.recovered_after_heal.as_secs_f64(),
            self.dead_letters,
            self.provider_repeat_calls,
            self.timeouts,
            self.pause.as_ref().map(|p| (p.cause, p.kind, p.failures)),
        )?;
        for (c, t) in &self.tallies {
            write!(f, "; {c}: {t}")?;
        }
        Ok(())
    }
}

/// A frozen database connection is given up at the statement deadline and the work
/// goes on on a fresh one while the old sockets still hang (the field report: still
/// stuck after 180 s).
async fn a_frozen_way_is_left_at_the_deadline(peer: Peer) {
    let Some(o) = run(peer, Fault::Freeze).await else {
        return;
    };
    o.assert_kept_the_promise();
    o.assert_paused_for_its_peer();
    assert!(
        o.stalled_for < fault_length(Fault::Freeze),
        "processing again while the old sockets still hang: {o}"
    );
}

async fn a_black_hole_pauses_and_heals(peer: Peer) {
    let Some(o) = run(peer, Fault::BlackHole).await else {
        return;
    };
    o.assert_kept_the_promise();
    o.assert_paused_for_its_peer();
}

async fn a_reset_way_pauses_and_heals(peer: Peer) {
    let Some(o) = run(peer, Fault::Reset).await else {
        return;
    };
    o.assert_kept_the_promise();
}

macro_rules! fault_tests {
    ($($name:ident: $check:ident($peer:expr);)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $check($peer).await;
            }
        )*
    };
}

fault_tests! {
    frozen_postgres_connections_are_left_at_the_deadline: a_frozen_way_is_left_at_the_deadline(Peer::Postgres);
    frozen_mariadb_connections_are_left_at_the_deadline: a_frozen_way_is_left_at_the_deadline(Peer::Mariadb);
    frozen_rabbitmq_link_is_left_at_the_heartbeat: a_frozen_way_is_left_at_the_deadline(Peer::RabbitMq);
    frozen_nats_link_is_left_at_the_ping: a_frozen_way_is_left_at_the_deadline(Peer::Nats);
    frozen_redis_seen_set_is_left_at_the_deadline: a_frozen_way_is_left_at_the_deadline(Peer::Redis);
    black_holed_postgres_pauses_and_heals: a_black_hole_pauses_and_heals(Peer::Postgres);
    black_holed_mariadb_pauses_and_heals: a_black_hole_pauses_and_heals(Peer::Mariadb);
    black_holed_rabbitmq_pauses_and_heals: a_black_hole_pauses_and_heals(Peer::RabbitMq);
    black_holed_nats_pauses_and_heals: a_black_hole_pauses_and_heals(Peer::Nats);
    black_holed_redis_seen_set_pauses_and_heals: a_black_hole_pauses_and_heals(Peer::Redis);
    reset_postgres_connections_lose_nothing: a_reset_way_pauses_and_heals(Peer::Postgres);
    reset_mariadb_connections_lose_nothing: a_reset_way_pauses_and_heals(Peer::Mariadb);
    reset_rabbitmq_link_loses_nothing: a_reset_way_pauses_and_heals(Peer::RabbitMq);
    reset_nats_link_loses_nothing: a_reset_way_pauses_and_heals(Peer::Nats);
    reset_redis_seen_set_loses_nothing: a_reset_way_pauses_and_heals(Peer::Redis);
}
