//! PromQL, written once: the expressions the dashboard sends to a Prometheus server
//! for history ([`super::history`]) and the recording and alert rules shipped in
//! `assets/prometheus/` for teams that alert from Prometheus ([`rules_yaml`]).
//!
//! The rules are generated from the constants the dashboard's own alerts read
//! ([`super::alerts`], [`crate::config::AlertRules`]'s defaults, the rate windows of
//! [`super::rates`]), and a test compares the shipped file with [`rules_yaml`]: the
//! two can only disagree in a commit that fails. Where a dashboard rule needs
//! something Prometheus does not have (deploy markers live in the database), the
//! rule reads the closest thing it has (a restart of the target) and the README's
//! table says so.

use std::fmt::Write as _;
use std::time::Duration;

use crate::config::{AlertRules, MetricNames};
use idemwatch_engine::metrics::names;

use super::rates::{WINDOW_1M, WINDOW_5M};
use super::ratios::{DEPLOY_DAY_RATIO, DEPLOY_WINDOW, DUPLICATE_RATIO_ALERT};

/// How long the duplicate rate must stay above the deploy-day baseline, with no
/// restart of the target, before Prometheus pages (a deploy's spike is over well
/// before that).
pub const ABOVE_DEPLOY_DAY_FOR: Duration = Duration::from_secs(600);
/// How far back a target must have exported consumer metrics for its `up == 0` to be
/// a consumer down (rather than any other job of the server).
pub const CONSUMER_TARGET_SEEN: Duration = Duration::from_secs(3600);
/// A consumer paused (`idem_consumer_paused` at 1) this long pages. The dashboard
/// shows a pause from its first poll; a pager should not ring for a back-off of a
/// few seconds that a 15 s scrape may not even see, and a pause that outlasts a
/// minute is an outage the on-call engineer must hear of.
pub const PAUSED_FOR: Duration = Duration::from_secs(60);

/// A duration as PromQL writes it: `1m`, `15s`.
pub fn duration(d: Duration) -> String {
    let s = d.as_secs().max(1);
    if s.is_multiple_of(3600) {
        format!("{}h", s / 3600)
    } else if s.is_multiple_of(60) {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

/// The labels every per-consumer expression keeps: where it ran and which consumer.
pub fn consumer_grouping(names: &MetricNames) -> String {
    format!("job, instance, {}", names.consumer_label)
}

/// Per-second rate of a counter over `range`, summed per target and consumer (over
/// `reason` for dead letters).
pub fn rate(names: &MetricNames, counter: &str, range: Duration) -> String {
    format!(
        "sum by ({}) (rate({counter}[{}]))",
        consumer_grouping(names),
        duration(range)
    )
}

/// dup / (processed + dup) over `range` (docs/CONTRACT.md §5); no sample where nothing flowed
/// (0/0 is NaN, which Prometheus keeps and the reader turns into a gap).
pub fn duplicate_ratio(names: &MetricNames, range: Duration) -> String {
    let dup = rate(names, &names.duplicate_dropped, range);
    let processed = rate(names, &names.processed, range);
    format!("{dup} / ({processed} + {dup})")
}

/// Targets whose process started anew within `range`: one series per restarted
/// target (a changed `process_start_time_seconds`).
pub fn restarted_within(names: &MetricNames, range: Duration) -> String {
    format!(
        "changes({}[{}]) > 0",
        names.process_start_time,
        duration(range)
    )
}

/// Side-effect claims in doubt per target and consumer.
pub fn claims_in_doubt(names: &MetricNames) -> String {
    format!(
        "max by ({}) ({})",
        consumer_grouping(names),
        names.claims_in_doubt
    )
}

/// Per target, consumer and `cause`: 1 while the consumer stops leasing, else 0.
pub fn paused(names: &MetricNames) -> String {
    format!(
        "max by ({}, cause) ({})",
        consumer_grouping(names),
        names.paused
    )
}

/// One recording rule: its name and expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recording {
    pub record: String,
    pub expr: String,
}

/// One alert rule, with the dashboard rule it mirrors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlertRule {
    pub alert: &'static str,
    /// The `kind` of the dashboard alert it mirrors ([`super::alerts::AlertKind::name`]);
    /// None where the dashboard lists rather than alerts.
    pub dashboard: Option<&'static str>,
    pub expr: String,
    pub for_: Option<Duration>,
    pub severity: &'static str,
    pub summary: String,
}

