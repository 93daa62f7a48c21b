//! MySQL / MariaDB: what differs from the other backends.

use super::super::Failure;

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
