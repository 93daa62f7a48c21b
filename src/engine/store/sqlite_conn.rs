//! SQLite's connection plumbing, apart from the store's statements: the pool options
//! the store and the embedded queue share, and the one held connection a single
//! writer's statements run on (the store's batch writes, the queue's leases and
//! acks), with the write transaction that travels as plain SQL on it.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::SqlitePool;
use tokio::sync::{Mutex, MutexGuard};

use super::{StoreError, StoreResult};

/// Pool options shared by the store and the embedded queue: WAL, a generous busy
/// timeout (writers wait for each other instead of failing), and the fsync policy
/// the caller needs (FULL for anything whose loss would lose data).
pub(crate) async fn connect_sqlite(
    url: &str,
    max_connections: u32,
    synchronous: SqliteSynchronous,
) -> StoreResult<SqlitePool> {
    let opts = SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(synchronous)
        .busy_timeout(Duration::from_secs(30))
        .foreign_keys(true);
    if let Some(parent) = opts.get_filename().parent() {
        if !parent.as_os_str().is_empty() {
            std::fs::create_dir_all(parent).map_err(|source| StoreError::CreateDir {
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

/// One connection kept apart from its pool for a single writer's statements, opened
/// on first use and closed after a failure (the next use opens a fresh one). A pooled
/// statement costs two extra calls to SQLite's thread (the pool pings a connection
/// when it is acquired and when it is returned); SQLite has one writer at a time
/// anyway. The store's batch writes and the embedded queue's leases and acks use it.
#[derive(Debug, Default)]
pub(crate) struct HeldConnection(Mutex<Option<SqliteConnection>>);

/// [`HeldConnection`] taken by one user.
pub(crate) struct Held<'a>(MutexGuard<'a, Option<SqliteConnection>>);

impl HeldConnection {
    /// Wait for the connection, opening it from `pool` if there is none.
    pub(crate) async fn take<'a>(&'a self, pool: &SqlitePool) -> Result<Held<'a>, sqlx::Error> {
        let mut conn = self.0.lock().await;
        if conn.is_none() {
            *conn = Some(pool.acquire().await?.detach());
        }
        Ok(Held(conn))
    }
}

impl Held<'_> {
    pub(crate) fn conn(&mut self) -> &mut SqliteConnection {
        self.0
            .as_mut()
            .expect("opened by HeldConnection::take, closed only on the way out")
    }

    /// One call's result; after a failure the connection is closed.
    pub(crate) fn keep<T>(&mut self, result: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
        if result.is_err() {
            self.close();
        }
        result
    }

    /// Close the connection: SQLite rolls back a transaction left open on it.
    fn close(&mut self) {
        *self.0 = None;
    }
}

/// A write transaction run as plain SQL on the store's held batch connection:
/// `BEGIN IMMEDIATE` travels with the first statements and `COMMIT` with the last, so
/// a batch costs two calls to SQLite's thread instead of six (`Transaction` sends
/// `BEGIN` and `COMMIT` as calls of their own, each waiting for an acknowledgement,
/// and the pool pings a connection when it is returned). Every call to that thread
/// is a hand-off between threads, and on a small VM hand-offs, not SQL, were most of
/// a batch's cost. Holding one connection serializes batches, which SQLite's single
/// writer does anyway.
///
/// Anything short of [`Self::finish`] (an error, or the future dropped half-way)
/// closes the connection (the next batch opens another): SQLite rolls back an open
/// transaction when its connection closes, so no half-done transaction, and no
/// write lock, can outlive the batch.
pub(super) struct OneWriteTx<'a> {
    held: Held<'a>,
    done: bool,
}

impl<'a> OneWriteTx<'a> {
    pub(super) async fn begin(pool: &SqlitePool, writer: &'a HeldConnection) -> StoreResult<Self> {
        Ok(OneWriteTx {
            held: writer.take(pool).await?,
            done: false,
        })
    }

    pub(super) fn conn(&mut self) -> &mut SqliteConnection {
        self.held.conn()
    }

    /// One call's result; after a failure the connection is closed (rolled back).
    pub(super) fn check<T>(&mut self, result: Result<T, sqlx::Error>) -> StoreResult<T> {
        Ok(self.held.keep(result)?)
    }

    /// Committed: the connection stays for the next batch.
    pub(super) fn finish(mut self) {
        self.done = true;
    }
}

impl Drop for OneWriteTx<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.held.close();
        }
    }
}
