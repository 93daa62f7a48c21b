//! Vehicles over MQTT: the fleet published with QoS 1, as devices do, including the
//! retransmissions with the DUP flag that a device sends when a PUBACK is late.
//!
//! Written on the MQTT packets themselves (encoded by `rumqttc`'s `mqttbytes`) rather
//! than through a client library: a client library retransmits only when it decides
//! to, and a simulator must do it on demand, with the same packet id and the DUP bit.

use std::time::Duration;

use bytes::BytesMut;
use rand::{Rng, SeedableRng};
use rumqttc::mqttbytes::v4::{Connect, Packet, Publish};
use rumqttc::mqttbytes::QoS;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest wait for the broker (connect, CONNACK, the last PUBACKs).
const BROKER_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest packet read back from the broker.
const MAX_PACKET: usize = 1 << 16;
/// Connections after the first that one call may make to get everything acknowledged.
const MAX_RECONNECTS: u64 = 5;
/// Messages per connection at most: a packet id must name one message in flight.
const PACKET_IDS: usize = 65_535;

/// What the device publisher sent.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct DevicePublishStats {
    /// Distinct PUBLISH packets (one per envelope).
    pub published: u64,
    /// Extra copies sent again with the DUP flag and the same packet id.
    pub retransmitted: u64,
    /// Distinct PUBLISH packets the broker acknowledged (a PUBACK for each packet
    /// id; the broker's answers to the retransmissions are not counted again).
    pub acked: u64,
    /// Connections made again because the broker closed one before acknowledging
    /// everything sent on it; the unacknowledged messages were sent again with DUP.
    pub reconnects: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("{0}")]
    Broker(String),
    #[error("MQTT: {0}")]
    Io(#[from] std::io::Error),
}

/// The topic a device publishes its events on: `{prefix}/{device_id}/events`.
pub fn device_topic(prefix: &str, device_id: &str) -> String {
    format!("{prefix}/{device_id}/events")
}

/// One message not acknowledged yet: `(device_id, body)`, its packet id, and how many
/// copies with DUP follow its first send.
type Pending<'a> = (&'a (String, Vec<u8>), u16, u32);

/// Publish `(device_id, body)` pairs with QoS 1 to `broker` (`mqtt://HOST:PORT`); each
/// is retransmitted `extra` more times with the DUP flag with probability `dup_rate`
/// (or always, `extra` times, with `dup_rate` ≥ 1). Returns once every message's packet
/// id has a PUBACK. A broker may close the connection before that (Mosquitto 2.0
/// closes a publisher's connection when a subscriber's socket dies under it, "out of
/// memory" in its log): then, as a QoS 1 device does, the call connects again and
/// sends what was not acknowledged again with DUP, at most [`MAX_RECONNECTS`] times.
/// Counting every PUBACK instead (the broker also answers retransmissions) once
/// reported all acknowledged when a quarter had never reached the broker.
pub async fn publish_fleet(
    broker: &str,
    client_id: &str,
    topic_prefix: &str,
    messages: &[(String, Vec<u8>)],
    dup_rate: f64,
    extra: u32,
    seed: u64,
) -> Result<DevicePublishStats, DeviceError> {
    let (host, port) = idemwatch_engine::ingress::broker_address(broker)
        .map_err(|e| DeviceError::Broker(e.to_string()))?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut stats = DevicePublishStats::default();
    for chunk in messages.chunks(PACKET_IDS) {
        let mut pending: Vec<Pending> = Vec::with_capacity(chunk.len());
        for (i, m) in chunk.iter().enumerate() {
            let copies = if dup_rate >= 1.0 || rng.random_bool(dup_rate.clamp(0.0, 1.0)) {
                extra.max(1)
            } else {
                0
            };
            pending.push((m, u16::try_from(i + 1).unwrap_or(u16::MAX), copies));
        }
        stats.published += pending.len() as u64;
        let mut resend = false;
        loop {
            let acked = one_connection(
                (&host, port),
                client_id,
                topic_prefix,
                &pending,
                resend,
                &mut stats,
            )
            .await?;
            pending.retain(|(_, id, _)| !acked.contains(id));
            stats.acked += acked.len() as u64;
            if pending.is_empty() {
                break;
            }
            if stats.reconnects >= MAX_RECONNECTS {
                return Err(DeviceError::Broker(format!(
                    "{} messages not acknowledged after {} connections",
                    pending.len(),
                    stats.reconnects + 1
                )));
            }
            stats.reconnects += 1;
            resend = true;
        }
    }
    Ok(stats)
}

