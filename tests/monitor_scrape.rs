//! A scrape target that goes down and comes back: down with the error text, a gap
//! in the series, up again, and the restart as a marker.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use idemwatch::config::{Config, ScrapeTarget};
use idemwatch::engine::consumers::risk_class;
use idemwatch::engine::metrics::Metrics;
use idemwatch::engine::store::Durability;
use idemwatch::monitor::alerts::{AlertKind, Severity};
use idemwatch::monitor::db::SourceStatus;
use idemwatch::monitor::markers::MarkerSource;
use idemwatch::monitor::{Monitor, MonitorCommand, Snapshot};

const CONSUMER: &str = "zone-exit-sms";

/// Serve `metrics` like `idemwatch serve` does; `Connection: close` so that stopping
/// the server really ends every connection (a kept-alive one would outlive it).
async fn serve(
    metrics: Arc<Metrics>,
    addr: SocketAddr,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
    let local = listener.local_addr().expect("local addr");
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let m = metrics.clone();
            async move {
                (
                    [
                        (
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        ),
                        (header::CONNECTION, "close"),
                    ],
                    m.encode(),
                )
                    .into_response()
            }
        }),
    );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (local, task)
}

fn consumer(s: &Snapshot) -> &idemwatch::monitor::targets::ConsumerStatus {
    s.consumers
        .iter()
        .find(|c| c.consumer == CONSUMER)
        .expect("the consumer is listed")
}

fn config_for(addr: SocketAddr) -> Config {
    Config {
        targets: vec![ScrapeTarget {
            name: "sms".into(),
            url: format!("http://{addr}/metrics"),
        }],
        scrape_timeout: Duration::from_secs(2),
        // A test's target is down for one poll: alert at once (the dashboard's
        // default waits 15 s, one missed scrape during a restart not being an outage).
        alerts: idemwatch::config::AlertRules {
            target_down_after: Duration::ZERO,
            ..Default::default()
        },
        ..Config::default()
    }
}

#[tokio::test]
async fn target_down_then_back_shows_gap_error_and_restart() {
    let first = Arc::new(Metrics::new());
    first.register_consumer(CONSUMER, risk_class(CONSUMER));
    for _ in 0..10 {
        first.processed(CONSUMER);
    }
    let (addr, server) = serve(first.clone(), ([127, 0, 0, 1], 0).into()).await;
    let mut monitor = Monitor::new(&config_for(addr)).unwrap();

    let s1 = monitor.poll().await;
    assert_eq!(s1.targets[0].status, SourceStatus::Up);
    assert_eq!(consumer(&s1).processed.total, 10.0);
    assert_eq!(
        consumer(&s1).processed.per_second,
        None,
        "one reading, no rate"
    );

    for _ in 0..5 {
        first.processed(CONSUMER);
    }
    first.duplicate_dropped(CONSUMER);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let s2 = monitor.poll().await;
    let c = consumer(&s2);
    assert!(c.processed.per_second.unwrap() > 0.0);
    let ratio = c.duplicate_ratio.expect("traffic gives a ratio");
    assert!((ratio - 1.0 / 6.0).abs() < 1e-9, "1 dup of 6: {ratio}");

    server.abort();
    let _ = server.await;
    let s3 = monitor.poll().await;
    match &s3.targets[0].status {
        SourceStatus::Down { error } => {
            assert!(
                error.to_lowercase().contains("refused") || error.contains("connect"),
                "{error}"
            )
        }
        SourceStatus::Up => panic!("a stopped target must be down"),
    }
    assert!(!consumer(&s3).up);
    assert_eq!(consumer(&s3).processed.per_second, None);
    assert!(s3
        .alerts
        .iter()
        .any(|a| matches!(&a.kind, AlertKind::TargetDown { target, .. } if target == "sms")));
    let series = monitor.series("sms", CONSUMER).unwrap();
    assert_eq!(
        series.processed_per_s.latest().map(|p| p.value),
        Some(None),
        "a failed scrape is a gap, not a zero"
    );

    // The process comes back: a new start time (1 s later at least) and counters
    // from zero.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let second = Arc::new(Metrics::new());
    second.register_consumer(CONSUMER, risk_class(CONSUMER));
    for _ in 0..2 {
        second.processed(CONSUMER);
    }
    let (_, server) = serve(second.clone(), addr).await;
    let s4 = monitor.poll().await;
    assert_eq!(s4.targets[0].status, SourceStatus::Up);
    assert!(consumer(&s4).up);
    assert!(s4.targets[0].last_restart.is_some());
    let restart = s4
        .markers
        .iter()
        .find(|m| m.kind == "restart")
        .expect("a restart marker");
    assert_eq!(restart.source, MarkerSource::Scrape);
    assert!(restart
        .detail
        .as_deref()
        .unwrap_or("")
        .contains("process_start_time_seconds"));
    // Across the reset the rate counts from zero, never negative.
    assert!(consumer(&s4).processed.per_second.unwrap() > 0.0);

    let points = monitor
        .series("sms", CONSUMER)
        .unwrap()
        .processed_per_s
        .window(s4.taken_at, Duration::from_secs(60));
    let shape: Vec<bool> = points.iter().map(|p| p.value.is_some()).collect();
    assert_eq!(shape, vec![true, false, true], "value, gap, value");
    server.abort();
}

