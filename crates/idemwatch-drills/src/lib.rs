//! Redelivery drills (docs/CONTRACT.md §6.1): reproduce a failure of the field report on demand
//! and return a verdict.
//!
//! A drill runs against the configured store and queue but in its own corner: its
//! own queue namespace and its own device id, so it never touches live rows. Every
//! drill writes a `drill_runs` row and a `drill` marker. In naive mode the same
//! checks run and fail: that is the harm the pattern prevents.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use idemwatch_engine::consumers::ConsumerMode;
use idemwatch_engine::runner::{DeliveryEvent, DeliveryOutcome};
use idemwatch_engine::seen_set::SeenSetConfig;
use idemwatch_engine::store::{MarkerKind, StoreError};

pub mod chaos;
mod client_retry;
mod concurrent_duplicate;
mod crash_after_send;
mod crash_before_ack;
mod device_retransmit;
mod double_publish;
mod key_conflict;
pub mod live_redelivery;
mod out_of_order;
pub(crate) mod rig;
mod seen_set_window;
pub mod sim;
pub mod target;
pub mod twice;
pub mod verdict;

use rig::Rig;
pub use target::DrillTarget;
pub use verdict::{EffectTally, EffectVerdict};

/// The drill scenarios of docs/CONTRACT.md §6.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    CrashBeforeAck,
    CrashAfterSend,
    DoublePublish,
    ConcurrentDuplicate,
    OutOfOrder,
    KeyConflict,
    ClientRetry,
    SeenSetWindow,
    DeviceRetransmit,
    LiveRedelivery,
}

