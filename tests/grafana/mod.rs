//! The Grafana dashboard shipped in `assets/grafana/idemwatch.json`, generated here
//! the way `promql::rules_yaml` generates the rules file: every expression reads a
//! recording rule's name ([`promql::recorded`]), a PromQL piece of
//! [`idemwatch::monitor::promql`] or a metric name of [`MetricNames`], and the
//! thresholds drawn on the duplicate ratio are the dashboard's own alert thresholds
//! ([`idemwatch::monitor::alerts`]). `tests/grafana_dashboard.rs` fails when the
//! shipped file and [`dashboard_json`] differ (IDEMWATCH_BLESS=1 writes it).
//!
//! Written by hand rather than with a Grafana SDK (grafana-foundation-sdk has no
//! Rust edition): a dashboard is one JSON document, and `serde_json::json!` writes it
//! as it reads.
//!
//! The variables are substituted the way Grafana does it in the live test, so a
//! query here is a query a user's Grafana sends.

use std::time::Duration;

use serde_json::{json, Value};

use idemwatch::config::{AlertRules, MetricNames};
use idemwatch::engine::metrics::names;
use idemwatch::monitor::alerts::{DEPLOY_DAY_RATIO, DEPLOY_WINDOW, DUPLICATE_RATIO_ALERT};
use idemwatch::monitor::promql::{self, PAUSED_FOR};
use idemwatch::monitor::rates::{WINDOW_1M, WINDOW_5M};

pub const UID: &str = "idemwatch-consumers";
/// Grafana 10.3's dashboard schema: what it writes on export, and what 10.3 – 12
/// import as is.
pub const SCHEMA_VERSION: u64 = 39;
/// The datasource variables: Prometheus for every panel, PostgreSQL (idemwatch's own
/// database) for the deploy markers.
pub const DATASOURCE: &str = "datasource";
pub const MARKERS_DB: &str = "markers_db";
/// The PostgreSQL plugin's id since Grafana 10.2.3 (`postgres` before, kept as an
/// alias).
pub const POSTGRES_PLUGIN: &str = "grafana-postgresql-datasource";
/// The jobs whose targets export idemwatch's metrics, the consumers, and the jobs
/// scraping RabbitMQ's own exporter (`rabbitmq_prometheus`, :15692).
pub const JOB: &str = "job";
pub const CONSUMER: &str = "consumer";
pub const BROKER: &str = "broker";
/// The jobs scraping `idemwatch ingest mqtt --listen` (an ingest exports no consumer
/// metric, so the `job` variable does not find it).
pub const INGRESS_JOB: &str = "ingress_job";

/// The deploy markers `idemwatch mark deploy|incident|note` writes (docs/CONTRACT.md §8), and the
/// drills', read by Grafana's PostgreSQL macros. Restarts come from Prometheus.
pub const MARKERS_SQL: &str = "SELECT at AS \"time\", label AS text, kind AS tags\n\
FROM markers\n\
WHERE $__timeFilter(at) AND kind <> 'restart'\n\
ORDER BY at";

/// How a panel draws its targets.
enum Draw {
    /// Lines over time, in `unit`, with `thresholds` (value, colour) as dashed lines.
    Lines {
        unit: &'static str,
        thresholds: Vec<(f64, &'static str)>,
    },
    /// One band per series, green at 0 and red at 1 (a consumer paused or not).
    States,
    /// One band per series, each value's (value, text, colour); the first is the
    /// colour below the others.
    StatesOf(&'static [(&'static str, &'static str, &'static str)]),
    /// Lines in `unit` with no threshold, but the target `alarm` (its refId) drawn
    /// red with a dashed line at `at`: the series that should stay at 0.
    LinesAlarm {
        unit: &'static str,
        alarm: &'static str,
        at: f64,
    },
}

struct Target {
    expr: String,
    legend: &'static str,
}

struct Panel {
    title: &'static str,
    description: String,
    draw: Draw,
    targets: Vec<Target>,
    /// Of Grafana's 24 columns.
    width: u32,
}

struct Row {
    title: &'static str,
    panels: Vec<Panel>,
}

/// `metric{job=~"$job",consumer=~"$consumer"}`: a selector is a name as far as
/// PromQL goes, so it goes where the rules put a metric's name.
fn selected(metric: &str, labels: &[(&str, &str)]) -> String {
    let matchers: Vec<String> = labels
        .iter()
        .map(|(label, var)| format!("{label}=~\"${var}\""))
        .collect();
    format!("{metric}{{{}}}", matchers.join(","))
}

