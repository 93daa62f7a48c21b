//! The chaos run: several `idemwatch serve` processes competing on one queue (RabbitMQ
//! in the field) over one database and one SMS provider, SIGKILLed at random and
//! restarted while a fleet publishes events with duplicates and late arrivals.
//!
//! At the end the business tables and the provider must look as if every distinct
//! event had been handled exactly once: `trip_counters` = distinct zone exits, one SMS
//! per distinct zone exit, every vehicle's state = its newest event, every message
//! processed or dead-lettered. A process killed between its commit and its ack is the
//! field report's failure; here it happens hundreds of times, for real.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use super::{Check, DrillError, Verdict};
use crate::engine::consumers;
use crate::engine::crash::CrashPlan;
use crate::engine::envelope::EventType;
use crate::engine::metrics::Metrics;
use crate::engine::queue::Queue;
use crate::engine::runner::RunnerSettings;
use crate::engine::store::{MarkerKind, Store};
use crate::engine::{Engine, EngineConfig};
use crate::exposition::{ScrapeLimits, Scraper};
use crate::sim::fleet::{FleetConfig, FleetSim, SimKind, SimMessage};
use crate::sim::sandbox_provider;

/// An instance lives a few seconds here: a claim left by a killed process must be
/// taken over within that, not after production's 60 s.
pub const CHAOS_CLAIM_LEASE: Duration = Duration::from_secs(5);
/// Every kill returns every delivery the victim had prefetched, and RabbitMQ counts
/// each return in `x-delivery-count`: at one kill every 2 s a message can be bounced
/// ten times without ever being handled. The poison-message limit scales with it.
pub const CHAOS_MAX_DELIVERIES: u32 = 50;
/// The visibility timeout of the instances on a queue that redelivers only when it
/// runs out (JetStream's AckWait): a killed instance's deliveries come back after this,
/// not after the 30 s default. RabbitMQ requeues at the connection's death and keeps
/// the default.
pub const CHAOS_ACK_WAIT: Duration = Duration::from_secs(5);

/// When the killer strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillSchedule {
    /// One SIGKILL this often. How many kills a run gets then depends on how fast the
    /// machine gets through it.
    Every(Duration),
    /// One SIGKILL each time this many more deliveries were taken off the queues: the
    /// same number of kills on a fast machine as on a slow one, each of them while
    /// messages are still in flight.
    EveryMessages(u64),
}

impl std::fmt::Display for KillSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KillSchedule::Every(d) => write!(f, "every {}", humantime::format_duration(*d)),
            KillSchedule::EveryMessages(n) => write!(f, "every {n} deliveries"),
        }
    }
}

/// How often the killer looks at the queues when it kills by progress.
const PROGRESS_POLL: Duration = Duration::from_millis(100);

/// How to run one chaos run.
#[derive(Debug, Clone)]
pub struct ChaosOptions {
    pub instances: usize,
    pub events: usize,
    /// Share of published messages that are copies of earlier ones.
    pub dup_rate: f64,
    /// Share of fresh events held back to arrive after newer ones.
    pub late_rate: f64,
    /// When one random instance is SIGKILLed (and restarted).
    pub kill_every: KillSchedule,
    pub db_url: String,
    pub queue_url: String,
    /// The idemwatch executable to run as `serve`.
    pub exe: PathBuf,
    pub seed: u64,
    /// Messages per publish call (one batch of confirms).
    pub publish_batch: usize,
    /// Give up waiting for the queues to drain after this long.
    pub drain_timeout: Duration,
    /// Progress lines.
    pub progress: Option<mpsc::UnboundedSender<String>>,
}

impl ChaosOptions {
    pub fn new(db_url: &str, queue_url: &str, exe: PathBuf) -> Self {
        ChaosOptions {
            instances: 4,
            events: 20_000,
            dup_rate: 0.1,
            late_rate: 0.01,
            kill_every: KillSchedule::Every(Duration::from_secs(2)),
            db_url: db_url.to_string(),
            queue_url: queue_url.to_string(),
            exe,
            seed: rand::random(),
            publish_batch: 250,
            drain_timeout: Duration::from_secs(600),
            progress: None,
        }
    }
}

