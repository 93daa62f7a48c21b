//! The live demo behind `idemwatch` without a config: the embedded engine (SQLite)
//! consuming the fleet simulator in-process, its `/metrics` served on a loopback port
//! and scraped over real HTTP like any external consumer, the SMS sandbox running,
//! and a simulated deploy every couple of minutes.
//!
//! A deploy does what a real one does to an at-least-once consumer: the running
//! incarnation dies mid-flight (a few deliveries committed but not acked), a new one
//! starts with fresh counters and a new `process_start_time_seconds`, and the
//! unacked deliveries come back as duplicates after the visibility timeout. The
//! producer side redelivers more during the deploy window too (the simulator's
//! ~0.4 %). The duplicate-rate chart spikes at the deploy marker for real reasons.
//! Every second deploy drains the old incarnation instead of killing it (`(drained)`
//! in its marker): nothing is redelivered twice, so it stays within the duplicate
//! budget beside the killed ones over it.
//!
//! The other two things the tool is for show within its first minute or so, from the
//! same real parts:
//! - **Ordering anomalies.** Some devices drive through tunnels: they buffer a few
//!   events, send their newest one live when they are back in coverage, then flush
//!   the buffer (the simulator's `tunnel_rate`). The `vehicle-state` consumer's
//!   seq-guarded upsert keeps those older events in history only, and the Vehicles
//!   tab lists them as late events; opening one shows the state (still at the newer
//!   seq) beside the history. The first tunnel is flushed 38 s in.
//! - **Claims in doubt.** Now and then (`slow_first_after`, then every
//!   `slow_every`, for `slow_for`) the SMS/ERP sandbox turns slow: it sends at once
//!   but answers only after `slow_answer`, past the engine's 10 s provider deadline.
//!   The engine gives up on those calls — did the SMS go out? — and gives their
//!   claims back: in doubt on the Overview and the Tables tab while the consumers
//!   pause. Their retries go out under the same provider key; once the provider is
//!   quick again it replays its first answer and the claims are resolved: one SMS
//!   each, nothing lost, nothing sent twice.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use chrono::Utc;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use idemwatch_drills::sim::fleet::{FleetConfig, FleetSim};
use idemwatch_drills::sim::sandbox_provider::{self, SandboxHandle, SandboxState};
use idemwatch_engine::consumers::ConsumerMode;
use idemwatch_engine::crash::{CrashPlan, CrashPoint};
use idemwatch_engine::exporter;
use idemwatch_engine::metrics::Metrics;
use idemwatch_engine::queue::{self, Queue};
use idemwatch_engine::runner::RunnerSettings;
use idemwatch_engine::store::{self, MarkerKind, Store};
use idemwatch_engine::{Engine, EngineConfig, EngineError};
use idemwatch_monitor::config::{Config, DatabaseConfig, ScrapeTarget};

/// How the demo world behaves.
#[derive(Debug, Clone)]
pub struct DemoSettings {
    /// Where the demo's database, queue and nothing else live (wiped at start).
    pub dir: PathBuf,
    pub vehicles: usize,
    /// Fleet events published per second.
    pub events_per_second: u32,
    /// First simulated deploy after this long, then every `deploy_every`.
    pub first_deploy_after: Duration,
    pub deploy_every: Duration,
    /// Deliveries killed between commit and ack by each odd-numbered deploy; the
    /// even-numbered ones drain the old consumers first and kill nothing, so the
    /// Deploys panel shows a deploy over its duplicate budget beside one within it.
    pub deploy_kills: u32,
    /// A malformed message from a "buggy producer" this often (dead letters).
    pub garbage_every: Duration,
    /// Probability per fresh event that its device enters a tunnel (see the module
    /// doc): the ordering anomalies of the Vehicles tab.
    pub tunnel_rate: f64,
    /// The provider's slow spells: the first after `slow_first_after`, then every
    /// `slow_every`, each lasting `slow_for`, answers held `slow_answer` (zero: never
    /// slow). Past the engine's provider deadline, so a claim comes into doubt.
    pub slow_first_after: Duration,
    pub slow_every: Duration,
    pub slow_for: Duration,
    pub slow_answer: Duration,
    /// The side-effect claims' lease, the engine's and the dashboard's alike.
    pub claim_lease: Duration,
    pub seed: u64,
}

