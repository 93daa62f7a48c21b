//! The exposition parser on our own engine's output (OpenMetrics from
//! prometheus-client) and on classic Prometheus text.

use idemwatch_engine::consumers::risk_class;
use idemwatch_engine::envelope::RejectReason;
use idemwatch_engine::exporter;
use idemwatch_engine::metrics::{EffectResult, Metrics};
use idemwatch_monitor::prometheus::{parse, Format, MetricType, Parser, ScrapeLimits, Scraper};

#[test]
fn reads_the_engines_own_exposition() {
    let m = Metrics::new();
    m.register_consumer("zone-exit-sms", risk_class("zone-exit-sms"));
    for _ in 0..3 {
        m.processed("zone-exit-sms");
    }
    m.duplicate_dropped("zone-exit-sms");
    m.dead_lettered("zone-exit-sms", RejectReason::KeyConflict);
    m.side_effect("zone-exit-sms", EffectResult::Sent);
    m.observe_handler("zone-exit-sms", 0.002);
    let e = parse(&m.encode(), Format::OpenMetrics).expect("the engine's exposition parses");
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
    // Every reason is exported from the start (at 0), in the registry's order.
    let dead: Vec<_> = e
        .named("idem_dead_lettered_total")
        .filter(|s| s.value > 0.0)
        .collect();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].label("reason"), Some("key_conflict"));
    assert_eq!(dead[0].value, 1.0);
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
    let e = parse(CLASSIC, Format::PrometheusText).expect("classic text parses");
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
    let e = parse(text, Format::OpenMetrics).unwrap();
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
        "# TYPE lonely",
    ] {
        for (format, text) in [
            (Format::PrometheusText, format!("ok 1\n{bad}\n")),
            (Format::OpenMetrics, format!("ok 1\n{bad}\n# EOF\n")),
        ] {
            let err = parse(&text, format).expect_err(bad);
            assert_eq!(err.line, 2, "{format:?} {bad:?}: {err}");
        }
    }
}

/// 10,000 samples, each read back whole (how fast is `bench scrape`'s business, not
/// a test's).
#[test]
fn ten_thousand_samples_are_all_read() {
    let mut text = String::from("# TYPE idem_messages_processed counter\n");
    let eof = "# EOF\n";
    for i in 0..10_000 {
        text.push_str(&format!(
            "idem_messages_processed_total{{consumer=\"consumer-{}\",shard=\"{}\"}} {}\n",
            i % 40,
            i,
            i * 7
        ));
    }
    text.push_str(eof);
    let e = parse(&text, Format::OpenMetrics).unwrap();
    assert_eq!(e.samples.len(), 10_000);
    for (i, s) in e.samples.iter().enumerate() {
        assert_eq!(s.label("shard"), Some(i.to_string().as_str()));
        assert_eq!(
            s.label("consumer"),
            Some(format!("consumer-{}", i % 40).as_str())
        );
        assert_eq!(s.value, (i * 7) as f64);
    }
}

/// Texts with what a split can fall inside: CRLF ends, blank lines, comments,
/// escapes, multi-byte characters, invalid UTF-8, lines after `# EOF`, a last
/// line without a newline, and malformed lines (whose number must not move).
fn texts_to_split() -> Vec<Vec<u8>> {
    let m = Metrics::new();
    for c in ["zone-exit-sms", "state-upsert"] {
        m.register_consumer(c, risk_class(c));
        m.processed(c);
        m.dead_lettered(c, RejectReason::MalformedJson);
        m.observe_handler(c, 0.004);
    }
    let mut invalid = b"m{a=\"caf\xc3\xa9 \xff\xfe\"} 1\nn 2\n".to_vec();
    invalid.extend_from_slice("o{p=\"ğüşıöç\"} 3".as_bytes());
    vec![
        m.encode().into_bytes(),
        b"# TYPE a counter\r\na_total{x=\"1\"} 3\r\n\r\n  \n# HELP a what\na_total{x=\"q\\\"\\n\"} 4 1700000000\nb 5"
            .to_vec(),
        invalid,
        b"a 1\n# EOF\nthis is not parsed\n".to_vec(),
        b"a 1\nb 2\nc{broken 3\nd 4\n".to_vec(),
        b"\n\n\nm one\n".to_vec(),
        b"# TYPE lonely\n".to_vec(),
    ]
}

