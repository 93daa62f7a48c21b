//! Device ingress: MQTT (QoS 1) into the engine's queue.
//!
//! Vehicles publish with QoS 1: a PUBLISH not acknowledged in time is sent again with
//! the DUP flag, which is where most device-side duplicates are born. The ingress does
//! not try to drop them (it cannot tell a retransmission from a new event without the
//! dedup table); it makes sure none is lost on the way in:
//!
//! - a persistent session (clean start false, a fixed client id): while the ingress
//!   is away the broker keeps its subscription and queues the QoS 1 messages for it;
//! - manual acks: a message is PUBACKed only after the queue accepted it, so a broker
//!   connection (or the ingress) that dies in between gets it redelivered, DUP set;
//! - an ack is sent only on the connection the message came in on: a packet id is
//!   per connection, and acking an old id on a new connection could ack another message.
//!
//! The configured filters are the subscription (issue 44): on every connect the
//! ingress subscribes to each (SUBSCRIBE is idempotent, so also when the broker kept
//! the session) and unsubscribes the filters an earlier run subscribed that the
//! configuration no longer names. MQTT cannot list a session's subscriptions, so they
//! are remembered in the database (`ingress_subscriptions`, by broker and client id):
//! the union of old and new before connecting, the new ones once every UNSUBACK is
//! in. `--share-group NAME` subscribes each filter as `$share/NAME/FILTER`: several
//! ingest processes (each its own client id) split the messages. Mosquitto 2.0 keeps
//! routing a member's share to its persistent session while it is away, so a killed
//! member's messages wait for it to come back (a supervisor restarts it) rather than
//! going to the others; none is lost either way.
//!
//! Poison costs only itself (issue 39, docs/CONTRACT.md §9 "Ingress poison"): a message the queue
//! cannot take — over the envelope's limit ([`MAX_RAW_BYTES`]), or not JSON at all —
//! goes to `dead_letters` (consumer [`DEAD_LETTER_CONSUMER`], reason `too_large` or
//! `malformed_json`, the first 64 KiB of the bytes and their true length), is acked and
//! counted (`idem_ingress_dead_lettered_total`), and the messages after it flow. It
//! used to be published with its batch, which the queue refused whole, forever: one
//! device's firmware bug stopped the fleet. An oversized message is cut to what the
//! dead letter keeps as soon as it is read, so a burst of them holds little memory;
//! the packet itself may be as large as MQTT allows (the broker's own limit decides
//! what a device may send), since a packet the client refused to read would close the
//! connection and come back first on the next one, forever.
//!
//! The MQTT client's event loop runs on its own task and hands messages to the
//! publishing task through a bounded channel (backpressure, not memory growth).
//! Counted: `idem_ingress_messages_total{source="mqtt",dup_flag}` — the flag as it
//! arrived here (a broker does not pass a device's DUP on; it sets its own when it
//! redelivers to us) — and the link's state (`idem_ingress_connected`, since when,
//! failures by kind) for the dashboard's sources.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rumqttc::{AsyncClient, Event, Packet, Publish, QoS, SubscribeFilter, SubscribeReasonCode};
use serde::Serialize;
use tokio::sync::{mpsc, watch};

use super::envelope::{dead_letter_raw, RejectReason, MAX_RAW_BYTES};
use super::metrics::{Metrics, INGRESS_REASONS};
use super::mqtt_link::{failure, IngressErrorKind, LinkConfig, LinkError, LinkFailure};
use super::queue::Queue;
use super::store::Store;