/// Expected against found, per consumer.
#[derive(Debug, Clone, Serialize)]
pub struct ConsumerTally {
    /// Distinct keys this consumer had to handle.
    pub expected: usize,
    /// Of those, recorded as processed (dedup row or history row).
    pub processed: usize,
    /// Of those, dead-lettered instead.
    pub dead_lettered: usize,
    /// Neither: lost.
    pub missing: usize,
}

/// What a chaos run did and found (`idemwatch chaos --json`).
#[derive(Debug, Clone, Serialize)]
pub struct ChaosReport {
    pub run_id: i64,
    pub verdict: Verdict,
    pub seed: u64,
    pub instances: usize,
    pub claim_lease_ms: u64,
    pub max_deliveries: u32,
    pub db: String,
    pub queue: String,
    pub messages_published: usize,
    pub distinct_events: usize,
    pub duplicates_published: usize,
    pub late_events: usize,
    pub vehicles: usize,
    /// `every 2s` or `every N deliveries`.
    pub kill_schedule: String,
    pub kills: u64,
    pub restarts: u64,
    pub publish_seconds: f64,
    pub duration_seconds: f64,
    pub distinct_zone_exits: usize,
    pub trip_counter_total: i64,
    pub sms_sent: usize,
    pub sms_max_per_exit: usize,
    pub distinct_ignition_offs: usize,
    pub webhooks_sent: usize,
    pub vehicles_state_ok: usize,
    pub consumers: BTreeMap<String, ConsumerTally>,
    pub dead_lettered: usize,
    /// Left over when the killing stopped and handled by a last in-process consumer.
    pub drained_after_stop: u64,
    /// Ready messages left on the queues at the very end.
    pub left_on_queues: u64,
    /// The broker's own redelivery counter over the run, where its metrics are reachable.
    pub broker_redelivered: Option<f64>,
    pub checks: Vec<Check>,
}

impl ChaosReport {
    pub fn render_text(&self) -> String {
        let mut out = format!(
            "chaos run #{} ({} instances of `idemwatch serve`, {} / {}): {}\n",
            self.run_id,
            self.instances,
            self.queue,
            self.db,
            self.verdict.as_str().to_uppercase()
        );
        out.push_str(&format!(
            "  published {} messages ({} distinct events, {} duplicates, {} late) for {} vehicles in {:.1}s\n",
            self.messages_published, self.distinct_events, self.duplicates_published,
            self.late_events, self.vehicles, self.publish_seconds
        ));
        out.push_str(&format!(
            "  {} SIGKILLs ({}), {} restarts, {:.1}s in all (claim lease {} ms, max deliveries {}); {} deliveries drained after the last kill; broker redeliveries: {}\n",
            self.kills,
            self.kill_schedule,
            self.restarts,
            self.duration_seconds,
            self.claim_lease_ms,
            self.max_deliveries,
            self.drained_after_stop,
            self.broker_redelivered
                .map(|v| format!("{v:.0}"))
                .unwrap_or_else(|| "n/a".into())
        ));
        out.push_str(&format!(
            "  zone exits: {} distinct, trip_counters {}, SMS sent {} (at most {} per exit); ignition_off: {} distinct, webhooks {}\n",
            self.distinct_zone_exits, self.trip_counter_total, self.sms_sent,
            self.sms_max_per_exit, self.distinct_ignition_offs, self.webhooks_sent
        ));
        out.push_str(&format!(
            "  vehicles whose state is their newest event: {}/{}; dead-lettered {}; left on queues {}\n",
            self.vehicles_state_ok, self.vehicles, self.dead_lettered, self.left_on_queues
        ));
        out.push_str("  consumer         expected  processed  dead-lettered  missing\n");
        for (name, t) in &self.consumers {
            out.push_str(&format!(
                "  {name:<16} {:>8} {:>10} {:>14} {:>8}\n",
                t.expected, t.processed, t.dead_lettered, t.missing
            ));
        }
        for c in &self.checks {
            out.push_str(&format!(
                "  [{}] {}: expected {}, got {}\n",
                if c.ok { "ok" } else { "FAIL" },
                c.name,
                c.expected,
                c.actual
            ));
        }
        out
    }

