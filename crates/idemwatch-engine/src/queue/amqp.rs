//! RabbitMQ (AMQP 0-9-1) behind the [`Queue`] trait, through the `amqprs` crate.
//!
//! Why `amqprs` and not `lapin`: lapin runs its own I/O thread and hands every frame
//! across it, so each delivery and ack costs thread wake-ups on a machine whose cores
//! the broker and the database need too; amqprs reads and writes in tokio tasks on the
//! engine's own runtime. Measured (docs/journal/benchmarks-2026-11-30-to-12-05.md, "Which AMQP client" and "amqprs in
//! the engine"): 3.9 against 6.4–7.4 µs of our CPU per delivery on the consume path,
//! and a tenth of the context switches. What amqprs does not do for us: it does not
//! hold an incoming frame to the negotiated `frame_max`, so the broker is trusted not
//! to send more than its own `max_message_size` (RabbitMQ's default 128 MiB); the
//! broker is the operator's, reached with the operator's credentials, unlike the
//! HTTP peers and scrape targets, which are capped by us. amqprs also unwraps where
//! a string exceeds AMQP's 255-byte short strings, so every name and the vhost are
//! held under that here ([`MAX_PREFIX`], [`connection_args`]). A method frame it does
//! not know panics its reader task (not seen with RabbitMQ 3.10; untested): by its
//! code, the consumers' receivers close then, the next lease fails, and that
//! reconnects, as after a broker restart.
//!
//! Topology, declared idempotently by whoever gets there first (publisher or consumer):
//!
//! - one durable **direct exchange** `{prefix}`; every consumer queue is bound to it with
//!   its own name as routing key. The engine decides the fan-out (which consumers get a
//!   message, so `publish --consumer X` and drills can target a subset) and publishes one
//!   copy per target queue; another producer can publish to the same exchange.
//! - one durable **queue per consumer** `{prefix}.{namespace}.{consumer}`, a *quorum*
//!   queue where the broker has them (classic durable otherwise), with the dead-letter
//!   exchange `{prefix}.dlx` (fanout → queue `{prefix}.dead-letters`) and a
//!   `x-delivery-limit` far above the runner's `max_deliveries`: the runner dead-letters
//!   poison messages into the `dead_letters` table itself; the broker's limit is the safety
//!   net for a message the runner cannot even record (its database is down).
//!
//! Delivery: a consumer channel per queue with `basic.qos(prefetch)` + `basic.consume`
//! (the broker pushes; `basic.get` would cost one round trip per message), drained into
//! [`Queue::lease`]. Unacked deliveries come back when the channel or connection closes —
//! a process death, the field report's mechanism — with the broker's `redelivered` flag,
//! and on quorum queues an `x-delivery-count` header. AMQP has no visibility timeout: a
//! lease that outlives its `visibility` is given back here with `basic.nack(requeue)` the
//! next time the queue is leased, which keeps the trait's semantics (in-process drills
//! crash a worker without closing the connection). A stale ack after that is refused
//! locally (`Ok(false)`) instead of being sent with an unknown tag, which would close the
//! channel.
//!
//! Publishing: persistent messages, `mandatory`, publisher confirms awaited for the whole
//! batch (amqprs hands confirms and returns to a channel callback, [`Confirms`], not to
//! a future per message). A batch that fails (broker restart) is retried on a new
//! connection: a message may then be published twice, never lost — the consumers' dedup
//! drops the copy.
//!
//! Reconnection: every operation goes through the current connection; any channel or
//! connection error drops it and the next call opens a new one. Deliveries leased on the
//! old connection cannot be acked any more (`Ok(false)`): the broker requeued them when the
//! connection died and redelivers them, flagged, and the dedup makes that harmless.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amqprs::callbacks::{ChannelCallback, ConnectionCallback};
use amqprs::channel::{
    BasicAckArguments, BasicConsumeArguments, BasicNackArguments, BasicPublishArguments,
    BasicQosArguments, Channel, ConfirmSelectArguments, ConsumerMessage, ExchangeDeclareArguments,
    ExchangeDeleteArguments, QueueBindArguments, QueueDeclareArguments, QueueDeleteArguments,
    QueuePurgeArguments,
};
use amqprs::connection::{Connection, OpenConnectionArguments};
use amqprs::{BasicProperties, FieldName, FieldTable, FieldValue};
use async_trait::async_trait;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, Mutex, Notify};

use super::{Delivery, Queue, QueueDepth, QueueError, QueueResult};
use crate::deadlines::Deadlines;
use crate::store::redact_url;

/// Least `basic.qos` prefetch per consumer channel. Without `?prefetch=N` a channel
/// asks for three times the first lease's size when that is more: while the pipelined
/// runner handles one lease and leases the next beside it, the lease before is still
/// unacked in the broker's count (its ack goes out with that next lease, and a quorum
/// queue settles it through its log). With room for only two, the broker pushes the
/// next lease's deliveries only after that ack is settled, a few at a time, and the
/// next batch waits for them; with three they are in the client's buffer by then.
pub const DEFAULT_PREFETCH: u16 = 32;
/// The broker-side safety net (quorum queues only), well above any `max_deliveries`.
pub const BROKER_DELIVERY_LIMIT: i64 = 100;
/// How long an empty lease waits for the broker to push something.
const LEASE_WAIT: Duration = Duration::from_millis(100);
/// How long a lease run beside a batch ([`Queue::ack_then_lease_beside`]) still waits
/// once that batch is done: the broker answers an ack with the deliveries it frees
/// within a millisecond or so on a healthy link; a longer silence means the queue has
/// nothing, and the runner had better ack the batch than sit out [`LEASE_WAIT`].
const BESIDE_GRACE: Duration = Duration::from_millis(5);
/// A delivery given back with `basic.nack(requeue)` is counted in flight this long: the
/// broker requeues it asynchronously (through Raft on a quorum queue), so for a moment
/// it is neither ready nor ours, and `depth` must not call the queue empty.
const RETURN_GRACE: Duration = Duration::from_secs(1);
/// How long a publish keeps retrying through reconnections before giving up.
const PUBLISH_RETRY_FOR: Duration = Duration::from_secs(60);

/// Which kind of queue to declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueKind {
    Quorum,
    Classic,
}

/// Options read from (and removed from) the `amqp://` URL's query string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmqpOptions {
    /// `?prefetch=N`; `None`: [`DEFAULT_PREFETCH`] or three times the lease size, the more.
    pub prefetch: Option<u16>,
    /// `?queue_type=quorum|classic`
    pub kind: QueueKind,
    /// `?prefix=NAME`: the exchange and queue-name prefix.
    pub prefix: String,
}

impl Default for AmqpOptions {
    fn default() -> Self {
        AmqpOptions {
            prefetch: None,
            kind: QueueKind::Quorum,
            prefix: "idemwatch".into(),
        }
    }
}