/// The `source` label of this ingress's metrics.
pub const SOURCE: &str = "mqtt";
/// The `consumer` of a dead letter the MQTT ingress wrote: no consumer ever saw it.
pub const DEAD_LETTER_CONSUMER: &str = "ingress:mqtt";
/// Messages published into the queue per call, at most.
pub const MAX_BATCH: usize = 256;
/// Messages waiting between the MQTT event loop and the queue, at most.
const CHANNEL_CAPACITY: usize = 1024;
/// Longest pause before reconnecting to a broker that went away.
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(5);
/// MQTT keep-alive: a dead broker connection is noticed within about this.
const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// Largest MQTT packet read: MQTT's own largest (a remaining length of 256 MiB). Any
/// smaller cap turns a device's oversized message into a connection that closes on
/// it forever (see the module doc); the broker's `message_size_limit` is the cap.
const MAX_PACKET: usize = 268_435_455;
/// Longest packet sent: a SUBSCRIBE with every filter fits.
const MAX_OUTGOING_PACKET: usize = 1 << 20;
/// Longest wait for the database (the subscription record, a dead letter) per call.
const STORE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest accepted topic filter, in bytes: ours to remember in the database, and far
/// over any fleet's.
pub const MAX_FILTER_BYTES: usize = 1024;

/// Where to read and where to write.
#[derive(Debug, Clone)]
pub struct MqttIngressConfig {
    /// The broker, the login and the TLS files.
    pub link: LinkConfig,
    /// Topic filters, e.g. `fleet/+/events` (at least one).
    pub filters: Vec<String>,
    /// Subscribe each filter as `$share/GROUP/FILTER` to split the messages between
    /// the ingest processes of the group.
    pub share_group: Option<String>,
    /// The persistent session's name: the same id resumes the same session.
    pub client_id: String,
    /// The engine queues each message goes to (one per consumer).
    pub queues: Vec<String>,
    /// Stop after this long without a message (tests, one-off imports); `None`: run
    /// until shutdown.
    pub idle_exit: Option<Duration>,
}

impl MqttIngressConfig {
    /// Check the filters and the share group by MQTT's rules (3.1.1 §4.7, MQTT 5
    /// §4.8.2), so a mistake is a usage error now rather than a refused SUBSCRIBE later.
    pub fn validate(&self) -> Result<(), IngressError> {
        let bad = |why: String| Err(IngressError::BadConfig(why));
        if self.filters.is_empty() {
            return bad("no --topic filter".into());
        }
        for f in &self.filters {
            if let Err(why) = check_filter(f) {
                return bad(format!("--topic {f:?}: {why}"));
            }
            if self.share_group.is_some() && f.starts_with("$share/") {
                return bad(format!(
                    "--topic {f:?} is a shared subscription already; give the plain filter with --share-group"
                ));
            }
        }
        if let Some(g) = &self.share_group {
            if g.is_empty() || g.contains(['/', '+', '#']) || g.contains('\0') {
                return bad(format!(
                    "--share-group {g:?}: a group name is not empty and has no '/', '+' or '#'"
                ));
            }
        }
        if self.client_id.is_empty() || self.client_id.len() > 255 {
            return bad("--client-id must be 1 to 255 bytes".into());
        }
        Ok(())
    }

    /// The filters as subscribed: each under `$share/GROUP/` when sharing, in the
    /// configured order without repeats.
    pub fn subscriptions(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::with_capacity(self.filters.len());
        for f in &self.filters {
            let s = match &self.share_group {
                Some(g) => format!("$share/{g}/{f}"),
                None => f.clone(),
            };
            if !out.contains(&s) {
                out.push(s);
            }
        }
        out
    }

    /// The session's name in `ingress_subscriptions`: the broker's address and the
    /// client id (never the user: a login change is the same session).
    pub fn session(&self) -> String {
        format!("{}/{}", self.link.url.address(), self.client_id)
    }
}

/// A topic filter by MQTT's rules: not empty, no NUL, `+` and `#` alone in their
/// level, `#` last.
fn check_filter(f: &str) -> Result<(), String> {
    if f.is_empty() {
        return Err("empty".into());
    }
    if f.len() > MAX_FILTER_BYTES {
        return Err(format!("{} bytes, limit {MAX_FILTER_BYTES}", f.len()));
    }
    if f.contains('\0') {
        return Err("contains NUL".into());
    }
    let levels: Vec<&str> = f.split('/').collect();
    for (i, level) in levels.iter().enumerate() {
        if level.contains('#') && (*level != "#" || i + 1 != levels.len()) {
            return Err("'#' must be a whole level, and the last".into());
        }
        if level.contains('+') && *level != "+" {
            return Err("'+' must be a whole level".into());
        }
    }
    Ok(())
}

