//! Where a consumer in `seen-set` mode keeps the keys it has handled: a SQL table (the
//! store's `processed_messages`) or Redis.
//!
//! The seen-set is the field report's cheap design: check the key before handling,
//! write it *after* the effect succeeded. Nothing ties the effect and the write
//! together, so a process that dies between the two leaves the key unwritten and the
//! redelivery runs the effect again (`drill seen-set-window` shows it). That is fine
//! for an upsert and wrong for an SMS; the transactional record and the two-phase
//! claim have no such window.
//!
//! Redis is reached with a short timeout per command, and a lost connection is
//! dropped and redialled on the next call. What happens while Redis cannot answer is
//! the operator's choice ([`Unavailable`]): fail-closed (the default) treats it as a
//! store outage — an infrastructure error, the delivery is retried and never counted
//! against the message — and fail-open handles the message unchecked and counts
//! `idem_seen_set_bypassed_total{consumer}`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;

use super::envelope::{Fingerprint, MessageKey};
use super::metrics::Metrics;
use super::store::{duplicate_or_conflict, DedupOutcome, Store, StoreError, StoreResult};

/// The default TTL of a Redis key: the dedup table's default retention (7 days), so
/// a key lives as long as a SQL row would before `purge`.
pub const DEFAULT_TTL: Duration = super::retention::DEFAULT_RETENTION;

/// Longest wait for one Redis command (or the dial before it): a consumer must not
/// hang on a Redis that stopped answering.
pub const REDIS_TIMEOUT: Duration = Duration::from_secs(2);

/// What a `seen-set` consumer does while its seen-set cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Unavailable {
    /// Stop handling: an infrastructure error, retried like any store outage.
    #[default]
    FailClosed,
    /// Handle the message without the check (a duplicate may run its effect again)
    /// and count `idem_seen_set_bypassed_total`.
    FailOpen,
}

impl Unavailable {
    pub fn as_str(self) -> &'static str {
        match self {
            Unavailable::FailClosed => "fail-closed",
            Unavailable::FailOpen => "fail-open",
        }
    }
}

/// `--seen-set URL` and `--seen-set-unavailable`: where the keys go and what to do
/// when that place is down. Without a URL the keys go to the store's table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenSetConfig {
    /// `redis://…` (or `rediss://…`); `None`: the SQL table.
    pub url: Option<String>,
    pub unavailable: Unavailable,
    /// How long a Redis key lives: the retention.
    pub ttl: Duration,
}

impl Default for SeenSetConfig {
    fn default() -> Self {
        SeenSetConfig {
            url: None,
            unavailable: Unavailable::FailClosed,
            ttl: DEFAULT_TTL,
        }
    }
}

/// A set of handled `(consumer, key)` pairs with the fingerprint each was handled with.
#[async_trait]
pub trait SeenSet: Send + Sync + 'static {
    /// `Some(Duplicate)` or `Some(KeyConflict)` when the key was recorded, `None` if not.
    async fn seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<Option<DedupOutcome>>;

    /// Record the key, AFTER the effect succeeded. Recording an already recorded key
    /// changes nothing (the first fingerprint stays).
    async fn mark_seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<()>;

    /// Whether the seen-set answers: the probe of a consumer paused for it.
    async fn ping(&self) -> StoreResult<()>;

    /// Where the keys live, for logs and the dashboard (secrets redacted).
    fn describe(&self) -> String;
}

/// The store's `processed_messages` table as the seen-set.
pub struct SqlSeenSet(pub Arc<dyn Store>);

#[async_trait]
impl SeenSet for SqlSeenSet {
    async fn seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<Option<DedupOutcome>> {
        self.0.seen(consumer, key, fingerprint).await
    }

    async fn mark_seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<()> {
        self.0.mark_seen(consumer, key, fingerprint).await
    }

    async fn ping(&self) -> StoreResult<()> {
        self.0.ping().await
    }

    fn describe(&self) -> String {
        "sql (processed_messages)".into()
    }
}

/// A Redis seen-set value: the fingerprint, a space, and when the key was first
/// processed in Unix milliseconds (docs/CONTRACT.md §3), so a duplicate's age is
/// known without a second key or command.
pub fn redis_value_of(fingerprint: &Fingerprint, first_at: DateTime<Utc>) -> String {
    format!("{} {}", fingerprint.as_str(), first_at.timestamp_millis())
}

/// A stored value read back: the fingerprint, and the first-processed time where the
/// value has one. A value written before the time was kept (a bare fingerprint) reads
/// as that fingerprint with no time: its duplicate's age is unknown, never guessed.
pub fn redis_value(value: &str) -> (&str, Option<DateTime<Utc>>) {
    match value.split_once(' ') {
        Some((fingerprint, millis)) => match millis.parse::<i64>() {
            Ok(ms) => (fingerprint, DateTime::from_timestamp_millis(ms)),
            Err(_) => (value, None),
        },
        None => (value, None),
    }
}

