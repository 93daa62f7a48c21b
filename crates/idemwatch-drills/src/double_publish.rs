//! `double-publish`: the producer publishes the same event twice (or N times) with
//! different `message_id`s. The key comes from the event, so it is one event.

use super::rig::Rig;
use super::{count, deliveries, DeliveryOutcome, DrillError, Findings};
use idemwatch_engine::consumers::{trip_counter, vehicle_state, zone_exit_sms};
use idemwatch_engine::envelope::EventType;

pub(crate) async fn run(rig: &Rig, times: u32) -> Result<Findings, DrillError> {
    let consumers = [zone_exit_sms::NAME, trip_counter::NAME, vehicle_state::NAME];
    let bodies: Vec<Vec<u8>> = (1..=times)
        .map(|i| {
            rig.event(3100, EventType::ZoneExit, &format!("producer-retry-{i}"))
                .to_json_line()
                .into_bytes()
        })
        .collect();
    rig.publish(&consumers, &bodies).await?;
    rig.say(format!(
        "published one zone_exit {times} times with distinct message_ids"
    ));
    let mut events = Vec::new();
    for c in consumers {
        events.extend(rig.incarnation(c, None).await?.events);
    }
    let mut f = Findings {
        events,
        ..Findings::default()
    };
    rig.clean_up(&consumers).await;

    let history = rig.store.vehicle_history(&rig.device).await?;
    f.deliveries = deliveries(&f.events, zone_exit_sms::NAME);
    f.duplicate_dropped = count(&f.events, zone_exit_sms::NAME, DeliveryOutcome::Duplicate);
    f.sms_sent = rig.sms_sent().await? as u64;
    f.counter_delta = rig.counter().await?;
    f.state_ok = history.len() == 1;
    f.effect("SMS for the zone exit", 1, f.sms_sent as i64, false);
    f.effect("trip counter +1", 1, f.counter_delta, false);
    f.effect("history row", 1, history.len() as i64, false);
    f.check("SMS actually sent", 1, f.sms_sent);
    f.check("trip counter delta", 1, f.counter_delta);
    f.check("duplicates dropped", times - 1, f.duplicate_dropped);
    f.check("history rows", 1, history.len());
    Ok(f)
}