/// What one ingress run did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct IngressStats {
    pub received: u64,
    pub received_dup_flag: u64,
    pub published: u64,
    /// Messages kept in `dead_letters` instead of queued, by reason (each acked).
    pub dead_lettered: BTreeMap<String, u64>,
    /// Broker connections made (1 without a reconnect).
    pub connections: u64,
    /// The filters in force, as subscribed.
    pub filters: Vec<String>,
    /// Filters an earlier run subscribed that this one unsubscribed.
    pub unsubscribed: Vec<String>,
}

impl IngressStats {
    /// Every message dead-lettered, whatever the reason.
    pub fn dead_lettered_total(&self) -> u64 {
        self.dead_lettered.values().sum()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IngressError {
    #[error("bad broker URL {0}: {1}")]
    BadUrl(String, String),
    #[error("{0}")]
    BadConfig(String),
    #[error("{0}")]
    Link(#[from] LinkError),
    #[error("{0}")]
    Queue(#[from] super::queue::QueueError),
    #[error("database: {0}")]
    Store(String),
    #[error("MQTT broker {0}: {1}")]
    Broker(String, String),
    /// A failure trying again cannot fix: a refused login, a certificate check.
    #[error("{}", .0.message)]
    Fatal(LinkFailure),
}

/// Host and port of `mqtt://HOST[:PORT]` (1883 by default): where the device
/// simulator, which speaks plain MQTT, connects.
pub fn broker_address(url: &str) -> Result<(String, u16), IngressError> {
    let u = super::mqtt_link::BrokerUrl::parse(url).map_err(|e| match e {
        LinkError::BadUrl(u, why) => IngressError::BadUrl(u, why),
        other => IngressError::BadConfig(other.to_string()),
    })?;
    if u.tls {
        return Err(IngressError::BadUrl(
            idemwatch_base::redact::redact_url(url),
            "expected mqtt://HOST:PORT (plain MQTT)".into(),
        ));
    }
    Ok((u.host, u.port))
}

/// A message as the event loop read it, for the publishing loop.
struct Arrival {
    /// Its packet id and QoS (no payload), for the PUBACK.
    ack: Publish,
    dup: bool,
    /// The connection it came in on.
    generation: u64,
    body: Body,
}

enum Body {
    /// For the queue (checked there that it is JSON, see [`door`]).
    Fits(Bytes),
    /// Over [`MAX_RAW_BYTES`]: what its dead letter keeps, and why.
    TooLarge { kept: Vec<u8>, detail: String },
}

/// Subscriptions to make on each connect, and what to forget once done.
struct Subscriber {
    client: AsyncClient,
    filters: Vec<String>,
    /// Filters of an earlier run to unsubscribe, until every UNSUBACK is in.
    stale: Vec<String>,
    unsubacks_due: usize,
    store: Arc<dyn Store>,
    session: String,
}

impl Subscriber {
    /// SUBSCRIBE every filter (the broker replaces an identical subscription, so this
    /// is idempotent), UNSUBSCRIBE the stale ones. From a task of its own: the
    /// client's request channel may be full of PUBACKs, and only the poller drains it.
    fn on_connect(&mut self) {
        let (client, filters, stale) = (
            self.client.clone(),
            self.filters.clone(),
            self.stale.clone(),
        );
        self.unsubacks_due = stale.len();
        tokio::spawn(async move {
            let subscribe = filters
                .into_iter()
                .map(|f| SubscribeFilter::new(f, QoS::AtLeastOnce));
            if let Err(e) = client.subscribe_many(subscribe).await {
                tracing::warn!(error = %e, "MQTT SUBSCRIBE not queued");
            }
            for f in stale {
                if let Err(e) = client.unsubscribe(f).await {
                    tracing::warn!(error = %e, "MQTT UNSUBSCRIBE not queued");
                }
            }
        });
    }

    /// One UNSUBACK: after the last, the stale filters are gone from the broker and
    /// from the record.
    fn on_unsuback(&mut self) {
        if self.unsubacks_due == 0 {
            return;
        }
        self.unsubacks_due -= 1;
        if self.unsubacks_due > 0 {
            return;
        }
        tracing::info!(unsubscribed = ?self.stale, "MQTT filters no longer configured unsubscribed");
        self.stale.clear();
        let (store, session, filters) = (
            self.store.clone(),
            self.session.clone(),
            self.filters.clone(),
        );
        tokio::spawn(async move {
            let recorded =
                tokio::time::timeout(STORE_TIMEOUT, store.set_ingress_filters(&session, &filters))
                    .await;
            if !matches!(recorded, Ok(Ok(()))) {
                // The next run unsubscribes them again: harmless.
                tracing::warn!("the unsubscribed filters could not be forgotten in the database");
            }
        });
    }
}

/// Run the ingress until `shutdown` (or `idle_exit`), or a failure trying again
/// cannot fix ([`IngressError::Fatal`]).
pub async fn run_mqtt(
    cfg: &MqttIngressConfig,
    queue: Arc<dyn Queue>,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<IngressStats, IngressError> {
    cfg.validate()?;
    let mut options = cfg.link.options(&cfg.client_id)?;
    options
        .set_keep_alive(KEEP_ALIVE)
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_max_packet_size(MAX_PACKET, MAX_OUTGOING_PACKET);
    metrics.register_ingress(SOURCE);

    let filters = cfg.subscriptions();
    let session = cfg.session();
    let remembered = store_call(store.ingress_filters(&session)).await?;
    let stale: Vec<String> = remembered
        .iter()
        .filter(|f| !filters.contains(f))
        .cloned()
        .collect();
    // Remembered before subscribing: a run that dies after its SUBSCRIBE still has
    // its filters unsubscribed by the next one that no longer names them.
    let mut union = filters.clone();
    union.extend(stale.iter().cloned());
    if union != remembered {
        store_call(store.set_ingress_filters(&session, &union)).await?;
    }
    tracing::info!(
        broker = %cfg.link.url.shown(),
        client_id = %cfg.client_id,
        filters = %filters.join(", "),
        unsubscribing = %stale.join(", "),
        "MQTT ingress starting"
    );

    let (client, mut eventloop) = AsyncClient::new(options, 64);
    let mut subscriber = Subscriber {
        client: client.clone(),
        filters: filters.clone(),
        stale: stale.clone(),
        unsubacks_due: 0,
        store: store.clone(),
        session,
    };
    // The connection a message came in on; an ack goes only back on that one.
    let generation = Arc::new(AtomicU64::new(0));
    let (tx, mut rx) = mpsc::channel::<Arrival>(CHANNEL_CAPACITY);
    let (fatal_tx, mut fatal_rx) = mpsc::channel::<LinkFailure>(1);
    let poller = {
        let (generation, metrics, url) =
            (generation.clone(), metrics.clone(), cfg.link.url.clone());
        tokio::spawn(async move {
            let mut delay = Duration::from_millis(100);
            let mut connected = false;
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                        generation.fetch_add(1, Ordering::SeqCst);
                        delay = Duration::from_millis(100);
                        connected = true;
                        metrics.set_ingress_connected(SOURCE, true);
                        tracing::info!(
                            session_present = ack.session_present,
                            filters = %subscriber.filters.join(", "),
                            "MQTT connected; subscribing"
                        );
                        subscriber.on_connect();
                    }
                    Ok(Event::Incoming(Packet::SubAck(ack))) => {
                        if ack
                            .return_codes
                            .iter()
                            .any(|c| matches!(c, SubscribeReasonCode::Failure))
                        {
                            metrics.ingress_error(SOURCE, IngressErrorKind::Protocol);
                            let _ = fatal_tx
                                .send(LinkFailure {
                                    kind: IngressErrorKind::Protocol,
                                    fatal: true,
                                    message: format!(
                                        "{} refused the subscription to {} (the broker's ACL?)",
                                        url.shown(),
                                        subscriber.filters.join(", ")
                                    ),
                                })
                                .await;
                            return;
                        }
                    }
                    Ok(Event::Incoming(Packet::UnsubAck(_))) => subscriber.on_unsuback(),
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let g = generation.load(Ordering::SeqCst);
                        if tx.send(arrival(p, g)).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        let f = failure(&e, &url);
                        metrics.ingress_error(SOURCE, f.kind);
                        if connected {
                            connected = false;
                            metrics.set_ingress_connected(SOURCE, false);
                        }
                        if f.fatal {
                            tracing::error!(error = %f.message, "MQTT ingress stops");
                            let _ = fatal_tx.send(f).await;
                            return;
                        }
                        tracing::warn!(error = %f.message, retry_in = ?delay, "MQTT connection lost; resuming the session");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(MAX_RECONNECT_DELAY);
                    }
                }
            }
        })
    };

    // PUBACKs go out from a task of their own. `client.ack` waits while the client's
    // request channel is full, and only the poller drains it; the poller in turn
    // waits while `rx` is full, which only this loop drains. Acking here deadlocked
    // both as soon as a burst filled the two channels (a broker flushing a session's
    // backlog of thousands: the ingress stopped, idle-exit never came). The acker's
    // queue holds packet ids only, and at most what the broker let in flight.
    let (acks, mut to_ack) = mpsc::unbounded_channel::<(Publish, u64)>();
    let acker = {
        let (client, generation) = (client.clone(), generation.clone());
        tokio::spawn(async move {
            while let Some((p, g)) = to_ack.recv().await {
                if g != generation.load(Ordering::SeqCst) {
                    continue; // another connection: its packet ids are not ours to ack
                }
                if let Err(e) = client.ack(&p).await {
                    tracing::warn!(error = %e, "PUBACK not sent; the broker will redeliver");
                }
            }
        })
    };

    let mut stats = IngressStats {
        dead_lettered: INGRESS_REASONS
            .iter()
            .map(|r| (r.as_str().to_string(), 0))
            .collect(),
        filters: filters.clone(),
        unsubscribed: stale,
        ..IngressStats::default()
    };
    let mut fatal = None;
    let mut batch: Vec<Arrival> = Vec::with_capacity(MAX_BATCH);
    'run: loop {
        let first = tokio::select! {
            m = rx.recv() => m,
            f = fatal_rx.recv() => { fatal = f; None }
            _ = shutdown.changed() => None,
            _ = idle(cfg.idle_exit) => None,
        };
        let Some(first) = first else { break };
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let mut bodies: Vec<Vec<u8>> = Vec::with_capacity(batch.len());
        for a in &batch {
            metrics.ingress(SOURCE, a.dup);
            stats.received += 1;
            stats.received_dup_flag += u64::from(a.dup);
            let refused = match &a.body {
                Body::TooLarge { kept, detail } => {
                    Some((RejectReason::TooLarge, kept.as_slice(), detail.clone()))
                }
                Body::Fits(b) => match door(b) {
                    Ok(()) => {
                        bodies.push(b.to_vec());
                        None
                    }
                    Err(detail) => Some((RejectReason::MalformedJson, b.as_ref(), detail)),
                },
            };
            if let Some((reason, raw, detail)) = refused {
                // Kept before its ack; an outage of the database holds the batch
                // (nothing acked, the broker keeps it), it never drops the message.
                if !dead_letter(&*store, &metrics, reason, &detail, raw, &mut shutdown).await {
                    batch.clear();
                    break 'run;
                }
                tracing::warn!(reason = %reason, %detail, "MQTT message dead-lettered at the door; acked");
                *stats
                    .dead_lettered
                    .entry(reason.as_str().to_string())
                    .or_default() += 1;
            }
        }
        // Not accepted by the queue: not acked either. The broker keeps them (the
        // session) and sends them again; retry the same batch meanwhile.
        let mut delay = Duration::from_millis(100);
        while !bodies.is_empty() {
            let Err(e) = queue.publish(&cfg.queues, &bodies).await else {
                break;
            };
            metrics.ingress_error(SOURCE, IngressErrorKind::Queue);
            tracing::warn!(error = %e, retry_in = ?delay, "queue refused the batch; not acked, retrying");
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown.changed() => { batch.clear(); break 'run; }
            }
            delay = (delay * 2).min(MAX_RECONNECT_DELAY);
        }
        stats.published += bodies.len() as u64;
        for a in batch.drain(..) {
            // Never blocks: the acker waits for the client, not this loop.
            let _ = acks.send((a.ack, a.generation));
        }
        if *shutdown.borrow() {
            break;
        }
    }
    // The poller sends a fatal failure before it ends, and its end closes `rx`: the
    // loop may have seen the close first.
    fatal = fatal.or_else(|| fatal_rx.try_recv().ok());
    stats.connections = generation.load(Ordering::SeqCst);
    // The last PUBACKs out before the goodbye (bounded: a dead broker cannot hold us).
    drop(acks);
    let _ = tokio::time::timeout(Duration::from_secs(2), acker).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), client.disconnect()).await;
    poller.abort();
    metrics.set_ingress_connected(SOURCE, false);
    match fatal {
        Some(f) => Err(IngressError::Fatal(f)),
        None => Ok(stats),
    }
}

