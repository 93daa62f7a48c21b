//! The consumers' statements that are the same on every backend, written once over
//! the dialect layer; each backend's [`Store`](super::Store) calls them on its pool.
//! What needs a backend's own atomic form (the batch writes — a single claim or
//! vehicle event is a batch of one — and PostgreSQL's one-statement purge) stays in
//! `sqlite.rs`, `postgres.rs` and `mysql.rs`. Times written here are the process clock's on every
//! backend, but for a claim's renewal, on the database's clock ([`db_now`]).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::{Executor, IntoArguments};

use super::batch::note_duplicate_age_sql;
use super::dialect::{
    binds, execute, fetch, first, in_list, retrying, BindValue, Dialect, Kind, Sql,
};
use super::repair_sql::{claim, CLAIM_KINDS};
use super::DedupOutcome;
use super::{duplicate_or_conflict, Backend, BusinessWrite, Claim, ClaimFinish, ClaimResult};
use super::{FirstSeen, StoreResult, ROWS_PER_STATEMENT};
use crate::envelope::{dead_letter_raw, Fingerprint, MessageKey, RejectReason};

/// See [`Store::ping`](super::Store::ping).
pub(super) async fn ping(sql: &dyn Sql) -> StoreResult<()> {
    sql.execute("SELECT 1", &[]).await?;
    Ok(())
}

/// See [`Store::seen`](super::Store::seen).
pub(super) async fn seen(
    sql: &dyn Sql,
    consumer: &str,
    key: &MessageKey,
    fingerprint: &Fingerprint,
) -> StoreResult<Option<DedupOutcome>> {
    let select = "SELECT payload_hash, processed_at FROM processed_messages
                  WHERE consumer = ? AND message_key = ?";
    let kinds = [Kind::Text, Kind::Time];
    let Some(row) = first(sql, select, &binds![consumer, key.as_str()], &kinds).await? else {
        return Ok(None);
    };
    Ok(Some(duplicate_or_conflict(
        row.text(0)?,
        fingerprint,
        row.time(1),
    )))
}

/// [`note_duplicate_age_sql`] on a batch path's own transaction (PostgreSQL, MariaDB).
pub(super) async fn note_duplicate_age_in<D>(
    conn: &mut D::Connection,
    consumer: &str,
    age_seconds: f64,
) -> StoreResult<()>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
{
    let values = binds![consumer, age_seconds, Utc::now()];
    execute::<D, _>(conn, note_duplicate_age_sql(D::BACKEND), &values).await?;
    Ok(())
}

/// See [`Store::note_duplicate_age`](super::Store::note_duplicate_age): the seen-set
/// path, whose check is a read of its own.
pub(super) async fn note_duplicate_age(
    sql: &dyn Sql,
    consumer: &str,
    age_seconds: f64,
) -> StoreResult<()> {
    let values = binds![consumer, age_seconds, Utc::now()];
    let note = note_duplicate_age_sql(sql.backend());
    retrying(|| async { Ok(sql.execute(note, &values).await?) }).await?;
    Ok(())
}

/// See [`Store::mark_seen`](super::Store::mark_seen): a key already recorded is left
/// as it is; a MariaDB deadlock between racing first inserts is retried.
pub(super) async fn mark_seen(
    sql: &dyn Sql,
    consumer: &str,
    key: &MessageKey,
    fingerprint: &Fingerprint,
) -> StoreResult<()> {
    let insert = sql.insert_or_skip(
        "INTO processed_messages (consumer, message_key, payload_hash, processed_at)
         VALUES (?, ?, ?, ?)",
    );
    let values = binds![consumer, key.as_str(), fingerprint.as_str(), Utc::now()];
    retrying(|| async { Ok(sql.execute(&insert, &values).await?) }).await?;
    Ok(())
}

/// See [`Store::apply_unguarded`](super::Store::apply_unguarded): the business write
/// alone, in a write transaction of its own (SQLite's `BEGIN IMMEDIATE`: no busy
/// snapshot), a MariaDB deadlock retried.
pub(super) async fn apply_unguarded(sql: &dyn Sql, write: &BusinessWrite) -> StoreResult<()> {
    let BusinessWrite::CountZoneExit { device_id } = write;
    let on_key = match sql.backend() {
        Backend::Mysql => "ON DUPLICATE KEY UPDATE",
        Backend::Sqlite | Backend::Postgres => "ON CONFLICT (device_id) DO UPDATE SET",
    };
    let upsert = format!(
        "INSERT INTO trip_counters (device_id, zone_exits) VALUES (?, 1)
         {on_key} zone_exits = trip_counters.zone_exits + 1"
    );
    let values = binds![device_id];
    retrying(|| async {
        let mut tx = sql.begin().await?;
        tx.execute(&upsert, &values).await?;
        Ok(tx.commit().await?)
    })
    .await
}

