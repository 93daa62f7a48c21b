//! Replaying dead letters (SPEC §8 `dead-letters replay`): the raw bytes of each
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
//! Queue-generic: it publishes through [`Queue::publish`], so the embedded queue,
//! RabbitMQ and any later broker replay the same way. The CLI and the dashboard both
//! call [`replay`]; neither writes its own.

use serde::Serialize;

use super::consumers::FLEET_CONSUMERS;
use super::queue::Queue;
use super::store::{DeadLetter, DeadLetterFilter, Store};
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
            ReplayStatus::UnknownConsumer => report.skipped += 1,
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
    };
    if !FLEET_CONSUMERS.contains(&letter.consumer.as_str()) {
        return Ok(out);
    }
    let name = queue_name(plan.namespace.as_deref(), &letter.consumer);
    out.queue = Some(name.clone());
    if plan.dry_run {
        out.status = ReplayStatus::WouldReplay;
        return Ok(out);
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
