//! The SMS / ERP provider of docs/CONTRACT.md §4 as a real HTTP server (axum).
//!
//! idemwatch needs an external side-effect endpoint it can *inspect*: a drill only
//! proves "a redelivered message is a no-op" if someone outside the engine counts
//! what was actually sent. This sandbox honours `Idempotency-Key` the way a good
//! provider does (the second request with a key gets the stored first response and
//! sends nothing), records every request it received, and can inject 503s so the
//! caller's retry logic is exercised too.
//!
//! Choices where docs/CONTRACT.md §4 is silent:
//! - The body comparison for a reused key is on the parsed JSON value, so key order
//!   and whitespace do not matter; anything else different is `idempotency_key_reused`.
//! - Only successful (200) responses are stored under a key. A 422 or an injected
//!   503 leaves the key free, so a corrected or retried request can still go through.
//! - The key is read by the one rule of `engine::idempotency_key` (bare or quoted
//!   string form); an empty, non-ASCII, malformed or over-long (> 255 bytes) key is
//!   a 400 `invalid_idempotency_key`: silently treating it as "no key" would hide a
//!   client bug.
//! - Every POST, whatever its outcome (200, replay, 422, 503), is appended to the
//!   `/…/requests` log.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use idemwatch_engine::idempotency_key::{IdempotencyKey, InvalidKey, REPLAYED_HEADER};

/// One SMS the sandbox actually "sent": the thing a customer would have received.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentSms {
    /// Provider id (`sms-N`), also in the 200 response body.
    pub id: String,
    pub to: String,
    pub text: String,
    /// The key it was sent under, to match a send to the event that caused it.
    pub idempotency_key: Option<String>,
    /// Wall-clock send time: the sandbox plays an external system, not the simulator.
    pub at: DateTime<Utc>,
}

/// One POST /sms as received, whatever its outcome: lets a drill see that a
/// redelivery *did* reach the provider and was answered by a replay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SmsRequest {
    /// The key as received (also when the request was rejected).
    pub idempotency_key: Option<String>,
    /// Answered with the stored first response, nothing sent.
    pub replayed: bool,
    /// HTTP status answered: 200, 422 or an injected 503.
    pub status: u16,
    /// `None` when the body had no string `to` (a rejected request).
    pub to: Option<String>,
    /// `None` when the body had no string `text` (a rejected request).
    pub text: Option<String>,
}

/// One ERP webhook delivery the sink accepted: the thing the customer's ERP booked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SentErp {
    /// Sink id (`erp-N`), also in the 200 response body.
    pub id: String,
    /// The JSON object delivered.
    pub body: Value,
    /// The key it was accepted under.
    pub idempotency_key: Option<String>,
    /// Wall-clock acceptance time.
    pub at: DateTime<Utc>,
}

/// One POST /erp as received, whatever its outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErpRequest {
    /// The key as received (also when the request was rejected).
    pub idempotency_key: Option<String>,
    /// Answered with the stored first response, nothing delivered.
    pub replayed: bool,
    /// HTTP status answered: 200, 422 or an injected 503.
    pub status: u16,
    /// The parsed body, or `null` when it was not JSON.
    pub body: Value,
}

/// Why a POST was not sent. The `code` is the machine-readable `error` field.
#[derive(Debug, Clone, thiserror::Error)]
enum ApiError {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("{0}")]
    InvalidKey(InvalidKey),
    #[error("Idempotency-Key {0:?} was already used with a different request body")]
    KeyReused(String),
    #[error("injected fault: the provider is temporarily unavailable, retry later")]
    Unavailable,
    #[error("injected fault: too many requests, retry after {0} s")]
    Throttled(u64),
    #[error("injected fault: the recipient is refused for good")]
    Refused,
}

impl ApiError {
    fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest(_) => "invalid_request",
            ApiError::InvalidKey(_) => "invalid_idempotency_key",
            ApiError::KeyReused(_) => "idempotency_key_reused",
            ApiError::Unavailable => "unavailable",
            ApiError::Throttled(_) => "rate_limited",
            ApiError::Refused => "recipient_refused",
        }
    }

    fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest(_) | ApiError::KeyReused(_) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            ApiError::InvalidKey(_) => StatusCode::BAD_REQUEST,
            ApiError::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Throttled(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Refused => StatusCode::BAD_REQUEST,
        }
    }

    fn reply(&self) -> Reply {
        let body = json!({ "error": self.code(), "detail": self.to_string() });
        Reply {
            status: self.status(),
            body: body.to_string().into_bytes(),
            replayed: false,
            retry_after: match self {
                ApiError::Throttled(secs) => Some(*secs),
                _ => None,
            },
        }
    }
}

