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
//! The MQTT client's event loop runs on its own task and hands messages to the
//! publishing task through a bounded channel (backpressure, not memory growth).
//! Counted: `idem_ingress_messages_total{source="mqtt",dup_flag}` — the flag as it
//! arrived here (a broker does not pass a device's DUP on; it sets its own when it
//! redelivers to us).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rumqttc::{AsyncClient, Event, MqttOptions, Packet, Publish, QoS};
use serde::Serialize;
use tokio::sync::{mpsc, watch};

use super::metrics::Metrics;
use super::queue::Queue;

/// Messages published into the queue per call, at most.
pub const MAX_BATCH: usize = 256;
/// Messages waiting between the MQTT event loop and the queue, at most.
const CHANNEL_CAPACITY: usize = 1024;
/// Longest pause before reconnecting to a broker that went away.
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(5);
/// MQTT keep-alive: a dead broker connection is noticed within about this.
const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// Largest MQTT packet accepted (the envelope's 64 KiB plus room for bad input).
const MAX_PACKET: usize = 1 << 20;

/// Where to read and where to write.
#[derive(Debug, Clone)]
pub struct MqttIngressConfig {
    /// `mqtt://HOST:PORT`.
    pub broker: String,
    /// A topic filter, e.g. `fleet/+/events`.
    pub topic: String,
    /// The persistent session's name: the same id resumes the same session.
    pub client_id: String,
    /// The engine queues each message goes to (one per consumer).
    pub queues: Vec<String>,
    /// Stop after this long without a message (tests, one-off imports); `None`: run
    /// until shutdown.
    pub idle_exit: Option<Duration>,
}

/// What one ingress run did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct IngressStats {
    pub received: u64,
    pub received_dup_flag: u64,
    pub published: u64,
    /// Broker connections made (1 without a reconnect).
    pub connections: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum IngressError {
    #[error("bad broker URL {0}: {1}")]
    BadUrl(String, String),
    #[error("{0}")]
    Queue(#[from] super::queue::QueueError),
    #[error("MQTT broker {0}: {1}")]
    Broker(String, String),
}

/// Host and port of `mqtt://HOST[:PORT]` (1883 by default).
pub fn broker_address(url: &str) -> Result<(String, u16), IngressError> {
    let redacted = idemwatch_base::redact::redact_url(url);
    let u =
        url::Url::parse(url).map_err(|e| IngressError::BadUrl(redacted.clone(), e.to_string()))?;
    if u.scheme() != "mqtt" && u.scheme() != "tcp" {
        return Err(IngressError::BadUrl(
            redacted,
            "expected mqtt://HOST:PORT".into(),
        ));
    }
    let host = u
        .host_str()
        .ok_or_else(|| IngressError::BadUrl(redacted, "no host".into()))?;
    Ok((host.to_string(), u.port().unwrap_or(1883)))
}

/// Run the ingress until `shutdown` (or `idle_exit`).
pub async fn run_mqtt(
    cfg: &MqttIngressConfig,
    queue: Arc<dyn Queue>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<IngressStats, IngressError> {
    let (host, port) = broker_address(&cfg.broker)?;
    let mut options = MqttOptions::new(cfg.client_id.clone(), host, port);
    options
        .set_keep_alive(KEEP_ALIVE)
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_max_packet_size(MAX_PACKET, MAX_PACKET);
    let (client, mut eventloop) = AsyncClient::new(options, 64);
    metrics.register_ingress("mqtt");

    // The connection a message came in on; an ack goes only back on that one.
    let generation = Arc::new(AtomicU64::new(0));
    let (tx, mut rx) = mpsc::channel::<(Publish, u64)>(CHANNEL_CAPACITY);
    let poller = {
        let (client, generation, topic) = (client.clone(), generation.clone(), cfg.topic.clone());
        tokio::spawn(async move {
            let mut delay = Duration::from_millis(100);
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                        generation.fetch_add(1, Ordering::SeqCst);
                        delay = Duration::from_millis(100);
                        tracing::info!(session_present = ack.session_present, "MQTT connected");
                        // A new session (first start, or a broker that lost it): subscribe.
                        if !ack.session_present {
                            if let Err(e) = client.try_subscribe(topic.clone(), QoS::AtLeastOnce) {
                                tracing::warn!(error = %e, "MQTT subscribe could not be queued");
                            }
                        }
                    }
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let g = generation.load(Ordering::SeqCst);
                        if tx.send((p, g)).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in = ?delay, "MQTT connection lost; resuming the session");
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

    let mut stats = IngressStats::default();
    let mut batch: Vec<(Publish, u64)> = Vec::with_capacity(MAX_BATCH);
    loop {
        let first = tokio::select! {
            m = rx.recv() => m,
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
        let bodies: Vec<Vec<u8>> = batch.iter().map(|(p, _)| p.payload.to_vec()).collect();
        for (p, _) in &batch {
            metrics.ingress("mqtt", p.dup);
            stats.received += 1;
            stats.received_dup_flag += u64::from(p.dup);
        }
        // Not accepted by the queue: not acked either. The broker keeps them (the
        // session) and sends them again; retry the same batch meanwhile.
        let mut delay = Duration::from_millis(100);
        while let Err(e) = queue.publish(&cfg.queues, &bodies).await {
            tracing::warn!(error = %e, retry_in = ?delay, "queue refused the batch; not acked, retrying");
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown.changed() => { batch.clear(); break; }
            }
            delay = (delay * 2).min(MAX_RECONNECT_DELAY);
        }
        stats.published += batch.len() as u64;
        for (p, g) in batch.drain(..) {
            // Never blocks: the acker waits for the client, not this loop.
            let _ = acks.send((ack_of(&p), g));
        }
        if *shutdown.borrow() {
            break;
        }
    }
    stats.connections = generation.load(Ordering::SeqCst);
    // The last PUBACKs out before the goodbye (bounded: a dead broker cannot hold us).
    drop(acks);
    let _ = tokio::time::timeout(Duration::from_secs(2), acker).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), client.disconnect()).await;
    poller.abort();
    Ok(stats)
}

/// Longest wait for the broker while a session is opened or dropped.
const SESSION_TIMEOUT: Duration = Duration::from_secs(20);

/// Open the ingress's persistent session ahead of it and subscribe it to `topic`
/// (QoS 1), then leave: from the SUBACK on, the broker keeps every QoS 1 message on
/// the topic for `client_id`, and [`run_mqtt`] with the same id gets them when it
/// connects (the session is present, so it does not subscribe again). A drill uses
/// it to know that nothing its device sends can be missed.
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
    let (host, port) = broker_address(broker)?;
    let redacted = idemwatch_base::redact::redact_url(broker);
    let mut options = MqttOptions::new(client_id.to_string(), host, port);
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
                        .any(|c| matches!(c, rumqttc::SubscribeReasonCode::Failure))
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
        Ok(Err(e)) => Err(IngressError::Broker(redacted, e)),
        Err(_) => Err(IngressError::Broker(redacted, "no answer in time".into())),
    }
}

/// Resolves after `d`, or never.
async fn idle(d: Option<Duration>) {
    match d {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

/// What a PUBACK needs of a message (its packet id and QoS), without its payload, so
/// the acker's queue stays small.
fn ack_of(p: &Publish) -> Publish {
    let mut ack = Publish::new(String::new(), p.qos, Vec::new());
    ack.pkid = p.pkid;
    ack
}
