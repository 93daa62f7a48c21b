//! [`EdgeStore`] on every backend, written once over the dialect layer: the backend
//! binds times, opens write transactions (`BEGIN IMMEDIATE` on SQLite), spells the
//! insert that skips an existing key, the null-safe compare and the row lock, and
//! reports a new row's id. Retention is a native statement per backend.

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::dialect::{binds, each, retrying, Kind, Row, Sql, SqlTx};
use super::edge::*;
use super::{Backend, StoreResult};

use Kind::{Bytes, Int, Json, Text, Time};

/// The HTTP edge's tables in the store's database.
pub(crate) struct SqlEdge(pub Box<dyn Sql>);

async fn insert_write(
    tx: &mut dyn SqlTx,
    write: &EdgeWrite,
    now: DateTime<Utc>,
) -> StoreResult<i64> {
    let id = match write {
        EdgeWrite::TripNote {
            device_id,
            text,
            principal,
        } => {
            let sql = "INSERT INTO trip_notes (device_id, text, principal, created_at)
                       VALUES (?, ?, ?, ?)";
            tx.insert(sql, &binds![device_id, text, principal, now])
                .await?
        }
        EdgeWrite::VehicleCommand {
            device_id,
            command,
            principal,
        } => {
            let sql =
                "INSERT INTO vehicle_commands (device_id, command, principal, status, created_at)
                       VALUES (?, ?, ?, 'queued', ?)";
            tx.insert(sql, &binds![device_id, command, principal, now])
                .await?
        }
    };
    Ok(id)
}

/// Mark the key completed with `response`, if this request still holds `lease`.
async fn complete(
    tx: &mut dyn SqlTx,
    req: &IdemRequest<'_>,
    lease: LeaseToken,
    response: &StoredResponse,
    now: DateTime<Utc>,
) -> StoreResult<bool> {
    let headers = serde_json::to_value(&response.headers).unwrap_or_default();
    let sql = "UPDATE idempotency_keys
         SET state = 'completed', response_status = ?, response_headers = ?, response_body = ?,
             completed_at = ?, locked_until = NULL
         WHERE scope = ? AND idem_key = ? AND state = 'in_progress' AND locked_until = ?";
    let binds = binds![
        i64::from(response.status),
        &headers,
        response.body.as_slice(),
        now,
        req.scope,
        req.key,
        lease.0
    ];
    Ok(tx.execute(sql, &binds).await?.rows_affected == 1)
}

