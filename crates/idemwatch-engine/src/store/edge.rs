//! Storage for the HTTP edge (`Idempotency-Key` on write endpoints): the same
//! pattern as the consumers' dedup table — a key, a unique index, a stored result.
//!
//! Invariants, kept by every backend:
//! - one business effect per (caller scope, key): the business row and the stored
//!   response commit in ONE transaction, guarded by the lease token taken in
//!   [`EdgeStore::idem_begin`] (a request whose lease was taken over cannot complete);
//! - a retry with the same key and fingerprint replays the stored response byte for
//!   byte; a different fingerprint is refused, never replayed;
//! - an in-flight request holds a lease; when its process dies the lease expires and
//!   the next retry takes over (compare-and-set on `locked_until`).

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, SubsecRound, Utc};
use serde::Serialize;

use super::StoreResult;

/// One idempotent request, as the store sees it.
#[derive(Debug, Clone)]
pub struct IdemRequest<'a> {
    /// The caller's scope (a principal): keys never cross it.
    pub scope: &'a str,
    pub key: &'a str,
    pub route: &'a str,
    /// Hash of method, path and canonical body.
    pub fingerprint: &'a str,
    /// How long an in-flight request holds the key.
    pub lease: Duration,
    /// How long a completed key is remembered (24 h by default).
    pub ttl: Duration,
}

/// A response as stored and replayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StoredResponse {
    pub status: u16,
    /// The headers that matter (content type, location); replayed as they were.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// The lease this request holds on its key; completing requires it unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseToken(pub DateTime<Utc>);

/// What the first phase decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdemBegin {
    /// This request owns the key (new, expired, or taken over from a dead request).
    Execute(LeaseToken),
    /// Completed before: replay this.
    Replay(StoredResponse),
    /// Another request with this key is still in flight.
    InProgress { retry_after: Duration },
    /// Same key, different request.
    Mismatch,
}

/// The business writes of the edge endpoints: each call appends a row, so without
/// the key a retry is a second note or a second command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EdgeWrite {
    TripNote {
        device_id: String,
        text: String,
        principal: String,
    },
    VehicleCommand {
        device_id: String,
        command: String,
        principal: String,
    },
}

/// Builds the response from the id of the row the write created.
pub type RespondFn = dyn Fn(i64) -> StoredResponse + Send + Sync;

/// What completing a request came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    Done(StoredResponse),
    /// Our lease expired and another request took the key: nothing was written.
    LeaseLost,
}

#[async_trait]
pub trait EdgeStore: Send + Sync + 'static {
    /// Phase 1, its own short transaction: claim the key or find what it holds.
    async fn idem_begin(&self, req: &IdemRequest<'_>) -> StoreResult<IdemBegin>;

    /// Phase 2, one transaction: the business row, then the response stored on the
    /// key — only if this request still holds `lease`.
    async fn idem_execute(
        &self,
        req: &IdemRequest<'_>,
        lease: LeaseToken,
        write: &EdgeWrite,
        respond: &RespondFn,
    ) -> StoreResult<Completion>;

    /// Store a result reached without a business write (a 4xx validation answer):
    /// retries get the same answer.
    async fn idem_store(
        &self,
        req: &IdemRequest<'_>,
        lease: LeaseToken,
        response: &StoredResponse,
    ) -> StoreResult<Completion>;

    /// Our own failure (5xx): release the key so the retry re-executes.
    async fn idem_release(&self, req: &IdemRequest<'_>, lease: LeaseToken) -> StoreResult<()>;

    /// Naive: the business write with no key at all.
    async fn edge_write(
        &self,
        write: &EdgeWrite,
        respond: &RespondFn,
    ) -> StoreResult<StoredResponse>;

    /// Delete at most `batch` keys that expired before `now`; 0 means done.
    async fn purge_idempotency_batch(&self, now: DateTime<Utc>, batch: i64) -> StoreResult<u64>;

    /// Notes of one device (id, text), oldest first.
    async fn trip_notes(&self, device_id: &str) -> StoreResult<Vec<(i64, String)>>;

    /// Commands of one device (id, command), oldest first.
    async fn vehicle_commands(&self, device_id: &str) -> StoreResult<Vec<(i64, String)>>;
}

/// Microsecond precision, the finest every backend stores: a lease token read back
/// compares equal to the one written.
pub(crate) fn now_micros() -> DateTime<Utc> {
    Utc::now().trunc_subsecs(6)
}

pub(crate) fn after(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    t + chrono::Duration::from_std(d).unwrap_or(chrono::Duration::days(365))
}

/// How long until an in-flight lease ends (at least one second, for Retry-After).
pub(crate) fn retry_after(locked_until: Option<DateTime<Utc>>, now: DateTime<Utc>) -> Duration {
    locked_until
        .and_then(|t| (t - now).to_std().ok())
        .unwrap_or(Duration::ZERO)
        .max(Duration::from_secs(1))
}

/// What an existing key row means for a new request, decided the same way on every
/// backend (the takeover itself is a compare-and-set on `locked_until`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyStep {
    /// The row expired: replace it as if new.
    Expired,
    Mismatch,
    Replay,
    InProgress(Duration),
    TakeOver,
}

