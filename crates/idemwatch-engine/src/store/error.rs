//! What can go wrong in the database layer, and whose fault it is.
//!
//! The engine must tell two failures apart that look alike from far away: the
//! database (or the way to it) could not do it now — an outage, a timeout, a lock, a
//! lost race: retry later, and never hold it against the message — and the database
//! refuses *this row* for what it holds — a constraint, a value too long, a NUL byte
//! in PostgreSQL text: retrying the same message fails the same way, so it is
//! dead-lettered (`store_rejected`). [`StoreError::failure`] says which; each
//! backend's error codes are read in its dialect file (`dialect/{sqlite,postgres,mysql}.rs`).

use std::time::Duration;

use serde::Serialize;

use idemwatch_base::vocab::{InfraKind, PauseCause};

/// Errors from the database layer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("unsupported database URL {0} (expected sqlite://, postgres:// or mysql://)")]
    UnsupportedUrl(String),
    /// A durability the backend cannot give without changing what is not ours: bad
    /// usage, refused before any connection is made.
    #[error("{0}")]
    DurabilityUnsupported(String),
    /// The directory of a SQLite file could not be created.
    #[error("cannot create {path}: {source}")]
    CreateDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    /// A value of the message does not fit the column that stores it.
    #[error("{what} {value} exceeds storage range")]
    OutOfRange { what: &'static str, value: String },
    /// A row seen a moment ago was gone at the next statement (a purge ran in
    /// between): the transaction was rolled back and is retried whole.
    #[error("dedup row for {key} neither inserted nor found")]
    RowVanished { key: String },
    /// Another writer got in between this transaction's read and its write (a key,
    /// a claim or a history row it decided on was written meanwhile): rolled back,
    /// nothing of it kept. [`retrying`](super::dialect::retrying) runs it again,
    /// and the next read sees the other writer's rows.
    #[error("a race lost to another writer: {what}")]
    LostRace { what: &'static str },
    /// A broken promise inside the store (a bug), not a database's answer.
    #[error("internal store error: {0}")]
    Internal(&'static str),
    /// The seen-set outside the database (Redis) could not answer: an outage like any
    /// other, which pauses a fail-closed consumer under its own cause (see
    /// [`crate::seen_set`]).
    #[error("seen-set {seen_set} unavailable: {why}")]
    SeenSetUnavailable { seen_set: String, why: String },
    /// A deadline fired: the database or the seen-set (`cause`), or the way to it, did
    /// not answer `what` within `after`. The way is suspect: the call's connection is
    /// not reused (see `store/deadline.rs`). An outage, never the message's fault.
    #[error("{} did not answer within {after:?} ({what}): timeout", cause.as_str())]
    TimedOut {
        cause: PauseCause,
        what: &'static str,
        after: Duration,
    },
    /// A seen-set URL that cannot be used (unparsable, or not `redis://`): bad
    /// configuration, which no retry mends.
    #[error("{0}")]
    SeenSetUrl(String),
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Whose fault a [`StoreError`] is, for the caller deciding a message's fate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Failure {
    /// The database, or the way to it, cannot do it now: unreachable, connection
    /// reset, a timeout (statement, lock wait, pool), SQLITE_BUSY/LOCKED, a
    /// serialization failure or deadlock, a race lost to another writer, a server
    /// shutting down, full or read-only, privileges taken away. Says nothing about
    /// the message: retry later, never dead-letter it for this.
    Infrastructure,
    /// The database refuses this row for what it holds: a constraint, a value too
    /// long or out of range, an invalid byte sequence (NUL in PostgreSQL text), data
    /// truncated. The same message fails the same way every time.
    Content,
    /// Neither: a bug or a schema that does not match (an SQL error, a missing
    /// column, a value that cannot be decoded), a bad URL, a failed migration.
    Other,
}

impl StoreError {
    /// Whose fault this is (see [`Failure`]).
    pub fn failure(&self) -> Failure {
        match self {
            StoreError::Db(e) => classify(e),
            StoreError::Migrate(sqlx::migrate::MigrateError::Execute(e)) => classify(e),
            StoreError::Migrate(_) => Failure::Other,
            StoreError::UnsupportedUrl(_) | StoreError::DurabilityUnsupported(_) => Failure::Other,
            StoreError::CreateDir { .. }
            | StoreError::RowVanished { .. }
            | StoreError::LostRace { .. } => Failure::Infrastructure,
            StoreError::OutOfRange { .. } => Failure::Content,
            StoreError::Internal(_) => Failure::Other,
            StoreError::SeenSetUnavailable { .. } | StoreError::TimedOut { .. } => {
                Failure::Infrastructure
            }
            StoreError::SeenSetUrl(_) => Failure::Other,
        }
    }

    /// The database or the way to it failed, not the message: retry later.
    pub fn is_infrastructure(&self) -> bool {
        self.failure() == Failure::Infrastructure
    }

    /// A deadline fired: ours around the call ([`StoreError::TimedOut`]), the pool's
    /// wait for a connection, or the server's own (statement, lock wait, idle
    /// transaction; SQLite's busy timeout). Counted as `kind="timeout"`.
    pub fn timed_out(&self) -> bool {
        match self {
            StoreError::TimedOut { .. } => true,
            StoreError::Db(e) => timed_out(e),
            StoreError::Migrate(sqlx::migrate::MigrateError::Execute(e)) => timed_out(e),
            _ => false,
        }
    }

    /// The `kind` an infrastructure failure of this error is counted under, and
    /// through it the cause its consumer pauses for: a deadline is `timeout` of the
    /// part that went silent, a fail-closed seen-set's outage pauses for the
    /// seen-set (probed with its own ping), anything else is the store's.
    pub fn infra_kind(&self) -> InfraKind {
        match self {
            StoreError::TimedOut { cause, .. } => InfraKind::Timeout(*cause),
            StoreError::SeenSetUnavailable { .. } => InfraKind::SeenSet,
            e if e.timed_out() => InfraKind::Timeout(PauseCause::Store),
            _ => InfraKind::Store,
        }
    }

    /// The database refused this message's row for its content.
    pub fn is_content(&self) -> bool {
        self.failure() == Failure::Content
    }
}

impl From<crate::sqlite::conn::OpenError> for StoreError {
    fn from(e: crate::sqlite::conn::OpenError) -> Self {
        use crate::sqlite::conn::OpenError;
        match e {
            OpenError::CreateDir { path, source } => StoreError::CreateDir { path, source },
            OpenError::Db(e) => StoreError::Db(e),
        }
    }
}

/// A driver error: the connection-level ones here, a database's answer by the
/// codes of the backend that gave it.
fn classify(e: &sqlx::Error) -> Failure {
    match e {
        sqlx::Error::Database(db) => super::database_failure(db.as_ref()),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => Failure::Infrastructure,
        // A row read a statement ago and gone now: a race with a purge.
        sqlx::Error::RowNotFound => Failure::Infrastructure,
        // The value cannot even be sent as this database's type.
        sqlx::Error::Encode(_) => Failure::Content,
        _ => Failure::Other,
    }
}

/// A driver error that is a deadline firing (see [`StoreError::timed_out`]).
pub(crate) fn timed_out(e: &sqlx::Error) -> bool {
    use super::{
        mysql::dialect as mysql, postgres::dialect as postgres, sqlite::dialect as sqlite,
    };
    match e {
        sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Io(io) => io.kind() == std::io::ErrorKind::TimedOut,
        sqlx::Error::Database(db) => {
            if let Some(e) = db.try_downcast_ref::<sqlx::sqlite::SqliteError>() {
                sqlite::timed_out(e)
            } else if let Some(e) =
                db.try_downcast_ref::<crate::sqlite::thread::SqliteThreadError>()
            {
                sqlite::timed_out(e)
            } else if let Some(e) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
                postgres::timed_out(e.code())
            } else if let Some(e) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                mysql::timed_out(e.number())
            } else {
                false
            }
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_level_failures_are_infrastructure() {
        for e in [
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
            sqlx::Error::WorkerCrashed,
            sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
            sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::TimedOut)),
        ] {
            assert!(StoreError::Db(e).is_infrastructure());
        }
        let dir = StoreError::CreateDir {
            path: "/x".into(),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
        assert!(dir.is_infrastructure());
        // Not the message's fault: retried, never dead-lettered.
        assert!(StoreError::LostRace { what: "a claim" }.is_infrastructure());
    }

    #[test]
    fn a_message_value_out_of_range_is_content_and_a_bug_is_neither() {
        let seq = StoreError::OutOfRange {
            what: "seq",
            value: u64::MAX.to_string(),
        };
        assert!(seq.is_content() && !seq.is_infrastructure());
        assert_eq!(StoreError::Internal("x").failure(), Failure::Other);
        let decode = StoreError::Db(sqlx::Error::ColumnNotFound("x".into()));
        assert_eq!(decode.failure(), Failure::Other);
    }

    #[test]
    fn a_row_gone_between_statements_is_infrastructure_and_an_unsendable_value_content() {
        // Read a statement ago and gone at the next (a purge in between): the store's
        // moment, not the message's; retried, never dead-lettered.
        let gone = StoreError::Db(sqlx::Error::RowNotFound);
        assert!(gone.is_infrastructure() && !gone.is_content());
        // A value the driver cannot even send as the column's type: this message's own.
        let unsendable = StoreError::Db(sqlx::Error::Encode("a value too wide".into()));
        assert!(unsendable.is_content() && !unsendable.is_infrastructure());
    }
}
