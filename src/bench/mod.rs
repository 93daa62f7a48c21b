//! Measurements at production scale (`idemwatch bench …`), PostgreSQL first: fill
//! `processed_messages` with tens of millions of rows by server-side generation,
//! time the dashboard's real queries and read their plans, and measure what the
//! retention purge costs a consumer writing at the same time.
//!
//! It sits beside the dashboard at the end of the layers: it uses the engine's
//! `Store` (schema and writes) and the monitor's `DbPoller` (the very SQL the
//! dashboard runs), and nothing uses it.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};

use crate::config::DatabaseConfig;
use crate::engine::envelope::Envelope;
use crate::engine::retention::{self, PurgePlan, PurgeProgress, PurgeSummary};
use crate::engine::store::{self, BusinessWrite, Durability, Store};
use crate::monitor::db::{DbError, DbPoller};

pub mod engine;
pub mod partitions;
pub mod pipeline;
pub mod process;
pub mod rusqlite_raw;
pub mod scrape;
pub mod tui;

/// Errors of a bench run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Sql(#[from] sqlx::Error),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Run(String),
}

pub type BenchResult<T> = Result<T, BenchError>;

/// The consumers the generated rows are spread over.
pub const BENCH_CONSUMERS: [&str; 4] = [
    "trip-counter",
    "zone-exit-sms",
    "erp-webhook",
    "vehicle-audit",
];

/// What to generate.
#[derive(Debug, Clone, Copy)]
pub struct LoadPlan {
    pub rows: i64,
    /// `processed_at` spreads evenly over the last `days` days, newest = now.
    pub days: i32,
    /// Rows per INSERT (per transaction).
    pub chunk: i64,
    /// Connections inserting at once.
    pub parallel: usize,
}

/// How long each phase of a load took.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadReport {
    pub rows: i64,
    pub days: i32,
    pub insert_seconds: f64,
    pub index_seconds: f64,
    pub vacuum_analyze_seconds: f64,
    pub total_seconds: f64,
    pub table_bytes: i64,
    pub index_bytes: i64,
}

/// One row per `i`: consumer `i % 4`, key `BENCH-{device}:{seq}:zone_exit` unique
/// per consumer, a 64-hex-char hash, `processed_at` increasing with `i` (rows are
/// appended in time order, as in production).
const GENERATE: &str = "INSERT INTO processed_messages (consumer, message_key, payload_hash, processed_at)
    SELECT ($5::text[])[1 + i % 4],
           'BENCH-' || lpad(((i / 4) % 20000)::text, 5, '0') || ':' || (i / 80000) || ':zone_exit',
           md5(i::text) || md5((i + 1)::text),
           $4::timestamptz - make_interval(days => $3) + (i::float8 / $6) * make_interval(days => $3)
    FROM generate_series($1::bigint, $2::bigint) i";

async fn admin_pool(url: &str, connections: u32) -> BenchResult<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(connections)
        .after_connect(|conn, _| {
            Box::pin(async move {
                // A bulk load: commit without waiting for the WAL flush, and give
                // index builds room to sort in memory.
                conn.execute("SET synchronous_commit = off; SET maintenance_work_mem = '1GB'")
                    .await?;
                Ok(())
            })
        })
        .connect(url)
        .await?)
}

fn require_postgres(url: &str) -> BenchResult<()> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(())
    } else {
        Err(BenchError::Usage(format!(
            "bench needs a postgres:// database, got {}",
            store::redact_url(url)
        )))
    }
}