#[tokio::test]
async fn spawned_monitor_publishes_snapshots_and_obeys_commands() {
    let metrics = Arc::new(Metrics::new());
    metrics.register_consumer(CONSUMER, risk_class(CONSUMER));
    let (addr, server) = serve(metrics, ([127, 0, 0, 1], 0).into()).await;
    let mut config = config_for(addr);
    config.poll_interval = Duration::from_millis(100);
    let monitor = Monitor::new(&config).unwrap();
    let mut handle = monitor.spawn();
    tokio::time::timeout(Duration::from_secs(5), handle.snapshots.changed())
        .await
        .expect("a snapshot within 5 s")
        .unwrap();
    let first = handle.snapshots.borrow().clone().expect("a snapshot");
    // A fresh monitor's chart spans the data it has (1 min, zoom.rs): zooming out
    // goes to the level above it (5 min) and holds there.
    handle.commands.send(MonitorCommand::ZoomOut).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            handle.snapshots.changed().await.unwrap();
            let s = handle.snapshots.borrow().clone().unwrap();
            if s.poll > first.poll
                && s.charts.iter().all(|c| c.span_seconds == 300)
                && !s.charts.is_empty()
            {
                break;
            }
        }
    })
    .await
    .expect("zoomed charts");
    drop(handle.commands);
    tokio::time::timeout(Duration::from_secs(5), handle.task)
        .await
        .expect("the monitor stops when its handle is dropped")
        .unwrap();
    server.abort();
}

#[tokio::test]
async fn http_edge_replays_and_conflicts_are_read_per_route() {
    let metrics = Arc::new(Metrics::new());
    let (addr, _task) = serve(metrics.clone(), "127.0.0.1:0".parse().unwrap()).await;
    let mut monitor = Monitor::new(&config_for(addr)).unwrap();
    let route = idemwatch::engine::http_api::ROUTE_NOTES;
    metrics.register_http_route(route, &idemwatch::engine::http_api::OUTCOMES);
    metrics.http_request(route, "executed");
    monitor.poll().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..4 {
        metrics.http_request(route, "replayed");
    }
    metrics.http_request(route, "conflict");
    let snap = monitor.poll().await;
    let outcomes = &snap.targets[0].http[route];
    assert_eq!(outcomes["executed"].total, 1.0);
    assert_eq!(outcomes["replayed"].total, 4.0);
    assert!(outcomes["replayed"].per_second.unwrap() > 0.0);
    assert_eq!(outcomes["conflict"].total, 1.0);
}