/// The metric names with the job and consumer variables' selectors in them.
fn consumer_names() -> MetricNames {
    let n = MetricNames::default();
    let by = [(JOB, JOB), (n.consumer_label.as_str(), CONSUMER)];
    MetricNames {
        claims_in_doubt: selected(&n.claims_in_doubt, &by),
        paused: selected(&n.paused, &by),
        process_start_time: selected(&n.process_start_time, &[(JOB, JOB)]),
        ..n.clone()
    }
}

/// A recording rule of the rules file, per consumer of the selected jobs.
fn recorded(stem: &str, range: Duration) -> String {
    let n = MetricNames::default();
    selected(
        &promql::recorded(stem, range),
        &[(JOB, JOB), (n.consumer_label.as_str(), CONSUMER)],
    )
}

/// A RabbitMQ exporter family summed per scrape target of the broker jobs.
fn broker(expr_of: impl Fn(&str) -> String, family: &str) -> String {
    format!(
        "sum by (job, instance) ({})",
        expr_of(&selected(family, &[(JOB, BROKER)]))
    )
}

const PER_CONSUMER: &str = "{{consumer}} · {{instance}}";

/// A per-deploy recording rule of the rules file, per consumer of the selected jobs.
fn deploy_recorded(stem: &str) -> String {
    let n = MetricNames::default();
    selected(
        &promql::deploy_recorded(stem),
        &[(JOB, JOB), (n.consumer_label.as_str(), CONSUMER)],
    )
}

/// "Deploy day: duplicate budget" (issue 41): each deploy's window (a new process,
/// the settle time after its start) with its duplicates and their ratio against the
/// budget — what IdemDeployOverBudget and the dashboard's Deploys panel judge.
fn deploy_budget_row() -> Row {
    let budget = AlertRules::default().deploy_duplicate_budget;
    let window = promql::duration(promql::DEPLOY_WINDOW_RULES);
    Row {
        title: "Deploy day: duplicate budget",
        panels: vec![
            Panel {
                title: "Duplicate ratio in the deploy window",
                description: format!(
                    "dup / (processed + dup) of each consumer since its process started, during the {window} \
                     after the start (a deploy as Prometheus sees it; recording rule {}). The line is the \
                     budget {} % ([alerts] deploy_duplicate_budget); IdemDeployOverBudget fires when the \
                     window closed above it.",
                    promql::deploy_recorded(promql::DEPLOY_RATIO),
                    budget * 100.0,
                ),
                draw: Draw::Lines {
                    unit: "percentunit",
                    thresholds: vec![(budget, "red")],
                },
                targets: vec![Target {
                    expr: deploy_recorded(promql::DEPLOY_RATIO),
                    legend: PER_CONSUMER,
                }],
                width: 12,
            },
            Panel {
                title: "Duplicates dropped in the deploy window",
                description: format!(
                    "Duplicates each consumer dropped since its process started, during the {window} after \
                     the start (recording rule {}): the deploy's cost in messages, beside the deliveries \
                     processed in the same window ({}).",
                    promql::deploy_recorded(promql::DEPLOY_DUPLICATES),
                    promql::deploy_recorded(promql::DEPLOY_PROCESSED),
                ),
                draw: Draw::Lines {
                    unit: "short",
                    thresholds: vec![],
                },
                targets: vec![
                    Target {
                        expr: deploy_recorded(promql::DEPLOY_DUPLICATES),
                        legend: "duplicates · {{consumer}} · {{instance}}",
                    },
                    Target {
                        expr: deploy_recorded(promql::DEPLOY_PROCESSED),
                        legend: "processed · {{consumer}} · {{instance}}",
                    },
                ],
                width: 12,
            },
        ],
    }
}

