//! NATS JetStream behind the [`Queue`] trait, through the `async-nats` crate.
//!
//! Topology, created idempotently by whoever gets there first:
//!
//! - one **stream per namespace** `{prefix}-{namespace}` (or `{prefix}` without one),
//!   file storage, *work-queue* retention (an acked message is gone, as on the other
//!   queues), capped in bytes with discard-new (a full stream refuses publishes rather
//!   than dropping what is not consumed yet), subjects `{prefix}.{namespace}.>`;
//! - one subject and one **durable pull consumer per idemwatch consumer**
//!   (`{prefix}.{namespace}.{consumer}`, durable `{consumer}`), explicit acks,
//!   `AckWait` = the runner's visibility timeout, no server-side delivery limit (the
//!   runner dead-letters poison itself, into the `dead_letters` table).
//!
//! Delivery: `fetch` (no wait) of up to `max` messages. The delivery count is the
//! server's `num_delivered` from the message's ack subject, so a redelivery after a
//! process death is flagged as on RabbitMQ. The ack subject is the lease token: an ack
//! is a request to it that the server confirms (JetStream's *double ack*), sent only
//! after the business commit; a nack is `-NAK` with the retry delay.
//!
//! Publishing: one copy per target subject (the engine decides the fan-out), each with
//! `Nats-Msg-Id` = `{queue}:{message_id}` (the producer's id, else a hash of the body)
//! and every publish acknowledgement awaited, in windows of at most
//! [`PUBLISH_WINDOW`] unacknowledged publishes (see there why). JetStream drops a second publish with
//! the same id inside its duplicate window — a *producer* retry. That window does
//! nothing for a *consumer* redelivery (the message is stored once and delivered
//! again when unacked): the dedup table still has to catch those
//! (`tests/nats.rs` shows both).

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream, AckKind};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;

use super::{Delivery, Queue, QueueDepth, QueueError, QueueResult};
use crate::engine::store::redact_url;

/// Subject and stream-name prefix (`?prefix=` in the URL changes it).
pub const DEFAULT_PREFIX: &str = "idemwatch";
/// How long JetStream remembers a `Nats-Msg-Id` (its own default).
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// Cap of one stream (one namespace): past it publishes are refused, never dropped.
pub const STREAM_MAX_BYTES: i64 = 1 << 30;
/// Cap of one message: the envelope's 64 KiB plus room for bad input to reach the
/// dead-letter table whole.
pub const MAX_MESSAGE_BYTES: i32 = 1 << 20;
/// Longest wait for one request to the server (publish ack, fetch, ack, info).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Publishes of this queue whose acknowledgement is not in yet, at most.
///
/// `async-nats` gives every JetStream publish a permit of a semaphore (5,000 by
/// default) that is only returned when its acknowledgement future is awaited, and a
/// publish past the cap waits for a permit. Publishing a whole call's bodies before
/// awaiting any acknowledgement therefore hung for ever past 5,000 bodies (`bench
/// engine --messages 10000` on JetStream never finished). So a call publishes in
/// windows: each window takes its permits from our own semaphore all at once (a
/// fair `acquire_many`, so concurrent callers cannot each hold part of what they
/// need), publishes, and awaits every acknowledgement before the next window. The
/// library's cap is set to twice ours, so its semaphore never waits on our account
/// (an abandoned window's permits come back by the library's own ack timeout).
pub const PUBLISH_WINDOW: usize = 1024;

fn nats_err(e: impl std::fmt::Display) -> QueueError {
    QueueError::Nats(e.to_string())
}

/// A stream or consumer name: JetStream allows no `.`, `*`, `>`, `/` or whitespace.
fn name_part(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Where one idemwatch queue (`[namespace/]consumer`) lives on the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub stream: String,
    pub subject: String,
    pub durable: String,
}

/// The JetStream queue.
pub struct NatsQueue {
    client: async_nats::Client,
    js: jetstream::Context,
    prefix: String,
    redacted: String,
    /// Pull consumers already created, by idemwatch queue name.
    consumers: Mutex<HashMap<String, consumer::PullConsumer>>,
    /// Streams already created, by name.
    streams: Mutex<HashMap<String, stream::Stream>>,
    /// Room for unacknowledged publishes ([`PUBLISH_WINDOW`]).
    publish_slots: tokio::sync::Semaphore,
}

/// What one publish call did: how many copies the stream stored, and how many it
/// recognised as duplicates of a `Nats-Msg-Id` inside its window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PublishCounts {
    pub stored: u64,
    pub duplicates: u64,
}