pub(crate) struct KeyRow {
    pub fingerprint: String,
    pub state: String,
    pub locked_until: Option<DateTime<Utc>>,
    pub expires_at: DateTime<Utc>,
}

pub(crate) fn key_step(row: &KeyRow, req: &IdemRequest<'_>, now: DateTime<Utc>) -> KeyStep {
    if row.expires_at <= now {
        KeyStep::Expired
    } else if row.fingerprint != req.fingerprint {
        KeyStep::Mismatch
    } else if row.state == "completed" {
        KeyStep::Replay
    } else if row.locked_until.is_some_and(|t| t > now) {
        KeyStep::InProgress(retry_after(row.locked_until, now))
    } else {
        KeyStep::TakeOver
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(fingerprint: &str) -> IdemRequest<'_> {
        IdemRequest {
            scope: "alice",
            key: "k-1",
            route: "POST /v1/trip-notes",
            fingerprint,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(24 * 3600),
        }
    }

    fn row(
        fingerprint: &str,
        state: &str,
        locked_until: Option<DateTime<Utc>>,
        expires_at: DateTime<Utc>,
    ) -> KeyRow {
        KeyRow {
            fingerprint: fingerprint.into(),
            state: state.into(),
            locked_until,
            expires_at,
        }
    }

    /// What a stored key means for a new request, in the order the checks go: an
    /// expired key is new whatever it held, then a different request is refused (even
    /// while the first one is in flight), a completed key replays, a live lease is in
    /// progress for what it has left, and a lapsed or missing lease is taken over. A
    /// lease and a key end at their instant, on both sides the same way.
    #[test]
    fn a_stored_key_is_expired_mismatched_replayed_in_progress_or_taken_over() {
        let now = now_micros();
        let lease = Duration::from_secs(30);
        let (live, remembered) = (after(now, lease), after(now, Duration::from_secs(3600)));
        let lapsed = now - chrono::Duration::seconds(1);
        let cases = [
            (row("fp", "completed", None, lapsed), KeyStep::Expired),
            (
                row("other", "in_progress", Some(live), now),
                KeyStep::Expired,
            ),
            (
                row("other", "completed", None, remembered),
                KeyStep::Mismatch,
            ),
            (
                row("other", "in_progress", Some(live), remembered),
                KeyStep::Mismatch,
            ),
            (row("fp", "completed", None, remembered), KeyStep::Replay),
            (
                row("fp", "in_progress", Some(live), remembered),
                KeyStep::InProgress(lease),
            ),
            (
                row("fp", "in_progress", Some(now), remembered),
                KeyStep::TakeOver,
            ),
            (
                row("fp", "in_progress", Some(lapsed), remembered),
                KeyStep::TakeOver,
            ),
            (
                row("fp", "in_progress", None, remembered),
                KeyStep::TakeOver,
            ),
        ];
        for (i, (stored, step)) in cases.iter().enumerate() {
            assert_eq!(&key_step(stored, &request("fp"), now), step, "case {i}");
        }
    }

    /// The `Retry-After` of a 409: what the lease has left, and never less than a
    /// second (the header counts whole seconds; 0 would invite a busy loop).
    #[test]
    fn retry_after_is_what_the_lease_has_left_and_at_least_a_second() {
        let now = now_micros();
        let s = Duration::from_secs;
        assert_eq!(retry_after(Some(after(now, s(30))), now), s(30));
        assert_eq!(
            retry_after(Some(after(now, Duration::from_millis(300))), now),
            s(1)
        );
        assert_eq!(
            retry_after(Some(now - chrono::Duration::seconds(5)), now),
            s(1)
        );
        assert_eq!(retry_after(None, now), s(1));
    }
}
