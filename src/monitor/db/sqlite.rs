//! The SQLite queries of the database poller.
//!
//! Table and column names come from the config mapping; they were validated as plain
//! identifiers (`[A-Za-z_][A-Za-z0-9_]*`) and are double-quoted here as well, so a
//! column named like a keyword (`order`) works too. Values are always bound.
//!
//! Total rows: `processed_messages` is a `WITHOUT ROWID` table, so there is no
//! `MAX(rowid)` shortcut. We count with a cap (`COUNT(*)` over a `LIMIT`ed subquery,
//! at most [`COUNT_CAP`] index entries, a few milliseconds); above the cap we use
//! `sqlite_stat1` when the database was `ANALYZE`d, else report "at least the cap".

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions, SqliteRow};
use sqlx::{Row, SqlitePool};

use super::*;
use crate::config::TableMapping;
use crate::monitor::markers::MarkerSource;

/// The SQL text of every query, built once from the mapping.
#[derive(Debug)]
struct Queries {
    ping: String,
    inserts_since: String,
    capped_count: String,
    stat1: String,
    oldest: String,
    in_doubt_count: String,
    in_doubt_list: String,
    dead_letters: String,
    recent_dead_letters: String,
    dead_letter: String,
    markers: String,
    drill_runs: String,
    history_window: String,
    late_count: String,
    device_seqs: String,
    history_of_device: String,
    state_select: String,
    state_of_device: String,
}

fn q(identifier: &str) -> String {
    format!("\"{identifier}\"")
}

impl Queries {
    fn new(t: &TableMapping) -> Queries {
        let pm = &t.processed_messages;
        let c = &t.side_effect_claims;
        let dl = &t.dead_letters;
        let m = &t.markers;
        let d = &t.drill_runs;
        let h = &t.vehicle_history;
        let s = &t.vehicle_state;
        let history_columns = format!(
            "{}, {}, {}, {}, {}, {}",
            q(&h.device_id),
            q(&h.seq),
            q(&h.event_type),
            q(&h.occurred_at),
            q(&h.received_at),
            q(&h.applied)
        );
        let state_select = format!(
            "SELECT {}, {}, {}, {}, {}, {} FROM {}",
            q(&s.device_id),
            q(&s.last_seq),
            q(&s.last_event_type),
            q(&s.ignition),
            q(&s.occurred_at),
            q(&s.updated_at),
            q(&s.table)
        );
        Queries {
            ping: "SELECT 1".into(),
            inserts_since: format!(
                "SELECT {c}, COUNT(*) FROM {t} WHERE {at} >= ? GROUP BY {c} ORDER BY {c}",
                c = q(&pm.consumer),
                t = q(&pm.table),
                at = q(&pm.processed_at)
            ),
            capped_count: format!(
                "SELECT COUNT(*) FROM (SELECT 1 FROM {} LIMIT ?)",
                q(&pm.table)
            ),
            stat1: "SELECT stat FROM sqlite_stat1 WHERE tbl = ? LIMIT 1".into(),
            oldest: format!("SELECT MIN({}) FROM {}", q(&pm.processed_at), q(&pm.table)),
            in_doubt_count: format!(
                "SELECT COUNT(*) FROM {} WHERE {} = 'claimed' AND {} <= ?",
                q(&c.table),
                q(&c.state),
                q(&c.claimed_at)
            ),
            in_doubt_list: format!(
                "SELECT {}, {}, {}, {} FROM {} WHERE {} = 'claimed' AND {} <= ? ORDER BY {} LIMIT ?",
                q(&c.consumer),
                q(&c.message_key),
                q(&c.claimed_at),
                q(&c.attempts),
                q(&c.table),
                q(&c.state),
                q(&c.claimed_at),
                q(&c.claimed_at)
            ),
            dead_letters: format!(
                "SELECT {c}, {r}, COUNT(*), SUM(CASE WHEN {at} >= ? THEN 1 ELSE 0 END), MAX({at})
                 FROM {t} GROUP BY {c}, {r} ORDER BY COUNT(*) DESC, {c}, {r} LIMIT ?",
                c = q(&dl.consumer),
                r = q(&dl.reason),
                at = q(&dl.received_at),
                t = q(&dl.table)
            ),
            recent_dead_letters: format!(
                "SELECT {}, {}, {}, {}, {}, length({}), substr({}, 1, ?) FROM {} ORDER BY {} DESC LIMIT ?",
                q(&dl.id),
                q(&dl.consumer),
                q(&dl.reason),
                q(&dl.received_at),
                q(&dl.detail),
                q(&dl.raw),
                q(&dl.raw),
                q(&dl.table),
                q(&dl.id)
            ),
            dead_letter: format!(
                "SELECT {}, {}, {}, {}, {}, {} FROM {} WHERE {} = ?",
                q(&dl.id),
                q(&dl.consumer),
                q(&dl.reason),
                q(&dl.received_at),
                q(&dl.detail),
                q(&dl.raw),
                q(&dl.table),
                q(&dl.id)
            ),
            markers: format!(
                "SELECT {}, {}, {}, {} FROM {} ORDER BY {} DESC LIMIT ?",
                q(&m.kind),
                q(&m.at),
                q(&m.label),
                q(&m.detail),
                q(&m.table),
                q(&m.at)
            ),
            drill_runs: format!(
                "SELECT {}, {}, {}, {}, {}, {} FROM {} ORDER BY {} DESC LIMIT ?",
                q(&d.id),
                q(&d.scenario),
                q(&d.mode),
                q(&d.started_at),
                q(&d.finished_at),
                q(&d.verdict),
                q(&d.table),
                q(&d.id)
            ),
            history_window: format!(
                "SELECT {history_columns} FROM {} WHERE {} >= ? ORDER BY {} DESC LIMIT ?",
                q(&h.table),
                q(&h.received_at),
                q(&h.received_at)
            ),
            late_count: format!(
                "SELECT COUNT(*) FROM {} WHERE {} = 0 AND {} >= ?",
                q(&h.table),
                q(&h.applied),
                q(&h.received_at)
            ),
            device_seqs: format!(
                "SELECT DISTINCT {seq} FROM {} WHERE {} = ? AND {seq} BETWEEN ? AND ?",
                q(&h.table),
                q(&h.device_id),
                seq = q(&h.seq)
            ),
            history_of_device: format!(
                "SELECT {history_columns} FROM {} WHERE {} = ? ORDER BY {} DESC, {} DESC LIMIT ?",
                q(&h.table),
                q(&h.device_id),
                q(&h.received_at),
                q(&h.seq)
            ),
            state_of_device: format!("{state_select} WHERE {} = ?", q(&s.device_id)),
            state_select: format!("{state_select} WHERE {} IN ", q(&s.device_id)),
        }
    }
}

