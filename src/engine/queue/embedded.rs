//! The embedded queue: a small broker in its own SQLite file.
//!
//! It deliberately lives in a different database from the business tables: if the
//! ack committed with the business rows there would be no redelivery to study, and
//! real brokers never share a transaction with the consumer's database either.

use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;
use sqlx::sqlite::SqliteSynchronous;
use sqlx::{QueryBuilder, Row, Sqlite, SqlitePool};

use super::{Delivery, Queue, QueueDepth, QueueResult};
use crate::engine::store::redact_url;
use crate::engine::store::sqlite::connect_sqlite;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./assets/migrations/queue-sqlite");

/// Two pools on one file, with different fsync policies.
///
/// Publishes commit with `synchronous = FULL`: losing one to a power cut would lose
/// a message. Leases, acks and nacks commit with `NORMAL` (still crash-safe under
/// WAL; only an OS crash or power cut can undo the last few): an ack undone that way
/// is a redelivery, which the consumers' dedup absorbs — that is what the pattern is
/// for — and a lease undone is a delivery that comes back early. Paying an fsync for
/// each would put the queue, not the business database, on the critical path.
#[derive(Debug, Clone)]
pub struct EmbeddedQueue {
    pool: SqlitePool,
    deliveries: SqlitePool,
    url: String,
}

/// Ids per acking DELETE.
const ACK_CHUNK: usize = 500;

/// Delete the rows of one lease: only while the lease is still ours.
fn delete_leased<'a>(token: &'a str, ids: &'a [i64]) -> QueryBuilder<'a, Sqlite> {
    let mut q = QueryBuilder::new("DELETE FROM queue_messages WHERE lease_token = ");
    q.push_bind(token).push(" AND id IN ");
    q.push_tuples(ids, |mut t, id| {
        t.push_bind(*id);
    });
    q
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
            url: url.to_string(),
        })
    }
}

#[async_trait]
impl Queue for EmbeddedQueue {
    async fn publish(&self, queues: &[String], bodies: &[Vec<u8>]) -> QueueResult<()> {
        let now = now_ms();
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        for body in bodies {
            for queue in queues {
                sqlx::query(
                    "INSERT INTO queue_messages (queue, body, published_at, visible_at)
                     VALUES (?, ?, ?, ?)",
                )
                .bind(queue)
                .bind(body)
                .bind(now)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            }
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
        let now = now_ms();
        let token = format!("{:016x}", rand::random::<u64>());
        // One statement: select the visible rows and hide them. SQLite runs it under
        // the write lock, so two workers never lease the same row.
        let rows = sqlx::query(
            "UPDATE queue_messages
             SET visible_at = ?, delivery_count = delivery_count + 1, lease_token = ?
             WHERE id IN (SELECT id FROM queue_messages
                          WHERE queue = ? AND visible_at <= ? ORDER BY visible_at, id LIMIT ?)
             RETURNING id, queue, body, delivery_count",
        )
        .bind(now.saturating_add(millis(visibility)))
        .bind(&token)
        .bind(queue)
        .bind(now)
        .bind(i64::try_from(max).unwrap_or(i64::MAX))
        .fetch_all(&self.deliveries)
        .await?;
        let mut deliveries = rows
            .iter()
            .map(|r| {
                let count: i64 = r.try_get("delivery_count")?;
                let count = u32::try_from(count).unwrap_or(u32::MAX);
                Ok(Delivery {
                    id: r.try_get("id")?,
                    queue: r.try_get("queue")?,
                    body: r.try_get("body")?,
                    delivery_count: count,
                    redelivered: count > 1,
                    lease_token: token.clone(),
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        deliveries.sort_by_key(|d| d.id);
        Ok(deliveries)
    }

    async fn ack(&self, delivery: &Delivery) -> QueueResult<bool> {
        let done = sqlx::query("DELETE FROM queue_messages WHERE id = ? AND lease_token = ?")
            .bind(delivery.id)
            .bind(&delivery.lease_token)
            .execute(&self.deliveries)
            .await?
            .rows_affected();
        Ok(done == 1)
    }

    async fn ack_batch(&self, deliveries: &[Delivery]) -> QueueResult<usize> {
        // One DELETE per lease (a batch is usually one lease), each row still proven
        // by its lease token; one transaction when there are several.
        let mut leases: Vec<(&str, Vec<i64>)> = Vec::new();
        for d in deliveries {
            match leases.iter_mut().find(|(t, _)| *t == d.lease_token) {
                Some((_, ids)) => ids.push(d.id),
                None => leases.push((&d.lease_token, vec![d.id])),
            }
        }
        if let [(token, ids)] = leases.as_slice() {
            if ids.len() <= ACK_CHUNK {
                let mut q = delete_leased(token, ids);
                return Ok(q.build().execute(&self.deliveries).await?.rows_affected() as usize);
            }
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
        sqlx::query(
            "UPDATE queue_messages SET visible_at = ?, lease_token = NULL
             WHERE id = ? AND lease_token = ?",
        )
        .bind(now_ms().saturating_add(millis(delay)))
        .bind(delivery.id)
        .bind(&delivery.lease_token)
        .execute(&self.deliveries)
        .await?;
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