/// Split our own query parameters off an `amqp://` URL; the rest is the broker's
/// ([`connection_args`]).
pub fn parse_url(raw: &str) -> QueueResult<(String, AmqpOptions)> {
    let mut url =
        url::Url::parse(raw).map_err(|e| QueueError::BadUrl(redact_url(raw), e.to_string()))?;
    let mut opts = AmqpOptions::default();
    let mut rest = Vec::new();
    for (k, v) in url.query_pairs() {
        match k.as_ref() {
            "prefetch" => {
                opts.prefetch =
                    Some(v.parse().ok().filter(|p| *p > 0).ok_or_else(|| {
                        QueueError::BadUrl(redact_url(raw), format!("prefetch={v}"))
                    })?)
            }
            "queue_type" => {
                opts.kind = match v.as_ref() {
                    "quorum" => QueueKind::Quorum,
                    "classic" => QueueKind::Classic,
                    other => {
                        return Err(QueueError::BadUrl(
                            redact_url(raw),
                            format!("queue_type={other} (quorum or classic)"),
                        ))
                    }
                }
            }
            "prefix" if v.chars().count() > MAX_PREFIX => {
                return Err(QueueError::BadUrl(
                    redact_url(raw),
                    format!("prefix longer than {MAX_PREFIX} characters"),
                ))
            }
            "prefix" if !v.is_empty() => opts.prefix = sanitize(&v),
            _ => rest.push((k.into_owned(), v.into_owned())),
        }
    }
    if rest.is_empty() {
        url.set_query(None);
    } else {
        url.query_pairs_mut().clear().extend_pairs(rest);
    }
    Ok((url.to_string(), opts))
}

/// The longest `?prefix=`: with the dot and a queue name cut to [`MAX_QUEUE_NAME`],
/// every name we give the broker fits AMQP's short strings (255 bytes), which amqprs
/// would otherwise panic on.
const MAX_PREFIX: usize = 48;
/// The longest engine queue name kept (longer ones are cut).
const MAX_QUEUE_NAME: usize = 200;

/// Keep queue names to what every RabbitMQ tool handles without escaping.
fn sanitize(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| match c {
            '/' => '.',
            c if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') => c,
            _ => '_',
        })
        .collect();
    s.chars().take(MAX_QUEUE_NAME).collect()
}

/// What [`Connection::open`] needs, from what [`parse_url`] left of the URL:
/// `amqp[s]://[user[:password]@]host[:port][/vhost][?heartbeat=S]`, user and password
/// guest by default, the vhost `/` when the path is empty (`%2f` spelled out is `/`
/// too). `amqps` verifies the broker's certificate against the web PKI roots. Any
/// other parameter is refused rather than ignored: a setting that silently does nothing
/// is worse than an error naming it.
fn connection_args(rest: &str) -> QueueResult<OpenConnectionArguments> {
    let bad = |why: String| QueueError::BadUrl(redact_url(rest), why);
    let url = url::Url::parse(rest).map_err(|e| bad(e.to_string()))?;
    let tls = match url.scheme() {
        "amqp" => false,
        "amqps" => true,
        other => return Err(bad(format!("scheme {other} (amqp or amqps)"))),
    };
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| bad("no host".into()))?
        .trim_matches(|c| c == '[' || c == ']')
        .to_string();
    let port = url.port().unwrap_or(if tls { 5671 } else { 5672 });
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|c| c.into_owned())
            .map_err(|_| bad("not UTF-8 once decoded".into()))
    };
    let user = match url.username() {
        "" => "guest".to_string(),
        u => decode(u)?,
    };
    let password = match url.password() {
        None => "guest".to_string(),
        Some(p) => decode(p)?,
    };
    let vhost = match url.path().strip_prefix('/').unwrap_or("") {
        "" => "/".to_string(),
        v => decode(v)?,
    };
    // AMQP carries the vhost as a short string; amqprs would panic on a longer one.
    if vhost.len() > 255 {
        return Err(bad("a vhost longer than 255 bytes".into()));
    }
    let mut args = OpenConnectionArguments::new(&host, port, &user, &password);
    args.virtual_host(&vhost)
        // The name shows in the broker's connection list and management UI, and lets
        // an operator (or a test) find and close one process's connection.
        .connection_name(&format!("idemwatch pid={}", std::process::id()));
    for (k, v) in url.query_pairs() {
        match k.as_ref() {
            "heartbeat" => {
                let s: u16 = v.parse().map_err(|_| bad(format!("heartbeat={v}")))?;
                args.heartbeat(s);
            }
            other => return Err(bad(format!("unsupported parameter {other}"))),
        }
    }
    if tls {
        let adaptor = amqprs::tls::TlsAdaptor::without_client_auth(None, host.clone())
            .map_err(|e| bad(format!("TLS set-up: {e}")))?;
        args.scheme("amqps").tls_adaptor(adaptor);
    }
    Ok(args.finish())
}

/// [`connection_args`] with the deadlines' heartbeat, unless the URL sets its own.
fn connection_args_with(rest: &str, deadlines: &Deadlines) -> QueueResult<OpenConnectionArguments> {
    let mut args = connection_args(rest)?;
    let url_says = url::Url::parse(rest)
        .map(|u| u.query_pairs().any(|(k, _)| k == "heartbeat"))
        .unwrap_or(false);
    if !url_says {
        args.heartbeat(deadlines.heartbeat_secs());
    }
    Ok(args)
}

/// One delivery between `lease` and `ack`/`nack`.
struct InFlight {
    queue: String,
    /// The consumer channel it came on: acks and nacks go there.
    channel: Channel,
    /// The broker's delivery tag on the lease's channel (see [`Queue::ack_batch`]).
    tag: u64,
    deadline: Instant,
    /// What happens at the deadline: by default the lease ran out (`basic.nack`
    /// requeue, as a dead consumer's would); after a `nack` with a delay, the
    /// counted or uncounted return it asked for.
    then: Return,
}

/// How a delivery goes back to its queue.
#[derive(Debug, Clone)]
enum Return {
    /// `basic.nack(requeue)`: the broker counts it (quorum queues), or only flags it
    /// redelivered (classic queues).
    Requeue,
    /// A copy published with our own counts in its headers, then the original acked:
    /// exact counts on every queue type, and an uncounted return possible.
    Republish { body: Vec<u8>, counts: Counts },
}

/// Our own delivery counts, carried in a message's headers across the copies a
/// return publishes: what came before the copy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counts {
    /// Deliveries that counted toward `max_deliveries`.
    attempts: u32,
    /// All deliveries.
    deliveries: u32,
}

/// Header of the deliveries that counted, before this copy.
const ATTEMPTS_HEADER: &str = "x-idemwatch-attempts";
/// Header of all deliveries before this copy.
const DELIVERIES_HEADER: &str = "x-idemwatch-deliveries";

impl Counts {
    fn of(d: &Incoming) -> Counts {
        let header = |name: &str| header_of(d, name).unwrap_or(0);
        Counts {
            attempts: header(ATTEMPTS_HEADER),
            deliveries: header(DELIVERIES_HEADER),
        }
    }

    fn headers(self) -> FieldTable {
        let mut t = FieldTable::new();
        t.insert(field(ATTEMPTS_HEADER), FieldValue::i(self.attempts));
        t.insert(field(DELIVERIES_HEADER), FieldValue::i(self.deliveries));
        t
    }
}

/// A delivery as the broker pushed it, not leased yet.
struct Incoming {
    tag: u64,
    redelivered: bool,
    headers: Option<FieldTable>,
    body: Vec<u8>,
}

impl Incoming {
    /// What the channel's dispatcher hands over: a `basic.deliver` with its header and
    /// body (it forwards nothing else to a consumer).
    fn of(m: ConsumerMessage) -> QueueResult<Incoming> {
        let deliver = m
            .deliver
            .ok_or_else(|| QueueError::Amqp("a delivery without its basic.deliver".into()))?;
        Ok(Incoming {
            tag: deliver.delivery_tag(),
            redelivered: deliver.redelivered(),
            headers: m.basic_properties.and_then(|p| p.headers().cloned()),
            body: m.content.unwrap_or_default(),
        })
    }
}