/// Feed `text` cut at `cuts` (positions), then finish.
fn fed(
    format: Format,
    text: &[u8],
    cuts: &[usize],
) -> Result<idemwatch_monitor::prometheus::Exposition, String> {
    let mut parser = Parser::new(format, ScrapeLimits::default());
    let mut from = 0;
    let mut fed = Ok(());
    for &cut in cuts.iter().chain([&text.len()]) {
        fed = fed.and_then(|()| parser.feed(&text[from..cut]));
        from = cut;
    }
    fed.and_then(|()| parser.finish())
        .map_err(|e| e.to_string())
}

proptest::proptest! {
    /// A body parsed as its pieces arrive, wherever they are cut, reads exactly as
    /// the whole body, in either grammar: same samples, types and terminator, or the
    /// same error at the same line. And as `parse` of the text, when it is text.
    #[test]
    fn a_body_parsed_in_pieces_reads_as_the_whole(
        which in 0usize..7,
        openmetrics: bool,
        cuts in proptest::collection::vec(0.0f64..1.0, 0..12),
    ) {
        let format = if openmetrics { Format::OpenMetrics } else { Format::PrometheusText };
        let text = &texts_to_split()[which];
        let whole = fed(format, text, &[]);
        if let Ok(text) = std::str::from_utf8(text) {
            proptest::prop_assert_eq!(&parse(text, format).map_err(|e| e.to_string()), &whole);
        }
        let mut cuts: Vec<usize> = cuts.iter().map(|c| (c * text.len() as f64) as usize).collect();
        cuts.sort_unstable();
        proptest::prop_assert_eq!(fed(format, text, &cuts), whole);
    }
}

/// The exporter streams a big registry in pieces (no Content-Length: chunked), the
/// body is byte for byte the encoding, and the scraper, parsing the pieces as they
/// come, reads what a parse of the whole encoding reads.
#[tokio::test]
async fn a_big_exposition_is_streamed_in_pieces_and_read_whole() {
    let metrics = std::sync::Arc::new(Metrics::new());
    for i in 0..200 {
        let c = format!("consumer-{i:03}");
        metrics.register_consumer(&c, None);
        metrics.processed(&c);
        metrics.observe_handler(&c, 0.002);
    }
    let encoded = metrics.encode();
    assert!(encoded.len() > 3 * 64 * 1024, "{} bytes", encoded.len());
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .expect("bind");
    let url = format!("http://{}/metrics", listener.local_addr().expect("addr"));
    let server = tokio::spawn(async move {
        let _ = axum::serve(exporter::no_delay(listener), exporter::router(metrics)).await;
    });

    let response = reqwest::Client::new()
        .get(&url)
        .header("accept", "application/openmetrics-text;version=1.0.0")
        .send()
        .await
        .expect("GET /metrics");
    assert!(
        response.content_length().is_none(),
        "{:?}",
        response.headers()
    );
    assert_eq!(
        response
            .headers()
            .get("transfer-encoding")
            .map(|v| v.as_bytes()),
        Some(&b"chunked"[..])
    );
    assert_eq!(response.text().await.expect("body"), encoded);

    let scraper =
        Scraper::new(std::time::Duration::from_secs(5), ScrapeLimits::default()).expect("client");
    let scraped = scraper.scrape("big", &url).await;
    assert_eq!(
        scraped.outcome,
        Ok(parse(&encoded, Format::OpenMetrics).expect("parses"))
    );
    server.abort();
}
