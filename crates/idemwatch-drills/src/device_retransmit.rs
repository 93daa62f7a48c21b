//! `device-retransmit`: where most device-side duplicates are born. A vehicle sends
//! one `zone_exit` with QoS 1; its PUBACK is late, so it sends the same PUBLISH again
//! (same packet id, DUP flag set), N copies in all. The broker forwards every copy —
//! QoS 1 is at least once, and the DUP flag is per hop (MQTT 3.1.1 §3.3.1.1: the
//! broker does not pass the device's flag on, it sets its own only when it redelivers
//! itself), so nothing downstream can tell a retransmission from a new event by the
//! flag. The key (device, seq, event type) can: idempotent consumers apply it once.
//!
//! With a broker (`--broker mqtt://…`, or `[drills] mqtt_broker`) the copies go the
//! real way: a device connection publishes them, the ingress of `ingest mqtt`
//! (`ingress::run_mqtt`, the same code) takes them off a persistent session into the
//! drill's queues. Without one, the drill publishes the N identical bodies straight
//! into the queues, which is what the ingress would have put there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::sync::watch;

use super::rig::Rig;
use super::{count, deliveries, DeliveryOutcome, DrillError, Findings};
use crate::sim::mqtt_device::publish_fleet;
use idemwatch_engine::consumers::{trip_counter, zone_exit_sms, ConsumerMode};
use idemwatch_engine::envelope::EventType;
use idemwatch_engine::ingress::{self, IngressStats, MqttIngressConfig};
use idemwatch_engine::metrics::Metrics;
use idemwatch_engine::mqtt_link::LinkConfig;
use idemwatch_engine::queue_name;

/// Copies a device sends at most in this drill: the broker keeps them for the
/// ingress's session, and a shared broker's queue per session is bounded
/// (Mosquitto's `max_queued_messages` is 1000 by default).
pub(crate) const MAX_COPIES: u32 = 100;
/// The ingress stops after this long without a message, and is run again while
/// copies are missing (the session keeps them).
const INGRESS_IDLE: Duration = Duration::from_secs(1);
/// How long the ingress may take to bring every copy in.
const INGRESS_DEADLINE: Duration = Duration::from_secs(60);

pub(crate) async fn run(rig: &Rig, times: u32) -> Result<Findings, DrillError> {
    if times > MAX_COPIES {
        return Err(DrillError::Usage(format!(
            "device-retransmit sends at most {MAX_COPIES} copies (--times {times})"
        )));
    }
    let consumers = [zone_exit_sms::NAME, trip_counter::NAME];
    let exit = rig.event(61001, EventType::ZoneExit, "qos1-61001");
    let body = exit.to_json_line().into_bytes();
    let mut f = Findings::default();
    let taken = match &rig.mqtt_broker {
        Some(broker) => through_broker(rig, broker, &consumers, &body, times, &mut f).await?,
        None => {
            rig.publish(&consumers, &vec![body; times as usize]).await?;
            rig.say(format!(
                "no MQTT broker configured: published the {times} identical copies of {} straight into the queues, as the ingress would",
                exit.key()
            ));
            f.extra.insert("path".into(), json!("queue"));
            f.note("no MQTT broker configured (--broker, [drills] mqtt_broker): the copies went straight into the queues");
            u64::from(times)
        }
    };
    let mut events = Vec::new();
    for c in consumers {
        events.extend(rig.incarnation(c, None).await?.events);
    }
    f.events = events;
    rig.clean_up(&consumers).await;

    f.deliveries = deliveries(&f.events, zone_exit_sms::NAME);
    f.duplicate_dropped = count(&f.events, zone_exit_sms::NAME, DeliveryOutcome::Duplicate);
    f.sms_sent = rig.sms_sent().await? as u64;
    f.counter_delta = rig.counter().await?;
    f.state_ok = f.sms_sent == 1 && f.counter_delta == 1;
    f.effect("SMS for the zone exit", 1, f.sms_sent as i64, false);
    f.effect("trip counter +1", 1, f.counter_delta, false);
    f.check("deliveries of the zone_exit", taken, f.deliveries);
    f.check("SMS actually sent", 1, f.sms_sent);
    f.check("trip counter delta", 1, f.counter_delta);
    f.check(
        "duplicates dropped",
        taken.saturating_sub(1),
        f.duplicate_dropped,
    );
    if f.sms_sent > 1 {
        f.note(format!(
            "one zone exit, {} SMS: every retransmitted copy ran the effect again",
            f.sms_sent
        ));
    } else if rig.mode == ConsumerMode::Idempotent {
        f.note("the copies share the event's key (device, seq, event type): the first applied it, the rest were dropped as duplicates");
    }
    Ok(f)
}