impl Scenario {
    /// Every scenario, as the dashboard lists them (the live one last).
    pub const ALL: [Scenario; 10] = [
        Scenario::CrashBeforeAck,
        Scenario::CrashAfterSend,
        Scenario::DoublePublish,
        Scenario::ConcurrentDuplicate,
        Scenario::OutOfOrder,
        Scenario::KeyConflict,
        Scenario::ClientRetry,
        Scenario::SeenSetWindow,
        Scenario::DeviceRetransmit,
        Scenario::LiveRedelivery,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Scenario::CrashBeforeAck => "crash-before-ack",
            Scenario::CrashAfterSend => "crash-after-send",
            Scenario::DoublePublish => "double-publish",
            Scenario::ConcurrentDuplicate => "concurrent-duplicate",
            Scenario::OutOfOrder => "out-of-order",
            Scenario::KeyConflict => "key-conflict",
            Scenario::ClientRetry => "client-retry",
            Scenario::SeenSetWindow => "seen-set-window",
            Scenario::DeviceRetransmit => "device-retransmit",
            Scenario::LiveRedelivery => "live-redelivery",
        }
    }

    /// One line for the operator: what the drill does.
    pub fn describe(self) -> &'static str {
        match self {
            Scenario::CrashBeforeAck => "one zone_exit delivered N times; the first N-1 consumers die after the side effect, before the ack",
            Scenario::CrashAfterSend => "the consumer dies between the SMS provider call and recording the result",
            Scenario::DoublePublish => "the producer publishes the same event twice with different message_ids",
            Scenario::ConcurrentDuplicate => "two workers get the same key at the same moment",
            Scenario::OutOfOrder => "ignition_off (seq n+1) is processed, then ignition_on (seq n) arrives late",
            Scenario::KeyConflict => "the same key arrives with a different payload",
            Scenario::ClientRetry => "a mobile client retries one \"save note\" N times over HTTP: a dropped response, concurrent and later retries",
            Scenario::SeenSetWindow => "the consumer dies after the SMS and the +1, before writing the key to its seen-set (Redis or a table)",
            Scenario::DeviceRetransmit => "a vehicle's QoS 1 publish of one zone_exit is sent N times (N-1 retransmissions with the DUP flag) through the MQTT broker and the ingress",
            Scenario::LiveRedelivery => "LIVE: re-publish K processed messages to the watched system; its duplicate_dropped must rise by K and nothing else move",
        }
    }

    /// The default `--times` of the scenario.
    pub fn default_times(self) -> u32 {
        match self {
            Scenario::CrashBeforeAck => 7,
            Scenario::CrashAfterSend | Scenario::DoublePublish | Scenario::ConcurrentDuplicate => 2,
            Scenario::OutOfOrder | Scenario::KeyConflict => 2,
            Scenario::ClientRetry => 6,
            Scenario::SeenSetWindow => 2,
            Scenario::DeviceRetransmit => 3,
            Scenario::LiveRedelivery => 5,
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Scenario {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Scenario::ALL
            .into_iter()
            .find(|x| x.as_str() == s)
            .ok_or_else(|| format!("unknown drill scenario {s:?}"))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DrillError {
    #[error("drill setup failed: {0}")]
    Setup(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("could not read the provider's record: {0}")]
    Provider(String),
    #[error("bad drill parameters: {0}")]
    Usage(String),
}

/// How to run one drill.
#[derive(Debug, Clone)]
pub struct DrillOptions {
    pub scenario: Scenario,
    pub times: Option<u32>,
    /// `Idempotent` or `Naive` (docs/CONTRACT.md §6.1); `SeenSet` also works and shows its window.
    pub mode: ConsumerMode,
    /// Run each consumer incarnation as a real child process that aborts.
    pub kill_process: bool,
    /// The idemwatch executable for child processes (the CLI passes its own).
    pub child_exe: Option<PathBuf>,
    pub db_url: String,
    pub queue_url: String,
    /// SMS provider base URL; `None` starts an embedded sandbox for the drill.
    pub sms_url: Option<String>,
    pub webhook_url: Option<String>,
    /// Progress lines for a live view (the TUI's Drills tab).
    pub progress: Option<mpsc::UnboundedSender<String>>,
    /// `live-redelivery` only: the watched system and the operator's permission.
    pub live: live_redelivery::LiveSettings,
    /// Where `seen-set` mode keeps its keys (the table, or Redis).
    pub seen_set: SeenSetConfig,
    /// `device-retransmit` only: the device broker (`mqtt://HOST:PORT`) the copies go
    /// through; `None`: straight into the queues.
    pub mqtt_broker: Option<String>,
}

impl DrillOptions {
    pub fn new(scenario: Scenario, db_url: &str, queue_url: &str) -> Self {
        DrillOptions {
            scenario,
            times: None,
            mode: ConsumerMode::Idempotent,
            kill_process: false,
            child_exe: None,
            db_url: db_url.to_string(),
            queue_url: queue_url.to_string(),
            sms_url: None,
            webhook_url: None,
            progress: None,
            live: live_redelivery::LiveSettings::default(),
            seen_set: SeenSetConfig::default(),
            mqtt_broker: None,
        }
    }
}

/// One checked expectation of a drill.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    pub name: String,
    pub expected: Value,
    pub actual: Value,
    pub ok: bool,
}

/// What a scenario measured; the common report is built from it.
#[derive(Debug, Default)]
pub(crate) struct Findings {
    pub deliveries: u64,
    pub sms_sent: u64,
    pub webhooks_sent: u64,
    pub duplicate_dropped: u64,
    pub counter_delta: i64,
    pub dead_lettered: u64,
    pub state_ok: bool,
    pub checks: Vec<Check>,
    pub notes: Vec<String>,
    pub extra: serde_json::Map<String, Value>,
    pub events: Vec<DeliveryEvent>,
    /// The effects the drill is about, for its verdict in Jepsen's terms.
    pub effects: Vec<EffectTally>,
}

impl Findings {
    pub fn check(&mut self, name: &str, expected: impl Into<Value>, actual: impl Into<Value>) {
        let (expected, actual) = (expected.into(), actual.into());
        let ok = expected == actual;
        self.checks.push(Check {
            name: name.to_string(),
            expected,
            actual,
            ok,
        });
    }

    /// A check that holds when `actual` is at least `min` (a count live traffic may add to).
    pub fn check_at_least(&mut self, name: &str, min: u64, actual: u64) {
        self.checks.push(Check {
            name: name.to_string(),
            expected: Value::from(format!(">= {min}")),
            actual: Value::from(actual),
            ok: actual >= min,
        });
    }

    pub fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    /// One effect the drill is about (see [`EffectTally`]): how many times it should
    /// have been applied, how many times it was, and whether a fault met the way to it.
    pub fn effect(&mut self, name: &str, expected: u64, applied: i64, interrupted: bool) {
        let applied = u64::try_from(applied).unwrap_or(0);
        self.effects
            .push(EffectTally::new(name, expected, applied, interrupted));
    }
}

/// Count delivery outcomes of one consumer.
pub(crate) fn count(events: &[DeliveryEvent], consumer: &str, outcome: DeliveryOutcome) -> u64 {
    events
        .iter()
        .filter(|e| e.consumer == consumer && e.outcome == outcome)
        .count() as u64
}

/// Deliveries one consumer saw (crashed ones included: they emit no event in a child
/// that aborted, so the drill counts those itself).
pub(crate) fn deliveries(events: &[DeliveryEvent], consumer: &str) -> u64 {
    events.iter().filter(|e| e.consumer == consumer).count() as u64
}

/// The report's `outcomes_by_consumer`: per consumer, how many deliveries ended how.
fn outcomes_by_consumer(events: &[DeliveryEvent]) -> BTreeMap<String, BTreeMap<String, u64>> {
    let mut per_consumer: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for e in events {
        *per_consumer
            .entry(e.consumer.clone())
            .or_default()
            .entry(e.outcome.as_str().to_string())
            .or_default() += 1;
    }
    per_consumer
}

/// The drill report (docs/CONTRACT.md §6, its `--json`).
#[derive(Debug, Clone, Serialize)]
pub struct DrillReport {
    pub run_id: i64,
    pub scenario: Scenario,
    pub mode: ConsumerMode,
    pub times: u32,
    pub kill_process: bool,
    pub deliveries: u64,
    pub sms_sent: u64,
    pub webhooks_sent: u64,
    pub duplicate_dropped: u64,
    pub counter_delta: i64,
    pub dead_lettered: u64,
    pub state_ok: bool,
    pub verdict: Verdict,
    /// `lost`, `duplicated`, `recovered`, `ok_fraction`, `provider_repeat_calls`
    /// (docs/CONTRACT.md §9), flat in the report.
    #[serde(flatten)]
    pub effects: EffectVerdict,
    pub duration_ms: u64,
    pub details: Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Fail,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
        }
    }
}

