//! `idemwatch serve`'s write API as an operator runs it: off (404) without
//! `--api-keys`, on its own listener with `--api-listen` (the metrics port answers
//! 404 for it), callers checked against the keys file, the file read again on a
//! change and on SIGHUP without a restart, and a client that never finishes its
//! headers cut off.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{idemwatch_bin, KillOnDrop, TempEnv};

const ALICE: &str = "tok-alice-0123456789abcdef";
const BOB: &str = "tok-bob-0123456789abcdefgh";

/// `serve` on free ports; returns the process and its start line (stderr).
fn serve(env: &TempEnv, extra: &[&str]) -> (KillOnDrop, String) {
    let mut child = Command::new(idemwatch_bin())
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--db", &env.db_url(), "--queue", &env.queue_url()])
        .args(extra)
        .env("IDEMWATCH_LOG_FILE", env.path("serve.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start serve");
    let stderr = child.stderr.take().expect("stderr");
    let guard = KillOnDrop(child);
    let mut lines = BufReader::new(stderr).lines();
    let line = lines
        .find_map(|l| l.ok().filter(|l| l.contains("/metrics")))
        .expect("serve's start line");
    (guard, line)
}

/// The base URL (`http://ADDR`) of the URL in `line` that ends with `suffix`.
fn base_of(line: &str, suffix: &str) -> String {
    line.split_whitespace()
        .map(|w| w.trim_end_matches([';', ',']))
        .find(|w| w.starts_with("http://") && w.ends_with(suffix))
        .and_then(|w| w.strip_suffix(suffix))
        .unwrap_or_else(|| panic!("no …{suffix} URL in {line:?}"))
        .to_string()
}

fn post_note(base: &str, token: Option<&str>, key: &str) -> u16 {
    let mut req = reqwest::blocking::Client::new()
        .post(format!("{base}/v1/trips/34-ABC-123/notes"))
        .header("idempotency-key", key)
        .json(&serde_json::json!({"text": "tyre pressure low"}));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    req.send().expect("request").status().as_u16()
}

/// A keys file of `text`, readable by its owner alone (serve refuses it otherwise);
/// returns its path as `--api-keys` takes it.
fn write_keys(path: &std::path::Path, text: &str) -> String {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    path.display().to_string()
}

/// `idem_http_requests_total` of `route` and `outcome` on the /metrics of `base` (0
/// when not exported yet).
fn http_requests(base: &str, route: &str, outcome: &str) -> f64 {
    let exposition = reqwest::blocking::get(format!("{base}/metrics"))
        .unwrap()
        .text()
        .unwrap();
    exposition
        .lines()
        .find(|l| {
            l.starts_with("idem_http_requests_total{")
                && l.contains(&format!("route=\"{route}\""))
                && l.contains(&format!("outcome=\"{outcome}\""))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Poll until `check` holds (30 s at most).
fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn write_api_answers_404_without_api_keys() {
    let env = TempEnv::new();
    let (_serve, line) = serve(&env, &[]);
    assert!(line.contains("write API off"), "{line}");
    let base = base_of(&line, "/metrics");
    assert_eq!(post_note(&base, Some(ALICE), "k-1"), 404);
    assert_eq!(post_note(&base, None, "k-1"), 404);
    // --api-listen without a way to authenticate is refused, not silently useless.
    let out = Command::new(idemwatch_bin())
        .args(["serve", "--api-listen", "127.0.0.1:0"])
        .args(["--db", &env.db_url(), "--queue", &env.queue_url()])
        .env("IDEMWATCH_LOG_FILE", env.path("refused.log"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--api-keys"));
}

#[test]
fn api_on_its_own_listener_checks_keys_and_reloads_them_without_restart() {
    let env = TempEnv::new();
    let keys = env.path("api-keys");
    let keys_arg = write_keys(&keys, &format!("# fleet apps\nalice {ALICE}\n"));
    let (serve, line) = serve(
        &env,
        &["--api-listen", "127.0.0.1:0", "--api-keys", &keys_arg],
    );
    let metrics = base_of(&line, "/metrics");
    let api = base_of(&line, "/v1/…");
    assert_ne!(metrics, api);
    // The metrics port has no write API; the API port has no /metrics.
    assert_eq!(post_note(&metrics, Some(ALICE), "k-1"), 404);
    let on_api = reqwest::blocking::get(format!("{api}/metrics")).unwrap();
    assert_eq!(on_api.status(), 404);
    assert_eq!(post_note(&api, None, "k-1"), 401);
    assert_eq!(post_note(&api, Some("Bearer-less nonsense"), "k-1"), 401);
    assert_eq!(post_note(&api, Some(ALICE), "k-1"), 201);
    assert_eq!(post_note(&api, Some(BOB), "k-2"), 401);

    // A changed file is picked up while serving.
    std::fs::write(&keys, format!("alice {ALICE}\nbob {BOB}\n")).unwrap();
    eventually("bob's new key accepted", || {
        post_note(&api, Some(BOB), "k-2") == 201
    });

    // SIGHUP reloads even when the file looks unchanged (same size, same mtime):
    // alice's token rotated in place.
    let rotated = ALICE.replace("alice", "ALICE");
    let before = std::fs::metadata(&keys).unwrap().modified().unwrap();
    std::fs::write(&keys, format!("alice {rotated}\nbob {BOB}\n")).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&keys)
        .unwrap()
        .set_modified(before)
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        post_note(&api, Some(ALICE), "k-3"),
        201,
        "no SIGHUP yet: the old key holds"
    );
    let pid = serve.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
    eventually("the rotated key accepted after SIGHUP", || {
        post_note(&api, Some(&rotated), "k-4") == 201
    });
    assert_eq!(post_note(&api, Some(ALICE), "k-5"), 401);

    // The refusals are counted on /metrics.
    let unauthorized = || http_requests(&metrics, "/v1/trips/{device}/notes", "unauthorized");
    let before = unauthorized();
    assert!(before >= 4.0, "{before}");
    assert_eq!(post_note(&api, None, "k-6"), 401);
    assert_eq!(unauthorized(), before + 1.0);
}

#[test]
fn a_client_that_never_finishes_its_headers_is_cut_off() {
    let env = TempEnv::new();
    let (_serve, line) = serve(&env, &[]);
    let addr = base_of(&line, "/metrics").replace("http://", "");
    let mut slow = std::net::TcpStream::connect(&addr).unwrap();
    slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        .unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut rest = Vec::new();
    // read_to_end returns once the server closes (serve's header read timeout is
    // 10 s); a timeout error means it did not.
    slow.read_to_end(&mut rest)
        .expect("the server closed the connection within a minute");
    // The server is still there for well-behaved clients.
    let ok = reqwest::blocking::get(format!("http://{addr}/metrics")).unwrap();
    assert_eq!(ok.status(), 200);
}

/// Idempotency-Keys are scoped to the caller, as `serve` runs the write API: two
/// principals of the keys file sending the same key and the same command to the same
/// vehicle are two requests, each executed once (two commands stored, two answers of
/// their own), and a retry replays only its own caller's answer. A second test of the
/// scope beside `tests/http_edge.rs` (the router in-process, notes): here the binary,
/// its keys file, the commands route, both credential headers, and the outcome read
/// from the database and from `/metrics`.
#[test]
fn one_key_from_two_callers_is_two_commands_not_a_replay() {
    let env = TempEnv::new();
    let keys_arg = write_keys(
        &env.path("api-keys"),
        &format!("alice {ALICE}\nbob {BOB}\n"),
    );
    let (_serve, line) = serve(&env, &["--api-keys", &keys_arg]);
    let base = base_of(&line, "/metrics");
    let device = "34-KS-1";
    let command = |header: &str, value: &str| {
        let resp = reqwest::blocking::Client::new()
            .post(format!("{base}/v1/vehicles/{device}/commands"))
            .header(header, value)
            .header("idempotency-key", "lock-after-trip-7")
            .json(&serde_json::json!({"command": "lock"}))
            .send()
            .expect("request");
        let status = resp.status().as_u16();
        let replayed = resp.headers().contains_key("idempotent-replayed");
        let body: serde_json::Value = resp.json().expect("a JSON answer");
        (status, replayed, body)
    };
    let alice = command("authorization", &format!("Bearer {ALICE}"));
    let bob = command("x-api-key", BOB);
    let bob_again = command("x-api-key", BOB);
    assert_eq!(
        [
            (alice.0, alice.1),
            (bob.0, bob.1),
            (bob_again.0, bob_again.1)
        ],
        [(202, false), (202, false), (202, true)],
        "{alice:?} {bob:?} {bob_again:?}"
    );
    assert_ne!(alice.2["id"], bob.2["id"], "each caller its own command");
    assert_eq!(bob_again.2, bob.2, "bob's retry gets bob's answer");

    let stored = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let stores = idemwatch::engine::store::open_with_edge(&env.db_url())
            .await
            .expect("open the database");
        stores.edge.vehicle_commands(device).await.unwrap()
    });
    assert_eq!(
        stored.iter().map(|(_, c)| c.as_str()).collect::<Vec<_>>(),
        ["lock", "lock"],
        "two commands for two callers, none for the retry"
    );
    assert_eq!(
        stored.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        [&alice.2["id"], &bob.2["id"]].map(|id| id.as_i64().expect("a numeric id")),
    );
    let commands = |outcome| http_requests(&base, "/v1/vehicles/{device}/commands", outcome);
    assert_eq!((commands("executed"), commands("replayed")), (2.0, 1.0));
}
