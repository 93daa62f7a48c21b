//! Chaos verification: the business tables, the dead letters and the sandbox
//! provider against the ground truth, as if every distinct event had been handled
//! exactly once; and the broker's own redelivery count where it has one (read by
//! the arena, [`super::setup`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use serde_json::{json, Value};

use super::setup::{Arena, Truth};
use super::{ChaosOptions, ChaosReport, ConsumerTally, CHAOS_CLAIM_LEASE, CHAOS_MAX_DELIVERIES};
use crate::sim::fleet::SimKind;
use crate::sim::sandbox_provider::SandboxState;
use crate::verdict::{repeat_calls, EffectTally, EffectVerdict};
use crate::{Check, DrillError, Verdict};
use idemwatch_engine::consumers;
use idemwatch_engine::envelope::EventType;
use idemwatch_engine::queue::Queue;
use idemwatch_engine::store::Store;

/// What the run measured on the way, for the report.
pub(super) struct VerifyExtras {
    pub kills: u64,
    pub publish_seconds: f64,
    pub drained_after_stop: u64,
    pub left_on_queues: u64,
    pub broker_redelivered: Option<f64>,
    pub duration: Duration,
}

/// Messages ready or in flight on the run's queues (an unreadable queue counts one:
/// unknown is not empty).
pub(super) async fn ready_total(queue: &dyn Queue, names: &[String]) -> u64 {
    let mut total = 0;
    for n in names {
        match queue.depth(n).await {
            Ok(d) => total += d.ready + d.in_flight,
            // Unknown is not empty.
            Err(_) => total += 1,
        }
    }
    total
}

/// The end state of `arena` against its truth: the dead letters of the run, each
/// consumer's tally of the distinct events it should have handled, the vehicles'
/// states and history, what the sandbox provider really sent, then the checks.
pub(super) async fn verify(
    opts: &ChaosOptions,
    arena: &Arena,
    x: VerifyExtras,
) -> Result<ChaosReport, DrillError> {
    let (store, truth, prefix) = (arena.store.as_ref(), &arena.truth, arena.prefix.as_str());
    let (dead, dead_keys) = dead_letters_of_the_run(store, prefix).await?;
    let mut tallies = side_effect_tallies(store, truth, prefix, &dead_keys).await?;
    let vehicles = vehicle_tally(store, truth, &dead_keys).await?;
    tallies.insert(
        consumers::vehicle_state::NAME.to_string(),
        vehicles.tally.clone(),
    );
    let sent = provider_tally(arena.sandbox.state(), prefix);
    let checks = checks(truth, &tallies, &vehicles, &sent, x.left_on_queues);
    let effects = effects(store, truth, &vehicles, arena.sandbox.state(), prefix).await?;
    let verdict = if checks.iter().all(|c| c.ok) {
        Verdict::Pass
    } else {
        Verdict::Fail
    };
    if !vehicles.wrong_states.is_empty() {
        tracing::warn!(wrong = %json!(vehicles.wrong_states.iter().take(10).collect::<Vec<_>>()), "vehicle states off");
    }
    let count = |kind: SimKind| truth.messages.iter().filter(|m| m.kind == kind).count();
    Ok(ChaosReport {
        run_id: arena.run_id,
        verdict,
        seed: opts.seed,
        instances: opts.instances,
        claim_lease_ms: u64::try_from(CHAOS_CLAIM_LEASE.as_millis()).unwrap_or(u64::MAX),
        max_deliveries: CHAOS_MAX_DELIVERIES,
        db: idemwatch_engine::store::redact_url(&opts.db_url),
        queue: idemwatch_engine::store::redact_url(&opts.queue_url),
        messages_published: truth.messages.len(),
        distinct_events: truth.history_per_device.values().sum(),
        duplicates_published: count(SimKind::Redelivery),
        late_events: count(SimKind::Late),
        vehicles: truth.newest.len(),
        kill_schedule: opts.kill_every.to_string(),
        kills: x.kills,
        restarts: x.kills,
        publish_seconds: x.publish_seconds,
        duration_seconds: x.duration.as_secs_f64(),
        distinct_zone_exits: truth.keys_of(EventType::ZoneExit).len(),
        trip_counter_total: vehicles.trip_total,
        sms_sent: sent.sms,
        sms_max_per_exit: sent.sms_max,
        distinct_ignition_offs: truth.keys_of(EventType::IgnitionOff).len(),
        webhooks_sent: sent.webhooks,
        vehicles_state_ok: vehicles.state_ok,
        consumers: tallies,
        dead_lettered: dead,
        drained_after_stop: x.drained_after_stop,
        left_on_queues: x.left_on_queues,
        broker_redelivered: x.broker_redelivered,
        effects,
        checks,
    })
}

