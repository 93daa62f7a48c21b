//! A password planted in every URL idemwatch is given (database userinfo and
//! `?password=`, provider URLs, scrape targets, the environment) never shows on any
//! output surface: stdout, stderr, `--json`, the log file, `--help`, report files, the
//! dashboard's screen (tmux), and the command lines of the processes a drill starts
//! (`/proc/<pid>/cmdline`, what `ps` shows every user).
//!
//! The database is PostgreSQL with trust authentication: the planted password is
//! sent and ignored, so every command runs its real path, not an error path.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::backends::{Kind, TestDb};
use common::tmux::Tmux;
use common::{idemwatch_bin, KillOnDrop, TempEnv};

const PW: &str = "Planted-Secret-7f3a";

fn assert_clean(surface: &str, text: &str) {
    assert!(
        !text.contains(PW),
        "{surface} shows the planted password:\n{text}"
    );
}

/// `url` with the planted password in its userinfo.
fn with_password(url: &str) -> String {
    let mut u = url::Url::parse(url).expect("database URL");
    u.set_password(Some(PW)).expect("a URL with a host");
    u.to_string()
}

/// The same database, the password as a query parameter instead.
fn with_password_param(url: &str) -> String {
    let mut u = url::Url::parse(url).expect("database URL");
    u.query_pairs_mut().append_pair("password", PW);
    u.to_string()
}

/// A command with the planted URLs in its environment, its home and logs in `dir`.
fn idemwatch(dir: &Path, db_url: &str) -> Command {
    let mut cmd = Command::new(idemwatch_bin());
    cmd.env("HOME", dir)
        .env("XDG_DATA_HOME", dir.join("data"))
        .env("XDG_CONFIG_HOME", dir.join("config"))
        .env("IDEMWATCH_LOG_FILE", dir.join("idemwatch.log"))
        .env("IDEMWATCH_DB", db_url)
        .env(
            "IDEMWATCH_QUEUE",
            format!("sqlite://{}", dir.join("queue.db").display()),
        )
        .env("IDEMWATCH_SMS_URL", format!("http://sms:{PW}@127.0.0.1:1"))
        .env(
            "IDEMWATCH_WEBHOOK_URL",
            format!("http://127.0.0.1:1/erp?token={PW}"),
        )
        .env("IDEMWATCH_MQTT_PASSWORD", PW);
    cmd
}

fn check_output(what: &str, out: &Output) {
    assert_clean(
        &format!("{what} stdout"),
        &String::from_utf8_lossy(&out.stdout),
    );
    assert_clean(
        &format!("{what} stderr"),
        &String::from_utf8_lossy(&out.stderr),
    );
}

fn check_log(dir: &Path) {
    let log = std::fs::read_to_string(dir.join("idemwatch.log")).unwrap_or_default();
    assert_clean("the log file", &log);
}

#[test]
fn help_never_shows_environment_values() {
    let env = TempEnv::new();
    let db = with_password("postgres://u@db.example/fleet");
    for sub in [
        &[][..],
        &["serve"],
        &["publish"],
        &["consume"],
        &["drill"],
        &["snapshot"],
        &["purge"],
        &["report"],
        &["bench", "engine"],
        &["chaos"],
        &["dead-letters", "replay"],
        &["ingest", "mqtt"],
    ] {
        let out = idemwatch(env.dir.path(), &db)
            .args(sub)
            .arg("--help")
            .output()
            .expect("run idemwatch");
        assert!(out.status.success(), "{sub:?} --help");
        let text = String::from_utf8_lossy(&out.stdout);
        assert_clean(&format!("{sub:?} --help"), &text);
        if sub == ["snapshot"] {
            assert!(text.contains("[env: IDEMWATCH_DB]"), "{text}");
        }
    }
}

/// `serve` with the planted URLs; returns it and its start line.
fn serve(dir: &Path, db_url: &str) -> (KillOnDrop, String) {
    let mut child = idemwatch(dir, db_url)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start serve");
    let stderr = child.stderr.take().expect("stderr");
    let guard = KillOnDrop(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).expect("serve's start line");
        assert_clean("serve's stderr", &line);
        if line.contains("/metrics") {
            return (guard, line);
        }
    }
}

