//! `vehicle-state`: the vehicle's current state plus its full history.
//! Naturally idempotent: a seq-guarded upsert and an insert-once history row; no
//! dedup row needed. Late events go to history only.

use async_trait::async_trait;

use super::{Consumer, ConsumerMode, Deps, HandleError, Outcome};
use crate::crash::CrashPlan;
use crate::envelope::{EventType, Message, RejectReason, Rejection};
use crate::store::VehicleOutcome;

pub const NAME: &str = "vehicle-state";

pub struct VehicleStateConsumer {
    deps: Deps,
    mode: ConsumerMode,
}

impl VehicleStateConsumer {
    pub fn new(deps: Deps, mode: ConsumerMode) -> Self {
        VehicleStateConsumer { deps, mode }
    }
}

#[async_trait]
impl Consumer for VehicleStateConsumer {
    fn name(&self) -> &'static str {
        NAME
    }

    fn mode(&self) -> ConsumerMode {
        self.mode
    }

    fn wants(&self, _event: EventType) -> bool {
        true
    }

    /// Guarded, the whole batch is one transaction (history rows and the seq-guarded
    /// upserts); naive (drills only) goes one by one.
    async fn handle_batch(
        &self,
        envs: &[Message],
        crash: &CrashPlan,
    ) -> Result<Vec<Outcome>, HandleError> {
        if self.mode == ConsumerMode::Naive {
            return super::one_by_one(self, envs, crash).await;
        }
        let outcomes = self.deps.store.apply_vehicle_batch(envs).await?;
        Ok(outcomes.into_iter().map(outcome_of).collect())
    }

    async fn handle(&self, env: &Message, _crash: &CrashPlan) -> Result<Outcome, HandleError> {
        // Seen-set adds nothing to a naturally idempotent write: it runs guarded.
        let guarded = self.mode != ConsumerMode::Naive;
        let outcome = self.deps.store.apply_vehicle_event(env, guarded).await?;
        Ok(outcome_of(outcome))
    }
}

fn outcome_of(outcome: VehicleOutcome) -> Outcome {
    match outcome {
        VehicleOutcome::Applied => Outcome::Processed {
            effect: None,
            took_over_in_doubt: false,
        },
        VehicleOutcome::Late => Outcome::Late,
        VehicleOutcome::Duplicate => Outcome::Duplicate,
        VehicleOutcome::KeyConflict { stored } => Outcome::Rejected(Rejection::new(
            RejectReason::KeyConflict,
            format!("history already holds this event with fingerprint {stored}"),
        )),
    }
}
