//! The dashboard's queries, written once for every backend over the dialect layer
//! ([`idemwatch_engine::store::dialect`]): the backend quotes and casts the mapped
//! identifiers, binds the values and reads the columns; the SQL is the same.
//!
//! Table and column names come from the config mapping; they were validated as plain
//! identifiers (`[A-Za-z_][A-Za-z0-9_]*`) and are quoted as well, so a column named
//! like a keyword (`order`) works too. Values are always bound. Time columns are
//! compared as they are (so their indexes serve) and read through the backend's cast
//! (so a `timestamp` column of a user's table reads too).
//!
//! Cheap on a 40-million-row dedup table (measured in `docs/SCALE.md` with
//! `idemwatch bench dashboard-queries`):
//! - total rows: the catalog's estimate ([`Catalog`]); only a table it says is smaller
//!   than [`COUNT_CAP`] is counted, and that count is capped (`COUNT(*)` over a
//!   `LIMIT`ed subquery). SQLite counts first (its `processed_messages` is `WITHOUT
//!   ROWID`: no `MAX(rowid)` shortcut) and asks `sqlite_stat1` above the cap.
//! - per-consumer rows of the last minute: a range scan of the `processed_at` index.
//! - the oldest row: `MIN(processed_at)`, answered from the index (MySQL: "Select
//!   tables optimized away"; its `ORDER BY … LIMIT 1` shows as access type `index`,
//!   which the plan check treats as a full scan); PostgreSQL: `ORDER BY … LIMIT 1`,
//!   the first entry of that index.
//! - claims in doubt: the partial index `side_effect_claims_open … WHERE state =
//!   'claimed'` (PostgreSQL), a range on `(state, claimed_at)` elsewhere.

use chrono::{DateTime, Utc};

use super::*;
use crate::config::TableMapping;
use crate::markers::MarkerSource;
use idemwatch_engine::store::dialect::{binds, each, first, Catalog, Kind, Row, Sql};
use idemwatch_engine::store::Backend;

use Kind::{Bool, Bytes, Int, Text, Time};

