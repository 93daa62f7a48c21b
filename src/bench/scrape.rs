//! `bench scrape`: one scrape of a 10,000-sample exposition — over real HTTP from an
//! exporter in a child process, parsed, turned into rates — against a baseline in
//! the same process that only walks the same bytes line by line. The exporter's own
//! cost (prometheus-client encoding the registry on every scrape) belongs to the
//! engine's process, not to the dashboard: it is measured apart.
//!
//! The monitor's per-target work depends on the history it keeps (an hour of raw
//! points per series, one-minute means over the last minute's points), so the
//! trackers run on a simulated poll clock, one scrape a second, after an hour of
//! such scrapes: the steady state of a dashboard that has been up a while. Stamping
//! the measured scrapes with the wall clock instead would put hundreds of points in
//! every one-minute window and grow every series as the iterations go.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use serde::Serialize;

use super::process::spawn_server;
use super::{cpu_seconds, BenchError, BenchResult};
use crate::config::MetricNames;
use crate::engine::envelope::RejectReason;
use crate::engine::exporter;
use crate::engine::metrics::Metrics;
use crate::monitor::prometheus::{self, ScrapeLimits, ScrapeResult, Scraper};
use crate::monitor::targets::TargetTracker;

#[derive(Debug, Clone, Serialize)]
pub struct ScrapeBenchReport {
    pub samples: usize,
    pub bytes: usize,
    pub iterations: u32,
    /// Walking the bytes line by line: the floor any parser pays.
    pub baseline_us: f64,
    pub parse_us: f64,
    /// Parse plus counters → rates, resets, restarts (the monitor's per-target work).
    pub parse_and_rates_us: f64,
    /// One real scrape as long as the dashboard waits for it: GET over loopback HTTP
    /// from an exporter in a child process (its encoding included: the answer waits
    /// for it), body read, parse and rates.
    pub http_scrape_us: f64,
    /// GET over loopback HTTP from the same exporter, the body parsed as it
    /// arrives, no rates: the target's "scrape + parse" alone.
    pub http_scrape_parse_us: f64,
    /// The dashboard's own CPU time per HTTP scrape, every thread of this process:
    /// request, body read, parse and rates (the exporter's process is not in it).
    /// Read from /proc in 10 ms ticks: meaningful over a few hundred iterations.
    pub http_scrape_cpu_us: f64,
    /// The exporter's side of each scrape: prometheus-client encoding the same
    /// registry (measured in this process, apart from any scrape).
    pub exporter_encode_us: f64,
    pub parse_vs_baseline: f64,
    pub scrape_vs_baseline: f64,
    /// The simulated poll interval the trackers see, seconds.
    pub poll_interval_s: u64,
    /// How much simulated history the trackers hold before the measured scrapes.
    pub warm_history_s: u64,
}

/// The dashboard's default poll interval, which the trackers are fed at.
const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Scrape times one poll interval apart.
struct PollClock {
    next: chrono::DateTime<Utc>,
    step: chrono::Duration,
}

impl PollClock {
    fn starting(at: chrono::DateTime<Utc>) -> PollClock {
        PollClock {
            next: at,
            step: chrono::Duration::from_std(POLL_INTERVAL).unwrap_or(chrono::Duration::seconds(1)),
        }
    }

    fn tick(&mut self) -> chrono::DateTime<Utc> {
        let at = self.next;
        self.next += self.step;
        at
    }
}

/// An engine registry with `consumers` consumers: ~20 samples each.
fn exposition_of(consumers: usize) -> Arc<Metrics> {
    let m = Arc::new(Metrics::new());
    for i in 0..consumers {
        let c = format!("consumer-{i:04}");
        m.register_consumer(&c, None);
        m.processed(&c);
        m.dead_lettered(&c, RejectReason::MalformedJson);
        m.observe_handler(&c, 0.003);
    }
    m
}

fn mean_us(iterations: u32, mut f: impl FnMut()) -> f64 {
    let started = Instant::now();
    for _ in 0..iterations {
        f();
    }
    started.elapsed().as_secs_f64() * 1e6 / f64::from(iterations)
}

/// Serve the registry of [`run`] on a loopback port and print its URL as one JSON
/// line; runs until killed. The child side of [`run`].
pub async fn serve_exposition(target_samples: usize) -> BenchResult<()> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .map_err(|e| BenchError::Run(e.to_string()))?;
    let url = format!(
        "http://{}/metrics",
        listener
            .local_addr()
            .map_err(|e| BenchError::Run(e.to_string()))?
    );
    println!("{}", serde_json::json!({ "urls": [url] }));
    axum::serve(
        exporter::no_delay(listener),
        exporter::router(exposition_of(target_samples / 20)),
    )
    .await
    .map_err(|e| BenchError::Run(e.to_string()))
}

