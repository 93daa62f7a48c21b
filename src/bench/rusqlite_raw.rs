//! Raw baselines on SQLite's C API through rusqlite, for `bench engine` and `bench
//! pipeline`: the limit of the database with a synchronous driver, beside the sqlx
//! baseline (which pays sqlx's hand-off to its SQLite worker thread on every call).
//!
//! What a plain C program would do: one connection per writer on its own OS thread,
//! prepared statements from the connection's cache, a statement per row inside one
//! `BEGIN IMMEDIATE … COMMIT` per batch, the store's pragmas (WAL; `synchronous=FULL`
//! durable, `NORMAL` relaxed; a 30 s busy timeout; foreign keys on). The schema is the
//! store's (the database is opened by the store first, which migrates it).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use chrono::Utc;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use crate::engine::consumers::{provider_key, FLEET_CONSUMERS};
use crate::engine::consumers::{trip_counter, vehicle_state, zone_exit_sms};
use crate::engine::envelope::{Envelope, EventType};
use crate::engine::store::vehicle_sql::{vehicle_upsert_tail, VEHICLE_UPSERT_HEAD};
use crate::engine::store::{ts, Durability, VehicleFacts};

use super::{cpu_seconds, BenchError, RawRunFigures};

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Run(format!("rusqlite baseline: {e}"))
}

/// The file of a `sqlite://PATH[?…]` URL.
pub fn sqlite_path(url: &str) -> PathBuf {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    PathBuf::from(rest.split('?').next().unwrap_or(rest))
}

/// A connection with the store's pragmas.
pub fn open(path: &std::path::Path, durability: Durability) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    debug_assert_eq!(mode.to_lowercase(), "wal");
    let synchronous = match durability {
        Durability::Durable => "FULL",
        Durability::Relaxed => "NORMAL",
    };
    conn.execute_batch(&format!(
        "PRAGMA synchronous = {synchronous}; PRAGMA foreign_keys = ON;"
    ))?;
    conn.busy_timeout(Duration::from_secs(30))?;
    Ok(conn)
}

const INSERT_KEY: &str =
    "INSERT INTO processed_messages (consumer, message_key, payload_hash, processed_at)
     VALUES (?1, ?2, ?3, ?4) ON CONFLICT DO NOTHING";
const COUNT_EXIT: &str = "INSERT INTO trip_counters (device_id, zone_exits) VALUES (?1, 1)
     ON CONFLICT (device_id) DO UPDATE SET zone_exits = zone_exits + 1";

/// One trip-counter message: its key, fingerprint and the device counted.
#[derive(Debug, Clone)]
pub struct TripItem {
    pub key: String,
    pub fingerprint: String,
    pub device_id: String,
}

/// What [`record_batches`] did: applied, duplicates, per-message latency (ms, from
/// the start of its batch's transaction to its commit).
pub type RecordFigures = (u64, u64, Vec<f64>);

/// `bench engine`'s pattern: per batch one transaction, per message the dedup row
/// under the unique key and, when it is new, the counter upsert.
pub fn record_batches(
    conn: &mut Connection,
    consumer: &str,
    items: &[TripItem],
    batch: usize,
) -> rusqlite::Result<RecordFigures> {
    let (mut applied, mut duplicates) = (0u64, 0u64);
    let mut latencies = Vec::with_capacity(items.len());
    for chunk in items.chunks(batch.max(1)) {
        let t = Instant::now();
        let now = ts(Utc::now());
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        {
            let mut insert = tx.prepare_cached(INSERT_KEY)?;
            let mut count = tx.prepare_cached(COUNT_EXIT)?;
            for item in chunk {
                if insert.execute(params![consumer, item.key, item.fingerprint, now])? == 1 {
                    count.execute([&item.device_id])?;
                    applied += 1;
                } else {
                    duplicates += 1;
                }
            }
        }
        tx.commit()?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        latencies.extend(std::iter::repeat_n(ms, chunk.len()));
    }
    Ok((applied, duplicates, latencies))
}

