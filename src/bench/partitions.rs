//! The alternative to a batched purge, measured: `processed_messages` partitioned
//! by day on `processed_at`, retention by dropping a whole day.
//!
//! Run it only on a scratch database: it replaces `processed_messages` with a
//! partitioned table. It also shows why idemwatch does not ship this layout: the
//! primary key of a partitioned table must contain the partition column, so the
//! dedup key becomes `(consumer, message_key, processed_at)` and the same message
//! recorded on two days is accepted twice (`duplicate_across_days_accepted`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Days, Utc};
use serde::Serialize;
use sqlx::Executor;

use super::*;

/// What dropping one day cost, and what the layout costs the dedup invariant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PartitionReport {
    pub db: String,
    pub load: LoadReport,
    pub partition: String,
    pub partition_rows: i64,
    pub detach_concurrently_ms: f64,
    pub drop_ms: f64,
    pub writer_during_drop: WriterReport,
    /// The same (consumer, message_key) inserted with processed_at on two different
    /// days: both rows were accepted (the invariant is broken across partitions).
    pub duplicate_across_days_accepted: bool,
}

fn day_start(t: DateTime<Utc>) -> DateTime<Utc> {
    t.date_naive()
        .and_hms_opt(0, 0, 0)
        .unwrap_or_default()
        .and_utc()
}

fn partition_name(day: DateTime<Utc>) -> String {
    format!("processed_messages_p{}", day.format("%Y%m%d"))
}

/// Replace `processed_messages` by a daily-partitioned table, fill it like
/// [`load`], then detach and drop the oldest full day while a paced writer runs.
pub async fn partition_drop(
    url: &str,
    plan: LoadPlan,
    writer_per_second: u32,
    mut progress: impl FnMut(&str) + Send,
) -> BenchResult<PartitionReport> {
    require_postgres(url)?;
    drop(store::open(url).await?);
    let pool = admin_pool(url, 4).await?;
    let now = Utc::now();
    let first = day_start(now - chrono::Duration::days(i64::from(plan.days)));
    pool.execute(
        "DROP TABLE processed_messages;
         CREATE TABLE processed_messages (
             consumer      text        NOT NULL,
             message_key   text        NOT NULL,
             payload_hash  text        NOT NULL,
             processed_at  timestamptz NOT NULL DEFAULT now()
         ) PARTITION BY RANGE (processed_at)",
    )
    .await?;
    let mut day = first;
    let last = day_start(now) + chrono::Duration::days(2);
    while day < last {
        let next = day + chrono::Duration::days(1);
        pool.execute(
            format!(
                "CREATE TABLE {} PARTITION OF processed_messages FOR VALUES FROM ('{}') TO ('{}')",
                partition_name(day),
                day.to_rfc3339(),
                next.to_rfc3339()
            )
            .as_str(),
        )
        .await?;
        day = next;
    }
    pool.close().await;
    progress("partitioned table created; loading (indexes are built after the load)");
    // `load` drops and rebuilds the indexes it finds; the partitioned table has
    // none yet, so the keys are added afterwards, as the partitioned layout needs.
    let load_report = load(url, plan, &mut progress).await?;
    let pool = admin_pool(url, 4).await?;
    let t = Instant::now();
    pool.execute(
        "ALTER TABLE processed_messages ADD PRIMARY KEY (consumer, message_key, processed_at);
         CREATE INDEX processed_messages_consumer_at ON processed_messages (consumer, processed_at);
         CREATE INDEX processed_messages_processed_at ON processed_messages (processed_at);
         ANALYZE processed_messages",
    )
    .await?;
    progress(&format!(
        "keys and indexes on the partitions in {:.1}s",
        t.elapsed().as_secs_f64()
    ));
    let duplicate_across_days_accepted = sqlx::query(
        "INSERT INTO processed_messages VALUES
           ('bench-invariant', 'X:1:zone_exit', 'h', $1), ('bench-invariant', 'X:1:zone_exit', 'h', $2)
         ON CONFLICT DO NOTHING",
    )
    .bind(now - chrono::Duration::hours(25))
    .bind(now)
    .execute(&pool)
    .await?
    .rows_affected()
        == 2;
    // The oldest day that is fully covered by the generated rows.
    let victim_day = first.checked_add_days(Days::new(1)).unwrap_or(first);
    let partition = partition_name(victim_day);
    let partition_rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {partition}"))
        .fetch_one(&pool)
        .await?;
    let writer_store = store::open(url).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(paced_writer(writer_store, writer_per_second, stop.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t = Instant::now();
    pool.execute(
        format!("ALTER TABLE processed_messages DETACH PARTITION {partition} CONCURRENTLY")
            .as_str(),
    )
    .await?;
    let detach_concurrently_ms = t.elapsed().as_secs_f64() * 1000.0;
    let t = Instant::now();
    pool.execute(format!("DROP TABLE {partition}").as_str())
        .await?;
    let drop_ms = t.elapsed().as_secs_f64() * 1000.0;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    let (latencies, errors) = writer
        .await
        .map_err(|e| BenchError::Usage(format!("the writer panicked: {e}")))?;
    pool.close().await;
    Ok(PartitionReport {
        db: store::redact_url(url),
        load: load_report,
        partition,
        partition_rows,
        detach_concurrently_ms,
        drop_ms,
        writer_during_drop: writer_report(latencies, errors, writer_per_second),
        duplicate_across_days_accepted,
    })
}