/// The consumer side of one queue on one connection.
struct QueueConsumer {
    /// Its `basic.qos` prefetch.
    prefetch: u16,
    channel: Channel,
    /// What the channel's dispatcher forwards; closed when the channel or the
    /// connection goes.
    consumer: Mutex<mpsc::UnboundedReceiver<ConsumerMessage>>,
    /// Deliveries pushed by the broker, not leased yet (drained from the receiver when
    /// counting depth).
    buffered: Mutex<VecDeque<Incoming>>,
}

/// The publisher channel and what its callback learns of confirms and returns.
struct Publisher {
    channel: Channel,
    confirms: Arc<Confirms>,
}

/// Publisher confirms as they arrive (`basic.ack`/`basic.nack` from the broker, each
/// for one delivery tag or, `multiple`, every tag up to it) and mandatory returns.
/// One batch publishes at a time (the publisher's lock), so whatever arrives while it
/// waits is its own.
#[derive(Default)]
struct Confirms {
    state: std::sync::Mutex<ConfirmState>,
    changed: Notify,
}

#[derive(Default)]
struct ConfirmState {
    /// The tag the next publish gets (1 after `confirm.select`).
    next_tag: u64,
    /// Tags published and neither acked nor nacked yet.
    outstanding: std::collections::BTreeSet<u64>,
    nacked: u64,
    returned: u64,
}

impl Confirms {
    fn lock(&self) -> std::sync::MutexGuard<'_, ConfirmState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn settle(&self, tag: u64, multiple: bool, refused: bool) {
        let mut st = self.lock();
        let settled = if multiple {
            let above = st.outstanding.split_off(&(tag + 1));
            let n = st.outstanding.len() as u64;
            st.outstanding = above;
            n
        } else {
            u64::from(st.outstanding.remove(&tag))
        };
        if refused {
            st.nacked += settled;
        }
        drop(st);
        self.changed.notify_one();
    }
}

/// A channel's callback. What the broker says when it closes a channel is worth a
/// log line (a refused declaration closes its channel on purpose); on the publisher
/// channel (`confirms`), confirms and returns go into [`Confirms`], and a close wakes
/// the batch waiting for them.
struct ChannelEvents {
    confirms: Option<Arc<Confirms>>,
}

#[async_trait]
impl ChannelCallback for ChannelEvents {
    async fn close(
        &mut self,
        _: &Channel,
        close: amqprs::CloseChannel,
    ) -> Result<(), amqprs::error::Error> {
        match &self.confirms {
            Some(c) => {
                tracing::warn!(reason = %close, "the broker closed the publisher channel");
                c.changed.notify_one();
            }
            None => tracing::debug!(reason = %close, "the broker closed a channel"),
        }
        Ok(())
    }
    async fn cancel(&mut self, _: &Channel, _: amqprs::Cancel) -> Result<(), amqprs::error::Error> {
        tracing::warn!("the broker cancelled a consumer (its queue was deleted?)");
        Ok(())
    }
    async fn flow(&mut self, _: &Channel, active: bool) -> Result<bool, amqprs::error::Error> {
        Ok(active)
    }
    async fn publish_ack(&mut self, _: &Channel, ack: amqprs::Ack) {
        if let Some(c) = &self.confirms {
            c.settle(ack.delivery_tag(), ack.mutiple(), false);
        }
    }
    async fn publish_nack(&mut self, _: &Channel, nack: amqprs::Nack) {
        if let Some(c) = &self.confirms {
            c.settle(nack.delivery_tag(), nack.multiple(), true);
        }
    }
    async fn publish_return(
        &mut self,
        _: &Channel,
        _: amqprs::Return,
        _: BasicProperties,
        _: Vec<u8>,
    ) {
        if let Some(c) = &self.confirms {
            c.lock().returned += 1;
            c.changed.notify_one();
        }
    }
}

/// The connection's callback: what the broker says when it closes or blocks it.
struct Quiet;

#[async_trait]
impl ConnectionCallback for Quiet {
    async fn close(
        &mut self,
        _: &Connection,
        close: amqprs::Close,
    ) -> Result<(), amqprs::error::Error> {
        tracing::warn!(reason = %close, "the broker closed the AMQP connection");
        Ok(())
    }
    async fn blocked(&mut self, _: &Connection, reason: String) {
        tracing::warn!(
            reason,
            "the broker blocked the AMQP connection (resource alarm)"
        );
    }
    async fn unblocked(&mut self, _: &Connection) {
        tracing::info!("the broker unblocked the AMQP connection");
    }
    async fn secret_updated(&mut self, _: &Connection) {}
}

/// One live connection and what was declared and opened on it.
struct Link {
    generation: u64,
    connection: Connection,
    publisher: Mutex<Option<Publisher>>,
    declared: Mutex<HashSet<String>>,
    consumers: Mutex<HashMap<String, Arc<QueueConsumer>>>,
}

/// A [`Queue`] on a RabbitMQ broker.
pub struct AmqpQueue {
    url: String,
    args: OpenConnectionArguments,
    /// The longest a new connection (TCP, TLS, handshake) may take.
    connect_timeout: Duration,
    opts: AmqpOptions,
    link: Mutex<Option<Arc<Link>>>,
    generation: AtomicU64,
    inflight: std::sync::Mutex<HashMap<String, InFlight>>,
    /// Deliveries taken out of `inflight` to go back to the broker whose `basic.nack`
    /// (or republish and ack) may not be on the wire yet: while any is, a batch's acks
    /// go one by one, since a `multiple` ack could settle the tag first and the
    /// broker would close the channel at the late nack of an unknown tag.
    returns_under_way: AtomicU64,
    /// Per queue: when each delivery given back recently stops counting (`RETURN_GRACE`).
    returning: std::sync::Mutex<HashMap<String, Vec<Instant>>>,
    /// Connections opened so far (1 = never reconnected); tests and logs read it.
    connects: AtomicU64,
}

impl std::fmt::Debug for AmqpQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpQueue")
            .field("url", &redact_url(&self.url))
            .field("opts", &self.opts)
            .finish()
    }
}

fn amqp_err(e: amqprs::error::Error) -> QueueError {
    QueueError::Amqp(e.to_string())
}

/// Every broker round trip is bounded: when a connection dies under an operation in
/// flight (a broker restart), the client may never resolve it, and one worker would wait
/// forever on its ack.
const RPC_TIMEOUT: Duration = Duration::from_secs(10);

async fn rpc<T>(
    what: &str,
    fut: impl std::future::Future<Output = Result<T, amqprs::error::Error>>,
) -> QueueResult<T> {
    match tokio::time::timeout(RPC_TIMEOUT, fut).await {
        Ok(r) => r.map_err(amqp_err),
        Err(_) => Err(QueueError::TimedOut {
            what: what.to_string(),
            after: RPC_TIMEOUT,
        }),
    }
}

/// A goodbye that must not hang on a dead connection.
async fn quietly(fut: impl std::future::Future<Output = Result<(), amqprs::error::Error>>) {
    let _ = tokio::time::timeout(RPC_TIMEOUT, fut).await;
}

/// A header name; ours and the broker's are short ASCII, far under 256 bytes.
fn field(s: &str) -> FieldName {
    FieldName::try_from(s).expect("a header name under 256 bytes")
}

/// A new channel with a callback, so what the broker says when it closes it is heard.
async fn open_channel(connection: &Connection) -> QueueResult<Channel> {
    let ch = rpc("broker", connection.open_channel(None)).await?;
    ch.register_callback(ChannelEvents { confirms: None })
        .await
        .map_err(amqp_err)?;
    Ok(ch)
}

