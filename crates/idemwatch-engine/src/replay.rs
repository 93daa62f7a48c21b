//! Replaying dead letters (docs/CONTRACT.md §8 `dead-letters replay`): the raw bytes of each
//! chosen dead letter go back, unchanged, to the queue of the consumer that gave up
//! on them, and the row records the replay (`replayed_at`, `replay_count`).
//!
//! Why a replay is always safe: it is one more delivery of the same bytes, so the
//! consumer's own dedup decides. A message that was in fact processed (dead-lettered
//! after its commit, or replayed twice) is dropped as a duplicate; a side effect
//! whose claim is still in doubt is retried with the claim's provider key. A message
//! that fails again becomes a new dead letter with the new cause; the replayed row
//! keeps its own.
//!
//! One exception to "the consumer's dedup decides": a `provider_rejected` dead
//! letter's claim is `failed` (the provider refused, nothing went out), and a
//! finished claim drops every later delivery as a duplicate, so the replay that
//! follows the provider's fix would send nothing. Replaying such a letter first
//! re-arms its claim ([`RepairStore::rearm_failed_claim`]): `claimed` again, lease
//! over, same provider key, so the replayed copy takes it over in doubt and sends
//! once; a second replay then finds `sent` and is a duplicate. Only that reason
//! re-arms: a claim an operator resolved `failed` by hand (`claims resolve`) with
//! no such dead letter stays so.
//!
//! [`RepairStore::rearm_failed_claim`]: super::store::RepairStore::rearm_failed_claim
//!
//! Queue-generic: it publishes through [`Queue::publish`], so the embedded queue,
//! RabbitMQ and any later broker replay the same way. The CLI and the dashboard both
//! call [`replay`]; neither writes its own.

use serde::Serialize;

use super::consumers::FLEET_CONSUMERS;
use super::envelope::{cut_raw_length, Envelope, MessageKey, RejectReason, MAX_RAW_BYTES};
use super::queue::Queue;
use super::store::{ClaimState, DeadLetter, DeadLetterFilter, Store};
use super::EngineError;

/// What to replay.
#[derive(Debug, Clone)]
pub struct ReplayPlan {
    pub filter: DeadLetterFilter,
    /// Say what would be replayed, publish nothing, record nothing.
    pub dry_run: bool,
    /// Queue-name prefix of the consumers' queues (drills); `None` for a live system.
    pub namespace: Option<String>,
}

/// What happened to one dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayStatus {
    /// Published to its consumer's queue and recorded.
    Replayed,
    /// `--dry-run`: would have been published.
    WouldReplay,
    /// Not a consumer this engine runs: nowhere to publish it.
    UnknownConsumer,
    /// Over what a queue takes (`too_large`, or raw bytes of which only the first
    /// 64 KiB were kept): a copy would only be refused again. Skipped, and the replay
    /// goes on with the next letter instead of stopping at this one every time.
    TooLarge,
}

impl ReplayStatus {
    /// Why a letter was not published, as the CLI and the dashboard say it.
    pub fn skipped_because(self) -> Option<&'static str> {
        match self {
            ReplayStatus::Replayed | ReplayStatus::WouldReplay => None,
            ReplayStatus::UnknownConsumer => Some("not a consumer of this engine"),
            ReplayStatus::TooLarge => {
                Some("over the queue's size limit, it would be refused again")
            }
        }
    }
}

/// One dead letter of a replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayedLetter {
    pub id: i64,
    pub consumer: String,
    pub reason: String,
    /// The queue it went (or would go) to.
    pub queue: Option<String>,
    pub status: ReplayStatus,
    /// Replays of this row, this one included.
    pub replay_count: i64,
    /// A `provider_rejected` letter whose `failed` claim was re-armed (or, on a dry
    /// run, would be) so the replayed copy sends once.
    pub rearmed_claim: bool,
}

/// The whole replay, as `dead-letters replay --json` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    pub dry_run: bool,
    pub matched: usize,
    pub replayed: usize,
    pub skipped: usize,
    pub letters: Vec<ReplayedLetter>,
}

/// The queue a consumer reads, prefixed by a namespace if any. The one place the
/// naming is written: [`super::Engine::queue_name`] uses it too.
pub fn queue_name(namespace: Option<&str>, consumer: &str) -> String {
    match namespace {
        Some(ns) => format!("{ns}/{consumer}"),
        None => consumer.to_string(),
    }
}

