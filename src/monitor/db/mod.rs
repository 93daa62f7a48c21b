//! Polling the business database: the dedup table's health, claims in doubt, dead
//! letters, markers, drill runs and the vehicles' ordering anomalies.
//!
//! Read-only by construction: only SELECTs, and SQLite connections are opened with
//! `PRAGMA query_only = ON`. Every query is bounded (an index range, a `LIMIT`, or
//! a capped count) because the dedup table holds ~40 million rows in production and
//! the dashboard polls every second.
//!
//! One file per backend holds its SQL ([`sqlite`]); this file holds the plain-data
//! results and the dispatch. Adding PostgreSQL or MySQL means one more file with the
//! same query functions and one more [`Backend`] arm.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::markers::TimelineMarker;
use super::vehicles::{VehicleAnomalies, VehicleDetail};
use crate::config::DatabaseConfig;
use crate::engine::store::redact_url;

pub mod sqlite;

/// Rows kept per list: enough for a screen, small enough for every poll.
pub const LIST_LIMIT: i64 = 50;

/// Errors of the database source.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("the dashboard cannot poll {0} yet (supported: sqlite://)")]
    Unsupported(String),
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
    /// The planner statistics (`sqlite_stat1` after `ANALYZE`); as old as the last
    /// ANALYZE, never below the capped count.
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
    pub age_seconds: i64,
    pub attempts: i64,
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
    pub markers: Vec<TimelineMarker>,
    pub drill_runs: Vec<DrillRunSummary>,
    pub vehicles: Option<VehicleAnomalies>,
    pub failures: Vec<QueryFailure>,
}

enum Backend {
    Sqlite(Box<sqlite::SqlitePoller>),
    /// A backend whose poller is not written yet: reported as down on every poll
    /// (the rest of the dashboard still works) rather than refusing to start.
    NotYetSupported,
}

/// Polls one database. Connections are opened lazily, so a database that is down at
/// start is reported as down and picked up when it comes back.
pub struct DbPoller {
    backend: Backend,
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

/// A recent window for the vehicle anomaly scan.
pub const VEHICLE_WINDOW: Duration = Duration::from_secs(3600);

impl DbPoller {
    /// A poller for the config's database; fails only on a URL that cannot be read.
    /// PostgreSQL and MySQL URLs give a poller that reports itself down until their
    /// query files exist.
    pub fn new(settings: &DatabaseConfig) -> Result<DbPoller, DbError> {
        let redacted_url = redact_url(&settings.url);
        let backend = if settings.url.starts_with("sqlite:") {
            Backend::Sqlite(Box::new(sqlite::SqlitePoller::new(settings)?))
        } else {
            Backend::NotYetSupported
        };
        Ok(DbPoller {
            backend,
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
        let mut stats = DbStats {
            url: self.redacted_url.clone(),
            status: SourceStatus::Up,
            polled_at: now,
            duration_ms: 0,
            dedup: None,
            claims_in_doubt_total: 0,
            claims_in_doubt: Vec::new(),
            dead_letters: Vec::new(),
            markers: Vec::new(),
            drill_runs: Vec::new(),
            vehicles: None,
            failures: Vec::new(),
        };
        match &self.backend {
            Backend::Sqlite(p) => p.poll_into(&self.settings, now, &mut stats).await,
            Backend::NotYetSupported => {
                stats.status = SourceStatus::Down {
                    error: DbError::Unsupported(self.redacted_url.clone()).to_string(),
                }
            }
        }
        stats.duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        stats
    }

    /// One vehicle's state beside its newest `limit` history rows in arrival order.
    pub async fn vehicle_detail(
        &self,
        device_id: &str,
        limit: i64,
    ) -> Result<VehicleDetail, DbError> {
        match &self.backend {
            Backend::Sqlite(p) => p.vehicle_detail(device_id, limit).await,
            Backend::NotYetSupported => Err(DbError::Unsupported(self.redacted_url.clone())),
        }
    }
}

/// Whether the oldest dedup row says the purge stopped: more than a day past the
/// retention (the nightly purge may legitimately lag by up to a day).
pub fn purge_stalled(oldest_age: chrono::Duration, retention: Duration) -> bool {
    let limit = chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX)
        + chrono::Duration::days(1);
    oldest_age > limit
}

/// The TEXT timestamp form the engine writes (fixed width, sorts as it reads); bound
/// as the cutoff of range queries.
pub(crate) fn db_time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// Read a TEXT timestamp: RFC 3339 (the engine's form) or SQLite's
/// `YYYY-MM-DD HH:MM:SS[.fff]` (a user's own table written with `datetime()`).
pub(crate) fn parse_db_time(s: &str) -> Option<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Some(t.with_timezone(&Utc));
    }
    chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f")
        .ok()
        .map(|n| n.and_utc())
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

    #[test]
    fn reads_both_timestamp_forms() {
        let engine = parse_db_time("2026-11-30T04:12:03.000000Z").unwrap();
        let sqlite = parse_db_time("2026-11-30 04:12:03").unwrap();
        assert_eq!(engine, sqlite);
        assert_eq!(db_time(engine), "2026-11-30T04:12:03.000000Z");
        assert!(parse_db_time("yesterday").is_none());
    }
}
