//! The business database behind one [`Store`] trait (docs/CONTRACT.md §3).
//!
//! Each idempotency mode is one method here, and each backend implements it with
//! its own native atomic form. The invariants every backend must keep are written
//! once, on the trait methods; the conformance tests check them on every backend.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;

use super::deadlines::Deadlines;
use super::envelope::{Envelope, Fingerprint, Message, MessageKey, RejectReason};

mod admin_sql;
mod batch;
mod claim_batch;
mod consumer_sql;
pub mod deadline;
pub mod dialect;
pub mod edge;
mod edge_sql;
mod error;
pub mod mysql;
pub mod postgres;
pub mod repair;
mod repair_sql;
pub mod sqlite;
mod vehicle_batch;
pub mod vehicle_sql;

pub use claim_batch::{ClaimFinish, ClaimRequest, ClaimResult};
pub(crate) use error::timed_out as sqlx_timed_out;
pub use error::{Failure, StoreError, StoreResult};
pub use repair::{DeadLetterFilter, RepairStore};

pub(crate) use batch::{DedupBatch, FirstSeen, ROWS_PER_STATEMENT};

/// What the dedup insert decided. "First" is always decided by the unique-key insert
/// (the rows it returned or affected), never by a prior SELECT saying a key is absent;
/// a read may only say a key is already there (dedup rows are insert-only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DedupOutcome {
    /// First time this key: the dedup row and the business rows committed together.
    Applied,
    /// Already done: nothing written, the caller acks and counts a duplicate.
    /// `first_at`: when the key was first processed (its stored `processed_at`, or the
    /// batch's own time for a key twice in one batch), read in the same transaction
    /// that decided the duplicate; None where the dedup layer does not keep it (a
    /// Redis seen-set value written before it did: "age unknown", never a wrong age).
    Duplicate { first_at: Option<DateTime<Utc>> },
    /// The key was recorded with another fingerprint: two different events claim one
    /// identity. Nothing written; the caller dead-letters it.
    KeyConflict { stored: Fingerprint },
}

/// One message for [`Store::record_batch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recordable {
    pub key: MessageKey,
    pub fingerprint: Fingerprint,
    pub write: BusinessWrite,
}

/// The business rows a transactional consumer writes with its dedup row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BusinessWrite {
    /// `trip_counters.zone_exits + 1`: accumulation, not naturally idempotent.
    CountZoneExit { device_id: String },
}

/// The result of the natural (seq-guarded) vehicle-state write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VehicleOutcome {
    /// Newest seq so far: state moved, history row `applied = true`.
    Applied,
    /// Older than the state: history row stored with `applied = false`, state untouched.
    Late,
    /// This (device, seq, event_type) is already in history with the same payload.
    /// `first_at`: when that history row was received (its `received_at`), so the
    /// duplicate's age is known as for the dedup table's consumers (issue 41); None
    /// where nothing was read (the naive path decides nothing).
    Duplicate { first_at: Option<DateTime<Utc>> },
    /// Already in history with a different payload.
    KeyConflict { stored: Fingerprint },
}

/// How long before `now` the time `first` was: a duplicate's age. Never negative: a
/// first time ahead of `now` (a clock step between two hosts) reads as 0.
pub(crate) fn age_at(first: DateTime<Utc>, now: DateTime<Utc>) -> Duration {
    now.signed_duration_since(first)
        .to_std()
        .unwrap_or(Duration::ZERO)
}

/// The oldest of a batch's duplicate ages, in seconds (None when no duplicate had a
/// known first time): what the batch notes in `duplicate_ages`.
pub(crate) fn oldest_age(ages: impl Iterator<Item = Option<Duration>>) -> Option<f64> {
    ages.flatten()
        .map(|age| age.as_secs_f64())
        .max_by(f64::total_cmp)
}

impl VehicleOutcome {
    /// The decision alone, without when the row was first received: what comparing
    /// two ways of deciding (one-by-one calls against a batch) compares.
    pub fn without_age(self) -> Self {
        match self {
            VehicleOutcome::Duplicate { .. } => VehicleOutcome::Duplicate { first_at: None },
            other => other,
        }
    }

    /// How long ago its history row was received, for a duplicate whose first time
    /// is known (never negative, as [`DedupOutcome::duplicate_age`]).
    pub fn duplicate_age(&self, now: DateTime<Utc>) -> Option<Duration> {
        match self {
            VehicleOutcome::Duplicate {
                first_at: Some(first),
            } => Some(age_at(*first, now)),
            _ => None,
        }
    }

    /// The oldest duplicate among `outcomes`, in seconds: what the batch notes in
    /// `duplicate_ages` in its own transaction (see [`DedupBatch::oldest_duplicate`]).
    pub(crate) fn oldest_duplicate(outcomes: &[VehicleOutcome], now: DateTime<Utc>) -> Option<f64> {
        oldest_age(outcomes.iter().map(|o| o.duplicate_age(now)))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimState {
    Claimed,
    Sent,
    Failed,
}

impl ClaimState {
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimState::Claimed => "claimed",
            ClaimState::Sent => "sent",
            ClaimState::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "claimed" => Some(ClaimState::Claimed),
            "sent" => Some(ClaimState::Sent),
            "failed" => Some(ClaimState::Failed),
            _ => None,
        }
    }
}

/// A row of `side_effect_claims`: who owns the right to perform one external effect.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Claim {
    pub consumer: String,
    pub message_key: String,
    /// Sent to the provider as `Idempotency-Key` on every attempt of this claim.
    pub provider_key: String,
    pub state: ClaimState,
    pub claimed_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub attempts: i64,
    pub detail: Option<String>,
}

