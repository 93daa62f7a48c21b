//! The Idempotency-Key semantics of the write API, over real HTTP (reqwest against
//! the axum server on a loopback port), on every backend.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::backends::TestDb;
use idemwatch::drills::{self, DrillOptions, Scenario, Verdict};
use idemwatch::engine::api_keys::ApiKeys;
use idemwatch::engine::consumers::ConsumerMode;
use idemwatch::engine::http_api::{self, ApiConfig, ApiState};
use idemwatch::engine::http_server::{self, ConnectionLimits};
use idemwatch::engine::metrics::Metrics;
use idemwatch::engine::store::edge::{IdemBegin, IdemRequest};
use idemwatch::engine::store::{self, Stores};
use idemwatch_testkit::on_every_backend;
use serde_json::{json, Value};

on_every_backend!(
    missing_key_is_a_400_problem,
    retry_replays_the_stored_response_byte_for_byte,
    same_key_other_body_is_422,
    same_key_and_body_on_another_path_is_422,
    in_flight_key_is_409_with_retry_after,
    expired_lease_is_taken_over,
    keys_are_scoped_to_the_caller,
    a_caller_never_gets_another_callers_response,
    concurrent_pair_writes_once,
    validation_answer_is_stored_and_replayed,
    our_own_failure_releases_the_key,
    expired_keys_execute_again_and_are_purged,
    anonymous_callers_need_permission,
    client_retry_drill,
);

struct Api {
    base: String,
    stores: Stores,
    metrics: Arc<Metrics>,
    _server: tokio::task::JoinHandle<()>,
}

/// The callers the tests' keys file knows: the principal `alice` sends
/// `token("alice")`.
fn keys() -> Arc<ApiKeys> {
    let text: String = ["alice", "bob"]
        .iter()
        .map(|name| format!("{name} {}\n", token(name)))
        .collect();
    Arc::new(ApiKeys::from_text(&text).unwrap())
}

fn token(principal: &str) -> String {
    format!("tok-{principal}-0123456789abcdef")
}

/// The default config with the tests' keys.
fn keyed() -> ApiConfig {
    ApiConfig {
        keys: Some(keys()),
        ..ApiConfig::default()
    }
}

async fn api(db: &TestDb, config: ApiConfig) -> Api {
    let stores = store::open_with_edge(&db.url).await.expect("open store");
    let metrics = Arc::new(Metrics::new());
    let state = ApiState {
        edge: stores.edge.clone(),
        metrics: metrics.clone(),
        config,
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        let _ = http_server::serve(
            listener,
            http_api::router(state),
            ConnectionLimits::default(),
            std::future::pending(),
        )
        .await;
    });
    Api {
        base,
        stores,
        metrics,
        _server: server,
    }
}

const DEVICE: &str = "34-ABC-123";

fn note_url(api: &Api) -> String {
    format!("{}/v1/trips/{DEVICE}/notes", api.base)
}

/// POST as `principal` (its token from the keys file), or without credentials.
async fn post(
    url: &str,
    principal: Option<&str>,
    key: Option<&str>,
    body: &Value,
) -> reqwest::Response {
    let mut req = reqwest::Client::new().post(url).json(body);
    if let Some(p) = principal {
        req = req.bearer_auth(token(p));
    }
    if let Some(k) = key {
        req = req.header("Idempotency-Key", k);
    }
    req.send().await.expect("request")
}

async fn problem_code(resp: reqwest::Response) -> (u16, String, Value) {
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body: Value = resp.json().await.unwrap();
    (status, ct, body)
}

async fn missing_key_is_a_400_problem(db: &TestDb) {
    let api = api(db, keyed()).await;
    let (status, ct, body) =
        problem_code(post(&note_url(&api), Some("alice"), None, &json!({"text": "x"})).await).await;
    assert_eq!((status, ct.as_str()), (400, "application/problem+json"));
    assert_eq!(body["code"], "missing_idempotency_key");
    assert_eq!(body["status"], 400);
    assert!(api.stores.edge.trip_notes(DEVICE).await.unwrap().is_empty());
    assert_eq!(
        api.metrics
            .http_requests(http_api::ROUTE_NOTES, "missing_key"),
        1
    );
}

