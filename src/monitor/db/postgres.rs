//! The PostgreSQL queries of the database poller, cheap on a 40-million-row dedup
//! table (measured in `docs/SCALE.md` with `idemwatch bench dashboard-queries`):
//!
//! - total rows: the live-tuple count of the statistics (`pg_stat_user_tables.n_live_tup`,
//!   kept current by every commit),
//!   else `pg_class.reltuples` (as of the last VACUUM/ANALYZE), summed over the
//!   partitions when the table is partitioned. Only a table the catalog says is
//!   smaller than [`COUNT_CAP`] is counted, and that count is capped too.
//! - per-consumer rows of the last minute: a range scan of the `processed_at` index.
//! - the oldest row: `ORDER BY processed_at LIMIT 1`, the first entry of that index.
//! - claims in doubt: the partial index `side_effect_claims_open … WHERE state = 'claimed'`.
//!
//! Sessions run with `default_transaction_read_only = on` and a statement timeout,
//! so a role with SELECT grants is enough and a poll can never hold the database.
//! Identifiers come from the validated mapping and are double-quoted; values are
//! always bound. Time columns are compared as they are (so their indexes serve) and
//! read through `::timestamptz` (so a `timestamp` column of a user's table reads too).

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::{PgArguments, PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::query::Query;
use sqlx::{ConnectOptions, PgPool, Postgres, Row};

use super::explain::{summarize_postgres, PlanSummary};
use super::*;
use crate::config::TableMapping;
use crate::monitor::markers::MarkerSource;

/// A poll query that runs longer than this is cancelled by the server.
const STATEMENT_TIMEOUT_MS: u64 = 5_000;

fn q(identifier: &str) -> String {
    format!("\"{identifier}\"")
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
    states_of: String,
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
            "{}::text, {}::bigint, {}::text, {}::timestamptz, {}::timestamptz, {}::boolean",
            q(&h.device_id),
            q(&h.seq),
            q(&h.event_type),
            q(&h.occurred_at),
            q(&h.received_at),
            q(&h.applied)
        );
        let state_select = format!(
            "SELECT {}::text, {}::bigint, {}::text, {}::text, {}::timestamptz, {}::timestamptz FROM {}",
            q(&s.device_id),
            q(&s.last_seq),
            q(&s.last_event_type),
            q(&s.ignition),
            q(&s.occurred_at),
            q(&s.updated_at),
            q(&s.table)
        );
        let in_doubt_where = format!("{} = 'claimed' AND {} <= $1", q(&c.state), q(&c.claimed_at));
        Queries {
            inserts_since: format!(
                "SELECT {c}::text, count(*) FROM {t} WHERE {at} >= $1 GROUP BY {c} ORDER BY {c}",
                c = q(&pm.consumer),
                t = q(&pm.table),
                at = q(&pm.processed_at)
            ),
            // n_live_tup is maintained by every commit; reltuples only by VACUUM and
            // ANALYZE (-1: never). The leaves of pg_partition_tree are the partitions
            // when the table is partitioned (it lists nothing for a plain table).
            // The stats function, not the pg_stat_user_tables view, which joins and
            // aggregates every index of the database.
            estimate: "SELECT COALESCE(sum(CASE WHEN pg_stat_get_live_tuples(c.oid) > 0
                                 THEN pg_stat_get_live_tuples(c.oid)
                                 ELSE greatest(c.reltuples, 0)::bigint END), 0)::bigint,
                        COALESCE(bool_and(pg_stat_get_live_tuples(c.oid) > 0 OR c.reltuples >= 0), false)
                 FROM pg_class c
                 WHERE c.relkind = 'r' AND c.oid = ANY (ARRAY(
                     SELECT to_regclass($1)::oid
                     UNION ALL SELECT relid FROM pg_partition_tree(to_regclass($1))))"
                .into(),
            capped_count: format!(
                "SELECT count(*) FROM (SELECT 1 FROM {} LIMIT $1) capped",
                q(&pm.table)
            ),
            oldest: format!(
                "SELECT {at}::timestamptz FROM {t} WHERE {at} IS NOT NULL ORDER BY {at} LIMIT 1",
                at = q(&pm.processed_at),
                t = q(&pm.table)
            ),
            in_doubt_count: format!("SELECT count(*) FROM {} WHERE {in_doubt_where}", q(&c.table)),
            in_doubt_list: format!(
                "SELECT {}::text, {}::text, {}::timestamptz, {}::bigint FROM {} WHERE {in_doubt_where}
                 ORDER BY {} LIMIT $2",
                q(&c.consumer),
                q(&c.message_key),
                q(&c.claimed_at),
                q(&c.attempts),
                q(&c.table),
                q(&c.claimed_at)
            ),
            dead_letters: format!(
                "SELECT {c}::text, {r}::text, count(*), count(*) FILTER (WHERE {at} >= $1),
                        max({at})::timestamptz
                 FROM {t} GROUP BY {c}, {r} ORDER BY count(*) DESC, {c}, {r} LIMIT $2",
                c = q(&dl.consumer),
                r = q(&dl.reason),
                at = q(&dl.received_at),
                t = q(&dl.table)
            ),
            recent_dead_letters: format!(
                "SELECT {}::bigint, {}::text, {}::text, {}::timestamptz, {}::text, octet_length({})::bigint, substring({} from 1 for $1::int) FROM {} ORDER BY {} DESC LIMIT $2",
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
                "SELECT {}::bigint, {}::text, {}::text, {}::timestamptz, {}::text, {} FROM {} WHERE {} = $1",
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
                "SELECT {}::text, {}::timestamptz, {}::text, {}::text FROM {} ORDER BY {} DESC LIMIT $1",
                q(&m.kind),
                q(&m.at),
                q(&m.label),
                q(&m.detail),
                q(&m.table),
                q(&m.at)
            ),
            drill_runs: format!(
                "SELECT {}::bigint, {}::text, {}::text, {}::timestamptz, {}::timestamptz, {}::text
                 FROM {} ORDER BY {} DESC LIMIT $1",
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
                "SELECT {history_columns} FROM {} WHERE {} >= $1 ORDER BY {} DESC LIMIT $2",
                q(&h.table),
                q(&h.received_at),
                q(&h.received_at)
            ),
            // `NOT applied` matches the partial index vehicle_history_late.
            late_count: format!(
                "SELECT count(*) FROM {} WHERE NOT {} AND {} >= $1",
                q(&h.table),
                q(&h.applied),
                q(&h.received_at)
            ),
            device_seqs: format!(
                "SELECT DISTINCT {seq}::bigint FROM {} WHERE {} = $1 AND {seq} BETWEEN $2 AND $3",
                q(&h.table),
                q(&h.device_id),
                seq = q(&h.seq)
            ),
            history_of_device: format!(
                "SELECT {history_columns} FROM {} WHERE {} = $1 ORDER BY {} DESC, {} DESC LIMIT $2",
                q(&h.table),
                q(&h.device_id),
                q(&h.received_at),
                q(&h.seq)
            ),
            states_of: format!("{state_select} WHERE {} = ANY($1)", q(&s.device_id)),
            state_of_device: format!("{state_select} WHERE {} = $1", q(&s.device_id)),
        }
    }
}