impl DemoSettings {
    pub fn in_dir(dir: &Path) -> Self {
        DemoSettings {
            dir: dir.to_path_buf(),
            vehicles: 24,
            events_per_second: 8,
            first_deploy_after: Duration::from_secs(40),
            deploy_every: Duration::from_secs(120),
            deploy_kills: 6,
            garbage_every: Duration::from_secs(75),
            // ~1 tunnel every 40 s fleet-wide at 8 events/s; seed 2026 flushes the first
            // one 38 s in (see the test `the_first_tunnel_flushes_within_45_s`).
            tunnel_rate: 0.004,
            // Between deploys (40 s, then every 120 s), so the chart's deploy spike
            // and the claims in doubt are told apart.
            slow_first_after: Duration::from_secs(55),
            // Every other deploy's window (#1, #3, …: the killed ones): its claims
            // given back and redelivered are the window's duplicates too, and a
            // drained deploy's window stays clean (within its budget).
            slow_every: Duration::from_secs(240),
            slow_for: Duration::from_secs(25),
            slow_answer: Duration::from_secs(12),
            claim_lease: idemwatch_engine::consumers::DEFAULT_CLAIM_LEASE,
            seed: 2026,
        }
    }
}

/// Where the demo's parts can be reached.
#[derive(Debug, Clone)]
pub struct DemoEndpoints {
    pub metrics_url: String,
    pub db_url: String,
    pub queue_url: String,
    pub sms_url: String,
    /// The sandbox the Drills tab's drills call: one of their own, never slow, so a
    /// drill's verdict does not depend on when the demo's provider is slow.
    pub drill_sms_url: String,
    pub dir: PathBuf,
    /// The side-effect claims' lease the demo's engine runs with.
    pub claim_lease: Duration,
}

impl DemoEndpoints {
    /// The dashboard config that watches the demo exactly as it would watch a real
    /// system: one scrape target and the database.
    pub fn monitor_config(&self) -> Config {
        let mut db = DatabaseConfig::with_url(&self.db_url);
        db.claim_lease = self.claim_lease;
        Config {
            targets: vec![ScrapeTarget {
                name: "demo-engine".into(),
                url: self.metrics_url.clone(),
            }],
            database: Some(db),
            ..Config::default()
        }
    }
}

/// A running demo. Dropping it stops everything.
pub struct Demo {
    pub endpoints: DemoEndpoints,
    stop: watch::Sender<bool>,
    deploy_now: tokio::sync::mpsc::UnboundedSender<()>,
    world: Arc<World>,
    tasks: Vec<JoinHandle<()>>,
    sandbox: SandboxHandle,
    _drill_sandbox: SandboxHandle,
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// What the consumer "process" of the demo shares across incarnations.
struct World {
    store: Arc<dyn Store>,
    queue: Arc<dyn Queue>,
    cfg: EngineConfig,
    current: RwLock<Arc<Metrics>>,
    /// Deploys that killed their consumers so far: the producer opens a redelivery
    /// window on each (a drained deploy returns what it held unprocessed: no window).
    deploys: AtomicU64,
}

impl World {
    fn metrics(&self) -> Arc<Metrics> {
        self.current
            .read()
            .map(|m| m.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }
}

fn sqlite_url(path: &Path) -> String {
    format!("sqlite://{}", path.display())
}

impl Demo {
    /// Start the demo world in `settings.dir` (its previous demo files are removed).
    pub async fn start(settings: DemoSettings) -> Result<Demo, EngineError> {
        std::fs::create_dir_all(&settings.dir).map_err(|e| {
            EngineError::Other(format!("cannot create {}: {e}", settings.dir.display()))
        })?;
        for f in [
            "demo.db",
            "demo.db-wal",
            "demo.db-shm",
            "demo-queue.db",
            "demo-queue.db-wal",
            "demo-queue.db-shm",
        ] {
            let _ = std::fs::remove_file(settings.dir.join(f));
        }
        let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
            .await
            .map_err(|e| EngineError::Other(format!("cannot start the SMS sandbox: {e}")))?;
        let drill_sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
            .await
            .map_err(|e| EngineError::Other(format!("cannot start the drills' sandbox: {e}")))?;
        let db_url = sqlite_url(&settings.dir.join("demo.db"));
        let queue_url = sqlite_url(&settings.dir.join("demo-queue.db"));
        let store = store::open(&db_url).await?;
        let queue = queue::open(&queue_url).await?;
        let mut cfg = EngineConfig::new(&db_url, &queue_url, &sandbox.url(), &sandbox.url());
        cfg.mode = ConsumerMode::Idempotent;
        cfg.claim_lease = settings.claim_lease;
        cfg.runner = RunnerSettings {
            visibility_timeout: Duration::from_secs(5),
            lease_batch: 8,
            idle_poll: Duration::from_millis(200),
            ..RunnerSettings::default()
        };
        let world = Arc::new(World {
            store,
            queue,
            cfg,
            current: RwLock::new(Arc::new(Metrics::new())),
            deploys: AtomicU64::new(0),
        });

        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|e| EngineError::Other(format!("cannot bind the metrics port: {e}")))?;
        let metrics_addr = listener
            .local_addr()
            .map_err(|e| EngineError::Other(e.to_string()))?;
        let (stop, stop_rx) = watch::channel(false);
        let (deploy_now, deploy_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();

        let source_world = world.clone();
        let app = exporter::router_with(Arc::new(move || source_world.metrics()));
        let mut http_stop = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            let _ = axum::serve(exporter::no_delay(listener), app)
                .with_graceful_shutdown(async move {
                    let _ = http_stop.changed().await;
                })
                .await;
        }));
        tasks.push(tokio::spawn(produce(
            world.clone(),
            settings.clone(),
            stop_rx.clone(),
        )));
        tasks.push(tokio::spawn(slow_spells(
            sandbox.state().clone(),
            settings.clone(),
            stop_rx.clone(),
        )));
        tasks.push(tokio::spawn(consume(
            world.clone(),
            settings.clone(),
            stop_rx,
            deploy_rx,
        )));

