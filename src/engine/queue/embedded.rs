//! The embedded queue: a small broker in its own SQLite file.
//!
//! It deliberately lives in a different database from the business tables: if the
//! ack committed with the business rows there would be no redelivery to study, and
//! real brokers never share a transaction with the consumer's database either.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;
use sqlx::sqlite::{SqliteRow, SqliteSynchronous};
use sqlx::{QueryBuilder, Row, Sqlite, SqlitePool};

use super::{Delivery, Queue, QueueDepth, QueueError, QueueResult};
use crate::engine::store::redact_url;
use crate::engine::store::sqlite_conn::{connect_sqlite, Held, HeldConnection};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./assets/migrations/queue-sqlite");

/// Two pools on one file, with different fsync policies.
///
/// Publishes commit with `synchronous = FULL`: losing one to a power cut would lose
/// a message. Leases, acks and nacks commit with `NORMAL` (still crash-safe under
/// WAL; only an OS crash or power cut can undo the last few): an ack undone that way
/// is a redelivery, which the consumers' dedup absorbs — that is what the pattern is
/// for — and a lease undone is a delivery that comes back early. Paying an fsync for
/// each would put the queue, not the business database, on the critical path.
///
/// Leases, acks and nacks go through one [`HeldConnection`] of the `NORMAL` pool:
/// on the engine's hot path the pool's pings cost more than the statements.
/// Only single autocommit statements run on it, so a caller that gives up half-way
/// leaves it clean.
#[derive(Debug, Clone)]
pub struct EmbeddedQueue {
    pool: SqlitePool,
    deliveries: SqlitePool,
    writer: Arc<HeldConnection>,
    url: String,
}

/// Deliveries per row when a lease is read back. Each row crosses from SQLite's
/// thread to ours with a wake-up of its own, so the fewer the better; but a row is one
/// value, and SQLite caps a value at 1e9 bytes: 32 bodies stay under it up to ~30 MB
/// a body.
const PACKED_PER_ROW: i64 = 32;

/// Ids per acking DELETE, rows per publishing INSERT.
const ACK_CHUNK: usize = 500;

/// Deliveries grouped by the lease that holds them, in first-seen order.
fn by_lease(deliveries: &[Delivery]) -> Vec<(&str, Vec<i64>)> {
    let mut leases: Vec<(&str, Vec<i64>)> = Vec::new();
    for d in deliveries {
        match leases.iter_mut().find(|(t, _)| *t == d.lease_token) {
            Some((_, ids)) => ids.push(d.id),
            None => leases.push((&d.lease_token, vec![d.id])),
        }
    }
    leases
}

/// Delete the rows of one lease: only while the lease is still ours.
fn delete_leased<'a>(token: &'a str, ids: &'a [i64]) -> QueryBuilder<'a, Sqlite> {
    let mut q = QueryBuilder::new("DELETE FROM queue_messages WHERE lease_token = ");
    q.push_bind(token).push(" AND id IN ");
    q.push_tuples(ids, |mut t, id| {
        t.push_bind(*id);
    });
    q
}

/// One lease: a token and a visibility deadline for up to `max` rows.
struct Lease {
    token: String,
    now: i64,
    until: i64,
    max: i64,
}

impl Lease {
    fn new(max: usize, visibility: Duration) -> Self {
        let now = now_ms();
        Lease {
            token: format!("{:016x}", rand::random::<u64>()),
            now,
            until: now.saturating_add(millis(visibility)),
            max: i64::try_from(max).unwrap_or(i64::MAX),
        }
    }