/// One claim's result as a statement of its own: the provider's final answer
/// ([`Store::finish_side_effect`](super::Store::finish_side_effect)), or a transient
/// failure ([`Store::release_claim`](super::Store::release_claim)): the claim kept,
/// claimed at the epoch so that its lease is over at once. A result that carries its
/// owner's `attempts` is written only while that owner still holds the claim (see
/// [`ClaimResult::attempts`]); it then matches one row, or none when the claim is no
/// longer its owner's.
pub(super) fn finishing(r: &ClaimResult, consumer: &str) -> (String, Vec<BindValue>) {
    let owner = if r.attempts.is_some() {
        " AND state = 'claimed' AND attempts = ?"
    } else {
        ""
    };
    let (update, mut values): (&str, Vec<BindValue>) = match &r.finish {
        ClaimFinish::Done { state, detail } => (
            "UPDATE side_effect_claims SET state = ?, finished_at = ?, detail = ?
             WHERE consumer = ? AND message_key = ?",
            binds![state.as_str(), Utc::now(), detail, consumer, r.key.as_str()].into(),
        ),
        ClaimFinish::Release { detail } => (
            "UPDATE side_effect_claims SET claimed_at = ?, detail = ?
             WHERE consumer = ? AND message_key = ? AND state = 'claimed'",
            binds![
                DateTime::<Utc>::UNIX_EPOCH,
                detail,
                consumer,
                r.key.as_str()
            ]
            .into(),
        ),
    };
    if let Some(attempts) = r.attempts {
        values.push(attempts.into());
    }
    (format!("{update}{owner}"), values)
}

/// [`finishing`] on the pool: whether the result was written (an owned result whose
/// claim another owner holds now is not).
pub(super) async fn finish(sql: &dyn Sql, consumer: &str, r: &ClaimResult) -> StoreResult<bool> {
    let (update, values) = finishing(r, consumer);
    let done = sql.execute(&update, &values).await?;
    Ok(r.attempts.is_none() || done.rows_affected == 1)
}

/// [`Store::finish_batch`](super::Store::finish_batch) as one transaction of each
/// result's own statement, in order (a key answered twice ends as its last answer
/// leaves it, as one-by-one calls would). Returns the keys of the owned results that
/// were not written: their claims are no longer their owner's.
pub(super) async fn finish_all(
    sql: &dyn Sql,
    consumer: &str,
    results: &[ClaimResult],
) -> StoreResult<Vec<MessageKey>> {
    if results.is_empty() {
        return Ok(Vec::new());
    }
    let mut lost = Vec::new();
    let mut tx = sql.begin().await?;
    for r in results {
        let (update, values) = finishing(r, consumer);
        let done = tx.execute(&update, &values).await?;
        if r.attempts.is_some() && done.rows_affected != 1 {
            lost.push(r.key.clone());
        }
    }
    tx.commit().await?;
    Ok(lost)
}

/// The database's clock: PostgreSQL's `clock_timestamp()`, MariaDB's
/// `UTC_TIMESTAMP(6)`. SQLite has no clock of its own (it is read in the process, by
/// the same host's clock every process on that file shares), so there it is this
/// process's. What every lease and retention decision is made on (ARCHITECTURE.md,
/// "Clocks"): one clock for every instance, whatever a host's own says.
pub(super) async fn db_now(sql: &dyn Sql) -> StoreResult<DateTime<Utc>> {
    let select = match sql.backend() {
        Backend::Sqlite => return Ok(Utc::now()),
        Backend::Postgres => "SELECT clock_timestamp()",
        Backend::Mysql => "SELECT UTC_TIMESTAMP(6)",
    };
    let row = first(sql, select, &[], &[Kind::Time]).await?;
    Ok(row.map_or_else(Utc::now, |r| r.at(0)))
}

/// See [`Store::renew_claims`](super::Store::renew_claims): in one transaction, each
/// claim still `claimed` by its owner (its `attempts`) claimed again at the
/// database's time; the keys renewed.
pub(super) async fn renew(
    sql: &dyn Sql,
    consumer: &str,
    held: &[(MessageKey, i64)],
) -> StoreResult<Vec<MessageKey>> {
    if held.is_empty() {
        return Ok(Vec::new());
    }
    let now = db_now(sql).await?;
    let update = "UPDATE side_effect_claims SET claimed_at = ?
                  WHERE consumer = ? AND message_key = ? AND state = 'claimed' AND attempts = ?";
    let mut renewed = Vec::with_capacity(held.len());
    let mut tx = sql.begin().await?;
    for (key, attempts) in held {
        let done = tx
            .execute(update, &binds![now, consumer, key.as_str(), *attempts])
            .await?;
        if done.rows_affected == 1 {
            renewed.push(key.clone());
        }
    }
    tx.commit().await?;
    Ok(renewed)
}