/// What the claim step decided for one delivery of a side-effect message.
#[derive(Debug, Clone, PartialEq)]
pub enum ClaimOutcome {
    /// First delivery of this key: we own the send.
    Fresh(Claim),
    /// A previous owner claimed it longer than the lease ago and never recorded a
    /// result: the send may or may not have happened. We now own the retry, which
    /// must reuse the claim's provider key.
    InDoubt(Claim),
    /// A claim its owner gave back after the provider failed (throttled, 5xx,
    /// unreachable: [`Store::release_claim`]): we own the retry, under the claim's
    /// provider key. The provider said the earlier call failed, so this one is the
    /// retry it asked for, not a repeat of a send.
    Released(Claim),
    /// Already finished (`sent` or `failed`): a duplicate, nothing to do. With when
    /// its key was first processed (the dedup row's `processed_at`, read by the same
    /// statement that found the claim), as [`DedupOutcome::Duplicate`] has it.
    Done(ClaimState, Option<DateTime<Utc>>),
    /// Another delivery holds a live claim (within the lease): come back later.
    Busy,
    /// The key is recorded with another fingerprint.
    KeyConflict { stored: Fingerprint },
}

impl ClaimOutcome {
    /// How long ago (at `now`) a finished claim's key was first processed: the age of
    /// the duplicate this outcome drops. Never negative.
    pub fn duplicate_age(&self, now: DateTime<Utc>) -> Option<Duration> {
        match self {
            ClaimOutcome::Done(_, Some(first)) => Some(age_at(*first, now)),
            _ => None,
        }
    }

    /// The oldest duplicate among `outcomes`, in seconds (see
    /// [`DedupBatch::oldest_duplicate`]).
    pub(crate) fn oldest_duplicate(outcomes: &[ClaimOutcome], now: DateTime<Utc>) -> Option<f64> {
        oldest_age(outcomes.iter().map(|o| o.duplicate_age(now)))
    }
}

/// One `vehicle_state` row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VehicleState {
    pub device_id: String,
    pub last_seq: i64,
    pub last_event_type: String,
    pub ignition: Option<String>,
    pub zone: Option<String>,
    pub lat: Option<f64>,
    pub lon: Option<f64>,
    pub occurred_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// One `vehicle_history` row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HistoryRow {
    pub device_id: String,
    pub seq: i64,
    pub event_type: String,
    pub occurred_at: DateTime<Utc>,
    pub received_at: DateTime<Utc>,
    pub applied: bool,
    pub payload: String,
}

/// One `dead_letters` row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetter {
    pub id: i64,
    pub consumer: String,
    pub reason: String,
    pub detail: Option<String>,
    #[serde(serialize_with = "raw_as_lossy_text")]
    pub raw: Vec<u8>,
    pub received_at: DateTime<Utc>,
    /// When it was last re-published (`dead-letters replay`), if ever.
    pub replayed_at: Option<DateTime<Utc>>,
    pub replay_count: i64,
}

fn raw_as_lossy_text<S: serde::Serializer>(raw: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&String::from_utf8_lossy(raw))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MarkerKind {
    Deploy,
    Restart,
    Drill,
    Manual,
    /// Written by `idemwatch mark incident`.
    Incident,
    /// Written by `idemwatch mark note`.
    Note,
}

impl MarkerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MarkerKind::Deploy => "deploy",
            MarkerKind::Restart => "restart",
            MarkerKind::Drill => "drill",
            MarkerKind::Manual => "manual",
            MarkerKind::Incident => "incident",
            MarkerKind::Note => "note",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "deploy" => Some(MarkerKind::Deploy),
            "restart" => Some(MarkerKind::Restart),
            "drill" => Some(MarkerKind::Drill),
            "manual" => Some(MarkerKind::Manual),
            "incident" => Some(MarkerKind::Incident),
            "note" => Some(MarkerKind::Note),
            _ => None,
        }
    }
}

/// One `markers` row: a vertical line on the duplicate-rate chart.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Marker {
    pub id: i64,
    pub kind: MarkerKind,
    pub at: DateTime<Utc>,
    pub label: String,
    pub detail: Option<String>,
}

/// One `drill_runs` row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DrillRun {
    pub id: i64,
    pub scenario: String,
    pub mode: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub verdict: Option<String>,
    pub report: Option<serde_json::Value>,
}

/// How hard a commit is pushed to disk before the engine acks the message.
///
/// `Durable` (the default) survives a power cut: SQLite `synchronous=FULL`, the
/// servers' own commit settings. `Relaxed` trades that for commit latency: SQLite
/// WAL `synchronous=NORMAL`, PostgreSQL `synchronous_commit = off`. A process crash
/// loses nothing either way; a power cut (or OS crash) can undo the last commits
/// of a relaxed store while their messages are already acked, so their effects are
/// gone without a redelivery. Never the default, always visible (`idem_engine_info`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// Every commit on disk before the ack (SQLite FULL; the server's own settings).
    #[default]
    Durable,
    /// SQLite NORMAL, PostgreSQL synchronous_commit=off: a power cut can undo the
    /// last commits.
    Relaxed,
}

impl Durability {
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Durable => "durable",
            Durability::Relaxed => "relaxed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "durable" => Some(Durability::Durable),
            "relaxed" => Some(Durability::Relaxed),
            _ => None,
        }
    }

    /// Whether the backend a `--db` URL names can run with this durability.
    ///
    /// MySQL/MariaDB's knob, `innodb_flush_log_at_trx_commit`, is a server-global
    /// setting: changing it would relax every other client of the server, so relaxed
    /// is refused there rather than silently running durable under a relaxed label.
    pub fn check_url(self, url: &str) -> StoreResult<()> {
        if self == Durability::Relaxed && is_mysql_url(url) {
            return Err(StoreError::DurabilityUnsupported(format!(
                "relaxed durability is refused on MySQL/MariaDB ({}): its equivalent, \
                 innodb_flush_log_at_trx_commit, is a server-global setting that idemwatch \
                 must not change for every client of the server; run durable, or set it on \
                 the server yourself",
                redact_url(url)
            )));
        }
        Ok(())
    }
}

