//! [`RepairStore`] on PostgreSQL.

use async_trait::async_trait;
use sqlx::{Postgres, Row};

use super::postgres::PostgresStore;
use super::repair::*;
use super::{DeadLetter, StoreResult};

#[async_trait]
impl RepairStore for PostgresStore {
    async fn find_dead_letters(&self, filter: &DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        let mut q = dead_letter_query::<Postgres, _>(
            "SELECT id, consumer, reason, detail, raw, received_at, replayed_at, replay_count
             FROM dead_letters",
            filter,
            filter.since,
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
                    received_at: r.try_get("received_at")?,
                    replayed_at: r.try_get("replayed_at")?,
                    replay_count: i64::from(r.try_get::<i32, _>("replay_count")?),
                })
            })
            .collect()
    }

    async fn mark_replayed(&self, id: i64) -> StoreResult<bool> {
        let n = sqlx::query(
            "UPDATE dead_letters SET replayed_at = now(), replay_count = replay_count + 1
             WHERE id = $1",
        )
        .bind(id)
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(n == 1)
    }
}