/// The panels, row by row.
fn rows() -> Vec<Row> {
    let n = consumer_names();
    let age_buckets = selected(
        &promql::duplicate_age_buckets(),
        &[(JOB, JOB), (n.consumer_label.as_str(), CONSUMER)],
    );
    let one_minute = promql::duration(WINDOW_1M);
    let rate_panel = |title: &'static str, stem: &str, why: &str| Panel {
        title,
        description: format!(
            "{why} Per second over {one_minute}, per consumer (recording rule {}).",
            promql::recorded(stem, WINDOW_1M)
        ),
        draw: Draw::Lines {
            unit: "ops",
            thresholds: vec![],
        },
        targets: vec![Target {
            expr: recorded(stem, WINDOW_1M),
            legend: PER_CONSUMER,
        }],
        width: 6,
    };
    vec![
        Row {
            title: "Duplicates",
            panels: vec![Panel {
                title: "Duplicate ratio per consumer",
                description: format!(
                    "dup / (processed + dup) per consumer (docs/CONTRACT.md §5), over {one_minute} and over {}. \
                     Lines: the deploy-day baseline {} % (judged over {} within {} of a restart, \
                     the shaded annotations) and the alert threshold {} % (over {one_minute}), \
                     the thresholds of the dashboard and of IdemDuplicateRateHigh.",
                    promql::duration(WINDOW_5M),
                    DEPLOY_DAY_RATIO * 100.0,
                    promql::duration(WINDOW_5M),
                    promql::duration(DEPLOY_WINDOW),
                    DUPLICATE_RATIO_ALERT * 100.0,
                ),
                draw: Draw::Lines {
                    unit: "percentunit",
                    thresholds: vec![(DEPLOY_DAY_RATIO, "orange"), (DUPLICATE_RATIO_ALERT, "red")],
                },
                targets: vec![
                    Target {
                        expr: recorded(promql::DUPLICATE_RATIO, WINDOW_1M),
                        legend: "{{consumer}} · {{instance}} (1m)",
                    },
                    Target {
                        expr: recorded(promql::DUPLICATE_RATIO, WINDOW_5M),
                        legend: "{{consumer}} · {{instance}} (5m)",
                    },
                ],
                width: 24,
            }],
        },
        Row {
            title: "Deliveries",
            panels: vec![
                rate_panel(
                    "Processed / s",
                    names::PROCESSED.family,
                    "Messages handled for the first time.",
                ),
                rate_panel(
                    "Duplicates dropped / s",
                    names::DUPLICATE_DROPPED.family,
                    "Deliveries whose key was already processed: the dedup at work.",
                ),
                rate_panel(
                    "Redelivered / s",
                    names::REDELIVERED.family,
                    "Deliveries the queue flagged as redelivered (a consumer died or gave one back).",
                ),
                rate_panel(
                    "Dead-lettered / s",
                    names::DEAD_LETTERED.family,
                    "Messages set aside for a human, all reasons (`idemwatch dead-letters list`).",
                ),
            ],
        },
        Row {
            title: "Stuck",
            panels: vec![
                Panel {
                    title: "Claims in doubt",
                    description: "Side-effect claims past their lease without a recorded result: \
                        the SMS or webhook may or may not have gone out (`idemwatch claims list`). \
                        IdemClaimsInDoubt fires above 0."
                        .into(),
                    draw: Draw::Lines {
                        unit: "short",
                        thresholds: vec![(1.0, "red")],
                    },
                    targets: vec![Target {
                        expr: promql::claims_in_doubt(&n),
                        legend: PER_CONSUMER,
                    }],
                    width: 12,
                },
                Panel {
                    title: "Paused consumers",
                    description: "A consumer stops leasing while its store, queue, provider or \
                        seen-set is unhealthy (label cause); messages wait in the queue, none is \
                        dead-lettered. IdemConsumerPaused fires after a minute."
                        .into(),
                    draw: Draw::States,
                    targets: vec![Target {
                        expr: promql::paused(&n),
                        legend: "{{consumer}} · {{cause}} · {{instance}}",
                    }],
                    width: 12,
                },
            ],
        },
        // Issue 41 (`idem_duplicate_age_seconds`, the per-deploy duplicate budget rule)
        // and issue 43 (`idem_provider_repeat_calls_total`) add their rows here, between
        // what the consumers do and what the broker sees: a `Row` whose panels read the
        // rules file's names as the ones above do. The live test then queries them too.
        stalls_and_side_effects(),
        deploy_budget_row(),
        device_ingress(),
        Row {
            title: "Dedup windows: duplicate age",
            panels: vec![Panel {
                title: "Duplicate age: p50, p99 and the oldest",
                description: format!(
                    "How long before a dropped duplicate its key had first been processed \
                     (docs/CONTRACT.md §3, §5): p50 and p99 over {} of the recording rule {}, \
                     and the oldest one each process has dropped ({}). Every dedup layer \
                     forgets a key after a while (the table's retention, a Redis seen-set's \
                     TTL, JetStream's duplicate_window, the provider's key lifetime): a window \
                     shorter than twice the oldest duplicate is short (the dashboard's WARN \
                     dedup_window_short, with the margins in its Duplicates tab).",
                    promql::duration(promql::DUPLICATE_AGE_RANGE),
                    promql::duplicate_age_buckets(),
                    n.duplicate_age_max,
                ),
                draw: Draw::Lines {
                    unit: "s",
                    thresholds: vec![],
                },
                targets: vec![
                    Target {
                        expr: promql::duplicate_age_quantile(0.5, &age_buckets),
                        legend: "p50 · {{consumer}} · {{instance}}",
                    },
                    Target {
                        expr: promql::duplicate_age_quantile(0.99, &age_buckets),
                        legend: "p99 · {{consumer}} · {{instance}}",
                    },
                    Target {
                        expr: format!(
                            "max by (job, instance, {}) ({})",
                            n.consumer_label,
                            selected(
                                &n.duplicate_age_max,
                                &[(JOB, JOB), (n.consumer_label.as_str(), CONSUMER)]
                            )
                        ),
                        legend: "oldest · {{consumer}} · {{instance}}",
                    },
                ],
                width: 24,
            }],
        },
        Row {
            title: "RabbitMQ (its own exporter, rabbitmq_prometheus)",
            panels: vec![
                Panel {
                    title: "Broker: messages ready and unacked",
                    description: "What waits in RabbitMQ's queues, and what consumers hold \
                        without an ack (a paused or stuck consumer's backlog shows here first)."
                        .into(),
                    draw: Draw::Lines {
                        unit: "short",
                        thresholds: vec![],
                    },
                    targets: vec![
                        Target {
                            expr: broker(|s| s.to_string(), "rabbitmq_queue_messages_ready"),
                            legend: "ready · {{instance}}",
                        },
                        Target {
                            expr: broker(|s| s.to_string(), "rabbitmq_queue_messages_unacked"),
                            legend: "unacked · {{instance}}",
                        },
                    ],
                    width: 8,
                },
                Panel {
                    title: "Broker: delivered, redelivered, acked / s",
                    description: "The broker's side of the redeliveries idemwatch counts: \
                        RabbitMQ redelivers what a consumer took and did not ack."
                        .into(),
                    draw: Draw::Lines {
                        unit: "ops",
                        thresholds: vec![],
                    },
                    targets: [
                        ("rabbitmq_global_messages_delivered_total", "delivered · {{instance}}"),
                        ("rabbitmq_global_messages_redelivered_total", "redelivered · {{instance}}"),
                        ("rabbitmq_global_messages_acknowledged_total", "acked · {{instance}}"),
                    ]
                    .into_iter()
                    .map(|(family, legend)| Target {
                        expr: broker(|s| format!("rate({s}[$__rate_interval])"), family),
                        legend,
                    })
                    .collect(),
                    width: 8,
                },
                Panel {
                    title: "Broker: consumers and connections",
                    description: "Consumers attached to the broker's queues and client \
                        connections: a crash loop shows as a saw."
                        .into(),
                    draw: Draw::Lines {
                        unit: "short",
                        thresholds: vec![],
                    },
                    targets: vec![
                        Target {
                            expr: broker(|s| s.to_string(), "rabbitmq_queue_consumers"),
                            legend: "consumers · {{instance}}",
                        },
                        Target {
                            expr: broker(|s| s.to_string(), "rabbitmq_connections"),
                            legend: "connections · {{instance}}",
                        },
                    ],
                    width: 8,
                },
            ],
        },
    ]
}

