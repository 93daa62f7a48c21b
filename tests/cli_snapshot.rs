//! `idemwatch snapshot` as a script would run it.

use std::path::Path;
use std::process::{Command, Output};

use idemwatch::engine::envelope::RejectReason;
use idemwatch::engine::store::{self, MarkerKind};

fn snapshot(args: &[&str], home: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemwatch"))
        .arg("snapshot")
        .args(args)
        // No user config may leak into the test.
        .env("XDG_CONFIG_HOME", home.join("config"))
        .env("IDEMWATCH_LOG_FILE", home.join("idemwatch.log"))
        .env_remove("IDEMWATCH_DB")
        .output()
        .expect("run idemwatch")
}

async fn fleet_db(dir: &Path) -> String {
    let url = format!("sqlite://{}", dir.join("fleet.db").display());
    let s = store::open(&url).await.expect("open store");
    s.dead_letter("trip-counter", RejectReason::UnknownEventType, "x", b"{}")
        .await
        .unwrap();
    s.add_marker(MarkerKind::Deploy, "deploy v9", None)
        .await
        .unwrap();
    url
}

#[tokio::test]
async fn json_snapshot_reports_a_down_target_and_the_database() {
    let dir = tempfile::tempdir().unwrap();
    let url = fleet_db(dir.path()).await;
    // Port 1 on loopback: nothing listens there.
    let out = snapshot(
        &[
            "--json",
            "--db",
            &url,
            "--target",
            "edge=http://127.0.0.1:1/metrics",
            "--spacing",
            "100ms",
        ],
        dir.path(),
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is exactly one JSON document");
    assert_eq!(doc["targets"][0]["name"], "edge");
    assert_eq!(doc["targets"][0]["status"], "down");
    assert!(doc["targets"][0]["error"]
        .as_str()
        .unwrap()
        .contains("127.0.0.1:1"));
    assert_eq!(doc["database"]["status"], "up");
    assert_eq!(
        doc["database"]["dead_letters"][0]["reason"],
        "unknown_event_type"
    );
    assert_eq!(doc["markers"][0]["label"], "deploy v9");
    // The deploy's window: open (younger than the settle time), nothing known of its
    // consumers while the only target is down.
    assert_eq!(doc["deploys"][0]["label"], "deploy v9");
    assert_eq!(doc["deploys"][0]["ends"], "open");
    assert_eq!(doc["deploys"][0]["verdict"], "no_traffic");
    assert_eq!(doc["deploys"][0]["consumers"], serde_json::json!([]));
    assert!(doc["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a["kind"] == "target_down"));
    assert!(doc.get("charts").is_none(), "charts stay out of the JSON");
}

#[tokio::test]
async fn text_snapshot_is_a_readable_summary_and_hides_passwords() {
    let dir = tempfile::tempdir().unwrap();
    let out = snapshot(
        &[
            "--db",
            "postgres://watch:s3cret@127.0.0.1:1/fleet",
            "--target",
            "edge=http://127.0.0.1:1/metrics",
            "--spacing",
            "10ms",
        ],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Targets") && text.contains("DOWN"), "{text}");
    assert!(
        text.contains("postgres://watch:***@127.0.0.1:1/fleet"),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");
}

#[test]
fn bad_config_and_bad_usage_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "poll_intervall = \"1s\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idemwatch"))
        .args(["--config", bad.to_str().unwrap(), "snapshot", "--json"])
        .env("IDEMWATCH_LOG_FILE", dir.path().join("log"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "nothing on stdout on error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.toml") && err.contains("poll_intervall"),
        "{err}"
    );

    let out = snapshot(&["--target", "no-equals-sign"], dir.path());
    assert_eq!(out.status.code(), Some(2));
}

/// A target serving `text` as its `/metrics` (Prometheus text) until the test ends.
async fn metrics_target(text: String) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let body = text.clone();
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                let _ = socket.read(&mut request).await;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(answer.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}/metrics")
}

/// `snapshot --json` carries `windows`: a consumer whose oldest duplicate came
/// 3 h 12 m after its key was first processed (the store's `duplicate_ages`, larger
/// than the process's maximum), against the 7-day retention: margin 52×; the text
/// snapshot says the same line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_sets_the_duplicate_ages_beside_the_retention() {
    use idemwatch::engine::consumers::RiskClass;
    use idemwatch::engine::metrics::Metrics;
    let dir = tempfile::tempdir().unwrap();
    let url = fleet_db(dir.path()).await;
    let s = store::open(&url).await.unwrap();
    s.note_duplicate_age("trip-counter", 3.0 * 3600.0 + 12.0 * 60.0)
        .await
        .unwrap();
    let metrics = Metrics::new();
    metrics.register_consumer("trip-counter", Some(RiskClass::Accumulation));
    metrics.duplicate_age("trip-counter", Some(std::time::Duration::from_secs(40)));
    let target = metrics_target(metrics.encode_prometheus_text()).await;
    let home = dir.path().to_path_buf();
    let run = move |json: bool| {
        let (url, target, home) = (url.clone(), target.clone(), home.clone());
        tokio::task::spawn_blocking(move || {
            let target = format!("fleet={target}");
            let mut args = vec!["--db", &url, "--target", &target, "--spacing", "100ms"];
            if json {
                args.push("--json");
            }
            snapshot(&args, &home)
        })
    };
    let out = run(true).await.unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let w = &doc["windows"][0];
    assert_eq!(w["consumer"], "trip-counter", "{doc}");
    assert_eq!(w["max_seconds"], 11_520.0);
    assert_eq!(w["count"], 1.0);
    assert_eq!(w["windows"][0]["layer"], "retention");
    assert_eq!(w["windows"][0]["short"], false);
    let line = "oldest duplicate 3 h 12 m; retention 7 d: margin 52×";
    assert_eq!(w["summary"], line);
    let out = run(false).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Dedup windows") && text.contains(line),
        "{text}"
    );
}