/// The duplicate ratio's stem in its recording rules' names (it is no metric of its
/// own: dup / (processed + dup)).
pub const DUPLICATE_RATIO: &str = "idem_duplicate_ratio";

/// A recording rule's name: `instance_consumer:{stem}:rate{range}` (what the rules file
/// records and the Grafana dashboard in `assets/grafana/` charts).
pub fn recorded(metric_stem: &str, range: Duration) -> String {
    format!("instance_consumer:{metric_stem}:rate{}", duration(range))
}

/// Over how long the duplicate-age buckets are rated: duplicates are rare (0.01 % of a
/// normal day), so a minute of them is mostly empty; an hour holds a deploy's.
pub const DUPLICATE_AGE_RANGE: Duration = Duration::from_secs(3600);

/// The recording rule of the duplicate-age buckets, per target, consumer and bucket
/// (`le` kept, so `histogram_quantile` reads it).
pub fn duplicate_age_buckets() -> String {
    format!(
        "instance_consumer_le:{}_bucket:rate{}",
        names::DUPLICATE_AGE,
        duration(DUPLICATE_AGE_RANGE)
    )
}

/// A quantile of the duplicates' ages over the recording rule `buckets` (a selector
/// of [`duplicate_age_buckets`]).
pub fn duplicate_age_quantile(q: f64, buckets: &str) -> String {
    format!("histogram_quantile({q}, {buckets})")
}

/// A recording rule's name at another aggregation `level` than per consumer, e.g.
/// `instance_consumer_kind:idem_infra_errors:rate1m`.
pub fn recorded_at(level: &str, metric_stem: &str, operation: &str) -> String {
    format!("{level}:{metric_stem}:{operation}")
}

/// `rate1m`, `rate5m`: the operation part of a rate rule's name.
fn rate_op(range: Duration) -> String {
    format!("rate{}", duration(range))
}

/// The labels every per-ingress expression keeps: where it ran and which ingress
/// (`source`, docs/CONTRACT.md §9 "Fleet ingress").
pub const SOURCE_GROUPING: &str = "job, instance, source";

/// The aggregation levels of the stall, side-effect and ingress rules.
pub const CONSUMER_CAUSE: &str = "instance_consumer_cause";
pub const CONSUMER_KIND: &str = "instance_consumer_kind";
pub const CONSUMER_REASON: &str = "instance_consumer_reason";
pub const SOURCE: &str = "instance_source";
pub const SOURCE_KIND: &str = "instance_source_kind";
pub const SOURCE_REASON: &str = "instance_source_reason";

/// The stem of the rule that says how long a paused consumer has been paused.
pub const PAUSED_FOR_STEM: &str = "idem_consumer_paused_for";
/// The stem of the DUP-flag share of an ingress's messages (no metric of its own:
/// dup_flag="true" / all).
pub const INGRESS_DUP_FLAG_RATIO: &str = "idem_ingress_dup_flag_ratio";

/// Per target, consumer and `cause`, only while paused: seconds since the pause
/// began (`time() - idem_consumer_paused_since_seconds`, which is per consumer;
/// the cause comes from `idem_consumer_paused`, at 1 for the one that paused it).
pub fn paused_for(names: &MetricNames) -> String {
    let by = consumer_grouping(names);
    format!(
        "(time() - max by ({by}) ({since} > 0))\n  * on ({by}) group_right\nmax by ({by}, cause) ({paused} == 1)",
        since = names.paused_since,
        paused = names.paused,
    )
}

/// Per target and consumer: failed tries in the current pause (0 while running).
pub fn pause_retries(names: &MetricNames) -> String {
    format!(
        "max by ({}) ({})",
        consumer_grouping(names),
        names.pause_retries
    )
}

/// Per-second rate of a counter over `range`, summed per target, consumer and `label`.
pub fn rate_by(names: &MetricNames, counter: &str, label: &str, range: Duration) -> String {
    format!(
        "sum by ({}, {label}) (rate({counter}[{}]))",
        consumer_grouping(names),
        duration(range)
    )
}

/// Per-second rate of an ingress counter over `range`, per target and source (and
/// `label` when given); `selector` narrows the counter (`{dup_flag="true"}`).
pub fn ingress_rate(counter: &str, selector: &str, label: Option<&str>, range: Duration) -> String {
    let by = match label {
        Some(l) => format!("{SOURCE_GROUPING}, {l}"),
        None => SOURCE_GROUPING.to_string(),
    };
    format!(
        "sum by ({by}) (rate({counter}{selector}[{}]))",
        duration(range)
    )
}

