//! The embedded queue: a small broker in its own SQLite file.
//!
//! It deliberately lives in a different database from the business tables: if the
//! ack committed with the business rows there would be no redelivery to study, and
//! real brokers never share a transaction with the consumer's database either.

use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;
use rusqlite::types::ValueRef;
use rusqlite::Connection;
use sqlx::sqlite::SqliteSynchronous;
use sqlx::SqlitePool;

use super::{Delivery, Queue, QueueDepth, QueueError, QueueResult};
use crate::deadlines::DEFAULT_STATEMENT_TIMEOUT;
use crate::sqlite::conn::{connect_sqlite, migrate};
use crate::sqlite::thread::{db, SqliteThread};
use crate::store::redact_url;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("src/queue/migrations");

/// The queue's file: sqlx for the migrations and the reads (depth) and the purge,
/// and the file's [`SqliteThread`] for everything on the engine's hot path —
/// publish, lease, ack, nack — so each is one hand-off to that thread whatever the
/// number of rows, and the publishers and the lease/ack writer of this process queue
/// for that one connection instead of meeting in SQLite's busy handler.
///
/// Each is a write job of that thread, so the jobs of the four consumers and the
/// publisher waiting together commit together (its group commit), each still whole
/// or not at all under its own savepoint.
///
/// Two fsync policies on that one connection. Publishes commit with `synchronous =
/// FULL`: losing one to a power cut would lose a message. Leases, acks and nacks
/// commit with `NORMAL` (still crash-safe under WAL; only an OS crash or power cut
/// can undo the last few): an ack undone that way is a redelivery, which the
/// consumers' dedup absorbs — that is what the pattern is for — and a lease undone
/// is a delivery that comes back early. Paying an fsync for each would put the
/// queue, not the business database, on the critical path. (A lease that shares a
/// group with a publish is fsynced with it: the group pays one fsync, not one each.)
#[derive(Debug, Clone)]
pub struct EmbeddedQueue {
    pool: SqlitePool,
    thread: SqliteThread,
    url: String,
}

/// A lease: hide up to `?5` visible rows of queue `?3` (visible at `?4`, now) under
/// token `?2` until `?1`, and hand them back. One statement: SQLite runs it under its
/// write lock, so two workers never lease the same row. The body comes back as its
/// bytes whatever its storage class (see [`body`]).
const LEASE: &str = "UPDATE queue_messages SET visible_at = ?1,
       delivery_count = delivery_count + 1, lease_token = ?2
     WHERE id IN (SELECT id FROM queue_messages WHERE queue = ?3 AND visible_at <= ?4
                  ORDER BY visible_at, id LIMIT ?5)
     RETURNING id, delivery_count, delivery_count - uncounted, body";

/// An ack: delete the row only while the lease is still ours.
const ACK: &str = "DELETE FROM queue_messages WHERE id = ?1 AND lease_token = ?2";

/// A return: visible again at `?1`, counted toward the attempts or (`?4 = 1`) not.
const NACK: &str = "UPDATE queue_messages
     SET visible_at = ?1, lease_token = NULL, uncounted = uncounted + ?4
     WHERE id = ?2 AND lease_token = ?3";

const PUBLISH: &str = "INSERT INTO queue_messages (queue, body, published_at, visible_at)
     VALUES (?1, ?2, ?3, ?3)";

/// One lease: a token and a visibility deadline for up to `max` rows.
struct Lease {
    queue: String,
    token: String,
    now: i64,
    until: i64,
    max: i64,
}

impl Lease {
    fn new(queue: &str, max: usize, visibility: Duration) -> Self {
        let now = now_ms();
        Lease {
            queue: queue.to_string(),
            token: format!("{:016x}", rand::random::<u64>()),
            now,
            until: now.saturating_add(millis(visibility)),
            max: i64::try_from(max).unwrap_or(i64::MAX),
        }
    }

