//! Polling the business database: the dedup table's health, claims in doubt, dead
//! letters, markers, drill runs and the vehicles' ordering anomalies.
//!
//! Read-only by construction: only SELECTs; SQLite connections run with
//! `PRAGMA query_only = ON`, PostgreSQL sessions with `default_transaction_read_only`,
//! MySQL sessions with `SET SESSION TRANSACTION READ ONLY`, so a role with SELECT
//! grants is enough. Every query is bounded (an index range, a `LIMIT`, a capped
//! count or the catalog's estimate) because the dedup table holds ~40 million rows
//! in production and the dashboard polls every second.
//!
//! The queries are written once (`queries.rs`) over the engine's dialect layer; the
//! engine opens the read-only connections (`store::dashboard`, each backend's
//! `readonly.rs`); this file holds the plain-data
//! results and the one poll that assembles them, so every backend yields the same
//! figures.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::markers::TimelineMarker;
use super::vehicles::{
    self, HistoryEvent, StateRow, VehicleAnomalies, VehicleAnomaly, VehicleDetail,
};
use crate::config::DatabaseConfig;
use idemwatch_engine::store::{redact_url, StoreError};

pub mod explain;
pub mod mark;
mod queries;

/// Rows kept per list: enough for a screen, small enough for every poll.
pub const LIST_LIMIT: i64 = 50;

/// Errors of the database source.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("unsupported database URL {0} (expected sqlite://, postgres:// or mysql://)")]
    Unsupported(String),
    #[error("{0} is not available on {1}")]
    NotOnBackend(&'static str, &'static str),
    #[error("{0}")]
    Sql(#[from] sqlx::Error),
}

/// Up, or down with the reason; shown per source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum SourceStatus {
    Up,
    Down { error: String },
}

impl SourceStatus {
    /// The source answered its last poll.
    pub fn is_up(&self) -> bool {
        matches!(self, SourceStatus::Up)
    }
}

/// How a row count was obtained: counting 40 million rows every second is not an
/// option, so large tables get an estimate and say so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CountMethod {
    /// Counted, below the cap.
    Exact,
    /// The planner statistics: `sqlite_stat1` after `ANALYZE`, PostgreSQL's
    /// `pg_stat_user_tables.n_live_tup` (else `pg_class.reltuples`), MySQL's
    /// `information_schema.TABLES.TABLE_ROWS`. An estimate, never below the cap.
    Statistics,
    /// The capped count hit its cap and no statistics exist: at least this many.
    AtLeast,
}

/// Total rows of the dedup table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RowEstimate {
    pub rows: i64,
    pub method: CountMethod,
}

/// Dedup rows inserted per consumer in the last minute (a range scan on
/// `processed_at`): the database's own view of throughput, independent of metrics.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConsumerInserts {
    pub consumer: String,
    pub last_minute: i64,
}

/// The dedup table's health.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DedupStats {
    pub inserts: Vec<ConsumerInserts>,
    pub total_rows: Option<RowEstimate>,
    pub oldest_processed_at: Option<DateTime<Utc>>,
    pub oldest_age_seconds: Option<i64>,
    pub retention_seconds: i64,
    /// The oldest row is more than a day past the retention: the purge stopped.
    pub purge_stalled: bool,
}

/// A claim in doubt: the send may or may not have happened.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InDoubtClaim {
    pub consumer: String,
    pub message_key: String,
    pub claimed_at: DateTime<Utc>,
    /// Since `claimed_at`; 0 for a released claim (its claim time is gone).
    pub age_seconds: i64,
    pub attempts: i64,
    /// Given back by its owner after the provider failed or did not answer in time
    /// (the engine's release sets `claimed_at` to the epoch, so it is due for a retry
    /// at once): the retry is due, there is no age to show.
    pub released: bool,
}

/// Dead letters of one consumer and reason.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetterGroup {
    pub consumer: String,
    pub reason: String,
    pub total: i64,
    /// Received within the last hour.
    pub last_hour: i64,
    pub newest_at: Option<DateTime<Utc>>,
    /// The newest one's id: an alert about the group opens it even when it is older
    /// than the [`LIST_LIMIT`] newest dead letters listed one by one.
    pub newest_id: Option<i64>,
}

