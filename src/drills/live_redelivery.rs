//! `live-redelivery`: the parachute jump on the real system. K events the watched
//! system already processed (from `vehicle_history`) are published again, with their
//! original keys, to its own queues; then its `/metrics` must show `duplicate_dropped`
//! rising by exactly K on every consumer that handles them — and nothing else moving:
//! no processed counter, no side effect, no trip counter, no vehicle state.
//!
//! Unlike the other drills this one touches live queues, so it is off unless the
//! operator says so (`--yes-live`; `[drills] allow_live` plus a confirmation in the
//! dashboard). The copies are tagged as drill traffic by their `message_id`
//! (`drill-live-<run>-<n>`), which the fingerprint ignores.
//!
//! The watched endpoint is read with `crate::exposition`, the Prometheus text parser
//! that sits below both drills and monitor, so no layer arrow runs backwards.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::rig::Rig;
use super::{DrillError, Findings};
use crate::engine::consumers::{trip_counter, zone_exit_sms};
use crate::engine::envelope::{Envelope, EventType};
use crate::engine::metrics::Metrics;
use crate::engine::store::{HistoryRow, VehicleState};
use crate::engine::{Engine, EngineConfig};
use crate::exposition::{ScrapeLimits, Scraper};
use crate::redact::redact_url;

/// What the operator set for a live drill.
#[derive(Debug, Clone)]
pub struct LiveSettings {
    /// The watched system's `/metrics`.
    pub metrics_url: String,
    /// How many processed messages to re-publish.
    pub k: u32,
    /// How long to wait for the duplicates to be dropped.
    pub timeout: Duration,
    /// The watched system's queue namespace (None: the live queues).
    pub namespace: Option<String>,
    /// The operator's explicit permission (`--yes-live`, or the dashboard's confirmation
    /// with `allow_live`).
    pub confirmed: bool,
}

impl Default for LiveSettings {
    fn default() -> Self {
        LiveSettings {
            metrics_url: "http://127.0.0.1:9464/metrics".into(),
            k: 5,
            timeout: Duration::from_secs(30),
            namespace: None,
            confirmed: false,
        }
    }
}

/// Per consumer, the counters the drill watches.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counters {
    processed: f64,
    duplicate_dropped: f64,
    dead_lettered: f64,
    out_of_order: f64,
    effects_sent: f64,
}

impl Counters {
    fn minus(&self, before: &Counters) -> Counters {
        Counters {
            processed: self.processed - before.processed,
            duplicate_dropped: self.duplicate_dropped - before.duplicate_dropped,
            dead_lettered: self.dead_lettered - before.dead_lettered,
            out_of_order: self.out_of_order - before.out_of_order,
            effects_sent: self.effects_sent - before.effects_sent,
        }
    }

    /// Deliveries accounted for one way or another.
    fn handled(&self) -> f64 {
        self.processed + self.duplicate_dropped + self.dead_lettered
    }
}

async fn scrape(http: &Scraper, url: &str) -> Result<BTreeMap<String, Counters>, DrillError> {
    let exposition = http
        .exposition(url)
        .await
        .map_err(|e| DrillError::Setup(format!("cannot scrape {}: {e}", redact_url(url))))?;
    let mut out: BTreeMap<String, Counters> = BTreeMap::new();
    for (name, field) in [
        ("idem_messages_processed_total", 0),
        ("idem_duplicate_dropped_total", 1),
        ("idem_dead_lettered_total", 2),
        ("idem_out_of_order_total", 3),
        ("idem_side_effects_total", 4),
    ] {
        for s in exposition.named(name) {
            let Some(consumer) = s.label("consumer") else {
                continue;
            };
            if field == 4 && s.label("result") != Some("sent") {
                continue;
            }
            let c = out.entry(consumer.to_string()).or_default();
            match field {
                0 => c.processed += s.value,
                1 => c.duplicate_dropped += s.value,
                2 => c.dead_lettered += s.value,
                3 => c.out_of_order += s.value,
                _ => c.effects_sent += s.value,
            }
        }
    }
    Ok(out)
}

/// The envelope a history row was made from (the fingerprint covers payload and
/// `occurred_at`, both stored; `message_id` is ours to set).
fn envelope_of(row: &HistoryRow, tag: String) -> Option<Envelope> {
    let payload = match serde_json::from_str::<Value>(&row.payload).ok()? {
        Value::Object(m) => m,
        _ => return None,
    };
    Some(Envelope {
        message_id: Some(tag),
        device_id: row.device_id.clone(),
        seq: u64::try_from(row.seq).ok()?,
        event_type: EventType::parse(&row.event_type)?,
        occurred_at: row.occurred_at,
        payload,
    })
}