        Ok(Demo {
            endpoints: DemoEndpoints {
                metrics_url: format!("http://{metrics_addr}/metrics"),
                db_url,
                queue_url,
                sms_url: sandbox.url(),
                drill_sms_url: drill_sandbox.url(),
                dir: settings.dir.clone(),
                claim_lease: settings.claim_lease,
            },
            stop,
            deploy_now,
            world,
            tasks,
            sandbox,
            _drill_sandbox: drill_sandbox,
        })
    }

    /// The SMS sandbox: what it sent and was asked (tests check nothing was sent
    /// twice).
    pub fn sandbox(&self) -> &SandboxState {
        self.sandbox.state()
    }

    /// The demo's business database (tests read its claims).
    pub fn store(&self) -> Arc<dyn Store> {
        self.world.store.clone()
    }

    /// Simulate a deploy now (the dashboard's `D` key in demo mode).
    pub fn deploy(&self) {
        let _ = self.deploy_now.send(());
    }

    /// An operator's marker in the demo's own database (the dashboard's `m`); it
    /// comes back with the next poll like any other marker.
    pub async fn add_marker(&self, label: &str) -> Result<i64, store::StoreError> {
        self.world
            .store
            .add_marker(MarkerKind::Manual, label, Some("added from the dashboard"))
            .await
    }
}

/// The demo's fleet: `events_per_second` events a (simulated) second, a few late
/// ones, and the tunnels.
fn fleet_config(settings: &DemoSettings, start: chrono::DateTime<Utc>) -> FleetConfig {
    FleetConfig {
        vehicles: settings.vehicles,
        seed: settings.seed,
        start,
        tick: Duration::from_millis(1000 / u64::from(settings.events_per_second.max(1))),
        late_rate: 0.004,
        tunnel_rate: settings.tunnel_rate,
        ..FleetConfig::default()
    }
}

/// The producer: the fleet, at a steady rate, plus the occasional buggy message.
async fn produce(world: Arc<World>, settings: DemoSettings, mut stop: watch::Receiver<bool>) {
    let per_tick = settings.events_per_second.max(1);
    let mut sim = FleetSim::new(fleet_config(&settings, Utc::now()));
    let queues: Vec<String> = idemwatch_engine::consumers::FLEET_CONSUMERS
        .iter()
        .map(|c| c.to_string())
        .collect();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut garbage_at = tokio::time::Instant::now() + settings.garbage_every / 3;
    let mut deploy_windows = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        // The producer redelivers more while consumers restart (the field report: ~0.4 %).
        let deploys = world.deploys.load(Ordering::Relaxed);
        if deploys > deploy_windows {
            deploy_windows = deploys;
            sim.deploy(u64::from(per_tick) * 30);
        }
        let mut bodies: Vec<Vec<u8>> = (0..per_tick).map(|_| sim.next().raw).collect();
        if tokio::time::Instant::now() >= garbage_at {
            garbage_at += settings.garbage_every;
            bodies.push(
                br#"{"device_id":"34-SIM-0003","seq":"oops","event_type":"position"}"#.to_vec(),
            );
        }
        if let Err(e) = world.queue.publish(&queues, &bodies).await {
            tracing::warn!(error = %e, "demo producer could not publish");
        }
    }
}

