//! [`AdminStore`] on every backend, written once over the dialect layer (as
//! `repair_sql.rs` is): the backend binds times (TEXT on SQLite, DATETIME on MariaDB,
//! timestamptz on PostgreSQL), turns `?` into its placeholders, decodes each column
//! as the statement's [`Kind`]s ask (a MariaDB key column of a binary collation reads
//! as text, a JSON column as JSON) and reports a new row's id. Times written here
//! are the process clock's on every backend.

use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;

use super::dialect::{binds, each, first, BindValue, Kind, Row, Sql};
use super::repair_sql::{claim, CLAIM_COLUMNS, CLAIM_KINDS};
use super::*;

use Kind::{Bool, Float, Int, Json, Text, Time};

const STATE_COLUMNS: &str =
    "device_id, last_seq, last_event_type, ignition, zone, lat, lon, occurred_at, updated_at";
const STATE_KINDS: [Kind; 9] = [Text, Int, Text, Text, Text, Float, Float, Time, Time];

/// The history rows `tail` (their WHERE and ORDER BY) selects, the payload as text
/// (`jsonb` on PostgreSQL, whose own text form is what the rows have always shown).
async fn history(sql: &dyn Sql, tail: &str, values: &[BindValue]) -> StoreResult<Vec<HistoryRow>> {
    let payload = sql.cast("payload", Text);
    let select = format!(
        "SELECT device_id, seq, event_type, occurred_at, received_at, applied, {payload} FROM vehicle_history {tail}"
    );
    each(sql, &select, values, &HISTORY_KINDS, history_row).await
}
const HISTORY_KINDS: [Kind; 7] = [Text, Int, Text, Time, Time, Bool, Text];

fn history_row(r: &Row) -> StoreResult<HistoryRow> {
    Ok(HistoryRow {
        device_id: r.text(0)?,
        seq: r.int(1)?,
        event_type: r.text(2)?,
        occurred_at: r.at(3),
        received_at: r.at(4),
        applied: r.bool(5)?,
        payload: r.text(6)?,
    })
}

/// Every [`Store`] is its own [`AdminStore`]: each method runs on the store's pool
/// ([`Store::sql`], a handle: cloning it shares the pool).
#[async_trait]
impl<S: Store> AdminStore for S {
    async fn add_marker(
        &self,
        kind: MarkerKind,
        label: &str,
        detail: Option<&str>,
    ) -> StoreResult<i64> {
        let insert = "INSERT INTO markers (kind, at, label, detail) VALUES (?, ?, ?, ?)";
        let values = binds![kind.as_str(), Utc::now(), label, detail];
        Ok(self.sql().0.insert(insert, &values).await?)
    }

    async fn start_drill_run(&self, scenario: &str, mode: &str) -> StoreResult<i64> {
        let insert = "INSERT INTO drill_runs (scenario, mode, started_at) VALUES (?, ?, ?)";
        let values = binds![scenario, mode, Utc::now()];
        Ok(self.sql().0.insert(insert, &values).await?)
    }

    async fn finish_drill_run(
        &self,
        id: i64,
        verdict: &str,
        report: &serde_json::Value,
    ) -> StoreResult<()> {
        let update = "UPDATE drill_runs SET finished_at = ?, verdict = ?, report = ? WHERE id = ?";
        let values = binds![Utc::now(), verdict, report, id];
        self.sql().0.execute(update, &values).await?;
        Ok(())
    }

    async fn vehicle_state(&self, device_id: &str) -> StoreResult<Option<VehicleState>> {
        let select = format!("SELECT {STATE_COLUMNS} FROM vehicle_state WHERE device_id = ?");
        let row = first(&*self.sql().0, &select, &binds![device_id], &STATE_KINDS).await?;
        row.map(|r| {
            Ok(VehicleState {
                device_id: r.text(0)?,
                last_seq: r.int(1)?,
                last_event_type: r.text(2)?,
                ignition: r.opt_text(3),
                zone: r.opt_text(4),
                lat: r.opt_float(5),
                lon: r.opt_float(6),
                occurred_at: r.at(7),
                updated_at: r.at(8),
            })
        })
        .transpose()
    }