#[tokio::test]
async fn a_relaxed_engine_is_flagged_per_target_and_in_the_json() {
    let metrics = Arc::new(Metrics::new());
    metrics.register_consumer(CONSUMER, risk_class(CONSUMER));
    let (addr, server) = serve(metrics.clone(), "127.0.0.1:0".parse().unwrap()).await;
    let mut monitor = Monitor::new(&config_for(addr)).unwrap();
    let durable = monitor.poll().await;
    assert_eq!(durable.targets[0].durability, Some(Durability::Durable));
    assert!(!durable
        .alerts
        .iter()
        .any(|a| matches!(a.kind, AlertKind::RelaxedDurability { .. })));

    metrics.set_durability(Durability::Relaxed);
    let relaxed = monitor.poll().await;
    assert_eq!(relaxed.targets[0].durability, Some(Durability::Relaxed));
    let alert = relaxed
        .alerts
        .iter()
        .find(|a| {
            a.kind
                == AlertKind::RelaxedDurability {
                    target: "sms".into(),
                }
        })
        .expect("a relaxed-durability alert");
    assert_eq!(
        alert.message,
        "sms runs with relaxed durability: a power cut can undo its last commits"
    );
    assert_eq!(alert.severity, Severity::Warning);
    let doc = serde_json::to_value(&relaxed).unwrap();
    assert_eq!(doc["targets"][0]["durability"], "relaxed", "{doc}");
    assert_eq!(doc["alerts"][0]["kind"], "relaxed_durability", "{doc}");

    // Down: the last reported durability stays, so does the warning.
    server.abort();
    let _ = server.await;
    let down = monitor.poll().await;
    assert_eq!(down.targets[0].durability, Some(Durability::Relaxed));
}

/// Serve whatever `body` holds as Prometheus text (format 0.0.4), the way an exporter
/// that is not idemwatch does.
async fn serve_text(body: Arc<std::sync::Mutex<String>>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let text = body.lock().unwrap().clone();
            async move { ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text) }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

fn exposition(processed: u64, started: u64) -> String {
    format!(
        "# TYPE idem_messages_processed_total counter\n\
         idem_messages_processed_total{{consumer=\"{CONSUMER}\"}} {processed}\n\
         # TYPE process_start_time_seconds gauge\n\
         process_start_time_seconds {started}\n"
    )
}

/// The snapshot's target is up with exactly one restart marker, from the scrape, whose
/// cause is a new `process_start_time_seconds`, and the target's last restart is it.
fn one_restart_by_start_time(s: &Snapshot) -> idemwatch::monitor::markers::TimelineMarker {
    assert_eq!(s.targets[0].status, SourceStatus::Up);
    let found: Vec<_> = s.markers.iter().filter(|m| m.kind == "restart").collect();
    assert_eq!(found.len(), 1, "{:?}", s.markers);
    let marker = found[0].clone();
    assert_eq!(marker.source, MarkerSource::Scrape);
    let cause = marker.detail.as_deref().unwrap_or("");
    assert!(cause.contains("process_start_time_seconds"), "{cause}");
    assert_eq!(s.targets[0].last_restart, Some(marker.at));
    marker
}

#[tokio::test]
async fn a_restart_between_two_scrapes_is_one_marker_without_any_downtime() {
    // The process was replaced between two polls: the dashboard never saw it down,
    // only a new start time and counters from zero in the next scrape.
    let body = Arc::new(std::sync::Mutex::new(exposition(100, 1_700_000_000)));
    let addr = serve_text(body.clone()).await;
    let mut monitor = Monitor::new(&config_for(addr)).unwrap();
    let restarts = |s: &Snapshot| s.markers.iter().filter(|m| m.kind == "restart").count();
    // Readings a little apart: a rate needs time between them.
    let beat = || tokio::time::sleep(Duration::from_millis(50));

    let first = monitor.poll().await;
    *body.lock().unwrap() = exposition(130, 1_700_000_000);
    beat().await;
    let steady = monitor.poll().await;
    for s in [&first, &steady] {
        assert_eq!(s.targets[0].status, SourceStatus::Up);
        assert_eq!((restarts(s), s.targets[0].last_restart), (0, None));
    }

    *body.lock().unwrap() = exposition(7, 1_700_000_600);
    beat().await;
    let after = monitor.poll().await;
    let marker = one_restart_by_start_time(&after);
    assert_eq!(consumer(&after).last_restart, Some(marker.at));
    let rate = consumer(&after).processed.per_second.unwrap();
    assert!(rate > 0.0, "counted from zero across the restart: {rate}");

    *body.lock().unwrap() = exposition(9, 1_700_000_600);
    beat().await;
    let later = monitor.poll().await;
    assert_eq!(restarts(&later), 1, "one restart, one marker");
    assert_eq!(later.targets[0].last_restart, Some(marker.at));
}