/// The run's effects in Jepsen's terms (see `drills::verdict`): an SMS per distinct
/// zone exit and a webhook per distinct ignition_off (what the provider sent under
/// each one's key; recovered when its claim was taken over after a kill and it went
/// out once), a +1 per distinct zone exit (per device: the counter against the count
/// of its zone exits), a history row per distinct event; and the provider's calls
/// beyond the first per key.
async fn effects(
    store: &dyn Store,
    truth: &Truth,
    vehicles: &VehicleTally,
    sandbox: &SandboxState,
    prefix: &str,
) -> Result<EffectVerdict, DrillError> {
    use consumers::{erp_webhook, provider_key, zone_exit_sms};
    let mut per_key: HashMap<String, u64> = HashMap::new();
    for s in sandbox.sent_sms() {
        *per_key
            .entry(s.idempotency_key.unwrap_or_default())
            .or_default() += 1;
    }
    for w in sandbox.sent_erp() {
        *per_key
            .entry(w.idempotency_key.unwrap_or_default())
            .or_default() += 1;
    }
    let mut effects = Vec::new();
    for (consumer, wanted) in [
        (zone_exit_sms::NAME, EventType::ZoneExit),
        (erp_webhook::NAME, EventType::IgnitionOff),
    ] {
        for key in truth.keys_of(wanted) {
            let message_key = idemwatch_engine::envelope::MessageKey::from_stored(key.clone());
            let applied = per_key
                .get(&provider_key(consumer, &message_key))
                .copied()
                .unwrap_or(0);
            let taken_over = store
                .claim(consumer, &message_key)
                .await?
                .is_some_and(|c| c.attempts > 1);
            effects.push(EffectTally::new(
                format!("{consumer} {key}"),
                1,
                applied,
                taken_over,
            ));
        }
    }
    let mut exits_per_device: HashMap<&str, u64> = HashMap::new();
    for key in truth.keys_of(EventType::ZoneExit) {
        let device = key.split(':').next().unwrap_or_default();
        *exits_per_device.entry(device).or_default() += 1;
    }
    for (device, n) in exits_per_device {
        let counted = u64::try_from(store.zone_exits(device).await?).unwrap_or(0);
        for i in 0..n {
            // The counter says how many +1 there were, not which: the surplus doubles
            // the first ones, a shortfall loses the last ones.
            let applied = if counted >= n {
                1 + u64::from(i < counted - n)
            } else {
                u64::from(i < counted)
            };
            effects.push(EffectTally::new(
                format!("trip-counter {device} +1"),
                1,
                applied,
                false,
            ));
        }
    }
    let t = &vehicles.tally;
    effects.extend((0..t.processed).map(|_| EffectTally::new("history row", 1, 1, false)));
    effects.extend(
        (0..t.expected.saturating_sub(t.processed))
            .map(|_| EffectTally::new("history row", 1, 0, false)),
    );
    let sms = sandbox
        .sms_requests()
        .into_iter()
        .filter(|r| r.text.as_deref().is_some_and(|t| t.contains(prefix)))
        .map(|r| {
            (
                r.idempotency_key,
                format!("sms {}", r.text.unwrap_or_default()),
            )
        });
    let erp = sandbox
        .erp_requests()
        .into_iter()
        .filter(|r| {
            r.body
                .get("device_id")
                .and_then(Value::as_str)
                .is_some_and(|d| d.starts_with(prefix))
        })
        .map(|r| (r.idempotency_key, format!("erp {}", r.body)));
    let calls: Vec<(Option<String>, String)> = sms.chain(erp).collect();
    let repeats = repeat_calls(calls.iter().map(|(k, c)| (k.as_deref(), c.clone())));
    Ok(EffectVerdict::of(&effects, repeats))
}

/// Keys dead-lettered per consumer in this run (their raw bytes name our devices).
type DeadKeys = HashMap<String, HashSet<String>>;

/// How many dead letters the run left, and their keys per consumer.
async fn dead_letters_of_the_run(
    store: &dyn Store,
    prefix: &str,
) -> Result<(usize, DeadKeys), DrillError> {
    let dead: Vec<_> = store
        .dead_letters(100_000)
        .await?
        .into_iter()
        .filter(|d| String::from_utf8_lossy(&d.raw).contains(prefix))
        .collect();
    let mut keys: DeadKeys = HashMap::new();
    for d in &dead {
        if let Ok(env) = idemwatch_engine::envelope::Envelope::parse(&d.raw) {
            keys.entry(d.consumer.clone())
                .or_default()
                .insert(env.key().to_string());
        }
    }
    Ok((dead.len(), keys))
}

/// trip-counter, zone-exit-sms and erp-webhook: of the distinct events each wants,
/// how many it processed, how many were dead-lettered, how many are missing.
async fn side_effect_tallies(
    store: &dyn Store,
    truth: &Truth,
    prefix: &str,
    dead_keys: &DeadKeys,
) -> Result<BTreeMap<String, ConsumerTally>, DrillError> {
    let empty = HashSet::new();
    let mut tallies = BTreeMap::new();
    for (consumer, wanted) in [
        (consumers::trip_counter::NAME, EventType::ZoneExit),
        (consumers::zone_exit_sms::NAME, EventType::ZoneExit),
        (consumers::erp_webhook::NAME, EventType::IgnitionOff),
    ] {
        let wanted = truth.keys_of(wanted);
        let processed: HashSet<String> = store
            .processed_keys(consumer, prefix)
            .await?
            .into_iter()
            .collect();
        let dl = dead_keys.get(consumer).unwrap_or(&empty);
        let p = wanted.intersection(&processed).count();
        let d = wanted
            .difference(&processed)
            .filter(|k| dl.contains(*k))
            .count();
        tallies.insert(
            consumer.to_string(),
            ConsumerTally {
                expected: wanted.len(),
                processed: p,
                dead_lettered: d,
                missing: wanted.len() - p - d,
            },
        );
    }
    Ok(tallies)
}

