//! One SQLite connection on an OS thread of its own per database file, fed whole
//! jobs through a bounded channel: the engine's SQLite hot path (the embedded queue's
//! publish, leases and acks) runs here instead of through sqlx.
//!
//! Why hand-written: sqlx's SQLite driver also keeps each connection on a worker
//! thread, but every call — each statement, each `BEGIN`/`COMMIT`, each result row —
//! is a hand-off to that thread and back, and on a small shared machine those
//! hand-offs, not SQL, were most of a batch's cost (docs/journal/benchmarks-2026-11-30-to-12-05.md, "rusqlite against
//! sqlx": the same statements are ~2× faster through SQLite's C API). Here a job is a
//! closure over a [`rusqlite::Connection`] that runs whole on the thread — prepared
//! statements from the connection's cache, one `BEGIN IMMEDIATE … COMMIT` where it
//! writes — so a batch costs one hand-off there and one back. sqlx stays for
//! migrations, reads and everything that is not the hot path.
//!
//! **Group commit.** A write job ([`SqliteThread::write`]) does not commit alone: the
//! write jobs already waiting in the channel when the thread takes one (up to
//! [`GROUP_MAX`]) run inside one `BEGIN IMMEDIATE … COMMIT`, each under a `SAVEPOINT`
//! of its own, and every caller hears back only once that commit is done. Four
//! consumers and a publisher share one queue file, so its jobs queue behind one
//! another, and a commit per job was much of their cost (the pages they share
//! written to the WAL again at every commit, the lock and wal-index work of each
//! transaction): with it the queue's thread wrote ~65 % fewer WAL frames and used
//! ~40 % less CPU for the same 20,000 messages (the benchmarks journal, docs/journal/, "Group commit on the
//! SQLite threads"). A job that fails is rolled back to its savepoint and the others
//! commit: the group shares a transaction only for the fsync and the page writes.
//! A job alone in its group runs without a savepoint.
//!
//! The rules a job keeps:
//! - **Whole or not at all.** A job whose caller has gone (its future dropped, its
//!   wait timed out) before the job started is skipped; one that started runs to its
//!   end on the thread, and its transaction (its savepoint in a group) commits or
//!   rolls back there (rusqlite's `Transaction` rolls back when dropped, also on a
//!   panic). A caller told `Ok` is told so after the commit. After every job (every
//!   group) the thread checks that the connection is back in autocommit, and closes
//!   it when a `ROLLBACK` cannot bring it there: no transaction, and no write lock,
//!   outlives its job — the same atomicity a crash gives.
//! - **Every wait bounded**: queueing for the thread (the pool's acquire timeout) and
//!   the answer (the busy timeout on top): a stuck thread is an outage error, not a
//!   hang.
//! - **Errors keep their meaning.** A rusqlite error becomes a `sqlx::Error` whose
//!   classification (the store's `Failure`) reads the same SQLite result codes as sqlx's
//!   own errors do (`store/sqlite/dialect.rs`): busy, locked, I/O are an outage, never a
//!   dead letter; a constraint is the content's fault only where it is for sqlx.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rusqlite::{Connection, Transaction, TransactionBehavior};
use sqlx::sqlite::{SqliteConnectOptions, SqliteSynchronous};
use tokio::sync::{mpsc, oneshot};

/// What the thread runs: a write job ([`SqliteThread::write`]); `durable`: its group
/// commits with `synchronous = FULL` whatever the connection's policy.
struct Job {
    durable: bool,
    job: Grouped,
}

/// A write job: given the group's transaction (or why there is none, when it answers
/// at once), it runs and says whether it succeeded — its savepoint is released, else
/// rolled back — and how to answer once the group's commit is known. `None`: its
/// caller was gone, nothing ran.
type Grouped = Box<dyn FnOnce(Result<&Transaction<'_>, &rusqlite::Error>) -> Option<Ran> + Send>;

/// A write job that ran: whether it succeeded, and its answer, sent with the
/// outcome of the group's commit.
type Ran = (bool, Answer);

/// A write job's answer, given the outcome of its group's commit.
type Answer = Box<dyn FnOnce(Result<(), &rusqlite::Error>) + Send>;

/// Jobs waiting for the thread. Callers beyond it wait (bounded) to hand theirs over.
const QUEUED_JOBS: usize = 64;

/// The most write jobs one transaction takes: each answer waits for the group's
/// commit, so the first job of a group waits for the others' work too.
pub(crate) const GROUP_MAX: usize = 16;

/// How long a caller waits to hand a job to the thread: the sqlx pool's acquire
/// timeout, which this wait replaces.
const HANDOFF_WAIT: Duration = Duration::from_secs(60);

/// How a connection is opened: the fsync policy and how long a statement waits for
/// another writer's lock before it fails busy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ThreadOptions {
    /// `PRAGMA synchronous`: `FULL` or `NORMAL`.
    pub synchronous: &'static str,
    pub busy_timeout: Duration,
}

