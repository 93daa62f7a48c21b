//! `client-retry`: the field report's mobile client on a weak network. One logical
//! "save a trip note" request is sent N times: the first response is dropped (the
//! client gives up before it arrives, the server still commits), then retries —
//! some concurrent, some one after another. With an Idempotency-Key exactly one
//! note exists and every later response is a replay or a 409; without (naive) every
//! retry is another note.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::rig::Rig;
use super::{DrillError, Findings};
use idemwatch_engine::api_keys::ApiKeys;
use idemwatch_engine::consumers::ConsumerMode;
use idemwatch_engine::http_api::{self, ApiConfig, ApiState};
use idemwatch_engine::http_server::{self, ConnectionLimits};
use idemwatch_engine::idempotency_key::{self, IdempotencyKey};
use idemwatch_engine::metrics::Metrics;
use idemwatch_engine::store;

/// How long the API holds a key in progress before another request may take it over.
const LEASE: Duration = Duration::from_secs(5);

/// A 409 that says "the first request with this key is still being handled".
fn in_progress(seen: &Seen) -> bool {
    seen.status == Some(409)
        && seen
            .body
            .as_deref()
            .is_some_and(|b| b.contains("request_in_progress"))
}

/// The principal the drill's client authenticates as.
const CLIENT: &str = "drill-mobile-client";

/// One response as the client saw it.
#[derive(Debug, Clone, serde::Serialize)]
struct Seen {
    attempt: u32,
    status: Option<u16>,
    replayed: bool,
    body: Option<String>,
    note: &'static str,
}

/// Send a complete request over a raw connection and hang up without reading the
/// answer: what a phone that loses its signal right after "send" does.
async fn drop_response(
    addr: std::net::SocketAddr,
    path: &str,
    token: &str,
    key: Option<&IdempotencyKey>,
    body: &str,
) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let key_header = key
        .map(|k| {
            let value = k.header_value();
            format!(
                "{}: {}\r\n",
                idempotency_key::HEADER,
                value.to_str().unwrap_or_default()
            )
        })
        .unwrap_or_default();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\n{key_header}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await?;
    stream.flush().await?;
    // Give the server the request, then vanish before the response.
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(stream);
    Ok(())
}

