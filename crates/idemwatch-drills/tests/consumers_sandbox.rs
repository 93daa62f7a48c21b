//! The side-effect consumers against the sandbox SMS/ERP provider (the simulator's):
//! what a provider receives per delivery, idempotent or naive. A test of the engine's
//! consumers that needs the simulator above it, so it lives beside the simulator.

use std::sync::Arc;
use std::time::Duration;

use idemwatch_engine::consumers::{
    build, erp_webhook, zone_exit_sms, Consumer, ConsumerMode, Deps, Outcome,
};
use idemwatch_engine::crash::CrashPlan;
use idemwatch_engine::envelope::Message;
use idemwatch_engine::metrics::{EffectResult, Metrics};
use idemwatch_engine::provider::ProviderClient;
use idemwatch_engine::seen_set::{GuardedSeenSet, SeenSetConfig};

/// Deps over a real SQLite store in `dir`, both providers (SMS and webhook) at `provider`.
async fn deps_on(dir: &tempfile::TempDir, provider: &str) -> Deps {
    let url = format!("sqlite://{}", dir.path().join("consumers.db").display());
    let store = idemwatch_engine::store::open(&url).await.unwrap();
    let metrics = Arc::new(Metrics::new());
    Deps {
        seen_set: GuardedSeenSet::open(&SeenSetConfig::default(), store.clone(), metrics.clone())
            .unwrap(),
        store,
        provider: ProviderClient::new(provider, provider),
        metrics,
        claim_lease: Duration::from_secs(60),
        provider_concurrency: 1,
        custody: Arc::default(),
    }
}

/// An event of `event_type` from `device` at `seq`, with a zone and, when given,
/// a phone to notify.
fn event(device: &str, seq: u64, event_type: &str, phone: Option<&str>) -> Message {
    let phone = phone
        .map(|p| format!(r#","phone":"{p}""#))
        .unwrap_or_default();
    let line = format!(
        r#"{{"device_id":"{device}","seq":{seq},"event_type":"{event_type}","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X"{phone}}}}}"#
    );
    Message::parse(line.as_bytes()).unwrap()
}

fn sent() -> Outcome {
    Outcome::Processed {
        effect: Some(EffectResult::Sent),
        took_over_in_doubt: false,
    }
}

/// `consumer`'s batch of `envs`, which must succeed.
async fn batch(consumer: &dyn Consumer, envs: &[Message]) -> Vec<Outcome> {
    consumer
        .handle_batch(envs, &CrashPlan::none())
        .await
        .unwrap()
}

/// `env` delivered three times to `consumer`: in a batch of its own, again, then
/// alone; `first` the first time, `then` after.
async fn three_deliveries(consumer: &dyn Consumer, env: &Message, first: Outcome, then: &Outcome) {
    let (name, mode) = (consumer.name(), consumer.mode());
    let one = std::slice::from_ref(env);
    assert_eq!(batch(consumer, one).await, [first], "{name} {mode:?}");
    let again = batch(consumer, one).await;
    assert_eq!(again, std::slice::from_ref(then), "{name} {mode:?}");
    let alone = consumer.handle(env, &CrashPlan::none()).await.unwrap();
    assert_eq!(&alone, then, "{name} {mode:?}");
}

/// zone-exit-sms and erp-webhook against a sandbox provider: idempotent, each
/// event's effect goes out once (a zone exit without a phone notifies nobody),
/// in a batch or alone; naive (drills only) sends it on every delivery — its
/// batch is one by one, never the claiming batch.
#[tokio::test]
async fn a_side_effect_goes_out_once_unless_naive() {
    let sandbox = idemwatch_drills::sim::sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let deps = deps_on(&dir, &sandbox.url()).await;
    for (mode, sms, erp, then, times) in [
        (
            ConsumerMode::Idempotent,
            "34-SMS-I",
            "34-ERP-I",
            Outcome::Duplicate,
            1,
        ),
        (ConsumerMode::Naive, "34-SMS-N", "34-ERP-N", sent(), 3),
    ] {
        let zone_exit_sms = build(zone_exit_sms::NAME, &deps, mode).unwrap();
        let nobody = [event(sms, 2, "zone_exit", None)];
        let skipped = batch(&*zone_exit_sms, &nobody).await;
        assert_eq!(skipped, [Outcome::Skipped], "{mode:?}");
        let exit = event(sms, 1, "zone_exit", Some("+905551112233"));
        three_deliveries(&*zone_exit_sms, &exit, sent(), &then).await;
        let erp_webhook = build(erp_webhook::NAME, &deps, mode).unwrap();
        let off = event(erp, 1, "ignition_off", None);
        three_deliveries(&*erp_webhook, &off, sent(), &then).await;
        let state = sandbox.state();
        let texts = state
            .sent_sms()
            .into_iter()
            .filter(|s| s.text.contains(sms));
        assert_eq!(texts.count(), times, "{mode:?}");
        let posts = state
            .sent_erp()
            .into_iter()
            .filter(|e| e.body["device_id"] == erp);
        assert_eq!(posts.count(), times, "{mode:?}");
    }
}