/// `http://ADDR/metrics` from serve's start line.
fn metrics_addr(line: &str) -> String {
    line.split_whitespace()
        .map(|w| w.trim_end_matches([';', ',']))
        .find_map(|w| w.strip_prefix("http://")?.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no /metrics URL in {line:?}"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn serve_snapshot_and_report_never_show_a_planted_password() {
    let Some(db) = TestDb::new(Kind::Postgres).await else {
        return;
    };
    let dir = db.env.dir.path().to_path_buf();
    let db_url = with_password(&db.url);
    let (serve, start_line) = serve(&dir, &db_url);
    assert!(start_line.contains("sms:***@"), "{start_line}");
    let addr = metrics_addr(&start_line);

    let up = format!("up=http://admin:{PW}@{addr}/metrics");
    let down = format!("down=http://admin:{PW}@127.0.0.1:1/metrics?token={PW}");
    for (db_url, json) in [
        (&db_url, false),
        (&with_password_param(&db.url), false),
        (&db_url, true),
    ] {
        let mut cmd = idemwatch(&dir, db_url);
        cmd.args(["snapshot", "--target", &up, "--target", &down])
            .args(["--spacing", "200ms"]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().expect("snapshot");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}");
        check_output("snapshot", &out);
        // The URLs are there, masked: the operator still sees which target.
        assert!(stdout.contains("admin:***@"), "{stdout}");
        if json {
            let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
            assert_eq!(doc["targets"][0]["status"], "up", "{stdout}");
        }
    }

    for format in ["html", "json", "csv"] {
        let file = dir.join(format!("report.{format}"));
        let out = idemwatch(&dir, &db_url)
            .args(["report", "--from", "1h", "--to", "now"])
            .args(["--format", format, "--out"])
            .arg(&file)
            .output()
            .expect("report");
        check_output("report", &out);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_clean(
            &format!("the {format} report"),
            &std::fs::read_to_string(&file).unwrap(),
        );
    }
    drop(serve);
    check_log(&dir);
    db.cleanup().await;
}

/// The command lines of `pid`'s children, as `ps` shows them.
fn children_cmdlines(pid: u32) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`: comm may hold spaces, so read after the last `)`.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            if let Ok(cmdline) = std::fs::read(format!("/proc/{child}/cmdline")) {
                found.push((child, String::from_utf8_lossy(&cmdline).replace('\0', " ")));
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread")]
async fn a_drills_child_processes_get_their_urls_through_the_environment() {
    let Some(db) = TestDb::new(Kind::Postgres).await else {
        return;
    };
    let dir = db.env.dir.path().to_path_buf();
    let mut drill = KillOnDrop(
        idemwatch(&dir, &with_password(&db.url))
            // The drill's own sandbox provider: the planted SMS URL goes nowhere.
            .env_remove("IDEMWATCH_SMS_URL")
            .env_remove("IDEMWATCH_WEBHOOK_URL")
            // Ten child incarnations: each lives a moment, and one seen is enough.
            .args([
                "drill",
                "crash-before-ack",
                "--times",
                "10",
                "--kill-process",
                "--json",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the drill"),
    );
    let pid = drill.0.id();
    let mut seen = std::collections::BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    while drill.0.try_wait().expect("wait").is_none() {
        for (child, cmdline) in children_cmdlines(pid) {
            assert_clean(&format!("/proc/{child}/cmdline"), &cmdline);
            // Keep the fullest read of each child: once killed and not yet reaped it
            // reads as an empty zombie, which must not overwrite what was seen alive.
            let kept = seen.entry(child).or_insert_with(String::new);
            if cmdline.len() > kept.len() {
                *kept = cmdline;
            }
        }
        assert!(Instant::now() < deadline, "the drill did not finish");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        seen.values().any(|c| c.contains(" consume ")),
        "no child consume process seen: {seen:?}"
    );
    let out = drill.0.wait_with_output_taken();
    check_output("drill", &out);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("drill JSON");
    assert_eq!(report["verdict"], "pass", "{report}");
    check_log(&dir);
    db.cleanup().await;
}

trait TakeOutput {
    fn wait_with_output_taken(&mut self) -> Output;
}

impl TakeOutput for std::process::Child {
    /// The output of a child already reaped by `try_wait`.
    fn wait_with_output_taken(&mut self) -> Output {
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        if let Some(mut s) = self.stdout.take() {
            std::io::Read::read_to_end(&mut s, &mut stdout).unwrap();
        }
        if let Some(mut s) = self.stderr.take() {
            std::io::Read::read_to_end(&mut s, &mut stderr).unwrap();
        }
        Output {
            status: self.wait().expect("status"),
            stdout,
            stderr,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_dashboard_screen_never_shows_a_planted_password() {
    let Some(db) = TestDb::new(Kind::Postgres).await else {
        return;
    };
    let env = &db.env;
    let dir = env.dir.path().to_path_buf();
    let config = dir.join("dashboard.toml");
    std::fs::write(
        &config,
        format!(
            "[[targets]]\nname = \"edge\"\nurl = \"http://admin:{PW}@127.0.0.1:1/metrics\"\n\n\
             [database]\nurl = \"{}\"\n",
            with_password_param(&with_password(&db.url))
        ),
    )
    .unwrap();
    let command = format!(
        "IDEMWATCH_LOG_FILE={log} {bin} --config {config}; sleep 600",
        log = dir.join("idemwatch.log").display(),
        bin = idemwatch_bin().display(),
        config = config.display(),
    );
    let Some(t) = Tmux::start(env, &command, 160, 45) else {
        return;
    };
    let screen = t.wait_for(
        "the target and the database",
        Duration::from_secs(60),
        |s| s.contains("admin:***@") && s.contains("postgres:***@"),
    );
    assert_clean("the overview", &screen);
    for (key, title) in [
        ("5", "Dedup table"),
        ("1", "Consumers"),
        ("4", "Redelivery drills"),
    ] {
        t.keys(&[key]);
        let screen = t.wait_for(title, Duration::from_secs(10), |s| s.contains(title));
        assert_clean(title, &screen);
    }
    t.keys(&["q"]);
    drop(t);
    check_log(&dir);
    db.cleanup().await;
}

/// `ingest mqtt` with its broker password in `IDEMWATCH_MQTT_PASSWORD` (the planted
/// one), against a private Mosquitto with a password file: refused (another password
/// is the right one) and accepted (the planted one is). Neither run shows it on
/// stdout, stderr, `--json`, the log, `/metrics` or its command line; the refusal
/// names the user.
#[tokio::test(flavor = "multi_thread")]
async fn the_mqtt_password_never_shows_whether_the_broker_takes_it_or_not() {
    use common::mqtt::{ingest_command, ingest_exit, password_broker, INGEST_USER};

    for (right, code) in [("another-Pa55word", 3), (PW, 0)] {
        let env = TempEnv::new();
        let Some((broker, auth)) = password_broker(&env, right) else {
            return;
        };
        let port = common::services::free_port();
        let mut c = ingest_command(
            &env,
            &format!("mqtt://{INGEST_USER}@127.0.0.1:{auth}"),
            "secret-ingest",
            "idemwatch.log",
        );
        c.args(["--topic", "fleet/+/events"])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("IDEMWATCH_MQTT_PASSWORD", PW);
        let mut ingest = KillOnDrop(c.spawn().expect("ingest starts"));
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", ingest.0.id())).unwrap();
        assert_clean("the command line", &String::from_utf8_lossy(&cmdline));
        if code == 0 {
            broker.wait_for_log("Received SUBSCRIBE from secret-ingest");
            let metrics = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            assert!(
                metrics.contains("idem_ingress_connected{source=\"mqtt\"} 1"),
                "{metrics}"
            );
            assert_clean("/metrics", &metrics);
        }
        let (status, out, err) = tokio::task::spawn_blocking(move || ingest_exit(&mut ingest))
            .await
            .unwrap();
        assert_eq!(status, Some(code), "{out}\n{err}");
        assert_clean("stdout", &out);
        assert_clean("stderr", &err);
        check_log(env.dir.path());
        if code == 3 {
            assert!(err.contains(INGEST_USER), "{err}");
        }
    }
}
