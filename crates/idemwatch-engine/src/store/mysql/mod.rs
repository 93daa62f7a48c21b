//! [`Store`] on MySQL / MariaDB (InnoDB).
//!
//! Duplicates go through `INSERT IGNORE` on the primary key (0 rows affected, no
//! error, the transaction goes on). The seq guard is `ON DUPLICATE KEY UPDATE` with
//! every column conditional on the newer seq and `last_seq` assigned last (MySQL
//! evaluates the assignments left to right). sqlx connects with `CLIENT_FOUND_ROWS`,
//! so rows-affected cannot tell "inserted" from "left as it was"; whether the guard
//! let the event through is read back under the row lock instead.
//! InnoDB may pick a deadlock victim when several transactions insert the same new
//! key at once; such a transaction is retried whole.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::{Connection, MySql, MySqlPool, QueryBuilder};

use super::claim_batch;
use super::deadline::{connect_within, Tripwire};
use super::dialect::{lost_race, retrying};
use super::vehicle_batch::{StoredHistory, VehicleBatch, VehicleItem};
use super::vehicle_sql::{vehicle_upsert_update, VEHICLE_UPSERT_HEAD};
use super::*;
use crate::deadlines::Deadlines;

pub mod dialect;
pub(crate) mod readonly;
use crate::envelope::Message;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("src/store/mysql/migrations");

#[derive(Debug, Clone)]
pub struct MysqlStore {
    pool: MySqlPool,
    url: String,
}

/// One multi-row `INSERT IGNORE` of dedup rows (key, fingerprint) processed at `now`,
/// or at the server's `UTC_TIMESTAMP(6)` when `None` (what the retention compares its
/// cutoff, on the server's clock, with): the batch paths of `record_batch` and
/// `claim_batch` count the rows it wrote to learn which keys were first.
fn insert_dedup_rows<'a>(
    consumer: &'a str,
    rows: impl Iterator<Item = (&'a str, &'a str)>,
    now: Option<NaiveDateTime>,
) -> QueryBuilder<'a, MySql> {
    let mut q = QueryBuilder::<MySql>::new(
        "INSERT IGNORE INTO processed_messages
           (consumer, message_key, payload_hash, processed_at) ",
    );
    q.push_values(rows, |mut row, (key, fingerprint)| {
        row.push_bind(consumer)
            .push_bind(key)
            .push_bind(fingerprint);
        match now {
            Some(now) => row.push_bind(now),
            None => row.push("UTC_TIMESTAMP(6)"),
        };
    });
    q
}

fn naive(t: DateTime<Utc>) -> NaiveDateTime {
    t.naive_utc()
}

impl MysqlStore {
    /// [`MysqlStore::open_with`] the default deadlines.
    pub async fn open(url: &str) -> StoreResult<Self> {
        Self::open_with(url, &Deadlines::default(), Arc::default()).await
    }

    /// The migrations first, on a connection of their own without the statement
    /// deadline (an index build may take longer than any consumer's transaction
    /// should); then the pool, each session set by [`dialect::engine_session`].
    pub(crate) async fn open_with(
        url: &str,
        deadlines: &Deadlines,
        tripwire: Arc<Tripwire>,
    ) -> StoreResult<Self> {
        let opts = dialect::options(url)?;
        let mut migrating =
            connect_within(deadlines, sqlx::MySqlConnection::connect_with(&opts)).await?;
        dialect::utc_session(&mut migrating).await?;
        MIGRATOR.run_direct(&mut migrating).await?;
        let _ = tokio::time::timeout(deadlines.connect_timeout, migrating.close()).await;
        let session = *deadlines;
        let pool = super::dialect::server_pool::<MySql>(deadlines, tripwire).after_connect(
            move |conn, _| Box::pin(async move { dialect::engine_session(conn, &session).await }),
        );
        let pool = connect_within(deadlines, pool.connect_with(opts)).await?;
        Ok(MysqlStore {
            pool,
            url: url.to_string(),
        })
    }

    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }
}

#[async_trait]
impl Store for MysqlStore {
    super::dialect::pooled_store!(pool_and_url);

