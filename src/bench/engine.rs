//! `bench engine`: the engine against the raw database limit of the pattern, in one
//! process, on one database, with the same batch size, durability and connection
//! count.
//!
//! - **raw**: the pattern's SQL alone — per batch of B messages one transaction
//!   with, per message, the dedup-row insert under the unique key and the business
//!   upsert (`Store::record_batch`, the same statements the engine issues) — from W
//!   tasks, no queue, no parsing, no engine;
//! - **engine**: the same messages through the embedded queue and the real
//!   `trip-counter` consumer: lease a batch, parse, dedup + business rows in one
//!   transaction, count, ack the batch — W workers.
//!
//! The ratio engine/raw is the price of everything that is not the database.
//!
//! Two breakdowns go beside it. **queue alone**: the same messages leased and acked
//! in batches, no database. **raw with the queue**: raw's very transactions, each
//! overlapped with one ack-and-lease of a batch of the same messages on the same
//! queue, the way the pipelined runner overlaps them, and nothing else (no parse, no
//! classification, no counting). It shares the queue's cost on purpose: on a small
//! machine the broker's and its client's work per delivery competes with the
//! database for the same cores and slows its commits, and engine ÷ this figure is
//! what is left for the engine's own code. The headline ratio stays engine ÷ raw.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::engine::consumers::trip_counter;
use crate::engine::crash::CrashPlan;
use crate::engine::envelope::Envelope;
use crate::engine::runner::{EventSink, RunnerSettings};
use crate::engine::store::{self, BusinessWrite, Durability, Recordable};
use crate::engine::{Engine, EngineConfig};

use super::{cpu_seconds, durability_words, BenchError};

/// What to measure.
#[derive(Debug, Clone)]
pub struct EngineBenchPlan {
    pub db_url: String,
    /// Queue for the engine run (default: an embedded queue in a scratch directory).
    pub queue_url: Option<String>,
    pub messages: usize,
    /// Fraction of messages that are redeliveries of an earlier one.
    pub dup_rate: f64,
    pub batch: usize,
    pub workers: usize,
    pub seed: u64,
    /// Raw/engine pairs to run; the report gives the median pair.
    pub runs: usize,
    /// The runner's pipelining (on by default, as in `serve`).
    pub pipeline: bool,
    /// Deliveries per lease when pipelined (`RunnerSettings::prefetch`, 32 as in
    /// `serve`), rounded up to whole batches.
    pub prefetch: usize,
    /// The business database's commit durability, the same for raw and engine.
    pub durability: Durability,
}

impl EngineBenchPlan {
    /// The engine run's runner: the plan's batch, pipelining and prefetch; a
    /// visibility timeout no run comes near.
    fn runner(&self) -> RunnerSettings {
        RunnerSettings {
            lease_batch: self.batch.max(1),
            visibility_timeout: Duration::from_secs(300),
            idle_poll: Duration::from_millis(5),
            pipeline: self.pipeline,
            prefetch: self.prefetch,
            ..RunnerSettings::default()
        }
    }
}

/// One measured run.
#[derive(Debug, Clone, Serialize)]
pub struct RunFigures {
    pub messages: usize,
    pub seconds: f64,
    pub messages_per_second: f64,
    /// CPU (user + system) of this process per message: the engine's own work. A
    /// database server's CPU is not in it.
    pub cpu_us_per_message: f64,
    /// Per message: from the start of its batch to its commit (raw) or its ack
    /// decision (engine).
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub applied: u64,
    pub duplicates: u64,
}