/// A recording rule of the stall, repeat-call and ingress rules at its `level`, per
/// consumer of the selected jobs; `extra` matchers after the variables'.
fn recorded_at(level: &str, stem: &str, operation: &str, extra: &str) -> String {
    let n = MetricNames::default();
    let vars = selected(
        &promql::recorded_at(level, stem, operation),
        &[(JOB, JOB), (n.consumer_label.as_str(), CONSUMER)],
    );
    with_matcher(vars, extra)
}

/// `metric{a=~"$a"}` with `extra` (`reason="x"`) added inside the braces.
fn with_matcher(selector: String, extra: &str) -> String {
    if extra.is_empty() {
        return selector;
    }
    let open = selector
        .strip_suffix('}')
        .expect("a selector with matchers");
    format!("{open},{extra}}}")
}

/// A recording rule of the ingress rules, per source of the selected ingest jobs.
fn ingress_recorded(level: &str, stem: &str) -> String {
    selected(
        &promql::recorded_at(level, stem, &format!("rate{}", promql::duration(WINDOW_1M))),
        &[(JOB, INGRESS_JOB)],
    )
}

const PER_INGRESS: &str = "{{source}} · {{instance}}";

/// The stall (issue 39: who is paused, under which cause, since when, how many
/// tries), what the infrastructure answered, and the provider's repeat calls (issue
/// 43): docs/CONTRACT.md §9.
fn stalls_and_side_effects() -> Row {
    let n = MetricNames::default();
    let rate1m = format!("rate{}", promql::duration(WINDOW_1M));
    let retries = MetricNames {
        pause_retries: selected(
            &n.pause_retries,
            &[(JOB, JOB), (n.consumer_label.as_str(), CONSUMER)],
        ),
        ..n.clone()
    };
    let paused_for =
        promql::recorded_at(promql::CONSUMER_CAUSE, promql::PAUSED_FOR_STEM, "seconds");
    let repeats = promql::recorded_at(
        promql::CONSUMER_REASON,
        names::PROVIDER_REPEAT_CALLS.family,
        &rate1m,
    );
    let unexpected = format!("{}=\"{}\"", n.reason_label, promql::REPEAT_UNEXPECTED);
    Row {
        title: "Stalls and side effects",
        panels: vec![
            Panel {
                title: "Paused for, by cause",
                description: format!(
                    "How long each paused consumer has stopped leasing, under the cause that \
                     paused it (store, queue, provider, seen_set): seconds since \
                     idem_consumer_paused_since_seconds, only while paused (rule {paused_for}). \
                     Messages wait in the queue; none is dead-lettered. The line: {}, where \
                     IdemConsumerPaused pages. `idemwatch snapshot --json` says why \
                     (paused.summary: last error, retries).",
                    promql::duration(PAUSED_FOR)
                ),
                draw: Draw::Lines {
                    unit: "s",
                    thresholds: vec![(PAUSED_FOR.as_secs_f64(), "red")],
                },
                targets: vec![Target {
                    expr: recorded_at(
                        promql::CONSUMER_CAUSE,
                        promql::PAUSED_FOR_STEM,
                        "seconds",
                        "",
                    ),
                    legend: "{{consumer}} · {{cause}} · {{instance}}",
                }],
                width: 8,
            },
            Panel {
                title: "Failed tries in the pause",
                description: "idem_consumer_pause_retries: the failure that began the pause, \
                    then each failed probe or trial (docs/CONTRACT.md §9). Climbing: the peer is \
                    still gone; back to 0: resumed by itself."
                    .into(),
                draw: Draw::Lines {
                    unit: "short",
                    thresholds: vec![],
                },
                targets: vec![Target {
                    expr: promql::pause_retries(&retries),
                    legend: PER_CONSUMER,
                }],
                width: 8,
            },
            Panel {
                title: "Infrastructure errors / s by kind",
                description: format!(
                    "What the consumers met that was not the message's fault, by kind: store, \
                     queue, timeout (a deadline fired: docs/CONTRACT.md §9), \
                     provider_unreachable, provider_unavailable, provider_throttled, seen_set. \
                     None spends a delivery; each pauses the consumer. Per second over \
                     {} (rule {}).",
                    promql::duration(WINDOW_1M),
                    promql::recorded_at(promql::CONSUMER_KIND, names::INFRA_ERRORS.family, &rate1m)
                ),
                draw: Draw::Lines {
                    unit: "ops",
                    thresholds: vec![],
                },
                targets: vec![Target {
                    expr: recorded_at(
                        promql::CONSUMER_KIND,
                        names::INFRA_ERRORS.family,
                        &rate1m,
                        "",
                    ),
                    legend: "{{consumer}} · {{kind}} · {{instance}}",
                }],
                width: 8,
            },
            Panel {
                title: "Provider repeat calls / s by reason",
                description: format!(
                    "A provider call for a key that had been sent before (issue 43, \
                     idem_provider_repeat_calls_total, rule {repeats}). lease_takeover and \
                     sweeper_redrive: the price of an owner that died or froze with calls in \
                     flight; provider_retry: a call that timed out had gone through (the \
                     provider's timeout is shorter than its answers). unexpected (red) should \
                     stay 0: the line is one such call within {}; IdemProviderRepeatUnexpected \
                     warns at the first (a purged claim, a second store).",
                    promql::duration(WINDOW_1M)
                ),
                draw: Draw::LinesAlarm {
                    unit: "ops",
                    alarm: "B",
                    at: 1.0 / WINDOW_1M.as_secs_f64(),
                },
                targets: vec![
                    Target {
                        expr: recorded_at(
                            promql::CONSUMER_REASON,
                            names::PROVIDER_REPEAT_CALLS.family,
                            &rate1m,
                            &unexpected.replacen('=', "!=", 1),
                        ),
                        legend: "{{consumer}} · {{reason}} · {{instance}}",
                    },
                    Target {
                        expr: recorded_at(
                            promql::CONSUMER_REASON,
                            names::PROVIDER_REPEAT_CALLS.family,
                            &rate1m,
                            &unexpected,
                        ),
                        legend: "{{consumer}} · unexpected · {{instance}}",
                    },
                ],
                width: 24,
            },
        ],
    }
}

