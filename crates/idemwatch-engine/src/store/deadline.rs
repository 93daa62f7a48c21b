//! Every store call on the consumers' path within the statement deadline, and a
//! connection that went silent never handed out again.
//!
//! sqlx bounds the wait for a pooled connection (`acquire_timeout`) but not the wait
//! for an answer on one: a PostgreSQL or MariaDB connection whose TCP session a NAT
//! or a failover forgot answers nothing and refuses nothing, and every consumer on
//! it waited for as long as the socket did (issue 39: still stuck after 180 s). The
//! server's own statement timeout does not help there — the server never sees the
//! statement, or its answer never arrives. So [`DeadlineStore`] wraps the backend
//! and bounds each call (one transaction) by `statement_timeout`; a call that runs
//! out is [`StoreError::TimedOut`], an infrastructure failure of kind `timeout`.
//!
//! Dropping the call's future drops its connection in the middle of a statement;
//! what happens to that connection and its siblings is the [`Tripwire`]'s part, in
//! the pool's hooks (`dialect::server_pool`): the abandoned connection must answer
//! what it still owes within [`RELEASE_GRACE`] or it is closed, and every connection
//! that sat idle in the pool when a deadline fired is closed at its next acquire
//! instead of being tried (the way to the server they were opened on is suspect: a
//! frozen way freezes all of them, and each would cost another whole deadline).
//! Fresh connections replace them.
//!
//! Not bounded here: `after_purge` (a `VACUUM` of a big table takes a minute: it is
//! maintenance, off the consumers' path, and runs with the server's statement
//! timeout lifted) and the [`AdminStore`] reads and writes of drills and operators,
//! which reach the pool through [`Store::sql`] (the server's statement timeout still
//! bounds each of their statements). Known gap, sqlx's own: a connection handed back
//! to the pool is pinged without a deadline, so one whose ping was on the wire at the
//! moment the way froze stays parked (one of the pool's 16 slots) until the way moves
//! again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::repair::{ClaimFilter, StrandedClaim};
use super::*;
use crate::deadlines::Deadlines;
use crate::envelope::Message;
use idemwatch_base::vocab::PauseCause;

/// How long a connection whose call was abandoned may take to answer what it still
/// owes before it is closed: a healthy server that was merely slow answers at once
/// (its own statement timeout ended the statement by then); a silent way never does.
pub(crate) const RELEASE_GRACE: Duration = Duration::from_secs(2);

/// When a store deadline last fired, shared by a store's pool hooks and its
/// [`DeadlineStore`]: a connection idle since before then is not handed out again.
#[derive(Debug)]
pub(crate) struct Tripwire {
    origin: Instant,
    /// Nanoseconds after `origin` of the last firing, plus one; 0: never fired.
    fired: AtomicU64,
}

impl Default for Tripwire {
    fn default() -> Self {
        Tripwire {
            origin: Instant::now(),
            fired: AtomicU64::new(0),
        }
    }
}

impl Tripwire {
    /// A deadline fired now.
    pub(crate) fn fire(&self) {
        let at = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX - 1);
        self.fired.fetch_max(at + 1, Ordering::Relaxed);
    }

    /// Whether a connection idle for `idle_for` was already idle when a deadline
    /// last fired: it was opened on the way that went silent and has not been heard
    /// from since.
    pub(crate) fn idle_across_a_firing(&self, idle_for: Duration) -> bool {
        let fired = self.fired.load(Ordering::Relaxed);
        if fired == 0 {
            return false;
        }
        let fired_at = self.origin + Duration::from_nanos(fired - 1);
        Instant::now()
            .checked_sub(idle_for)
            .is_none_or(|idle_since| idle_since <= fired_at)
    }
}