    /// Always durable as far as idemwatch goes: the flush policy is the server's
    /// (`innodb_flush_log_at_trx_commit`), see [`Durability::check_url`].
    fn durability(&self) -> Durability {
        Durability::Durable
    }

    /// Look up which keys are already stored (a plain read, no locks, so concurrent
    /// batches do not deadlock on gap locks), insert the others with one multi-row
    /// `INSERT IGNORE`, and trust that only if the insert wrote every one of them.
    /// MySQL has no `RETURNING`: when a racing transaction committed one of those keys
    /// in between, the affected count is short and this transaction is rolled back as
    /// a lost race, retried whole by [`retrying`]: the next read finds the key.
    async fn record_batch(
        &self,
        consumer: &str,
        items: &[Recordable],
    ) -> StoreResult<Vec<DedupOutcome>> {
        retrying(|| async {
            let batch = DedupBatch::new(items);
            let mut tx = self.pool.begin().await?;
            let (mut stored, mut first_seen) = (HashMap::new(), FirstSeen::new());
            for chunk in batch.distinct().chunks(ROWS_PER_STATEMENT) {
                let mut q = QueryBuilder::<MySql>::new(
                    "SELECT CAST(message_key AS CHAR), payload_hash, processed_at
                     FROM processed_messages WHERE consumer = ",
                );
                q.push_bind(consumer).push(" AND message_key IN ");
                q.push_tuples(chunk, |mut t, item| {
                    t.push_bind(item.key.as_str());
                });
                let rows: Vec<(String, String, NaiveDateTime)> =
                    q.build_query_as().fetch_all(&mut *tx).await?;
                for (key, fingerprint, at) in rows {
                    first_seen.insert(key.clone(), at.and_utc());
                    stored.insert(key, fingerprint);
                }
            }
            let (fresh, inserted) = batch.fresh(&stored);
            for chunk in fresh.chunks(ROWS_PER_STATEMENT) {
                let rows = chunk
                    .iter()
                    .map(|i| (i.key.as_str(), i.fingerprint.as_str()));
                let written = insert_dedup_rows(consumer, rows, None)
                    .build()
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if written != chunk.len() as u64 {
                    let raced = "a dedup row stored by another writer during the batch";
                    return lost_race(tx, raced).await;
                }
            }
            let outcomes = batch.outcomes(&inserted, &stored, &first_seen, Utc::now())?;
            if let Some(age) = DedupBatch::oldest_duplicate(&outcomes, Utc::now()) {
                consumer_sql::note_duplicate_age_in::<MySql>(&mut tx, consumer, age).await?;
            }
            for chunk in batch.zone_exits(&outcomes).chunks(ROWS_PER_STATEMENT) {
                let mut q = QueryBuilder::<MySql>::new(
                    "INSERT INTO trip_counters (device_id, zone_exits) ",
                );
                q.push_values(chunk, |mut row, (device, n)| {
                    row.push_bind(*device).push_bind(*n);
                });
                q.push(" ON DUPLICATE KEY UPDATE zone_exits = zone_exits + VALUES(zone_exits)");
                q.build().execute(&mut *tx).await?;
            }
            tx.commit().await?;
            Ok(outcomes)
        })
        .await
    }