/// One dead letter's arrival, without its bytes: what the alert replay of a past
/// window counts (`monitor::replay`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetterArrival {
    pub consumer: String,
    pub reason: String,
    pub received_at: DateTime<Utc>,
}

/// The most dead-letter arrivals one replay reads; beyond it the report says the
/// replay saw only the first ones.
pub const ARRIVALS_CAP: i64 = 200_000;

/// How much of each listed dead letter's bytes a poll reads (for its preview and
/// its message key); the whole message is read only when one is opened.
pub const DEAD_LETTER_PREFIX: i64 = 1024;

/// One dead letter as listed: who refused it, why, when, and what it starts with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetterRow {
    pub id: i64,
    pub consumer: String,
    pub reason: String,
    pub received_at: DateTime<Utc>,
    pub detail: Option<String>,
    /// The whole message's size in bytes.
    pub size: i64,
    /// The first bytes as escaped text (no control sequence reaches a terminal).
    pub preview: String,
    /// The message key when the bytes are an envelope (a key conflict's are).
    pub message_key: Option<String>,
    /// The device id when the bytes are JSON that names one.
    pub device_id: Option<String>,
}

/// One dead letter opened: its whole raw bytes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetterDetail {
    pub id: i64,
    pub consumer: String,
    pub reason: String,
    pub received_at: DateTime<Utc>,
    pub detail: Option<String>,
    pub raw: Vec<u8>,
}

/// A listed dead letter's columns as each backend reads them: id, consumer, reason,
/// received_at, detail, size, the first bytes of raw.
pub(crate) type DeadLetterColumns = (
    i64,
    String,
    String,
    Option<DateTime<Utc>>,
    Option<String>,
    i64,
    Vec<u8>,
);

/// A listed dead letter from its stored columns and the first bytes of its raw.
pub(crate) fn dead_letter_row(
    (id, consumer, reason, received_at, detail, size, prefix): DeadLetterColumns,
) -> DeadLetterRow {
    let (message_key, device_id) = identity(&prefix);
    let preview: String = super::bytes::escaped(&prefix).chars().take(80).collect();
    DeadLetterRow {
        id,
        consumer,
        reason,
        received_at: received_at.unwrap_or(DateTime::<Utc>::UNIX_EPOCH),
        detail,
        size,
        preview,
        message_key,
        device_id,
    }
}

/// The key of an envelope, else the device id of any JSON naming one.
fn identity(raw: &[u8]) -> (Option<String>, Option<String>) {
    if let Ok(envelope) = idemwatch_engine::envelope::Envelope::parse(raw) {
        return (
            Some(envelope.key().as_str().to_string()),
            Some(envelope.device_id.clone()),
        );
    }
    let device = serde_json::from_slice::<serde_json::Value>(raw)
        .ok()
        .and_then(|v| v.get("device_id")?.as_str().map(str::to_string));
    (None, device)
}

/// One past drill, without its (large) report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DrillRunSummary {
    pub id: i64,
    pub scenario: String,
    pub mode: String,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub verdict: Option<String>,
}

/// One query that failed while the database itself answered (e.g. a user's database
/// without a `markers` table): that section is empty, the others still show.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueryFailure {
    pub query: &'static str,
    pub error: String,
}

/// Everything one database poll yields.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DbStats {
    /// The URL with any password as `***`.
    pub url: String,
    /// `"status": "up"`, or `"status": "down", "error": …` in JSON.
    #[serde(flatten)]
    pub status: SourceStatus,
    pub polled_at: DateTime<Utc>,
    pub duration_ms: u64,
    pub dedup: Option<DedupStats>,
    pub claims_in_doubt_total: i64,
    /// Oldest first, at most [`LIST_LIMIT`].
    pub claims_in_doubt: Vec<InDoubtClaim>,
    pub dead_letters: Vec<DeadLetterGroup>,
    /// The newest dead letters, one by one (at most [`LIST_LIMIT`]).
    pub recent_dead_letters: Vec<DeadLetterRow>,
    pub markers: Vec<TimelineMarker>,
    pub drill_runs: Vec<DrillRunSummary>,
    pub vehicles: Option<VehicleAnomalies>,
    pub failures: Vec<QueryFailure>,
    /// The store's `duplicate_ages` (the oldest duplicate each consumer dropped, in
    /// seconds); None when the database has no such table (not idemwatch's, or
    /// older): not a failure, the windows then go by the scraped maximum alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duplicate_ages: Option<std::collections::BTreeMap<String, f64>>,
}

