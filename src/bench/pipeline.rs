//! `bench pipeline`: the fleet trace through all four consumers until every queue is
//! drained, against a raw baseline doing the same statements with the same
//! durability in the same process.
//!
//! `bench engine` measures one consumer; a user runs four, fed by one trace in which
//! most events concern only one or two of them. This bench is what `consume` does to a
//! user's backlog, timed:
//!
//! - **engine**: the simulator's fleet trace (the same generator as `simulate`)
//!   published to every consumer's queue while the four real consumers, one worker
//!   each with `consume`'s settings, drain them; the SMS and webhook calls go to a
//!   real in-process sandbox provider answering after `--provider-latency` (give or
//!   take a quarter). Per consumer: messages per second from the first publish to its
//!   last ack; overall: the trace over the time until the slowest consumer is done;
//!   publish-to-ack latency of every delivery; the process's peak RSS; the SMS the
//!   sandbox really sent against the distinct zone exits of the trace.
//! - **raw**: the same trace (on fresh device ids) as the store calls the four
//!   consumers make, four tasks at once in batches of `--batch` deliveries:
//!   `apply_vehicle_batch`; `record_batch` of the zone exits; `claim_batch` then
//!   `finish_batch` of the zone exits with a phone and of the ignition-offs. No queue,
//!   no parsing, no provider: the database's share of the pipeline.
//! - **raw, SQLite's C API** (SQLite only, `super::rusqlite_raw`): the same work
//!   through rusqlite, prepared cached statements, the store's pragmas.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::watch;

use crate::engine::consumers::{claim_request, FLEET_CONSUMERS};
use crate::engine::consumers::{erp_webhook, trip_counter, vehicle_state, zone_exit_sms};
use crate::engine::crash::CrashPlan;
use crate::engine::envelope::{Envelope, EventType, Message};
use crate::engine::runner::{DeliveryEvent, DeliveryOutcome, EventSink, RunnerSettings};
use crate::engine::store::{
    self, BusinessWrite, ClaimFinish, ClaimOutcome, ClaimRequest, ClaimResult, ClaimState,
    Durability, Recordable, Store,
};
use crate::engine::{Engine, EngineConfig};
use crate::sim::fleet::{FleetConfig, FleetSim};
use crate::sim::sandbox_provider::{self, SandboxState};

use super::{cpu_seconds, peak_rss_mib, rss_mib, BenchError, RawRunFigures};

/// What to measure.
#[derive(Debug, Clone)]
pub struct PipelineBenchPlan {
    pub db_url: String,
    /// The engine's queue (default: an embedded queue in a scratch file).
    pub queue_url: Option<String>,
    pub messages: usize,
    pub vehicles: usize,
    /// The trace's share of redeliveries (`simulate --redelivery-rate`).
    pub redelivery_rate: f64,
    pub seed: u64,
    /// How long the sandbox provider takes to answer a call (± a quarter).
    pub provider_latency: Duration,
    /// Provider calls in flight per side-effect consumer (`--provider-concurrency`).
    pub provider_concurrency: usize,
    /// Messages published per second; `None`: as fast as the queue takes them (a
    /// backlog, as after an outage or on a deploy day).
    pub publish_rate: Option<f64>,
    /// `consume`'s runner settings (batch, prefetch, pipelining).
    pub runner: RunnerSettings,
    pub durability: Durability,
    /// Raw/engine rounds; the round with the median engine/raw ratio is reported.
    pub runs: usize,
    /// Give up on an engine run that has not drained after this long.
    pub timeout: Duration,
}

/// What the trace holds.
#[derive(Debug, Clone, Serialize)]
pub struct TraceFigures {
    pub messages: usize,
    pub vehicles: usize,
    pub redeliveries: usize,
    pub zone_exits: usize,
    pub ignition_offs: usize,
    /// Distinct zone exits with a phone: the SMS a correct pipeline sends, once each.
    pub sms_expected: usize,
    /// Distinct ignition-offs: the webhooks a correct pipeline sends, once each.
    pub webhooks_expected: usize,
}