/// One raw run and the engine run paired with it.
#[derive(Debug, Clone, Serialize)]
pub struct RunPair {
    pub raw_messages_per_second: f64,
    pub engine_messages_per_second: f64,
    pub ratio: f64,
    /// The same pair's rusqlite baseline (SQLite only), and engine ÷ it.
    pub raw_rusqlite_messages_per_second: Option<f64>,
    pub ratio_rusqlite: Option<f64>,
    /// The same pair's raw-with-the-queue run (one worker only), and engine ÷ it.
    pub raw_with_queue_messages_per_second: Option<f64>,
    pub ratio_with_queue: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchReport {
    pub db: String,
    pub backend: String,
    /// `durable: …` or `relaxed: …` with what that means on this backend: the raw
    /// baseline and the engine both ran with it.
    pub durability: String,
    pub messages: usize,
    pub dup_rate: f64,
    pub batch: usize,
    pub workers: usize,
    /// The engine's queue (the embedded one in a scratch file unless `--queue`).
    pub queue: String,
    /// Whether the runner overlaps the queue with the database (it does by default).
    pub pipeline: bool,
    /// Deliveries the engine leased per queue round trip (its prefetch, rounded up to
    /// whole batches; one batch without pipelining).
    pub lease_size: usize,
    /// The pair whose ratio is the median of all pairs.
    pub raw: RunFigures,
    pub engine: RunFigures,
    /// engine messages/s ÷ raw messages/s: the median over the pairs.
    pub ratio: f64,
    /// SQLite only: the same pattern through SQLite's C API (rusqlite, prepared cached
    /// statements, the store's pragmas, a thread and a connection per worker), run
    /// beside each pair; the median pair's figures.
    pub raw_rusqlite: Option<RunFigures>,
    /// engine messages/s ÷ rusqlite raw messages/s: the median over the pairs.
    pub ratio_rusqlite: Option<f64>,
    /// Every pair, in the order run (raw first in even pairs, engine first in odd ones,
    /// so a drift of the machine does not favour one side).
    pub runs: Vec<RunPair>,
    /// The queue alone, for the breakdown: the same messages leased and acked in
    /// batches of the same size on the engine's kind of queue, no database, no
    /// parsing.
    pub queue_only: Option<RunFigures>,
    /// Raw's transactions overlapped with the queue's leases and acks (see the module
    /// doc), run beside each pair with one worker; the median pair's figures.
    pub raw_with_queue: Option<RunFigures>,
    /// engine messages/s ÷ raw-with-the-queue messages/s: the median over the pairs.
    pub ratio_with_queue: Option<f64>,
}

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Run(e.to_string())
}

/// N zone exits over 1,000 devices of this run, `dup_rate` of them redeliveries of an
/// earlier message (same key and payload), in a deterministic shuffled order.
///
/// Every copy carries its own `message_id` (`{tag}-c{position}`), which the engine's
/// key and fingerprint ignore, so a redelivery is still a duplicate to the dedup
/// table. Why: JetStream drops a publish whose `Nats-Msg-Id` it saw inside its
/// duplicate window, and that id is the producer's `message_id` (else a hash of the
/// bytes), so identical copies never reached a consumer on NATS and the bench counted
/// 0 duplicates there. With an id per copy every queue stores and delivers all N, as
/// a redelivery that entered the queue twice arrives, and the NATS, RabbitMQ and
/// embedded runs do the same work.
fn messages(plan: &EngineBenchPlan, tag: &str) -> Vec<Vec<u8>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(plan.seed);
    let distinct = ((plan.messages as f64) * (1.0 - plan.dup_rate))
        .round()
        .max(1.0) as usize;
    let mut picks: Vec<usize> = (0..distinct).collect();
    while picks.len() < plan.messages {
        picks.push(rng.random_range(0..distinct));
    }
    picks.shuffle(&mut rng);
    picks
        .into_iter()
        .enumerate()
        .map(|(position, i)| {
            format!(
                r#"{{"message_id":"{tag}-c{position}","device_id":"{tag}-{:04}","seq":{i},"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"Z{}"}}}}"#,
                i % 1000,
                i % 7
            )
            .into_bytes()
        })
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn figures(
    messages: usize,
    (seconds, cpu_seconds): (f64, f64),
    mut latencies_ms: Vec<f64>,
    applied: u64,
    duplicates: u64,
) -> RunFigures {
    latencies_ms.sort_by(|a, b| a.total_cmp(b));
    RunFigures {
        messages,
        seconds,
        messages_per_second: messages as f64 / seconds.max(1e-9),
        cpu_us_per_message: cpu_seconds * 1e6 / (messages.max(1) as f64),
        p50_ms: percentile(&latencies_ms, 0.50),
        p99_ms: percentile(&latencies_ms, 0.99),
        applied,
        duplicates,
    }
}

/// The business store with the plan's durability (what the engine opens too).
async fn open_store(plan: &EngineBenchPlan) -> Result<Arc<dyn store::Store>, BenchError> {
    Ok(
        store::open_with_edge_durability(&plan.db_url, plan.durability)
            .await
            .map_err(err)?
            .store,
    )
}

/// The messages as the raw baselines write them, parsed before any clock starts;
/// `suffix` keeps each baseline's counters apart from the engine's.
fn recordables(bodies: &[Vec<u8>], suffix: &str) -> Result<Vec<Recordable>, BenchError> {
    bodies
        .iter()
        .map(|b| {
            let env = Envelope::parse(b).map_err(err)?;
            Ok(Recordable {
                key: env.key(),
                fingerprint: env.fingerprint(),
                write: BusinessWrite::CountZoneExit {
                    device_id: format!("{}-{suffix}", env.device_id),
                },
            })
        })
        .collect()
}

