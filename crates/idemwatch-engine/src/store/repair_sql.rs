//! [`RepairStore`] on every backend, written once over the dialect layer: the
//! backend binds times (TEXT on SQLite, DATETIME on MariaDB, timestamptz on
//! PostgreSQL), turns `?` into its placeholders, decodes each column as the
//! statement's [`Kind`]s ask, and spells `IN` a list of names. These statements are
//! rare and driven by a person, so one spelling for three databases is worth more
//! than what a backend's own SQL would save.

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::dialect::{binds, BindValue, Kind, Pooled, Row, Sql};
use super::mysql::MysqlStore;
use super::postgres::PostgresStore;
use super::repair::*;
use super::sqlite::SqliteStore;
use super::{Claim, ClaimState, DeadLetter, StoreResult};

use Kind::{Bytes, Int, Text, Time};

const DEAD_LETTER_COLUMNS: &str =
    "id, consumer, reason, detail, raw, received_at, replayed_at, replay_count";
const DEAD_LETTER_KINDS: [Kind; 8] = [Int, Text, Text, Text, Bytes, Time, Time, Int];
pub(super) const CLAIM_COLUMNS: &str =
    "consumer, message_key, provider_key, state, claimed_at, finished_at, attempts, detail";
pub(super) const CLAIM_KINDS: [Kind; 8] = [Text, Text, Text, Text, Time, Time, Int, Text];
/// [`CLAIM_KINDS`] and the message the claim was taken for.
const STRANDED_KINDS: [Kind; 9] = [Text, Text, Text, Text, Time, Time, Int, Text, Bytes];

/// Dead letters matching `filter`, newest first.
pub(super) async fn find_dead_letters(
    sql: &dyn Sql,
    filter: &DeadLetterFilter,
) -> StoreResult<Vec<DeadLetter>> {
    let mut query = format!("SELECT {DEAD_LETTER_COLUMNS} FROM dead_letters WHERE 1 = 1");
    let mut values: Vec<BindValue> = Vec::new();
    if let Some(c) = &filter.consumer {
        query.push_str(" AND consumer = ?");
        values.push(c.into());
    }
    if let Some(r) = &filter.reason {
        query.push_str(" AND reason = ?");
        values.push(r.into());
    }
    if let Some(t) = filter.since {
        query.push_str(" AND received_at >= ?");
        values.push(t.into());
    }
    if !filter.ids.is_empty() {
        let marks = vec!["?"; filter.ids.len()].join(", ");
        query.push_str(&format!(" AND id IN ({marks})"));
        values.extend(filter.ids.iter().map(|id| BindValue::from(*id)));
    }
    if !filter.takes_replayed() {
        query.push_str(" AND replayed_at IS NULL");
    }
    query.push_str(" ORDER BY id DESC LIMIT ?");
    values.push(filter.capped_limit().into());
    let rows = sql.rows(&query, &values, &DEAD_LETTER_KINDS).await?;
    rows.iter()
        .map(|r| {
            Ok(DeadLetter {
                id: r.int(0)?,
                consumer: r.text(1)?,
                reason: r.text(2)?,
                detail: r.opt_text(3),
                raw: r.opt_bytes(4).unwrap_or_default(),
                received_at: r.at(5),
                replayed_at: r.time(6),
                replay_count: r.int(7)?,
            })
        })
        .collect()
}

/// See [`RepairStore::mark_replayed`].
pub(super) async fn mark_replayed(sql: &dyn Sql, id: i64) -> StoreResult<bool> {
    let update = "UPDATE dead_letters SET replayed_at = ?, replay_count = replay_count + 1
                  WHERE id = ?";
    let done = sql.execute(update, &binds![Utc::now(), id]).await?;
    Ok(done.rows_affected == 1)
}

/// See [`RepairStore::rearm_failed_claim`]: claimed at the epoch, a lease long over.
pub(super) async fn rearm_failed_claim(
    sql: &dyn Sql,
    consumer: &str,
    key: &str,
    detail: &str,
) -> StoreResult<bool> {
    let update = "UPDATE side_effect_claims SET state = 'claimed', claimed_at = ?,
                  finished_at = NULL, detail = ?
                  WHERE consumer = ? AND message_key = ? AND state = 'failed'";
    let epoch = DateTime::<Utc>::UNIX_EPOCH;
    let done = sql
        .execute(update, &binds![epoch, detail, consumer, key])
        .await?;
    Ok(done.rows_affected == 1)
}