/// Which database a [`Store`] talks to. Each has a folder of its own under `store/`
/// (its `Store`, its dialect, the dashboard's read-only connection, its migrations);
/// this enum and the functions below that match on it are their registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Sqlite,
    Postgres,
    Mysql,
}

impl Backend {
    /// The backend a database URL names by its scheme, if it is one of ours.
    pub fn of_url(url: &str) -> Option<Backend> {
        if url.starts_with("sqlite:") {
            Some(Backend::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Backend::Postgres)
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            Some(Backend::Mysql)
        } else {
            None
        }
    }
}

/// The dashboard's read-only connections to the database a URL names (each backend's
/// `readonly.rs`: never writing, every statement time-limited), opened lazily, so a
/// database that is down now is picked up when it comes back.
pub fn dashboard(url: &str) -> StoreResult<Box<dyn dialect::Sql>> {
    let sql = match Backend::of_url(url) {
        Some(Backend::Sqlite) => sqlite::readonly::connect(url)?,
        Some(Backend::Postgres) => postgres::readonly::connect(url)?,
        Some(Backend::Mysql) => mysql::readonly::connect(url)?,
        None => return Err(StoreError::UnsupportedUrl(redact_url(url))),
    };
    Ok(sql)
}

/// A database's answer by the codes of the backend that gave it (each backend's
/// `dialect.rs` reads its own), for [`StoreError::failure`].
fn database_failure(db: &dyn sqlx::error::DatabaseError) -> Failure {
    if let Some(e) = db.try_downcast_ref::<sqlx::sqlite::SqliteError>() {
        sqlite::dialect::failure(e)
    } else if let Some(e) = db.try_downcast_ref::<crate::sqlite::thread::SqliteThreadError>() {
        sqlite::dialect::failure(e)
    } else if let Some(e) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        postgres::dialect::failure(e.code())
    } else if let Some(e) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        mysql::dialect::failure(e.number(), e.code())
    } else {
        Failure::Other
    }
}

/// One claim's result in a statement of its own (see [`ClaimResult`]): whether it was
/// written — an owned result whose claim is no longer its owner's is not.
pub(crate) async fn finish_claim<S: Store + ?Sized>(
    store: &S,
    consumer: &str,
    r: &ClaimResult,
) -> StoreResult<bool> {
    consumer_sql::finish(&*store.sql().0, consumer, r).await
}