impl SqlEdge {
    /// Phase 1 in one transaction; on MySQL concurrent first requests on one new key
    /// can deadlock, and the loser is retried whole.
    async fn begin_tx(&self, req: &IdemRequest<'_>) -> StoreResult<IdemBegin> {
        let now = now_micros();
        let lease = after(now, req.lease);
        let mut tx = self.0.begin().await?;
        let insert = self.0.insert_or_skip(
            "INTO idempotency_keys
               (scope, idem_key, route, fingerprint, state, locked_until, created_at, expires_at)
             VALUES (?, ?, ?, ?, 'in_progress', ?, ?, ?)",
        );
        let (scope, key) = (req.scope, req.key);
        let insert_binds = binds![
            scope,
            key,
            req.route,
            req.fingerprint,
            lease,
            now,
            after(now, req.ttl)
        ];
        if tx.execute(&insert, &insert_binds).await?.rows_affected == 1 {
            tx.commit().await?;
            return Ok(IdemBegin::Execute(LeaseToken(lease)));
        }
        let select = format!(
            "SELECT fingerprint, state, locked_until, response_status, response_headers,
                    response_body, expires_at
             FROM idempotency_keys WHERE scope = ? AND idem_key = ?{}",
            self.0.lock_read()
        );
        let kinds = [Text, Text, Time, Int, Json, Bytes, Time];
        let row = tx.one(&select, &binds![scope, key], &kinds).await?;
        let stored = KeyRow {
            fingerprint: row.text(0)?,
            state: row.text(1)?,
            locked_until: row.time(2),
            expires_at: row.at(6),
        };
        let outcome = match key_step(&stored, req, now) {
            KeyStep::Expired => {
                let delete = "DELETE FROM idempotency_keys WHERE scope = ? AND idem_key = ?";
                tx.execute(delete, &binds![scope, key]).await?;
                tx.execute(&insert, &insert_binds).await?;
                IdemBegin::Execute(LeaseToken(lease))
            }
            KeyStep::Mismatch => IdemBegin::Mismatch,
            KeyStep::Replay => IdemBegin::Replay(StoredResponse {
                status: u16::try_from(row.int(3)?).unwrap_or(500),
                headers: row
                    .json(4)
                    .and_then(|h| serde_json::from_value(h).ok())
                    .unwrap_or_default(),
                body: row.opt_bytes(5).unwrap_or_default(),
            }),
            KeyStep::InProgress(retry_after) => IdemBegin::InProgress { retry_after },
            KeyStep::TakeOver => {
                let take = format!(
                    "UPDATE idempotency_keys SET locked_until = ?
                     WHERE scope = ? AND idem_key = ? AND state = 'in_progress'
                       AND locked_until {} ?",
                    self.0.null_safe_eq()
                );
                let binds = binds![lease, scope, key, stored.locked_until];
                if tx.execute(&take, &binds).await?.rows_affected == 1 {
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
}

#[async_trait]
impl EdgeStore for SqlEdge {
    async fn idem_begin(&self, req: &IdemRequest<'_>) -> StoreResult<IdemBegin> {
        retrying(|| self.begin_tx(req)).await
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
            let mut tx = self.0.begin().await?;
            let id = insert_write(tx.as_mut(), write, now).await?;
            let response = respond(id);
            if !complete(tx.as_mut(), req, lease, &response, now).await? {
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
        let mut tx = self.0.begin().await?;
        let completed = complete(tx.as_mut(), req, lease, response, now_micros()).await?;
        tx.commit().await?;
        Ok(if completed {
            Completion::Done(response.clone())
        } else {
            Completion::LeaseLost
        })
    }

    async fn idem_release(&self, req: &IdemRequest<'_>, lease: LeaseToken) -> StoreResult<()> {
        let sql = "DELETE FROM idempotency_keys
             WHERE scope = ? AND idem_key = ? AND state = 'in_progress' AND locked_until = ?";
        self.0
            .execute(sql, &binds![req.scope, req.key, lease.0])
            .await?;
        Ok(())
    }

    async fn edge_write(
        &self,
        write: &EdgeWrite,
        respond: &RespondFn,
    ) -> StoreResult<StoredResponse> {
        let mut tx = self.0.begin().await?;
        let id = insert_write(tx.as_mut(), write, now_micros()).await?;
        tx.commit().await?;
        Ok(respond(id))
    }

    async fn purge_idempotency_batch(&self, now: DateTime<Utc>, batch: i64) -> StoreResult<u64> {
        let sql = match self.0.backend() {
            Backend::Mysql => {
                "DELETE FROM idempotency_keys WHERE expires_at < ? ORDER BY expires_at LIMIT ?"
            }
            Backend::Postgres => {
                "DELETE FROM idempotency_keys WHERE (scope, idem_key) IN (
                    SELECT scope, idem_key FROM idempotency_keys WHERE expires_at < ?
                    ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED)"
            }
            Backend::Sqlite => {
                "DELETE FROM idempotency_keys WHERE (scope, idem_key) IN (
                    SELECT scope, idem_key FROM idempotency_keys WHERE expires_at < ?
                    ORDER BY expires_at LIMIT ?)"
            }
        };
        Ok(self
            .0
            .execute(sql, &binds![now, batch])
            .await?
            .rows_affected)
    }

    async fn trip_notes(&self, device_id: &str) -> StoreResult<Vec<(i64, String)>> {
        self.id_and_text(
            "SELECT id, text FROM trip_notes WHERE device_id = ? ORDER BY id",
            device_id,
        )
        .await
    }

    async fn vehicle_commands(&self, device_id: &str) -> StoreResult<Vec<(i64, String)>> {
        let sql = "SELECT id, command FROM vehicle_commands WHERE device_id = ? ORDER BY id";
        self.id_and_text(sql, device_id).await
    }
}

impl SqlEdge {
    async fn id_and_text(&self, sql: &str, device_id: &str) -> StoreResult<Vec<(i64, String)>> {
        let row = |r: &Row| Ok::<_, sqlx::Error>((r.int(0)?, r.text(1)?));
        Ok(each(&*self.0, sql, &binds![device_id], &[Int, Text], row).await?)
    }
}