impl DbStats {
    /// An answered poll that found nothing yet: what a poll fills, and what the
    /// alert replay of a past window fills from the dead letters it read.
    pub fn empty(url: &str, polled_at: DateTime<Utc>) -> DbStats {
        DbStats {
            url: url.to_string(),
            status: SourceStatus::Up,
            polled_at,
            duration_ms: 0,
            dedup: None,
            claims_in_doubt_total: 0,
            claims_in_doubt: Vec::new(),
            dead_letters: Vec::new(),
            recent_dead_letters: Vec::new(),
            markers: Vec::new(),
            drill_runs: Vec::new(),
            vehicles: None,
            failures: Vec::new(),
            duplicate_ages: None,
        }
    }
}

/// The most rows an exact count touches per poll; above it the catalog's estimate.
pub const COUNT_CAP: i64 = 100_000;
/// The most history rows the anomaly scan reads per poll.
pub const HISTORY_SCAN_LIMIT: i64 = 20_000;
/// Devices whose apparent gaps are confirmed against their full seq range per poll.
const GAP_CONFIRM_DEVICES: usize = 20;
/// Widest seq range read to confirm a gap.
const GAP_CONFIRM_SPAN: i64 = 10_000;
/// A recent window for the vehicle anomaly scan.
pub const VEHICLE_WINDOW: Duration = Duration::from_secs(3600);

pub use idemwatch_engine::store::dialect::BindValue;

/// One dashboard query: its name in reports, its SQL and its bound values.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DashboardQuery {
    pub name: &'static str,
    pub sql: String,
    pub binds: Vec<BindValue>,
}

/// Polls one database. Connections are opened lazily, so a database that is down at
/// start is reported as down and picked up when it comes back.
pub struct DbPoller {
    sql: queries::Dashboard,
    redacted_url: String,
    settings: DatabaseConfig,
}

impl std::fmt::Debug for DbPoller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DbPoller")
            .field("url", &self.redacted_url)
            .finish()
    }
}

impl DbPoller {
    /// A poller for the config's database; fails only on a URL that cannot be read.
    pub fn new(settings: &DatabaseConfig) -> Result<DbPoller, DbError> {
        let redacted_url = redact_url(&settings.url);
        // The read-only connections are the engine's, one per backend.
        let sql = idemwatch_engine::store::dashboard(&settings.url).map_err(|e| match e {
            StoreError::Db(e) => DbError::Sql(e),
            _ => DbError::Unsupported(redacted_url.clone()),
        })?;
        Ok(DbPoller {
            sql: queries::Dashboard::new(sql, &settings.tables),
            redacted_url,
            settings: settings.clone(),
        })
    }

    /// The URL as it may be shown.
    pub fn redacted_url(&self) -> &str {
        &self.redacted_url
    }

    /// One poll of every query. A database that does not answer gives
    /// `status: Down` and empty sections; it never returns an error.
    pub async fn poll(&self, now: DateTime<Utc>) -> DbStats {
        let started = Instant::now();
        let mut stats = DbStats::empty(&self.redacted_url, now);
        self.poll_into(now, &mut stats).await;
        stats.duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        stats
    }