/// One consumer's part of an engine run.
#[derive(Debug, Clone, Serialize)]
pub struct ConsumerFigures {
    pub consumer: String,
    /// Deliveries settled (acked): every message of the trace, once each.
    pub messages: usize,
    /// From the first publish to this consumer's last settled delivery.
    pub seconds: f64,
    pub messages_per_second: f64,
    /// Publish-to-ack of this consumer's deliveries.
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub processed: u64,
    pub duplicates: u64,
    pub dead_lettered: u64,
    /// Deliveries given back to come again (a key twice in one batch, a busy claim).
    pub retries: usize,
}

/// The engine's run.
#[derive(Debug, Clone, Serialize)]
pub struct EngineRunFigures {
    /// From the first publish until the slowest consumer settled its last delivery.
    pub seconds: f64,
    /// The trace's messages over `seconds`: what a user's backlog drains at.
    pub messages_per_second: f64,
    /// How long publishing the trace took (it runs beside the consumers).
    pub publish_seconds: f64,
    /// Publish-to-ack over every delivery of every consumer.
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// CPU of this process (engine, publisher and in-process sandbox) per message.
    pub cpu_us_per_message: f64,
    /// The process's peak RSS during the engine run (`VmHWM`, reset before it): the
    /// engine's and the bench's own data together.
    pub peak_rss_mib: f64,
    /// The process's RSS just before the engine opened: the bench's own data (the
    /// trace's bodies and keys, the baselines' traces, the sandbox provider, the
    /// latency tally sized for every delivery, what the raw runs left to the
    /// allocator).
    pub bench_rss_mib: f64,
    /// `peak_rss_mib - bench_rss_mib`: what the engine (queue, store, four consumers)
    /// added at its peak.
    pub engine_rss_mib: f64,
    pub consumers: Vec<ConsumerFigures>,
    /// SMS the sandbox really sent (each distinct provider key once).
    pub sms_sent: usize,
    /// Sent SMS over the time the SMS consumer took.
    pub sms_per_second: f64,
    pub webhooks_sent: usize,
    pub webhooks_per_second: f64,
    /// Every expected SMS and webhook sent, none twice.
    pub exactly_once: bool,
    /// The most provider calls (SMS and webhooks) the sandbox answered at once.
    pub provider_peak_in_flight: usize,
}

/// One round: the engine and its baselines on the same trace (fresh device ids each).
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    pub engine_messages_per_second: f64,
    pub raw_messages_per_second: f64,
    pub ratio: f64,
    pub raw_rusqlite_messages_per_second: Option<f64>,
    pub ratio_rusqlite: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PipelineBenchReport {
    pub db: String,
    pub backend: String,
    pub durability: String,
    pub queue: String,
    pub batch: usize,
    pub lease_size: usize,
    /// The most deliveries a batch gathers across leases (`null`: off).
    pub gather: Option<usize>,
    pub provider_latency_ms: f64,
    pub provider_concurrency: usize,
    /// Messages per second published; `null`: as fast as the queue takes them.
    pub publish_rate: Option<f64>,
    pub trace: TraceFigures,
    /// The round with the median engine/raw ratio.
    pub engine: EngineRunFigures,
    pub raw: RawRunFigures,
    /// Engine messages/s ÷ raw messages/s (the median round's).
    pub ratio: f64,
    /// The same work through SQLite's C API (SQLite only).
    pub raw_rusqlite: Option<RawRunFigures>,
    pub ratio_rusqlite: Option<f64>,
    pub rounds: Vec<Round>,
    /// `/proc/loadavg` when the bench started and ended: the machine's load, which
    /// the absolute figures depend on (the ratios less).
    pub load_average_start: Option<[f64; 3]>,
    pub load_average_end: Option<[f64; 3]>,
}

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Run(e.to_string())
}

/// The 1, 5 and 15-minute load averages.
pub fn load_average() -> Option<[f64; 3]> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut f = s.split_whitespace().map(|x| x.parse::<f64>().ok());
    Some([f.next()??, f.next()??, f.next()??])
}