    /// A vehicle batch in one transaction: the devices' state rows read `FOR UPDATE`
    /// (row locks on the stored ones, and InnoDB's gap locks keep a new device's row
    /// from being inserted by anyone else until COMMIT), the history rows already
    /// stored read, the outcomes decided by `vehicle_batch.rs` as one-by-one calls
    /// would, the new history rows in one multi-row `INSERT IGNORE` and the state
    /// upserts in rounds (round k: each device's k-th applied event, so no row twice in
    /// a statement and each device in order). If the history insert wrote fewer rows
    /// than decided, another batch of a device new to both stored one in between (gap
    /// locks do not keep two batches apart): the transaction is rolled back as a lost
    /// race and, like a deadlock between two such batches, retried whole by
    /// [`retrying`], whose new read sees the other batch's rows.
    async fn apply_vehicle_batch(&self, envs: &[Message]) -> StoreResult<Vec<VehicleOutcome>> {
        retrying(|| async {
            let batch = VehicleBatch::new(envs)?;
            let devices = batch.devices();
            let distinct: Vec<&VehicleItem> = batch.distinct().collect();
            let now = naive(Utc::now());
            let mut tx = self.pool.begin().await?;
            let mut last_seq = HashMap::new();
            for chunk in devices.chunks(ROWS_PER_STATEMENT) {
                let mut q = QueryBuilder::<MySql>::new(
                    "SELECT CAST(device_id AS CHAR), last_seq FROM vehicle_state WHERE device_id IN ",
                );
                q.push_tuples(chunk, |mut t, device| {
                    t.push_bind(*device);
                });
                q.push(" ORDER BY device_id FOR UPDATE");
                let rows: Vec<(String, i64)> = q.build_query_as().fetch_all(&mut *tx).await?;
                last_seq.extend(rows);
            }
            let mut stored = StoredHistory::new();
            for chunk in distinct.chunks(ROWS_PER_STATEMENT) {
                let mut q = QueryBuilder::<MySql>::new(
                    "SELECT CAST(device_id AS CHAR), seq, CAST(event_type AS CHAR), CAST(payload_hash AS CHAR),
                            received_at
                     FROM vehicle_history WHERE (device_id, seq, event_type) IN ",
                );
                q.push_tuples(chunk, |mut t, item| {
                    let (device, seq, event_type) = item.key();
                    t.push_bind(device).push_bind(seq).push_bind(event_type);
                });
                let rows: Vec<(String, i64, String, String, NaiveDateTime)> =
                    q.build_query_as().fetch_all(&mut *tx).await?;
                stored.extend(
                    rows.into_iter()
                        .map(|(d, s, t, h, at)| ((d, s, t), (h, Some(at.and_utc())))),
                );
            }
            let (outcomes, writes) = batch.decide(&stored, &last_seq, Utc::now());
            for chunk in writes.history.chunks(ROWS_PER_STATEMENT) {
                let mut q = QueryBuilder::<MySql>::new(
                    "INSERT IGNORE INTO vehicle_history
                       (device_id, seq, event_type, occurred_at, received_at, applied, payload, payload_hash) ",
                );
                q.push_values(chunk, |mut row, (item, applied)| {
                    row.push_bind(item.env.device_id.as_str())
                        .push_bind(item.facts.seq)
                        .push_bind(item.facts.event_type)
                        .push_bind(naive(item.env.occurred_at))
                        .push_bind(now)
                        .push_bind(*applied)
                        .push_bind(item.facts.payload.as_str())
                        .push_bind(item.fingerprint.as_str());
                });
                let written = q.build().execute(&mut *tx).await?.rows_affected();
                if written != chunk.len() as u64 {
                    let raced = "a history row stored by another writer during the batch";
                    return lost_race(tx, raced).await;
                }
            }
            let update = vehicle_upsert_update("VALUES(last_seq) > last_seq");
            for round in writes.upsert_rounds() {
                for chunk in round.chunks(ROWS_PER_STATEMENT) {
                    let mut q = QueryBuilder::<MySql>::new(VEHICLE_UPSERT_HEAD);
                    q.push(" ");
                    q.push_values(chunk, |mut row, item| {
                        row.push_bind(item.env.device_id.as_str())
                            .push_bind(item.facts.seq)
                            .push_bind(item.facts.event_type)
                            .push_bind(item.facts.ignition)
                            .push_bind(item.facts.zone)
                            .push_bind(item.facts.lat)
                            .push_bind(item.facts.lon)
                            .push_bind(naive(item.env.occurred_at))
                            .push_bind(now);
                    });
                    q.push(" ").push(&update);
                    q.build().execute(&mut *tx).await?;
                }
            }
            tx.commit().await?;
            Ok(outcomes)
        })
        .await
    }

