//! `bench tui`: the dashboard headless — the real monitor polling N scrape targets
//! every second, the real `App::update` and render functions drawing into an
//! off-screen buffer on every snapshot — for a fixed time; reports its own CPU and
//! peak RSS. The targets run in a child process so their cost is not counted.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratatui::backend::TestBackend;
use ratatui::Terminal;
use serde::Serialize;

use super::process::spawn_server;
use super::{cpu_seconds, peak_rss_mib, BenchError, BenchResult};
use crate::config::{Config, ScrapeTarget};
use crate::engine::exporter;
use crate::engine::metrics::Metrics;
use crate::monitor::Monitor;
use crate::tui::action::Action;
use crate::tui::app::App;
use crate::tui::render::render;
use crate::tui::theme::Theme;

#[derive(Debug, Clone, Serialize)]
pub struct TuiBenchReport {
    pub targets: usize,
    pub poll_interval_ms: u64,
    pub seconds: f64,
    pub snapshots: u64,
    pub frames: u64,
    /// CPU time of this process over the measured window ÷ wall time, in % of one core.
    pub cpu_percent: f64,
    pub peak_rss_mib: f64,
}

/// Serve `count` live exporters (4 consumers each, counters moving) and print their
/// URLs as one JSON line; runs until killed. The child side of [`run`].
pub async fn serve_targets(count: usize) -> BenchResult<()> {
    let mut urls = Vec::new();
    let mut registries = Vec::new();
    for _ in 0..count {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|e| BenchError::Run(e.to_string()))?;
        urls.push(format!(
            "http://{}/metrics",
            listener
                .local_addr()
                .map_err(|e| BenchError::Run(e.to_string()))?
        ));
        let metrics = Arc::new(Metrics::new());
        for c in crate::engine::consumers::FLEET_CONSUMERS {
            metrics.register_consumer(c, crate::engine::consumers::risk_class(c));
        }
        registries.push(metrics.clone());
        tokio::spawn(async move {
            let _ = axum::serve(exporter::no_delay(listener), exporter::router(metrics)).await;
        });
    }
    println!("{}", serde_json::json!({ "urls": urls }));
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut n = 0u64;
    loop {
        tick.tick().await;
        n += 1;
        for m in &registries {
            for c in crate::engine::consumers::FLEET_CONSUMERS {
                m.processed(c);
                if n.is_multiple_of(50) {
                    m.duplicate_dropped(c);
                }
            }
        }
    }
}

pub async fn run(exe: &Path, targets: usize, duration: Duration) -> BenchResult<TuiBenchReport> {
    let (mut child, first) = spawn_server(
        exe,
        &["bench", "serve-targets", "--count", &targets.to_string()],
    )
    .await?;
    let urls: Vec<String> = serde_json::from_value(first["urls"].clone())
        .map_err(|_| BenchError::Run(format!("unexpected targets line: {first}")))?;

    let config = Config {
        targets: urls
            .iter()
            .enumerate()
            .map(|(i, url)| ScrapeTarget {
                name: format!("t{i:02}"),
                url: url.clone(),
            })
            .collect(),
        poll_interval: Duration::from_secs(1),
        ..Config::default()
    };
    let monitor = Monitor::new(&config).map_err(|e| BenchError::Run(e.to_string()))?;
    let mut handle = monitor.spawn();
    let mut app = App::new(chrono::Utc::now(), false, None);
    let theme = Theme::default_colors();
    let mut terminal =
        Terminal::new(TestBackend::new(160, 45)).map_err(|e| BenchError::Run(e.to_string()))?;

    let warmup = Instant::now() + Duration::from_secs(3);
    let (mut cpu0, mut wall0) = (cpu_seconds(), Instant::now());
    let mut measuring = false;
    let end = warmup + duration;
    let (mut snapshots, mut frames) = (0u64, 0u64);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while Instant::now() < end {
        if !measuring && Instant::now() >= warmup {
            measuring = true;
            cpu0 = cpu_seconds();
            wall0 = Instant::now();
        }
        let action = tokio::select! {
            changed = handle.snapshots.changed() => match changed {
                Ok(()) => handle.snapshots.borrow_and_update().clone().map(Action::Snapshot),
                Err(_) => break,
            },
            _ = tick.tick() => Some(Action::Tick(chrono::Utc::now())),
        };
        if let Some(action) = action {
            if matches!(action, Action::Snapshot(_)) && measuring {
                snapshots += 1;
            }
            app.update(action);
            terminal
                .draw(|f| render(f, &app, &theme))
                .map_err(|e| BenchError::Run(e.to_string()))?;
            if measuring {
                frames += 1;
            }
        }
    }
    let seconds = wall0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    drop(handle);
    let _ = child.kill().await;
    Ok(TuiBenchReport {
        targets,
        poll_interval_ms: 1000,
        seconds,
        snapshots,
        frames,
        cpu_percent: cpu / seconds.max(1e-9) * 100.0,
        peak_rss_mib: peak_rss_mib(),
    })
}
