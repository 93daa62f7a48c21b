//! The seen-set against a real Redis (and the SQL table): the window the report
//! describes (a death between the effect and the key write runs the effect again),
//! the drill in both outcomes, key conflicts through Redis, and the fail-closed /
//! fail-open policy while Redis is down (a private redis-server on a port of our
//! own, never the shared one).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::services::{free_port, reachable, redis_url};
use common::{run_cli, KillOnDrop, TempEnv};
use idemwatch::config::MetricNames;
use idemwatch::drills::{self, DrillOptions, DrillReport, Scenario, Verdict};
use idemwatch::engine::consumers::{trip_counter, zone_exit_sms, ConsumerMode};
use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::health::{InfraKind, PauseCause};
use idemwatch::engine::seen_set::{SeenSetConfig, Unavailable};
use idemwatch::engine::{Engine, EngineConfig};
use idemwatch::monitor::prometheus::{parse, Format, ScrapeResult};
use idemwatch::monitor::targets::TargetTracker;
use idemwatch::sim::sandbox_provider::{self, SandboxClient};

async fn window_drill(env: &TempEnv, mode: ConsumerMode, seen_set: &SeenSetConfig) -> DrillReport {
    let mut opts = DrillOptions::new(Scenario::SeenSetWindow, &env.db_url(), &env.queue_url());
    opts.mode = mode;
    opts.seen_set = seen_set.clone();
    drills::run(opts).await.expect("drill runs")
}

/// Seen-set mode sends twice and explains why; idempotent mode sends once.
async fn window_in_both_outcomes(seen_set: SeenSetConfig, expect_store: &str) {
    let env = TempEnv::new();
    let r = window_drill(&env, ConsumerMode::SeenSet, &seen_set).await;
    let text = r.render_text();
    assert_eq!((r.sms_sent, r.counter_delta), (2, 2), "{text}");
    assert_eq!(r.verdict, Verdict::Fail, "{text}");
    assert_eq!(
        r.exit_code(),
        0,
        "showing the window is not a failed idempotent drill"
    );
    assert!(text.contains("fine for an upsert"), "{text}");
    assert!(
        r.details["seen_set"]
            .as_str()
            .unwrap()
            .starts_with(expect_store),
        "{text}"
    );
    let recorded = r.details["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "key in the seen-set after the redelivery")
        .expect("the seen-set check");
    assert_eq!(recorded["ok"], true, "{text}");

    let r = window_drill(&env, ConsumerMode::Idempotent, &seen_set).await;
    let text = r.render_text();
    assert_eq!((r.sms_sent, r.counter_delta), (1, 1), "{text}");
    assert_eq!(r.verdict, Verdict::Pass, "{text}");
}

#[tokio::test]
async fn seen_set_window_in_redis_sends_the_sms_twice_and_two_phase_once() {
    let Some(url) = redis_url() else { return };
    window_in_both_outcomes(
        SeenSetConfig {
            url: Some(url),
            ..SeenSetConfig::default()
        },
        "redis",
    )
    .await;
}

#[tokio::test]
async fn seen_set_window_in_the_sql_table_sends_the_sms_twice_and_two_phase_once() {
    window_in_both_outcomes(SeenSetConfig::default(), "sql").await;
}

#[test]
fn cli_seen_set_window_with_redis_and_real_process_kills() {
    let Some(url) = redis_url() else { return };
    let env = TempEnv::new();
    let args = |mode: &'static str| {
        vec![
            "drill",
            "seen-set-window",
            "--kill-process",
            "--json",
            "--mode",
            mode,
            "--seen-set",
            url.as_str(),
        ]
    };
    let (code, out, err) = run_cli(&env, &args("seen-set"));
    let r: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        (r["sms_sent"].as_u64(), r["verdict"].as_str()),
        (Some(2), Some("fail")),
        "{r}"
    );
    assert!(
        r["details"]["seen_set"]
            .as_str()
            .unwrap()
            .starts_with("redis"),
        "{r}"
    );
    let (code, out, _) = run_cli(&env, &args("idempotent"));
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        (r["sms_sent"].as_u64(), r["verdict"].as_str()),
        (Some(1), Some("pass")),
        "{r}"
    );
}

