//! `idemwatch mark`: the one write the dashboard's side makes.
//!
//! A CD pipeline (or an operator) records a deploy, an incident or a note as one row
//! of the `markers` table; every running dashboard reads the table on each poll, so
//! the line appears on their charts within one poll interval, and in `snapshot`.
//!
//! Everything else on this side is read-only ([`super::DbPoller`]), so the grant a
//! pipeline needs is exactly one: `INSERT` on `markers` (PostgreSQL adds `USAGE` on the
//! id's sequence, which `INSERT` into a serial column needs). That is why the insert
//! here has no `RETURNING` and reads nothing back: `RETURNING` would need `SELECT`.
//! The id is reported where the driver hands it over for free (SQLite, MySQL).
//!
//! It uses the config's table mapping like the poller, so a user's own markers table
//! is written where the dashboard reads it, and one connection with a bounded connect
//! and statement time: a pipeline must not hang on a database that is away.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::Connection;

use crate::config::{DatabaseConfig, MarkersTable};
use idemwatch_engine::store::dialect::text_time;
use idemwatch_engine::store::{redact_url, Backend};

/// The longest label: the `markers.label` column of the MySQL schema is 255
/// characters, and a chart label longer than a line helps nobody.
pub const MAX_LABEL_CHARS: usize = 255;

/// How long `mark` waits for the database, connecting and inserting each.
pub const MARK_TIMEOUT: Duration = Duration::from_secs(5);

/// What a pipeline can mark (docs/CONTRACT.md §8 `idemwatch mark deploy|incident|note`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum MarkKind {
    /// A release went out: the line every duplicate spike is read against.
    Deploy,
    /// Something broke (an outage, a page): the start of a post-mortem window.
    Incident,
    /// Anything else worth a line on the chart.
    Note,
}

impl MarkKind {
    /// The stored `kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            MarkKind::Deploy => "deploy",
            MarkKind::Incident => "incident",
            MarkKind::Note => "note",
        }
    }
}

/// A marker to write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NewMarker {
    pub kind: MarkKind,
    pub at: DateTime<Utc>,
    pub label: String,
    pub detail: Option<String>,
}

/// A label fit for the chart: not blank, at most [`MAX_LABEL_CHARS`], no control
/// characters (they would reach every terminal that draws it). Returns it trimmed.
pub fn check_label(raw: &str) -> Result<String, String> {
    let label = raw.trim();
    if label.is_empty() {
        return Err("the label is empty".into());
    }
    if label.chars().count() > MAX_LABEL_CHARS {
        return Err(format!(
            "the label is longer than {MAX_LABEL_CHARS} characters"
        ));
    }
    if label.chars().any(char::is_control) {
        return Err("the label contains control characters".into());
    }
    Ok(label.to_string())
}

/// Why a marker was not written.
#[derive(Debug, thiserror::Error)]
pub enum MarkError {
    #[error("unsupported database URL {0} (expected sqlite://, postgres:// or mysql://)")]
    Unsupported(String),
    #[error("cannot reach the database {url}: {error}")]
    Unreachable { url: String, error: String },
    #[error("the database {url} refused the marker: {error}")]
    Refused { url: String, error: String },
}