/// `basic.ack` (`multiple`: every tag up to this one) on a delivery's channel;
/// `Ok(false)` when that channel is gone (the broker requeued what it held).
async fn ack_on(channel: &Channel, tag: u64, multiple: bool) -> QueueResult<bool> {
    if !channel.is_open() {
        return Ok(false);
    }
    rpc(
        "basic.ack",
        channel.basic_ack(BasicAckArguments::new(tag, multiple)),
    )
    .await?;
    Ok(true)
}

impl AmqpQueue {
    /// [`AmqpQueue::open_with`] the default deadlines.
    pub async fn open(url: &str) -> QueueResult<Self> {
        Self::open_with(url, &Deadlines::default()).await
    }

    /// Parse the URL and connect once, so a wrong address or password fails now.
    /// The heartbeat is the deadlines' unless the URL sets `?heartbeat=`: amqprs
    /// closes a connection that missed two of the broker's beats, and the next call
    /// reconnects (with amqprs's 60 s a frozen link went unnoticed for minutes, and
    /// a lease on it only ever came back empty).
    pub async fn open_with(url: &str, deadlines: &Deadlines) -> QueueResult<Self> {
        let (rest, opts) = parse_url(url)?;
        let args = connection_args_with(&rest, deadlines)?;
        let q = AmqpQueue {
            url: url.to_string(),
            args,
            connect_timeout: deadlines.connect_timeout,
            opts,
            link: Mutex::new(None),
            generation: AtomicU64::new(0),
            inflight: std::sync::Mutex::new(HashMap::new()),
            returns_under_way: AtomicU64::new(0),
            returning: std::sync::Mutex::new(HashMap::new()),
            connects: AtomicU64::new(0),
        };
        q.link().await?;
        Ok(q)
    }

    pub fn options(&self) -> &AmqpOptions {
        &self.opts
    }

    /// How many connections this queue opened (reconnections + 1).
    pub fn connections_opened(&self) -> u64 {
        self.connects.load(Ordering::Relaxed)
    }

    /// The broker-side name of an engine queue (`ns/consumer` → `prefix.ns.consumer`).
    pub fn broker_queue_name(&self, queue: &str) -> String {
        format!("{}.{}", self.opts.prefix, sanitize(queue))
    }

    fn exchange(&self) -> String {
        self.opts.prefix.clone()
    }

    fn dead_letter_exchange(&self) -> String {
        format!("{}.dlx", self.opts.prefix)
    }

