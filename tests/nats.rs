//! NATS JetStream as the engine's queue, against the real server (`IDEMWATCH_NATS_URL`,
//! default nats://127.0.0.1:4222): the queue contract (lease, AckWait as visibility,
//! num_delivered as the delivery count, double ack, nack), the drills, the publish-side
//! dedup window next to consumer redeliveries, and a chaos run with SIGKILLs.

mod common;

use std::time::Duration;

use common::backends::{Kind, TestDb};
use common::services::nats_url;
use common::{chaos_short, run_cli, TempEnv};
use idemwatch::drills::{self, DrillOptions, Scenario, Verdict};
use idemwatch::engine::consumers::ConsumerMode;
use idemwatch::engine::queue::nats::NatsQueue;
use idemwatch::engine::queue::Queue;

fn unique(tag: &str) -> String {
    format!(
        "t-{tag}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// Lease until something comes back (a redelivery after AckWait), at most 30 s.
async fn lease_again(
    q: &NatsQueue,
    queue: &str,
    visibility: Duration,
) -> Vec<idemwatch::engine::queue::Delivery> {
    for _ in 0..300 {
        let got = q.lease(queue, 10, visibility).await.unwrap();
        if !got.is_empty() {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("nothing came back on {queue}");
}

#[tokio::test]
async fn an_unacked_delivery_comes_back_after_ack_wait_counted_by_the_server() {
    let Some(url) = nats_url() else { return };
    let q = NatsQueue::open(&url).await.expect("JetStream reachable");
    let ns = unique("lease");
    let queue = format!("{ns}/trip-counter");
    let visibility = Duration::from_millis(400);
    let bodies: Vec<Vec<u8>> = (0..3)
        .map(|i| format!(r#"{{"n":{i}}}"#).into_bytes())
        .collect();
    q.publish(std::slice::from_ref(&queue), &bodies)
        .await
        .unwrap();
    let first = q.lease(&queue, 10, visibility).await.unwrap();
    assert_eq!(first.len(), 3);
    assert!(first
        .iter()
        .all(|d| d.delivery_count == 1 && !d.redelivered));
    let depth = q.depth(&queue).await.unwrap();
    assert_eq!((depth.ready, depth.in_flight), (0, 3));
    // Ack one (confirmed by the server), give one back now, let one run out.
    assert!(q.ack(&first[0]).await.unwrap());
    q.nack(&first[1], Duration::ZERO).await.unwrap();
    // Both come back, counted by the server (the newest delivery of each kept: one
    // may run out again while the test leases the other).
    let mut back = std::collections::BTreeMap::new();
    while back.len() < 2 {
        for d in lease_again(&q, &queue, visibility).await {
            back.insert(d.id, d);
        }
    }
    let back: Vec<_> = back.into_values().collect();
    assert_eq!(
        back.iter().map(|d| d.body.clone()).collect::<Vec<_>>(),
        vec![bodies[1].clone(), bodies[2].clone()]
    );
    assert!(
        back.iter().all(|d| d.delivery_count >= 2 && d.redelivered),
        "{back:?}"
    );
    assert_eq!(q.ack_batch(&back).await.unwrap(), 2);
    // An ack of a delivery whose AckWait ran out may be too late; whatever is left
    // comes back once more and is acked then.
    for _ in 0..50 {
        if q.depth(&queue).await.unwrap().is_empty() {
            break;
        }
        let again = q.lease(&queue, 10, visibility).await.unwrap();
        q.ack_batch(&again).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(q.depth(&queue).await.unwrap().is_empty());
    q.remove_queue(&queue).await.unwrap();
    q.delete_namespace(&ns).await.unwrap();
}

#[tokio::test]
async fn jetstream_dedup_window_stops_a_republish_but_not_a_redelivery() {
    let Some(url) = nats_url() else { return };
    let q = NatsQueue::open(&url).await.unwrap();
    let ns = unique("window");
    let queue = format!("{ns}/zone-exit-sms");
    let body = br#"{"message_id":"p-81f3","device_id":"34-ABC-123","seq":48211,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{"zone":"X"}}"#.to_vec();
    // A producer retry with the same message_id: the stream keeps one copy.
    let first = q
        .publish_counted(std::slice::from_ref(&queue), std::slice::from_ref(&body))
        .await
        .unwrap();
    let retry = q
        .publish_counted(std::slice::from_ref(&queue), std::slice::from_ref(&body))
        .await
        .unwrap();
    assert_eq!((first.stored, first.duplicates), (1, 0));
    assert_eq!((retry.stored, retry.duplicates), (0, 1));
    // A consumer that dies before its ack: the same stored message is delivered again,
    // inside the same window. Only a consumer-side record can drop it.
    let visibility = Duration::from_millis(300);
    let d1 = q.lease(&queue, 10, visibility).await.unwrap();
    assert_eq!(d1.len(), 1);
    let d2 = lease_again(&q, &queue, visibility).await;
    assert_eq!(
        (d2.len(), d2[0].delivery_count, d2[0].body.clone()),
        (1, 2, body.clone())
    );
    q.ack(&d2[0]).await.unwrap();
    q.remove_queue(&queue).await.unwrap();
    q.delete_namespace(&ns).await.unwrap();

    // The 7-SMS incident on JetStream: published once (with its Nats-Msg-Id), delivered
    // 7 times. The dedup table makes it one SMS; without it, seven.
    let env = TempEnv::new();
    let run = |mode| {
        let mut o = DrillOptions::new(Scenario::CrashBeforeAck, &env.db_url(), &url);
        o.mode = mode;
        drills::run(o)
    };
    let r = run(ConsumerMode::Idempotent).await.unwrap();
    assert_eq!(r.verdict, Verdict::Pass, "{}", r.render_text());
    assert_eq!(
        (r.sms_sent, r.duplicate_dropped, r.counter_delta),
        (1, 6, 1)
    );
    assert_eq!(
        r.details["delivery_counts"],
        serde_json::json!([1, 2, 3, 4, 5, 6, 7]),
        "num_delivered is the delivery count: {}",
        r.render_text()
    );
    let r = run(ConsumerMode::Naive).await.unwrap();
    assert_eq!((r.sms_sent, r.counter_delta), (7, 7), "{}", r.render_text());
}

/// One publish call of more bodies than `async-nats` lets be unacknowledged (5,000 by
/// default): before the windows the 5,001st publish waited for ever for a permit only
/// an awaited acknowledgement returns (`bench engine --messages 10000` hung). All
/// 6,000 must be stored, then leased and acked, within the test's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_of_more_than_five_thousand_bodies_completes_and_every_one_is_delivered() {
    let Some(url) = nats_url() else { return };
    let q = NatsQueue::open(&url).await.unwrap();
    let ns = unique("bulk");
    let queue = format!("{ns}/trip-counter");
    let n = 6_000;
    let bodies: Vec<Vec<u8>> = (0..n)
        .map(|i| format!(r#"{{"n":{i}}}"#).into_bytes())
        .collect();
    let counts = tokio::time::timeout(
        Duration::from_secs(60),
        q.publish_counted(std::slice::from_ref(&queue), &bodies),
    )
    .await
    .expect("a publish of 6,000 bodies hung")
    .unwrap();
    assert_eq!((counts.stored, counts.duplicates), (n as u64, 0));
    let mut seen = std::collections::BTreeSet::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while seen.len() < n && std::time::Instant::now() < deadline {
        let got = q.lease(&queue, 500, Duration::from_secs(30)).await.unwrap();
        for d in &got {
            seen.insert(d.body.clone());
        }
        assert_eq!(q.ack_batch(&got).await.unwrap(), got.len());
    }
    assert_eq!(seen.len(), n);
    assert!(q.depth(&queue).await.unwrap().is_empty());
    q.remove_queue(&queue).await.unwrap();
    q.delete_namespace(&ns).await.unwrap();
}

/// `bench engine` on JetStream meets its redeliveries: every copy is stored (each has
/// its own `message_id`, so the publish-side window keeps them all) and the dedup
/// table drops the same duplicates the raw baseline counts. Before, the window dropped
/// the copies and the engine counted 0.
#[test]
fn bench_engine_on_jetstream_delivers_its_redeliveries_to_the_dedup_table() {
    let Some(url) = nats_url() else { return };
    let env = TempEnv::new();
    let db = env.db_url();
    let (code, out, err) = run_cli(
        &env,
        &[
            "bench",
            "engine",
            "--db",
            &db,
            "--json",
            "--queue",
            &url,
            "--messages",
            "300",
            "--dup-rate",
            "0.1",
            "--batch",
            "10",
            "--runs",
            "1",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(r["raw"]["duplicates"], 30, "{r}");
    assert_eq!(r["engine"]["applied"], r["raw"]["applied"], "{r}");
    assert_eq!(r["engine"]["duplicates"], r["raw"]["duplicates"], "{r}");
}

#[tokio::test]
async fn drills_on_jetstream_pass_idempotent() {
    let Some(url) = nats_url() else { return };
    let env = TempEnv::new();
    for scenario in [
        Scenario::CrashAfterSend,
        Scenario::DoublePublish,
        Scenario::KeyConflict,
        Scenario::SeenSetWindow,
    ] {
        let opts = DrillOptions::new(scenario, &env.db_url(), &url);
        let r = drills::run(opts).await.unwrap();
        assert_eq!(r.verdict, Verdict::Pass, "{scenario}: {}", r.render_text());
    }
}

/// The chaos run on JetStream: 3 `serve` processes, one SIGKILLed every 600 deliveries
/// taken off the streams, over PostgreSQL, 2,000 messages with ~10 % duplicates.
#[test]
fn chaos_run_on_jetstream_with_process_kills_ends_exactly_once() {
    let Some(url) = nats_url() else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(db) = rt.block_on(TestDb::new(Kind::Postgres)) else {
        return;
    };
    let (code, r) = chaos_short(&db.env, &url, &db.url, "4m");
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["verdict"], "pass", "{r:#}");
    assert!(r["kills"].as_u64().unwrap() >= 3, "{r}");
    assert_eq!(r["trip_counter_total"], r["distinct_zone_exits"]);
    assert_eq!(r["sms_sent"], r["distinct_zone_exits"]);
    assert_eq!(r["sms_max_per_exit"], 1);
    assert_eq!(r["vehicles_state_ok"], r["vehicles"]);
    assert_eq!(r["left_on_queues"], 0);
    rt.block_on(db.cleanup());
}

#[tokio::test]
async fn publish_then_consume_until_idle_over_jetstream_from_the_command_line() {
    let Some(url) = nats_url() else { return };
    let env = TempEnv::new();
    let ns = unique("cli");
    let exit = |seq: u32| {
        format!(
            r#"{{"message_id":"m-{seq}","device_id":"NATS-CLI","seq":{seq},"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X","phone":"+905551112233"}}}}"#
        )
    };
    // seq 1 twice under other message ids: JetStream stores both, the table drops one.
    let lines = [exit(1), exit(2), exit(1).replace("m-1", "m-1b")].join("\n");
    let file = env.path("in.jsonl");
    std::fs::write(&file, lines).unwrap();
    let common = ["--queue", url.as_str(), "--namespace", ns.as_str()];
    let (code, _, err) = run_cli(
        &env,
        &[&["publish", file.to_str().unwrap()][..], &common[..]].concat(),
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = run_cli(
        &env,
        &[&["consume", "--until-idle", "--json"][..], &common[..]].concat(),
    );
    assert_eq!(code, 0, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(r["consumers"]["trip-counter"]["processed"], 2, "{r}");
    assert_eq!(
        r["consumers"]["trip-counter"]["duplicate_dropped"], 1,
        "{r}"
    );
    assert_eq!(r["consumers"]["zone-exit-sms"]["processed"], 2, "{r}");
    let q = NatsQueue::open(&url).await.unwrap();
    q.delete_namespace(&ns).await.unwrap();
}

/// The dashboard charts JetStream's own redeliveries from a PRIVATE nats-server's
/// monitoring endpoint (`-m`, its own ports and store): five deliveries left unacked
/// come back after AckWait and show as 5 redelivered; first deliveries do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_charts_jetstream_redeliveries_from_the_monitoring_endpoint() {
    use common::services::{free_port, reachable};
    use idemwatch::config::{Config, JetStreamMonitor};
    use idemwatch::monitor::targets::BrokerKind;
    use idemwatch::monitor::Monitor;

    if std::process::Command::new("nats-server")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(
            !common::backends::required(),
            "nats-server is required (IDEMWATCH_REQUIRE_SERVICES=1)"
        );
        return;
    }
    let env = TempEnv::new();
    let (port, monitor_port) = (free_port(), free_port());
    let store = env.path("jetstream");
    let server = std::process::Command::new("nats-server")
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string()])
        .args(["-m", &monitor_port.to_string(), "-sd"])
        .arg(&store)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("nats-server starts");
    let _server = common::KillOnDrop(server);
    let url = format!("nats://127.0.0.1:{port}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while reachable(&url).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "private nats-server did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let q = NatsQueue::open(&url).await.expect("private JetStream");
    let ns = unique("jsz");
    let (counter, sms) = (format!("{ns}/trip-counter"), format!("{ns}/zone-exit-sms"));
    let bodies: Vec<Vec<u8>> = (0..5)
        .map(|i| format!(r#"{{"n":{i}}}"#).into_bytes())
        .collect();
    q.publish(&[counter.clone(), sms.clone()], &bodies)
        .await
        .unwrap();
    let visibility = Duration::from_millis(300);
    let mut first = Vec::new();
    while first.len() < 5 {
        first.extend(lease_again(&q, &counter, visibility).await);
    }
    let mut once = Vec::new();
    while once.len() < 5 {
        once.extend(lease_again(&q, &sms, visibility).await);
    }
    q.ack_batch(&once).await.unwrap();

    let config = Config {
        jetstream: vec![JetStreamMonitor {
            name: "nats".into(),
            url: format!("http://127.0.0.1:{monitor_port}"),
        }],
        ..Config::default()
    };
    let mut monitor = Monitor::new(&config).unwrap();
    let before = monitor.poll().await;
    let b = &before.brokers[0];
    assert!(b.up, "{b:?}");
    assert_eq!((b.kind, b.redelivered.total), (BrokerKind::JetStream, 0.0));
    assert_eq!(b.messages_unacked, Some(5.0), "{b:?}");

    // The five unacked come back after AckWait: redeliveries, then acked.
    let mut again = Vec::new();
    while again.len() < 5 {
        again.extend(lease_again(&q, &counter, visibility).await);
    }
    assert!(again.iter().all(|d| d.redelivered));
    q.ack_batch(&again).await.unwrap();
    let after = monitor.poll().await;
    let b = &after.brokers[0];
    assert_eq!(b.redelivered.total, 5.0, "{b:?}");
    assert!(b.redelivered.per_second.is_some_and(|r| r > 0.0), "{b:?}");
    assert_eq!(b.acknowledged.total, 5.0, "{b:?}");
    assert_eq!(
        (b.messages_ready, b.messages_unacked),
        (Some(0.0), Some(0.0)),
        "{b:?}"
    );
    let chart = after
        .broker_charts
        .iter()
        .find(|c| c.target == "nats")
        .expect("a chart for the JetStream server");
    assert!(
        chart
            .redelivered_per_s
            .iter()
            .any(|p| p.value.is_some_and(|v| v > 0.0)),
        "{chart:?}"
    );
    let json = serde_json::to_value(&after).unwrap();
    assert_eq!(json["brokers"][0]["kind"], "jetstream", "{json}");
}