/// Per target and source: 1 while the ingress holds its broker connection.
pub fn ingress_connected(names: &MetricNames) -> String {
    format!("max by ({SOURCE_GROUPING}) ({})", names.ingress_connected)
}

/// The `reason` of `idem_provider_repeat_calls_total` that should stay 0 (a send the
/// engine lost track of: a purged claim, a second store).
pub const REPEAT_UNEXPECTED: &str = "unexpected";

/// The recording rules of the stalls, the provider's repeat calls and the device
/// ingress (docs/CONTRACT.md §9): what the Grafana rows "Stalls and side effects" and
/// "Device ingress" chart, each expression once.
pub fn stall_and_ingress_rules() -> Vec<Recording> {
    let n = MetricNames::default();
    let op = rate_op(WINDOW_1M);
    let messages = recorded_at(SOURCE, names::INGRESS_MESSAGES.family, &op);
    vec![
        Recording {
            record: recorded_at(CONSUMER_CAUSE, PAUSED_FOR_STEM, "seconds"),
            expr: paused_for(&n),
        },
        Recording {
            record: recorded_at(CONSUMER_KIND, names::INFRA_ERRORS.family, &op),
            expr: rate_by(&n, &n.infra_errors, "kind", WINDOW_1M),
        },
        Recording {
            record: recorded_at(CONSUMER_REASON, names::PROVIDER_REPEAT_CALLS.family, &op),
            expr: rate_by(&n, &n.provider_repeat_calls, &n.reason_label, WINDOW_1M),
        },
        Recording {
            record: messages.clone(),
            expr: ingress_rate(&n.ingress_messages, "", None, WINDOW_1M),
        },
        Recording {
            record: recorded_at(SOURCE, INGRESS_DUP_FLAG_RATIO, &op),
            expr: format!(
                "{}\n/ {messages}",
                ingress_rate(&n.ingress_messages, "{dup_flag=\"true\"}", None, WINDOW_1M)
            ),
        },
        Recording {
            record: recorded_at(SOURCE_REASON, names::INGRESS_DEAD_LETTERED.family, &op),
            expr: ingress_rate(
                &n.ingress_dead_lettered,
                "",
                Some(&n.reason_label),
                WINDOW_1M,
            ),
        },
        Recording {
            record: recorded_at(SOURCE_KIND, names::INGRESS_ERRORS.family, &op),
            expr: ingress_rate(&n.ingress_errors, "", Some("kind"), WINDOW_1M),
        },
    ]
}

/// The deploy window's length in the shipped rules: the dashboard's default settle
/// time (`[alerts] deploy_settle_time`).
pub const DEPLOY_WINDOW_RULES: Duration = crate::config::DEFAULT_DEPLOY_SETTLE_TIME;

/// A per-deploy recording rule's name:
/// `instance_consumer:{stem}:window{settle}` (e.g.
/// `instance_consumer:idem_deploy_duplicate_ratio:window10m`).
pub fn deploy_recorded(stem: &str) -> String {
    format!(
        "instance_consumer:{stem}:window{}",
        duration(DEPLOY_WINDOW_RULES)
    )
}

/// The stems of the per-deploy rules: duplicates, deliveries processed, their ratio.
pub const DEPLOY_DUPLICATES: &str = "idem_deploy_duplicate_dropped";
pub const DEPLOY_PROCESSED: &str = "idem_deploy_messages_processed";
pub const DEPLOY_RATIO: &str = "idem_deploy_duplicate_ratio";

/// A deploy as Prometheus sees it: the server has no markers table, so a deploy is a
/// new process (`process_start_time_seconds`), and its window is the settle time
/// after the start. A counter starts at zero with its process, so its value in
/// the window is what the deploy's process did since it started: the deploy's own
/// count, no range or offset needed.
pub fn in_deploy_window(names: &MetricNames) -> String {
    format!(
        "time() - {} <= {}",
        names.process_start_time,
        DEPLOY_WINDOW_RULES.as_secs()
    )
}