/// The engine's queue: `--queue`, or an embedded one in `scratch`.
fn queue_url(plan: &EngineBenchPlan, scratch: &std::path::Path) -> String {
    plan.queue_url
        .clone()
        .unwrap_or_else(|| format!("sqlite://{}", scratch.join("bench-queue.db").display()))
}

/// A queue of its own for a breakdown run, on the engine's kind of queue, filled
/// with `bodies` before any clock starts.
async fn filled_queue(
    plan: &EngineBenchPlan,
    scratch: &std::path::Path,
    what: &str,
    bodies: &[Vec<u8>],
) -> Result<(Arc<dyn crate::engine::queue::Queue>, String), BenchError> {
    let queue = crate::engine::queue::open(&queue_url(plan, scratch))
        .await
        .map_err(err)?;
    let name = format!("bench-{:08x}/{what}", rand::random::<u32>());
    queue
        .publish(std::slice::from_ref(&name), bodies)
        .await
        .map_err(err)?;
    Ok((queue, name))
}

/// Remove a breakdown run's queue (a broker keeps it otherwise) and let go of it.
async fn drop_queue(queue: Arc<dyn crate::engine::queue::Queue>, name: &str) {
    if let Err(e) = queue.remove_queue(name).await {
        tracing::warn!(error = %e, "bench queue not removed");
    }
    queue.close().await;
}

/// The raw baseline: the pattern's transactions, nothing else.
async fn raw(plan: &EngineBenchPlan, bodies: &[Vec<u8>]) -> Result<RunFigures, BenchError> {
    let store = open_store(plan).await?;
    let items = recordables(bodies, "raw")?;
    let chunks: Vec<Vec<Recordable>> = items.chunks(plan.batch.max(1)).map(<[_]>::to_vec).collect();
    let queue = Arc::new(Mutex::new(chunks));
    let (started, cpu0) = (Instant::now(), cpu_seconds());
    let mut tasks = Vec::new();
    for _ in 0..plan.workers.max(1) {
        let (store, queue) = (store.clone(), queue.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let (mut applied, mut dups) = (0u64, 0u64);
            while let Some(chunk) = queue.lock().ok().and_then(|mut q| q.pop()) {
                let t = Instant::now();
                let outcomes = store.record_batch("bench-raw", &chunk).await?;
                let ms = t.elapsed().as_secs_f64() * 1000.0;
                for o in outcomes {
                    lat.push(ms);
                    match o {
                        store::DedupOutcome::Applied => applied += 1,
                        _ => dups += 1,
                    }
                }
            }
            Ok::<_, store::StoreError>((lat, applied, dups))
        }));
    }
    let (mut lat, mut applied, mut dups) = (Vec::new(), 0, 0);
    for t in tasks {
        let (l, a, d) = t.await.map_err(err)?.map_err(err)?;
        lat.extend(l);
        applied += a;
        dups += d;
    }
    Ok(figures(
        bodies.len(),
        (started.elapsed().as_secs_f64(), cpu_seconds() - cpu0),
        lat,
        applied,
        dups,
    ))
}

/// The raw baseline on SQLite's C API (`super::rusqlite_raw`), on the plan's database
/// file, with its durability.
async fn raw_rusqlite(
    plan: &EngineBenchPlan,
    bodies: &[Vec<u8>],
) -> Result<RunFigures, BenchError> {
    let items = bodies
        .iter()
        .map(|b| {
            let env = Envelope::parse(b).map_err(err)?;
            Ok(super::rusqlite_raw::TripItem {
                key: env.key().as_str().to_string(),
                fingerprint: env.fingerprint().as_str().to_string(),
                device_id: format!("{}-rusqlite", env.device_id),
            })
        })
        .collect::<Result<Vec<_>, BenchError>>()?;
    let path = super::rusqlite_raw::sqlite_path(&plan.db_url);
    let ((applied, duplicates, latencies), seconds, cpu) = super::rusqlite_raw::engine_baseline(
        path,
        plan.durability,
        items,
        plan.batch,
        plan.workers,
    )
    .await?;
    Ok(figures(
        bodies.len(),
        (seconds, cpu),
        latencies,
        applied,
        duplicates,
    ))
}