/// What the consumers call on the business database: one implementation per backend,
/// each with its own native atomic statements where that is what makes a mode
/// correct or fast, and the retention that runs beside them. What only the drills,
/// the dashboard and the operator call is in the supertraits [`AdminStore`] and
/// [`RepairStore`], written once for every backend.
#[async_trait]
pub trait Store: RepairStore + AdminStore + Send + Sync + 'static {
    /// The backend [`Store::sql`] runs on.
    fn backend(&self) -> Backend {
        self.sql().0.backend()
    }

    /// The store's connections as the dialect layer sees them: the statements that
    /// are the same on every backend (this trait's provided methods, written once in
    /// `consumer_sql.rs`) run on it.
    fn sql(&self) -> SqlHandle;

    /// The URL with any password replaced by `***`.
    fn redacted_url(&self) -> String;

    /// The commit durability this store's connections were opened with.
    fn durability(&self) -> Durability;

    /// One round trip to the database (`SELECT 1`): the probe of a consumer paused
    /// by an outage (see `engine/health.rs`). Says the database answers, not that it
    /// takes writes: the trial delivery after it tells that.
    async fn ping(&self) -> StoreResult<()> {
        consumer_sql::ping(&*self.sql().0).await
    }

    // ---- transactional mode -------------------------------------------------

    /// Transactional dedup for a batch: for each item, insert `(consumer, key)` into
    /// `processed_messages` and apply its write — all items in ONE transaction.
    ///
    /// Invariant: the effect of each write is committed exactly once per key. The
    /// duplicate decision comes from the insert's rows-affected under the unique
    /// constraint (`ON CONFLICT DO NOTHING` and kin), so two racing deliveries cannot
    /// both win, a duplicate neither raises an error nor aborts the transaction, and
    /// a key twice in one batch is a duplicate the second time, exactly as across
    /// batches. One outcome per item, in order. Backends write a batch with a few
    /// multi-row statements, not two per message (see `batch.rs`).
    async fn record_batch(
        &self,
        consumer: &str,
        items: &[Recordable],
    ) -> StoreResult<Vec<DedupOutcome>>;

    /// [`Store::record_batch`] of one item.
    async fn record_once(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
        write: &BusinessWrite,
    ) -> StoreResult<DedupOutcome> {
        let item = Recordable {
            key: key.clone(),
            fingerprint: fingerprint.clone(),
            write: write.clone(),
        };
        self.record_batch(consumer, std::slice::from_ref(&item))
            .await?
            .pop()
            .ok_or(StoreError::Internal("record_batch returned no outcome"))
    }

    // ---- seen-set mode ------------------------------------------------------

    /// Seen-set check: has `(consumer, key)` been recorded? `Some(Duplicate)` or
    /// `Some(KeyConflict)` when it has, `None` when not.
    async fn seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<Option<DedupOutcome>> {
        consumer_sql::seen(&*self.sql().0, consumer, key, fingerprint).await
    }

    /// Seen-set record, AFTER the effect succeeded.
    ///
    /// Invariant (weaker by design): a crash between the effect and this call re-runs
    /// the effect on redelivery. Only acceptable when the effect is itself idempotent.
    async fn mark_seen(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
    ) -> StoreResult<()> {
        consumer_sql::mark_seen(&*self.sql().0, consumer, key, fingerprint).await
    }

    /// A duplicate dropped outside a batch transaction (seen-set mode: its check is a
    /// read of its own) was first processed `age_seconds` ago: raise the consumer's
    /// oldest duplicate age (`duplicate_ages`, what `purge` and the dashboard's dedup
    /// windows read) if this one is older. The batch paths keep it in their own
    /// transaction instead.
    async fn note_duplicate_age(&self, consumer: &str, age_seconds: f64) -> StoreResult<()> {
        consumer_sql::note_duplicate_age(&*self.sql().0, consumer, age_seconds).await
    }

    /// Naive mode: apply `write` with no dedup at all. For drills only.
    async fn apply_unguarded(&self, write: &BusinessWrite) -> StoreResult<()> {
        consumer_sql::apply_unguarded(&*self.sql().0, write).await
    }

    // ---- natural mode -------------------------------------------------------

    /// Natural idempotency for `vehicle-state`, in one transaction: insert the event
    /// into `vehicle_history` once (unique on device, seq, event_type), then upsert
    /// `vehicle_state` only if the event's seq is newer than the stored one.
    ///
    /// Invariant: state never goes backwards; every distinct event is in history
    /// exactly once; a late event is kept with `applied = false` ("the late truth is
    /// not lost, but it cannot rewrite today"). With `guarded = false` (naive, drills
    /// only) the upsert overwrites whatever arrives last.
    ///
    /// Guarded, this is [`Store::apply_vehicle_batch`] of one event, so a single event
    /// and a batch cannot decide differently; naive, it is written once for every
    /// backend (`vehicle_sql.rs`).
    async fn apply_vehicle_event(
        &self,
        msg: &Message,
        guarded: bool,
    ) -> StoreResult<VehicleOutcome> {
        if !guarded {
            return vehicle_sql::apply_unguarded(&*self.sql().0, msg).await;
        }
        self.apply_vehicle_batch(std::slice::from_ref(msg))
            .await?
            .pop()
            .ok_or(StoreError::Internal(
                "apply_vehicle_batch returned no outcome",
            ))
    }

    /// [`Store::apply_vehicle_event`] (guarded) for a batch, in ONE transaction: one
    /// outcome per event, in order, each exactly what one-by-one calls in order would
    /// have decided — an event earlier in the batch counts as stored, and the newest
    /// event per device wins inside the batch as across batches (see
    /// `vehicle_batch.rs`). The backend's native statements.
    async fn apply_vehicle_batch(&self, envs: &[Message]) -> StoreResult<Vec<VehicleOutcome>>;

    // ---- side effects (two-phase claim) -------------------------------------

    /// Phase 1: in one transaction, insert the dedup row and a `claimed` claim.
    ///
    /// Invariant: at most one live claim per key. A redelivery that finds `sent` or
    /// `failed` does nothing; one that finds a claim older than `lease` takes it over
    /// (compare-and-set on `claimed_at`, attempts + 1) and must resend with the SAME
    /// provider key, so the provider's own dedup closes the send/record window.
    ///
    /// [`Store::claim_batch`] of one request, so a single claim and a batch cannot
    /// decide differently. It carries no message: the claim it takes keeps an empty
    /// one, which the claim sweeper cannot re-drive (a redelivery can). The consumers
    /// claim through [`Store::claim_batch`] with their message.
    async fn claim_side_effect(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &Fingerprint,
        provider_key: &str,
        lease: Duration,
    ) -> StoreResult<ClaimOutcome> {
        let request = ClaimRequest {
            key: key.clone(),
            fingerprint: fingerprint.clone(),
            provider_key: provider_key.to_string(),
            message: Vec::new(),
        };
        self.claim_one(consumer, &request, lease).await
    }

    /// [`Store::claim_batch`] of one request: the claim and its message in one
    /// transaction, decided as a batch would.
    async fn claim_one(
        &self,
        consumer: &str,
        request: &ClaimRequest,
        lease: Duration,
    ) -> StoreResult<ClaimOutcome> {
        self.claim_batch(consumer, std::slice::from_ref(request), lease)
            .await?
            .pop()
            .ok_or(StoreError::Internal("claim_batch returned no outcome"))
    }

    /// Phase 3 by hand: record an answer on the claim whoever holds it (an operator's
    /// tool, a test). The consumers record as the claim's owner ([`Store::finish_batch`]
    /// with [`ClaimResult::attempts`]).
    async fn finish_side_effect(
        &self,
        consumer: &str,
        key: &MessageKey,
        state: ClaimState,
        detail: &str,
    ) -> StoreResult<()> {
        let done = ClaimResult {
            key: key.clone(),
            finish: ClaimFinish::Done {
                state,
                detail: detail.to_string(),
            },
            attempts: None,
        };
        consumer_sql::finish(&*self.sql().0, consumer, &done).await?;
        Ok(())
    }

    /// A transient provider failure: keep the claim, note why, and make it
    /// immediately eligible for an in-doubt retry (with the same provider key).
    async fn release_claim(
        &self,
        consumer: &str,
        key: &MessageKey,
        detail: &str,
    ) -> StoreResult<()> {
        let release = ClaimResult {
            key: key.clone(),
            finish: ClaimFinish::Release {
                detail: detail.to_string(),
            },
            attempts: None,
        };
        consumer_sql::finish(&*self.sql().0, consumer, &release).await?;
        Ok(())
    }

    /// While its provider calls run, an owner keeps its claims: each of `held` (a key
    /// and the `attempts` its owner took it with) still `claimed` by that owner is
    /// claimed again now, on the database's clock, so no lease runs out under a live
    /// call and no sweeper or redelivery takes it over. Returns the keys renewed; one
    /// missing was taken over (its owner's lease ran out: a frozen or cut-off process)
    /// or finished by someone else, and must not be sent again by this owner.
    async fn renew_claims(
        &self,
        consumer: &str,
        held: &[(MessageKey, i64)],
    ) -> StoreResult<Vec<MessageKey>> {
        consumer_sql::renew(&*self.sql().0, consumer, held).await
    }

    /// The clock leases and retention are decided on: the database's where it has one
    /// (PostgreSQL, MariaDB), so a process whose own clock jumped neither takes over a
    /// live claim nor purges early; this process's on SQLite (ARCHITECTURE.md, "Clocks").
    async fn db_now(&self) -> StoreResult<DateTime<Utc>> {
        consumer_sql::db_now(&*self.sql().0).await
    }

    /// Phase 1 for a batch, in ONE transaction: each request decided exactly as
    /// one-by-one [`Store::claim_side_effect`] calls in order would have (see
    /// `claim_batch.rs`), with the same invariants, and each claim taken (fresh or in
    /// doubt) keeping its request's message. The backend's native statements.
    async fn claim_batch(
        &self,
        consumer: &str,
        requests: &[ClaimRequest],
        lease: Duration,
    ) -> StoreResult<Vec<ClaimOutcome>>;

    /// Phase 3 for a batch, in ONE transaction: [`Store::finish_side_effect`] or
    /// [`Store::release_claim`] per result, in order, each owned result only while its
    /// owner still holds the claim (see [`ClaimResult::attempts`]). Returns the keys of
    /// the owned results not written for that reason: another owner's now. The default
    /// runs each result's statement in one transaction (one commit, one flush of the
    /// log, instead of one per claim).
    async fn finish_batch(
        &self,
        consumer: &str,
        results: &[ClaimResult],
    ) -> StoreResult<Vec<MessageKey>> {
        consumer_sql::finish_all(&*self.sql().0, consumer, results).await
    }

    // ---- bad input -------------------------------------------------------------

    /// Keep a message we cannot process, with its raw bytes (bounded: over the queue's
    /// limit, the first 64 KiB and the true length in `detail`,
    /// [`dead_letter_raw`](crate::envelope::dead_letter_raw)). Never loses
    /// input a queue could have carried.
    async fn dead_letter(
        &self,
        consumer: &str,
        reason: RejectReason,
        detail: &str,
        raw: &[u8],
    ) -> StoreResult<i64> {
        consumer_sql::dead_letter(&*self.sql().0, consumer, reason, detail, raw).await
    }

    // ---- retention ------------------------------------------------------------

    /// Delete at most `batch` dedup rows (and their finished claims) processed
    /// before `cutoff`. Returns how many dedup rows went; 0 means done. Callers loop:
    /// each batch is its own short transaction, so the purge can be interrupted and
    /// rerun and never holds locks for long.
    async fn purge_processed_batch(&self, cutoff: DateTime<Utc>, batch: i64) -> StoreResult<u64>;

    /// After a purge: reclaim the deleted rows where the database does not do it by
    /// itself soon enough. On PostgreSQL the purged rows stay in the `processed_at`
    /// index as dead entries until VACUUM, and every scan from the oldest end (the
    /// dashboard's oldest row, the next purge batch) steps over all of them —
    /// measured at 40M rows: 13,800 index pages, 36 ms for the oldest row instead of
    /// 0.1 ms. Default: nothing to do.
    async fn after_purge(&self) -> StoreResult<()> {
        Ok(())
    }
}

