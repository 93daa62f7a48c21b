//! The four fleet consumers of the field report (docs/CONTRACT.md §2), one file each.
//!
//! The review rule for every consumer: "what happens if I call this handler twice
//! with the same message?" The answer must be "the same result"; the property tests
//! in `tests/twice.rs` ask it of every consumer here.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemwatch_base::vocab::{EffectResult, InfraKind};
use serde::{Deserialize, Serialize};

use super::crash::{CrashPlan, Crashed};
use super::envelope::{EventType, Message, RejectReason, Rejection};
use super::metrics::Metrics;
use super::provider::ProviderClient;
use super::seen_set::GuardedSeenSet;
use super::store::{Failure, Store, StoreError};

mod custody;
pub mod erp_webhook;
mod holding;
mod side_effect;
pub mod trip_counter;
pub mod vehicle_state;
pub mod zone_exit_sms;

pub use custody::Custody;
pub(crate) use side_effect::record_kept;
pub use side_effect::{claim_request, provider_key};

/// Kept here for the consumers' callers; the words live in [`idemwatch_base::vocab`].
pub use idemwatch_base::vocab::RiskClass;

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
/// `max_deliveries` (docs/CONTRACT.md §8): an outage or a throttling provider says nothing about
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
                    kind: e.infra_kind(),
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
    /// A claim older than this without a result is in doubt (docs/CONTRACT.md §3: 60 s).
    pub claim_lease: Duration,
    /// Provider calls of one batch in flight at once (`--provider-concurrency`).
    pub provider_concurrency: usize,
    /// The claims this process holds between the claim and the record, and the
    /// provider answers it could not record yet: one per engine (see `custody.rs`).
    pub custody: Arc<Custody>,
}

/// How long a claim may stay without a result before it is in doubt (docs/CONTRACT.md
/// §3: 60 s): the engine's, `claims`' and `purge`'s `--claim-lease`, the
/// dashboard's `database.claim_lease` and the cap of the runner's retry back-off.
pub const DEFAULT_CLAIM_LEASE: Duration = Duration::from_secs(60);