/// vehicle-state and the trip counters, read per device.
struct VehicleTally {
    tally: ConsumerTally,
    trip_total: i64,
    state_ok: usize,
    wrong_states: Vec<Value>,
}

/// vehicle-state: the history holds every distinct event, the state is the newest.
async fn vehicle_tally(
    store: &dyn Store,
    truth: &Truth,
    dead_keys: &DeadKeys,
) -> Result<VehicleTally, DrillError> {
    let mut trip_total = 0;
    let mut state_ok = 0;
    let mut found = 0;
    let mut expected = 0;
    let mut wrong_states = Vec::new();
    for (device, (seq, event_type)) in &truth.newest {
        trip_total += store.zone_exits(device).await?;
        let expected_rows = truth.history_per_device.get(device).copied().unwrap_or(0);
        expected += expected_rows;
        found += store
            .vehicle_history(device)
            .await?
            .len()
            .min(expected_rows);
        match store.vehicle_state(device).await? {
            Some(s)
                if u64::try_from(s.last_seq).ok() == Some(*seq)
                    && s.last_event_type == event_type.as_str() =>
            {
                state_ok += 1
            }
            other => wrong_states.push(json!({
                "device": device,
                "expected": [seq, event_type.as_str()],
                "found": other.map(|s| (s.last_seq, s.last_event_type)),
            })),
        }
    }
    let dead = dead_keys
        .get(consumers::vehicle_state::NAME)
        .map_or(0, HashSet::len)
        .min(expected - found);
    Ok(VehicleTally {
        tally: ConsumerTally {
            expected,
            processed: found,
            dead_lettered: dead,
            missing: expected - found - dead,
        },
        trip_total,
        state_ok,
        wrong_states,
    })
}

/// What the sandbox provider really sent for this run's devices.
struct ProviderTally {
    sms: usize,
    /// The most SMS one zone exit's text was sent as (1 = none twice).
    sms_max: usize,
    webhooks: usize,
}

fn provider_tally(sandbox: &SandboxState, prefix: &str) -> ProviderTally {
    let sms: Vec<_> = sandbox
        .sent_sms()
        .into_iter()
        .filter(|s| s.text.contains(prefix))
        .collect();
    let mut per_text: HashMap<&str, usize> = HashMap::new();
    for s in &sms {
        *per_text.entry(s.text.as_str()).or_default() += 1;
    }
    let webhooks = sandbox
        .sent_erp()
        .into_iter()
        .filter(|w| {
            w.body
                .get("device_id")
                .and_then(Value::as_str)
                .is_some_and(|d| d.starts_with(prefix))
        })
        .count();
    ProviderTally {
        sms: sms.len(),
        sms_max: per_text.values().copied().max().unwrap_or(0),
        webhooks,
    }
}

/// The verdict's checks: each figure against what exactly-once handling of every
/// distinct event would give.
fn checks(
    truth: &Truth,
    tallies: &BTreeMap<String, ConsumerTally>,
    vehicles: &VehicleTally,
    sent: &ProviderTally,
    left_on_queues: u64,
) -> Vec<Check> {
    let zone_exits = truth.keys_of(EventType::ZoneExit).len();
    let missing_total: usize = tallies.values().map(|t| t.missing).sum();
    let mut checks = Vec::new();
    let mut check = |name: &str, expected: Value, actual: Value| {
        let ok = expected == actual;
        checks.push(Check {
            name: name.to_string(),
            expected,
            actual,
            ok,
        });
    };
    check(
        "trip_counters = distinct zone exits",
        json!(zone_exits),
        json!(vehicles.trip_total),
    );
    check(
        "SMS sent = distinct zone exits",
        json!(zone_exits),
        json!(sent.sms),
    );
    check(
        "at most one SMS per zone exit",
        json!(zone_exits.min(1)),
        json!(sent.sms_max),
    );
    check(
        "webhooks sent = distinct ignition_off",
        json!(truth.keys_of(EventType::IgnitionOff).len()),
        json!(sent.webhooks),
    );
    check(
        "vehicles whose state is their newest event",
        json!(truth.newest.len()),
        json!(vehicles.state_ok),
    );
    check(
        "messages neither processed nor dead-lettered",
        json!(0),
        json!(missing_total),
    );
    check(
        "messages left on the queues",
        json!(0),
        json!(left_on_queues),
    );
    checks
}
