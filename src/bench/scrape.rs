//! `bench scrape`: one scrape of a 10,000-sample exposition — over real HTTP from a
//! loopback exporter, parsed, turned into rates — against a baseline in the same
//! process that only walks the same bytes line by line.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use serde::Serialize;

use super::{BenchError, BenchResult};
use crate::config::MetricNames;
use crate::engine::envelope::RejectReason;
use crate::engine::exporter;
use crate::engine::metrics::Metrics;
use crate::monitor::prometheus::{self, ScrapeResult, Scraper};
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
    /// GET over loopback HTTP, parse and rates: one real scrape.
    pub http_scrape_us: f64,
    pub parse_vs_baseline: f64,
    pub scrape_vs_baseline: f64,
}

/// An engine registry with `consumers` consumers: ~20 samples each.
fn exposition_of(consumers: usize) -> Arc<Metrics> {
    let m = Arc::new(Metrics::new());
    for i in 0..consumers {
        let c = format!("consumer-{i:04}");
        m.register_consumer(&c);
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

pub async fn run(target_samples: usize, iterations: u32) -> BenchResult<ScrapeBenchReport> {
    let metrics = exposition_of(target_samples / 20);
    let text = metrics.encode();
    let parsed = prometheus::parse(&text).map_err(|e| BenchError::Run(e.to_string()))?;
    let samples = parsed.samples.len();
    let names = MetricNames::default();
    let iterations = iterations.max(1);

    let baseline_us = mean_us(iterations, || {
        std::hint::black_box(text.lines().filter(|l| !l.starts_with('#')).count());
    });
    let parse_us = mean_us(iterations, || {
        std::hint::black_box(
            prometheus::parse(&text)
                .map(|e| e.samples.len())
                .unwrap_or(0),
        );
    });
    let mut tracker = TargetTracker::new("bench", "http://bench/metrics");
    let parse_and_rates_us = mean_us(iterations, || {
        let outcome = prometheus::parse(&text).map_err(|e| e.to_string());
        let scrape = ScrapeResult {
            target: "bench".into(),
            url: "http://bench/metrics".into(),
            at: Utc::now(),
            duration: Duration::ZERO,
            outcome,
        };
        std::hint::black_box(tracker.observe(&scrape, &names));
    });

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .map_err(|e| BenchError::Run(e.to_string()))?;
    let url = format!(
        "http://{}/metrics",
        listener
            .local_addr()
            .map_err(|e| BenchError::Run(e.to_string()))?
    );
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, exporter::router(metrics)).await;
    });
    let scraper =
        Scraper::new(Duration::from_secs(5)).map_err(|e| BenchError::Run(e.to_string()))?;
    let mut http_tracker = TargetTracker::new("bench", &url);
    // Warm the connection pool once, as a dashboard polling every second has.
    let _ = scraper.scrape("bench", &url).await;
    let started = Instant::now();
    for _ in 0..iterations {
        let scrape = scraper.scrape("bench", &url).await;
        if let Err(e) = &scrape.outcome {
            server.abort();
            return Err(BenchError::Run(format!("scrape failed: {e}")));
        }
        std::hint::black_box(http_tracker.observe(&scrape, &names));
    }
    let http_scrape_us = started.elapsed().as_secs_f64() * 1e6 / f64::from(iterations);
    server.abort();
    Ok(ScrapeBenchReport {
        samples,
        bytes: text.len(),
        iterations,
        baseline_us,
        parse_us,
        parse_and_rates_us,
        http_scrape_us,
        parse_vs_baseline: parse_us / baseline_us.max(1e-9),
        scrape_vs_baseline: http_scrape_us / baseline_us.max(1e-9),
    })
}