    pub fn exit_code(&self) -> i32 {
        if self.verdict == Verdict::Pass {
            0
        } else {
            1
        }
    }
}

fn say(opts: &ChaosOptions, line: impl Into<String>) {
    let line = line.into();
    tracing::info!("chaos: {line}");
    if let Some(p) = &opts.progress {
        let _ = p.send(line);
    }
}

fn setup(e: impl std::fmt::Display) -> DrillError {
    DrillError::Setup(e.to_string())
}

/// The ground truth of what was published.
struct Truth {
    messages: Vec<SimMessage>,
    /// Distinct keys per event type.
    keys: HashMap<EventType, HashSet<String>>,
    newest: HashMap<String, (u64, EventType)>,
    history_per_device: HashMap<String, usize>,
}

fn generate(opts: &ChaosOptions, prefix: &str) -> Truth {
    let vehicles = (opts.events / 100).clamp(1, 500);
    let mut sim = FleetSim::new(FleetConfig {
        vehicles,
        seed: opts.seed,
        redelivery_rate: opts.dup_rate,
        deploy_redelivery_rate: opts.dup_rate,
        late_rate: opts.late_rate,
        device_prefix: prefix.to_string(),
        ..FleetConfig::default()
    });
    let messages = sim.take_n(opts.events);
    let mut keys: HashMap<EventType, HashSet<String>> = HashMap::new();
    let mut newest: HashMap<String, (u64, EventType)> = HashMap::new();
    let mut distinct: HashSet<String> = HashSet::new();
    let mut history_per_device: HashMap<String, usize> = HashMap::new();
    for m in &messages {
        let e = &m.envelope;
        let key = e.key().to_string();
        keys.entry(e.event_type).or_default().insert(key.clone());
        if distinct.insert(key) {
            *history_per_device.entry(e.device_id.clone()).or_default() += 1;
        }
        let slot = newest
            .entry(e.device_id.clone())
            .or_insert((e.seq, e.event_type));
        if e.seq > slot.0 {
            *slot = (e.seq, e.event_type);
        }
    }
    Truth {
        messages,
        keys,
        newest,
        history_per_device,
    }
}

/// One `idemwatch serve` instance.
struct Instance {
    child: Option<Child>,
    args: Vec<String>,
    /// The connection URLs (see [`crate::engine::url_env`]).
    env: Vec<(&'static str, String)>,
    exe: PathBuf,
}

impl Instance {
    fn start(&mut self) -> Result<(), DrillError> {
        let child = Command::new(&self.exe)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| setup(format!("cannot start {}: {e}", self.exe.display())))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: no destructor, no ack, no goodbye to the broker.
    async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
    }
}

