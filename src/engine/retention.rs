//! Retention of the dedup table: delete rows older than the retention in bounded
//! batches, one short transaction each.
//!
//! Why batches and not one `DELETE`: a single multi-million-row delete holds row
//! locks and a snapshot for minutes, bloats the WAL/binlog in one go and, if
//! interrupted, rolls everything back. A batch of a few thousand rows commits in
//! milliseconds, so a consumer inserting at the same time waits at most one batch,
//! and an interrupted purge keeps what it already deleted: rerunning it continues.
//! Why not daily partitions dropped whole: see `docs/SCALE.md` — the primary key of
//! a partitioned table must include the partition column, so `(consumer,
//! message_key)` would only be unique within a day, and a redelivery that crosses
//! midnight would be applied twice.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::store::{Store, StoreResult};

/// Where a running purge is, reported after every batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PurgeProgress {
    pub deleted: u64,
    pub batches: u64,
    pub elapsed_seconds: f64,
    pub rows_per_second: f64,
    pub last_batch_ms: f64,
}

/// How a purge ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PurgeSummary {
    pub cutoff: DateTime<Utc>,
    pub deleted: u64,
    pub batches: u64,
    pub seconds: f64,
    pub rows_per_second: f64,
    /// The longest batch: the most a concurrent writer of the same rows could wait.
    pub slowest_batch_ms: f64,
    /// Stopped between two batches on request; rerun to continue.
    pub interrupted: bool,
}

/// Knobs of one purge run.
#[derive(Debug, Clone, Copy)]
pub struct PurgePlan {
    pub cutoff: DateTime<Utc>,
    /// Rows per batch (per transaction).
    pub batch: i64,
    /// Sleep between batches, to leave I/O to the consumers.
    pub pause: Duration,
    /// Stop after this many rows (None: until done).
    pub max_rows: Option<u64>,
}

/// Purge until no row is older than the cutoff, `stop` is raised (checked between
/// batches, so a batch is never cut in half), or `max_rows` is reached.
pub async fn purge(
    store: &dyn Store,
    plan: PurgePlan,
    stop: &AtomicBool,
    mut on_batch: impl FnMut(&PurgeProgress),
) -> StoreResult<PurgeSummary> {
    let started = Instant::now();
    let (mut deleted, mut batches, mut slowest) = (0u64, 0u64, Duration::ZERO);
    let mut interrupted = false;
    loop {
        if stop.load(Ordering::SeqCst) {
            interrupted = true;
            break;
        }
        let batch = match plan.max_rows {
            Some(max) if deleted >= max => break,
            Some(max) => plan
                .batch
                .min(i64::try_from(max - deleted).unwrap_or(i64::MAX)),
            None => plan.batch,
        };
        let t = Instant::now();
        let n = store.purge_processed_batch(plan.cutoff, batch).await?;
        let took = t.elapsed();
        if n == 0 {
            break;
        }
        slowest = slowest.max(took);
        deleted += n;
        batches += 1;
        let elapsed = started.elapsed().as_secs_f64();
        on_batch(&PurgeProgress {
            deleted,
            batches,
            elapsed_seconds: elapsed,
            rows_per_second: rate(deleted, elapsed),
            last_batch_ms: took.as_secs_f64() * 1000.0,
        });
        if !plan.pause.is_zero() {
            tokio::time::sleep(plan.pause).await;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(PurgeSummary {
        cutoff: plan.cutoff,
        deleted,
        batches,
        seconds,
        rows_per_second: rate(deleted, seconds),
        slowest_batch_ms: slowest.as_secs_f64() * 1000.0,
        interrupted,
    })
}

fn rate(rows: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        rows as f64 / seconds
    } else {
        0.0
    }
}
