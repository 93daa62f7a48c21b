//! The systemd units in `assets/systemd/` (issue 42): `systemd-analyze verify`
//! accepts them with not a word to say; they keep the crash-loop brake, the sandbox
//! and the secrets where the docs promise; and each one's own `ExecStart=` runs with
//! its own `Environment=` and credentials directory, as systemd would start it: a
//! device message published to a private Mosquitto goes through the ingest unit's
//! process into the state directory's queue and is processed by the serve unit's
//! process on a PostgreSQL database whose URL (with a password) came from a
//! credential file, and both stop cleanly on their unit's `KillSignal=`.
//!
//! This machine runs no systemd as PID 1, so the sandbox itself (DynamicUser,
//! ProtectSystem, the system-call filter) is checked by `systemd-analyze` only, not
//! enforced on a running process. Without systemd-analyze, Mosquitto or PostgreSQL
//! the tests that need them skip, unless IDEMWATCH_REQUIRE_SERVICES=1 (CI): then
//! they fail.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::backends::{required, Kind, TestDb};
use common::services::{free_port, reachable};
use common::{idemwatch_bin, KillOnDrop, TempEnv};

const UNITS: [&str; 2] = ["idemwatch-serve.service", "idemwatch-ingest-mqtt.service"];
/// Where the units say the binary is (`cargo install --root /usr/local`).
const INSTALLED_BIN: &str = "/usr/local/bin/idemwatch";

fn unit_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("assets/systemd")
        .join(name)
}

/// A unit file's `Key=value` lines in order (comments and section headers dropped).
struct Unit {
    name: &'static str,
    lines: Vec<(String, String)>,
}

impl Unit {
    fn read(name: &'static str) -> Unit {
        let text = std::fs::read_to_string(unit_path(name)).unwrap();
        let lines = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('['))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        Unit { name, lines }
    }

    fn all(&self, key: &str) -> Vec<&str> {
        self.lines
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    fn one(&self, key: &str) -> &str {
        match self.all(key).as_slice() {
            [v] => v,
            other => panic!("{}: {key}= expected once, found {other:?}", self.name),
        }
    }

    /// `Environment=` with the specifiers the units use expanded: `%d` the
    /// credentials directory, `%S` the state root (`/var/lib`).
    fn environment(&self, credentials: &Path, state_root: &Path) -> BTreeMap<String, String> {
        self.all("Environment")
            .into_iter()
            .map(|kv| {
                let (k, v) = kv.split_once('=').expect("NAME=value");
                (k.to_string(), expand(v, credentials, state_root))
            })
            .collect()
    }

    /// `ExecStart=` split into words, specifiers expanded.
    fn exec_start(&self, credentials: &Path, state_root: &Path) -> Vec<String> {
        self.one("ExecStart")
            .split_whitespace()
            .map(|w| expand(w, credentials, state_root))
            .collect()
    }
}

fn expand(value: &str, credentials: &Path, state_root: &Path) -> String {
    value
        .replace("%d", credentials.to_str().unwrap())
        .replace("%S", state_root.to_str().unwrap())
}

/// `systemd-analyze ARGS`: None (skip) without it outside CI. (success, all output)
fn systemd_analyze(args: &[&str]) -> Option<(bool, String)> {
    match Command::new("systemd-analyze").args(args).output() {
        Ok(out) => Some((
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )),
        Err(e) if !required() => {
            eprintln!("SKIP: systemd-analyze not available ({e})");
            None
        }
        Err(e) => panic!("systemd-analyze is required (IDEMWATCH_REQUIRE_SERVICES=1): {e}"),
    }
}

/// The units as installed, but pointing at this build's binary (verify checks that
/// `ExecStart=`'s program exists).
fn units_for_this_build(env: &TempEnv) -> Vec<PathBuf> {
    UNITS
        .iter()
        .map(|name| {
            let text = std::fs::read_to_string(unit_path(name)).unwrap();
            assert!(text.contains(INSTALLED_BIN), "{name} runs {INSTALLED_BIN}");
            let path = env.path(name);
            std::fs::write(
                &path,
                text.replace(INSTALLED_BIN, idemwatch_bin().to_str().unwrap()),
            )
            .unwrap();
            path
        })
        .collect()
}