/// Run the chaos scenario and verify the end state.
pub async fn run(opts: ChaosOptions) -> Result<ChaosReport, DrillError> {
    if opts.instances == 0 || opts.events == 0 {
        return Err(DrillError::Usage(
            "--instances and --events must be at least 1".into(),
        ));
    }
    if !(0.0..1.0).contains(&opts.dup_rate) || !(0.0..1.0).contains(&opts.late_rate) {
        return Err(DrillError::Usage(
            "--dup-rate and --late-rate must be in [0, 1)".into(),
        ));
    }
    let started = Instant::now();
    let store = crate::engine::store::open(&opts.db_url).await?;
    let queue = crate::engine::queue::open(&opts.queue_url)
        .await
        .map_err(setup)?;
    let run_id = store.start_drill_run("chaos", "idempotent").await?;
    let salt: u32 = rand::random();
    let namespace = format!("chaos-{run_id}-{salt:08x}");
    let prefix = format!("CHAOS-{salt:08x}-");
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .map_err(|e| setup(format!("cannot start the SMS sandbox: {e}")))?;
    let sms_url = sandbox.url();
    let broker_metrics = broker_metrics_url(&opts.queue_url);
    let redelivered_before = match &broker_metrics {
        Some(u) => broker_redeliveries(u).await,
        None => None,
    };

    let truth = generate(&opts, &prefix);
    let names: Vec<&str> = consumers::FLEET_CONSUMERS.to_vec();
    say(
        &opts,
        format!(
            "chaos #{run_id}: {} messages for {} vehicles, {} instances, a SIGKILL {}",
            truth.messages.len(),
            truth.history_per_device.len(),
            opts.instances,
            opts.kill_every
        ),
    );

    let mut cfg = EngineConfig::new(&opts.db_url, &opts.queue_url, &sms_url, &sms_url);
    cfg.namespace = Some(namespace.clone());
    let publisher =
        Engine::from_parts(store.clone(), queue.clone(), Arc::new(Metrics::new()), &cfg)
            .map_err(setup)?;
    // Declare the queues before anyone consumes or publishes.
    for c in &names {
        queue.depth(&publisher.queue_name(c)).await.map_err(setup)?;
    }

    let serve_args = |_i: usize| -> Vec<String> {
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--namespace".into(),
            namespace.clone(),
            "--mode".into(),
            "idempotent".into(),
            "--claim-lease-ms".into(),
            CHAOS_CLAIM_LEASE.as_millis().to_string(),
            "--max-deliveries".into(),
            CHAOS_MAX_DELIVERIES.to_string(),
        ];
        if opts.queue_url.starts_with("nats://") {
            args.extend([
                "--visibility-ms".into(),
                CHAOS_ACK_WAIT.as_millis().to_string(),
            ]);
        }
        args
    };
    let mut instances: Vec<Instance> = (0..opts.instances)
        .map(|i| Instance {
            child: None,
            args: serve_args(i),
            env: crate::engine::url_env(&opts.db_url, &opts.queue_url, &sms_url, &sms_url)
                .map(|(k, v)| (k, v.to_string()))
                .to_vec(),
            exe: opts.exe.clone(),
        })
        .collect();
    for inst in &mut instances {
        inst.start()?;
    }

    // Publish in the background while the killer works, counting the deliveries put
    // on the queues (one per message and queue) for a killer that goes by progress.
    let bodies: Vec<Vec<u8>> = truth.messages.iter().map(|m| m.raw.clone()).collect();
    let batch = opts.publish_batch.max(1);
    let publish_started = Instant::now();
    let published = Arc::new(AtomicU64::new(0));
    let publishing = {
        let (queue, published) = (queue.clone(), published.clone());
        let queues: Vec<String> = names.iter().map(|c| publisher.queue_name(c)).collect();
        tokio::spawn(async move {
            for chunk in bodies.chunks(batch) {
                queue.publish(&queues, chunk).await?;
                published.fetch_add((chunk.len() * queues.len()) as u64, Ordering::SeqCst);
            }
            Ok::<f64, crate::engine::queue::QueueError>(publish_started.elapsed().as_secs_f64())
        })
    };

    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(opts.seed ^ 0x5eed);
    let mut kills = 0u64;
    let mut publish_seconds = None;
    let mut publishing = Some(publishing);
    let deadline = Instant::now() + opts.drain_timeout;
    let queue_names: Vec<String> = names.iter().map(|c| publisher.queue_name(c)).collect();
    let mut last_report = Instant::now();
    let (tick, mut next_kill_at) = match opts.kill_every {
        KillSchedule::Every(d) => (d, 0),
        KillSchedule::EveryMessages(n) => (PROGRESS_POLL, n.max(1)),
    };
    loop {
        tokio::time::sleep(tick).await;
        if let Some(p) = publishing.as_ref() {
            if p.is_finished() {
                let done = publishing
                    .take()
                    .ok_or_else(|| setup("publisher vanished"))?
                    .await
                    .map_err(setup)?
                    .map_err(setup)?;
                say(&opts, format!("all messages published in {done:.1}s"));
                publish_seconds = Some(done);
            }
        }
        let ready = ready_total(queue.as_ref(), &queue_names).await;
        if publishing.is_none() && ready == 0 {
            break;
        }
        if Instant::now() > deadline {
            say(&opts, "drain timeout: stopping the kills");
            break;
        }
        if let KillSchedule::EveryMessages(n) = opts.kill_every {
            // Taken off the queues: acked (embedded queue), or handed to an instance
            // (a broker's ready count does not hold its unacked deliveries).
            let taken = published.load(Ordering::SeqCst).saturating_sub(ready);
            if taken < next_kill_at {
                continue;
            }
            // Kill points passed between two looks are caught up one per look.
            next_kill_at += n.max(1);
        }
        let victim = rng.random_range(0..instances.len());
        instances[victim].kill().await;
        kills += 1;
        instances[victim].start()?;
        if last_report.elapsed() > Duration::from_secs(10) {
            say(
                &opts,
                format!("{kills} kills so far; {ready} messages ready on the queues"),
            );
            last_report = Instant::now();
        }
    }
    let publish_seconds = match (publish_seconds, publishing) {
        (Some(s), _) => s,
        (None, Some(p)) => p.await.map_err(setup)?.map_err(setup)?,
        (None, None) => 0.0,
    };
    // Let the instances finish what they hold, then the last kill of the run.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for inst in &mut instances {
        inst.kill().await;
    }
    say(&opts, format!("{kills} kills; draining what is left"));

    // Whatever the last kills left unacked comes back; one last consumer drains it.
    let drain_cfg = {
        let mut c = cfg.clone();
        c.claim_lease = CHAOS_CLAIM_LEASE;
        c.runner = RunnerSettings {
            idle_poll: Duration::from_millis(50),
            retry_delay: Duration::from_millis(250),
            max_retry_delay: CHAOS_CLAIM_LEASE,
            max_deliveries: CHAOS_MAX_DELIVERIES,
            ..RunnerSettings::default()
        };
        c
    };
    let drainer = Engine::from_parts(
        store.clone(),
        queue.clone(),
        Arc::new(Metrics::new()),
        &drain_cfg,
    )
    .map_err(setup)?;
    let drained = drainer
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .map_err(setup)?;
    let drained_after_stop =
        drained.total.processed + drained.total.duplicate_dropped + drained.total.dead_lettered;
    let left_on_queues = ready_total(queue.as_ref(), &queue_names).await;

    let broker_redelivered = match (&broker_metrics, redelivered_before) {
        (Some(u), Some(before)) => broker_redeliveries(u).await.map(|after| after - before),
        _ => None,
    };

    let report = verify(
        &opts,
        run_id,
        store.as_ref(),
        &truth,
        &prefix,
        sandbox.state(),
        VerifyExtras {
            kills,
            publish_seconds,
            drained_after_stop,
            left_on_queues,
            broker_redelivered,
            duration: started.elapsed(),
        },
    )
    .await?;

    for q in &queue_names {
        let _ = queue.remove_queue(q).await;
    }
    queue.close().await;
    let report_json = serde_json::to_value(&report).unwrap_or(Value::Null);
    store
        .finish_drill_run(run_id, report.verdict.as_str(), &report_json)
        .await?;
    store
        .add_marker(
            MarkerKind::Drill,
            &format!("chaos run: {}", report.verdict.as_str()),
            Some(&json!({"run_id": run_id, "kills": kills}).to_string()),
        )
        .await?;
    let _ = sandbox.shutdown().await;
    Ok(report)
}