/// One connection: send `pending` (all with DUP when `resend`, else each with its
/// retransmissions), then read PUBACKs until each packet id has one or the broker
/// closes or goes quiet. The packet ids acknowledged.
async fn one_connection(
    (host, port): (&str, u16),
    client_id: &str,
    topic_prefix: &str,
    pending: &[Pending<'_>],
    resend: bool,
    stats: &mut DevicePublishStats,
) -> Result<std::collections::HashSet<u16>, DeviceError> {
    let mut stream = tokio::time::timeout(BROKER_TIMEOUT, TcpStream::connect((host, port)))
        .await
        .map_err(|_| DeviceError::Broker("connect timed out".into()))??;
    stream.set_nodelay(true)?;
    let mut out = BytesMut::new();
    let mut connect = Connect::new(client_id);
    connect.keep_alive = 60;
    connect
        .write(&mut out)
        .map_err(|e| DeviceError::Broker(format!("{e:?}")))?;
    stream.write_all(&out).await?;
    let mut inbuf = BytesMut::with_capacity(4096);
    match read_packet(&mut stream, &mut inbuf).await? {
        Packet::ConnAck(_) => {}
        other => {
            return Err(DeviceError::Broker(format!(
                "expected CONNACK, got {other:?}"
            )))
        }
    }
    let (mut reader, mut writer) = stream.into_split();
    let expected: std::collections::HashSet<u16> = pending.iter().map(|(_, id, _)| *id).collect();
    // PUBACKs are read beside the writes: a broker stops reading a client whose
    // socket buffer it cannot write into.
    let acks = tokio::spawn(async move {
        let mut acked = std::collections::HashSet::new();
        let mut buf = inbuf;
        while acked.len() < expected.len() {
            match tokio::time::timeout(BROKER_TIMEOUT, read_packet(&mut reader, &mut buf)).await {
                Ok(Ok(Packet::PubAck(a))) if expected.contains(&a.pkid) => {
                    acked.insert(a.pkid);
                }
                Ok(Ok(_)) => {}
                Ok(Err(_)) | Err(_) => break,
            }
        }
        acked
    });
    for ((device, body), pkid, copies) in pending {
        let mut p = Publish::new(
            device_topic(topic_prefix, device),
            QoS::AtLeastOnce,
            body.clone(),
        );
        p.pkid = *pkid;
        p.dup = resend;
        out.clear();
        p.write(&mut out)
            .map_err(|e| DeviceError::Broker(format!("{e:?}")))?;
        if resend {
            stats.retransmitted += 1;
        } else if *copies > 0 {
            p.dup = true;
            let mut again = BytesMut::new();
            p.write(&mut again)
                .map_err(|e| DeviceError::Broker(format!("{e:?}")))?;
            for _ in 0..*copies {
                out.extend_from_slice(&again);
                stats.retransmitted += 1;
            }
        }
        if writer.write_all(&out).await.is_err() {
            // The broker closed the connection: what it acknowledged is known below.
            break;
        }
    }
    let _ = writer.flush().await;
    let acked = acks.await.unwrap_or_default();
    let _ = writer.write_all(&[0xE0, 0x00]).await; // DISCONNECT
    Ok(acked)
}

async fn read_packet<R: AsyncReadExt + Unpin>(
    r: &mut R,
    buf: &mut BytesMut,
) -> Result<Packet, DeviceError> {
    loop {
        match Packet::read(buf, MAX_PACKET) {
            Ok(p) => return Ok(p),
            Err(rumqttc::mqttbytes::Error::InsufficientBytes(_)) => {}
            Err(e) => return Err(DeviceError::Broker(format!("{e:?}"))),
        }
        let n = tokio::time::timeout(BROKER_TIMEOUT, r.read_buf(buf))
            .await
            .map_err(|_| DeviceError::Broker("broker did not answer in time".into()))??;
        if n == 0 {
            return Err(DeviceError::Broker("broker closed the connection".into()));
        }
    }
}