/// The real way: device → broker → `ingest mqtt`'s ingress → the drill's queues.
/// Returns how many copies the ingress put on the queue.
async fn through_broker(
    rig: &Rig,
    broker: &str,
    consumers: &[&str],
    body: &[u8],
    times: u32,
    f: &mut Findings,
) -> Result<u64, DrillError> {
    let setup = |e: &dyn std::fmt::Display| DrillError::Setup(e.to_string());
    let client_id = format!("{}-ingest", rig.namespace);
    let prefix = format!("idemwatch-drill/{}", rig.namespace);
    let topic = format!("{prefix}/+/events");
    ingress::open_session(broker, &client_id, &topic)
        .await
        .map_err(|e| setup(&e))?;
    let result = async {
        let (rate, extra) = if times > 1 {
            (1.0, times - 1)
        } else {
            (0.0, 0)
        };
        let device = publish_fleet(
            broker,
            &format!("{}-device", rig.namespace),
            &prefix,
            &[(rig.device.clone(), body.to_vec())],
            rate,
            extra,
            rand::random(),
        )
        .await
        .map_err(|e| setup(&e))?;
        rig.say(format!(
            "the device sent its QoS 1 PUBLISH {} time(s), {} with the DUP flag; PUBACKs received: {}",
            device.published + device.retransmitted,
            device.retransmitted,
            device.acked
        ));
        let cfg = MqttIngressConfig {
            link: LinkConfig::plain(broker).map_err(|e| setup(&e))?,
            filters: vec![topic.clone()],
            share_group: None,
            client_id: client_id.clone(),
            queues: consumers
                .iter()
                .map(|c| queue_name(Some(&rig.namespace), c))
                .collect(),
            idle_exit: Some(INGRESS_IDLE),
        };
        let metrics = Arc::new(Metrics::new());
        let mut taken = IngressStats::default();
        let deadline = Instant::now() + INGRESS_DEADLINE;
        while taken.published < u64::from(times) && Instant::now() < deadline {
            let (_stop, stopped) = watch::channel(false);
            let s = ingress::run_mqtt(
                &cfg,
                rig.queue.clone(),
                rig.store.clone(),
                metrics.clone(),
                stopped,
            )
            .await
            .map_err(|e| setup(&e))?;
            taken.received += s.received;
            taken.received_dup_flag += s.received_dup_flag;
            taken.published += s.published;
            taken.connections += s.connections;
        }
        rig.say(format!(
            "the ingress took {} copies off its session ({} flagged DUP by the broker) into the queues",
            taken.published, taken.received_dup_flag
        ));
        // The run's record of the session's filters goes with the session.
        let _ = rig.store.set_ingress_filters(&cfg.session(), &[]).await;
        Ok::<_, DrillError>((device, taken))
    }
    .await;
    if let Err(e) = ingress::forget_session(broker, &client_id).await {
        rig.say(format!("could not drop the drill's MQTT session: {e}"));
    }
    let (device, taken) = result?;
    f.check(
        "copies the device sent",
        u64::from(times),
        device.published + device.retransmitted,
    );
    f.check_at_least(
        "copies the broker forwarded to the ingress",
        u64::from(times),
        taken.received,
    );
    f.extra.insert("path".into(), json!("mqtt"));
    f.extra.insert(
        "mqtt".into(),
        json!({
            "broker": idemwatch_base::redact::redact_url(broker),
            "topic": topic,
            "device_published": device.published,
            "device_retransmitted_with_dup": device.retransmitted,
            "device_pubacks": device.acked,
            "ingress_received": taken.received,
            "ingress_received_dup_flag": taken.received_dup_flag,
            "ingress_published": taken.published,
            "ingress_connections": taken.connections,
        }),
    );
    f.note(format!(
        "the broker forwarded {} copies; {} carried the DUP flag on arrival: the flag is per hop, so the key, not the flag, is what finds the duplicate",
        taken.received, taken.received_dup_flag
    ));
    Ok(taken.published)
}