async fn retry_replays_the_stored_response_byte_for_byte(db: &TestDb) {
    let api = api(db, keyed()).await;
    let body = json!({"text": "tyre pressure low"});
    let first = post(&note_url(&api), Some("alice"), Some("k-1"), &body).await;
    assert_eq!(first.status().as_u16(), 201);
    assert!(!first.headers().contains_key("idempotent-replayed"));
    let location = first.headers().get("location").cloned();
    let first_bytes = first.bytes().await.unwrap();
    for _ in 0..3 {
        let again = post(&note_url(&api), Some("alice"), Some("k-1"), &body).await;
        assert_eq!(again.status().as_u16(), 201);
        assert_eq!(again.headers().get("idempotent-replayed").unwrap(), "true");
        assert_eq!(again.headers().get("location").cloned(), location);
        assert_eq!(again.bytes().await.unwrap(), first_bytes, "byte for byte");
    }
    assert_eq!(api.stores.edge.trip_notes(DEVICE).await.unwrap().len(), 1);
    assert_eq!(
        api.metrics.http_requests(http_api::ROUTE_NOTES, "executed"),
        1
    );
    assert_eq!(
        api.metrics.http_requests(http_api::ROUTE_NOTES, "replayed"),
        3
    );
}

async fn same_key_other_body_is_422(db: &TestDb) {
    let api = api(db, keyed()).await;
    post(
        &note_url(&api),
        Some("alice"),
        Some("k-2"),
        &json!({"text": "a"}),
    )
    .await;
    let (status, _, body) = problem_code(
        post(
            &note_url(&api),
            Some("alice"),
            Some("k-2"),
            &json!({"text": "b"}),
        )
        .await,
    )
    .await;
    assert_eq!(status, 422);
    assert_eq!(body["code"], "idempotency_key_reused");
    // Same key on another route is another request too.
    let cmd = format!("{}/v1/vehicles/{DEVICE}/commands", api.base);
    let (status, _, _) = problem_code(
        post(
            &cmd,
            Some("alice"),
            Some("k-2"),
            &json!({"command": "lock"}),
        )
        .await,
    )
    .await;
    assert_eq!(status, 422);
    assert_eq!(api.stores.edge.trip_notes(DEVICE).await.unwrap().len(), 1);
    assert!(api
        .stores
        .edge
        .vehicle_commands(DEVICE)
        .await
        .unwrap()
        .is_empty());
}

async fn same_key_and_body_on_another_path_is_422(db: &TestDb) {
    // One key, one body, two vehicles: the second is another request. Replaying A's
    // answer would tell the caller B was commanded when it never was.
    let api = api(db, keyed()).await;
    let body = json!({"command": "lock"});
    let commands = |device: &str| format!("{}/v1/vehicles/{device}/commands", api.base);
    let first = post(&commands("34-A-1"), Some("alice"), Some("k-path"), &body).await;
    assert_eq!(first.status().as_u16(), 202);
    let (status, _, problem) =
        problem_code(post(&commands("34-B-2"), Some("alice"), Some("k-path"), &body).await).await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (422, Some("idempotency_key_reused"))
    );
    let edge = &api.stores.edge;
    assert_eq!(edge.vehicle_commands("34-A-1").await.unwrap().len(), 1);
    assert!(edge.vehicle_commands("34-B-2").await.unwrap().is_empty());
    assert_eq!(
        api.metrics
            .http_requests(http_api::ROUTE_COMMANDS, "mismatch"),
        1
    );
}

fn request_for<'a>(scope: &'a str, key: &'a str, fp: &'a str, lease: Duration) -> IdemRequest<'a> {
    IdemRequest {
        scope,
        key,
        route: http_api::ROUTE_NOTES,
        fingerprint: fp,
        lease,
        ttl: Duration::from_secs(3600),
    }
}

fn alice_scope() -> String {
    let mut h = axum::http::HeaderMap::new();
    h.insert(
        "authorization",
        format!("Bearer {}", token("alice")).parse().unwrap(),
    );
    http_api::authenticate(&h, Some(&keys()), false)
        .unwrap()
        .scope()
}