/// A second test of restart detection from a scrape, beside the two above (an
/// exposition served in-process): the real `idemwatch serve` killed and started again
/// on the same port between two polls. No traffic, so no counter goes down: only the
/// process's own `process_start_time_seconds` tells, and it must.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serve_process_killed_and_started_again_is_one_restart_marker() {
    let env = common::TempEnv::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let up = || async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while reqwest::get(format!("http://{addr}/metrics"))
            .await
            .is_err()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "serve never answered"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let mut first = common::serve(&env, port);
    up().await;
    let mut monitor = Monitor::new(&config_for(addr)).unwrap();
    let restarts = |s: &Snapshot| s.markers.iter().filter(|m| m.kind == "restart").count();
    for _ in 0..2 {
        let s = monitor.poll().await;
        assert_eq!(s.targets[0].status, SourceStatus::Up);
        assert_eq!((restarts(&s), s.targets[0].last_restart), (0, None));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    first.stop();
    // A start time a second later at least: closer is exporter noise, not a restart.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let _second = common::serve(&env, port);
    up().await;
    let after = monitor.poll().await;
    one_restart_by_start_time(&after);
    let later = monitor.poll().await;
    assert_eq!(restarts(&later), 1, "one restart, one marker");
}

#[tokio::test]
async fn a_paused_consumer_shows_since_when_why_and_an_alert() {
    use idemwatch::engine::health::{Backoff, ConsumerHealth, InfraKind};
    let metrics = Arc::new(Metrics::new());
    metrics.register_consumer(CONSUMER, risk_class(CONSUMER));
    let health = ConsumerHealth::new(
        CONSUMER,
        Backoff {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(30),
        },
        metrics.clone(),
    );
    let (addr, server) = serve(metrics.clone(), ([127, 0, 0, 1], 0).into()).await;
    let mut monitor = Monitor::new(&config_for(addr)).unwrap();
    let running = monitor.poll().await;
    assert_eq!(consumer(&running).paused, None);

    // The provider fails, then throttles: paused for the provider, the last error
    // the throttling, since the first failure.
    metrics.infra_error(CONSUMER, InfraKind::ProviderUnavailable);
    health.failed(InfraKind::ProviderUnavailable, None, "503");
    let since = health.pause().unwrap().since;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    metrics.infra_error(CONSUMER, InfraKind::ProviderThrottled);
    health.failed(
        InfraKind::ProviderThrottled,
        Some(Duration::from_secs(2)),
        "429",
    );
    let paused = monitor.poll().await;
    let p = consumer(&paused).paused.clone().expect("shown paused");
    assert_eq!(p.cause, "provider");
    assert_eq!(p.last_error_kind.as_deref(), Some("provider_throttled"));
    assert_eq!(p.since.map(|t| t.timestamp()), Some(since.timestamp()));
    let alert = paused
        .alerts
        .iter()
        .find(|a| matches!(&a.kind, AlertKind::ConsumerPaused { consumer, .. } if consumer == CONSUMER))
        .expect("a pause alert");
    assert_eq!(alert.severity, Severity::Critical);
    assert_eq!(alert.since.map(|t| t.timestamp()), Some(since.timestamp()));
    assert!(
        alert.message.contains("provider_throttled"),
        "{}",
        alert.message
    );

    health.recovered();
    let resumed = monitor.poll().await;
    assert_eq!(consumer(&resumed).paused, None);
    assert!(!resumed
        .alerts
        .iter()
        .any(|a| matches!(a.kind, AlertKind::ConsumerPaused { .. })));
    server.abort();
}