/// A handle on one file's thread; clones share it. The thread ends when the last
/// handle is dropped (its channel closes), closing the connection.
#[derive(Clone)]
pub(crate) struct SqliteThread {
    inner: Arc<Inner>,
}

struct Inner {
    jobs: mpsc::Sender<Job>,
    path: PathBuf,
    options: ThreadOptions,
}

impl std::fmt::Debug for SqliteThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteThread")
            .field("path", &self.inner.path)
            .field("options", &self.inner.options)
            .finish()
    }
}

/// The threads of this process, by file: two handles opened on one file share one
/// thread, so its writers queue in the channel instead of meeting in SQLite's busy
/// handler.
static THREADS: Mutex<Option<HashMap<PathBuf, Weak<Inner>>>> = Mutex::new(None);

impl SqliteThread {
    /// The thread of a `sqlite://` URL's file (the URL read as sqlx reads it), with
    /// the fsync policy `synchronous` and the pools' busy timeout `busy`.
    pub(crate) fn for_url(
        url: &str,
        synchronous: SqliteSynchronous,
        busy: Duration,
    ) -> Result<Self, sqlx::Error> {
        let path = SqliteConnectOptions::from_str(url)?
            .get_filename()
            .to_path_buf();
        let synchronous = match synchronous {
            SqliteSynchronous::Off => "OFF",
            SqliteSynchronous::Normal => "NORMAL",
            SqliteSynchronous::Full => "FULL",
            SqliteSynchronous::Extra => "EXTRA",
        };
        let options = ThreadOptions {
            synchronous,
            busy_timeout: busy,
        };
        // No thread to be had (out of threads or memory): an outage.
        Self::for_file(&path, options).map_err(sqlx::Error::Io)
    }

    /// The thread of `path` (the file must exist and be migrated: sqlx opens it
    /// first), started if this process has none. `options` are those of the first
    /// opener while the thread lives.
    pub(crate) fn for_file(path: &Path, options: ThreadOptions) -> std::io::Result<Self> {
        let key = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let mut threads = THREADS.lock().unwrap_or_else(|e| e.into_inner());
        let threads = threads.get_or_insert_with(HashMap::new);
        threads.retain(|_, t| t.strong_count() > 0);
        if let Some(inner) = threads.get(&key).and_then(Weak::upgrade) {
            return Ok(SqliteThread { inner });
        }
        let thread = Self::spawn(&key, options)?;
        threads.insert(key, Arc::downgrade(&thread.inner));
        Ok(thread)
    }

    /// A thread of its own on `path`, shared with nobody (tests, and [`Self::for_file`]).
    pub(crate) fn spawn(path: &Path, options: ThreadOptions) -> std::io::Result<Self> {
        let (jobs, mut queued) = mpsc::channel::<Job>(QUEUED_JOBS);
        let file = path.to_path_buf();
        std::thread::Builder::new()
            // Named after its file (`sql q.sqlite`; Linux keeps 15 bytes), so the CPU
            // of a queue's thread and a store's can be told apart in /proc.
            .name(format!(
                "sql {}",
                path.file_name().unwrap_or_default().to_string_lossy()
            ))
            .spawn(move || {
                let mut conn: Option<Connection> = None;
                while let Some(Job { durable, job }) = queued.blocking_recv() {
                    if conn.is_none() {
                        match open(&file, options) {
                            Ok(c) => conn = Some(c),
                            Err(e) => {
                                job(Err(&e));
                                continue;
                            }
                        }
                    }
                    let c = conn.as_mut().expect("opened above");
                    // The write jobs waiting now join this one's transaction.
                    let mut group = VecDeque::from([(durable, job)]);
                    while group.len() < GROUP_MAX {
                        match queued.try_recv() {
                            Ok(Job { durable, job }) => group.push_back((durable, job)),
                            Err(_) => break,
                        }
                    }
                    while !group.is_empty() {
                        commit_group(c, &mut group, options);
                    }
                    if !back_in_autocommit(c) {
                        // Closing the connection rolls back whatever it still holds.
                        conn = None;
                    }
                }
            })?;
        Ok(SqliteThread {
            inner: Arc::new(Inner {
                jobs,
                path: path.to_path_buf(),
                options,
            }),
        })
    }