impl NatsQueue {
    /// Connect to `nats://HOST:PORT[?prefix=P]`.
    pub async fn open(url: &str) -> QueueResult<Self> {
        let redacted = redact_url(url);
        let parsed = url::Url::parse(url)
            .map_err(|e| QueueError::BadUrl(redacted.clone(), e.to_string()))?;
        let prefix = parsed
            .query_pairs()
            .find(|(k, _)| k == "prefix")
            .map(|(_, v)| name_part(&v))
            .unwrap_or_else(|| DEFAULT_PREFIX.to_string());
        let mut server = parsed.clone();
        server.set_query(None);
        let client = async_nats::ConnectOptions::new()
            .name(format!("idemwatch pid={}", std::process::id()))
            .connection_timeout(Duration::from_secs(5))
            .request_timeout(Some(REQUEST_TIMEOUT))
            .connect(server.as_str())
            .await
            .map_err(|e| QueueError::Nats(format!("cannot connect to {redacted}: {e}")))?;
        let js = jetstream::ContextBuilder::new()
            .timeout(REQUEST_TIMEOUT)
            .max_ack_inflight(2 * PUBLISH_WINDOW)
            .build(client.clone());
        Ok(NatsQueue {
            client,
            js,
            prefix,
            redacted,
            consumers: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            publish_slots: tokio::sync::Semaphore::new(PUBLISH_WINDOW),
        })
    }

    /// The stream, subject and durable consumer of an idemwatch queue name.
    pub fn location(&self, queue: &str) -> Location {
        let (namespace, consumer) = match queue.rsplit_once('/') {
            Some((ns, c)) => (Some(name_part(ns)), name_part(c)),
            None => (None, name_part(queue)),
        };
        match namespace {
            Some(ns) => Location {
                stream: format!("{}-{ns}", self.prefix),
                subject: format!("{}.{ns}.{consumer}", self.prefix),
                durable: consumer,
            },
            None => Location {
                stream: self.prefix.clone(),
                subject: format!("{}._.{consumer}", self.prefix),
                durable: consumer,
            },
        }
    }

