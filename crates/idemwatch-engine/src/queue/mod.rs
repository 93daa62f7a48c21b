//! The broker side: at-least-once delivery with leases, acks and redelivery.
//!
//! One named queue per consumer (a fan-out, as a RabbitMQ exchange with one queue per
//! consuming service would do), so one consumer dying does not redeliver to another.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;

use crate::deadlines::Deadlines;
use crate::envelope::MAX_RAW_BYTES;
use idemwatch_base::vocab::{InfraKind, PauseCause};

pub mod amqp;
pub mod embedded;
pub mod nats;
mod nats_poison;

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("queue database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("queue migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("{0}")]
    Store(#[from] crate::store::StoreError),
    #[error("unsupported queue URL {0} (expected sqlite://…, amqp://… or nats://…)")]
    UnsupportedUrl(String),
    #[error("bad queue URL {0}: {1}")]
    BadUrl(String, String),
    #[error("AMQP: {0}")]
    Amqp(String),
    #[error("NATS: {0}")]
    Nats(String),
    /// A body over the envelope's limit: refused before any of the call is queued.
    #[error("message {index} is {bytes} bytes, over the envelope limit of {limit} bytes: nothing was published")]
    TooLarge {
        index: usize,
        bytes: usize,
        limit: usize,
    },
    /// A deadline fired: the broker (or the way to it) did not answer `what` within
    /// `after`. The link is dropped; the next call dials a fresh one.
    #[error("{what}: no answer from the broker within {after:?}: timeout")]
    TimedOut { what: String, after: Duration },
    #[error("{0}")]
    Other(String),
}

impl QueueError {
    /// The `kind` a failure of the queue is counted under (the consumer pauses with
    /// `cause="queue"` either way): `timeout` for a deadline — ours, a driver's, or
    /// the embedded queue's busy timeout — else `queue`.
    pub fn infra_kind(&self) -> InfraKind {
        let timed_out = match self {
            QueueError::TimedOut { .. } => true,
            QueueError::Db(e) => crate::store::sqlx_timed_out(e),
            QueueError::Store(e) => e.timed_out(),
            _ => false,
        };
        if timed_out {
            InfraKind::Timeout(PauseCause::Queue)
        } else {
            InfraKind::Queue
        }
    }
}

pub type QueueResult<T> = Result<T, QueueError>;

/// One leased message. Until it is acked it will come back after the visibility
/// timeout, with `redelivered = true` and a higher `delivery_count`.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub id: i64,
    pub queue: String,
    pub body: Vec<u8>,
    /// 1 on the first delivery.
    pub delivery_count: u32,
    /// The deliveries that count toward `max_deliveries`, this one included: the
    /// delivery count less the returns that said "not the message's fault" (an
    /// outage, throttling, a lease given back unhandled; see [`Queue::nack_uncounted`]).
    pub attempts: u32,
    pub redelivered: bool,
    /// Proves this lease: an ack with a stale token (the lease expired and another
    /// worker took the message) does nothing.
    pub lease_token: String,
}

/// Ready and leased (in flight) messages of one queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct QueueDepth {
    pub ready: u64,
    pub in_flight: u64,
}

impl QueueDepth {
    pub fn is_empty(&self) -> bool {
        self.ready == 0 && self.in_flight == 0
    }
}

/// Refuse a publish call with a body over [`MAX_RAW_BYTES`] before any of it is
/// queued: a consumer would only dead-letter it unread (`too_large`), and a queue
/// without a cap lets one producer fill the broker's disk or memory. Every
/// [`Queue::publish`] calls it first.
pub fn check_body_sizes(bodies: &[Vec<u8>]) -> QueueResult<()> {
    match bodies.iter().position(|b| b.len() > MAX_RAW_BYTES) {
        Some(index) => Err(QueueError::TooLarge {
            index,
            bytes: bodies[index].len(),
            limit: MAX_RAW_BYTES,
        }),
        None => Ok(()),
    }
}