/// See [`RepairStore::list_claims`].
pub(super) async fn list_claims(sql: &dyn Sql, filter: &ClaimFilter) -> StoreResult<Vec<Claim>> {
    let mut query = format!("SELECT {CLAIM_COLUMNS} FROM side_effect_claims WHERE 1 = 1");
    let mut values: Vec<BindValue> = Vec::new();
    if let Some(c) = &filter.consumer {
        query.push_str(" AND consumer = ?");
        values.push(c.into());
    }
    if let Some(state) = filter.state {
        query.push_str(" AND state = ?");
        values.push(state.as_str().into());
    }
    query.push_str(" ORDER BY claimed_at, consumer, message_key LIMIT ?");
    values.push(filter.capped_limit().into());
    let rows = sql.rows(&query, &values, &CLAIM_KINDS).await?;
    rows.iter().map(claim).collect()
}

/// See [`RepairStore::stranded_claims`]. No consumers: no claims (no statement).
pub(super) async fn stranded_claims(
    sql: &dyn Sql,
    consumers: &[&str],
    claimed_before: DateTime<Utc>,
    limit: i64,
) -> StoreResult<Vec<StrandedClaim>> {
    if consumers.is_empty() {
        return Ok(Vec::new());
    }
    let query = format!(
        "SELECT {CLAIM_COLUMNS}, message FROM side_effect_claims
         WHERE state = 'claimed' AND claimed_at < ? AND {}
         ORDER BY claimed_at LIMIT ?",
        sql.in_list("consumer", consumers.len())
    );
    let names = BindValue::TextList(consumers.iter().map(|c| c.to_string()).collect());
    let values = [
        claimed_before.into(),
        names,
        limit.clamp(0, MAX_LISTED).into(),
    ];
    let rows = sql.rows(&query, &values, &STRANDED_KINDS).await?;
    rows.iter()
        .map(|r| {
            Ok(StrandedClaim {
                claim: claim(r)?,
                message: r.opt_bytes(8),
            })
        })
        .collect()
}

/// See [`RepairStore::resolve_claim`].
pub(super) async fn resolve_claim(
    sql: &dyn Sql,
    consumer: &str,
    key: &str,
    state: ClaimState,
    detail: &str,
) -> StoreResult<bool> {
    let update = "UPDATE side_effect_claims SET state = ?, finished_at = ?, detail = ?
                  WHERE consumer = ? AND message_key = ? AND state = 'claimed'";
    let values = binds![state.as_str(), Utc::now(), detail, consumer, key];
    Ok(sql.execute(update, &values).await?.rows_affected == 1)
}

/// A claim read as [`CLAIM_KINDS`].
pub(super) fn claim(r: &Row) -> StoreResult<Claim> {
    Ok(Claim {
        consumer: r.text(0)?,
        message_key: r.text(1)?,
        provider_key: r.text(2)?,
        state: ClaimState::parse(&r.text(3)?).unwrap_or(ClaimState::Claimed),
        claimed_at: r.at(4),
        finished_at: r.time(5),
        attempts: r.int(6)?,
        detail: r.opt_text(7),
    })
}

/// [`RepairStore`] for a store with a `pool()`, every method one of the functions
/// above on that pool (a handle: cloning it shares the pool).
macro_rules! repair_over_sql {
    ($store:ty) => {
        #[async_trait]
        impl RepairStore for $store {
            async fn find_dead_letters(
                &self,
                filter: &DeadLetterFilter,
            ) -> StoreResult<Vec<DeadLetter>> {
                find_dead_letters(&Pooled(self.pool().clone()), filter).await
            }
            async fn mark_replayed(&self, id: i64) -> StoreResult<bool> {
                mark_replayed(&Pooled(self.pool().clone()), id).await
            }
            async fn rearm_failed_claim(
                &self,
                consumer: &str,
                key: &str,
                detail: &str,
            ) -> StoreResult<bool> {
                let sql = Pooled(self.pool().clone());
                rearm_failed_claim(&sql, consumer, key, detail).await
            }
            async fn list_claims(&self, filter: &ClaimFilter) -> StoreResult<Vec<Claim>> {
                list_claims(&Pooled(self.pool().clone()), filter).await
            }
            async fn stranded_claims(
                &self,
                consumers: &[&str],
                claimed_before: DateTime<Utc>,
                limit: i64,
            ) -> StoreResult<Vec<StrandedClaim>> {
                let sql = Pooled(self.pool().clone());
                stranded_claims(&sql, consumers, claimed_before, limit).await
            }
            async fn resolve_claim(
                &self,
                consumer: &str,
                key: &str,
                state: ClaimState,
                detail: &str,
            ) -> StoreResult<bool> {
                let sql = Pooled(self.pool().clone());
                resolve_claim(&sql, consumer, key, state, detail).await
            }
        }
    };
}

