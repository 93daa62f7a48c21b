//! The duplicate ratios the field report names, and the window a deploy owns in the
//! alert rules: one home for the numbers the alerts, the deploy budget, the config's
//! defaults, the PromQL rules, the report and the charts all compare against.
//!
//! A leaf: it imports nothing of the crate, so the config (whose default budget is
//! the deploy day's ratio) and the deploy budget (whose baseline falls back to the
//! normal day's) can read them without depending on the alerts that read both.

use std::time::Duration;

/// Above this duplicate rate (1%) over a minute something is redelivering far more
/// than the 0.01% of a normal day or the 0.4% of a deploy day.
pub const DUPLICATE_RATIO_ALERT: f64 = 0.01;
/// A normal day's duplicate rate (the field report: ~0.01 %).
pub const NORMAL_DAY_RATIO: f64 = 0.0001;
/// What a deploy day reaches (~0.4 %): inside a deploy window the five-minute rate
/// is judged against it, and it is the default per-deploy duplicate budget.
pub const DEPLOY_DAY_RATIO: f64 = 0.004;
/// How long after a deploy or restart marker its duplicates are expected.
pub const DEPLOY_WINDOW: Duration = Duration::from_secs(300);

/// How long after its window closed an over-budget deploy stays an alert, unless
/// the next deploy's window closes first: long enough for the on-call engineer back
/// from the rollout's follow-ups to see it; older verdicts live in the Deploys panel
/// and the report.
pub const OVER_BUDGET_HELD: Duration = Duration::from_secs(3600);
