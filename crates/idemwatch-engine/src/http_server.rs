//! The HTTP server under `serve`'s listeners (`/metrics` and the write API): hyper's
//! HTTP/1.1 connection builder with the limits `axum::serve` does not set.
//!
//! `axum::serve` gives hyper no timer, so hyper's header read timeout never runs: a
//! client that opens a connection and never finishes its headers (or never sends a
//! byte) holds it forever, and enough of them hold every file descriptor. Here:
//!
//! - a **header read timeout** (default 10 s) from the moment a connection waits
//!   for a request's first byte to the end of its headers — hyper starts it again
//!   on a kept-alive connection as it waits for the next request;
//! - an **idle timeout** (default 30 s): a connection on which no byte moved for that
//!   long is closed once its request in hand (if any) is answered; together with
//!   the header timeout, no connection sits idle past the shorter of the two;
//! - a **connection cap** (default 512): past it, new connections wait in the
//!   kernel's backlog until one closes, rather than each costing a task and buffers;
//! - `TCP_NODELAY` on every connection (the exporter sends its encoding in pieces,
//!   see `exporter`).
//!
//! The body timeout, the body size limit and the concurrency limit answered with
//! 503 are per route (the write API's, in `http_api`): `/metrics` has no body.

use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

/// What a connection may cost. The defaults are what `serve` uses.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// From waiting for a request's first byte to the end of its headers.
    pub header_read_timeout: Duration,
    /// No byte in either direction for this long: the connection is closed (after
    /// the request in hand, if any, is answered).
    pub idle_timeout: Duration,
    /// Open connections at once; more wait to be accepted.
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            max_connections: 512,
        }
    }
}

/// Serve `app` on `listener` until `shutdown` resolves, then let the connections
/// finish the requests in hand (as `axum::serve`'s graceful shutdown does).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let (app, stop) = (app.clone(), stop_rx.clone());
        tokio::spawn(async move {
            connection(stream, app, limits, stop).await;
            drop(slot);
        });
    }
    let _ = stop_tx.send(true);
    // Every connection gives its slot back when it ends.
    let _ = slots
        .acquire_many(u32::try_from(limits.max_connections.max(1)).unwrap_or(u32::MAX))
        .await;
    Ok(())
}

async fn connection(
    stream: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    mut stop: watch::Receiver<bool>,
) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY not set");
    }
    let started = Instant::now();
    let activity = Arc::new(AtomicU64::new(0));
    let io = TokioIo::new(Tracked {
        inner: stream,
        started,
        activity: activity.clone(),
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    let mut conn = pin!(builder.serve_connection(io, TowerToHyperService::new(app)));
    let mut closing = *stop.borrow();
    if closing {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        let last = Duration::from_millis(activity.load(Ordering::Relaxed));
        let idle_deadline = tokio::time::Instant::from_std(started + last + limits.idle_timeout);
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended");
                }
                return;
            }
            changed = stop.changed(), if !closing => {
                if changed.is_err() || *stop.borrow() {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
            () = tokio::time::sleep_until(idle_deadline), if !closing => {
                let now = Duration::from_millis(activity.load(Ordering::Relaxed));
                if now == last {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// A connection that notes when a byte last moved (milliseconds since it opened).
struct Tracked {
    inner: TcpStream,
    started: Instant,
    activity: Arc<AtomicU64>,
}

impl Tracked {
    fn touch(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.activity.store(ms, Ordering::Relaxed);
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn start(limits: ConnectionLimits) -> (std::net::SocketAddr, watch::Sender<bool>) {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/", get(|| async { "ok" }));
        let (tx, mut rx) = watch::channel(false);
        tokio::spawn(serve(listener, app, limits, async move {
            let _ = rx.changed().await;
        }));
        (addr, tx)
    }

    /// Read until the peer closes; `None` when it is still open after `within`.
    async fn read_to_close(stream: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
        let mut got = Vec::new();
        tokio::time::timeout(within, stream.read_to_end(&mut got))
            .await
            .ok()
            .map(|_| got)
    }

    #[tokio::test]
    async fn a_client_that_never_finishes_its_headers_is_cut_off() {
        let limits = ConnectionLimits {
            header_read_timeout: Duration::from_millis(300),
            ..ConnectionLimits::default()
        };
        let (addr, _stop) = start(limits).await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        // Closed by the server (hyper may answer 408 first), long before a minute.
        let got = read_to_close(&mut slow, Duration::from_secs(60)).await;
        assert!(got.is_some(), "a slow client held its connection");
        let silent = TcpStream::connect(addr).await;
        let got = read_to_close(&mut silent.unwrap(), Duration::from_secs(60)).await;
        assert!(got.is_some(), "a silent client held its connection");
    }

    #[tokio::test]
    async fn an_idle_kept_alive_connection_is_closed() {
        let limits = ConnectionLimits {
            header_read_timeout: Duration::from_secs(3600),
            idle_timeout: Duration::from_millis(300),
            ..ConnectionLimits::default()
        };
        let (addr, _stop) = start(limits).await;
        let mut client = TcpStream::connect(addr).await.unwrap();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let got = read_to_close(&mut client, Duration::from_secs(60)).await;
        let text = String::from_utf8(got.expect("idle connection kept open")).unwrap();
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    }

    #[tokio::test]
    async fn connections_past_the_cap_wait_for_a_free_one() {
        let limits = ConnectionLimits {
            max_connections: 1,
            header_read_timeout: Duration::from_secs(3600),
            idle_timeout: Duration::from_secs(3600),
        };
        let (addr, _stop) = start(limits).await;
        let holder = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The second connects (the kernel's backlog) but is not served…
        let second = tokio::spawn(reqwest::get(format!("http://{addr}/")));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!second.is_finished(), "served past the connection cap");
        // …until the first goes away.
        drop(holder);
        assert_eq!(second.await.unwrap().unwrap().status(), 200);
    }
}
