//! Engine metrics (docs/CONTRACT.md §5), exposed in the Prometheus text format through the
//! `prometheus-client` crate.
//!
//! The same families are the engine's own source of truth for counts: `consume
//! --json` and the drills read them back instead of keeping a second tally.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use serde::Serialize;

use chrono::{DateTime, Utc};
use idemwatch_base::vocab::{InfraKind, PauseCause, RiskClass};

use super::envelope::RejectReason;
use super::mqtt_link::IngressErrorKind;
use super::store::Durability;

/// Kept here for the metrics' callers; the words live in [`idemwatch_base::vocab`].
pub use idemwatch_base::vocab::EffectResult;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsumerLabel {
    consumer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeadLetterLabel {
    consumer: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IngressLabel {
    source: String,
    dup_flag: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceErrorLabel {
    source: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceReasonLabel {
    source: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PausedLabel {
    consumer: String,
    cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InfraLabel {
    consumer: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabel {
    route: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EngineInfoLabel {
    durability: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EffectLabel {
    consumer: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RepeatLabel {
    consumer: String,
    reason: String,
}

/// Why the provider was called twice for one key: the `reason` label of
/// `idem_provider_repeat_calls_total`. The engine counts a second call where it has
/// proof of one, once per pair: the provider answering a call as a replay of an
/// earlier one with the same Idempotency-Key, or an owner that finds, recording its
/// accepted call, that another owner took its claim over meanwhile (and did not
/// count it). A provider that ignores the key, and an owner that died after its
/// call, leave no proof: the provider's own records are the truth there, as the
/// drills' and chaos run's verdicts read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RepeatReason {
    /// A claim taken over by a redelivery once its owner's lease ran out with no
    /// record (the owner died, froze, or lost the store): the expected price of a
    /// dead or frozen owner, at most the calls it had in flight.
    LeaseTakeover,
    /// The same, by the claim sweeper re-driving the claim from its kept message.
    SweeperRedrive,
    /// A retry after a call that failed or timed out (its claim given back): the
    /// provider had done the earlier call after all. A rise says the provider's
    /// timeout is shorter than its answers.
    ProviderRetry,
    /// None expected: the provider replayed a key the engine called as the key's
    /// first (a fresh claim). Should stay 0; a rise means a send the engine lost track
    /// of (a purged claim, a second store).
    Unexpected,
}

impl RepeatReason {
    /// Every reason, for the series exported at zero from the start.
    pub const ALL: [RepeatReason; 4] = [
        RepeatReason::LeaseTakeover,
        RepeatReason::SweeperRedrive,
        RepeatReason::ProviderRetry,
        RepeatReason::Unexpected,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RepeatReason::LeaseTakeover => "lease_takeover",
            RepeatReason::SweeperRedrive => "sweeper_redrive",
            RepeatReason::ProviderRetry => "provider_retry",
            RepeatReason::Unexpected => "unexpected",
        }
    }
}

/// Counts for one consumer, read back from the metric families.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ConsumerCounts {
    pub processed: u64,
    pub duplicate_dropped: u64,
    pub out_of_order: u64,
    pub dead_lettered: u64,
    pub redelivered: u64,
    pub side_effects_sent: u64,
    pub side_effects_suppressed: u64,
    pub side_effects_failed: u64,
    /// `idem_provider_repeat_calls_total`, every reason.
    pub provider_repeat_calls: u64,
}

impl ConsumerCounts {
    pub fn add(&mut self, other: &ConsumerCounts) {
        self.processed += other.processed;
        self.duplicate_dropped += other.duplicate_dropped;
        self.out_of_order += other.out_of_order;
        self.dead_lettered += other.dead_lettered;
        self.redelivered += other.redelivered;
        self.side_effects_sent += other.side_effects_sent;
        self.side_effects_suppressed += other.side_effects_suppressed;
        self.side_effects_failed += other.side_effects_failed;
        self.provider_repeat_calls += other.provider_repeat_calls;
    }
}

/// The engine's metric names, written once. Registration below, the dashboard's
/// default `MetricNames` (`idemwatch-monitor`'s config), the Prometheus recording rules
/// (`monitor::promql`) and the `live-redelivery` drill all read them from here, so a
/// rename cannot leave one of them scraping a family that no longer exists.
pub mod names {
    /// One metric family: the name it is registered under, and the name its samples
    /// are exposed under (prometheus-client appends `_total` to a counter's).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Name {
        pub family: &'static str,
        pub exposed: &'static str,
    }

    macro_rules! counter {
        ($(#[$doc:meta])* $id:ident = $family:literal) => {
            $(#[$doc])*
            pub const $id: Name = Name { family: $family, exposed: concat!($family, "_total") };
        };
    }
    macro_rules! gauge {
        ($(#[$doc:meta])* $id:ident = $family:literal) => {
            $(#[$doc])*
            pub const $id: Name = Name { family: $family, exposed: $family };
        };
    }

    counter!(PROCESSED = "idem_messages_processed");
    counter!(DUPLICATE_DROPPED = "idem_duplicate_dropped");
    counter!(REDELIVERED = "idem_messages_redelivered");
    counter!(OUT_OF_ORDER = "idem_out_of_order");
    counter!(DEAD_LETTERED = "idem_dead_lettered");
    counter!(SIDE_EFFECTS = "idem_side_effects");
    gauge!(CLAIMS_IN_DOUBT = "idem_side_effect_claims_in_doubt");
    /// A histogram: exposed as `_bucket`, `_sum` and `_count` series of this name.
    pub const HANDLER_DURATION: &str = "idem_handler_duration_seconds";
    counter!(HTTP_REQUESTS = "idem_http_requests");
    gauge!(ENGINE_INFO = "idem_engine_info");
    gauge!(PAUSED = "idem_consumer_paused");
    gauge!(PAUSED_SINCE = "idem_consumer_paused_since_seconds");
    gauge!(PAUSE_RETRIES = "idem_consumer_pause_retries");
    gauge!(BUSY_SINCE = "idem_consumer_busy_since_seconds");
    counter!(INFRA_ERRORS = "idem_infra_errors");
    gauge!(INFRA_ERROR_LAST = "idem_infra_error_last_seconds");
    gauge!(
        /// The standard process metric, exported by the engine itself.
        PROCESS_START = "process_start_time_seconds"
    );
    counter!(SEEN_SET_BYPASSED = "idem_seen_set_bypassed");
    counter!(INGRESS_MESSAGES = "idem_ingress_messages");
    counter!(
        /// Second provider calls for one key, by `reason` (docs/CONTRACT.md §9; see
        /// [`RepeatReason`](super::RepeatReason)).
        PROVIDER_REPEAT_CALLS = "idem_provider_repeat_calls"
    );

    gauge!(INGRESS_CONNECTED = "idem_ingress_connected");
    gauge!(INGRESS_STATE_SINCE = "idem_ingress_state_since_seconds");
    counter!(INGRESS_ERRORS = "idem_ingress_errors");
    gauge!(INGRESS_ERROR_LAST = "idem_ingress_error_last_seconds");
    counter!(INGRESS_DEAD_LETTERED = "idem_ingress_dead_lettered");
    /// A histogram: how long before a dropped duplicate its key had first been
    /// processed (docs/CONTRACT.md §5), buckets [`DUPLICATE_AGE_BUCKETS`](super::DUPLICATE_AGE_BUCKETS).
    pub const DUPLICATE_AGE: &str = "idem_duplicate_age_seconds";
    gauge!(
        /// The oldest of those ages this process has seen: a histogram cannot say
        /// its maximum, and the windows are judged on it.
        DUPLICATE_AGE_MAX = "idem_duplicate_age_max_seconds"
    );
    gauge!(
        /// The Redis seen-set's key TTL in seconds, when consumers run in seen-set mode
        /// over Redis: after it a key is forgotten and a copy is applied again.
        SEEN_SET_TTL = "idem_seen_set_ttl_seconds"
    );
    counter!(
        /// Duplicates whose first time the dedup layer did not keep (a Redis value
        /// written before it did): not in the histogram, counted here.
        DUPLICATE_AGE_UNKNOWN = "idem_duplicate_age_unknown"
    );

    /// Every family above but the histograms.
    pub const ALL: [Name; 27] = [
        PROCESSED,
        DUPLICATE_DROPPED,
        REDELIVERED,
        OUT_OF_ORDER,
        DEAD_LETTERED,
        SIDE_EFFECTS,
        CLAIMS_IN_DOUBT,
        HTTP_REQUESTS,
        ENGINE_INFO,
        PAUSED,
        PAUSED_SINCE,
        PAUSE_RETRIES,
        BUSY_SINCE,
        INFRA_ERRORS,
        INFRA_ERROR_LAST,
        PROCESS_START,
        SEEN_SET_BYPASSED,
        INGRESS_MESSAGES,
        PROVIDER_REPEAT_CALLS,
        INGRESS_CONNECTED,
        INGRESS_STATE_SINCE,
        INGRESS_ERRORS,
        INGRESS_ERROR_LAST,
        INGRESS_DEAD_LETTERED,
        DUPLICATE_AGE_MAX,
        DUPLICATE_AGE_UNKNOWN,
        SEEN_SET_TTL,
    ];
}

/// The engine's metric families and their registry.
pub struct Metrics {
    registry: Registry,
    processed: Family<ConsumerLabel, Counter>,
    duplicate_dropped: Family<ConsumerLabel, Counter>,
    redelivered: Family<ConsumerLabel, Counter>,
    out_of_order: Family<ConsumerLabel, Counter>,
    dead_lettered: Family<DeadLetterLabel, Counter>,
    side_effects: Family<EffectLabel, Counter>,
    claims_in_doubt: Family<ConsumerLabel, Gauge>,
    handler_duration: Family<ConsumerLabel, Histogram>,
    http_requests: Family<HttpLabel, Counter>,
    engine_info: Family<EngineInfoLabel, Gauge>,
    seen_set_bypassed: Family<ConsumerLabel, Counter>,
    ingress: Family<IngressLabel, Counter>,
    ingress_connected: Family<SourceLabel, Gauge>,
    ingress_state_since: Family<SourceLabel, Gauge>,
    ingress_errors: Family<SourceErrorLabel, Counter>,
    ingress_error_last: Family<SourceErrorLabel, Gauge>,
    ingress_dead_lettered: Family<SourceReasonLabel, Counter>,
    paused: Family<PausedLabel, Gauge>,
    paused_since: Family<ConsumerLabel, Gauge>,
    pause_retries: Family<ConsumerLabel, Gauge>,
    busy_since: Family<ConsumerLabel, Gauge>,
    infra_errors: Family<InfraLabel, Counter>,
    infra_error_last: Family<InfraLabel, Gauge>,
    provider_repeat_calls: Family<RepeatLabel, Counter>,
    duplicate_age: Family<ConsumerLabel, Histogram>,
    duplicate_age_max: Family<ConsumerLabel, Gauge<f64, AtomicU64>>,
    duplicate_age_unknown: Family<ConsumerLabel, Counter>,
    seen_set_ttl: Gauge<f64, AtomicU64>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let processed = Family::<ConsumerLabel, Counter>::default();
        let duplicate_dropped = Family::<ConsumerLabel, Counter>::default();
        let redelivered = Family::<ConsumerLabel, Counter>::default();
        let out_of_order = Family::<ConsumerLabel, Counter>::default();
        let dead_lettered = Family::<DeadLetterLabel, Counter>::default();
        let side_effects = Family::<EffectLabel, Counter>::default();
        let claims_in_doubt = Family::<ConsumerLabel, Gauge>::default();
        let http_requests = Family::<HttpLabel, Counter>::default();
        let handler_duration = Family::<ConsumerLabel, Histogram>::new_with_constructor(
            handler_histogram as fn() -> _,
        );
        let duplicate_age = Family::<ConsumerLabel, Histogram>::new_with_constructor(
            duplicate_age_histogram as fn() -> _,
        );
        let duplicate_age_max = Family::<ConsumerLabel, Gauge<f64, AtomicU64>>::default();
        let duplicate_age_unknown = Family::<ConsumerLabel, Counter>::default();
        let seen_set_ttl: Gauge<f64, AtomicU64> = Gauge::default();
        registry.register(
            names::DUPLICATE_AGE,
            "How long before a dropped duplicate its key had first been processed, per consumer",
            duplicate_age.clone(),
        );
        registry.register(
            names::DUPLICATE_AGE_MAX.family,
            "The oldest duplicate age this process has dropped, per consumer, in seconds",
            duplicate_age_max.clone(),
        );
        registry.register(
            names::DUPLICATE_AGE_UNKNOWN.family,
            "Duplicates dropped whose first-processed time the dedup layer did not keep",
            duplicate_age_unknown.clone(),
        );
        registry.register(
            names::SEEN_SET_TTL.family,
            "The Redis seen-set's key TTL in seconds (seen-set mode over Redis only)",
            seen_set_ttl.clone(),
        );
        // prometheus-client appends `_total` to counter names itself.
        registry.register(
            names::PROCESSED.family,
            "Messages whose effect was applied (first delivery of a key)",
            processed.clone(),
        );
        registry.register(
            names::DUPLICATE_DROPPED.family,
            "Redelivered or republished messages recognised as already done and acked without effect",
            duplicate_dropped.clone(),
        );
        registry.register(
            names::REDELIVERED.family,
            "Deliveries the queue marked as redelivered",
            redelivered.clone(),
        );
        registry.register(
            names::OUT_OF_ORDER.family,
            "Events older than the current state: kept in history, not applied",
            out_of_order.clone(),
        );
        registry.register(
            names::DEAD_LETTERED.family,
            "Messages moved to dead_letters, by reason",
            dead_lettered.clone(),
        );
        registry.register(
            names::SIDE_EFFECTS.family,
            "External side effects by result (sent, suppressed, failed)",
            side_effects.clone(),
        );
        registry.register(
            names::CLAIMS_IN_DOUBT.family,
            "Claims older than the lease without a recorded result: the send may or may not have happened",
            claims_in_doubt.clone(),
        );
        registry.register(
            names::HANDLER_DURATION,
            "Time from delivery to ack decision, per consumer",
            handler_duration.clone(),
        );
        registry.register(
            names::HTTP_REQUESTS.family,
            "Write requests at the HTTP edge by route and outcome (executed, replayed, conflict, mismatch, missing_key, invalid_key, invalid_request, too_large, timeout, overloaded, unauthorized, error)",
            http_requests.clone(),
        );
        // A gauge rather than OpenMetrics' `info` type: the classic text format (and
        // `promtool check metrics`) has no such type, and a gauge at 1 is the
        // Prometheus convention for `_info`.
        let engine_info = Family::<EngineInfoLabel, Gauge>::default();
        registry.register(
            names::ENGINE_INFO.family,
            "How this engine runs (durability: durable, or relaxed where a power cut can undo the last commits); always 1",
            engine_info.clone(),
        );
        let paused = Family::<PausedLabel, Gauge>::default();
        registry.register(
            names::PAUSED.family,
            "1 while the consumer stops leasing because its store or provider (cause) is unhealthy",
            paused.clone(),
        );
        let paused_since = Family::<ConsumerLabel, Gauge>::default();
        registry.register(
            names::PAUSED_SINCE.family,
            "When the consumer's current pause began, in seconds since the epoch; 0 while it runs",
            paused_since.clone(),
        );
        let pause_retries = Family::<ConsumerLabel, Gauge>::default();
        registry.register(
            names::PAUSE_RETRIES.family,
            "Failed tries in the consumer's current pause (the failure that began it, then each failed probe or trial); 0 while it runs",
            pause_retries.clone(),
        );
        let busy_since = Family::<ConsumerLabel, Gauge>::default();
        registry.register(
            names::BUSY_SINCE.family,
            "When the batch the consumer is handling was taken up, in seconds since the epoch; 0 between batches (a batch in hand for long is a wait on a peer that has not answered yet)",
            busy_since.clone(),
        );
        let infra_errors = Family::<InfraLabel, Counter>::default();
        registry.register(
            names::INFRA_ERRORS.family,
            "Infrastructure failures met by the consumer, by kind (store, queue, timeout: a deadline fired, provider_unreachable, provider_unavailable, provider_throttled, seen_set); none counts toward max_deliveries",
            infra_errors.clone(),
        );
        let infra_error_last = Family::<InfraLabel, Gauge>::default();
        registry.register(
            names::INFRA_ERROR_LAST.family,
            "When the consumer last met an infrastructure failure of this kind, in seconds since the epoch; 0 if never",
            infra_error_last.clone(),
        );
        let start: Gauge<f64, AtomicU64> = Gauge::default();
        start.set(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
        );
        registry.register(
            names::PROCESS_START.family,
            "Start time of the process since unix epoch in seconds",
            start,
        );
        let seen_set_bypassed = Family::<ConsumerLabel, Counter>::default();
        registry.register(
            names::SEEN_SET_BYPASSED.family,
            "Seen-set checks or records skipped because the seen-set was unreachable and the policy is fail-open",
            seen_set_bypassed.clone(),
        );
        let ingress = Family::<IngressLabel, Counter>::default();
        registry.register(
            names::INGRESS_MESSAGES.family,
            "Messages taken in from a device broker and put on the engine's queue, by source and the DUP flag they arrived with",
            ingress.clone(),
        );
        let provider_repeat_calls = Family::<RepeatLabel, Counter>::default();
        registry.register(
            names::PROVIDER_REPEAT_CALLS.family,
            "Second provider calls for one key, counted once per key where the engine has proof (the provider replayed, or an owner found its claim taken over while its call was out), by reason: lease_takeover (a claim taken over by a redelivery after its owner's lease ran out), sweeper_redrive (by the claim sweeper), provider_retry (a retry after a failed or timed-out call), unexpected (the provider replayed a key the engine called as new)",
            provider_repeat_calls.clone(),
        );
        let ingress_connected = Family::<SourceLabel, Gauge>::default();
        registry.register(
            names::INGRESS_CONNECTED.family,
            "1 while an ingress holds a connection to its broker, else 0",
            ingress_connected.clone(),
        );
        let ingress_state_since = Family::<SourceLabel, Gauge>::default();
        registry.register(
            names::INGRESS_STATE_SINCE.family,
            "When an ingress's current state (connected or not, idem_ingress_connected) began, in seconds since the epoch",
            ingress_state_since.clone(),
        );
        let ingress_errors = Family::<SourceErrorLabel, Counter>::default();
        registry.register(
            names::INGRESS_ERRORS.family,
            "Failures of an ingress by kind (connect, login_refused, tls, protocol, queue, store)",
            ingress_errors.clone(),
        );
        let ingress_error_last = Family::<SourceErrorLabel, Gauge>::default();
        registry.register(
            names::INGRESS_ERROR_LAST.family,
            "When an ingress last failed with this kind, in seconds since the epoch; 0 if never",
            ingress_error_last.clone(),
        );
        let ingress_dead_lettered = Family::<SourceReasonLabel, Counter>::default();
        registry.register(
            names::INGRESS_DEAD_LETTERED.family,
            "Messages an ingress could not put on the queue (too_large, malformed_json), kept in dead_letters and acked",
            ingress_dead_lettered.clone(),
        );
        let metrics = Metrics {
            registry,
            processed,
            duplicate_dropped,
            redelivered,
            out_of_order,
            dead_lettered,
            side_effects,
            claims_in_doubt,
            handler_duration,
            http_requests,
            engine_info,
            seen_set_bypassed,
            ingress,
            ingress_connected,
            ingress_state_since,
            ingress_errors,
            ingress_error_last,
            ingress_dead_lettered,
            paused,
            paused_since,
            pause_retries,
            busy_since,
            infra_errors,
            infra_error_last,
            provider_repeat_calls,
            duplicate_age,
            duplicate_age_max,
            duplicate_age_unknown,
            seen_set_ttl,
        };
        metrics.set_durability(Durability::default());
        metrics
    }

    /// `idem_engine_info{durability=…} 1`: exactly one series, the durability the
    /// engine's store runs with, so a dashboard can show a relaxed engine.
    pub fn set_durability(&self, durability: Durability) {
        self.engine_info.clear();
        self.engine_info
            .get_or_create(&EngineInfoLabel {
                durability: durability.as_str().to_string(),
            })
            .set(1);
    }

    /// Make every consumer's series visible at zero, so a scraper sees the consumer
    /// before its first message and rates start from a known point: every known dead
    /// letter `reason`, and every side-effect `result` of a consumer that has side
    /// effects (Prometheus' instrumentation guidance for known label values). Without
    /// the zero, the first dead letter creates its series at 1 and `rate()` or
    /// `increase()` over it stays 0: the one event that matters is invisible to a
    /// Prometheus alert. `risk` is the consumer's ([`consumers::risk_class`](crate::consumers::risk_class)
    /// for the fleet's).
    pub fn register_consumer(&self, consumer: &str, risk: Option<RiskClass>) {
        let l = label(consumer);
        drop(self.processed.get_or_create(&l));
        drop(self.duplicate_dropped.get_or_create(&l));
        drop(self.redelivered.get_or_create(&l));
        drop(self.out_of_order.get_or_create(&l));
        drop(self.claims_in_doubt.get_or_create(&l));
        drop(self.handler_duration.get_or_create(&l));
        drop(self.duplicate_age.get_or_create(&l));
        drop(self.duplicate_age_max.get_or_create(&l));
        drop(self.duplicate_age_unknown.get_or_create(&l));
        drop(self.seen_set_bypassed.get_or_create(&l));
        drop(self.paused_since.get_or_create(&l));
        drop(self.pause_retries.get_or_create(&l));
        drop(self.busy_since.get_or_create(&l));
        for cause in PauseCause::ALL {
            drop(self.paused.get_or_create(&paused_label(consumer, cause)));
        }
        for kind in InfraKind::ALL {
            drop(
                self.infra_errors
                    .get_or_create(&infra_label(consumer, kind)),
            );
            drop(
                self.infra_error_last
                    .get_or_create(&infra_label(consumer, kind)),
            );
        }
        for reason in RejectReason::ALL {
            drop(self.dead_lettered.get_or_create(&DeadLetterLabel {
                consumer: consumer.to_string(),
                reason: reason.as_str().to_string(),
            }));
        }
        if risk == Some(RiskClass::ExternalSideEffect) {
            for result in EffectResult::ALL {
                drop(self.side_effects.get_or_create(&EffectLabel {
                    consumer: consumer.to_string(),
                    result: result.as_str().to_string(),
                }));
            }
            for reason in RepeatReason::ALL {
                drop(
                    self.provider_repeat_calls
                        .get_or_create(&repeat_label(consumer, reason)),
                );
            }
        }
    }

    /// Every series of an ingress source at 0 from the start: both `dup_flag`s,
    /// every error kind, both reasons an ingress dead-letters with; disconnected
    /// since now.
    pub fn register_ingress(&self, source: &str) {
        for dup in [false, true] {
            drop(self.ingress.get_or_create(&ingress_label(source, dup)));
        }
        for kind in IngressErrorKind::ALL {
            let l = source_error(source, kind);
            drop(self.ingress_errors.get_or_create(&l));
            drop(self.ingress_error_last.get_or_create(&l));
        }
        for reason in INGRESS_REASONS {
            drop(
                self.ingress_dead_lettered
                    .get_or_create(&source_reason(source, reason)),
            );
        }
        self.set_ingress_connected(source, false);
    }

    /// The ingress connected to its broker (or lost it), now.
    pub fn set_ingress_connected(&self, source: &str, connected: bool) {
        let l = SourceLabel {
            source: source.to_string(),
        };
        self.ingress_connected
            .get_or_create(&l)
            .set(i64::from(connected));
        self.ingress_state_since
            .get_or_create(&l)
            .set(Utc::now().timestamp());
    }

    /// One failure of an ingress.
    pub fn ingress_error(&self, source: &str, kind: IngressErrorKind) {
        let l = source_error(source, kind);
        self.ingress_errors.get_or_create(&l).inc();
        self.ingress_error_last
            .get_or_create(&l)
            .set(Utc::now().timestamp());
    }

    /// Failures of an ingress of one kind so far.
    pub fn ingress_errors(&self, source: &str, kind: IngressErrorKind) -> u64 {
        self.ingress_errors
            .get(&source_error(source, kind))
            .map(|c| c.get())
            .unwrap_or(0)
    }

    /// One message an ingress dead-lettered instead of queueing it.
    pub fn ingress_dead_lettered(&self, source: &str, reason: RejectReason) {
        self.ingress_dead_lettered
            .get_or_create(&source_reason(source, reason))
            .inc();
    }

    /// `idem_ingress_dead_lettered_total` of one source and reason so far.
    pub fn ingress_dead_lettered_count(&self, source: &str, reason: RejectReason) -> u64 {
        self.ingress_dead_lettered
            .get(&source_reason(source, reason))
            .map(|c| c.get())
            .unwrap_or(0)
    }

    /// One message taken in from a device broker.
    pub fn ingress(&self, source: &str, dup_flag: bool) {
        self.ingress
            .get_or_create(&ingress_label(source, dup_flag))
            .inc();
    }

    /// `idem_ingress_messages_total` of one source and flag so far.
    pub fn ingress_count(&self, source: &str, dup_flag: bool) -> u64 {
        self.ingress
            .get(&ingress_label(source, dup_flag))
            .map(|c| c.get())
            .unwrap_or(0)
    }

    /// A seen-set call skipped under fail-open (Redis unreachable).
    pub fn seen_set_bypassed(&self, consumer: &str) {
        self.seen_set_bypassed.get_or_create(&label(consumer)).inc();
    }

    /// `idem_seen_set_bypassed_total` of one consumer so far.
    pub fn seen_set_bypassed_count(&self, consumer: &str) -> u64 {
        self.seen_set_bypassed
            .get(&label(consumer))
            .map(|c| c.get())
            .unwrap_or(0)
    }

    /// `idem_consumer_paused{cause}` to 1 with its start (`Some`), or back to 0.
    pub fn set_paused(&self, consumer: &str, cause: PauseCause, since: Option<DateTime<Utc>>) {
        self.paused
            .get_or_create(&paused_label(consumer, cause))
            .set(i64::from(since.is_some()));
        self.paused_since
            .get_or_create(&label(consumer))
            .set(since.map_or(0, |t| t.timestamp()));
    }

    /// `idem_consumer_pause_retries`: the failed tries of the current pause (0: none).
    pub fn set_pause_retries(&self, consumer: &str, failures: u32) {
        self.pause_retries
            .get_or_create(&label(consumer))
            .set(i64::from(failures));
    }

    /// `idem_consumer_busy_since_seconds`: a batch taken up at `since`, or none.
    pub fn set_busy(&self, consumer: &str, since: Option<DateTime<Utc>>) {
        self.busy_since
            .get_or_create(&label(consumer))
            .set(since.map_or(0, |t| t.timestamp()));
    }

    /// One infrastructure failure of `consumer`.
    pub fn infra_error(&self, consumer: &str, kind: InfraKind) {
        let l = infra_label(consumer, kind);
        self.infra_errors.get_or_create(&l).inc();
        self.infra_error_last
            .get_or_create(&l)
            .set(Utc::now().timestamp());
    }

    /// Infrastructure failures of one kind so far.
    pub fn infra_errors(&self, consumer: &str, kind: InfraKind) -> u64 {
        self.infra_errors
            .get(&infra_label(consumer, kind))
            .map(|c| c.get())
            .unwrap_or(0)
    }

    pub fn processed(&self, consumer: &str) {
        self.processed.get_or_create(&label(consumer)).inc();
    }

    pub fn duplicate_dropped(&self, consumer: &str) {
        self.duplicate_dropped.get_or_create(&label(consumer)).inc();
    }

    pub fn redelivered(&self, consumer: &str) {
        self.redelivered.get_or_create(&label(consumer)).inc();
    }

    pub fn out_of_order(&self, consumer: &str) {
        self.out_of_order.get_or_create(&label(consumer)).inc();
    }

    pub fn dead_lettered(&self, consumer: &str, reason: RejectReason) {
        self.dead_lettered
            .get_or_create(&DeadLetterLabel {
                consumer: consumer.to_string(),
                reason: reason.as_str().to_string(),
            })
            .inc();
    }

    pub fn side_effect(&self, consumer: &str, result: EffectResult) {
        self.side_effects
            .get_or_create(&EffectLabel {
                consumer: consumer.to_string(),
                result: result.as_str().to_string(),
            })
            .inc();
    }

    /// A second provider call for one key.
    pub fn provider_repeat_call(&self, consumer: &str, reason: RepeatReason) {
        self.provider_repeat_calls
            .get_or_create(&repeat_label(consumer, reason))
            .inc();
    }

    /// `idem_provider_repeat_calls_total` of one consumer and reason so far.
    pub fn provider_repeat_calls(&self, consumer: &str, reason: RepeatReason) -> u64 {
        self.provider_repeat_calls
            .get(&repeat_label(consumer, reason))
            .map(|c| c.get())
            .unwrap_or(0)
    }

    /// Make a route's outcome series visible at zero, so rates exist from the first
    /// retry on.
    pub fn register_http_route(&self, route: &str, outcomes: &[&str]) {
        for outcome in outcomes {
            drop(self.http_requests.get_or_create(&HttpLabel {
                route: route.to_string(),
                outcome: outcome.to_string(),
            }));
        }
    }

    /// One request at the HTTP edge.
    pub fn http_request(&self, route: &str, outcome: &str) {
        self.http_requests
            .get_or_create(&HttpLabel {
                route: route.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Requests of one route and outcome so far.
    pub fn http_requests(&self, route: &str, outcome: &str) -> u64 {
        self.http_requests
            .get(&HttpLabel {
                route: route.to_string(),
                outcome: outcome.to_string(),
            })
            .map(|c| c.get())
            .unwrap_or(0)
    }

    pub fn set_claims_in_doubt(&self, consumer: &str, n: i64) {
        self.claims_in_doubt.get_or_create(&label(consumer)).set(n);
    }

    /// A duplicate dropped whose key was first processed `age` ago (None: the dedup
    /// layer did not keep when): into the histogram and the maximum, or counted as
    /// unknown.
    pub fn duplicate_age(&self, consumer: &str, age: Option<Duration>) {
        let l = label(consumer);
        let Some(age) = age else {
            self.duplicate_age_unknown.get_or_create(&l).inc();
            return;
        };
        let seconds = age.as_secs_f64();
        self.duplicate_age.get_or_create(&l).observe(seconds);
        let max = self.duplicate_age_max.get_or_create(&l);
        // Raised only: a compare-and-swap loop would be exact under races, but two
        // consumers never share a label, and one consumer's batches are sequential.
        if seconds > max.get() {
            max.set(seconds);
        }
    }

    /// See [`names::SEEN_SET_TTL`].
    pub fn set_seen_set_ttl(&self, ttl: Duration) {
        self.seen_set_ttl.set(ttl.as_secs_f64());
    }

    /// The oldest duplicate age this process has seen for `consumer`, in seconds.
    pub fn duplicate_age_max(&self, consumer: &str) -> f64 {
        self.duplicate_age_max
            .get(&label(consumer))
            .map(|g| g.get())
            .unwrap_or(0.0)
    }

    pub fn observe_handler(&self, consumer: &str, seconds: f64) {
        self.handler_duration
            .get_or_create(&label(consumer))
            .observe(seconds);
    }

    /// The text exposition served on `/metrics`.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = self.encode_to(&mut out);
        out
    }

    /// The same exposition into any writer: the exporter streams it in pieces.
    /// Fails only when `out` does.
    pub fn encode_to(&self, out: &mut impl std::fmt::Write) -> std::fmt::Result {
        encode(out, &self.registry)
    }

    /// The classic Prometheus text format (0.0.4), for scrapers and tools that do not
    /// speak OpenMetrics (`promtool check metrics` among them).
    pub fn encode_prometheus_text(&self) -> String {
        openmetrics_to_prometheus_text(&self.encode())
    }

    /// Read one consumer's counts back from the families.
    pub fn counts(&self, consumer: &str) -> ConsumerCounts {
        let l = label(consumer);
        let dead_lettered = RejectReason::ALL
            .iter()
            .map(|r| {
                self.dead_lettered
                    .get(&DeadLetterLabel {
                        consumer: consumer.to_string(),
                        reason: r.as_str().to_string(),
                    })
                    .map(|c| c.get())
                    .unwrap_or(0)
            })
            .sum();
        let effect = |r: EffectResult| {
            self.side_effects
                .get(&EffectLabel {
                    consumer: consumer.to_string(),
                    result: r.as_str().to_string(),
                })
                .map(|c| c.get())
                .unwrap_or(0)
        };
        let get = |f: &Family<ConsumerLabel, Counter>| f.get(&l).map(|c| c.get()).unwrap_or(0);
        ConsumerCounts {
            processed: get(&self.processed),
            duplicate_dropped: get(&self.duplicate_dropped),
            out_of_order: get(&self.out_of_order),
            dead_lettered,
            redelivered: get(&self.redelivered),
            side_effects_sent: effect(EffectResult::Sent),
            side_effects_suppressed: effect(EffectResult::Suppressed),
            side_effects_failed: effect(EffectResult::Failed),
            provider_repeat_calls: RepeatReason::ALL
                .iter()
                .map(|r| self.provider_repeat_calls(consumer, *r))
                .sum(),
        }
    }

    /// Counts for several consumers and their sum.
    pub fn summary<'a>(&self, consumers: impl IntoIterator<Item = &'a str>) -> CountSummary {
        let mut total = ConsumerCounts::default();
        let mut per = BTreeMap::new();
        for c in consumers {
            let counts = self.counts(c);
            total.add(&counts);
            per.insert(c.to_string(), counts);
        }
        CountSummary {
            total,
            consumers: per,
        }
    }
}

/// `consume --until-idle --json`: totals flattened at the top, per consumer under
/// `"consumers"` (docs/CONTRACT.md §6).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CountSummary {
    #[serde(flatten)]
    pub total: ConsumerCounts,
    pub consumers: BTreeMap<String, ConsumerCounts>,
}

fn repeat_label(consumer: &str, reason: RepeatReason) -> RepeatLabel {
    RepeatLabel {
        consumer: consumer.to_string(),
        reason: reason.as_str().to_string(),
    }
}

/// The reasons an ingress dead-letters with (docs/CONTRACT.md §9 "Ingress poison"): what the queue
/// cannot take. Everything else about a message is for its consumers to judge.
pub const INGRESS_REASONS: [RejectReason; 2] =
    [RejectReason::TooLarge, RejectReason::MalformedJson];

fn source_error(source: &str, kind: IngressErrorKind) -> SourceErrorLabel {
    SourceErrorLabel {
        source: source.to_string(),
        kind: kind.as_str().to_string(),
    }
}

fn source_reason(source: &str, reason: RejectReason) -> SourceReasonLabel {
    SourceReasonLabel {
        source: source.to_string(),
        reason: reason.as_str().to_string(),
    }
}

fn ingress_label(source: &str, dup_flag: bool) -> IngressLabel {
    IngressLabel {
        source: source.to_string(),
        dup_flag: dup_flag.to_string(),
    }
}

/// Content type of [`Metrics::encode`].
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of [`Metrics::encode_prometheus_text`].
pub const PROMETHEUS_TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Rewrite prometheus-client's OpenMetrics output as the classic text format.
///
/// `prometheus-client` only speaks OpenMetrics, where a counter family `x` has samples
/// `x_total`; the classic format names the family after its samples and has no
/// `# EOF`, `# UNIT` or `_created`. The two formats differ only in those lines, so
/// this small rewrite is ours rather than a second metrics library.
pub fn openmetrics_to_prometheus_text(openmetrics: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.strip_suffix(" counter") {
                counters.insert(name.to_string());
            }
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = line
            .strip_prefix("# HELP ")
            .map(|r| ("# HELP ", r))
            .or_else(|| line.strip_prefix("# TYPE ").map(|r| ("# TYPE ", r)));
        if let Some((prefix, rest)) = meta {
            let name = rest.split(' ').next().unwrap_or("");
            if counters.contains(name) {
                out.push_str(prefix);
                out.push_str(name);
                out.push_str("_total");
                out.push_str(&rest[name.len()..]);
                out.push('\n');
                continue;
            }
        } else {
            let sample = line.split(['{', ' ']).next().unwrap_or("");
            if sample
                .strip_suffix("_created")
                .is_some_and(|family| counters.contains(family))
            {
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn label(consumer: &str) -> ConsumerLabel {
    ConsumerLabel {
        consumer: consumer.to_string(),
    }
}

fn paused_label(consumer: &str, cause: PauseCause) -> PausedLabel {
    PausedLabel {
        consumer: consumer.to_string(),
        cause: cause.as_str().to_string(),
    }
}

fn infra_label(consumer: &str, kind: InfraKind) -> InfraLabel {
    InfraLabel {
        consumer: consumer.to_string(),
        kind: kind.as_str().to_string(),
    }
}

/// `idem_duplicate_age_seconds`' buckets, 1 s to 30 days: the dedup windows in the
/// field (JetStream's 2 min duplicate window, a provider key's 24 h, the table's 7 d
/// retention) each fall between two of them.
pub const DUPLICATE_AGE_BUCKETS: [f64; 9] = [
    1.0, 10.0, 60.0, 600.0, 3600.0, 21600.0, 86400.0, 604800.0, 2592000.0,
];

fn duplicate_age_histogram() -> Histogram {
    Histogram::new(DUPLICATE_AGE_BUCKETS)
}

fn handler_histogram() -> Histogram {
    // 100 µs .. ~3 s
    Histogram::new(exponential_buckets(0.0001, 2.5, 12))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one list of names is what the registry exports: a family under its
    /// `family` name in OpenMetrics, under its `exposed` name in the classic text
    /// format the dashboard's defaults and the drills read.
    #[test]
    fn every_named_family_is_exported_under_its_names() {
        let m = Metrics::new();
        m.register_consumer("trip-counter", Some(RiskClass::Accumulation));
        m.register_consumer("zone-exit-sms", Some(RiskClass::ExternalSideEffect));
        // Families without a series are not written: give each one.
        m.side_effect("zone-exit-sms", EffectResult::Sent);
        m.register_http_route("/v1/notes", &["executed"]);
        m.register_ingress("mqtt");
        let (open, classic) = (m.encode(), m.encode_prometheus_text());
        for n in names::ALL {
            assert!(
                open.contains(&format!("# TYPE {} ", n.family)),
                "{n:?} in\n{open}"
            );
            assert!(
                classic.contains(&format!("# TYPE {} ", n.exposed)),
                "{n:?} in\n{classic}"
            );
        }
        assert!(open.contains(&format!("# TYPE {} histogram", names::HANDLER_DURATION)));
        assert!(open.contains(&format!("# TYPE {} histogram", names::DUPLICATE_AGE)));
    }

    /// An age lands in the first bucket at or above it, the maximum only rises, and
    /// an unknown age is counted apart, not as 0 s.
    #[test]
    fn a_duplicate_age_lands_in_its_bucket_and_raises_the_maximum() {
        let m = Metrics::new();
        m.register_consumer("trip-counter", Some(RiskClass::Accumulation));
        m.duplicate_age("trip-counter", Some(Duration::from_secs(90)));
        m.duplicate_age("trip-counter", Some(Duration::from_secs(5)));
        m.duplicate_age("trip-counter", None);
        let text = m.encode_prometheus_text();
        for line in [
            "idem_duplicate_age_seconds_bucket{le=\"10.0\",consumer=\"trip-counter\"} 1",
            "idem_duplicate_age_seconds_bucket{le=\"60.0\",consumer=\"trip-counter\"} 1",
            "idem_duplicate_age_seconds_bucket{le=\"600.0\",consumer=\"trip-counter\"} 2",
            "idem_duplicate_age_seconds_count{consumer=\"trip-counter\"} 2",
            "idem_duplicate_age_max_seconds{consumer=\"trip-counter\"} 90",
            "idem_duplicate_age_unknown_total{consumer=\"trip-counter\"} 1",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
        assert_eq!(m.duplicate_age_max("trip-counter"), 90.0);
    }

    #[test]
    fn exposition_has_spec_names() {
        let m = Metrics::new();
        m.register_consumer("trip-counter", Some(RiskClass::Accumulation));
        m.processed("trip-counter");
        m.duplicate_dropped("trip-counter");
        m.dead_lettered("trip-counter", RejectReason::MalformedJson);
        m.side_effect("zone-exit-sms", EffectResult::Sent);
        let text = m.encode();
        for name in [
            "idem_messages_processed_total{consumer=\"trip-counter\"} 1",
            "idem_duplicate_dropped_total{consumer=\"trip-counter\"} 1",
            "idem_messages_redelivered_total{consumer=\"trip-counter\"} 0",
            "idem_out_of_order_total",
            "idem_dead_lettered_total{consumer=\"trip-counter\",reason=\"malformed_json\"} 1",
            "idem_side_effects_total{consumer=\"zone-exit-sms\",result=\"sent\"} 1",
            "idem_side_effect_claims_in_doubt{consumer=\"trip-counter\"} 0",
            "idem_handler_duration_seconds_bucket",
            "process_start_time_seconds ",
            "idem_engine_info{durability=\"durable\"} 1",
            "idem_consumer_paused{consumer=\"trip-counter\",cause=\"store\"} 0",
            "idem_consumer_paused{consumer=\"trip-counter\",cause=\"provider\"} 0",
            "idem_consumer_paused_since_seconds{consumer=\"trip-counter\"} 0",
            "idem_infra_errors_total{consumer=\"trip-counter\",kind=\"provider_throttled\"} 0",
            "idem_infra_error_last_seconds{consumer=\"trip-counter\",kind=\"store\"} 0",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
        let classic = m.encode_prometheus_text();
        assert!(classic.contains("# TYPE idem_messages_processed_total counter\n"));
        assert!(classic.contains("# HELP idem_duplicate_dropped_total Redelivered"));
        assert!(classic.contains("# TYPE idem_handler_duration_seconds histogram\n"));
        assert!(!classic.contains("# EOF"));
        assert!(classic.contains("# TYPE idem_engine_info gauge\n"));
        m.set_durability(Durability::Relaxed);
        let text = m.encode();
        assert!(text.contains("idem_engine_info{durability=\"relaxed\"} 1"));
        assert!(
            !text.contains("durability=\"durable\""),
            "one series only:\n{text}"
        );
        let c = m.counts("trip-counter");
        assert_eq!(
            (c.processed, c.duplicate_dropped, c.dead_lettered),
            (1, 1, 1)
        );
    }
}
