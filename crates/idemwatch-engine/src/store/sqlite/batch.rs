//! The SQLite store's batch writes as jobs on the store file's
//! [`SqliteThread`](crate::sqlite::thread::SqliteThread): each runs whole inside the
//! one `BEGIN IMMEDIATE … COMMIT` the thread gives it, a prepared statement from the
//! connection's cache per row, so a batch is one hand-off to that thread and back
//! instead of one or more per statement (see `crate::sqlite::thread` for why).
//!
//! The decisions are the backend-neutral ones (`batch.rs`, `vehicle_batch.rs`,
//! `claim_batch.rs`): the write lock is taken first, so what is read here stays
//! true until the commit and the writes follow from it. A dedup or history row is
//! written with a plain `INSERT`: a row stored after all fails the statement (and
//! the batch rolls back, an outage the retry decides), never passes for new.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rusqlite::{params, OptionalExtension, Transaction};

use crate::envelope::{Fingerprint, Message, MessageKey};
use crate::sqlite::thread::db;
use crate::store::batch::{note_duplicate_age_sql, FirstSeen};
use crate::store::claim_batch::{self, ClaimFinish, ClaimRequest, ClaimResult};
use crate::store::dialect::parse_text_time;
use crate::store::vehicle_batch::{StoredHistory, VehicleBatch};
use crate::store::vehicle_sql::{vehicle_upsert_tail, VEHICLE_UPSERT_HEAD};
use crate::store::{
    parse_ts, ts, Backend, Claim, ClaimOutcome, ClaimState, DedupBatch, DedupOutcome, Recordable,
    StoreResult, VehicleOutcome,
};

const STORED_KEY: &str =
    "SELECT payload_hash, processed_at FROM processed_messages WHERE consumer = ?1 AND message_key = ?2";

const INSERT_KEY: &str =
    "INSERT INTO processed_messages (consumer, message_key, payload_hash, processed_at)
     VALUES (?1, ?2, ?3, ?4)";

/// A new key's dedup row (a plain `INSERT`: see the module doc).
fn insert_key(
    tx: &Transaction<'_>,
    consumer: &str,
    key: &MessageKey,
    fingerprint: &Fingerprint,
    now: &str,
) -> StoreResult<()> {
    tx.prepare_cached(INSERT_KEY)
        .and_then(|mut insert| {
            insert.execute(params![consumer, key.as_str(), fingerprint.as_str(), now])
        })
        .map_err(db)?;
    Ok(())
}

/// `select`'s first column for each key's parameters (a prepared statement from the
/// connection's cache), by key where it found a row.
fn read_each<K: Eq + std::hash::Hash, P: rusqlite::Params, V: rusqlite::types::FromSql>(
    tx: &Transaction<'_>,
    select: &str,
    keys: impl Iterator<Item = (K, P)>,
) -> StoreResult<HashMap<K, V>> {
    read_each_row(tx, select, keys, |r| r.get(0))
}

/// [`read_each`] with the row read by `row` (several columns).
fn read_each_row<K: Eq + std::hash::Hash, P: rusqlite::Params, V>(
    tx: &Transaction<'_>,
    select: &str,
    keys: impl Iterator<Item = (K, P)>,
    row: impl Fn(&rusqlite::Row<'_>) -> rusqlite::Result<V>,
) -> StoreResult<HashMap<K, V>> {
    let mut read = tx.prepare_cached(select).map_err(db)?;
    let mut found = HashMap::new();
    for (key, params) in keys {
        if let Some(v) = read.query_row(params, &row).optional().map_err(db)? {
            found.insert(key, v);
        }
    }
    Ok(found)
}

/// For each of `keys` already stored: its fingerprint, and when it was first
/// processed (one read per key, the one that decides it: no extra read for the age).
fn stored_keys<'k>(
    tx: &Transaction<'_>,
    consumer: &str,
    keys: impl Iterator<Item = &'k str>,
) -> StoreResult<(HashMap<String, String>, FirstSeen)> {
    let mut read = tx.prepare_cached(STORED_KEY).map_err(db)?;
    let (mut stored, mut first_seen) = (HashMap::new(), FirstSeen::new());
    for key in keys {
        let row = read
            .query_row(params![consumer, key], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
            })
            .optional()
            .map_err(db)?;
        if let Some((fingerprint, at)) = row {
            if let Some(at) = parse_text_time(&at) {
                first_seen.insert(key.to_string(), at);
            }
            stored.insert(key.to_string(), fingerprint);
        }
    }
    Ok((stored, first_seen))
}

/// `trip_counters.zone_exits + n`.
const COUNT_EXITS: &str = "INSERT INTO trip_counters (device_id, zone_exits) VALUES (?1, ?2)
     ON CONFLICT (device_id) DO UPDATE SET zone_exits = trip_counters.zone_exits + excluded.zone_exits";