    async fn stream(&self, loc: &Location) -> QueueResult<stream::Stream> {
        let mut streams = self.streams.lock().await;
        if let Some(s) = streams.get(&loc.stream) {
            return Ok(s.clone());
        }
        let wildcard = match loc.subject.rsplit_once('.') {
            Some((base, _)) => format!("{base}.>"),
            None => format!("{}.>", loc.subject),
        };
        let s = self
            .js
            .get_or_create_stream(stream::Config {
                name: loc.stream.clone(),
                subjects: vec![wildcard],
                retention: stream::RetentionPolicy::WorkQueue,
                storage: stream::StorageType::File,
                discard: stream::DiscardPolicy::New,
                max_bytes: STREAM_MAX_BYTES,
                max_message_size: MAX_MESSAGE_BYTES,
                duplicate_window: DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await
            .map_err(nats_err)?;
        streams.insert(loc.stream.clone(), s.clone());
        Ok(s)
    }

    async fn consumer(
        &self,
        queue: &str,
        ack_wait: Duration,
    ) -> QueueResult<consumer::PullConsumer> {
        let mut consumers = self.consumers.lock().await;
        if let Some(c) = consumers.get(queue) {
            return Ok(c.clone());
        }
        let loc = self.location(queue);
        let stream = self.stream(&loc).await?;
        let c = stream
            .get_or_create_consumer(
                &loc.durable,
                consumer::pull::Config {
                    durable_name: Some(loc.durable.clone()),
                    filter_subject: loc.subject.clone(),
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: ack_wait.max(Duration::from_millis(100)),
                    deliver_policy: consumer::DeliverPolicy::All,
                    max_deliver: -1,
                    ..Default::default()
                },
            )
            .await
            .map_err(nats_err)?;
        consumers.insert(queue.to_string(), c.clone());
        Ok(c)
    }

    /// The consumer of `queue` if it exists on the server (without creating it).
    async fn existing_consumer(&self, queue: &str) -> QueueResult<Option<consumer::PullConsumer>> {
        if let Some(c) = self.consumers.lock().await.get(queue) {
            return Ok(Some(c.clone()));
        }
        let loc = self.location(queue);
        let Some(stream) = self.existing_stream(&loc.stream).await? else {
            return Ok(None);
        };
        match stream.consumer_info(&loc.durable).await {
            Ok(_) => {}
            Err(e) => match e.kind() {
                jetstream::context::ConsumerInfoErrorKind::NotFound
                | jetstream::context::ConsumerInfoErrorKind::StreamNotFound => return Ok(None),
                jetstream::context::ConsumerInfoErrorKind::JetStream(j)
                    if j.error_code() == jetstream::ErrorCode::CONSUMER_NOT_FOUND =>
                {
                    return Ok(None)
                }
                _ => return Err(nats_err(e)),
            },
        }
        stream
            .get_consumer::<consumer::pull::Config>(&loc.durable)
            .await
            .map(Some)
            .map_err(nats_err)
    }

    /// The stream named `name` if it exists on the server.
    async fn existing_stream(&self, name: &str) -> QueueResult<Option<stream::Stream>> {
        match self.js.get_stream(name).await {
            Ok(s) => Ok(Some(s)),
            Err(e) => match e.kind() {
                jetstream::context::GetStreamErrorKind::JetStream(j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                {
                    Ok(None)
                }
                _ => Err(nats_err(e)),
            },
        }
    }

    /// The `Nats-Msg-Id` of one body on one queue: the producer's `message_id` when
    /// the body has one, else a hash of the bytes.
    pub fn message_id(queue: &str, body: &[u8]) -> String {
        let producer_id = serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v.get("message_id")?.as_str().map(str::to_string))
            .filter(|id| !id.is_empty() && id.len() <= 256);
        match producer_id {
            Some(id) => format!("{queue}:{id}"),
            None => format!("{queue}:sha256:{}", hex::encode(Sha256::digest(body))),
        }
    }

    /// Publish each body to each queue, every publish acknowledged by the stream.
    pub async fn publish_counted(
        &self,
        queues: &[String],
        bodies: &[Vec<u8>],
    ) -> QueueResult<PublishCounts> {
        super::check_body_sizes(bodies)?;
        let mut counts = PublishCounts::default();
        for queue in queues {
            let loc = self.location(queue);
            self.stream(&loc).await?;
            for window in bodies.chunks(PUBLISH_WINDOW) {
                let n = u32::try_from(window.len()).unwrap_or(u32::MAX);
                let _slots = self.publish_slots.acquire_many(n).await.map_err(nats_err)?;
                let mut pending = Vec::with_capacity(window.len());
                for body in window {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert(
                        async_nats::header::NATS_MESSAGE_ID,
                        Self::message_id(queue, body).as_str(),
                    );
                    let ack = self
                        .js
                        .publish_with_headers(
                            loc.subject.clone(),
                            headers,
                            Bytes::from(body.clone()),
                        )
                        .await
                        .map_err(nats_err)?;
                    pending.push(ack);
                }
                // The acks arrive in any order; all of the window's must before the next.
                for ack in futures::future::join_all(
                    pending
                        .into_iter()
                        .map(std::future::IntoFuture::into_future),
                )
                .await
                {
                    let ack = ack.map_err(nats_err)?;
                    if ack.duplicate {
                        counts.duplicates += 1;
                    } else {
                        counts.stored += 1;
                    }
                }
            }
        }
        Ok(counts)
    }

    /// Delete the stream of a namespace (drill and test clean-up).
    pub async fn delete_namespace(&self, namespace: &str) -> QueueResult<()> {
        let loc = self.location(&format!("{namespace}/x"));
        self.streams.lock().await.remove(&loc.stream);
        self.consumers
            .lock()
            .await
            .retain(|q, _| !q.starts_with(&format!("{namespace}/")));
        if self.existing_stream(&loc.stream).await?.is_some() {
            self.js.delete_stream(&loc.stream).await.map_err(nats_err)?;
        }
        Ok(())
    }

    /// The server's own count of redelivered messages of `queue` right now (messages
    /// delivered more than once and not yet acked).
    pub async fn server_redelivered(&self, queue: &str) -> QueueResult<u64> {
        Ok(match self.existing_consumer(queue).await? {
            Some(c) => c.get_info().await.map_err(nats_err)?.num_redelivered as u64,
            None => 0,
        })
    }
}

/// The delivery count from a JetStream message's metadata (1 on the first delivery).
fn delivery_of(queue: &str, m: &jetstream::Message) -> QueueResult<Delivery> {
    let info = m.info().map_err(nats_err)?;
    let count = u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX);
    let token = m
        .reply
        .as_ref()
        .map(|r| r.to_string())
        .ok_or_else(|| QueueError::Nats("a JetStream message without an ack subject".into()))?;
    Ok(Delivery {
        id: i64::try_from(info.stream_sequence).unwrap_or(i64::MAX),
        queue: queue.to_string(),
        body: m.payload.to_vec(),
        delivery_count: count,
        // JetStream counts every delivery and cannot be told otherwise: an uncounted
        // return is counted here (the consumer's pause still keeps an outage short
        // of the limit; a header of our own, as on AMQP, is not done yet).
        attempts: count,
        redelivered: count > 1,
        lease_token: token,
    })
}

#[async_trait]
impl Queue for NatsQueue {
    async fn publish(&self, queues: &[String], bodies: &[Vec<u8>]) -> QueueResult<()> {
        self.publish_counted(queues, bodies).await.map(|_| ())
    }

