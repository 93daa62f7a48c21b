//! What really differs between the SQL backends, in one place per backend (each
//! backend folder's `dialect.rs`: [`sqlite`](super::sqlite::dialect),
//! [`postgres`](super::postgres::dialect), [`mysql`](super::mysql::dialect)): placeholders, how a time is bound and read
//! back, the casts a user's table may need, how a write transaction opens, how rows
//! affected and new ids are reported, and how error codes are read (infrastructure or
//! content, see [`super::Failure`]). Everything else — the SQL the engine store, the
//! HTTP-edge store and the monitor's queries share — is written once, with `?`
//! placeholders, and runs through [`Sql`] on any backend.
//!
//! Why our own small value layer and not `sqlx::Any`: `Any` has no chrono, and a time
//! is exactly what differs (TEXT on SQLite, `timestamptz` on PostgreSQL, UTC
//! `DATETIME` on MySQL). Statements bind [`BindValue`]s and read [`Row`]s of the
//! [`Kind`]s the caller names; each backend decodes a column as its own type for that
//! kind. The hot batch writes stay native per backend (see `batch.rs` and each store).

use std::borrow::Cow;

use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use serde::Serialize;
use sqlx::query::Query;
use sqlx::{Database, Executor, IntoArguments, Pool};

use super::deadline::{Tripwire, RELEASE_GRACE};
use super::Backend;

/// The stored timestamp format of TEXT time columns (SQLite): fixed-width UTC with
/// microseconds, so that text order is time order. Written here only.
const TEXT_TIME_FORMAT: &str = "%Y-%m-%dT%H:%M:%S%.6fZ";

/// A time as the engine stores it in a TEXT column.
pub fn text_time(t: DateTime<Utc>) -> String {
    t.format(TEXT_TIME_FORMAT).to_string()
}

/// A TEXT time column read back: the engine's form (any RFC 3339), or SQLite's
/// `YYYY-MM-DD HH:MM:SS[.fff]` (a user's own table written with `datetime()`).
pub(crate) fn parse_text_time(s: &str) -> Option<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Some(t.with_timezone(&Utc));
    }
    NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f")
        .ok()
        .map(|n| n.and_utc())
}

/// What a column is read as; each backend decodes it from its own column type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Int,
    Float,
    Text,
    Bytes,
    /// Unreadable stored text reads as NULL rather than failing the statement.
    Time,
    Bool,
    Json,
}

/// A value bound to a statement, kept as data so that `EXPLAIN` (the bench and the
/// plan tests) runs exactly the SQL and values a poll runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum BindValue {
    Time(DateTime<Utc>),
    Int(i64),
    Text(String),
    /// One value per element: an array on PostgreSQL (`= ANY(?)`), one placeholder
    /// each elsewhere (see [`Sql::in_list`]).
    TextList(Vec<String>),
    Float(f64),
    Bytes(Vec<u8>),
    Bool(bool),
    Json(serde_json::Value),
    Null(Kind),
}

/// The kind a NULL of this Rust type is bound as (PostgreSQL types its NULLs).
pub trait NullKind {
    const KIND: Kind;
}

/// Each Rust type a statement binds: its [`BindValue`], and the [`Kind`] of its NULL.
macro_rules! bind_from {
    ($($t:ty => |$v:ident| $variant:ident($value:expr), $kind:ident;)*) => {$(
        impl From<$t> for BindValue {
            fn from($v: $t) -> Self {
                BindValue::$variant($value)
            }
        }
        impl NullKind for $t {
            const KIND: Kind = Kind::$kind;
        }
    )*};
}

bind_from! {
    &str => |s| Text(s.to_string()), Text;
    &String => |s| Text(s.clone()), Text;
    i64 => |i| Int(i), Int;
    f64 => |f| Float(f), Float;
    DateTime<Utc> => |t| Time(t), Time;
    &[u8] => |b| Bytes(b.to_vec()), Bytes;
    bool => |b| Bool(b), Bool;
    &serde_json::Value => |j| Json(j.clone()), Json;
}

impl<T: Into<BindValue> + NullKind> From<Option<T>> for BindValue {
    fn from(v: Option<T>) -> Self {
        v.map_or(BindValue::Null(T::KIND), Into::into)
    }
}

