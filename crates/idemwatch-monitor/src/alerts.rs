//! What deserves the operator's attention, derived from one snapshot's data, and
//! since when. Pure rules ([`evaluate`]) serve the TUI's alert list and
//! `snapshot --json`; [`AlertLog`] remembers across polls when each alert started
//! and when it ended, so an alert says how long it has been going on and a report
//! can list those of a past window.
//!
//! Two things are never incidents: what a drill caused (a drill device's ghost
//! state, its claims, a live drill's duplicates) is labelled [`Cause::Drill`], and a
//! deploy's duplicate spike is judged over five minutes against the deploy-day
//! baseline rather than the one-minute threshold, the redeliveries of what its
//! restart left in flight counted as expected (see [`deploy_spike_beyond_baseline`]).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::db::{DbStats, SourceStatus};
use super::deploys::{DeployBudget, Verdict};
use super::markers::TimelineMarker;
use super::targets::{ConsumerStatus, Flow, TargetStatus, WindowCounts};
use super::vehicles::VehicleAnomaly;
use crate::config::AlertRules;
use crate::windows::ConsumerWindows;
use idemwatch_engine::store::Durability;

// The ratios live in a leaf (`ratios.rs`) so that the config and the deploy budget
// read them without an import circle through the alerts; named here too, where
// the dashboard's users have always found them.
pub use crate::ratios::{
    DEPLOY_DAY_RATIO, DEPLOY_WINDOW, DUPLICATE_RATIO_ALERT, NORMAL_DAY_RATIO, OVER_BUDGET_HELD,
};
/// How long after a drill ended its effects are still put down to it.
const DRILL_GRACE: Duration = Duration::from_secs(60);
/// Drill runs use device ids with this prefix (see `drills::rig`): their states,
/// claims and dead letters are the drill's, never the fleet's.
pub const DRILL_DEVICE_PREFIX: &str = "DRILL-";
/// Resolved alerts kept for the session's report.
const ENDED_KEPT: usize = 500;

/// Critical first: a down source or a send in doubt needs action now, a high
/// duplicate rate needs a look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Warning,
    Critical,
}

impl Severity {
    pub fn tag(self) -> &'static str {
        match self {
            Severity::Critical => "CRIT",
            Severity::Warning => "WARN",
        }
    }
}

/// An incident, or the expected effect of a drill (shown, labelled, never counted
/// as an incident).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "cause", rename_all = "snake_case")]
pub enum Cause {
    Incident,
    Drill { what: String },
}

/// What an alert is about: where the dashboard jumps on Enter.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AlertObject {
    Target {
        target: String,
    },
    Consumer {
        target: String,
        consumer: String,
    },
    Database,
    Claim {
        consumer: String,
        message_key: String,
    },
    DeadLetters {
        consumer: String,
        reason: String,
    },
    Device {
        device_id: String,
    },
    /// One consumer in one deploy's window.
    Deploy {
        target: String,
        consumer: String,
        at: DateTime<Utc>,
    },
}

impl AlertObject {
    /// How it reads on screen.
    pub fn label(&self) -> String {
        match self {
            AlertObject::Target { target } => format!("target {target}"),
            AlertObject::Consumer { target, consumer } => format!("{target}/{consumer}"),
            AlertObject::Database => "database".into(),
            AlertObject::Claim {
                consumer,
                message_key,
            } => format!("{consumer} {message_key}"),
            AlertObject::DeadLetters { consumer, reason } => format!("{consumer} {reason}"),
            AlertObject::Device { device_id } => format!("vehicle {device_id}"),
            AlertObject::Deploy {
                target,
                consumer,
                at,
            } => format!(
                "{target}/{consumer} deploy at {}",
                idemwatch_base::clock::clock(*at)
            ),
        }
    }
}

/// One alert, machine-readable (`kind` and its fields) and human-readable
/// (`message`), with its object, its cause and since when it holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alert {
    pub severity: Severity,
    #[serde(flatten)]
    pub kind: AlertKind,
    pub message: String,
    pub object: AlertObject,
    #[serde(flatten)]
    pub cause: Cause,
    /// The first poll it held in (or, for a down target, when it went down); set by
    /// [`AlertLog::track`].
    pub since: Option<DateTime<Utc>>,
}