/// `systemd-analyze verify` succeeds and says nothing: it exits 0 over an unknown
/// key or a misspelt section, and only its words tell.
#[test]
fn systemd_analyze_verify_accepts_the_units_without_a_warning() {
    let env = TempEnv::new();
    let units = units_for_this_build(&env);
    let mut args = vec!["verify", "--man=no"];
    args.extend(units.iter().map(|p| p.to_str().unwrap()));
    if let Some((ok, out)) = systemd_analyze(&args) {
        assert!(
            ok && out.trim().is_empty(),
            "systemd-analyze verify:\n{out}"
        );
    }
}

/// The sandbox, judged by systemd itself: an exposure of at most 2.0 of 10
/// (`systemd-analyze security`; the units score 1.4, a unit without any of it ~9.6).
#[test]
fn systemd_analyze_security_rates_the_units_exposure_low() {
    let env = TempEnv::new();
    for unit in units_for_this_build(&env) {
        let Some((ok, out)) = systemd_analyze(&[
            "security",
            "--offline=true",
            "--threshold=20",
            unit.to_str().unwrap(),
        ]) else {
            return;
        };
        let overall = out
            .lines()
            .find(|l| l.contains("Overall exposure level"))
            .unwrap_or("");
        assert!(
            ok,
            "{}: exposure above 2.0: {overall}\n{out}",
            unit.display()
        );
    }
}

#[test]
fn units_restart_on_failure_but_stop_a_crash_loop_and_sandbox_the_process() {
    for name in UNITS {
        let unit = Unit::read(name);
        assert_eq!(unit.one("Restart"), "on-failure", "{name}");
        // The field report's supervisor restarted 7 times in one night: at most 3
        // starts an hour, at least 30 s apart.
        let burst: u32 = unit.one("StartLimitBurst").parse().unwrap();
        assert!((1..=3).contains(&burst), "{name}: StartLimitBurst={burst}");
        let interval = humantime::parse_duration(unit.one("StartLimitIntervalSec")).unwrap();
        assert!(
            interval >= Duration::from_secs(3600),
            "{name}: {interval:?}"
        );
        let pause = humantime::parse_duration(unit.one("RestartSec")).unwrap();
        assert!(
            pause >= Duration::from_secs(30),
            "{name}: RestartSec {pause:?}"
        );
        assert_eq!(
            unit.one("RestartPreventExitStatus"),
            "2",
            "{name}: a usage error is not retried"
        );
        for (key, value) in [
            ("DynamicUser", "yes"),
            ("ProtectSystem", "strict"),
            ("PrivateTmp", "yes"),
            ("ProtectHome", "yes"),
            ("StateDirectory", "idemwatch"),
            ("StateDirectoryMode", "0700"),
            ("Environment", "XDG_DATA_HOME=%S"),
        ] {
            assert!(
                unit.all(key).contains(&value),
                "{name}: {key}={value} missing"
            );
        }
        // The state directory is the only writable place: nothing else opened up.
        for key in [
            "ReadWritePaths",
            "LogsDirectory",
            "CacheDirectory",
            "RuntimeDirectory",
        ] {
            assert!(
                unit.all(key).is_empty(),
                "{name}: {key}= opens another place"
            );
        }
    }
}

/// No secret in a unit file or on a command line: the database URL comes from a
/// credential through IDEMWATCH_DB_FILE, the keys from a credential file.
#[test]
fn units_take_secrets_from_credentials_never_from_the_command_line() {
    for name in UNITS {
        let unit = Unit::read(name);
        let exec = unit.one("ExecStart");
        for word in exec.split_whitespace().filter(|w| w.contains("://")) {
            let url = url::Url::parse(word).expect("a URL on ExecStart");
            assert!(
                url.password().is_none(),
                "{name}: a password on ExecStart: {word}"
            );
        }
        for flag in [
            "--db",
            "--queue",
            "--seen-set",
            "--sms-url",
            "--webhook-url",
        ] {
            assert!(
                !exec
                    .split_whitespace()
                    .any(|w| w == flag || w.starts_with(&format!("{flag}="))),
                "{name}: {flag} on the command line"
            );
        }
        for (key, value) in &unit.lines {
            if key == "Environment" {
                assert!(
                    !value.contains("://"),
                    "{name}: a URL in Environment= (use a credential): {value}"
                );
            }
        }
    }
    let serve = Unit::read("idemwatch-serve.service");
    assert!(serve
        .all("LoadCredential")
        .contains(&"db-url:/etc/idemwatch/db-url"));
    assert!(serve
        .all("LoadCredential")
        .contains(&"api-keys:/etc/idemwatch/api-keys"));
    assert!(serve
        .all("Environment")
        .contains(&"IDEMWATCH_DB_FILE=%d/db-url"));
    assert!(serve.one("ExecStart").contains("--api-keys %d/api-keys"));
}

