//! Device ingress end to end over a PRIVATE Mosquitto (its own port, persistence
//! directory and log; never the shared one): devices publish QoS 1 with DUP
//! retransmissions, the broker restarts in the middle, `idemwatch ingest mqtt` resumes
//! its persistent session — nothing lost, and the consumers apply each effect once.

mod common;

use std::time::{Duration, Instant};

use common::mqtt::{
    assert_each_effect_once, fleet_events, ingest_stats, spawn_ingest, PrivateMosquitto,
};
use common::TempEnv;
use idemwatch::sim::mqtt_device::publish_fleet;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_ingress_with_dup_retransmissions_and_a_broker_restart_loses_nothing_and_doubles_nothing(
) {
    let env = TempEnv::new();
    let Some(mut broker) = PrivateMosquitto::new(&env) else {
        return;
    };
    let mut ingest = spawn_ingest(&env, &broker, "idemwatch-ingest-test", "ingest.log");
    broker.wait_for_log("Received SUBSCRIBE from idemwatch-ingest-test");

    let (events, messages) = fleet_events(20, 400);
    let (first, second) = messages.split_at(200);
    let a = publish_fleet(&broker.url(), "dev-a", "fleet", first, 0.3, 2, 1)
        .await
        .unwrap();
    assert!(a.retransmitted > 50, "{a:?}");
    broker.restart();
    // Published while the ingress is still reconnecting: kept for its session.
    let b = publish_fleet(&broker.url(), "dev-b", "fleet", second, 0.3, 2, 2)
        .await
        .unwrap();
    assert!(b.retransmitted > 50, "{b:?}");

    let stats = ingest_stats(&mut ingest);
    let sent = a.published + a.retransmitted + b.published + b.retransmitted;
    // Every copy the devices sent arrived (QoS 1: at least once), over 2+ connections.
    assert!(
        stats["received"].as_u64().unwrap() >= sent,
        "{stats} vs {sent}"
    );
    assert!(stats["connections"].as_u64().unwrap() >= 2, "{stats}");

    let s = assert_each_effect_once(&env, &events).await;
    assert!(
        s.total.duplicate_dropped > 0,
        "the retransmissions were dropped as duplicates: {s:?}"
    );
}

/// One device's firmware bug (issue 39): an 80 KB message (under the broker's packet
/// limit, over the envelope's 64 KiB), a 2 MiB one (over what the ingress used to read
/// at all) and one that is not JSON, among the fleet's normal traffic. The ingress
/// used to retry the batch holding the first forever, so nothing after it reached a
/// consumer. Now each poison message is dead-lettered at the door with its reason and
/// its bytes (the first 64 KiB, the true length in the detail), acked and counted, and
/// every other event is processed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_device_message_is_dead_lettered_at_the_door_and_the_fleet_flows() {
    use idemwatch::engine::envelope::{cut_raw_length, DEAD_LETTER_KEEP};
    use idemwatch::engine::store::DeadLetterFilter;

    let env = TempEnv::new();
    let Some(broker) = PrivateMosquitto::new(&env) else {
        return;
    };
    let client_id = "idemwatch-ingest-poison";
    let mut ingest = spawn_ingest(&env, &broker, client_id, "ingest.log");
    broker.wait_for_log(&format!("Received SUBSCRIBE from {client_id}"));
    let (events, mut messages) = fleet_events(39, 300);
    let firmware_bug = vec![b'7'; 80_000];
    let huge = format!("{{\"pad\":\"{}\"}}", "x".repeat(2 << 20)).into_bytes();
    let not_json = b"\xff\xfe garbage from a sensor".to_vec();
    messages.insert(0, ("34-BUG-1".into(), firmware_bug.clone()));
    messages.insert(100, ("34-BUG-2".into(), huge.clone()));
    messages.insert(200, ("34-BUG-3".into(), not_json.clone()));
    let d = publish_fleet(&broker.url(), "dev-poison", "fleet", &messages, 0.0, 0, 6)
        .await
        .unwrap();
    assert_eq!(d.acked, d.published, "{d:?}");

    let stats = ingest_stats(&mut ingest);
    assert_eq!(stats["received"], 303, "{stats}");
    assert_eq!(stats["published"], 300, "{stats}");
    assert_eq!(
        stats["dead_lettered"],
        serde_json::json!({"too_large": 2, "malformed_json": 1}),
        "{stats}"
    );
    assert_each_effect_once(&env, &events).await;

    let store = idemwatch::engine::store::open(&env.db_url()).await.unwrap();
    let mut letters = store
        .find_dead_letters(&DeadLetterFilter {
            consumer: Some("ingress:mqtt".into()),
            ..DeadLetterFilter::default()
        })
        .await
        .unwrap();
    letters.sort_by_key(|l| l.id);
    let seen: Vec<_> = letters
        .iter()
        .map(|l| {
            let detail = l.detail.clone().unwrap_or_default();
            (l.reason.as_str(), l.raw.len(), cut_raw_length(&detail))
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("too_large", DEAD_LETTER_KEEP, Some(firmware_bug.len())),
            ("too_large", DEAD_LETTER_KEEP, Some(huge.len())),
            ("malformed_json", not_json.len(), None),
        ],
        "{letters:?}"
    );
    assert_eq!(letters[0].raw, firmware_bug[..DEAD_LETTER_KEEP]);
    assert_eq!(letters[2].raw, not_json);
}

