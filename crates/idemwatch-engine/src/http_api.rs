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
//! - callers authenticate with a token from `serve --api-keys` (`Authorization:
//!   Bearer TOKEN` or `X-Api-Key: TOKEN`, see `api_keys`); keys are scoped to the
//!   principal the token names; anonymous callers share one scope only when allowed
//!   (a credential that cannot be checked never makes a scope of its own);
//! - keys expire after 24 h (configurable), purged by `idemwatch purge`;
//! - error policy: our own failure (5xx) releases the key, so the retry re-executes;
//!   a 4xx validation answer is stored and replayed — the request was understood and
//!   answered, and answering it differently on retry would be the surprise.
//!
//! Limits, answered before any of the above (none of them is stored under a key):
//! more than `max_in_flight` requests at once → 503 `overloaded` + `Retry-After`;
//! no or unknown credentials → 401; a `{device}` that breaks the envelope's
//! `device_id` rule → 400 `invalid_device_id`; a key present but unusable → 400
//! `invalid_idempotency_key` (the rule is `idempotency_key`'s); a body over
//! [`MAX_BODY`] → 413 `body_too_large`; a body not received within the body timeout
//! → 408 `body_timeout`. Every answer is counted in `idem_http_requests_total`.
//! Header and idle timeouts and the connection cap are the server's (`http_server`).

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::api_keys::ApiKeys;
use super::envelope::check_device_id;
use super::idempotency_key::{IdempotencyKey, InvalidKey};
use super::metrics::Metrics;
use super::store::edge::{
    Completion, EdgeStore, EdgeWrite, IdemBegin, IdemRequest, StoredResponse,
};

pub use super::idempotency_key::{HEADER as IDEMPOTENCY_KEY, REPLAYED_HEADER as REPLAYED};
/// Largest accepted request body (bytes).
pub const MAX_BODY: usize = 64 * 1024;

pub const ROUTE_NOTES: &str = "/v1/trips/{device}/notes";
pub const ROUTE_COMMANDS: &str = "/v1/vehicles/{device}/commands";
/// Vehicle commands the gateway knows.
pub const COMMANDS: [&str; 4] = ["lock", "unlock", "honk", "immobilize"];

/// How the edge treats callers and keys.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// How long an in-flight request holds its key.
    pub lease: Duration,
    /// How long a completed key is remembered.
    pub ttl: Duration,
    /// The principals and their tokens (`serve --api-keys`). Without them nobody
    /// authenticates: only anonymous callers, if allowed, get in.
    pub keys: Option<Arc<ApiKeys>>,
    /// Callers without credentials share the `anonymous` scope (else 401).
    pub allow_anonymous: bool,
    /// false = naive: keys are ignored and every request executes (drills only).
    pub idempotent: bool,
    /// Requests handled at once; more are answered 503 with `Retry-After`.
    pub max_in_flight: usize,
    /// How long a request's body may take to arrive once its headers are in.
    pub body_timeout: Duration,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(24 * 3600),
            keys: None,
            allow_anonymous: false,
            idempotent: true,
            max_in_flight: 64,
            body_timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Clone)]
pub struct ApiState {
    pub edge: Arc<dyn EdgeStore>,
    pub metrics: Arc<Metrics>,
    pub config: ApiConfig,
}

/// The state the routes share: the caller's, plus the in-flight slots.
struct Shared {
    api: ApiState,
    in_flight: Arc<Semaphore>,
}

/// Every outcome counted in `idem_http_requests_total`.
pub const OUTCOMES: [&str; 12] = [
    "executed",
    "replayed",
    "conflict",
    "mismatch",
    "missing_key",
    "invalid_key",
    "invalid_request",
    "too_large",
    "timeout",
    "overloaded",
    "unauthorized",
    "error",
];

/// The write API's routes.
pub fn router(state: ApiState) -> Router {
    for route in [ROUTE_NOTES, ROUTE_COMMANDS] {
        state.metrics.register_http_route(route, &OUTCOMES);
    }
    let in_flight = Arc::new(Semaphore::new(state.config.max_in_flight.max(1)));
    Router::new()
        .route(ROUTE_NOTES, post(post_note))
        .route(ROUTE_COMMANDS, post(post_command))
        .with_state(Arc::new(Shared {
            api: state,
            in_flight,
        }))
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

/// Who is calling, once the credentials are checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A token from the keys file: the principal's name.
    Principal(String),
    /// No credentials, and anonymous callers are allowed.
    Anonymous,
}

impl Caller {
    /// The idempotency scope: keys never cross it. A principal's name, never its
    /// token (a rotated token keeps the caller's stored responses).
    pub fn scope(&self) -> String {
        match self {
            Caller::Principal(name) => format!("key:{name}"),
            Caller::Anonymous => "anonymous".into(),
        }
    }

    /// Who wrote a row, as stored beside it.
    pub fn principal(&self) -> &str {
        match self {
            Caller::Principal(name) => name,
            Caller::Anonymous => "anonymous",
        }
    }
}