struct VerifyExtras {
    kills: u64,
    publish_seconds: f64,
    drained_after_stop: u64,
    left_on_queues: u64,
    broker_redelivered: Option<f64>,
    duration: Duration,
}

async fn ready_total(queue: &dyn Queue, names: &[String]) -> u64 {
    let mut total = 0;
    for n in names {
        match queue.depth(n).await {
            Ok(d) => total += d.ready + d.in_flight,
            // Unknown is not empty.
            Err(_) => total += 1,
        }
    }
    total
}

async fn verify(
    opts: &ChaosOptions,
    run_id: i64,
    store: &dyn Store,
    truth: &Truth,
    prefix: &str,
    sandbox: &sandbox_provider::SandboxState,
    x: VerifyExtras,
) -> Result<ChaosReport, DrillError> {
    let empty = HashSet::new();
    let keys_of = |t: EventType| truth.keys.get(&t).unwrap_or(&empty);
    let zone_exits = keys_of(EventType::ZoneExit);
    let ignition_offs = keys_of(EventType::IgnitionOff);

    // Dead letters of this run (their raw bytes name our devices).
    let dead: Vec<_> = store
        .dead_letters(100_000)
        .await?
        .into_iter()
        .filter(|d| String::from_utf8_lossy(&d.raw).contains(prefix))
        .collect();
    let mut dead_keys: HashMap<String, HashSet<String>> = HashMap::new();
    for d in &dead {
        if let Ok(env) = crate::engine::envelope::Envelope::parse(&d.raw) {
            dead_keys
                .entry(d.consumer.clone())
                .or_default()
                .insert(env.key().to_string());
        }
    }

    let mut tallies = BTreeMap::new();
    for (consumer, wanted) in [
        (consumers::trip_counter::NAME, zone_exits),
        (consumers::zone_exit_sms::NAME, zone_exits),
        (consumers::erp_webhook::NAME, ignition_offs),
    ] {
        let processed: HashSet<String> = store
            .processed_keys(consumer, prefix)
            .await?
            .into_iter()
            .collect();
        let dl = dead_keys.get(consumer).unwrap_or(&empty);
        let p = wanted.intersection(&processed).count();
        let d = wanted
            .difference(&processed)
            .filter(|k| dl.contains(*k))
            .count();
        tallies.insert(
            consumer.to_string(),
            ConsumerTally {
                expected: wanted.len(),
                processed: p,
                dead_lettered: d,
                missing: wanted.len() - p - d,
            },
        );
    }

    // vehicle-state: history holds every distinct event; state = newest event.
    let mut trip_total = 0;
    let mut state_ok = 0;
    let mut history_found = 0;
    let mut history_expected = 0;
    let mut wrong_states = Vec::new();
    for (device, (seq, event_type)) in &truth.newest {
        trip_total += store.zone_exits(device).await?;
        let expected_rows = truth.history_per_device.get(device).copied().unwrap_or(0);
        history_expected += expected_rows;
        history_found += store
            .vehicle_history(device)
            .await?
            .len()
            .min(expected_rows);
        match store.vehicle_state(device).await? {
            Some(s)
                if u64::try_from(s.last_seq).ok() == Some(*seq)
                    && s.last_event_type == event_type.as_str() =>
            {
                state_ok += 1
            }
            other => wrong_states.push(json!({
                "device": device,
                "expected": [seq, event_type.as_str()],
                "found": other.map(|s| (s.last_seq, s.last_event_type)),
            })),
        }
    }
    let vs_dead = dead_keys
        .get(consumers::vehicle_state::NAME)
        .map_or(0, HashSet::len);
    tallies.insert(
        consumers::vehicle_state::NAME.to_string(),
        ConsumerTally {
            expected: history_expected,
            processed: history_found,
            dead_lettered: vs_dead.min(history_expected - history_found),
            missing: history_expected
                - history_found
                - vs_dead.min(history_expected - history_found),
        },
    );

    let sms: Vec<_> = sandbox
        .sent_sms()
        .into_iter()
        .filter(|s| s.text.contains(prefix))
        .collect();
    let mut per_text: HashMap<&str, usize> = HashMap::new();
    for s in &sms {
        *per_text.entry(s.text.as_str()).or_default() += 1;
    }
    let sms_max = per_text.values().copied().max().unwrap_or(0);
    let webhooks = sandbox
        .sent_erp()
        .into_iter()
        .filter(|w| {
            w.body
                .get("device_id")
                .and_then(Value::as_str)
                .is_some_and(|d| d.starts_with(prefix))
        })
        .count();

    let distinct_events: usize = truth.history_per_device.values().sum();
    let duplicates = truth
        .messages
        .iter()
        .filter(|m| m.kind == SimKind::Redelivery)
        .count();
    let late = truth
        .messages
        .iter()
        .filter(|m| m.kind == SimKind::Late)
        .count();
    let missing_total: usize = tallies.values().map(|t| t.missing).sum();

    let mut checks = Vec::new();
    let mut check = |name: &str, expected: Value, actual: Value| {
        let ok = expected == actual;
        checks.push(Check {
            name: name.to_string(),
            expected,
            actual,
            ok,
        });
    };
    check(
        "trip_counters = distinct zone exits",
        json!(zone_exits.len()),
        json!(trip_total),
    );
    check(
        "SMS sent = distinct zone exits",
        json!(zone_exits.len()),
        json!(sms.len()),
    );
    check(
        "at most one SMS per zone exit",
        json!(zone_exits.len().min(1)),
        json!(sms_max),
    );
    check(
        "webhooks sent = distinct ignition_off",
        json!(ignition_offs.len()),
        json!(webhooks),
    );
    check(
        "vehicles whose state is their newest event",
        json!(truth.newest.len()),
        json!(state_ok),
    );
    check(
        "messages neither processed nor dead-lettered",
        json!(0),
        json!(missing_total),
    );
    check(
        "messages left on the queues",
        json!(0),
        json!(x.left_on_queues),
    );
    let verdict = if checks.iter().all(|c| c.ok) {
        Verdict::Pass
    } else {
        Verdict::Fail
    };
    if !wrong_states.is_empty() {
        tracing::warn!(wrong = %json!(wrong_states.iter().take(10).collect::<Vec<_>>()), "vehicle states off");
    }
    Ok(ChaosReport {
        run_id,
        verdict,
        seed: opts.seed,
        instances: opts.instances,
        claim_lease_ms: u64::try_from(CHAOS_CLAIM_LEASE.as_millis()).unwrap_or(u64::MAX),
        max_deliveries: CHAOS_MAX_DELIVERIES,
        db: crate::engine::store::redact_url(&opts.db_url),
        queue: crate::engine::store::redact_url(&opts.queue_url),
        messages_published: truth.messages.len(),
        distinct_events,
        duplicates_published: duplicates,
        late_events: late,
        vehicles: truth.newest.len(),
        kill_schedule: opts.kill_every.to_string(),
        kills: x.kills,
        restarts: x.kills,
        publish_seconds: x.publish_seconds,
        duration_seconds: x.duration.as_secs_f64(),
        distinct_zone_exits: zone_exits.len(),
        trip_counter_total: trip_total,
        sms_sent: sms.len(),
        sms_max_per_exit: sms_max,
        distinct_ignition_offs: ignition_offs.len(),
        webhooks_sent: webhooks,
        vehicles_state_ok: state_ok,
        consumers: tallies,
        dead_lettered: dead.len(),
        drained_after_stop: x.drained_after_stop,
        left_on_queues: x.left_on_queues,
        broker_redelivered: x.broker_redelivered,
        checks,
    })
}

