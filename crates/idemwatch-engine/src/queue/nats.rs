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
//! Uncounted returns (an outage, throttling, a lease given back unhandled) must not
//! spend `max_deliveries`, but JetStream counts every delivery and has no way to give
//! a message back without counting it: `-NAK` and a run-out `AckWait` both raise
//! `num_delivered`, and `+WPI` only holds a message, it never makes it deliverable
//! again. So an uncounted return is a **copy with our own counts** (as the classic
//! AMQP path does, `amqp.rs`): the delivery is held for the return's delay (`+WPI`
//! keeps its lease alive past `AckWait`), then its body is published again with the
//! headers `Idemwatch-Attempts` / `Idemwatch-Deliveries` (what counted and what
//! happened before the copy) under `Nats-Msg-Id` `{id}:u{stream sequence}` — a fresh
//! id, else the duplicate window would drop the copy as a producer retry — and only
//! once the stream has stored it is the original acked. A delivery's attempts are the
//! header's plus this copy's `num_delivered`, its delivery count likewise. A crash
//! between the copy and the ack leaves both: the original comes back counted (a crash
//! is counted on every queue) and the dedup table drops whichever is second; a second
//! return of the same stored message reuses its copy's id, so the window keeps one.
//! Chosen over holding with `+WPI` alone, which would keep the message in one
//! process's memory for the whole outage (lost, and counted, when that process stops)
//! and in the consumer's `max_ack_pending` the while. The copy goes to the end of its
//! subject, as a requeued message does on the other queues.
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
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream, AckKind};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;

use super::{nats_poison, Delivery, Queue, QueueDepth, QueueError, QueueResult};
use crate::deadlines::Deadlines;
use crate::store::redact_url;

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
/// Header of a returned copy: the deliveries before it that counted toward
/// `max_deliveries`.
pub const ATTEMPTS_HEADER: &str = "Idemwatch-Attempts";
/// Header of a returned copy: all deliveries before it.
pub const DELIVERIES_HEADER: &str = "Idemwatch-Deliveries";
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

/// How often a stream's creation is asked again after the server failed it (about
/// 1.5 s in all: 100, 200, 400, 800 ms).
const STREAM_CREATE_RETRIES: u32 = 4;

/// The server's own trouble setting a stream up (its API answered 5xx): seen as error
/// 10049 "error creating store for stream" when the server removed its account's
/// empty storage directory after another client deleted its last stream, at the
/// instant this one's was being made (nats-server's log: "could not create storage
/// directory … no such file or directory"). Asked again, it succeeds; a chaos drill's
/// setup failed on it in a CI run. A refusal of the request (4xx: a bad name, a
/// config in conflict) is not asked again.
fn server_fault(e: &async_nats::jetstream::context::CreateStreamError) -> bool {
    use async_nats::jetstream::context::CreateStreamErrorKind;
    matches!(e.kind(), CreateStreamErrorKind::JetStream(err) if err.code() >= 500)
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
    publish_slots: Arc<tokio::sync::Semaphore>,
    /// Uncounted returns waiting out their delay (see the module doc).
    returns: std::sync::Mutex<tokio::task::JoinSet<()>>,
    /// Set by [`Queue::close`]: the waiting returns are made at once.
    flush: tokio::sync::watch::Sender<bool>,
    /// The longest a lease's fetch may take (see [`fetch_deadline`]).
    fetch_timeout: Duration,
}

/// A no-wait fetch is answered within a round trip; one unanswered for two
/// heartbeats (at most [`REQUEST_TIMEOUT`]) was asked on a link that went silent, and
/// its answer will not come even once async-nats has reconnected (the pull request
/// went out on the old link).
fn fetch_deadline(heartbeat: Duration) -> Duration {
    heartbeat.saturating_mul(2).min(REQUEST_TIMEOUT)
}

/// What one publish call did: how many copies the stream stored, and how many it
/// recognised as duplicates of a `Nats-Msg-Id` inside its window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PublishCounts {
    pub stored: u64,
    pub duplicates: u64,
}

impl NatsQueue {
    /// [`NatsQueue::open_with`] the default deadlines.
    pub async fn open(url: &str) -> QueueResult<Self> {
        Self::open_with(url, &Deadlines::default()).await
    }

