//! [`Store`] on PostgreSQL.
//!
//! Duplicates go through `INSERT … ON CONFLICT DO NOTHING`: the conflict is found in
//! the unique index before a heap tuple is written, so a redelivery neither aborts
//! the transaction nor leaves a dead tuple behind. The seq guard is
//! `ON CONFLICT (device_id) DO UPDATE … WHERE excluded.last_seq > vehicle_state.last_seq`,
//! which reports 0 rows when the guard refuses.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, Executor, PgConnection, PgPool};

use super::deadline::{connect_within, Tripwire};
use super::dialect::lost_race;
use super::vehicle_batch::{StoredHistory, VehicleBatch, VehicleItem};
use super::vehicle_sql::{vehicle_upsert_tail, VEHICLE_UPSERT_HEAD};
use super::*;
use crate::deadlines::Deadlines;

pub mod dialect;
pub(crate) mod readonly;
use crate::envelope::Message;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("src/store/postgres/migrations");

#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    url: String,
    durability: Durability,
    /// The sessions' `statement_timeout`, restored after a maintenance statement
    /// that ran without it.
    statement_ms: u64,
}

/// Server-side TCP keep-alive of the engine's sessions (seconds idle, between
/// probes, probes): the server finds a client that vanished behind a NAT or a
/// failover within about a minute and ends its session, instead of holding its
/// backend (and any lock) until the kernel gives up after hours.
const KEEPALIVE: (u32, u32, u32) = (30, 10, 3);

/// Every engine session's settings, one `SET` each in one round trip when the
/// connection opens: the statement deadline as the server's own statement, lock
/// and idle-in-transaction limits (a session whose client went silent mid-
/// transaction is ended, its locks freed, instead of blocking the redelivery of
/// the same keys on a fresh connection), the keep-alive, and the durability.
fn session_settings(deadlines: &Deadlines, durability: Durability) -> String {
    let ms = deadlines.statement_millis();
    let (idle, interval, count) = KEEPALIVE;
    let mut sql = format!(
        "SET statement_timeout = {ms}; SET lock_timeout = {ms}; \
         SET idle_in_transaction_session_timeout = {ms}; SET tcp_keepalives_idle = {idle}; \
         SET tcp_keepalives_interval = {interval}; SET tcp_keepalives_count = {count}"
    );
    if durability == Durability::Relaxed {
        sql.push_str("; SET synchronous_commit = off");
    }
    sql
}

impl PostgresStore {
    /// [`PostgresStore::open_with`] the default deadlines.
    pub async fn open(url: &str, durability: Durability) -> StoreResult<Self> {
        Self::open_with(url, durability, &Deadlines::default(), Arc::default()).await
    }

