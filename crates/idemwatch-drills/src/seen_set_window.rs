//! `seen-set-window`: the field report's seen-set, written after the handler
//! succeeded, and the window it leaves. One `zone_exit`; the first incarnation of
//! each consumer dies right after its effect (the SMS, the +1), before the key is
//! written. The redelivery finds no key and runs the effect again.
//!
//! Seen-set mode → 2 SMS and +2 (the window), whether the keys live in Redis
//! (`--seen-set redis://…`) or in the SQL table. Idempotent mode → the two-phase claim
//! finds its claim in doubt and resends with the same provider key (1 SMS), and the
//! transactional record commits the +1 with its key (no window at all).

use std::sync::Arc;

use serde_json::json;

use super::rig::Rig;
use super::{count, deliveries, DeliveryOutcome, DrillError, Findings};
use idemwatch_engine::consumers::{trip_counter, zone_exit_sms, ConsumerMode};
use idemwatch_engine::crash::CrashPoint;
use idemwatch_engine::envelope::EventType;
use idemwatch_engine::metrics::Metrics;
use idemwatch_engine::seen_set::GuardedSeenSet;

/// The verdict's explanation, the report's own words: where the window is and when
/// it matters.
pub(crate) const WINDOW: &str =
    "seen-set window: the SMS went out and the +1 was applied, then the \
process died before the key was written; the redelivery found no key and did it all again. \
A seen-set is fine for an upsert (running it twice leaves the same row), not for an SMS or a \
counter: use the transactional record and the two-phase claim with a provider Idempotency-Key \
(--mode idempotent)";

pub(crate) async fn run(rig: &Rig) -> Result<Findings, DrillError> {
    let consumers = [zone_exit_sms::NAME, trip_counter::NAME];
    let seen_set = GuardedSeenSet::open(&rig.seen_set, rig.store.clone(), Arc::new(Metrics::new()))
        .map_err(|e| DrillError::Setup(e.to_string()))?;
    let exit = rig.event(52001, EventType::ZoneExit, "p-window-1");
    rig.publish(&consumers, &[exit.to_json_line().into_bytes()])
        .await?;
    rig.say(format!(
        "published {}; keys in {}; the first incarnation of each consumer dies at {}",
        exit.key(),
        seen_set.describe(),
        CrashPoint::AfterSideEffect
    ));
    let (sms, counter) = tokio::join!(
        rig.supervise(zone_exit_sms::NAME, 2, 1, CrashPoint::AfterSideEffect),
        rig.supervise(trip_counter::NAME, 2, 1, CrashPoint::AfterSideEffect),
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
    f.effect("SMS for the zone exit", 1, f.sms_sent as i64, true);
    f.effect("trip counter +1", 1, f.counter_delta, true);
    f.extra
        .insert("seen_set".into(), json!(seen_set.describe()));
    f.check("SMS actually sent", 1, f.sms_sent);
    f.check("trip counter delta", 1, f.counter_delta);
    if rig.mode == ConsumerMode::SeenSet {
        // After the redelivery the key is there: the window is only between the effect
        // and the write, and the seen-set works once the write happened.
        let recorded = seen_set
            .seen(zone_exit_sms::NAME, &exit.key(), &exit.fingerprint())
            .await?
            .is_some();
        f.check("key in the seen-set after the redelivery", true, recorded);
    }
    if f.sms_sent > 1 || f.counter_delta > 1 {
        f.note(format!(
            "{} SMS and +{} for one zone exit",
            f.sms_sent, f.counter_delta
        ));
        if rig.mode == ConsumerMode::SeenSet {
            f.note(WINDOW);
        }
    } else if rig.mode == ConsumerMode::Idempotent {
        f.note("the claim was found in doubt and resent with the same provider key; the +1 committed with its key");
    }
    Ok(f)
}
