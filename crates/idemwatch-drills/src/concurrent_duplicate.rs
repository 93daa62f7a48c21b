//! `concurrent-duplicate`: two workers get the same key at the same moment. The
//! loser must end as a duplicate through the unique constraint (rows affected = 0),
//! not through a check made before the insert.

use super::rig::Rig;
use super::{count, deliveries, DeliveryOutcome, DrillError, Findings};
use idemwatch_engine::consumers::{trip_counter, zone_exit_sms};
use idemwatch_engine::envelope::EventType;

pub(crate) async fn run(rig: &Rig) -> Result<Findings, DrillError> {
    let consumers = [trip_counter::NAME, zone_exit_sms::NAME];
    let bodies: Vec<Vec<u8>> = ["race-a", "race-b"]
        .iter()
        .map(|id| {
            rig.event(5150, EventType::ZoneExit, id)
                .to_json_line()
                .into_bytes()
        })
        .collect();
    rig.publish(&consumers, &bodies).await?;
    rig.say("two copies of one key published; two workers per consumer start together");
    // Each worker leases one delivery, so the two copies are handled concurrently.
    let (a, b, c, d) = tokio::join!(
        rig.incarnation(trip_counter::NAME, None),
        rig.incarnation(trip_counter::NAME, None),
        rig.incarnation(zone_exit_sms::NAME, None),
        rig.incarnation(zone_exit_sms::NAME, None),
    );
    let mut f = Findings::default();
    for inc in [a?, b?, c?, d?] {
        f.events.extend(inc.events);
    }
    rig.clean_up(&consumers).await;

    f.deliveries = deliveries(&f.events, trip_counter::NAME);
    f.duplicate_dropped = count(&f.events, trip_counter::NAME, DeliveryOutcome::Duplicate);
    f.sms_sent = rig.sms_sent().await? as u64;
    f.counter_delta = rig.counter().await?;
    f.state_ok = f.counter_delta == 1 && f.sms_sent == 1;
    f.effect("SMS for the zone exit", 1, f.sms_sent as i64, false);
    f.effect("trip counter +1", 1, f.counter_delta, false);
    f.check("trip counter delta", 1, f.counter_delta);
    f.check("SMS actually sent", 1, f.sms_sent);
    f.check("trip-counter duplicates dropped", 1, f.duplicate_dropped);
    f.check(
        "zone-exit-sms duplicates dropped",
        1,
        count(&f.events, zone_exit_sms::NAME, DeliveryOutcome::Duplicate),
    );
    f.note("the duplicate decision is the unique-key insert's rows-affected = 0 inside the losing transaction");
    Ok(f)
}