    /// Connect to `nats://HOST:PORT[?prefix=P]`, within `connect_timeout`, pinging
    /// the server every `heartbeat`: async-nats drops a link with two pings
    /// unanswered and reconnects (its 60 s default left a frozen link unnoticed for
    /// minutes, every request on it timing out meanwhile).
    pub async fn open_with(url: &str, deadlines: &Deadlines) -> QueueResult<Self> {
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
            .connection_timeout(deadlines.connect_timeout)
            .ping_interval(deadlines.heartbeat)
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
            publish_slots: Arc::new(tokio::sync::Semaphore::new(PUBLISH_WINDOW)),
            returns: std::sync::Mutex::new(tokio::task::JoinSet::new()),
            flush: tokio::sync::watch::channel(false).0,
            fetch_timeout: fetch_deadline(deadlines.heartbeat),
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
        let config = stream::Config {
            name: loc.stream.clone(),
            subjects: vec![wildcard],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            discard: stream::DiscardPolicy::New,
            max_bytes: STREAM_MAX_BYTES,
            max_message_size: MAX_MESSAGE_BYTES,
            duplicate_window: DUPLICATE_WINDOW,
            ..Default::default()
        };
        let mut attempt = 0u32;
        let s = loop {
            match self.js.get_or_create_stream(config.clone()).await {
                Ok(s) => break s,
                Err(e) if attempt < STREAM_CREATE_RETRIES && server_fault(&e) => {
                    attempt += 1;
                    tracing::debug!(error = %e, attempt, stream = %loc.stream, "JetStream could not set the stream up; asking again");
                    tokio::time::sleep(Duration::from_millis(50) * 2u32.pow(attempt)).await;
                }
                Err(e) => return Err(nats_err(e)),
            }
        };
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

/// A count from one of our headers (0 when absent or not a number).
fn header_count(m: &jetstream::Message, name: &str) -> u32 {
    m.headers
        .as_ref()
        .and_then(|h| h.get(name))
        .and_then(|v| v.as_str().trim().parse().ok())
        .unwrap_or(0)
}

/// A delivery from a JetStream message: the server's `num_delivered` (1 on the first
/// delivery of this stored message) on top of the counts a returned copy carries.
fn delivery_of(queue: &str, m: &jetstream::Message) -> QueueResult<Delivery> {
    let info = m.info().map_err(nats_err)?;
    let here = u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX);
    let count = header_count(m, DELIVERIES_HEADER).saturating_add(here);
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
        attempts: header_count(m, ATTEMPTS_HEADER).saturating_add(here),
        redelivered: count > 1,
        lease_token: token,
    })
}

/// One uncounted return: what the copy carries and where it goes.
struct Return {
    client: async_nats::Client,
    js: jetstream::Context,
    slots: Arc<tokio::sync::Semaphore>,
    subject: String,
    /// The original's ack subject.
    token: String,
    body: Bytes,
    headers: async_nats::HeaderMap,
    delay: Duration,
    /// How often the held original's lease is renewed (`+WPI`): within its `AckWait`.
    keep_alive: Duration,
}

impl Return {
    /// Hold the original for the delay (sooner when the queue closes), then copy and
    /// ack it. A copy the stream does not take falls back to `-NAK`: counted, but
    /// never lost.
    async fn make(self, mut flush: tokio::sync::watch::Receiver<bool>) {
        let until = tokio::time::Instant::now() + self.delay;
        loop {
            if *flush.borrow() || tokio::time::Instant::now() >= until {
                break;
            }
            let step = until
                .saturating_duration_since(tokio::time::Instant::now())
                .min(self.keep_alive);
            tokio::select! {
                _ = tokio::time::sleep(step) => {}
                changed = flush.changed() => if changed.is_err() { break },
            }
            if tokio::time::Instant::now() < until && !*flush.borrow() {
                let _ = self
                    .client
                    .publish(self.token.clone(), Bytes::from(AckKind::Progress))
                    .await;
            }
        }
        if let Err(e) = self.copy_then_ack().await {
            tracing::warn!(error = %e, "an uncounted return failed: given back counted instead");
            let _ = self
                .client
                .publish(self.token.clone(), Bytes::from(AckKind::Nak(None)))
                .await;
        }
    }

    async fn copy_then_ack(&self) -> QueueResult<()> {
        let _slot = self.slots.acquire().await.map_err(nats_err)?;
        let ack = self
            .js
            .publish_with_headers(
                self.subject.clone(),
                self.headers.clone(),
                self.body.clone(),
            )
            .await
            .map_err(nats_err)?;
        ack.await.map_err(nats_err)?;
        // The copy is stored: the original goes (confirmed, as any ack).
        ack_confirmed(&self.client, &self.token).await
    }
}