/// `idemwatch ingest mqtt --listen`'s metrics (issue 44): per ingest process and
/// `source`.
fn device_ingress() -> Row {
    let n = MetricNames::default();
    let rate1m = format!("rate{}", promql::duration(WINDOW_1M));
    let connected = MetricNames {
        ingress_connected: selected(&n.ingress_connected, &[(JOB, INGRESS_JOB)]),
        ..n.clone()
    };
    Row {
        title: "Device ingress",
        panels: vec![
            Panel {
                title: "Ingress connected",
                description: "idem_ingress_connected: whether each ingest holds its broker \
                    connection (red: reconnecting; the broker keeps the session's messages \
                    meanwhile). A band's start is idem_ingress_state_since_seconds; the errors \
                    panel says what broke it. IdemIngressDisconnected pages after a minute."
                    .into(),
                draw: Draw::StatesOf(&[("0", "disconnected", "red"), ("1", "connected", "green")]),
                targets: vec![Target {
                    expr: promql::ingress_connected(&connected),
                    legend: PER_INGRESS,
                }],
                width: 8,
            },
            Panel {
                title: "Ingress messages / s",
                description: format!(
                    "Device messages taken in and put on the consumers' queues, per second \
                     over {} (rule {}).",
                    promql::duration(WINDOW_1M),
                    promql::recorded_at(promql::SOURCE, names::INGRESS_MESSAGES.family, &rate1m)
                ),
                draw: Draw::Lines {
                    unit: "ops",
                    thresholds: vec![],
                },
                targets: vec![Target {
                    expr: ingress_recorded(promql::SOURCE, names::INGRESS_MESSAGES.family),
                    legend: PER_INGRESS,
                }],
                width: 8,
            },
            Panel {
                title: "DUP-flag share",
                description: format!(
                    "Of the messages taken in, the share that arrived with MQTT's DUP flag: \
                     the broker sent them again (an ingest died or lost its connection before \
                     its PUBACK). The consumers' dedup absorbs them; a steady share is a link \
                     that keeps dropping (rule {}).",
                    promql::recorded_at(promql::SOURCE, promql::INGRESS_DUP_FLAG_RATIO, &rate1m)
                ),
                draw: Draw::Lines {
                    unit: "percentunit",
                    thresholds: vec![],
                },
                targets: vec![Target {
                    expr: ingress_recorded(promql::SOURCE, promql::INGRESS_DUP_FLAG_RATIO),
                    legend: PER_INGRESS,
                }],
                width: 8,
            },
            Panel {
                title: "Ingress dead letters / s by reason",
                description: "Messages the queue cannot take (too_large, malformed_json), kept \
                    in dead_letters with consumer ingress:mqtt and acked: one device's bad \
                    message costs only itself (docs/CONTRACT.md §9). `idemwatch dead-letters \
                    list` shows them."
                    .into(),
                draw: Draw::Lines {
                    unit: "ops",
                    thresholds: vec![],
                },
                targets: vec![Target {
                    expr: ingress_recorded(
                        promql::SOURCE_REASON,
                        names::INGRESS_DEAD_LETTERED.family,
                    ),
                    legend: "{{source}} · {{reason}} · {{instance}}",
                }],
                width: 12,
            },
            Panel {
                title: "Ingress errors / s by kind",
                description: "What broke an ingest's link or stopped its batch: connect, \
                    login_refused, tls, protocol (a refused subscription), queue, store. \
                    idem_ingress_error_last_seconds says when each kind last happened."
                    .into(),
                draw: Draw::Lines {
                    unit: "ops",
                    thresholds: vec![],
                },
                targets: vec![Target {
                    expr: ingress_recorded(promql::SOURCE_KIND, names::INGRESS_ERRORS.family),
                    legend: "{{source}} · {{kind}} · {{instance}}",
                }],
                width: 12,
            },
        ],
    }
}