/// Reset `VmHWM` to the current RSS (Linux: `5` into `/proc/self/clear_refs`), so
/// the peak read after a run is that run's.
fn reset_peak_rss() {
    if let Err(e) = std::fs::write("/proc/self/clear_refs", "5") {
        tracing::debug!(error = %e, "peak RSS not reset: it covers the whole process");
    }
}

/// The fleet trace with device ids under `prefix`: the same events for every prefix.
pub fn fleet_trace(plan: &PipelineBenchPlan, prefix: &str) -> Vec<crate::sim::fleet::SimMessage> {
    let mut sim = FleetSim::new(FleetConfig {
        vehicles: plan.vehicles,
        seed: plan.seed,
        redelivery_rate: plan.redelivery_rate,
        device_prefix: prefix.to_string(),
        ..FleetConfig::default()
    });
    sim.take_n(plan.messages)
}

fn trace_figures(plan: &PipelineBenchPlan, envs: &[Envelope]) -> TraceFigures {
    use std::collections::HashSet;
    let distinct = |f: &dyn Fn(&Envelope) -> bool| {
        envs.iter()
            .filter(|e| f(e))
            .map(Envelope::key)
            .collect::<HashSet<_>>()
            .len()
    };
    let keys = envs.iter().map(Envelope::key).collect::<HashSet<_>>().len();
    TraceFigures {
        messages: envs.len(),
        vehicles: plan.vehicles,
        redeliveries: envs.len() - keys,
        zone_exits: envs
            .iter()
            .filter(|e| e.event_type == EventType::ZoneExit)
            .count(),
        ignition_offs: envs
            .iter()
            .filter(|e| e.event_type == EventType::IgnitionOff)
            .count(),
        sms_expected: distinct(&|e| e.event_type == EventType::ZoneExit && e.phone().is_some()),
        webhooks_expected: distinct(&|e| e.event_type == EventType::IgnitionOff),
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Per consumer: when each key was published (a FIFO per key: a redelivered copy is
/// published again), and what its deliveries came to.
#[derive(Default)]
struct Tally {
    published: HashMap<String, VecDeque<Instant>>,
    latencies_ms: Vec<f64>,
    settled: usize,
    retries: usize,
    last: Option<Instant>,
}

impl Tally {
    /// A tally with room for every delivery of `keys` (one publish each, and the
    /// redeliveries' second), allocated before the engine run.
    fn sized(keys: &[String]) -> Self {
        let mut published: HashMap<String, VecDeque<Instant>> = HashMap::with_capacity(keys.len());
        for k in keys {
            published
                .entry(k.clone())
                .or_insert_with(|| VecDeque::with_capacity(2));
        }
        Tally {
            published,
            latencies_ms: Vec::with_capacity(keys.len()),
            ..Tally::default()
        }
    }
}

/// Every consumer's tally, and the signal that all of them settled every message.
struct Watcher {
    consumers: Vec<&'static str>,
    tallies: Vec<Mutex<Tally>>,
    expected: usize,
    done: AtomicUsize,
    stop: watch::Sender<bool>,
}

impl Watcher {
    fn published(&self, keys: &[String], at: Instant) {
        for tally in &self.tallies {
            if let Ok(mut t) = tally.lock() {
                for k in keys {
                    t.published.entry(k.clone()).or_default().push_back(at);
                }
            }
        }
    }

    fn delivered(&self, e: &DeliveryEvent) {
        let Some(i) = self.consumers.iter().position(|c| *c == e.consumer) else {
            return;
        };
        let Ok(mut t) = self.tallies[i].lock() else {
            return;
        };
        if e.outcome == DeliveryOutcome::Retry {
            t.retries += 1;
            return;
        }
        let now = Instant::now();
        if let Some(at) = e
            .key
            .as_ref()
            .and_then(|k| t.published.get_mut(k.as_str()))
            .and_then(VecDeque::pop_front)
        {
            t.latencies_ms.push((now - at).as_secs_f64() * 1000.0);
        }
        t.settled += 1;
        t.last = Some(now);
        if t.settled == self.expected
            && self.done.fetch_add(1, Ordering::SeqCst) + 1 == self.consumers.len()
        {
            let _ = self.stop.send(true);
        }
    }
}

/// The engine: publish the trace while the four consumers drain it.
async fn engine_run(
    plan: &PipelineBenchPlan,
    bodies: Vec<Vec<u8>>,
    keys: Vec<String>,
    trace: &TraceFigures,
    sandbox: &SandboxState,
    sandbox_url: &str,
    scratch: &std::path::Path,
) -> Result<EngineRunFigures, BenchError> {
    let queue_url = plan
        .queue_url
        .clone()
        .unwrap_or_else(|| format!("sqlite://{}", scratch.join("bench-queue.db").display()));
    // The bench's own data, counted before the engine opens: the tally sized up
    // front for every delivery it will time, so that its growth does not pass for
    // the engine's.
    let names = FLEET_CONSUMERS.to_vec();
    let (stop, stopped) = watch::channel(false);
    let watcher = Arc::new(Watcher {
        tallies: names
            .iter()
            .map(|_| Mutex::new(Tally::sized(&keys)))
            .collect(),
        consumers: names.clone(),
        expected: bodies.len(),
        done: AtomicUsize::new(0),
        stop,
    });
    reset_peak_rss();
    let bench_rss_mib = rss_mib();
    let mut cfg = EngineConfig::new(&plan.db_url, &queue_url, sandbox_url, sandbox_url);
    cfg.durability = plan.durability;
    cfg.namespace = Some(format!("bench-pipeline-{:08x}", rand::random::<u32>()));
    cfg.runner = plan.runner.clone();
    cfg.provider_concurrency = plan.provider_concurrency.max(1);
    let engine = Arc::new(Engine::open(&cfg).await.map_err(err)?);
    if engine.consumer_names() != names {
        return Err(BenchError::Run(format!(
            "the engine runs {:?}, the bench times {names:?}",
            engine.consumer_names()
        )));
    }
    let sink: EventSink = {
        let watcher = watcher.clone();
        Arc::new(move |e| watcher.delivered(&e))
    };
    let workers = names
        .iter()
        .map(|c| engine.worker(c, Arc::new(CrashPlan::none()), Some(sink.clone())))
        .collect::<Result<Vec<_>, _>>()
        .map_err(err)?;
    let sent_before = (sandbox.sent_sms().len(), sandbox.sent_erp().len());
    let (started, cpu0) = (Instant::now(), cpu_seconds());
    let publisher = {
        let (engine, watcher, rate) = (engine.clone(), watcher.clone(), plan.publish_rate);
        async move {
            const CHUNK: usize = 500;
            for (i, (chunk, chunk_keys)) in bodies.chunks(CHUNK).zip(keys.chunks(CHUNK)).enumerate()
            {
                if let Some(rate) = rate.filter(|r| *r > 0.0) {
                    let due = started + Duration::from_secs_f64((i * CHUNK) as f64 / rate);
                    tokio::time::sleep_until(due.into()).await;
                }
                watcher.published(chunk_keys, Instant::now());
                engine.publish(chunk).await?;
            }
            Ok::<_, crate::engine::EngineError>(started.elapsed().as_secs_f64())
        }
    };
    let consumers = futures::future::join_all(workers.iter().map(|w| w.run(stopped.clone())));
    let drained =
        tokio::time::timeout(plan.timeout, async { tokio::join!(publisher, consumers) }).await;
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let peak_rss_mib = peak_rss_mib();
    let (published, results) = match drained {
        Ok(r) => r,
        Err(_) => {
            let settled: Vec<String> = names
                .iter()
                .zip(&watcher.tallies)
                .map(|(c, t)| format!("{c} {}", t.lock().map(|t| t.settled).unwrap_or(0)))
                .collect();
            return Err(BenchError::Run(format!(
                "the pipeline did not drain {} messages within {:?} (settled: {})",
                watcher.expected,
                plan.timeout,
                settled.join(", ")
            )));
        }
    };
    let publish_seconds = published.map_err(err)?;
    for r in results {
        r.map_err(err)?;
    }
    for c in &names {
        if let Err(e) = engine.queue.remove_queue(&engine.queue_name(c)).await {
            tracing::warn!(error = %e, "bench queue not removed");
        }
    }
    engine.queue.close().await;
    let mut all = Vec::new();
    let mut consumers = Vec::new();
    let mut took: HashMap<&str, f64> = HashMap::new();
    for (name, tally) in names.iter().zip(&watcher.tallies) {
        let mut t = tally.lock().map_err(err)?;
        let took_s = t.last.map_or(seconds, |l| (l - started).as_secs_f64());
        took.insert(name, took_s);
        t.latencies_ms.sort_by(|a, b| a.total_cmp(b));
        all.extend_from_slice(&t.latencies_ms);
        let counts = engine.metrics.counts(name);
        consumers.push(ConsumerFigures {
            consumer: name.to_string(),
            messages: t.settled,
            seconds: took_s,
            messages_per_second: t.settled as f64 / took_s.max(1e-9),
            p50_ms: percentile(&t.latencies_ms, 0.5),
            p99_ms: percentile(&t.latencies_ms, 0.99),
            processed: counts.processed,
            duplicates: counts.duplicate_dropped,
            dead_lettered: counts.dead_lettered,
            retries: t.retries,
        });
    }
    all.sort_by(|a, b| a.total_cmp(b));
    let slowest = took.values().copied().fold(0.0, f64::max);
    let sms = sandbox.sent_sms();
    let erp = sandbox.sent_erp();
    let distinct = |keys: Vec<Option<String>>| {
        keys.into_iter()
            .collect::<std::collections::HashSet<_>>()
            .len()
    };
    let sms_sent = sms.len() - sent_before.0;
    let webhooks_sent = erp.len() - sent_before.1;
    let sms_keys = distinct(
        sms[sent_before.0..]
            .iter()
            .map(|s| s.idempotency_key.clone())
            .collect(),
    );
    let erp_keys = distinct(
        erp[sent_before.1..]
            .iter()
            .map(|s| s.idempotency_key.clone())
            .collect(),
    );
    let per_second = |n: usize, consumer: &str| {
        n as f64 / took.get(consumer).copied().unwrap_or(seconds).max(1e-9)
    };
    Ok(EngineRunFigures {
        seconds: slowest,
        messages_per_second: trace.messages as f64 / slowest.max(1e-9),
        publish_seconds,
        p50_ms: percentile(&all, 0.5),
        p99_ms: percentile(&all, 0.99),
        cpu_us_per_message: cpu * 1e6 / trace.messages.max(1) as f64,
        peak_rss_mib,
        bench_rss_mib,
        engine_rss_mib: (peak_rss_mib - bench_rss_mib).max(0.0),
        consumers,
        sms_per_second: per_second(sms_sent, zone_exit_sms::NAME),
        webhooks_per_second: per_second(webhooks_sent, erp_webhook::NAME),
        exactly_once: sms_sent == trace.sms_expected
            && sms_keys == sms_sent
            && webhooks_sent == trace.webhooks_expected
            && erp_keys == webhooks_sent,
        sms_sent,
        webhooks_sent,
        provider_peak_in_flight: sandbox.peak_in_flight(),
    })
}

/// One side-effect consumer's raw work for a batch: claim, then "sent" for every
/// claim taken. Returns the transactions it committed.
async fn raw_side_effects(
    store: &dyn Store,
    consumer: &'static str,
    envs: &[&Message],
    lease: Duration,
) -> Result<usize, store::StoreError> {
    if envs.is_empty() {
        return Ok(0);
    }
    let requests: Vec<ClaimRequest> = envs
        .iter()
        .map(|env| claim_request(consumer, env))
        .collect();
    let claims = store.claim_batch(consumer, &requests, lease).await?;
    let results: Vec<ClaimResult> = claims
        .iter()
        .zip(&requests)
        .filter_map(|(c, r)| match c {
            ClaimOutcome::Fresh(c) | ClaimOutcome::InDoubt(c) | ClaimOutcome::Released(c) => {
                Some((c.attempts, r))
            }
            _ => None,
        })
        .map(|(attempts, r)| {
            let sent = ClaimFinish::Done {
                state: ClaimState::Sent,
                detail: "sent (200)".into(),
            };
            ClaimResult::owned(r.key.clone(), sent, attempts)
        })
        .collect();
    if results.is_empty() {
        return Ok(1);
    }
    store.finish_batch(consumer, &results).await?;
    Ok(2)
}

/// The raw baseline through the store (sqlx): the four consumers' statements at once.
async fn raw_run(
    plan: &PipelineBenchPlan,
    envs: Arc<Vec<Message>>,
) -> Result<RawRunFigures, BenchError> {
    let store = store::open_with_edge_durability(&plan.db_url, plan.durability)
        .await
        .map_err(err)?
        .store;
    let batch = plan.runner.batch();
    let lease = Duration::from_secs(60);
    let (started, cpu0) = (Instant::now(), cpu_seconds());
    let tasks = FLEET_CONSUMERS.iter().map(|&consumer| {
        let (store, envs) = (store.clone(), envs.clone());
        async move {
            let mut transactions = 0;
            for chunk in envs.chunks(batch) {
                match consumer {
                    vehicle_state::NAME => {
                        store.apply_vehicle_batch(chunk).await?;
                        transactions += 1;
                    }
                    trip_counter::NAME => {
                        let items: Vec<Recordable> = chunk
                            .iter()
                            .filter(|e| e.event_type == EventType::ZoneExit)
                            .map(|e| Recordable {
                                key: e.key().clone(),
                                fingerprint: e.fingerprint().clone(),
                                write: BusinessWrite::CountZoneExit {
                                    device_id: e.device_id.clone(),
                                },
                            })
                            .collect();
                        if !items.is_empty() {
                            store.record_batch(consumer, &items).await?;
                            transactions += 1;
                        }
                    }
                    zone_exit_sms::NAME => {
                        let mine: Vec<&Message> = chunk
                            .iter()
                            .filter(|e| e.event_type == EventType::ZoneExit && e.phone().is_some())
                            .collect();
                        transactions +=
                            raw_side_effects(store.as_ref(), consumer, &mine, lease).await?;
                    }
                    _ => {
                        let mine: Vec<&Message> = chunk
                            .iter()
                            .filter(|e| e.event_type == EventType::IgnitionOff)
                            .collect();
                        transactions +=
                            raw_side_effects(store.as_ref(), consumer, &mine, lease).await?;
                    }
                }
            }
            Ok::<_, store::StoreError>((consumer, started.elapsed().as_secs_f64(), transactions))
        }
    });
    let results = futures::future::join_all(tasks).await;
    RawRunFigures::of(
        envs.len(),
        started.elapsed().as_secs_f64(),
        cpu_seconds() - cpu0,
        results,
    )
}

/// Parsed envelopes of a trace, its raw bodies and its keys.
fn prepared(
    messages: Vec<crate::sim::fleet::SimMessage>,
) -> (Vec<Envelope>, Vec<Vec<u8>>, Vec<String>) {
    let mut envs = Vec::with_capacity(messages.len());
    let mut bodies = Vec::with_capacity(messages.len());
    let mut keys = Vec::with_capacity(messages.len());
    for m in messages {
        keys.push(m.envelope.key().as_str().to_string());
        envs.push(m.envelope);
        bodies.push(m.raw);
    }
    (envs, bodies, keys)
}

/// Run `plan.runs` rounds (engine and baselines, alternating which goes first) and
/// report the median one.
pub async fn run(plan: &PipelineBenchPlan) -> Result<PipelineBenchReport, BenchError> {
    if plan.messages == 0 || plan.runs == 0 || !(0.0..1.0).contains(&plan.redelivery_rate) {
        return Err(BenchError::Usage(
            "--messages and --runs must be > 0 and --redelivery-rate in [0, 1)".into(),
        ));
    }
    plan.durability
        .check_url(&plan.db_url)
        .map_err(|e| BenchError::Usage(e.to_string()))?;
    let load_average_start = load_average();
    let sandbox = SandboxState::new();
    sandbox.set_latency(plan.provider_latency);
    let provider = sandbox_provider::spawn_with_state(([127, 0, 0, 1], 0).into(), sandbox.clone())
        .await
        .map_err(err)?;
    let store = store::open_with_edge_durability(&plan.db_url, plan.durability)
        .await
        .map_err(err)?
        .store;
    let sqlite_path = match store.backend() {
        store::Backend::Sqlite => Some(super::rusqlite_raw::sqlite_path(&plan.db_url)),
        _ => None,
    };
    let provider_url = provider.url();
    let mut rounds = Vec::with_capacity(plan.runs);
    let mut figures = Vec::with_capacity(plan.runs);
    let mut trace_seen = None;
    for i in 0..plan.runs {
        let tag = format!("{:06x}", rand::random::<u32>() & 0xff_ffff);
        let scratch = tempfile::tempdir().map_err(err)?;
        let (envs, bodies, keys) = prepared(fleet_trace(plan, &format!("PE{tag}-")));
        let trace = trace_figures(plan, &envs);
        // Parsed with their identity, as the engine's runner hands them to a consumer.
        let raw_envs: Arc<Vec<Message>> = Arc::new(
            prepared(fleet_trace(plan, &format!("PR{tag}-")))
                .0
                .into_iter()
                .map(Message::new)
                .collect(),
        );
        let q_envs = prepared(fleet_trace(plan, &format!("PQ{tag}-"))).0;
        drop(envs);
        let run_engine = || {
            engine_run(
                plan,
                bodies.clone(),
                keys.clone(),
                &trace,
                &sandbox,
                &provider_url,
                scratch.path(),
            )
        };
        let (engine, raw) = if i % 2 == 0 {
            let engine = run_engine().await?;
            (engine, raw_run(plan, raw_envs.clone()).await?)
        } else {
            let raw = raw_run(plan, raw_envs.clone()).await?;
            (run_engine().await?, raw)
        };
        let rusqlite = match &sqlite_path {
            Some(path) => Some(
                super::rusqlite_raw::pipeline(
                    path.clone(),
                    plan.durability,
                    plan.runner.batch(),
                    q_envs,
                )
                .await?,
            ),
            None => None,
        };
        let ratio = engine.messages_per_second / raw.messages_per_second.max(1e-9);
        let ratio_rusqlite = rusqlite
            .as_ref()
            .map(|q| engine.messages_per_second / q.messages_per_second.max(1e-9));
        rounds.push(Round {
            engine_messages_per_second: engine.messages_per_second,
            raw_messages_per_second: raw.messages_per_second,
            ratio,
            raw_rusqlite_messages_per_second: rusqlite.as_ref().map(|q| q.messages_per_second),
            ratio_rusqlite,
        });
        figures.push((engine, raw, rusqlite));
        trace_seen = Some(trace);
    }
    drop(provider);
    let mut order: Vec<usize> = (0..rounds.len()).collect();
    order.sort_by(|&a, &b| rounds[a].ratio.total_cmp(&rounds[b].ratio));
    let median = order[order.len() / 2];
    let (engine, raw, raw_rusqlite) = figures.swap_remove(median);
    let durability = format!(
        "{}{}",
        super::durability_words(store.as_ref()),
        if plan.queue_url.is_none() {
            "; embedded queue: publishes FULL, leases/acks NORMAL"
        } else {
            ""
        }
    );
    let queue = match &plan.queue_url {
        Some(url) => store::redact_url(url),
        None => "embedded SQLite queue in a scratch file".into(),
    };
    Ok(PipelineBenchReport {
        db: store.redacted_url(),
        backend: format!("{:?}", store.backend()).to_lowercase(),
        durability,
        queue,
        batch: plan.runner.batch(),
        lease_size: plan.runner.lease_size(),
        gather: plan.runner.gather_limit(),
        provider_latency_ms: plan.provider_latency.as_secs_f64() * 1000.0,
        provider_concurrency: plan.provider_concurrency,
        publish_rate: plan.publish_rate,
        trace: trace_seen.ok_or_else(|| BenchError::Run("no round ran".into()))?,
        ratio: rounds[median].ratio,
        ratio_rusqlite: rounds[median].ratio_rusqlite,
        engine,
        raw,
        raw_rusqlite,
        rounds,
        load_average_start,
        load_average_end: load_average(),
    })
}