    /// The queue holding what the broker dead-lettered (past `x-delivery-limit`).
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dead-letters", self.opts.prefix)
    }

    /// The current connection, or a new one (with the shared topology declared).
    async fn link(&self) -> QueueResult<Arc<Link>> {
        let mut guard = self.link.lock().await;
        if let Some(link) = guard.as_ref() {
            if link.connection.is_open() {
                return Ok(link.clone());
            }
            tracing::warn!(queue = %redact_url(&self.url), "AMQP connection lost: reconnecting");
        }
        *guard = None;
        let connection = tokio::time::timeout(self.connect_timeout, Connection::open(&self.args))
            .await
            .map_err(|_| QueueError::TimedOut {
                what: format!("connect to {}", redact_url(&self.url)),
                after: self.connect_timeout,
            })?
            .map_err(amqp_err)
            .map_err(|e| {
                QueueError::Amqp(format!(
                    "cannot connect to {}: {e}{}",
                    redact_url(&self.url),
                    handshake_hint(&e)
                ))
            })?;
        connection
            .register_callback(Quiet)
            .await
            .map_err(amqp_err)?;
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        self.connects.fetch_add(1, Ordering::Relaxed);
        let link = Arc::new(Link {
            generation,
            connection,
            publisher: Mutex::new(None),
            declared: Mutex::new(HashSet::new()),
            consumers: Mutex::new(HashMap::new()),
        });
        self.declare_shared(&link).await?;
        // Leases of older connections are void: the broker requeued them.
        self.lock_inflight()
            .retain(|token, _| token.starts_with(&format!("{generation}:")));
        *guard = Some(link.clone());
        Ok(link)
    }

    /// Forget the current connection after an error, so the next call reconnects.
    async fn drop_link(&self, generation: u64) {
        let mut guard = self.link.lock().await;
        if guard.as_ref().is_some_and(|l| l.generation == generation) {
            if let Some(link) = guard.take() {
                quietly(link.connection.clone().close()).await;
            }
        }
    }

    /// How many deliveries of `channel` we hold unacked (lease tokens start with the
    /// link's generation and the channel's id).
    fn holding(&self, link: &Link, channel: &Channel) -> usize {
        let prefix = format!("{}:{}:", link.generation, channel.channel_id());
        self.lock_inflight()
            .keys()
            .filter(|token| token.starts_with(&prefix))
            .count()
    }

    fn lock_inflight(&self) -> std::sync::MutexGuard<'_, HashMap<String, InFlight>> {
        self.inflight.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn declare_shared(&self, link: &Link) -> QueueResult<()> {
        let ch = open_channel(&link.connection).await?;
        for (name, kind) in [
            (self.exchange(), "direct"),
            (self.dead_letter_exchange(), "fanout"),
        ] {
            rpc(
                "broker",
                ch.exchange_declare(
                    ExchangeDeclareArguments::new(&name, kind)
                        .durable(true)
                        .finish(),
                ),
            )
            .await?;
        }
        let dlq = self.dead_letter_queue();
        self.declare_queue_on(link, &dlq, false).await?;
        rpc(
            "broker",
            ch.queue_bind(QueueBindArguments::new(
                &dlq,
                &self.dead_letter_exchange(),
                "",
            )),
        )
        .await?;
        quietly(ch.close()).await;
        Ok(())
    }

    /// Declare a durable queue: quorum if asked and possible, else classic; an existing
    /// queue with other arguments is used as it is.
    async fn declare_queue_on(
        &self,
        link: &Link,
        broker_name: &str,
        dead_lettered: bool,
    ) -> QueueResult<()> {
        let mut base = FieldTable::new();
        if dead_lettered {
            base.insert(
                field("x-dead-letter-exchange"),
                FieldValue::from(self.dead_letter_exchange()),
            );
        }
        let mut quorum = base.clone();
        quorum.insert(field("x-queue-type"), FieldValue::from("quorum"));
        if dead_lettered {
            quorum.insert(
                field("x-delivery-limit"),
                FieldValue::l(BROKER_DELIVERY_LIMIT),
            );
        }
        let mut attempts = Vec::new();
        if self.opts.kind == QueueKind::Quorum {
            attempts.push(quorum);
        }
        attempts.push(base);
        let mut last = None;
        for args in attempts {
            // A refused declaration closes its channel: one channel per attempt.
            let ch = open_channel(&link.connection).await?;
            match rpc(
                "queue.declare",
                ch.queue_declare(
                    QueueDeclareArguments::new(broker_name)
                        .durable(true)
                        .arguments(args)
                        .finish(),
                ),
            )
            .await
            {
                Ok(_) => {
                    quietly(ch.close()).await;
                    return Ok(());
                }
                Err(e) => {
                    tracing::info!(queue = broker_name, error = %e, "queue declaration refused, trying the next kind");
                    last = Some(e);
                }
            }
        }
        // It exists with arguments of its own (declared by an older version or by hand).
        let ch = open_channel(&link.connection).await?;
        match rpc(
            "queue.declare",
            ch.queue_declare(
                QueueDeclareArguments::new(broker_name)
                    .passive(true)
                    .finish(),
            ),
        )
        .await
        {
            Ok(_) => {
                quietly(ch.close()).await;
                Ok(())
            }
            Err(e) => Err(last.unwrap_or(e)),
        }
    }

    /// Declare and bind an engine queue once per connection.
    async fn ensure_queue(&self, link: &Link, queue: &str) -> QueueResult<String> {
        let name = self.broker_queue_name(queue);
        if link.declared.lock().await.contains(&name) {
            return Ok(name);
        }
        self.declare_queue_on(link, &name, true).await?;
        let ch = open_channel(&link.connection).await?;
        rpc(
            "broker",
            ch.queue_bind(QueueBindArguments::new(&name, &self.exchange(), &name)),
        )
        .await?;
        quietly(ch.close()).await;
        link.declared.lock().await.insert(name.clone());
        Ok(name)
    }

    /// The consumer channel of `queue`, opened on first use for leases of `max`.
    async fn consumer(
        &self,
        link: &Link,
        queue: &str,
        max: usize,
    ) -> QueueResult<Arc<QueueConsumer>> {
        if let Some(c) = link.consumers.lock().await.get(queue) {
            if c.channel.is_open() {
                return Ok(c.clone());
            }
        }
        let name = self.ensure_queue(link, queue).await?;
        let channel = open_channel(&link.connection).await?;
        let qos = prefetch(self.opts.prefetch, max);
        rpc(
            "broker",
            channel.basic_qos(BasicQosArguments::new(0, qos, false)),
        )
        .await?;
        let tag = format!("idemwatch-{}-{}", std::process::id(), link.generation);
        let (_, consumer) = rpc(
            "basic.consume",
            channel.basic_consume_rx(BasicConsumeArguments::new(&name, &tag)),
        )
        .await?;
        let c = Arc::new(QueueConsumer {
            prefetch: qos,
            channel,
            consumer: Mutex::new(consumer),
            buffered: Mutex::new(VecDeque::new()),
        });
        link.consumers
            .lock()
            .await
            .insert(queue.to_string(), c.clone());
        Ok(c)
    }

    /// Give back leases older than their visibility timeout (see the module doc).
    async fn return_expired(&self, queue: &str) {
        let now = Instant::now();
        let (expired, _under_way): (Vec<InFlight>, _) = {
            let mut map = self.lock_inflight();
            let tokens: Vec<String> = map
                .iter()
                .filter(|(_, f)| f.queue == queue && f.deadline <= now)
                .map(|(t, _)| t.clone())
                .collect();
            if tokens.is_empty() {
                return;
            }
            let under_way = ReturnsUnderWay::count(&self.returns_under_way);
            (
                tokens.iter().filter_map(|t| map.remove(t)).collect(),
                under_way,
            )
        };
        for f in expired {
            if matches!(f.then, Return::Requeue) {
                tracing::info!(
                    queue,
                    "lease expired: giving the delivery back to the broker"
                );
            }
            self.send_back(f).await;
        }
    }

    /// Return one delivery the way it asked for (see [`Return`]). A copy that cannot
    /// be published falls back to a requeue: counted where the broker counts, never
    /// lost.
    async fn send_back(&self, f: InFlight) {
        let (body, counts) = match &f.then {
            Return::Requeue => return self.give_back(&f).await,
            Return::Republish { body, counts } => (body, *counts),
        };
        let queues = [f.queue.clone()];
        let bodies = [body.clone()];
        let published = self
            .with_link(|link| async move {
                self.publish_on(&link, &queues, &bodies, Some(counts.headers()))
                    .await
            })
            .await;
        match published {
            // The copy is safely queued: the original goes. A crash in between leaves
            // both, and the consumers' dedup drops the second.
            Ok(()) => {
                if let Err(e) = ack_on(&f.channel, f.tag, false).await {
                    tracing::warn!(error = %e, "ack of a republished delivery failed: it comes back as a duplicate");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "republishing a returned delivery failed: requeued instead");
                self.give_back(&f).await;
            }
        }
    }

    /// Return `delivery` after `delay` as a copy carrying its counts.
    async fn return_later(&self, delivery: &Delivery, delay: Duration, counted: bool) {
        let counts = Counts {
            attempts: if counted {
                delivery.attempts
            } else {
                delivery.attempts.saturating_sub(1)
            },
            deliveries: delivery.delivery_count,
        };
        let (due, _under_way) = {
            let mut map = self.lock_inflight();
            let Some(f) = map.get_mut(&delivery.lease_token) else {
                return;
            };
            f.then = Return::Republish {
                body: delivery.body.clone(),
                counts,
            };
            f.deadline = Instant::now() + delay;
            if delay.is_zero() {
                let under_way = ReturnsUnderWay::count(&self.returns_under_way);
                (map.remove(&delivery.lease_token), Some(under_way))
            } else {
                (None, None)
            }
        };
        // AMQP has no delayed requeue: a later return is held (still unacked, so it
        // comes back anyway if this process dies meanwhile) and sent back once its
        // delay is over, the way an expired lease is given back.
        if let Some(f) = due {
            self.send_back(f).await;
        }
    }

    /// `basic.nack(requeue)`, remembered for `RETURN_GRACE` (see there).
    async fn give_back(&self, f: &InFlight) {
        if !f.channel.is_open() {
            // The broker requeued it when the channel went.
            return;
        }
        let nack = BasicNackArguments::new(f.tag, false, true);
        if rpc("basic.nack", f.channel.basic_nack(nack)).await.is_ok() {
            self.returning
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(f.queue.clone())
                .or_default()
                .push(Instant::now() + RETURN_GRACE);
        }
    }

    fn returning_count(&self, queue: &str) -> u64 {
        let now = Instant::now();
        let mut map = self.returning.lock().unwrap_or_else(|e| e.into_inner());
        match map.get_mut(queue) {
            Some(v) => {
                v.retain(|t| *t > now);
                v.len() as u64
            }
            None => 0,
        }
    }

    /// Pull whatever the broker already pushed into the consumer's buffer.
    async fn drain_ready(&self, c: &QueueConsumer) -> QueueResult<()> {
        let mut stream = c.consumer.lock().await;
        let mut buf = c.buffered.lock().await;
        loop {
            match stream.try_recv() {
                Ok(m) => buf.push_back(Incoming::of(m)?),
                Err(TryRecvError::Empty) => return Ok(()),
                Err(TryRecvError::Disconnected) => return Err(cancelled()),
            }
        }
    }

    async fn lease_on(
        &self,
        link: &Link,
        queue: &str,
        max: usize,
        visibility: Duration,
        beside: Option<&Notify>,
    ) -> QueueResult<Vec<Delivery>> {
        self.return_expired(queue).await;
        let c = self.consumer(link, queue, max).await?;
        let mut taken = Vec::new();
        {
            let mut stream = c.consumer.lock().await;
            let mut buf = c.buffered.lock().await;
            if buf.is_empty() && self.holding(link, &c.channel) >= usize::from(c.prefetch) {
                // Every prefetch slot is a delivery we hold: the broker sends nothing
                // more until one is acked, so waiting would only stall the caller.
                return Ok(Vec::new());
            }
            // The batch this lease runs beside is done (never, for a plain lease).
            let handled = async {
                match beside {
                    Some(handled) => handled.notified().await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(handled);
            let mut done = false;
            if buf.is_empty() {
                drop(buf);
                // The first delivery: up to LEASE_WAIT, cut to BESIDE_GRACE once the
                // batch beside is done. `recv()` is cancel-safe: a delivery not yet
                // received stays in the receiver for the next lease.
                let wait = tokio::time::sleep(LEASE_WAIT);
                tokio::pin!(wait);
                let arrived = loop {
                    tokio::select! {
                        biased;
                        arrived = stream.recv() => break arrived,
                        () = &mut handled, if !done => {
                            done = true;
                            let grace = tokio::time::Instant::now() + BESIDE_GRACE;
                            let end = wait.deadline().min(grace);
                            wait.as_mut().reset(end);
                        }
                        () = &mut wait => return Ok(Vec::new()),
                    }
                };
                match arrived {
                    Some(m) => c.buffered.lock().await.push_back(Incoming::of(m)?),
                    None => return Err(cancelled()),
                }
                buf = c.buffered.lock().await;
            }
            while buf.len() < max {
                let next = match stream.try_recv() {
                    Ok(m) => Some(m),
                    Err(TryRecvError::Disconnected) => None,
                    // Beside a batch, the lease has until that batch is done: the
                    // broker pushes what the last ack freed a few at a time, and a
                    // lease that returned with the first few would leave the rest of
                    // the next batch to leases the database waits for.
                    Err(TryRecvError::Empty) if beside.is_some() && !done => tokio::select! {
                        biased;
                        next = stream.recv() => next,
                        () = &mut handled => break,
                    },
                    Err(TryRecvError::Empty) => break,
                };
                match next {
                    Some(m) => buf.push_back(Incoming::of(m)?),
                    None => break,
                }
            }
            while taken.len() < max {
                match buf.pop_front() {
                    Some(d) => taken.push(d),
                    None => break,
                }
            }
        }
        tracing::trace!(
            queue,
            taken = taken.len(),
            max,
            beside = beside.is_some(),
            "leased"
        );
        let deadline = Instant::now() + visibility;
        let channel_id = c.channel.channel_id();
        let mut out = Vec::with_capacity(taken.len());
        let mut map = self.lock_inflight();
        for d in taken {
            let token = format!("{}:{}:{}", link.generation, channel_id, d.tag);
            let before = Counts::of(&d);
            let returns = broker_returns(&d);
            map.insert(
                token.clone(),
                InFlight {
                    queue: queue.to_string(),
                    channel: c.channel.clone(),
                    tag: d.tag,
                    deadline,
                    then: Return::Requeue,
                },
            );
            out.push(Delivery {
                id: i64::try_from(d.tag).unwrap_or(i64::MAX),
                queue: queue.to_string(),
                body: d.body,
                delivery_count: before.deliveries.saturating_add(returns).saturating_add(1),
                attempts: before.attempts.saturating_add(returns).saturating_add(1),
                redelivered: d.redelivered || before.deliveries > 0,
                lease_token: token,
            });
        }
        Ok(out)
    }

    async fn publish_on(
        &self,
        link: &Link,
        queues: &[String],
        bodies: &[Vec<u8>],
        headers: Option<FieldTable>,
    ) -> QueueResult<()> {
        let mut names = Vec::with_capacity(queues.len());
        for q in queues {
            names.push(self.ensure_queue(link, q).await?);
        }
        let mut guard = link.publisher.lock().await;
        let publisher = match guard.as_ref() {
            Some(p) if p.channel.is_open() => p,
            _ => {
                let channel = rpc("broker", link.connection.open_channel(None)).await?;
                let confirms = Arc::new(Confirms::default());
                channel
                    .register_callback(ChannelEvents {
                        confirms: Some(confirms.clone()),
                    })
                    .await
                    .map_err(amqp_err)?;
                rpc(
                    "broker",
                    channel.confirm_select(ConfirmSelectArguments::new(false)),
                )
                .await?;
                confirms.lock().next_tag = 1;
                guard.insert(Publisher { channel, confirms })
            }
        };
        let exchange = self.exchange();
        let mut props = BasicProperties::default();
        props
            .with_delivery_mode(amqprs::DELIVERY_MODE_PERSISTENT)
            .with_content_type("application/json");
        if let Some(headers) = headers {
            props.with_headers(headers);
        }
        let confirms = &publisher.confirms;
        {
            let mut st = confirms.lock();
            st.nacked = 0;
            st.returned = 0;
        }
        for body in bodies {
            for name in &names {
                {
                    let mut st = confirms.lock();
                    let tag = st.next_tag;
                    st.next_tag += 1;
                    st.outstanding.insert(tag);
                }
                rpc(
                    "broker",
                    publisher.channel.basic_publish(
                        props.clone(),
                        body.clone(),
                        BasicPublishArguments::new(&exchange, name)
                            .mandatory(true)
                            .finish(),
                    ),
                )
                .await?;
            }
        }
        // Every confirm, each wait bounded: a broker that stops answering (or a
        // connection that dies under the batch) fails it, and the caller retries on a
        // new connection.
        let mut last_progress = (Instant::now(), usize::MAX);
        loop {
            let (outstanding, nacked, returned) = {
                let st = confirms.lock();
                (st.outstanding.len(), st.nacked, st.returned)
            };
            if returned > 0 {
                return Err(QueueError::Amqp(
                    "a message was returned as unroutable".into(),
                ));
            }
            if nacked > 0 {
                return Err(QueueError::Amqp(
                    "the broker refused a message (publisher nack)".into(),
                ));
            }
            if outstanding == 0 {
                return Ok(());
            }
            if !publisher.channel.is_open() || !link.connection.is_open() {
                return Err(QueueError::Amqp(
                    "the publisher channel closed before every confirm arrived".into(),
                ));
            }
            if outstanding != last_progress.1 {
                last_progress = (Instant::now(), outstanding);
            } else if last_progress.0.elapsed() >= RPC_TIMEOUT {
                return Err(QueueError::TimedOut {
                    what: "publisher confirm".into(),
                    after: RPC_TIMEOUT,
                });
            }
            // Woken by each confirm; the timeout rechecks the channel, since a dead
            // connection sends nothing.
            let _ =
                tokio::time::timeout(Duration::from_millis(100), confirms.changed.notified()).await;
        }
    }

    /// Queue depth as the broker counts it (`message_count` of a passive declare, ready
    /// only) plus what this connection holds: pushed but not leased, and leased.
    async fn depth_on(&self, link: &Link, queue: &str) -> QueueResult<QueueDepth> {
        self.return_expired(queue).await;
        let name = self.ensure_queue(link, queue).await?;
        let existing = link.consumers.lock().await.get(queue).cloned();
        // On the consumer's own channel, and asked twice when the first answer is 0. A
        // quorum queue counts only its ready messages: the ones it has just checked out
        // to us (an ack freed prefetch room) are in neither count, and the broker's
        // channel can answer the declare before it writes those deliveries. They are
        // ahead of the second declare-ok on the wire, so the drain below finds them
        // (`deliveries_on_their_way_from_the_broker_are_counted_in_the_depth`: with one
        // declare, 9 of 200 depths right after an ack said empty with 20 on their way).
        let (channel, temporary) = match &existing {
            Some(c) if c.channel.is_open() => (c.channel.clone(), false),
            _ => (open_channel(&link.connection).await?, true),
        };
        let declare = || async {
            let declared = rpc(
                "broker",
                channel.queue_declare(QueueDeclareArguments::new(&name).passive(true).finish()),
            )
            .await?;
            Ok::<_, QueueError>(declared.map_or(0, |(_, ready, _)| ready))
        };
        let mut ready = declare().await?;
        if ready == 0 && !temporary {
            ready = declare().await?;
        }
        if temporary {
            quietly(channel.close()).await;
        }
        let mut buffered = 0;
        if let Some(c) = &existing {
            self.drain_ready(c).await?;
            buffered = c.buffered.lock().await.len() as u64;
        }
        let leased = self
            .lock_inflight()
            .values()
            .filter(|f| f.queue == queue)
            .count() as u64;
        Ok(QueueDepth {
            ready: u64::from(ready),
            in_flight: buffered + leased + self.returning_count(queue),
        })
    }

    /// Run `op` on the current connection; on failure drop it (the next call reconnects).
    async fn with_link<T, F, Fut>(&self, op: F) -> QueueResult<T>
    where
        F: FnOnce(Arc<Link>) -> Fut,
        Fut: std::future::Future<Output = QueueResult<T>>,
    {
        let link = self.link().await?;
        let generation = link.generation;
        match op(link).await {
            Ok(v) => Ok(v),
            Err(e) => {
                self.drop_link(generation).await;
                Err(e)
            }
        }
    }

    /// A lease on the current connection; `beside`: see [`Queue::ack_then_lease_beside`].
    async fn lease_beside(
        &self,
        queue: &str,
        max: usize,
        visibility: Duration,
        beside: Option<&Notify>,
    ) -> QueueResult<Vec<Delivery>> {
        self.with_link(|link| async move {
            self.lease_on(&link, queue, max.max(1), visibility, beside)
                .await
        })
        .await
    }

    /// Remove a queue from the broker (drill and chaos clean-up).
    pub async fn delete(&self, queue: &str) -> QueueResult<u64> {
        let name = self.broker_queue_name(queue);
        self.with_link(|link| async move {
            if let Some(c) = link.consumers.lock().await.remove(queue) {
                quietly(c.channel.clone().close()).await;
            }
            link.declared.lock().await.remove(&name);
            self.lock_inflight().retain(|_, f| f.queue != queue);
            let ch = open_channel(&link.connection).await?;
            let n = rpc("broker", ch.queue_delete(QueueDeleteArguments::new(&name))).await?;
            quietly(ch.close()).await;
            Ok(u64::from(n.unwrap_or(0)))
        })
        .await
    }

    /// Remove this prefix's exchanges and dead-letter queue (a test's or a trial's own
    /// prefix; never call it on a prefix other processes use).
    pub async fn remove_topology(&self) -> QueueResult<()> {
        self.with_link(|link| async move {
            let ch = open_channel(&link.connection).await?;
            rpc(
                "broker",
                ch.queue_delete(QueueDeleteArguments::new(&self.dead_letter_queue())),
            )
            .await?;
            for ex in [self.exchange(), self.dead_letter_exchange()] {
                rpc(
                    "broker",
                    ch.exchange_delete(ExchangeDeleteArguments::new(&ex)),
                )
                .await?;
            }
            quietly(ch.close()).await;
            Ok(())
        })
        .await?;
        self.close().await;
        Ok(())
    }

    /// Close the connection cleanly: what is still leased goes back to the broker.
    pub async fn close(&self) {
        if let Some(link) = self.link.lock().await.take() {
            quietly(link.connection.clone().close()).await;
        }
    }
}

/// Counts a return in [`AmqpQueue::returns_under_way`] from before it takes its
/// delivery out of the in-flight map (under the map's lock, where `ack_batch` reads
/// the count) until its frames are sent (dropped).
struct ReturnsUnderWay<'a>(&'a AtomicU64);

