//! `key-conflict`: the same key arrives with a different payload. That is not a
//! duplicate: it is dead-lettered as `key_conflict`, never silently dropped.

use super::rig::Rig;
use super::{count, deliveries, DeliveryOutcome, DrillError, Findings};
use idemwatch_engine::consumers::{trip_counter, vehicle_state, zone_exit_sms};
use idemwatch_engine::envelope::EventType;

pub(crate) async fn run(rig: &Rig) -> Result<Findings, DrillError> {
    let consumers = [zone_exit_sms::NAME, trip_counter::NAME, vehicle_state::NAME];
    let first = rig.event(4400, EventType::ZoneExit, "p-a");
    let mut second = rig.event(4400, EventType::ZoneExit, "p-b");
    second.payload.insert("zone".into(), serde_json::json!("Y"));
    rig.publish(&consumers, &[first.to_json_line().into_bytes()])
        .await?;
    let mut events = Vec::new();
    for c in consumers {
        events.extend(rig.incarnation(c, None).await?.events);
    }
    rig.say(format!(
        "{} processed; now the same key with zone Y instead of X",
        first.key()
    ));
    rig.publish(&consumers, &[second.to_json_line().into_bytes()])
        .await?;
    for c in consumers {
        events.extend(rig.incarnation(c, None).await?.events);
    }
    let mut f = Findings {
        events,
        ..Findings::default()
    };
    rig.clean_up(&consumers).await;

    f.deliveries = deliveries(&f.events, zone_exit_sms::NAME);
    f.duplicate_dropped = count(&f.events, zone_exit_sms::NAME, DeliveryOutcome::Duplicate);
    f.dead_lettered = count(
        &f.events,
        zone_exit_sms::NAME,
        DeliveryOutcome::DeadLettered,
    );
    f.sms_sent = rig.sms_sent().await? as u64;
    f.counter_delta = rig.counter().await?;
    f.state_ok = f.counter_delta == 1;
    f.effect(
        "SMS for the key's first payload",
        1,
        f.sms_sent as i64,
        false,
    );
    f.effect("trip counter +1", 1, f.counter_delta, false);
    for c in consumers {
        f.check(
            &format!("{c} dead-lettered as key_conflict"),
            1,
            count(&f.events, c, DeliveryOutcome::DeadLettered),
        );
        f.check(
            &format!("{c} dropped as duplicate"),
            0,
            count(&f.events, c, DeliveryOutcome::Duplicate),
        );
    }
    f.check("SMS actually sent", 1, f.sms_sent);
    f.check("trip counter delta", 1, f.counter_delta);
    Ok(f)
}
