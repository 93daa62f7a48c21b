//! A real store (SQLite, PostgreSQL or MariaDB) whose record of provider answers fails
//! the first N times for the store's health: the moment between a send the provider
//! accepted and its record, which a test cannot otherwise hit on purpose (issue 43).
//! Every other statement goes to the real store untouched.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use idemwatch::engine::envelope::{Message, MessageKey, RejectReason};
use idemwatch::engine::store::repair::{ClaimFilter, StrandedClaim};
use idemwatch::engine::store::{
    BusinessWrite, Claim, ClaimOutcome, ClaimRequest, ClaimResult, ClaimState, DeadLetter,
    DeadLetterFilter, DedupOutcome, Durability, Recordable, RepairStore, SqlHandle, Store,
    StoreError, StoreResult, VehicleOutcome,
};

pub struct FlakyRecord {
    inner: Arc<dyn Store>,
    /// Records still to fail.
    failures_left: AtomicUsize,
    /// Records failed so far.
    pub failed: AtomicUsize,
}

impl FlakyRecord {
    /// `inner`, its next `failures` records of provider answers failing.
    pub fn new(inner: Arc<dyn Store>, failures: usize) -> Arc<FlakyRecord> {
        Arc::new(FlakyRecord {
            inner,
            failures_left: AtomicUsize::new(failures),
            failed: AtomicUsize::new(0),
        })
    }

    /// Fail the next `n` records.
    pub fn fail_next(&self, n: usize) {
        self.failures_left.store(n, Ordering::SeqCst);
    }

    pub fn failed(&self) -> usize {
        self.failed.load(Ordering::SeqCst)
    }

    /// The store "went away" for this record: a connection reset, as an outage is.
    fn record(&self) -> StoreResult<()> {
        let left = self
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if left.is_ok() {
            self.failed.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::Db(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "injected: the store went away between the send and its record",
            ))));
        }
        Ok(())
    }
}

#[async_trait]
impl Store for FlakyRecord {
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
        self.inner.ping().await
    }
    async fn record_batch(&self, c: &str, items: &[Recordable]) -> StoreResult<Vec<DedupOutcome>> {
        self.inner.record_batch(c, items).await
    }
    async fn seen(
        &self,
        c: &str,
        key: &MessageKey,
        fp: &idemwatch::engine::envelope::Fingerprint,
    ) -> StoreResult<Option<DedupOutcome>> {
        self.inner.seen(c, key, fp).await
    }
    async fn mark_seen(
        &self,
        c: &str,
        key: &MessageKey,
        fp: &idemwatch::engine::envelope::Fingerprint,
    ) -> StoreResult<()> {
        self.inner.mark_seen(c, key, fp).await
    }
    async fn apply_unguarded(&self, write: &BusinessWrite) -> StoreResult<()> {
        self.inner.apply_unguarded(write).await
    }
    async fn apply_vehicle_batch(&self, envs: &[Message]) -> StoreResult<Vec<VehicleOutcome>> {
        self.inner.apply_vehicle_batch(envs).await
    }
    async fn claim_batch(
        &self,
        c: &str,
        requests: &[ClaimRequest],
        lease: Duration,
    ) -> StoreResult<Vec<ClaimOutcome>> {
        self.inner.claim_batch(c, requests, lease).await
    }
    async fn finish_side_effect(
        &self,
        c: &str,
        key: &MessageKey,
        state: ClaimState,
        detail: &str,
    ) -> StoreResult<()> {
        self.record()?;
        self.inner.finish_side_effect(c, key, state, detail).await
    }
    async fn release_claim(&self, c: &str, key: &MessageKey, detail: &str) -> StoreResult<()> {
        self.record()?;
        self.inner.release_claim(c, key, detail).await
    }
    async fn finish_batch(&self, c: &str, results: &[ClaimResult]) -> StoreResult<Vec<MessageKey>> {
        self.record()?;
        self.inner.finish_batch(c, results).await
    }
    async fn renew_claims(
        &self,
        c: &str,
        held: &[(MessageKey, i64)],
    ) -> StoreResult<Vec<MessageKey>> {
        self.inner.renew_claims(c, held).await
    }
    async fn db_now(&self) -> StoreResult<DateTime<Utc>> {
        self.inner.db_now().await
    }
    async fn dead_letter(
        &self,
        c: &str,
        reason: RejectReason,
        detail: &str,
        raw: &[u8],
    ) -> StoreResult<i64> {
        self.inner.dead_letter(c, reason, detail, raw).await
    }
    async fn purge_processed_batch(&self, cutoff: DateTime<Utc>, batch: i64) -> StoreResult<u64> {
        self.inner.purge_processed_batch(cutoff, batch).await
    }
    async fn after_purge(&self) -> StoreResult<()> {
        self.inner.after_purge().await
    }
}

#[async_trait]
impl RepairStore for FlakyRecord {
    async fn find_dead_letters(&self, f: &DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
        self.inner.find_dead_letters(f).await
    }
    async fn mark_replayed(&self, id: i64) -> StoreResult<bool> {
        self.inner.mark_replayed(id).await
    }
    async fn rearm_failed_claim(&self, c: &str, key: &str, detail: &str) -> StoreResult<bool> {
        self.inner.rearm_failed_claim(c, key, detail).await
    }
    async fn list_claims(&self, f: &ClaimFilter) -> StoreResult<Vec<Claim>> {
        self.inner.list_claims(f).await
    }
    async fn stranded_claims(
        &self,
        consumers: &[&str],
        claimed_before: DateTime<Utc>,
        limit: i64,
    ) -> StoreResult<Vec<StrandedClaim>> {
        self.inner
            .stranded_claims(consumers, claimed_before, limit)
            .await
    }
    async fn resolve_claim(
        &self,
        c: &str,
        key: &str,
        state: ClaimState,
        detail: &str,
    ) -> StoreResult<bool> {
        self.inner.resolve_claim(c, key, state, detail).await
    }
}