/// What the drills, the dashboard, snapshots and reports read, and the markers and
/// drill runs they write: rare statements off the consumers' path, so written once
/// for every backend over the dialect layer (`admin_sql.rs`). A supertrait of
/// [`Store`], so one handle still reaches everything.
#[async_trait]
pub trait AdminStore: Send + Sync {
    async fn add_marker(
        &self,
        kind: MarkerKind,
        label: &str,
        detail: Option<&str>,
    ) -> StoreResult<i64>;

    async fn start_drill_run(&self, scenario: &str, mode: &str) -> StoreResult<i64>;

    async fn finish_drill_run(
        &self,
        id: i64,
        verdict: &str,
        report: &serde_json::Value,
    ) -> StoreResult<()>;

    // ---- reads ----------------------------------------------------------------

    async fn vehicle_state(&self, device_id: &str) -> StoreResult<Option<VehicleState>>;
    async fn vehicle_history(&self, device_id: &str) -> StoreResult<Vec<HistoryRow>>;
    /// The newest `limit` history rows outside drill devices (`DRILL-…`), optionally of
    /// one event type, newest first: already-processed events a live drill re-publishes.
    async fn recent_history(
        &self,
        event_type: Option<&str>,
        limit: i64,
    ) -> StoreResult<Vec<HistoryRow>>;
    /// Keys `consumer` recorded in `processed_messages` that start with `key_prefix`
    /// (a device id prefix): what a chaos run checks against what it published.
    async fn processed_keys(&self, consumer: &str, key_prefix: &str) -> StoreResult<Vec<String>>;
    async fn zone_exits(&self, device_id: &str) -> StoreResult<i64>;
    /// The oldest duplicate each consumer has dropped (`duplicate_ages`), by consumer.
    async fn duplicate_ages(&self) -> StoreResult<Vec<DuplicateAge>>;
    async fn claim(&self, consumer: &str, key: &MessageKey) -> StoreResult<Option<Claim>>;
    /// Claims still `claimed` and older than `lease`: the sends in doubt.
    async fn claims_in_doubt(&self, lease: Duration) -> StoreResult<Vec<Claim>>;
    async fn markers(&self, limit: i64) -> StoreResult<Vec<Marker>>;
    async fn drill_runs(&self, limit: i64) -> StoreResult<Vec<DrillRun>>;
    /// Whole-table contents in a canonical order, without wall-clock columns: two
    /// databases that saw the same distinct events have equal digests.
    async fn digest(&self) -> StoreResult<StateDigest>;
    /// The MQTT topic filters the ingress session `session` (broker host:port and
    /// client id) was last subscribed to, as subscribed; empty if never recorded. A
    /// broker keeps a persistent session's subscriptions and MQTT cannot list them, so
    /// the ingress remembers them to unsubscribe the ones no longer configured.
    async fn ingress_filters(&self, session: &str) -> StoreResult<Vec<String>>;
    /// Record `filters` as `session`'s subscriptions (replacing what was there; none
    /// forgets the session).
    async fn set_ingress_filters(&self, session: &str, filters: &[String]) -> StoreResult<()>;
}