/// See [`Store::dead_letter`](super::Store::dead_letter). Bytes over what a queue
/// takes are kept bounded, their true length in the detail ([`dead_letter_raw`]).
pub(super) async fn dead_letter(
    sql: &dyn Sql,
    consumer: &str,
    reason: RejectReason,
    detail: &str,
    raw: &[u8],
) -> StoreResult<i64> {
    let insert = "INSERT INTO dead_letters (consumer, reason, detail, raw, received_at)
                  VALUES (?, ?, ?, ?, ?)";
    let (raw, detail) = dead_letter_raw(raw, detail);
    let values = binds![consumer, reason.as_str(), detail.as_str(), raw, Utc::now()];
    Ok(sql.insert(insert, &values).await?)
}

/// What a claim batch reads first, inside its transaction on the backend's own
/// connection: for each of `keys` (sorted) that has a dedup row, its stored
/// fingerprint, and its claim where it has one (a dedup row without a claim was
/// recorded by another mode). Locked where the backend locks a read that decides a
/// write ([`Dialect::LOCK_READ`]: MariaDB's `FOR UPDATE`, in key order); PostgreSQL's
/// batch holds its advisory locks already, SQLite its write lock.
pub(super) async fn stored_claims<D>(
    conn: &mut D::Connection,
    consumer: &str,
    keys: &[&str],
) -> StoreResult<(HashMap<String, String>, HashMap<String, Claim>, FirstSeen)>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
{
    let per_statement = match D::BACKEND {
        Backend::Postgres => keys.len().max(1),
        _ => ROWS_PER_STATEMENT,
    };
    let mut kinds = CLAIM_KINDS.to_vec();
    kinds.extend([Kind::Text, Kind::Text, Kind::Time]);
    let (mut stored, mut claims) = (HashMap::new(), HashMap::new());
    let mut first_seen = FirstSeen::new();
    for chunk in keys.chunks(per_statement) {
        let select = format!(
            "SELECT c.consumer, c.message_key, c.provider_key, c.state, c.claimed_at,
                    c.finished_at, c.attempts, c.detail, p.message_key, p.payload_hash,
                    p.processed_at
             FROM processed_messages p LEFT JOIN side_effect_claims c
               ON c.consumer = p.consumer AND c.message_key = p.message_key
             WHERE p.consumer = ? AND {} ORDER BY p.message_key{}",
            in_list(D::BACKEND, "p.message_key", chunk.len()),
            D::LOCK_READ
        );
        let list = BindValue::TextList(chunk.iter().map(|k| k.to_string()).collect());
        for row in fetch::<D, _>(&mut *conn, &select, &[consumer.into(), list], &kinds).await? {
            let key = row.text(8)?;
            if row.opt_text(3).is_some() {
                claims.insert(key.clone(), claim(&row)?);
            }
            if let Some(at) = row.time(10) {
                first_seen.insert(key.clone(), at);
            }
            stored.insert(key, row.text(9)?);
        }
    }
    Ok((stored, claims, first_seen))
}

/// [`Store::purge_processed_batch`](super::Store::purge_processed_batch) where one
/// statement cannot pick and delete the batch (MariaDB cannot `DELETE … LIMIT` from a
/// subquery on the same table; SQLite, whose write lock is held from `BEGIN
/// IMMEDIATE`, does it the same way): the batch picked by the processed_at index
/// first (locked where the dialect locks a read that decides a write), then exactly
/// those keys deleted, their finished claims with them. The open (in-doubt) claims are
/// left out of the batch itself, not after it: a batch whose oldest rows were all held
/// would delete nothing and end the purge with older rows still there.
pub(super) async fn purge_picked_batch(
    sql: &dyn Sql,
    cutoff: DateTime<Utc>,
    batch: i64,
) -> StoreResult<u64> {
    let select = format!(
        "SELECT p.consumer, p.message_key FROM processed_messages p
         WHERE p.processed_at < ? AND NOT EXISTS (
            SELECT 1 FROM side_effect_claims c
            WHERE c.consumer = p.consumer AND c.message_key = p.message_key
              AND c.state = 'claimed')
         ORDER BY p.processed_at LIMIT ?{}",
        sql.lock_read()
    );
    retrying(|| async {
        let mut tx = sql.begin().await?;
        let picked = binds![cutoff, batch];
        let doomed = tx.rows(&select, &picked, &[Kind::Text, Kind::Text]).await?;
        let mut deleted = 0;
        for chunk in doomed.chunks(500) {
            let mut keys = Vec::with_capacity(2 * chunk.len());
            for row in chunk {
                keys.extend([BindValue::Text(row.text(0)?), BindValue::Text(row.text(1)?)]);
            }
            // A list of row values: SQLite takes it only as a VALUES subquery.
            let tuples = vec!["(?, ?)"; chunk.len()].join(", ");
            let list = match sql.backend() {
                Backend::Sqlite => format!("VALUES {tuples}"),
                Backend::Mysql | Backend::Postgres => tuples,
            };
            for table in ["side_effect_claims", "processed_messages"] {
                let delete =
                    format!("DELETE FROM {table} WHERE (consumer, message_key) IN ({list})");
                let n = tx.execute(&delete, &keys).await?.rows_affected;
                if table == "processed_messages" {
                    deleted += n;
                }
            }
        }
        tx.commit().await?;
        Ok(deleted)
    })
    .await
}