/// Replay the dead letters `plan` selects, oldest first (the order they first
/// arrived in), each published and then recorded. A publish that fails stops the
/// replay there: what went out is recorded, the rest is untouched and can be
/// replayed again.
pub async fn replay(
    store: &dyn Store,
    queue: &dyn Queue,
    plan: &ReplayPlan,
) -> Result<ReplayReport, EngineError> {
    let mut letters = store.find_dead_letters(&plan.filter).await?;
    letters.reverse();
    let mut report = ReplayReport {
        dry_run: plan.dry_run,
        matched: letters.len(),
        replayed: 0,
        skipped: 0,
        letters: Vec::with_capacity(letters.len()),
    };
    for letter in letters {
        let outcome = replay_one(store, queue, plan, &letter).await?;
        match outcome.status {
            ReplayStatus::Replayed | ReplayStatus::WouldReplay => report.replayed += 1,
            ReplayStatus::UnknownConsumer | ReplayStatus::TooLarge => report.skipped += 1,
        }
        report.letters.push(outcome);
    }
    Ok(report)
}

/// Replay one dead letter by id on the database and queue these URLs name (what
/// the dashboard's Tables tab does after its confirmation).
pub async fn replay_by_id(
    db_url: &str,
    queue_url: &str,
    id: i64,
) -> Result<ReplayReport, EngineError> {
    let store = super::store::open(db_url).await?;
    let queue = super::queue::open(queue_url).await?;
    let plan = ReplayPlan {
        filter: DeadLetterFilter {
            ids: vec![id],
            ..DeadLetterFilter::default()
        },
        dry_run: false,
        namespace: None,
    };
    let result = replay(store.as_ref(), queue.as_ref(), &plan).await;
    queue.close().await;
    result
}

async fn replay_one(
    store: &dyn Store,
    queue: &dyn Queue,
    plan: &ReplayPlan,
    letter: &DeadLetter,
) -> Result<ReplayedLetter, EngineError> {
    let mut out = ReplayedLetter {
        id: letter.id,
        consumer: letter.consumer.clone(),
        reason: letter.reason.clone(),
        queue: None,
        status: ReplayStatus::UnknownConsumer,
        replay_count: letter.replay_count,
        rearmed_claim: false,
    };
    if too_large(letter) {
        out.status = ReplayStatus::TooLarge;
        return Ok(out);
    }
    if !FLEET_CONSUMERS.contains(&letter.consumer.as_str()) {
        return Ok(out);
    }
    let name = queue_name(plan.namespace.as_deref(), &letter.consumer);
    out.queue = Some(name.clone());
    let rejected_key = rejected_claim_key(letter);
    if plan.dry_run {
        if let Some(key) = &rejected_key {
            out.rearmed_claim = store
                .claim(&letter.consumer, key)
                .await?
                .is_some_and(|c| c.state == ClaimState::Failed);
        }
        out.status = ReplayStatus::WouldReplay;
        return Ok(out);
    }
    // Re-armed before the publish: re-armed but not published (the queue went away
    // just now) leaves a claim in doubt that the sweeper, a redelivery or the next
    // replay takes over with the same provider key; one send either way.
    if let Some(key) = &rejected_key {
        out.rearmed_claim = store
            .rearm_failed_claim(
                &letter.consumer,
                key.as_str(),
                &format!("re-armed by the replay of dead letter {}", letter.id),
            )
            .await?;
    }
    queue
        .publish(
            std::slice::from_ref(&name),
            std::slice::from_ref(&letter.raw),
        )
        .await?;
    // Published but not recorded (the database went away just now) is harmless: the
    // row still reads as not replayed and a second replay is one more duplicate.
    store.mark_replayed(letter.id).await?;
    out.status = ReplayStatus::Replayed;
    out.replay_count += 1;
    Ok(out)
}

/// A letter no queue would take back: refused for its size, kept cut, or (a row from
/// before letters were bounded) over the limit whole.
fn too_large(letter: &DeadLetter) -> bool {
    letter.reason == RejectReason::TooLarge.as_str()
        || letter.raw.len() > MAX_RAW_BYTES
        || letter.detail.as_deref().and_then(cut_raw_length).is_some()
}

/// The message key of a `provider_rejected` letter's claim; `None` for any other
/// reason, or raw bytes that no longer parse (the replay fails again, as before).
fn rejected_claim_key(letter: &DeadLetter) -> Option<MessageKey> {
    if letter.reason != RejectReason::ProviderRejected.as_str() {
        return None;
    }
    Envelope::parse(&letter.raw).ok().map(|e| e.key())
}