/// The SQL text of every query, built once from the mapping in the backend's form.
#[derive(Debug)]
struct Queries {
    inserts_since: String,
    capped_count: String,
    oldest: String,
    in_doubt_count: String,
    in_doubt_list: String,
    dead_letters: String,
    recent_dead_letters: String,
    dead_letters_between: String,
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

const HISTORY: [Kind; 6] = [Text, Int, Text, Time, Time, Bool];
const STATE: [Kind; 6] = [Text, Int, Text, Text, Time, Time];
const DEAD_LETTER: [Kind; 7] = [Int, Text, Text, Time, Text, Int, Bytes];
const DEAD_LETTER_WHOLE: [Kind; 6] = [Int, Text, Text, Time, Text, Bytes];

impl Queries {
    fn new(sql: &dyn Sql, t: &TableMapping) -> Queries {
        let q = |id: &str| sql.quote(id);
        let cast = |id: &str, kind| sql.cast(id, kind);
        let columns = |list: &[(&str, Kind)]| {
            let cols: Vec<String> = list.iter().map(|(c, k)| cast(c, *k)).collect();
            cols.join(", ")
        };
        let (pm, c, dl, m, d, h, s) = (
            &t.processed_messages,
            &t.side_effect_claims,
            &t.dead_letters,
            &t.markers,
            &t.drill_runs,
            &t.vehicle_history,
            &t.vehicle_state,
        );
        let history_columns = columns(&[
            (&h.device_id, Text),
            (&h.seq, Int),
            (&h.event_type, Text),
            (&h.occurred_at, Time),
            (&h.received_at, Time),
            (&h.applied, Bool),
        ]);
        let state_select = format!(
            "SELECT {} FROM {}",
            columns(&[
                (&s.device_id, Text),
                (&s.last_seq, Int),
                (&s.last_event_type, Text),
                (&s.ignition, Text),
                (&s.occurred_at, Time),
                (&s.updated_at, Time),
            ]),
            q(&s.table)
        );
        // Each quoted identifier the statements below name more than once.
        let (pt, pat) = (q(&pm.table), q(&pm.processed_at));
        let (ct, cat) = (q(&c.table), q(&c.claimed_at));
        let (dlt, dli, raw) = (q(&dl.table), q(&dl.id), q(&dl.raw));
        let (ht, hd, hs, hat) = (q(&h.table), q(&h.device_id), q(&h.seq), q(&h.received_at));
        let backend = sql.backend();
        let oldest = if backend == Backend::Postgres {
            let at = cast(&pm.processed_at, Time);
            format!("SELECT {at} FROM {pt} WHERE {pat} IS NOT NULL ORDER BY {pat} LIMIT 1")
        } else {
            format!("SELECT MIN({pat}) FROM {pt}")
        };
        // A dead letter as the lists and the detail read it (its raw bytes apart).
        let dead_letter_columns = columns(&[
            (&dl.id, Int),
            (&dl.consumer, Text),
            (&dl.reason, Text),
            (&dl.received_at, Time),
            (&dl.detail, Text),
        ]);
        let in_doubt_where = format!("{} = 'claimed' AND {cat} <= ?", q(&c.state));
        let (raw_length, raw_prefix) = match backend {
            Backend::Postgres => (
                "octet_length({})::bigint",
                "substring({} from 1 for ?::int)",
            ),
            Backend::Mysql => ("CAST(LENGTH({}) AS SIGNED)", "SUBSTRING({}, 1, ?)"),
            Backend::Sqlite => ("length({})", "substr({}, 1, ?)"),
        };
        // `NOT applied` matches PostgreSQL's partial index vehicle_history_late;
        // `applied = 0` leads MySQL's (applied, received_at) index.
        let not_applied = if backend == Backend::Postgres {
            format!("NOT {}", q(&h.applied))
        } else {
            format!("{} = 0", q(&h.applied))
        };
        let n = |generic: String| sql.native(&generic);
        // The newest rows of a small table, by one column.
        let newest = |list: &[(&str, Kind)], table: &str, by: &str| {
            let (cols, table, by) = (columns(list), q(table), q(by));
            n(format!(
                "SELECT {cols} FROM {table} ORDER BY {by} DESC LIMIT ?"
            ))
        };
        let queries = Queries {
            inserts_since: n(format!(
                "SELECT {}, COUNT(*) FROM {pt} WHERE {pat} >= ? GROUP BY {c} ORDER BY {c}",
                cast(&pm.consumer, Text),
                c = q(&pm.consumer)
            )),
            capped_count: n(format!("SELECT COUNT(*) FROM (SELECT 1 FROM {pt} LIMIT ?) capped")),
            oldest: n(oldest),
            in_doubt_count: n(format!("SELECT COUNT(*) FROM {ct} WHERE {in_doubt_where}")),
            in_doubt_list: n(format!(
                "SELECT {} FROM {ct} WHERE {in_doubt_where} ORDER BY {cat} LIMIT ?",
                columns(&[
                    (&c.consumer, Text),
                    (&c.message_key, Text),
                    (&c.claimed_at, Time),
                    (&c.attempts, Int)
                ])
            )),
            dead_letters: n(format!(
                "SELECT {}, {}, COUNT(*), COUNT(CASE WHEN {at} >= ? THEN 1 END), MAX({at}), MAX({id})
                 FROM {dlt} GROUP BY {c}, {r} ORDER BY COUNT(*) DESC, {c}, {r} LIMIT ?",
                cast(&dl.consumer, Text),
                cast(&dl.reason, Text),
                id = cast(&dl.id, Int),
                c = q(&dl.consumer),
                r = q(&dl.reason),
                at = q(&dl.received_at)
            )),
            recent_dead_letters: n(format!(
                "SELECT {dead_letter_columns}, {}, {} FROM {dlt} ORDER BY {dli} DESC LIMIT ?",
                raw_length.replace("{}", &raw),
                raw_prefix.replace("{}", &raw)
            )),
            dead_letters_between: n(format!(
                "SELECT {} FROM {dlt} WHERE {at} >= ? AND {at} <= ? ORDER BY {at} LIMIT ?",
                columns(&[
                    (&dl.consumer, Text),
                    (&dl.reason, Text),
                    (&dl.received_at, Time)
                ]),
                at = q(&dl.received_at)
            )),
            dead_letter: n(format!(
                "SELECT {dead_letter_columns}, {raw} FROM {dlt} WHERE {dli} = ?"
            )),
            markers: newest(
                &[
                    (&m.kind, Text),
                    (&m.at, Time),
                    (&m.label, Text),
                    (&m.detail, Text),
                ],
                &m.table,
                &m.at,
            ),
            drill_runs: newest(
                &[
                    (&d.id, Int),
                    (&d.scenario, Text),
                    (&d.mode, Text),
                    (&d.started_at, Time),
                    (&d.finished_at, Time),
                    (&d.verdict, Text),
                ],
                &d.table,
                &d.id,
            ),
            history_window: n(format!(
                "SELECT {history_columns} FROM {ht} WHERE {hat} >= ? ORDER BY {hat} DESC LIMIT ?"
            )),
            late_count: n(format!("SELECT COUNT(*) FROM {ht} WHERE {not_applied} AND {hat} >= ?")),
            device_seqs: n(format!(
                "SELECT DISTINCT {} FROM {ht} WHERE {hd} = ? AND {hs} BETWEEN ? AND ?",
                cast(&h.seq, Int)
            )),
            history_of_device: n(format!(
                "SELECT {} FROM {ht} WHERE {hd} = ? ORDER BY {hat} DESC, {hs} DESC LIMIT ?",
                history_columns
            )),
            state_of_device: n(format!("{state_select} WHERE {} = ?", q(&s.device_id))),
            state_select: format!("{state_select} WHERE "),
        };
        queries
    }
}

/// The dashboard's questions to one database, the same on every backend.
pub(super) struct Dashboard {
    sql: Box<dyn Sql>,
    queries: Queries,
    /// The dedup table as the catalog's estimate names it.
    estimate_name: String,
    device_id: String,
}

impl Dashboard {
    pub(super) fn new(sql: Box<dyn Sql>, tables: &TableMapping) -> Dashboard {
        let queries = Queries::new(sql.as_ref(), tables);
        Dashboard {
            estimate_name: (sql.catalog().estimate_name)(&tables.processed_messages.table),
            device_id: sql.quote(&tables.vehicle_state.device_id),
            queries,
            sql,
        }
    }