/// A store that stopped answering (issue 39): the dashboard, `snapshot --json` and
/// the alert all say what, since when, how often it was tried and what failed last
/// — "store not answering since 04:12:07, 3 retries, last: timeout" — from the
/// engine's metrics alone, and all of it clears by itself once a batch gets through.
#[tokio::test]
async fn a_silent_store_reads_not_answering_since_when_with_its_retries() {
    use idemwatch::engine::health::{Backoff, ConsumerHealth, InfraKind, PauseCause};
    let metrics = Arc::new(Metrics::new());
    metrics.register_consumer(CONSUMER, risk_class(CONSUMER));
    let health = ConsumerHealth::new(
        CONSUMER,
        Backoff {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(30),
        },
        metrics.clone(),
    );
    let (addr, server) = serve(metrics.clone(), ([127, 0, 0, 1], 0).into()).await;
    let mut monitor = Monitor::new(&config_for(addr)).unwrap();
    assert_eq!(consumer(&monitor.poll().await).paused, None);

    // The statement deadline fired, then a probe and a trial timed out too.
    let timeout = InfraKind::Timeout(PauseCause::Store);
    for _ in 0..3 {
        metrics.infra_error(CONSUMER, timeout);
        health.failed(
            timeout,
            None,
            "store did not answer within 30s (record_batch)",
        );
    }
    let since = health.pause().unwrap().since;
    let stalled = monitor.poll().await;
    let p = consumer(&stalled).paused.clone().expect("shown paused");
    let want = format!(
        "store not answering since {}, 3 retries, last: timeout",
        since.format("%H:%M:%S")
    );
    assert_eq!(p.summary, want);
    assert_eq!(p.retries, Some(3));
    let json = serde_json::to_value(&stalled).unwrap();
    let shown = json["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer"] == CONSUMER)
        .unwrap();
    assert_eq!(shown["paused"]["summary"], want.as_str(), "{shown}");
    assert_eq!(shown["paused"]["retries"], 3);
    let alert = stalled
        .alerts
        .iter()
        .find(|a| matches!(&a.kind, AlertKind::ConsumerPaused { .. }))
        .expect("a pause alert");
    assert!(alert.message.contains(&want), "{}", alert.message);
    assert!(metrics.encode().contains(&format!(
        "idem_consumer_pause_retries{{consumer=\"{CONSUMER}\"}} 3"
    )));

    health.recovered();
    let resumed = monitor.poll().await;
    assert_eq!(consumer(&resumed).paused, None);
    assert!(!resumed
        .alerts
        .iter()
        .any(|a| matches!(a.kind, AlertKind::ConsumerPaused { .. })));
    assert!(metrics.encode().contains(&format!(
        "idem_consumer_pause_retries{{consumer=\"{CONSUMER}\"}} 0"
    )));
    server.abort();
}

/// A batch held by a peer that has not answered yet, before any deadline fired (the
/// first 30 s of a frozen connection): shown as waiting, with an alert saying so,
/// and nothing once the batch is through.
#[tokio::test]
async fn a_batch_held_by_a_silent_peer_shows_as_waiting_before_any_deadline() {
    let metrics = Arc::new(Metrics::new());
    metrics.register_consumer(CONSUMER, risk_class(CONSUMER));
    let (addr, server) = serve(metrics.clone(), ([127, 0, 0, 1], 0).into()).await;
    let mut monitor = Monitor::new(&config_for(addr)).unwrap();
    // A batch taken up a moment ago is work, not a wait.
    metrics.set_busy(CONSUMER, Some(chrono::Utc::now()));
    assert_eq!(consumer(&monitor.poll().await).waiting_seconds, None);

    metrics.set_busy(
        CONSUMER,
        Some(chrono::Utc::now() - chrono::Duration::seconds(21)),
    );
    let held = monitor.poll().await;
    let waiting = consumer(&held).waiting_seconds.expect("shown waiting");
    assert!((21..25).contains(&waiting), "{waiting}");
    let alert = held
        .alerts
        .iter()
        .find(|a| matches!(&a.kind, AlertKind::ConsumerWaiting { .. }))
        .expect("a waiting alert");
    assert_eq!(alert.severity, Severity::Warning);
    assert!(
        alert.message.contains("one batch in hand for 2"),
        "{}",
        alert.message
    );

    metrics.set_busy(CONSUMER, None);
    let through = monitor.poll().await;
    assert_eq!(consumer(&through).waiting_seconds, None);
    assert!(!through
        .alerts
        .iter()
        .any(|a| matches!(a.kind, AlertKind::ConsumerWaiting { .. })));
    server.abort();
}