/// A unit's process, started as systemd would: this build's binary, the unit's
/// arguments with each listen address moved to a free port (and the broker's to
/// `broker`), no environment but the unit's and $CREDENTIALS_DIRECTORY.
struct UnitProcess {
    child: KillOnDrop,
    /// The unit's listen addresses → the free ports used instead.
    ports: BTreeMap<String, u16>,
    stderr: PathBuf,
}

impl UnitProcess {
    fn start(unit: &Unit, dirs: &UnitDirs, broker: Option<&str>) -> UnitProcess {
        let mut words = unit.exec_start(&dirs.credentials, &dirs.state_root);
        assert_eq!(words[0], INSTALLED_BIN);
        let mut ports = BTreeMap::new();
        for w in words.iter_mut().skip(1) {
            if w.parse::<std::net::SocketAddr>().is_ok() {
                let port = free_port();
                ports.insert(w.clone(), port);
                *w = format!("127.0.0.1:{port}");
            } else if w.starts_with("mqtt://") {
                *w = broker.expect("a broker for the ingest unit").to_string();
            }
        }
        let stderr = dirs.root.path(&format!("{}.stderr", unit.name));
        let child = Command::new(idemwatch_bin())
            .args(&words[1..])
            .env_clear()
            .envs(unit.environment(&dirs.credentials, &dirs.state_root))
            .env("CREDENTIALS_DIRECTORY", &dirs.credentials)
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("start the unit's ExecStart");
        UnitProcess {
            child: KillOnDrop(child),
            ports,
            stderr,
        }
    }