/// Empty `processed_messages` (schema from the migrations) and fill it with
/// `plan.rows` generated rows: drop the indexes, insert in parallel chunks, rebuild
/// the indexes with their original definitions, then `VACUUM (ANALYZE)` as
/// autovacuum would eventually.
pub async fn load(
    url: &str,
    plan: LoadPlan,
    mut progress: impl FnMut(&str) + Send,
) -> BenchResult<LoadReport> {
    require_postgres(url)?;
    if plan.rows <= 0 || plan.days <= 0 || plan.chunk <= 0 {
        return Err(BenchError::Usage(
            "rows, days and chunk must be positive".into(),
        ));
    }
    // Migrations first, so the table is exactly the engine's.
    drop(store::open(url).await?);
    let parallel = plan.parallel.max(1);
    let pool = admin_pool(url, u32::try_from(parallel).unwrap_or(2) + 1).await?;
    let started = Instant::now();
    let primary_key: Option<(String, String)> = sqlx::query_as(
        "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
         WHERE conrelid = 'processed_messages'::regclass AND contype = 'p'",
    )
    .fetch_optional(&pool)
    .await?;
    let indexes: Vec<(String, String)> = sqlx::query_as(
        "SELECT i.relname::text, pg_get_indexdef(i.oid) FROM pg_index x
         JOIN pg_class i ON i.oid = x.indexrelid
         WHERE x.indrelid = 'processed_messages'::regclass AND NOT x.indisprimary",
    )
    .fetch_all(&pool)
    .await?;
    pool.execute("TRUNCATE processed_messages").await?;
    if let Some((name, _)) = &primary_key {
        pool.execute(format!("ALTER TABLE processed_messages DROP CONSTRAINT \"{name}\"").as_str())
            .await?;
    }
    for (name, _) in &indexes {
        pool.execute(format!("DROP INDEX \"{name}\"").as_str())
            .await?;
    }
    let now = Utc::now();
    let next = Arc::new(AtomicI64::new(0));
    let consumers: Vec<String> = BENCH_CONSUMERS.iter().map(|c| c.to_string()).collect();
    let mut workers = Vec::new();
    for _ in 0..parallel {
        let (pool, next, consumers) = (pool.clone(), next.clone(), consumers.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let lo = next.fetch_add(plan.chunk, Ordering::SeqCst);
                if lo >= plan.rows {
                    return Ok::<_, sqlx::Error>(());
                }
                let hi = (lo + plan.chunk).min(plan.rows) - 1;
                sqlx::query(GENERATE)
                    .bind(lo)
                    .bind(hi)
                    .bind(plan.days)
                    .bind(now)
                    .bind(&consumers)
                    .bind(plan.rows as f64)
                    .execute(&pool)
                    .await?;
            }
        }));
    }
    let mut last = Instant::now();
    while !workers.iter().all(|w| w.is_finished()) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if last.elapsed() >= Duration::from_secs(5) {
            last = Instant::now();
            let done = next.load(Ordering::SeqCst).min(plan.rows);
            progress(&format!(
                "inserting: ~{done} of {} rows dispatched, {:.0}s",
                plan.rows,
                started.elapsed().as_secs_f64()
            ));
        }
    }
    for w in workers {
        w.await
            .map_err(|e| BenchError::Usage(format!("a load worker panicked: {e}")))??;
    }
    let insert_seconds = started.elapsed().as_secs_f64();
    progress(&format!(
        "inserted {} rows in {insert_seconds:.1}s; building indexes",
        plan.rows
    ));
    let t = Instant::now();
    if let Some((name, definition)) = &primary_key {
        pool.execute(
            format!("ALTER TABLE processed_messages ADD CONSTRAINT \"{name}\" {definition}")
                .as_str(),
        )
        .await?;
    }
    for (_, definition) in &indexes {
        pool.execute(definition.as_str()).await?;
    }
    let index_seconds = t.elapsed().as_secs_f64();
    progress(&format!("indexes in {index_seconds:.1}s; VACUUM (ANALYZE)"));
    let t = Instant::now();
    pool.execute("VACUUM (ANALYZE) processed_messages").await?;
    let vacuum_analyze_seconds = t.elapsed().as_secs_f64();
    let (table_bytes, index_bytes): (i64, i64) = sqlx::query_as(
        "SELECT pg_table_size('processed_messages'), pg_indexes_size('processed_messages')",
    )
    .fetch_one(&pool)
    .await?;
    pool.close().await;
    Ok(LoadReport {
        rows: plan.rows,
        days: plan.days,
        insert_seconds,
        index_seconds,
        vacuum_analyze_seconds,
        total_seconds: started.elapsed().as_secs_f64(),
        table_bytes,
        index_bytes,
    })
}

/// One dashboard query: timings over several runs and its plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueryReport {
    pub name: &'static str,
    pub sql: String,
    pub runs: usize,
    pub median_ms: f64,
    pub max_ms: f64,
    /// Plan nodes of `EXPLAIN (ANALYZE, BUFFERS)`.
    pub plan_nodes: Vec<String>,
    pub execution_ms: Option<f64>,
    pub seq_scan_of_processed_messages: bool,
    pub plan: serde_json::Value,
}

/// Every dashboard query's timings and plan, and a whole poll's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueriesReport {
    pub db: String,
    /// The poll time the queries ran as of: the newest row + 1 s.
    pub as_of: DateTime<Utc>,
    pub estimated_rows: Option<i64>,
    pub queries: Vec<QueryReport>,
    /// One complete `DbPoller::poll` (every section, vehicles included), median ms.
    pub full_poll_median_ms: f64,
    pub full_poll_max_ms: f64,
    pub any_seq_scan_of_processed_messages: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Run each dashboard query `runs` times (after one warm-up) and explain it once.