impl DrillReport {
    /// Exit code for the CLI (docs/CONTRACT.md §6): 1 only when an idempotent drill failed; a
    /// naive or seen-set drill failing is the expected demonstration of harm (or of
    /// the seen-set's window).
    pub fn exit_code(&self) -> i32 {
        if self.verdict == Verdict::Fail && self.mode == ConsumerMode::Idempotent {
            1
        } else {
            0
        }
    }

    /// Human-readable summary for the terminal.
    pub fn render_text(&self) -> String {
        let mut out = format!(
            "drill {} ({}{}) run #{}: {}\n",
            self.scenario,
            self.mode.as_str(),
            if self.kill_process {
                ", real process kills"
            } else {
                ""
            },
            self.run_id,
            self.verdict.as_str().to_uppercase()
        );
        out.push_str(&format!(
            "  deliveries {}  sms_sent {}  webhooks_sent {}  duplicate_dropped {}  counter_delta {}  dead_lettered {}  state_ok {}\n",
            self.deliveries, self.sms_sent, self.webhooks_sent, self.duplicate_dropped,
            self.counter_delta, self.dead_lettered, self.state_ok
        ));
        out.push_str(&format!("  {}\n", self.effects.render()));
        if let Some(checks) = self.details.get("checks").and_then(Value::as_array) {
            for c in checks {
                let ok = c.get("ok").and_then(Value::as_bool).unwrap_or(false);
                out.push_str(&format!(
                    "  [{}] {}: expected {}, got {}\n",
                    if ok { "ok" } else { "FAIL" },
                    c.get("name").and_then(Value::as_str).unwrap_or("?"),
                    c.get("expected").unwrap_or(&Value::Null),
                    c.get("actual").unwrap_or(&Value::Null),
                ));
            }
        }
        if let Some(notes) = self.details.get("notes").and_then(Value::as_array) {
            for n in notes {
                out.push_str(&format!("  - {}\n", n.as_str().unwrap_or("")));
            }
        }
        out
    }
}

