//! SQLite's connection plumbing for sqlx, apart from the store's statements: the
//! pool options the store and the embedded queue share. Their hot paths (the
//! store's batch writes, the queue's publish, leases and acks) do not go through
//! sqlx but through the file's own thread ([`super::thread`]), with the same
//! pragmas.

use std::str::FromStr;
use std::time::{Duration, Instant};

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

/// Pool options shared by the store and the embedded queue: WAL, the statement
/// deadline as the busy timeout (`busy`: writers wait that long for each other's lock
/// instead of failing, and no longer), and the fsync policy the caller needs (FULL
/// for anything whose loss would lose data).
pub(crate) async fn connect_sqlite(
    url: &str,
    max_connections: u32,
    synchronous: SqliteSynchronous,
    busy: Duration,
) -> Result<SqlitePool, OpenError> {
    let opts = SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(synchronous)
        .busy_timeout(busy)
        .foreign_keys(true);
    if let Some(parent) = opts.get_filename().parent() {
        if !parent.as_os_str().is_empty() {
            std::fs::create_dir_all(parent).map_err(|source| OpenError::CreateDir {
                path: parent.to_path_buf(),
                source,
            })?;
        }
    }
    // Two processes opening one new file at once (two `ingest mqtt` members of a share
    // group started together): the one that does not turn the file to WAL meets
    // SQLITE_BUSY on its connection's `PRAGMA journal_mode = WAL` at once, without
    // SQLite's busy handler (changing the journal mode takes the file's exclusive lock,
    // and SQLite does not wait for it). It exited 3 "database is locked" about one
    // start in four. Opening is tried again for as long as a writer may wait (`busy`),
    // then the lock is an error like any other.
    let deadline = Instant::now() + busy;
    let mut pause = Duration::from_millis(10);
    loop {
        let opened = SqlitePoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(60))
            // A local file does not hang up: no ping (a round trip to SQLite's thread)
            // before every statement.
            .test_before_acquire(false)
            .connect_with(opts.clone())
            .await;
        match opened {
            Err(e) if locked(&e) && Instant::now() + pause < deadline => {
                tracing::debug!(error = %e, "SQLite file locked while opening; another process is opening it too, again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            opened => return Ok(opened?),
        }
    }
}

/// SQLITE_BUSY or SQLITE_LOCKED, extended codes included (the low byte).
fn locked(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    let code: i32 = db.code().and_then(|c| c.parse().ok()).unwrap_or(1);
    matches!(code & 0xff, 5 | 6)
}

/// Bring a SQLite file's schema up to date, also when another process is doing the
/// same at that moment. sqlx's migrator takes no lock on SQLite (it does on
/// PostgreSQL and MariaDB): two processes opening one new file at once (two `ingest
/// mqtt` members of a share group started together) both applied a migration, and the
/// second failed on "duplicate column name". Each migration is its own transaction,
/// so a failed one left nothing behind; run again, the migrator skips what the other
/// process applied meanwhile. A migration that fails for itself fails every time.
pub(crate) async fn migrate(
    migrator: &sqlx::migrate::Migrator,
    pool: &SqlitePool,
) -> Result<(), sqlx::migrate::MigrateError> {
    const ATTEMPTS: u32 = 5;
    let mut attempt = 1;
    loop {
        match migrator.run(pool).await {
            Ok(()) => return Ok(()),
            Err(e) if attempt < ATTEMPTS => {
                tracing::debug!(error = %e, attempt, "SQLite migration failed; another process may be migrating the same file, again");
                tokio::time::sleep(Duration::from_millis(100 * u64::from(attempt))).await;
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three openers of one new file at once (three processes' worth: SQLite's locks
    /// hold between connections of one process as between processes), on 40 new
    /// files: every open succeeds and every file ends in WAL. Before the retry, the
    /// openers that lost the race to turn the file to WAL failed "database is
    /// locked" at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 3)]
    async fn openers_of_one_new_file_at_once_all_open_it() {
        let dir = tempfile::tempdir().unwrap();
        for round in 0..40 {
            let url = format!(
                "sqlite://{}",
                dir.path().join(format!("f{round}.db")).display()
            );
            let openers: Vec<_> = (0..3)
                .map(|_| {
                    let url = url.clone();
                    tokio::spawn(async move {
                        connect_sqlite(&url, 1, SqliteSynchronous::Full, Duration::from_secs(5))
                            .await
                    })
                })
                .collect();
            for opener in openers {
                let pool = opener
                    .await
                    .unwrap()
                    .unwrap_or_else(|e| panic!("round {round}: {e}"));
                let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                assert_eq!(mode, "wal");
            }
        }
    }
}