/// The values of one statement, in placeholder order.
#[macro_export]
macro_rules! binds {
    ($($v:expr),* $(,)?) => {
        [$($crate::store::dialect::BindValue::from($v)),*]
    };
}
pub use crate::binds;

/// One decoded column.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    Null,
    Int(i64),
    Float(f64),
    Text(String),
    Bytes(Vec<u8>),
    Time(DateTime<Utc>),
    Bool(bool),
    Json(serde_json::Value),
}

impl Cell {
    pub fn of<T>(v: Option<T>, f: impl FnOnce(T) -> Cell) -> Cell {
        v.map_or(Cell::Null, f)
    }
}

/// One row, its columns decoded as the statement's [`Kind`]s asked.
#[derive(Debug, Clone, PartialEq)]
pub struct Row(pub Vec<Cell>);

fn not_as(index: usize, what: &str) -> sqlx::Error {
    sqlx::Error::ColumnDecode {
        index: index.to_string(),
        source: format!("NULL or not {what}").into(),
    }
}

/// `name(i)`: column `i` if it decoded as `variant`, else None (NULL).
macro_rules! readers {
    ($($(#[$doc:meta])* $name:ident: $variant:ident -> $t:ty;)*) => {$(
        $(#[$doc])*
        pub fn $name(&self, i: usize) -> Option<$t> {
            match self.cell(i) {
                Cell::$variant(v) => Some(v),
                _ => None,
            }
            .cloned()
        }
    )*};
}

impl Row {
    fn cell(&self, i: usize) -> &Cell {
        self.0.get(i).unwrap_or(&Cell::Null)
    }
    readers! {
        opt_text: Text -> String;
        opt_int: Int -> i64;
        opt_float: Float -> f64;
        opt_bytes: Bytes -> Vec<u8>;
        /// A time; NULL (or unreadable stored text) is None.
        time: Time -> DateTime<Utc>;
        opt_bool: Bool -> bool;
        json: Json -> serde_json::Value;
    }
    pub fn text(&self, i: usize) -> Result<String, sqlx::Error> {
        self.opt_text(i).ok_or_else(|| not_as(i, "text"))
    }
    pub fn int(&self, i: usize) -> Result<i64, sqlx::Error> {
        self.opt_int(i).ok_or_else(|| not_as(i, "an integer"))
    }
    pub fn bool(&self, i: usize) -> Result<bool, sqlx::Error> {
        self.opt_bool(i).ok_or_else(|| not_as(i, "a boolean"))
    }
    /// A NOT NULL time; unreadable stored text reads as the epoch.
    pub fn at(&self, i: usize) -> DateTime<Utc> {
        self.time(i).unwrap_or(DateTime::<Utc>::UNIX_EPOCH)
    }
}

/// What a statement changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Done {
    pub rows_affected: u64,
    /// The id an auto-increment insert produced (SQLite, MySQL; PostgreSQL says it
    /// with `RETURNING`).
    pub last_insert_id: Option<i64>,
}

/// Run a whole transaction again when the database rolled it back as a deadlock
/// victim (InnoDB, when several transactions insert the same new key at once; see
/// [`is_deadlock`]) or it rolled itself back as a lost race
/// ([`StoreError::LostRace`](super::StoreError::LostRace), or a row a purge took
/// between two statements, [`StoreError::RowVanished`](super::StoreError::RowVanished)):
/// the next try reads what the other writer did. Other errors
/// pass straight through, and after 8 tries these do too (an infrastructure failure:
/// the delivery is retried later).
pub(crate) async fn retrying<T, F, Fut>(mut attempt: F) -> super::StoreResult<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = super::StoreResult<T>>,
{
    let mut tries = 0u32;
    loop {
        match attempt().await {
            Err(e) if tries < 8 && retried_whole(&e) => {
                tries += 1;
                tracing::debug!(tries, error = %e, "retrying a deadlocked or raced transaction");
                let pause = std::time::Duration::from_millis(5 * u64::from(tries));
                tokio::time::sleep(pause).await;
            }
            other => return other,
        }
    }
}

/// Roll a batch's transaction back as a lost race
/// ([`StoreError::LostRace`](super::StoreError::LostRace)): one of its writes took fewer
/// rows than it decided, another writer got in between; [`retrying`] runs it again.
pub(crate) async fn lost_race<D: Database, T>(
    tx: sqlx::Transaction<'_, D>,
    what: &'static str,
) -> super::StoreResult<T> {
    tx.rollback().await?;
    Err(super::StoreError::LostRace { what })
}

/// The engine's pool on a server (PostgreSQL, MariaDB): 16 connections, a wait for
/// one bounded by `acquire_timeout`, and the two hooks that keep a connection whose
/// way went silent out of use (see `store/deadline.rs`):
///
/// - handed back after its call ran out of time (its statement's answer never came),
///   a connection must settle what it still owes within [`RELEASE_GRACE`] — a
///   no-op for one that owes nothing — or it is closed hard, never pinged and
///   parked forever, never reused;
/// - idle in the pool when a deadline fired, it is closed at its next acquire
///   rather than handed out: each would cost another whole deadline.
pub(crate) fn server_pool<D: Database>(
    deadlines: &crate::deadlines::Deadlines,
    tripwire: std::sync::Arc<Tripwire>,
) -> sqlx::pool::PoolOptions<D> {
    sqlx::pool::PoolOptions::new()
        .max_connections(16)
        .acquire_timeout(deadlines.acquire_timeout)
        // No ping before every transaction (a round trip each): a connection the
        // server dropped fails its first statement instead, the delivery is
        // retried, and sqlx discards the connection when it comes back.
        .test_before_acquire(false)
        .before_acquire(move |_, meta| {
            let suspect = tripwire.idle_across_a_firing(meta.idle_for);
            Box::pin(async move { Ok(!suspect) })
        })
        .after_release(|conn, _| {
            Box::pin(async move {
                // `flush` reads what the connection still owes (the answer of a
                // statement whose caller gave up) and returns at once when it owes
                // nothing; sqlx's own ping after this hook has no deadline.
                match tokio::time::timeout(RELEASE_GRACE, sqlx::Connection::flush(conn)).await {
                    Ok(Ok(())) => Ok(true),
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "a connection whose call ran out of time stayed silent: closed",
                    ))),
                }
            })
        })
}

