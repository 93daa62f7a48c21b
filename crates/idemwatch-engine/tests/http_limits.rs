//! The write API against hostile or careless callers, over real HTTP on SQLite (the
//! limits are the edge's, the same on every backend): credentials checked, a
//! present-but-broken Idempotency-Key named as such, bodies capped at 64 KiB, a
//! concurrency limit answered 503, a body that never arrives cut off, a device id
//! held to the envelope's rule. Every answer is counted in `idem_http_requests_total`.

use std::sync::Arc;
use std::time::Duration;

use idemwatch_engine::api_keys::ApiKeys;
use idemwatch_engine::http_api::{self, ApiConfig, ApiState, ROUTE_NOTES};
use idemwatch_engine::http_server::{self, ConnectionLimits};
use idemwatch_engine::metrics::Metrics;
use idemwatch_engine::store::{self, Stores};
use idemwatch_testkit::backends::{Kind, TestDb};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ALICE: &str = "tok-alice-0123456789abcdef";
const DEVICE: &str = "34-ABC-123";

struct Api {
    addr: std::net::SocketAddr,
    stores: Stores,
    metrics: Arc<Metrics>,
    _db: TestDb,
}

impl Api {
    fn notes_url(&self) -> String {
        format!("http://{}/v1/trips/{DEVICE}/notes", self.addr)
    }

    fn count(&self, outcome: &str) -> u64 {
        self.metrics.http_requests(ROUTE_NOTES, outcome)
    }

    async fn notes(&self) -> usize {
        self.stores.edge.trip_notes(DEVICE).await.unwrap().len()
    }
}

async fn api(config: ApiConfig) -> Api {
    let db = TestDb::new(Kind::Sqlite).await.expect("sqlite");
    let stores = store::open_with_edge(&db.url).await.expect("open store");
    let metrics = Arc::new(Metrics::new());
    let state = ApiState {
        edge: stores.edge.clone(),
        metrics: metrics.clone(),
        config: ApiConfig {
            keys: Some(Arc::new(
                ApiKeys::from_text(&format!("alice {ALICE}\n")).unwrap(),
            )),
            ..config
        },
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(http_server::serve(
        listener,
        http_api::router(state),
        ConnectionLimits::default(),
        std::future::pending(),
    ));
    Api {
        addr,
        stores,
        metrics,
        _db: db,
    }
}

async fn answer(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = resp.text().await.unwrap();
    assert_eq!(ct, "application/problem+json", "{status}: {body}");
    (status, serde_json::from_str(&body).unwrap())
}

/// POST `body` with one credential header and an Idempotency-Key.
async fn post_with(
    url: &str,
    header: &str,
    value: &str,
    key: &str,
    body: &Value,
) -> reqwest::Response {
    reqwest::Client::new()
        .post(url)
        .header(header, value)
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await
        .unwrap()
}

/// POST `body` as alice (a valid key) with an Idempotency-Key.
async fn post_as_alice(url: &str, key: &str, body: &Value) -> reqwest::Response {
    post_with(url, "authorization", &format!("Bearer {ALICE}"), key, body).await
}

/// A request written by hand, for what reqwest will not send (bytes outside
/// ASCII in a header, a body announced and never sent): the raw answer.
async fn raw(addr: std::net::SocketAddr, head: &[u8], body: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(head).await.unwrap();
    // The server may answer (and close) before the whole body is in.
    let _ = s.write_all(body).await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut got)).await;
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test]
async fn unknown_or_malformed_credentials_are_refused_401() {
    let api = api(ApiConfig::default()).await;
    let http = reqwest::Client::new();
    let body = json!({"text": "immobilize me"});
    // The review's reproduction: any non-empty Authorization used to be a principal.
    for (name, value) in [
        ("authorization", "x"),
        ("authorization", "Bearer not-a-key-0123456789"),
        ("authorization", "Basic YWxpY2U6cHc="),
        ("x-api-key", "not-a-key-0123456789"),
    ] {
        let resp = post_with(&api.notes_url(), name, value, "k-1", &body).await;
        assert_eq!(
            resp.headers().get("www-authenticate").unwrap(),
            "Bearer",
            "{name}: {value}"
        );
        let (status, problem) = answer(resp).await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (401, Some("unauthorized"))
        );
        assert!(!problem.to_string().contains("not-a-key"), "{problem}");
    }
    let missing = http.post(api.notes_url()).json(&body).send().await.unwrap();
    assert_eq!(missing.status(), 401);
    assert_eq!(api.count("unauthorized"), 5);
    // Both ways of sending a real key work, and name the same principal.
    for (name, value) in [
        ("authorization", format!("Bearer {ALICE}")),
        ("authorization", format!("bearer {ALICE}")),
        ("x-api-key", ALICE.to_string()),
    ] {
        let resp = post_with(&api.notes_url(), name, &value, "k-ok", &body).await;
        assert_eq!(resp.status(), 201);
    }
    assert_eq!((api.count("executed"), api.count("replayed")), (1, 2));
    assert_eq!(api.notes().await, 1);
}