impl<'a> ReturnsUnderWay<'a> {
    fn count(n: &'a AtomicU64) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        ReturnsUnderWay(n)
    }
}

impl Drop for ReturnsUnderWay<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The channel part of a lease token (`{generation}:{channel}:`).
fn channel_of(token: &str) -> &str {
    token.rsplit_once(':').map_or(token, |(channel, _)| channel)
}

/// The prefetch of a consumer channel that leases up to `max` at a time: the URL's,
/// else [`DEFAULT_PREFETCH`] or three times `max`, the more.
fn prefetch(set: Option<u16>, max: usize) -> u16 {
    set.unwrap_or_else(|| {
        let thrice = u16::try_from(max.saturating_mul(3)).unwrap_or(u16::MAX);
        thrice.max(DEFAULT_PREFETCH)
    })
}

/// RabbitMQ answers a wrong user or password, or a vhost the user may not open, by
/// closing the socket in the middle of the handshake (it sends a reason only to clients
/// that announce `authentication_failure_close`, which amqprs does not), and amqprs
/// reports that as a network error. Say what it most likely means.
fn handshake_hint(e: &QueueError) -> &'static str {
    let text = e.to_string();
    if ["reset by peer", "peer shutdown", "connection interrupted"]
        .iter()
        .any(|t| text.contains(t))
    {
        " (the broker closed the connection during the handshake: wrong user or password, or no access to the vhost?)"
    } else {
        ""
    }
}