/// Insert one marker row; the id when the backend reports it without a read. The
/// mapping's identifiers were checked as plain when the config was loaded.
pub async fn insert_marker(
    settings: &DatabaseConfig,
    marker: &NewMarker,
) -> Result<Option<i64>, MarkError> {
    let m = &settings.tables.markers;
    let url = settings.url.as_str();
    let shown = redact_url(url);
    let unreachable = |error: String| MarkError::Unreachable {
        url: shown.clone(),
        error,
    };
    let refused = |error: String| MarkError::Refused {
        url: shown.clone(),
        error,
    };
    let backend = Backend::of_url(url);
    if backend == Some(Backend::Sqlite) {
        // Never create the database: a pipeline pointed at a wrong path must fail.
        let options = sqlx::sqlite::SqliteConnectOptions::from_str(url)
            .map_err(|e| unreachable(e.to_string()))?
            .create_if_missing(false)
            .busy_timeout(MARK_TIMEOUT);
        let mut conn = within(sqlx::SqliteConnection::connect_with(&options))
            .await
            .map_err(unreachable)?;
        let sql = insert_sql(m, '"', |_| "?".into());
        let insert = sqlx::query(&sql)
            .bind(marker.kind.as_str())
            .bind(text_time(marker.at))
            .bind(&marker.label)
            .bind(&marker.detail);
        let done = within(insert.execute(&mut conn)).await.map_err(refused)?;
        let _ = conn.close().await;
        Ok(Some(done.last_insert_rowid()))
    } else if backend == Some(Backend::Postgres) {
        let options = sqlx::postgres::PgConnectOptions::from_str(url)
            .map_err(|e| unreachable(e.to_string()))?
            .options([("statement_timeout", MARK_TIMEOUT.as_millis().to_string())])
            .application_name("idemwatch-mark");
        let mut conn = within(sqlx::PgConnection::connect_with(&options))
            .await
            .map_err(unreachable)?;
        let sql = insert_sql(m, '"', |i| format!("${i}"));
        let insert = sqlx::query(&sql)
            .bind(marker.kind.as_str())
            .bind(marker.at)
            .bind(&marker.label)
            .bind(&marker.detail);
        within(insert.execute(&mut conn)).await.map_err(refused)?;
        let _ = conn.close().await;
        Ok(None)
    } else if backend == Some(Backend::Mysql) {
        let url = url.replacen("mariadb:", "mysql:", 1);
        let options = sqlx::mysql::MySqlConnectOptions::from_str(&url)
            .map_err(|e| unreachable(e.to_string()))?;
        let mut conn = within(sqlx::MySqlConnection::connect_with(&options))
            .await
            .map_err(unreachable)?;
        let sql = insert_sql(m, '`', |_| "?".into());
        let insert = sqlx::query(&sql)
            .bind(marker.kind.as_str())
            .bind(marker.at.naive_utc())
            .bind(&marker.label)
            .bind(&marker.detail);
        let done = within(insert.execute(&mut conn)).await.map_err(refused)?;
        let _ = conn.close().await;
        Ok(i64::try_from(done.last_insert_id()).ok())
    } else {
        Err(MarkError::Unsupported(shown))
    }
}

/// One database step, bounded by [`MARK_TIMEOUT`]; its error as text.
async fn within<T>(
    step: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(MARK_TIMEOUT, step).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {MARK_TIMEOUT:?}")),
    }
}

/// `INSERT INTO markers (kind, at, label, detail) VALUES (…)` over the mapping, with
/// the backend's identifier quote and placeholders (1-based).
fn insert_sql(m: &MarkersTable, quote: char, placeholder: impl Fn(usize) -> String) -> String {
    let q = |id: &str| format!("{quote}{id}{quote}");
    format!(
        "INSERT INTO {} ({}, {}, {}, {}) VALUES ({}, {}, {}, {})",
        q(&m.table),
        q(&m.kind),
        q(&m.at),
        q(&m.label),
        q(&m.detail),
        placeholder(1),
        placeholder(2),
        placeholder(3),
        placeholder(4)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_trimmed_and_bounded() {
        assert_eq!(check_label("  v2.4.1 "), Ok("v2.4.1".into()));
        assert!(check_label("   ").is_err());
        assert!(check_label("v2\x1b[31m").is_err());
        assert!(check_label(&"x".repeat(MAX_LABEL_CHARS)).is_ok());
        assert!(check_label(&"x".repeat(MAX_LABEL_CHARS + 1)).is_err());
    }

    #[test]
    fn the_insert_follows_the_mapping() {
        let m = MarkersTable {
            table: "deploys".into(),
            ..MarkersTable::default()
        };
        assert_eq!(
            insert_sql(&m, '"', |i| format!("${i}")),
            r#"INSERT INTO "deploys" ("kind", "at", "label", "detail") VALUES ($1, $2, $3, $4)"#
        );
    }
}