    /// Run the lease on `conn` (the queue's thread): its deliveries in id order.
    fn take(self, conn: &Connection) -> rusqlite::Result<Vec<Delivery>> {
        if self.max == 0 {
            return Ok(Vec::new());
        }
        let mut lease = conn.prepare_cached(LEASE)?;
        let mut rows = lease.query(rusqlite::params![
            self.until, self.token, self.queue, self.now, self.max
        ])?;
        let mut deliveries = Vec::new();
        while let Some(row) = rows.next()? {
            let count: u32 = row.get(1)?;
            deliveries.push(Delivery {
                id: row.get(0)?,
                queue: self.queue.clone(),
                body: body(row.get_ref(3)?)?,
                delivery_count: count,
                attempts: row.get(2)?,
                redelivered: count > 1,
                lease_token: self.token.clone(),
            });
        }
        deliveries.sort_by_key(|d| d.id);
        Ok(deliveries)
    }
}

/// A body's bytes: a blob as `publish` writes it, or a row written by hand as text
/// (its UTF-8 bytes, not cut at a character count).
fn body(value: ValueRef<'_>) -> rusqlite::Result<Vec<u8>> {
    match value {
        ValueRef::Blob(b) | ValueRef::Text(b) => Ok(b.to_vec()),
        other => Err(rusqlite::Error::FromSqlConversionFailure(
            3,
            other.data_type(),
            "a queue body is a blob or text".into(),
        )),
    }
}

/// Delete the rows of `done` still held under their lease (inside the job's
/// transaction): the number deleted (a stale lease's rows are not).
fn ack_all(conn: &Connection, done: &[(i64, String)]) -> rusqlite::Result<usize> {
    let mut acked = 0;
    if !done.is_empty() {
        let mut ack = conn.prepare_cached(ACK)?;
        for (id, token) in done {
            acked += ack.execute(rusqlite::params![id, token])?;
        }
    }
    Ok(acked)
}

/// `part` under a savepoint of its own inside the job's transaction: kept when it
/// succeeds, undone when it fails, whatever the job's other parts do.
fn apart<T>(conn: &Connection, part: impl FnOnce() -> rusqlite::Result<T>) -> rusqlite::Result<T> {
    conn.execute_batch("SAVEPOINT part")?;
    let done = part();
    match done {
        Ok(_) => conn.execute_batch("RELEASE part")?,
        Err(_) => conn.execute_batch("ROLLBACK TO part; RELEASE part")?,
    }
    done
}

/// What an ack needs of a delivery, owned (it travels to the queue's thread).
fn acks(deliveries: &[Delivery]) -> Vec<(i64, String)> {
    deliveries
        .iter()
        .map(|d| (d.id, d.lease_token.clone()))
        .collect()
}

fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl EmbeddedQueue {
    pub async fn open(url: &str) -> QueueResult<Self> {
        Self::open_with(url, DEFAULT_STATEMENT_TIMEOUT).await
    }

    /// [`EmbeddedQueue::open`] with `busy` as the busy timeout (the engine's
    /// statement deadline): a lease or an ack waits that long for the file's write
    /// lock, then fails as the queue's timeout.
    pub async fn open_with(url: &str, busy: Duration) -> QueueResult<Self> {
        let pool = connect_sqlite(url, 4, SqliteSynchronous::Full, busy)
            .await
            .map_err(crate::store::StoreError::from)?;
        migrate(&MIGRATOR, &pool).await?;
        let thread = SqliteThread::for_url(url, SqliteSynchronous::Normal, busy)
            .map_err(crate::store::StoreError::Db)?;
        Ok(EmbeddedQueue {
            pool,
            thread,
            url: url.to_string(),
        })
    }

    /// A return of `delivery`, counted toward its attempts or not.
    async fn give_back(
        &self,
        delivery: &Delivery,
        delay: Duration,
        counted: bool,
    ) -> QueueResult<()> {
        let visible_at = now_ms().saturating_add(millis(delay));
        let (id, token) = (delivery.id, delivery.lease_token.clone());
        let uncounted = i64::from(!counted);
        self.thread
            .write(move |tx| {
                tx.prepare_cached(NACK)?
                    .execute(rusqlite::params![visible_at, id, token, uncounted])?;
                Ok::<_, QueueError>(())
            })
            .await
    }
}

/// A queue job's result: rusqlite's error as the `sqlx::Error` the engine reads, or
/// the thread's own failure.
impl From<rusqlite::Error> for QueueError {
    fn from(e: rusqlite::Error) -> Self {
        QueueError::Db(db(e))
    }
}