#[tokio::test]
async fn a_redelivery_after_success_is_dropped_through_redis_and_a_new_payload_is_a_conflict() {
    let Some(url) = redis_url() else { return };
    let env = TempEnv::new();
    let seen_set = SeenSetConfig {
        url: Some(url),
        ..SeenSetConfig::default()
    };
    let mut opts = DrillOptions::new(Scenario::DoublePublish, &env.db_url(), &env.queue_url());
    opts.mode = ConsumerMode::SeenSet;
    opts.seen_set = seen_set.clone();
    let r = drills::run(opts).await.unwrap();
    assert_eq!(
        (r.sms_sent, r.counter_delta, r.duplicate_dropped),
        (1, 1, 1),
        "{}",
        r.render_text()
    );
    let mut opts = DrillOptions::new(Scenario::KeyConflict, &env.db_url(), &env.queue_url());
    opts.mode = ConsumerMode::SeenSet;
    opts.seen_set = seen_set;
    let r = drills::run(opts).await.unwrap();
    assert_eq!(
        (r.sms_sent, r.dead_lettered, r.verdict),
        (1, 1, Verdict::Pass),
        "{}",
        r.render_text()
    );
}

// ---- Redis down ------------------------------------------------------------------

/// A private redis-server on `port`: no persistence, gone with the test.
fn private_redis(port: u16) -> KillOnDrop {
    let child = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server is installed (apt-get install redis-server)");
    let guard = KillOnDrop(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while reachable(&format!("redis://127.0.0.1:{port}")).is_err() {
        assert!(
            Instant::now() < deadline,
            "private redis-server did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    guard
}

/// Three zone exits through trip-counter and zone-exit-sms in seen-set mode, with
/// the seen-set at a Redis on `port` (down until the test starts it).
async fn engine_with_redis_on(
    env: &TempEnv,
    port: u16,
    unavailable: Unavailable,
) -> (Engine, sandbox_provider::SandboxHandle) {
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let mut cfg = EngineConfig::new(
        &env.db_url(),
        &env.queue_url(),
        &sandbox.url(),
        &sandbox.url(),
    );
    cfg.mode = ConsumerMode::SeenSet;
    cfg.consumers = vec![trip_counter::NAME.into(), zone_exit_sms::NAME.into()];
    cfg.seen_set = SeenSetConfig {
        url: Some(format!("redis://127.0.0.1:{port}")),
        unavailable,
        ..SeenSetConfig::default()
    };
    cfg.runner.retry_delay = Duration::from_millis(50);
    cfg.runner.max_retry_delay = Duration::from_millis(200);
    cfg.runner.idle_poll = Duration::from_millis(20);
    // A budget an outage would burn in a second if its retries counted: a Redis
    // outage pauses the consumer and its returns are uncounted (faults, issue 14).
    cfg.runner.max_deliveries = 2;
    cfg.runner.max_pause = Duration::from_millis(400);
    let engine = Engine::open(&cfg).await.unwrap();
    engine.publish(&zone_exits(1..=3)).await.unwrap();
    (engine, sandbox)
}

/// Zone exits of device RD-1 with these sequence numbers.
fn zone_exits(seqs: std::ops::RangeInclusive<u64>) -> Vec<Vec<u8>> {
    seqs.map(|seq| {
        format!(
            r#"{{"device_id":"RD-1","seq":{seq},"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:0{seq}Z","payload":{{"zone":"X","phone":"+905551112233"}}}}"#
        )
        .into_bytes()
    })
    .collect()
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn fail_closed_handles_nothing_while_redis_is_down_and_resumes_when_it_is_back() {
    let env = TempEnv::new();
    let port = free_port();
    let (engine, sandbox) = engine_with_redis_on(&env, port, Unavailable::FailClosed).await;
    let engine = Arc::new(engine);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let run = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.run(1, Arc::new(CrashPlan::none()), stopped).await })
    };
    // Several retries against the dead port, then nothing may have happened.
    let sms = SandboxClient::new(sandbox.url()).unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let s = engine.summary();
    assert_eq!((s.total.processed, s.total.dead_lettered), (0, 0), "{s:?}");
    assert_eq!(sms.sent_sms().await.unwrap().len(), 0);
    assert_eq!(
        engine.metrics.seen_set_bypassed_count(zone_exit_sms::NAME),
        0
    );

    let _redis = private_redis(port);
    let m = engine.metrics.clone();
    wait_for("all six handled after Redis came back", || {
        m.summary([trip_counter::NAME, zone_exit_sms::NAME])
            .total
            .processed
            == 6
    })
    .await;
    stop.send(true).unwrap();
    run.await.unwrap().unwrap();
    let s = engine.summary();
    assert_eq!(
        (s.total.dead_lettered, s.total.duplicate_dropped),
        (0, 0),
        "{s:?}"
    );
    assert_eq!(sms.sent_sms().await.unwrap().len(), 3);
    assert_eq!(engine.store.zone_exits("RD-1").await.unwrap(), 3);
}

/// Redis goes away under a running fail-closed engine and comes back: the messages
/// that arrive meanwhile pause the consumers (`idem_consumer_paused{cause="seen_set"}`,
/// probed with Redis's own PING) without using up their 2 deliveries, and each is
/// handled once after Redis is back — no dead letter, one SMS and +1 each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_pauses_through_a_redis_restart_and_burns_no_delivery_budget() {
    let env = TempEnv::new();
    let port = free_port();
    let mut redis = private_redis(port);
    let (engine, sandbox) = engine_with_redis_on(&env, port, Unavailable::FailClosed).await;
    let engine = Arc::new(engine);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let run = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.run(1, Arc::new(CrashPlan::none()), stopped).await })
    };
    let consumers = [trip_counter::NAME, zone_exit_sms::NAME];
    let m = engine.metrics.clone();
    wait_for("the first three handled", || {
        m.summary(consumers).total.processed == 6
    })
    .await;

    redis.stop();
    engine.publish(&zone_exits(4..=6)).await.unwrap();
    let paused =
        |c: &str, v: u8| format!(r#"idem_consumer_paused{{consumer="{c}",cause="seen_set"}} {v}"#);
    wait_for(
        "both consumers paused for the seen-set, retried past their budget",
        || {
            let text = m.encode_prometheus_text();
            consumers
                .iter()
                .all(|c| text.contains(&paused(c, 1)) && m.infra_errors(c, InfraKind::SeenSet) > 2)
        },
    )
    .await;
    let s = engine.summary();
    assert_eq!((s.total.processed, s.total.dead_lettered), (6, 0), "{s:?}");
    let p = engine.pause(zone_exit_sms::NAME).expect("paused");
    assert_eq!(p.cause, PauseCause::SeenSet, "{p:?}");

    let _redis = private_redis(port);
    wait_for("the three that came during the outage handled", || {
        m.summary(consumers).total.processed == 12
    })
    .await;
    wait_for("both consumers resumed", || {
        let text = m.encode_prometheus_text();
        consumers.iter().all(|c| text.contains(&paused(c, 0)))
    })
    .await;
    stop.send(true).unwrap();
    run.await.unwrap().unwrap();
    let s = engine.summary();
    assert_eq!(
        (s.total.dead_lettered, s.total.duplicate_dropped),
        (0, 0),
        "{s:?}"
    );
    let sms = SandboxClient::new(sandbox.url()).unwrap();
    assert_eq!(
        sms.sent_sms().await.unwrap().len(),
        6,
        "one SMS per zone exit"
    );
    assert_eq!(engine.store.zone_exits("RD-1").await.unwrap(), 6);
    assert!(engine.store.dead_letters(10).await.unwrap().is_empty());
}