impl Alert {
    fn new(severity: Severity, kind: AlertKind, object: AlertObject, message: String) -> Alert {
        Alert {
            severity,
            kind,
            message,
            object,
            cause: Cause::Incident,
            since: None,
        }
    }

    fn caused_by(mut self, cause: Option<Cause>) -> Alert {
        if let Some(c) = cause {
            self.cause = c;
        }
        self
    }

    /// Stable across polls: the same rule about the same object.
    pub fn key(&self) -> String {
        format!("{}:{:?}", self.kind.name(), self.object)
    }

    /// A real incident (not a drill's expected effect).
    pub fn is_incident(&self) -> bool {
        self.cause == Cause::Incident
    }
}

/// What the alert is about, with the numbers a script needs (`kind` in JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AlertKind {
    TargetDown {
        target: String,
        error: String,
        down_seconds: i64,
    },
    DatabaseDown {
        error: String,
    },
    /// Sends that may or may not have happened: someone must look before a retry.
    ClaimsInDoubt {
        count: i64,
    },
    /// The oldest dedup row is more than a day past the retention.
    PurgeStalled {
        oldest_age_seconds: i64,
        retention_seconds: i64,
    },
    /// The engine commits with relaxed durability: a power cut can undo commits
    /// whose messages were already acked.
    RelaxedDurability {
        target: String,
    },
    /// Over a minute above [`DUPLICATE_RATIO_ALERT`]; inside a deploy window, over
    /// five minutes above [`DEPLOY_DAY_RATIO`].
    DuplicateRateHigh {
        target: String,
        consumer: String,
        ratio: f64,
        window_seconds: u64,
        deploy_window: bool,
    },
    /// Traffic for an hour and not one duplicate dropped: the dedup path is never
    /// exercised ("the parachute is tested every day with small jumps").
    ParachuteUntested {
        target: String,
        consumer: String,
        quiet_seconds: i64,
    },
    /// The consumer stopped leasing because its store or provider is unhealthy: its
    /// messages wait (none is lost, none uses up a delivery), and it resumes by itself.
    ConsumerPaused {
        target: String,
        consumer: String,
        /// `store`, `queue`, `provider` or `seen_set`.
        cause: String,
        last_error_kind: Option<String>,
    },
    /// One batch in hand for [`super::targets::WAITING_AFTER`] seconds or more: a peer (store,
    /// queue, provider, seen-set) has not answered yet and no deadline has fired.
    ConsumerWaiting {
        target: String,
        consumer: String,
        waiting_seconds: i64,
    },
    /// Nothing processed for a minute although the rate before promised messages.
    ConsumerStalled {
        target: String,
        consumer: String,
        expected_per_minute: f64,
    },
    /// Dead letters of one reason in five minutes: any `key_conflict` (same key,
    /// different payload: an identity bug upstream), or a burst of the others.
    DeadLetterBurst {
        consumer: String,
        reason: String,
        count: f64,
        window_seconds: u64,
    },
    /// A state row behind its own applied history: state went backwards.
    StateBehind {
        devices: usize,
    },
    DuplicateHistoryRows {
        devices: usize,
    },
    /// A dedup window shorter than twice the oldest duplicate the consumer has
    /// dropped (`windows.rs`): copies have arrived half that late already; one a
    /// little later gets through that layer and is applied twice.
    DedupWindowShort {
        target: String,
        consumer: String,
        /// The short windows, shortest first ("seen-set TTL").
        windows: Vec<String>,
        shortest_seconds: f64,
        oldest_duplicate_seconds: f64,
    },
    /// The newest closed deploy window cost this consumer more duplicates than its
    /// budget (`[alerts] deploy_duplicate_budget`, [`super::deploys`]).
    DeployOverBudget {
        target: String,
        consumer: String,
        deploy: String,
        deploy_at: DateTime<Utc>,
        duplicates: f64,
        ratio: f64,
        budget: f64,
        window_seconds: i64,
    },
}