/// `connect` (a connection or a pool's first) within `connect_timeout`: a server
/// behind a black-holed way accepts nothing and refuses nothing.
pub(crate) async fn connect_within<T>(
    deadlines: &Deadlines,
    connect: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> StoreResult<T> {
    match tokio::time::timeout(deadlines.connect_timeout, connect).await {
        Ok(connected) => Ok(connected?),
        Err(_) => Err(StoreError::TimedOut {
            cause: PauseCause::Store,
            what: "connect",
            after: deadlines.connect_timeout,
        }),
    }
}

/// A [`Store`] whose every consumer-path call answers within `limit` (see the
/// module doc).
pub struct DeadlineStore {
    inner: Arc<dyn Store>,
    limit: Duration,
    tripwire: Arc<Tripwire>,
}

impl DeadlineStore {
    pub(crate) fn new(inner: Arc<dyn Store>, limit: Duration, tripwire: Arc<Tripwire>) -> Self {
        DeadlineStore {
            inner,
            limit,
            tripwire,
        }
    }

    /// `call` within the deadline; `what` names it in the error.
    async fn within<T>(
        &self,
        what: &'static str,
        call: impl std::future::Future<Output = StoreResult<T>>,
    ) -> StoreResult<T> {
        match tokio::time::timeout(self.limit, call).await {
            Ok(result) => result,
            Err(_) => {
                self.tripwire.fire();
                Err(StoreError::TimedOut {
                    cause: PauseCause::Store,
                    what,
                    after: self.limit,
                })
            }
        }
    }
}

#[async_trait]
impl Store for DeadlineStore {
    fn backend(&self) -> Backend {
        self.inner.backend()
    }

    fn sql(&self) -> SqlHandle {
        self.inner.sql()
    }

    fn redacted_url(&self) -> String {
        self.inner.redacted_url()
    }

    fn durability(&self) -> Durability {
        self.inner.durability()
    }

    async fn ping(&self) -> StoreResult<()> {
        self.within("ping", self.inner.ping()).await
    }

    async fn record_batch(
        &self,
        consumer: &str,
        items: &[Recordable],
    ) -> StoreResult<Vec<DedupOutcome>> {
        self.within("record_batch", self.inner.record_batch(consumer, items))
            .await
    }

    async fn record_once(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
        write: &BusinessWrite,
    ) -> StoreResult<DedupOutcome> {
        let call = self.inner.record_once(consumer, key, fingerprint, write);
        self.within("record_once", call).await
    }

    async fn seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<Option<DedupOutcome>> {
        self.within("seen", self.inner.seen(consumer, key, fingerprint))
            .await
    }

    async fn mark_seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<()> {
        self.within(
            "mark_seen",
            self.inner.mark_seen(consumer, key, fingerprint),
        )
        .await
    }

    async fn note_duplicate_age(&self, consumer: &str, age_seconds: f64) -> StoreResult<()> {
        let call = self.inner.note_duplicate_age(consumer, age_seconds);
        self.within("note_duplicate_age", call).await
    }

    async fn apply_unguarded(&self, write: &BusinessWrite) -> StoreResult<()> {
        self.within("apply_unguarded", self.inner.apply_unguarded(write))
            .await
    }

    async fn apply_vehicle_event(
        &self,
        msg: &Message,
        guarded: bool,
    ) -> StoreResult<VehicleOutcome> {
        let call = self.inner.apply_vehicle_event(msg, guarded);
        self.within("apply_vehicle_event", call).await
    }

    async fn apply_vehicle_batch(&self, envs: &[Message]) -> StoreResult<Vec<VehicleOutcome>> {
        self.within("apply_vehicle_batch", self.inner.apply_vehicle_batch(envs))
            .await
    }

    async fn claim_side_effect(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
        provider_key: &str,
        lease: Duration,
    ) -> StoreResult<ClaimOutcome> {
        let call = self
            .inner
            .claim_side_effect(consumer, key, fingerprint, provider_key, lease);
        self.within("claim_side_effect", call).await
    }

    async fn claim_one(
        &self,
        consumer: &str,
        request: &ClaimRequest,
        lease: Duration,
    ) -> StoreResult<ClaimOutcome> {
        self.within("claim_one", self.inner.claim_one(consumer, request, lease))
            .await
    }

    async fn finish_side_effect(
        &self,
        consumer: &str,
        key: &MessageKey,
        state: ClaimState,
        detail: &str,
    ) -> StoreResult<()> {
        let call = self.inner.finish_side_effect(consumer, key, state, detail);
        self.within("finish_side_effect", call).await
    }

    async fn release_claim(
        &self,
        consumer: &str,
        key: &MessageKey,
        detail: &str,
    ) -> StoreResult<()> {
        let call = self.inner.release_claim(consumer, key, detail);
        self.within("release_claim", call).await
    }

    async fn claim_batch(
        &self,
        consumer: &str,
        requests: &[ClaimRequest],
        lease: Duration,
    ) -> StoreResult<Vec<ClaimOutcome>> {
        let call = self.inner.claim_batch(consumer, requests, lease);
        self.within("claim_batch", call).await
    }

    async fn finish_batch(
        &self,
        consumer: &str,
        results: &[ClaimResult],
    ) -> StoreResult<Vec<MessageKey>> {
        self.within("finish_batch", self.inner.finish_batch(consumer, results))
            .await
    }

    async fn renew_claims(
        &self,
        consumer: &str,
        held: &[(MessageKey, i64)],
    ) -> StoreResult<Vec<MessageKey>> {
        self.within("renew_claims", self.inner.renew_claims(consumer, held))
            .await
    }

    async fn db_now(&self) -> StoreResult<DateTime<Utc>> {
        self.within("db_now", self.inner.db_now()).await
    }

    async fn dead_letter(
        &self,
        consumer: &str,
        reason: RejectReason,
        detail: &str,
        raw: &[u8],
    ) -> StoreResult<i64> {
        let call = self.inner.dead_letter(consumer, reason, detail, raw);
        self.within("dead_letter", call).await
    }

    async fn purge_processed_batch(&self, cutoff: DateTime<Utc>, batch: i64) -> StoreResult<u64> {
        let call = self.inner.purge_processed_batch(cutoff, batch);
        self.within("purge_processed_batch", call).await
    }

    /// Maintenance (`VACUUM`): not bounded, see the module doc.
    async fn after_purge(&self) -> StoreResult<()> {
        self.inner.after_purge().await
    }
}

#[async_trait]
impl RepairStore for DeadlineStore {
    async fn find_dead_letters(&self, filter: &DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        self.within("find_dead_letters", self.inner.find_dead_letters(filter))
            .await
    }

    async fn mark_replayed(&self, id: i64) -> StoreResult<bool> {
        self.within("mark_replayed", self.inner.mark_replayed(id))
            .await
    }

    async fn rearm_failed_claim(
        &self,
        consumer: &str,
        key: &str,
        detail: &str,
    ) -> StoreResult<bool> {
        let call = self.inner.rearm_failed_claim(consumer, key, detail);
        self.within("rearm_failed_claim", call).await
    }

    async fn list_claims(&self, filter: &ClaimFilter) -> StoreResult<Vec<Claim>> {
        self.within("list_claims", self.inner.list_claims(filter))
            .await
    }

    async fn stranded_claims(
        &self,
        consumers: &[&str],
        claimed_before: DateTime<Utc>,
        limit: i64,
    ) -> StoreResult<Vec<StrandedClaim>> {
        let call = self.inner.stranded_claims(consumers, claimed_before, limit);
        self.within("stranded_claims", call).await
    }

    async fn resolve_claim(
        &self,
        consumer: &str,
        key: &str,
        state: ClaimState,
        detail: &str,
    ) -> StoreResult<bool> {
        let call = self.inner.resolve_claim(consumer, key, state, detail);
        self.within("resolve_claim", call).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_idle_across_a_firing_is_suspect_and_one_idle_since_is_not() {
        let t = Tripwire::default();
        assert!(
            !t.idle_across_a_firing(Duration::from_secs(3600)),
            "never fired"
        );
        std::thread::sleep(Duration::from_millis(20));
        t.fire();
        // Idle for longer than the firing is ago: it sat in the pool through it.
        assert!(t.idle_across_a_firing(Duration::from_secs(1)));
        std::thread::sleep(Duration::from_millis(20));
        // Released after the firing: it answered since.
        assert!(!t.idle_across_a_firing(Duration::from_millis(5)));
    }

    /// A store call that never answers ends at the deadline as a timeout of the
    /// store: an infrastructure failure, which pauses the consumer and costs the
    /// message nothing.
    #[tokio::test]
    async fn a_call_that_never_answers_is_a_store_timeout_at_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("s.db").display());
        let inner: Arc<dyn Store> = Arc::new(
            sqlite::SqliteStore::open(&url, Durability::Durable)
                .await
                .unwrap(),
        );
        let tripwire = Arc::new(Tripwire::default());
        let store = DeadlineStore::new(inner, Duration::from_millis(50), tripwire.clone());
        let started = Instant::now();
        let e = store
            .within("record_batch", std::future::pending::<StoreResult<()>>())
            .await
            .expect_err("never answers");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(e.is_infrastructure(), "{e}");
        assert!(e.timed_out(), "{e}");
        assert!(e.to_string().contains("50ms"), "{e}");
        assert!(tripwire.idle_across_a_firing(Duration::from_secs(1)));
        store.ping().await.expect("a store that answers answers");
    }
}
