//! The four fleet consumers of the field report (SPEC §2), one file each.
//!
//! The review rule for every consumer: "what happens if I call this handler twice
//! with the same message?" The answer must be "the same result"; the property tests
//! in `tests/twice.rs` ask it of every consumer here.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::crash::{CrashPlan, Crashed};
use super::envelope::{EventType, Message, RejectReason, Rejection};
use super::health::InfraKind;
use super::metrics::{EffectResult, Metrics};
use super::provider::ProviderClient;
use super::seen_set::GuardedSeenSet;
use super::store::{Failure, Store, StoreError};

pub mod erp_webhook;
mod side_effect;
pub mod trip_counter;
pub mod vehicle_state;
pub mod zone_exit_sms;

pub(crate) use side_effect::{claim_request, provider_key};

/// How dangerous a second call of the handler is, from the field report's inventory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RiskClass {
    /// Writes "set state": naturally idempotent with a seq guard.
    Natural,
    /// Counters, balances, appends: needs the dedup table.
    Accumulation,
    /// Cannot be rolled back: SMS, e-mail, webhooks.
    ExternalSideEffect,
}

impl RiskClass {
    pub fn as_str(self) -> &'static str {
        match self {
            RiskClass::Natural => "natural",
            RiskClass::Accumulation => "accumulation",
            RiskClass::ExternalSideEffect => "external side effect",
        }
    }
}

/// Which idempotency mechanism a consumer runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ConsumerMode {
    /// The consumer's proper mode: seq guard, transactional dedup, or two-phase claim.
    #[default]
    Idempotent,
    /// Record the key after the effect succeeded (cheap; re-runs the effect if the
    /// process dies between the two).
    SeenSet,
    /// No dedup, no claims, no provider key, no seq guard. For drills only.
    Naive,
}

impl ConsumerMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ConsumerMode::Idempotent => "idempotent",
            ConsumerMode::SeenSet => "seen-set",
            ConsumerMode::Naive => "naive",
        }
    }
}

/// What one handler call decided; the runner turns it into metrics and an ack.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The effect was applied (the first completed delivery of this key).
    Processed {
        effect: Option<EffectResult>,
        /// This delivery took over a claim left in doubt by a dead predecessor.
        took_over_in_doubt: bool,
    },
    /// Stored in history only: older than the current state.
    Late,
    /// Already done: acked without effect.
    Duplicate,
    /// Not an event this consumer cares about.
    Skipped,
    /// Bad input discovered by the consumer (a key conflict): dead-letter and ack.
    Rejected(Rejection),
    /// Not now: give the delivery back to the queue; [`Retry::cause`] says whether
    /// that uses up one of its `max_deliveries`.
    Retry(Retry),
}

/// A delivery going back to the queue, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Retry {
    pub cause: RetryCause,
    /// The last cause in words: kept in the dead letter if it comes to that.
    pub why: String,
}

/// Whose fault a retry is. Only [`RetryCause::Message`] counts toward
/// `max_deliveries` (SPEC §8): an outage or a throttling provider says nothing about
/// the message, and a budget burnt on them dead-letters good messages by the hundred.
#[derive(Debug, Clone, PartialEq)]
pub enum RetryCause {
    /// The handler failed in a way that is neither the database's health nor the
    /// message's content as the database judged it (a bug, a schema that does not
    /// match): counted, so a message that always fails ends as a dead letter.
    Message,
    /// Another delivery holds a live claim on this key: wait for it, not counted.
    Busy,
    /// The store or the provider could not do it now: not counted; the consumer
    /// pauses (see `health.rs`). `after`: when the provider asked to be called again.
    Infra {
        kind: InfraKind,
        after: Option<Duration>,
    },
}

impl Outcome {
    pub(crate) fn retry(cause: RetryCause, why: impl Into<String>) -> Outcome {
        Outcome::Retry(Retry {
            cause,
            why: why.into(),
        })
    }

    /// A store error of one message, by whose fault it is (see [`StoreError::failure`]):
    /// infrastructure → retry later without counting; the row refused for what it holds
    /// → `store_rejected` with the database's own words; anything else → a counted retry.
    pub fn of_store_error(e: &StoreError) -> Outcome {
        match e.failure() {
            Failure::Infrastructure => Outcome::retry(
                RetryCause::Infra {
                    // A fail-closed seen-set that is down pauses the consumer like a
                    // store outage, under its own cause (probed with its own ping).
                    kind: if matches!(e, StoreError::SeenSetUnavailable { .. }) {
                        InfraKind::SeenSet
                    } else {
                        InfraKind::Store
                    },
                    after: None,
                },
                e.to_string(),
            ),
            Failure::Content => {
                Outcome::Rejected(Rejection::new(RejectReason::StoreRejected, e.to_string()))
            }
            Failure::Other => Outcome::retry(RetryCause::Message, e.to_string()),
        }
    }
}

impl Outcome {
    /// How the delivery ends when the handler decided this (a rejection is
    /// dead-lettered by the runner).
    pub fn fate(&self) -> DeliveryOutcome {
        match self {
            Outcome::Processed { .. } => DeliveryOutcome::Processed,
            Outcome::Late => DeliveryOutcome::Late,
            Outcome::Duplicate => DeliveryOutcome::Duplicate,
            Outcome::Skipped => DeliveryOutcome::Skipped,
            Outcome::Rejected(_) => DeliveryOutcome::DeadLettered,
            Outcome::Retry(_) => DeliveryOutcome::Retry,
        }
    }
}

