//! PostgreSQL: what differs from the other backends.

use std::borrow::Cow;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgArguments, PgQueryResult, PgRow};
use sqlx::query::Query;
use sqlx::{Postgres, Row, TypeInfo, ValueRef};

use super::super::{Backend, Failure};
use crate::store::dialect::{BindValue, Catalog, Cell, Done, Kind};

/// By SQLSTATE (<https://www.postgresql.org/docs/current/errcodes-appendix.html>).
pub(crate) fn failure(sqlstate: &str) -> Failure {
    match sqlstate {
        // unique_violation: key writes go through ON CONFLICT, so this is a race lost
        // to another writer between two statements, decided by the retry.
        "23505" => Failure::Infrastructure,
        // serialization_failure, deadlock_detected, statement_completion_unknown;
        // read_only_sql_transaction (a standby after failover), idle-in-transaction
        // timeout; insufficient_privilege; the database does not exist (yet, again).
        "40001" | "40P01" | "40003" | "25006" | "25P03" | "42501" | "3D000" => {
            Failure::Infrastructure
        }
        // program_limit_exceeded: an index row over the btree maximum (a huge key).
        "54000" => Failure::Content,
        _ => match &sqlstate[..sqlstate.len().min(2)] {
            // data exception (value too long, invalid byte sequence, out of range…),
            // integrity constraint violation
            "22" | "23" => Failure::Content,
            // connection exception, invalid authorization, insufficient resources,
            // object not in prerequisite state (lock_not_available, a database not
            // accepting connections), operator intervention (statement timeout,
            // shutdown), system error (I/O)
            "08" | "28" | "53" | "55" | "57" | "58" => Failure::Infrastructure,
            _ => Failure::Other,
        },
    }
}

/// The server's own deadlines: `statement_timeout` (query_canceled, 57014 — also an
/// operator's cancel, an outage all the same), `lock_timeout` (lock_not_available),
/// `idle_in_transaction_session_timeout`.
pub(crate) fn timed_out(sqlstate: &str) -> bool {
    matches!(sqlstate, "57014" | "55P03" | "25P03")
}

impl crate::store::dialect::Dialect for Postgres {
    const BACKEND: Backend = Backend::Postgres;
    const BEGIN: &'static str = "BEGIN";