/// What the event loop hands on: the body, or (over the limit) only what its dead
/// letter keeps, so the packet's memory goes now.
fn arrival(p: Publish, generation: u64) -> Arrival {
    let mut ack = Publish::new(String::new(), p.qos, Vec::new());
    ack.pkid = p.pkid;
    let body = if p.payload.len() > MAX_RAW_BYTES {
        let what = format!(
            "MQTT message on {} is {} bytes, over the queue's limit of {MAX_RAW_BYTES}",
            p.topic,
            p.payload.len()
        );
        let (kept, detail) = dead_letter_raw(&p.payload, &what);
        Body::TooLarge {
            kept: kept.to_vec(),
            detail,
        }
    } else {
        Body::Fits(p.payload)
    };
    Arrival {
        ack,
        dup: p.dup,
        generation,
        body,
    }
}

/// What the door checks of a body that fits: that it is JSON text at all. Nothing
/// else (fields, types) — that is each consumer's to judge and dead-letter; a body
/// that is not JSON can never be processed by any, and one dead letter here beats
/// one per consumer.
fn door(body: &[u8]) -> Result<(), String> {
    serde_json::from_slice::<serde::de::IgnoredAny>(body)
        .map(drop)
        .map_err(|e| format!("MQTT message is not JSON: {e}"))
}