/// The PostgreSQL side of [`DbPoller`].
#[derive(Debug, Clone)]
pub(super) struct PostgresPoller {
    pool: PgPool,
    sql: std::sync::Arc<Queries>,
    /// The dedup table as `to_regclass` reads it (quoted).
    processed_regclass: String,
}

impl PostgresPoller {
    pub(super) fn new(settings: &DatabaseConfig) -> Result<PostgresPoller, DbError> {
        let options: PgConnectOptions = settings.url.parse()?;
        let options = options
            .options([
                ("default_transaction_read_only", "on".to_string()),
                ("statement_timeout", STATEMENT_TIMEOUT_MS.to_string()),
            ])
            .application_name("idemwatch-dashboard")
            .log_statements(tracing::log::LevelFilter::Trace);
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(3))
            .connect_lazy_with(options);
        Ok(PostgresPoller {
            pool,
            sql: std::sync::Arc::new(Queries::new(&settings.tables)),
            processed_regclass: q(&settings.tables.processed_messages.table),
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
            vec![BindValue::Text(self.processed_regclass.clone())],
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

    /// The catalog's estimate of the dedup table: (rows, whether it is known).
    async fn estimate(&self) -> Result<(i64, bool), sqlx::Error> {
        let row = bind(&self.estimate_query()).fetch_one(&self.pool).await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }
}

/// Bind a query's values in order.
fn bind(query: &DashboardQuery) -> Query<'_, Postgres, PgArguments> {
    let mut out = sqlx::query(&query.sql);
    for value in &query.binds {
        out = match value {
            BindValue::Time(t) => out.bind(*t),
            BindValue::Int(i) => out.bind(*i),
            BindValue::Text(s) => out.bind(s.as_str()),
            BindValue::TextList(list) => out.bind(list.clone()),
        };
    }
    out
}

#[async_trait]
impl DashboardSql for PostgresPoller {
    fn backend_name(&self) -> &'static str {
        "postgres"
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
        let (estimate, known) = self.estimate().await?;
        if known && estimate > COUNT_CAP {
            return Ok(RowEstimate {
                rows: estimate,
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
        let row = bind(&self.oldest_query())
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| r.try_get(0)).transpose()?)
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
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?)))
            .collect::<Result<_, sqlx::Error>>()?;
        Ok((total, list))
    }

    async fn dead_letters(
        &self,
        since: DateTime<Utc>,
    ) -> Result<Vec<DeadLetterGroup>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.dead_letters)
            .bind(since)
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
                    newest_at: r.try_get(4)?,
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
                    r.try_get::<Option<DateTime<Utc>>, _>(3)?,
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
        row.map(|r: PgRow| {
            let r = &r;
            Ok(DeadLetterDetail {
                id: r.try_get(0)?,
                consumer: r.try_get(1)?,
                reason: r.try_get(2)?,
                received_at: r
                    .try_get::<Option<DateTime<Utc>>, _>(3)?
                    .unwrap_or(DateTime::<Utc>::UNIX_EPOCH),
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
            if let Some(at) = r.try_get::<Option<DateTime<Utc>>, _>(1)? {
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
                    started_at: r.try_get(3)?,
                    finished_at: r.try_get(4)?,
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
            .bind(since)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(history_event).collect()
    }

    async fn late_since(&self, since: DateTime<Utc>) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(&self.sql.late_count)
            .bind(since)
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

    async fn states_of(&self, devices: &[&str]) -> Result<Vec<StateRow>, sqlx::Error> {
        if devices.is_empty() {
            return Ok(Vec::new());
        }
        let devices: Vec<String> = devices.iter().map(|d| d.to_string()).collect();
        let rows = sqlx::query(&self.sql.states_of)
            .bind(devices)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(state_row).collect()
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
        // The capped count runs only when the catalog says the table is small.
        let (estimate, known) = self.estimate().await?;
        if !(known && estimate > COUNT_CAP) {
            out.push(self.capped_count_query());
        }
        out.push(self.oldest_query());
        let cutoff = now - chrono::Duration::from_std(settings.claim_lease).unwrap_or_default();
        out.extend(self.in_doubt_queries(cutoff));
        Ok(out)
    }

    async fn explain(&self, query: &DashboardQuery, analyze: bool) -> Result<PlanSummary, DbError> {
        let options = if analyze {
            "ANALYZE, BUFFERS, FORMAT JSON"
        } else {
            "FORMAT JSON"
        };
        let explained = DashboardQuery {
            sql: format!("EXPLAIN ({options}) {}", query.sql),
            ..query.clone()
        };
        let plan: serde_json::Value = bind(&explained).fetch_one(&self.pool).await?.try_get(0)?;
        Ok(summarize_postgres(plan))
    }

    async fn run(&self, query: &DashboardQuery) -> Result<(), DbError> {
        bind(query).fetch_all(&self.pool).await?;
        Ok(())
    }
}

fn history_event(r: &PgRow) -> Result<HistoryEvent, sqlx::Error> {
    Ok(HistoryEvent {
        device_id: r.try_get(0)?,
        seq: r.try_get(1)?,
        event_type: r.try_get(2)?,
        occurred_at: r.try_get(3)?,
        received_at: r
            .try_get::<Option<DateTime<Utc>>, _>(4)?
            .unwrap_or(DateTime::<Utc>::UNIX_EPOCH),
        applied: r.try_get(5)?,
    })
}

fn state_row(r: &PgRow) -> Result<StateRow, sqlx::Error> {
    Ok(StateRow {
        device_id: r.try_get(0)?,
        last_seq: r.try_get(1)?,
        last_event_type: r.try_get(2)?,
        ignition: r.try_get(3)?,
        occurred_at: r.try_get(4)?,
        updated_at: r.try_get(5)?,
    })
}