impl AlertKind {
    /// The `kind` tag.
    pub fn name(&self) -> &'static str {
        match self {
            AlertKind::TargetDown { .. } => "target_down",
            AlertKind::DatabaseDown { .. } => "database_down",
            AlertKind::ClaimsInDoubt { .. } => "claims_in_doubt",
            AlertKind::PurgeStalled { .. } => "purge_stalled",
            AlertKind::RelaxedDurability { .. } => "relaxed_durability",
            AlertKind::DuplicateRateHigh { .. } => "duplicate_rate_high",
            AlertKind::ParachuteUntested { .. } => "parachute_untested",
            AlertKind::ConsumerPaused { .. } => "consumer_paused",
            AlertKind::ConsumerWaiting { .. } => "consumer_waiting",
            AlertKind::ConsumerStalled { .. } => "consumer_stalled",
            AlertKind::DeadLetterBurst { .. } => "dead_letter_burst",
            AlertKind::StateBehind { .. } => "state_behind",
            AlertKind::DuplicateHistoryRows { .. } => "duplicate_history_rows",
            AlertKind::DedupWindowShort { .. } => "dedup_window_short",
            AlertKind::DeployOverBudget { .. } => "deploy_over_budget",
        }
    }

    /// Sort rank within a severity: a key conflict before any other dead letter.
    fn rank(&self) -> u8 {
        match self {
            AlertKind::DeadLetterBurst { reason, .. } if reason == "key_conflict" => 0,
            AlertKind::DeadLetterBurst { .. } => 2,
            _ => 1,
        }
    }
}

/// What the rules read.
#[derive(Debug, Clone, Copy)]
pub struct AlertInputs<'a> {
    pub now: DateTime<Utc>,
    pub targets: &'a [TargetStatus],
    pub consumers: &'a [ConsumerStatus],
    pub database: Option<&'a DbStats>,
    /// Deploys and restarts open a deploy window; drills a drill window.
    pub markers: &'a [TimelineMarker],
    /// Each deploy's duplicates against its budget ([`super::deploys`]).
    pub deploys: &'a [DeployBudget],
    pub rules: &'a AlertRules,
    /// Each consumer's duplicate ages against its dedup windows.
    pub windows: &'a [ConsumerWindows],
}

/// Evaluate every rule without a timeline, at the newest scrape's time, with the
/// default thresholds.
pub fn evaluate(
    targets: &[TargetStatus],
    consumers: &[ConsumerStatus],
    database: Option<&DbStats>,
) -> Vec<Alert> {
    let now = targets
        .iter()
        .filter_map(|t| t.scraped_at)
        .chain(database.map(|d| d.polled_at))
        .max()
        .unwrap_or_else(Utc::now);
    evaluate_at(&AlertInputs {
        now,
        targets,
        consumers,
        database,
        markers: &[],
        deploys: &[],
        rules: &AlertRules::default(),
        windows: &[],
    })
}

/// Evaluate every rule: incidents first by severity, then drills' effects; within a
/// severity a key conflict first.
pub fn evaluate_at(input: &AlertInputs<'_>) -> Vec<Alert> {
    let mut out = Vec::new();
    target_alerts(input, &mut out);
    consumer_alerts(input, &mut out);
    window_alerts(input.windows, &mut out);
    deploy_alerts(input, &mut out);
    if let Some(db) = input.database {
        database_alerts(db, input, &mut out);
    }
    out.sort_by_key(|a| {
        (
            !a.is_incident(),
            std::cmp::Reverse(a.severity),
            a.kind.rank(),
        )
    });
    out
}