/// The dashboard's pool (its read-only sessions are set in each backend's `readonly.rs`):
/// two connections, and a poll that waits 3 s for one fails rather than queue.
pub(crate) fn dashboard_pool<D: Database>() -> sqlx::pool::PoolOptions<D> {
    sqlx::pool::PoolOptions::new()
        .max_connections(2)
        .acquire_timeout(std::time::Duration::from_secs(3))
}

/// InnoDB deadlock (1213) or lock wait timeout (1205): the transaction was rolled
/// back whole and can simply run again. (MySQL's answer, read here beside the retry
/// that needs it, so the shared SQL does not import a backend.)
pub(crate) fn is_deadlock(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            matches!(db.code().as_deref(), Some("40001") | Some("HY000"))
                && (db.message().contains("Deadlock") || db.message().contains("Lock wait"))
        }
        _ => false,
    }
}

/// A deadlock victim or a lost race: see [`retrying`]. The deadlock is InnoDB's (MySQL,
/// MariaDB), read from its code and message by [`is_deadlock`].
fn retried_whole(e: &super::StoreError) -> bool {
    match e {
        super::StoreError::Db(db) => is_deadlock(db),
        super::StoreError::RowVanished { .. } | super::StoreError::LostRace { .. } => true,
        _ => false,
    }
}

/// What a backend's catalog and planner offer the dashboard: a row estimate that
/// needs no scan, and `EXPLAIN` in JSON.
#[derive(Debug)]
pub struct Catalog {
    /// One row: the estimate of the table bound as [`Catalog::estimate_name`].
    pub estimate_sql: &'static str,
    pub estimate_kinds: &'static [Kind],
    /// How the statement names the table.
    pub estimate_name: fn(&str) -> String,
    /// The estimate from that row; None when the catalog does not know.
    pub read_estimate: fn(&Row) -> Option<i64>,
    /// A capped count runs before the estimate (SQLite: a capped count is cheap, and
    /// `sqlite_stat1` is only as fresh as the last `ANALYZE`).
    pub count_first: bool,
    /// The statement under `EXPLAIN`, returning the plan as one JSON column; None
    /// when the dashboard does not explain on this backend.
    pub explain: fn(&str, bool) -> Option<String>,
}