/// The receiver of a consumer ended: its channel or connection is gone.
fn cancelled() -> QueueError {
    QueueError::Amqp("consumer cancelled by the broker".into())
}

/// How often the broker gave this copy back since it was published. Quorum queues
/// count returns in `x-delivery-count`; classic queues only say whether a delivery is
/// a redelivery (at least one). Returns the engine makes itself are republished
/// copies carrying [`Counts`], so a classic queue still reaches `max_deliveries`.
fn broker_returns(d: &Incoming) -> u32 {
    match header_of(d, "x-delivery-count") {
        Some(n) => n,
        None => u32::from(d.redelivered),
    }
}

/// A non-negative integer header, whatever integer type the sender chose.
fn header_u32(v: &FieldValue) -> Option<u32> {
    match *v {
        FieldValue::l(n) => u32::try_from(n).ok(),
        FieldValue::I(n) => u32::try_from(n).ok(),
        FieldValue::i(n) => Some(n),
        FieldValue::s(n) => u32::try_from(n).ok(),
        FieldValue::u(n) => Some(u32::from(n)),
        FieldValue::B(n) => Some(u32::from(n)),
        FieldValue::b(n) => u32::try_from(n).ok(),
        _ => None,
    }
}

/// A delivery's integer header `name`, if it has one.
fn header_of(d: &Incoming, name: &str) -> Option<u32> {
    d.headers.as_ref()?.get(&field(name)).and_then(header_u32)
}