/// `ingest mqtt` SIGKILLed while devices publish QoS 1 (with DUP retransmissions),
/// more published while it is dead, then started again under the same client id: the
/// broker kept its session, so what it had not PUBACKed comes again and what arrived
/// meanwhile is delivered — nothing lost; what it had queued but not acked comes
/// twice, and the dedup table makes each effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_ingress_killed_while_devices_publish_loses_nothing_and_doubles_nothing() {
    let env = TempEnv::new();
    let Some(broker) = PrivateMosquitto::new(&env) else {
        return;
    };
    let client_id = "idemwatch-ingest-kill";
    let mut ingest = spawn_ingest(&env, &broker, client_id, "ingest-1.log");
    broker.wait_for_log(&format!("Received SUBSCRIBE from {client_id}"));
    let (events, messages) = fleet_events(21, 600);
    let (first, second) = messages.split_at(400);
    let url = broker.url();
    let devices = {
        let first = first.to_vec();
        tokio::spawn(async move { publish_fleet(&url, "dev-k1", "fleet", &first, 0.3, 2, 3).await })
    };
    // SIGKILL as soon as the ingress has queued something: mid-stream.
    let queue = idemwatch::engine::queue::open(&env.queue_url())
        .await
        .unwrap();
    let queued = || async {
        queue
            .depth("trip-counter")
            .await
            .map(|d| d.ready)
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while queued().await == 0 {
        assert!(Instant::now() < deadline, "the ingress queued nothing");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    ingest.stop();
    let at_kill = queued().await;
    let a = devices.await.unwrap().unwrap();
    assert!(a.retransmitted > 50 && a.acked == a.published, "{a:?}");
    assert!(
        at_kill < a.published,
        "the kill came after everything was queued ({at_kill} of {}): it tests nothing",
        a.published
    );
    // The ingress is dead: the broker queues these for its session.
    let b = publish_fleet(&broker.url(), "dev-k2", "fleet", second, 0.3, 2, 4)
        .await
        .unwrap();
    assert_eq!(b.acked, b.published, "{b:?}");
    let mut again = spawn_ingest(&env, &broker, client_id, "ingest-2.log");
    let stats = ingest_stats(&mut again);
    eprintln!("queued at the kill: {at_kill}; devices: {a:?} {b:?}; ingest after: {stats}");
    assert!(stats["received"].as_u64().unwrap() > 0, "{stats}");
    let s = assert_each_effect_once(&env, &events).await;
    assert!(
        b.published > 0 && s.total.duplicate_dropped > 0,
        "{b:?} {s:?}"
    );
}

/// A broker flushing a session's backlog faster than the queue takes it: 3,000
/// events published while the ingress was away, the broker letting every one fly at
/// once (`max_inflight_messages 0`). The ingress used to PUBACK from its main loop,
/// which waited on the MQTT client while the client's poller waited on the main
/// loop: after ~1,100 messages both stopped and `--idle-exit` never came. Now every
/// event is taken, each effect once, and the ingress exits when idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_thousands_flushed_at_once_is_taken_whole() {
    let env = TempEnv::new();
    let Some(broker) = PrivateMosquitto::with_conf(&env, "max_inflight_messages 0\n") else {
        return;
    };
    let client_id = "idemwatch-ingest-backlog";
    // The persistent session exists (subscribed), then the ingress goes away.
    let mut first = spawn_ingest(&env, &broker, client_id, "ingest-1.log");
    broker.wait_for_log(&format!("Received SUBSCRIBE from {client_id}"));
    first.stop();
    let (events, messages) = fleet_events(33, 3000);
    let d = publish_fleet(&broker.url(), "dev-backlog", "fleet", &messages, 0.0, 0, 5)
        .await
        .unwrap();
    assert_eq!(d.acked, d.published, "{d:?}");
    let mut again = spawn_ingest(&env, &broker, client_id, "ingest-2.log");
    let stats = ingest_stats(&mut again);
    assert!(
        stats["received"].as_u64().unwrap() >= 3000,
        "the whole backlog taken: {stats}"
    );
    assert_each_effect_once(&env, &events).await;
}