/// The recording rules: per target and consumer, the rates the dashboard charts.
pub fn recording_rules() -> Vec<Recording> {
    let n = MetricNames::default();
    let mut out = Vec::new();
    for range in [WINDOW_1M, WINDOW_5M] {
        for (stem, counter) in [
            (names::PROCESSED.family, &n.processed),
            (names::DUPLICATE_DROPPED.family, &n.duplicate_dropped),
            (names::REDELIVERED.family, &n.redelivered),
            (names::DEAD_LETTERED.family, &n.dead_lettered),
        ] {
            out.push(Recording {
                record: recorded(stem, range),
                expr: rate(&n, counter, range),
            });
        }
        let dup = recorded(names::DUPLICATE_DROPPED.family, range);
        let processed = recorded(names::PROCESSED.family, range);
        out.push(Recording {
            record: recorded(DUPLICATE_RATIO, range),
            expr: format!("{dup} / ({processed} + {dup})"),
        });
    }
    out.push(Recording {
        record: duplicate_age_buckets(),
        expr: format!(
            "sum by (job, instance, {}, le) (rate({}_bucket[{}]))",
            n.consumer_label,
            n.duplicate_age,
            duration(DUPLICATE_AGE_RANGE)
        ),
    });
    out.extend(stall_and_ingress_rules());
    // The deploy budget (crate::deploys): per consumer, since its process started,
    // while that start is within the window.
    let window = in_deploy_window(&n);
    for (stem, counter) in [
        (DEPLOY_DUPLICATES, &n.duplicate_dropped),
        (DEPLOY_PROCESSED, &n.processed),
    ] {
        out.push(Recording {
            record: deploy_recorded(stem),
            expr: format!(
                "sum by ({}) ({counter})\nand on (job, instance) ({window})",
                consumer_grouping(&n)
            ),
        });
    }
    let dup = deploy_recorded(DEPLOY_DUPLICATES);
    let processed = deploy_recorded(DEPLOY_PROCESSED);
    out.push(Recording {
        record: deploy_recorded(DEPLOY_RATIO),
        expr: format!("{dup} / ({processed} + {dup})"),
    });
    out
}

/// The alert rules, each the Prometheus side of a dashboard rule
/// ([`super::alerts`]).
pub fn alert_rules() -> Vec<AlertRule> {
    let mut rules = consumer_alert_rules();
    rules.extend(stall_and_ingress_alerts());
    rules
}

/// An ingress without its broker connection this long pages: its reconnects back off
/// to a few seconds, so a minute is a broker (or its login, or its certificate) that
/// is really gone; the broker keeps the session's messages meanwhile, and nothing of
/// the fleet reaches a consumer.
pub const INGRESS_DISCONNECTED_FOR: Duration = Duration::from_secs(60);

/// The alerts of the stall, repeat-call and ingress rules (docs/CONTRACT.md §9); the
/// terminal dashboard shows these on its Overview rather than alerting.
pub fn stall_and_ingress_alerts() -> Vec<AlertRule> {
    let n = MetricNames::default();
    vec![
        AlertRule {
            alert: "IdemProviderRepeatUnexpected",
            dashboard: None,
            expr: format!(
                "sum by ({}) (increase({}{{{}=\"{REPEAT_UNEXPECTED}\"}}[{}])) > 0",
                consumer_grouping(&n),
                n.provider_repeat_calls,
                n.reason_label,
                duration(WINDOW_5M)
            ),
            for_: None,
            severity: "warning",
            summary: format!(
                "{{{{ $labels.instance }}}}/{{{{ $labels.{} }}}}: the provider replayed {{{{ $value }}}} key(s) in {} that the engine called as new: a send it lost track of (a purged claim, a second store)",
                n.consumer_label,
                duration(WINDOW_5M)
            ),
        },
        AlertRule {
            alert: "IdemIngressDisconnected",
            dashboard: None,
            expr: format!("{} == 0", ingress_connected(&n)),
            for_: Some(INGRESS_DISCONNECTED_FOR),
            severity: "critical",
            summary: format!(
                "{{{{ $labels.instance }}}}: ingress {{{{ $labels.source }}}} has had no broker connection for {}: device messages wait at the broker",
                duration(INGRESS_DISCONNECTED_FOR)
            ),
        },
    ]
}

