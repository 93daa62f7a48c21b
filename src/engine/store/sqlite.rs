//! [`Store`] on SQLite (the embedded default), WAL mode.
//!
//! SQLite serialises writers. Every write transaction starts with `BEGIN IMMEDIATE`
//! so it takes the write lock up front: a transaction that reads before it writes
//! (the claim takeover) can then never fail with a busy snapshot under WAL. The
//! connection plumbing (pool options, the held writer connection) is in
//! `sqlite_conn.rs`; the statements the same on every backend are in the dialect
//! layer's files.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::sqlite::SqliteSynchronous;
use sqlx::{QueryBuilder, Row, Sqlite, SqlitePool};

use super::claim_batch;
use super::sqlite_conn::{connect_sqlite, HeldConnection, OneWriteTx};
use super::vehicle_batch::{VehicleBatch, VehicleItem};
use super::vehicle_sql::{vehicle_upsert_tail, VEHICLE_UPSERT_HEAD};
use super::*;
use crate::engine::envelope::Message;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./assets/migrations/sqlite");

/// The embedded SQLite store.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    /// The connection batches are written on (see [`OneWriteTx`]).
    batch_writer: Arc<HeldConnection>,
    url: String,
    durability: Durability,
}

impl SqliteStore {
    /// Durable: `synchronous=FULL`, the WAL is fsynced at every commit. Relaxed:
    /// `NORMAL`, fsynced at checkpoints only, so a power cut can undo the last
    /// commits (a process crash cannot: the WAL is already in the OS).
    pub async fn open(url: &str, durability: Durability) -> StoreResult<Self> {
        let synchronous = match durability {
            Durability::Durable => SqliteSynchronous::Full,
            Durability::Relaxed => SqliteSynchronous::Normal,
        };
        let pool = connect_sqlite(url, 8, synchronous).await?;
        MIGRATOR.run(&pool).await?;
        Ok(SqliteStore {
            pool,
            batch_writer: Arc::new(HeldConnection::default()),
            url: url.to_string(),
            durability,
        })
    }

    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn begin(&self) -> StoreResult<sqlx::Transaction<'static, sqlx::Sqlite>> {
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
    }
}

