//! [`RepairStore`] on MySQL/MariaDB.

use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::{MySql, Row};

use super::mysql::MysqlStore;
use super::mysql::{claim_from_row, CLAIM_COLUMNS};
use super::repair::*;
use super::{Claim, ClaimState, DeadLetter, StoreResult};

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
    async fn keep_claim_message(
        &self,
        consumer: &str,
        key: &str,
        message: &[u8],
    ) -> StoreResult<()> {
        sqlx::query(
            "UPDATE side_effect_claims SET message = ?
             WHERE consumer = ? AND message_key = ? AND state = 'claimed'",
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
            "UPDATE side_effect_claims SET state = 'claimed', claimed_at = ?, finished_at = NULL,
             detail = ? WHERE consumer = ? AND message_key = ? AND state = 'failed'",
        )
        .bind(DateTime::<Utc>::UNIX_EPOCH.naive_utc())
        .bind(detail)
        .bind(consumer)
        .bind(key)
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(n == 1)
    }

    async fn list_claims(&self, filter: &ClaimFilter) -> StoreResult<Vec<Claim>> {
        let rows = claim_query::<MySql>(CLAIM_COLUMNS, filter)
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
        let rows =
            stranded_query::<MySql, _>(CLAIM_COLUMNS, consumers, claimed_before.naive_utc(), limit)
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
            "UPDATE side_effect_claims SET state = ?, finished_at = ?, detail = ?
             WHERE consumer = ? AND message_key = ? AND state = 'claimed'",
        )
        .bind(state.as_str())
        .bind(Utc::now().naive_utc())
        .bind(detail)
        .bind(consumer)
        .bind(key)
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(n == 1)
    }
}

fn stranded(row: &sqlx::mysql::MySqlRow) -> StoreResult<StrandedClaim> {
    Ok(StrandedClaim {
        claim: claim_from_row(row)?,
        message: row.try_get("message")?,
    })
}