    async fn lease(
        &self,
        queue: &str,
        max: usize,
        visibility: Duration,
    ) -> QueueResult<Vec<Delivery>> {
        let consumer = self.consumer(queue, visibility).await?;
        let mut batch = consumer
            .fetch()
            .max_messages(max.max(1))
            .messages()
            .await
            .map_err(nats_err)?;
        let mut out = Vec::new();
        while let Some(m) = batch.next().await {
            let m = m.map_err(nats_err)?;
            out.push(delivery_of(queue, &m)?);
        }
        Ok(out)
    }

    /// The double ack: `+ACK` as a request the server answers once it has applied it.
    async fn ack(&self, delivery: &Delivery) -> QueueResult<bool> {
        let reply = tokio::time::timeout(
            REQUEST_TIMEOUT,
            self.client
                .request(delivery.lease_token.clone(), Bytes::from(AckKind::Ack)),
        )
        .await
        .map_err(|_| QueueError::Nats("ack not confirmed in time".into()))?
        .map_err(nats_err)?;
        drop(reply);
        Ok(true)
    }

    async fn ack_batch(&self, deliveries: &[Delivery]) -> QueueResult<usize> {
        let results = futures::future::join_all(deliveries.iter().map(|d| self.ack(d))).await;
        let mut acked = 0;
        for r in results {
            if r? {
                acked += 1;
            }
        }
        Ok(acked)
    }

    async fn nack(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()> {
        let kind = AckKind::Nak((!delay.is_zero()).then_some(delay));
        self.client
            .publish(delivery.lease_token.clone(), Bytes::from(kind))
            .await
            .map_err(nats_err)?;
        self.client.flush().await.map_err(nats_err)
    }

    async fn nack_uncounted(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()> {
        self.nack(delivery, delay).await
    }

    async fn depth(&self, queue: &str) -> QueueResult<QueueDepth> {
        let Some(c) = self.existing_consumer(queue).await? else {
            return Ok(QueueDepth::default());
        };
        let info = c.get_info().await.map_err(nats_err)?;
        Ok(QueueDepth {
            ready: info.num_pending,
            in_flight: info.num_ack_pending as u64,
        })
    }

    async fn purge_queue(&self, queue: &str) -> QueueResult<u64> {
        let loc = self.location(queue);
        let Some(stream) = self.existing_stream(&loc.stream).await? else {
            return Ok(0);
        };
        let purged = stream
            .purge()
            .filter(loc.subject.clone())
            .await
            .map_err(nats_err)?;
        Ok(purged.purged)
    }

    /// Purge the subject and delete the durable consumer; the namespace's stream goes
    /// with its last consumer, so drill namespaces leave nothing on the server.
    async fn remove_queue(&self, queue: &str) -> QueueResult<u64> {
        let purged = self.purge_queue(queue).await?;
        let loc = self.location(queue);
        self.consumers.lock().await.remove(queue);
        if let Some(mut stream) = self.existing_stream(&loc.stream).await? {
            let _ = stream.delete_consumer(&loc.durable).await;
            let left = stream
                .info()
                .await
                .map(|i| i.state.consumer_count)
                .unwrap_or(1);
            if left == 0 && loc.stream != self.prefix {
                self.streams.lock().await.remove(&loc.stream);
                let _ = self.js.delete_stream(&loc.stream).await;
            }
        }
        Ok(purged)
    }

    async fn close(&self) {
        let _ = tokio::time::timeout(REQUEST_TIMEOUT, self.client.flush()).await;
    }

    fn redacted_url(&self) -> String {
        self.redacted.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_server_accepts() {
        assert_eq!(name_part("drill-12-ab.c*d>e/f g"), "drill-12-ab_c_d_e_f_g");
    }

    #[test]
    fn a_producer_id_is_the_msg_id_and_a_body_without_one_its_hash() {
        let with = br#"{"message_id":"p-81f3","device_id":"d"}"#;
        assert_eq!(
            NatsQueue::message_id("ns/trip-counter", with),
            "ns/trip-counter:p-81f3"
        );
        let without = br#"{"device_id":"d"}"#;
        let id = NatsQueue::message_id("q", without);
        assert!(
            id.starts_with("q:sha256:") && id.len() == "q:sha256:".len() + 64,
            "{id}"
        );
        assert_ne!(id, NatsQueue::message_id("q", b"not json"));
    }
}