/// Keep a refused message in `dead_letters`, retrying while the database is away.
/// `false`: shutdown came first (nothing to ack then).
async fn dead_letter(
    store: &dyn Store,
    metrics: &Metrics,
    reason: RejectReason,
    detail: &str,
    raw: &[u8],
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    let mut delay = Duration::from_millis(100);
    loop {
        let kept = tokio::time::timeout(
            STORE_TIMEOUT,
            store.dead_letter(DEAD_LETTER_CONSUMER, reason, detail, raw),
        )
        .await;
        match kept {
            Ok(Ok(_)) => {
                metrics.ingress_dead_lettered(SOURCE, reason);
                return true;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, retry_in = ?delay, "dead letter not written; not acked, retrying")
            }
            Err(_) => {
                tracing::warn!(retry_in = ?delay, "dead letter not written in time; not acked, retrying")
            }
        }
        metrics.ingress_error(SOURCE, IngressErrorKind::Store);
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.changed() => return false,
        }
        delay = (delay * 2).min(MAX_RECONNECT_DELAY);
    }
}

/// A database call of the ingress's setup, within [`STORE_TIMEOUT`].
async fn store_call<T>(
    call: impl std::future::Future<Output = super::store::StoreResult<T>>,
) -> Result<T, IngressError> {
    match tokio::time::timeout(STORE_TIMEOUT, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(IngressError::Store(e.to_string())),
        Err(_) => Err(IngressError::Store("no answer in time".into())),
    }
}

