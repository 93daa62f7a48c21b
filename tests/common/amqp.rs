//! The RabbitMQ broker for tests: `IDEMWATCH_AMQP_URL` (default: the local broker as
//! guest). Skipped when unreachable, failed instead when `IDEMWATCH_REQUIRE_SERVICES=1`.

use std::sync::atomic::{AtomicU32, Ordering};

use idemwatch::engine::queue::amqp::AmqpQueue;

pub const AMQP_DEFAULT: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

pub fn amqp_url_unchecked() -> String {
    std::env::var("IDEMWATCH_AMQP_URL").unwrap_or_else(|_| AMQP_DEFAULT.to_string())
}

/// The broker URL if it answers, else `None` (after saying why) — or a panic in CI.
pub async fn amqp_url() -> Option<String> {
    let url = amqp_url_unchecked();
    match AmqpQueue::open(&url).await {
        Ok(q) => {
            q.close().await;
            Some(url)
        }
        Err(e) => {
            if super::backends::required() {
                panic!("RabbitMQ is required (IDEMWATCH_REQUIRE_SERVICES=1): {e}");
            }
            eprintln!("SKIP: RabbitMQ unreachable ({e}); set IDEMWATCH_AMQP_URL or start it");
            None
        }
    }
}

/// One RabbitMQ test at a time in this test binary: some close every AMQP connection
/// of their process or stop the broker, and under `cargo test` the tests of a binary
/// share one process, so a neighbour's connections would go with them. Held for the
/// whole test. (nextest runs each test in a process of its own and keeps these tests
/// apart across binaries too, through `.config/nextest.toml`.)
pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    static BROKER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    BROKER.lock().await
}

/// A queue namespace no other test (or run) uses.
pub fn namespace(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "t-{tag}-{}-{}-{:04x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        rand::random::<u16>()
    )
}

/// Close, on the broker's side, every AMQP connection this process opened (they are
/// named `idemwatch pid=N`): what a broker restart or a network cut does to a consumer.
/// Returns how many were closed.
pub fn force_close_connections_of(pid: u32) -> usize {
    let out = std::process::Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "-q",
            "--no-table-headers",
            "pid",
            "client_properties",
        ])
        .output()
        .expect("rabbitmqctl runs (the broker's CLI is needed for this test)");
    let text = String::from_utf8_lossy(&out.stdout);
    let needle = format!("idemwatch pid={pid}\"");
    let mut closed = 0;
    for line in text.lines().filter(|l| l.contains(&needle)) {
        let Some(conn) = line.split_whitespace().next() else {
            continue;
        };
        let status = std::process::Command::new("rabbitmqctl")
            .args([
                "close_connection",
                conn,
                "idemwatch test: force-closed mid-run",
            ])
            .status()
            .expect("rabbitmqctl close_connection");
        if status.success() {
            closed += 1;
        }
    }
    closed
}
