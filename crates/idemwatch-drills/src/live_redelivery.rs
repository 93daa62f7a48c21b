//! `live-redelivery`: the parachute jump on the real system. K events the watched
//! system already processed (from `vehicle_history`) are published again, with their
//! original keys, to its own queues.
//!
//! The verdict rests on per-key evidence for those K messages only, so it holds on a
//! system under live load (whose own traffic moves every counter): for each key, the
//! dedup rows and claims are unchanged, its history row is unchanged, and the
//! provider sent nothing new for it (an SMS text is a pure function of the event);
//! and each consumer's `duplicate_dropped` rose by at least the copies it handles
//! (live duplicates may add to it; a naive consumer never counts one). Whole-system
//! counters (processed, trip counters) are reported, not judged.
//!
//! It never re-publishes a message whose dedup row or claim is gone (purged, or not
//! yet written): without it the copy would be applied again for real. Such a
//! candidate is named and skipped, and another is picked.
//!
//! Unlike the other drills this one touches live queues, so it is off unless the
//! operator says so (`--yes-live`; `[drills] allow_live` plus a confirmation in the
//! dashboard). The copies are tagged as drill traffic by their `message_id`
//! (`drill-live-<run>-<n>`), which the fingerprint ignores.
//!
//! The watched endpoint is read with `idemwatch_base::exposition`, the Prometheus text parser
//! that sits below both drills and monitor, so no layer arrow runs backwards.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::rig::Rig;
use super::{DrillError, Findings};
use idemwatch_base::exposition::{ScrapeLimits, Scraper};
use idemwatch_base::redact::redact_url;
use idemwatch_engine::consumers::zone_exit_sms::sms_text;
use idemwatch_engine::consumers::{risk_class, trip_counter, zone_exit_sms, RiskClass};
use idemwatch_engine::envelope::{Envelope, EventType};
use idemwatch_engine::metrics::names;
use idemwatch_engine::metrics::Metrics;
use idemwatch_engine::store::{Claim, ClaimState, HistoryRow};
use idemwatch_engine::{Engine, EngineConfig};

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
}

