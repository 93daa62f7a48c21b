//! `crash-before-ack`: the 7-SMS incident. One `zone_exit`, delivered N times; the
//! first N-1 incarnations of each consumer die after their work, before the ack.

use super::rig::Rig;
use super::{count, deliveries, DeliveryOutcome, DrillError, Findings};
use idemwatch_engine::consumers::{trip_counter, zone_exit_sms};
use idemwatch_engine::crash::CrashPoint;
use idemwatch_engine::envelope::EventType;

pub(crate) async fn run(rig: &Rig, times: u32) -> Result<Findings, DrillError> {
    let consumers = [zone_exit_sms::NAME, trip_counter::NAME];
    let exit = rig.event(48211, EventType::ZoneExit, "p-81f3");
    rig.publish(&consumers, &[exit.to_json_line().into_bytes()])
        .await?;
    rig.say(format!(
        "published {} once; arming {} of {times} incarnations to die at {}",
        exit.key(),
        times - 1,
        CrashPoint::AfterCommitBeforeAck
    ));
    let (sms, counter) = tokio::join!(
        rig.supervise(
            zone_exit_sms::NAME,
            times,
            times - 1,
            CrashPoint::AfterCommitBeforeAck
        ),
        rig.supervise(
            trip_counter::NAME,
            times,
            times - 1,
            CrashPoint::AfterCommitBeforeAck
        ),
    );
    let mut f = Findings {
        events: sms?.into_iter().chain(counter?).collect(),
        ..Findings::default()
    };
    rig.clean_up(&consumers).await;

    f.deliveries = deliveries(&f.events, zone_exit_sms::NAME);
    f.duplicate_dropped = count(&f.events, zone_exit_sms::NAME, DeliveryOutcome::Duplicate);
    f.sms_sent = rig.sms_sent().await? as u64;
    f.counter_delta = rig.counter().await?;
    f.state_ok = f.sms_sent == 1 && f.counter_delta == 1;
    let crashed = times > 1;
    f.effect("SMS for the zone exit", 1, f.sms_sent as i64, crashed);
    f.effect("trip counter +1", 1, f.counter_delta, crashed);
    f.check("deliveries of the zone_exit", times, f.deliveries);
    f.check("SMS actually sent", 1, f.sms_sent);
    f.check("duplicates dropped", times - 1, f.duplicate_dropped);
    f.check("trip counter delta", 1, f.counter_delta);
    f.check(
        "trip-counter duplicates dropped",
        times - 1,
        count(&f.events, trip_counter::NAME, DeliveryOutcome::Duplicate),
    );
    // The redeliveries are the queue's own (the broker's `redelivered` flag on AMQP),
    // not re-publishes: every incarnation after the first must see the flag.
    let flagged = f
        .events
        .iter()
        .filter(|e| e.consumer == zone_exit_sms::NAME && e.redelivered)
        .count() as u64;
    f.extra.insert("redelivered_seen".into(), flagged.into());
    // As the queue counted them (RabbitMQ quorum queues: x-delivery-count + 1).
    let counts: Vec<u32> = f
        .events
        .iter()
        .filter(|e| e.consumer == zone_exit_sms::NAME)
        .map(|e| e.delivery_count)
        .collect();
    f.extra.insert("delivery_counts".into(), counts.into());
    f.check(
        "deliveries flagged redelivered by the queue",
        times - 1,
        flagged,
    );
    if f.sms_sent > 1 {
        f.note(format!(
            "the customer received {} identical SMS for one zone exit",
            f.sms_sent
        ));
    }
    Ok(f)
}