    /// Hand `job` to the thread and wait (bounded) for its answer on `result`. `E`
    /// carries the thread's own failures as `sqlx::Error`s (see [`db`] for
    /// rusqlite's).
    async fn hand_over<T, E>(
        &self,
        job: Job,
        result: oneshot::Receiver<Result<T, E>>,
    ) -> Result<T, E>
    where
        E: From<sqlx::Error>,
    {
        let handed = self.inner.jobs.send_timeout(job, HANDOFF_WAIT).await;
        if let Err(e) = handed {
            return Err(E::from(match e {
                mpsc::error::SendTimeoutError::Timeout(_) => sqlx::Error::PoolTimedOut,
                mpsc::error::SendTimeoutError::Closed(_) => sqlx::Error::WorkerCrashed,
            }));
        }
        // A job waits at most the busy timeout per lock it takes; one that has not
        // answered well after is stuck.
        let answer_wait = self.inner.options.busy_timeout + HANDOFF_WAIT;
        match tokio::time::timeout(answer_wait, result).await {
            Ok(Ok(result)) => result,
            // The job panicked (its answer dropped unsent) or the thread is gone.
            Ok(Err(_)) => Err(E::from(sqlx::Error::WorkerCrashed)),
            Err(_) => Err(E::from(sqlx::Error::PoolTimedOut)),
        }
    }

    /// Run `job` inside a `BEGIN IMMEDIATE … COMMIT` shared with the write jobs
    /// waiting beside it (see the module's "Group commit"): its work is kept when it
    /// returns `Ok` and the group commits, rolled back to its savepoint otherwise (and
    /// on a panic); the answer comes after the commit.
    pub(crate) async fn write<T, E>(
        &self,
        job: impl FnOnce(&Transaction<'_>) -> Result<T, E> + Send + 'static,
    ) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<sqlx::Error> + Send + 'static,
    {
        self.write_with(false, job).await
    }

    /// [`Self::write`]; `durable`: its commit is fsynced (`synchronous = FULL`)
    /// whatever the connection's policy, and so is the rest of its group's.
    pub(crate) async fn write_with<T, E>(
        &self,
        durable: bool,
        work: impl FnOnce(&Transaction<'_>) -> Result<T, E> + Send + 'static,
    ) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<sqlx::Error> + Send + 'static,
    {
        let (answer, result) = oneshot::channel();
        let job: Grouped = Box::new(move |tx: Result<&Transaction<'_>, &rusqlite::Error>| {
            let tx = match tx {
                Ok(tx) => tx,
                Err(e) => {
                    let _ = answer.send(Err(E::from(db_ref(e))));
                    return None;
                }
            };
            // The caller is gone: not at all (it started nothing).
            if answer.is_closed() {
                return None;
            }
            let outcome = work(tx);
            let ok = outcome.is_ok();
            let reply: Answer = Box::new(move |committed: Result<(), &rusqlite::Error>| {
                let _ = answer.send(match (outcome, committed) {
                    (Ok(_), Err(e)) => Err(E::from(db_ref(e))),
                    (outcome, _) => outcome,
                });
            });
            Some((ok, reply))
        });
        self.hand_over(Job { durable, job }, result).await
    }
}

/// Run the write jobs at the front of `group` in one transaction, each under a
/// savepoint, commit, and answer each with the commit's outcome. A job that leaves
/// the transaction gone (SQLite rolls a transaction back by itself on some I/O and
/// memory errors) ends the group there: its jobs so far are answered with that error
/// (their work went with the transaction) and the rest stay in `group` for the next.
fn commit_group(
    conn: &mut Connection,
    group: &mut VecDeque<(bool, Grouped)>,
    options: ThreadOptions,
) {
    let durable = matches!(options.synchronous, "OFF" | "NORMAL")
        && group.iter().any(|(durable, _)| *durable);
    let refuse = |group: &mut VecDeque<(bool, Grouped)>, e: rusqlite::Error| {
        for (_, job) in group.drain(..) {
            job(Err(&e));
        }
    };
    if let Err(e) = sync(conn, durable, "FULL") {
        refuse(group, e);
        return;
    }
    // Unchecked: borrowed shared, so the policy can be set back beside it.
    let tx = match Transaction::new_unchecked(conn, TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(e) => {
            refuse(group, e);
            let _ = sync(conn, durable, options.synchronous);
            return;
        }
    };
    // A job alone needs no savepoint: the transaction is its own.
    let alone = group.len() == 1;
    let mut answers = Vec::with_capacity(group.len());
    let mut broken: Option<rusqlite::Error> = None;
    let mut failed_alone = false;
    while let Some((_, job)) = group.pop_front() {
        if !alone {
            if let Err(e) = tx.execute_batch("SAVEPOINT job") {
                job(Err(&e));
                broken = Some(e);
                break;
            }
        }
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(Ok(&tx))));
        let ok = matches!(ran, Ok(Some((true, _))));
        if let Ok(Some((_, answer))) = ran {
            answers.push(answer);
        }
        if tx.is_autocommit() {
            // SQLite ends a transaction by itself on I/O, disk-full and memory
            // errors: an outage for every job of the group, not their messages' fault.
            broken = Some(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_IOERR),
                Some("the transaction was rolled back under a job of its group".into()),
            ));
            break;
        }
        if alone {
            failed_alone = !ok;
        } else {
            let settled = if ok {
                tx.execute_batch("RELEASE job")
            } else {
                tx.execute_batch("ROLLBACK TO job; RELEASE job")
            };
            if let Err(e) = settled {
                broken = Some(e);
                break;
            }
        }
    }
    let committed = match broken {
        Some(e) => {
            drop(tx);
            Err(e)
        }
        // Rolled back (dropped): the job's answer is its own error.
        None if failed_alone => {
            drop(tx);
            Ok(())
        }
        None => tx.commit(),
    };
    for answer in answers {
        answer(committed.as_ref().map(|_| ()));
    }
    let _ = sync(conn, durable, options.synchronous);
}

