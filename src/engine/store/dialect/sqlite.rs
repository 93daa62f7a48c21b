//! SQLite: what differs from the other backends.

use super::super::Failure;

/// SQLite's extended result codes (<https://www.sqlite.org/rescode.html>).
pub(crate) fn failure(e: &sqlx::sqlite::SqliteError) -> Failure {
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