/// One backend's differences. Implemented for `sqlx::Sqlite`, `Postgres` and `MySql`
/// in this module's backend files; everything generic goes through [`Pooled`].
pub(crate) trait Dialect: Database {
    const BACKEND: Backend;
    /// The statement that opens a write transaction.
    const BEGIN: &'static str;
    /// The generic SQL's `?` placeholders as this backend writes them.
    fn placeholders(sql: &str) -> Cow<'_, str> {
        Cow::Borrowed(sql)
    }
    /// An identifier, quoted.
    fn quote(identifier: &str) -> String {
        format!("\"{identifier}\"")
    }
    /// A column of a user's table, cast so that it reads as `kind`.
    fn cast(identifier: &str, _kind: Kind) -> String {
        Self::quote(identifier)
    }
    /// `a <op> b` true when both are NULL or both equal.
    const NULL_SAFE_EQ: &'static str = "IS NOT DISTINCT FROM";
    /// What a read that decides a write appends to lock the row it read.
    const LOCK_READ: &'static str = "";
    /// `INSERT` that skips a row whose key exists: `into` is `INTO t (…) VALUES (…)`.
    fn insert_or_skip(into: &str) -> String {
        format!("INSERT {into} ON CONFLICT DO NOTHING")
    }
    fn bind<'q>(
        query: Query<'q, Self, Self::Arguments<'q>>,
        value: &'q BindValue,
    ) -> Query<'q, Self, Self::Arguments<'q>>;
    fn cell(row: &Self::Row, index: usize, kind: Kind) -> Result<Cell, sqlx::Error>;
    fn done(result: &Self::QueryResult) -> Done;
    const CATALOG: Catalog;
}

/// A backend's connections behind one interface: the generic SQL of the engine
/// store, the edge store and the monitor runs here.
#[async_trait]
pub trait Sql: Send + Sync {
    fn backend(&self) -> Backend;
    /// See [`Dialect::quote`].
    fn quote(&self, identifier: &str) -> String;
    /// See [`Dialect::cast`].
    fn cast(&self, identifier: &str, kind: Kind) -> String;
    fn catalog(&self) -> &'static Catalog;
    /// See [`Dialect::NULL_SAFE_EQ`].
    fn null_safe_eq(&self) -> &'static str;
    /// See [`Dialect::LOCK_READ`].
    fn lock_read(&self) -> &'static str;
    /// See [`Dialect::insert_or_skip`].
    fn insert_or_skip(&self, into: &str) -> String;
    /// Generic SQL in this backend's placeholders (done once for a statement kept).
    fn native(&self, sql: &str) -> String;
    /// `column IN` a list of `n` values bound as one [`BindValue::TextList`].
    fn in_list(&self, column: &str, n: usize) -> String {
        in_list(self.backend(), column, n)
    }
    async fn rows(
        &self,
        sql: &str,
        binds: &[BindValue],
        kinds: &[Kind],
    ) -> Result<Vec<Row>, sqlx::Error>;
    async fn execute(&self, sql: &str, binds: &[BindValue]) -> Result<Done, sqlx::Error>;
    /// An insert into a table with an `id` key, in a statement of its own: the new id
    /// (see [`SqlTx::insert`]).
    async fn insert(&self, sql: &str, binds: &[BindValue]) -> Result<i64, sqlx::Error> {
        match returning_id(self.backend(), sql) {
            Some(returning) => self
                .rows(&returning, binds, &[Kind::Int])
                .await?
                .first()
                .ok_or(sqlx::Error::RowNotFound)?
                .int(0),
            None => new_id(self.execute(sql, binds).await?),
        }
    }
    /// A write transaction ([`Dialect::BEGIN`]).
    async fn begin(&self) -> Result<Box<dyn SqlTx>, sqlx::Error>;
}

/// The [`Store`](super::Store) methods each SQL store answers alike from its `pool`,
/// `url` and (unless it has a durability of its own) `durability` fields.
macro_rules! pooled_store {
    () => {
        $crate::store::dialect::pooled_store!(pool_and_url);

        fn durability(&self) -> $crate::store::Durability {
            self.durability
        }
    };
    (pool_and_url) => {
        fn sql(&self) -> $crate::store::SqlHandle {
            $crate::store::SqlHandle::of(self.pool.clone())
        }

        fn redacted_url(&self) -> String {
            $crate::store::redact_url(&self.url)
        }
    };
}
pub(crate) use pooled_store;

