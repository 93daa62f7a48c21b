//! The engine's deadlines as an operator sets them (issue 39, docs/CONTRACT.md §9): `[engine]`
//! and `[queue]` in the config, the command line's flags over them, and what a
//! deadline that fires looks like from outside.

mod common;

use std::io::Read;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{idemwatch_bin, TempEnv};

/// A server that accepts connections and never says a word: a black-holed way.
fn black_hole() -> (String, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().unwrap().port();
    let held = std::thread::spawn(move || {
        let mut open = Vec::new();
        // Held until the test process ends.
        for conn in listener.incoming().flatten() {
            open.push(conn);
        }
    });
    (format!("postgres://idw@127.0.0.1:{port}/fleet"), held)
}

/// `idemwatch ARGS`, killed if it runs past `limit`; (exit code, stderr, elapsed).
fn run_within(env: &TempEnv, args: &[&str], limit: Duration) -> (Option<i32>, String, Duration) {
    let started = Instant::now();
    let mut child = Command::new(idemwatch_bin())
        .args(args)
        .env("IDEMWATCH_LOG_FILE", env.path("idemwatch.log"))
        .env("IDEMWATCH_QUEUE", env.queue_url())
        .env("XDG_CONFIG_HOME", env.path("xdg"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start idemwatch");
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    (code, stderr, started.elapsed())
}

/// A database behind a black-holed way at start-up: the config's `[engine]
/// connect_timeout` ends the wait, saying which deadline fired and after how long,
/// and `--connect-timeout` wins over the config. (Before, sqlx's pool waited its 30 s
/// acquire and said only "pool timed out".)
#[test]
fn a_black_holed_database_is_left_at_the_connect_deadline_of_the_config_or_the_flag() {
    let env = TempEnv::new();
    let (db, _held) = black_hole();
    let config = env.path("config.toml");
    std::fs::write(&config, "[engine]\nconnect_timeout = \"1s\"\n").unwrap();
    let config = config.display().to_string();
    let consume = [
        "--config",
        config.as_str(),
        "consume",
        "--until-idle",
        "--db",
        db.as_str(),
        "--sms-url",
        "http://127.0.0.1:9",
    ];
    let (code, stderr, took) = run_within(&env, &consume, Duration::from_secs(20));
    assert_eq!(code, Some(3), "{stderr}");
    assert!(took < Duration::from_secs(8), "{took:?}: {stderr}");
    assert!(
        stderr.contains("did not answer within 1s (connect)"),
        "{stderr}"
    );
    assert!(!stderr.contains("idw@"), "no user in the message: {stderr}");

    let mut with_flag = consume.to_vec();
    with_flag.extend(["--connect-timeout", "2s"]);
    let (code, stderr, took) = run_within(&env, &with_flag, Duration::from_secs(20));
    assert_eq!(code, Some(3), "{stderr}");
    assert!(took >= Duration::from_secs(2), "{took:?}");
    assert!(
        stderr.contains("did not answer within 2s (connect)"),
        "{stderr}"
    );
}

/// A deadline of nothing would fail every call: refused on the command line as in
/// the config.
#[test]
fn a_deadline_of_nothing_is_refused() {
    let env = TempEnv::new();
    for (flag, value) in [
        ("--statement-timeout", "0s"),
        ("--acquire-timeout", "10ms"),
        ("--heartbeat", "500ms"),
    ] {
        let (code, _, stderr) = common::run_cli(&env, &["consume", "--until-idle", flag, value]);
        assert_eq!(code, 2, "{flag} {value}: {stderr}");
        assert!(stderr.contains("must be at least"), "{stderr}");
    }
}
