//! PostgreSQL: what differs from the other backends.

use super::super::Failure;

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