/// See [`Sql::in_list`].
pub(crate) fn in_list(backend: Backend, column: &str, n: usize) -> String {
    match backend {
        Backend::Postgres => format!("{column} = ANY(?)"),
        _ => format!("{column} IN ({})", vec!["?"; n.max(1)].join(", ")),
    }
}

/// The first row, if any.
pub async fn first(
    sql: &(impl Sql + ?Sized),
    query: &str,
    binds: &[BindValue],
    kinds: &[Kind],
) -> Result<Option<Row>, sqlx::Error> {
    Ok(sql.rows(query, binds, kinds).await?.into_iter().next())
}

/// Each row of `query`, read by `row`.
pub async fn each<T, E: From<sqlx::Error>>(
    sql: &(impl Sql + ?Sized),
    query: &str,
    binds: &[BindValue],
    kinds: &[Kind],
    row: impl Fn(&Row) -> Result<T, E>,
) -> Result<Vec<T>, E> {
    sql.rows(query, binds, kinds)
        .await?
        .iter()
        .map(row)
        .collect()
}

/// The insert that returns the new id as a row, where the backend says it that way
/// (PostgreSQL); None where the statement's result carries it.
fn returning_id(backend: Backend, insert: &str) -> Option<String> {
    (backend == Backend::Postgres).then(|| format!("{insert} RETURNING id"))
}

/// The id an insert's result carries (SQLite, MySQL).
fn new_id(done: Done) -> Result<i64, sqlx::Error> {
    done.last_insert_id.ok_or(sqlx::Error::RowNotFound)
}

/// An open write transaction; dropped without [`SqlTx::commit`], it rolls back.
#[async_trait]
pub trait SqlTx: Send {
    fn backend(&self) -> Backend;
    async fn rows(
        &mut self,
        sql: &str,
        binds: &[BindValue],
        kinds: &[Kind],
    ) -> Result<Vec<Row>, sqlx::Error>;
    async fn execute(&mut self, sql: &str, binds: &[BindValue]) -> Result<Done, sqlx::Error>;
    /// The one row a statement must return.
    async fn one(
        &mut self,
        sql: &str,
        binds: &[BindValue],
        kinds: &[Kind],
    ) -> Result<Row, sqlx::Error> {
        self.rows(sql, binds, kinds)
            .await?
            .into_iter()
            .next()
            .ok_or(sqlx::Error::RowNotFound)
    }
    /// An insert into a table with an `id` key: the new id (`RETURNING id` on
    /// PostgreSQL, the connection's last insert id elsewhere).
    async fn insert(&mut self, sql: &str, binds: &[BindValue]) -> Result<i64, sqlx::Error> {
        match returning_id(self.backend(), sql) {
            Some(returning) => self.one(&returning, binds, &[Kind::Int]).await?.int(0),
            None => new_id(self.execute(sql, binds).await?),
        }
    }
    async fn commit(self: Box<Self>) -> Result<(), sqlx::Error>;
    async fn rollback(self: Box<Self>) -> Result<(), sqlx::Error>;
}

/// A pool of one backend, seen as [`Sql`].
#[derive(Debug, Clone)]
pub(crate) struct Pooled<D: Database>(pub Pool<D>);

struct Tx<D: Database>(sqlx::Transaction<'static, D>);

fn bound<'q, D: Dialect>(sql: &'q str, binds: &'q [BindValue]) -> Query<'q, D, D::Arguments<'q>> {
    binds.iter().fold(sqlx::query(sql), D::bind)
}

/// Generic SQL read on `executor`, each row decoded as `kinds`: a pool, a
/// [`SqlTx`]'s transaction, or a batch path's own native transaction.
pub(crate) async fn fetch<'c, D, E>(
    executor: E,
    sql: &str,
    binds: &[BindValue],
    kinds: &[Kind],
) -> Result<Vec<Row>, sqlx::Error>
where
    D: Dialect,
    E: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
{
    let sql = D::placeholders(sql);
    let rows = bound(&sql, binds).fetch_all(executor).await?;
    rows.iter()
        .map(|r| {
            let cells = kinds.iter().enumerate().map(|(i, k)| D::cell(r, i, *k));
            Ok(Row(cells.collect::<Result<_, _>>()?))
        })
        .collect()
}