async fn in_flight_key_is_409_with_retry_after(db: &TestDb) {
    let api = api(db, keyed()).await;
    let body = json!({"text": "slow"});
    let path = format!("/v1/trips/{DEVICE}/notes");
    let fp = http_api::fingerprint("POST", &path, body.to_string().as_bytes());
    let scope = alice_scope();
    // A request in flight (say, on another instance) holds the key for 30 s.
    let begun = api
        .stores
        .edge
        .idem_begin(&request_for(&scope, "k-3", &fp, Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(matches!(begun, IdemBegin::Execute(_)));
    let resp = post(&note_url(&api), Some("alice"), Some("k-3"), &body).await;
    let retry_after: u64 = resp
        .headers()
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let (status, _, problem) = problem_code(resp).await;
    assert_eq!(status, 409);
    assert_eq!(
        problem["code"], "request_in_progress",
        "distinct from the mismatch code"
    );
    assert!((1..=30).contains(&retry_after), "{retry_after}");
    assert!(api.stores.edge.trip_notes(DEVICE).await.unwrap().is_empty());
}

async fn expired_lease_is_taken_over(db: &TestDb) {
    let api = api(db, keyed()).await;
    let body = json!({"text": "the process died mid-request"});
    let path = format!("/v1/trips/{DEVICE}/notes");
    let fp = http_api::fingerprint("POST", &path, body.to_string().as_bytes());
    let scope = alice_scope();
    // The first request's process died: its lease (1 ms here) has run out.
    let begun = api
        .stores
        .edge
        .idem_begin(&request_for(&scope, "k-4", &fp, Duration::from_millis(1)))
        .await
        .unwrap();
    let IdemBegin::Execute(dead_lease) = begun else {
        panic!("{begun:?}")
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let resp = post(&note_url(&api), Some("alice"), Some("k-4"), &body).await;
    assert_eq!(resp.status().as_u16(), 201);
    assert!(
        !resp.headers().contains_key("idempotent-replayed"),
        "the retry executed"
    );
    // The dead request cannot complete any more: its lease was taken over.
    let done = api
        .stores
        .edge
        .idem_execute(
            &request_for(&scope, "k-4", &fp, Duration::from_secs(30)),
            dead_lease,
            &idemwatch::engine::store::edge::EdgeWrite::TripNote {
                device_id: DEVICE.into(),
                text: "late".into(),
                principal: scope.clone(),
            },
            &|_| http_api::problem(axum::http::StatusCode::CREATED, "x", "x", "x"),
        )
        .await
        .unwrap();
    assert_eq!(done, idemwatch::engine::store::edge::Completion::LeaseLost);
    assert_eq!(api.stores.edge.trip_notes(DEVICE).await.unwrap().len(), 1);
}

async fn keys_are_scoped_to_the_caller(db: &TestDb) {
    let api = api(db, keyed()).await;
    let a = post(
        &note_url(&api),
        Some("alice"),
        Some("same-key"),
        &json!({"text": "alice's"}),
    )
    .await;
    let b = post(
        &note_url(&api),
        Some("bob"),
        Some("same-key"),
        &json!({"text": "bob's"}),
    )
    .await;
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (201, 201));
    let (a_body, b_body) = (a.text().await.unwrap(), b.text().await.unwrap());
    assert!(a_body.contains("alice's") && b_body.contains("bob's"));
    // Bob's retry replays Bob's response, never Alice's.
    let b2 = post(
        &note_url(&api),
        Some("bob"),
        Some("same-key"),
        &json!({"text": "bob's"}),
    )
    .await;
    assert_eq!(b2.headers().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(b2.text().await.unwrap(), b_body);
    assert_eq!(api.stores.edge.trip_notes(DEVICE).await.unwrap().len(), 2);
}

async fn a_caller_never_gets_another_callers_response(db: &TestDb) {
    // Two API keys send the same Idempotency-Key with the same body: to each caller
    // it is its own first request. A shared scope would replay the first caller's
    // stored response (its note's id) to the second, and write one note for two.
    let api = api(db, keyed()).await;
    let body = json!({"text": "same words, two callers"});
    let send = |principal: &str| {
        reqwest::Client::new()
            .post(note_url(&api))
            .header("X-Api-Key", token(principal))
            .header("Idempotency-Key", "shared-key")
            .json(&body)
            .send()
    };
    let mut answers = Vec::new();
    for caller in ["alice", "bob", "alice"] {
        let r = send(caller).await.unwrap();
        let replayed = r.headers().contains_key("idempotent-replayed");
        answers.push((r.status().as_u16(), replayed, r.text().await.unwrap()));
    }
    assert_eq!(
        answers.iter().map(|a| (a.0, a.1)).collect::<Vec<_>>(),
        [(201, false), (201, false), (201, true)],
        "{answers:?}"
    );
    assert_ne!(answers[0].2, answers[1].2, "each caller its own note");
    assert_eq!(
        answers[2].2, answers[0].2,
        "a caller's retry gets its own answer"
    );
    assert_eq!(api.stores.edge.trip_notes(DEVICE).await.unwrap().len(), 2);
}

async fn concurrent_pair_writes_once(db: &TestDb) {
    let api = api(db, keyed()).await;
    for round in 0..5 {
        let key = format!("race-{round}");
        let body = json!({"text": format!("race {round}")});
        let url = note_url(&api);
        let (a, b) = tokio::join!(
            post(&url, Some("alice"), Some(&key), &body),
            post(&url, Some("alice"), Some(&key), &body)
        );
        let outcomes: Vec<(u16, bool)> = [a, b]
            .into_iter()
            .map(|r| {
                (
                    r.status().as_u16(),
                    r.headers().contains_key("idempotent-replayed"),
                )
            })
            .collect();
        let executed = outcomes
            .iter()
            .filter(|(s, replayed)| *s == 201 && !replayed)
            .count();
        assert_eq!(executed, 1, "{outcomes:?}");
        assert!(
            outcomes
                .iter()
                .all(|(s, replayed)| (*s == 201) || (*s == 409 && !replayed)),
            "{outcomes:?}"
        );
    }
    assert_eq!(api.stores.edge.trip_notes(DEVICE).await.unwrap().len(), 5);
}

async fn validation_answer_is_stored_and_replayed(db: &TestDb) {
    let api = api(db, keyed()).await;
    let cmd = format!("{}/v1/vehicles/{DEVICE}/commands", api.base);
    let first = post(
        &cmd,
        Some("alice"),
        Some("k-5"),
        &json!({"command": "teleport"}),
    )
    .await;
    assert_eq!(first.status().as_u16(), 400);
    let first_body = first.text().await.unwrap();
    assert!(first_body.contains("invalid_request"));
    let again = post(
        &cmd,
        Some("alice"),
        Some("k-5"),
        &json!({"command": "teleport"}),
    )
    .await;
    assert_eq!(again.status().as_u16(), 400);
    assert_eq!(again.headers().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(again.text().await.unwrap(), first_body);
    let ok = post(
        &cmd,
        Some("alice"),
        Some("k-6"),
        &json!({"command": "lock"}),
    )
    .await;
    assert_eq!(ok.status().as_u16(), 202);
    assert_eq!(
        api.stores
            .edge
            .vehicle_commands(DEVICE)
            .await
            .unwrap()
            .len(),
        1
    );
}

/// Move the notes table away (and back): a real failure of our own database write.
async fn rename_notes(db: &TestDb, from: &str, to: &str) {
    db.exec(&format!("ALTER TABLE {from} RENAME TO {to}")).await;
}

async fn our_own_failure_releases_the_key(db: &TestDb) {
    let api = api(db, keyed()).await;
    let body = json!({"text": "written on the second try"});
    rename_notes(db, "trip_notes", "trip_notes_away").await;
    let (status, _, problem) =
        problem_code(post(&note_url(&api), Some("alice"), Some("k-7"), &body).await).await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (500, Some("internal_error"))
    );
    rename_notes(db, "trip_notes_away", "trip_notes").await;
    let retry = post(&note_url(&api), Some("alice"), Some("k-7"), &body).await;
    assert_eq!(
        retry.status().as_u16(),
        201,
        "the key was released: the retry executes"
    );
    assert!(!retry.headers().contains_key("idempotent-replayed"));
    assert_eq!(api.stores.edge.trip_notes(DEVICE).await.unwrap().len(), 1);
}

async fn expired_keys_execute_again_and_are_purged(db: &TestDb) {
    let api = api(
        db,
        ApiConfig {
            ttl: Duration::from_millis(300),
            ..keyed()
        },
    )
    .await;
    let body = json!({"text": "a day later"});
    assert_eq!(
        post(&note_url(&api), Some("alice"), Some("k-8"), &body)
            .await
            .status()
            .as_u16(),
        201
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    let again = post(&note_url(&api), Some("alice"), Some("k-8"), &body).await;
    assert_eq!(again.status().as_u16(), 201);
    assert!(
        !again.headers().contains_key("idempotent-replayed"),
        "an expired key is a new request"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    let purged = api
        .stores
        .edge
        .purge_idempotency_batch(chrono::Utc::now(), 100)
        .await
        .unwrap();
    assert_eq!(purged, 1);
    assert_eq!(
        api.stores
            .edge
            .purge_idempotency_batch(chrono::Utc::now(), 100)
            .await
            .unwrap(),
        0
    );
}

async fn anonymous_callers_need_permission(db: &TestDb) {
    let strict = api(db, keyed()).await;
    let (status, _, problem) =
        problem_code(post(&note_url(&strict), None, Some("k-9"), &json!({"text": "x"})).await)
            .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (401, Some("unauthorized"))
    );
    let open = api(
        db,
        ApiConfig {
            allow_anonymous: true,
            ..ApiConfig::default()
        },
    )
    .await;
    assert_eq!(
        post(&note_url(&open), None, Some("k-9"), &json!({"text": "x"}))
            .await
            .status()
            .as_u16(),
        201
    );
    let replay = post(&note_url(&open), None, Some("k-9"), &json!({"text": "x"})).await;
    assert_eq!(replay.headers().get("idempotent-replayed").unwrap(), "true");
}

async fn client_retry_drill(db: &TestDb) {
    for (mode, notes) in [(ConsumerMode::Idempotent, 1), (ConsumerMode::Naive, 6)] {
        let mut opts = DrillOptions::new(Scenario::ClientRetry, &db.url, &db.queue_url());
        opts.mode = mode;
        let r = drills::run(opts).await.expect("drill runs");
        assert_eq!(r.counter_delta, notes, "{}", r.render_text());
        assert_eq!(
            r.verdict == Verdict::Pass,
            mode == ConsumerMode::Idempotent,
            "{}",
            r.render_text()
        );
    }
}