/// The alerts over the consumers' own counters.
fn consumer_alert_rules() -> Vec<AlertRule> {
    let n = MetricNames::default();
    let defaults = AlertRules::default();
    let by = consumer_grouping(&n);
    let ratio_1m = recorded(DUPLICATE_RATIO, WINDOW_1M);
    let ratio_5m = recorded(DUPLICATE_RATIO, WINDOW_5M);
    let restarted = restarted_within(&n, DEPLOY_WINDOW);
    let sustained_window = ABOVE_DEPLOY_DAY_FOR + WINDOW_5M;
    let dead = |selector: &str| {
        format!(
            "sum by ({by}, {}) (increase({}{selector}[{}]))",
            n.reason_label,
            n.dead_lettered,
            duration(WINDOW_5M)
        )
    };
    vec![
        AlertRule {
            alert: "IdemDuplicateRateHigh",
            dashboard: Some("duplicate_rate_high"),
            expr: format!(
                "({ratio_1m} > {DUPLICATE_RATIO_ALERT} unless on (job, instance) ({restarted}))\nor\n({ratio_5m} > {DEPLOY_DAY_RATIO} and on (job, instance) ({restarted}))"
            ),
            for_: None,
            severity: "warning",
            summary: format!(
                "{{{{ $labels.instance }}}}/{{{{ $labels.{} }}}}: duplicate rate above {}% over 1 min (or above the deploy-day {}% over 5 min within {} of a restart)",
                n.consumer_label,
                DUPLICATE_RATIO_ALERT * 100.0,
                DEPLOY_DAY_RATIO * 100.0,
                duration(DEPLOY_WINDOW)
            ),
        },
        AlertRule {
            alert: "IdemDuplicateRateAboveDeployDay",
            dashboard: Some("duplicate_rate_high"),
            expr: format!(
                "{ratio_5m} > {DEPLOY_DAY_RATIO}\nunless on (job, instance) ({})",
                restarted_within(&n, sustained_window)
            ),
            for_: Some(ABOVE_DEPLOY_DAY_FOR),
            severity: "warning",
            summary: format!(
                "{{{{ $labels.instance }}}}/{{{{ $labels.{} }}}}: duplicate rate above the deploy-day {}% for {} with no restart: something redelivers",
                n.consumer_label,
                DEPLOY_DAY_RATIO * 100.0,
                duration(ABOVE_DEPLOY_DAY_FOR)
            ),
        },
        AlertRule {
            alert: "IdemKeyConflict",
            dashboard: Some("dead_letter_burst"),
            expr: format!("{} > 0", dead(&format!("{{{}=\"key_conflict\"}}", n.reason_label))),
            for_: None,
            severity: "critical",
            summary: format!(
                "{{{{ $labels.{} }}}}: key_conflict dead letter(s) in {}: same key, different payload",
                n.consumer_label,
                duration(WINDOW_5M)
            ),
        },
        AlertRule {
            alert: "IdemDeadLetterBurst",
            dashboard: Some("dead_letter_burst"),
            expr: format!("{} >= {}", dead(""), defaults.dead_letter_burst),
            for_: None,
            severity: "warning",
            summary: format!(
                "{{{{ $labels.{} }}}}: {{{{ $value }}}} {{{{ $labels.{} }}}} dead letters in {}",
                n.consumer_label,
                n.reason_label,
                duration(WINDOW_5M)
            ),
        },
        AlertRule {
            alert: "IdemDeadLettered",
            dashboard: None,
            expr: format!("{} > 0", dead("")),
            for_: None,
            severity: "info",
            summary: format!(
                "{{{{ $labels.{} }}}}: a {{{{ $labels.{} }}}} dead letter in {}",
                n.consumer_label,
                n.reason_label,
                duration(WINDOW_5M)
            ),
        },
        AlertRule {
            alert: "IdemClaimsInDoubt",
            dashboard: Some("claims_in_doubt"),
            expr: format!("{} > 0", claims_in_doubt(&n)),
            for_: None,
            severity: "critical",
            summary: format!(
                "{{{{ $labels.instance }}}}/{{{{ $labels.{} }}}}: {{{{ $value }}}} side-effect claim(s) in doubt past the lease: the send may or may not have happened",
                n.consumer_label
            ),
        },
        AlertRule {
            alert: "IdemConsumerTargetDown",
            dashboard: Some("target_down"),
            expr: format!(
                "up == 0\nand on (job, instance) group by (job, instance) (max_over_time({}[{}]))",
                n.processed,
                duration(CONSUMER_TARGET_SEEN)
            ),
            for_: Some(defaults.target_down_after),
            severity: "critical",
            summary: "consumer target {{ $labels.job }}/{{ $labels.instance }} is down".into(),
        },
        AlertRule {
            alert: "IdemDeployOverBudget",
            dashboard: Some("deploy_over_budget"),
            // The window's last recorded ratio (at its end, the settle time after
            // the start), judged once it closed, for as long as the dashboard holds
            // its alert (an hour) unless a newer start opens the next window.
            expr: format!(
                "last_over_time({}[{}]) > {}\nand on (job, instance) (time() - {} > {})",
                deploy_recorded(DEPLOY_RATIO),
                duration(super::ratios::OVER_BUDGET_HELD),
                defaults.deploy_duplicate_budget,
                n.process_start_time,
                DEPLOY_WINDOW_RULES.as_secs()
            ),
            for_: None,
            severity: "warning",
            summary: format!(
                "{{{{ $labels.instance }}}}/{{{{ $labels.{} }}}}: the deploy (process start) cost more than the {}% duplicate budget over its {} window",
                n.consumer_label,
                defaults.deploy_duplicate_budget * 100.0,
                duration(DEPLOY_WINDOW_RULES)
            ),
        },
        AlertRule {
            alert: "IdemConsumerPaused",
            dashboard: Some("consumer_paused"),
            expr: format!("{} == 1", paused(&n)),
            for_: Some(PAUSED_FOR),
            // The dashboard's consumer_paused is critical too: nothing of that
            // consumer moves until its store or provider is back.
            severity: "critical",
            summary: format!(
                "{{{{ $labels.instance }}}}/{{{{ $labels.{} }}}} stopped leasing: its {{{{ $labels.cause }}}} is unhealthy; messages wait in the queue",
                n.consumer_label
            ),
        },
    ]
}