/// `--provider-concurrency`'s default: calls in flight per side-effect consumer.
/// Enough that a batch of 100 against a provider answering in 80 ms takes a few
/// round trips, not a hundred (docs/journal/benchmarks-2026-11-30-to-12-05.md, "The whole pipeline", has the measurement);
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

    /// Handle a message the claim sweeper re-drives from its claim (no delivery of it
    /// is in hand). The same as [`Consumer::handle`]; a consumer with side effects
    /// counts a repeat call made here as the sweeper's
    /// (`idem_provider_repeat_calls_total{reason="sweeper_redrive"}`).
    async fn redrive(&self, env: &Message) -> Result<Outcome, HandleError> {
        self.handle(env, &CrashPlan::none()).await
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

/// The names of the fleet consumers, in the order of docs/CONTRACT.md §2's table.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Envelope;
    use crate::seen_set::SeenSetConfig;

    /// Deps over a real SQLite store in `dir` (nothing here reaches a provider).
    pub(super) async fn deps(dir: &tempfile::TempDir) -> Deps {
        let url = format!("sqlite://{}", dir.path().join("consumers.db").display());
        let store = super::super::store::open(&url).await.unwrap();
        let metrics = Arc::new(Metrics::new());
        Deps {
            seen_set: GuardedSeenSet::open(
                &SeenSetConfig::default(),
                store.clone(),
                metrics.clone(),
            )
            .unwrap(),
            store,
            provider: ProviderClient::new("http://127.0.0.1:9", "http://127.0.0.1:9"),
            metrics,
            claim_lease: Duration::from_secs(60),
            provider_concurrency: 1,
            custody: Arc::default(),
        }
    }

    /// `sql` run on `dir`'s store database beside the store (a trigger that makes the
    /// database refuse or fail a statement: nothing a consumer could know).
    pub(super) fn exec(dir: &tempfile::TempDir, sql: &str) {
        let db = rusqlite::Connection::open(dir.path().join("consumers.db")).unwrap();
        db.execute_batch(sql).expect(sql);
    }

    const MODES: [ConsumerMode; 3] = [
        ConsumerMode::Idempotent,
        ConsumerMode::SeenSet,
        ConsumerMode::Naive,
    ];

    /// docs/CONTRACT.md §2's table, consumer by consumer: its name, the events it acts on (the
    /// rest the runner acks as skipped without calling it), its risk class, and the
    /// mode it was built in — which the claim sweeper reads to re-drive the claims of
    /// idempotent consumers only (a naive or seen-set handler must never send for a
    /// claim it did not take).
    #[tokio::test]
    async fn each_fleet_consumer_is_built_as_the_spec_table_says() {
        let dir = tempfile::tempdir().unwrap();
        let deps = deps(&dir).await;
        use EventType::*;
        let table: [(&str, &[EventType], RiskClass); 4] = [
            ("vehicle-state", &EventType::ALL, RiskClass::Natural),
            ("trip-counter", &[ZoneExit], RiskClass::Accumulation),
            ("zone-exit-sms", &[ZoneExit], RiskClass::ExternalSideEffect),
            ("erp-webhook", &[IgnitionOff], RiskClass::ExternalSideEffect),
        ];
        assert_eq!(FLEET_CONSUMERS, table.map(|(name, _, _)| name));
        for mode in MODES {
            let built = fleet(&deps, mode);
            assert_eq!(built.len(), table.len());
            for ((name, wanted, risk), consumer) in table.iter().zip(&built) {
                assert_eq!((consumer.name(), consumer.mode()), (*name, mode));
                let one = build(name, &deps, mode).expect("a fleet consumer builds");
                assert_eq!((one.name(), one.mode()), (*name, mode));
                for event in EventType::ALL {
                    assert_eq!(
                        one.wants(event),
                        wanted.contains(&event),
                        "{name} wants {event}?"
                    );
                }
                assert_eq!(risk_class(name), Some(*risk), "{name}");
            }
        }
        assert!(build("sms-to-everyone", &deps, ConsumerMode::Idempotent).is_none());
        assert_eq!(risk_class("sms-to-everyone"), None);
    }

    /// The words are what the inventory shows and what `--mode` and the JSON take:
    /// a mode reads as its serde (and command-line) name, an outcome as its JSON word.
    #[test]
    fn modes_outcomes_and_risk_classes_keep_their_words() {
        for mode in MODES {
            assert_eq!(serde_json::json!(mode), mode.as_str());
        }
        assert_eq!(
            MODES.map(ConsumerMode::as_str),
            ["idempotent", "seen-set", "naive"]
        );
        let outcomes = [
            DeliveryOutcome::Processed,
            DeliveryOutcome::Late,
            DeliveryOutcome::Duplicate,
            DeliveryOutcome::Skipped,
            DeliveryOutcome::DeadLettered,
            DeliveryOutcome::Retry,
        ];
        for o in outcomes {
            assert_eq!(serde_json::json!(o), o.as_str());
            assert_eq!(o.to_string(), o.as_str());
        }
        assert_eq!(
            outcomes.map(DeliveryOutcome::as_str),
            [
                "processed",
                "late",
                "duplicate",
                "skipped",
                "dead_lettered",
                "retry"
            ]
        );
        assert_eq!(
            [
                RiskClass::Natural,
                RiskClass::Accumulation,
                RiskClass::ExternalSideEffect
            ]
            .map(RiskClass::as_str),
            ["natural", "accumulation", "external side effect"]
        );
    }

    /// A consumer that handles one message at a time and fails the store on odd seqs
    /// with the error its `seq` names.
    struct OneAtATime;

    #[async_trait]
    impl Consumer for OneAtATime {
        fn name(&self) -> &'static str {
            "one-at-a-time"
        }
        fn mode(&self) -> ConsumerMode {
            ConsumerMode::Idempotent
        }
        fn wants(&self, _event: EventType) -> bool {
            true
        }
        async fn handle(&self, env: &Message, _crash: &CrashPlan) -> Result<Outcome, HandleError> {
            match env.seq {
                1 => Err(StoreError::OutOfRange {
                    what: "seq",
                    value: "1".into(),
                }
                .into()),
                3 => Err(StoreError::RowVanished {
                    key: env.key().to_string(),
                }
                .into()),
                5 => Err(StoreError::Internal("a bug").into()),
                _ => Ok(Outcome::Duplicate),
            }
        }
    }

    /// The default `handle_batch` decides each message alone, in order: one message's
    /// store error is that message's fate (by whose fault it is), never its
    /// neighbours'.
    #[tokio::test]
    async fn the_default_batch_is_each_message_alone_in_order() {
        let messages: Vec<Message> = (0..7)
            .map(|seq| {
                Message::new(Envelope {
                    message_id: None,
                    device_id: "34-ONE-1".into(),
                    seq,
                    event_type: EventType::IgnitionOn,
                    occurred_at: chrono::DateTime::from_timestamp(1_764_475_923, 0).unwrap(),
                    payload: Default::default(),
                })
            })
            .collect();
        let outcomes = OneAtATime
            .handle_batch(&messages, &CrashPlan::none())
            .await
            .unwrap();
        let fates: Vec<String> = outcomes
            .iter()
            .map(|o| match o {
                Outcome::Rejected(r) => r.reason.to_string(),
                Outcome::Retry(r) => format!("{:?}", r.cause),
                o => o.fate().to_string(),
            })
            .collect();
        assert_eq!(
            fates,
            [
                "duplicate",
                "store_rejected",
                "duplicate",
                "Infra { kind: Store, after: None }",
                "duplicate",
                "Message",
                "duplicate"
            ]
        );
    }

    pub(super) fn zone_exit(device: &str, seq: u64, zone: &str) -> Message {
        let line = format!(
            r#"{{"device_id":"{device}","seq":{seq},"event_type":"zone_exit","occurred_at":"2026-11-30T07:12:03+03:00","payload":{{"zone":"{zone}","phone":"+905551112233"}}}}"#
        );
        Message::parse(line.as_bytes()).unwrap()
    }

    /// What the provider receives names the event, and is the same for every
    /// delivery of it (a resend must be byte-identical for the provider to replay it):
    /// the SMS says which vehicle left which zone when (in UTC), the ERP's trip end
    /// carries the device, seq, key and time it can file the trip under.
    #[test]
    fn what_the_provider_receives_names_the_event() {
        let exit = zone_exit("34-TXT-1", 7, "Kadıköy");
        assert_eq!(
            zone_exit_sms::sms_text(&exit),
            "Your vehicle 34-TXT-1 left zone Kadıköy at 2026-11-30T04:12:03Z."
        );
        assert_eq!(
            zone_exit_sms::sms_text(&zone_exit("34-TXT-1", 7, "Kadıköy")),
            zone_exit_sms::sms_text(&exit)
        );
        assert_eq!(
            erp_webhook::trip_end_body(&exit),
            serde_json::json!({
                "event": "trip_end",
                "device_id": "34-TXT-1",
                "seq": 7,
                "message_key": "34-TXT-1:7:zone_exit",
                "occurred_at": "2026-11-30T04:12:03Z",
            })
        );
    }

    /// The provider key is derived from the consumer and the message key alone (the
    /// same after the claim row is gone), differs per consumer and per event, and
    /// keeps its stored form: a new form would make the provider send again what it
    /// already sent under the old key.
    #[test]
    fn the_provider_key_is_one_per_consumer_and_event_and_keeps_its_form() {
        let key = zone_exit("34-PK-1", 1, "X").key().clone();
        let other = zone_exit("34-PK-1", 2, "X").key().clone();
        let k = provider_key(zone_exit_sms::NAME, &key);
        assert_eq!(k, "idemwatch-7544aacb71cb928c575b2d9032d00671");
        assert_eq!(provider_key(zone_exit_sms::NAME, &key), k);
        assert_ne!(provider_key(erp_webhook::NAME, &key), k);
        assert_ne!(provider_key(zone_exit_sms::NAME, &other), k);
        let exit = zone_exit("34-PK-1", 1, "X");
        let request = claim_request(zone_exit_sms::NAME, &exit);
        assert_eq!((&request.key, &request.provider_key), (&key, &k));
        assert_eq!(&request.fingerprint, exit.fingerprint());
        assert_eq!(request.message, exit.to_json_line().into_bytes());
    }

    /// An event of `event_type` from `device` at `seq`, with a zone and, when given,
    /// a phone to notify.
    fn event(device: &str, seq: u64, event_type: &str, phone: Option<&str>) -> Message {
        let phone = phone
            .map(|p| format!(r#","phone":"{p}""#))
            .unwrap_or_default();
        let line = format!(
            r#"{{"device_id":"{device}","seq":{seq},"event_type":"{event_type}","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X"{phone}}}}}"#
        );
        Message::parse(line.as_bytes()).unwrap()
    }

    fn applied() -> Outcome {
        Outcome::Processed {
            effect: None,
            took_over_in_doubt: false,
        }
    }

    /// `consumer`'s batch of `envs`, which must succeed.
    async fn batch(consumer: &dyn Consumer, envs: &[Message]) -> Vec<Outcome> {
        consumer
            .handle_batch(envs, &CrashPlan::none())
            .await
            .unwrap()
    }

    /// `env` delivered three times to `consumer`: in a batch of its own, again, then
    /// alone; `first` the first time, `then` after.
    async fn three_deliveries(
        consumer: &dyn Consumer,
        env: &Message,
        first: Outcome,
        then: &Outcome,
    ) {
        let (name, mode) = (consumer.name(), consumer.mode());
        let one = std::slice::from_ref(env);
        assert_eq!(batch(consumer, one).await, [first], "{name} {mode:?}");
        let again = batch(consumer, one).await;
        assert_eq!(again, std::slice::from_ref(then), "{name} {mode:?}");
        let alone = consumer.handle(env, &CrashPlan::none()).await.unwrap();
        assert_eq!(&alone, then, "{name} {mode:?}");
    }

    /// trip-counter: idempotent, a zone exit counts once however often it comes, in a
    /// batch or alone; naive (drills only) counts every delivery — its batch is one
    /// by one, never the deduplicating batch.
    #[tokio::test]
    async fn the_trip_counter_counts_a_zone_exit_once_unless_naive() {
        let dir = tempfile::tempdir().unwrap();
        let deps = deps(&dir).await;
        for (mode, device, then, counted) in [
            (ConsumerMode::Idempotent, "34-TC-I", Outcome::Duplicate, 1),
            (ConsumerMode::Naive, "34-TC-N", applied(), 3),
        ] {
            let counter = build(trip_counter::NAME, &deps, mode).unwrap();
            let exit = event(device, 1, "zone_exit", None);
            three_deliveries(&*counter, &exit, applied(), &then).await;
            let zone_exits = deps.store.zone_exits(device).await.unwrap();
            assert_eq!(zone_exits, counted, "{mode:?}");
        }
    }

    /// vehicle-state: guarded (idempotent, and seen-set, which runs guarded), an event
    /// older than the state is late, in a batch or alone; naive (drills only) applies
    /// it over the newer state — its batch is one by one, never the guarded batch.
    #[tokio::test]
    async fn vehicle_state_keeps_the_newest_event_unless_naive() {
        let dir = tempfile::tempdir().unwrap();
        let deps = deps(&dir).await;
        for (mode, device) in MODES.into_iter().zip(["34-VS-I", "34-VS-S", "34-VS-N"]) {
            let state = build(vehicle_state::NAME, &deps, mode).unwrap();
            let naive = mode == ConsumerMode::Naive;
            let late = if naive { applied() } else { Outcome::Late };
            let newest = [event(device, 5, "ignition_on", None)];
            assert_eq!(batch(&*state, &newest).await, [applied()], "{mode:?}");
            let older = [event(device, 3, "ignition_off", None)];
            let outcomes = batch(&*state, &older).await;
            assert_eq!(outcomes, std::slice::from_ref(&late), "{mode:?}");
            let oldest = event(device, 2, "zone_enter", None);
            let alone = state.handle(&oldest, &CrashPlan::none()).await.unwrap();
            assert_eq!(alone, late, "{mode:?}");
            let last = deps.store.vehicle_state(device).await.unwrap().unwrap();
            assert_eq!(last.last_seq, if naive { 2 } else { 5 }, "{mode:?}");
        }
    }
}
