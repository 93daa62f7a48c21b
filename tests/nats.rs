//! NATS JetStream as the engine's queue, against the real server (`IDEMWATCH_NATS_URL`,
//! default nats://127.0.0.1:4222): the queue contract (lease, AckWait as visibility,
//! num_delivered as the delivery count, double ack, nack), the drills, the publish-side
//! dedup window next to consumer redeliveries, and a chaos run with SIGKILLs.

mod common;

use std::time::Duration;

use common::backends::{Kind, TestDb};
use common::outage::Outage;
use common::services::nats_url;
use common::{
    bench_engine_on_queue, chaos_short, run_cli, stop_and_assert_each_once, wait_for, TempEnv,
};
use idemwatch::drills::{self, DrillOptions, Scenario, Verdict};
use idemwatch::engine::consumers::{trip_counter, ConsumerMode};
use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::queue::nats::NatsQueue;
use idemwatch::engine::queue::Queue;
use idemwatch::engine::runner::RunnerSettings;
use idemwatch::engine::{Engine, EngineConfig};

fn unique(tag: &str) -> String {
    format!(
        "t-{tag}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// Lease until something comes back (a redelivery after AckWait), at most 30 s.
async fn lease_again(
    q: &dyn Queue,
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
    let r = bench_engine_on_queue(&TempEnv::new(), &url);
    assert_eq!(r["raw"]["duplicates"], 30, "{r}");
    assert_eq!(r["engine"]["applied"], r["raw"]["applied"], "{r}");
    assert_eq!(r["engine"]["duplicates"], r["raw"]["duplicates"], "{r}");
    // The breakdown runs on JetStream too: raw beside the stream, and the stream alone.
    assert_eq!(r["raw_with_queue"]["applied"], r["raw"]["applied"], "{r}");
    assert_eq!(r["raw_with_queue"]["duplicates"], 30, "{r}");
    assert_eq!(r["queue_only"]["messages"], 300, "{r}");
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
    // 8,000 deliveries, a kill every 600, each kill point served (see tests/amqp.rs).
    assert_eq!(r["kills"], 8000 / 600, "{r}");
    assert_eq!(r["trip_counter_total"], r["distinct_zone_exits"]);
    assert_eq!(r["sms_sent"], r["distinct_zone_exits"]);
    assert_eq!(r["sms_max_per_exit"], 1);
    assert_eq!(r["vehicles_state_ok"], r["vehicles"]);
    assert_eq!(r["left_on_queues"], 0);
    // In Jepsen's terms over the effects (SMS, webhooks, +1s, history rows): none
    // lost, none doubled, every one as expected; some recovered from the kills.
    assert_eq!(
        (r["lost"].as_u64(), r["duplicated"].as_u64()),
        (Some(0), Some(0)),
        "{r}"
    );
    assert_eq!(r["ok_fraction"].as_f64(), Some(1.0), "{r}");
    assert!(
        r["recovered"].as_u64().is_some() && r["provider_repeat_calls"].as_u64().is_some(),
        "{r}"
    );
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

/// An engine of one consumer on JetStream, in a namespace (its own stream) of its own.
async fn nats_engine(db_url: &str, url: &str, ns: &str, runner: RunnerSettings) -> Engine {
    let mut cfg = EngineConfig::new(db_url, url, "http://127.0.0.1:9", "http://127.0.0.1:9");
    cfg.consumers = vec![trip_counter::NAME.into()];
    cfg.namespace = Some(ns.to_string());
    cfg.runner = runner;
    Engine::open(&cfg).await.unwrap()
}

fn zone_exit(device: &str) -> Vec<u8> {
    format!(
        r#"{{"device_id":"{device}","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X"}}}}"#
    )
    .into_bytes()
}

/// Issue 14 on JetStream: a PostgreSQL outage (our database refuses connections and
/// its sessions are killed) with `max_deliveries = 1`, so one delivery spent on the
/// outage costs a message. JetStream counts every delivery, so before the returned
/// copies the deliveries the outage handed back came again with `num_delivered` 2 and
/// were dead-lettered after recovery. Now: every effect once, 0 dead letters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_on_jetstream_burns_no_delivery_budget() {
    let Some(url) = nats_url() else { return };
    let Some(db) = TestDb::new(Kind::Postgres).await else {
        return;
    };
    let ns = unique("outage");
    let engine = std::sync::Arc::new(
        nats_engine(
            &db.url,
            &url,
            &ns,
            RunnerSettings {
                lease_batch: 4,
                max_deliveries: 1,
                retry_delay: Duration::from_millis(20),
                max_pause: Duration::from_millis(300),
                visibility_timeout: Duration::from_secs(5),
                idle_poll: Duration::from_millis(10),
                ..RunnerSettings::default()
            },
        )
        .await,
    );
    let consumer = trip_counter::NAME;
    let processed = || engine.summary().consumers[consumer].processed;
    let before: Vec<Vec<u8>> = (0..4).map(|i| zone_exit(&format!("NO-{i}"))).collect();
    engine.publish(&before).await.unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let worker = engine
        .worker(consumer, std::sync::Arc::new(CrashPlan::none()), None)
        .unwrap();
    let running = tokio::spawn(async move { worker.run(stopped).await });
    wait_for("the first messages", Duration::from_secs(60), || {
        processed() == 4
    })
    .await;

    let outage = Outage::start(&db, None).await;
    let during: Vec<Vec<u8>> = (4..12).map(|i| zone_exit(&format!("NO-{i}"))).collect();
    engine.publish(&during).await.unwrap();
    // Failed deliveries given back, then failed probes: well past the budget of one.
    wait_for("failures on the outage", Duration::from_secs(120), || {
        engine.pause(consumer).is_some_and(|p| p.failures >= 4)
    })
    .await;
    outage.end(None).await;

    wait_for(
        "every message after recovery",
        Duration::from_secs(120),
        || {
            let c = &engine.summary().consumers[consumer];
            c.processed + c.dead_lettered >= 12
        },
    )
    .await;
    stop_and_assert_each_once(&engine, consumer, stop, running, "NO-", 12).await;
    let queue = engine.queue_name(consumer);
    assert!(engine.queue.depth(&queue).await.unwrap().is_empty());
    engine.queue.close().await;
    let q = NatsQueue::open(&url).await.unwrap();
    q.delete_namespace(&ns).await.unwrap();
    db.cleanup().await;
}

/// Uncounted returns keep a message's attempts (its delivery count still rises);
/// counted nacks and a run-out `AckWait` raise them, across the returned copies; a
/// poison message still ends as a `max_deliveries` dead letter, and one returned
/// uncounted more often than the limit is still processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncounted_returns_on_jetstream_keep_attempts_and_poison_still_reaches_max_deliveries() {
    let Some(url) = nats_url() else { return };
    let env = TempEnv::new();
    let ns = unique("budget");
    let engine = nats_engine(
        &env.db_url(),
        &url,
        &ns,
        RunnerSettings {
            max_deliveries: 3,
            idle_poll: Duration::from_millis(10),
            ..RunnerSettings::default()
        },
    )
    .await;
    let queue = engine.queue_name(trip_counter::NAME);
    let q: &dyn Queue = engine.queue.as_ref();
    let visibility = Duration::from_millis(400);
    let counts = |d: &idemwatch::engine::queue::Delivery| (d.attempts, d.delivery_count);

    engine.publish(&[zone_exit("POISON")]).await.unwrap();
    let d = q.lease(&queue, 10, visibility).await.unwrap();
    assert_eq!(d.iter().map(counts).collect::<Vec<_>>(), vec![(1, 1)]);
    q.nack_uncounted(&d[0], Duration::ZERO).await.unwrap();
    let d = lease_again(q, &queue, visibility).await;
    assert_eq!(d.iter().map(counts).collect::<Vec<_>>(), vec![(1, 2)]);
    // A delayed uncounted return is held for its delay, then comes back uncounted.
    q.nack_uncounted(&d[0], Duration::from_millis(700))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(q.lease(&queue, 10, visibility).await.unwrap().is_empty());
    let d = lease_again(q, &queue, visibility).await;
    assert_eq!(d.iter().map(counts).collect::<Vec<_>>(), vec![(1, 3)]);
    // Counted: a nack, then a lease left to run out.
    q.nack(&d[0], Duration::ZERO).await.unwrap();
    let d = lease_again(q, &queue, visibility).await;
    assert_eq!(d.iter().map(counts).collect::<Vec<_>>(), vec![(2, 4)]);
    let d = lease_again(q, &queue, visibility).await;
    assert_eq!(d.iter().map(counts).collect::<Vec<_>>(), vec![(3, 5)]);
    q.nack_uncounted(&d[0], Duration::ZERO).await.unwrap();
    let d = lease_again(q, &queue, visibility).await;
    assert_eq!(d.iter().map(counts).collect::<Vec<_>>(), vec![(3, 6)]);
    // Its lease runs out once more: a fourth counted delivery of three allowed.
    tokio::time::sleep(visibility + Duration::from_millis(200)).await;

    // A good message given back uncounted five times (more than the limit).
    engine.publish(&[zone_exit("GOOD")]).await.unwrap();
    let mut good = None;
    for _ in 0..5 {
        let d = lease_again(q, &queue, visibility).await;
        for d in d {
            if d.body == zone_exit("GOOD") {
                good = Some(counts(&d));
            }
            q.nack_uncounted(&d, Duration::ZERO).await.unwrap();
        }
    }
    assert!(good.is_some_and(|(attempts, _)| attempts == 1), "{good:?}");

    let worker = engine
        .worker(
            trip_counter::NAME,
            std::sync::Arc::new(CrashPlan::none()),
            None,
        )
        .unwrap();
    worker.run_until_idle().await.unwrap();
    let c = &engine.summary().consumers[trip_counter::NAME];
    assert_eq!((c.processed, c.dead_lettered), (1, 1), "{c:?}");
    let dead = engine.store.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].reason, "max_deliveries");
    assert_eq!(dead[0].raw, zone_exit("POISON"));
    assert_eq!(engine.store.zone_exits("GOOD").await.unwrap(), 1);
    assert!(q.depth(&queue).await.unwrap().is_empty());
    engine.queue.close().await;
    let nq = NatsQueue::open(&url).await.unwrap();
    nq.delete_namespace(&ns).await.unwrap();
}