/// [`record_batches`] from `workers` threads (a connection each) over `items`,
/// batches handed out in turn. Returns the figures and the wall and CPU seconds.
pub async fn engine_baseline(
    path: PathBuf,
    durability: Durability,
    items: Vec<TripItem>,
    batch: usize,
    workers: usize,
) -> Result<(RecordFigures, f64, f64), BenchError> {
    tokio::task::spawn_blocking(move || {
        let chunks: Vec<&[TripItem]> = items.chunks(batch.max(1)).collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let mut conns = (0..workers.max(1))
            .map(|_| open(&path, durability))
            .collect::<rusqlite::Result<Vec<_>>>()
            .map_err(err)?;
        let (started, cpu0) = (Instant::now(), cpu_seconds());
        let results: Vec<rusqlite::Result<RecordFigures>> = std::thread::scope(|s| {
            let handles: Vec<_> = conns
                .iter_mut()
                .map(|conn| {
                    let (chunks, next) = (&chunks, &next);
                    s.spawn(move || {
                        let mut total: RecordFigures = (0, 0, Vec::new());
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            let Some(chunk) = chunks.get(i) else {
                                return Ok(total);
                            };
                            let (a, d, l) =
                                record_batches(conn, "bench-raw-rusqlite", chunk, chunk.len())?;
                            total.0 += a;
                            total.1 += d;
                            total.2.extend(l);
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(Err(rusqlite::Error::InvalidQuery)))
                .collect()
        });
        let seconds = started.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu0;
        let mut total: RecordFigures = (0, 0, Vec::new());
        for r in results {
            let (a, d, l) = r.map_err(err)?;
            total.0 += a;
            total.1 += d;
            total.2.extend(l);
        }
        Ok((total, seconds, cpu))
    })
    .await
    .map_err(err)?
}

/// `vehicle-state` for one batch: history insert-once, the seq-guarded upsert, a
/// late event kept with `applied = 0`; a stored event's hash read back.
fn vehicle_batch(conn: &mut Connection, envs: &[Envelope]) -> rusqlite::Result<()> {
    let now = ts(Utc::now());
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    {
        let mut history = tx.prepare_cached(
            "INSERT INTO vehicle_history
               (device_id, seq, event_type, occurred_at, received_at, applied, payload, payload_hash)
             VALUES (?1, ?2, ?3, ?4, ?5, 1, ?6, ?7) ON CONFLICT DO NOTHING",
        )?;
        let mut stored = tx.prepare_cached(
            "SELECT payload_hash FROM vehicle_history WHERE device_id = ?1 AND seq = ?2 AND event_type = ?3",
        )?;
        let mut upsert = tx.prepare_cached(&format!(
            "{VEHICLE_UPSERT_HEAD} VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) {}",
            vehicle_upsert_tail(true)
        ))?;
        let mut late = tx.prepare_cached(
            "UPDATE vehicle_history SET applied = 0 WHERE device_id = ?1 AND seq = ?2 AND event_type = ?3",
        )?;
        for env in envs {
            let Ok(facts) = VehicleFacts::of(env) else {
                continue;
            };
            let occurred_at = ts(env.occurred_at);
            let fingerprint = env.fingerprint();
            let new = history.execute(params![
                env.device_id,
                facts.seq,
                facts.event_type,
                occurred_at,
                now,
                facts.payload,
                fingerprint.as_str()
            ])? == 1;
            if !new {
                let _hash: Option<String> = stored
                    .query_row(params![env.device_id, facts.seq, facts.event_type], |r| {
                        r.get(0)
                    })
                    .optional()?;
                continue;
            }
            let applied = upsert.execute(params![
                env.device_id,
                facts.seq,
                facts.event_type,
                facts.ignition,
                facts.zone,
                facts.lat,
                facts.lon,
                occurred_at,
                now
            ])? == 1;
            if !applied {
                late.execute(params![env.device_id, facts.seq, facts.event_type])?;
            }
        }
    }
    tx.commit()
}

/// A side-effect consumer for one batch: the claims in one transaction (dedup row and
/// `claimed` claim per new key, the stored claim read for a known one), then `sent`
/// recorded for each claim taken, in a second. Returns the transactions committed.
fn side_effect_batch(
    conn: &mut Connection,
    consumer: &str,
    envs: &[&Envelope],
) -> rusqlite::Result<usize> {
    if envs.is_empty() {
        return Ok(0);
    }
    let now = ts(Utc::now());
    let mut claimed = Vec::new();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    {
        let mut insert = tx.prepare_cached(INSERT_KEY)?;
        let mut claim = tx.prepare_cached(
            "INSERT INTO side_effect_claims
               (consumer, message_key, provider_key, state, claimed_at, attempts, message)
             VALUES (?1, ?2, ?3, 'claimed', ?4, 1, ?5)",
        )?;
        let mut stored = tx.prepare_cached(
            "SELECT state, claimed_at FROM side_effect_claims WHERE consumer = ?1 AND message_key = ?2",
        )?;
        for env in envs {
            let key = env.key();
            if insert.execute(params![
                consumer,
                key.as_str(),
                env.fingerprint().as_str(),
                now
            ])? == 1
            {
                claim.execute(params![
                    consumer,
                    key.as_str(),
                    provider_key(consumer, &key),
                    now,
                    env.to_json_line().as_bytes()
                ])?;
                claimed.push(key);
            } else {
                let _state: Option<(String, String)> = stored
                    .query_row(params![consumer, key.as_str()], |r| {
                        Ok((r.get(0)?, r.get(1)?))
                    })
                    .optional()?;
            }
        }
    }
    tx.commit()?;
    if claimed.is_empty() {
        return Ok(1);
    }
    let now = ts(Utc::now());
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    {
        let mut sent = tx.prepare_cached(
            "UPDATE side_effect_claims SET state = 'sent', finished_at = ?1, detail = ?2
             WHERE consumer = ?3 AND message_key = ?4",
        )?;
        for key in &claimed {
            sent.execute(params![now, "sent (200)", consumer, key.as_str()])?;
        }
    }
    tx.commit()?;
    Ok(2)
}

/// One consumer's raw work over the whole trace in batches of `batch` deliveries.
fn consumer_work(
    conn: &mut Connection,
    consumer: &'static str,
    envs: &[Envelope],
    batch: usize,
) -> rusqlite::Result<usize> {
    let mut transactions = 0;
    for chunk in envs.chunks(batch.max(1)) {
        match consumer {
            vehicle_state::NAME => {
                vehicle_batch(conn, chunk)?;
                transactions += 1;
            }
            trip_counter::NAME => {
                let items: Vec<TripItem> = chunk
                    .iter()
                    .filter(|e| e.event_type == EventType::ZoneExit)
                    .map(|e| TripItem {
                        key: e.key().as_str().to_string(),
                        fingerprint: e.fingerprint().as_str().to_string(),
                        device_id: e.device_id.clone(),
                    })
                    .collect();
                if !items.is_empty() {
                    record_batches(conn, consumer, &items, items.len())?;
                    transactions += 1;
                }
            }
            zone_exit_sms::NAME => {
                let mine: Vec<&Envelope> = chunk
                    .iter()
                    .filter(|e| e.event_type == EventType::ZoneExit && e.phone().is_some())
                    .collect();
                transactions += side_effect_batch(conn, consumer, &mine)?;
            }
            _ => {
                let mine: Vec<&Envelope> = chunk
                    .iter()
                    .filter(|e| e.event_type == EventType::IgnitionOff)
                    .collect();
                transactions += side_effect_batch(conn, consumer, &mine)?;
            }
        }
    }
    Ok(transactions)
}

/// `bench pipeline`'s raw baseline on the C API: the four consumers' work at once,
/// a thread and a connection each.
pub async fn pipeline(
    path: PathBuf,
    durability: Durability,
    batch: usize,
    envs: Vec<Envelope>,
) -> Result<RawRunFigures, BenchError> {
    tokio::task::spawn_blocking(move || {
        let mut conns = FLEET_CONSUMERS
            .iter()
            .map(|_| open(&path, durability))
            .collect::<rusqlite::Result<Vec<_>>>()
            .map_err(err)?;
        let (started, cpu0) = (Instant::now(), cpu_seconds());
        let results: Vec<rusqlite::Result<(&str, f64, usize)>> = std::thread::scope(|s| {
            let handles: Vec<_> = conns
                .iter_mut()
                .zip(FLEET_CONSUMERS)
                .map(|(conn, consumer)| {
                    let envs = &envs;
                    s.spawn(move || {
                        let n = consumer_work(conn, consumer, envs, batch)?;
                        Ok((consumer, started.elapsed().as_secs_f64(), n))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(Err(rusqlite::Error::InvalidQuery)))
                .collect()
        });
        RawRunFigures::of(
            envs.len(),
            started.elapsed().as_secs_f64(),
            cpu_seconds() - cpu0,
            results,
        )
    })
    .await
    .map_err(err)?
}