/// Redis as the seen-set: `SET key value NX PX ttl` after success, `GET` before.
///
/// The value holds the payload fingerprint rather than a bare `1`: the same key with
/// another payload must still be a `key_conflict` (docs/CONTRACT.md §1: dead-lettered, never
/// silently dropped), as it is with the SQL table; and the time the key was first
/// processed ([`redis_value_of`]), so a duplicate's age is known.
pub struct RedisSeenSet {
    client: redis::Client,
    conn: tokio::sync::Mutex<Option<redis::aio::MultiplexedConnection>>,
    ttl: Duration,
    redacted: String,
}

impl RedisSeenSet {
    /// Parse the URL; the connection is made on first use (and remade after a
    /// failure), so a consumer starts while Redis is down and waits for it.
    pub fn new(url: &str, ttl: Duration) -> StoreResult<Self> {
        let client = redis::Client::open(url).map_err(|e| {
            StoreError::SeenSetUrl(format!(
                "bad seen-set URL {}: {e}",
                idemwatch_base::redact::redact_url(url)
            ))
        })?;
        Ok(RedisSeenSet {
            client,
            conn: tokio::sync::Mutex::new(None),
            ttl: ttl.max(Duration::from_millis(1)),
            redacted: idemwatch_base::redact::redact_url(url),
        })
    }

    /// The Redis key of one consumer's message key.
    pub fn redis_key(consumer: &str, key: &MessageKey) -> String {
        format!("idemwatch:seen:{consumer}:{}", key.as_str())
    }

    async fn connection(&self) -> StoreResult<redis::aio::MultiplexedConnection> {
        let mut held = self.conn.lock().await;
        if let Some(c) = held.as_ref() {
            return Ok(c.clone());
        }
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(REDIS_TIMEOUT))
            .set_response_timeout(Some(REDIS_TIMEOUT));
        let conn = tokio::time::timeout(
            REDIS_TIMEOUT,
            self.client
                .get_multiplexed_async_connection_with_config(&config),
        )
        .await
        .map_err(|_| self.timed_out("connect"))?
        .map_err(|e| self.failed(&e))?;
        *held = Some(conn.clone());
        Ok(conn)
    }

    /// Run one command; on any failure the connection is dropped so the next call
    /// dials again.
    async fn query<T: redis::FromRedisValue>(&self, cmd: redis::Cmd) -> StoreResult<T> {
        let mut conn = self.connection().await?;
        let result = tokio::time::timeout(REDIS_TIMEOUT, cmd.query_async::<T>(&mut conn)).await;
        match result {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                self.conn.lock().await.take();
                Err(self.failed(&e))
            }
            Err(_) => {
                self.conn.lock().await.take();
                Err(self.timed_out("a command"))
            }
        }
    }

    /// Redis said no, or the way to it broke; the driver's own response timeout is a
    /// deadline like ours.
    fn failed(&self, e: &redis::RedisError) -> StoreError {
        if e.is_timeout() {
            return self.timed_out("a command");
        }
        self.unreachable(&e.to_string())
    }

    fn unreachable(&self, why: &str) -> StoreError {
        StoreError::SeenSetUnavailable {
            seen_set: self.redacted.clone(),
            why: why.to_string(),
        }
    }

    /// A deadline fired (`kind="timeout"`, the consumer paused for the seen-set).
    fn timed_out(&self, what: &'static str) -> StoreError {
        StoreError::TimedOut {
            cause: crate::health::PauseCause::SeenSet,
            what,
            after: REDIS_TIMEOUT,
        }
    }
}

#[async_trait]
impl SeenSet for RedisSeenSet {
    async fn seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<Option<DedupOutcome>> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(Self::redis_key(consumer, key));
        let stored: Option<String> = self.query(cmd).await?;
        Ok(stored.map(|value| {
            let (stored, first_at) = redis_value(&value);
            duplicate_or_conflict(stored.to_string(), fingerprint, first_at)
        }))
    }

    async fn mark_seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<()> {
        let ttl_ms = u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX);
        let mut cmd = redis::cmd("SET");
        cmd.arg(Self::redis_key(consumer, key))
            .arg(redis_value_of(fingerprint, chrono::Utc::now()))
            .arg("NX")
            .arg("PX")
            .arg(ttl_ms);
        // `OK` when written, nil when the key was there already: both are "recorded".
        let _: Option<String> = self.query(cmd).await?;
        Ok(())
    }

    async fn ping(&self) -> StoreResult<()> {
        let _: String = self.query(redis::cmd("PING")).await?;
        Ok(())
    }

    fn describe(&self) -> String {
        format!("redis ({})", self.redacted)
    }
}

/// The seen-set a consumer talks to: the backend plus the unavailability policy.
/// The policy lives here, once, so every consumer in `seen-set` mode follows it alike.
#[derive(Clone)]
pub struct GuardedSeenSet {
    inner: Arc<dyn SeenSet>,
    unavailable: Unavailable,
    metrics: Arc<Metrics>,
    /// Where a dropped duplicate's age is kept (`duplicate_ages`), when anywhere.
    ages: Option<Arc<dyn Store>>,
}