/// `PRAGMA synchronous = level` when `needed`.
fn sync(conn: &Connection, needed: bool, level: &str) -> rusqlite::Result<()> {
    if needed {
        conn.execute_batch(&format!("PRAGMA synchronous = {level}"))?;
    }
    Ok(())
}

/// A connection with the store's pragmas (as `conn::connect_sqlite` sets them
/// for sqlx): WAL, the fsync policy, the busy timeout, foreign keys on.
fn open(path: &Path, options: ThreadOptions) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(options.busy_timeout)?;
    conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))?;
    // temp_store in memory: a job of a group writes the pages it changes to its
    // savepoint's statement journal, which SQLite otherwise spills to a temporary
    // file (a group's jobs wrote ~2 of those pages per WAL frame saved).
    conn.execute_batch(&format!(
        "PRAGMA synchronous = {}; PRAGMA foreign_keys = ON; PRAGMA temp_store = MEMORY;",
        options.synchronous
    ))?;
    // The batch statements are few and reused: keep them all prepared.
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

/// No transaction left open after a job: roll back one that is (a job that returned
/// without committing or rolling back), and say whether that worked.
fn back_in_autocommit(conn: &Connection) -> bool {
    conn.is_autocommit() || (conn.execute_batch("ROLLBACK").is_ok() && conn.is_autocommit())
}

/// A rusqlite error as a `sqlx::Error` that means the same to the engine: SQLite's
/// answers as a database error with their extended result code (read by
/// `store::sqlite::dialect::failure`, as for sqlx's own), a value that cannot be read back
/// as a decode error (a bug or a schema mismatch, not an outage).
pub(crate) fn db(e: rusqlite::Error) -> sqlx::Error {
    match e {
        rusqlite::Error::SqliteFailure(code, message) => {
            sqlx::Error::Database(Box::new(SqliteThreadError {
                code: code.extended_code,
                message: message.unwrap_or_else(|| code.to_string()),
            }))
        }
        other => sqlx::Error::Decode(Box::new(other)),
    }
}

