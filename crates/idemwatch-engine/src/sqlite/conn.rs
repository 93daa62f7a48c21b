//! SQLite's connection plumbing for sqlx, apart from the store's statements: the
//! pool options the store and the embedded queue share. Their hot paths (the
//! store's batch writes, the queue's publish, leases and acks) do not go through
//! sqlx but through the file's own thread ([`super::thread`]), with the same
//! pragmas.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::SqlitePool;

/// Why a SQLite file could not be opened: its directory, or the database itself. The
/// store and the queue take it as their own error (`StoreError::CreateDir`, `Db`).
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    /// The directory of the file could not be created.
    #[error("cannot create {path}: {source}")]
    CreateDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// How long a statement waits for another writer's lock before it fails busy: writers
/// wait for each other instead of failing (sqlx's pools and the file's thread alike).
pub(crate) const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// Pool options shared by the store and the embedded queue: WAL, a generous busy
/// timeout (writers wait for each other instead of failing), and the fsync policy
/// the caller needs (FULL for anything whose loss would lose data).
pub(crate) async fn connect_sqlite(
    url: &str,
    max_connections: u32,
    synchronous: SqliteSynchronous,
) -> Result<SqlitePool, OpenError> {
    let opts = SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(synchronous)
        .busy_timeout(BUSY_TIMEOUT)
        .foreign_keys(true);
    if let Some(parent) = opts.get_filename().parent() {
        if !parent.as_os_str().is_empty() {
            std::fs::create_dir_all(parent).map_err(|source| OpenError::CreateDir {
                path: parent.to_path_buf(),
                source,
            })?;
        }
    }
    Ok(SqlitePoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(60))
        // A local file does not hang up: no ping (a round trip to SQLite's thread)
        // before every statement.
        .test_before_acquire(false)
        .connect_with(opts)
        .await?)
}