/// `dedup_window_short` (WARN) for each consumer with a window shorter than
/// [`SAFE_MARGIN`](crate::windows::SAFE_MARGIN) times its oldest duplicate.
fn window_alerts(windows: &[ConsumerWindows], out: &mut Vec<Alert>) {
    for c in windows {
        let mut short: Vec<_> = c.short().collect();
        short.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
        let (Some(shortest), Some(oldest)) = (short.first(), c.max_seconds) else {
            continue;
        };
        let names: Vec<String> = short.iter().map(|w| w.name.clone()).collect();
        let message = format!(
            "{}: {} {} is shorter than twice the oldest duplicate ({}): a copy a little later gets through it",
            c.consumer,
            shortest.name,
            crate::windows::short_duration(shortest.seconds),
            crate::windows::short_duration(oldest),
        );
        out.push(Alert::new(
            Severity::Warning,
            AlertKind::DedupWindowShort {
                target: c.target.clone(),
                consumer: c.consumer.clone(),
                windows: names,
                shortest_seconds: shortest.seconds,
                oldest_duplicate_seconds: oldest,
            },
            AlertObject::Consumer {
                target: c.target.clone(),
                consumer: c.consumer.clone(),
            },
            message,
        ));
    }
}

fn target_alerts(input: &AlertInputs<'_>, out: &mut Vec<Alert>) {
    for t in input.targets {
        if let (SourceStatus::Down { error }, Some(since)) = (&t.status, t.down_since) {
            let down = input.now - since;
            if down.to_std().unwrap_or_default() >= input.rules.target_down_after {
                let mut alert = Alert::new(
                    Severity::Critical,
                    AlertKind::TargetDown {
                        target: t.name.clone(),
                        error: error.clone(),
                        down_seconds: down.num_seconds(),
                    },
                    AlertObject::Target {
                        target: t.name.clone(),
                    },
                    format!("target {} is down: {error}", t.name),
                );
                alert.since = Some(since);
                out.push(alert);
            }
        }
        if t.durability == Some(Durability::Relaxed) {
            out.push(Alert::new(
                Severity::Warning,
                AlertKind::RelaxedDurability {
                    target: t.name.clone(),
                },
                AlertObject::Target {
                    target: t.name.clone(),
                },
                format!(
                    "{} runs with relaxed durability: a power cut can undo its last commits",
                    t.name
                ),
            ));
        }
    }
}

/// The newest marker of one of `kinds` within `window` before `now`.
fn recent<'m>(
    markers: &'m [TimelineMarker],
    kinds: &[&str],
    now: DateTime<Utc>,
    window: Duration,
) -> Option<&'m TimelineMarker> {
    let window = chrono::Duration::from_std(window).unwrap_or_default();
    markers
        .iter()
        .filter(|m| kinds.contains(&m.kind.as_str()) && m.at <= now && now - m.at <= window)
        .max_by_key(|m| m.at)
}

/// A drill running now or ended within [`DRILL_GRACE`], from the drill runs (or
/// the drill markers when the database has no runs).
fn drill_running(input: &AlertInputs<'_>) -> Option<Cause> {
    let grace = chrono::Duration::from_std(DRILL_GRACE).unwrap_or_default();
    let from_runs = input.database.and_then(|db| {
        db.drill_runs.iter().find(|r| {
            r.started_at.is_some_and(|s| s <= input.now)
                && r.finished_at.is_none_or(|f| input.now - f <= grace)
        })
    });
    if let Some(run) = from_runs {
        return Some(Cause::Drill {
            what: format!("drill {} ({}) #{}", run.scenario, run.mode, run.id),
        });
    }
    recent(input.markers, &["drill"], input.now, DRILL_GRACE).map(|m| Cause::Drill {
        what: m.label.clone(),
    })
}

/// Inside a deploy window: the duplicates a deploy does not explain, when they are
/// above the deploy-day rate; None when the spike is the deploy's expected one.
///
/// A restart hands the deliveries in flight back to the queue; they come back
/// redelivered and the ones already committed are dropped as duplicates. That is
/// the at-least-once contract working, however small the consumer's traffic (one
/// redelivered duplicate among 30 messages is 3 %, and nothing is wrong). What the
/// redeliveries do not explain (a producer resending, a seen-set that forgot) is
/// judged against the deploy-day rate over the window.
pub fn deploy_spike_beyond_baseline(w: &WindowCounts) -> Option<f64> {
    let traffic = w.processed + w.duplicate_dropped;
    let beyond = (w.duplicate_dropped - w.redelivered).max(0.0);
    (traffic > 0.0 && beyond / traffic > DEPLOY_DAY_RATIO).then_some(beyond)
}

