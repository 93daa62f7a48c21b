//! [`RepairStore`] on SQLite.

use async_trait::async_trait;
use chrono::Utc;
use sqlx::{Row, Sqlite};

use super::repair::*;
use super::sqlite::SqliteStore;
use super::{parse_ts, ts, DeadLetter, StoreResult};

#[async_trait]
impl RepairStore for SqliteStore {
    async fn find_dead_letters(&self, filter: &DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        let mut q = dead_letter_query::<Sqlite, _>(
            "SELECT id, consumer, reason, detail, raw, received_at, replayed_at, replay_count
             FROM dead_letters",
            filter,
            filter.since.map(ts),
        );
        let rows = q.build().fetch_all(self.pool()).await?;
        rows.iter()
            .map(|r| {
                Ok(DeadLetter {
                    id: r.try_get("id")?,
                    consumer: r.try_get("consumer")?,
                    reason: r.try_get("reason")?,
                    detail: r.try_get("detail")?,
                    raw: r.try_get("raw")?,
                    received_at: parse_ts(r.try_get::<&str, _>("received_at")?),
                    replayed_at: r.try_get::<Option<&str>, _>("replayed_at")?.map(parse_ts),
                    replay_count: r.try_get("replay_count")?,
                })
            })
            .collect()
    }

    async fn mark_replayed(&self, id: i64) -> StoreResult<bool> {
        let n = sqlx::query(
            "UPDATE dead_letters SET replayed_at = ?, replay_count = replay_count + 1 WHERE id = ?",
        )
        .bind(ts(Utc::now()))
        .bind(id)
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(n == 1)
    }
}