#[tokio::test]
async fn present_but_invalid_idempotency_key_is_400_not_missing() {
    let api = api(ApiConfig::default()).await;
    let body = br#"{"text":"x"}"#;
    for key in [&b"cl\xc3\xa9"[..], b"\"unterminated", b"two words", b"\"\""] {
        let mut head = format!(
            "POST /v1/trips/{DEVICE}/notes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\nIdempotency-Key: ",
            body.len()
        )
        .into_bytes();
        head.extend_from_slice(key);
        head.extend_from_slice(b"\r\n\r\n");
        let got = raw(api.addr, &head, body).await;
        assert!(got.starts_with("HTTP/1.1 400"), "{key:?}: {got}");
        assert!(
            got.contains("\"code\":\"invalid_idempotency_key\""),
            "{got}"
        );
    }
    assert_eq!((api.count("invalid_key"), api.count("missing_key")), (4, 0));
    assert_eq!(api.notes().await, 0);
    // The structured-field string form and the bare token name one key.
    let first = post_as_alice(&api.notes_url(), "\"8e03978e-40d5\"", &json!({"text": "x"})).await;
    assert_eq!(first.status(), 201);
    let again = post_as_alice(&api.notes_url(), "8e03978e-40d5", &json!({"text": "x"})).await;
    assert_eq!(again.headers().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(api.notes().await, 1);
}

#[tokio::test]
async fn body_over_64_kib_is_413_problem_and_counted() {
    let api = api(ApiConfig::default()).await;
    let http = reqwest::Client::new();
    let big = json!({"text": "x".repeat(http_api::MAX_BODY)});
    let resp = http
        .post(api.notes_url())
        .bearer_auth(ALICE)
        .header("idempotency-key", "k-big")
        .json(&big)
        .send()
        .await
        .unwrap();
    let (status, problem) = answer(resp).await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (413, Some("body_too_large"))
    );
    // Without a Content-Length (chunked), the cap holds while reading.
    let head = format!(
        "POST /v1/trips/{DEVICE}/notes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n\
         Idempotency-Key: k-big-2\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    let mut chunks = Vec::new();
    for _ in 0..80 {
        chunks.extend_from_slice(b"400\r\n");
        chunks.extend_from_slice(&[b' '; 1024]);
        chunks.extend_from_slice(b"\r\n");
    }
    chunks.extend_from_slice(b"0\r\n\r\n");
    let got = raw(api.addr, head.as_bytes(), &chunks).await;
    assert!(got.starts_with("HTTP/1.1 413"), "{got}");
    assert!(got.contains("\"code\":\"body_too_large\""), "{got}");
    assert_eq!(api.count("too_large"), 2);
    // Exactly at the limit is still a request (a 400: not a note, but read).
    let at_limit = format!("{{\"text\":1}}{}", " ".repeat(http_api::MAX_BODY - 10));
    let resp = http
        .post(api.notes_url())
        .bearer_auth(ALICE)
        .header("idempotency-key", "k-at")
        .header("content-type", "application/json")
        .body(at_limit)
        .send()
        .await
        .unwrap();
    assert_eq!(answer(resp).await.1["code"], "invalid_request");
    assert_eq!(api.notes().await, 0);
}

/// Headers and a `Content-Length`, then nothing: the request holds its slot until
/// the body timeout.
async fn stalled_request(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/trips/{DEVICE}/notes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n\
         Idempotency-Key: k-stalled\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n{{\"te"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s
}

#[tokio::test]
async fn requests_past_the_in_flight_limit_are_503_with_retry_after() {
    let api = api(ApiConfig {
        max_in_flight: 1,
        body_timeout: Duration::from_secs(3600),
        ..ApiConfig::default()
    })
    .await;
    let _stalled = stalled_request(api.addr).await;
    // The stalled request takes the only slot once its headers are in.
    let mut refused = None;
    for _ in 0..200 {
        let resp = post_as_alice(&api.notes_url(), "k-next", &json!({"text": "x"})).await;
        if resp.status() == 503 {
            refused = Some(resp);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resp = refused.expect("never answered 503 with the only slot taken");
    assert_eq!(resp.headers().get("retry-after").unwrap(), "1");
    assert_eq!(answer(resp).await.1["code"], "overloaded");
    assert_eq!(api.count("overloaded"), 1);
    assert_eq!(api.notes().await, 0);
}

#[tokio::test]
async fn a_body_that_never_arrives_is_cut_off_408() {
    let api = api(ApiConfig {
        body_timeout: Duration::from_millis(300),
        ..ApiConfig::default()
    })
    .await;
    let mut stalled = stalled_request(api.addr).await;
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), stalled.read_to_end(&mut got))
        .await
        .expect("the connection is closed")
        .unwrap();
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("\"code\":\"body_timeout\""), "{got}");
    assert_eq!(api.count("timeout"), 1);
    // The slot came back: the next request goes through.
    let ok = post_as_alice(&api.notes_url(), "k-after", &json!({"text": "x"})).await;
    assert_eq!(ok.status(), 201);
}

#[tokio::test]
async fn device_id_breaking_the_envelope_rule_is_400() {
    let api = api(ApiConfig::default()).await;
    let lock = |device_len: usize| {
        let url = format!(
            "http://{}/v1/vehicles/{}/commands",
            api.addr,
            "D".repeat(device_len)
        );
        async move { post_as_alice(&url, "k-dev", &json!({"command": "lock"})).await }
    };
    let (status, problem) = answer(lock(200).await).await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (400, Some("invalid_device_id"))
    );
    assert!(problem["detail"].as_str().unwrap().contains("limit 128"));
    assert_eq!(
        api.metrics
            .http_requests(http_api::ROUTE_COMMANDS, "invalid_request"),
        1
    );
    assert_eq!(lock(128).await.status(), 202);
}

/// Poison at the HTTP edge costs only itself (issue 39): a body that is not UTF-8,
/// then one over the limit, each answered (400, 413) and counted, and the request
/// after them is executed. The caller keeps its bytes and is told why; the oversized
/// one is refused before its key is looked at, so a corrected retry with the same key
/// executes.
#[tokio::test]
async fn a_body_that_is_not_utf8_is_400_and_the_next_request_flows() {
    let api = api(ApiConfig::default()).await;
    let http = reqwest::Client::new();
    let resp = http
        .post(api.notes_url())
        .bearer_auth(ALICE)
        .header("idempotency-key", "k-poison")
        .header("content-type", "application/json")
        .body(&b"{\"text\":\"\xff\xfe\xc3\x28\"}"[..])
        .send()
        .await
        .unwrap();
    assert_eq!(answer(resp).await.1["code"], "invalid_request");
    let big = json!({"text": "x".repeat(http_api::MAX_BODY)});
    let resp = post_as_alice(&api.notes_url(), "k-poison-2", &big).await;
    assert_eq!(resp.status(), 413);
    let ok = post_as_alice(&api.notes_url(), "k-poison-2", &json!({"text": "fixed"})).await;
    assert_eq!(ok.status(), 201);
    assert_eq!(api.notes().await, 1);
    assert_eq!(api.count("too_large"), 1);
}
