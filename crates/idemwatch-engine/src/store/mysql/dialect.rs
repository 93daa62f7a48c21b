//! MySQL / MariaDB: what differs from the other backends.

use chrono::NaiveDateTime;
use sqlx::mysql::{MySqlArguments, MySqlQueryResult, MySqlRow};
use sqlx::query::Query;
use sqlx::{MySql, Row};

use super::super::{Backend, Failure};
use crate::store::dialect::{BindValue, Catalog, Cell, Done, Kind};

/// A `mysql://` or `mariadb://` URL as the driver's options (it knows only the
/// former).
pub(crate) fn options(url: &str) -> Result<sqlx::mysql::MySqlConnectOptions, sqlx::Error> {
    url.replacen("mariadb://", "mysql://", 1).parse()
}

/// Run first on every connection, the engine's and the dashboard's: DATETIME
/// columns hold UTC, written and read as such whatever the server's zone.
pub(crate) async fn utc_session(conn: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SET time_zone = '+00:00'")
        .execute(conn)
        .await
        .map(|_| ())
}

/// The engine's sessions (not the dashboard's): UTC as [`utc_session`], and the
/// statement deadline as the server's own limits — InnoDB's row-lock wait and the
/// metadata-lock wait, and on MariaDB `max_statement_time` and
/// `idle_transaction_timeout` (a session whose client went silent inside a
/// transaction is ended and its locks freed, instead of blocking the redelivery of
/// the same keys on a fresh connection). MySQL has neither of the last two: refused
/// there as unknown variables (1193), and skipped.
pub(crate) async fn engine_session(
    conn: &mut sqlx::MySqlConnection,
    deadlines: &crate::deadlines::Deadlines,
) -> Result<(), sqlx::Error> {
    use sqlx::Executor;
    let secs = deadlines.statement_secs();
    conn.execute(
        format!(
            "SET time_zone = '+00:00', innodb_lock_wait_timeout = {secs}, lock_wait_timeout = {secs}"
        )
        .as_str(),
    )
    .await?;
    let statement = deadlines.statement_timeout.as_secs_f64().max(0.001);
    let mariadb =
        format!("SET max_statement_time = {statement:.3}, idle_transaction_timeout = {secs}");
    match conn.execute(mariadb.as_str()).await {
        Err(sqlx::Error::Database(e))
            if e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                .is_some_and(|e| e.number() == 1193) =>
        {
            Ok(())
        }
        other => other.map(|_| ()),
    }
}

/// The server's own deadlines: InnoDB's lock wait (1205), MariaDB's
/// `max_statement_time` (1969), MySQL's `max_execution_time` (3024), a session
/// ended for inactivity (4031: MariaDB's `idle_transaction_timeout`).
pub(crate) fn timed_out(number: u16) -> bool {
    matches!(number, 1205 | 1969 | 3024 | 4031)
}

/// By error number, then SQLSTATE
/// (<https://dev.mysql.com/doc/mysql-errors/8.0/en/server-error-reference.html>,
/// <https://mariadb.com/kb/en/mariadb-error-code-reference/>).
pub(crate) fn failure(number: u16, sqlstate: Option<&str>) -> Failure {
    match number {
        // Duplicate entry: key writes go through INSERT IGNORE, so this is a race
        // lost to another writer, decided by the retry.
        1022 | 1062 | 1586 => Failure::Infrastructure,
        // Lock wait timeout, deadlock; too many connections, shutdown, connection
        // killed, query interrupted, statement time limits (MariaDB, MySQL);
        // read-only server or transaction; access or command denied, unknown
        // database; disk or table full, out of memory; network read/write errors,
        // commit/rollback failures, disconnected for inactivity; client-side
        // can't connect, server gone away, lost connection.
        1205
        | 1213
        | 1040
        | 1053
        | 1927
        | 1317
        | 1969
        | 3024
        | 1290
        | 1836
        | 1792
        | 1044
        | 1045
        | 1142
        | 1143
        | 1227
        | 1049
        | 1021
        | 1114
        | 1037
        | 1038
        | 1041
        | 1158..=1161
        | 1180
        | 1181
        | 4031
        | 2002
        | 2003
        | 2006
        | 2013 => Failure::Infrastructure,
        // Data too long, out of range, incorrect string value (invalid bytes), data
        // truncated, incorrect value, column cannot be null, foreign key, check
        // constraint (MySQL, MariaDB), invalid character string, illegal value,
        // value out of range in an expression, packet or row too large.
        1406 | 1264 | 1366 | 1265 | 1292 | 1048 | 1451 | 1452 | 3819 | 4025 | 1300 | 1367
        | 1411 | 1690 | 1153 | 1118 => Failure::Content,
        _ => match sqlstate.map(|s| &s[..s.len().min(2)]) {
            Some("22") | Some("23") => Failure::Content,
            Some("08") | Some("40") => Failure::Infrastructure,
            _ => Failure::Other,
        },
    }
}

