//! [`RepairStore`] on PostgreSQL.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{Postgres, Row};

use super::postgres::PostgresStore;
use super::postgres::{claim_from_row, CLAIM_COLUMNS};
use super::repair::*;
use super::{Claim, ClaimState, DeadLetter, StoreResult};

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
    async fn keep_claim_message(
        &self,
        consumer: &str,
        key: &str,
        message: &[u8],
    ) -> StoreResult<()> {
        sqlx::query(
            "UPDATE side_effect_claims SET message = $1
             WHERE consumer = $2 AND message_key = $3 AND state = 'claimed'",
        )
        .bind(message)
        .bind(consumer)
        .bind(key)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn rearm_failed_claim(
        &self,
        consumer: &str,
        key: &str,
        detail: &str,
    ) -> StoreResult<bool> {
        let n = sqlx::query(
            "UPDATE side_effect_claims SET state = 'claimed', claimed_at = 'epoch',
             finished_at = NULL, detail = $1
             WHERE consumer = $2 AND message_key = $3 AND state = 'failed'",
        )
        .bind(detail)
        .bind(consumer)
        .bind(key)
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(n == 1)
    }

    async fn list_claims(&self, filter: &ClaimFilter) -> StoreResult<Vec<Claim>> {
        let rows = claim_query::<Postgres>(CLAIM_COLUMNS, filter)
            .build()
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(claim_from_row).collect()
    }

    async fn stranded_claims(
        &self,
        consumers: &[&str],
        claimed_before: DateTime<Utc>,
        limit: i64,
    ) -> StoreResult<Vec<StrandedClaim>> {
        let rows = stranded_query::<Postgres, _>(CLAIM_COLUMNS, consumers, claimed_before, limit)
            .build()
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(stranded).collect()
    }

    async fn resolve_claim(
        &self,
        consumer: &str,
        key: &str,
        state: ClaimState,
        detail: &str,
    ) -> StoreResult<bool> {
        let n = sqlx::query(
            "UPDATE side_effect_claims SET state = $1, finished_at = $2, detail = $3
             WHERE consumer = $4 AND message_key = $5 AND state = 'claimed'",
        )
        .bind(state.as_str())
        .bind(Utc::now())
        .bind(detail)
        .bind(consumer)
        .bind(key)
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(n == 1)
    }
}

fn stranded(row: &sqlx::postgres::PgRow) -> StoreResult<StrandedClaim> {
    Ok(StrandedClaim {
        claim: claim_from_row(row)?,
        message: row.try_get("message")?,
    })
}
