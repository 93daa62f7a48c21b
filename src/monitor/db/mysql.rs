//! The MySQL / MariaDB queries of the database poller, cheap on a 40-million-row
//! dedup table:
//!
//! - total rows: `information_schema.TABLES.TABLE_ROWS` (InnoDB's sampled estimate);
//!   only a table it says is smaller than [`COUNT_CAP`] is counted, with a cap.
//! - per-consumer rows of the last minute: a range on the `processed_at` index.
//! - the oldest row: `MIN(processed_at)`, answered from the index ("Select tables
//!   optimized away"). (`ORDER BY … LIMIT 1` would show as access type `index`,
//!   which the plan check treats as a full scan.)
//! - claims in doubt: a range on `side_effect_claims_state (state, claimed_at)`.
//!
//! Sessions are `READ ONLY` with a statement time limit, so SELECT grants are
//! enough. Keys use a binary collation that the driver reports as VARBINARY, so
//! every text column is read through `CAST(… AS CHAR)`. DATETIME columns hold UTC
//! (the engine sets `time_zone = '+00:00'`, and so does this session).

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::mysql::{MySqlArguments, MySqlConnectOptions, MySqlPoolOptions, MySqlRow};
use sqlx::query::Query;
use sqlx::{MySql, MySqlPool, Row};

use super::explain::{summarize_mysql, PlanSummary};
use super::*;
use crate::config::TableMapping;
use crate::monitor::markers::MarkerSource;

fn q(identifier: &str) -> String {
    format!("`{identifier}`")
}

fn text(identifier: &str) -> String {
    format!("CAST(`{identifier}` AS CHAR)")
}

fn int(identifier: &str) -> String {
    format!("CAST(`{identifier}` AS SIGNED)")
}