fn consumer_alerts(input: &AlertInputs<'_>, out: &mut Vec<Alert>) {
    let deploy = recent(
        input.markers,
        &["deploy", "restart"],
        input.now,
        DEPLOY_WINDOW,
    );
    let drill = drill_running(input);
    for c in input.consumers {
        let object = AlertObject::Consumer {
            target: c.target.clone(),
            consumer: c.consumer.clone(),
        };
        let high = match deploy {
            Some(_) => deploy_spike_beyond_baseline(&c.window_5m).map(|beyond| {
                let ratio = c.window_5m.duplicate_ratio.unwrap_or(0.0);
                (ratio, c.window_5m.seconds, Some(beyond))
            }),
            None => c
                .duplicate_ratio_1m
                .filter(|r| *r > DUPLICATE_RATIO_ALERT)
                .map(|r| (r, c.window_1m.seconds, None)),
        };
        if let Some((ratio, seconds, beyond)) = high {
            let during = deploy
                .map(|m| {
                    format!(
                        ", {:.0} beyond the {:.0} redeliveries a restart explains (deploy window of \"{}\")",
                        beyond.unwrap_or(0.0),
                        c.window_5m.redelivered,
                        m.label
                    )
                })
                .unwrap_or_default();
            out.push(
                Alert::new(
                    Severity::Warning,
                    AlertKind::DuplicateRateHigh {
                        target: c.target.clone(),
                        consumer: c.consumer.clone(),
                        ratio,
                        window_seconds: seconds.round() as u64,
                        deploy_window: deploy.is_some(),
                    },
                    object.clone(),
                    format!(
                        "{}/{}: {:.2}% duplicates over the last {}{during}",
                        c.target,
                        c.consumer,
                        ratio * 100.0,
                        if deploy.is_some() { "5 min" } else { "minute" },
                    ),
                )
                .caused_by(drill.clone()),
            );
        }
        if let Some(quiet) = c.duplicates_quiet_seconds {
            out.push(Alert::new(
                Severity::Warning,
                AlertKind::ParachuteUntested {
                    target: c.target.clone(),
                    consumer: c.consumer.clone(),
                    quiet_seconds: quiet,
                },
                object.clone(),
                format!(
                    "{}/{}: no duplicate dropped for {} min while messages flow: the dedup path is never exercised",
                    c.target,
                    c.consumer,
                    quiet / 60
                ),
            ));
        }
        if let Some(p) = &c.paused {
            let mut alert = Alert::new(
                Severity::Critical,
                AlertKind::ConsumerPaused {
                    target: c.target.clone(),
                    consumer: c.consumer.clone(),
                    cause: p.cause.clone(),
                    last_error_kind: p.last_error_kind.clone(),
                },
                object.clone(),
                format!(
                    "{}/{}: paused, {}; messages wait in the queue and it resumes by itself",
                    c.target,
                    c.consumer,
                    p.summarize()
                ),
            );
            alert.since = p.since;
            out.push(alert);
        }
        if let (Some(held), None) = (c.waiting_seconds, &c.paused) {
            let mut alert = Alert::new(
                Severity::Warning,
                AlertKind::ConsumerWaiting {
                    target: c.target.clone(),
                    consumer: c.consumer.clone(),
                    waiting_seconds: held,
                },
                object.clone(),
                format!(
                    "{}/{}: one batch in hand for {held}s: its store, queue or provider has not answered yet; the deadline ends the wait and the consumer retries on a fresh connection",
                    c.target, c.consumer
                ),
            );
            alert.since = Some(input.now - chrono::Duration::seconds(held));
            out.push(alert);
        }
        // A paused or waiting consumer processes nothing: that says why, not a stall.
        if let (
            Flow::Stalled {
                expected_per_minute,
                ..
            },
            None,
            None,
        ) = (&c.flow, &c.paused, &c.waiting_seconds)
        {
            let expected_per_minute = *expected_per_minute;
            out.push(Alert::new(
                Severity::Warning,
                AlertKind::ConsumerStalled {
                    target: c.target.clone(),
                    consumer: c.consumer.clone(),
                    expected_per_minute,
                },
                object.clone(),
                format!(
                    "{}/{}: nothing processed for a minute (before: {:.0}/min)",
                    c.target, c.consumer, expected_per_minute
                ),
            ));
        }
        for (reason, count) in &c.window_5m.dead_lettered_by_reason {
            let conflict = reason == "key_conflict";
            if !conflict && *count < f64::from(input.rules.dead_letter_burst) {
                continue;
            }
            out.push(Alert::new(
                if conflict {
                    Severity::Critical
                } else {
                    Severity::Warning
                },
                AlertKind::DeadLetterBurst {
                    consumer: c.consumer.clone(),
                    reason: reason.clone(),
                    count: *count,
                    window_seconds: c.window_5m.seconds.round() as u64,
                },
                AlertObject::DeadLetters {
                    consumer: c.consumer.clone(),
                    reason: reason.clone(),
                },
                if conflict {
                    format!(
                        "{}: {count} key_conflict dead letter(s) in 5 min: same key, different payload",
                        c.consumer
                    )
                } else {
                    format!("{}: {count} {reason} dead letters in 5 min", c.consumer)
                },
            ));
        }
    }
}

