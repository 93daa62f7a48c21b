//! The Grafana dashboard `assets/grafana/idemwatch.json` (issue 42): the shipped file
//! is what `tests/grafana/mod.rs` generates from the rules' names and the alert
//! thresholds; it has what Grafana needs to import it; and against a real Prometheus
//! server every panel's query returns data. That server (our own: 1 s scrapes, 1 s
//! rule evaluation, the shipped rules file loaded) scrapes an `idemwatch serve` on
//! PostgreSQL (its queues on RabbitMQ, under a prefix of the run's own, so that the
//! broker's panels count the same deliveries) consuming a fleet trace with
//! redeliveries and a bad line, then a
//! deploy marker, the process gone, a consumer that dies after its commit and before
//! its ack (the field report's crash point), and a new `serve` that takes the
//! unacked batch again — and RabbitMQ's own exporter. For the rows of docs/CONTRACT.md
//! §9, the same run has a stall, a repeat call and a device ingress: the SMS and
//! ERP calls of the first `serve` go to a provider behind a fault proxy that resets
//! them (the two side-effect consumers pause, under cause `provider`, retrying), then
//! lets them through to a provider that has already answered those keys for a
//! second store (a SQLite run of the same trace first: `unexpected` repeat calls);
//! and an `ingest mqtt --listen` (scraped too) takes device messages from a private
//! Mosquitto through another fault proxy, a bad one among them, and gets three
//! again with the DUP flag after its link froze and was reset. Each query is sent over HTTP
//! with the variables substituted as Grafana substitutes them (the variables' own
//! queries resolved first); the restart annotation must find the restart and the
//! deploy annotation's SQL must find the marker in PostgreSQL.
//!
//! Without the `prometheus` binary, PostgreSQL or RabbitMQ's exporter
//! (IDEMWATCH_RABBITMQ_PROMETHEUS, default 127.0.0.1:15692) the live test skips what
//! needs them, unless IDEMWATCH_REQUIRE_SERVICES=1 (CI), where it fails.

mod common;
mod grafana;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::{Connection, Row};

use common::backends::{required, Kind, TestDb};
use common::mqtt::PrivateMosquitto;
use common::proxy::{Fault, FaultProxy};
use common::services::{free_port, reachable};
use common::{idemwatch_bin, KillOnDrop};
use idemwatch::config::MetricNames;
use idemwatch::engine::metrics::names;
use idemwatch::monitor::promql;
use idemwatch::monitor::rates::WINDOW_1M;

const SHIPPED: &str = "assets/grafana/idemwatch.json";
const RULES: &str = "assets/prometheus/idemwatch.rules.yml";
/// The scrape jobs of the test's Prometheus.
const SERVE_JOB: &str = "idemwatch";
const BROKER_JOB: &str = "rabbitmq";
const INGEST_JOB: &str = "idemwatch-ingest";

fn asset(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn shipped() -> Value {
    let text = std::fs::read_to_string(asset(SHIPPED)).unwrap();
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every panel, those inside a collapsed row too.
fn all_panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().expect("panels") {
        out.push(p);
        if let Some(nested) = p["panels"].as_array() {
            out.extend(nested);
        }
    }
    out
}

/// The panels that query something (rows only group).
fn query_panels(dashboard: &Value) -> Vec<&Value> {
    all_panels(dashboard)
        .into_iter()
        .filter(|p| p["type"] != "row")
        .collect()
}

/// The shipped file is exactly what the generator writes; IDEMWATCH_BLESS=1 writes it.
#[test]
fn shipped_dashboard_is_what_the_generator_writes() {
    let generated = grafana::dashboard_json();
    if std::env::var("IDEMWATCH_BLESS").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(asset("assets/grafana")).unwrap();
        std::fs::write(asset(SHIPPED), &generated).unwrap();
    }
    let shipped = std::fs::read_to_string(asset(SHIPPED)).unwrap_or_default();
    assert!(
        shipped == generated,
        "{SHIPPED} differs from tests/grafana/mod.rs; regenerate with IDEMWATCH_BLESS=1 cargo test --test grafana_dashboard"
    );
}