fn prometheus_ds() -> Value {
    json!({"type": "prometheus", "uid": format!("${{{DATASOURCE}}}")})
}

fn panel_json(id: u64, p: &Panel, x: u32, y: u32) -> Value {
    let targets: Vec<Value> = p
        .targets
        .iter()
        .zip('A'..)
        .map(|(t, ref_id)| {
            json!({
                "datasource": prometheus_ds(),
                "editorMode": "code",
                "expr": t.expr,
                "legendFormat": t.legend,
                "range": true,
                "refId": ref_id.to_string(),
            })
        })
        .collect();
    let (kind, field_config, options) = match &p.draw {
        Draw::LinesAlarm { unit, alarm, at } => {
            let (kind, mut field_config, options) = lines(unit, &[]);
            field_config["overrides"] = json!([{
                "matcher": {"id": "byFrameRefID", "options": alarm},
                "properties": [
                    {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
                    {"id": "thresholds", "value": {"mode": "absolute", "steps": [
                        {"color": "green", "value": null},
                        {"color": "red", "value": at},
                    ]}},
                    {"id": "custom.thresholdsStyle", "value": {"mode": "dashed"}},
                ],
            }]);
            (kind, field_config, options)
        }
        Draw::Lines { unit, thresholds } => lines(unit, thresholds),
        Draw::StatesOf(states) => {
            let mut mappings = serde_json::Map::new();
            let mut steps = Vec::new();
            for (index, (value, text, color)) in states.iter().enumerate() {
                mappings.insert(
                    value.to_string(),
                    json!({"text": text, "color": color, "index": index}),
                );
                let at: Value = if index == 0 {
                    Value::Null
                } else {
                    json!(value.parse::<f64>().expect("a number"))
                };
                steps.push(json!({"color": color, "value": at}));
            }
            states_panel(
                json!([{"type": "value", "options": mappings}]),
                json!({"mode": "absolute", "steps": steps}),
            )
        }
        Draw::States => states_panel(
            json!([{
                "type": "value",
                "options": {
                    "0": {"text": "leasing", "color": "green", "index": 0},
                    "1": {"text": "paused", "color": "red", "index": 1},
                },
            }]),
            json!({"mode": "absolute", "steps": [
                {"color": "green", "value": null},
                {"color": "red", "value": 1},
            ]}),
        ),
    };
    json!({
        "id": id,
        "type": kind,
        "title": p.title,
        "description": p.description,
        "datasource": prometheus_ds(),
        "gridPos": {"h": 8, "w": p.width, "x": x, "y": y},
        "fieldConfig": field_config,
        "options": options,
        "targets": targets,
    })
}

/// A state timeline's kind, field config and options.
fn states_panel(mappings: Value, thresholds: Value) -> (&'static str, Value, Value) {
    (
        "state-timeline",
        json!({
            "defaults": {"mappings": mappings, "thresholds": thresholds},
            "overrides": [],
        }),
        json!({
            "mergeValues": true,
            "showValue": "never",
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "single"},
        }),
    )
}