/// The double ack: `+ACK` as a request the server answers once it has applied it.
async fn ack_confirmed(client: &async_nats::Client, token: &str) -> QueueResult<()> {
    tokio::time::timeout(
        REQUEST_TIMEOUT,
        client.request(token.to_string(), Bytes::from(AckKind::Ack)),
    )
    .await
    .map_err(|_| QueueError::TimedOut {
        what: "ack".into(),
        after: REQUEST_TIMEOUT,
    })?
    .map_err(nats_err)?;
    Ok(())
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
        // A fetch has no expiry of its own: on a link that froze, or whose connection
        // ended under it, its end (the server's "no more messages") would never come.
        // So its start and each message within a deadline; what came before a failure
        // is still leased.
        let timed_out = || QueueError::TimedOut {
            what: "fetch".into(),
            after: self.fetch_timeout,
        };
        let mut batch = tokio::time::timeout(
            self.fetch_timeout,
            consumer.fetch().max_messages(max.max(1)).messages(),
        )
        .await
        .map_err(|_| timed_out())?
        .map_err(nats_err)?;
        let mut out = Vec::new();
        let failed = loop {
            match tokio::time::timeout(self.fetch_timeout, batch.next()).await {
                Ok(Some(Ok(m))) => out.push(delivery_of(queue, &m)?),
                Ok(Some(Err(e))) => break Some(nats_err(e)),
                Ok(None) => break None,
                Err(_) => break Some(timed_out()),
            }
        };
        let Some(e) = failed else {
            return Ok(out);
        };
        // Maybe a message whose headers no client reads ended the connection: it
        // would end every next one (`nats_poison.rs`). Looked for within the fetch
        // deadline too: on a link that froze (the other cause of a failed fetch) the
        // look would otherwise wait out the client's request timeout on the same
        // silent socket before the consumer pauses and reconnects.
        let loc = self.location(queue);
        let repair = async {
            let stream = self.stream(&loc).await?;
            nats_poison::repair_unreadable_headers(&self.js, &stream, &consumer, queue).await
        };
        match tokio::time::timeout(self.fetch_timeout, repair).await {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => {
                tracing::warn!(queue, replaced = n, "unreadable JetStream headers replaced")
            }
            Ok(Err(r)) => {
                tracing::warn!(queue, error = %r, "could not look for unreadable JetStream headers")
            }
            Err(_) => tracing::warn!(
                queue,
                "no answer in time while looking for unreadable JetStream headers"
            ),
        }
        if out.is_empty() {
            return Err(e);
        }
        Ok(out)
    }

    /// The double ack ([`ack_confirmed`]).
    async fn ack(&self, delivery: &Delivery) -> QueueResult<bool> {
        ack_confirmed(&self.client, &delivery.lease_token).await?;
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

    /// A copy with our own counts, then the original acked (see the module doc):
    /// after `delay`, holding the original meanwhile.
    async fn nack_uncounted(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()> {
        let keep_alive = self
            .consumers
            .lock()
            .await
            .get(&delivery.queue)
            .map_or(Duration::from_secs(1), |c| {
                c.cached_info().config.ack_wait / 2
            })
            .max(Duration::from_millis(50));
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!(
                "{}:u{}",
                Self::message_id(&delivery.queue, &delivery.body),
                delivery.id
            )
            .as_str(),
        );
        headers.insert(
            ATTEMPTS_HEADER,
            delivery.attempts.saturating_sub(1).to_string().as_str(),
        );
        headers.insert(
            DELIVERIES_HEADER,
            delivery.delivery_count.to_string().as_str(),
        );
        let ret = Return {
            client: self.client.clone(),
            js: self.js.clone(),
            slots: self.publish_slots.clone(),
            subject: self.location(&delivery.queue).subject,
            token: delivery.lease_token.clone(),
            body: Bytes::from(delivery.body.clone()),
            headers,
            delay,
            keep_alive,
        };
        if delay.is_zero() {
            return ret.copy_then_ack().await;
        }
        let flush = self.flush.subscribe();
        let mut returns = self.returns.lock().unwrap_or_else(|p| p.into_inner());
        while returns.try_join_next().is_some() {}
        returns.spawn(ret.make(flush));
        Ok(())
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

    /// Make the waiting uncounted returns now (a stopping process would otherwise
    /// leave their originals to run out of `AckWait`, counted), then flush.
    async fn close(&self) {
        self.flush.send_replace(true);
        let mut returns =
            std::mem::take(&mut *self.returns.lock().unwrap_or_else(|p| p.into_inner()));
        let _ = tokio::time::timeout(2 * REQUEST_TIMEOUT, async {
            while returns.join_next().await.is_some() {}
        })
        .await;
        let _ = tokio::time::timeout(REQUEST_TIMEOUT, self.client.flush()).await;
    }

    fn redacted_url(&self) -> String {
        self.redacted.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The server's 500 (error 10049, its store for the stream) is asked again; a
    /// 400 (a config the server refuses) and a timeout are not.
    #[test]
    fn only_the_servers_own_failure_to_make_a_stream_is_asked_again() {
        use async_nats::jetstream::context::{CreateStreamError, CreateStreamErrorKind};
        let answer = |code: u16, err_code: u64| {
            let body = format!(
                r#"{{"code":{code},"err_code":{err_code},"description":"error creating store for stream"}}"#
            );
            CreateStreamError::new(CreateStreamErrorKind::JetStream(
                serde_json::from_str(&body).unwrap(),
            ))
        };
        assert!(server_fault(&answer(500, 10049)));
        assert!(!server_fault(&answer(400, 10058)));
        assert!(!server_fault(&CreateStreamError::new(
            CreateStreamErrorKind::TimedOut
        )));
    }

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