#[async_trait]
pub trait Queue: Send + Sync + 'static {
    /// Publish each body to every named queue, atomically for the whole call; a body
    /// over the envelope's limit refuses the call ([`check_body_sizes`]).
    async fn publish(&self, queues: &[String], bodies: &[Vec<u8>]) -> QueueResult<()>;

    /// Lease up to `max` visible messages of `queue` for `visibility`.
    async fn lease(
        &self,
        queue: &str,
        max: usize,
        visibility: Duration,
    ) -> QueueResult<Vec<Delivery>>;

    /// Acknowledge: the message is done and will not come back. `false` when the
    /// lease was lost (expired and taken by someone else).
    async fn ack(&self, delivery: &Delivery) -> QueueResult<bool>;

    /// Acknowledge several deliveries; returns how many were still held. The default
    /// acks one by one; a queue that can do better does it in one round trip.
    async fn ack_batch(&self, deliveries: &[Delivery]) -> QueueResult<usize> {
        let mut acked = 0;
        for d in deliveries {
            if self.ack(d).await? {
                acked += 1;
            }
        }
        Ok(acked)
    }

    /// Ack `done` (a batch whose commit is done), then lease up to `max` of `queue`:
    /// the pipelined runner's queue step. One round trip where the queue can manage
    /// it; by default the two calls. Results apart: an ack that failed still leases.
    async fn ack_then_lease(
        &self,
        done: &[Delivery],
        queue: &str,
        max: usize,
        visibility: Duration,
    ) -> (QueueResult<()>, QueueResult<Vec<Delivery>>) {
        (
            self.ack_done(done).await,
            self.lease(queue, max, visibility).await,
        )
    }

    /// [`Queue::ack_batch`] of a committed batch, nothing to do when it is empty.
    async fn ack_done(&self, done: &[Delivery]) -> QueueResult<()> {
        if done.is_empty() {
            return Ok(());
        }
        self.ack_batch(done).await.map(|_| ())
    }

    /// [`Queue::ack_then_lease`] run beside a batch the runner is still handling:
    /// `handled` is notified when that batch is done. A queue whose lease waits for
    /// deliveries to arrive (a broker's push, [`amqp`]) stops waiting a moment after
    /// it: the runner's next step is to ack that batch, or to find the queue drained,
    /// and a long poll would hold both back (the last batch before a lull waited a whole
    /// poll for its ack). Until then it keeps taking what arrives, up to `max`: the
    /// time beside the batch is free, and a lease that returned with the first few
    /// deliveries would leave the next batch to be gathered by leases the database
    /// waits for. A queue whose lease never waits (the embedded one, NATS's
    /// no-wait fetch) needs nothing more than the plain call, the default.
    async fn ack_then_lease_beside(
        &self,
        done: &[Delivery],
        queue: &str,
        max: usize,
        visibility: Duration,
        handled: &tokio::sync::Notify,
    ) -> (QueueResult<()>, QueueResult<Vec<Delivery>>) {
        let _ = handled;
        self.ack_then_lease(done, queue, max, visibility).await
    }

    /// Give the message back now (or after `delay`) without counting it done. This
    /// delivery counts toward `max_deliveries`: the message itself failed.
    async fn nack(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()>;

    /// Give the message back (after `delay`) as if this delivery had not happened as
    /// far as `max_deliveries` goes: the store or the provider failed, not the message,
    /// or the delivery was never handled. Its next delivery is still flagged
    /// redelivered and its delivery count still rises; its `attempts` do not.
    async fn nack_uncounted(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()>;

    async fn depth(&self, queue: &str) -> QueueResult<QueueDepth>;

    /// Remove every message of `queue` (drill clean-up).
    async fn purge_queue(&self, queue: &str) -> QueueResult<u64>;

    /// Remove `queue` itself where queues are declared objects (a broker), else just
    /// its messages: drills and chaos runs leave nothing behind.
    async fn remove_queue(&self, queue: &str) -> QueueResult<u64> {
        self.purge_queue(queue).await
    }

    /// Let go of the broker connection cleanly; whatever is still leased comes back.
    async fn close(&self) {}

    fn redacted_url(&self) -> String;
}

/// Open the queue a `--queue` URL names (default deadlines).
pub async fn open(url: &str) -> QueueResult<Arc<dyn Queue>> {
    open_with(url, &Deadlines::default()).await
}

/// Open the queue a `--queue` URL names with the engine's [`Deadlines`]: the
/// broker's connect bounded by `connect_timeout`, its link kept alive by `heartbeat`
/// (a silent one is closed and redialled), the embedded queue's lock waits by the
/// statement deadline.
pub async fn open_with(url: &str, deadlines: &Deadlines) -> QueueResult<Arc<dyn Queue>> {
    if url.starts_with("sqlite:") {
        Ok(Arc::new(
            embedded::EmbeddedQueue::open_with(url, deadlines.statement_timeout).await?,
        ))
    } else if url.starts_with("amqp://") || url.starts_with("amqps://") {
        Ok(Arc::new(amqp::AmqpQueue::open_with(url, deadlines).await?))
    } else if url.starts_with("nats://") {
        Ok(Arc::new(nats::NatsQueue::open_with(url, deadlines).await?))
    } else {
        Err(QueueError::UnsupportedUrl(crate::store::redact_url(url)))
    }
}