async fn scrape(http: &Scraper, url: &str) -> Result<BTreeMap<String, Counters>, DrillError> {
    let exposition = http
        .exposition(url)
        .await
        .map_err(|e| DrillError::Setup(format!("cannot scrape {}: {e}", redact_url(url))))?;
    let mut out: BTreeMap<String, Counters> = BTreeMap::new();
    for (name, field) in [
        (names::PROCESSED.exposed, 0),
        (names::DUPLICATE_DROPPED.exposed, 1),
        (names::DEAD_LETTERED.exposed, 2),
        (names::OUT_OF_ORDER.exposed, 3),
        (names::SIDE_EFFECTS.exposed, 4),
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

/// What the store says about one key, for every consumer that handles it: the
/// per-key evidence the verdict compares before and after.
#[derive(Debug, Clone, PartialEq)]
struct KeyEvidence {
    /// Consumer → its dedup row exists (transactional and side-effect consumers).
    dedup: BTreeMap<&'static str, bool>,
    /// Consumer → its claim (side-effect consumers).
    claims: BTreeMap<&'static str, Option<Claim>>,
    /// The event's `vehicle_history` row.
    history: Option<HistoryRow>,
}

impl KeyEvidence {
    async fn read(rig: &Rig, target: &Engine, env: &Envelope) -> Result<Self, DrillError> {
        let key = env.key();
        let mut e = KeyEvidence {
            dedup: BTreeMap::new(),
            claims: BTreeMap::new(),
            history: rig
                .store
                .vehicle_history(&env.device_id)
                .await?
                .into_iter()
                .find(|h| {
                    u64::try_from(h.seq).ok() == Some(env.seq)
                        && h.event_type == env.event_type.as_str()
                }),
        };
        for c in target
            .consumers()
            .iter()
            .filter(|c| c.wants(env.event_type))
        {
            match risk_class(c.name()) {
                Some(RiskClass::Accumulation) | Some(RiskClass::ExternalSideEffect) => {
                    let rows = rig.store.processed_keys(c.name(), key.as_str()).await?;
                    e.dedup
                        .insert(c.name(), rows.iter().any(|k| k == key.as_str()));
                }
                _ => {}
            }
            if risk_class(c.name()) == Some(RiskClass::ExternalSideEffect) {
                e.claims
                    .insert(c.name(), rig.store.claim(c.name(), &key).await?);
            }
        }
        Ok(e)
    }

    /// Why re-publishing this key would not be a pure duplicate, if it would not: a
    /// dedup row or claim missing (purged, or not written yet), a claim still open,
    /// or no history row.
    fn unsafe_to_republish(&self) -> Option<String> {
        if let Some((c, _)) = self.dedup.iter().find(|(_, present)| !**present) {
            return Some(format!(
                "{c} has no dedup row for it (purged, or not processed yet)"
            ));
        }
        for (c, claim) in &self.claims {
            match claim {
                None => return Some(format!("{c} has no claim for it (purged?)")),
                Some(cl) if cl.state == ClaimState::Claimed => {
                    return Some(format!("{c}'s claim on it is still open"))
                }
                Some(_) => {}
            }
        }
        if self.history.is_none() {
            return Some("its vehicle_history row is gone".into());
        }
        None
    }
}

/// SMS the provider sent with exactly this event's text (a pure function of the
/// event, so a resend with or without a key is the same text).
fn sms_for(sent: &[String], env: &Envelope) -> usize {
    let text = sms_text(env);
    sent.iter().filter(|t| **t == text).count()
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
    let k = live.k as usize;
    // Candidates: zone exits first (they exercise the counter and the SMS, the two
    // harms), then anything; more than K, since some may not be safe to re-publish.
    let pool = i64::from(live.k).saturating_mul(4).min(4000);
    let mut rows = rig.store.recent_history(Some("zone_exit"), pool).await?;
    if rows.len() < k {
        rows.extend(rig.store.recent_history(None, pool).await?);
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

    let run_tag = rig.namespace.clone();
    let mut envelopes: Vec<Envelope> = Vec::new();
    let mut before_keys: Vec<KeyEvidence> = Vec::new();
    let mut skipped = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        if envelopes.len() == k {
            break;
        }
        let Some(env) = envelope_of(r, format!("drill-live-{run_tag}-{i}")) else {
            continue;
        };
        if envelopes.iter().any(|e| e.key() == env.key()) {
            continue;
        }
        let evidence = KeyEvidence::read(rig, &target, &env).await?;
        if let Some(why) = evidence.unsafe_to_republish() {
            rig.say(format!(
                "not re-publishing {}: {why}; picking another",
                env.key()
            ));
            skipped.push(json!({"key": env.key().to_string(), "why": why}));
            continue;
        }
        envelopes.push(env);
        before_keys.push(evidence);
    }
    if envelopes.is_empty() {
        return Err(DrillError::Usage(
            "the database holds no processed event that is safe to re-publish yet".into(),
        ));
    }
    if envelopes.len() < k {
        rig.say(format!(
            "only {} of the {k} asked-for messages are safe to re-publish",
            envelopes.len()
        ));
    }
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
    for d in &devices {
        counters_before.insert(d.clone(), rig.store.zone_exits(d).await?);
    }
    let sms_before = rig.sms_texts_sent().await;

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

    // Watch until every consumer has dropped at least its copies, or the timeout (a
    // naive system never drops one; live traffic cannot make a system look better
    // here, only a real duplicate drop counts).
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
            d.duplicate_dropped >= *n as f64
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
    for (consumer, n) in &expected {
        let d = delta(&after, &before, consumer);
        f.duplicate_dropped += d.duplicate_dropped.max(0.0) as u64;
        f.dead_lettered += d.dead_lettered.max(0.0) as u64;
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
        f.check_at_least(
            &format!("{consumer}: duplicate_dropped rose by"),
            *n,
            d.duplicate_dropped.max(0.0) as u64,
        );
    }

    // Per-key evidence: only the drill's own messages are judged.
    let mut changed = Vec::new();
    let mut history_changed = Vec::new();
    let mut resent = Vec::new();
    let sms_after = rig.sms_texts_sent().await;
    for (env, was) in envelopes.iter().zip(&before_keys) {
        let now = KeyEvidence::read(rig, &target, env).await?;
        let key = env.key().to_string();
        // Already applied before the drill: anything applied again is one too many.
        let mut again = 0;
        if now.dedup != was.dedup || now.claims != was.claims {
            again += 1;
            changed.push(json!({"key": key, "before": format!("{:?}", was.claims), "after": format!("{:?}", now.claims), "dedup_after": format!("{:?}", now.dedup)}));
        }
        if now.history != was.history {
            again += 1;
            history_changed.push(key.clone());
        }
        if let (Some(b), Some(a)) = (&sms_before, &sms_after) {
            let (b, a) = (sms_for(b, env), sms_for(a, env));
            if a > b {
                again += (a - b) as i64;
                f.sms_sent += (a - b) as u64;
                resent.push(format!("{key} ({} SMS)", a - b));
            }
        }
        f.effect(&format!("{key} re-published"), 0, again, false);
    }
    f.check(
        "re-published keys whose dedup rows or claims changed",
        0,
        changed.len(),
    );
    f.check(
        "re-published keys whose history changed",
        0,
        history_changed.len(),
    );
    f.check("re-published keys the provider sent again", 0, resent.len());
    if !resent.is_empty() {
        f.note(format!(
            "duplicated side effect: {} sent {} SMS again, for {}",
            zone_exit_sms::NAME,
            f.sms_sent,
            resent.join(", ")
        ));
    }
    for (consumer, d) in &deltas {
        let dropped = d["duplicate_dropped"].as_f64().unwrap_or(0.0);
        let n = d["expected_duplicates"].as_f64().unwrap_or(0.0);
        if dropped < n {
            f.note(format!(
                "{consumer} dropped {dropped} of the {n} copies as duplicates: it handled the rest as new"
            ));
        }
    }

    // Whole-system figures, reported, not judged: live traffic moves them too.
    let mut counter_moves = Vec::new();
    for d in &devices {
        let moved = rig.store.zone_exits(d).await? - counters_before.get(d).copied().unwrap_or(0);
        f.counter_delta += moved;
        if moved != 0 {
            counter_moves.push(format!("{d} {moved:+}"));
        }
    }
    if !counter_moves.is_empty() {
        f.note(format!(
            "{} moved trip_counters.zone_exits of the re-published devices ({}); live traffic \
             to those devices counts here too",
            trip_counter::NAME,
            counter_moves.join(", ")
        ));
    }
    if !settled {
        f.note(format!(
            "timeout after {watched_ms} ms: not every copy was accounted for on {}",
            redact_url(&live.metrics_url)
        ));
    }
    f.state_ok = changed.is_empty() && history_changed.is_empty();
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
    f.extra.insert("skipped".into(), json!(skipped));
    f.extra.insert("changed_keys".into(), json!(changed));
    f.extra
        .insert("history_changed".into(), json!(history_changed));
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