/// One `duplicate_ages` row: the oldest duplicate a consumer has dropped.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DuplicateAge {
    pub consumer: String,
    /// How long before that duplicate its key had first been processed.
    pub max_age_seconds: f64,
    /// When that duplicate was dropped.
    pub observed_at: DateTime<Utc>,
}

/// Canonical contents of the business tables, for the "twice" property.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct StateDigest {
    pub processed: Vec<(String, String, String)>,
    pub claims: Vec<(String, String, String, String)>,
    pub vehicle_state: Vec<String>,
    pub history: Vec<String>,
    pub trip_counters: Vec<(String, i64)>,
}

/// What the vehicle-state upsert writes, derived once from an envelope for every
/// backend: which columns this event type sets, and which it leaves as they are.
pub struct VehicleFacts<'a> {
    pub seq: i64,
    pub event_type: &'static str,
    /// `on`/`off` for ignition events, else None (keep the stored value).
    pub ignition: Option<&'static str>,
    /// The zone entered; a `zone_exit` clears it, other events keep it.
    pub zone: Option<&'a str>,
    pub lat: Option<f64>,
    pub lon: Option<f64>,
    pub payload: String,
}

impl<'a> VehicleFacts<'a> {
    pub fn of(env: &'a Envelope) -> StoreResult<Self> {
        use super::envelope::EventType;
        let seq = i64::try_from(env.seq).map_err(|_| StoreError::OutOfRange {
            what: "seq",
            value: env.seq.to_string(),
        })?;
        let (lat, lon) = env.lat_lon().unzip();
        Ok(VehicleFacts {
            seq,
            event_type: env.event_type.as_str(),
            ignition: match env.event_type {
                EventType::IgnitionOn => Some("on"),
                EventType::IgnitionOff => Some("off"),
                _ => None,
            },
            zone: match env.event_type {
                EventType::ZoneEnter => env.zone(),
                _ => None,
            },
            lat,
            lon,
            payload: serde_json::Value::Object(env.payload.clone()).to_string(),
        })
    }
}

/// What a redelivery does with an existing claim, decided the same way on every
/// backend (the takeover itself is a compare-and-set on `claimed_at`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClaimStep {
    Done(ClaimState),
    Busy,
    TakeOver,
}

pub(crate) fn claim_step(claim: &Claim, now: DateTime<Utc>, lease: Duration) -> ClaimStep {
    match claim.state {
        ClaimState::Sent | ClaimState::Failed => ClaimStep::Done(claim.state),
        ClaimState::Claimed => {
            let lease = chrono::Duration::from_std(lease).unwrap_or(chrono::Duration::MAX);
            if now.signed_duration_since(claim.claimed_at) >= lease {
                ClaimStep::TakeOver
            } else {
                ClaimStep::Busy
            }
        }
    }
}

/// One `vehicle_state` row of a [`StateDigest`], formatted the same on every backend.
#[allow(clippy::too_many_arguments)]
pub(crate) fn vehicle_digest_line(
    device_id: &str,
    last_seq: i64,
    last_event_type: &str,
    ignition: Option<String>,
    zone: Option<String>,
    lat: Option<f64>,
    lon: Option<f64>,
    occurred_at: DateTime<Utc>,
) -> String {
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    format!(
        "{device_id}|{last_seq}|{last_event_type}|{}|{}|{}|{}|{}",
        opt(ignition),
        opt(zone),
        opt(lat.map(|v| v.to_string())),
        opt(lon.map(|v| v.to_string())),
        ts(occurred_at)
    )
}

impl DedupOutcome {
    /// The decision alone, without when the key was first processed: what comparing
    /// two ways of deciding (one-by-one calls against a batch) compares.
    pub fn without_age(self) -> Self {
        match self {
            DedupOutcome::Duplicate { .. } => DedupOutcome::Duplicate { first_at: None },
            other => other,
        }
    }

    /// How long ago its key was first processed, for a duplicate whose first time is
    /// known (never negative: a first time ahead of `now`, a clock step between two
    /// hosts, reads as 0).
    pub fn duplicate_age(&self, now: DateTime<Utc>) -> Option<Duration> {
        match self {
            DedupOutcome::Duplicate {
                first_at: Some(first),
            } => Some(age_at(*first, now)),
            _ => None,
        }
    }
}