#[async_trait]
impl Queue for AmqpQueue {
    async fn publish(&self, queues: &[String], bodies: &[Vec<u8>]) -> QueueResult<()> {
        super::check_body_sizes(bodies)?;
        if queues.is_empty() || bodies.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let mut pause = Duration::from_millis(200);
        loop {
            match self
                .with_link(|link| async move { self.publish_on(&link, queues, bodies, None).await })
                .await
            {
                Ok(()) => return Ok(()),
                Err(e) if started.elapsed() < PUBLISH_RETRY_FOR => {
                    tracing::warn!(error = %e, "publish failed: retrying on a new connection (copies are dropped by the consumers' dedup)");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn lease(
        &self,
        queue: &str,
        max: usize,
        visibility: Duration,
    ) -> QueueResult<Vec<Delivery>> {
        self.lease_beside(queue, max, visibility, None).await
    }

    /// The lease stops waiting [`BESIDE_GRACE`] after `handled`.
    async fn ack_then_lease_beside(
        &self,
        done: &[Delivery],
        queue: &str,
        max: usize,
        visibility: Duration,
        handled: &Notify,
    ) -> (QueueResult<()>, QueueResult<Vec<Delivery>>) {
        let acked = self.ack_done(done).await;
        let leased = self.lease_beside(queue, max, visibility, Some(handled));
        (acked, leased.await)
    }

    async fn ack(&self, delivery: &Delivery) -> QueueResult<bool> {
        let Some(f) = self.lock_inflight().remove(&delivery.lease_token) else {
            return Ok(false);
        };
        ack_on(&f.channel, f.tag, false).await
    }

    /// Per channel, one `basic.ack(multiple)` on the batch's highest delivery tag
    /// when every delivery of that channel still held below it is in the batch: one
    /// frame and one broker operation instead of
    /// one per delivery. The broker pushes a channel's deliveries in tag order and
    /// leases take them in that order, so a pipelined runner's committed batch is
    /// all the channel holds below its top (the batch leased ahead is above it).
    /// Otherwise (a lower tag leased and not in this batch, one waiting for a delayed
    /// return, or a return under way) the acks go one by one, all at once.
    async fn ack_batch(&self, deliveries: &[Delivery]) -> QueueResult<usize> {
        let acks: Vec<(InFlight, bool, usize)> = {
            let mut map = self.lock_inflight();
            let mut per_channel: HashMap<String, Vec<InFlight>> = HashMap::new();
            for d in deliveries {
                if let Some(f) = map.remove(&d.lease_token) {
                    per_channel
                        .entry(channel_of(&d.lease_token).to_string())
                        .or_default()
                        .push(f);
                }
            }
            let returning = self.returns_under_way.load(Ordering::SeqCst) > 0;
            let mut acks = Vec::new();
            for (channel, mut held) in per_channel {
                held.sort_by_key(|f| f.tag);
                let top = held.last().map_or(0, |f| f.tag);
                let below_held = map
                    .iter()
                    .any(|(token, f)| channel_of(token) == channel && f.tag < top);
                if returning || below_held || held.len() == 1 {
                    acks.extend(held.into_iter().map(|f| (f, false, 1)));
                } else if let Some(last) = held.pop() {
                    acks.push((last, true, held.len() + 1));
                }
            }
            acks
        };
        let sent = futures::future::join_all(
            acks.iter()
                .map(|(f, multiple, _)| ack_on(&f.channel, f.tag, *multiple)),
        )
        .await;
        let mut acked = 0;
        for (ack, (_, _, covers)) in sent.into_iter().zip(&acks) {
            if ack? {
                acked += covers;
            }
        }
        Ok(acked)
    }

    async fn nack(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()> {
        self.return_later(delivery, delay, true).await;
        Ok(())
    }

    async fn nack_uncounted(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()> {
        self.return_later(delivery, delay, false).await;
        Ok(())
    }

    async fn depth(&self, queue: &str) -> QueueResult<QueueDepth> {
        self.with_link(|link| async move { self.depth_on(&link, queue).await })
            .await
    }

    async fn purge_queue(&self, queue: &str) -> QueueResult<u64> {
        let name = self.broker_queue_name(queue);
        self.with_link(|link| async move {
            let ch = open_channel(&link.connection).await?;
            let n = rpc("broker", ch.queue_purge(QueuePurgeArguments::new(&name))).await?;
            quietly(ch.close()).await;
            Ok(u64::from(n.unwrap_or(0)))
        })
        .await
    }

    async fn remove_queue(&self, queue: &str) -> QueueResult<u64> {
        self.delete(queue).await
    }

    async fn close(&self) {
        AmqpQueue::close(self).await
    }

    fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_query_parameters_are_split_off() {
        let (rest, o) = parse_url(
            "amqp://guest:pw@127.0.0.1:5672/%2f?prefetch=8&queue_type=classic&heartbeat=10",
        )
        .unwrap();
        assert_eq!(rest, "amqp://guest:pw@127.0.0.1:5672/%2f?heartbeat=10");
        assert_eq!(o.prefetch, Some(8));
        assert_eq!(o.kind, QueueKind::Classic);
        let (rest, o) = parse_url("amqp://127.0.0.1/%2f").unwrap();
        assert_eq!(rest, "amqp://127.0.0.1/%2f");
        assert_eq!(o, AmqpOptions::default());
        let err = parse_url("amqp://u:secret@h/%2f?prefetch=0").unwrap_err();
        assert!(!err.to_string().contains("secret"));
    }

    #[test]
    fn the_heartbeat_is_the_deadlines_unless_the_url_sets_one() {
        let d = Deadlines {
            heartbeat: Duration::from_secs(7),
            ..Deadlines::default()
        };
        let a = connection_args_with("amqp://guest:guest@127.0.0.1:5672/%2f", &d).unwrap();
        assert_eq!(a.get_heartbeat(), 7);
        let a =
            connection_args_with("amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=20", &d).unwrap();
        assert_eq!(a.get_heartbeat(), 20);
    }

    #[test]
    fn the_rest_of_the_url_becomes_the_connection_and_nothing_is_ignored() {
        let a = connection_args("amqp://fleet%40ops:p%2Fw@10.0.0.7:5673/fleet%2Fprod?heartbeat=10")
            .unwrap();
        assert_eq!(a.get_host(), "10.0.0.7");
        assert_eq!(a.get_port(), 5673);
        assert_eq!(a.get_virtual_host(), "fleet/prod");
        assert_eq!(a.get_heartbeat(), 10);
        assert!(
            *a.get_credentials()
                == amqprs::security::SecurityCredentials::new_plain("fleet@ops", "p/w")
        );
        let a = connection_args("amqp://127.0.0.1/%2f").unwrap();
        assert_eq!((a.get_port(), a.get_virtual_host()), (5672, "/"));
        assert!(
            *a.get_credentials()
                == amqprs::security::SecurityCredentials::new_plain("guest", "guest")
        );
        assert_eq!(connection_args("amqp://h").unwrap().get_virtual_host(), "/");
        assert_eq!(connection_args("amqps://h/%2f").unwrap().get_port(), 5671);
        let long_vhost = format!("amqp://u:secret@h/{}", "v".repeat(256));
        for bad in [
            long_vhost.as_str(),
            "amqp://u:secret@h/%2f?frame_max=4096",
            "amqp://u:secret@h/%2f?heartbeat=soon",
            "http://u:secret@h/",
        ] {
            let Err(e) = connection_args(bad) else {
                panic!("{} was accepted", redact_url(bad));
            };
            let e = e.to_string();
            assert!(!e.contains("secret"), "{e}");
        }
    }

    #[test]
    fn prefetch_leaves_room_for_a_leased_ahead_batch_unless_the_url_sets_it() {
        assert_eq!(prefetch(None, 1), DEFAULT_PREFETCH);
        assert_eq!(prefetch(None, 10), DEFAULT_PREFETCH);
        assert_eq!(prefetch(None, 16), 48);
        assert_eq!(prefetch(None, 100), 300);
        assert_eq!(prefetch(None, 1_000_000), u16::MAX);
        assert_eq!(prefetch(Some(8), 100), 8);
    }

    #[test]
    fn every_name_given_to_the_broker_fits_a_short_string() {
        let longest = "p".repeat(MAX_PREFIX);
        let (_, o) = parse_url(&format!("amqp://h/%2f?prefix={longest}")).unwrap();
        let name = format!("{}.{}", o.prefix, sanitize(&"q".repeat(1000)));
        assert!(name.len() <= 255, "{}", name.len());
        for name in [
            format!("{}.dead-letters", o.prefix),
            format!("{}.dlx", o.prefix),
        ] {
            assert!(name.len() <= 255);
        }
        assert!(parse_url(&format!("amqp://h/%2f?prefix={longest}p")).is_err());
    }

    #[test]
    fn drill_namespaces_become_plain_queue_names() {
        assert_eq!(
            sanitize("drill-12-ab/zone-exit-sms"),
            "drill-12-ab.zone-exit-sms"
        );
        assert_eq!(sanitize("a b*c"), "a_b_c");
    }
}
