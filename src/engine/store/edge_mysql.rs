//! [`EdgeStore`] on MySQL / MariaDB.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::Row;

use super::edge::*;
use super::mysql::{retrying, MysqlStore};
use super::StoreResult;

fn naive(t: DateTime<Utc>) -> chrono::NaiveDateTime {
    t.naive_utc()
}

async fn insert_write(
    conn: &mut sqlx::MySqlConnection,
    write: &EdgeWrite,
    now: DateTime<Utc>,
) -> StoreResult<i64> {
    let id = match write {
        EdgeWrite::TripNote {
            device_id,
            text,
            principal,
        } => sqlx::query(
            "INSERT INTO trip_notes (device_id, text, principal, created_at) VALUES (?, ?, ?, ?)",
        )
        .bind(device_id)
        .bind(text)
        .bind(principal)
        .bind(naive(now)),
        EdgeWrite::VehicleCommand {
            device_id,
            command,
            principal,
        } => sqlx::query(
            "INSERT INTO vehicle_commands (device_id, command, principal, status, created_at)
             VALUES (?, ?, ?, 'queued', ?)",
        )
        .bind(device_id)
        .bind(command)
        .bind(principal)
        .bind(naive(now)),
    }
    .execute(conn)
    .await?
    .last_insert_id();
    Ok(i64::try_from(id).unwrap_or(i64::MAX))
}

/// Mark the key completed with `response`, if this request still holds `lease`.
async fn complete(
    conn: &mut sqlx::MySqlConnection,
    req: &IdemRequest<'_>,
    lease: LeaseToken,
    response: &StoredResponse,
    now: DateTime<Utc>,
) -> StoreResult<bool> {
    Ok(sqlx::query(
        "UPDATE idempotency_keys
         SET state = 'completed', response_status = ?, response_headers = ?, response_body = ?,
             completed_at = ?, locked_until = NULL
         WHERE scope = ? AND idem_key = ? AND state = 'in_progress' AND locked_until = ?",
    )
    .bind(i32::from(response.status))
    .bind(headers_json(&response.headers))
    .bind(&response.body)
    .bind(naive(now))
    .bind(req.scope)
    .bind(req.key)
    .bind(naive(lease.0))
    .execute(conn)
    .await?
    .rows_affected()
        == 1)
}

async fn begin_tx(store: &MysqlStore, req: &IdemRequest<'_>) -> StoreResult<IdemBegin> {
    let now = now_micros();
    let lease = after(now, req.lease);
    let mut tx = store.pool().begin().await?;
    let insert = "INSERT IGNORE INTO idempotency_keys
           (scope, idem_key, route, fingerprint, state, locked_until, created_at, expires_at)
         VALUES (?, ?, ?, ?, 'in_progress', ?, ?, ?)";
    let bind_insert = |q: sqlx::query::Query<'static, sqlx::MySql, sqlx::mysql::MySqlArguments>| {
        q.bind(req.scope.to_string())
            .bind(req.key.to_string())
            .bind(req.route.to_string())
            .bind(req.fingerprint.to_string())
            .bind(naive(lease))
            .bind(naive(now))
            .bind(naive(after(now, req.ttl)))
    };
    if bind_insert(sqlx::query(insert))
        .execute(&mut *tx)
        .await?
        .rows_affected()
        == 1
    {
        tx.commit().await?;
        return Ok(IdemBegin::Execute(LeaseToken(lease)));
    }
    let row = sqlx::query(
        "SELECT fingerprint, state, locked_until, response_status, response_headers,
                response_body, expires_at
         FROM idempotency_keys WHERE scope = ? AND idem_key = ? FOR UPDATE",
    )
    .bind(req.scope)
    .bind(req.key)
    .fetch_one(&mut *tx)
    .await?;
    let key = KeyRow {
        fingerprint: row.try_get("fingerprint")?,
        state: row.try_get("state")?,
        locked_until: row
            .try_get::<Option<chrono::NaiveDateTime>, _>("locked_until")?
            .map(|t| t.and_utc()),
        expires_at: row
            .try_get::<chrono::NaiveDateTime, _>("expires_at")?
            .and_utc(),
    };
    let outcome = match key_step(&key, req, now) {
        KeyStep::Expired => {
            sqlx::query("DELETE FROM idempotency_keys WHERE scope = ? AND idem_key = ?")
                .bind(req.scope)
                .bind(req.key)
                .execute(&mut *tx)
                .await?;
            bind_insert(sqlx::query(insert)).execute(&mut *tx).await?;
            IdemBegin::Execute(LeaseToken(lease))
        }
        KeyStep::Mismatch => IdemBegin::Mismatch,
        KeyStep::Replay => IdemBegin::Replay(StoredResponse {
            status: u16::try_from(row.try_get::<i32, _>("response_status")?).unwrap_or(500),
            headers: headers_from_json(
                row.try_get::<Option<String>, _>("response_headers")?
                    .as_deref(),
            ),
            body: row
                .try_get::<Option<Vec<u8>>, _>("response_body")?
                .unwrap_or_default(),
        }),
        KeyStep::InProgress(retry_after) => IdemBegin::InProgress { retry_after },
        KeyStep::TakeOver => {
            let took = sqlx::query(
                "UPDATE idempotency_keys SET locked_until = ?
                 WHERE scope = ? AND idem_key = ? AND state = 'in_progress'
                   AND locked_until <=> ?",
            )
            .bind(naive(lease))
            .bind(req.scope)
            .bind(req.key)
            .bind(key.locked_until.map(naive))
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if took == 1 {
                IdemBegin::Execute(LeaseToken(lease))
            } else {
                IdemBegin::InProgress {
                    retry_after: req.lease,
                }
            }
        }
    };
    tx.commit().await?;
    Ok(outcome)
}