/// The engine: queue, real consumer, batch transaction, batch ack.
async fn engine(
    plan: &EngineBenchPlan,
    bodies: &[Vec<u8>],
    scratch: &std::path::Path,
) -> Result<RunFigures, BenchError> {
    let queue_url = queue_url(plan, scratch);
    let mut cfg = EngineConfig::new(
        &plan.db_url,
        &queue_url,
        "http://127.0.0.1:9",
        "http://127.0.0.1:9",
    );
    cfg.consumers = vec![trip_counter::NAME.into()];
    cfg.durability = plan.durability;
    cfg.namespace = Some(format!("bench-{}", rand::random::<u32>()));
    cfg.runner = plan.runner();
    let engine = Engine::open(&cfg).await.map_err(err)?;
    engine.publish(bodies).await.map_err(err)?;
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(bodies.len())));
    let sink: EventSink = {
        let latencies = latencies.clone();
        Arc::new(move |e| {
            if let Ok(mut l) = latencies.lock() {
                l.push(e.latency_us as f64 / 1000.0);
            }
        })
    };
    let workers: Vec<_> = (0..plan.workers.max(1))
        .map(|_| {
            engine.worker(
                trip_counter::NAME,
                Arc::new(CrashPlan::none()),
                Some(sink.clone()),
            )
        })
        .collect::<Result<_, _>>()
        .map_err(err)?;
    let (started, cpu0) = (Instant::now(), cpu_seconds());
    let results = futures::future::join_all(workers.iter().map(|w| w.run_until_idle())).await;
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    for r in results {
        r.map_err(err)?;
    }
    // Leave nothing behind on a broker (on the embedded queue: the scratch file goes).
    if let Err(e) = engine
        .queue
        .remove_queue(&engine.queue_name(trip_counter::NAME))
        .await
    {
        tracing::warn!(error = %e, "bench queue not removed");
    }
    engine.queue.close().await;
    let counts = engine.metrics.counts(trip_counter::NAME);
    // A run that stopped before its last batch would report a rate for work it did
    // not do (and the queue removed above takes the rest with it).
    let settled = counts.processed + counts.duplicate_dropped;
    if settled != bodies.len() as u64 {
        return Err(BenchError::Run(format!(
            "the engine run ended with {settled} of {} messages settled",
            bodies.len()
        )));
    }
    let lat = latencies.lock().map(|l| l.clone()).unwrap_or_default();
    Ok(figures(
        bodies.len(),
        (seconds, cpu),
        lat,
        counts.processed,
        counts.duplicate_dropped,
    ))
}