/// How one delivery ended, without the details an [`Outcome`] carries: the
/// `outcome` of a `DeliveryEvent` (JSON lines of `consume --json`, read back by the
/// drills), counted by the drills and the bench. Typed from the runner to the
/// JSON edge, where it is the snake_case word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryOutcome {
    /// The effect was applied.
    Processed,
    /// Kept in history only: older than the current state.
    Late,
    /// Already done: acked without effect.
    Duplicate,
    /// Not an event this consumer handles: acked.
    Skipped,
    /// Kept in `dead_letters` with its raw bytes, then acked.
    DeadLettered,
    /// Given back to the queue.
    Retry,
}

impl DeliveryOutcome {
    /// The word in JSON (the same as serde's).
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryOutcome::Processed => "processed",
            DeliveryOutcome::Late => "late",
            DeliveryOutcome::Duplicate => "duplicate",
            DeliveryOutcome::Skipped => "skipped",
            DeliveryOutcome::DeadLettered => "dead_lettered",
            DeliveryOutcome::Retry => "retry",
        }
    }
}

impl std::fmt::Display for DeliveryOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    #[error(transparent)]
    Crashed(#[from] Crashed),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What every consumer needs from the engine.
#[derive(Clone)]
pub struct Deps {
    pub store: Arc<dyn Store>,
    /// Where `seen-set` mode checks and records keys (the store's table or Redis).
    pub seen_set: GuardedSeenSet,
    pub provider: ProviderClient,
    pub metrics: Arc<Metrics>,
    /// A claim older than this without a result is in doubt (SPEC §3: 60 s).
    pub claim_lease: Duration,
    /// Provider calls of one batch in flight at once (`--provider-concurrency`).
    pub provider_concurrency: usize,
}

/// `--provider-concurrency`'s default: calls in flight per side-effect consumer.
/// Enough that a batch of 100 against a provider answering in 80 ms takes a few
/// round trips, not a hundred (BENCHMARKS.md, "Pipeline", has the measurement);
/// far below the hundreds of concurrent requests a real SMS API's rate limits
/// start to refuse.
pub const DEFAULT_PROVIDER_CONCURRENCY: usize = 32;

#[async_trait]
pub trait Consumer: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    fn mode(&self) -> ConsumerMode;
    /// Event types this consumer acts on; the rest are acked as skipped.
    fn wants(&self, event: EventType) -> bool;
    /// Handle one parsed message. Must give "the same result" when called twice.
    async fn handle(&self, env: &Message, crash: &CrashPlan) -> Result<Outcome, HandleError>;

    /// Handle several messages, one outcome each, in order. The default handles them
    /// one by one; a consumer whose effects are all in the database overrides it to
    /// commit the whole batch in one transaction (one fsync, not one per message).
    async fn handle_batch(
        &self,
        envs: &[Message],
        crash: &CrashPlan,
    ) -> Result<Vec<Outcome>, HandleError> {
        one_by_one(self, envs, crash).await
    }
}

/// [`Consumer::handle`] per message, in order: the default of
/// [`Consumer::handle_batch`], and the path of the modes a consumer does not batch.
pub(crate) async fn one_by_one<C: Consumer + ?Sized>(
    consumer: &C,
    envs: &[Message],
    crash: &CrashPlan,
) -> Result<Vec<Outcome>, HandleError> {
    let mut outcomes = Vec::with_capacity(envs.len());
    for env in envs {
        outcomes.push(match consumer.handle(env, crash).await {
            Ok(o) => o,
            // Only this message's fate; the ones before it are committed.
            Err(HandleError::Store(e)) => Outcome::of_store_error(&e),
            Err(crashed) => return Err(crashed),
        });
    }
    Ok(outcomes)
}

/// The names of the fleet consumers, in the order of the SPEC table.
pub const FLEET_CONSUMERS: [&str; 4] = [
    vehicle_state::NAME,
    trip_counter::NAME,
    zone_exit_sms::NAME,
    erp_webhook::NAME,
];

/// Each fleet consumer's risk class, from the field report's inventory.
pub fn risk_class(name: &str) -> Option<RiskClass> {
    match name {
        vehicle_state::NAME => Some(RiskClass::Natural),
        trip_counter::NAME => Some(RiskClass::Accumulation),
        zone_exit_sms::NAME | erp_webhook::NAME => Some(RiskClass::ExternalSideEffect),
        _ => None,
    }
}

/// Build one fleet consumer by name.
pub fn build(name: &str, deps: &Deps, mode: ConsumerMode) -> Option<Arc<dyn Consumer>> {
    let deps = deps.clone();
    Some(match name {
        vehicle_state::NAME => Arc::new(vehicle_state::VehicleStateConsumer::new(deps, mode)),
        trip_counter::NAME => Arc::new(trip_counter::TripCounter::new(deps, mode)),
        zone_exit_sms::NAME => Arc::new(zone_exit_sms::ZoneExitSms::new(deps, mode)),
        erp_webhook::NAME => Arc::new(erp_webhook::ErpWebhook::new(deps, mode)),
        _ => return None,
    })
}

/// All four fleet consumers in one mode.
pub fn fleet(deps: &Deps, mode: ConsumerMode) -> Vec<Arc<dyn Consumer>> {
    FLEET_CONSUMERS
        .iter()
        .filter_map(|n| build(n, deps, mode))
        .collect()
}
