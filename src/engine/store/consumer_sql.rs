//! The consumers' statements that are the same on every backend, written once over
//! the dialect layer; each backend's [`Store`](super::Store) calls them on its pool.
//! What needs a backend's own atomic form (the batch writes — a single claim or
//! vehicle event is a batch of one — and retention) stays in `sqlite.rs`,
//! `postgres.rs` and `mysql.rs`. Times written here are the process clock's on every
//! backend.

use chrono::{DateTime, Utc};

use super::dialect::{binds, first, retrying, BindValue, Kind, Sql};
use super::{
    duplicate_or_conflict, Backend, BusinessWrite, ClaimFinish, DedupOutcome, StoreResult,
};
use crate::engine::envelope::{Fingerprint, MessageKey, RejectReason};

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
    let select =
        "SELECT payload_hash FROM processed_messages WHERE consumer = ? AND message_key = ?";
    let row = first(sql, select, &binds![consumer, key.as_str()], &[Kind::Text]).await?;
    Ok(row
        .map(|r| r.text(0))
        .transpose()?
        .map(|stored| duplicate_or_conflict(stored, fingerprint)))
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
/// claimed at the epoch so that its lease is over at once.
pub(super) fn finishing(
    consumer: &str,
    key: &MessageKey,
    finish: &ClaimFinish,
) -> (&'static str, Vec<BindValue>) {
    match finish {
        ClaimFinish::Done { state, detail } => (
            "UPDATE side_effect_claims SET state = ?, finished_at = ?, detail = ?
             WHERE consumer = ? AND message_key = ?",
            binds![state.as_str(), Utc::now(), detail, consumer, key.as_str()].into(),
        ),
        ClaimFinish::Release { detail } => (
            "UPDATE side_effect_claims SET claimed_at = ?, detail = ?
             WHERE consumer = ? AND message_key = ? AND state = 'claimed'",
            binds![DateTime::<Utc>::UNIX_EPOCH, detail, consumer, key.as_str()].into(),
        ),
    }
}

/// [`finishing`] on the pool.
pub(super) async fn finish(
    sql: &dyn Sql,
    consumer: &str,
    key: &MessageKey,
    finish: &ClaimFinish,
) -> StoreResult<()> {
    let (update, values) = finishing(consumer, key, finish);
    sql.execute(update, &values).await?;
    Ok(())
}

/// See [`Store::dead_letter`](super::Store::dead_letter).
pub(super) async fn dead_letter(
    sql: &dyn Sql,
    consumer: &str,
    reason: RejectReason,
    detail: &str,
    raw: &[u8],
) -> StoreResult<i64> {
    let insert = "INSERT INTO dead_letters (consumer, reason, detail, raw, received_at)
                  VALUES (?, ?, ?, ?, ?)";
    let values = binds![consumer, reason.as_str(), detail, raw, Utc::now()];
    Ok(sql.insert(insert, &values).await?)
}