    /// Durable: the server's own commit settings. Relaxed: `synchronous_commit = off`
    /// in this pool's sessions only — a commit returns before its WAL is flushed, so a
    /// server power cut can undo the last commits (never corrupt them); other clients
    /// of the server are untouched. The migrations run first on a connection of their
    /// own, without the statement deadline: an index build on a big table may take
    /// longer than any consumer's transaction should.
    pub(crate) async fn open_with(
        url: &str,
        durability: Durability,
        deadlines: &Deadlines,
        tripwire: Arc<Tripwire>,
    ) -> StoreResult<Self> {
        let opts: PgConnectOptions = url.parse()?;
        let opts = opts.log_statements(tracing::log::LevelFilter::Trace);
        let mut migrating = connect_within(deadlines, PgConnection::connect_with(&opts)).await?;
        MIGRATOR.run_direct(&mut migrating).await?;
        let _ = tokio::time::timeout(deadlines.connect_timeout, migrating.close()).await;
        let session = Arc::new(session_settings(deadlines, durability));
        let pool = super::dialect::server_pool::<sqlx::Postgres>(deadlines, tripwire)
            .after_connect(move |conn, _| {
                let session = session.clone();
                Box::pin(async move { conn.execute(session.as_str()).await.map(|_| ()) })
            });
        let pool = connect_within(deadlines, pool.connect_with(opts)).await?;
        Ok(PostgresStore {
            pool,
            url: url.to_string(),
            durability,
            statement_ms: deadlines.statement_millis(),
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

#[async_trait]
impl Store for PostgresStore {
    super::dialect::pooled_store!();

    async fn record_batch(
        &self,
        consumer: &str,
        items: &[Recordable],
    ) -> StoreResult<Vec<DedupOutcome>> {
        let batch = DedupBatch::new(items);
        let mut tx = self.pool.begin().await?;
        let distinct = batch.distinct();
        let inserted: HashSet<String> = sqlx::query_scalar(
            "INSERT INTO processed_messages (consumer, message_key, payload_hash, processed_at)
             SELECT $1, k, f, now() FROM UNNEST($2::text[], $3::text[]) AS t (k, f)
             ON CONFLICT DO NOTHING RETURNING message_key",
        )
        .bind(consumer)
        .bind(column(distinct, |item| item.key.as_str()))
        .bind(column(distinct, |item| item.fingerprint.as_str()))
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .collect();
        let others = batch.not_inserted(&inserted);
        // Read only on a conflict: a batch without duplicates never runs it.
        let (mut stored, mut first_seen) = (HashMap::new(), FirstSeen::new());
        if !others.is_empty() {
            let rows: Vec<(String, String, DateTime<Utc>)> = sqlx::query_as(
                "SELECT message_key, payload_hash, processed_at FROM processed_messages
                 WHERE consumer = $1 AND message_key = ANY($2)",
            )
            .bind(consumer)
            .bind(&others)
            .fetch_all(&mut *tx)
            .await?;
            for (key, fingerprint, at) in rows {
                first_seen.insert(key.clone(), at);
                stored.insert(key, fingerprint);
            }
        }
        let outcomes = batch.outcomes(&inserted, &stored, &first_seen, Utc::now())?;
        if let Some(age) = DedupBatch::oldest_duplicate(&outcomes, Utc::now()) {
            consumer_sql::note_duplicate_age_in::<sqlx::Postgres>(&mut tx, consumer, age).await?;
        }
        let (devices, counts): (Vec<&str>, Vec<i64>) =
            batch.zone_exits(&outcomes).into_iter().unzip();
        if !devices.is_empty() {
            sqlx::query(
                "INSERT INTO trip_counters (device_id, zone_exits)
                 SELECT * FROM UNNEST($1::text[], $2::bigint[])
                 ON CONFLICT (device_id) DO UPDATE
                 SET zone_exits = trip_counters.zone_exits + EXCLUDED.zone_exits",
            )
            .bind(&devices)
            .bind(&counts)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    /// In one transaction: the batch's devices locked (a transaction-scoped advisory
    /// lock per device, taken in sorted order so two batches cannot deadlock), the
    /// history rows already stored and each device's state read, the outcomes decided
    /// by `vehicle_batch.rs` as one-by-one calls would, the new history rows in one
    /// `INSERT … SELECT FROM UNNEST`, and the state upserts in rounds — round k holds
    /// each device's k-th applied event, so a round never touches a row twice and each
    /// device still sees its events in order. About six round trips and ONE commit
    /// per batch instead of three statements and a commit per event (the pipeline's
    /// `vehicle-state` was the slowest consumer on PostgreSQL, issue 16).
    ///
    /// A writer outside these locks (the one-by-one [`Store::apply_vehicle_event`])
    /// could still move a state between the read and the upsert; the upserts say which
    /// rows they changed, and if that is not every event decided applied, the
    /// transaction is rolled back and retried whole ([`StoreError::LostRace`]: a
    /// lost race, infrastructure) rather than record an outcome that did not happen.
    async fn apply_vehicle_batch(&self, envs: &[Message]) -> StoreResult<Vec<VehicleOutcome>> {
        let batch = VehicleBatch::new(envs)?;
        let devices = batch.devices();
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "SELECT pg_advisory_xact_lock(hashtextextended('idw_vehicle:' || d, 0))
             FROM (SELECT unnest($1::text[]) AS d ORDER BY 1) AS sorted",
        )
        .bind(&devices)
        .execute(&mut *tx)
        .await?;
        let keys: Vec<_> = batch.distinct().map(|item| item.key()).collect();
        let stored: StoredHistory = sqlx::query_as(
            "SELECT h.device_id, h.seq, h.event_type, h.payload_hash, h.received_at
             FROM UNNEST($1::text[], $2::bigint[], $3::text[]) AS v (d, s, t)
             JOIN vehicle_history h ON h.device_id = v.d AND h.seq = v.s AND h.event_type = v.t",
        )
        .bind(column(&keys, |k| k.0))
        .bind(column(&keys, |k| k.1))
        .bind(column(&keys, |k| k.2))
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(
            |(d, s, t, h, at): (String, i64, String, String, DateTime<Utc>)| {
                ((d, s, t), (h, Some(at)))
            },
        )
        .collect();
        let last_seq: HashMap<String, i64> = sqlx::query_as(
            "SELECT device_id, last_seq FROM vehicle_state WHERE device_id = ANY($1)",
        )
        .bind(&devices)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .collect();
        let (outcomes, writes) = batch.decide(&stored, &last_seq, Utc::now());
        let rows = &writes.history;
        if !rows.is_empty() {
            let payload = |(item, _): &(&VehicleItem, bool)| {
                serde_json::from_str(&item.facts.payload).unwrap_or(serde_json::Value::Null)
            };
            // A plain INSERT: a row stored after all fails the batch, never passes as new.
            sqlx::query(
                "INSERT INTO vehicle_history
                   (device_id, seq, event_type, occurred_at, received_at, applied, payload, payload_hash)
                 SELECT d, s, t, o, now(), a, p, h
                 FROM UNNEST($1::text[], $2::bigint[], $3::text[], $4::timestamptz[], $5::boolean[],
                             $6::jsonb[], $7::text[]) AS v (d, s, t, o, a, p, h)",
            )
            .bind(column(rows, |(item, _)| item.env.device_id.as_str()))
            .bind(column(rows, |(item, _)| item.facts.seq))
            .bind(column(rows, |(item, _)| item.facts.event_type))
            .bind(column(rows, |(item, _)| item.env.occurred_at))
            .bind(column(rows, |(_, applied)| *applied))
            .bind(column(rows, payload))
            .bind(column(rows, |(item, _)| item.fingerprint.as_str()))
            .execute(&mut *tx)
            .await?;
        }
        let round_sql = format!(
            "{VEHICLE_UPSERT_HEAD}
             SELECT d, s, t, i, z, la, lo, o, now()
             FROM UNNEST($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[],
                         $6::float8[], $7::float8[], $8::timestamptz[])
                  AS v (d, s, t, i, z, la, lo, o)
             {}",
            vehicle_upsert_tail(true)
        );
        for round in writes.upsert_rounds() {
            let changed = sqlx::query(&round_sql)
                .bind(column(&round, |item| item.env.device_id.as_str()))
                .bind(column(&round, |item| item.facts.seq))
                .bind(column(&round, |item| item.facts.event_type))
                .bind(column(&round, |item| item.facts.ignition))
                .bind(column(&round, |item| item.facts.zone))
                .bind(column(&round, |item| item.facts.lat))
                .bind(column(&round, |item| item.facts.lon))
                .bind(column(&round, |item| item.env.occurred_at))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if changed != round.len() as u64 {
                let raced = "a vehicle state moved by another writer during the batch";
                return lost_race(tx, raced).await;
            }
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    /// Phase 1 of a batch in one transaction: the keys locked (a transaction-scoped
    /// advisory lock per key, sorted, so two batches neither deadlock nor decide the
    /// same key at once), the server's clock and the stored dedup rows and claims read
    /// once, every request decided by `claim_batch.rs` as one-by-one calls would, then
    /// the fresh keys' dedup rows and claims in two `INSERT … SELECT FROM UNNEST` and
    /// each takeover's compare-and-set. A writer outside these locks (the one-by-one
    /// path) that got in between shows as an insert or a compare-and-set that did not
    /// take: the transaction is rolled back and retried whole ([`StoreError::LostRace`],
    /// a lost race), never recorded as decided.
    async fn claim_batch(
        &self,
        consumer: &str,
        requests: &[ClaimRequest],
        lease: Duration,
    ) -> StoreResult<Vec<ClaimOutcome>> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let keys = claim_batch::sorted_keys(requests);
        let mut tx = self.pool.begin().await?;
        // The claim time every fresh claim and takeover of this batch writes, from the
        // server's clock as the one-by-one path's `clock_timestamp()`.
        let now: DateTime<Utc> = sqlx::query_scalar(
            "SELECT max(t) FROM (
               SELECT pg_advisory_xact_lock(hashtextextended('idw_claim:' || $1 || ':' || k, 0)),
                      clock_timestamp() AS t
               FROM (SELECT unnest($2::text[]) AS k ORDER BY 1) AS sorted
             ) AS locked",
        )
        .bind(consumer)
        .bind(&keys)
        .fetch_one(&mut *tx)
        .await?;
        let (stored, claims, first_seen) =
            consumer_sql::stored_claims::<sqlx::Postgres>(&mut tx, consumer, &keys).await?;
        let (outcomes, writes) = claim_batch::decide(
            consumer,
            requests,
            &stored,
            &first_seen,
            &claims,
            now,
            lease,
        );
        if let Some(age) = ClaimOutcome::oldest_duplicate(&outcomes, Utc::now()) {
            consumer_sql::note_duplicate_age_in::<sqlx::Postgres>(&mut tx, consumer, age).await?;
        }
        let raced = "a claim taken by another writer during the batch";
        let fresh = &writes.fresh;
        if !fresh.is_empty() {
            let fresh_keys = column(fresh, |r| r.key.as_str());
            let inserted = sqlx::query(
                "INSERT INTO processed_messages (consumer, message_key, payload_hash, processed_at)
                 SELECT $1, k, f, $4 FROM UNNEST($2::text[], $3::text[]) AS v (k, f)
                 ON CONFLICT DO NOTHING",
            )
            .bind(consumer)
            .bind(&fresh_keys)
            .bind(column(fresh, |r| r.fingerprint.as_str()))
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if inserted != fresh_keys.len() as u64 {
                return lost_race(tx, raced).await;
            }
            sqlx::query(
                "INSERT INTO side_effect_claims
                   (consumer, message_key, provider_key, state, claimed_at, attempts, message)
                 SELECT $1, k, p, 'claimed', $5, 1, m
                 FROM UNNEST($2::text[], $3::text[], $4::bytea[]) AS v (k, p, m)",
            )
            .bind(consumer)
            .bind(&fresh_keys)
            .bind(column(fresh, |r| r.provider_key.as_str()))
            .bind(column(fresh, |r| r.message.as_slice()))
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        for (r, claimed_at) in &writes.takeovers {
            let taken = sqlx::query(
                "UPDATE side_effect_claims SET claimed_at = $1, attempts = attempts + 1, message = $2
                 WHERE consumer = $3 AND message_key = $4 AND state = 'claimed' AND claimed_at = $5",
            )
            .bind(now)
            .bind(r.message.as_slice())
            .bind(consumer)
            .bind(r.key.as_str())
            .bind(claimed_at)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if taken != 1 {
                return lost_race(tx, raced).await;
            }
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    /// Phase 3 of a batch in one transaction and at most two statements: the final
    /// answers in one `UPDATE … FROM UNNEST`, the releases (transient failures, the
    /// claim kept and due at once) in another, instead of a statement and a commit per
    /// claim; an owned answer only where its owner still holds the claim (the rows
    /// returned are the ones written). A key answered twice in one batch takes the
    /// trait's default (each result's statement in order).
    async fn finish_batch(
        &self,
        consumer: &str,
        results: &[ClaimResult],
    ) -> StoreResult<Vec<MessageKey>> {
        let distinct: HashSet<&str> = results.iter().map(|r| r.key.as_str()).collect();
        if distinct.len() != results.len() {
            return consumer_sql::finish_all(&*self.sql().0, consumer, results).await;
        }
        let (mut done_keys, mut done_states, mut done_details, mut done_owners) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut released_keys, mut released_details, mut released_owners) =
            (Vec::new(), Vec::new(), Vec::new());
        for r in results {
            match &r.finish {
                ClaimFinish::Done { state, detail } => {
                    done_keys.push(r.key.as_str());
                    done_states.push(state.as_str());
                    done_details.push(detail.as_str());
                    done_owners.push(r.attempts);
                }
                ClaimFinish::Release { detail } => {
                    released_keys.push(r.key.as_str());
                    released_details.push(detail.as_str());
                    released_owners.push(r.attempts);
                }
            }
        }
        let mut written: HashSet<String> = HashSet::new();
        let mut tx = self.pool.begin().await?;
        if !done_keys.is_empty() {
            let keys: Vec<String> = sqlx::query_scalar(
                "UPDATE side_effect_claims c SET state = v.s, finished_at = now(), detail = v.d
                 FROM UNNEST($2::text[], $3::text[], $4::text[], $5::bigint[]) AS v (k, s, d, a)
                 WHERE c.consumer = $1 AND c.message_key = v.k
                   AND (v.a IS NULL OR (c.state = 'claimed' AND c.attempts = v.a))
                 RETURNING c.message_key",
            )
            .bind(consumer)
            .bind(&done_keys)
            .bind(&done_states)
            .bind(&done_details)
            .bind(&done_owners)
            .fetch_all(&mut *tx)
            .await?;
            written.extend(keys);
        }
        if !released_keys.is_empty() {
            let keys: Vec<String> = sqlx::query_scalar(
                "UPDATE side_effect_claims c SET claimed_at = 'epoch', detail = v.d
                 FROM UNNEST($2::text[], $3::text[], $4::bigint[]) AS v (k, d, a)
                 WHERE c.consumer = $1 AND c.message_key = v.k AND c.state = 'claimed'
                   AND (v.a IS NULL OR c.attempts = v.a)
                 RETURNING c.message_key",
            )
            .bind(consumer)
            .bind(&released_keys)
            .bind(&released_details)
            .bind(&released_owners)
            .fetch_all(&mut *tx)
            .await?;
            written.extend(keys);
        }
        tx.commit().await?;
        Ok(results
            .iter()
            .filter(|r| r.attempts.is_some() && !written.contains(r.key.as_str()))
            .map(|r| r.key.clone())
            .collect())
    }

    /// `VACUUM (ANALYZE)` of the purged tables: drops the dead index entries,
    /// marks pages all-visible again (index-only scans) and refreshes the row
    /// estimate. Not inside a transaction, and only the owner may do it.
    /// The session's statement timeout is lifted for it (a `VACUUM` of 34 M rows
    /// takes about a minute, docs/SCALE.md) and put back after, whatever it answered.
    async fn after_purge(&self) -> StoreResult<()> {
        let mut conn = self.pool.acquire().await?;
        conn.execute("SET statement_timeout = 0").await?;
        let vacuumed = conn
            .execute("VACUUM (ANALYZE) processed_messages, side_effect_claims")
            .await;
        conn.execute(format!("SET statement_timeout = {}", self.statement_ms).as_str())
            .await?;
        vacuumed?;
        Ok(())
    }

    async fn purge_processed_batch(&self, cutoff: DateTime<Utc>, batch: i64) -> StoreResult<u64> {
        let mut tx = self.pool.begin().await?;
        // One batch: the oldest rows by the processed_at index, finished claims with
        // them; an open (in-doubt) claim keeps its dedup row.
        let deleted = sqlx::query(
            "WITH doomed AS (
                SELECT p.consumer, p.message_key FROM processed_messages p
                WHERE p.processed_at < $1 AND NOT EXISTS (
                    SELECT 1 FROM side_effect_claims c
                    WHERE c.consumer = p.consumer AND c.message_key = p.message_key
                      AND c.state = 'claimed')
                ORDER BY p.processed_at LIMIT $2
             ), gone_claims AS (
                DELETE FROM side_effect_claims c USING doomed d
                WHERE c.consumer = d.consumer AND c.message_key = d.message_key
             )
             DELETE FROM processed_messages p USING doomed d
             WHERE p.consumer = d.consumer AND p.message_key = d.message_key",
        )
        .bind(cutoff)
        .bind(batch)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(deleted)
    }
}

/// One column of a batch's rows, as the array `UNNEST` takes.
fn column<T, U>(rows: &[T], value: impl Fn(&T) -> U) -> Vec<U> {
    rows.iter().map(value).collect()
}