/// The newest deploy whose window closed, for each consumer it cost more than its
/// budget. Only a closed window is judged: its first minute is all spike, so a
/// ratio read while it lasts looks over budget for every deploy (the Deploys panel
/// shows it so far, marked open). The alert holds from the window's end.
fn deploy_alerts(input: &AlertInputs<'_>, out: &mut Vec<Alert>) {
    let held = chrono::Duration::from_std(OVER_BUDGET_HELD).unwrap_or_default();
    let Some(d) = input
        .deploys
        .iter()
        .filter(|d| d.closed())
        .max_by_key(|d| d.until)
        .filter(|d| input.now - d.until <= held)
    else {
        return;
    };
    for c in d.consumers.iter().filter(|c| c.verdict == Verdict::Over) {
        let ratio = c.ratio.unwrap_or(0.0);
        let mut alert = Alert::new(
            Severity::Warning,
            AlertKind::DeployOverBudget {
                target: c.target.clone(),
                consumer: c.consumer.clone(),
                deploy: d.label.clone(),
                deploy_at: d.at,
                duplicates: c.duplicates,
                ratio,
                budget: c.budget,
                window_seconds: d.window_seconds,
            },
            AlertObject::Deploy {
                target: c.target.clone(),
                consumer: c.consumer.clone(),
                at: d.at,
            },
            format!(
                "{}/{}: \"{}\" cost {:.0} duplicate{}, {:.2}% of its {} window (budget {:.2}%)",
                c.target,
                c.consumer,
                d.label,
                c.duplicates,
                if c.duplicates == 1.0 { "" } else { "s" },
                ratio * 100.0,
                humantime::format_duration(Duration::from_secs(
                    u64::try_from(d.window_seconds).unwrap_or_default()
                )),
                c.budget * 100.0
            ),
        );
        alert.since = Some(d.until);
        out.push(alert);
    }
}

