//! `zone-exit-sms`: "your vehicle left zone X" — the consumer of the 7-SMS incident.
//! External side effect: two-phase claim plus the provider's Idempotency-Key.

use async_trait::async_trait;

use super::{side_effect, Consumer, ConsumerMode, Deps, HandleError, Outcome, RetryCause};
use crate::crash::CrashPlan;
use crate::envelope::{rfc3339, Envelope, EventType, Message};

pub const NAME: &str = "zone-exit-sms";

pub struct ZoneExitSms {
    deps: Deps,
    mode: ConsumerMode,
}

impl ZoneExitSms {
    pub fn new(deps: Deps, mode: ConsumerMode) -> Self {
        ZoneExitSms { deps, mode }
    }
}

/// The SMS text: a pure function of the event, so a resend is byte-identical.
pub fn sms_text(env: &Envelope) -> String {
    format!(
        "Your vehicle {} left zone {} at {}.",
        env.device_id,
        env.zone().unwrap_or("?"),
        rfc3339(&env.occurred_at)
    )
}

#[async_trait]
impl Consumer for ZoneExitSms {
    fn name(&self) -> &'static str {
        NAME
    }

    fn mode(&self) -> ConsumerMode {
        self.mode
    }

    fn wants(&self, event: EventType) -> bool {
        event == EventType::ZoneExit
    }

    /// Idempotent: the batch's claims and results in one transaction each, its SMS
    /// sent concurrently (see [`side_effect::perform_batch`]).
    async fn handle_batch(
        &self,
        envs: &[Message],
        crash: &CrashPlan,
    ) -> Result<Vec<Outcome>, HandleError> {
        if self.mode != ConsumerMode::Idempotent {
            return super::one_by_one(self, envs, crash).await;
        }
        let notify: Vec<&Message> = envs.iter().filter(|e| e.phone().is_some()).collect();
        let provider = &self.deps.provider;
        let caller = side_effect::Caller::Delivery;
        let mut sent =
            side_effect::perform_batch(NAME, &self.deps, &notify, crash, caller, |env, key| {
                let text = sms_text(env);
                let phone = env.phone().unwrap_or_default();
                async move { provider.send_sms(phone, &text, Some(&key)).await }
            })
            .await?
            .into_iter();
        Ok(envs
            .iter()
            .map(|e| match e.phone() {
                Some(_) => sent
                    .next()
                    .unwrap_or_else(|| Outcome::retry(RetryCause::Message, "no outcome decided")),
                None => Outcome::Skipped,
            })
            .collect())
    }

    async fn handle(&self, env: &Message, crash: &CrashPlan) -> Result<Outcome, HandleError> {
        self.notify(env, crash, side_effect::Caller::Delivery).await
    }

    async fn redrive(&self, env: &Message) -> Result<Outcome, HandleError> {
        self.notify(env, &CrashPlan::none(), side_effect::Caller::Sweeper)
            .await
    }
}

impl ZoneExitSms {
    /// One message's SMS, for a delivery or the claim sweeper.
    async fn notify(
        &self,
        env: &Message,
        crash: &CrashPlan,
        caller: side_effect::Caller,
    ) -> Result<Outcome, HandleError> {
        let Some(phone) = env.phone() else {
            // Nobody to notify: nothing to do, and nothing to do twice.
            return Ok(Outcome::Skipped);
        };
        let text = sms_text(env);
        let provider = &self.deps.provider;
        let mode = self.mode;
        side_effect::perform(
            NAME,
            &self.deps,
            mode,
            env,
            crash,
            caller,
            |key| async move { provider.send_sms(phone, &text, key.as_deref()).await },
        )
        .await
    }
}