/// What the server answers; also what is stored under a key for replays.
#[derive(Debug, Clone)]
struct Reply {
    status: StatusCode,
    body: Vec<u8>,
    replayed: bool,
    /// `Retry-After`, in seconds (a throttling answer).
    retry_after: Option<u64>,
}

impl IntoResponse for Reply {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
            self.body,
        )
            .into_response();
        if self.replayed {
            response
                .headers_mut()
                .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
        }
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// The first response given for a key, with the request it answered.
#[derive(Debug)]
struct Stored {
    request: Value,
    reply: Reply,
}

/// Per-route bookkeeping: keys are per route, so SMS and ERP keys never collide.
#[derive(Debug)]
struct Ledger<S, R> {
    issued: u64,
    by_key: HashMap<String, Stored>,
    sent: Vec<S>,
    requests: Vec<R>,
}

impl<S, R> Default for Ledger<S, R> {
    fn default() -> Self {
        Ledger {
            issued: 0,
            by_key: HashMap::new(),
            sent: Vec::new(),
            requests: Vec::new(),
        }
    }
}

/// Outcome of the idempotency decision for a valid request.
enum Decision {
    /// Send now, under this id.
    Send(String),
    /// Already answered: return this.
    Replay(Reply),
}

impl<S, R> Ledger<S, R> {
    /// The idempotency decision, made under the state lock so concurrent requests
    /// with one key cannot both send.
    fn decide(
        &mut self,
        key: Option<&str>,
        request: &Value,
        id_prefix: &str,
    ) -> Result<Decision, ApiError> {
        if let Some(key) = key {
            if let Some(stored) = self.by_key.get(key) {
                if stored.request != *request {
                    return Err(ApiError::KeyReused(key.to_owned()));
                }
                let mut reply = stored.reply.clone();
                reply.replayed = true;
                return Ok(Decision::Replay(reply));
            }
        }
        self.issued += 1;
        Ok(Decision::Send(format!("{id_prefix}-{}", self.issued)))
    }

    /// Remember the first response for `key` so later requests get the same bytes.
    fn store(&mut self, key: Option<&str>, request: Value, reply: &Reply) {
        if let Some(key) = key {
            self.by_key.insert(
                key.to_owned(),
                Stored {
                    request,
                    reply: reply.clone(),
                },
            );
        }
    }
}

/// A fault armed for the next requests: which, and how many are left.
#[derive(Debug, Clone, Copy, Default)]
struct Armed {
    fault: Fault,
    left: usize,
}

#[derive(Debug, Clone, Copy, Default)]
enum Fault {
    /// 503.
    #[default]
    Unavailable,
    /// 429 with `Retry-After: N` seconds.
    Throttled(u64),
    /// 400: a final refusal.
    Refused,
}

#[derive(Debug, Default)]
struct Inner {
    armed: Armed,
    sms: Ledger<SentSms, SmsRequest>,
    erp: Ledger<SentErp, ErpRequest>,
}

/// Shared, cloneable state of one sandbox. Kept outside the server so the embedded
/// demo and tests can inject faults and read what was sent without HTTP.
#[derive(Debug, Clone, Default)]
pub struct SandboxState {
    inner: Arc<Mutex<Inner>>,
    /// How long every POST takes to answer (see [`SandboxState::set_latency`]).
    latency: Arc<Mutex<Duration>>,
    /// How long every POST's answer is held after it was acted on (see
    /// [`SandboxState::set_answer_delay`]).
    answer_delay: Arc<Mutex<Duration>>,
    /// POSTs being answered now, and the most there ever were at once.
    in_flight: Arc<(AtomicUsize, AtomicUsize)>,
}

/// One POST being answered: counted in [`SandboxState::peak_in_flight`] while alive.
struct InFlight(Arc<(AtomicUsize, AtomicUsize)>);

