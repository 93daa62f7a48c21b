//! Chaos verification: the business tables, the dead letters and the sandbox
//! provider against the ground truth, as if every distinct event had been handled
//! exactly once; and the broker's own redelivery count where it has one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use serde_json::{json, Value};

use super::setup::Arena;
use super::{ChaosOptions, ChaosReport, ConsumerTally, CHAOS_CLAIM_LEASE, CHAOS_MAX_DELIVERIES};
use crate::drills::{Check, DrillError, Verdict};
use crate::engine::consumers;
use crate::engine::envelope::EventType;
use crate::engine::queue::Queue;
use crate::exposition::{ScrapeLimits, Scraper};
use crate::sim::fleet::SimKind;

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

/// The end state of `arena` against its truth.
pub(super) async fn verify(
    opts: &ChaosOptions,
    arena: &Arena,
    x: VerifyExtras,
) -> Result<ChaosReport, DrillError> {
    let (run_id, store, truth, prefix) = (
        arena.run_id,
        arena.store.as_ref(),
        &arena.truth,
        arena.prefix.as_str(),
    );
    let sandbox = arena.sandbox.state();
    let empty = HashSet::new();
    let keys_of = |t: EventType| truth.keys.get(&t).unwrap_or(&empty);
    let zone_exits = keys_of(EventType::ZoneExit);
    let ignition_offs = keys_of(EventType::IgnitionOff);

    // Dead letters of this run (their raw bytes name our devices).
    let dead: Vec<_> = store
        .dead_letters(100_000)
        .await?
        .into_iter()
        .filter(|d| String::from_utf8_lossy(&d.raw).contains(prefix))
        .collect();
    let mut dead_keys: HashMap<String, HashSet<String>> = HashMap::new();
    for d in &dead {
        if let Ok(env) = crate::engine::envelope::Envelope::parse(&d.raw) {
            dead_keys
                .entry(d.consumer.clone())
                .or_default()
                .insert(env.key().to_string());
        }
    }

    let mut tallies = BTreeMap::new();
    for (consumer, wanted) in [
        (consumers::trip_counter::NAME, zone_exits),
        (consumers::zone_exit_sms::NAME, zone_exits),
        (consumers::erp_webhook::NAME, ignition_offs),
    ] {
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

    // vehicle-state: history holds every distinct event; state = newest event.
    let mut trip_total = 0;
    let mut state_ok = 0;
    let mut history_found = 0;
    let mut history_expected = 0;
    let mut wrong_states = Vec::new();
    for (device, (seq, event_type)) in &truth.newest {
        trip_total += store.zone_exits(device).await?;
        let expected_rows = truth.history_per_device.get(device).copied().unwrap_or(0);
        history_expected += expected_rows;
        history_found += store
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
    let vs_dead = dead_keys
        .get(consumers::vehicle_state::NAME)
        .map_or(0, HashSet::len);
    tallies.insert(
        consumers::vehicle_state::NAME.to_string(),
        ConsumerTally {
            expected: history_expected,
            processed: history_found,
            dead_lettered: vs_dead.min(history_expected - history_found),
            missing: history_expected
                - history_found
                - vs_dead.min(history_expected - history_found),
        },
    );

    let sms: Vec<_> = sandbox
        .sent_sms()
        .into_iter()
        .filter(|s| s.text.contains(prefix))
        .collect();
    let mut per_text: HashMap<&str, usize> = HashMap::new();
    for s in &sms {
        *per_text.entry(s.text.as_str()).or_default() += 1;
    }
    let sms_max = per_text.values().copied().max().unwrap_or(0);
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

    let distinct_events: usize = truth.history_per_device.values().sum();
    let duplicates = truth
        .messages
        .iter()
        .filter(|m| m.kind == SimKind::Redelivery)
        .count();
    let late = truth
        .messages
        .iter()
        .filter(|m| m.kind == SimKind::Late)
        .count();
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
        json!(zone_exits.len()),
        json!(trip_total),
    );
    check(
        "SMS sent = distinct zone exits",
        json!(zone_exits.len()),
        json!(sms.len()),
    );
    check(
        "at most one SMS per zone exit",
        json!(zone_exits.len().min(1)),
        json!(sms_max),
    );
    check(
        "webhooks sent = distinct ignition_off",
        json!(ignition_offs.len()),
        json!(webhooks),
    );
    check(
        "vehicles whose state is their newest event",
        json!(truth.newest.len()),
        json!(state_ok),
    );
    check(
        "messages neither processed nor dead-lettered",
        json!(0),
        json!(missing_total),
    );
    check(
        "messages left on the queues",
        json!(0),
        json!(x.left_on_queues),
    );
    let verdict = if checks.iter().all(|c| c.ok) {
        Verdict::Pass
    } else {
        Verdict::Fail
    };
    if !wrong_states.is_empty() {
        tracing::warn!(wrong = %json!(wrong_states.iter().take(10).collect::<Vec<_>>()), "vehicle states off");
    }
    Ok(ChaosReport {
        run_id,
        verdict,
        seed: opts.seed,
        instances: opts.instances,
        claim_lease_ms: u64::try_from(CHAOS_CLAIM_LEASE.as_millis()).unwrap_or(u64::MAX),
        max_deliveries: CHAOS_MAX_DELIVERIES,
        db: crate::engine::store::redact_url(&opts.db_url),
        queue: crate::engine::store::redact_url(&opts.queue_url),
        messages_published: truth.messages.len(),
        distinct_events,
        duplicates_published: duplicates,
        late_events: late,
        vehicles: truth.newest.len(),
        kill_schedule: opts.kill_every.to_string(),
        kills: x.kills,
        restarts: x.kills,
        publish_seconds: x.publish_seconds,
        duration_seconds: x.duration.as_secs_f64(),
        distinct_zone_exits: zone_exits.len(),
        trip_counter_total: trip_total,
        sms_sent: sms.len(),
        sms_max_per_exit: sms_max,
        distinct_ignition_offs: ignition_offs.len(),
        webhooks_sent: webhooks,
        vehicles_state_ok: state_ok,
        consumers: tallies,
        dead_lettered: dead.len(),
        drained_after_stop: x.drained_after_stop,
        left_on_queues: x.left_on_queues,
        broker_redelivered: x.broker_redelivered,
        checks,
    })
}

/// Where a RabbitMQ broker serves Prometheus metrics: its host, port 15692
/// (`IDEMWATCH_BROKER_METRICS_URL` overrides). Only for `amqp://` queues.
pub(super) fn broker_metrics_url(queue_url: &str) -> Option<String> {
    if let Ok(u) = std::env::var("IDEMWATCH_BROKER_METRICS_URL") {
        return Some(u);
    }
    let u = url::Url::parse(queue_url).ok()?;
    if !u.scheme().starts_with("amqp") {
        return None;
    }
    Some(format!("http://{}:15692/metrics", u.host_str()?))
}

/// `rabbitmq_global_messages_redelivered_total`, summed over protocols and queue types.
pub(super) async fn broker_redeliveries(url: &str) -> Option<f64> {
    let exposition = Scraper::new(Duration::from_secs(3), ScrapeLimits::default())
        .ok()?
        .exposition(url)
        .await
        .ok()?;
    let mut sum = None;
    for s in exposition.named("rabbitmq_global_messages_redelivered_total") {
        *sum.get_or_insert(0.0) += s.value;
    }
    sum
}