pub(crate) async fn run(rig: &Rig, times: u32) -> Result<Findings, DrillError> {
    let stores = store::open_with_edge(&rig.db_url)
        .await
        .map_err(|e| DrillError::Setup(e.to_string()))?;
    // The client authenticates as a real one would: a token from the API's keys.
    let token = format!("drill-token-{:032x}", rand::random::<u128>());
    let keys = ApiKeys::from_text(&format!("{CLIENT} {token}"))
        .map_err(|e| DrillError::Setup(e.to_string()))?;
    let state = ApiState {
        edge: stores.edge.clone(),
        metrics: Arc::new(Metrics::new()),
        config: ApiConfig {
            lease: LEASE,
            keys: Some(Arc::new(keys)),
            idempotent: rig.mode != ConsumerMode::Naive,
            ..ApiConfig::default()
        },
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .map_err(|e| DrillError::Setup(format!("cannot bind the API port: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| DrillError::Setup(e.to_string()))?;
    let server = tokio::spawn(http_server::serve(
        listener,
        http_api::router(state),
        ConnectionLimits::default(),
        std::future::pending(),
    ));
    let url = format!("http://{addr}/v1/trips/{}/notes", rig.device);
    // Naive: the client sends no key at all.
    let key = if rig.mode == ConsumerMode::Naive {
        None
    } else {
        Some(
            IdempotencyKey::new(&format!("{}-save-note", rig.namespace))
                .map_err(|e| DrillError::Setup(e.to_string()))?,
        )
    };
    let body = json!({"text": format!("tyre pressure low ({})", rig.namespace)});
    let send = |attempt: u32, timeout: Duration, note: &'static str| {
        let (url, key, body, token) = (url.clone(), key.clone(), body.clone(), token.clone());
        async move {
            let client = reqwest::Client::builder().timeout(timeout).build().ok();
            let mut req = match &client {
                Some(c) => c.post(&url).bearer_auth(&token).json(&body),
                None => {
                    return Seen {
                        attempt,
                        status: None,
                        replayed: false,
                        body: None,
                        note,
                    }
                }
            };
            if let Some(key) = &key {
                req = req.header(idempotency_key::HEADER, key.header_value());
            }
            match req.send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let replayed = idempotency_key::is_replayed(r.headers());
                    let body = r.text().await.ok();
                    Seen {
                        attempt,
                        status: Some(status),
                        replayed,
                        body,
                        note,
                    }
                }
                Err(_) => Seen {
                    attempt,
                    status: None,
                    replayed: false,
                    body: None,
                    note,
                },
            }
        }
    };
    rig.say(format!(
        "sending one logical request {times} times to {url}"
    ));
    // 1: the request reaches the server, the response never reaches the client.
    let path = format!("/v1/trips/{}/notes", rig.device);
    drop_response(addr, &path, &token, key.as_ref(), &body.to_string())
        .await
        .map_err(|e| DrillError::Setup(format!("first request: {e}")))?;
    let mut seen = vec![Seen {
        attempt: 1,
        status: None,
        replayed: false,
        body: None,
        note: "response dropped by the network",
    }];
    // Then half the retries at once, the rest one after another.
    let concurrent = (times.saturating_sub(1)) / 2;
    let burst: Vec<_> = (0..concurrent)
        .map(|i| send(2 + i, Duration::from_secs(10), "concurrent retry"))
        .collect();
    seen.extend(futures::future::join_all(burst).await);
    // A sequential retry behaves as a well-made client does: a 409 "in progress"
    // (the dropped first request still being handled, which takes a while on a busy
    // machine) is retried after its Retry-After, within the lease, so the drill
    // reads the notes only once the first request has settled.
    let settle_by = tokio::time::Instant::now() + LEASE + Duration::from_secs(5);
    for i in (2 + concurrent)..=times {
        let mut answer = send(i, Duration::from_secs(10), "sequential retry").await;
        while in_progress(&answer) && tokio::time::Instant::now() < settle_by {
            tokio::time::sleep(Duration::from_millis(250)).await;
            answer = send(
                i,
                Duration::from_secs(10),
                "sequential retry after 409 in progress",
            )
            .await;
        }
        seen.push(answer);
    }
    server.abort();

    let notes = stores
        .edge
        .trip_notes(&rig.device)
        .await
        .map_err(|e| DrillError::Setup(e.to_string()))?;
    let after_first: Vec<&Seen> = seen.iter().filter(|s| s.attempt > 1).collect();
    let replays: Vec<&&Seen> = after_first.iter().filter(|s| s.replayed).collect();
    let conflicts = after_first.iter().filter(|s| s.status == Some(409)).count();
    let executed_again = after_first
        .iter()
        .filter(|s| !s.replayed && s.status.is_some_and(|c| (200..300).contains(&c)))
        .count();
    let replay_bodies: std::collections::BTreeSet<_> =
        replays.iter().map(|s| s.body.clone()).collect();

    let mut f = Findings {
        deliveries: u64::from(times),
        counter_delta: notes.len() as i64,
        duplicate_dropped: (replays.len() + conflicts) as u64,
        state_ok: notes.len() == 1,
        ..Findings::default()
    };
    f.check("trip notes written", 1, notes.len());
    // A dropped response and retries in flight: the first attempt's fate was unknown.
    f.effect(
        "trip note saved",
        1,
        (notes.len() + executed_again) as i64,
        true,
    );
    f.check("later responses that executed again", 0, executed_again);
    f.check(
        "later responses that are replays or 409",
        after_first.len(),
        replays.len() + conflicts,
    );
    if rig.mode != ConsumerMode::Naive {
        f.check("replayed bodies identical", true, replay_bodies.len() <= 1);
    } else if notes.len() > 1 {
        f.note(format!(
            "without an Idempotency-Key every retry saved another note: {} notes for one tap on \"save\"",
            notes.len()
        ));
    }
    f.extra.insert("responses".into(), json!(seen));
    f.extra.insert("notes".into(), json!(notes));
    Ok(f)
}