/// The provider's slow spells (see the module doc): answers held past the engine's
/// deadline for `slow_for`, then quick again.
async fn slow_spells(
    sandbox: SandboxState,
    settings: DemoSettings,
    mut stop: watch::Receiver<bool>,
) {
    if settings.slow_answer.is_zero() || settings.slow_for.is_zero() {
        return;
    }
    let mut next = tokio::time::Instant::now() + settings.slow_first_after;
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = stop.changed() => return,
        }
        tracing::info!(answer_after = ?settings.slow_answer, lasting = ?settings.slow_for,
            "demo: the provider turns slow");
        sandbox.set_answer_delay(settings.slow_answer);
        tokio::select! {
            _ = tokio::time::sleep(settings.slow_for) => {}
            _ = stop.changed() => return,
        }
        sandbox.set_answer_delay(Duration::ZERO);
        next += settings.slow_every.max(settings.slow_for);
    }
}

/// The consumer "process": one incarnation after another, each killed by a deploy.
async fn consume(
    world: Arc<World>,
    settings: DemoSettings,
    mut stop: watch::Receiver<bool>,
    mut deploy_rx: tokio::sync::mpsc::UnboundedReceiver<()>,
) {
    let mut next_deploy = tokio::time::Instant::now() + settings.first_deploy_after;
    let mut deploy_no = 0u64;
    loop {
        let metrics = world.metrics();
        let engine = match Engine::from_parts(
            world.store.clone(),
            world.queue.clone(),
            metrics,
            &world.cfg,
        ) {
            Ok(e) => Arc::new(e),
            Err(e) => {
                tracing::error!(error = %e, "demo engine could not start");
                return;
            }
        };
        let crash = Arc::new(CrashPlan::none());
        let (inc_stop, inc_stop_rx) = watch::channel(false);
        let runner = {
            let (engine, crash) = (engine.clone(), crash.clone());
            tokio::spawn(async move { engine.run(1, crash, inc_stop_rx).await })
        };
        // Run until the next deploy (scheduled or requested) or the demo stops.
        let mut gauges = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next_deploy) => break,
                Some(()) = deploy_rx.recv() => break,
                _ = gauges.tick() => {
                    let _ = engine.refresh_in_doubt_gauge().await;
                    continue;
                }
                _ = stop.changed() => {
                    let _ = inc_stop.send(true);
                    let _ = runner.await;
                    return;
                }
            }
        }
        deploy_no += 1;
        next_deploy = tokio::time::Instant::now() + settings.deploy_every;
        // Odd deploys kill the old incarnation mid-flight (some deliveries commit and
        // never ack: their redeliveries are dropped as duplicates) while the producer
        // redelivers more: over the budget. Even ones drain it first (what it held
        // unprocessed goes back uncounted, nothing is redelivered twice): within it.
        // The question the Deploys panel answers — did this deploy cost more
        // duplicates than deploys usually do? — then has both answers on screen.
        let drained = deploy_no.is_multiple_of(2);
        if !drained {
            world.deploys.fetch_add(1, Ordering::Relaxed);
        }
        let (label, detail) = if drained {
            (
                format!("demo deploy #{deploy_no} (drained)"),
                "simulated rolling restart: the old consumers drained first",
            )
        } else {
            (
                format!("demo deploy #{deploy_no}"),
                "simulated rolling restart: the old consumers killed mid-flight",
            )
        };
        let _ = world
            .store
            .add_marker(MarkerKind::Deploy, &label, Some(detail))
            .await;
        if !drained {
            crash.arm(CrashPoint::AfterCommitBeforeAck, settings.deploy_kills);
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
        while crash.pending() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = inc_stop.send(true);
        let _ = runner.await;
        // A new process: counters from zero, a new start time.
        tokio::time::sleep(Duration::from_secs(2)).await;
        if let Ok(mut current) = world.current.write() {
            *current = Arc::new(Metrics::new());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemwatch_drills::sim::fleet::{SimKind, MIN_TUNNEL_EVENTS};

    /// The slow provider's story end to end, in-process: claims come into doubt (the
    /// engine gave up on calls the sandbox had acted on), then resolve by themselves
    /// once it is quick again — each of them sent exactly once, none left open, and
    /// no provider key sent twice by anyone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_provider_puts_claims_in_doubt_that_resolve_with_nothing_lost_or_sent_twice() {
        let dir = std::env::temp_dir().join(format!(
            "idw-demo-slow-{}-{}",
            std::process::id(),
            Utc::now().timestamp_nanos_opt().unwrap_or_default()
        ));
        let mut settings = DemoSettings::in_dir(&dir);
        // Only the slow spell: no deploy, no garbage in this run.
        settings.first_deploy_after = Duration::from_secs(3600);
        settings.garbage_every = Duration::from_secs(3600);
        // Once the side-effect consumers have steady traffic (trips take ~10 s to
        // reach their first zone exit).
        settings.slow_first_after = Duration::from_secs(15);
        settings.slow_for = Duration::from_secs(15);
        settings.slow_every = Duration::from_secs(3600);
        let demo = Demo::start(settings).await.expect("demo starts");
        let store = demo.store();
        let lease = demo.endpoints.claim_lease;

        let mut doubted: std::collections::BTreeMap<(String, String), String> = Default::default();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while doubted.is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no claim came into doubt"
            );
            for c in store.claims_in_doubt(lease).await.expect("claims") {
                doubted.insert((c.consumer, c.message_key), c.provider_key);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            let open = store.claims_in_doubt(lease).await.expect("claims");
            if open.is_empty() {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "claims still in doubt: {open:?}"
            );
            for c in open {
                doubted.insert((c.consumer, c.message_key), c.provider_key);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        let sent: Vec<String> = demo
            .sandbox()
            .sent_sms()
            .into_iter()
            .filter_map(|s| s.idempotency_key)
            .chain(
                demo.sandbox()
                    .sent_erp()
                    .into_iter()
                    .filter_map(|e| e.idempotency_key),
            )
            .collect();
        let mut once = std::collections::HashSet::new();
        for key in &sent {
            assert!(once.insert(key), "provider key {key} sent twice");
        }
        for ((consumer, message_key), provider_key) in &doubted {
            let claim = store
                .claim(
                    consumer,
                    &idemwatch_engine::envelope::MessageKey::from_stored(message_key.clone()),
                )
                .await
                .expect("claim")
                .expect("the claim is kept");
            assert_eq!(
                claim.state,
                idemwatch_engine::store::ClaimState::Sent,
                "{consumer} {message_key}: {claim:?}"
            );
            assert!(
                sent.contains(provider_key),
                "{consumer} {message_key} never reached the provider"
            );
        }
        drop(demo);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The Vehicles tab has something to show within the first minute: the demo's
    /// fleet (seeded, so this is the stream every demo starts with) flushes its first
    /// tunnel — a run of older seqs of one device right behind its newer live event —
    /// within 45 s of events (38 s), the next one 70 s in; the dashboard lists each at
    /// its next poll.
    #[test]
    fn the_first_tunnel_flushes_within_45_s() {
        let settings = DemoSettings::in_dir(Path::new("unused"));
        let mut sim = FleetSim::new(fleet_config(&settings, Utc::now()));
        let per_second = settings.events_per_second as usize;
        let msgs = sim.take_n(per_second * 45);
        let first_flush = msgs.windows(1 + MIN_TUNNEL_EVENTS as usize).position(|w| {
            let live = &w[0].envelope;
            w[1..].iter().all(|m| {
                m.kind == SimKind::Late
                    && m.envelope.device_id == live.device_id
                    && m.envelope.seq < live.seq
            })
        });
        let at = first_flush.expect("a tunnel flushed within the first 45 s of events");
        eprintln!("first tunnel flush: event {at}, {} s in", at / per_second);
        assert!(at / per_second < 45, "first flush {} s in", at / per_second);
    }
}