/// `drill device-retransmit` through a real broker and the ingress: one QoS 1 publish
/// sent 4 times (3 retransmissions with the DUP flag) is one SMS and +1 in idempotent
/// mode, and 4 SMS, +4 in naive mode. The drill leaves no MQTT session behind.
#[test]
fn device_retransmit_drill_through_mosquitto_sends_one_sms_idempotent_and_n_naive() {
    let env = TempEnv::new();
    let Some(broker) = PrivateMosquitto::new(&env) else {
        return;
    };
    let url = broker.url();
    let drill = |mode: &str| {
        let (code, stdout, stderr) = common::run_cli(
            &env,
            &[
                "drill",
                "device-retransmit",
                "--times",
                "4",
                "--broker",
                &url,
                "--mode",
                mode,
                "--json",
            ],
        );
        let r: serde_json::Value = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("{e}: {stdout}\nstderr: {stderr}"));
        (code, r)
    };
    let (code, r) = drill("idempotent");
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["verdict"], "pass", "{r}");
    assert_eq!(r["details"]["path"], "mqtt", "{r}");
    let mqtt = &r["details"]["mqtt"];
    assert_eq!(mqtt["device_retransmitted_with_dup"], 3, "{r}");
    assert!(mqtt["ingress_received"].as_u64().unwrap() >= 4, "{r}");
    assert_eq!(r["sms_sent"], 1, "{r}");
    assert_eq!(r["counter_delta"], 1, "{r}");
    assert_eq!(r["deliveries"], mqtt["ingress_published"], "{r}");
    assert_eq!(
        r["duplicate_dropped"].as_u64().unwrap(),
        r["deliveries"].as_u64().unwrap() - 1,
        "{r}"
    );

    let (code, r) = drill("naive");
    assert_eq!(code, 0, "a naive drill failing is the demonstration: {r}");
    assert_eq!(r["verdict"], "fail", "{r}");
    assert_eq!(r["sms_sent"], r["deliveries"], "{r}");
    assert!(r["sms_sent"].as_u64().unwrap() >= 4, "{r}");
    assert!(r["counter_delta"].as_i64().unwrap() >= 4, "{r}");

    // The ingress's session was dropped: reconnecting with its id finds none.
    let topic = r["details"]["mqtt"]["topic"].as_str().unwrap();
    let namespace = topic.split('/').nth(1).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let present = rt.block_on(async {
        let mut o =
            rumqttc::MqttOptions::new(format!("{namespace}-ingest"), "127.0.0.1", broker.port);
        o.set_clean_session(false);
        let (client, mut ev) = rumqttc::AsyncClient::new(o, 8);
        let present = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                if let Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(a))) = ev.poll().await {
                    return a.session_present;
                }
            }
        })
        .await
        .expect("CONNACK");
        let _ = client.disconnect().await;
        let _ = tokio::time::timeout(Duration::from_secs(2), ev.poll()).await;
        present
    });
    assert!(!present, "the drill's MQTT session was left on the broker");

    // Without a broker the copies go straight into the queues: same verdicts.
    let (code, stdout, _) = common::run_cli(
        &env,
        &["drill", "device-retransmit", "--times", "3", "--json"],
    );
    let r: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (code, &r["details"]["path"]),
        (0, &serde_json::json!("queue")),
        "{r}"
    );
    assert_eq!(
        (r["sms_sent"].as_u64(), r["duplicate_dropped"].as_u64()),
        (Some(1), Some(2)),
        "{r}"
    );
}

