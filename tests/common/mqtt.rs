//! A private Mosquitto for the device-ingress tests (its own port, persistence
//! directory and log; never the shared one), and the steps those tests share: a
//! fleet's events, `idemwatch ingest mqtt` as a process, and the check that the
//! consumers applied each event once.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::services::{free_port, reachable};
use super::{idemwatch_bin, KillOnDrop, TempEnv};
use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::envelope::EventType;
use idemwatch::engine::{Engine, EngineConfig};
use idemwatch::sim::fleet::{FleetConfig, FleetSim};
use idemwatch::sim::sandbox_provider::{self, SandboxClient};

pub struct PrivateMosquitto {
    pub port: u16,
    /// Its directory (configuration, persistence, log, password file, certificates).
    pub dir: PathBuf,
    conf: PathBuf,
    log: PathBuf,
    proc: Option<KillOnDrop>,
}

impl PrivateMosquitto {
    pub fn new(env: &TempEnv) -> Option<Self> {
        Self::with_conf(env, "")
    }

    /// A broker with `extra` lines appended to the test's configuration.
    pub fn with_conf(env: &TempEnv, extra: &str) -> Option<Self> {
        Self::configured(env, "", extra)
    }

    /// A broker whose devices' listener ([`PrivateMosquitto::port`]) stays anonymous
    /// and whose other listeners, in `listeners`, have settings of their own
    /// (`per_listener_settings`): a password file, TLS.
    pub fn with_listeners(env: &TempEnv, listeners: &str) -> Option<Self> {
        Self::configured(env, "per_listener_settings true\n", listeners)
    }