fn database_alerts(db: &DbStats, input: &AlertInputs<'_>, out: &mut Vec<Alert>) {
    if let SourceStatus::Down { error } = &db.status {
        out.push(Alert::new(
            Severity::Critical,
            AlertKind::DatabaseDown {
                error: error.clone(),
            },
            AlertObject::Database,
            format!("database {} is down: {error}", db.url),
        ));
        return;
    }
    claims_alerts(db, out);
    if let Some(d) = db.dedup.as_ref().filter(|d| d.purge_stalled) {
        let age = d.oldest_age_seconds.unwrap_or_default();
        out.push(Alert::new(
            Severity::Warning,
            AlertKind::PurgeStalled {
                oldest_age_seconds: age,
                retention_seconds: d.retention_seconds,
            },
            AlertObject::Database,
            format!(
                "oldest dedup row is {} days old (retention {} days): the purge stopped",
                age / 86400,
                d.retention_seconds / 86400
            ),
        ));
    }
    // Without metrics for a consumer the database's dead letters are the only view.
    for g in &db.dead_letters {
        let watched = input.consumers.iter().any(|c| c.consumer == g.consumer);
        let conflict = g.reason == "key_conflict";
        let recent = g.last_hour as f64;
        if watched
            || recent <= 0.0
            || (!conflict && recent < f64::from(input.rules.dead_letter_burst))
        {
            continue;
        }
        out.push(Alert::new(
            if conflict {
                Severity::Critical
            } else {
                Severity::Warning
            },
            AlertKind::DeadLetterBurst {
                consumer: g.consumer.clone(),
                reason: g.reason.clone(),
                count: recent,
                window_seconds: 3600,
            },
            AlertObject::DeadLetters {
                consumer: g.consumer.clone(),
                reason: g.reason.clone(),
            },
            format!(
                "{}: {} {} dead letter(s) in the last hour",
                g.consumer, g.last_hour, g.reason
            ),
        ));
    }
    if let Some(v) = &db.vehicles {
        vehicle_alerts(&v.anomalies, out);
    }
}

/// Claims in doubt, the fleet's apart from the drills'.
fn claims_alerts(db: &DbStats, out: &mut Vec<Alert>) {
    if db.claims_in_doubt_total <= 0 {
        return;
    }
    let is_drill = |key: &str| key.starts_with(DRILL_DEVICE_PREFIX);
    let drill_claims = db
        .claims_in_doubt
        .iter()
        .filter(|c| is_drill(&c.message_key))
        .count() as i64;
    let fleet = db.claims_in_doubt_total - drill_claims;
    for (count, drill) in [(fleet, false), (drill_claims, true)] {
        if count <= 0 {
            continue;
        }
        // The oldest listed claim of its kind; the database when none is listed.
        let object = db
            .claims_in_doubt
            .iter()
            .find(|c| is_drill(&c.message_key) == drill)
            .map_or(AlertObject::Database, |c| AlertObject::Claim {
                consumer: c.consumer.clone(),
                message_key: c.message_key.clone(),
            });
        let alert = Alert::new(
            Severity::Critical,
            AlertKind::ClaimsInDoubt { count },
            object,
            format!("{count} side-effect claim(s) in doubt: the send may or may not have happened"),
        );
        out.push(alert.caused_by(drill.then(|| Cause::Drill {
            what: "a drill's claim (its own device)".into(),
        })));
    }
}

/// Vehicle anomalies: a drill device's are the drill's (the naive out-of-order drill
/// leaves a ghost state on purpose).
fn vehicle_alerts(anomalies: &[VehicleAnomaly], out: &mut Vec<Alert>) {
    type Pick = fn(&VehicleAnomaly) -> bool;
    let rules: [(Pick, Severity, &str); 2] = [
        (
            |a| matches!(a, VehicleAnomaly::StateBehind { .. }),
            Severity::Critical,
            "vehicle state(s) behind their applied history",
        ),
        (
            |a| matches!(a, VehicleAnomaly::DuplicateHistory { .. }),
            Severity::Warning,
            "vehicle(s) with duplicate history rows",
        ),
    ];
    for (pick, severity, what) in rules {
        for drill in [false, true] {
            let mut devices: Vec<&str> = anomalies
                .iter()
                .filter(|a| pick(a) && a.device_id().starts_with(DRILL_DEVICE_PREFIX) == drill)
                .map(|a| a.device_id())
                .collect();
            devices.sort_unstable();
            devices.dedup();
            let Some(first) = devices.first() else {
                continue;
            };
            let n = devices.len();
            let kind = if severity == Severity::Critical {
                AlertKind::StateBehind { devices: n }
            } else {
                AlertKind::DuplicateHistoryRows { devices: n }
            };
            let alert = Alert::new(
                severity,
                kind,
                AlertObject::Device {
                    device_id: first.to_string(),
                },
                format!("{n} {what}"),
            );
            out.push(alert.caused_by(drill.then(|| Cause::Drill {
                what: "a drill's own device".into(),
            })));
        }
    }
}

