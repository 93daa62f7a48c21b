//! The chaos run: several `idemwatch serve` processes competing on one queue (RabbitMQ
//! in the field) over one database and one SMS provider, SIGKILLed at random and
//! restarted while a fleet publishes events with duplicates and late arrivals.
//!
//! At the end the business tables and the provider must look as if every distinct
//! event had been handled exactly once: `trip_counters` = distinct zone exits, one SMS
//! per distinct zone exit, every vehicle's state = its newest event, every message
//! processed or dead-lettered. A process killed between its commit and its ack is the
//! field report's failure; here it happens hundreds of times, for real.
//!
//! Three rooms: [`setup`] (the ground truth and the arena: store, queue, sandbox
//! provider, the `serve` instances), [`run`] (publish while the killer works, then
//! stop and drain what is left) and [`verify`] (the end state against the truth, as
//! a [`ChaosReport`]); [`run()`] below calls them in that order.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::mpsc;

use super::{Check, DrillError, Verdict};

mod run;
mod setup;
mod verify;

/// An instance lives a few seconds here: a claim left by a killed process must be
/// taken over within that, not after production's 60 s.
pub const CHAOS_CLAIM_LEASE: Duration = Duration::from_secs(5);
/// Every kill returns every delivery the victim had prefetched, and RabbitMQ counts
/// each return in `x-delivery-count`: at one kill every 2 s a message can be bounced
/// ten times without ever being handled. The poison-message limit scales with it.
pub const CHAOS_MAX_DELIVERIES: u32 = 50;
/// The visibility timeout of the instances on a queue that redelivers only when it
/// runs out (JetStream's AckWait): a killed instance's deliveries come back after this,
/// not after the 30 s default. RabbitMQ requeues at the connection's death and keeps
/// the default.
pub const CHAOS_ACK_WAIT: Duration = Duration::from_secs(5);

/// When the killer strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillSchedule {
    /// One SIGKILL this often. How many kills a run gets then depends on how fast the
    /// machine gets through it.
    Every(Duration),
    /// One SIGKILL each time this many more deliveries were taken off the queues: the
    /// same number of kills on a fast machine as on a slow one, each of them while
    /// messages are still in flight.
    EveryMessages(u64),
}

impl std::fmt::Display for KillSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KillSchedule::Every(d) => write!(f, "every {}", humantime::format_duration(*d)),
            KillSchedule::EveryMessages(n) => write!(f, "every {n} deliveries"),
        }
    }
}

/// How often the killer looks at the queues when it kills by progress.
const PROGRESS_POLL: Duration = Duration::from_millis(100);

/// How to run one chaos run.
#[derive(Debug, Clone)]
pub struct ChaosOptions {
    pub instances: usize,
    pub events: usize,
    /// Share of published messages that are copies of earlier ones.
    pub dup_rate: f64,
    /// Share of fresh events held back to arrive after newer ones.
    pub late_rate: f64,
    /// When one random instance is SIGKILLed (and restarted).
    pub kill_every: KillSchedule,
    pub db_url: String,
    pub queue_url: String,
    /// The idemwatch executable to run as `serve`.
    pub exe: PathBuf,
    pub seed: u64,
    /// Messages per publish call (one batch of confirms).
    pub publish_batch: usize,
    /// Give up waiting for the queues to drain after this long.
    pub drain_timeout: Duration,
    /// Progress lines.
    pub progress: Option<mpsc::UnboundedSender<String>>,
}

impl ChaosOptions {
    pub fn new(db_url: &str, queue_url: &str, exe: PathBuf) -> Self {
        ChaosOptions {
            instances: 4,
            events: 20_000,
            dup_rate: 0.1,
            late_rate: 0.01,
            kill_every: KillSchedule::Every(Duration::from_secs(2)),
            db_url: db_url.to_string(),
            queue_url: queue_url.to_string(),
            exe,
            seed: rand::random(),
            publish_batch: 250,
            drain_timeout: Duration::from_secs(600),
            progress: None,
        }
    }
}

/// Expected against found, per consumer.
#[derive(Debug, Clone, Serialize)]
pub struct ConsumerTally {
    /// Distinct keys this consumer had to handle.
    pub expected: usize,
    /// Of those, recorded as processed (dedup row or history row).
    pub processed: usize,
    /// Of those, dead-lettered instead.
    pub dead_lettered: usize,
    /// Neither: lost.
    pub missing: usize,
}

/// What a chaos run did and found (`idemwatch chaos --json`).
#[derive(Debug, Clone, Serialize)]
pub struct ChaosReport {
    pub run_id: i64,
    pub verdict: Verdict,
    pub seed: u64,
    pub instances: usize,
    pub claim_lease_ms: u64,
    pub max_deliveries: u32,
    pub db: String,
    pub queue: String,
    pub messages_published: usize,
    pub distinct_events: usize,
    pub duplicates_published: usize,
    pub late_events: usize,
    pub vehicles: usize,
    /// `every 2s` or `every N deliveries`.
    pub kill_schedule: String,
    pub kills: u64,
    pub restarts: u64,
    pub publish_seconds: f64,
    pub duration_seconds: f64,
    pub distinct_zone_exits: usize,
    pub trip_counter_total: i64,
    pub sms_sent: usize,
    pub sms_max_per_exit: usize,
    pub distinct_ignition_offs: usize,
    pub webhooks_sent: usize,
    pub vehicles_state_ok: usize,
    pub consumers: BTreeMap<String, ConsumerTally>,
    pub dead_lettered: usize,
    /// Left over when the killing stopped and handled by a last in-process consumer.
    pub drained_after_stop: u64,
    /// Ready messages left on the queues at the very end.
    pub left_on_queues: u64,
    /// The broker's own redelivery counter over the run, where its metrics are reachable.
    pub broker_redelivered: Option<f64>,
    /// `lost`, `duplicated`, `recovered`, `ok_fraction`, `provider_repeat_calls`
    /// (docs/CONTRACT.md §9), flat in the report.
    #[serde(flatten)]
    pub effects: super::EffectVerdict,
    pub checks: Vec<Check>,
}

