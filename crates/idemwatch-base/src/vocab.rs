//! The words the engine's metrics, its consumers, its health breaker and the dashboard
//! share: a consumer's risk class, what kind of infrastructure failed, why a consumer
//! is paused, what a side effect came to. Each is a label value of an exported metric
//! family (docs/CONTRACT.md §5) or a field of a delivery event.
//!
//! They sit below every module that names them, so the metrics need not import the
//! consumers or the breaker that import the metrics (that was an import circle).

use serde::Serialize;

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

/// What happened to one side-effect attempt, the `result` label of
/// `idem_side_effects_total`, and the `effect` of a delivery event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EffectResult {
    /// The provider accepted a new send.
    Sent,
    /// Nothing went out: our claim said `sent` already, or the provider recognised the
    /// Idempotency-Key and replayed its first answer.
    Suppressed,
    /// The provider refused it for good (4xx); recorded as `failed`.
    Failed,
}

impl EffectResult {
    /// Every result, for the series exported at zero from the start.
    pub const ALL: [EffectResult; 3] = [
        EffectResult::Sent,
        EffectResult::Suppressed,
        EffectResult::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EffectResult::Sent => "sent",
            EffectResult::Suppressed => "suppressed",
            EffectResult::Failed => "failed",
        }
    }
}

/// What is unhealthy: the `cause` label of `idem_consumer_paused`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseCause {
    Store,
    /// The queue or the broker link: a lease, ack or give-back failed or went
    /// unanswered.
    Queue,
    Provider,
    /// The seen-set outside the database (Redis) of a fail-closed `seen-set` consumer.
    SeenSet,
}

impl PauseCause {
    pub const ALL: [PauseCause; 4] = [
        PauseCause::Store,
        PauseCause::Queue,
        PauseCause::Provider,
        PauseCause::SeenSet,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PauseCause::Store => "store",
            PauseCause::Queue => "queue",
            PauseCause::Provider => "provider",
            PauseCause::SeenSet => "seen_set",
        }
    }
}

/// One infrastructure failure: the `kind` label of `idem_infra_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InfraKind {
    /// The database, or the way to it: unreachable, reset, locked, full, refused.
    Store,
    /// The queue or the broker link failed (connection lost, refused, closed).
    Queue,
    /// A deadline fired (docs/CONTRACT.md §9, `kind="timeout"`): the peer of the cause said
    /// nothing in time — a statement, a lock wait, a pool, a broker request, a Redis
    /// command, a provider call. The consumer pauses under that cause and tries again
    /// on a fresh connection.
    Timeout(PauseCause),
    /// No answer from the provider (connect refused, reset): the request may or may
    /// not have reached it.
    ProviderUnreachable,
    /// The provider answered 5xx.
    ProviderUnavailable,
    /// The provider answered 408, 425 or 429: slow down.
    ProviderThrottled,
    /// A fail-closed seen-set (Redis) could not answer: unreachable, reset.
    SeenSet,
}

impl InfraKind {
    /// One of each label (every `timeout` shares one, whatever its cause): the
    /// series exported at zero from the start.
    pub const ALL: [InfraKind; 7] = [
        InfraKind::Store,
        InfraKind::Queue,
        InfraKind::Timeout(PauseCause::Store),
        InfraKind::ProviderUnreachable,
        InfraKind::ProviderUnavailable,
        InfraKind::ProviderThrottled,
        InfraKind::SeenSet,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            InfraKind::Store => "store",
            InfraKind::Queue => "queue",
            InfraKind::Timeout(_) => "timeout",
            InfraKind::ProviderUnreachable => "provider_unreachable",
            InfraKind::ProviderUnavailable => "provider_unavailable",
            InfraKind::ProviderThrottled => "provider_throttled",
            InfraKind::SeenSet => "seen_set",
        }
    }

    /// The kind a `kind` label names (`timeout` reads as a store timeout: the label
    /// does not carry the cause).
    pub fn parse(s: &str) -> Option<InfraKind> {
        InfraKind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    pub fn cause(self) -> PauseCause {
        match self {
            InfraKind::Store => PauseCause::Store,
            InfraKind::Queue => PauseCause::Queue,
            InfraKind::Timeout(cause) => cause,
            InfraKind::SeenSet => PauseCause::SeenSet,
            InfraKind::ProviderUnreachable
            | InfraKind::ProviderUnavailable
            | InfraKind::ProviderThrottled => PauseCause::Provider,
        }
    }
}

/// As its label (every `timeout` is `"timeout"`, whatever its cause).
impl Serialize for InfraKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}