    fn url(&self, unit_addr: &str, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.ports[unit_addr])
    }

    /// Send the unit's KillSignal= and wait (TimeoutStopSec=) for a clean exit.
    fn stop_as_systemd_would(&mut self, unit: &Unit) -> std::process::ExitStatus {
        let signal = match unit.one("KillSignal") {
            "SIGTERM" => libc::SIGTERM,
            "SIGINT" => libc::SIGINT,
            other => panic!("{}: KillSignal={other}", unit.name),
        };
        let pid = i32::try_from(self.child.0.id()).unwrap();
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
        let limit = humantime::parse_duration(unit.one("TimeoutStopSec")).unwrap();
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.0.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{}: still running {limit:?} after {}",
                unit.name,
                unit.one("KillSignal")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

/// `/var/lib` and the credentials directory of a pretend host.
struct UnitDirs {
    root: TempEnv,
    state_root: PathBuf,
    credentials: PathBuf,
}

impl UnitDirs {
    fn new() -> UnitDirs {
        let root = TempEnv::new();
        let state_root = root.path("var-lib");
        let credentials = root.path("credentials");
        std::fs::create_dir_all(&state_root).unwrap();
        std::fs::create_dir_all(&credentials).unwrap();
        UnitDirs {
            root,
            state_root,
            credentials,
        }
    }

    /// A credential as systemd hands it over: a file readable by the service only.
    fn credential(&self, name: &str, content: &str) {
        let path = self.credentials.join(name);
        std::fs::write(&path, content).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
    }

    fn state_dir(&self) -> PathBuf {
        self.state_root.join("idemwatch")
    }
}

/// The URL with `password` set, unless it has one: the secret the test looks for.
fn with_password(url: &str, password: &str) -> (String, String) {
    let mut u = url::Url::parse(url).unwrap();
    if let Some(p) = u.password() {
        let p = p.to_string();
        return (url.to_string(), p);
    }
    u.set_password(Some(password)).unwrap();
    (u.to_string(), password.to_string())
}

/// A private Mosquitto logging everything (its log says when ingest has subscribed).
fn private_mosquitto(dirs: &UnitDirs) -> Option<(KillOnDrop, String, PathBuf)> {
    if Command::new("mosquitto").arg("-h").output().is_err() {
        assert!(
            !required(),
            "mosquitto is required (IDEMWATCH_REQUIRE_SERVICES=1)"
        );
        eprintln!("SKIP: mosquitto not installed");
        return None;
    }
    let port = free_port();
    let log = dirs.root.path("mosquitto.log");
    let conf = dirs.root.path("mosquitto.conf");
    std::fs::write(
        &conf,
        format!(
            "user root\nlistener {port} 127.0.0.1\nallow_anonymous true\nlog_dest file {}\nlog_type all\n",
            log.display()
        ),
    )
    .unwrap();
    let child = Command::new("mosquitto")
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("mosquitto starts");
    let url = format!("mqtt://127.0.0.1:{port}");
    wait_until("the private mosquitto", Duration::from_secs(20), || {
        reachable(&url).is_ok()
    });
    Some((KillOnDrop(child), url, log))
}

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One sample's value from a /metrics page, if present.
fn sample(url: &str, series: &str) -> Option<f64> {
    let text = reqwest::blocking::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .ok()?
        .text()
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The two units' processes as systemd would run them, on one state directory: a
/// device's zone exit in through the ingest unit, processed once by the serve unit,
/// on PostgreSQL through a credential's URL, whose password shows nowhere.
#[test]
fn the_units_run_as_written_ingest_to_serve_with_credentials() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(db) = rt.block_on(TestDb::new(Kind::Postgres)) else {
        return;
    };
    let dirs = UnitDirs::new();
    let Some((_mosquitto, broker, broker_log)) = private_mosquitto(&dirs) else {
        return rt.block_on(db.cleanup());
    };
    let (db_url, password) = with_password(&db.url, "unit-credential-pw-5c1e");
    dirs.credential("db-url", &format!("{db_url}\n"));
    let token = "fleet-ops-token-0123456789";
    dirs.credential("api-keys", &format!("fleet-ops {token}\n"));

    // The ingest unit: subscribed once the broker says so, then a device publishes.
    let ingest_unit = Unit::read("idemwatch-ingest-mqtt.service");
    let mut ingest = UnitProcess::start(&ingest_unit, &dirs, Some(&broker));
    let client_id = ingest_unit
        .one("ExecStart")
        .split_whitespace()
        .skip_while(|w| *w != "--client-id")
        .nth(1)
        .expect("the ingest unit names its session")
        .to_string();
    wait_until("ingest's subscription", Duration::from_secs(30), || {
        std::fs::read_to_string(&broker_log)
            .is_ok_and(|l| l.contains(&format!("Received SUBSCRIBE from {client_id}")))
    });
    let port = broker.rsplit(':').next().unwrap();
    let zone_exit = r#"{"device_id":"TRUCK-7","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{"zone":"X","phone":"+905551112233"}}"#;
    let published = Command::new("mosquitto_pub")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            port,
            "-q",
            "1",
            "-t",
            "fleet/TRUCK-7/events",
        ])
        .args(["-m", zone_exit])
        .status()
        .expect("mosquitto_pub (Debian package mosquitto-clients)");
    assert!(published.success());
    let ingest_metrics = ingest.url("127.0.0.1:9466", "/metrics");
    wait_until("the message on the queue", Duration::from_secs(30), || {
        sample(
            &ingest_metrics,
            r#"idem_ingress_messages_total{source="mqtt",dup_flag="false"}"#,
        ) == Some(1.0)
    });

    // The serve unit on the same state directory: the queue ingest wrote.
    let serve_unit = Unit::read("idemwatch-serve.service");
    let mut serve = UnitProcess::start(&serve_unit, &dirs, None);
    let serve_metrics = serve.url("127.0.0.1:9464", "/metrics");
    wait_until("the zone exit processed", Duration::from_secs(60), || {
        sample(
            &serve_metrics,
            r#"idem_messages_processed_total{consumer="zone-exit-sms"}"#,
        ) == Some(1.0)
    });
    // On the credential's database, not the default SQLite file in the state directory.
    let db_name = db.name().expect("a server database");
    assert!(
        serve.stderr().contains("postgres://") && serve.stderr().contains(db_name),
        "serve runs on the credential's database: {}",
        serve.stderr()
    );
    // The write API took its keys from the credential.
    let notes = serve.url("127.0.0.1:9480", "/v1/trips/TRUCK-7/notes");
    let client = reqwest::blocking::Client::new();
    let anonymous = client.post(&notes).body("{}").send().unwrap().status();
    assert_eq!(anonymous.as_u16(), 401, "no key, no entry");
    let keyed = client
        .post(&notes)
        .bearer_auth(token)
        .body("{}")
        .send()
        .unwrap()
        .status();
    assert!(
        ![401, 403, 404].contains(&keyed.as_u16()),
        "the credential's key is accepted: {keyed}"
    );

    // Stopped as systemd stops them: each exits 0 on its own KillSignal=.
    let serve_exit = serve.stop_as_systemd_would(&serve_unit);
    assert!(
        serve_exit.success(),
        "serve: {serve_exit:?}\n{}",
        serve.stderr()
    );
    let ingest_exit = ingest.stop_as_systemd_would(&ingest_unit);
    assert!(
        ingest_exit.success(),
        "ingest: {ingest_exit:?}\n{}",
        ingest.stderr()
    );

    // Everything written lives in the state directory: the queue, the log.
    let state = dirs.state_dir();
    assert!(
        state.join("idemwatch-queue.db").is_file(),
        "the shared queue"
    );
    let log = std::fs::read_to_string(state.join("idemwatch.log")).expect("the log file");
    let mode = std::fs::metadata(&state).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "the state directory is private");
    for (what, text) in [
        ("serve's stderr", serve.stderr()),
        ("ingest's stderr", ingest.stderr()),
        ("the log", log),
    ] {
        assert!(
            !text.contains(&password),
            "{what} shows the database password"
        );
    }
    rt.block_on(db.cleanup());
}