    fn catalog(&self) -> &'static Catalog {
        self.sql.catalog()
    }

    fn backend_name(&self) -> &'static str {
        match self.sql.backend() {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
            Backend::Mysql => "mysql",
        }
    }

    async fn count(&self, query: &str, binds: &[BindValue]) -> SqlResult<i64> {
        first(self.sql.as_ref(), query, binds, &[Int])
            .await?
            .ok_or(sqlx::Error::RowNotFound)?
            .int(0)
    }

    pub(super) async fn ping(&self) -> SqlResult<()> {
        self.sql.rows("SELECT 1", &[], &[]).await.map(|_| ())
    }

    fn query(&self, name: &'static str, sql: &str, binds: Vec<BindValue>) -> DashboardQuery {
        DashboardQuery {
            name,
            sql: sql.to_string(),
            binds,
        }
    }

    fn inserts_query(&self, since: DateTime<Utc>) -> DashboardQuery {
        let sql = &self.queries.inserts_since;
        self.query("inserts_last_minute", sql, binds![since].into())
    }

    fn estimate_query(&self) -> DashboardQuery {
        let generic = self.catalog().estimate_sql;
        let name = BindValue::Text(self.estimate_name.clone());
        let binds = vec![name; generic.matches('?').count()];
        self.query("total_rows_estimate", &self.sql.native(generic), binds)
    }

    fn capped_count_query(&self) -> DashboardQuery {
        let sql = &self.queries.capped_count;
        self.query("total_rows_capped_count", sql, binds![COUNT_CAP + 1].into())
    }

    fn oldest_query(&self) -> DashboardQuery {
        self.query("oldest_row", &self.queries.oldest, vec![])
    }

    fn in_doubt_queries(&self, cutoff: DateTime<Utc>) -> [DashboardQuery; 2] {
        let (count, list) = (&self.queries.in_doubt_count, &self.queries.in_doubt_list);
        [
            self.query("claims_in_doubt_count", count, binds![cutoff].into()),
            self.query(
                "claims_in_doubt_list",
                list,
                binds![cutoff, LIST_LIMIT].into(),
            ),
        ]
    }

    /// The catalog's estimate of the dedup table; None when it does not know (a
    /// SQLite database never `ANALYZE`d has no `sqlite_stat1`: not a failure).
    async fn estimate(&self) -> SqlResult<Option<i64>> {
        let q = self.estimate_query();
        let kinds = self.catalog().estimate_kinds;
        let rows = match self.sql.rows(&q.sql, &q.binds, kinds).await {
            Err(_) if self.catalog().count_first => return Ok(None),
            rows => rows?,
        };
        Ok(rows.first().and_then(self.catalog().read_estimate))
    }

    /// Dedup rows per consumer with `processed_at >= since`, by consumer.
    pub(super) async fn inserts_since(
        &self,
        since: DateTime<Utc>,
    ) -> SqlResult<Vec<ConsumerInserts>> {
        let q = self.inserts_query(since);
        each(&*self.sql, &q.sql, &q.binds, &[Text, Int], |r| {
            Ok(ConsumerInserts {
                consumer: r.text(0)?,
                last_minute: r.int(1)?,
            })
        })
        .await
    }

    /// The catalog's estimate when it is above [`COUNT_CAP`], else a capped count.
    pub(super) async fn total_rows(&self) -> SqlResult<RowEstimate> {
        let statistics = |rows| RowEstimate {
            rows,
            method: CountMethod::Statistics,
        };
        let count_first = self.catalog().count_first;
        if !count_first {
            if let Some(rows) = self.estimate().await?.filter(|n| *n > COUNT_CAP) {
                return Ok(statistics(rows));
            }
        }
        let q = self.capped_count_query();
        let counted = self.count(&q.sql, &q.binds).await?;
        if counted <= COUNT_CAP {
            return Ok(RowEstimate {
                rows: counted,
                method: CountMethod::Exact,
            });
        }
        if count_first {
            if let Some(rows) = self.estimate().await?.filter(|n| *n > COUNT_CAP) {
                return Ok(statistics(rows));
            }
        }
        Ok(RowEstimate {
            rows: COUNT_CAP,
            method: CountMethod::AtLeast,
        })
    }

    pub(super) async fn oldest_processed_at(&self) -> SqlResult<Option<DateTime<Utc>>> {
        let row = first(self.sql.as_ref(), &self.queries.oldest, &[], &[Time]).await?;
        Ok(row.and_then(|r| r.time(0)))
    }

    /// Claims still `claimed` and claimed at or before `cutoff`: the count, and the
    /// oldest [`LIST_LIMIT`] as `(consumer, key, claimed_at, attempts)`.
    pub(super) async fn claims_in_doubt(
        &self,
        cutoff: DateTime<Utc>,
    ) -> SqlResult<(i64, Vec<(String, String, Option<DateTime<Utc>>, i64)>)> {
        let [count, list] = self.in_doubt_queries(cutoff);
        let total = self.count(&count.sql, &count.binds).await?;
        let read = |r: &Row| Ok((r.text(0)?, r.text(1)?, r.time(2), r.int(3)?));
        let kinds = [Text, Text, Time, Int];
        let list: SqlResult<_> = each(&*self.sql, &list.sql, &list.binds, &kinds, read).await;
        Ok((total, list?))
    }

    /// Dead letters by consumer and reason, with those received since `since`. A
    /// full scan of `dead_letters`, which stays small (a large one is the alarm).
    pub(super) async fn dead_letters(
        &self,
        since: DateTime<Utc>,
    ) -> SqlResult<Vec<DeadLetterGroup>> {
        let (binds, kinds) = (binds![since, LIST_LIMIT], [Text, Text, Int, Int, Time, Int]);
        let q = &self.queries.dead_letters;
        each(&*self.sql, q, &binds, &kinds, |r| {
            Ok(DeadLetterGroup {
                consumer: r.text(0)?,
                reason: r.text(1)?,
                total: r.int(2)?,
                last_hour: r.opt_int(3).unwrap_or(0),
                newest_at: r.time(4),
                newest_id: r.opt_int(5),
            })
        })
        .await
    }

    /// The newest [`LIST_LIMIT`] dead letters with the first [`DEAD_LETTER_PREFIX`]
    /// bytes of each.
    pub(super) async fn recent_dead_letters(&self) -> SqlResult<Vec<DeadLetterRow>> {
        let binds = binds![DEAD_LETTER_PREFIX, LIST_LIMIT];
        let q = &self.queries.recent_dead_letters;
        each(&*self.sql, q, &binds, &DEAD_LETTER, |r| {
            Ok(dead_letter_row((
                r.int(0)?,
                r.text(1)?,
                r.text(2)?,
                r.time(3),
                r.opt_text(4),
                r.opt_int(5).unwrap_or(0),
                r.opt_bytes(6).unwrap_or_default(),
            )))
        })
        .await
    }

    /// When each dead letter of `from..=to` arrived, by consumer and reason, oldest
    /// first, at most `limit` (a range of the `received_at` index).
    pub(super) async fn dead_letters_between(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        limit: i64,
    ) -> SqlResult<Vec<DeadLetterArrival>> {
        let binds = binds![from, to, limit];
        let q = &self.queries.dead_letters_between;
        let rows = self.sql.rows(q, &binds, &[Text, Text, Time]);
        Ok(rows
            .await?
            .iter()
            .filter_map(|r| {
                Some(DeadLetterArrival {
                    consumer: r.text(0).ok()?,
                    reason: r.text(1).ok()?,
                    received_at: r.time(2)?,
                })
            })
            .collect())
    }

    /// One dead letter with all its bytes.
    pub(super) async fn dead_letter(&self, id: i64) -> SqlResult<Option<DeadLetterDetail>> {
        let (sql, kinds) = (&self.queries.dead_letter, &DEAD_LETTER_WHOLE);
        first(self.sql.as_ref(), sql, &binds![id], kinds)
            .await?
            .map(|r| {
                Ok(DeadLetterDetail {
                    id: r.int(0)?,
                    consumer: r.text(1)?,
                    reason: r.text(2)?,
                    received_at: r.at(3),
                    detail: r.opt_text(4),
                    raw: r.opt_bytes(5).unwrap_or_default(),
                })
            })
            .transpose()
    }

    /// idemwatch's own `duplicate_ages` (not in the table mapping: a watched database
    /// that is not idemwatch's has none, and the caller takes the error as "unknown").
    /// One row per consumer.
    pub(super) async fn duplicate_ages(
        &self,
    ) -> SqlResult<std::collections::BTreeMap<String, f64>> {
        let select = "SELECT consumer, max_age_seconds FROM duplicate_ages";
        let rows = each(&*self.sql, select, &[], &[Text, Kind::Float], |r| {
            Ok::<_, sqlx::Error>((r.text(0)?, r.opt_float(1).unwrap_or(0.0)))
        });
        Ok(rows.await?.into_iter().collect())
    }

    pub(super) async fn markers(&self) -> SqlResult<Vec<TimelineMarker>> {
        let (binds, kinds) = (binds![LIST_LIMIT], [Text, Time, Text, Text]);
        let rows = self.sql.rows(&self.queries.markers, &binds, &kinds);
        let mut out = Vec::new();
        for r in rows.await? {
            // A marker whose time cannot be read cannot be placed on a chart.
            if let Some(at) = r.time(1) {
                out.push(TimelineMarker {
                    at,
                    kind: r.text(0)?,
                    label: r.text(2)?,
                    detail: r.opt_text(3),
                    source: MarkerSource::Database,
                });
            }
        }
        Ok(out)
    }

    pub(super) async fn drill_runs(&self) -> SqlResult<Vec<DrillRunSummary>> {
        let kinds = [Int, Text, Text, Time, Time, Text];
        let q = &self.queries.drill_runs;
        each(&*self.sql, q, &binds![LIST_LIMIT], &kinds, |r| {
            Ok(DrillRunSummary {
                id: r.int(0)?,
                scenario: r.text(1)?,
                mode: r.text(2)?,
                started_at: r.time(3),
                finished_at: r.time(4),
                verdict: r.opt_text(5),
            })
        })
        .await
    }

    /// The newest history rows received since `since`, at most `limit`.
    pub(super) async fn history_since(
        &self,
        since: DateTime<Utc>,
        limit: i64,
    ) -> SqlResult<Vec<HistoryEvent>> {
        let binds = binds![since, limit];
        let q = &self.queries.history_window;
        each(&*self.sql, q, &binds, &HISTORY, history_event).await
    }

    /// History rows received since `since` and not applied (late).
    pub(super) async fn late_since(&self, since: DateTime<Utc>) -> SqlResult<i64> {
        self.count(&self.queries.late_count, &binds![since]).await
    }

    /// The distinct seqs of one device in `lo..=hi`.
    pub(super) async fn device_seqs(
        &self,
        device_id: &str,
        lo: i64,
        hi: i64,
    ) -> SqlResult<Vec<i64>> {
        let binds = binds![device_id, lo, hi];
        let q = &self.queries.device_seqs;
        each(&*self.sql, q, &binds, &[Int], |r| r.int(0)).await
    }

    /// State rows of these devices, in chunks that stay under SQLite's bind limit
    /// (and keep an IN list a reasonable statement).
    pub(super) async fn states_of(&self, devices: &[&str]) -> SqlResult<Vec<StateRow>> {
        let mut out = Vec::new();
        for chunk in devices.chunks(500) {
            let list = self.sql.in_list(&self.device_id, chunk.len());
            let sql = self
                .sql
                .native(&format!("{}{list}", self.queries.state_select));
            let devices = chunk.iter().map(|d| d.to_string()).collect();
            let binds = [BindValue::TextList(devices)];
            out.extend(each(&*self.sql, &sql, &binds, &STATE, state_row).await?);
        }
        Ok(out)
    }

    pub(super) async fn state_of(&self, device_id: &str) -> SqlResult<Option<StateRow>> {
        let sql = &self.queries.state_of_device;
        let row = first(self.sql.as_ref(), sql, &binds![device_id], &STATE).await?;
        row.map(|r| state_row(&r)).transpose()
    }

    /// One device's newest `limit` history rows.
    pub(super) async fn history_of(
        &self,
        device_id: &str,
        limit: i64,
    ) -> SqlResult<Vec<HistoryEvent>> {
        let binds = binds![device_id, limit];
        let q = &self.queries.history_of_device;
        each(&*self.sql, q, &binds, &HISTORY, history_event).await
    }

    /// The dedup and claims queries a poll at `now` runs, with their bound values.
    pub(super) async fn dashboard_queries(
        &self,
        settings: &DatabaseConfig,
        now: DateTime<Utc>,
    ) -> Result<Vec<DashboardQuery>, DbError> {
        if (self.catalog().explain)("", false).is_none() {
            let what = "EXPLAIN of the dashboard queries";
            return Err(DbError::NotOnBackend(what, self.backend_name()));
        }
        let mut out = vec![
            self.inserts_query(now - chrono::Duration::minutes(1)),
            self.estimate_query(),
        ];
        // The capped count runs only when the catalog says the table is small.
        if self.estimate().await?.is_none_or(|n| n <= COUNT_CAP) {
            out.push(self.capped_count_query());
        }
        out.push(self.oldest_query());
        let cutoff = now - chrono::Duration::from_std(settings.claim_lease).unwrap_or_default();
        out.extend(self.in_doubt_queries(cutoff));
        Ok(out)
    }

    /// One dashboard query under `EXPLAIN`: the plan's node types, the tables read
    /// whole, the raw plan.
    pub(super) async fn explain(
        &self,
        query: &DashboardQuery,
        analyze: bool,
    ) -> Result<explain::PlanSummary, DbError> {
        let backend = self.backend_name();
        let sql = (self.catalog().explain)(&query.sql, analyze)
            .ok_or(DbError::NotOnBackend("EXPLAIN", backend))?;
        let row = first(self.sql.as_ref(), &sql, &query.binds, &[Kind::Json]).await?;
        let plan = row.and_then(|r| r.json(0)).unwrap_or_default();
        Ok(match self.sql.backend() {
            Backend::Mysql => explain::summarize_mysql(plan),
            _ => explain::summarize_postgres(plan),
        })
    }

    /// One dashboard query run as the poll runs it, rows discarded.
    pub(super) async fn run(&self, query: &DashboardQuery) -> Result<(), DbError> {
        if (self.catalog().explain)("", false).is_none() {
            let what = "running a named dashboard query";
            return Err(DbError::NotOnBackend(what, self.backend_name()));
        }
        self.sql.rows(&query.sql, &query.binds, &[]).await?;
        Ok(())
    }
}

type SqlResult<T> = Result<T, sqlx::Error>;

fn history_event(r: &Row) -> SqlResult<HistoryEvent> {
    Ok(HistoryEvent {
        device_id: r.text(0)?,
        seq: r.int(1)?,
        event_type: r.text(2)?,
        occurred_at: r.time(3),
        received_at: r.at(4),
        applied: r.bool(5)?,
    })
}

fn state_row(r: &Row) -> SqlResult<StateRow> {
    Ok(StateRow {
        device_id: r.text(0)?,
        last_seq: r.int(1)?,
        last_event_type: r.text(2)?,
        ignition: r.opt_text(3),
        occurred_at: r.time(4),
        updated_at: r.time(5),
    })
}