/// An alert that held for a while, as the report lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AlertRecord {
    pub alert: Alert,
    pub started: DateTime<Utc>,
    /// None while it still holds.
    pub ended: Option<DateTime<Utc>>,
}

/// When each alert started, across polls, and the ones that ended (bounded).
#[derive(Debug, Clone, Default)]
pub struct AlertLog {
    active: BTreeMap<String, AlertRecord>,
    ended: VecDeque<AlertRecord>,
}

impl AlertLog {
    /// Stamp `alerts` with their start (an alert's own `since` wins the first time),
    /// and close the records of those that no longer hold.
    pub fn track(&mut self, now: DateTime<Utc>, alerts: &mut [Alert]) {
        let mut still = BTreeMap::new();
        for alert in alerts.iter_mut() {
            let key = alert.key();
            let started = self
                .active
                .remove(&key)
                .map(|r| r.started)
                .or(alert.since)
                .unwrap_or(now);
            alert.since = Some(started);
            still.insert(
                key,
                AlertRecord {
                    alert: alert.clone(),
                    started,
                    ended: None,
                },
            );
        }
        for (_, mut gone) in std::mem::replace(&mut self.active, still) {
            gone.ended = Some(now);
            self.ended.push_back(gone);
            if self.ended.len() > ENDED_KEPT {
                self.ended.pop_front();
            }
        }
    }

    /// Every alert that held at some point in `from..=to`, oldest first.
    pub fn between(&self, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<AlertRecord> {
        let mut out: Vec<AlertRecord> = self
            .ended
            .iter()
            .chain(self.active.values())
            .filter(|r| r.started <= to && r.ended.is_none_or(|e| e >= from))
            .cloned()
            .collect();
        out.sort_by_key(|r| r.started);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drill_devices_ghost_state_is_labelled_and_not_an_incident() {
        let anomalies = [
            VehicleAnomaly::StateBehind {
                device_id: "DRILL-9-ab12".into(),
                state_seq: 900,
                newest_applied_seq: 901,
            },
            VehicleAnomaly::StateBehind {
                device_id: "34-SIM-0001".into(),
                state_seq: 10,
                newest_applied_seq: 11,
            },
        ];
        let mut out = Vec::new();
        vehicle_alerts(&anomalies, &mut out);
        assert_eq!(out.len(), 2, "{out:?}");
        let fleet = out.iter().find(|a| a.is_incident()).expect("the fleet's");
        assert_eq!(
            fleet.object,
            AlertObject::Device {
                device_id: "34-SIM-0001".into()
            }
        );
        let drill = out.iter().find(|a| !a.is_incident()).expect("the drill's");
        assert!(matches!(drill.cause, Cause::Drill { .. }));
    }

    #[test]
    fn an_alert_keeps_its_start_across_polls_and_is_listed_after_it_ends() {
        let t = |s: i64| DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap_or_default();
        let alert = Alert::new(
            Severity::Warning,
            AlertKind::PurgeStalled {
                oldest_age_seconds: 1,
                retention_seconds: 1,
            },
            AlertObject::Database,
            "purge".into(),
        );
        let mut log = AlertLog::default();
        let mut now = vec![alert.clone()];
        log.track(t(0), &mut now);
        let mut later = vec![alert];
        log.track(t(30), &mut later);
        assert_eq!(later[0].since, Some(t(0)));
        log.track(t(60), &mut []);
        let past = log.between(t(10), t(20));
        assert_eq!(past.len(), 1);
        assert_eq!(past[0].ended, Some(t(60)));
        assert!(log.between(t(61), t(90)).is_empty());
    }
}
