//! `erp-webhook`: one POST to the customer's ERP per trip end (`ignition_off`).
//! External side effect: two-phase claim plus an `Idempotency-Key` header.

use async_trait::async_trait;

use super::{side_effect, Consumer, ConsumerMode, Deps, HandleError, Outcome};
use crate::crash::CrashPlan;
use crate::envelope::{rfc3339, EventType, Message};

pub const NAME: &str = "erp-webhook";

pub struct ErpWebhook {
    deps: Deps,
    mode: ConsumerMode,
}

impl ErpWebhook {
    pub fn new(deps: Deps, mode: ConsumerMode) -> Self {
        ErpWebhook { deps, mode }
    }
}

/// The webhook body: a pure function of the event, so a resend is byte-identical.
pub fn trip_end_body(env: &Message) -> serde_json::Value {
    serde_json::json!({
        "event": "trip_end",
        "device_id": env.device_id,
        "seq": env.seq,
        "message_key": env.key(),
        "occurred_at": rfc3339(&env.occurred_at),
    })
}

#[async_trait]
impl Consumer for ErpWebhook {
    fn name(&self) -> &'static str {
        NAME
    }

    fn mode(&self) -> ConsumerMode {
        self.mode
    }

    fn wants(&self, event: EventType) -> bool {
        event == EventType::IgnitionOff
    }

    /// Idempotent: the batch's claims and results in one transaction each, its
    /// webhooks posted concurrently (see [`side_effect::perform_batch`]).
    async fn handle_batch(
        &self,
        envs: &[Message],
        crash: &CrashPlan,
    ) -> Result<Vec<Outcome>, HandleError> {
        if self.mode != ConsumerMode::Idempotent {
            return super::one_by_one(self, envs, crash).await;
        }
        let all: Vec<&Message> = envs.iter().collect();
        let provider = &self.deps.provider;
        let caller = side_effect::Caller::Delivery;
        side_effect::perform_batch(NAME, &self.deps, &all, crash, caller, |env, key| {
            let body = trip_end_body(env);
            async move { provider.post_webhook(&body, Some(&key)).await }
        })
        .await
    }

    async fn handle(&self, env: &Message, crash: &CrashPlan) -> Result<Outcome, HandleError> {
        self.post(env, crash, side_effect::Caller::Delivery).await
    }

    async fn redrive(&self, env: &Message) -> Result<Outcome, HandleError> {
        self.post(env, &CrashPlan::none(), side_effect::Caller::Sweeper)
            .await
    }
}

impl ErpWebhook {
    /// One message's webhook, for a delivery or the claim sweeper.
    async fn post(
        &self,
        env: &Message,
        crash: &CrashPlan,
        caller: side_effect::Caller,
    ) -> Result<Outcome, HandleError> {
        let body = trip_end_body(env);
        let provider = &self.deps.provider;
        let mode = self.mode;
        side_effect::perform(
            NAME,
            &self.deps,
            mode,
            env,
            crash,
            caller,
            |key| async move { provider.post_webhook(&body, key.as_deref()).await },
        )
        .await
    }
}