    /// Two statements: hide the visible rows under this lease (SQLite runs the
    /// `UPDATE` under its write lock, so two workers never lease the same row), then
    /// read them back packed, up to [`PACKED_PER_ROW`] to a row. The driver hands every result row from SQLite's
    /// thread to ours with a wake-up of its own; a batch of 100 bodies as 100 rows
    /// (an `UPDATE … RETURNING`) cost more in those hand-offs than in SQL. Each
    /// delivery is packed as `id,count,length:` and then its body's bytes as they are
    /// (SQLite's `||` keeps a blob's bytes, NULs and invalid UTF-8 included; the length
    /// is of the bytes even for a body stored as text), so any
    /// body (a malformed message's too) comes back intact without an encoding step.
    fn push<'a>(&'a self, q: &mut QueryBuilder<'a, Sqlite>, queue: &'a str) {
        q.push("UPDATE queue_messages SET visible_at = ")
            .push_bind(self.until)
            .push(", delivery_count = delivery_count + 1, lease_token = ")
            .push_bind(&self.token)
            .push(" WHERE id IN (SELECT id FROM queue_messages WHERE queue = ")
            .push_bind(queue)
            .push(" AND visible_at <= ")
            .push_bind(self.now)
            .push(" ORDER BY visible_at, id LIMIT ")
            .push_bind(self.max)
            .push(
                "); SELECT CAST(group_concat(id || ',' || delivery_count || ',' \
                 || (delivery_count - uncounted) || ',' \
                 || length(CAST(body AS BLOB)) || ':' || body, '') AS BLOB)",
            )
            .push(" FROM queue_messages WHERE queue = ")
            .push_bind(queue)
            .push(" AND visible_at = ")
            .push_bind(self.until)
            .push(" AND lease_token = ")
            .push_bind(&self.token)
            .push(" GROUP BY id / ")
            .push(PACKED_PER_ROW);
    }

    /// The deliveries in the packed rows [`Self::push`] reads back, in id order.
    fn deliveries(&self, queue: &str, rows: &[SqliteRow]) -> Result<Vec<Delivery>, sqlx::Error> {
        let mut deliveries = Vec::new();
        for row in rows {
            let packed: &[u8] = row.try_get(0)?;
            let mut rest = packed;
            while !rest.is_empty() {
                let (
                    Packed {
                        id,
                        count,
                        attempts,
                        body,
                    },
                    after,
                ) = unpack_one(rest).ok_or_else(|| {
                    sqlx::Error::Decode("lease row: not id,count,attempts,length:body".into())
                })?;
                deliveries.push(Delivery {
                    id,
                    queue: queue.to_string(),
                    body: body.to_vec(),
                    delivery_count: count,
                    attempts,
                    redelivered: count > 1,
                    lease_token: self.token.clone(),
                });
                rest = after;
            }
        }
        deliveries.sort_by_key(|d| d.id);
        Ok(deliveries)
    }
}

/// One delivery of a packed lease row.
#[derive(Debug, PartialEq)]
struct Packed<'a> {
    id: i64,
    count: u32,
    attempts: u32,
    body: &'a [u8],
}

/// One `id,count,attempts,length:body` off the front of a packed lease row, and what
/// follows.
fn unpack_one(packed: &[u8]) -> Option<(Packed<'_>, &[u8])> {
    fn number<T: std::str::FromStr>(s: &[u8], end: u8) -> Option<(T, &[u8])> {
        let at = s.iter().position(|&b| b == end)?;
        let n = std::str::from_utf8(&s[..at]).ok()?.parse().ok()?;
        Some((n, &s[at + 1..]))
    }
    let (id, s) = number::<i64>(packed, b',')?;
    let (count, s) = number::<u32>(s, b',')?;
    let (attempts, s) = number::<u32>(s, b',')?;
    let (len, s) = number::<usize>(s, b':')?;
    (s.len() >= len).then(|| {
        let body = &s[..len];
        (
            Packed {
                id,
                count,
                attempts,
                body,
            },
            &s[len..],
        )
    })
}

fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl EmbeddedQueue {
    pub async fn open(url: &str) -> QueueResult<Self> {
        let pool = connect_sqlite(url, 4, SqliteSynchronous::Full).await?;
        MIGRATOR.run(&pool).await?;
        let deliveries = connect_sqlite(url, 4, SqliteSynchronous::Normal).await?;
        Ok(EmbeddedQueue {
            pool,
            deliveries,
            writer: Arc::new(HeldConnection::default()),
            url: url.to_string(),
        })
    }

    async fn writer(&self) -> QueueResult<Held<'_>> {
        Ok(self.writer.take(&self.deliveries).await?)
    }
}

