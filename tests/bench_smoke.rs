//! Tiny runs of the benchmark commands, to keep them working (the figures come from
//! release builds, see BENCHMARKS.md; nothing here is timed).

mod common;

use common::{run_cli, TempEnv};

fn json(env: &TempEnv, args: &[&str]) -> serde_json::Value {
    let (code, out, err) = run_cli(env, args);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// `bench engine --json` on a fresh SQLite database, with `args` (`--batch` included).
fn bench_engine(args: &[&str]) -> serde_json::Value {
    let env = TempEnv::new();
    let db = env.db_url();
    let head = ["bench", "engine", "--db", &db, "--json"];
    json(&env, &[&head[..], args].concat())
}

#[test]
fn bench_engine_counts_the_same_effects_both_ways() {
    let r = bench_engine(&[
        "--batch",
        "10",
        "--messages",
        "300",
        "--dup-rate",
        "0.1",
        "--runs",
        "2",
    ]);
    assert_eq!(r["runs"].as_array().map(Vec::len), Some(2), "{r}");
    assert_eq!(r["queue_only"]["messages"], 300, "{r}");
    assert_eq!(r["raw"]["applied"], r["engine"]["applied"], "{r}");
    assert_eq!(r["raw"]["duplicates"], r["engine"]["duplicates"], "{r}");
    assert_eq!(
        r["raw"]["applied"].as_u64().unwrap() + r["raw"]["duplicates"].as_u64().unwrap(),
        300
    );
    assert!(r["ratio"].as_f64().unwrap() > 0.0);
    // serve's prefetch of 32 in whole batches of 10.
    assert_eq!(r["lease_size"], 40, "{r}");
}

#[test]
fn bench_engine_reports_how_throughput_scales_with_the_batch() {
    let r = bench_engine(&["--messages", "60", "--batch", "5,1", "--runs", "1"]);
    let each = |field: &str| -> Vec<u64> {
        r["batches"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b[field].as_u64().unwrap())
            .collect()
    };
    assert_eq!(each("batch"), [1, 5], "{r}");
    // serve's prefetch of 32 in whole batches.
    assert_eq!(each("lease_size"), [32, 35], "{r}");
    assert_eq!(r["scaling"][0]["from_batch"], 1);
    assert_eq!(r["scaling"][0]["to_batch"], 5);
    assert!(r["scaling"][0]["engine"].as_f64().unwrap() > 0.0, "{r}");
}

#[test]
fn bench_engine_relaxed_reports_its_durability() {
    let r = bench_engine(&[
        "--batch",
        "10",
        "--messages",
        "50",
        "--runs",
        "1",
        "--durability",
        "relaxed",
    ]);
    let durability = r["durability"].as_str().unwrap_or_default();
    assert!(
        durability.starts_with("relaxed: SQLite WAL, synchronous=NORMAL"),
        "{r}"
    );
    assert_eq!(r["raw"]["applied"], r["engine"]["applied"], "{r}");
}

/// A baseline run beside each pair (`field`, with engine ÷ it in `ratio`): the same
/// pattern on the same keys as the sqlx raw run, so the same effects, and a ratio in
/// every pair and for the median.
fn assert_a_baseline_beside_raw(r: &serde_json::Value, field: &str, ratio: &str) {
    let b = &r[field];
    assert_eq!(b["applied"], r["raw"]["applied"], "{r}");
    assert_eq!(b["duplicates"], r["raw"]["duplicates"], "{r}");
    assert!(b["messages_per_second"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r[ratio].as_f64().unwrap() > 0.0, "{r}");
    let pairs = r["runs"].as_array().unwrap();
    assert!(pairs.iter().all(|p| p[ratio].as_f64().is_some()), "{r}");
}

#[test]
fn bench_engine_reports_the_rusqlite_baseline_beside_the_sqlx_one_on_sqlite() {
    let r = bench_engine(&["--batch", "10", "--messages", "200", "--runs", "2"]);
    assert_a_baseline_beside_raw(&r, "raw_rusqlite", "ratio_rusqlite");
}

/// The breakdown beside each pair: raw's transactions overlapped with the queue's
/// leases and acks write the same effects as raw (its own counters, the same keys), and
/// the queue alone takes every message.
#[test]
fn bench_engine_reports_raw_with_the_queue_and_the_queue_alone() {
    let r = bench_engine(&["--batch", "10", "--messages", "200", "--runs", "2"]);
    assert_a_baseline_beside_raw(&r, "raw_with_queue", "ratio_with_queue");
    assert_eq!(r["raw_with_queue"]["messages"], 200, "{r}");
    assert_eq!(r["queue_only"]["messages"], 200, "{r}");
}

#[test]
fn bench_pipeline_drains_the_trace_through_four_consumers_and_sends_each_sms_once() {
    let env = TempEnv::new();
    let db = env.db_url();
    let r = json(
        &env,
        &[
            "bench",
            "pipeline",
            "--db",
            &db,
            "--messages",
            "400",
            "--vehicles",
            "10",
            "--provider-latency",
            "5ms",
            "--batch",
            "20",
            "--json",
        ],
    );
    let trace = &r["trace"];
    assert_eq!(trace["messages"], 400, "{r}");
    let engine = &r["engine"];
    let consumers = engine["consumers"].as_array().unwrap();
    assert_eq!(consumers.len(), 4, "{r}");
    for c in consumers {
        // Every message settled by every consumer, none dead-lettered.
        assert_eq!(c["messages"], 400, "{c}");
        assert_eq!(c["dead_lettered"], 0, "{c}");
        assert!(c["p99_ms"].as_f64().unwrap() >= c["p50_ms"].as_f64().unwrap());
    }
    assert!(trace["sms_expected"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(engine["sms_sent"], trace["sms_expected"], "{r}");
    assert_eq!(engine["webhooks_sent"], trace["webhooks_expected"], "{r}");
    assert_eq!(engine["exactly_once"], true, "{r}");
    assert!(engine["peak_rss_mib"].as_f64().unwrap() > 0.0, "{r}");
    // The peak split into the bench's own data (measured before the engine opened)
    // and what the engine added on top of it.
    let (bench, own) = (
        engine["bench_rss_mib"].as_f64().unwrap(),
        engine["engine_rss_mib"].as_f64().unwrap(),
    );
    assert!(bench > 0.0 && own >= 0.0, "{r}");
    assert!(
        (bench + own - engine["peak_rss_mib"].as_f64().unwrap()).abs() < 0.01,
        "{r}"
    );
    assert!(engine["messages_per_second"].as_f64().unwrap() > 0.0, "{r}");
    assert_eq!(
        r["raw"]["consumers"].as_array().map(Vec::len),
        Some(4),
        "{r}"
    );
    assert!(r["ratio"].as_f64().unwrap() > 0.0, "{r}");
    // On SQLite the C-API baseline runs beside the sqlx one.
    assert!(r["ratio_rusqlite"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["load_average_start"].is_array(), "{r}");
}

#[test]
fn bench_scrape_parses_every_sample() {
    let env = TempEnv::new();
    let r = json(
        &env,
        &[
            "bench",
            "scrape",
            "--samples",
            "1000",
            "--iterations",
            "3",
            "--json",
        ],
    );
    assert!(r["samples"].as_u64().unwrap() >= 1000, "{r}");
    assert!(r["http_scrape_us"].as_f64().unwrap() > 0.0);
    assert!(r["http_scrape_parse_us"].as_f64().unwrap() > 0.0, "{r}");
    // The trackers are timed in the steady state of an hour of one-second polls.
    assert_eq!(r["poll_interval_s"].as_u64(), Some(1), "{r}");
    assert_eq!(r["warm_history_s"].as_u64(), Some(3600), "{r}");
    // The exporter runs in a child process: its encoding is reported apart, and
    // the dashboard's CPU (in 10 ms ticks, so maybe 0 over 3 iterations) beside it.
    assert!(r["exporter_encode_us"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["http_scrape_cpu_us"].as_f64().unwrap() >= 0.0, "{r}");
}

#[test]
fn bench_tui_polls_its_targets() {
    let env = TempEnv::new();
    let r = json(
        &env,
        &[
            "bench",
            "tui",
            "--targets",
            "2",
            "--duration",
            "2s",
            "--json",
        ],
    );
    assert!(r["snapshots"].as_u64().unwrap() >= 1, "{r}");
    assert!(r["peak_rss_mib"].as_f64().unwrap() > 0.0);
}
