//! The post-mortem report in a real browser: a drill writes its run and its marker
//! to a database, `idemwatch report` exports the window as HTML, and Debian's
//! headless chromium renders it (`--screenshot`) and dumps the DOM it built
//! (`--dump-dom`), where the chart's marker lane must carry the drill's label and
//! the drill verdict table its run. The page must load nothing from outside.

mod common;

use std::process::Command;

use common::{run_cli, TempEnv};

fn required() -> bool {
    std::env::var("IDEMWATCH_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// Headless chromium with a fresh profile and nothing that phones home.
fn chromium(env: &TempEnv, args: &[&str]) -> Option<std::process::Output> {
    let profile = env.path(&format!("chromium-{}", rand::random::<u32>()));
    let out = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .output();
    match out {
        Ok(o) => Some(o),
        Err(e) if !required() => {
            eprintln!("SKIP: chromium unavailable ({e})");
            None
        }
        Err(e) => panic!("chromium is required (IDEMWATCH_REQUIRE_SERVICES=1): {e}"),
    }
}

#[test]
fn the_report_renders_in_a_browser_with_its_drill_marker_on_the_chart() {
    let env = TempEnv::new();
    let db = env.db_url();
    let (code, _, err) = run_cli(
        &env,
        &[
            "drill",
            "crash-before-ack",
            "--times",
            "3",
            "--db",
            &db,
            "--queue",
            &env.queue_url(),
        ],
    );
    assert_eq!(code, 0, "drill: {err}");
    let html = env.path("report.html");
    let (code, _, err) = run_cli(
        &env,
        &[
            "report",
            "--from",
            "10m",
            "--to",
            "now",
            "--db",
            &db,
            "--out",
            html.to_str().expect("utf-8 path"),
        ],
    );
    assert_eq!(code, 0, "report: {err}");
    let page = std::fs::read_to_string(&html).expect("the report");
    // Self-contained: no script, stylesheet or image from anywhere.
    for outside in ["<script", "<link", "src=\"http", "href=\"http", "url(http"] {
        assert!(!page.contains(outside), "{outside} in the page");
    }

    let shot = env.path("report.png");
    let Some(out) = chromium(
        &env,
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1200,1600",
            &format!("file://{}", html.display()),
        ],
    ) else {
        return;
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );

    let Some(out) = chromium(&env, &["--dump-dom", &format!("file://{}", html.display())]) else {
        return;
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dom = String::from_utf8_lossy(&out.stdout);
    let label = "drill crash-before-ack (idempotent): pass";
    let marker = dom
        .split("class=\"marker-label\"")
        .nth(1)
        .unwrap_or_else(|| panic!("no marker label in the rendered chart:\n{dom}"));
    assert!(
        marker.contains(label),
        "the marker lane names the drill:\n{dom}"
    );
    assert!(dom.contains("id=\"duplicate-rate\""), "{dom}");
    assert!(dom.contains("<h2>Drill verdicts</h2>") && dom.contains("crash-before-ack"));
}