impl crate::store::dialect::Dialect for MySql {
    const BACKEND: Backend = Backend::Mysql;
    const BEGIN: &'static str = "BEGIN";
    const NULL_SAFE_EQ: &'static str = "<=>";
    const LOCK_READ: &'static str = " FOR UPDATE";

    /// `INSERT IGNORE`: a duplicate key is 0 rows affected, no error, and the
    /// transaction goes on.
    fn insert_or_skip(into: &str) -> String {
        format!("INSERT IGNORE {into}")
    }

    fn quote(identifier: &str) -> String {
        format!("`{identifier}`")
    }

    /// Keys use a binary collation that the driver reports as VARBINARY, so text is
    /// read through `CAST(… AS CHAR)`; integers and booleans of a user's table
    /// through `CAST(… AS SIGNED)`.
    fn cast(identifier: &str, kind: Kind) -> String {
        match kind {
            Kind::Text => format!("CAST(`{identifier}` AS CHAR)"),
            Kind::Int | Kind::Bool => format!("CAST(`{identifier}` AS SIGNED)"),
            _ => format!("`{identifier}`"),
        }
    }

    /// DATETIME columns hold UTC (every session sets `time_zone = '+00:00'`).
    fn bind<'q>(
        query: Query<'q, MySql, MySqlArguments>,
        value: &'q BindValue,
    ) -> Query<'q, MySql, MySqlArguments> {
        match value {
            BindValue::Time(t) => query.bind(t.naive_utc()),
            BindValue::Int(i) => query.bind(*i),
            BindValue::Text(s) => query.bind(s.as_str()),
            BindValue::TextList(list) => list.iter().fold(query, |q, s| q.bind(s.as_str())),
            BindValue::Float(f) => query.bind(*f),
            BindValue::Bytes(b) => query.bind(b.as_slice()),
            BindValue::Bool(b) => query.bind(*b),
            BindValue::Json(j) => query.bind(j.to_string()),
            BindValue::Null(_) => query.bind(None::<String>),
        }
    }

    fn cell(row: &MySqlRow, i: usize, kind: Kind) -> Result<Cell, sqlx::Error> {
        Ok(match kind {
            Kind::Int => Cell::of(row.try_get(i)?, Cell::Int),
            Kind::Float => Cell::of(row.try_get(i)?, Cell::Float),
            Kind::Text => Cell::of(text(row, i)?, Cell::Text),
            Kind::Bytes => Cell::of(row.try_get(i)?, Cell::Bytes),
            Kind::Time => Cell::of(row.try_get::<Option<NaiveDateTime>, _>(i)?, |t| {
                Cell::Time(t.and_utc())
            }),
            Kind::Bool => Cell::of(row.try_get::<Option<i64>, _>(i)?, |n| Cell::Bool(n != 0)),
            Kind::Json => Cell::of(text(row, i)?, |s| {
                Cell::Json(serde_json::from_str(&s).unwrap_or(serde_json::Value::String(s)))
            }),
        })
    }

    /// InnoDB's sampled estimate; `EXPLAIN FORMAT=JSON` is not executed (`analyze`
    /// is ignored).
    const CATALOG: Catalog = Catalog {
        estimate_sql: "SELECT CAST(TABLE_ROWS AS SIGNED) FROM information_schema.TABLES
                       WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
        estimate_kinds: &[Kind::Int],
        estimate_name: str::to_string,
        read_estimate: |row| row.opt_int(0),
        count_first: false,
        explain: |sql, _| Some(format!("EXPLAIN FORMAT=JSON {sql}")),
    };

    fn done(result: &MySqlQueryResult) -> Done {
        Done {
            rows_affected: result.rows_affected(),
            last_insert_id: i64::try_from(result.last_insert_id()).ok(),
        }
    }
}