/// Where a RabbitMQ broker serves Prometheus metrics: its host, port 15692
/// (`IDEMWATCH_BROKER_METRICS_URL` overrides). Only for `amqp://` queues.
fn broker_metrics_url(queue_url: &str) -> Option<String> {
    if let Ok(u) = std::env::var("IDEMWATCH_BROKER_METRICS_URL") {
        return Some(u);
    }
    let u = url::Url::parse(queue_url).ok()?;
    if !u.scheme().starts_with("amqp") {
        return None;
    }
    Some(format!("http://{}:15692/metrics", u.host_str()?))
}

/// `rabbitmq_global_messages_redelivered_total`, summed over protocols and queue types.
async fn broker_redeliveries(url: &str) -> Option<f64> {
    let exposition = Scraper::new(Duration::from_secs(3), ScrapeLimits::default())
        .ok()?
        .exposition(url)
        .await
        .ok()?;
    let mut sum = None;
    for s in exposition.named("rabbitmq_global_messages_redelivered_total") {
        *sum.get_or_insert(0.0) += s.value;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_metrics_follow_the_queue_host() {
        if std::env::var("IDEMWATCH_BROKER_METRICS_URL").is_ok() {
            return;
        }
        assert_eq!(
            broker_metrics_url("amqp://guest:guest@10.0.0.7:5672/%2f").as_deref(),
            Some("http://10.0.0.7:15692/metrics")
        );
        assert_eq!(broker_metrics_url("sqlite:///tmp/q.db"), None);
    }

    #[test]
    fn generated_truth_counts_duplicates_once() {
        let mut o = ChaosOptions::new("sqlite://x", "sqlite://y", PathBuf::from("idemwatch"));
        o.events = 2_000;
        o.seed = 7;
        let t = generate(&o, "CHAOS-T-");
        let dups = t
            .messages
            .iter()
            .filter(|m| m.kind == SimKind::Redelivery)
            .count();
        assert!(dups > 100, "about 10 % duplicates, got {dups}");
        let distinct: usize = t.history_per_device.values().sum();
        assert_eq!(distinct + dups, t.messages.len());
    }
}