    async fn vehicle_history(&self, device_id: &str) -> StoreResult<Vec<HistoryRow>> {
        let tail = "WHERE device_id = ? ORDER BY received_at, seq";
        history(&*self.sql().0, tail, &binds![device_id]).await
    }

    async fn recent_history(
        &self,
        event_type: Option<&str>,
        limit: i64,
    ) -> StoreResult<Vec<HistoryRow>> {
        let tail = "WHERE device_id NOT LIKE 'DRILL-%' AND (? IS NULL OR event_type = ?)
             ORDER BY received_at DESC, seq DESC LIMIT ?";
        let values = binds![event_type, event_type, limit];
        history(&*self.sql().0, tail, &values).await
    }

    /// A prefix compared by characters on every backend (PostgreSQL's `substr` takes
    /// an `integer` length).
    async fn processed_keys(&self, consumer: &str, prefix: &str) -> StoreResult<Vec<String>> {
        let length = match self.backend() {
            Backend::Postgres => "CAST(? AS integer)",
            Backend::Sqlite | Backend::Mysql => "?",
        };
        let select = format!(
            "SELECT message_key FROM processed_messages
             WHERE consumer = ? AND substr(message_key, 1, {length}) = ? ORDER BY message_key"
        );
        let chars = i64::try_from(prefix.chars().count()).unwrap_or(i64::MAX);
        let values = binds![consumer, chars, prefix];
        Ok(each(&*self.sql().0, &select, &values, &[Text], |r| r.text(0)).await?)
    }

    async fn duplicate_ages(&self) -> StoreResult<Vec<DuplicateAge>> {
        let select = "SELECT consumer, max_age_seconds, observed_at FROM duplicate_ages
                      ORDER BY consumer";
        each(&*self.sql().0, select, &[], &[Text, Float, Time], |r| {
            Ok(DuplicateAge {
                consumer: r.text(0)?,
                max_age_seconds: r.opt_float(1).unwrap_or(0.0),
                observed_at: r.at(2),
            })
        })
        .await
    }

    async fn zone_exits(&self, device_id: &str) -> StoreResult<i64> {
        let select = "SELECT zone_exits FROM trip_counters WHERE device_id = ?";
        let row = first(&*self.sql().0, select, &binds![device_id], &[Int]).await?;
        Ok(row.and_then(|r| r.opt_int(0)).unwrap_or(0))
    }

    async fn claim(&self, consumer: &str, key: &MessageKey) -> StoreResult<Option<Claim>> {
        let select = format!(
            "SELECT {CLAIM_COLUMNS} FROM side_effect_claims WHERE consumer = ? AND message_key = ?"
        );
        let values = binds![consumer, key.as_str()];
        let row = first(&*self.sql().0, &select, &values, &CLAIM_KINDS).await?;
        row.as_ref().map(claim).transpose()
    }

    async fn claims_in_doubt(&self, lease: Duration) -> StoreResult<Vec<Claim>> {
        let lease = chrono::Duration::from_std(lease).unwrap_or(chrono::Duration::zero());
        let select = format!(
            "SELECT {CLAIM_COLUMNS} FROM side_effect_claims
             WHERE state = 'claimed' AND claimed_at <= ? ORDER BY claimed_at LIMIT 1000"
        );
        let now = super::consumer_sql::db_now(&*self.sql().0).await?;
        let values = binds![now - lease];
        each(&*self.sql().0, &select, &values, &CLAIM_KINDS, claim).await
    }

    async fn markers(&self, limit: i64) -> StoreResult<Vec<Marker>> {
        let select = "SELECT id, kind, at, label, detail FROM markers ORDER BY id DESC LIMIT ?";
        let kinds = [Int, Text, Time, Text, Text];
        each(&*self.sql().0, select, &binds![limit], &kinds, |r| {
            Ok(Marker {
                id: r.int(0)?,
                kind: MarkerKind::parse(&r.text(1)?).unwrap_or(MarkerKind::Manual),
                at: r.at(2),
                label: r.text(3)?,
                detail: r.opt_text(4),
            })
        })
        .await
    }

