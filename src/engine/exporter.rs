//! The `/metrics` endpoint over an engine's [`Metrics`]: what `serve` exposes and
//! what the dashboard's demo scrapes over real HTTP, as it would any consumer.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use super::metrics::{Metrics, OPENMETRICS_CONTENT_TYPE, PROMETHEUS_TEXT_CONTENT_TYPE};

/// OpenMetrics for scrapers that ask for it (Prometheus does), the classic text
/// format for everyone else (curl, promtool).
async fn metrics_handler(
    State(source): State<MetricsSource>,
    headers: HeaderMap,
) -> impl IntoResponse {
    let metrics = source();
    let wants_openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    if wants_openmetrics {
        (
            [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)],
            metrics.encode(),
        )
    } else {
        (
            [(header::CONTENT_TYPE, PROMETHEUS_TEXT_CONTENT_TYPE)],
            metrics.encode_prometheus_text(),
        )
    }
}

/// Where the exporter reads the current metrics from. A restarted consumer brings a
/// new registry (counters from zero, a new start time), exactly as a new process does.
pub type MetricsSource = Arc<dyn Fn() -> Arc<Metrics> + Send + Sync>;

/// `/metrics` and `/healthz` over one fixed registry.
pub fn router(metrics: Arc<Metrics>) -> Router {
    router_with(Arc::new(move || metrics.clone()))
}

/// `/metrics` and `/healthz` over whatever registry `source` returns at scrape time.
pub fn router_with(source: MetricsSource) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(source)
}