/// [`Store::record_batch`](super::Store::record_batch): the dedup rows and the
/// business rows of the applied items.
pub(super) fn record_batch(
    tx: &Transaction<'_>,
    consumer: &str,
    items: &[Recordable],
) -> StoreResult<Vec<DedupOutcome>> {
    let batch = DedupBatch::new(items);
    let at = Utc::now();
    let now = ts(at);
    let keys = batch.distinct().iter().map(|i| i.key.as_str());
    let (stored, first_seen) = stored_keys(tx, consumer, keys)?;
    let (fresh, inserted) = batch.fresh(&stored);
    let outcomes = batch.outcomes(&inserted, &stored, &first_seen, at)?;
    for item in fresh {
        insert_key(tx, consumer, &item.key, &item.fingerprint, &now)?;
    }
    if let Some(age) = DedupBatch::oldest_duplicate(&outcomes, Utc::now()) {
        let note = note_duplicate_age_sql(Backend::Sqlite);
        let mut note = tx.prepare_cached(note).map_err(db)?;
        note.execute(params![consumer, age, now]).map_err(db)?;
    }
    let mut count = tx.prepare_cached(COUNT_EXITS).map_err(db)?;
    for (device, n) in batch.zone_exits(&outcomes) {
        count.execute(params![device, n]).map_err(db)?;
    }
    Ok(outcomes)
}