    /// Phase 1 of a batch in one transaction, as PostgreSQL's: the batch's stored
    /// dedup rows and claims read once with `SELECT … FOR UPDATE` in key order (row
    /// locks on the stored keys; InnoDB's gap locks keep a new key from being inserted
    /// by anyone else until COMMIT),
    /// every request decided by `claim_batch.rs` as one-by-one calls would, then the
    /// fresh keys' dedup rows and claims in two multi-row inserts and each takeover's
    /// compare-and-set on the stored `claimed_at`. An insert or a takeover that does
    /// not take (a writer the locks did not hold off) rolls the transaction back as a
    /// lost race ([`StoreError::LostRace`]); two batches that gap-lock the same new
    /// keys and then both insert are a deadlock InnoDB breaks; both are retried whole
    /// by [`retrying`].
    ///
    /// The claim time is the server's clock (`UTC_TIMESTAMP(6)`, read once the rows are
    /// locked), as every lease decision on this backend: an instance whose own clock
    /// jumped neither takes over a live claim nor writes one that looks old at once.
    async fn claim_batch(
        &self,
        consumer: &str,
        requests: &[ClaimRequest],
        lease: Duration,
    ) -> StoreResult<Vec<ClaimOutcome>> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        retrying(|| async {
            let keys = claim_batch::sorted_keys(requests);
            let mut tx = self.pool.begin().await?;
            let (stored, claims, first_seen) =
                consumer_sql::stored_claims::<MySql>(&mut tx, consumer, &keys).await?;
            let now: NaiveDateTime = sqlx::query_scalar("SELECT UTC_TIMESTAMP(6)")
                .fetch_one(&mut *tx)
                .await?;
            let now = now.and_utc();
            let (outcomes, writes) =
                claim_batch::decide(consumer, requests, &stored, &first_seen, &claims, now, lease);
            if let Some(age) = ClaimOutcome::oldest_duplicate(&outcomes, Utc::now()) {
                consumer_sql::note_duplicate_age_in::<MySql>(&mut tx, consumer, age).await?;
            }
            let raced = "a claim taken by another writer during the batch";
            for chunk in writes.fresh.chunks(ROWS_PER_STATEMENT) {
                let rows = chunk
                    .iter()
                    .map(|r| (r.key.as_str(), r.fingerprint.as_str()));
                let mut q = insert_dedup_rows(consumer, rows, Some(naive(now)));
                if q.build().execute(&mut *tx).await?.rows_affected() != chunk.len() as u64 {
                    return lost_race(tx, raced).await;
                }
                let mut q = QueryBuilder::<MySql>::new(
                    "INSERT INTO side_effect_claims
                       (consumer, message_key, provider_key, state, claimed_at, attempts, message) ",
                );
                q.push_values(chunk, |mut row, r| {
                    row.push_bind(consumer)
                        .push_bind(r.key.as_str())
                        .push_bind(r.provider_key.as_str())
                        .push_bind("claimed")
                        .push_bind(naive(now))
                        .push_bind(1i64)
                        .push_bind(r.message.as_slice());
                });
                q.build().execute(&mut *tx).await?;
            }
            for (r, claimed_at) in &writes.takeovers {
                // CLIENT_FOUND_ROWS: the count is of the rows matched, the compare-and-set.
                let taken = sqlx::query(
                    "UPDATE side_effect_claims SET claimed_at = ?, attempts = attempts + 1, message = ?
                     WHERE consumer = ? AND message_key = ? AND state = 'claimed' AND claimed_at = ?",
                )
                .bind(naive(now))
                .bind(r.message.as_slice())
                .bind(consumer)
                .bind(r.key.as_str())
                .bind(naive(*claimed_at))
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if taken != 1 {
                    return lost_race(tx, raced).await;
                }
            }
            tx.commit().await?;
            Ok(outcomes)
        })
        .await
    }

    /// InnoDB's purge thread removes the delete-marked records by itself; only the
    /// row estimate the dashboard reads needs a refresh.
    async fn after_purge(&self) -> StoreResult<()> {
        sqlx::query("ANALYZE TABLE processed_messages, side_effect_claims")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn purge_processed_batch(&self, cutoff: DateTime<Utc>, batch: i64) -> StoreResult<u64> {
        consumer_sql::purge_picked_batch(&*self.sql().0, cutoff, batch).await
    }
}