#[async_trait]
impl Queue for EmbeddedQueue {
    async fn publish(&self, queues: &[String], bodies: &[Vec<u8>]) -> QueueResult<()> {
        super::check_body_sizes(bodies)?;
        let now = now_ms();
        // Multi-row inserts, in publish order (ids follow it): one call to SQLite's
        // thread per chunk instead of one per message.
        let rows: Vec<(&String, &Vec<u8>)> = bodies
            .iter()
            .flat_map(|body| queues.iter().map(move |queue| (queue, body)))
            .collect();
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        for chunk in rows.chunks(ACK_CHUNK) {
            let mut q = QueryBuilder::<Sqlite>::new(
                "INSERT INTO queue_messages (queue, body, published_at, visible_at) ",
            );
            q.push_values(chunk, |mut row, (queue, body)| {
                row.push_bind(*queue)
                    .push_bind(body.as_slice())
                    .push_bind(now)
                    .push_bind(now);
            });
            q.build().execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn lease(
        &self,
        queue: &str,
        max: usize,
        visibility: Duration,
    ) -> QueueResult<Vec<Delivery>> {
        let lease = Lease::new(max, visibility);
        let mut q = QueryBuilder::new("");
        lease.push(&mut q, queue);
        let mut w = self.writer().await?;
        let rows = q.build().fetch_all(w.conn()).await;
        Ok(lease.deliveries(queue, &w.keep(rows)?)?)
    }

    async fn ack_then_lease(
        &self,
        done: &[Delivery],
        queue: &str,
        max: usize,
        visibility: Duration,
    ) -> (QueueResult<()>, QueueResult<Vec<Delivery>>) {
        // The usual case, one lease acked: both statements in one call to SQLite's
        // thread (each still its own transaction), not two.
        let leases = by_lease(done);
        let (token, ids) = match leases.as_slice() {
            [] => return (Ok(()), self.lease(queue, max, visibility).await),
            [(token, ids)] if ids.len() <= ACK_CHUNK => (*token, ids.as_slice()),
            _ => {
                let acked = self.ack_batch(done).await.map(|_| ());
                return (acked, self.lease(queue, max, visibility).await);
            }
        };
        let lease = Lease::new(max, visibility);
        let mut q = delete_leased(token, ids);
        q.push("; ");
        lease.push(&mut q, queue);
        let mut w = match self.writer().await {
            Ok(w) => w,
            Err(e) => return (Err(QueueError::Other(format!("ack not sent: {e}"))), Err(e)),
        };
        let rows = q.build().fetch_all(w.conn()).await;
        match w.keep(rows) {
            Ok(rows) => match lease.deliveries(queue, &rows) {
                Ok(d) => (Ok(()), Ok(d)),
                Err(e) => (Ok(()), Err(e.into())),
            },
            // The DELETE failed, or the UPDATE after it: the ack may or may not have
            // happened (a redelivery the dedup absorbs) and nothing was leased.
            Err(e) => (
                Err(QueueError::Other(format!(
                    "ack (with the next lease) failed: {e}"
                ))),
                Err(e.into()),
            ),
        }
    }

    async fn ack(&self, delivery: &Delivery) -> QueueResult<bool> {
        let mut w = self.writer().await?;
        let done = sqlx::query("DELETE FROM queue_messages WHERE id = ? AND lease_token = ?")
            .bind(delivery.id)
            .bind(&delivery.lease_token)
            .execute(w.conn())
            .await;
        Ok(w.keep(done)?.rows_affected() == 1)
    }

    async fn ack_batch(&self, deliveries: &[Delivery]) -> QueueResult<usize> {
        // One DELETE per lease (a batch is usually one lease), each row still proven
        // by its lease token; one transaction when there are several.
        let leases = by_lease(deliveries);
        match leases.as_slice() {
            [] => return Ok(0),
            [(token, ids)] if ids.len() <= ACK_CHUNK => {
                let mut q = delete_leased(token, ids);
                let mut w = self.writer().await?;
                let done = q.build().execute(w.conn()).await;
                return Ok(w.keep(done)?.rows_affected() as usize);
            }
            _ => {}
        }
        let mut tx = self.deliveries.begin_with("BEGIN IMMEDIATE").await?;
        let mut acked = 0;
        for (token, ids) in &leases {
            for chunk in ids.chunks(ACK_CHUNK) {
                let mut q = delete_leased(token, chunk);
                acked += q.build().execute(&mut *tx).await?.rows_affected() as usize;
            }
        }
        tx.commit().await?;
        Ok(acked)
    }

    async fn nack(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()> {
        let mut w = self.writer().await?;
        let done = sqlx::query(
            "UPDATE queue_messages SET visible_at = ?, lease_token = NULL
             WHERE id = ? AND lease_token = ?",
        )
        .bind(now_ms().saturating_add(millis(delay)))
        .bind(delivery.id)
        .bind(&delivery.lease_token)
        .execute(w.conn())
        .await;
        w.keep(done)?;
        Ok(())
    }

    async fn nack_uncounted(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()> {
        let mut w = self.writer().await?;
        let done = sqlx::query(
            "UPDATE queue_messages SET visible_at = ?, lease_token = NULL, uncounted = uncounted + 1
             WHERE id = ? AND lease_token = ?",
        )
        .bind(now_ms().saturating_add(millis(delay)))
        .bind(delivery.id)
        .bind(&delivery.lease_token)
        .execute(w.conn())
        .await;
        w.keep(done)?;
        Ok(())
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

    #[test]
    fn a_packed_row_cut_short_or_garbled_is_an_error_not_a_guess() {
        let packed = |id, count, attempts, body| Packed {
            id,
            count,
            attempts,
            body,
        };
        assert_eq!(
            unpack_one(b"12,3,2,2:ab7,1,1,0:"),
            Some((packed(12, 3, 2, &b"ab"[..]), &b"7,1,1,0:"[..]))
        );
        assert_eq!(
            unpack_one(b"7,1,1,0:"),
            Some((packed(7, 1, 1, &b""[..]), &b""[..]))
        );
        for bad in [
            &b"12,3,3,5:ab"[..],
            b"12,3,2:ab",
            b"x,1,1,1:a",
            b"12,3,3,-1:a",
            b"12,3,-1,1:a",
            b"",
        ] {
            assert_eq!(unpack_one(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
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