impl GuardedSeenSet {
    pub fn new(inner: Arc<dyn SeenSet>, unavailable: Unavailable, metrics: Arc<Metrics>) -> Self {
        GuardedSeenSet {
            inner,
            unavailable,
            metrics,
            ages: None,
        }
    }

    /// Keep the oldest duplicate age each consumer drops in `store` (what `purge`
    /// and the dashboard's dedup windows read).
    pub fn keeping_ages_in(mut self, store: Arc<dyn Store>) -> Self {
        self.ages = Some(store);
        self
    }

    /// Open the seen-set `cfg` names over `store`.
    pub fn open(
        cfg: &SeenSetConfig,
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
    ) -> StoreResult<Self> {
        let inner: Arc<dyn SeenSet> = match &cfg.url {
            Some(url) if url.starts_with("redis://") || url.starts_with("rediss://") => {
                Arc::new(RedisSeenSet::new(url, cfg.ttl)?)
            }
            Some(url) => {
                return Err(StoreError::SeenSetUrl(format!(
                    "unsupported seen-set URL {} (expected redis://…)",
                    idemwatch_base::redact::redact_url(url)
                )))
            }
            None => Arc::new(SqlSeenSet(store.clone())),
        };
        Ok(GuardedSeenSet::new(inner, cfg.unavailable, metrics).keeping_ages_in(store))
    }

    pub fn describe(&self) -> String {
        self.inner.describe()
    }

    pub fn unavailable(&self) -> Unavailable {
        self.unavailable
    }

    /// Whether the seen-set answers, whatever the policy: a paused consumer's probe.
    pub async fn ping(&self) -> StoreResult<()> {
        self.inner.ping().await
    }

    /// The check before handling. Fail-open turns an outage into "not seen".
    pub async fn seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<Option<DedupOutcome>> {
        match self.inner.seen(consumer, key, fingerprint).await {
            Err(e) if self.bypass(consumer, &e) => Ok(None),
            Ok(Some(dup @ DedupOutcome::Duplicate { .. })) => {
                self.note_age(consumer, &dup).await;
                Ok(Some(dup))
            }
            other => other,
        }
    }

    /// A duplicate found: its age into `idem_duplicate_age_seconds` (or counted as
    /// unknown), and into the store's oldest duplicate age. The latter is a write of
    /// its own beside a read-only check: when it fails the duplicate is still dropped
    /// (the drop is right whatever its age), the failure logged.
    async fn note_age(&self, consumer: &str, dup: &DedupOutcome) {
        let age = dup.duplicate_age(Utc::now());
        self.metrics.duplicate_age(consumer, age);
        let (Some(age), Some(store)) = (age, &self.ages) else {
            return;
        };
        if let Err(e) = store.note_duplicate_age(consumer, age.as_secs_f64()).await {
            tracing::warn!(consumer, error = %e, "duplicate age not kept");
        }
    }

    /// The record after success. Fail-open turns an outage into "not recorded".
    pub async fn mark_seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<()> {
        match self.inner.mark_seen(consumer, key, fingerprint).await {
            Err(e) if self.bypass(consumer, &e) => Ok(()),
            other => other,
        }
    }

    /// Whether to go on without the seen-set: fail-open and an outage (never a bug or
    /// a bad answer). Counted and logged each time.
    fn bypass(&self, consumer: &str, e: &StoreError) -> bool {
        if self.unavailable != Unavailable::FailOpen || !e.is_infrastructure() {
            return false;
        }
        self.metrics.seen_set_bypassed(consumer);
        tracing::warn!(consumer, error = %e, "seen-set unavailable: fail-open, handled unchecked");
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Failure;

    /// A value carries its first-processed time and reads back to it; a value of the
    /// old format (a bare fingerprint) reads as the fingerprint with no time, so its
    /// duplicate's age is unknown rather than wrong; a value whose tail is not a time
    /// is kept whole as the fingerprint (a conflict, not a made-up age).
    #[test]
    fn a_value_keeps_its_first_time_and_an_old_value_has_none() {
        let fp = Fingerprint::from_stored("ab12".into());
        let at = DateTime::from_timestamp_millis(1_800_000_000_123).unwrap();
        let value = redis_value_of(&fp, at);
        assert_eq!(value, "ab12 1800000000123");
        assert_eq!(redis_value(&value), ("ab12", Some(at)));
        assert_eq!(redis_value("ab12"), ("ab12", None));
        assert_eq!(redis_value("ab12 soon"), ("ab12 soon", None));
    }

    /// A seen-set URL that cannot be used is bad configuration, which no retry mends;
    /// a Redis that does not answer is an outage, which pauses the consumer.
    #[tokio::test]
    async fn an_unusable_url_is_not_an_outage_and_an_unreachable_redis_is() {
        let ttl = Duration::from_secs(1);
        let bad = RedisSeenSet::new("redis://127.0.0.1:notaport", ttl).err();
        assert_eq!(bad.expect("an unparsable URL").failure(), Failure::Other);
        let down = RedisSeenSet::new("redis://127.0.0.1:1", ttl).unwrap();
        let e = down.ping().await.expect_err("nothing listens on port 1");
        assert_eq!(e.failure(), Failure::Infrastructure);
    }
}
