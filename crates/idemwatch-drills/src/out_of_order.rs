//! `out-of-order`: `ignition_off` (seq n+1) is processed, then `ignition_on` (seq n)
//! arrives late. State must stay `off`; history keeps both, the late one unapplied.

use serde_json::json;

use super::rig::Rig;
use super::{count, deliveries, DeliveryOutcome, DrillError, Findings};
use idemwatch_engine::consumers::vehicle_state;
use idemwatch_engine::envelope::EventType;

pub(crate) async fn run(rig: &Rig) -> Result<Findings, DrillError> {
    let consumers = [vehicle_state::NAME];
    let off = rig.event(901, EventType::IgnitionOff, "p-off");
    let on = rig.event(900, EventType::IgnitionOn, "p-on-redelivered");
    rig.publish(&consumers, &[off.to_json_line().into_bytes()])
        .await?;
    let mut events = rig.incarnation(vehicle_state::NAME, None).await?.events;
    rig.say("ignition_off (seq 901) applied; now the older ignition_on (seq 900) arrives");
    rig.publish(&consumers, &[on.to_json_line().into_bytes()])
        .await?;
    events.extend(rig.incarnation(vehicle_state::NAME, None).await?.events);
    let mut f = Findings {
        events,
        ..Findings::default()
    };
    rig.clean_up(&consumers).await;

    let state = rig.store.vehicle_state(&rig.device).await?;
    let history = rig.store.vehicle_history(&rig.device).await?;
    let late_applied = history.iter().find(|h| h.seq == 900).map(|h| h.applied);
    let ignition = state.as_ref().and_then(|s| s.ignition.clone());
    f.deliveries = deliveries(&f.events, vehicle_state::NAME);
    f.duplicate_dropped = count(&f.events, vehicle_state::NAME, DeliveryOutcome::Duplicate);
    f.state_ok = ignition.as_deref() == Some("off");
    let applied_off = state.as_ref().is_some_and(|s| s.last_seq == 901);
    f.effect(
        "state: ignition_off (seq 901)",
        1,
        i64::from(applied_off),
        false,
    );
    f.effect(
        "state: the late ignition_on (seq 900) never applied",
        0,
        i64::from(late_applied == Some(true)),
        false,
    );
    for seq in [900, 901] {
        let rows = history.iter().filter(|h| h.seq == seq).count();
        f.effect(&format!("history row of seq {seq}"), 1, rows as i64, false);
    }
    f.extra.insert("state".into(), json!(state));
    f.extra.insert("history".into(), json!(history));
    f.check(
        "vehicle ignition",
        "off",
        ignition.clone().unwrap_or_default(),
    );
    f.check(
        "state seq",
        901,
        state.as_ref().map(|s| s.last_seq).unwrap_or(0),
    );
    f.check("history rows", 2, history.len());
    f.check(
        "late ignition_on applied",
        json!(false),
        json!(late_applied),
    );
    f.check(
        "out-of-order counted",
        1,
        count(&f.events, vehicle_state::NAME, DeliveryOutcome::Late),
    );
    if ignition.as_deref() == Some("on") {
        f.note("ghost \"engine running\": an older ignition_on overwrote a newer ignition_off");
    }
    Ok(f)
}