pub async fn dashboard_queries(url: &str, runs: usize) -> BenchResult<QueriesReport> {
    let runs = runs.max(1);
    let settings = DatabaseConfig::with_url(url);
    let poller = DbPoller::new(&settings)?;
    // Timed as of the newest row: a table loaded minutes ago would otherwise have
    // an empty "last minute", which is not what a live table looks like.
    let newest: Option<DateTime<Utc>> = {
        let pool = admin_pool(url, 1).await?;
        let newest = sqlx::query_scalar("SELECT max(processed_at) FROM processed_messages")
            .fetch_one(&pool)
            .await?;
        pool.close().await;
        newest
    };
    let now = newest.map_or_else(Utc::now, |t| t + chrono::Duration::seconds(1));
    let mut queries = Vec::new();
    for query in poller.dashboard_queries(now).await? {
        poller.run_query(&query).await?;
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs {
            let t = Instant::now();
            poller.run_query(&query).await?;
            times.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let plan = poller.explain(&query, true).await?;
        queries.push(QueryReport {
            name: query.name,
            sql: query.sql.clone(),
            runs,
            median_ms: median(times.clone()),
            max_ms: times.iter().copied().fold(0.0, f64::max),
            seq_scan_of_processed_messages: plan.reads_whole("processed_messages"),
            plan_nodes: plan.nodes,
            execution_ms: plan.execution_ms,
            plan: plan.plan,
        });
    }
    let mut polls = Vec::with_capacity(runs);
    let mut estimated_rows = None;
    for _ in 0..runs {
        let t = Instant::now();
        let stats = poller.poll(now).await;
        polls.push(t.elapsed().as_secs_f64() * 1000.0);
        estimated_rows = stats.dedup.and_then(|d| d.total_rows).map(|r| r.rows);
    }
    Ok(QueriesReport {
        db: store::redact_url(url),
        as_of: now,
        estimated_rows,
        any_seq_scan_of_processed_messages: queries
            .iter()
            .any(|q| q.seq_scan_of_processed_messages),
        queries,
        full_poll_median_ms: median(polls.clone()),
        full_poll_max_ms: polls.iter().copied().fold(0.0, f64::max),
    })
}

/// Latencies of the writer that runs beside a purge.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WriterReport {
    pub calls: usize,
    pub target_per_second: u32,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Calls slower than 100 ms.
    pub over_100ms: usize,
    pub errors: usize,
}

/// A purge measured with a consumer writing at the same time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PurgeUnderLoad {
    pub db: String,
    pub purge: PurgeSummary,
    pub writer_during_purge: WriterReport,
}

/// A paced consumer: `record_once` (dedup row + counter, one transaction) on fresh
/// keys at `per_second`, until `stop`. Returns every call's latency in ms.
pub async fn paced_writer(
    store: Arc<dyn Store>,
    per_second: u32,
    stop: Arc<AtomicBool>,
) -> (Vec<f64>, usize) {
    let mut ticker =
        tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(per_second.max(1))));
    // After a stall, carry on at the pace instead of bursting to catch up.
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let salt = rand::random::<u32>();
    let (mut latencies, mut errors) = (Vec::new(), 0usize);
    let mut seq = 0u64;
    while !stop.load(Ordering::SeqCst) {
        ticker.tick().await;
        seq += 1;
        let device = format!("WRITER-{salt:08x}-{}", seq % 1000);
        let line = format!(
            r#"{{"device_id":"{device}","seq":{seq},"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X"}}}}"#
        );
        let Ok(env) = Envelope::parse(line.as_bytes()) else {
            errors += 1;
            continue;
        };
        let t = Instant::now();
        let write = BusinessWrite::CountZoneExit { device_id: device };
        match store
            .record_once("bench-writer", &env.key(), &env.fingerprint(), &write)
            .await
        {
            Ok(_) => latencies.push(t.elapsed().as_secs_f64() * 1000.0),
            Err(_) => errors += 1,
        }
    }
    (latencies, errors)
}

/// Summarize a writer's latencies.
pub fn writer_report(mut latencies: Vec<f64>, errors: usize, per_second: u32) -> WriterReport {
    latencies.sort_by(|a, b| a.total_cmp(b));
    let pick = |q: f64| {
        if latencies.is_empty() {
            0.0
        } else {
            let i = ((latencies.len() - 1) as f64 * q).round() as usize;
            latencies[i]
        }
    };
    WriterReport {
        calls: latencies.len(),
        target_per_second: per_second,
        p50_ms: pick(0.5),
        p99_ms: pick(0.99),
        max_ms: latencies.last().copied().unwrap_or(0.0),
        over_100ms: latencies.iter().filter(|l| **l > 100.0).count(),
        errors,
    }
}

