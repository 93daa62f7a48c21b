//! `crash-after-send`: the consumer dies between the provider call and recording
//! the result. The claim is left in doubt; the retry must carry the same provider key.

use serde_json::json;

use super::rig::Rig;
use super::{count, deliveries, DeliveryOutcome, DrillError, Findings};
use idemwatch_engine::consumers::{zone_exit_sms, ConsumerMode};
use idemwatch_engine::crash::CrashPoint;
use idemwatch_engine::envelope::EventType;
use idemwatch_engine::store::ClaimState;

pub(crate) async fn run(rig: &Rig) -> Result<Findings, DrillError> {
    let consumers = [zone_exit_sms::NAME];
    let exit = rig.event(7001, EventType::ZoneExit, "p-send-1");
    rig.publish(&consumers, &[exit.to_json_line().into_bytes()])
        .await?;
    rig.say(format!(
        "published {}; the first incarnation dies right after the provider call",
        exit.key()
    ));
    let events = rig
        .supervise(zone_exit_sms::NAME, 2, 1, CrashPoint::AfterSideEffect)
        .await?;
    let mut f = Findings {
        events,
        ..Findings::default()
    };
    rig.clean_up(&consumers).await;

    let keys = rig.sms_request_keys().await?;
    let claim = rig.store.claim(zone_exit_sms::NAME, &exit.key()).await?;
    let took_over = f.events.iter().any(|e| e.took_over_in_doubt);
    f.deliveries = deliveries(&f.events, zone_exit_sms::NAME) + 1; // the crashed one emitted nothing
    f.duplicate_dropped = count(&f.events, zone_exit_sms::NAME, DeliveryOutcome::Duplicate);
    f.sms_sent = rig.sms_sent().await? as u64;
    f.effect("SMS for the zone exit", 1, f.sms_sent as i64, true);
    f.extra
        .insert("provider_requests".into(), json!(keys.len()));
    f.extra.insert("provider_keys".into(), json!(keys));
    f.extra.insert("claim".into(), json!(claim));
    f.check("SMS actually sent", 1, f.sms_sent);
    f.check("provider requests", 2, keys.len());
    if rig.mode == ConsumerMode::Idempotent {
        let same_key = keys.len() == 2 && keys[0].is_some() && keys[0] == keys[1];
        f.check("claim found in doubt and taken over", true, took_over);
        f.check("resend carried the same provider key", true, same_key);
        f.check(
            "claim recorded as sent",
            "sent",
            claim
                .as_ref()
                .map(|c| c.state.as_str())
                .unwrap_or("missing"),
        );
        f.state_ok = claim.is_some_and(|c| c.state == ClaimState::Sent);
    } else {
        f.state_ok = f.sms_sent == 1;
        f.note("without a claim and a provider key the retry is a second SMS");
    }
    Ok(f)
}
