//! [`RepairStore`] on MySQL/MariaDB.

use async_trait::async_trait;
use chrono::{NaiveDateTime, Utc};
use sqlx::{MySql, Row};

use super::mysql::MysqlStore;
use super::repair::*;
use super::{DeadLetter, StoreResult};

#[async_trait]
impl RepairStore for MysqlStore {
    async fn find_dead_letters(&self, filter: &DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        let mut q = dead_letter_query::<MySql, _>(
            "SELECT id, CAST(consumer AS CHAR) AS consumer, CAST(reason AS CHAR) AS reason,
                    detail, raw, received_at, replayed_at, replay_count
             FROM dead_letters",
            filter,
            filter.since.map(|t| t.naive_utc()),
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
                    received_at: r.try_get::<NaiveDateTime, _>("received_at")?.and_utc(),
                    replayed_at: r
                        .try_get::<Option<NaiveDateTime>, _>("replayed_at")?
                        .map(|t| t.and_utc()),
                    replay_count: i64::from(r.try_get::<i32, _>("replay_count")?),
                })
            })
            .collect()
    }

    async fn mark_replayed(&self, id: i64) -> StoreResult<bool> {
        let n = sqlx::query(
            "UPDATE dead_letters SET replayed_at = ?, replay_count = replay_count + 1 WHERE id = ?",
        )
        .bind(Utc::now().naive_utc())
        .bind(id)
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(n == 1)
    }
}