fn state_line(s: &Option<VehicleState>) -> Value {
    match s {
        Some(s) => json!([s.last_seq, s.last_event_type, s.ignition, s.zone]),
        None => Value::Null,
    }
}

pub(crate) async fn run(rig: &Rig, live: &LiveSettings) -> Result<Findings, DrillError> {
    if !live.confirmed {
        return Err(DrillError::Usage(
            "live-redelivery re-publishes processed messages into a running system: \
             pass --yes-live (the dashboard needs [drills] allow_live and a confirmation)"
                .into(),
        ));
    }
    if live.k == 0 || live.k > 1000 {
        return Err(DrillError::Usage(format!(
            "--k {} is outside 1..=1000",
            live.k
        )));
    }
    let k = i64::from(live.k);
    // Zone exits first: they exercise the counter and the SMS, the two harms.
    let mut rows = rig.store.recent_history(Some("zone_exit"), k).await?;
    if rows.len() < live.k as usize {
        rows = rig.store.recent_history(None, k).await?;
    }
    let run_tag = rig.namespace.clone();
    let envelopes: Vec<Envelope> = rows
        .iter()
        .enumerate()
        .filter_map(|(i, r)| envelope_of(r, format!("drill-live-{run_tag}-{i}")))
        .collect();
    if envelopes.is_empty() {
        return Err(DrillError::Usage(
            "the database holds no processed event to re-publish yet".into(),
        ));
    }

    let mut cfg = EngineConfig::new(
        rig.db_url(),
        rig.queue_url(),
        &rig.sms_url,
        &rig.webhook_url,
    );
    cfg.namespace = live.namespace.clone();
    let target = Engine::from_parts(
        rig.store.clone(),
        rig.queue.clone(),
        Arc::new(Metrics::new()),
        &cfg,
    )
    .map_err(|e| DrillError::Setup(e.to_string()))?;
    // What each consumer should drop: the re-published events it handles at all.
    let expected: BTreeMap<String, u64> = target
        .consumers()
        .iter()
        .map(|c| {
            let n = envelopes.iter().filter(|e| c.wants(e.event_type)).count() as u64;
            (c.name().to_string(), n)
        })
        .collect();

    let http = Scraper::new(Duration::from_secs(5), ScrapeLimits::default())
        .map_err(|e| DrillError::Setup(format!("HTTP client: {e}")))?;
    let before = scrape(&http, &live.metrics_url).await?;
    let mut devices: Vec<String> = envelopes.iter().map(|e| e.device_id.clone()).collect();
    devices.sort();
    devices.dedup();
    let mut counters_before = BTreeMap::new();
    let mut states_before = BTreeMap::new();
    for d in &devices {
        counters_before.insert(d.clone(), rig.store.zone_exits(d).await?);
        states_before.insert(d.clone(), state_line(&rig.store.vehicle_state(d).await?));
    }
    let sms_before = rig.sms_sent_for(&devices).await;

    let bodies: Vec<Vec<u8>> = envelopes
        .iter()
        .map(|e| e.to_json_line().into_bytes())
        .collect();
    target
        .publish(&bodies)
        .await
        .map_err(|e| DrillError::Setup(e.to_string()))?;
    rig.say(format!(
        "re-published {} processed messages ({}) to {}; watching {} for up to {:?}",
        envelopes.len(),
        envelopes
            .iter()
            .map(|e| e.key().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        rig.queue.redacted_url(),
        redact_url(&live.metrics_url),
        live.timeout
    ));

    // Watch until every consumer has accounted for its copies (dropped, or — the harm —
    // processed again), or the timeout.
    let started = Instant::now();
    let mut after = before.clone();
    let mut settled = false;
    while started.elapsed() < live.timeout {
        tokio::time::sleep(Duration::from_millis(250)).await;
        match scrape(&http, &live.metrics_url).await {
            Ok(now) => after = now,
            Err(e) => {
                rig.say(format!("scrape failed, still watching: {e}"));
                continue;
            }
        }
        settled = expected.iter().all(|(c, n)| {
            let d = delta(&after, &before, c);
            d.handled() >= *n as f64
        });
        if settled {
            // A moment more, so a late extra count is seen too.
            tokio::time::sleep(Duration::from_millis(500)).await;
            if let Ok(now) = scrape(&http, &live.metrics_url).await {
                after = now;
            }
            break;
        }
    }
    let watched_ms = started.elapsed().as_millis() as u64;

    let mut f = Findings {
        deliveries: envelopes.len() as u64,
        ..Findings::default()
    };
    let mut deltas = serde_json::Map::new();
    let mut processed_again = 0.0;
    let mut effects_again = 0.0;
    let mut dead = 0.0;
    for (consumer, n) in &expected {
        let d = delta(&after, &before, consumer);
        f.duplicate_dropped += d.duplicate_dropped.max(0.0) as u64;
        processed_again += d.processed;
        effects_again += d.effects_sent;
        dead += d.dead_lettered;
        deltas.insert(
            consumer.clone(),
            json!({
                "expected_duplicates": n,
                "duplicate_dropped": d.duplicate_dropped,
                "processed": d.processed,
                "side_effects_sent": d.effects_sent,
                "dead_lettered": d.dead_lettered,
                "out_of_order": d.out_of_order,
            }),
        );
        f.check(
            &format!("{consumer}: duplicate_dropped rose by"),
            *n,
            d.duplicate_dropped as u64,
        );
        if d.processed > 0.0 {
            f.note(format!(
                "{consumer} processed {} re-published messages again",
                d.processed
            ));
        }
        if d.effects_sent > 0.0 {
            let what = match consumer.as_str() {
                zone_exit_sms::NAME => "SMS",
                _ => "webhook calls",
            };
            f.note(format!(
                "duplicated side effect: {consumer} sent {} {what} again (idem_side_effects_total{{result=\"sent\"}} +{})",
                d.effects_sent, d.effects_sent
            ));
        }
    }
    f.check("processed counters moved", 0, processed_again as i64);
    f.check("side effects sent", 0, effects_again as i64);
    f.check("dead-lettered", 0, dead as i64);
    f.dead_lettered = dead.max(0.0) as u64;
    f.sms_sent = deltas
        .get(zone_exit_sms::NAME)
        .and_then(|d| d["side_effects_sent"].as_f64())
        .unwrap_or(0.0)
        .max(0.0) as u64;

    let mut counter_moves = Vec::new();
    let mut state_moves = Vec::new();
    for d in &devices {
        let moved = rig.store.zone_exits(d).await? - counters_before.get(d).copied().unwrap_or(0);
        f.counter_delta += moved;
        if moved != 0 {
            counter_moves.push(format!("{d} {moved:+}"));
        }
        let now = state_line(&rig.store.vehicle_state(d).await?);
        if states_before.get(d) != Some(&now) {
            state_moves.push(json!({"device": d, "before": states_before.get(d), "after": now}));
        }
    }
    if !counter_moves.is_empty() {
        f.note(format!(
            "duplicated effect: {} moved trip_counters.zone_exits ({})",
            trip_counter::NAME,
            counter_moves.join(", ")
        ));
    }
    f.check("trip counter delta", 0, f.counter_delta);
    f.check("vehicle states changed", 0, state_moves.len());
    if let (Some(b), Some(a)) = (sms_before, rig.sms_sent_for(&devices).await) {
        let provider = a as i64 - b as i64;
        f.check("SMS the provider sent", 0, provider);
        if provider > 0 {
            f.note(format!(
                "the provider at {} sent {provider} SMS again",
                redact_url(&rig.sms_url)
            ));
        }
    }
    if !settled {
        f.note(format!(
            "timeout after {watched_ms} ms: not every copy was accounted for on {}",
            redact_url(&live.metrics_url)
        ));
    }
    f.state_ok = state_moves.is_empty() && f.counter_delta == 0;
    f.extra
        .insert("metrics_url".into(), json!(redact_url(&live.metrics_url)));
    f.extra.insert("k".into(), json!(envelopes.len()));
    f.extra.insert(
        "republished".into(),
        json!(envelopes
            .iter()
            .map(|e| e.key().to_string())
            .collect::<Vec<_>>()),
    );
    f.extra.insert("deltas".into(), Value::Object(deltas));
    f.extra.insert("state_changes".into(), json!(state_moves));
    f.extra.insert("watched_ms".into(), json!(watched_ms));
    f.extra.insert("settled".into(), json!(settled));
    Ok(f)
}

fn delta(
    after: &BTreeMap<String, Counters>,
    before: &BTreeMap<String, Counters>,
    c: &str,
) -> Counters {
    after
        .get(c)
        .copied()
        .unwrap_or_default()
        .minus(&before.get(c).copied().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_rows_rebuild_their_envelope_with_the_same_key_and_fingerprint() {
        let original = Envelope::parse(
            br#"{"message_id":"p-81f3","device_id":"34-ABC-123","seq":48211,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{"zone":"X","phone":"+905551112233"}}"#,
        )
        .unwrap();
        let row = HistoryRow {
            device_id: original.device_id.clone(),
            seq: 48211,
            event_type: "zone_exit".into(),
            occurred_at: original.occurred_at,
            received_at: original.occurred_at,
            applied: true,
            payload: Value::Object(original.payload.clone()).to_string(),
        };
        let copy = envelope_of(&row, "drill-live-1-0".into()).unwrap();
        assert_eq!(copy.key(), original.key());
        assert_eq!(copy.fingerprint(), original.fingerprint());
        assert_eq!(copy.message_id.as_deref(), Some("drill-live-1-0"));
    }
}