    async fn poll_into(&self, now: DateTime<Utc>, stats: &mut DbStats) {
        if let Err(e) = self.sql.ping().await {
            stats.status = SourceStatus::Down {
                error: e.to_string(),
            };
            return;
        }
        let mut fail = |query: &'static str, e: sqlx::Error| {
            stats.failures.push(QueryFailure {
                query,
                error: e.to_string(),
            })
        };
        let dedup = self.dedup(now).await;
        let in_doubt = self.claims_in_doubt(now).await;
        let dead = self
            .sql
            .dead_letters(now - chrono::Duration::hours(1))
            .await;
        let recent_dead = self.sql.recent_dead_letters().await;
        let markers = self.sql.markers().await;
        let drills = self.sql.drill_runs().await;
        let vehicles = self.vehicle_anomalies(now).await;
        let ages = self.sql.duplicate_ages().await.ok();
        let dedup = dedup.map_err(|e| fail("dedup", e)).ok();
        let in_doubt = in_doubt.map_err(|e| fail("claims_in_doubt", e)).ok();
        let dead = dead.map_err(|e| fail("dead_letters", e)).ok();
        let recent_dead = recent_dead.map_err(|e| fail("recent_dead_letters", e)).ok();
        let markers = markers.map_err(|e| fail("markers", e)).ok();
        let drills = drills.map_err(|e| fail("drill_runs", e)).ok();
        let vehicles = vehicles.map_err(|e| fail("vehicles", e)).ok();
        stats.dedup = dedup;
        if let Some((total, list)) = in_doubt {
            stats.claims_in_doubt_total = total;
            stats.claims_in_doubt = list;
        }
        stats.dead_letters = dead.unwrap_or_default();
        stats.recent_dead_letters = recent_dead.unwrap_or_default();
        stats.markers = markers.unwrap_or_default();
        stats.drill_runs = drills.unwrap_or_default();
        stats.vehicles = vehicles;
        stats.duplicate_ages = ages;
    }

    async fn dedup(&self, now: DateTime<Utc>) -> Result<DedupStats, sqlx::Error> {
        let retention = self.settings.retention;
        let inserts = self
            .sql
            .inserts_since(now - chrono::Duration::minutes(1))
            .await?;
        let total_rows = Some(self.sql.total_rows().await?);
        let oldest_processed_at = self.sql.oldest_processed_at().await?;
        let oldest_age = oldest_processed_at.map(|t| now - t);
        Ok(DedupStats {
            inserts,
            total_rows,
            oldest_processed_at,
            oldest_age_seconds: oldest_age.map(|a| a.num_seconds()),
            retention_seconds: i64::try_from(retention.as_secs()).unwrap_or(i64::MAX),
            purge_stalled: oldest_age.is_some_and(|a| purge_stalled(a, retention)),
        })
    }

    /// Claims still `claimed` after the lease: count and the oldest ones.
    async fn claims_in_doubt(
        &self,
        now: DateTime<Utc>,
    ) -> Result<(i64, Vec<InDoubtClaim>), sqlx::Error> {
        let cutoff =
            now - chrono::Duration::from_std(self.settings.claim_lease).unwrap_or_default();
        let (total, rows) = self.sql.claims_in_doubt(cutoff).await?;
        let list = rows
            .into_iter()
            .map(|(consumer, message_key, claimed_at, attempts)| {
                let claimed_at = claimed_at.unwrap_or(now);
                let released = claimed_at == DateTime::<Utc>::UNIX_EPOCH;
                InDoubtClaim {
                    consumer,
                    message_key,
                    claimed_at,
                    age_seconds: if released {
                        0
                    } else {
                        (now - claimed_at).num_seconds()
                    },
                    attempts,
                    released,
                }
            })
            .collect();
        Ok((total, list))
    }

    /// The fleet-wide anomaly scan over the newest history rows of the last
    /// [`VEHICLE_WINDOW`]. Apparent gaps are confirmed against the device's full seq
    /// range (a late event received in the window would otherwise fake a gap down to
    /// its old seq); gaps of devices beyond the confirmation budget are not reported.
    async fn vehicle_anomalies(&self, now: DateTime<Utc>) -> Result<VehicleAnomalies, sqlx::Error> {
        let since = now - chrono::Duration::from_std(VEHICLE_WINDOW).unwrap_or_default();
        let events = self.sql.history_since(since, HISTORY_SCAN_LIMIT).await?;
        let late_events_in_window = self.sql.late_since(since).await?;
        let devices: BTreeSet<&str> = events.iter().map(|e| e.device_id.as_str()).collect();
        let devices: Vec<&str> = devices.into_iter().collect();
        let states = self.sql.states_of(&devices).await?;
        let mut anomalies = vehicles::detect_anomalies(&states, &events);
        let gap_devices: BTreeSet<String> = anomalies
            .iter()
            .filter(|a| matches!(a, VehicleAnomaly::SequenceGap { .. }))
            .map(|a| a.device_id().to_string())
            .collect();
        anomalies.retain(|a| !matches!(a, VehicleAnomaly::SequenceGap { .. }));
        for device in gap_devices.iter().take(GAP_CONFIRM_DEVICES) {
            let seqs = events
                .iter()
                .filter(|e| &e.device_id == device)
                .map(|e| e.seq);
            let (Some(lo), Some(hi)) = (seqs.clone().min(), seqs.max()) else {
                continue;
            };
            let lo = lo.max(hi - GAP_CONFIRM_SPAN);
            let full = self.sql.device_seqs(device, lo, hi).await?;
            anomalies.extend(vehicles::sequence_gaps(device, &full));
        }
        Ok(VehicleAnomalies {
            rows_examined: events.len(),
            truncated: i64::try_from(events.len()).unwrap_or(i64::MAX) >= HISTORY_SCAN_LIMIT,
            late_events_in_window,
            anomalies,
        })
    }

    /// The dead letters that arrived in `from..=to`, oldest first, at most
    /// [`ARRIVALS_CAP`] (the bool says the cap was hit).
    pub async fn dead_letter_arrivals(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<(Vec<DeadLetterArrival>, bool), DbError> {
        let rows = self
            .sql
            .dead_letters_between(from, to, ARRIVALS_CAP)
            .await?;
        let capped = i64::try_from(rows.len()).unwrap_or(i64::MAX) >= ARRIVALS_CAP;
        Ok((rows, capped))
    }

    /// One dead letter with all its raw bytes (None: no such id).
    pub async fn dead_letter(&self, id: i64) -> Result<Option<DeadLetterDetail>, DbError> {
        Ok(self.sql.dead_letter(id).await?)
    }

    /// One vehicle's state beside its newest `limit` history rows in arrival order.
    pub async fn vehicle_detail(
        &self,
        device_id: &str,
        limit: i64,
    ) -> Result<VehicleDetail, DbError> {
        let state = self.sql.state_of(device_id).await?;
        let events = self.sql.history_of(device_id, limit).await?;
        Ok(VehicleDetail {
            device_id: device_id.to_string(),
            state,
            truncated: i64::try_from(events.len()).unwrap_or(i64::MAX) >= limit,
            history: vehicles::arrival_order(events),
        })
    }

    /// The queries a poll at `now` runs against the dedup and claims tables, with
    /// the values it binds (PostgreSQL and MySQL; the bench and the plan tests run
    /// them under `EXPLAIN`).
    pub async fn dashboard_queries(
        &self,
        now: DateTime<Utc>,
    ) -> Result<Vec<DashboardQuery>, DbError> {
        self.sql.dashboard_queries(&self.settings, now).await
    }

    /// Run one dashboard query under `EXPLAIN` (`ANALYZE, BUFFERS` on PostgreSQL
    /// when `analyze`): the plan's node types, the tables read whole, the raw plan.
    pub async fn explain(
        &self,
        query: &DashboardQuery,
        analyze: bool,
    ) -> Result<explain::PlanSummary, DbError> {
        self.sql.explain(query, analyze).await
    }

    /// Run one dashboard query as the poll does (rows discarded), for timing.
    pub async fn run_query(&self, query: &DashboardQuery) -> Result<(), DbError> {
        self.sql.run(query).await
    }
}

/// Whether the oldest dedup row says the purge stopped: more than a day past the
/// retention (the nightly purge may legitimately lag by up to a day).
pub fn purge_stalled(oldest_age: chrono::Duration, retention: Duration) -> bool {
    let limit = chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX)
        + chrono::Duration::days(1);
    oldest_age > limit
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn purge_counts_as_stalled_only_a_day_past_retention() {
        let week = Duration::from_secs(7 * 86400);
        assert!(!purge_stalled(chrono::Duration::days(7), week));
        assert!(!purge_stalled(chrono::Duration::hours(7 * 24 + 23), week));
        assert!(purge_stalled(chrono::Duration::hours(8 * 24 + 1), week));
    }
}
