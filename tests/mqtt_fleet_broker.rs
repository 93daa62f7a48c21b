//! `ingest mqtt` against a fleet broker as production runs one (issue 44), each on a
//! PRIVATE Mosquitto the test starts: a password file with `allow_anonymous false`, a
//! TLS listener that requires a client certificate (certificates made in the test),
//! a topic changed between two runs of one client id, and two ingest processes
//! sharing a subscription while one is SIGKILLed. Devices publish on the broker's
//! plain anonymous listener; the ingress connects to the guarded one.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::mqtt::{
    assert_each_effect_once, fleet_events, ingest_command, ingest_exit, ingest_stats,
    password_broker, tls_broker, PrivateMosquitto, INGEST_USER,
};
use common::{KillOnDrop, TempEnv};
use idemwatch::sim::mqtt_device::publish_fleet;

/// An ingest expected to stop at once: its exit code, stdout and stderr.
fn refused(mut c: std::process::Command) -> (Option<i32>, String, String) {
    let mut p = KillOnDrop(c.spawn().expect("ingest starts"));
    ingest_exit(&mut p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_broker_takes_the_ingress_login_and_a_refused_one_exits_3_naming_the_user() {
    let env = TempEnv::new();
    const INGEST_PASSWORD: &str = "S3cret-Pa55word-7f1c";
    let Some((broker, auth)) = password_broker(&env, INGEST_PASSWORD) else {
        return;
    };
    let url = format!("mqtt://{INGEST_USER}@127.0.0.1:{auth}");
    let wrong = "not-the-Pa55word-0b9e";
    let mut c = ingest_command(&env, &url, "ingest-wrong", "wrong.log");
    c.args(["--topic", "fleet/+/events"])
        .env("IDEMWATCH_MQTT_PASSWORD", wrong);
    let (code, out, err) = refused(c);
    assert_eq!(code, Some(3), "{out}\n{err}");
    assert!(
        err.contains(&format!("refused the login of user {INGEST_USER}")),
        "{err}"
    );
    assert!(!format!("{out}{err}").contains(wrong), "{out}\n{err}");

    let mut c = ingest_command(
        &env,
        &format!("mqtt://127.0.0.1:{auth}"),
        "ingest-anon",
        "anon.log",
    );
    c.args(["--topic", "fleet/+/events"]);
    let (code, _, err) = refused(c);
    assert_eq!(code, Some(3), "{err}");
    assert!(err.contains("anonymous"), "{err}");

    // The right password, from a file: the fleet flows through the guarded listener.
    let file = env.path("mqtt-password");
    std::fs::write(&file, format!("{INGEST_PASSWORD}\n")).unwrap();
    let mut c = ingest_command(&env, &url, "ingest-auth", "auth.log");
    c.args(["--topic", "fleet/+/events", "--password-file"])
        .arg(&file);
    let mut ingest = KillOnDrop(c.spawn().expect("ingest starts"));
    broker.wait_for_log("Received SUBSCRIBE from ingest-auth");
    let (events, messages) = fleet_events(44, 200);
    let d = publish_fleet(&broker.url(), "dev-auth", "fleet", &messages, 0.2, 1, 7)
        .await
        .unwrap();
    let stats = ingest_stats(&mut ingest);
    assert!(
        stats["received"].as_u64().unwrap() >= d.published + d.retransmitted,
        "{stats} {d:?}"
    );
    assert!(broker.log_has(&format!("u'{INGEST_USER}'")));
    assert_each_effect_once(&env, &events).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_broker_is_reached_with_its_ca_and_a_client_certificate_and_a_failed_check_is_named()
{
    let env = TempEnv::new();
    let Some((broker, tls, pki)) = tls_broker(&env) else {
        return;
    };
    let url = format!("mqtts://127.0.0.1:{tls}");
    let ingest = |url: &str, ca: &Path, client: bool, id: &str| {
        let mut c = ingest_command(&env, url, id, &format!("{id}.log"));
        c.args(["--topic", "fleet/+/events", "--ca-file"]).arg(ca);
        if client {
            c.arg("--client-cert")
                .arg(&pki.client_cert)
                .arg("--client-key")
                .arg(&pki.client_key);
        }
        c
    };
    let checks = [
        (
            ingest(&url, &pki.other_ca, true, "untrusted"),
            "the broker's certificate is not signed by a trusted CA",
        ),
        (
            ingest(
                &format!("mqtts://localhost:{tls}"),
                &pki.ca,
                true,
                "wrong-name",
            ),
            "the broker's certificate is not valid for the name localhost",
        ),
        (
            ingest(&url, &pki.ca, false, "no-client-cert"),
            "the broker wants a client certificate",
        ),
    ];
    for (c, check) in checks {
        let (code, out, err) = refused(c);
        assert_eq!(code, Some(3), "{check}: {out}\n{err}");
        assert!(err.contains(check), "{check}: {err}");
    }

    let mut ingest = KillOnDrop(
        ingest(&url, &pki.ca, true, "tls-ok")
            .spawn()
            .expect("ingest starts"),
    );
    broker.wait_for_log("Received SUBSCRIBE from tls-ok");
    let (events, messages) = fleet_events(45, 200);
    let d = publish_fleet(&broker.url(), "dev-tls", "fleet", &messages, 0.2, 1, 8)
        .await
        .unwrap();
    let stats = ingest_stats(&mut ingest);
    assert!(
        stats["received"].as_u64().unwrap() >= d.published + d.retransmitted,
        "{stats} {d:?}"
    );
    assert_each_effect_once(&env, &events).await;
}

/// The field report: `--topic 'tA/+/events'`, stopped, then `--topic 'tB/+/events'`
/// with the same client id. The broker kept the session with the old filter and the
/// ingress subscribed only to a new session: "ingested 0 messages" while devices
/// published on tB. Now the second run subscribes tB and unsubscribes tA (what tA
/// carries meanwhile is not taken), and a third run takes both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_changed_between_two_runs_of_one_client_id_is_the_subscription() {
    let env = TempEnv::new();
    let Some(broker) = PrivateMosquitto::new(&env) else {
        return;
    };
    let id = "idemwatch-ingest";
    let subscribed = format!("Received SUBSCRIBE from {id}");
    let run = |topics: &[&str], log: &str| {
        let mut c = ingest_command(&env, &broker.url(), id, log);
        for t in topics {
            c.args(["--topic", t]);
        }
        KillOnDrop(c.spawn().expect("ingest starts"))
    };
    let (events, messages) = fleet_events(46, 150);
    let (on_a, rest) = messages.split_at(50);
    let (on_b, both) = rest.split_at(80);
    let publish = |prefix: &'static str, m: Vec<(String, Vec<u8>)>, seed: u64| {
        let url = broker.url();
        async move {
            let d = publish_fleet(&url, &format!("dev-{prefix}"), prefix, &m, 0.0, 0, seed)
                .await
                .unwrap();
            assert_eq!(d.acked, d.published, "{d:?}");
        }
    };

    let mut first = run(&["tA/+/events"], "run-1.log");
    broker.wait_for_log_count(&subscribed, 1);
    publish("tA", on_a.to_vec(), 1).await;
    let s1 = ingest_stats(&mut first);
    assert_eq!(s1["received"], 50, "{s1}");

    let mut second = run(&["tB/+/events"], "run-2.log");
    broker.wait_for_log_count(&subscribed, 2);
    broker.wait_for_log(&format!("Received UNSUBSCRIBE from {id}"));
    publish("tB", on_b.to_vec(), 2).await;
    // No longer the subscription: nothing of this reaches the ingress.
    let (_, stray) = fleet_events(47, 20);
    publish("tA", stray, 3).await;
    let s2 = ingest_stats(&mut second);
    assert_eq!(s2["received"], 80, "{s2}");
    assert_eq!(s2["filters"], serde_json::json!(["tB/+/events"]), "{s2}");
    assert_eq!(
        s2["unsubscribed"],
        serde_json::json!(["tA/+/events"]),
        "{s2}"
    );

    let mut third = run(&["tA/+/events", "tB/+/events"], "run-3.log");
    broker.wait_for_log_count(&subscribed, 3);
    let (to_a, to_b) = both.split_at(10);
    publish("tA", to_a.to_vec(), 4).await;
    publish("tB", to_b.to_vec(), 5).await;
    let s3 = ingest_stats(&mut third);
    assert_eq!(s3["received"], 20, "{s3}");
    assert_eq!(
        s3["filters"],
        serde_json::json!(["tA/+/events", "tB/+/events"]),
        "{s3}"
    );
    assert_eq!(s3["unsubscribed"], serde_json::json!([]), "{s3}");
    let log = std::fs::read_to_string(env.path("run-3.log")).unwrap();
    assert!(
        log.contains("tA/+/events, tB/+/events"),
        "the log names the filters"
    );
    assert_each_effect_once(&env, &events).await;
}

/// Two ingest processes in one share group (`$share/fleet-ingest/fleet/+/events`),
/// one SIGKILLed while devices publish (QoS 1, DUP retransmissions), then started
/// again under its client id as a supervisor would: Mosquitto kept routing the dead
/// member's share to its session, which it now takes. Every device message is
/// enqueued, the two split the traffic, and the consumers count each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ingest_instances_in_a_share_group_split_the_fleet_and_one_sigkilled_loses_nothing() {
    let env = TempEnv::new();
    let Some(broker) = PrivateMosquitto::new(&env) else {
        return;
    };
    let member = |id: &str, log: &str| {
        let mut c = ingest_command(&env, &broker.url(), id, log);
        c.args(["--topic", "fleet/+/events", "--share-group", "fleet-ingest"]);
        KillOnDrop(c.spawn().expect("ingest starts"))
    };
    let mut a = member("ingest-a", "a-1.log");
    let mut b = member("ingest-b", "b.log");
    broker.wait_subscribed(&mut a, "ingest-a", &env.path("a-1.log"));
    broker.wait_subscribed(&mut b, "ingest-b", &env.path("b.log"));
    assert!(broker.log_has("$share/fleet-ingest/fleet/+/events"));

    let (events, messages) = fleet_events(48, 800);
    let devices = {
        let url = broker.url();
        tokio::spawn(async move {
            publish_fleet(&url, "dev-share", "fleet", &messages, 0.3, 2, 9).await
        })
    };
    let queue = idemwatch::engine::queue::open(&env.queue_url())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while queue
        .depth("trip-counter")
        .await
        .map(|d| d.ready)
        .unwrap_or(0)
        < 50
    {
        assert!(Instant::now() < deadline, "the members queued nothing");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    a.stop();
    let at_kill = queue.depth("trip-counter").await.unwrap().ready;
    let d = devices.await.unwrap().unwrap();
    assert!(
        at_kill < d.published,
        "the kill came after everything was queued ({at_kill}): it tests nothing"
    );
    assert_eq!(d.acked, d.published, "{d:?}");
    let mut a = member("ingest-a", "a-2.log");
    let (sa, sb) = (ingest_stats(&mut a), ingest_stats(&mut b));
    let sent = d.published + d.retransmitted;
    let (ra, rb) = (
        sa["received"].as_u64().unwrap(),
        sb["received"].as_u64().unwrap(),
    );
    eprintln!("devices: {d:?}; a after its restart: {sa}; b: {sb}");
    assert!(
        rb > 0 && rb < sent,
        "b took a share, not everything: {rb} of {sent}"
    );
    assert!(ra > 0, "a's session kept its share while it was dead: {sa}");
    assert_each_effect_once(&env, &events).await;
}