/// The stored fingerprint of an existing row decides duplicate vs conflict; a
/// duplicate carries when the row was first processed, where that is known.
pub(crate) fn duplicate_or_conflict(
    stored: String,
    fingerprint: &Fingerprint,
    first_at: Option<DateTime<Utc>>,
) -> DedupOutcome {
    if stored == fingerprint.as_str() {
        DedupOutcome::Duplicate { first_at }
    } else {
        DedupOutcome::KeyConflict {
            stored: Fingerprint::from_stored(stored),
        }
    }
}

pub(crate) fn vehicle_duplicate_or_conflict(
    stored: String,
    fingerprint: &Fingerprint,
    first_at: Option<DateTime<Utc>>,
) -> VehicleOutcome {
    match duplicate_or_conflict(stored, fingerprint, first_at) {
        DedupOutcome::KeyConflict { stored } => VehicleOutcome::KeyConflict { stored },
        _ => VehicleOutcome::Duplicate { first_at },
    }
}

/// Open the store a `--db` URL names and bring its schema up to date (durable).
pub async fn open(url: &str) -> StoreResult<Arc<dyn Store>> {
    Ok(open_with_edge(url).await?.store)
}

/// A store's pool seen as [`dialect::Sql`] (opaque outside the store).
pub struct SqlHandle(pub(crate) Box<dyn dialect::Sql>);

impl SqlHandle {
    pub(crate) fn of<D: dialect::Dialect>(pool: sqlx::Pool<D>) -> Self
    where
        dialect::Pooled<D>: dialect::Sql,
    {
        SqlHandle(Box::new(dialect::Pooled(pool)))
    }
}

/// One database seen through both traits: the consumers' [`Store`] and the HTTP
/// edge's [`edge::EdgeStore`], over one connection pool.
#[derive(Clone)]
pub struct Stores {
    pub store: Arc<dyn Store>,
    pub edge: Arc<dyn edge::EdgeStore>,
}

/// The store, and the edge's tables over the same pool.
fn both<S: Store, D>(s: S, pool: sqlx::Pool<D>) -> Stores
where
    D: dialect::Dialect,
    dialect::Pooled<D>: dialect::Sql,
{
    Stores {
        store: Arc::new(s),
        edge: Arc::new(edge_sql::SqlEdge(Box::new(dialect::Pooled(pool)))),
    }
}

/// Open the store a `--db` URL names, with its HTTP-edge side (durable).
pub async fn open_with_edge(url: &str) -> StoreResult<Stores> {
    open_with_edge_durability(url, Durability::Durable).await
}

/// [`open_with_edge`] with a chosen [`Durability`]; a durability the backend
/// refuses fails before any connection is made.
pub async fn open_with_edge_durability(url: &str, durability: Durability) -> StoreResult<Stores> {
    open_with(url, durability, &Deadlines::default()).await
}

/// [`open_with_edge_durability`] with the engine's [`Deadlines`]: the store's calls
/// bounded by the statement deadline ([`deadline::DeadlineStore`]), its sessions told
/// the same, its connects and its pool's waits bounded by theirs.
pub async fn open_with(
    url: &str,
    durability: Durability,
    deadlines: &Deadlines,
) -> StoreResult<Stores> {
    durability.check_url(url)?;
    let tripwire = Arc::new(deadline::Tripwire::default());
    let Stores { store, edge } = match Backend::of_url(url) {
        Some(Backend::Sqlite) => {
            let s = sqlite::SqliteStore::open_with(url, durability, deadlines.statement_timeout)
                .await?;
            let pool = s.pool().clone();
            both(s, pool)
        }
        Some(Backend::Postgres) => {
            let s =
                postgres::PostgresStore::open_with(url, durability, deadlines, tripwire.clone())
                    .await?;
            let pool = s.pool().clone();
            both(s, pool)
        }
        Some(Backend::Mysql) => {
            let s = mysql::MysqlStore::open_with(url, deadlines, tripwire.clone()).await?;
            let pool = s.pool().clone();
            both(s, pool)
        }
        None => return Err(StoreError::UnsupportedUrl(redact_url(url))),
    };
    let store = deadline::DeadlineStore::new(store, deadlines.statement_timeout, tripwire);
    Ok(Stores {
        store: Arc::new(store),
        edge,
    })
}

fn is_mysql_url(url: &str) -> bool {
    Backend::of_url(url) == Some(Backend::Mysql)
}

/// Kept here for the store's callers; the rule lives in [`idemwatch_base::redact`].
pub use idemwatch_base::redact::redact_url;

/// A time as stored in TEXT columns (see [`dialect::text_time`]).
pub fn ts(t: DateTime<Utc>) -> String {
    dialect::text_time(t)
}