/// Run one drill against the store and queue the options name.
pub async fn run(opts: DrillOptions) -> Result<DrillReport, DrillError> {
    let started = Instant::now();
    let times = match opts.scenario {
        Scenario::LiveRedelivery => opts.live.k,
        _ => opts.times.unwrap_or(opts.scenario.default_times()),
    };
    if times == 0 || times > 1000 {
        return Err(DrillError::Usage(format!(
            "--times {times} is outside 1..=1000"
        )));
    }
    if opts.scenario == Scenario::LiveRedelivery && !opts.live.confirmed {
        return Err(DrillError::Usage(
            "live-redelivery re-publishes processed messages into a running system: \
             pass --yes-live (the dashboard needs [drills] allow_live and a confirmation)"
                .into(),
        ));
    }
    let store = idemwatch_engine::store::open(&opts.db_url).await?;
    let queue = idemwatch_engine::queue::open(&opts.queue_url)
        .await
        .map_err(|e| DrillError::Setup(e.to_string()))?;
    let run_id = store
        .start_drill_run(opts.scenario.as_str(), opts.mode.as_str())
        .await?;
    let rig = Rig::new(&opts, store.clone(), queue, run_id).await?;
    rig.say(format!(
        "drill #{run_id} {} ({}): {}",
        opts.scenario,
        opts.mode.as_str(),
        opts.scenario.describe()
    ));
    let findings = match opts.scenario {
        Scenario::CrashBeforeAck => crash_before_ack::run(&rig, times).await,
        Scenario::CrashAfterSend => crash_after_send::run(&rig).await,
        Scenario::DoublePublish => double_publish::run(&rig, times).await,
        Scenario::ConcurrentDuplicate => concurrent_duplicate::run(&rig).await,
        Scenario::OutOfOrder => out_of_order::run(&rig).await,
        Scenario::KeyConflict => key_conflict::run(&rig).await,
        Scenario::ClientRetry => client_retry::run(&rig, times).await,
        Scenario::SeenSetWindow => seen_set_window::run(&rig).await,
        Scenario::DeviceRetransmit => device_retransmit::run(&rig, times).await,
        Scenario::LiveRedelivery => live_redelivery::run(&rig, &opts.live).await,
    };
    let mut findings = match findings {
        Ok(f) => f,
        Err(e) => {
            let report = json!({ "error": e.to_string() });
            let _ = store.finish_drill_run(run_id, "error", &report).await;
            return Err(e);
        }
    };
    findings.webhooks_sent = rig.webhooks_sent().await? as u64;
    let effects = EffectVerdict::of(&findings.effects, rig.provider_repeat_calls().await?);
    let verdict = if findings.checks.iter().all(|c| c.ok) {
        Verdict::Pass
    } else {
        Verdict::Fail
    };
    let per_consumer = outcomes_by_consumer(&findings.events);
    let mut details = findings.extra.clone();
    details.insert("description".into(), json!(opts.scenario.describe()));
    details.insert("device_id".into(), json!(rig.device));
    details.insert("checks".into(), json!(findings.checks));
    details.insert("notes".into(), json!(findings.notes));
    details.insert("outcomes_by_consumer".into(), json!(per_consumer));
    details.insert("effects".into(), json!(findings.effects));
    let report = DrillReport {
        run_id,
        scenario: opts.scenario,
        mode: opts.mode,
        times,
        kill_process: opts.kill_process,
        deliveries: findings.deliveries,
        sms_sent: findings.sms_sent,
        webhooks_sent: findings.webhooks_sent,
        duplicate_dropped: findings.duplicate_dropped,
        counter_delta: findings.counter_delta,
        dead_lettered: findings.dead_lettered,
        state_ok: findings.state_ok,
        verdict,
        effects,
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        details: Value::Object(details),
    };
    let report_json = serde_json::to_value(&report).unwrap_or(Value::Null);
    store
        .finish_drill_run(run_id, verdict.as_str(), &report_json)
        .await?;
    store
        .add_marker(
            MarkerKind::Drill,
            &format!(
                "drill {} ({}): {}",
                opts.scenario,
                opts.mode.as_str(),
                verdict.as_str()
            ),
            Some(&json!({"run_id": run_id}).to_string()),
        )
        .await?;
    rig.say(format!("verdict: {}", verdict.as_str()));
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One delivery event per way a delivery ends, as the runner fills them in.
    fn events() -> Vec<DeliveryEvent> {
        use idemwatch_engine::envelope::MessageKey;
        use idemwatch_engine::metrics::EffectResult;
        use DeliveryOutcome::*;
        let event = |consumer: &str, key: Option<&str>, outcome| DeliveryEvent {
            consumer: consumer.into(),
            key: key.map(|k| MessageKey::from_stored(k.into())),
            outcome,
            redelivered: false,
            delivery_count: 1,
            effect: None,
            took_over_in_doubt: false,
            reason: None,
            latency_us: 1250,
        };
        let sms = "zone-exit-sms";
        let exit = Some("34-ABC-123:48211:zone_exit");
        vec![
            DeliveryEvent {
                effect: Some(EffectResult::Sent),
                took_over_in_doubt: true,
                redelivered: true,
                delivery_count: 2,
                ..event(sms, exit, Processed)
            },
            DeliveryEvent {
                effect: Some(EffectResult::Suppressed),
                ..event(sms, exit, Processed)
            },
            DeliveryEvent {
                effect: Some(EffectResult::Failed),
                ..event(sms, exit, Processed)
            },
            event("trip-counter", exit, Processed),
            event("vehicle-state", Some("34-ABC-123:48210:position"), Late),
            event(sms, exit, Duplicate),
            event(sms, Some("34-ABC-123:48212:position"), Skipped),
            DeliveryEvent {
                reason: Some("malformed_json: expected value at line 1 column 1".into()),
                ..event(sms, None, DeadLettered)
            },
            DeliveryEvent {
                reason: Some("store unavailable".into()),
                delivery_count: 3,
                ..event(sms, exit, Retry)
            },
        ]
    }

    /// The JSON lines `consume --json` prints and a drill reads back from its child
    /// processes, captured before outcomes and effects became enums: a typed field
    /// must serialize to the very bytes the string did.
    const GOLDEN_EVENTS: &str = include_str!("golden/delivery_events.jsonl");

    /// `details.outcomes_by_consumer` of a drill report for [`events`].
    const GOLDEN_TALLY: &str = include_str!("golden/outcomes_by_consumer.json");

    #[test]
    fn delivery_events_and_outcome_tallies_keep_their_json_bytes() {
        let lines: Vec<String> = events()
            .iter()
            .map(|e| serde_json::to_string(e).unwrap())
            .collect();
        let tally = serde_json::to_string(&outcomes_by_consumer(&events())).unwrap();
        assert_eq!(lines, GOLDEN_EVENTS.lines().collect::<Vec<_>>());
        assert_eq!(tally, GOLDEN_TALLY.trim_end());
        // A supervising drill reads the same lines back into the same events.
        let back: Vec<DeliveryEvent> = GOLDEN_EVENTS
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(back, events());
    }
}