pub(super) fn claim_from_row(row: &sqlx::sqlite::SqliteRow) -> StoreResult<Claim> {
    let state: String = row.try_get("state")?;
    Ok(Claim {
        consumer: row.try_get("consumer")?,
        message_key: row.try_get("message_key")?,
        provider_key: row.try_get("provider_key")?,
        state: ClaimState::parse(&state).unwrap_or(ClaimState::Claimed),
        claimed_at: parse_ts(row.try_get::<&str, _>("claimed_at")?),
        finished_at: row.try_get::<Option<&str>, _>("finished_at")?.map(parse_ts),
        attempts: row.try_get("attempts")?,
        detail: row.try_get("detail")?,
    })
}

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> Backend {
        Backend::Sqlite
    }

    fn sql(&self) -> SqlHandle {
        SqlHandle::of(self.pool.clone())
    }

    fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }

    fn durability(&self) -> Durability {
        self.durability
    }

    async fn record_batch(
        &self,
        consumer: &str,
        items: &[Recordable],
    ) -> StoreResult<Vec<DedupOutcome>> {
        let batch = DedupBatch::new(items);
        let now = ts(Utc::now());
        let mut tx = OneWriteTx::begin(&self.pool, &self.batch_writer).await?;
        // Call 1: take the write lock and read which keys are already stored (the
        // duplicates: a handful). SQLite's one writer is us until the commit, so no
        // other writer can store one of the rest in between.
        let mut q = QueryBuilder::<Sqlite>::new("BEGIN IMMEDIATE");
        for chunk in batch.distinct().chunks(ROWS_PER_STATEMENT) {
            q.push("; SELECT message_key, payload_hash FROM processed_messages WHERE consumer = ")
                .push_bind(consumer)
                .push(" AND message_key IN ");
            q.push_tuples(chunk, |mut t, item| {
                t.push_bind(item.key.as_str());
            });
        }
        let read = q.build_query_as().fetch_all(tx.conn()).await;
        let rows: Vec<(String, String)> = tx.check(read)?;
        let stored: HashMap<String, String> = rows.into_iter().collect();
        let (fresh, inserted) = batch.fresh(&stored);
        let outcomes = batch.outcomes(&inserted, &stored)?;
        // Call 2: the dedup rows (a plain INSERT: a key stored after all would fail
        // the statement, never pass for applied), the merged business rows, COMMIT.
        let mut q = QueryBuilder::<Sqlite>::new("");
        for chunk in fresh.chunks(ROWS_PER_STATEMENT) {
            q.push(
                "INSERT INTO processed_messages (consumer, message_key, payload_hash, processed_at) ",
            );
            q.push_values(chunk, |mut row, item| {
                row.push_bind(consumer)
                    .push_bind(item.key.as_str())
                    .push_bind(item.fingerprint.as_str())
                    .push_bind(&now);
            });
            q.push("; ");
        }
        for chunk in batch.zone_exits(&outcomes).chunks(ROWS_PER_STATEMENT) {
            q.push("INSERT INTO trip_counters (device_id, zone_exits) ");
            q.push_values(chunk, |mut row, (device, n)| {
                row.push_bind(*device).push_bind(*n);
            });
            q.push(
                " ON CONFLICT (device_id) DO UPDATE
                  SET zone_exits = trip_counters.zone_exits + excluded.zone_exits; ",
            );
        }
        q.push("COMMIT");
        let written = q.build().execute(tx.conn()).await;
        tx.check(written)?;
        tx.finish();
        Ok(outcomes)
    }

    async fn apply_vehicle_batch(&self, envs: &[Message]) -> StoreResult<Vec<VehicleOutcome>> {
        let batch = VehicleBatch::new(envs)?;
        let devices = batch.devices();
        let distinct: Vec<&VehicleItem> = batch.distinct().collect();
        let now = ts(Utc::now());
        let mut tx = OneWriteTx::begin(&self.pool, &self.batch_writer).await?;
        // Call 1: the write lock, the history rows already stored (duplicates: a
        // handful) and each device's seq. Nobody else writes until our COMMIT.
        let mut q = QueryBuilder::<Sqlite>::new("BEGIN IMMEDIATE");
        for chunk in distinct.chunks(ROWS_PER_STATEMENT) {
            q.push("; SELECT h.device_id, h.seq, h.event_type, h.payload_hash FROM (");
            q.push_values(chunk, |mut row, item| {
                let (device, seq, event_type) = item.key();
                row.push_bind(device).push_bind(seq).push_bind(event_type);
            });
            q.push(
                ") v JOIN vehicle_history h
                 ON h.device_id = v.column1 AND h.seq = v.column2 AND h.event_type = v.column3",
            );
        }
        for chunk in devices.chunks(ROWS_PER_STATEMENT) {
            q.push(
                "; SELECT device_id, last_seq, NULL, NULL FROM vehicle_state WHERE device_id IN ",
            );
            q.push_tuples(chunk, |mut t, device| {
                t.push_bind(*device);
            });
        }
        let read = q.build_query_as().fetch_all(tx.conn()).await;
        let rows: Vec<(String, i64, Option<String>, Option<String>)> = tx.check(read)?;
        let mut stored = HashMap::new();
        let mut last_seq = HashMap::new();
        for (device, seq, event_type, hash) in rows {
            match (event_type, hash) {
                (Some(event_type), Some(hash)) => {
                    stored.insert((device, seq, event_type), hash);
                }
                _ => {
                    last_seq.insert(device, seq);
                }
            }
        }
        let (outcomes, writes) = batch.decide(&stored, &last_seq);
        // Call 2: the new history rows (a plain INSERT: a row stored after all would
        // fail the statement, never pass for new), each applied event's upsert in
        // order, COMMIT.
        let mut q = QueryBuilder::<Sqlite>::new("");
        for chunk in writes.history.chunks(ROWS_PER_STATEMENT) {
            q.push(
                "INSERT INTO vehicle_history
                   (device_id, seq, event_type, occurred_at, received_at, applied, payload, payload_hash) ",
            );
            q.push_values(chunk, |mut row, (item, applied)| {
                row.push_bind(item.env.device_id.as_str())
                    .push_bind(item.facts.seq)
                    .push_bind(item.facts.event_type)
                    .push_bind(ts(item.env.occurred_at))
                    .push_bind(&now)
                    .push_bind(*applied)
                    .push_bind(item.facts.payload.as_str())
                    .push_bind(item.fingerprint.as_str());
            });
            q.push("; ");
        }
        for item in &writes.upserts {
            q.push(VEHICLE_UPSERT_HEAD);
            q.push(" VALUES (");
            let mut row = q.separated(", ");
            row.push_bind(item.env.device_id.as_str())
                .push_bind(item.facts.seq)
                .push_bind(item.facts.event_type)
                .push_bind(item.facts.ignition)
                .push_bind(item.facts.zone)
                .push_bind(item.facts.lat)
                .push_bind(item.facts.lon)
                .push_bind(ts(item.env.occurred_at))
                .push_bind(&now);
            q.push(") ").push(vehicle_upsert_tail(true)).push("; ");
        }
        q.push("COMMIT");
        let written = q.build().execute(tx.conn()).await;
        tx.check(written)?;
        tx.finish();
        Ok(outcomes)
    }

    async fn claim_batch(
        &self,
        consumer: &str,
        requests: &[ClaimRequest],
        lease: Duration,
    ) -> StoreResult<Vec<ClaimOutcome>> {
        // Read back as stored, so a later compare-and-set on it matches.
        let now = parse_ts(&ts(Utc::now()));
        let keys = claim_batch::sorted_keys(requests);
        let mut tx = OneWriteTx::begin(&self.pool, &self.batch_writer).await?;
        // Call 1: the write lock, the stored dedup rows of these keys and their claims.
        let mut q = QueryBuilder::<Sqlite>::new("BEGIN IMMEDIATE");
        for chunk in keys.chunks(ROWS_PER_STATEMENT) {
            q.push(
                "; SELECT p.message_key AS stored_key, p.payload_hash AS stored_hash,
                   c.consumer, c.message_key, c.provider_key, c.state, c.claimed_at,
                   c.finished_at, c.attempts, c.detail
                 FROM processed_messages p LEFT JOIN side_effect_claims c
                   ON c.consumer = p.consumer AND c.message_key = p.message_key
                 WHERE p.consumer = ",
            )
            .push_bind(consumer)
            .push(" AND p.message_key IN ");
            q.push_tuples(chunk, |mut t, key| {
                t.push_bind(*key);
            });
        }
        let read = q.build().fetch_all(tx.conn()).await;
        let rows = tx.check(read)?;
        let (mut stored, mut claims) = (HashMap::new(), HashMap::new());
        for row in &rows {
            let key: String = row.try_get("stored_key")?;
            if row.try_get::<Option<String>, _>("state")?.is_some() {
                claims.insert(key.clone(), claim_from_row(row)?);
            }
            stored.insert(key, row.try_get::<String, _>("stored_hash")?);
        }
        let (outcomes, writes) =
            claim_batch::decide(consumer, requests, &stored, &claims, now, lease);
        // Call 2: dedup rows and claims of the new keys, the takeovers, COMMIT.
        let now = ts(now);
        let mut q = QueryBuilder::<Sqlite>::new("");
        for chunk in writes.fresh.chunks(ROWS_PER_STATEMENT) {
            q.push(
                "INSERT INTO processed_messages (consumer, message_key, payload_hash, processed_at) ",
            );
            q.push_values(chunk, |mut row, r| {
                row.push_bind(consumer)
                    .push_bind(r.key.as_str())
                    .push_bind(r.fingerprint.as_str())
                    .push_bind(&now);
            });
            q.push(
                "; INSERT INTO side_effect_claims
                   (consumer, message_key, provider_key, state, claimed_at, attempts, message) ",
            );
            q.push_values(chunk, |mut row, r| {
                row.push_bind(consumer)
                    .push_bind(r.key.as_str())
                    .push_bind(r.provider_key.as_str())
                    .push_bind("claimed")
                    .push_bind(&now)
                    .push_bind(1i64)
                    .push_bind(r.message.as_slice());
            });
            q.push("; ");
        }
        for (r, claimed_at) in &writes.takeovers {
            q.push("UPDATE side_effect_claims SET claimed_at = ")
                .push_bind(&now)
                .push(", attempts = attempts + 1, message = ")
                .push_bind(r.message.as_slice())
                .push(" WHERE consumer = ")
                .push_bind(consumer)
                .push(" AND message_key = ")
                .push_bind(r.key.as_str())
                .push(" AND state = 'claimed' AND claimed_at = ")
                .push_bind(ts(*claimed_at))
                .push("; ");
        }
        q.push("COMMIT");
        let written = q.build().execute(tx.conn()).await;
        tx.check(written)?;
        tx.finish();
        Ok(outcomes)
    }

    async fn finish_batch(&self, consumer: &str, results: &[ClaimResult]) -> StoreResult<()> {
        if results.is_empty() {
            return Ok(());
        }
        let now = ts(Utc::now());
        let epoch = ts(DateTime::<Utc>::UNIX_EPOCH);
        let mut tx = OneWriteTx::begin(&self.pool, &self.batch_writer).await?;
        let mut q = QueryBuilder::<Sqlite>::new("BEGIN IMMEDIATE; ");
        for r in results {
            match &r.finish {
                ClaimFinish::Done { state, detail } => {
                    q.push("UPDATE side_effect_claims SET state = ")
                        .push_bind(state.as_str())
                        .push(", finished_at = ")
                        .push_bind(&now)
                        .push(", detail = ")
                        .push_bind(detail.as_str());
                }
                // Immediately eligible for an in-doubt retry, as `release_claim`.
                ClaimFinish::Release { detail } => {
                    q.push("UPDATE side_effect_claims SET claimed_at = ")
                        .push_bind(&epoch)
                        .push(", detail = ")
                        .push_bind(detail.as_str());
                }
            }
            q.push(" WHERE consumer = ")
                .push_bind(consumer)
                .push(" AND message_key = ")
                .push_bind(r.key.as_str());
            if matches!(r.finish, ClaimFinish::Release { .. }) {
                q.push(" AND state = 'claimed'");
            }
            q.push("; ");
        }
        q.push("COMMIT");
        let written = q.build().execute(tx.conn()).await;
        tx.check(written)?;
        tx.finish();
        Ok(())
    }

    async fn purge_processed_batch(&self, cutoff: DateTime<Utc>, batch: i64) -> StoreResult<u64> {
        let cutoff = ts(cutoff);
        let mut tx = self.begin().await?;
        // One batch: the oldest rows not held by an open (in-doubt) claim, with their
        // finished claims. The open claims are left out of the batch itself, not
        // after it: a batch whose oldest rows were all held would delete nothing and
        // end the purge with older rows still there. The same rows are picked twice
        // in one write transaction, and deleting finished claims does not change
        // which rows are held, so both statements take exactly the same rows.
        const DOOMED: &str = "SELECT p.consumer, p.message_key FROM processed_messages p
            WHERE p.processed_at < ?1 AND NOT EXISTS (
                SELECT 1 FROM side_effect_claims c
                WHERE c.consumer = p.consumer AND c.message_key = p.message_key
                  AND c.state = 'claimed')
            ORDER BY p.processed_at LIMIT ?2";
        sqlx::query(&format!(
            "DELETE FROM side_effect_claims WHERE (consumer, message_key) IN ({DOOMED})"
        ))
        .bind(&cutoff)
        .bind(batch)
        .execute(&mut *tx)
        .await?;
        let deleted = sqlx::query(&format!(
            "DELETE FROM processed_messages WHERE (consumer, message_key) IN ({DOOMED})"
        ))
        .bind(&cutoff)
        .bind(batch)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use sqlx::sqlite::SqliteConnectOptions;
    use sqlx::ConnectOptions;

    use super::*;

    fn item(key: &str, device: &str) -> Recordable {
        Recordable {
            key: MessageKey::from_stored(key.to_string()),
            fingerprint: Fingerprint::from_stored(format!("fp-{key}")),
            write: BusinessWrite::CountZoneExit {
                device_id: device.into(),
            },
        }
    }

    /// Whether another connection takes the write lock within 5 s (a closed
    /// connection's rollback runs on its own thread, a moment later).
    async fn lock_frees(url: &str) -> bool {
        for _ in 0..500 {
            if lock_is_free(url).await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// Whether another connection could take the write lock right now.
    async fn lock_is_free(url: &str) -> bool {
        let mut probe = SqliteConnectOptions::from_str(url)
            .unwrap()
            .busy_timeout(Duration::ZERO)
            .connect()
            .await
            .unwrap();
        match sqlx::query("BEGIN IMMEDIATE").execute(&mut probe).await {
            Ok(_) => {
                sqlx::query("ROLLBACK").execute(&mut probe).await.unwrap();
                true
            }
            Err(_) => false,
        }
    }

    #[tokio::test]
    async fn a_failed_or_abandoned_batch_leaves_no_transaction_behind() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("s.db").display());
        let store = SqliteStore::open(&url, Durability::Durable).await.unwrap();
        sqlx::query(
            "CREATE TRIGGER boom BEFORE INSERT ON trip_counters WHEN NEW.device_id = 'BOOM'
             BEGIN SELECT RAISE(ABORT, 'boom'); END",
        )
        .execute(store.pool())
        .await
        .unwrap();

        // Fails in its last call, after its dedup rows went in: none of it stays.
        let failed = store
            .record_batch("c", &[item("k1", "D1"), item("k2", "BOOM")])
            .await;
        assert!(failed.is_err());
        assert!(store.processed_keys("c", "k").await.unwrap().is_empty());
        assert_eq!(store.zone_exits("D1").await.unwrap(), 0);
        assert!(lock_frees(&url).await);

        // Abandoned between its two calls, holding the write lock: dropping it
        // closes the connection, which gives the lock back and keeps nothing. Each
        // try polls the batch, then looks for its lock a while without polling (the
        // batch cannot move past a call it has not been polled to see answered;
        // the look takes the lock for an instant when it is free), and polls again
        // until the lock is seen held. Whether a poll found the first call already
        // answered and sent the second is a race with SQLite's thread, so what is
        // checked is that the lock comes back and the batch kept all or nothing.
        let mut caught = false;
        for attempt in 0..5 {
            let counted_before = store.zone_exits("D3").await.unwrap();
            let key = format!("abandoned-{attempt}");
            let batch = [item(&key, "D3")];
            let mut abandoned = Box::pin(store.record_batch("c", &batch));
            let mut held = false;
            'polls: for _ in 0..50 {
                if futures::poll!(&mut abandoned).is_ready() {
                    break 'polls; // it committed between two looks: try again
                }
                for _ in 0..20 {
                    if !lock_is_free(&url).await {
                        held = true;
                        break 'polls;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            drop(abandoned);
            if held {
                assert!(
                    lock_frees(&url).await,
                    "the abandoned batch's lock was given back"
                );
                // All of it or nothing: the one poll may have found the first call
                // already answered and sent the second (SQLite's thread can answer
                // before the poll looks), so a commit may still have gone through.
                let kept = store.processed_keys("c", &key).await.unwrap().len();
                let counted = store.zone_exits("D3").await.unwrap();
                assert_eq!(
                    counted - counted_before,
                    kept as i64,
                    "dedup row without its business row or the reverse"
                );
                caught = true;
                break;
            }
        }
        assert!(caught, "no try was caught holding the lock");

        // And the store goes on.
        let ok = store
            .record_batch("c", &[item("k4", "D1"), item("k4", "D1")])
            .await
            .unwrap();
        assert_eq!(ok, [DedupOutcome::Applied, DedupOutcome::Duplicate]);
        assert_eq!(store.zone_exits("D1").await.unwrap(), 1);
    }
}
