//! The exposition parser on our own engine's output (OpenMetrics from
//! prometheus-client) and on classic Prometheus text.

use std::time::Instant;

use idemwatch::engine::envelope::RejectReason;
use idemwatch::engine::metrics::{EffectResult, Metrics};
use idemwatch::monitor::prometheus::{parse, MetricType};

#[test]
fn reads_the_engines_own_exposition() {
    let m = Metrics::new();
    m.register_consumer("zone-exit-sms");
    for _ in 0..3 {
        m.processed("zone-exit-sms");
    }
    m.duplicate_dropped("zone-exit-sms");
    m.dead_lettered("zone-exit-sms", RejectReason::KeyConflict);
    m.side_effect("zone-exit-sms", EffectResult::Sent);
    m.observe_handler("zone-exit-sms", 0.002);
    let e = parse(&m.encode()).expect("the engine's exposition parses");
    assert!(e.saw_eof, "prometheus-client ends with # EOF");
    let processed: Vec<_> = e.named("idem_messages_processed_total").collect();
    assert_eq!(processed.len(), 1);
    assert_eq!(processed[0].label("consumer"), Some("zone-exit-sms"));
    assert_eq!(processed[0].value, 3.0);
    assert_eq!(
        e.type_of("idem_messages_processed_total"),
        Some(MetricType::Counter)
    );
    assert_eq!(
        e.type_of("idem_handler_duration_seconds_bucket"),
        Some(MetricType::Histogram)
    );
    let dead = e.named("idem_dead_lettered_total").next().unwrap();
    assert_eq!(dead.label("reason"), Some("key_conflict"));
    assert!(e.first("process_start_time_seconds").unwrap() > 1.7e9);
    let inf_bucket = e
        .named("idem_handler_duration_seconds_bucket")
        .find(|s| s.label("le") == Some("+Inf"))
        .expect("a +Inf bucket");
    assert_eq!(inf_bucket.value, 1.0);
}

const CLASSIC: &str = r#"# HELP http_requests_total The total number of HTTP requests.
# TYPE http_requests_total counter
http_requests_total{method="post",code="200"} 1027 1395066363000
http_requests_total{method="post",code="400"}    3 1395066363000

# A free comment
msdos_file_access_time_seconds{path="C:\\DIR\\FILE.TXT",error="Cannot find file:\n\"FILE.TXT\""} 1.458255915e9
metric_without_timestamp_and_labels 12.47
something_weird{problem="division by zero"} +Inf -3982045
nan_gauge NaN
neg_inf -Inf
braces_in_value{query="{a=\"b\"}",} 1
# TYPE rpc_duration_seconds summary
rpc_duration_seconds{quantile="0.5"} 4773
rpc_duration_seconds_sum 1.7560473e+07
rpc_duration_seconds_count 2693
"#;

#[test]
fn reads_classic_prometheus_text() {
    let e = parse(CLASSIC).expect("classic text parses");
    assert!(!e.saw_eof);
    assert_eq!(e.samples.len(), 11);
    let first = &e.samples[0];
    assert_eq!(first.label("code"), Some("200"));
    assert_eq!(first.timestamp, Some(1395066363000.0));
    let dos = e.named("msdos_file_access_time_seconds").next().unwrap();
    assert_eq!(dos.label("path"), Some(r"C:\DIR\FILE.TXT"));
    assert_eq!(dos.label("error"), Some("Cannot find file:\n\"FILE.TXT\""));
    assert_eq!(e.first("something_weird"), Some(f64::INFINITY));
    assert_eq!(
        e.named("something_weird").next().unwrap().timestamp,
        Some(-3982045.0)
    );
    assert!(e.first("nan_gauge").unwrap().is_nan());
    assert_eq!(e.first("neg_inf"), Some(f64::NEG_INFINITY));
    assert_eq!(
        e.named("braces_in_value").next().unwrap().label("query"),
        Some("{a=\"b\"}")
    );
    assert_eq!(
        e.type_of("rpc_duration_seconds_count"),
        Some(MetricType::Summary)
    );
    assert_eq!(e.first("metric_without_timestamp_and_labels"), Some(12.47));
}

#[test]
fn openmetrics_exemplars_and_created_lines_are_read() {
    let text = "# TYPE foo counter\nfoo_total{a=\"1\"} 17 # {trace_id=\"x\"} 1 1.5\nfoo_created{a=\"1\"} 1.7e9\n# EOF\n";
    let e = parse(text).unwrap();
    assert_eq!(e.first("foo_total"), Some(17.0));
    assert_eq!(e.first("foo_created"), Some(1.7e9));
    assert!(e.saw_eof);
}

#[test]
fn malformed_lines_are_refused() {
    for bad in [
        "m{a=\"unterminated} 1",
        "m{a=b} 1",
        "m{=\"x\"} 1",
        "m",
        "m one",
        "m 1 2 3",
        "{a=\"b\"} 1",
        "m{a=\"\\q\"} 1",
        "# TYPE lonely",
    ] {
        assert!(parse(bad).is_err(), "accepted {bad:?}");
    }
}

/// 10,000 samples; the bound is loose in debug builds (unoptimised code is ~20x
/// slower) and 5 ms in optimised ones.
#[test]
fn ten_thousand_samples_parse_fast() {
    let mut text = String::from("# TYPE idem_messages_processed counter\n");
    for i in 0..10_000 {
        text.push_str(&format!(
            "idem_messages_processed_total{{consumer=\"consumer-{}\",shard=\"{}\"}} {}\n",
            i % 40,
            i,
            i * 7
        ));
    }
    let started = Instant::now();
    let e = parse(&text).unwrap();
    let took = started.elapsed();
    assert_eq!(e.samples.len(), 10_000);
    let limit_ms = if cfg!(debug_assertions) { 250 } else { 5 };
    assert!(
        took.as_millis() < limit_ms,
        "10k samples took {took:?} (limit {limit_ms} ms)"
    );
    eprintln!("10k samples parsed in {took:?}");
}