/// The SQL text of every query, built once from the mapping.
#[derive(Debug)]
struct Queries {
    inserts_since: String,
    estimate: String,
    capped_count: String,
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
            text(&h.device_id),
            int(&h.seq),
            text(&h.event_type),
            q(&h.occurred_at),
            q(&h.received_at),
            int(&h.applied)
        );
        let state_select = format!(
            "SELECT {}, {}, {}, {}, {}, {} FROM {}",
            text(&s.device_id),
            int(&s.last_seq),
            text(&s.last_event_type),
            text(&s.ignition),
            q(&s.occurred_at),
            q(&s.updated_at),
            q(&s.table)
        );
        let in_doubt_where = format!("{} = 'claimed' AND {} <= ?", q(&c.state), q(&c.claimed_at));
        Queries {
            inserts_since: format!(
                "SELECT {}, COUNT(*) FROM {t} WHERE {at} >= ? GROUP BY {c} ORDER BY {c}",
                text(&pm.consumer),
                c = q(&pm.consumer),
                t = q(&pm.table),
                at = q(&pm.processed_at)
            ),
            estimate: "SELECT CAST(TABLE_ROWS AS SIGNED) FROM information_schema.TABLES
                       WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?"
                .into(),
            capped_count: format!(
                "SELECT COUNT(*) FROM (SELECT 1 FROM {} LIMIT ?) capped",
                q(&pm.table)
            ),
            oldest: format!("SELECT MIN({}) FROM {}", q(&pm.processed_at), q(&pm.table)),
            in_doubt_count: format!(
                "SELECT COUNT(*) FROM {} WHERE {in_doubt_where}",
                q(&c.table)
            ),
            in_doubt_list: format!(
                "SELECT {}, {}, {}, {} FROM {} WHERE {in_doubt_where} ORDER BY {} LIMIT ?",
                text(&c.consumer),
                text(&c.message_key),
                q(&c.claimed_at),
                int(&c.attempts),
                q(&c.table),
                q(&c.claimed_at)
            ),
            dead_letters: format!(
                "SELECT {}, {}, COUNT(*), COUNT(CASE WHEN {at} >= ? THEN 1 END), MAX({at})
                 FROM {t} GROUP BY {c}, {r} ORDER BY COUNT(*) DESC, {c}, {r} LIMIT ?",
                text(&dl.consumer),
                text(&dl.reason),
                c = q(&dl.consumer),
                r = q(&dl.reason),
                at = q(&dl.received_at),
                t = q(&dl.table)
            ),
            recent_dead_letters: format!(
                "SELECT {}, {}, {}, {}, {}, CAST(LENGTH({}) AS SIGNED), SUBSTRING({}, 1, ?) FROM {} ORDER BY {} DESC LIMIT ?",
                int(&dl.id),
                text(&dl.consumer),
                text(&dl.reason),
                q(&dl.received_at),
                text(&dl.detail),
                q(&dl.raw),
                q(&dl.raw),
                q(&dl.table),
                q(&dl.id)
            ),
            dead_letter: format!(
                "SELECT {}, {}, {}, {}, {}, {} FROM {} WHERE {} = ?",
                int(&dl.id),
                text(&dl.consumer),
                text(&dl.reason),
                q(&dl.received_at),
                text(&dl.detail),
                q(&dl.raw),
                q(&dl.table),
                q(&dl.id)
            ),
            markers: format!(
                "SELECT {}, {}, {}, {} FROM {} ORDER BY {} DESC LIMIT ?",
                text(&m.kind),
                q(&m.at),
                text(&m.label),
                text(&m.detail),
                q(&m.table),
                q(&m.at)
            ),
            drill_runs: format!(
                "SELECT {}, {}, {}, {}, {}, {} FROM {} ORDER BY {} DESC LIMIT ?",
                int(&d.id),
                text(&d.scenario),
                text(&d.mode),
                q(&d.started_at),
                q(&d.finished_at),
                text(&d.verdict),
                q(&d.table),
                q(&d.id)
            ),
            history_window: format!(
                "SELECT {history_columns} FROM {} WHERE {} >= ? ORDER BY {} DESC LIMIT ?",
                q(&h.table),
                q(&h.received_at),
                q(&h.received_at)
            ),
            // `applied = 0` leads the (applied, received_at) index.
            late_count: format!(
                "SELECT COUNT(*) FROM {} WHERE {} = 0 AND {} >= ?",
                q(&h.table),
                q(&h.applied),
                q(&h.received_at)
            ),
            device_seqs: format!(
                "SELECT DISTINCT {} FROM {} WHERE {} = ? AND {seq} BETWEEN ? AND ?",
                int(&h.seq),
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

/// The MySQL side of [`DbPoller`].
#[derive(Debug, Clone)]
pub(super) struct MysqlPoller {
    pool: MySqlPool,
    sql: std::sync::Arc<Queries>,
    processed_table: String,
}

impl MysqlPoller {
    pub(super) fn new(settings: &DatabaseConfig) -> Result<MysqlPoller, DbError> {
        let url = settings.url.replacen("mariadb://", "mysql://", 1);
        let options: MySqlConnectOptions = url.parse()?;
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(3))
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::query("SET time_zone = '+00:00'")
                        .execute(&mut *conn)
                        .await?;
                    sqlx::query("SET SESSION TRANSACTION READ ONLY")
                        .execute(&mut *conn)
                        .await?;
                    // MariaDB (seconds) and MySQL (milliseconds) spell the statement
                    // time limit differently; the other one is an unknown variable.
                    if sqlx::query("SET SESSION max_statement_time = 5")
                        .execute(&mut *conn)
                        .await
                        .is_err()
                    {
                        let _ = sqlx::query("SET SESSION max_execution_time = 5000")
                            .execute(&mut *conn)
                            .await;
                    }
                    Ok(())
                })
            })
            .connect_lazy_with(options);
        Ok(MysqlPoller {
            pool,
            sql: std::sync::Arc::new(Queries::new(&settings.tables)),
            processed_table: settings.tables.processed_messages.table.clone(),
        })
    }

    fn query(&self, name: &'static str, sql: &str, binds: Vec<BindValue>) -> DashboardQuery {
        DashboardQuery {
            name,
            sql: sql.to_string(),
            binds,
        }
    }

    fn inserts_query(&self, since: DateTime<Utc>) -> DashboardQuery {
        self.query(
            "inserts_last_minute",
            &self.sql.inserts_since,
            vec![BindValue::Time(since)],
        )
    }

    fn estimate_query(&self) -> DashboardQuery {
        self.query(
            "total_rows_estimate",
            &self.sql.estimate,
            vec![BindValue::Text(self.processed_table.clone())],
        )
    }

    fn capped_count_query(&self) -> DashboardQuery {
        self.query(
            "total_rows_capped_count",
            &self.sql.capped_count,
            vec![BindValue::Int(COUNT_CAP + 1)],
        )
    }

    fn oldest_query(&self) -> DashboardQuery {
        self.query("oldest_row", &self.sql.oldest, vec![])
    }

    fn in_doubt_queries(&self, cutoff: DateTime<Utc>) -> [DashboardQuery; 2] {
        [
            self.query(
                "claims_in_doubt_count",
                &self.sql.in_doubt_count,
                vec![BindValue::Time(cutoff)],
            ),
            self.query(
                "claims_in_doubt_list",
                &self.sql.in_doubt_list,
                vec![BindValue::Time(cutoff), BindValue::Int(LIST_LIMIT)],
            ),
        ]
    }

    /// InnoDB's estimate of the dedup table; None when the table is unknown there.
    async fn estimate(&self) -> Result<Option<i64>, sqlx::Error> {
        let row = bind(&self.estimate_query())
            .fetch_optional(&self.pool)
            .await?;
        Ok(row
            .map(|r| r.try_get::<Option<i64>, _>(0))
            .transpose()?
            .flatten())
    }
}