impl ChaosReport {
    pub fn render_text(&self) -> String {
        let mut out = format!(
            "chaos run #{} ({} instances of `idemwatch serve`, {} / {}): {}\n",
            self.run_id,
            self.instances,
            self.queue,
            self.db,
            self.verdict.as_str().to_uppercase()
        );
        out.push_str(&format!(
            "  published {} messages ({} distinct events, {} duplicates, {} late) for {} vehicles in {:.1}s\n",
            self.messages_published, self.distinct_events, self.duplicates_published,
            self.late_events, self.vehicles, self.publish_seconds
        ));
        out.push_str(&format!(
            "  {} SIGKILLs ({}), {} restarts, {:.1}s in all (claim lease {} ms, max deliveries {}); {} deliveries drained after the last kill; broker redeliveries: {}\n",
            self.kills,
            self.kill_schedule,
            self.restarts,
            self.duration_seconds,
            self.claim_lease_ms,
            self.max_deliveries,
            self.drained_after_stop,
            self.broker_redelivered
                .map(|v| format!("{v:.0}"))
                .unwrap_or_else(|| "n/a".into())
        ));
        out.push_str(&format!(
            "  zone exits: {} distinct, trip_counters {}, SMS sent {} (at most {} per exit); ignition_off: {} distinct, webhooks {}\n",
            self.distinct_zone_exits, self.trip_counter_total, self.sms_sent,
            self.sms_max_per_exit, self.distinct_ignition_offs, self.webhooks_sent
        ));
        out.push_str(&format!(
            "  vehicles whose state is their newest event: {}/{}; dead-lettered {}; left on queues {}\n",
            self.vehicles_state_ok, self.vehicles, self.dead_lettered, self.left_on_queues
        ));
        out.push_str(&format!("  effects: {}\n", self.effects.render()));
        out.push_str("  consumer         expected  processed  dead-lettered  missing\n");
        for (name, t) in &self.consumers {
            out.push_str(&format!(
                "  {name:<16} {:>8} {:>10} {:>14} {:>8}\n",
                t.expected, t.processed, t.dead_lettered, t.missing
            ));
        }
        for c in &self.checks {
            out.push_str(&format!(
                "  [{}] {}: expected {}, got {}\n",
                if c.ok { "ok" } else { "FAIL" },
                c.name,
                c.expected,
                c.actual
            ));
        }
        out
    }

    pub fn exit_code(&self) -> i32 {
        if self.verdict == Verdict::Pass {
            0
        } else {
            1
        }
    }
}

fn say(opts: &ChaosOptions, line: impl Into<String>) {
    let line = line.into();
    tracing::info!("chaos: {line}");
    if let Some(p) = &opts.progress {
        let _ = p.send(line);
    }
}

fn setup_failed(e: impl std::fmt::Display) -> DrillError {
    DrillError::Setup(e.to_string())
}

/// Run the chaos scenario and verify the end state.
pub async fn run(opts: ChaosOptions) -> Result<ChaosReport, DrillError> {
    if opts.instances == 0 || opts.events == 0 {
        return Err(DrillError::Usage(
            "--instances and --events must be at least 1".into(),
        ));
    }
    if !(0.0..1.0).contains(&opts.dup_rate) || !(0.0..1.0).contains(&opts.late_rate) {
        return Err(DrillError::Usage(
            "--dup-rate and --late-rate must be in [0, 1)".into(),
        ));
    }
    let started = Instant::now();
    let arena = setup::Arena::prepare(&opts).await?;
    let mut instances = arena.start_instances(&opts)?;
    let storm = run::kill_while_publishing(&opts, &arena, &mut instances).await?;
    let drained = run::stop_and_drain(&opts, &arena, &mut instances, storm.kills).await?;
    let broker_redelivered = arena.broker_redelivered().await;
    let report = verify::verify(
        &opts,
        &arena,
        verify::VerifyExtras {
            kills: storm.kills,
            publish_seconds: storm.publish_seconds,
            drained_after_stop: drained.after_stop,
            left_on_queues: drained.left_on_queues,
            broker_redelivered,
            duration: started.elapsed(),
        },
    )
    .await?;
    arena.finish(&report, storm.kills).await?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::setup::{broker_metrics_url, generate};
    use super::*;
    use crate::sim::fleet::SimKind;

    #[test]
    fn broker_metrics_follow_the_queue_host() {
        if std::env::var("IDEMWATCH_BROKER_METRICS_URL").is_ok() {
            return;
        }
        assert_eq!(
            broker_metrics_url("amqp://guest:guest@10.0.0.7:5672/%2f").as_deref(),
            Some("http://10.0.0.7:15692/metrics")
        );
        assert_eq!(broker_metrics_url("sqlite:///tmp/q.db"), None);
    }

    #[test]
    fn generated_truth_counts_duplicates_once() {
        let mut o = ChaosOptions::new("sqlite://x", "sqlite://y", PathBuf::from("idemwatch"));
        o.events = 2_000;
        o.seed = 7;
        let t = generate(&o, "CHAOS-T-");
        let dups = t
            .messages
            .iter()
            .filter(|m| m.kind == SimKind::Redelivery)
            .count();
        assert!(dups > 100, "about 10 % duplicates, got {dups}");
        let distinct: usize = t.history_per_device.values().sum();
        assert_eq!(distinct + dups, t.messages.len());
    }
}