/// [`db`] of an error several callers share (a group's failed `BEGIN` or `COMMIT`).
fn db_ref(e: &rusqlite::Error) -> sqlx::Error {
    match e {
        rusqlite::Error::SqliteFailure(code, message) => {
            db(rusqlite::Error::SqliteFailure(*code, message.clone()))
        }
        other => sqlx::Error::Decode(other.to_string().into()),
    }
}

/// SQLite's answer to a statement run on a [`SqliteThread`].
#[derive(Debug, thiserror::Error)]
#[error("(code: {code}) {message}")]
pub(crate) struct SqliteThreadError {
    /// The extended result code (<https://www.sqlite.org/rescode.html>).
    code: i32,
    message: String,
}

impl sqlx::error::DatabaseError for SqliteThreadError {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Owned(self.code.to_string()))
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        use sqlx::error::ErrorKind;
        match self.code {
            1555 | 2067 => ErrorKind::UniqueViolation,
            787 => ErrorKind::ForeignKeyViolation,
            1299 => ErrorKind::NotNullViolation,
            275 => ErrorKind::CheckViolation,
            _ => ErrorKind::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Failure, StoreError, StoreResult};

    fn options(busy_timeout: Duration) -> ThreadOptions {
        ThreadOptions {
            synchronous: "FULL",
            busy_timeout,
        }
    }

    /// A file with one table, a thread on it, and a second connection to watch it.
    fn file() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.sqlite");
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE t (n INTEGER NOT NULL CHECK (n >= 0));
             CREATE TRIGGER no_sevens BEFORE INSERT ON t WHEN NEW.n = 7
             BEGIN SELECT RAISE(ABORT, 'no sevens'); END;",
        )
        .unwrap();
        (dir, path)
    }

    fn rows(path: &Path) -> i64 {
        Connection::open(path)
            .unwrap()
            .query_row("SELECT count(*) FROM t", [], |r| r.get(0))
            .unwrap()
    }

    /// Another writer can take the write lock at once: nobody holds it.
    fn nobody_holds_the_write_lock(path: &Path) -> bool {
        let conn = Connection::open(path).unwrap();
        conn.execute_batch("BEGIN IMMEDIATE; ROLLBACK").is_ok()
    }

    async fn insert(thread: &SqliteThread, values: Vec<i64>) -> StoreResult<()> {
        thread
            .write(move |tx| {
                let mut insert = tx
                    .prepare_cached("INSERT INTO t (n) VALUES (?1)")
                    .map_err(db)?;
                for n in values {
                    insert.execute([n]).map_err(db)?;
                }
                Ok::<_, StoreError>(())
            })
            .await
    }

    #[tokio::test]
    async fn a_failing_statement_rolls_the_whole_batch_back_and_is_the_contents_fault() {
        let (_dir, path) = file();
        let thread = SqliteThread::spawn(&path, options(Duration::from_secs(5))).unwrap();
        insert(&thread, vec![1, 2]).await.unwrap();
        // The trigger refuses the third row: the first two of this batch go too.
        let refused = insert(&thread, vec![3, 4, 7, 8]).await.unwrap_err();
        assert_eq!(refused.failure(), Failure::Content, "{refused}");
        assert!(refused.to_string().contains("no sevens"), "{refused}");
        assert_eq!(rows(&path), 2);
        assert!(nobody_holds_the_write_lock(&path));
        // The thread goes on.
        insert(&thread, vec![5]).await.unwrap();
        assert_eq!(rows(&path), 3);
    }

    #[tokio::test]
    async fn a_locked_database_is_an_outage_after_the_busy_timeout_not_a_hang() {
        let (_dir, path) = file();
        let thread = SqliteThread::spawn(&path, options(Duration::from_millis(200))).unwrap();
        let other = Connection::open(&path).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        let started = std::time::Instant::now();
        let busy = tokio::time::timeout(Duration::from_secs(10), insert(&thread, vec![1]))
            .await
            .expect("answered within the busy timeout, not hung")
            .unwrap_err();
        assert!(started.elapsed() >= Duration::from_millis(150));
        assert_eq!(busy.failure(), Failure::Infrastructure, "{busy}");
        other.execute_batch("ROLLBACK").unwrap();
        insert(&thread, vec![1]).await.unwrap();
        assert_eq!(rows(&path), 1);
    }

    #[tokio::test]
    async fn an_abandoned_caller_leaves_no_transaction_open() {
        let (_dir, path) = file();
        let thread = SqliteThread::spawn(&path, options(Duration::from_secs(5))).unwrap();
        // A caller that gives up while its job runs, half-way through the batch:
        // the job finishes whole.
        let (started, half_way) = oneshot::channel();
        let (go_on, wait) = std::sync::mpsc::channel::<()>();
        let mut slow = Box::pin(thread.write(move |tx| {
            tx.execute("INSERT INTO t (n) VALUES (1)", []).map_err(db)?;
            started.send(()).unwrap();
            wait.recv().unwrap();
            tx.execute("INSERT INTO t (n) VALUES (2)", []).map_err(db)?;
            Ok::<_, StoreError>(())
        }));
        tokio::select! {
            _ = &mut slow => panic!("finished before it was let go on"),
            _ = half_way => {}
        }
        drop(slow);
        go_on.send(()).unwrap();
        // The next job runs after the abandoned one: it committed whole, and nothing
        // is left open (the other connection takes the write lock at once).
        thread.write(|_| Ok::<_, StoreError>(())).await.unwrap();
        assert_eq!(rows(&path), 2);
        assert!(nobody_holds_the_write_lock(&path));
        // A job that ends the thread's transaction under it (as SQLite does by itself
        // on some I/O errors): its caller is told, not told `Ok`, and nothing is left
        // open.
        let gone = thread
            .write(|tx| {
                tx.execute_batch("INSERT INTO t (n) VALUES (3); ROLLBACK")
                    .map_err(db)?;
                Ok::<_, StoreError>(())
            })
            .await
            .unwrap_err();
        assert_eq!(gone.failure(), Failure::Infrastructure, "{gone}");
        assert!(nobody_holds_the_write_lock(&path));
        assert_eq!(rows(&path), 2);
        // A job that panics half-way: rolled back, its caller told, the thread alive.
        let panicked = thread
            .write(|tx| {
                let n = tx.execute("INSERT INTO t (n) VALUES (4)", []).map_err(db)?;
                if n == 1 {
                    panic!("a bug half-way through a batch");
                }
                Ok::<_, StoreError>(())
            })
            .await
            .unwrap_err();
        assert_eq!(panicked.failure(), Failure::Infrastructure);
        assert!(nobody_holds_the_write_lock(&path));
        insert(&thread, vec![5]).await.unwrap();
        assert_eq!(rows(&path), 3);
    }

    /// A job that holds `thread` (running, inside its transaction) until told to go
    /// on, so that the jobs sent after it wait in the channel together.
    async fn hold(
        thread: &SqliteThread,
    ) -> (
        tokio::task::JoinHandle<StoreResult<()>>,
        std::sync::mpsc::Sender<()>,
    ) {
        let (go_on, wait) = std::sync::mpsc::channel::<()>();
        let (started, holding) = oneshot::channel();
        let holder = tokio::spawn({
            let t = thread.clone();
            async move {
                t.write(move |_| {
                    started.send(()).unwrap();
                    wait.recv().unwrap();
                    Ok::<_, StoreError>(())
                })
                .await
            }
        });
        holding.await.unwrap();
        (holder, go_on)
    }

    #[tokio::test]
    async fn write_jobs_waiting_together_commit_together_and_fail_apart() {
        let (_dir, path) = file();
        let thread = SqliteThread::spawn(&path, options(Duration::from_secs(5))).unwrap();
        // Hold the thread with a job of its own until three write jobs wait behind it.
        let (holder, go_on) = hold(&thread).await;
        // The first job's row is not committed yet when the next one runs: they share
        // a transaction (one by one, another connection would already see it).
        let watch = path.clone();
        let first = tokio::spawn({
            let t = thread.clone();
            async move { insert(&t, vec![1]).await }
        });
        let seen_by_another = tokio::spawn({
            let t = thread.clone();
            async move {
                t.write(move |tx| {
                    tx.execute("INSERT INTO t (n) VALUES (2)", []).map_err(db)?;
                    Ok::<_, StoreError>(rows(&watch))
                })
                .await
            }
        });
        let refused = tokio::spawn({
            let t = thread.clone();
            async move { insert(&t, vec![3, 7]).await }
        });
        let last = tokio::spawn({
            let t = thread.clone();
            async move { insert(&t, vec![4]).await }
        });
        while thread.inner.jobs.capacity() > QUEUED_JOBS - 4 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        go_on.send(()).unwrap();
        holder.await.unwrap().unwrap();
        first.await.unwrap().unwrap();
        assert_eq!(
            seen_by_another.await.unwrap().unwrap(),
            0,
            "the group commits once"
        );
        // The failing job is undone alone; the jobs before and after it commit.
        let refused = refused.await.unwrap().unwrap_err();
        assert_eq!(refused.failure(), Failure::Content, "{refused}");
        last.await.unwrap().unwrap();
        let kept: Vec<i64> = Connection::open(&path)
            .unwrap()
            .prepare("SELECT n FROM t ORDER BY n")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(kept, [1, 2, 4]);
        assert!(nobody_holds_the_write_lock(&path));
    }

    #[tokio::test]
    async fn one_file_one_thread() {
        let (_dir, path) = file();
        let a = SqliteThread::for_file(&path, options(Duration::from_secs(5))).unwrap();
        let b = SqliteThread::for_file(&path, options(Duration::from_secs(5))).unwrap();
        assert!(Arc::ptr_eq(&a.inner, &b.inner));
        let (_dir2, other) = file();
        let c = SqliteThread::for_file(&other, options(Duration::from_secs(5))).unwrap();
        assert!(!Arc::ptr_eq(&a.inner, &c.inner));
    }

    /// The printed handle names its file and how it was opened (a store's `Debug`
    /// shows it).
    #[test]
    fn a_thread_prints_its_file_and_options() {
        let (_dir, path) = file();
        let thread = SqliteThread::spawn(&path, options(Duration::from_secs(5))).unwrap();
        let printed = format!("{thread:?}");
        assert!(printed.starts_with("SqliteThread"), "{printed}");
        assert!(printed.contains("t.sqlite"), "{printed}");
        assert!(printed.contains("synchronous: \"FULL\""), "{printed}");
    }

    /// A file whose last handle went is forgotten by the next opener of any file:
    /// the table of threads does not grow with every file ever opened.
    #[test]
    fn a_thread_that_ended_leaves_the_table_of_threads() {
        let (_dir, path) = file();
        let key = std::fs::canonicalize(&path).unwrap();
        let known = |key: &Path| {
            let threads = THREADS.lock().unwrap_or_else(|e| e.into_inner());
            threads.as_ref().is_some_and(|t| t.contains_key(key))
        };
        let thread = SqliteThread::for_file(&path, options(Duration::from_secs(5))).unwrap();
        assert!(known(&key));
        drop(thread);
        let (_dir2, other) = file();
        let _other = SqliteThread::for_file(&other, options(Duration::from_secs(5))).unwrap();
        assert!(!known(&key), "a thread gone is still in the table");
    }

    /// Seventeen write jobs waiting: the first GROUP_MAX share one transaction (none
    /// sees another's row committed), the last is a group of its own after them.
    #[tokio::test]
    async fn a_group_takes_at_most_group_max_jobs() {
        let (_dir, path) = file();
        let thread = SqliteThread::spawn(&path, options(Duration::from_secs(5))).unwrap();
        let (holder, go_on) = hold(&thread).await;
        let waiting = GROUP_MAX + 1;
        let jobs: Vec<_> = (0..waiting)
            .map(|n| {
                let t = thread.clone();
                let watch = path.clone();
                tokio::spawn(async move {
                    // From 100: the table refuses a 7.
                    t.write(move |tx| {
                        tx.execute("INSERT INTO t (n) VALUES (?1)", [100 + n as i64])
                            .map_err(db)?;
                        Ok::<_, StoreError>(rows(&watch))
                    })
                    .await
                })
            })
            .collect();
        while thread.inner.jobs.capacity() > QUEUED_JOBS - waiting {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        go_on.send(()).unwrap();
        holder.await.unwrap().unwrap();
        let mut seen = Vec::new();
        for job in jobs {
            seen.push(job.await.unwrap().unwrap());
        }
        seen.sort_unstable();
        let mut expected = vec![0; GROUP_MAX];
        expected.push(GROUP_MAX as i64);
        assert_eq!(
            seen, expected,
            "committed rows each job saw from another connection"
        );
        assert_eq!(rows(&path), waiting as i64);
    }

    /// The connection's own fsync policy for an ordinary group, `FULL` for one with a
    /// durable job, and the policy back after it.
    #[tokio::test]
    async fn a_durable_job_commits_with_synchronous_full_and_the_policy_comes_back() {
        let (_dir, path) = file();
        let normal = ThreadOptions {
            synchronous: "NORMAL",
            busy_timeout: Duration::from_secs(5),
        };
        let thread = SqliteThread::spawn(&path, normal).unwrap();
        let level = |durable: bool| {
            thread.write_with(durable, |tx| {
                tx.query_row("PRAGMA synchronous", [], |r| r.get::<_, i64>(0))
                    .map_err(|e| StoreError::from(db(e)))
            })
        };
        // PRAGMA synchronous reads 1 for NORMAL, 2 for FULL.
        assert_eq!(level(false).await.unwrap(), 1);
        assert_eq!(level(true).await.unwrap(), 2);
        assert_eq!(level(false).await.unwrap(), 1);
    }

    /// One connection for the thread's life: what a job leaves on it (a temporary
    /// table, the prepared statements) is there for the next job.
    #[tokio::test]
    async fn the_connection_outlives_its_jobs() {
        let (_dir, path) = file();
        let thread = SqliteThread::spawn(&path, options(Duration::from_secs(5))).unwrap();
        let run = |sql: &'static str| {
            thread.write(move |tx| tx.execute_batch(sql).map_err(|e| StoreError::from(db(e))))
        };
        run("CREATE TEMP TABLE kept (n INTEGER)").await.unwrap();
        run("INSERT INTO kept (n) VALUES (1)").await.unwrap();
        run("INSERT INTO kept (n) VALUES (2)").await.unwrap();
    }

    /// SQLite's answers through [`db`] read as sqlx's own SQLite errors do: the
    /// extended code, SQLite's message, and the constraint's kind.
    #[test]
    fn sqlite_answers_keep_their_code_message_and_kind() {
        use sqlx::error::ErrorKind;
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(
            "PRAGMA foreign_keys = ON;
             CREATE TABLE p (id INTEGER PRIMARY KEY);
             CREATE TABLE c (id INTEGER PRIMARY KEY, u TEXT UNIQUE,
                             p INTEGER REFERENCES p (id), nn TEXT NOT NULL DEFAULT 'x',
                             ck INTEGER CHECK (ck >= 0));
             CREATE TRIGGER no_sevens BEFORE INSERT ON c WHEN NEW.id = 7
             BEGIN SELECT RAISE(ABORT, 'no sevens'); END;
             INSERT INTO p (id) VALUES (1);
             INSERT INTO c (id, u, p) VALUES (1, 'a', 1);",
        )
        .unwrap();
        let cases = [
            (
                "INSERT INTO c (id) VALUES (1)",
                "1555",
                "UNIQUE constraint failed: c.id",
                ErrorKind::UniqueViolation,
            ),
            (
                "INSERT INTO c (id, u) VALUES (2, 'a')",
                "2067",
                "UNIQUE constraint failed: c.u",
                ErrorKind::UniqueViolation,
            ),
            (
                "INSERT INTO c (id, p) VALUES (3, 9)",
                "787",
                "FOREIGN KEY constraint failed",
                ErrorKind::ForeignKeyViolation,
            ),
            (
                "INSERT INTO c (id, nn) VALUES (4, NULL)",
                "1299",
                "NOT NULL constraint failed: c.nn",
                ErrorKind::NotNullViolation,
            ),
            (
                "INSERT INTO c (id, ck) VALUES (5, -1)",
                "275",
                "CHECK constraint failed: ck >= 0",
                ErrorKind::CheckViolation,
            ),
            (
                "INSERT INTO c (id) VALUES (7)",
                "1811",
                "no sevens",
                ErrorKind::Other,
            ),
        ];
        for (sql, code, message, kind) in cases {
            let e = db(conn.execute(sql, []).unwrap_err());
            let answer = e.as_database_error().expect("a database error");
            assert_eq!(answer.code().as_deref(), Some(code), "{sql}");
            assert_eq!(answer.message(), message, "{sql}");
            assert_eq!(answer.kind(), kind, "{sql}");
        }
    }
}