/// Generic SQL written on `executor` (see [`fetch`]).
pub(crate) async fn execute<'c, D, E>(
    executor: E,
    sql: &str,
    binds: &[BindValue],
) -> Result<Done, sqlx::Error>
where
    D: Dialect,
    E: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
{
    let sql = D::placeholders(sql);
    Ok(D::done(&bound(&sql, binds).execute(executor).await?))
}

#[async_trait]
impl<D> Sql for Pooled<D>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
{
    fn backend(&self) -> Backend {
        D::BACKEND
    }
    fn quote(&self, identifier: &str) -> String {
        D::quote(identifier)
    }
    fn cast(&self, identifier: &str, kind: Kind) -> String {
        D::cast(identifier, kind)
    }
    fn catalog(&self) -> &'static Catalog {
        &D::CATALOG
    }
    fn null_safe_eq(&self) -> &'static str {
        D::NULL_SAFE_EQ
    }
    fn lock_read(&self) -> &'static str {
        D::LOCK_READ
    }
    fn insert_or_skip(&self, into: &str) -> String {
        D::insert_or_skip(into)
    }
    fn native(&self, sql: &str) -> String {
        D::placeholders(sql).into_owned()
    }
    async fn rows(
        &self,
        sql: &str,
        binds: &[BindValue],
        kinds: &[Kind],
    ) -> Result<Vec<Row>, sqlx::Error> {
        fetch(&self.0, sql, binds, kinds).await
    }
    async fn execute(&self, sql: &str, binds: &[BindValue]) -> Result<Done, sqlx::Error> {
        execute(&self.0, sql, binds).await
    }
    async fn begin(&self) -> Result<Box<dyn SqlTx>, sqlx::Error> {
        Ok(Box::new(Tx(self.0.begin_with(D::BEGIN).await?)))
    }
}

