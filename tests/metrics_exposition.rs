//! `/metrics` of `idemwatch serve` over real HTTP, checked by `promtool check metrics`.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{idemwatch_bin, run_cli, KillOnDrop, TempEnv};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn required() -> bool {
    std::env::var("IDEMWATCH_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// `idemwatch serve` on a free port over the env's database and queue; killed on drop.
fn serve(env: &TempEnv, extra: &[&str]) -> (KillOnDrop, String) {
    let port = free_port();
    let child = Command::new(idemwatch_bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--db", &env.db_url(), "--queue", &env.queue_url()])
        .args(extra)
        .env("IDEMWATCH_LOG_FILE", env.path("serve.log"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    (
        KillOnDrop(child),
        format!("http://127.0.0.1:{port}/metrics"),
    )
}

/// Scrape until the exposition contains `line` (20 s at most).
fn scrape_until(url: &str, line: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(resp) = reqwest::blocking::get(url) {
            let body = resp.text().unwrap();
            if body.contains(line) {
                return body;
            }
        }
        assert!(Instant::now() < deadline, "serve never exposed {line}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `promtool check metrics` passes (skipped without promtool unless required).
fn promtool_accepts(body: &str) {
    let promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut promtool = match promtool {
        Ok(p) => p,
        Err(e) if !required() => {
            eprintln!("SKIP promtool check: promtool not available ({e})");
            return;
        }
        Err(e) => panic!("promtool is required (IDEMWATCH_REQUIRE_SERVICES=1): {e}"),
    };
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn relaxed_serve_says_so_in_its_metrics() {
    let env = TempEnv::new();
    let (_guard, url) = serve(&env, &["--durability", "relaxed"]);
    let body = scrape_until(&url, r#"idem_engine_info{durability="relaxed"} 1"#);
    assert!(!body.contains(r#"durability="durable""#), "{body}");
    assert!(body.contains("# TYPE idem_engine_info gauge"), "{body}");
    promtool_accepts(&body);
}

#[test]
fn serve_exposes_spec_metrics_that_promtool_accepts() {
    let env = TempEnv::new();
    let lines = concat!(
        r#"{"device_id":"34-ABC-123","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{"zone":"X","phone":"+905551112233"}}"#,
        "\n",
        r#"{"device_id":"34-ABC-123","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{"zone":"X","phone":"+905551112233"}}"#,
        "\n",
        "garbage\n"
    );
    let file = env.path("in.jsonl");
    std::fs::write(&file, lines).unwrap();
    assert_eq!(run_cli(&env, &["publish", file.to_str().unwrap()]).0, 0);

    let (_guard, url) = serve(&env, &[]);
    // The consumers run concurrently: wait for the last of them too.
    scrape_until(
        &url,
        r#"idem_duplicate_dropped_total{consumer="trip-counter"} 1"#,
    );
    scrape_until(
        &url,
        r#"idem_dead_lettered_total{consumer="trip-counter",reason="malformed_json"} 1"#,
    );
    let body = scrape_until(
        &url,
        r#"idem_side_effects_total{consumer="zone-exit-sms",result="suppressed"} 1"#,
    );
    for name in [
        "idem_messages_processed_total",
        "idem_duplicate_dropped_total",
        "idem_messages_redelivered_total",
        "idem_out_of_order_total",
        r#"idem_dead_lettered_total{consumer="trip-counter",reason="malformed_json"} 1"#,
        r#"idem_side_effects_total{consumer="zone-exit-sms",result="sent"} 1"#,
        r#"idem_side_effects_total{consumer="zone-exit-sms",result="suppressed"} 1"#,
        "idem_side_effect_claims_in_doubt",
        "idem_handler_duration_seconds_bucket",
        "process_start_time_seconds",
        r#"idem_engine_info{durability="durable"} 1"#,
    ] {
        assert!(body.contains(name), "missing {name}:\n{body}");
    }
    promtool_accepts(&body);

    // A Prometheus server asking for OpenMetrics gets it.
    let om = reqwest::blocking::Client::new()
        .get(&url)
        .header("Accept", "application/openmetrics-text; version=1.0.0")
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(om.trim_end().ends_with("# EOF"));
}

/// Before the first message, every consumer already exports every dead-letter
/// reason, and the side-effect consumers every result, at 0: Prometheus' `rate()` and
/// `increase()` then see the first dead letter as a rise from 0 (a series born at 1
/// shows no increase, and an alert on it never fires).
#[test]
fn fresh_serve_exports_every_reason_and_result_at_zero() {
    use idemwatch::engine::consumers::{risk_class, RiskClass, FLEET_CONSUMERS};
    use idemwatch::engine::envelope::RejectReason;
    use idemwatch::engine::metrics::EffectResult;

    let env = TempEnv::new();
    let (_guard, url) = serve(&env, &[]);
    let body = scrape_until(
        &url,
        r#"idem_dead_lettered_total{consumer="erp-webhook",reason="key_conflict"} 0"#,
    );
    for consumer in FLEET_CONSUMERS {
        for reason in RejectReason::ALL {
            let line = format!(
                "idem_dead_lettered_total{{consumer=\"{consumer}\",reason=\"{}\"}} 0",
                reason.as_str()
            );
            assert!(body.contains(&line), "missing {line}:\n{body}");
        }
        let side_effects = risk_class(consumer) == Some(RiskClass::ExternalSideEffect);
        for result in EffectResult::ALL {
            let line = format!(
                "idem_side_effects_total{{consumer=\"{consumer}\",result=\"{}\"}} 0",
                result.as_str()
            );
            assert_eq!(body.contains(&line), side_effects, "{line}:\n{body}");
        }
    }
    assert!(body.contains(r#"idem_side_effects_total{consumer="zone-exit-sms",result="failed"} 0"#));
    promtool_accepts(&body);
}
