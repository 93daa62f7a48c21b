//! What deserves the operator's attention, derived from one snapshot's data. Pure:
//! the same rules serve the TUI's alert bar and `snapshot --json` for scripts.

use serde::Serialize;

use super::db::{DbStats, SourceStatus};
use super::targets::{ConsumerStatus, TargetStatus};
use super::vehicles::VehicleAnomaly;
use crate::engine::store::Durability;

/// Above this duplicate rate (1%) something is redelivering far more than the
/// 0.01% of a normal day or the 0.4% of a deploy day.
pub const DUPLICATE_RATIO_ALERT: f64 = 0.01;

/// Critical first: a down source or a send in doubt needs action now, a high
/// duplicate rate needs a look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Warning,
    Critical,
}

/// One alert, machine-readable (`kind` and its fields) and human-readable
/// (`message`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alert {
    pub severity: Severity,
    #[serde(flatten)]
    pub kind: AlertKind,
    pub message: String,
}

/// What the alert is about, with the numbers a script needs (`kind` in JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AlertKind {
    TargetDown {
        target: String,
        error: String,
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
    DuplicateRateHigh {
        target: String,
        consumer: String,
        ratio: f64,
    },
    /// Traffic for an hour and not one duplicate dropped: the dedup path is never
    /// exercised ("the parachute is tested every day with small jumps").
    ParachuteUntested {
        target: String,
        consumer: String,
        quiet_seconds: i64,
    },
    /// A state row behind its own applied history: state went backwards.
    StateBehind {
        devices: usize,
    },
    DuplicateHistoryRows {
        devices: usize,
    },
}

/// Evaluate every rule.
pub fn evaluate(
    targets: &[TargetStatus],
    consumers: &[ConsumerStatus],
    database: Option<&DbStats>,
) -> Vec<Alert> {
    let mut out = Vec::new();
    for t in targets {
        if let SourceStatus::Down { error } = &t.status {
            out.push(Alert {
                severity: Severity::Critical,
                message: format!("target {} is down: {error}", t.name),
                kind: AlertKind::TargetDown {
                    target: t.name.clone(),
                    error: error.clone(),
                },
            });
        }
        if t.durability == Some(Durability::Relaxed) {
            out.push(Alert {
                severity: Severity::Warning,
                message: format!(
                    "{} runs with relaxed durability: a power cut can undo its last commits",
                    t.name
                ),
                kind: AlertKind::RelaxedDurability {
                    target: t.name.clone(),
                },
            });
        }
    }
    for c in consumers {
        if let Some(ratio) = c.duplicate_ratio_1m.filter(|r| *r > DUPLICATE_RATIO_ALERT) {
            out.push(Alert {
                severity: Severity::Warning,
                message: format!(
                    "{}/{}: {:.2}% duplicates over the last minute",
                    c.target,
                    c.consumer,
                    ratio * 100.0
                ),
                kind: AlertKind::DuplicateRateHigh {
                    target: c.target.clone(),
                    consumer: c.consumer.clone(),
                    ratio,
                },
            });
        }
        if let Some(quiet) = c.duplicates_quiet_seconds {
            out.push(Alert {
                severity: Severity::Warning,
                message: format!(
                    "{}/{}: no duplicate dropped for {} min while messages flow: the dedup path is never exercised",
                    c.target,
                    c.consumer,
                    quiet / 60
                ),
                kind: AlertKind::ParachuteUntested {
                    target: c.target.clone(),
                    consumer: c.consumer.clone(),
                    quiet_seconds: quiet,
                },
            });
        }
    }
    if let Some(db) = database {
        database_alerts(db, &mut out);
    }
    out.sort_by_key(|a| std::cmp::Reverse(a.severity));
    out
}

fn database_alerts(db: &DbStats, out: &mut Vec<Alert>) {
    if let SourceStatus::Down { error } = &db.status {
        out.push(Alert {
            severity: Severity::Critical,
            message: format!("database {} is down: {error}", db.url),
            kind: AlertKind::DatabaseDown {
                error: error.clone(),
            },
        });
        return;
    }
    if db.claims_in_doubt_total > 0 {
        out.push(Alert {
            severity: Severity::Critical,
            message: format!(
                "{} side-effect claim(s) in doubt: the send may or may not have happened",
                db.claims_in_doubt_total
            ),
            kind: AlertKind::ClaimsInDoubt {
                count: db.claims_in_doubt_total,
            },
        });
    }
    if let Some(d) = db.dedup.as_ref().filter(|d| d.purge_stalled) {
        let age = d.oldest_age_seconds.unwrap_or_default();
        out.push(Alert {
            severity: Severity::Warning,
            message: format!(
                "oldest dedup row is {} days old (retention {} days): the purge stopped",
                age / 86400,
                d.retention_seconds / 86400
            ),
            kind: AlertKind::PurgeStalled {
                oldest_age_seconds: age,
                retention_seconds: d.retention_seconds,
            },
        });
    }
    if let Some(v) = &db.vehicles {
        let count = |pred: fn(&VehicleAnomaly) -> bool| {
            let mut devices: Vec<&str> = v
                .anomalies
                .iter()
                .filter(|a| pred(a))
                .map(|a| a.device_id())
                .collect();
            devices.dedup();
            devices.len()
        };
        let behind = count(|a| matches!(a, VehicleAnomaly::StateBehind { .. }));
        if behind > 0 {
            out.push(Alert {
                severity: Severity::Critical,
                message: format!("{behind} vehicle state(s) behind their applied history"),
                kind: AlertKind::StateBehind { devices: behind },
            });
        }
        let dups = count(|a| matches!(a, VehicleAnomaly::DuplicateHistory { .. }));
        if dups > 0 {
            out.push(Alert {
                severity: Severity::Warning,
                message: format!("{dups} vehicle(s) with duplicate history rows"),
                kind: AlertKind::DuplicateHistoryRows { devices: dups },
            });
        }
    }
}