    /// `$1`, `$2`… in order (the generic SQL has no `?` but its placeholders).
    fn placeholders(sql: &str) -> Cow<'_, str> {
        if !sql.contains('?') {
            return Cow::Borrowed(sql);
        }
        let mut out = String::with_capacity(sql.len() + 16);
        for (n, piece) in sql.split('?').enumerate() {
            if n > 0 {
                out.push('$');
                out.push_str(&n.to_string());
            }
            out.push_str(piece);
        }
        Cow::Owned(out)
    }

    /// A user's table may use other types (`varchar`, `timestamp`, `int`): read
    /// through a cast, compared as it is (so its indexes serve).
    fn cast(identifier: &str, kind: Kind) -> String {
        let cast = match kind {
            Kind::Int => "::bigint",
            Kind::Float => "::double precision",
            Kind::Text => "::text",
            Kind::Time => "::timestamptz",
            Kind::Bool => "::boolean",
            Kind::Bytes | Kind::Json => "",
        };
        format!("\"{identifier}\"{cast}")
    }

    fn bind<'q>(
        query: Query<'q, Postgres, PgArguments>,
        value: &'q BindValue,
    ) -> Query<'q, Postgres, PgArguments> {
        match value {
            BindValue::Time(t) => query.bind(*t),
            BindValue::Int(i) => query.bind(*i),
            BindValue::Text(s) => query.bind(s.as_str()),
            BindValue::TextList(list) => query.bind(list.as_slice()),
            BindValue::Float(f) => query.bind(*f),
            BindValue::Bytes(b) => query.bind(b.as_slice()),
            BindValue::Bool(b) => query.bind(*b),
            BindValue::Json(j) => query.bind(j),
            BindValue::Null(kind) => match kind {
                Kind::Int => query.bind(None::<i64>),
                Kind::Float => query.bind(None::<f64>),
                Kind::Text => query.bind(None::<String>),
                Kind::Bytes => query.bind(None::<Vec<u8>>),
                Kind::Time => query.bind(None::<DateTime<Utc>>),
                Kind::Bool => query.bind(None::<bool>),
                Kind::Json => query.bind(None::<serde_json::Value>),
            },
        }
    }

    fn cell(row: &PgRow, i: usize, kind: Kind) -> Result<Cell, sqlx::Error> {
        Ok(match kind {
            Kind::Int => match row.try_get_raw(i)?.type_info().name() {
                "INT2" => Cell::of(row.try_get::<Option<i16>, _>(i)?, |n| Cell::Int(n.into())),
                "INT4" => Cell::of(row.try_get::<Option<i32>, _>(i)?, |n| Cell::Int(n.into())),
                _ => Cell::of(row.try_get(i)?, Cell::Int),
            },
            Kind::Float => Cell::of(row.try_get(i)?, Cell::Float),
            Kind::Text => Cell::of(row.try_get(i)?, Cell::Text),
            Kind::Bytes => Cell::of(row.try_get(i)?, Cell::Bytes),
            Kind::Time => Cell::of(row.try_get(i)?, Cell::Time),
            Kind::Bool => Cell::of(row.try_get(i)?, Cell::Bool),
            Kind::Json => Cell::of(row.try_get(i)?, Cell::Json),
        })
    }

    /// The live-tuple count of the statistics (kept current by every commit), else
    /// `reltuples` (as of the last VACUUM/ANALYZE; -1: never), summed over the
    /// partitions when the table is partitioned (`pg_partition_tree` lists nothing
    /// for a plain table). The stats function, not the `pg_stat_user_tables` view,
    /// which joins and aggregates every index of the database.
    const CATALOG: Catalog = Catalog {
        estimate_sql: "SELECT COALESCE(sum(CASE WHEN pg_stat_get_live_tuples(c.oid) > 0
                                 THEN pg_stat_get_live_tuples(c.oid)
                                 ELSE greatest(c.reltuples, 0)::bigint END), 0)::bigint,
                        COALESCE(bool_and(pg_stat_get_live_tuples(c.oid) > 0 OR c.reltuples >= 0), false)
                 FROM pg_class c
                 WHERE c.relkind = 'r' AND c.oid = ANY (ARRAY(
                     SELECT to_regclass(?)::oid
                     UNION ALL SELECT relid FROM pg_partition_tree(to_regclass(?))))",
        estimate_kinds: &[Kind::Int, Kind::Bool],
        estimate_name: |table| format!("\"{table}\""),
        read_estimate: |row| row.bool(1).unwrap_or(false).then(|| row.opt_int(0)).flatten(),
        count_first: false,
        explain: |sql, analyze| {
            let options = if analyze {
                "ANALYZE, BUFFERS, FORMAT JSON"
            } else {
                "FORMAT JSON"
            };
            Some(format!("EXPLAIN ({options}) {sql}"))
        },
    };

    fn done(result: &PgQueryResult) -> Done {
        Done {
            rows_affected: result.rows_affected(),
            last_insert_id: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::dialect::tests::assert_classes;
    use crate::store::dialect::Dialect;

    #[test]
    fn sqlstates_are_infrastructure_content_or_neither() {
        use Failure::{Content, Infrastructure, Other};
        let table = [
            // unique_violation: a race lost between two statements.
            ("23505", Infrastructure),
            ("40001", Infrastructure),
            ("40P01", Infrastructure),
            ("25006", Infrastructure),
            ("3D000", Infrastructure),
            // program_limit_exceeded: a key over the btree maximum.
            ("54000", Content),
            // string_data_right_truncation, not_null_violation, check_violation.
            ("22001", Content),
            ("23502", Content),
            ("23514", Content),
            // connection_failure, invalid_password, too_many_connections,
            // lock_not_available, query_canceled, io_error.
            ("08006", Infrastructure),
            ("28P01", Infrastructure),
            ("53300", Infrastructure),
            ("55P03", Infrastructure),
            ("57014", Infrastructure),
            ("58030", Infrastructure),
            // undefined_table (a bug's SQL), syntax_error, a code too short to have a class.
            ("42P01", Other),
            ("42601", Other),
            ("2", Other),
        ];
        assert_classes(table, failure);
    }

    #[test]
    fn placeholders_are_numbered_in_order_and_a_statement_without_is_kept() {
        let sql = "UPDATE t SET a = ?, b = ? WHERE k = ?";
        assert_eq!(
            Postgres::placeholders(sql),
            "UPDATE t SET a = $1, b = $2 WHERE k = $3"
        );
        assert_eq!(Postgres::placeholders("?"), "$1");
        let plain = Postgres::placeholders("SELECT 1");
        assert!(matches!(plain, Cow::Borrowed("SELECT 1")), "{plain:?}");
    }
}