    /// Where the broker keeps its files: write a password file or certificates here
    /// before starting it.
    pub fn dir_of(env: &TempEnv) -> PathBuf {
        let dir = env.path("mosquitto");
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn configured(env: &TempEnv, head: &str, extra: &str) -> Option<Self> {
        if Command::new("mosquitto").arg("-h").output().is_err() {
            if super::backends::required() {
                panic!("mosquitto is required (IDEMWATCH_REQUIRE_SERVICES=1)");
            }
            eprintln!("SKIP: mosquitto not installed");
            return None;
        }
        let port = free_port();
        let dir = Self::dir_of(env);
        let log = dir.join("mosquitto.log");
        let conf = dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "{head}user root\nlistener {port} 127.0.0.1\nallow_anonymous true\npersistence true\npersistence_location {}/\nlog_dest file {}\nlog_type all\nmax_queued_messages 10000\n{extra}",
                dir.display(),
                log.display()
            ),
        )
        .unwrap();
        let mut m = PrivateMosquitto {
            port,
            dir,
            conf,
            log,
            proc: None,
        };
        m.start();
        Some(m)
    }

    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    pub fn start(&mut self) {
        let child = Command::new("mosquitto")
            .arg("-c")
            .arg(&self.conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mosquitto starts");
        self.proc = Some(KillOnDrop(child));
        let deadline = Instant::now() + Duration::from_secs(20);
        while reachable(&self.url()).is_err() {
            assert!(Instant::now() < deadline, "private mosquitto did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A clean stop (SIGTERM: the broker writes its sessions and queued messages to
    /// its persistence file), then a start on the same port.
    pub fn restart(&mut self) {
        if let Some(mut p) = self.proc.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &p.0.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while p.0.try_wait().ok().flatten().is_none() {
                assert!(Instant::now() < deadline, "mosquitto did not stop");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.start();
    }

    /// Wait (30 s at most) for a line of the broker's log.
    pub fn wait_for_log(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.log_has(needle) {
            assert!(
                Instant::now() < deadline,
                "not in the broker's log: {needle}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log_has(&self, needle: &str) -> bool {
        self.log_count(needle) > 0
    }

    /// Wait (30 s at most) for `ingest` to subscribe (`Received SUBSCRIBE from
    /// CLIENT_ID` in the broker's log). An ingest that exits meanwhile fails the wait
    /// at once with its exit status, output and log, instead of the wait's timeout.
    pub fn wait_subscribed(&self, ingest: &mut KillOnDrop, client_id: &str, log: &Path) {
        use std::io::Read;
        let needle = format!("Received SUBSCRIBE from {client_id}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.log_has(&needle) {
            if let Some(status) = ingest.0.try_wait().expect("ingest's status") {
                let (mut out, mut err) = (String::new(), String::new());
                if let Some(o) = ingest.0.stdout.as_mut() {
                    let _ = o.read_to_string(&mut out);
                }
                if let Some(e) = ingest.0.stderr.as_mut() {
                    let _ = e.read_to_string(&mut err);
                }
                let log = std::fs::read_to_string(log).unwrap_or_default();
                panic!("{client_id} exited ({status}) before it subscribed:\n{out}\n{err}\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "{client_id} did not subscribe within 30 s; its log:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// How many times `needle` is in the broker's log.
    pub fn log_count(&self, needle: &str) -> usize {
        std::fs::read_to_string(&self.log).map_or(0, |t| t.matches(needle).count())
    }

    /// Wait (30 s at most) until `needle` is in the broker's log `n` times.
    pub fn wait_for_log_count(&self, needle: &str, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.log_count(needle) < n {
            assert!(
                Instant::now() < deadline,
                "not {n} times in the broker's log: {needle}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// `n` distinct events of 5 vehicles, and each as a device publishes it.
pub fn fleet_events(
    seed: u64,
    n: usize,
) -> (
    Vec<idemwatch::sim::fleet::SimMessage>,
    Vec<(String, Vec<u8>)>,
) {
    let mut sim = FleetSim::new(FleetConfig {
        vehicles: 5,
        seed,
        redelivery_rate: 0.0,
        late_rate: 0.0,
        ..FleetConfig::default()
    });
    let events: Vec<_> = (0..n).map(|_| sim.next()).collect();
    let messages = events
        .iter()
        .map(|m| (m.envelope.device_id.clone(), m.raw.clone()))
        .collect();
    (events, messages)
}

/// `idemwatch ingest mqtt --broker URL` under the persistent session `client_id`,
/// into the test's database and embedded queue, exiting after 8 s without a message,
/// its counts as JSON; the caller adds the topics and the rest.
pub fn ingest_command(env: &TempEnv, broker_url: &str, client_id: &str, log: &str) -> Command {
    let mut c = Command::new(idemwatch_bin());
    c.args(["ingest", "mqtt", "--broker", broker_url])
        .args(["--client-id", client_id, "--idle-exit", "8s", "--json"])
        .env("IDEMWATCH_LOG_FILE", env.path(log))
        .env("IDEMWATCH_DB", env.db_url())
        .env("IDEMWATCH_QUEUE", env.queue_url())
        .env_remove("IDEMWATCH_MQTT_PASSWORD")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// [`ingest_command`] on `broker`'s devices' topic `fleet/+/events`, started.
pub fn spawn_ingest(
    env: &TempEnv,
    broker: &PrivateMosquitto,
    client_id: &str,
    log: &str,
) -> KillOnDrop {
    let child = ingest_command(env, &broker.url(), client_id, log)
        .args(["--topic", "fleet/+/events"])
        .spawn()
        .expect("ingest starts");
    KillOnDrop(child)
}

/// Wait (90 s at most) for an ingest to exit: its exit code, stdout and stderr.
pub fn ingest_exit(ingest: &mut KillOnDrop) -> (Option<i32>, String, String) {
    use std::io::Read;
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = ingest.0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "ingest did not exit");
        std::thread::sleep(Duration::from_millis(100));
    };
    let (mut out, mut err) = (String::new(), String::new());
    if let Some(mut s) = ingest.0.stdout.take() {
        s.read_to_string(&mut out).unwrap();
    }
    if let Some(mut s) = ingest.0.stderr.take() {
        s.read_to_string(&mut err).unwrap();
    }
    (status.code(), out, err)
}

/// Wait (90 s at most) for an ingest to go idle and exit; its `--json` stats.
pub fn ingest_stats(ingest: &mut KillOnDrop) -> serde_json::Value {
    let (code, out, err) = ingest_exit(ingest);
    assert_eq!(code, Some(0), "{out}\n{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"))
}

/// Run the consumers over what the ingress queued: every event there (vehicle-state
/// sees each once), each zone exit counted once and one SMS each, no dead letter.
pub async fn assert_each_effect_once(
    env: &TempEnv,
    events: &[idemwatch::sim::fleet::SimMessage],
) -> idemwatch::engine::metrics::CountSummary {
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let cfg = EngineConfig::new(
        &env.db_url(),
        &env.queue_url(),
        &sandbox.url(),
        &sandbox.url(),
    );
    let engine = Engine::open(&cfg).await.unwrap();
    let s = engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .unwrap();
    assert_eq!(s.total.dead_lettered, 0, "{s:?}");
    let vehicle_state = &s.consumers["vehicle-state"];
    let distinct_events: BTreeSet<_> = events.iter().map(|m| m.envelope.key()).collect();
    // A late event (older than the vehicle's state) is processed too, and also
    // counted out of order: two ingest processes interleave the fleet's order.
    assert_eq!(
        vehicle_state.processed,
        distinct_events.len() as u64,
        "every event ingested: {s:?}"
    );
    let mut exits: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    for m in events {
        if m.envelope.event_type == EventType::ZoneExit {
            exits
                .entry(m.envelope.device_id.clone())
                .or_default()
                .insert(m.envelope.seq);
        }
    }
    let distinct: usize = exits.values().map(BTreeSet::len).sum();
    assert!(distinct > 0);
    for (device, seqs) in &exits {
        assert_eq!(
            engine.store.zone_exits(device).await.unwrap(),
            seqs.len() as i64,
            "{device}"
        );
    }
    let sms = SandboxClient::new(sandbox.url())
        .unwrap()
        .sent_sms()
        .await
        .unwrap();
    assert_eq!(sms.len(), distinct, "one SMS per distinct zone exit");
    assert_eq!(
        s.consumers["trip-counter"].processed as usize, distinct,
        "{s:?}"
    );
    s
}

/// The ingress's user on [`password_broker`].
pub const INGEST_USER: &str = "fleet-ingest";

/// A broker whose devices publish anonymously ([`PrivateMosquitto::port`]) and whose
/// second listener, the ingress's (the returned port), takes only logins from its
/// password file (`allow_anonymous false`): [`INGEST_USER`] with `password`.
pub fn password_broker(env: &TempEnv, password: &str) -> Option<(PrivateMosquitto, u16)> {
    let passwd = password_file(env, INGEST_USER, password)?;
    let auth = free_port();
    let broker = PrivateMosquitto::with_listeners(
        env,
        &format!(
            "listener {auth} 127.0.0.1\nallow_anonymous false\npassword_file {}\n",
            passwd.display()
        ),
    )?;
    Some((broker, auth))
}

/// A Mosquitto password file in the broker's directory with one login, `user` and
/// `password` (None, a skip, without mosquitto_passwd outside CI).
pub fn password_file(env: &TempEnv, user: &str, password: &str) -> Option<PathBuf> {
    let passwd = PrivateMosquitto::dir_of(env).join("passwd");
    let made = Command::new("mosquitto_passwd")
        .arg("-b")
        .arg("-c")
        .arg(&passwd)
        .args([user, password])
        .output();
    match made {
        Ok(o) if o.status.success() => Some(passwd),
        other => {
            if super::backends::required() {
                panic!("mosquitto_passwd is required: {other:?}");
            }
            eprintln!("SKIP: mosquitto_passwd failed: {other:?}");
            None
        }
    }
}

/// PEM files of a test PKI, written by [`tls_broker`].
pub struct TestPki {
    /// The CA that signed the broker's and the client's certificates.
    pub ca: PathBuf,
    /// A CA that signed nothing here.
    pub other_ca: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

/// A broker with a TLS listener (the returned port) whose certificate, for
/// 127.0.0.1 only, a test CA signed, and which requires a client certificate of
/// that CA; devices publish on the plain, anonymous one. Certificates made now with
/// rcgen, nothing from the machine.
pub fn tls_broker(env: &TempEnv) -> Option<(PrivateMosquitto, u16, TestPki)> {
    let (pki, server_cert, server_key) = test_pki(env, INGEST_USER);
    let tls = free_port();
    let broker = PrivateMosquitto::with_listeners(
        env,
        &format!(
            "listener {tls} 127.0.0.1\nallow_anonymous true\ncafile {}\ncertfile {}\nkeyfile {}\nrequire_certificate true\n",
            pki.ca.display(),
            server_cert.display(),
            server_key.display()
        ),
    )?;
    Some((broker, tls, pki))
}

/// A test PKI in the broker's directory, made now with rcgen: a CA, the broker's
/// certificate for 127.0.0.1 and its key (the two paths returned beside), a client
/// certificate for `client` and its key, and a CA that signed nothing here.
pub fn test_pki(env: &TempEnv, client: &str) -> (TestPki, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let dir = PrivateMosquitto::dir_of(env);
    let write = |name: &str, pem: String| {
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path
    };
    let ca = |name: &str| {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        (cert, key)
    };
    let (ca_cert, ca_key) = ca("idemwatch test CA");
    let (other_cert, _) = ca("another CA");
    let signed = |names: Vec<String>, cn: &str| {
        let mut p = CertificateParams::new(names).unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &ca_cert, &ca_key).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = signed(vec!["127.0.0.1".into()], "broker");
    let (client_cert, client_key) = signed(vec![], client);
    let pki = TestPki {
        ca: write("ca.pem", ca_cert.pem()),
        other_ca: write("other-ca.pem", other_cert.pem()),
        client_cert: write("client.pem", client_cert),
        client_key: write("client.key", client_key),
    };
    let server_cert = write("server.pem", server_cert);
    let server_key = write("server.key", server_key);
    (pki, server_cert, server_key)
}