/// Text, or bytes the driver reports as binary (a binary collation, JSON on MariaDB).
fn text(row: &MySqlRow, i: usize) -> Result<Option<String>, sqlx::Error> {
    match row.try_get::<Option<String>, _>(i) {
        Ok(s) => Ok(s),
        Err(_) => Ok(row
            .try_get::<Option<Vec<u8>>, _>(i)?
            .map(|b| String::from_utf8_lossy(&b).into_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::dialect::is_deadlock;
    use crate::store::dialect::tests::{answer, assert_classes};

    #[test]
    fn mysql_errors_are_infrastructure_content_or_neither() {
        use Failure::{Content, Infrastructure, Other};
        let table = [
            // Duplicate entry: a race lost between two statements.
            ((1062, Some("23000")), Infrastructure),
            ((1586, Some("23000")), Infrastructure),
            // Lock wait timeout, deadlock, too many connections, read-only, server gone away.
            ((1205, Some("HY000")), Infrastructure),
            ((1213, Some("40001")), Infrastructure),
            ((1040, Some("08004")), Infrastructure),
            ((1290, Some("HY000")), Infrastructure),
            ((2006, None), Infrastructure),
            // Data too long, column cannot be null, a foreign key, a check constraint
            // (MySQL, MariaDB).
            ((1406, Some("22001")), Content),
            ((1048, Some("23000")), Content),
            ((1452, Some("23000")), Content),
            ((3819, Some("HY000")), Content),
            ((4025, Some("23000")), Content),
            // Numbers not listed: by SQLSTATE class.
            ((1690, Some("22003")), Content),
            ((9999, Some("22007")), Content),
            ((9999, Some("23000")), Content),
            ((9999, Some("08S01")), Infrastructure),
            ((9999, Some("40001")), Infrastructure),
            // A syntax error, an unknown table: a bug.
            ((1064, Some("42000")), Other),
            ((1146, Some("42S02")), Other),
            ((9999, Some("HY000")), Other),
            ((9999, None), Other),
        ];
        assert_classes(table, |(n, s)| failure(n, s));
    }

    #[test]
    fn only_innodbs_deadlock_and_lock_wait_are_run_again_whole() {
        let deadlock = answer(
            "40001",
            "Deadlock found when trying to get lock; try restarting transaction",
        );
        let lock_wait = answer(
            "HY000",
            "Lock wait timeout exceeded; try restarting transaction",
        );
        assert!(is_deadlock(&deadlock));
        assert!(is_deadlock(&lock_wait));
        for not in [
            // Another serialization failure, another HY000, a deadlock's words under another code.
            answer("40001", "Serialization failure"),
            answer(
                "HY000",
                "The MySQL server is running with the --read-only option",
            ),
            answer("23000", "Deadlock found when trying to get lock"),
            sqlx::Error::PoolTimedOut,
        ] {
            assert!(!is_deadlock(&not), "{not}");
        }
    }

    #[test]
    fn a_mariadb_url_is_read_as_a_mysql_one() {
        for url in [
            "mariadb://idw@db.example:3307/fleet",
            "mysql://idw@db.example:3307/fleet",
        ] {
            let o = options(url).unwrap();
            let got = (
                o.get_host(),
                o.get_port(),
                o.get_database(),
                o.get_username(),
            );
            assert_eq!(got, ("db.example", 3307, Some("fleet"), "idw"), "{url}");
        }
    }
}