#[async_trait]
impl Queue for EmbeddedQueue {
    async fn publish(&self, queues: &[String], bodies: &[Vec<u8>]) -> QueueResult<()> {
        super::check_body_sizes(bodies)?;
        if queues.is_empty() || bodies.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        let (queues, bodies) = (queues.to_vec(), bodies.to_vec());
        // Fsynced: a message published is kept.
        self.thread
            .write_with(true, move |tx| {
                Ok::<_, QueueError>(publish_all(tx, &queues, &bodies, now)?)
            })
            .await
    }

    async fn lease(
        &self,
        queue: &str,
        max: usize,
        visibility: Duration,
    ) -> QueueResult<Vec<Delivery>> {
        let lease = Lease::new(queue, max, visibility);
        self.thread
            .write(move |tx| Ok::<_, QueueError>(lease.take(tx)?))
            .await
    }

    async fn ack_then_lease(
        &self,
        done: &[Delivery],
        queue: &str,
        max: usize,
        visibility: Duration,
    ) -> (QueueResult<()>, QueueResult<Vec<Delivery>>) {
        // Both in one hand-off to the queue's thread, each under its own savepoint:
        // the ack is kept whatever the lease does.
        let done = acks(done);
        let lease = Lease::new(queue, max, visibility);
        let both = self
            .thread
            .write(move |tx| {
                let acked = apart(tx, || ack_all(tx, &done))
                    .map(|_| ())
                    .map_err(QueueError::from);
                let leased = apart(tx, || lease.take(tx)).map_err(QueueError::from);
                Ok::<_, QueueError>((acked, leased))
            })
            .await;
        match both {
            Ok(both) => both,
            // The thread could not run the job (queueing for it timed out, or it is
            // gone): nothing was acked and nothing leased.
            Err(e) => (Err(QueueError::Other(format!("ack not sent: {e}"))), Err(e)),
        }
    }

    async fn ack(&self, delivery: &Delivery) -> QueueResult<bool> {
        Ok(self.ack_batch(std::slice::from_ref(delivery)).await? == 1)
    }

    async fn ack_batch(&self, deliveries: &[Delivery]) -> QueueResult<usize> {
        if deliveries.is_empty() {
            return Ok(0);
        }
        let done = acks(deliveries);
        self.thread
            .write(move |tx| Ok::<_, QueueError>(ack_all(tx, &done)?))
            .await
    }