/// What Grafana's import reads: a schema version, a uid it can put in a URL, a
/// datasource variable the panels point at (no `__inputs` to fill), unique panel
/// ids, panels that do not overlap, a refId per query, and no `$variable` that is
/// not defined.
#[test]
fn the_dashboard_has_what_grafana_needs_to_import_it() {
    let d = shipped();
    assert_eq!(d["schemaVersion"].as_u64(), Some(grafana::SCHEMA_VERSION));
    let uid = d["uid"].as_str().expect("uid");
    assert!(
        !uid.is_empty()
            && uid.len() <= 40
            && uid
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
        "a uid Grafana accepts: {uid}"
    );
    assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(d["id"].is_null(), "an import gets its own id");

    let variables = d["templating"]["list"].as_array().expect("templating.list");
    let defined: BTreeSet<&str> = variables
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    let datasource = variables
        .iter()
        .find(|v| v["type"] == "datasource" && v["query"] == "prometheus")
        .expect("a Prometheus datasource variable");
    let ds_ref = format!("${{{}}}", datasource["name"].as_str().unwrap());
    for name in [grafana::JOB, grafana::CONSUMER, grafana::BROKER] {
        assert!(defined.contains(name), "the {name} variable");
    }

    let mut ids = BTreeSet::new();
    let mut cells = BTreeSet::new();
    for p in all_panels(&d) {
        let id = p["id"].as_u64().expect("a panel id");
        assert!(ids.insert(id), "panel id {id} used twice");
        let g = &p["gridPos"];
        let (x, y, w, h) = (
            g["x"].as_u64().unwrap(),
            g["y"].as_u64().unwrap(),
            g["w"].as_u64().unwrap(),
            g["h"].as_u64().unwrap(),
        );
        assert!(x + w <= 24, "panel {id} wider than the grid");
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(cells.insert((cx, cy)), "panel {id} overlaps another");
            }
        }
    }

    for p in query_panels(&d) {
        let title = p["title"].as_str().unwrap();
        assert_eq!(p["datasource"]["uid"], ds_ref.as_str(), "{title}");
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title} queries nothing");
        let ref_ids: BTreeSet<&str> = targets
            .iter()
            .map(|t| t["refId"].as_str().unwrap())
            .collect();
        assert_eq!(ref_ids.len(), targets.len(), "{title}: refIds repeat");
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            for var in variables_in(expr) {
                assert!(
                    defined.contains(var.as_str()) || var.starts_with("__"),
                    "{title}: ${var} is not a variable of the dashboard"
                );
            }
        }
    }
    for a in d["annotations"]["list"].as_array().unwrap() {
        assert!(a["name"].is_string() && a["datasource"].is_object() && a["enable"].is_boolean());
    }
}

/// `$name` and `${name}` in an expression.
fn variables_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find('$') {
        rest = &rest[i + 1..];
        let name: String = rest
            .trim_start_matches('{')
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.push(name);
        }
    }
    out
}

/// Our own Prometheus: 1 s scrapes and rule evaluation, the shipped rules loaded.
fn prometheus(
    dir: &Path,
    serve_port: u16,
    ingest_port: u16,
    broker: Option<&str>,
) -> Option<(KillOnDrop, String)> {
    let port = free_port();
    let broker_job = broker
        .map(|b| {
            format!("  - job_name: {BROKER_JOB}\n    static_configs:\n      - targets: ['{b}']\n")
        })
        .unwrap_or_default();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: {SERVE_JOB}\n    static_configs:\n      - targets: ['127.0.0.1:{serve_port}']\n  - job_name: {INGEST_JOB}\n    static_configs:\n      - targets: ['127.0.0.1:{ingest_port}']\n{broker_job}",
            asset(RULES).display()
        ),
    )
    .unwrap();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
        .spawn();
    match child {
        Ok(c) => Some((KillOnDrop(c), format!("http://127.0.0.1:{port}"))),
        Err(e) if !required() => {
            eprintln!("SKIP: prometheus not available ({e})");
            None
        }
        Err(e) => panic!("prometheus is required (IDEMWATCH_REQUIRE_SERVICES=1): {e}"),
    }
}