pub async fn run(
    exe: &Path,
    target_samples: usize,
    iterations: u32,
) -> BenchResult<ScrapeBenchReport> {
    let metrics = exposition_of(target_samples / 20);
    let text = metrics.encode();
    let parsed = prometheus::parse(&text, prometheus::Format::OpenMetrics)
        .map_err(|e| BenchError::Run(e.to_string()))?;
    let samples = parsed.samples.len();
    let names = MetricNames::default();
    let iterations = iterations.max(1);

    let baseline_us = mean_us(iterations, || {
        std::hint::black_box(text.lines().filter(|l| !l.starts_with('#')).count());
    });
    let parse_us = mean_us(iterations, || {
        std::hint::black_box(
            prometheus::parse(&text, prometheus::Format::OpenMetrics)
                .map(|e| e.samples.len())
                .unwrap_or(0),
        );
    });
    // An hour of one-second polls of the same exposition before anything is timed.
    let mut tracker = TargetTracker::new("bench", "http://bench/metrics");
    let warm_history = crate::monitor::series::RAW_RETENTION;
    let mut clock = PollClock::starting(Utc::now() - warm_history * 2);
    let mut warm = ScrapeResult {
        target: "bench".into(),
        url: "http://bench/metrics".into(),
        at: clock.tick(),
        duration: Duration::ZERO,
        outcome: Ok(parsed),
    };
    for _ in 0..warm_history.as_secs() / POLL_INTERVAL.as_secs() {
        warm.at = clock.tick();
        tracker.observe(&warm, &names);
    }
    let parse_and_rates_us = mean_us(iterations, || {
        let outcome =
            prometheus::parse(&text, prometheus::Format::OpenMetrics).map_err(|e| e.to_string());
        let scrape = ScrapeResult {
            target: "bench".into(),
            url: "http://bench/metrics".into(),
            at: clock.tick(),
            duration: Duration::ZERO,
            outcome,
        };
        std::hint::black_box(tracker.observe(&scrape, &names));
    });
    // The HTTP scrapes carry on the same history, one poll after the other.
    let mut http_tracker = tracker.clone();
    drop(tracker);
    let exporter_encode_us = mean_us(iterations, || {
        std::hint::black_box(metrics.encode().len());
    });

    let (mut child, first) = spawn_server(
        exe,
        &[
            "bench",
            "serve-exposition",
            "--samples",
            &target_samples.to_string(),
        ],
    )
    .await?;
    let url = first["urls"][0]
        .as_str()
        .ok_or_else(|| BenchError::Run(format!("unexpected exporter line: {first}")))?
        .to_string();
    let scraper = Scraper::new(Duration::from_secs(5), ScrapeLimits::default())
        .map_err(|e| BenchError::Run(e.to_string()))?;
    // Warm the connection pool once, as a dashboard polling every second has, and
    // check that the child serves the exposition measured above.
    let warm = scraper.scrape("bench", &url).await;
    match &warm.outcome {
        Ok(e) if e.samples.len() == samples => {}
        Ok(e) => {
            return Err(BenchError::Run(format!(
                "the exporter serves {} samples, not {samples}",
                e.samples.len()
            )))
        }
        Err(e) => return Err(BenchError::Run(format!("scrape failed: {e}"))),
    }
    let started = Instant::now();
    for _ in 0..iterations {
        let scrape = scraper.scrape("bench", &url).await;
        if let Err(e) = &scrape.outcome {
            return Err(BenchError::Run(format!("scrape failed: {e}")));
        }
        std::hint::black_box(scrape);
    }
    let http_scrape_parse_us = started.elapsed().as_secs_f64() * 1e6 / f64::from(iterations);
    let (cpu_before, started) = (cpu_seconds(), Instant::now());
    for _ in 0..iterations {
        let mut scrape = scraper.scrape("bench", &url).await;
        if let Err(e) = &scrape.outcome {
            return Err(BenchError::Run(format!("scrape failed: {e}")));
        }
        scrape.at = clock.tick();
        std::hint::black_box(http_tracker.observe(&scrape, &names));
    }
    let http_scrape_us = started.elapsed().as_secs_f64() * 1e6 / f64::from(iterations);
    let http_scrape_cpu_us = (cpu_seconds() - cpu_before) * 1e6 / f64::from(iterations);
    let _ = child.kill().await;
    Ok(ScrapeBenchReport {
        samples,
        bytes: text.len(),
        iterations,
        baseline_us,
        parse_us,
        parse_and_rates_us,
        http_scrape_us,
        http_scrape_parse_us,
        http_scrape_cpu_us,
        exporter_encode_us,
        parse_vs_baseline: parse_us / baseline_us.max(1e-9),
        scrape_vs_baseline: http_scrape_us / baseline_us.max(1e-9),
        poll_interval_s: POLL_INTERVAL.as_secs(),
        warm_history_s: warm_history.as_secs(),
    })
}