/// Bind a query's values in order (a list binds one placeholder per element).
fn bind(query: &DashboardQuery) -> Query<'_, MySql, MySqlArguments> {
    let mut out = sqlx::query(&query.sql);
    for value in &query.binds {
        out = match value {
            BindValue::Time(t) => out.bind(t.naive_utc()),
            BindValue::Int(i) => out.bind(*i),
            BindValue::Text(s) => out.bind(s.as_str()),
            BindValue::TextList(list) => {
                for s in list {
                    out = out.bind(s.as_str());
                }
                out
            }
        };
    }
    out
}

fn utc(t: Option<NaiveDateTime>) -> Option<DateTime<Utc>> {
    t.map(|t| t.and_utc())
}

#[async_trait]
impl DashboardSql for MysqlPoller {
    fn backend_name(&self) -> &'static str {
        "mysql"
    }

    async fn ping(&self) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map(|_| ())
    }

    async fn inserts_since(
        &self,
        since: DateTime<Utc>,
    ) -> Result<Vec<ConsumerInserts>, sqlx::Error> {
        let rows = bind(&self.inserts_query(since))
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
        let estimate = self.estimate().await?;
        if let Some(rows) = estimate.filter(|n| *n > COUNT_CAP) {
            return Ok(RowEstimate {
                rows,
                method: CountMethod::Statistics,
            });
        }
        let counted: i64 = bind(&self.capped_count_query())
            .fetch_one(&self.pool)
            .await?
            .try_get(0)?;
        Ok(if counted <= COUNT_CAP {
            RowEstimate {
                rows: counted,
                method: CountMethod::Exact,
            }
        } else {
            RowEstimate {
                rows: COUNT_CAP,
                method: CountMethod::AtLeast,
            }
        })
    }

    async fn oldest_processed_at(&self) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
        let oldest: Option<NaiveDateTime> = bind(&self.oldest_query())
            .fetch_one(&self.pool)
            .await?
            .try_get(0)?;
        Ok(utc(oldest))
    }

    async fn claims_in_doubt(
        &self,
        cutoff: DateTime<Utc>,
    ) -> Result<(i64, Vec<(String, String, Option<DateTime<Utc>>, i64)>), sqlx::Error> {
        let [count, list] = self.in_doubt_queries(cutoff);
        let total: i64 = bind(&count).fetch_one(&self.pool).await?.try_get(0)?;
        let rows = bind(&list).fetch_all(&self.pool).await?;
        let list = rows
            .iter()
            .map(|r| {
                Ok((
                    r.try_get(0)?,
                    r.try_get(1)?,
                    utc(r.try_get(2)?),
                    r.try_get(3)?,
                ))
            })
            .collect::<Result<_, sqlx::Error>>()?;
        Ok((total, list))
    }

    async fn dead_letters(
        &self,
        since: DateTime<Utc>,
    ) -> Result<Vec<DeadLetterGroup>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.dead_letters)
            .bind(since.naive_utc())
            .bind(LIST_LIMIT)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(DeadLetterGroup {
                    consumer: r.try_get(0)?,
                    reason: r.try_get(1)?,
                    total: r.try_get(2)?,
                    last_hour: r.try_get(3)?,
                    newest_at: utc(r.try_get(4)?),
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
                    utc(r.try_get(3)?),
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
        row.map(|r: MySqlRow| {
            let r = &r;
            Ok(DeadLetterDetail {
                id: r.try_get(0)?,
                consumer: r.try_get(1)?,
                reason: r.try_get(2)?,
                received_at: utc(r.try_get(3)?).unwrap_or(DateTime::<Utc>::UNIX_EPOCH),
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
            // A marker without a time cannot be placed on a chart.
            if let Some(at) = utc(r.try_get(1)?) {
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
                    started_at: utc(r.try_get(3)?),
                    finished_at: utc(r.try_get(4)?),
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
            .bind(since.naive_utc())
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(history_event).collect()
    }

    async fn late_since(&self, since: DateTime<Utc>) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(&self.sql.late_count)
            .bind(since.naive_utc())
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

    /// In chunks, so the IN list stays a reasonable statement.
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

    async fn dashboard_queries(
        &self,
        settings: &DatabaseConfig,
        now: DateTime<Utc>,
    ) -> Result<Vec<DashboardQuery>, DbError> {
        let mut out = vec![
            self.inserts_query(now - chrono::Duration::minutes(1)),
            self.estimate_query(),
        ];
        // The capped count runs only when InnoDB's estimate says the table is small.
        if self.estimate().await?.is_none_or(|n| n <= COUNT_CAP) {
            out.push(self.capped_count_query());
        }
        out.push(self.oldest_query());
        let cutoff = now - chrono::Duration::from_std(settings.claim_lease).unwrap_or_default();
        out.extend(self.in_doubt_queries(cutoff));
        Ok(out)
    }

    /// `EXPLAIN FORMAT=JSON`; the plan is not executed (`analyze` is ignored).
    async fn explain(
        &self,
        query: &DashboardQuery,
        _analyze: bool,
    ) -> Result<PlanSummary, DbError> {
        let explained = DashboardQuery {
            sql: format!("EXPLAIN FORMAT=JSON {}", query.sql),
            ..query.clone()
        };
        let row = bind(&explained).fetch_one(&self.pool).await?;
        let raw: String = row.try_get(0)?;
        let plan = serde_json::from_str(&raw).unwrap_or(serde_json::Value::String(raw));
        Ok(summarize_mysql(plan))
    }

    async fn run(&self, query: &DashboardQuery) -> Result<(), DbError> {
        bind(query).fetch_all(&self.pool).await?;
        Ok(())
    }
}

fn history_event(r: &MySqlRow) -> Result<HistoryEvent, sqlx::Error> {
    Ok(HistoryEvent {
        device_id: r.try_get(0)?,
        seq: r.try_get(1)?,
        event_type: r.try_get(2)?,
        occurred_at: utc(r.try_get(3)?),
        received_at: utc(r.try_get(4)?).unwrap_or(DateTime::<Utc>::UNIX_EPOCH),
        applied: r.try_get::<i64, _>(5)? != 0,
    })
}

fn state_row(r: &MySqlRow) -> Result<StateRow, sqlx::Error> {
    Ok(StateRow {
        device_id: r.try_get(0)?,
        last_seq: r.try_get(1)?,
        last_event_type: r.try_get(2)?,
        ignition: r.try_get(3)?,
        occurred_at: utc(r.try_get(4)?),
        updated_at: utc(r.try_get(5)?),
    })
}