#[tokio::test]
async fn fail_open_handles_unchecked_while_redis_is_down_and_counts_the_bypass() {
    let env = TempEnv::new();
    let port = free_port(); // nothing listens there
    let (engine, sandbox) = engine_with_redis_on(&env, port, Unavailable::FailOpen).await;
    let s = engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .unwrap();
    assert_eq!((s.total.processed, s.total.dead_lettered), (6, 0), "{s:?}");
    // Each message: the check and the record went around Redis.
    for c in [trip_counter::NAME, zone_exit_sms::NAME] {
        assert_eq!(engine.metrics.seen_set_bypassed_count(c), 6, "{c}");
    }
    let text = engine.metrics.encode_prometheus_text();
    assert!(
        text.contains(r#"idem_seen_set_bypassed_total{consumer="zone-exit-sms"} 6"#),
        "{text}"
    );
    let sms = SandboxClient::new(sandbox.url()).unwrap();
    assert_eq!(sms.sent_sms().await.unwrap().len(), 3);

    // The dashboard reads the bypass from the engine's exposition, per consumer.
    let tracker = dashboard_view(&text, &MetricNames::default());
    let seen = &tracker.status().seen_set_bypassed;
    assert_eq!(seen.get(zone_exit_sms::NAME), Some(&6.0), "{seen:?}");
    assert_eq!(seen.get(trip_counter::NAME), Some(&6.0), "{seen:?}");
}

/// The dashboard's view of an engine: its tracker after one scrape of the engine's
/// exposition `text`.
fn dashboard_view(text: &str, names: &MetricNames) -> TargetTracker {
    let mut tracker = TargetTracker::new("fleet", "http://127.0.0.1:9464/metrics");
    tracker.observe(
        &ScrapeResult {
            target: "fleet".into(),
            url: "http://127.0.0.1:9464/metrics".into(),
            at: chrono::Utc::now(),
            duration: Duration::from_millis(1),
            outcome: Ok(
                parse(text, Format::PrometheusText).expect("the engine's exposition parses")
            ),
        },
        names,
    );
    tracker
}

// ---- duplicate age against the seen-set's TTL (issue 41) ----------------------------

/// A seen-set over Redis with a TTL of 4 s, a copy delivered 2.5 s after its original:
/// the copy is dropped (its key is still there) and its age, read from the value the
/// key was written with (`FINGERPRINT UNIX_MILLIS`), lands in the histogram. The
/// dashboard, scraping that engine, reads the TTL it exports and warns
/// (`dedup_window_short`): 4 s is less than twice the oldest duplicate, a copy a
/// little later would find no key. The retention, 7 days, is not short. A value of the
/// old format (a bare fingerprint) still drops its duplicate, with an unknown age.
#[tokio::test]
async fn a_seen_set_ttl_shorter_than_twice_the_oldest_duplicate_warns() {
    use idemwatch::engine::envelope::Message;
    use idemwatch::engine::seen_set::RedisSeenSet;
    use idemwatch::monitor::alerts::{evaluate_at, AlertInputs, AlertKind, Severity};
    use idemwatch::monitor::windows::{self, Layer, WindowInputs};

    let Some(url) = redis_url() else { return };
    let env = TempEnv::new();
    let ttl = Duration::from_secs(4);
    let delay = Duration::from_millis(2500);
    let mut cfg = EngineConfig::new(
        &env.db_url(),
        &env.queue_url(),
        "http://127.0.0.1:9",
        "http://127.0.0.1:9",
    );
    cfg.mode = ConsumerMode::SeenSet;
    cfg.consumers = vec![trip_counter::NAME.into()];
    cfg.seen_set = SeenSetConfig {
        url: Some(url.clone()),
        ttl,
        ..SeenSetConfig::default()
    };
    cfg.runner.idle_poll = Duration::from_millis(20);
    let engine = Engine::open(&cfg).await.unwrap();
    // A device of this run only: the shared Redis keeps other runs' keys.
    let device = format!(
        "AGE-{}-{}",
        std::process::id(),
        chrono::Utc::now().timestamp_millis()
    );
    let line = |seq: u64| {
        format!(
            r#"{{"device_id":"{device}","seq":{seq},"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X"}}}}"#
        )
        .into_bytes()
    };
    let drain = || async {
        tokio::time::timeout(
            Duration::from_secs(60),
            engine.run_until_idle(Arc::new(CrashPlan::none()), None),
        )
        .await
        .expect("drained within a minute")
        .expect("no crash")
    };
    engine.publish(&[line(1)]).await.unwrap();
    drain().await;
    let written = Instant::now();
    tokio::time::sleep(delay).await;
    engine.publish(&[line(1)]).await.unwrap();
    drain().await;
    let c = trip_counter::NAME;
    assert_eq!(engine.summary().consumers[c].duplicate_dropped, 1);
    let max = engine.metrics.duplicate_age_max(c);
    let since = written.elapsed().as_secs_f64();
    assert!(
        (delay.as_secs_f64()..since + 0.5).contains(&max),
        "oldest duplicate {max} s, {since} s after the first"
    );

    // The value the key holds: its fingerprint and when it was first processed.
    let first = Message::parse(&line(1)).unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let value: String = redis::cmd("GET")
        .arg(RedisSeenSet::redis_key(c, first.key()))
        .query_async(&mut conn)
        .await
        .unwrap();
    let (fingerprint, millis) = value.split_once(' ').expect("FINGERPRINT UNIX_MILLIS");
    assert_eq!(fingerprint, first.fingerprint().as_str());
    let at = chrono::DateTime::from_timestamp_millis(millis.parse().unwrap()).unwrap();
    assert!(
        chrono::Utc::now() - at < chrono::Duration::seconds(30),
        "{value}"
    );

    // The dashboard's view of this engine: its TTL, the ages, the margins, the WARN.
    let names = MetricNames::default();
    let tracker = dashboard_view(&engine.metrics.encode_prometheus_text(), &names);
    let targets = [tracker.status().clone()];
    assert_eq!(targets[0].seen_set_ttl_seconds, Some(ttl.as_secs_f64()));
    let consumers: Vec<_> = tracker.consumers().cloned().collect();
    let stored = engine
        .store
        .duplicate_ages()
        .await
        .unwrap()
        .into_iter()
        .map(|a| (a.consumer, a.max_age_seconds))
        .collect();
    let w = windows::evaluate(&WindowInputs {
        consumers: &consumers,
        targets: &targets,
        brokers: &[],
        stored_max: &stored,
        retention: Some(Duration::from_secs(7 * 86_400)),
        provider_key_lifetime: Duration::from_secs(86_400),
    });
    let trips = w.iter().find(|w| w.consumer == c).expect("trip-counter");
    let short: Vec<Layer> = trips.short().map(|w| w.layer).collect();
    assert_eq!(short, [Layer::SeenSetTtl], "{}", trips.summary);
    assert!(
        trips.summary.contains("seen-set TTL 4.0 s"),
        "{}",
        trips.summary
    );
    let alerts = evaluate_at(&AlertInputs {
        now: chrono::Utc::now(),
        targets: &targets,
        consumers: &consumers,
        database: None,
        markers: &[],
        deploys: &[],
        rules: &Default::default(),
        windows: &w,
    });
    let warn = alerts
        .iter()
        .find(|a| matches!(&a.kind, AlertKind::DedupWindowShort { consumer, .. } if consumer == c))
        .expect("dedup_window_short");
    assert_eq!(warn.severity, Severity::Warning);
    assert!(warn.message.contains("seen-set TTL"), "{}", warn.message);

    // A key written by an engine before the age was kept: a bare fingerprint.
    let old = Message::parse(&line(2)).unwrap();
    let _: () = redis::cmd("SET")
        .arg(RedisSeenSet::redis_key(c, old.key()))
        .arg(old.fingerprint().as_str())
        .arg("PX")
        .arg(ttl.as_millis() as u64)
        .query_async(&mut conn)
        .await
        .unwrap();
    engine.publish(&[line(2)]).await.unwrap();
    drain().await;
    assert_eq!(engine.summary().consumers[c].duplicate_dropped, 2);
    let text = engine.metrics.encode_prometheus_text();
    assert!(
        text.contains("idem_duplicate_age_unknown_total{consumer=\"trip-counter\"} 1"),
        "{text}"
    );
    assert_eq!(
        engine.metrics.duplicate_age_max(c),
        max,
        "an unknown age is no age"
    );
}