/// RabbitMQ's exporter as host:port when it answers (skipped, or a failure in CI).
async fn rabbitmq_exporter() -> Option<String> {
    let target = std::env::var("IDEMWATCH_RABBITMQ_PROMETHEUS")
        .unwrap_or_else(|_| "127.0.0.1:15692".to_string());
    let answer = reqwest::Client::new()
        .get(format!("http://{target}/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    match answer {
        Ok(r) if r.status().is_success() => Some(target),
        other => {
            let why = match other {
                Ok(r) => format!("HTTP {}", r.status()),
                Err(e) => e.to_string(),
            };
            assert!(
                !required(),
                "RabbitMQ's exporter at {target} is required (IDEMWATCH_REQUIRE_SERVICES=1; .ci/run enables rabbitmq_prometheus): {why}"
            );
            eprintln!(
                "SKIP: the broker panels: RabbitMQ's exporter at {target} does not answer ({why})"
            );
            None
        }
    }
}

/// One API call's `data`; None while the server does not answer (it is starting).
async fn try_api(prometheus: &str, path: &str, query: &[(&str, String)]) -> Option<Value> {
    let body: Value = reqwest::Client::new()
        .get(format!("{prometheus}{path}"))
        .query(query)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    assert_eq!(body["status"], "success", "{path} {query:?}: {body}");
    Some(body["data"].clone())
}

async fn api(prometheus: &str, path: &str, query: &[(&str, String)]) -> Value {
    try_api(prometheus, path, query)
        .await
        .unwrap_or_else(|| panic!("Prometheus does not answer {path} {query:?}"))
}

/// An instant query's first value (None while Prometheus is not up yet).
async fn instant(prometheus: &str, query: &str) -> Option<f64> {
    let data = try_api(prometheus, "/api/v1/query", &[("query", query.to_string())]).await?;
    data["result"][0]["value"][1].as_str()?.parse().ok()
}

async fn wait_for(prometheus: &str, query: &str, limit: Duration, ok: impl Fn(f64) -> bool) -> f64 {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = instant(prometheus, query).await.filter(|v| ok(*v)) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus never answered {query} as expected"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// What one query returned over the test's window: series with at least one
/// number, and the largest number.
#[derive(Debug, Clone, Copy)]
struct Returned {
    series: usize,
    max: f64,
}

async fn range(prometheus: &str, query: &str, from: f64, to: f64) -> Returned {
    let data = api(
        prometheus,
        "/api/v1/query_range",
        &[
            ("query", query.to_string()),
            ("start", format!("{from}")),
            ("end", format!("{to}")),
            ("step", "1".to_string()),
        ],
    )
    .await;
    let mut out = Returned {
        series: 0,
        max: f64::NEG_INFINITY,
    };
    for series in data["result"].as_array().unwrap() {
        let values: Vec<f64> = series["values"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v[1].as_str()?.parse::<f64>().ok())
            .filter(|v| !v.is_nan())
            .collect();
        if !values.is_empty() {
            out.series += 1;
            out.max = values.iter().copied().fold(out.max, f64::max);
        }
    }
    out
}

/// A regex-quoted value, as Grafana's Prometheus datasource quotes one.
fn regex_escape(value: &str) -> String {
    value
        .chars()
        .flat_map(|c| {
            let special = "\\^$.|?*+()[]{}".contains(c);
            special.then_some('\\').into_iter().chain([c])
        })
        .collect()
}

/// Grafana's substitution: `$name` / `${name}` by the variable's value (several
/// values as `(a|b)`), `$__rate_interval` by what Grafana gives a 15 s scrape.
fn substitute(expr: &str, values: &BTreeMap<String, String>) -> String {
    let mut out = expr.replace("$__rate_interval", "1m");
    // Longest names first: `$consumer` before a `$c` would be.
    let mut names: Vec<&String> = values.keys().collect();
    names.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for name in names {
        out = out
            .replace(&format!("${{{name}}}"), &values[name])
            .replace(&format!("${name}"), &values[name]);
    }
    out
}

/// Every query variable resolved as Grafana resolves `label_values(SELECTOR,
/// LABEL)` (the label values API), in order, each seeing the ones before; "All"
/// selected.
async fn resolve_variables(
    prometheus: &str,
    dashboard: &Value,
    with_broker: bool,
) -> BTreeMap<String, String> {
    let mut values = BTreeMap::new();
    for v in dashboard["templating"]["list"].as_array().unwrap() {
        let name = v["name"].as_str().unwrap();
        if v["type"] != "query" || (name == grafana::BROKER && !with_broker) {
            continue;
        }
        let definition = v["definition"].as_str().unwrap();
        let inner = definition
            .strip_prefix("label_values(")
            .and_then(|s| s.strip_suffix(')'))
            .unwrap_or_else(|| panic!("{name}: label_values(…) expected: {definition}"));
        let (selector, label) = inner
            .rsplit_once(',')
            .expect("label_values(SELECTOR, LABEL)");
        let selector = substitute(selector.trim(), &values);
        let data = api(
            prometheus,
            &format!("/api/v1/label/{}/values", label.trim()),
            &[("match[]", selector.clone())],
        )
        .await;
        let found: Vec<String> = data
            .as_array()
            .unwrap()
            .iter()
            .map(|s| regex_escape(s.as_str().unwrap()))
            .collect();
        assert!(
            !found.is_empty(),
            "the {name} variable finds no value ({selector})"
        );
        let value = if found.len() == 1 {
            found[0].clone()
        } else {
            format!("({})", found.join("|"))
        };
        println!("variable ${name} = {value}");
        values.insert(name.to_string(), value);
    }
    values
}

/// The database and queue every process of the run shares, and its log.
struct Run<'a> {
    db: &'a TestDb,
    queue: String,
    log: PathBuf,
}

/// `idemwatch ARGS` on the run's database and queue.
fn cli(run: &Run<'_>, args: &[&str]) -> std::process::Output {
    Command::new(idemwatch_bin())
        .args(args)
        .env("IDEMWATCH_DB", &run.db.url)
        .env("IDEMWATCH_QUEUE", &run.queue)
        .env("IDEMWATCH_LOG_FILE", &run.log)
        .output()
        .expect("run idemwatch")
}

/// `serve` on the run's database and queue; its SMS and ERP calls to `provider`
/// (the embedded sandbox without).
fn serve(run: &Run<'_>, port: u16, provider: Option<&str>) -> KillOnDrop {
    let mut command = Command::new(idemwatch_bin());
    command.env_remove(idemwatch::engine::ENV_SMS_URL);
    if let Some(url) = provider {
        command.env(idemwatch::engine::ENV_SMS_URL, url);
    }
    KillOnDrop(
        command
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .env("IDEMWATCH_DB", &run.db.url)
            .env("IDEMWATCH_QUEUE", &run.queue)
            .env("IDEMWATCH_LOG_FILE", &run.log)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start serve"),
    )
}

/// `idemwatch sms-sandbox` on a free port, a process of its own: it keeps the keys
/// it answered while the test's stores come and go. (The process, its base URL.)
async fn sms_sandbox(dir: &Path) -> (KillOnDrop, String) {
    let port = free_port();
    let child = Command::new(idemwatch_bin())
        .args(["sms-sandbox", "--listen", &format!("127.0.0.1:{port}")])
        .env("IDEMWATCH_LOG_FILE", dir.join("sandbox.log"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("sandbox.stderr")).unwrap())
        .spawn()
        .expect("start the SMS sandbox");
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while reachable(&url).is_err() {
        assert!(Instant::now() < deadline, "the SMS sandbox did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (KillOnDrop(child), url)
}

/// `trace` published and consumed on a second store (a SQLite file of the run's and
/// its embedded queue) whose SMS and webhooks go to `provider`: what a second
/// deployment on another database, or a purged claims table, would have sent.
fn second_store_run(dir: &Path, trace: &Path, provider: &str) {
    let db = format!("sqlite://{}", dir.join("second-store.db").display());
    for args in [
        &["publish", trace.to_str().unwrap()][..],
        &["consume", "--until-idle"],
    ] {
        let out = Command::new(idemwatch_bin())
            .args(args)
            .env("IDEMWATCH_DB", &db)
            .env_remove("IDEMWATCH_QUEUE")
            .env(idemwatch::engine::ENV_SMS_URL, provider)
            .env("IDEMWATCH_LOG_FILE", dir.join("second-store.log"))
            .output()
            .expect("run idemwatch");
        assert!(
            out.status.success(),
            "{args:?} on the second store: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The devices' topic filter on the test's private broker, and the ingest's session.
const DEVICE_TOPICS: &str = "fleet/+/events";
const INGEST_CLIENT_ID: &str = "idemwatch-grafana-test";

/// `idemwatch ingest mqtt --listen` from `broker` onto the run's queue (its door's
/// dead letters in the run's database).
fn ingest(run: &Run<'_>, broker: &str, port: u16) -> KillOnDrop {
    KillOnDrop(
        Command::new(idemwatch_bin())
            .args(["ingest", "mqtt", "--broker", broker.trim_end_matches('/')])
            .args(["--topic", DEVICE_TOPICS, "--client-id", INGEST_CLIENT_ID])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("IDEMWATCH_DB", &run.db.url)
            .env("IDEMWATCH_QUEUE", &run.queue)
            .env("IDEMWATCH_LOG_FILE", &run.log)
            .env_remove("IDEMWATCH_MQTT_PASSWORD")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start ingest mqtt"),
    )
}

/// One device message, QoS 1, as a vehicle publishes it.
fn device_publish(broker: &PrivateMosquitto, body: &str) {
    let published = Command::new("mosquitto_pub")
        .args(["-h", "127.0.0.1", "-p", &broker.port.to_string(), "-q", "1"])
        .args(["-t", "fleet/GRAFANA-MQTT/events", "-m", body])
        .status()
        .expect("mosquitto_pub (Debian package mosquitto-clients)");
    assert!(published.success());
}

/// The panels the trace must move above zero, every query of each (the others
/// return their series, at 0 where nothing happened to them).
const MOVED_BY_THE_TRACE: [&str; 7] = [
    "Duplicate ratio per consumer",
    "Processed / s",
    "Duplicates dropped / s",
    "Redelivered / s",
    "Dead-lettered / s",
    "Duplicate ratio in the deploy window",
    "Duplicates dropped in the deploy window",
];
/// The panels the stall, the repeat calls and the device ingress must move above
/// zero, every query of each (docs/CONTRACT.md §9): the provider's outage pauses two
/// consumers; its return brings `provider_retry` and `unexpected` repeat calls; the
/// ingest connects, takes messages in, dead-letters the bad one, loses its link
/// (an error) and gets three messages again with DUP.
const MOVED_BY_THE_STALL_AND_THE_DEVICES: [&str; 10] = [
    "Paused consumers",
    "Paused for, by cause",
    "Failed tries in the pause",
    "Infrastructure errors / s by kind",
    "Provider repeat calls / s by reason",
    "Ingress connected",
    "Ingress messages / s",
    "DUP-flag share",
    "Ingress dead letters / s by reason",
    "Ingress errors / s by kind",
];
/// With the run's queue on RabbitMQ, the broker's own count of its redeliveries.
const BROKER_REDELIVERED: &str = "rabbitmq_global_messages_redelivered_total";

/// The consumers' queues on RabbitMQ under a prefix of this run's own (`?prefix=`:
/// its own exchange and dead-letter queue too), so that the broker panels count the
/// trace's deliveries and redeliveries; None (the embedded queue) without a broker.
async fn broker_queue() -> Option<String> {
    let url = common::amqp::amqp_url().await?;
    let sep = if url.contains('?') { '&' } else { '?' };
    Some(format!(
        "{url}{sep}prefix=idw_grafana_{}",
        std::process::id()
    ))
}

/// Remove the run's queues and exchanges from the broker.
async fn remove_broker_queues(queue_url: &str) {
    let Ok(q) = idemwatch::engine::queue::amqp::AmqpQueue::open(queue_url).await else {
        return;
    };
    for consumer in idemwatch::engine::consumers::FLEET_CONSUMERS {
        let _ = q.delete(consumer).await;
    }
    let _ = q.remove_topology().await;
    q.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_returns_data_from_a_real_prometheus_scraping_serve() {
    let Some(db) = TestDb::new(Kind::Postgres).await else {
        return;
    };
    let dir = db.env.path("run");
    std::fs::create_dir_all(&dir).unwrap();
    let exporter = rabbitmq_exporter().await;
    let amqp = match exporter {
        Some(_) => broker_queue().await,
        None => None,
    };
    let run = Run {
        db: &db,
        queue: amqp.clone().unwrap_or_else(|| db.queue_url()),
        log: dir.join("idemwatch.log"),
    };
    // A fleet trace in which one message in five comes twice, and a line that is no
    // JSON (a dead letter). The first 200 lines during the provider's outage, the next
    // 100 once it is back, the rest after the deploy.
    let trace = cli(
        &run,
        &[
            "simulate",
            "--messages",
            "400",
            "--vehicles",
            "6",
            "--redelivery-rate",
            "0.2",
        ],
    );
    assert!(trace.status.success());
    let lines: Vec<&str> = std::str::from_utf8(&trace.stdout)
        .unwrap()
        .lines()
        .collect();
    let write = |name: &str, part: &[&str], extra: &str| {
        let path = dir.join(name);
        std::fs::write(&path, format!("{}\n{extra}", part.join("\n"))).unwrap();
        path
    };
    let outage_part = write("outage.jsonl", &lines[..200], "this line is no JSON\n");
    let healed_part = write("healed.jsonl", &lines[200..300], "");
    let second_part = write("after.jsonl", &lines[300..], "");

    // The provider: a sandbox of its own that has already answered the first 300
    // lines' SMS and webhooks for a second store (a SQLite database of the run's
    // own), so that each of those keys is a replay for the run's PostgreSQL store.
    let (_sandbox, sandbox_url) = sms_sandbox(&dir).await;
    let before_deploy = write("second-store.jsonl", &lines[..300], "");
    second_store_run(&dir, &before_deploy, &sandbox_url);
    // The first serve reaches it through a proxy that resets every call until the
    // stall has been seen.
    let provider_link = FaultProxy::in_front_of(&sandbox_url, 80).await;
    provider_link.cut();
    let provider_url = provider_link
        .url_through(&sandbox_url)
        .trim_end_matches('/')
        .to_string();

    // The device ingress: a private Mosquitto behind a proxy of the test's own.
    let Some(mosquitto) = PrivateMosquitto::new(&db.env) else {
        return db.cleanup().await;
    };
    let mqtt_link = FaultProxy::in_front_of(&mosquitto.url(), 1883).await;

    let serve_port = free_port();
    let ingest_port = free_port();
    let from = chrono::Utc::now();
    let mut first = serve(&run, serve_port, Some(&provider_url));
    let Some((_prometheus, url)) = prometheus(&dir, serve_port, ingest_port, exporter.as_deref())
    else {
        return db.cleanup().await;
    };
    let job = format!(r#"job="{SERVE_JOB}""#);
    wait_for(
        &url,
        &format!("up{{{job}}}"),
        Duration::from_secs(60),
        |v| v == 1.0,
    )
    .await;

    assert!(cli(&run, &["publish", outage_part.to_str().unwrap()])
        .status
        .success());
    for counter in ["idem_duplicate_dropped_total", "idem_dead_lettered_total"] {
        let query = format!("sum({counter}{{{job}}})");
        wait_for(&url, &query, Duration::from_secs(90), |v| v > 0.0).await;
    }

    // The stall: the SMS and ERP consumers pause under `provider`, retrying, and
    // their calls count as infrastructure errors; the other two go on.
    let n = MetricNames::default();
    let rate1m = format!("rate{}", promql::duration(WINDOW_1M));
    for query in [
        format!(r#"max({}{{{job},cause="provider"}})"#, n.paused),
        format!("max({}{{{job}}})", n.pause_retries),
        format!(
            "max({}{{{job}}})",
            promql::recorded_at(promql::CONSUMER_CAUSE, promql::PAUSED_FOR_STEM, "seconds")
        ),
        format!(
            r#"sum({}{{{job},kind="provider_unreachable"}})"#,
            promql::recorded_at(promql::CONSUMER_KIND, names::INFRA_ERRORS.family, &rate1m)
        ),
    ] {
        wait_for(&url, &query, Duration::from_secs(90), |v| v > 0.0).await;
    }

    // Meanwhile the devices: three messages and a bad one, then three more while the
    // ingest's link is frozen, which the broker sends again with DUP once the link
    // has been reset and the ingest is back on its session.
    let ingest_job = format!(r#"job="{INGEST_JOB}""#);
    let mut ingest = ingest(&run, &mqtt_link.url_through(&mosquitto.url()), ingest_port);
    wait_for(
        &url,
        &format!("max({}{{{ingest_job}}})", n.ingress_connected),
        Duration::from_secs(60),
        |v| v == 1.0,
    )
    .await;
    let devices: Vec<String> = lines[..6]
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let mut event: serde_json::Value = serde_json::from_str(line).unwrap();
            event["device_id"] = format!("GRAFANA-MQTT-{i}").into();
            event.to_string()
        })
        .collect();
    for body in devices[..3].iter().map(String::as_str).chain(["{ no JSON"]) {
        device_publish(&mosquitto, body);
    }
    let ingested = format!("sum({}{{{ingest_job}}})", n.ingress_messages);
    wait_for(&url, &ingested, Duration::from_secs(60), |v| v >= 4.0).await;
    mqtt_link.inject(Fault::Freeze);
    for body in &devices[3..] {
        device_publish(&mosquitto, body);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    mqtt_link.cut();
    tokio::time::sleep(Duration::from_secs(1)).await;
    mqtt_link.heal();
    for query in [
        format!(
            r#"sum({}{{{ingest_job},dup_flag="true"}})"#,
            n.ingress_messages
        ),
        format!(
            "sum({}{{{ingest_job}}})",
            promql::recorded_at(promql::SOURCE, promql::INGRESS_DUP_FLAG_RATIO, &rate1m)
        ),
        format!(
            "sum({}{{{ingest_job}}})",
            promql::recorded_at(
                promql::SOURCE_REASON,
                names::INGRESS_DEAD_LETTERED.family,
                &rate1m
            )
        ),
        format!(
            "sum({}{{{ingest_job}}})",
            promql::recorded_at(promql::SOURCE_KIND, names::INGRESS_ERRORS.family, &rate1m)
        ),
    ] {
        wait_for(&url, &query, Duration::from_secs(60), |v| v > 0.0).await;
    }

    // The provider back: the calls given back during the outage find their keys
    // answered (provider_retry), and the next lines' keys, new to this store, too
    // (unexpected: the second store's sends).
    provider_link.heal();
    assert!(cli(&run, &["publish", healed_part.to_str().unwrap()])
        .status
        .success());
    let repeats = promql::recorded_at(
        promql::CONSUMER_REASON,
        names::PROVIDER_REPEAT_CALLS.family,
        &rate1m,
    );
    for reason in ["provider_retry", promql::REPEAT_UNEXPECTED] {
        let query = format!(r#"sum({repeats}{{{job},reason="{reason}"}})"#);
        wait_for(&url, &query, Duration::from_secs(120), |v| v > 0.0).await;
    }
    let start_time = format!("max(process_start_time_seconds{{{job}}})");
    let first_start = instant(&url, &start_time).await.unwrap();

    // A deploy: its marker, the process gone; meanwhile a consumer takes the rest and
    // dies after its commit, before its ack.
    let marked = cli(&run, &["mark", "deploy", "--label", "v2.0 (grafana test)"]);
    assert!(
        marked.status.success(),
        "{}",
        String::from_utf8_lossy(&marked.stderr)
    );
    first.stop();
    assert!(cli(&run, &["publish", second_part.to_str().unwrap()])
        .status
        .success());
    let crashed = cli(
        &run,
        &[
            "consume",
            "--until-idle",
            "--crash-at",
            "after-commit-before-ack",
            "--crash-abort",
            "--visibility-ms",
            "1000",
        ],
    );
    assert!(
        !crashed.status.success(),
        "the consumer died at its crash point"
    );

    // The new process takes the unacked batch again: redelivered, deduplicated.
    let mut second = serve(&run, serve_port, None);
    wait_for(&url, &start_time, Duration::from_secs(60), |v| {
        v > first_start
    })
    .await;
    for query in [
        format!("sum(idem_messages_redelivered_total{{{job}}})"),
        format!("sum(instance_consumer:idem_messages_redelivered:rate1m{{{job}}})"),
        // The deploy's window (the new process's first 10 minutes) counts the
        // unacked batch it dropped as duplicates: the deploy's own cost.
        format!(
            "sum({}{{{job}}})",
            idemwatch::monitor::promql::deploy_recorded(
                idemwatch::monitor::promql::DEPLOY_DUPLICATES
            )
        ),
    ] {
        wait_for(&url, &query, Duration::from_secs(90), |v| v > 0.0).await;
    }
    if exporter.is_some() {
        let broker_job = format!(r#"job="{BROKER_JOB}""#);
        wait_for(
            &url,
            &format!("up{{{broker_job}}}"),
            Duration::from_secs(30),
            |v| v == 1.0,
        )
        .await;
        if amqp.is_some() {
            let query = format!("sum(rate({BROKER_REDELIVERED}{{{broker_job}}}[1m]))");
            wait_for(&url, &query, Duration::from_secs(30), |v| v > 0.0).await;
        }
    }
    let to = chrono::Utc::now();
    // Whole seconds around the run: the last sample a wait above saw is inside.
    let (t0, t1) = (from.timestamp() as f64, (to.timestamp() + 1) as f64);

    // Every panel's every query, with the variables as Grafana would set them.
    let dashboard = shipped();
    let values = resolve_variables(&url, &dashboard, exporter.is_some()).await;
    assert_eq!(values[grafana::JOB], SERVE_JOB);
    assert_eq!(
        values[grafana::CONSUMER].matches('|').count(),
        3,
        "four consumers"
    );
    let mut queried = 0;
    for panel in query_panels(&dashboard) {
        let title = panel["title"].as_str().unwrap();
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            if !values.contains_key(grafana::BROKER)
                && expr.contains(&format!("${}", grafana::BROKER))
            {
                continue;
            }
            let query = substitute(expr, &values);
            let returned = range(&url, &query, t0, t1).await;
            println!(
                "panel {title:?} {}: {} series, max {}",
                target["refId"].as_str().unwrap(),
                returned.series,
                returned.max
            );
            queried += 1;
            assert!(returned.series > 0, "{title}: no data for {query}");
            let moved = MOVED_BY_THE_TRACE.contains(&title)
                || MOVED_BY_THE_STALL_AND_THE_DEVICES.contains(&title)
                || (amqp.is_some() && expr.contains(BROKER_REDELIVERED));
            if moved {
                assert!(
                    returned.max > 0.0,
                    "{title}: the trace did not move {query}"
                );
            }
        }
    }
    let titles: Vec<&str> = query_panels(&dashboard)
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    assert!(MOVED_BY_THE_TRACE.iter().all(|t| titles.contains(t)));
    assert!(MOVED_BY_THE_STALL_AND_THE_DEVICES
        .iter()
        .all(|t| titles.contains(t)));
    println!("{queried} queries of {} panels", titles.len());

    // The annotations: the restart from Prometheus, the deploy from the database.
    let annotations = dashboard["annotations"]["list"].as_array().unwrap();
    let restarts = annotations
        .iter()
        .find_map(|a| a["expr"].as_str())
        .expect("a Prometheus annotation");
    let restarts = range(&url, &substitute(restarts, &values), t0, t1).await;
    println!("annotation restarts: {} series", restarts.series);
    assert!(
        restarts.series > 0 && restarts.max > 0.0,
        "the restart is annotated"
    );
    let sql = annotations
        .iter()
        .find_map(|a| a["target"]["rawSql"].as_str())
        .expect("the markers annotation");
    let secs =
        |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let window = format!(
        "at BETWEEN '{}' AND '{}'",
        secs(from),
        secs(to + chrono::Duration::seconds(1))
    );
    let sql = sql.replace("$__timeFilter(at)", &window);
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let rows = sqlx::query(&sql).fetch_all(&mut conn).await.unwrap();
    let markers: Vec<(String, String)> = rows
        .iter()
        .map(|r| (r.get::<String, _>("text"), r.get::<String, _>("tags")))
        .collect();
    println!("annotation deploys: {} rows {markers:?}", rows.len());
    assert!(
        markers.contains(&("v2.0 (grafana test)".to_string(), "deploy".to_string())),
        "{markers:?}"
    );
    drop(conn);
    // Stopped first: a running consumer declares its queue again once it is deleted.
    second.stop();
    ingest.stop();
    if let Some(queue) = &amqp {
        remove_broker_queues(queue).await;
    }
    db.cleanup().await;
}