/// A time series panel's kind, field config and options.
fn lines(unit: &str, thresholds: &[(f64, &str)]) -> (&'static str, Value, Value) {
    let mut steps = vec![json!({"color": "green", "value": null})];
    steps.extend(
        thresholds
            .iter()
            .map(|(value, color)| json!({"color": color, "value": value})),
    );
    (
        "timeseries",
        json!({
            "defaults": {
                "unit": unit,
                "min": 0,
                "custom": {
                    "drawStyle": "line",
                    "lineInterpolation": "stepAfter",
                    "spanNulls": false,
                    "showPoints": "never",
                    "thresholdsStyle": {"mode": if thresholds.is_empty() { "off" } else { "dashed" }},
                },
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        }),
        json!({
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["max", "lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }),
    )
}

/// The panels laid out: a row header, then its panels left to right, 24 columns wide.
fn panels_json() -> Vec<Value> {
    let mut out = Vec::new();
    let mut id = 0;
    let mut y = 0;
    for row in rows() {
        id += 1;
        out.push(json!({
            "id": id,
            "type": "row",
            "title": row.title,
            "collapsed": false,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            "panels": [],
        }));
        y += 1;
        let mut x = 0;
        for panel in &row.panels {
            if x + panel.width > 24 {
                x = 0;
                y += 8;
            }
            id += 1;
            out.push(panel_json(id, panel, x, y));
            x += panel.width;
        }
        y += 8;
    }
    out
}

fn templating() -> Value {
    let n = MetricNames::default();
    let query_var = |name: &str, label: &str, query: String, multi: bool| {
        json!({
            "name": name,
            "label": label,
            "type": "query",
            "datasource": prometheus_ds(),
            "definition": query,
            "query": {"query": query, "refId": format!("{name}-variable")},
            "refresh": 2,
            "sort": 1,
            "multi": multi,
            "includeAll": true,
            "current": {"selected": true, "text": ["All"], "value": ["$__all"]},
            "options": [],
            "hide": 0,
        })
    };
    json!({"list": [
        {
            "name": DATASOURCE,
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "options": [],
            "refresh": 1,
            "regex": "",
            "hide": 0,
        },
        {
            "name": MARKERS_DB,
            "label": "idemwatch database (deploy markers)",
            "type": "datasource",
            "query": POSTGRES_PLUGIN,
            "current": {},
            "options": [],
            "refresh": 1,
            "regex": "",
            "hide": 0,
        },
        query_var(JOB, "Job", format!("label_values({}, job)", n.processed), true),
        query_var(
            CONSUMER,
            "Consumer",
            format!(
                "label_values({}, {})",
                selected(&n.processed, &[(JOB, JOB)]),
                n.consumer_label
            ),
            true,
        ),
        query_var(BROKER, "RabbitMQ job", "label_values(rabbitmq_identity_info, job)".into(), true),
        query_var(
            INGRESS_JOB,
            "Ingest job",
            format!("label_values({}, job)", n.ingress_messages),
            true,
        ),
    ]})
}

fn annotations() -> Value {
    let n = consumer_names();
    json!({"list": [
        {
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": true,
            "hide": true,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        },
        {
            "name": "Restarts (deploy window)",
            "datasource": prometheus_ds(),
            "enable": true,
            "iconColor": "orange",
            "expr": promql::restarted_within(&n, DEPLOY_WINDOW),
            "step": "15s",
            "titleFormat": "{{instance}} restarted",
            "textFormat": "a new process_start_time_seconds: a deploy or a crash; the deploy-day baseline applies for this window",
            "tagKeys": "job,instance",
            "useValueForTime": false,
        },
        {
            "name": "Deploys (idemwatch markers)",
            "datasource": {"type": POSTGRES_PLUGIN, "uid": format!("${{{MARKERS_DB}}}")},
            "enable": true,
            "iconColor": "purple",
            "target": {
                "editorMode": "code",
                "format": "table",
                "rawQuery": true,
                "rawSql": MARKERS_SQL,
                "refId": "Markers",
            },
        },
    ]})
}

/// The shipped file's text.
pub fn dashboard_json() -> String {
    let dashboard = json!({
        "__inputs": [],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.3.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "datasource", "id": POSTGRES_PLUGIN, "name": "PostgreSQL", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
            {"type": "panel", "id": "state-timeline", "name": "State timeline", "version": ""},
        ],
        "title": "idemwatch: idempotent consumers",
        "uid": UID,
        "description": "Duplicates, deliveries, claims in doubt and pauses per consumer from idemwatch's \
            recording rules (assets/prometheus/idemwatch.rules.yml), beside RabbitMQ's own exporter. \
            Generated by tests/grafana/mod.rs; do not edit by hand.",
        "tags": ["idemwatch", "idempotency", "rabbitmq"],
        "editable": true,
        "graphTooltip": 1,
        "id": null,
        "links": [],
        "liveNow": false,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "version": 1,
        "weekStart": "",
        "annotations": annotations(),
        "templating": templating(),
        "panels": panels_json(),
    });
    let mut text = serde_json::to_string_pretty(&dashboard).expect("a JSON value encodes");
    text.push('\n');
    text
}