/// The dashboard reads an ingress's metrics of a target that exports them (Sources
/// panel, per source): messages in and those flagged DUP with their rates, whether
/// it holds its broker connection and since when, its newest failure, and what it
/// dead-lettered at its door by reason.
#[test]
fn the_dashboard_reads_ingress_messages_link_and_dead_letters() {
    use idemwatch::config::MetricNames;
    use idemwatch::engine::envelope::RejectReason;
    use idemwatch::engine::metrics::Metrics;
    use idemwatch::engine::mqtt_link::IngressErrorKind;
    use idemwatch::exposition::Format;
    use idemwatch::monitor::prometheus::{parse, ScrapeResult};
    use idemwatch::monitor::targets::TargetTracker;

    let metrics = Metrics::new();
    metrics.register_ingress("mqtt");
    let mut tracker = TargetTracker::new("ingest", "http://127.0.0.1:9465/metrics");
    let t0 = chrono::Utc::now();
    let mut scrape = |at: chrono::DateTime<chrono::Utc>| {
        let text = metrics.encode_prometheus_text();
        tracker.observe(
            &ScrapeResult {
                target: "ingest".into(),
                url: "http://127.0.0.1:9465/metrics".into(),
                at,
                duration: Duration::from_millis(1),
                outcome: Ok(parse(&text, Format::PrometheusText).expect("the exposition parses")),
            },
            &MetricNames::default(),
        );
        tracker.status().ingress.get("mqtt").cloned()
    };
    let first = scrape(t0).expect("the mqtt source, at 0 from the start");
    assert_eq!(first.received.total, 0.0);
    assert_eq!(first.connected, Some(false));
    assert_eq!(first.last_error, None);
    assert_eq!(
        first.dead_lettered.keys().collect::<Vec<_>>(),
        ["malformed_json", "too_large"]
    );
    metrics.ingress_error("mqtt", IngressErrorKind::Connect);
    metrics.set_ingress_connected("mqtt", true);
    metrics.ingress_dead_lettered("mqtt", RejectReason::TooLarge);
    for _ in 0..8 {
        metrics.ingress("mqtt", false);
    }
    for _ in 0..2 {
        metrics.ingress("mqtt", true);
    }
    let r = scrape(t0 + chrono::Duration::seconds(2)).unwrap();
    assert_eq!((r.received.total, r.dup_flagged.total), (10.0, 2.0));
    assert_eq!(
        (r.received.per_second, r.dup_flagged.per_second),
        (Some(5.0), Some(1.0))
    );
    assert_eq!(r.connected, Some(true));
    assert!(r.state_since.is_some());
    let e = r.last_error.expect("the connect failure");
    assert_eq!((e.kind.as_str(), e.count), ("connect", 1.0));
    assert_eq!(r.dead_lettered["too_large"], 1.0);
}