/// The SQLite side of [`DbPoller`].
pub(super) struct SqlitePoller {
    pool: SqlitePool,
    sql: Queries,
    processed_table: String,
}

impl SqlitePoller {
    pub(super) fn new(settings: &DatabaseConfig) -> Result<SqlitePoller, DbError> {
        let options = SqliteConnectOptions::from_str(&settings.url)?
            // Never create the watched database, never write to it.
            .create_if_missing(false)
            .pragma("query_only", "ON")
            .busy_timeout(Duration::from_secs(2));
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(3))
            .connect_lazy_with(options);
        Ok(SqlitePoller {
            pool,
            sql: Queries::new(&settings.tables),
            processed_table: settings.tables.processed_messages.table.clone(),
        })
    }
}

#[async_trait]
impl DashboardSql for SqlitePoller {
    fn backend_name(&self) -> &'static str {
        "sqlite"
    }

    async fn ping(&self) -> Result<(), sqlx::Error> {
        sqlx::query(&self.sql.ping)
            .fetch_one(&self.pool)
            .await
            .map(|_| ())
    }

    /// Dedup rows inserted per consumer since `since`: a range scan on the
    /// `processed_at` index.
    async fn inserts_since(
        &self,
        since: DateTime<Utc>,
    ) -> Result<Vec<ConsumerInserts>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.inserts_since)
            .bind(db_time(since))
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(ConsumerInserts {
                    consumer: r.try_get(0)?,
                    last_minute: r.try_get(1)?,
                })
            })
            .collect()
    }

    async fn total_rows(&self) -> Result<RowEstimate, sqlx::Error> {
        let counted: i64 = sqlx::query_scalar(&self.sql.capped_count)
            .bind(COUNT_CAP + 1)
            .fetch_one(&self.pool)
            .await?;
        if counted <= COUNT_CAP {
            return Ok(RowEstimate {
                rows: counted,
                method: CountMethod::Exact,
            });
        }
        // No sqlite_stat1 table (never ANALYZEd) is not a failure: fall back.
        let stat: Option<String> = sqlx::query_scalar(&self.sql.stat1)
            .bind(&self.processed_table)
            .fetch_optional(&self.pool)
            .await
            .ok()
            .flatten();
        let analyzed = stat
            .as_deref()
            .and_then(|s| s.split_whitespace().next())
            .and_then(|n| n.parse::<i64>().ok());
        Ok(match analyzed {
            Some(n) if n > COUNT_CAP => RowEstimate {
                rows: n,
                method: CountMethod::Statistics,
            },
            _ => RowEstimate {
                rows: COUNT_CAP,
                method: CountMethod::AtLeast,
            },
        })
    }

    async fn oldest_processed_at(&self) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
        let oldest: Option<String> = sqlx::query_scalar(&self.sql.oldest)
            .fetch_one(&self.pool)
            .await?;
        Ok(oldest.as_deref().and_then(parse_db_time))
    }

    /// Claims still `claimed` after the lease: count and the oldest ones.
    async fn claims_in_doubt(
        &self,
        cutoff: DateTime<Utc>,
    ) -> Result<(i64, Vec<(String, String, Option<DateTime<Utc>>, i64)>), sqlx::Error> {
        let cutoff = db_time(cutoff);
        let total: i64 = sqlx::query_scalar(&self.sql.in_doubt_count)
            .bind(&cutoff)
            .fetch_one(&self.pool)
            .await?;
        let rows = sqlx::query(&self.sql.in_doubt_list)
            .bind(&cutoff)
            .bind(LIST_LIMIT)
            .fetch_all(&self.pool)
            .await?;
        let list = rows
            .iter()
            .map(|r| {
                Ok((
                    r.try_get(0)?,
                    r.try_get(1)?,
                    time_column(r, 2)?,
                    r.try_get(3)?,
                ))
            })
            .collect::<Result<_, sqlx::Error>>()?;
        Ok((total, list))
    }

    /// Dead letters by consumer and reason. A full scan of `dead_letters`, which
    /// stays small (a large one is itself the alarm).
    async fn dead_letters(
        &self,
        since: DateTime<Utc>,
    ) -> Result<Vec<DeadLetterGroup>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.dead_letters)
            .bind(db_time(since))
            .bind(LIST_LIMIT)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(DeadLetterGroup {
                    consumer: r.try_get(0)?,
                    reason: r.try_get(1)?,
                    total: r.try_get(2)?,
                    last_hour: r.try_get::<Option<i64>, _>(3)?.unwrap_or(0),
                    newest_at: time_column(r, 4)?,
                })
            })
            .collect()
    }

    async fn recent_dead_letters(&self) -> Result<Vec<DeadLetterRow>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.recent_dead_letters)
            .bind(DEAD_LETTER_PREFIX)
            .bind(LIST_LIMIT)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(dead_letter_row((
                    r.try_get(0)?,
                    r.try_get(1)?,
                    r.try_get(2)?,
                    time_column(r, 3)?,
                    r.try_get(4)?,
                    r.try_get::<Option<i64>, _>(5)?.unwrap_or(0),
                    r.try_get::<Option<Vec<u8>>, _>(6)?.unwrap_or_default(),
                )))
            })
            .collect()
    }

    async fn dead_letter(&self, id: i64) -> Result<Option<DeadLetterDetail>, sqlx::Error> {
        let row = sqlx::query(&self.sql.dead_letter)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r: SqliteRow| {
            let r = &r;
            Ok(DeadLetterDetail {
                id: r.try_get(0)?,
                consumer: r.try_get(1)?,
                reason: r.try_get(2)?,
                received_at: time_column(r, 3)?.unwrap_or(DateTime::<Utc>::UNIX_EPOCH),
                detail: r.try_get(4)?,
                raw: r.try_get::<Option<Vec<u8>>, _>(5)?.unwrap_or_default(),
            })
        })
        .transpose()
    }

    async fn markers(&self) -> Result<Vec<TimelineMarker>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.markers)
            .bind(LIST_LIMIT)
            .fetch_all(&self.pool)
            .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            // A marker whose time cannot be read cannot be placed on a chart.
            if let Some(at) = time_column(r, 1)? {
                out.push(TimelineMarker {
                    at,
                    kind: r.try_get(0)?,
                    label: r.try_get(2)?,
                    detail: r.try_get(3)?,
                    source: MarkerSource::Database,
                });
            }
        }
        Ok(out)
    }

    async fn drill_runs(&self) -> Result<Vec<DrillRunSummary>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.drill_runs)
            .bind(LIST_LIMIT)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(DrillRunSummary {
                    id: r.try_get(0)?,
                    scenario: r.try_get(1)?,
                    mode: r.try_get(2)?,
                    started_at: time_column(r, 3)?,
                    finished_at: time_column(r, 4)?,
                    verdict: r.try_get(5)?,
                })
            })
            .collect()
    }

    async fn history_since(
        &self,
        since: DateTime<Utc>,
        limit: i64,
    ) -> Result<Vec<HistoryEvent>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.history_window)
            .bind(db_time(since))
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(history_event).collect()
    }

    async fn late_since(&self, since: DateTime<Utc>) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(&self.sql.late_count)
            .bind(db_time(since))
            .fetch_one(&self.pool)
            .await
    }

    async fn device_seqs(
        &self,
        device_id: &str,
        lo: i64,
        hi: i64,
    ) -> Result<Vec<i64>, sqlx::Error> {
        sqlx::query_scalar(&self.sql.device_seqs)
            .bind(device_id)
            .bind(lo)
            .bind(hi)
            .fetch_all(&self.pool)
            .await
    }

    /// State rows of these devices, in chunks that stay under SQLite's bind limit.
    async fn states_of(&self, devices: &[&str]) -> Result<Vec<StateRow>, sqlx::Error> {
        let mut out = Vec::new();
        for chunk in devices.chunks(500) {
            let placeholders = vec!["?"; chunk.len()].join(", ");
            let sql = format!("{}({placeholders})", self.sql.state_select);
            let mut query = sqlx::query(&sql);
            for d in chunk {
                query = query.bind(*d);
            }
            for r in query.fetch_all(&self.pool).await? {
                out.push(state_row(&r)?);
            }
        }
        Ok(out)
    }

    async fn state_of(&self, device_id: &str) -> Result<Option<StateRow>, sqlx::Error> {
        sqlx::query(&self.sql.state_of_device)
            .bind(device_id)
            .fetch_optional(&self.pool)
            .await?
            .map(|r| state_row(&r))
            .transpose()
    }

    async fn history_of(
        &self,
        device_id: &str,
        limit: i64,
    ) -> Result<Vec<HistoryEvent>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.history_of_device)
            .bind(device_id)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(history_event).collect()
    }
}

/// A TEXT timestamp column; unreadable text is treated as missing rather than failing
/// the whole list.
fn time_column(r: &SqliteRow, index: usize) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    Ok(r.try_get::<Option<String>, _>(index)?
        .as_deref()
        .and_then(parse_db_time))
}

fn history_event(r: &SqliteRow) -> Result<HistoryEvent, sqlx::Error> {
    Ok(HistoryEvent {
        device_id: r.try_get(0)?,
        seq: r.try_get(1)?,
        event_type: r.try_get(2)?,
        occurred_at: time_column(r, 3)?,
        received_at: time_column(r, 4)?.unwrap_or(DateTime::<Utc>::UNIX_EPOCH),
        applied: r.try_get::<i64, _>(5)? != 0,
    })
}

fn state_row(r: &SqliteRow) -> Result<StateRow, sqlx::Error> {
    Ok(StateRow {
        device_id: r.try_get(0)?,
        last_seq: r.try_get(1)?,
        last_event_type: r.try_get(2)?,
        ignition: r.try_get(3)?,
        occurred_at: time_column(r, 4)?,
        updated_at: time_column(r, 5)?,
    })
}