/// [`Store::apply_vehicle_batch`](super::Store::apply_vehicle_batch): history rows
/// insert-once, each applied event's state upsert in batch order.
pub(super) fn apply_vehicle_batch(
    tx: &Transaction<'_>,
    envs: &[Message],
) -> StoreResult<Vec<VehicleOutcome>> {
    let batch = VehicleBatch::new(envs)?;
    let at = Utc::now();
    let now = ts(at);
    let stored_rows: HashMap<(String, i64, String), (String, String)> = read_each_row(
        tx,
        "SELECT payload_hash, received_at FROM vehicle_history
         WHERE device_id = ?1 AND seq = ?2 AND event_type = ?3",
        batch
            .distinct()
            .map(|i| i.key())
            .map(|(d, s, t)| ((d.into(), s, t.into()), (d, s, t))),
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    let stored: StoredHistory = stored_rows
        .into_iter()
        .map(|(k, (hash, received))| (k, (hash, parse_text_time(&received))))
        .collect();
    let last_seq = read_each(
        tx,
        "SELECT last_seq FROM vehicle_state WHERE device_id = ?1",
        batch.devices().into_iter().map(|d| (d.to_string(), [d])),
    )?;
    let (outcomes, writes) = batch.decide(&stored, &last_seq, at);
    let mut history = tx
        .prepare_cached(
            "INSERT INTO vehicle_history
               (device_id, seq, event_type, occurred_at, received_at, applied, payload, payload_hash)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )
        .map_err(db)?;
    for (item, applied) in &writes.history {
        history
            .execute(params![
                item.env.device_id.as_str(),
                item.facts.seq,
                item.facts.event_type,
                ts(item.env.occurred_at),
                now,
                applied,
                item.facts.payload.as_str(),
                item.fingerprint.as_str(),
            ])
            .map_err(db)?;
    }
    let mut upsert = tx
        .prepare_cached(&format!(
            "{VEHICLE_UPSERT_HEAD} VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) {}",
            vehicle_upsert_tail(true)
        ))
        .map_err(db)?;
    for item in &writes.upserts {
        upsert
            .execute(params![
                item.env.device_id.as_str(),
                item.facts.seq,
                item.facts.event_type,
                item.facts.ignition,
                item.facts.zone,
                item.facts.lat,
                item.facts.lon,
                ts(item.env.occurred_at),
                now,
            ])
            .map_err(db)?;
    }
    Ok(outcomes)
}

/// [`Store::claim_batch`](super::Store::claim_batch): phase 1 of a batch of side
/// effects — dedup rows and claims of the new keys, takeovers of in-doubt ones.
pub(super) fn claim_batch(
    tx: &Transaction<'_>,
    consumer: &str,
    requests: &[ClaimRequest],
    lease: Duration,
) -> StoreResult<Vec<ClaimOutcome>> {
    // Read back as stored, so a later compare-and-set on it matches.
    let now = parse_ts(&ts(Utc::now()));
    let (mut stored, mut claims) = (HashMap::new(), HashMap::new());
    let mut first_seen = FirstSeen::new();
    {
        let mut read = tx
            .prepare_cached(
                "SELECT p.payload_hash, c.provider_key, c.state, c.claimed_at, c.finished_at,
                        c.attempts, c.detail, p.processed_at
                 FROM processed_messages p LEFT JOIN side_effect_claims c
                   ON c.consumer = p.consumer AND c.message_key = p.message_key
                 WHERE p.consumer = ?1 AND p.message_key = ?2",
            )
            .map_err(db)?;
        for key in claim_batch::sorted_keys(requests) {
            let row = read
                .query_row(params![consumer, key], |r| {
                    let hash: String = r.get(0)?;
                    let state: Option<String> = r.get(2)?;
                    let claim = match state {
                        None => None,
                        Some(state) => Some(Claim {
                            consumer: consumer.to_string(),
                            message_key: key.to_string(),
                            provider_key: r.get(1)?,
                            state: ClaimState::parse(&state).unwrap_or(ClaimState::Claimed),
                            claimed_at: parse_ts(&r.get::<_, String>(3)?),
                            finished_at: r.get::<_, Option<String>>(4)?.as_deref().map(parse_ts),
                            attempts: r.get(5)?,
                            detail: r.get(6)?,
                        }),
                    };
                    Ok((hash, claim, r.get::<_, String>(7)?))
                })
                .optional()
                .map_err(db)?;
            if let Some((hash, claim, at)) = row {
                if let Some(at) = parse_text_time(&at) {
                    first_seen.insert(key.to_string(), at);
                }
                stored.insert(key.to_string(), hash);
                if let Some(claim) = claim {
                    claims.insert(key.to_string(), claim);
                }
            }
        }
    }
    let (outcomes, writes) = claim_batch::decide(
        consumer,
        requests,
        &stored,
        &first_seen,
        &claims,
        now,
        lease,
    );
    let now = ts(now);
    if let Some(age) = ClaimOutcome::oldest_duplicate(&outcomes, Utc::now()) {
        let note = note_duplicate_age_sql(Backend::Sqlite);
        let mut note = tx.prepare_cached(note).map_err(db)?;
        note.execute(params![consumer, age, now]).map_err(db)?;
    }
    let mut claim = tx
        .prepare_cached(
            "INSERT INTO side_effect_claims
               (consumer, message_key, provider_key, state, claimed_at, attempts, message)
             VALUES (?1, ?2, ?3, 'claimed', ?4, 1, ?5)",
        )
        .map_err(db)?;
    for r in &writes.fresh {
        insert_key(tx, consumer, &r.key, &r.fingerprint, &now)?;
        claim
            .execute(params![
                consumer,
                r.key.as_str(),
                r.provider_key.as_str(),
                now,
                r.message.as_slice()
            ])
            .map_err(db)?;
    }
    let mut take_over = tx
        .prepare_cached(
            "UPDATE side_effect_claims SET claimed_at = ?1, attempts = attempts + 1, message = ?2
             WHERE consumer = ?3 AND message_key = ?4 AND state = 'claimed' AND claimed_at = ?5",
        )
        .map_err(db)?;
    for (r, claimed_at) in &writes.takeovers {
        take_over
            .execute(params![
                now,
                r.message.as_slice(),
                consumer,
                r.key.as_str(),
                ts(*claimed_at)
            ])
            .map_err(db)?;
    }
    Ok(outcomes)
}

/// [`Store::finish_batch`](super::Store::finish_batch): phase 3 of a batch — each
/// provider answer on its claim, an owned one only while its owner holds the claim;
/// the keys of the owned answers that found it another's.
pub(super) fn finish_batch(
    tx: &Transaction<'_>,
    consumer: &str,
    results: &[ClaimResult],
) -> StoreResult<Vec<MessageKey>> {
    let now = ts(Utc::now());
    let epoch = ts(DateTime::<Utc>::UNIX_EPOCH);
    // `?6 IS NULL`: a result without an owner's token is written whoever holds it.
    let mut done = tx
        .prepare_cached(
            "UPDATE side_effect_claims SET state = ?1, finished_at = ?2, detail = ?3
             WHERE consumer = ?4 AND message_key = ?5
               AND (?6 IS NULL OR (state = 'claimed' AND attempts = ?6))",
        )
        .map_err(db)?;
    // Immediately eligible for an in-doubt retry, as `release_claim`.
    let mut release = tx
        .prepare_cached(
            "UPDATE side_effect_claims SET claimed_at = ?1, detail = ?2
             WHERE consumer = ?3 AND message_key = ?4 AND state = 'claimed'
               AND (?5 IS NULL OR attempts = ?5)",
        )
        .map_err(db)?;
    let mut lost = Vec::new();
    for r in results {
        let finished = match &r.finish {
            ClaimFinish::Done { state, detail } => done.execute(params![
                state.as_str(),
                now,
                detail,
                consumer,
                r.key.as_str(),
                r.attempts
            ]),
            ClaimFinish::Release { detail } => {
                release.execute(params![epoch, detail, consumer, r.key.as_str(), r.attempts])
            }
        };
        if finished.map_err(db)? != 1 && r.attempts.is_some() {
            lost.push(r.key.clone());
        }
    }
    Ok(lost)
}
