//! Redis, Mosquitto and NATS (JetStream) for tests: `IDEMWATCH_REDIS_URL`,
//! `IDEMWATCH_MQTT_URL`, `IDEMWATCH_NATS_URL` (defaults: the local servers). A test
//! whose server does not answer is skipped, or fails with `IDEMWATCH_REQUIRE_SERVICES=1`.

use std::net::ToSocketAddrs;
use std::time::Duration;

pub const REDIS_DEFAULT: &str = "redis://127.0.0.1:6379";
pub const MQTT_DEFAULT: &str = "mqtt://127.0.0.1:1883";
pub const NATS_DEFAULT: &str = "nats://127.0.0.1:4222";

/// The Redis URL if its port answers.
pub fn redis_url() -> Option<String> {
    service("Redis", "IDEMWATCH_REDIS_URL", REDIS_DEFAULT)
}

/// The Mosquitto (MQTT) URL if its port answers.
pub fn mqtt_url() -> Option<String> {
    service("Mosquitto", "IDEMWATCH_MQTT_URL", MQTT_DEFAULT)
}

/// The NATS URL if its port answers.
pub fn nats_url() -> Option<String> {
    service("NATS", "IDEMWATCH_NATS_URL", NATS_DEFAULT)
}

fn service(name: &str, var: &str, default: &str) -> Option<String> {
    let url = std::env::var(var).unwrap_or_else(|_| default.to_string());
    match reachable(&url) {
        Ok(()) => Some(url),
        Err(e) => {
            if super::backends::required() {
                panic!("{name} is required (IDEMWATCH_REQUIRE_SERVICES=1) at {url}: {e}");
            }
            eprintln!("SKIP: {name} unreachable at {url} ({e}); set {var} or start it");
            None
        }
    }
}

/// A TCP connect to the URL's host and port within two seconds.
pub fn reachable(url: &str) -> Result<(), String> {
    let parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
    let host = parsed.host_str().ok_or("no host")?;
    let port = parsed.port().ok_or("no port")?;
    let addr = (host, port)
        .to_socket_addrs()
        .map_err(|e| e.to_string())?
        .next()
        .ok_or("no address")?;
    std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map(drop)
        .map_err(|e| e.to_string())
}

/// A free loopback port for a private server process.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}
