//! The same pattern at the HTTP edge: write endpoints that take an
//! `Idempotency-Key`, following the IETF httpapi Idempotency-Key draft and what
//! Stripe does. Mobile clients on weak networks retry "save"; the second request with
//! a key gets the stored response of the first.
//!
//! Semantics (each row has an integration test in `tests/http_edge.rs`):
//! - no key on a route that requires one → 400 `missing_idempotency_key`;
//! - first request → the key is recorded `in_progress` with a lease, then the business
//!   row and the response are committed in one transaction;
//! - same key, same fingerprint, completed → the stored response, byte for byte, with
//!   `Idempotent-Replayed: true`;
//! - same key while the first is in flight → 409 `request_in_progress` + `Retry-After`;
//! - same key, different fingerprint → 422 `idempotency_key_reused`;
//! - the lease of a request whose process died expires → the next retry takes over;
//! - keys are scoped to the caller (a hash of its `Authorization` or `X-Api-Key`);
//!   anonymous callers share one scope only when allowed;
//! - keys expire after 24 h (configurable), purged by `idemwatch purge`;
//! - error policy: our own failure (5xx) releases the key, so the retry re-executes;
//!   a 4xx validation answer is stored and replayed — the request was understood and
//!   answered, and answering it differently on retry would be the surprise.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::metrics::Metrics;
use super::store::edge::{
    Completion, EdgeStore, EdgeWrite, IdemBegin, IdemRequest, StoredResponse,
};

pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
pub const REPLAYED: &str = "idempotent-replayed";
/// Longest accepted key.
pub const MAX_KEY_LEN: usize = 255;
/// Largest accepted request body.
pub const MAX_BODY: usize = 64 * 1024;

pub const ROUTE_NOTES: &str = "/v1/trips/{device}/notes";
pub const ROUTE_COMMANDS: &str = "/v1/vehicles/{device}/commands";
/// Vehicle commands the gateway knows.
pub const COMMANDS: [&str; 4] = ["lock", "unlock", "honk", "immobilize"];

/// How the edge treats keys.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// How long an in-flight request holds its key.
    pub lease: Duration,
    /// How long a completed key is remembered.
    pub ttl: Duration,
    /// Callers without credentials share the `anonymous` scope (else 401).
    pub allow_anonymous: bool,
    /// false = naive: keys are ignored and every request executes (drills only).
    pub idempotent: bool,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(24 * 3600),
            allow_anonymous: false,
            idempotent: true,
        }
    }
}

#[derive(Clone)]
pub struct ApiState {
    pub edge: Arc<dyn EdgeStore>,
    pub metrics: Arc<Metrics>,
    pub config: ApiConfig,
}

/// Every outcome counted in `idem_http_requests_total`.
pub const OUTCOMES: [&str; 7] = [
    "executed",
    "replayed",
    "conflict",
    "mismatch",
    "missing_key",
    "unauthorized",
    "error",
];

/// The write API's routes.
pub fn router(state: ApiState) -> Router {
    for route in [ROUTE_NOTES, ROUTE_COMMANDS] {
        state.metrics.register_http_route(route, &OUTCOMES);
    }
    Router::new()
        .route(ROUTE_NOTES, post(post_note))
        .route(ROUTE_COMMANDS, post(post_command))
        .with_state(Arc::new(state))
}

