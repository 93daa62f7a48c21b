//! The vehicle state upsert, written once for every backend: the columns an event
//! carries, what it keeps of the stored row (`COALESCE`, the zone by event type) and
//! the seq guard. SQLite and PostgreSQL share the `ON CONFLICT … excluded.` form;
//! MariaDB writes the same rule as `ON DUPLICATE KEY UPDATE` with every column
//! conditional on the guard. The one-by-one paths, the batch paths and the rusqlite
//! baseline all take their statement from here, so a column rule cannot drift
//! between them.

use chrono::Utc;

use super::dialect::{binds, retrying, Sql};
use super::{Backend, StoreResult, VehicleFacts, VehicleOutcome};
use crate::envelope::Message;

/// `INSERT … (9 columns)`; a backend adds its `VALUES` or `SELECT` and the tail.
pub const VEHICLE_UPSERT_HEAD: &str = "INSERT INTO vehicle_state
    (device_id, last_seq, last_event_type, ignition, zone, lat, lon, occurred_at, updated_at)";

/// What an event changes in the state row: the columns its type does not carry
/// kept as they are.
macro_rules! vehicle_upsert_set {
    () => {
        "ON CONFLICT (device_id) DO UPDATE SET
           last_seq = excluded.last_seq,
           last_event_type = excluded.last_event_type,
           ignition = COALESCE(excluded.ignition, vehicle_state.ignition),
           zone = CASE excluded.last_event_type
                    WHEN 'zone_enter' THEN excluded.zone
                    WHEN 'zone_exit' THEN NULL
                    ELSE vehicle_state.zone END,
           lat = COALESCE(excluded.lat, vehicle_state.lat),
           lon = COALESCE(excluded.lon, vehicle_state.lon),
           occurred_at = excluded.occurred_at,
           updated_at = excluded.updated_at"
    };
}

/// SQLite and PostgreSQL: the upsert's conflict clause, with the seq guard in its
/// WHERE when `guarded` (the row is then left alone and 0 rows are reported).
pub fn vehicle_upsert_tail(guarded: bool) -> &'static str {
    if guarded {
        concat!(
            vehicle_upsert_set!(),
            " WHERE excluded.last_seq > vehicle_state.last_seq"
        )
    } else {
        vehicle_upsert_set!()
    }
}

/// MariaDB: the same rule as [`vehicle_upsert_tail`], every column conditional on
/// `newer` (the guard `VALUES(last_seq) > last_seq`, or `TRUE` for naive writes) and
/// `last_seq` assigned last, because MySQL evaluates the assignments left to right.
pub(crate) fn vehicle_upsert_update(newer: &str) -> String {
    format!(
        "ON DUPLICATE KEY UPDATE
           ignition = IF({newer}, COALESCE(VALUES(ignition), ignition), ignition),
           zone = IF({newer}, CASE VALUES(last_event_type)
                                WHEN 'zone_enter' THEN VALUES(zone)
                                WHEN 'zone_exit' THEN NULL
                                ELSE zone END, zone),
           lat = IF({newer}, COALESCE(VALUES(lat), lat), lat),
           lon = IF({newer}, COALESCE(VALUES(lon), lon), lon),
           occurred_at = IF({newer}, VALUES(occurred_at), occurred_at),
           updated_at = IF({newer}, VALUES(updated_at), updated_at),
           last_event_type = IF({newer}, VALUES(last_event_type), last_event_type),
           last_seq = IF({newer}, VALUES(last_seq), last_seq)"
    )
}

/// [`Store::apply_vehicle_event`](super::Store::apply_vehicle_event) naive (drills
/// only), written once for every backend: the event into history once (a row already
/// there is left as it is), then the state overwritten with no seq guard, in one
/// transaction. Always `Applied`: nothing is decided, which is the point of the
/// naive mode.
pub(super) async fn apply_unguarded(sql: &dyn Sql, msg: &Message) -> StoreResult<VehicleOutcome> {
    let facts = VehicleFacts::of(msg)?;
    let now = Utc::now();
    let history = sql.insert_or_skip(
        "INTO vehicle_history
           (device_id, seq, event_type, occurred_at, received_at, applied, payload, payload_hash)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    );
    let tail = match sql.backend() {
        Backend::Mysql => vehicle_upsert_update("TRUE"),
        Backend::Sqlite | Backend::Postgres => vehicle_upsert_tail(false).to_string(),
    };
    let upsert = format!("{VEHICLE_UPSERT_HEAD} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) {tail}");
    let payload = serde_json::Value::Object(msg.payload.clone());
    let device = msg.device_id.as_str();
    let history_values = binds![
        device,
        facts.seq,
        facts.event_type,
        msg.occurred_at,
        now,
        true,
        &payload,
        msg.fingerprint().as_str(),
    ];
    let state_values = binds![
        device,
        facts.seq,
        facts.event_type,
        facts.ignition,
        facts.zone,
        facts.lat,
        facts.lon,
        msg.occurred_at,
        now,
    ];
    retrying(|| async {
        let mut tx = sql.begin().await?;
        tx.execute(&history, &history_values).await?;
        tx.execute(&upsert, &state_values).await?;
        tx.commit().await?;
        Ok(VehicleOutcome::Applied)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MariaDB's upsert assigns every state column of the head but the key, each only
    /// when the event is `newer`, and `last_seq` last: MySQL evaluates the assignments
    /// left to right, so a guard read after `last_seq` was assigned would compare the
    /// new seq with itself and keep the rest of the old row.
    #[test]
    fn mariadb_assigns_every_column_under_the_guard_and_last_seq_last() {
        let (_, columns) = VEHICLE_UPSERT_HEAD.split_once('(').expect("a column list");
        let columns: Vec<&str> = columns
            .trim_end_matches(')')
            .split(',')
            .map(str::trim)
            .collect();
        let update = vehicle_upsert_update("NEWER");
        assert!(update.starts_with("ON DUPLICATE KEY UPDATE"), "{update}");
        let assigned: Vec<&str> = update
            .lines()
            .filter_map(|line| line.trim().split_once(" = IF(NEWER, "))
            .map(|(column, _)| column)
            .collect();
        let mut expected: Vec<&str> = columns.into_iter().filter(|c| *c != "device_id").collect();
        let mut sorted = assigned.clone();
        sorted.sort_unstable();
        expected.sort_unstable();
        assert_eq!(sorted, expected, "{update}");
        assert_eq!(assigned.last(), Some(&"last_seq"), "{update}");
    }
}