    async fn drill_runs(&self, limit: i64) -> StoreResult<Vec<DrillRun>> {
        let select = "SELECT id, scenario, mode, started_at, finished_at, verdict, report
                      FROM drill_runs ORDER BY id DESC LIMIT ?";
        let kinds = [Int, Text, Text, Time, Time, Text, Json];
        each(&*self.sql().0, select, &binds![limit], &kinds, |r| {
            Ok(DrillRun {
                id: r.int(0)?,
                scenario: r.text(1)?,
                mode: r.text(2)?,
                started_at: r.at(3),
                finished_at: r.time(4),
                verdict: r.opt_text(5),
                report: r.json(6),
            })
        })
        .await
    }

    /// Every column read as a value and formatted here, so two backends that saw the
    /// same events give equal digests.
    async fn digest(&self) -> StoreResult<StateDigest> {
        digest(&*self.sql().0).await
    }

    async fn ingress_filters(&self, session: &str) -> StoreResult<Vec<String>> {
        let select = "SELECT filters FROM ingress_subscriptions WHERE session = ?";
        let row = first(&*self.sql().0, select, &binds![session], &[Text]).await?;
        let Some(row) = row else {
            return Ok(Vec::new());
        };
        // Written by `set_ingress_filters` only; unreadable means edited by hand, and
        // then nothing is known to unsubscribe.
        Ok(serde_json::from_str(&row.text(0)?).unwrap_or_default())
    }

    async fn set_ingress_filters(&self, session: &str, filters: &[String]) -> StoreResult<()> {
        let json = serde_json::Value::from(filters.to_vec()).to_string();
        let mut tx = self.sql().0.begin().await?;
        let delete = "DELETE FROM ingress_subscriptions WHERE session = ?";
        tx.execute(delete, &binds![session]).await?;
        if !filters.is_empty() {
            let insert =
                "INSERT INTO ingress_subscriptions (session, filters, updated_at) VALUES (?, ?, ?)";
            tx.execute(insert, &binds![session, json.as_str(), Utc::now()])
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

/// See [`AdminStore::digest`].
async fn digest(sql: &dyn Sql) -> StoreResult<StateDigest> {
    let select = "SELECT consumer, message_key, payload_hash FROM processed_messages
                  ORDER BY consumer, message_key";
    let processed = each(sql, select, &[], &[Text, Text, Text], |r| {
        Ok::<_, sqlx::Error>((r.text(0)?, r.text(1)?, r.text(2)?))
    });
    let select = "SELECT consumer, message_key, provider_key, state FROM side_effect_claims
                  ORDER BY consumer, message_key";
    let claims = each(sql, select, &[], &[Text, Text, Text, Text], |r| {
        Ok::<_, sqlx::Error>((r.text(0)?, r.text(1)?, r.text(2)?, r.text(3)?))
    });
    let select =
        "SELECT device_id, last_seq, last_event_type, ignition, zone, lat, lon, occurred_at
                  FROM vehicle_state ORDER BY device_id";
    let kinds = [Text, Int, Text, Text, Text, Float, Float, Time];
    let vehicle_state = each(sql, select, &[], &kinds, |r| {
        Ok::<_, sqlx::Error>(vehicle_digest_line(
            &r.text(0)?,
            r.int(1)?,
            &r.text(2)?,
            r.opt_text(3),
            r.opt_text(4),
            r.opt_float(5),
            r.opt_float(6),
            r.at(7),
        ))
    });
    let select = "SELECT device_id, seq, event_type, applied, payload_hash FROM vehicle_history
                  ORDER BY device_id, seq, event_type";
    let history = each(sql, select, &[], &[Text, Int, Text, Bool, Text], |r| {
        let applied = u8::from(r.bool(3)?);
        let (d, s, t, h) = (r.text(0)?, r.int(1)?, r.text(2)?, r.text(4)?);
        Ok::<_, sqlx::Error>(format!("{d}|{s}|{t}|{applied}|{h}"))
    });
    let select = "SELECT device_id, zone_exits FROM trip_counters ORDER BY device_id";
    let trip_counters = each(sql, select, &[], &[Text, Int], |r| {
        Ok::<_, sqlx::Error>((r.text(0)?, r.int(1)?))
    });
    Ok(StateDigest {
        processed: processed.await?,
        claims: claims.await?,
        vehicle_state: vehicle_state.await?,
        history: history.await?,
        trip_counters: trip_counters.await?,
    })
}