/// An RFC 9457 problem document; `code` is the machine-readable reason.
pub fn problem(status: StatusCode, code: &str, title: &str, detail: &str) -> StoredResponse {
    let body = json!({
        "type": format!("urn:idemwatch:problem:{code}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
        "code": code,
    });
    StoredResponse {
        status: status.as_u16(),
        headers: vec![("content-type".into(), "application/problem+json".into())],
        body: body.to_string().into_bytes(),
    }
}

fn json_response(status: StatusCode, body: &Value, location: Option<String>) -> StoredResponse {
    let mut headers = vec![("content-type".to_string(), "application/json".to_string())];
    if let Some(l) = location {
        headers.push(("location".into(), l));
    }
    StoredResponse {
        status: status.as_u16(),
        headers,
        body: body.to_string().into_bytes(),
    }
}

fn into_response(stored: StoredResponse, extra: &[(&'static str, String)]) -> Response {
    let mut resp = (
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        stored.body,
    )
        .into_response();
    let headers = resp.headers_mut();
    for (k, v) in stored
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .chain(extra.iter().map(|(k, v)| (*k, v.clone())))
    {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(k), HeaderValue::try_from(v)) {
            headers.insert(name, value);
        }
    }
    resp
}

/// The caller's scope: a hash of its credentials (never the credentials themselves).
pub fn scope_of(headers: &HeaderMap, allow_anonymous: bool) -> Option<String> {
    let credential = headers
        .get(axum::http::header::AUTHORIZATION)
        .or_else(|| headers.get("x-api-key"))
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.trim().is_empty());
    match credential {
        Some(c) => {
            let digest = hex::encode(Sha256::digest(c.trim().as_bytes()));
            Some(format!("principal:{}", &digest[..24]))
        }
        None if allow_anonymous => Some("anonymous".into()),
        None => None,
    }
}

/// Method, path and canonical body: what "the same request" means.
pub fn fingerprint(method: &str, path: &str, body: &[u8]) -> String {
    let canonical = serde_json::from_slice::<Value>(body)
        .map(|v| v.to_string().into_bytes())
        .unwrap_or_else(|_| body.to_vec());
    let mut h = Sha256::new();
    h.update(method.as_bytes());
    h.update(b"\n");
    h.update(path.as_bytes());
    h.update(b"\n");
    h.update(&canonical);
    hex::encode(h.finalize())
}

/// What a route does with a valid body: the row to write and the response to give.
struct RouteSpec {
    route: &'static str,
    path: String,
    body: Bytes,
    write: Result<EdgeWrite, StoredResponse>,
    respond: Box<dyn Fn(i64) -> StoredResponse + Send + Sync>,
}

async fn post_note(
    State(state): State<Arc<ApiState>>,
    Path(device): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = format!("/v1/trips/{device}/notes");
    let principal = scope_of(&headers, state.config.allow_anonymous).unwrap_or_default();
    let text = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("text").and_then(Value::as_str).map(str::to_string));
    let write = match text {
        Some(t) if !t.trim().is_empty() && t.len() <= 4096 => Ok(EdgeWrite::TripNote {
            device_id: device.clone(),
            text: t,
            principal,
        }),
        _ => Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "Invalid note",
            "the body must be JSON with a non-empty \"text\" of at most 4096 bytes",
        )),
    };
    let (dev, loc_path) = (device.clone(), path.clone());
    let note = write.as_ref().ok().and_then(|w| match w {
        EdgeWrite::TripNote { text, .. } => Some(text.clone()),
        _ => None,
    });
    let spec = RouteSpec {
        route: ROUTE_NOTES,
        path,
        body,
        respond: Box::new(move |id| {
            let text = note.clone().map(Value::String).unwrap_or(Value::Null);
            json_response(
                StatusCode::CREATED,
                &json!({"id": id, "device_id": dev, "text": text}),
                Some(format!("{loc_path}/{id}")),
            )
        }),
        write,
    };
    detached(state, headers, spec).await
}

async fn post_command(
    State(state): State<Arc<ApiState>>,
    Path(device): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = format!("/v1/vehicles/{device}/commands");
    let principal = scope_of(&headers, state.config.allow_anonymous).unwrap_or_default();
    let command = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("command").and_then(Value::as_str).map(str::to_string));
    let write = match command {
        Some(c) if COMMANDS.contains(&c.as_str()) => Ok(EdgeWrite::VehicleCommand {
            device_id: device.clone(),
            command: c,
            principal,
        }),
        _ => Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "Invalid command",
            &format!(
                "the body must be JSON with \"command\" one of {}",
                COMMANDS.join(", ")
            ),
        )),
    };
    let cmd = write.as_ref().ok().and_then(|w| match w {
        EdgeWrite::VehicleCommand { command, .. } => Some(command.clone()),
        _ => None,
    });
    let dev = device.clone();
    let spec = RouteSpec {
        route: ROUTE_COMMANDS,
        path,
        body,
        respond: Box::new(move |id| {
            json_response(
                StatusCode::ACCEPTED,
                &json!({"id": id, "device_id": dev, "command": cmd, "status": "queued"}),
                None,
            )
        }),
        write,
    };
    detached(state, headers, spec).await
}

/// Run the request to completion even if the client goes away: a dropped response
/// must not leave the key in progress until its lease runs out (hyper drops the
/// handler future when the connection closes; a spawned task carries on).
async fn detached(state: Arc<ApiState>, headers: HeaderMap, spec: RouteSpec) -> Response {
    match tokio::spawn(async move { handle(&state, &headers, spec).await }).await {
        Ok(response) => response,
        Err(e) => into_response(server_error(&e.to_string()), &[]),
    }
}