/// Run the engine's batched purge (exactly what `idemwatch purge` runs) while a
/// paced writer inserts dedup rows, and report both.
pub async fn purge_under_load(
    url: &str,
    plan: PurgePlan,
    writer_per_second: u32,
    progress: impl FnMut(&PurgeProgress),
) -> BenchResult<PurgeUnderLoad> {
    let purger = store::open(url).await?;
    let writer_store = store::open(url).await?;
    let stop_writer = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(paced_writer(
        writer_store,
        writer_per_second,
        stop_writer.clone(),
    ));
    // Let the writer settle before the purge starts.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let never = AtomicBool::new(false);
    let purge = retention::purge(purger.as_ref(), plan, &never, progress).await;
    stop_writer.store(true, Ordering::SeqCst);
    let (latencies, errors) = writer
        .await
        .map_err(|e| BenchError::Usage(format!("the writer panicked: {e}")))?;
    Ok(PurgeUnderLoad {
        db: store::redact_url(url),
        purge: purge?,
        writer_during_purge: writer_report(latencies, errors, writer_per_second),
    })
}

/// The cutoff `older_than` before now.
pub fn cutoff(older_than: Duration) -> BenchResult<DateTime<Utc>> {
    chrono::Duration::from_std(older_than)
        .ok()
        .and_then(|age| Utc::now().checked_sub_signed(age))
        .ok_or_else(|| BenchError::Usage("--older-than is too large".into()))
}

/// CPU time (user + system) this process has used so far, in seconds (10 ms ticks).
pub(crate) fn cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the command name, which may contain spaces: split after ')'.
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(ticks / 100.0)
        })
        .unwrap_or(0.0)
}

/// Peak RSS of this process (`VmHWM`), in MiB.
pub(crate) fn peak_rss_mib() -> f64 {
    status_mib("VmHWM:")
}

/// RSS of this process now (`VmRSS`), in MiB.
pub(crate) fn rss_mib() -> f64 {
    status_mib("VmRSS:")
}

/// One `kB` field of `/proc/self/status`, in MiB (0 where there is none).
fn status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

/// One consumer's part of a raw run.
#[derive(Debug, Clone, Serialize)]
pub struct RawConsumerFigures {
    pub consumer: String,
    pub seconds: f64,
    pub messages_per_second: f64,
    /// Transactions it committed (claims and results count apart).
    pub transactions: usize,
}

/// A raw run: the four consumers' statements at once, no queue, no provider.
#[derive(Debug, Clone, Serialize)]
pub struct RawRunFigures {
    pub seconds: f64,
    pub messages_per_second: f64,
    pub cpu_us_per_message: f64,
    pub consumers: Vec<RawConsumerFigures>,
}

impl RawRunFigures {
    /// A raw run's figures: `n` messages in `seconds` wall and `cpu` CPU seconds, and
    /// each consumer's (name, seconds until it was done, transactions) or its error.
    pub(crate) fn of<E: std::fmt::Display>(
        n: usize,
        seconds: f64,
        cpu: f64,
        results: Vec<Result<(&str, f64, usize), E>>,
    ) -> Result<Self, BenchError> {
        let consumers = results
            .into_iter()
            .map(|r| {
                let (consumer, s, transactions) = r.map_err(|e| BenchError::Run(e.to_string()))?;
                Ok(RawConsumerFigures {
                    consumer: consumer.to_string(),
                    seconds: s,
                    messages_per_second: n as f64 / s.max(1e-9),
                    transactions,
                })
            })
            .collect::<Result<Vec<_>, BenchError>>()?;
        Ok(RawRunFigures {
            seconds,
            messages_per_second: n as f64 / seconds.max(1e-9),
            cpu_us_per_message: cpu * 1e6 / n.max(1) as f64,
            consumers,
        })
    }
}

/// `durable: …` or `relaxed: …`, with what it means on the store's backend.
pub(crate) fn durability_words(store: &dyn store::Store) -> String {
    let words = match (store.backend(), store.durability()) {
        (store::Backend::Sqlite, Durability::Durable) => {
            "SQLite WAL, synchronous=FULL (fsync per commit)"
        }
        (store::Backend::Sqlite, Durability::Relaxed) => {
            "SQLite WAL, synchronous=NORMAL (fsync at checkpoints only)"
        }
        (store::Backend::Postgres, Durability::Durable) => {
            "PostgreSQL server defaults (synchronous_commit as configured)"
        }
        (store::Backend::Postgres, Durability::Relaxed) => {
            "PostgreSQL synchronous_commit=off in the bench's sessions"
        }
        (store::Backend::Mysql, _) => {
            "MariaDB/MySQL server defaults (innodb_flush_log_at_trx_commit as configured)"
        }
    };
    format!("{}: {words}", store.durability().as_str())
}