/// YAML's literal block for a multi-line expression, or the plain one-liner quoted.
fn yaml_expr(out: &mut String, indent: &str, expr: &str) {
    if expr.contains('\n') {
        let _ = writeln!(out, "{indent}expr: |");
        for line in expr.lines() {
            let _ = writeln!(out, "{indent}  {line}");
        }
    } else {
        let _ = writeln!(out, "{indent}expr: {}", yaml_quote(expr));
    }
}

/// A double-quoted YAML scalar.
fn yaml_quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The shipped rules file, `assets/prometheus/idemwatch.rules.yml`.
pub fn rules_yaml() -> String {
    let mut out = String::new();
    out.push_str(
        "# idemwatch recording and alert rules for Prometheus.\n\
         # Generated from crates/idemwatch-monitor/src/promql.rs with the dashboard's own thresholds\n\
         # (crates/idemwatch-monitor/src/alerts.rs); do not edit by hand. Regenerate with\n\
         #   IDEMWATCH_BLESS=1 cargo test -p idemwatch-monitor --test prometheus_rules\n\
         # Unit tests: promtool test rules assets/prometheus/idemwatch.rules.test.yml\n\
         groups:\n  - name: idemwatch-recording\n    rules:\n",
    );
    for r in recording_rules() {
        let _ = writeln!(out, "      - record: {}", r.record);
        yaml_expr(&mut out, "        ", &r.expr);
    }
    out.push_str("  - name: idemwatch-alerts\n    rules:\n");
    for a in alert_rules() {
        let _ = writeln!(out, "      - alert: {}", a.alert);
        yaml_expr(&mut out, "        ", &a.expr);
        if let Some(f) = a.for_ {
            let _ = writeln!(out, "        for: {}", duration(f));
        }
        let _ = writeln!(out, "        labels:\n          severity: {}", a.severity);
        let _ = writeln!(
            out,
            "        annotations:\n          summary: {}",
            yaml_quote(&a.summary)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_promql() {
        assert_eq!(duration(Duration::from_secs(60)), "1m");
        assert_eq!(duration(Duration::from_secs(15)), "15s");
        assert_eq!(duration(Duration::from_secs(7200)), "2h");
        assert_eq!(duration(Duration::from_millis(10)), "1s");
    }

    #[test]
    fn thresholds_come_from_the_dashboard() {
        let yaml = rules_yaml();
        assert!(
            yaml.contains(&format!("> {DUPLICATE_RATIO_ALERT}")),
            "{yaml}"
        );
        assert!(yaml.contains(&format!("> {DEPLOY_DAY_RATIO}")));
        assert!(yaml.contains(&format!(">= {}", AlertRules::default().dead_letter_burst)));
        assert!(yaml.contains(&format!(
            "({}) == 1\"\n        for: {}",
            MetricNames::default().paused,
            duration(PAUSED_FOR)
        )));
    }
}
