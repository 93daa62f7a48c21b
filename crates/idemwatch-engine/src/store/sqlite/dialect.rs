//! SQLite: what differs from the other backends.

use sqlx::query::Query;
use sqlx::sqlite::{SqliteArguments, SqliteQueryResult, SqliteRow};
use sqlx::{Row, Sqlite};

use super::super::{Backend, Failure};
use crate::store::dialect::{parse_text_time, text_time, BindValue, Catalog, Cell, Done, Kind};

/// SQLite's extended result codes (<https://www.sqlite.org/rescode.html>), from sqlx's
/// driver or from the engine's own SQLite thread (`crate::sqlite::thread`) alike.
pub(crate) fn failure<E: sqlx::error::DatabaseError + ?Sized>(e: &E) -> Failure {
    let code: i32 = sqlx::error::DatabaseError::code(e)
        .and_then(|c| c.parse().ok())
        .unwrap_or(1);
    match code {
        // SQLITE_CONSTRAINT_PRIMARYKEY, _UNIQUE: every key write goes through
        // ON CONFLICT, so this is another writer that got there between two
        // statements — a lost race, decided by the retry.
        1555 | 2067 => Failure::Infrastructure,
        _ => match code & 0xff {
            // TOOBIG, CONSTRAINT (check, not null, trigger, datatype…), MISMATCH
            18..=20 => Failure::Content,
            // PERM, BUSY, LOCKED, NOMEM, READONLY, INTERRUPT, IOERR, FULL,
            // CANTOPEN, PROTOCOL, AUTH
            3 | 5 | 6 | 7 | 8 | 9 | 10 | 13 | 14 | 15 | 23 => Failure::Infrastructure,
            _ => Failure::Other,
        },
    }
}

/// SQLITE_BUSY: another writer held the lock for the whole busy timeout.
pub(crate) fn timed_out<E: sqlx::error::DatabaseError + ?Sized>(e: &E) -> bool {
    let code: i32 = sqlx::error::DatabaseError::code(e)
        .and_then(|c| c.parse().ok())
        .unwrap_or(1);
    code & 0xff == 5
}

impl crate::store::dialect::Dialect for sqlx::Sqlite {
    const BACKEND: Backend = Backend::Sqlite;
    /// Take the write lock up front: a transaction that reads before it writes (a
    /// claim takeover) can then never fail with a busy snapshot under WAL.
    const BEGIN: &'static str = "BEGIN IMMEDIATE";
    const NULL_SAFE_EQ: &'static str = "IS";

    fn bind<'q>(
        query: Query<'q, Sqlite, SqliteArguments<'q>>,
        value: &'q BindValue,
    ) -> Query<'q, Sqlite, SqliteArguments<'q>> {
        match value {
            BindValue::Time(t) => query.bind(text_time(*t)),
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

    /// Times are TEXT in [`super::text_time`]'s form, booleans and ints INTEGER,
    /// JSON is TEXT.
    fn cell(row: &SqliteRow, i: usize, kind: Kind) -> Result<Cell, sqlx::Error> {
        Ok(match kind {
            Kind::Int => Cell::of(row.try_get(i)?, Cell::Int),
            Kind::Float => Cell::of(row.try_get(i)?, Cell::Float),
            Kind::Text => Cell::of(row.try_get(i)?, Cell::Text),
            Kind::Bytes => Cell::of(row.try_get(i)?, Cell::Bytes),
            Kind::Bool => Cell::of(row.try_get::<Option<i64>, _>(i)?, |n| Cell::Bool(n != 0)),
            Kind::Time => Cell::of(
                row.try_get::<Option<String>, _>(i)?
                    .as_deref()
                    .and_then(parse_text_time),
                Cell::Time,
            ),
            Kind::Json => Cell::of(
                row.try_get::<Option<String>, _>(i)?
                    .and_then(|s| serde_json::from_str(&s).ok()),
                Cell::Json,
            ),
        })
    }

    /// `sqlite_stat1` after `ANALYZE` (its first number is the table's rows); the
    /// dashboard does not explain on SQLite.
    const CATALOG: Catalog = Catalog {
        estimate_sql: "SELECT stat FROM sqlite_stat1 WHERE tbl = ? LIMIT 1",
        estimate_kinds: &[Kind::Text],
        estimate_name: str::to_string,
        read_estimate: |row| row.opt_text(0)?.split_whitespace().next()?.parse().ok(),
        count_first: true,
        explain: |_, _| None,
    };

    fn done(result: &SqliteQueryResult) -> Done {
        Done {
            rows_affected: result.rows_affected(),
            last_insert_id: Some(result.last_insert_rowid()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::dialect::tests::{assert_classes, Answer};

    fn of(code: &'static str) -> Failure {
        failure(&Answer { code, message: "" })
    }

    /// By extended code, then by its primary code (the low byte).
    #[test]
    fn sqlite_codes_are_infrastructure_content_or_neither() {
        use Failure::{Content, Infrastructure, Other};
        let table = [
            // CONSTRAINT_PRIMARYKEY, CONSTRAINT_UNIQUE: a race lost between two statements.
            ("1555", Infrastructure),
            ("2067", Infrastructure),
            // CONSTRAINT (a trigger's RAISE), CONSTRAINT_CHECK, _NOTNULL, _FOREIGNKEY, TOOBIG, MISMATCH.
            ("19", Content),
            ("275", Content),
            ("1299", Content),
            ("787", Content),
            ("18", Content),
            ("20", Content),
            // BUSY, BUSY_SNAPSHOT, LOCKED, READONLY, IOERR_WRITE, FULL, CANTOPEN.
            ("5", Infrastructure),
            ("517", Infrastructure),
            ("6", Infrastructure),
            ("8", Infrastructure),
            ("778", Infrastructure),
            ("13", Infrastructure),
            ("14", Infrastructure),
            // ERROR (a bug's SQL), MISUSE, a code that is no number.
            ("1", Other),
            ("21", Other),
            ("?", Other),
        ];
        assert_classes(table, of);
    }

    /// SQLite has no boolean: an INTEGER, any value but 0 true; NULL is no boolean.
    #[tokio::test]
    async fn an_integer_reads_as_a_boolean_and_null_as_none() {
        use crate::store::dialect::{Pooled, Sql};
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        let rows = Pooled(pool)
            .rows("SELECT 0, 1, 2, -1, NULL", &[], &[Kind::Bool; 5])
            .await
            .unwrap();
        let row = &rows[0];
        let want = [false, true, true, true].map(Cell::Bool);
        assert_eq!(row.0, [want.as_slice(), &[Cell::Null]].concat());
        assert_eq!((row.bool(0).unwrap(), row.bool(1).unwrap()), (false, true));
        assert!(row.bool(4).is_err());
    }
}
