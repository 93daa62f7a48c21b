//! The `/metrics` endpoint over an engine's [`Metrics`]: what `serve` exposes and
//! what the dashboard's demo scrapes over real HTTP, as it would any consumer.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::sync::mpsc;

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
            Body::from_stream(encoding_in_pieces(metrics)),
        )
    } else {
        (
            [(header::CONTENT_TYPE, PROMETHEUS_TEXT_CONTENT_TYPE)],
            Body::from(metrics.encode_prometheus_text()),
        )
    }
}

/// How much of the encoding goes out at a time.
const PIECE: usize = 64 * 1024;

/// The OpenMetrics encoding as it is written: encoded on a blocking thread, sent in
/// pieces of [`PIECE`] bytes while the rest is encoded, so a scraper parses the
/// first pieces instead of waiting for the last (a big registry takes a
/// millisecond or more to encode). The channel is unbounded on purpose: the
/// encoder holds each family's lock while it writes it, and must never wait for a
/// slow scraper; at worst the whole exposition is buffered, as it was before. A
/// scraper that hangs up ends the encoding at its next piece.
fn encoding_in_pieces(
    metrics: Arc<Metrics>,
) -> impl futures::Stream<Item = Result<Bytes, std::convert::Infallible>> {
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    tokio::task::spawn_blocking(move || {
        let mut pieces = Pieces {
            buf: String::with_capacity(PIECE),
            tx,
        };
        if metrics.encode_to(&mut pieces).is_ok() && !pieces.buf.is_empty() {
            let _ = pieces.tx.send(Bytes::from(pieces.buf));
        }
    });
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|piece| (Ok(piece), rx))
    })
}

/// A writer that sends what it was given each time it holds a [`PIECE`].
struct Pieces {
    buf: String,
    tx: mpsc::UnboundedSender<Bytes>,
}

impl std::fmt::Write for Pieces {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.buf.push_str(s);
        if self.buf.len() >= PIECE {
            let full = std::mem::replace(&mut self.buf, String::with_capacity(PIECE));
            // The scraper hung up: stop encoding.
            self.tx
                .send(Bytes::from(full))
                .map_err(|_| std::fmt::Error)?;
        }
        Ok(())
    }
}

/// `listener` with `TCP_NODELAY` on every connection it accepts, for the servers
/// that serve `/metrics`: the encoding goes out in pieces, each an HTTP chunk, and
/// with Nagle's algorithm on a piece that follows another small write waits for the
/// scraper's delayed acknowledgement (up to 40 ms on Linux) before it is sent.
pub fn no_delay(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(|stream| {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY not set: pieces may wait for acks");
        }
    })
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