#[async_trait]
impl EdgeStore for MysqlStore {
    async fn idem_begin(&self, req: &IdemRequest<'_>) -> StoreResult<IdemBegin> {
        // Concurrent first requests on one new key can deadlock in InnoDB: retried whole.
        retrying(|| begin_tx(self, req)).await
    }

    async fn idem_execute(
        &self,
        req: &IdemRequest<'_>,
        lease: LeaseToken,
        write: &EdgeWrite,
        respond: &RespondFn,
    ) -> StoreResult<Completion> {
        // A deadlock victim rolled back whole: running it again is safe.
        retrying(|| async {
            let now = now_micros();
            let mut tx = self.pool().begin().await?;
            let id = insert_write(&mut tx, write, now).await?;
            let response = respond(id);
            if !complete(&mut tx, req, lease, &response, now).await? {
                tx.rollback().await?;
                return Ok(Completion::LeaseLost);
            }
            tx.commit().await?;
            Ok(Completion::Done(response))
        })
        .await
    }

    async fn idem_store(
        &self,
        req: &IdemRequest<'_>,
        lease: LeaseToken,
        response: &StoredResponse,
    ) -> StoreResult<Completion> {
        let mut conn = self.pool().acquire().await?;
        Ok(
            if complete(&mut conn, req, lease, response, now_micros()).await? {
                Completion::Done(response.clone())
            } else {
                Completion::LeaseLost
            },
        )
    }

    async fn idem_release(&self, req: &IdemRequest<'_>, lease: LeaseToken) -> StoreResult<()> {
        sqlx::query(
            "DELETE FROM idempotency_keys
             WHERE scope = ? AND idem_key = ? AND state = 'in_progress' AND locked_until = ?",
        )
        .bind(req.scope)
        .bind(req.key)
        .bind(naive(lease.0))
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn edge_write(
        &self,
        write: &EdgeWrite,
        respond: &RespondFn,
    ) -> StoreResult<StoredResponse> {
        let mut tx = self.pool().begin().await?;
        let id = insert_write(&mut tx, write, now_micros()).await?;
        tx.commit().await?;
        Ok(respond(id))
    }

    async fn purge_idempotency_batch(&self, now: DateTime<Utc>, batch: i64) -> StoreResult<u64> {
        Ok(sqlx::query(
            "DELETE FROM idempotency_keys WHERE expires_at < ? ORDER BY expires_at LIMIT ?",
        )
        .bind(naive(now))
        .bind(batch)
        .execute(self.pool())
        .await?
        .rows_affected())
    }

    async fn trip_notes(&self, device_id: &str) -> StoreResult<Vec<(i64, String)>> {
        Ok(
            sqlx::query_as("SELECT id, text FROM trip_notes WHERE device_id = ? ORDER BY id")
                .bind(device_id)
                .fetch_all(self.pool())
                .await?,
        )
    }

    async fn vehicle_commands(&self, device_id: &str) -> StoreResult<Vec<(i64, String)>> {
        Ok(sqlx::query_as(
            "SELECT id, command FROM vehicle_commands WHERE device_id = ? ORDER BY id",
        )
        .bind(device_id)
        .fetch_all(self.pool())
        .await?)
    }
}