    async fn nack(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()> {
        self.give_back(delivery, delay, true).await
    }

    async fn nack_uncounted(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()> {
        self.give_back(delivery, delay, false).await
    }

    async fn depth(&self, queue: &str) -> QueueResult<QueueDepth> {
        let (ready, in_flight): (i64, i64) = sqlx::query_as(
            "SELECT COALESCE(SUM(visible_at <= ?1), 0), COALESCE(SUM(visible_at > ?1), 0)
             FROM queue_messages WHERE queue = ?2",
        )
        .bind(now_ms())
        .bind(queue)
        .fetch_one(&self.pool)
        .await?;
        Ok(QueueDepth {
            ready: ready.max(0) as u64,
            in_flight: in_flight.max(0) as u64,
        })
    }

    async fn purge_queue(&self, queue: &str) -> QueueResult<u64> {
        Ok(sqlx::query("DELETE FROM queue_messages WHERE queue = ?")
            .bind(queue)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }
}

/// One row per (message, queue), inside the job's transaction: a queue's rows
/// together, in publish order (ids follow it within a queue). Queue by queue, not
/// message by message: a lease or an ack then touches the pages of its own queue's
/// rows only — message by message, the four queues' rows alternate and a lease of
/// 100 rows dirtied the pages of 400 (docs/journal/benchmarks-2026-11-30-to-12-05.md, "Group commit on the SQLite
/// threads").
fn publish_all(
    conn: &Connection,
    queues: &[String],
    bodies: &[Vec<u8>],
    now: i64,
) -> rusqlite::Result<()> {
    let mut insert = conn.prepare_cached(PUBLISH)?;
    for queue in queues {
        for body in bodies {
            insert.execute(rusqlite::params![queue, body, now])?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn queue() -> (tempfile::TempDir, EmbeddedQueue) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("q.db").display());
        let q = EmbeddedQueue::open(&url).await.unwrap();
        (dir, q)
    }

    #[tokio::test]
    async fn unacked_delivery_comes_back_redelivered() {
        let (_dir, q) = queue().await;
        q.publish(&["a".into()], &[b"m1".to_vec()]).await.unwrap();
        let first = q.lease("a", 10, Duration::from_millis(50)).await.unwrap();
        assert_eq!(first.len(), 1);
        assert!(!first[0].redelivered);
        // Invisible while leased.
        assert!(q
            .lease("a", 10, Duration::from_millis(50))
            .await
            .unwrap()
            .is_empty());
        assert_eq!(q.depth("a").await.unwrap().in_flight, 1);
        tokio::time::sleep(Duration::from_millis(80)).await;
        let again = q.lease("a", 10, Duration::from_secs(5)).await.unwrap();
        assert_eq!(again.len(), 1);
        assert!(again[0].redelivered);
        assert_eq!(again[0].delivery_count, 2);
        // The first lease is stale: its ack must not remove the message.
        assert!(!q.ack(&first[0]).await.unwrap());
        assert!(q.ack(&again[0]).await.unwrap());
        assert!(q.depth("a").await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn an_uncounted_return_is_redelivered_without_using_an_attempt() {
        let (_dir, q) = queue().await;
        q.publish(&["a".into()], &[b"m1".to_vec()]).await.unwrap();
        let vis = Duration::from_secs(30);
        let first = q.lease("a", 10, vis).await.unwrap();
        assert_eq!((first[0].delivery_count, first[0].attempts), (1, 1));
        q.nack_uncounted(&first[0], Duration::ZERO).await.unwrap();
        let second = q.lease("a", 10, vis).await.unwrap();
        assert_eq!((second[0].delivery_count, second[0].attempts), (2, 1));
        assert!(second[0].redelivered);
        q.nack(&second[0], Duration::ZERO).await.unwrap();
        let third = q.lease("a", 10, vis).await.unwrap();
        assert_eq!((third[0].delivery_count, third[0].attempts), (3, 2));
        // A stale lease's return changes nothing.
        q.nack_uncounted(&first[0], Duration::ZERO).await.unwrap();
        assert!(q.lease("a", 10, vis).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn ack_then_lease_acks_only_held_leases_and_leases_the_next() {
        let (_dir, q) = queue().await;
        let bodies: Vec<Vec<u8>> = (0..7).map(|i| format!("m{i}").into_bytes()).collect();
        q.publish(&["a".into()], &bodies).await.unwrap();
        let vis = Duration::from_secs(30);
        let (acked, nothing) = q.ack_then_lease(&[], "a", 0, vis).await;
        acked.unwrap();
        assert!(nothing.unwrap().is_empty());
        assert_eq!(q.ack_batch(&[]).await.unwrap(), 0);
        let first = q.lease("a", 3, vis).await.unwrap();
        let (acked, second) = q.ack_then_lease(&first, "a", 3, vis).await;
        acked.unwrap();
        let second = second.unwrap();
        let body = |d: &Delivery| String::from_utf8(d.body.clone()).unwrap();
        assert_eq!(
            second.iter().map(body).collect::<Vec<_>>(),
            ["m3", "m4", "m5"]
        );
        assert_eq!(
            q.depth("a").await.unwrap().in_flight,
            3,
            "the first three are gone"
        );
        // A stale lease acks nothing; the lease part still runs.
        let mut stale = second.clone();
        for d in &mut stale {
            d.lease_token = "not-ours".into();
        }
        let (acked, third) = q.ack_then_lease(&stale, "a", 3, vis).await;
        acked.unwrap();
        assert_eq!(third.unwrap().iter().map(body).collect::<Vec<_>>(), ["m6"]);
        assert_eq!(q.depth("a").await.unwrap().in_flight, 4);
        // Two leases at once go through the general path.
        q.publish(&["a".into()], &[b"m7".to_vec(), b"m8".to_vec()])
            .await
            .unwrap();
        let mut two = q.lease("a", 1, vis).await.unwrap();
        two.extend(q.lease("a", 1, vis).await.unwrap());
        assert_ne!(two[0].lease_token, two[1].lease_token);
        let (acked, none) = q.ack_then_lease(&two, "a", 3, vis).await;
        acked.unwrap();
        assert!(none.unwrap().is_empty());
        assert_eq!(q.depth("a").await.unwrap().in_flight, 4, "m7 and m8 acked");
    }

    #[tokio::test]
    async fn any_bytes_come_back_intact_from_a_lease() {
        let (_dir, q) = queue().await;
        let bodies: Vec<Vec<u8>> = vec![
            b"{\"a\":1}".to_vec(),
            vec![0, 0xff, b',', b';', 0xc3, 0x28, b'\n'],
            Vec::new(),
            "Kadıköy ; ,".as_bytes().to_vec(),
            b"7,1,99:x".to_vec(),
            vec![0; 3],
        ];
        q.publish(&["a".into()], &bodies).await.unwrap();
        let got = q.lease("a", 10, Duration::from_secs(5)).await.unwrap();
        assert_eq!(
            got.iter().map(|d| d.body.clone()).collect::<Vec<_>>(),
            bodies
        );
        assert!(got.windows(2).all(|w| w[0].id < w[1].id));
        assert!(got.iter().all(|d| d.delivery_count == 1 && !d.redelivered));
        assert!(q
            .lease("a", 10, Duration::from_secs(5))
            .await
            .unwrap()
            .is_empty());
        // A lease bigger than one packed row.
        let many: Vec<Vec<u8>> = (0..150).map(|i| format!("m{i};,").into_bytes()).collect();
        q.publish(&["b".into()], &many).await.unwrap();
        let got = q.lease("b", 120, Duration::from_secs(5)).await.unwrap();
        assert_eq!(
            got.iter().map(|d| d.body.clone()).collect::<Vec<_>>(),
            many[..120]
        );
        let (acked, rest) = q
            .ack_then_lease(&got, "b", 120, Duration::from_secs(5))
            .await;
        acked.unwrap();
        assert_eq!(
            rest.unwrap()
                .iter()
                .map(|d| d.body.clone())
                .collect::<Vec<_>>(),
            many[120..]
        );
    }

    #[tokio::test]
    async fn a_body_stored_as_text_comes_back_as_its_bytes() {
        let (_dir, q) = queue().await;
        // Not what publish writes (a blob), but a row written by hand must not come
        // back cut: the length in the packed row is of the bytes, not the characters.
        sqlx::query(
            "INSERT INTO queue_messages (queue, body, published_at, visible_at)
             VALUES ('t', 'Kadıköy', 0, 0)",
        )
        .execute(&q.pool)
        .await
        .unwrap();
        let got = q.lease("t", 10, Duration::from_secs(5)).await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].body, "Kadıköy".as_bytes());
    }

    #[tokio::test]
    async fn fan_out_keeps_queues_independent() {
        let (_dir, q) = queue().await;
        q.publish(&["a".into(), "b".into()], &[b"x".to_vec(), b"y".to_vec()])
            .await
            .unwrap();
        let a = q.lease("a", 10, Duration::from_secs(5)).await.unwrap();
        assert_eq!(
            a.iter().map(|d| d.body.clone()).collect::<Vec<_>>(),
            vec![b"x".to_vec(), b"y".to_vec()]
        );
        assert_eq!(q.depth("b").await.unwrap().ready, 2);
    }

    #[tokio::test]
    async fn concurrent_workers_never_lease_the_same_message() {
        let (_dir, q) = queue().await;
        let bodies: Vec<Vec<u8>> = (0..200).map(|i| format!("m{i}").into_bytes()).collect();
        q.publish(&["a".into()], &bodies).await.unwrap();
        let mut handles = Vec::new();
        for _ in 0..4 {
            let q = q.clone();
            handles.push(tokio::spawn(async move {
                let mut got = Vec::new();
                loop {
                    let batch = q.lease("a", 7, Duration::from_secs(30)).await.unwrap();
                    if batch.is_empty() {
                        break got;
                    }
                    for d in batch {
                        assert!(q.ack(&d).await.unwrap());
                        got.push(d.id);
                    }
                }
            }));
        }
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.await.unwrap());
        }
        all.sort();
        let before = all.len();
        all.dedup();
        assert_eq!(before, 200);
        assert_eq!(all.len(), 200);
    }
}