/// A stored TEXT time; an unreadable one reads as the epoch.
pub(crate) fn parse_ts(s: &str) -> DateTime<Utc> {
    dialect::parse_text_time(s).unwrap_or(DateTime::<Utc>::UNIX_EPOCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLAIM_STATES: [ClaimState; 3] =
        [ClaimState::Claimed, ClaimState::Sent, ClaimState::Failed];
    const MARKER_KINDS: [MarkerKind; 6] = [
        MarkerKind::Deploy,
        MarkerKind::Restart,
        MarkerKind::Drill,
        MarkerKind::Manual,
        MarkerKind::Incident,
        MarkerKind::Note,
    ];
    const DURABILITIES: [Durability; 2] = [Durability::Durable, Durability::Relaxed];

    /// A claim's `state`, a marker's `kind` and the `durability` label are stored
    /// (and scraped) as words: each word reads back as the value it was written
    /// from, and is the one the JSON of snapshots and reports shows (and, for
    /// durability, the `--durability` argument). The readers of a stored word fall
    /// back on a default for a word they do not know (`Claimed`, `Manual`), so a
    /// word that no longer parsed would read as that default without an error.
    #[test]
    fn stored_words_read_back_as_what_they_were_written_from() {
        for s in CLAIM_STATES {
            assert_eq!(serde_json::json!(s), s.as_str());
            assert_eq!(ClaimState::parse(s.as_str()), Some(s), "{s:?}");
        }
        assert_eq!(
            CLAIM_STATES.map(ClaimState::as_str),
            ["claimed", "sent", "failed"]
        );
        for k in MARKER_KINDS {
            assert_eq!(serde_json::json!(k), k.as_str());
            assert_eq!(MarkerKind::parse(k.as_str()), Some(k), "{k:?}");
        }
        assert_eq!(
            MARKER_KINDS.map(MarkerKind::as_str),
            ["deploy", "restart", "drill", "manual", "incident", "note"]
        );
        for d in DURABILITIES {
            assert_eq!(serde_json::json!(d), d.as_str());
            assert_eq!(Durability::parse(d.as_str()), Some(d), "{d:?}");
            let argument = <Durability as clap::ValueEnum>::from_str(d.as_str(), false);
            assert_eq!(argument, Ok(d));
        }
        assert_eq!(DURABILITIES.map(Durability::as_str), ["durable", "relaxed"]);
        for unknown in ["", "Sent", "xyzzy"] {
            assert_eq!(ClaimState::parse(unknown), None);
            assert_eq!(MarkerKind::parse(unknown), None);
            assert_eq!(Durability::parse(unknown), None);
        }
    }

    /// Relaxed durability is refused on both URL forms of MySQL/MariaDB and only
    /// there, before any connection (these hosts do not resolve), and the refusal
    /// names the URL without its password; durable is refused nowhere.
    #[test]
    fn relaxed_durability_is_refused_on_mysql_and_mariadb_only() {
        for url in [
            "mysql://app:hunter2@db.invalid/fleet",
            "mariadb://app:hunter2@db.invalid/fleet",
        ] {
            match Durability::Relaxed.check_url(url) {
                Err(StoreError::DurabilityUnsupported(m)) => {
                    assert!(
                        m.contains(&redact_url(url)) && !m.contains("hunter2"),
                        "{m}"
                    )
                }
                other => panic!("{url}: {other:?}"),
            }
            assert!(Durability::Durable.check_url(url).is_ok(), "{url}");
        }
        for url in [
            "sqlite:///var/lib/idemwatch/fleet.db",
            "postgres://app:hunter2@db.invalid/fleet",
            "postgresql://app:hunter2@db.invalid/fleet",
        ] {
            for d in DURABILITIES {
                assert!(d.check_url(url).is_ok(), "{d:?} {url}");
            }
        }
    }

    /// What the state upsert writes is derived here once for every backend: an
    /// ignition event carries its `on`/`off`, a zone entry the zone it names; every
    /// other event carries neither (the statement then clears the zone on a zone exit
    /// and keeps both columns otherwise).
    #[test]
    fn each_event_type_carries_only_its_own_state_columns() {
        let facts = |event_type: &str, payload: &str| {
            let raw = format!(
                r#"{{"device_id":"34-AB-1","seq":7,"event_type":"{event_type}","occurred_at":"2026-11-30T04:12:03Z","payload":{{{payload}}}}}"#
            );
            let env = Envelope::parse(raw.as_bytes()).unwrap();
            let f = VehicleFacts::of(&env).unwrap();
            (f.ignition, f.zone.map(String::from))
        };
        assert_eq!(facts("ignition_on", ""), (Some("on"), None));
        assert_eq!(facts("ignition_off", ""), (Some("off"), None));
        let zone = r#""zone":"depot""#;
        assert_eq!(facts("zone_enter", zone), (None, Some("depot".into())));
        assert_eq!(facts("zone_exit", zone), (None, None));
        assert_eq!(
            facts("position", r#""lat":41.15,"lon":-8.61"#),
            (None, None)
        );
    }

    /// The twice property compares the digests of two databases, so a digest line
    /// must change with every column it stands for: one that dropped a column (or
    /// were the same for every row) would call two different states equal.
    #[test]
    fn a_vehicle_digest_line_changes_with_every_column() {
        #[derive(Clone)]
        struct Row {
            device: &'static str,
            seq: i64,
            event_type: &'static str,
            ignition: Option<String>,
            zone: Option<String>,
            lat: Option<f64>,
            lon: Option<f64>,
            at: DateTime<Utc>,
        }
        let line = |r: &Row| {
            let (ignition, zone) = (r.ignition.clone(), r.zone.clone());
            vehicle_digest_line(
                r.device,
                r.seq,
                r.event_type,
                ignition,
                zone,
                r.lat,
                r.lon,
                r.at,
            )
        };
        let state = Row {
            device: "34-AB-1",
            seq: 7,
            event_type: "zone_enter",
            ignition: Some("on".into()),
            zone: Some("depot".into()),
            lat: Some(41.15),
            lon: Some(-8.61),
            at: parse_ts("2026-12-01T10:00:00.000000Z"),
        };
        assert_eq!(line(&state), line(&state.clone()));
        let changes: [fn(&mut Row); 8] = [
            |r| r.device = "34-AB-2",
            |r| r.seq += 1,
            |r| r.event_type = "position",
            |r| r.ignition = None,
            |r| r.zone = Some("yard".into()),
            |r| r.lat = None,
            |r| r.lon = Some(-8.62),
            |r| r.at += chrono::Duration::microseconds(1),
        ];
        for (column, change) in changes.iter().enumerate() {
            let mut other = state.clone();
            change(&mut other);
            assert_ne!(line(&other), line(&state), "column {column}");
        }
    }
}