impl InFlight {
    fn enter(counts: &Arc<(AtomicUsize, AtomicUsize)>) -> Self {
        let now = counts.0.fetch_add(1, Ordering::SeqCst) + 1;
        counts.1.fetch_max(now, Ordering::SeqCst);
        InFlight(counts.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl SandboxState {
    /// An empty sandbox: nothing sent, no keys seen, no faults armed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Make the next `n` POSTs (SMS or ERP) answer 503 without sending, to test a
    /// caller's retry path. Replaces any count still pending. Requests rejected as
    /// invalid (422) are answered before the fault and do not consume it.
    pub fn fail_next(&self, n: usize) {
        self.arm(Fault::Unavailable, n);
    }

    /// Make the next `n` POSTs answer 429 with `Retry-After: {retry_after}` (whole
    /// seconds) without sending: a provider's rate limit. Like [`Self::fail_next`].
    pub fn throttle_next(&self, n: usize, retry_after: Duration) {
        self.arm(Fault::Throttled(retry_after.as_secs()), n);
    }

    /// Make the next `n` POSTs answer 400 without sending: a refusal that no retry
    /// changes (a bad recipient). The key stays free, as with any fault, so the
    /// request can go through once fixed. Like [`Self::fail_next`].
    pub fn reject_next(&self, n: usize) {
        self.arm(Fault::Refused, n);
    }

    fn arm(&self, fault: Fault, left: usize) {
        self.lock().armed = Armed { fault, left };
    }

    /// Answer every POST after `latency`, give or take a quarter of it (uniformly):
    /// a real SMS API takes tens of milliseconds per call, and a caller that sends
    /// one at a time is only found out against one that does. Zero (the default):
    /// answer at once.
    pub fn set_latency(&self, latency: Duration) {
        *self
            .latency
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = latency;
    }

    /// Act on every POST at once (send, store the answer under its key) but answer
    /// only after `delay`: a provider that is slow to *answer*, not to act. A caller
    /// whose deadline is shorter gives up on a call that did go out — the send is in
    /// doubt — and its retry under the same key is answered by a replay. Zero (the
    /// default): answer as soon as acted on.
    pub fn set_answer_delay(&self, delay: Duration) {
        *self
            .answer_delay
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = delay;
    }

    fn answer_delay(&self) -> Duration {
        *self
            .answer_delay
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The most POSTs (SMS and ERP together) ever answered at once: how many calls
    /// a client keeps in flight.
    pub fn peak_in_flight(&self) -> usize {
        self.in_flight.1.load(Ordering::SeqCst)
    }

    /// This request's latency: the set one with its jitter.
    fn delay(&self) -> Duration {
        let base = *self
            .latency
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if base.is_zero() {
            return base;
        }
        base.mul_f64(rand::random_range(0.75..=1.25))
    }

    /// SMS actually sent, in order: the customer's view of the world.
    pub fn sent_sms(&self) -> Vec<SentSms> {
        self.lock().sms.sent.clone()
    }

    /// Every POST /sms received, in order, including replays and rejections.
    pub fn sms_requests(&self) -> Vec<SmsRequest> {
        self.lock().sms.requests.clone()
    }

    /// ERP deliveries actually accepted, in order.
    pub fn sent_erp(&self) -> Vec<SentErp> {
        self.lock().erp.sent.clone()
    }

    /// Every POST /erp received, in order, including replays and rejections.
    pub fn erp_requests(&self) -> Vec<ErpRequest> {
        self.lock().erp.requests.clone()
    }

    /// The lock is never held across an await and no code panics while holding it,
    /// so a poisoned mutex still holds consistent data: recover it instead of failing.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Consume one armed fault, if any.
    fn take_fault(inner: &mut Inner) -> Option<ApiError> {
        if inner.armed.left == 0 {
            return None;
        }
        inner.armed.left -= 1;
        Some(match inner.armed.fault {
            Fault::Unavailable => ApiError::Unavailable,
            Fault::Throttled(secs) => ApiError::Throttled(secs),
            Fault::Refused => ApiError::Refused,
        })
    }

    fn post_sms(&self, key: Result<Option<String>, ApiError>, body: &[u8]) -> Reply {
        let parsed: Option<Value> = serde_json::from_slice(body).ok();
        let field = |name: &str| {
            parsed
                .as_ref()
                .and_then(|v| v.get(name))
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        let (to, text) = (field("to"), field("text"));
        let logged_key = key.as_ref().ok().cloned().flatten();
        let checked = key.and_then(|key| validate_sms(parsed.as_ref()).map(|()| key));

        let mut inner = self.lock();
        let (reply, key) = match checked {
            Err(err) => (err.reply(), logged_key),
            Ok(key) => match Self::take_fault(&mut inner) {
                Some(err) => (err.reply(), key),
                None => {
                    let request = parsed.unwrap_or(Value::Null);
                    let reply = match inner.sms.decide(key.as_deref(), &request, "sms") {
                        Err(err) => err.reply(),
                        Ok(Decision::Replay(reply)) => reply,
                        Ok(Decision::Send(id)) => {
                            let reply = accepted(&id, "queued");
                            inner.sms.sent.push(SentSms {
                                id,
                                to: to.clone().unwrap_or_default(),
                                text: text.clone().unwrap_or_default(),
                                idempotency_key: key.clone(),
                                at: Utc::now(),
                            });
                            inner.sms.store(key.as_deref(), request, &reply);
                            reply
                        }
                    };
                    (reply, key)
                }
            },
        };
        inner.sms.requests.push(SmsRequest {
            idempotency_key: key,
            replayed: reply.replayed,
            status: reply.status.as_u16(),
            to,
            text,
        });
        reply
    }

    fn post_erp(&self, key: Result<Option<String>, ApiError>, body: &[u8]) -> Reply {
        let parsed: Option<Value> = serde_json::from_slice(body).ok();
        let logged_key = key.as_ref().ok().cloned().flatten();
        let checked = key.and_then(|key| match &parsed {
            Some(Value::Object(_)) => Ok(key),
            Some(_) => Err(ApiError::InvalidRequest(
                "body must be a JSON object".into(),
            )),
            None => Err(ApiError::InvalidRequest("body is not valid JSON".into())),
        });
        let request = parsed.unwrap_or(Value::Null);

        let mut inner = self.lock();
        let (reply, key) = match checked {
            Err(err) => (err.reply(), logged_key),
            Ok(key) => match Self::take_fault(&mut inner) {
                Some(err) => (err.reply(), key),
                None => {
                    let reply = match inner.erp.decide(key.as_deref(), &request, "erp") {
                        Err(err) => err.reply(),
                        Ok(Decision::Replay(reply)) => reply,
                        Ok(Decision::Send(id)) => {
                            let reply = accepted(&id, "accepted");
                            inner.erp.sent.push(SentErp {
                                id,
                                body: request.clone(),
                                idempotency_key: key.clone(),
                                at: Utc::now(),
                            });
                            inner.erp.store(key.as_deref(), request.clone(), &reply);
                            reply
                        }
                    };
                    (reply, key)
                }
            },
        };
        inner.erp.requests.push(ErpRequest {
            idempotency_key: key,
            replayed: reply.replayed,
            status: reply.status.as_u16(),
            body: request,
        });
        reply
    }
}

/// The 200 body for a request that was sent now.
fn accepted(id: &str, status: &str) -> Reply {
    Reply {
        status: StatusCode::OK,
        body: json!({ "id": id, "status": status })
            .to_string()
            .into_bytes(),
        replayed: false,
        retry_after: None,
    }
}

/// An SMS needs a non-empty `to` and a string `text`; anything else is the caller's bug.
fn validate_sms(parsed: Option<&Value>) -> Result<(), ApiError> {
    let invalid = |detail: &str| Err(ApiError::InvalidRequest(detail.to_owned()));
    let Some(Value::Object(obj)) = parsed else {
        return invalid("body must be a JSON object {\"to\": string, \"text\": string}");
    };
    match obj.get("to") {
        Some(Value::String(to)) if to.trim().is_empty() => invalid("to must not be empty"),
        Some(Value::String(_)) => match obj.get("text") {
            Some(Value::String(_)) => Ok(()),
            Some(_) => invalid("text must be a string"),
            None => invalid("required field text is missing"),
        },
        Some(_) => invalid("to must be a string"),
        None => invalid("required field to is missing"),
    }
}

/// Read the optional `Idempotency-Key` by the one rule (`engine::idempotency_key`);
/// a present but unusable key is rejected.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    IdempotencyKey::from_headers(headers)
        .map(|key| key.map(|k| k.as_str().to_owned()))
        .map_err(ApiError::InvalidKey)
}

async fn post_sms(State(state): State<SandboxState>, headers: HeaderMap, body: Bytes) -> Reply {
    let _in_flight = InFlight::enter(&state.in_flight);
    tokio::time::sleep(state.delay()).await;
    let reply = state.post_sms(idempotency_key(&headers), &body);
    tokio::time::sleep(state.answer_delay()).await;
    reply
}

async fn post_erp(State(state): State<SandboxState>, headers: HeaderMap, body: Bytes) -> Reply {
    let _in_flight = InFlight::enter(&state.in_flight);
    tokio::time::sleep(state.delay()).await;
    let reply = state.post_erp(idempotency_key(&headers), &body);
    tokio::time::sleep(state.answer_delay()).await;
    reply
}

async fn sent_sms(State(state): State<SandboxState>) -> Json<Vec<SentSms>> {
    Json(state.sent_sms())
}

async fn sms_requests(State(state): State<SandboxState>) -> Json<Vec<SmsRequest>> {
    Json(state.sms_requests())
}

async fn sent_erp(State(state): State<SandboxState>) -> Json<Vec<SentErp>> {
    Json(state.sent_erp())
}

async fn erp_requests(State(state): State<SandboxState>) -> Json<Vec<ErpRequest>> {
    Json(state.erp_requests())
}

async fn healthz() -> &'static str {
    "ok"
}

/// All sandbox routes over `state`, so callers can mount or serve it as they like.
pub fn router(state: SandboxState) -> Router {
    Router::new()
        .route("/sms", post(post_sms))
        .route("/sms/sent", get(sent_sms))
        .route("/sms/requests", get(sms_requests))
        .route("/erp", post(post_erp))
        .route("/erp/sent", get(sent_erp))
        .route("/erp/requests", get(erp_requests))
        .route("/healthz", get(healthz))
        .with_state(state)
}

/// Serve a fresh sandbox on `listener` until `shutdown` resolves: the body of
/// `idemwatch sms-sandbox --listen ADDR`.
pub async fn serve(
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with_state(listener, SandboxState::new(), shutdown).await
}

/// Like [`serve`], over a state the caller keeps (to inject faults or read it directly).
pub async fn serve_with_state(
    listener: TcpListener,
    state: SandboxState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

/// A sandbox running in a background task. Dropping it stops the server, so a test
/// or demo can never leak a listener.
#[derive(Debug)]
pub struct SandboxHandle {
    addr: SocketAddr,
    state: SandboxState,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl SandboxHandle {
    /// Base URL for clients, e.g. `http://127.0.0.1:40123` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The address actually bound (resolves port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The live state, to inject faults or read what was sent without HTTP.
    pub fn state(&self) -> &SandboxState {
        &self.state
    }

    /// Stop gracefully and wait until the server task has ended, reporting its error.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task.await.map_err(std::io::Error::other)?,
            None => Ok(()),
        }
    }
}

impl Drop for SandboxHandle {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            // The receiver is gone only if the server already ended: nothing to stop.
            let _ = stop.send(());
        }
    }
}

/// Bind `addr` and serve a fresh sandbox in a tokio task (embedded demo mode, tests).
pub async fn spawn(addr: SocketAddr) -> std::io::Result<SandboxHandle> {
    spawn_with_state(addr, SandboxState::new()).await
}

/// Like [`spawn`], over a state the caller already holds.
pub async fn spawn_with_state(
    addr: SocketAddr,
    state: SandboxState,
) -> std::io::Result<SandboxHandle> {
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown = async move {
        // A dropped sender also means "stop".
        let _ = stopped.await;
    };
    let task = tokio::spawn(serve_with_state(listener, state.clone(), shutdown));
    Ok(SandboxHandle {
        addr,
        state,
        stop: Some(stop),
        task: Some(task),
    })
}

/// Reads a sandbox's logs over HTTP: what drills and tests use to count what a
/// provider really sent, exactly as an operator would check a real one.
#[derive(Debug, Clone)]
pub struct SandboxClient {
    base: String,
    http: reqwest::Client,
}

impl SandboxClient {
    /// A client for the sandbox at `base` (e.g. [`SandboxHandle::url`]), with a
    /// timeout so a hung provider cannot hang a drill.
    pub fn new(base: impl Into<String>) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?;
        Ok(Self::with_http(base, http))
    }