#[async_trait]
impl<D> SqlTx for Tx<D>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
{
    fn backend(&self) -> Backend {
        D::BACKEND
    }
    async fn rows(
        &mut self,
        sql: &str,
        binds: &[BindValue],
        kinds: &[Kind],
    ) -> Result<Vec<Row>, sqlx::Error> {
        fetch(&mut *self.0, sql, binds, kinds).await
    }
    async fn execute(&mut self, sql: &str, binds: &[BindValue]) -> Result<Done, sqlx::Error> {
        execute(&mut *self.0, sql, binds).await
    }
    async fn commit(self: Box<Self>) -> Result<(), sqlx::Error> {
        self.0.commit().await
    }
    async fn rollback(self: Box<Self>) -> Result<(), sqlx::Error> {
        self.0.rollback().await
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::{StoreError, StoreResult};
    use super::*;

    #[test]
    fn stored_timestamps_sort_as_text_and_read_back() {
        let a = DateTime::from_timestamp(1_700_000_000, 5_000).unwrap();
        let b = DateTime::from_timestamp(1_700_000_000, 50_000_000).unwrap();
        assert!(text_time(a) < text_time(b));
        assert_eq!(parse_text_time(&text_time(b)), Some(b));
        assert_eq!(text_time(b), "2023-11-14T22:13:20.050000Z");
    }

    #[test]
    fn reads_both_timestamp_forms() {
        let engine = parse_text_time("2026-11-30T04:12:03.000000Z").unwrap();
        let sqlite = parse_text_time("2026-11-30 04:12:03").unwrap();
        assert_eq!(engine, sqlite);
        assert!(parse_text_time("yesterday").is_none());
    }

    /// A database's answer as the driver hands it over, with the code and message a
    /// test chooses (the real ones need a server in that state).
    #[derive(Debug)]
    pub(crate) struct Answer {
        pub code: &'static str,
        pub message: &'static str,
    }

    impl std::fmt::Display for Answer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{} ({})", self.message, self.code)
        }
    }

    impl std::error::Error for Answer {}

    type AnyError = dyn std::error::Error + Send + Sync + 'static;

    impl sqlx::error::DatabaseError for Answer {
        fn message(&self) -> &str {
            self.message
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.code))
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
        fn as_error(&self) -> &AnyError {
            self
        }
        fn as_error_mut(&mut self) -> &mut AnyError {
            self
        }
        fn into_error(self: Box<Self>) -> Box<AnyError> {
            self
        }
    }

    /// A backend's error classes, each code of `table` against what `failure` says.
    pub(crate) fn assert_classes<C: Copy + std::fmt::Debug + PartialEq, const N: usize>(
        table: [(C, super::super::Failure); N],
        failure: impl Fn(C) -> super::super::Failure,
    ) {
        assert_eq!(table.map(|(code, _)| (code, failure(code))), table);
    }

    pub(crate) fn answer(code: &'static str, message: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Answer { code, message }))
    }

    /// `retrying` over an attempt that fails with `error()` `failures` times, then
    /// succeeds: the attempts made and the result.
    async fn retried(failures: u32, error: impl Fn() -> StoreError) -> (u32, StoreResult<u32>) {
        let attempts = std::sync::atomic::AtomicU32::new(0);
        let run = retrying(|| {
            let n = attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            let r = if n <= failures { Err(error()) } else { Ok(n) };
            async move { r }
        });
        // A retry without end is a failure of this test, not a hang of the suite.
        let r = tokio::time::timeout(std::time::Duration::from_secs(10), run)
            .await
            .expect("retrying gave up within 10 s");
        (attempts.into_inner(), r)
    }

    #[tokio::test]
    async fn a_lost_race_a_vanished_row_or_a_deadlock_is_run_again_eight_times_at_most() {
        let lost = || StoreError::LostRace { what: "a claim" };
        let vanished = || StoreError::RowVanished { key: "k".into() };
        let deadlock = || StoreError::Db(answer("40001", "Deadlock found when trying to get lock"));
        for error in [&lost as &dyn Fn() -> StoreError, &vanished, &deadlock] {
            let (attempts, r) = retried(3, error).await;
            assert_eq!((attempts, r.unwrap()), (4, 4), "{}", error());
        }
        // Eight retries, each pausing 5 ms longer than the one before (5 + 10 + … + 40):
        // the ninth failure is the caller's.
        let started = std::time::Instant::now();
        let (attempts, r) = retried(9, lost).await;
        assert!(matches!(r, Err(StoreError::LostRace { .. })), "{r:?}");
        assert_eq!(attempts, 9);
        assert!(
            started.elapsed() >= std::time::Duration::from_millis(180),
            "{:?}",
            started.elapsed()
        );
        let (attempts, r) = retried(8, lost).await;
        assert_eq!((attempts, r.unwrap()), (9, 9));
        // Anything else passes straight through, at the first try.
        for error in [
            &(|| StoreError::Internal("a bug")) as &dyn Fn() -> StoreError,
            &|| StoreError::Db(sqlx::Error::PoolTimedOut),
            &|| StoreError::Db(answer("40001", "could not serialize access")),
        ] {
            let (attempts, r) = retried(3, error).await;
            assert_eq!(attempts, 1, "{}", error());
            assert!(r.is_err());
        }
    }

    #[test]
    fn the_engines_pool_and_the_dashboards_are_sized_as_documented() {
        let deadlines = crate::deadlines::Deadlines::default();
        let engine = server_pool::<sqlx::Postgres>(&deadlines, Default::default());
        assert_eq!(engine.get_max_connections(), 16);
        assert_eq!(engine.get_acquire_timeout(), deadlines.acquire_timeout);
        assert!(!engine.get_test_before_acquire());
        let dashboard = dashboard_pool::<sqlx::MySql>();
        assert_eq!(dashboard.get_max_connections(), 2);
        assert_eq!(
            dashboard.get_acquire_timeout(),
            std::time::Duration::from_secs(3)
        );
    }

    /// Each backend's SQL words through [`Sql`], as the generic store and the
    /// dashboard get them (lazy pools: nothing here connects).
    #[tokio::test]
    async fn each_backend_writes_its_own_sql() {
        let sqlite: Pooled<sqlx::Sqlite> =
            Pooled(sqlx::SqlitePool::connect_lazy("sqlite::memory:").unwrap());
        let postgres: Pooled<sqlx::Postgres> =
            Pooled(sqlx::PgPool::connect_lazy("postgres://u@127.0.0.1:1/none").unwrap());
        let mysql: Pooled<sqlx::MySql> =
            Pooled(sqlx::MySqlPool::connect_lazy("mysql://u@127.0.0.1:1/none").unwrap());
        let into = "INTO t (k) VALUES (?)";
        let generic = "SELECT a FROM t WHERE k = ? AND n > ?";
        let words = |sql: &dyn Sql| {
            (
                sql.backend(),
                sql.quote("user table"),
                [Kind::Int, Kind::Text, Kind::Time, Kind::Bool, Kind::Json]
                    .map(|k| sql.cast("c", k)),
                sql.null_safe_eq(),
                sql.lock_read(),
                sql.insert_or_skip(into),
                sql.native(generic),
                sql.in_list("k", 3),
                sql.in_list("k", 0),
            )
        };
        assert_eq!(
            words(&sqlite),
            (
                Backend::Sqlite,
                "\"user table\"".to_string(),
                ["\"c\"", "\"c\"", "\"c\"", "\"c\"", "\"c\""].map(String::from),
                "IS",
                "",
                "INSERT INTO t (k) VALUES (?) ON CONFLICT DO NOTHING".to_string(),
                generic.to_string(),
                "k IN (?, ?, ?)".to_string(),
                "k IN (?)".to_string(),
            )
        );
        assert_eq!(
            words(&postgres),
            (
                Backend::Postgres,
                "\"user table\"".to_string(),
                [
                    "\"c\"::bigint",
                    "\"c\"::text",
                    "\"c\"::timestamptz",
                    "\"c\"::boolean",
                    "\"c\"",
                ]
                .map(String::from),
                "IS NOT DISTINCT FROM",
                "",
                "INSERT INTO t (k) VALUES (?) ON CONFLICT DO NOTHING".to_string(),
                "SELECT a FROM t WHERE k = $1 AND n > $2".to_string(),
                "k = ANY(?)".to_string(),
                "k = ANY(?)".to_string(),
            )
        );
        assert_eq!(
            words(&mysql),
            (
                Backend::Mysql,
                "`user table`".to_string(),
                [
                    "CAST(`c` AS SIGNED)",
                    "CAST(`c` AS CHAR)",
                    "`c`",
                    "CAST(`c` AS SIGNED)",
                    "`c`",
                ]
                .map(String::from),
                "<=>",
                " FOR UPDATE",
                "INSERT IGNORE INTO t (k) VALUES (?)".to_string(),
                generic.to_string(),
                "k IN (?, ?, ?)".to_string(),
                "k IN (?)".to_string(),
            )
        );
        // The statement a backend reports a new id with.
        assert_eq!(
            returning_id(Backend::Postgres, "INSERT INTO t (k) VALUES (?)").as_deref(),
            Some("INSERT INTO t (k) VALUES (?) RETURNING id")
        );
        assert_eq!(returning_id(Backend::Sqlite, into), None);
        assert_eq!(returning_id(Backend::Mysql, into), None);
    }

    /// The new ids of inserts alone and in a transaction, read back after the
    /// commit (SQLite: the connection's last insert id).
    #[tokio::test]
    async fn an_insert_answers_its_new_id_and_a_commit_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("ids.db").display());
        let sql = Pooled(sqlx::SqlitePool::connect(&url).await.unwrap());
        sql.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, k TEXT)", &[])
            .await
            .unwrap();
        sql.execute("INSERT INTO t (id, k) VALUES (40, 'before')", &[])
            .await
            .unwrap();
        let insert = "INSERT INTO t (k) VALUES (?)";
        assert_eq!(sql.insert(insert, &binds!["a"]).await.unwrap(), 41);
        let mut tx = sql.begin().await.unwrap();
        assert_eq!(tx.insert(insert, &binds!["b"]).await.unwrap(), 42);
        assert_eq!(tx.insert(insert, &binds!["c"]).await.unwrap(), 43);
        tx.commit().await.unwrap();
        let rows = sql
            .rows(
                "SELECT id, k FROM t ORDER BY id",
                &[],
                &[Kind::Int, Kind::Text],
            )
            .await
            .unwrap();
        let rows: Vec<_> = rows
            .iter()
            .map(|r| (r.int(0).unwrap(), r.text(1).unwrap()))
            .collect();
        let want = [(40, "before"), (41, "a"), (42, "b"), (43, "c")];
        assert_eq!(rows, want.map(|(i, k)| (i, k.to_string())));
        // No id to report is an error, not a made-up id.
        assert!(matches!(
            new_id(Done::default()),
            Err(sqlx::Error::RowNotFound)
        ));
        let done = Done {
            rows_affected: 1,
            last_insert_id: Some(7),
        };
        assert_eq!(new_id(done).unwrap(), 7);
    }
}