/// Longest wait for the broker while a session is opened or dropped.
const SESSION_TIMEOUT: Duration = Duration::from_secs(20);

/// Open the ingress's persistent session ahead of it and subscribe it to `topic`
/// (QoS 1), then leave: from the SUBACK on, the broker keeps every QoS 1 message on
/// the topic for `client_id`, and [`run_mqtt`] with the same id gets them when it
/// connects. A drill uses it to know that nothing its device sends can be missed.
pub async fn open_session(broker: &str, client_id: &str, topic: &str) -> Result<(), IngressError> {
    session(broker, client_id, Some(topic)).await
}

/// Drop `client_id`'s persistent session and whatever the broker still keeps for
/// it (a connect with clean session, MQTT 3.1.1 §3.1.2.4): a drill leaves no session
/// behind on a shared broker.
pub async fn forget_session(broker: &str, client_id: &str) -> Result<(), IngressError> {
    session(broker, client_id, None).await
}

async fn session(
    broker: &str,
    client_id: &str,
    subscribe: Option<&str>,
) -> Result<(), IngressError> {
    let link = LinkConfig::plain(broker)?;
    let shown = link.url.shown();
    let mut options = link.options(client_id)?;
    options
        .set_keep_alive(KEEP_ALIVE)
        .set_clean_session(subscribe.is_none());
    let (client, mut eventloop) = AsyncClient::new(options, 8);
    let work = async {
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(_))) => match subscribe {
                    Some(topic) => client
                        .subscribe(topic.to_string(), QoS::AtLeastOnce)
                        .await
                        .map_err(|e| e.to_string())?,
                    None => break,
                },
                Ok(Event::Incoming(Packet::SubAck(ack))) => {
                    if ack
                        .return_codes
                        .iter()
                        .any(|c| matches!(c, SubscribeReasonCode::Failure))
                    {
                        return Err("the broker refused the subscription".to_string());
                    }
                    break;
                }
                Ok(_) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        client.disconnect().await.map_err(|e| e.to_string())?;
        // Until the DISCONNECT is on the wire.
        loop {
            match eventloop.poll().await {
                Ok(Event::Outgoing(rumqttc::Outgoing::Disconnect)) | Err(_) => return Ok(()),
                Ok(_) => {}
            }
        }
    };
    match tokio::time::timeout(SESSION_TIMEOUT, work).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(IngressError::Broker(shown, e)),
        Err(_) => Err(IngressError::Broker(shown, "no answer in time".into())),
    }
}