repair_over_sql!(SqliteStore);
repair_over_sql!(PostgresStore);
repair_over_sql!(MysqlStore);

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::envelope::{Fingerprint, MessageKey, RejectReason};
    use crate::store::{AdminStore, ClaimFinish, ClaimRequest, ClaimResult, Durability, Store};

    async fn open(dir: &tempfile::TempDir) -> SqliteStore {
        let url = format!("sqlite://{}", dir.path().join("s.db").display());
        SqliteStore::open(&url, Durability::Durable).await.unwrap()
    }

    fn key(k: &str) -> MessageKey {
        MessageKey::from_stored(k.to_string())
    }

    /// A replay is recorded on its own letter, once per replay, and an id with no
    /// letter is answered `false` (the operator named a row that is not there).
    #[tokio::test]
    async fn a_replay_is_recorded_on_its_own_letter_and_a_missing_one_is_no_row() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir).await;
        let reason = RejectReason::MaxDeliveries;
        let a = store
            .dead_letter("c", reason, "gave up", b"a")
            .await
            .unwrap();
        let b = store
            .dead_letter("c", reason, "gave up", b"b")
            .await
            .unwrap();
        let replayed = [
            store.mark_replayed(a).await.unwrap(),
            store.mark_replayed(a).await.unwrap(),
            store.mark_replayed(a.max(b) + 1).await.unwrap(),
        ];
        assert_eq!(replayed, [true, true, false]);
        let letters = store.dead_letters(10).await.unwrap();
        let read: Vec<_> = letters
            .iter()
            .map(|d| (d.id, d.replay_count, d.replayed_at.is_some()))
            .collect();
        assert_eq!(read, [(b, 0, false), (a, 2, true)], "newest first");
    }

    /// A claim is re-armed only from `failed` and resolved only from `claimed`; each
    /// says whether it changed the claim, and a claim in another state (or none) is
    /// left as it was.
    #[tokio::test]
    async fn a_claim_is_rearmed_only_when_failed_and_resolved_only_when_open() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir).await;
        let requests: Vec<_> = ["sent", "failed", "open"]
            .map(|k| ClaimRequest {
                key: key(k),
                fingerprint: Fingerprint::from_stored(format!("fp-{k}")),
                provider_key: format!("pk-{k}"),
                message: k.as_bytes().to_vec(),
            })
            .into();
        store
            .claim_batch("s", &requests, Duration::from_secs(3600))
            .await
            .unwrap();
        let done = |k: &str, state| ClaimResult {
            key: key(k),
            finish: ClaimFinish::Done {
                state,
                detail: k.to_string(),
            },
            attempts: Some(1),
        };
        let finished = [
            done("sent", ClaimState::Sent),
            done("failed", ClaimState::Failed),
        ];
        store.finish_batch("s", &finished).await.unwrap();

        let mut rearmed = Vec::new();
        for k in ["sent", "open", "none", "failed", "failed"] {
            rearmed.push(store.rearm_failed_claim("s", k, "re-armed").await.unwrap());
        }
        assert_eq!(rearmed, [false, false, false, true, false]);
        let c = store.claim("s", &key("failed")).await.unwrap().unwrap();
        assert_eq!(
            (c.state, c.claimed_at, c.finished_at, c.detail.as_deref()),
            (
                ClaimState::Claimed,
                DateTime::UNIX_EPOCH,
                None,
                Some("re-armed")
            )
        );

        let mut resolved = Vec::new();
        for k in ["sent", "none", "open", "open"] {
            let r = store.resolve_claim("s", k, ClaimState::Sent, "by hand");
            resolved.push(r.await.unwrap());
        }
        assert_eq!(resolved, [false, false, true, false]);
        let mut read = Vec::new();
        for k in ["open", "sent"] {
            let c = store.claim("s", &key(k)).await.unwrap().unwrap();
            read.push((c.state, c.detail, c.finished_at.is_some()));
        }
        let text = |s: &str| Some(s.to_string());
        assert_eq!(
            read,
            [
                (ClaimState::Sent, text("by hand"), true),
                (ClaimState::Sent, text("sent"), true),
            ]
        );
    }
}
