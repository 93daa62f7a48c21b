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

    let port = free_port();
    let child = Command::new(idemwatch_bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--db", &env.db_url(), "--queue", &env.queue_url()])
        .env("IDEMWATCH_LOG_FILE", env.path("serve.log"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _guard = KillOnDrop(child);
    let url = format!("http://127.0.0.1:{port}/metrics");
    let deadline = Instant::now() + Duration::from_secs(20);
    let body = loop {
        if let Ok(resp) = reqwest::blocking::get(&url) {
            let body = resp.text().unwrap();
            if body.contains(r#"idem_duplicate_dropped_total{consumer="trip-counter"} 1"#) {
                break body;
            }
        }
        assert!(
            Instant::now() < deadline,
            "serve never processed the published messages"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
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
    ] {
        assert!(body.contains(name), "missing {name}:\n{body}");
    }

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