/// Resolves after `d`, or never.
async fn idle(d: Option<Duration>) {
    match d {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(filters: &[&str], group: Option<&str>) -> MqttIngressConfig {
        MqttIngressConfig {
            link: LinkConfig::plain("mqtt://127.0.0.1:1883").unwrap(),
            filters: filters.iter().map(|f| f.to_string()).collect(),
            share_group: group.map(str::to_string),
            client_id: "idemwatch-ingest".into(),
            queues: vec!["trip-counter".into()],
            idle_exit: None,
        }
    }

    #[test]
    fn a_share_group_prefixes_every_filter_once() {
        let c = config(
            &["fleet/+/events", "depot/#", "fleet/+/events"],
            Some("ingest"),
        );
        c.validate().unwrap();
        assert_eq!(
            c.subscriptions(),
            ["$share/ingest/fleet/+/events", "$share/ingest/depot/#"]
        );
        assert_eq!(c.session(), "127.0.0.1:1883/idemwatch-ingest");
        assert_eq!(config(&["a/b"], None).subscriptions(), ["a/b"]);
    }

    #[test]
    fn filters_and_groups_that_break_mqtts_rules_are_usage_errors() {
        for bad in ["", "a/#/b", "a/b#", "a+/b", "x\0y"] {
            assert!(config(&[bad], None).validate().is_err(), "{bad:?}");
        }
        for good in ["#", "+", "a/+/c", "a/#", "/a", "$SYS/#"] {
            config(&[good], None).validate().unwrap();
        }
        assert!(config(&["a"], Some("g/x")).validate().is_err());
        assert!(config(&["$share/g/a"], Some("g")).validate().is_err());
        assert!(config(&[], None).validate().is_err());
    }

    #[test]
    fn the_door_refuses_only_what_is_not_json() {
        assert!(door(br#"{"device_id":"d"}"#).is_ok());
        assert!(
            door(b"[1,2]").is_ok(),
            "a consumer names what is wrong with it"
        );
        assert!(door(b"\xff\xfe{").unwrap_err().contains("not JSON"));
        assert!(door(b"{\"a\":").is_err());
    }
}