/// Why a caller was refused (the detail is safe to show: it never echoes a token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unauthorized {
    Missing,
    Unknown,
    Scheme,
}

impl Unauthorized {
    fn detail(self) -> &'static str {
        match self {
            Unauthorized::Missing => {
                "send Authorization: Bearer TOKEN or X-Api-Key: TOKEN (a token from the server's --api-keys file)"
            }
            Unauthorized::Unknown => "the token is not one of the server's API keys",
            Unauthorized::Scheme => "Authorization must use the Bearer scheme",
        }
    }
}

/// Check the caller's credentials: `Authorization: Bearer TOKEN`, else
/// `X-Api-Key: TOKEN`, looked up in `keys`. Without keys a credential cannot be
/// checked, so it counts for nothing (anonymous when allowed).
pub fn authenticate(
    headers: &HeaderMap,
    keys: Option<&ApiKeys>,
    allow_anonymous: bool,
) -> Result<Caller, Unauthorized> {
    let token = match headers.get(header::AUTHORIZATION) {
        Some(v) => {
            let v = v.to_str().map_err(|_| Unauthorized::Unknown)?.trim();
            match v.split_once(' ') {
                Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => {
                    Some(token.trim())
                }
                _ => return Err(Unauthorized::Scheme),
            }
        }
        None => headers
            .get("x-api-key")
            .map(|v| v.to_str().map(str::trim).map_err(|_| Unauthorized::Unknown))
            .transpose()?,
    };
    match (token, keys) {
        (Some(token), Some(keys)) => keys
            .principal(token)
            .map(Caller::Principal)
            .ok_or(Unauthorized::Unknown),
        (Some(_), None) if allow_anonymous => Ok(Caller::Anonymous),
        (Some(_), None) => Err(Unauthorized::Unknown),
        (None, _) if allow_anonymous => Ok(Caller::Anonymous),
        (None, _) => Err(Unauthorized::Missing),
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

/// A request that passed the limits and the credential check: what the
/// idempotency protocol needs.
struct Admitted {
    /// Held until the response is ready (also when the client has gone).
    _slot: OwnedSemaphorePermit,
    caller: Caller,
    /// `None` only in naive mode.
    key: Option<IdempotencyKey>,
    body: Bytes,
}

/// An answer given before the idempotency protocol: counted, never stored.
struct Refusal {
    outcome: &'static str,
    answer: StoredResponse,
    header: Option<(&'static str, String)>,
}

impl Refusal {
    fn new(outcome: &'static str, answer: StoredResponse) -> Refusal {
        Refusal {
            outcome,
            answer,
            header: None,
        }
    }

    fn with_header(mut self, name: &'static str, value: String) -> Refusal {
        self.header = Some((name, value));
        self
    }

    fn respond(self, api: &ApiState, route: &str) -> Response {
        api.metrics.http_request(route, self.outcome);
        into_response(self.answer, self.header.as_slice())
    }
}

/// The checks every write route makes before it reads the body's meaning, cheapest
/// first: a free slot (503), credentials (401), the `{device}` segment (400), the
/// key (400), then the body within its size (413) and time (408) limits.
async fn admit(
    shared: &Shared,
    device: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<Admitted, Refusal> {
    let api = &shared.api;
    let Ok(slot) = shared.in_flight.clone().try_acquire_owned() else {
        return Err(Refusal::new("overloaded", problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                "Too many requests in flight",
                "the server is handling as many write requests as it allows; retry after the indicated delay with the same Idempotency-Key",
            )).with_header("retry-after", "1".into()));
    };
    let caller = authenticate(
        headers,
        api.config.keys.as_deref(),
        api.config.allow_anonymous,
    )
    .map_err(|why| {
        Refusal::new(
            "unauthorized",
            problem(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Credentials required",
                why.detail(),
            ),
        )
        .with_header("www-authenticate", "Bearer".into())
    })?;
    if let Err(why) = check_device_id(device) {
        return Err(Refusal::new(
            "invalid_request",
            problem(
                StatusCode::BAD_REQUEST,
                "invalid_device_id",
                "Invalid device id",
                &format!("the device id in the path {why}"),
            ),
        ));
    }
    let key = if api.config.idempotent {
        Some(request_key(headers)?)
    } else {
        // Naive: no key, no record — every retry is a new write.
        None
    };
    let body = read_body(&api.config, headers, body).await?;
    Ok(Admitted {
        _slot: slot,
        caller,
        key,
        body,
    })
}

/// The request's Idempotency-Key, by the one rule: missing and invalid are two
/// different answers.
fn request_key(headers: &HeaderMap) -> Result<IdempotencyKey, Refusal> {
    match IdempotencyKey::from_headers(headers) {
        Ok(Some(key)) => Ok(key),
        Ok(None) => Err(Refusal::new(
            "missing_key",
            problem(
                StatusCode::BAD_REQUEST,
                "missing_idempotency_key",
                "Idempotency-Key header is required",
                "write endpoints need an Idempotency-Key (a UUID per logical request) so a retry cannot write twice",
            ),
        )),
        Err(why) => Err(Refusal::new(
            "invalid_key",
            problem(
                StatusCode::BAD_REQUEST,
                "invalid_idempotency_key",
                "Invalid Idempotency-Key",
                &invalid_key_detail(&why),
            ),
        )),
    }
}

fn invalid_key_detail(why: &InvalidKey) -> String {
    format!(
        "{why}; a key is 1 to {} printable ASCII characters, sent bare (abc) or as a quoted string (\"abc\")",
        super::idempotency_key::MAX_LEN
    )
}

/// The body, at most [`MAX_BODY`] bytes, received within the body timeout.
async fn read_body(config: &ApiConfig, headers: &HeaderMap, body: Body) -> Result<Bytes, Refusal> {
    let too_large = || {
        Refusal::new(
            "too_large",
            problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                "Request body too large",
                &format!("a write request's body is at most {MAX_BODY} bytes"),
            ),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    match tokio::time::timeout(config.body_timeout, axum::body::to_bytes(body, MAX_BODY)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) if is_length_limit(&e) => Err(too_large()),
        Ok(Err(e)) => Err(Refusal::new(
            "invalid_request",
            problem(
                StatusCode::BAD_REQUEST,
                "invalid_body",
                "The request body could not be read",
                &e.to_string(),
            ),
        )),
        Err(_) => Err(Refusal::new(
            "timeout",
            problem(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                "The request body did not arrive in time",
                &format!(
                    "the whole body must arrive within {} s of the headers",
                    config.body_timeout.as_secs_f64()
                ),
            ),
        )
        .with_header("connection", "close".into())),
    }
}

/// `to_bytes` stopped at its limit (rather than at a broken connection).
fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}

async fn post_note(
    State(shared): State<Arc<Shared>>,
    Path(device): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let admitted = match admit(&shared, &device, &headers, body).await {
        Ok(a) => a,
        Err(refused) => return refused.respond(&shared.api, ROUTE_NOTES),
    };
    let path = format!("/v1/trips/{device}/notes");
    let text = serde_json::from_slice::<Value>(&admitted.body)
        .ok()
        .and_then(|v| v.get("text").and_then(Value::as_str).map(str::to_string));
    let write = match text {
        Some(t) if !t.trim().is_empty() && t.len() <= 4096 => Ok(EdgeWrite::TripNote {
            device_id: device.clone(),
            text: t,
            principal: admitted.caller.principal().to_string(),
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
        body: admitted.body.clone(),
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
    detached(shared, admitted, spec).await
}

async fn post_command(
    State(shared): State<Arc<Shared>>,
    Path(device): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let admitted = match admit(&shared, &device, &headers, body).await {
        Ok(a) => a,
        Err(refused) => return refused.respond(&shared.api, ROUTE_COMMANDS),
    };
    let path = format!("/v1/vehicles/{device}/commands");
    let command = serde_json::from_slice::<Value>(&admitted.body)
        .ok()
        .and_then(|v| v.get("command").and_then(Value::as_str).map(str::to_string));
    let write = match command {
        Some(c) if COMMANDS.contains(&c.as_str()) => Ok(EdgeWrite::VehicleCommand {
            device_id: device.clone(),
            command: c,
            principal: admitted.caller.principal().to_string(),
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
        body: admitted.body.clone(),
        respond: Box::new(move |id| {
            json_response(
                StatusCode::ACCEPTED,
                &json!({"id": id, "device_id": dev, "command": cmd, "status": "queued"}),
                None,
            )
        }),
        write,
    };
    detached(shared, admitted, spec).await
}

/// Run the request to completion even if the client goes away: a dropped response
/// must not leave the key in progress until its lease runs out (hyper drops the
/// handler future when the connection closes; a spawned task carries on).
async fn detached(shared: Arc<Shared>, admitted: Admitted, spec: RouteSpec) -> Response {
    match tokio::spawn(async move { handle(&shared.api, admitted, spec).await }).await {
        Ok(response) => response,
        Err(e) => into_response(server_error(&e.to_string()), &[]),
    }
}

/// The idempotency protocol around one route's write.
async fn handle(state: &ApiState, admitted: Admitted, spec: RouteSpec) -> Response {
    let route = spec.route;
    let count = |outcome: &str| state.metrics.http_request(route, outcome);
    let Some(key) = admitted.key.as_ref() else {
        // Naive: every request executes.
        let response = match &spec.write {
            Err(p) => p.clone(),
            Ok(w) => match state.edge.edge_write(w, spec.respond.as_ref()).await {
                Ok(r) => r,
                Err(e) => server_error(&e.to_string()),
            },
        };
        count("executed");
        return into_response(response, &[]);
    };
    let scope = admitted.caller.scope();
    let key = key.as_str();
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