    /// A client reusing an existing reqwest client (its pool and settings).
    pub fn with_http(base: impl Into<String>, http: reqwest::Client) -> Self {
        let base = base.into().trim_end_matches('/').to_owned();
        SandboxClient { base, http }
    }

    /// `GET /sms/sent`.
    pub async fn sent_sms(&self) -> Result<Vec<SentSms>, reqwest::Error> {
        self.get("/sms/sent").await
    }

    /// `GET /sms/requests`.
    pub async fn sms_requests(&self) -> Result<Vec<SmsRequest>, reqwest::Error> {
        self.get("/sms/requests").await
    }

    /// `GET /erp/sent`.
    pub async fn sent_erp(&self) -> Result<Vec<SentErp>, reqwest::Error> {
        self.get("/erp/sent").await
    }

    /// `GET /erp/requests`.
    pub async fn erp_requests(&self) -> Result<Vec<ErpRequest>, reqwest::Error> {
        self.get("/erp/requests").await
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, reqwest::Error> {
        self.http
            .get(format!("{}{path}", self.base))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn start() -> (SandboxHandle, SandboxClient, reqwest::Client) {
        let handle = spawn(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind loopback");
        let client = SandboxClient::new(handle.url()).expect("client");
        (handle, client, reqwest::Client::new())
    }

    async fn post(
        http: &reqwest::Client,
        url: &str,
        key: Option<&str>,
        body: &str,
    ) -> (u16, Option<String>, Vec<u8>) {
        let mut req = http
            .post(url)
            .header(CONTENT_TYPE, "application/json")
            .body(body.to_owned());
        if let Some(key) = key {
            req = req.header(idemwatch_engine::idempotency_key::HEADER, key);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status().as_u16();
        let replayed = resp
            .headers()
            .get(REPLAYED_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let bytes = resp.bytes().await.expect("body").to_vec();
        (status, replayed, bytes)
    }

    const SMS: &str = r#"{"to":"+905551112233","text":"Vehicle 34-ABC-123 left zone X"}"#;

    #[tokio::test]
    async fn keyed_request_twice_sends_once_and_replays_identical_bytes() {
        let (handle, client, http) = start().await;
        let url = format!("{}/sms", handle.url());
        let first = post(&http, &url, Some("34-ABC-123:48211:zone_exit"), SMS).await;
        let second = post(&http, &url, Some("34-ABC-123:48211:zone_exit"), SMS).await;
        assert_eq!(first.0, 200);
        assert_eq!(first.1, None);
        assert_eq!(first.2, br#"{"id":"sms-1","status":"queued"}"#);
        assert_eq!(second.0, first.0);
        assert_eq!(second.2, first.2, "replay must be byte-identical");
        assert_eq!(second.1.as_deref(), Some("true"));

        let sent = client.sent_sms().await.expect("sent");
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].id, "sms-1");
        assert_eq!(sent[0].to, "+905551112233");
        assert_eq!(
            sent[0].idempotency_key.as_deref(),
            Some("34-ABC-123:48211:zone_exit")
        );
        let requests = client.sms_requests().await.expect("requests");
        assert_eq!(requests.len(), 2);
        assert!(!requests[0].replayed && requests[1].replayed);
        assert!(requests.iter().all(|r| r.status == 200));
        handle.shutdown().await.expect("clean shutdown");
    }

    #[tokio::test]
    async fn same_body_with_reordered_keys_is_a_replay() {
        let (handle, _client, http) = start().await;
        let url = format!("{}/sms", handle.url());
        post(&http, &url, Some("k"), SMS).await;
        let reordered = r#"{ "text":"Vehicle 34-ABC-123 left zone X", "to":"+905551112233" }"#;
        let again = post(&http, &url, Some("k"), reordered).await;
        assert_eq!(again.0, 200);
        assert_eq!(again.1.as_deref(), Some("true"));
        assert_eq!(handle.state().sent_sms().len(), 1);
    }

    #[tokio::test]
    async fn quoted_and_bare_key_are_one_key() {
        let (handle, _client, http) = start().await;
        let url = format!("{}/sms", handle.url());
        assert_eq!(post(&http, &url, Some("\"k-7\""), SMS).await.1, None);
        assert_eq!(
            post(&http, &url, Some("k-7"), SMS).await.1.as_deref(),
            Some("true")
        );
        assert_eq!(handle.state().sent_sms().len(), 1);
        assert_eq!(
            handle.state().sent_sms()[0].idempotency_key.as_deref(),
            Some("k-7")
        );
    }

    #[tokio::test]
    async fn without_key_every_request_sends() {
        let (handle, client, http) = start().await;
        let url = format!("{}/sms", handle.url());
        let a = post(&http, &url, None, SMS).await;
        let b = post(&http, &url, None, SMS).await;
        assert_eq!((a.0, b.0), (200, 200));
        assert_eq!(b.1, None);
        assert_eq!(b.2, br#"{"id":"sms-2","status":"queued"}"#);
        assert_eq!(client.sent_sms().await.expect("sent").len(), 2);
    }

    #[tokio::test]
    async fn same_key_different_body_is_422_and_not_sent() {
        let (handle, client, http) = start().await;
        let url = format!("{}/sms", handle.url());
        post(&http, &url, Some("k1"), SMS).await;
        let other = r#"{"to":"+905551112233","text":"something else"}"#;
        let (status, replayed, body) = post(&http, &url, Some("k1"), other).await;
        assert_eq!(status, 422);
        assert_eq!(replayed, None);
        let err: Value = serde_json::from_slice(&body).expect("json error");
        assert_eq!(err["error"], "idempotency_key_reused");
        assert!(err["detail"].as_str().is_some_and(|d| d.contains("k1")));
        assert_eq!(client.sent_sms().await.expect("sent").len(), 1);
        let requests = client.sms_requests().await.expect("requests");
        assert_eq!(requests.last().map(|r| r.status), Some(422));
    }

    #[tokio::test]
    async fn invalid_bodies_are_422_invalid_request() {
        let (handle, client, http) = start().await;
        let url = format!("{}/sms", handle.url());
        for body in [
            "not json",
            "[1]",
            r#"{"text":"hi"}"#,
            r#"{"to":"","text":"hi"}"#,
            r#"{"to":"+90555","text":7}"#,
        ] {
            let (status, _, bytes) = post(&http, &url, Some("bad"), body).await;
            assert_eq!(status, 422, "{body}");
            let err: Value = serde_json::from_slice(&bytes).expect("json error");
            assert_eq!(err["error"], "invalid_request", "{body}");
        }
        let (status, _, bytes) = post(&http, &url, Some(""), SMS).await;
        assert_eq!(status, 400, "empty key");
        let err: Value = serde_json::from_slice(&bytes).expect("json error");
        assert_eq!(err["error"], "invalid_idempotency_key");
        assert!(client.sent_sms().await.expect("sent").is_empty());
        assert_eq!(client.sms_requests().await.expect("requests").len(), 6);
        // A rejected request did not burn its key: the corrected one goes through.
        assert_eq!(post(&http, &url, Some("bad"), SMS).await.0, 200);
    }

    #[tokio::test]
    async fn fail_next_answers_503_then_succeeds_with_same_key() {
        let (handle, client, http) = start().await;
        let url = format!("{}/sms", handle.url());
        handle.state().fail_next(1);
        let (status, _, bytes) = post(&http, &url, Some("retry-me"), SMS).await;
        assert_eq!(status, 503);
        let err: Value = serde_json::from_slice(&bytes).expect("json error");
        assert_eq!(err["error"], "unavailable");
        assert!(client.sent_sms().await.expect("sent").is_empty());
        let (status, replayed, _) = post(&http, &url, Some("retry-me"), SMS).await;
        assert_eq!((status, replayed), (200, None));
        assert_eq!(client.sent_sms().await.expect("sent").len(), 1);
    }

    #[tokio::test]
    async fn concurrent_requests_with_one_key_send_exactly_once() {
        let (handle, client, http) = start().await;
        let url = format!("{}/sms", handle.url());
        let calls = (0..50).map(|_| post(&http, &url, Some("race"), SMS));
        let results = futures::future::join_all(calls).await;
        assert!(results.iter().all(|r| r.0 == 200));
        assert!(results.iter().all(|r| r.2 == results[0].2));
        let replays = results.iter().filter(|r| r.1.is_some()).count();
        assert_eq!(replays, 49);
        assert_eq!(client.sent_sms().await.expect("sent").len(), 1);
        assert_eq!(client.sms_requests().await.expect("requests").len(), 50);
    }

    #[tokio::test]
    async fn erp_sink_has_its_own_key_namespace() {
        let (handle, client, http) = start().await;
        let sms_url = format!("{}/sms", handle.url());
        let erp_url = format!("{}/erp", handle.url());
        let order = r#"{"order":"A-17","amount":"129.90"}"#;
        post(&http, &sms_url, Some("shared"), SMS).await;
        let first = post(&http, &erp_url, Some("shared"), order).await;
        let second = post(&http, &erp_url, Some("shared"), order).await;
        assert_eq!(first.0, 200);
        assert_eq!(first.2, br#"{"id":"erp-1","status":"accepted"}"#);
        assert_eq!((second.1.as_deref(), &second.2), (Some("true"), &first.2));
        assert_eq!(post(&http, &erp_url, None, "[1,2]").await.0, 422);

        let sent = client.sent_erp().await.expect("sent");
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].body["order"], "A-17");
        let requests = client.erp_requests().await.expect("requests");
        assert_eq!(requests.len(), 3);
        assert!(requests[1].replayed);
        assert_eq!(client.sent_sms().await.expect("sent").len(), 1);
    }

    /// A slow answer: the SMS is sent before the answer comes, a caller that gives
    /// up first does not know it, and its retry under the same key is a replay.
    #[tokio::test]
    async fn a_slow_answer_sends_first_and_a_retry_with_the_key_is_a_replay() {
        let (handle, client, _) = start().await;
        handle.state().set_answer_delay(Duration::from_millis(1500));
        let impatient = reqwest::Client::builder()
            .timeout(Duration::from_millis(300))
            .build()
            .expect("client");
        let url = format!("{}/sms", handle.url());
        let timed_out = impatient
            .post(&url)
            .header(CONTENT_TYPE, "application/json")
            .header(idemwatch_engine::idempotency_key::HEADER, "k-slow")
            .body(SMS)
            .send()
            .await
            .expect_err("the answer comes after the caller's deadline");
        assert!(timed_out.is_timeout(), "{timed_out}");
        // Sent nonetheless, before any answer.
        let sent = handle.state().sent_sms();
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].idempotency_key.as_deref(), Some("k-slow"));

        handle.state().set_answer_delay(Duration::ZERO);
        let http = reqwest::Client::new();
        let retry = post(&http, &url, Some("k-slow"), SMS).await;
        assert_eq!(retry.0, 200);
        assert_eq!(retry.1.as_deref(), Some("true"), "the retry is a replay");
        assert_eq!(client.sent_sms().await.expect("sent").len(), 1, "sent once");
    }

    #[test]
    fn latency_is_the_set_one_give_or_take_a_quarter() {
        let state = SandboxState::new();
        assert_eq!(state.delay(), Duration::ZERO);
        state.set_latency(Duration::from_millis(80));
        let delays: Vec<Duration> = (0..200).map(|_| state.delay()).collect();
        assert!(delays
            .iter()
            .all(|d| (Duration::from_millis(60)..=Duration::from_millis(100)).contains(d)));
        assert!(delays.iter().any(|d| *d != delays[0]), "no jitter");
    }

    #[tokio::test]
    async fn healthz_and_drop_stop_the_server() {
        let (handle, _client, http) = start().await;
        let url = format!("{}/healthz", handle.url());
        let resp = http.get(&url).send().await.expect("healthz");
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.text().await.expect("body"), "ok");
        let addr = handle.addr();
        drop(handle);
        // After drop the listener goes away: a fresh connection is refused soon.
        let mut refused = false;
        for _ in 0..50 {
            if tokio::net::TcpStream::connect(addr).await.is_err() {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(refused, "server still accepting after drop");
    }
}