/// `NAME_FILE` and `NAME` both set: which one was meant cannot be guessed; a file
/// that cannot be read is named, its content never printed.
#[test]
fn a_url_file_beside_its_variable_or_unreadable_is_refused_without_printing_a_url() {
    let env = TempEnv::new();
    let secret = "postgres://fleet:s3cret-in-file@db/fleet";
    let file = env.path("db-url");
    std::fs::write(&file, secret).unwrap();
    let run = |vars: &[(&str, &str)]| {
        let out = Command::new(idemwatch_bin())
            .args(["dead-letters", "list"])
            .env("IDEMWATCH_LOG_FILE", env.path("idemwatch.log"))
            .env("HOME", env.path(""))
            .env_remove("IDEMWATCH_DB")
            .envs(vars.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&[
        ("IDEMWATCH_DB", "sqlite:///nowhere.db"),
        ("IDEMWATCH_DB_FILE", file.to_str().unwrap()),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("IDEMWATCH_DB and IDEMWATCH_DB_FILE"), "{err}");
    assert!(!err.contains("s3cret") && !err.contains("nowhere"), "{err}");

    let (code, err) = run(&[("IDEMWATCH_DB_FILE", env.path("missing").to_str().unwrap())]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("missing"), "the file is named: {err}");

    std::fs::write(&file, "postgres://a:s3cret@x/a\npostgres://b:s3cret@y/b\n").unwrap();
    let (code, err) = run(&[("IDEMWATCH_DB_FILE", file.to_str().unwrap())]);
    assert_eq!(code, Some(2), "{err}");
    assert!(!err.contains("s3cret"), "{err}");
}

/// The URL in the file is the one used, whichever subcommand reads IDEMWATCH_DB:
/// `consume` creates the file's database, `mark` writes its marker there.
#[test]
fn a_database_url_file_is_read_by_every_subcommand() {
    let env = TempEnv::new();
    let db = env.path("from-file.db");
    let file = env.path("db-url");
    std::fs::write(&file, format!("sqlite://{}\n", db.display())).unwrap();
    for args in [
        &["consume", "--until-idle", "--json"][..],
        &["mark", "note", "--label", "from a file", "--json"],
    ] {
        let out = Command::new(idemwatch_bin())
            .args(args)
            .env("IDEMWATCH_LOG_FILE", env.path("idemwatch.log"))
            .env("HOME", env.path("home"))
            .env_remove("IDEMWATCH_DB")
            .env("IDEMWATCH_DB_FILE", &file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(db.is_file(), "{args:?} opened the file's database");
    }
    assert!(
        !env.path("home/.local/share/idemwatch/idemwatch.db")
            .exists(),
        "not the default database"
    );
}
