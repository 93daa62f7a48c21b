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
use common::mqtt::{password_file, test_pki, PrivateMosquitto};
use common::services::free_port;
use common::{idemwatch_bin, KillOnDrop, TempEnv};

const UNITS: [&str; 3] = [
    "idemwatch-serve.service",
    "idemwatch-ingest-mqtt.service",
    TEMPLATE,
];
const INGEST: &str = "idemwatch-ingest-mqtt.service";
/// The share-group members' template; an instance's name is its /metrics port.
const TEMPLATE: &str = "idemwatch-ingest-mqtt@.service";
/// The instance `systemd-analyze` checks beside the template.
const INSTANCE: &str = "idemwatch-ingest-mqtt@9467.service";
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
    /// What `%i` expands to (a template's instance name).
    instance: String,
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
        Unit {
            name,
            lines,
            instance: String::new(),
        }
    }

    /// A template unit as its instance `instance` (`%i`).
    fn instance(name: &'static str, instance: &str) -> Unit {
        Unit {
            instance: instance.to_string(),
            ..Unit::read(name)
        }
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
                (k.to_string(), self.expand(v, credentials, state_root))
            })
            .collect()
    }

    /// `ExecStart=` split into words, specifiers expanded.
    fn exec_start(&self, credentials: &Path, state_root: &Path) -> Vec<String> {
        self.one("ExecStart")
            .split_whitespace()
            .map(|w| self.expand(w, credentials, state_root))
            .collect()
    }

    /// The specifiers the units use: `%d` the credentials directory, `%S` the state
    /// root (`/var/lib`), `%i` the instance.
    fn expand(&self, value: &str, credentials: &Path, state_root: &Path) -> String {
        value
            .replace("%d", credentials.to_str().unwrap())
            .replace("%S", state_root.to_str().unwrap())
            .replace("%i", &self.instance)
    }

    /// The credentials the unit loads: `LoadCredential=NAME:PATH` → (NAME, PATH).
    fn credentials(&self) -> Vec<(&str, &str)> {
        self.all("LoadCredential")
            .into_iter()
            .map(|c| c.split_once(':').expect("NAME:PATH"))
            .collect()
    }
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
/// `ExecStart=`'s program exists), and the template as one of its instances too.
fn units_for_this_build(env: &TempEnv) -> Vec<PathBuf> {
    UNITS
        .iter()
        .map(|name| (*name, *name))
        .chain([(TEMPLATE, INSTANCE)])
        .map(|(name, installed_as)| {
            let text = std::fs::read_to_string(unit_path(name)).unwrap();
            assert!(text.contains(INSTALLED_BIN), "{name} runs {INSTALLED_BIN}");
            let path = env.path(installed_as);
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
    let deploy_doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/DEPLOY.md"))
            .unwrap();
    for name in UNITS {
        let unit = Unit::read(name);
        let exec = unit.one("ExecStart");
        // No password flag of any kind but a file's, no password variable.
        assert!(
            !exec
                .split_whitespace()
                .any(|w| w == "--password" || w.starts_with("--password=")),
            "{name}: a password on ExecStart"
        );
        for value in unit.all("Environment") {
            assert!(
                !value.contains("PASSWORD"),
                "{name}: a password in Environment= (use a credential): {value}"
            );
        }
        // Every credential the unit loads is read by something (`%d/NAME` on
        // ExecStart or in Environment=), every `%d/NAME` read is loaded, each comes
        // from /etc/idemwatch, and docs/DEPLOY.md says how to make its file.
        let loaded: Vec<(&str, &str)> = unit.credentials();
        let mut read: Vec<&str> = exec.split_whitespace().collect();
        read.extend(unit.all("Environment"));
        let read_names: Vec<&str> = read
            .iter()
            .filter_map(|w| w.split_once("%d/").map(|(_, n)| n))
            .collect();
        for (cred, source) in &loaded {
            assert!(
                read_names.contains(cred),
                "{name}: credential {cred} read by nothing"
            );
            assert_eq!(
                *source,
                format!("/etc/idemwatch/{cred}"),
                "{name}: credential {cred} from elsewhere"
            );
            assert!(
                deploy_doc.contains(source),
                "{name}: docs/DEPLOY.md does not say how to make {source}"
            );
        }
        for cred in read_names {
            assert!(
                loaded.iter().any(|(n, _)| *n == cred),
                "{name}: %d/{cred} is read but never loaded"
            );
        }
    }
    for name in [INGEST, TEMPLATE] {
        let unit = Unit::read(name);
        let exec = unit.one("ExecStart");
        for (flag, cred) in [
            ("--password-file", "mqtt-password"),
            ("--ca-file", "mqtt-ca.pem"),
            ("--client-cert", "mqtt-client.pem"),
            ("--client-key", "mqtt-client.key"),
        ] {
            assert!(
                exec.contains(&format!("{flag} %d/{cred}")),
                "{name}: {flag} %d/{cred} on ExecStart"
            );
        }
        let broker = exec
            .split_whitespace()
            .skip_while(|w| *w != "--broker")
            .nth(1)
            .expect("--broker");
        let url = url::Url::parse(broker).unwrap();
        assert!(
            url.scheme() == "mqtts" && !url.username().is_empty(),
            "{name}: TLS with a login: {broker}"
        );
        assert!(
            unit.all("Environment")
                .contains(&"IDEMWATCH_DB_FILE=%d/db-url"),
            "{name}: the door's dead letters go to serve's database"
        );
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

/// The share-group template is the single ingest unit line for line, but for its
/// description and, on ExecStart, the group and an instance's own session and port.
#[test]
fn the_template_is_the_ingest_unit_with_a_share_group_and_an_instances_session() {
    let single = Unit::read(INGEST);
    let template = Unit::read(TEMPLATE);
    let differing = |u: &Unit| -> Vec<(String, String)> {
        u.lines
            .iter()
            .filter(|(k, _)| k != "Description" && k != "ExecStart")
            .cloned()
            .collect()
    };
    assert_eq!(differing(&single), differing(&template));
    let exec = template.one("ExecStart");
    for part in [
        "--share-group idemwatch-ingest",
        "--client-id idemwatch-ingest-%i",
        "--listen 127.0.0.1:%i",
    ] {
        assert!(exec.contains(part), "{TEMPLATE}: {part} on ExecStart");
    }
    let as_single = exec
        .replace(" --share-group idemwatch-ingest", "")
        .replace("idemwatch-ingest-%i", "idemwatch-ingest")
        .replace("127.0.0.1:%i", "127.0.0.1:9466");
    assert_eq!(as_single, single.one("ExecStart"));
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
            } else if w.starts_with("mqtt://") || w.starts_with("mqtts://") {
                // The unit's broker URL (its scheme and user) at the test's broker.
                let at: std::net::SocketAddr = broker
                    .expect("a broker for the ingest unit")
                    .parse()
                    .unwrap();
                let mut url = url::Url::parse(w).unwrap();
                url.set_host(Some(&at.ip().to_string())).unwrap();
                url.set_port(Some(at.port())).unwrap();
                *w = url.to_string().trim_end_matches('/').to_string();
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

/// The fleet broker the ingest units expect, private to the test: the devices
/// publish anonymously on its plain listener ([`PrivateMosquitto::port`]); the
/// ingest's listener (the returned address) wants TLS with a client certificate of
/// the test's CA and the login `user`/`password` (`allow_anonymous false`). The
/// ingest's credential files are written into `dirs`' credentials directory.
fn fleet_broker(dirs: &UnitDirs, user: &str, password: &str) -> Option<(PrivateMosquitto, String)> {
    let passwd = password_file(&dirs.root, user, password)?;
    let (pki, server_cert, server_key) = test_pki(&dirs.root, user);
    let tls = free_port();
    let broker = PrivateMosquitto::with_listeners(
        &dirs.root,
        &format!(
            "listener {tls} 127.0.0.1\nallow_anonymous false\npassword_file {}\ncafile {}\ncertfile {}\nkeyfile {}\nrequire_certificate true\n",
            passwd.display(),
            pki.ca.display(),
            server_cert.display(),
            server_key.display()
        ),
    )?;
    dirs.credential("mqtt-password", &format!("{password}\n"));
    for (cred, file) in [
        ("mqtt-ca.pem", &pki.ca),
        ("mqtt-client.pem", &pki.client_cert),
        ("mqtt-client.key", &pki.client_key),
    ] {
        dirs.credential(cred, &std::fs::read_to_string(file).unwrap());
    }
    Some((broker, format!("127.0.0.1:{tls}")))
}

/// The ingest units' login on the broker (their URL's user) and a password.
fn ingest_login(unit: &Unit) -> String {
    let exec = unit.one("ExecStart");
    let broker = exec
        .split_whitespace()
        .skip_while(|w| *w != "--broker")
        .nth(1)
        .expect("--broker");
    url::Url::parse(broker).unwrap().username().to_string()
}

/// A device's message, QoS 1, on the broker's anonymous listener.
fn device_publish(broker: &PrivateMosquitto, body: &str) {
    let published = Command::new("mosquitto_pub")
        .args(["-h", "127.0.0.1", "-p", &broker.port.to_string(), "-q", "1"])
        .args(["-t", "fleet/TRUCK-7/events", "-m", body])
        .status()
        .expect("mosquitto_pub (Debian package mosquitto-clients)");
    assert!(published.success());
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

/// The client id an ingest unit's ExecStart names.
fn client_id_of(unit: &Unit) -> String {
    let exec = unit.one("ExecStart");
    let id = exec
        .split_whitespace()
        .skip_while(|w| *w != "--client-id")
        .nth(1)
        .expect("the ingest unit names its session");
    unit.expand(id, Path::new(""), Path::new(""))
}

const ZONE_EXIT: &str = r#"{"device_id":"TRUCK-7","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{"zone":"X","phone":"+905551112233"}}"#;

/// Longest a clean stop on the unit's KillSignal= may take here: the ingest's own
/// waits (the last PUBACKs, the DISCONNECT) are bounded at 2 s each, far inside
/// the units' TimeoutStopSec=.
const PROMPT_STOP: Duration = Duration::from_secs(10);

/// The two units' processes as systemd would run them, on one state directory: a
/// device's zone exit in through the ingest unit (TLS with a client certificate and
/// a login, every secret from its credential), processed once by the serve unit, on
/// PostgreSQL through a credential's URL, whose password shows nowhere; a device's
/// bad message dead-lettered at the ingest's door into that same database.
#[test]
fn the_units_run_as_written_ingest_to_serve_with_credentials() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(db) = rt.block_on(TestDb::new(Kind::Postgres)) else {
        return;
    };
    let dirs = UnitDirs::new();
    let ingest_unit = Unit::read(INGEST);
    let mqtt_password = "mqtt-credential-pw-9a41";
    let Some((mosquitto, broker)) = fleet_broker(&dirs, &ingest_login(&ingest_unit), mqtt_password)
    else {
        return rt.block_on(db.cleanup());
    };
    let (db_url, password) = with_password(&db.url, "unit-credential-pw-5c1e");
    dirs.credential("db-url", &format!("{db_url}\n"));
    let token = "fleet-ops-token-0123456789";
    dirs.credential("api-keys", &format!("fleet-ops {token}\n"));

    // The ingest unit: subscribed once the broker says so, then a device publishes.
    let mut ingest = UnitProcess::start(&ingest_unit, &dirs, Some(&broker));
    let client_id = client_id_of(&ingest_unit);
    wait_until("ingest's subscription", Duration::from_secs(30), || {
        mosquitto.log_has(&format!("Received SUBSCRIBE from {client_id}"))
    });
    device_publish(&mosquitto, ZONE_EXIT);
    device_publish(&mosquitto, "firmware 2.1 says hello");
    let ingest_metrics = ingest.url("127.0.0.1:9466", "/metrics");
    wait_until("the message on the queue", Duration::from_secs(30), || {
        sample(
            &ingest_metrics,
            r#"idem_ingress_messages_total{source="mqtt",dup_flag="false"}"#,
        ) == Some(2.0)
            && sample(
                &ingest_metrics,
                r#"idem_ingress_dead_lettered_total{source="mqtt",reason="malformed_json"}"#,
            ) == Some(1.0)
    });
    // The door's dead letter is in the credential's database, beside serve's.
    let door = rt.block_on(async {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters WHERE consumer = $1")
            .bind(idemwatch::engine::ingress::DEAD_LETTER_CONSUMER)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        n
    });
    assert_eq!(
        door, 1,
        "the ingest's dead letter in the credential's database"
    );

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
    let stopping = Instant::now();
    let ingest_exit = ingest.stop_as_systemd_would(&ingest_unit);
    let took = stopping.elapsed();
    println!(
        "ingest mqtt stopped on {} in {took:?}",
        ingest_unit.one("KillSignal")
    );
    assert!(
        ingest_exit.success(),
        "ingest: {ingest_exit:?}\n{}",
        ingest.stderr()
    );
    assert!(took < PROMPT_STOP, "ingest took {took:?} to stop");

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
        assert!(
            !text.contains(mqtt_password),
            "{what} shows the broker password"
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

/// Two instances of the share-group template, as systemd would run
/// `idemwatch-ingest-mqtt@PORT` twice: each its own session and /metrics port, one
/// subscription shared between them ($share/…), so the broker gives each device
/// message to one of them: every message enqueued, none twice, both members busy.
/// Each stops cleanly, promptly, on the unit's KillSignal=.
#[test]
fn two_template_instances_share_the_fleet_and_stop_cleanly() {
    let dirs = UnitDirs::new();
    let login = ingest_login(&Unit::read(TEMPLATE));
    let Some((mosquitto, broker)) = fleet_broker(&dirs, &login, "mqtt-member-pw-77e0") else {
        return;
    };
    // The database credential names a SQLite file (no server needed here): the
    // door's dead letters and the remembered filters.
    dirs.credential(
        "db-url",
        &format!("sqlite://{}/members.db\n", dirs.state_root.display()),
    );
    // One after the other: the first creates the database and the embedded queue.
    let members: Vec<(Unit, UnitProcess)> = [free_port(), free_port()]
        .into_iter()
        .map(|port| {
            let unit = Unit::instance(TEMPLATE, &port.to_string());
            let process = UnitProcess::start(&unit, &dirs, Some(&broker));
            let client_id = client_id_of(&unit);
            wait_until(
                "a member's shared subscription",
                Duration::from_secs(30),
                || mosquitto.log_has(&format!("Received SUBSCRIBE from {client_id}")),
            );
            (unit, process)
        })
        .collect();
    assert!(
        mosquitto.log_has("$share/idemwatch-ingest/fleet/+/events"),
        "subscribed as a share group"
    );
    const MESSAGES: u32 = 20;
    for seq in 1..=MESSAGES {
        device_publish(
            &mosquitto,
            &ZONE_EXIT.replace(r#""seq":1"#, &format!(r#""seq":{seq}"#)),
        );
    }
    let taken = |p: &UnitProcess, unit: &Unit| {
        sample(
            &p.url(&format!("127.0.0.1:{}", unit.instance), "/metrics"),
            r#"idem_ingress_messages_total{source="mqtt",dup_flag="false"}"#,
        )
        .unwrap_or(0.0)
    };
    wait_until(
        "every message taken in once",
        Duration::from_secs(30),
        || members.iter().map(|(u, p)| taken(p, u)).sum::<f64>() >= f64::from(MESSAGES),
    );
    // A moment for a message given to both (it would be a share group not working).
    std::thread::sleep(Duration::from_secs(1));
    let each: Vec<f64> = members.iter().map(|(u, p)| taken(p, u)).collect();
    println!("share-group members took {each:?} of {MESSAGES}");
    assert_eq!(
        each.iter().sum::<f64>(),
        f64::from(MESSAGES),
        "each message once: {each:?}"
    );
    assert!(
        each.iter().all(|n| *n > 0.0),
        "both members took some: {each:?}"
    );

    for (unit, mut process) in members {
        let stopping = Instant::now();
        let exit = process.stop_as_systemd_would(&unit);
        let took = stopping.elapsed();
        println!(
            "{} stopped on {} in {took:?}",
            unit.instance,
            unit.one("KillSignal")
        );
        assert!(
            exit.success(),
            "{}: {exit:?}\n{}",
            unit.instance,
            process.stderr()
        );
        assert!(
            took < PROMPT_STOP,
            "{} took {took:?} to stop",
            unit.instance
        );
    }
}