/// Raw's transactions, each beside one ack-and-lease on the queue (see the module
/// doc): the deliveries of batch N+1 are leased, and batch N-1's acked, while batch
/// N's transaction runs, as the pipelined runner does with its own batches. The
/// deliveries are counted, not read: the transactions write the messages parsed
/// beforehand, in the queue's order. One worker.
async fn raw_with_queue(
    plan: &EngineBenchPlan,
    bodies: &[Vec<u8>],
) -> Result<RunFigures, BenchError> {
    let store = open_store(plan).await?;
    let items = recordables(bodies, "rawq")?;
    let scratch = tempfile::tempdir().map_err(err)?;
    let (queue, name) = filled_queue(plan, scratch.path(), "raw-with-queue", bodies).await?;
    let (batch, visibility) = (plan.batch.max(1), Duration::from_secs(300));
    let lease = plan.runner().lease_size();
    let (started, cpu0) = (Instant::now(), cpu_seconds());
    let mut held = queue.lease(&name, lease, visibility).await.map_err(err)?;
    let (mut unacked, mut next, mut lat) = (Vec::new(), 0, Vec::new());
    let (mut applied, mut dups) = (0u64, 0u64);
    while next < items.len() {
        if held.is_empty() {
            // The lease beside the last batch came back short: ack, and lease again.
            let (acked, leased) = queue
                .ack_then_lease(&std::mem::take(&mut unacked), &name, lease, visibility)
                .await;
            acked.map_err(err)?;
            held = leased.map_err(err)?;
            if held.is_empty() {
                drop_queue(queue, &name).await;
                return Err(BenchError::Run(format!(
                    "the queue ran dry with {} of {} messages written",
                    next,
                    items.len()
                )));
            }
            continue;
        }
        let current: Vec<_> = held.drain(..batch.min(held.len())).collect();
        let chunk = &items[next..(next + current.len()).min(items.len())];
        next += current.len();
        let done = tokio::sync::Notify::new();
        let t = Instant::now();
        let (written, (acked, leased)) = tokio::join!(
            async {
                let written = store.record_batch("bench-raw-queue", chunk).await;
                done.notify_one();
                written
            },
            async {
                if held.is_empty() {
                    let previous = std::mem::take(&mut unacked);
                    queue
                        .ack_then_lease_beside(&previous, &name, lease, visibility, &done)
                        .await
                } else {
                    (Ok(()), Ok(Vec::new()))
                }
            }
        );
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        for o in written.map_err(err)? {
            lat.push(ms);
            match o {
                store::DedupOutcome::Applied => applied += 1,
                _ => dups += 1,
            }
        }
        acked.map_err(err)?;
        held.extend(leased.map_err(err)?);
        unacked.extend(current);
    }
    queue.ack_batch(&unacked).await.map_err(err)?;
    let (seconds, cpu) = (started.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    drop_queue(queue, &name).await;
    Ok(figures(bodies.len(), (seconds, cpu), lat, applied, dups))
}

/// The queue alone: publish, then ack-and-lease batches (one round trip each, the
/// previous batch acked with the next lease) until every message is taken, on the
/// engine's kind of queue.
async fn queue_alone(plan: &EngineBenchPlan) -> Result<RunFigures, BenchError> {
    let scratch = tempfile::tempdir().map_err(err)?;
    let bodies = messages(plan, "QUEUEONLY");
    let (queue, name) = filled_queue(plan, scratch.path(), "queue-only", &bodies).await?;
    let (batch, visibility) = (plan.batch.max(1), Duration::from_secs(300));
    let (started, cpu0) = (Instant::now(), cpu_seconds());
    let (mut held, mut taken) = (Vec::new(), 0);
    let mut latencies = Vec::with_capacity(bodies.len());
    while taken < bodies.len() {
        let t = Instant::now();
        let (acked, leased) = queue.ack_then_lease(&held, &name, batch, visibility).await;
        acked.map_err(err)?;
        held = leased.map_err(err)?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        latencies.extend(std::iter::repeat_n(ms, held.len()));
        if held.is_empty() {
            break;
        }
        taken += held.len();
    }
    queue.ack_batch(&held).await.map_err(err)?;
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    drop_queue(queue, &name).await;
    Ok(figures(taken, (seconds, cpu), latencies, 0, 0))
}

/// Several batch sizes in one process: how throughput scales with the batch.
#[derive(Debug, Clone, Serialize)]
pub struct ScalingReport {
    pub batches: Vec<EngineBenchReport>,
    /// Each larger batch against the first (smallest) one.
    pub scaling: Vec<Scaling>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Scaling {
    pub from_batch: usize,
    pub to_batch: usize,
    /// Engine messages/s at `to_batch` ÷ at `from_batch`.
    pub engine: f64,
    /// The same for the raw baseline.
    pub raw: f64,
}

/// [`run`] for each batch size in turn (smallest first), with the scaling between them.
pub async fn run_sizes(
    plan: &EngineBenchPlan,
    sizes: &[usize],
) -> Result<ScalingReport, BenchError> {
    let mut sizes = sizes.to_vec();
    sizes.sort_unstable();
    sizes.dedup();
    let mut batches = Vec::with_capacity(sizes.len());
    for batch in sizes {
        batches.push(
            run(&EngineBenchPlan {
                batch,
                ..plan.clone()
            })
            .await?,
        );
    }
    let scaling = match batches.split_first() {
        Some((first, rest)) => rest
            .iter()
            .map(|r| Scaling {
                from_batch: first.batch,
                to_batch: r.batch,
                engine: r.engine.messages_per_second / first.engine.messages_per_second.max(1e-9),
                raw: r.raw.messages_per_second / first.raw.messages_per_second.max(1e-9),
            })
            .collect(),
        None => Vec::new(),
    };
    Ok(ScalingReport { batches, scaling })
}

/// Run `runs` pairs of the raw baseline and the engine on the same database, each
/// pair on fresh keys, and report the median pair.
pub async fn run(plan: &EngineBenchPlan) -> Result<EngineBenchReport, BenchError> {
    if plan.messages == 0 || !(0.0..1.0).contains(&plan.dup_rate) || plan.runs == 0 {
        return Err(BenchError::Usage(
            "--messages and --runs must be > 0 and --dup-rate in [0, 1)".into(),
        ));
    }
    plan.durability
        .check_url(&plan.db_url)
        .map_err(|e| BenchError::Usage(e.to_string()))?;
    let sqlite = open_store(plan).await?.backend() == store::Backend::Sqlite;
    let mut pairs = Vec::with_capacity(plan.runs);
    let mut rusqlite = Vec::with_capacity(plan.runs);
    let mut with_queues = Vec::with_capacity(plan.runs);
    for i in 0..plan.runs {
        let scratch = tempfile::tempdir().map_err(err)?;
        let tag = format!("BENCH{:06x}", rand::random::<u32>() & 0xff_ffff);
        let bodies = messages(plan, &tag);
        // The rusqlite baseline (its own consumer name and counters) goes last in even
        // pairs and first in odd ones, like raw and engine.
        let mut q = None;
        let mut with_queue = None;
        if sqlite && i % 2 == 1 {
            q = Some(raw_rusqlite(plan, &bodies).await?);
        }
        if plan.workers <= 1 && i % 2 == 1 {
            with_queue = Some(raw_with_queue(plan, &bodies).await?);
        }
        let (raw, engine) = if i % 2 == 0 {
            let raw = raw(plan, &bodies).await?;
            (raw, engine(plan, &bodies, scratch.path()).await?)
        } else {
            let engine = engine(plan, &bodies, scratch.path()).await?;
            (raw(plan, &bodies).await?, engine)
        };
        if sqlite && i % 2 == 0 {
            q = Some(raw_rusqlite(plan, &bodies).await?);
        }
        if plan.workers <= 1 && i % 2 == 0 {
            with_queue = Some(raw_with_queue(plan, &bodies).await?);
        }
        pairs.push((raw, engine));
        rusqlite.push(q);
        with_queues.push(with_queue);
    }
    let ratio = |(raw, engine): &(RunFigures, RunFigures)| {
        engine.messages_per_second / raw.messages_per_second.max(1e-9)
    };
    let against = |p: &(RunFigures, RunFigures), q: &Option<RunFigures>| {
        q.as_ref()
            .map(|q| p.1.messages_per_second / q.messages_per_second.max(1e-9))
    };
    let runs: Vec<RunPair> = pairs
        .iter()
        .zip(rusqlite.iter().zip(&with_queues))
        .map(|(p, (q, w))| RunPair {
            raw_messages_per_second: p.0.messages_per_second,
            engine_messages_per_second: p.1.messages_per_second,
            ratio: ratio(p),
            raw_rusqlite_messages_per_second: q.as_ref().map(|q| q.messages_per_second),
            ratio_rusqlite: against(p, q),
            raw_with_queue_messages_per_second: w.as_ref().map(|w| w.messages_per_second),
            ratio_with_queue: against(p, w),
        })
        .collect();
    let median_of = |mut ratios: Vec<f64>| {
        ratios.sort_by(|a, b| a.total_cmp(b));
        ratios.get(ratios.len() / 2).copied()
    };
    let ratio_rusqlite = median_of(runs.iter().filter_map(|r| r.ratio_rusqlite).collect());
    let ratio_with_queue = median_of(runs.iter().filter_map(|r| r.ratio_with_queue).collect());
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    order.sort_by(|&a, &b| ratio(&pairs[a]).total_cmp(&ratio(&pairs[b])));
    let median = order[order.len() / 2];
    let median_ratio = ratio(&pairs[median]);
    let (raw, engine) = pairs.swap_remove(median);
    let raw_rusqlite = rusqlite.swap_remove(median);
    let raw_with_queue = with_queues.swap_remove(median);
    let queue_only = Some(queue_alone(plan).await?);
    let store = open_store(plan).await?;
    let backend = format!("{:?}", store.backend()).to_lowercase();
    let queue = match &plan.queue_url {
        Some(url) => store::redact_url(url),
        None => "embedded SQLite queue in a scratch file".into(),
    };
    let queue_durability = if plan.queue_url.is_none() {
        "; embedded queue: publishes FULL, leases/acks NORMAL"
    } else {
        ""
    };
    Ok(EngineBenchReport {
        db: store.redacted_url(),
        backend,
        durability: format!("{}{queue_durability}", durability_words(store.as_ref())),
        messages: plan.messages,
        dup_rate: plan.dup_rate,
        batch: plan.batch,
        workers: plan.workers,
        queue,
        pipeline: plan.pipeline,
        lease_size: plan.runner().lease_size(),
        ratio: median_ratio,
        raw,
        engine,
        runs,
        queue_only,
        raw_rusqlite,
        ratio_rusqlite,
        raw_with_queue,
        ratio_with_queue,
    })
}