/// The idempotency protocol around one route's write.
async fn handle(state: &ApiState, headers: &HeaderMap, spec: RouteSpec) -> Response {
    let route = spec.route;
    let count = |outcome: &str| state.metrics.http_request(route, outcome);
    let Some(scope) = scope_of(headers, state.config.allow_anonymous) else {
        count("unauthorized");
        return into_response(
            problem(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Credentials required",
                "send Authorization or X-Api-Key: idempotency keys are scoped to the caller",
            ),
            &[("www-authenticate", "Bearer".into())],
        );
    };
    if !state.config.idempotent {
        // Naive: no key, no record — every retry is a new write.
        let response = match &spec.write {
            Err(p) => p.clone(),
            Ok(w) => match state.edge.edge_write(w, spec.respond.as_ref()).await {
                Ok(r) => r,
                Err(e) => server_error(&e.to_string()),
            },
        };
        count("executed");
        return into_response(response, &[]);
    }
    let key = headers
        .get(IDEMPOTENCY_KEY)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .unwrap_or("");
    if key.is_empty() {
        count("missing_key");
        return into_response(
            problem(
                StatusCode::BAD_REQUEST,
                "missing_idempotency_key",
                "Idempotency-Key header is required",
                "write endpoints need an Idempotency-Key (a UUID per logical request) so a retry cannot write twice",
            ),
            &[],
        );
    }
    if key.len() > MAX_KEY_LEN || !key.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        count("missing_key");
        return into_response(
            problem(
                StatusCode::BAD_REQUEST,
                "invalid_idempotency_key",
                "Invalid Idempotency-Key",
                &format!("a key is 1 to {MAX_KEY_LEN} visible ASCII characters"),
            ),
            &[],
        );
    }
    let fp = fingerprint("POST", &spec.path, &spec.body);
    let req = IdemRequest {
        scope: &scope,
        key,
        route,
        fingerprint: &fp,
        lease: state.config.lease,
        ttl: state.config.ttl,
    };
    let lease = match state.edge.idem_begin(&req).await {
        Err(e) => {
            count("error");
            return into_response(server_error(&e.to_string()), &[]);
        }
        Ok(IdemBegin::Replay(stored)) => {
            count("replayed");
            return into_response(stored, &[(REPLAYED, "true".into())]);
        }
        Ok(IdemBegin::InProgress { retry_after }) => {
            count("conflict");
            return into_response(
                problem(
                    StatusCode::CONFLICT,
                    "request_in_progress",
                    "A request with this Idempotency-Key is still in progress",
                    "retry after the indicated delay to get its response",
                ),
                &[("retry-after", retry_after.as_secs().max(1).to_string())],
            );
        }
        Ok(IdemBegin::Mismatch) => {
            count("mismatch");
            return into_response(
                problem(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency_key_reused",
                    "Idempotency-Key reused for a different request",
                    "this key was first used with another method, path or body; use a new key",
                ),
                &[],
            );
        }
        Ok(IdemBegin::Execute(lease)) => lease,
    };
    let done = match &spec.write {
        Err(validation) => state.edge.idem_store(&req, lease, validation).await,
        Ok(w) => {
            state
                .edge
                .idem_execute(&req, lease, w, spec.respond.as_ref())
                .await
        }
    };
    match done {
        Ok(Completion::Done(response)) => {
            count("executed");
            into_response(response, &[])
        }
        Ok(Completion::LeaseLost) => {
            count("conflict");
            into_response(
                problem(
                    StatusCode::CONFLICT,
                    "request_in_progress",
                    "This request took longer than its lease and another retry took over",
                    "retry to get the response of the request that completed",
                ),
                &[("retry-after", "1".into())],
            )
        }
        Err(e) => {
            // Our own failure: release the key so the retry re-executes.
            if let Err(release) = state.edge.idem_release(&req, lease).await {
                tracing::warn!(error = %release, "could not release an idempotency key");
            }
            count("error");
            into_response(server_error(&e.to_string()), &[])
        }
    }
}

fn server_error(detail: &str) -> StoredResponse {
    tracing::warn!(detail, "write endpoint failed");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_error",
        "The write failed on our side",
        "nothing was recorded for this key: retry with the same key",
    )
}
