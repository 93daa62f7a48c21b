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
        self.note_ages(&outcomes).await;
        Ok(outcomes.into_iter().map(outcome_of).collect())
    }

    async fn handle(&self, env: &Message, _crash: &CrashPlan) -> Result<Outcome, HandleError> {
        // Seen-set adds nothing to a naturally idempotent write: it runs guarded.
        let guarded = self.mode != ConsumerMode::Naive;
        let outcome = self.deps.store.apply_vehicle_event(env, guarded).await?;
        self.note_ages(std::slice::from_ref(&outcome)).await;
        Ok(outcome_of(outcome))
    }
}

impl VehicleStateConsumer {
    /// Each duplicate's age (since its history row was received) into
    /// `idem_duplicate_age_seconds`, and the batch's oldest into the store's
    /// `duplicate_ages`. The history row is this consumer's dedup record, so its
    /// `received_at` is when the key was first processed (issue 41: "are our dedup
    /// windows long enough?" asked of every consumer). The store's note is a write of
    /// its own after the batch committed, as the seen-set's is: the store's batch stays
    /// free of consumer names, and a duplicate is rare (0.01 % on a normal day), so
    /// the extra statement runs about never. When it fails the drop stands (it is
    /// right whatever its age) and the failure is logged.
    async fn note_ages(&self, outcomes: &[VehicleOutcome]) {
        let now = chrono::Utc::now();
        for dup in outcomes
            .iter()
            .filter(|o| matches!(o, VehicleOutcome::Duplicate { .. }))
        {
            self.deps
                .metrics
                .duplicate_age(NAME, dup.duplicate_age(now));
        }
        let Some(oldest) = VehicleOutcome::oldest_duplicate(outcomes, now) else {
            return;
        };
        if let Err(e) = self.deps.store.note_duplicate_age(NAME, oldest).await {
            tracing::warn!(consumer = NAME, error = %e, "duplicate age not kept");
        }
    }
}

fn outcome_of(outcome: VehicleOutcome) -> Outcome {
    match outcome {
        VehicleOutcome::Applied => Outcome::Processed {
            effect: None,
            took_over_in_doubt: false,
        },
        VehicleOutcome::Late => Outcome::Late,
        VehicleOutcome::Duplicate { .. } => Outcome::Duplicate,
        VehicleOutcome::KeyConflict { stored } => Outcome::Rejected(Rejection::new(
            RejectReason::KeyConflict,
            format!("history already holds this event with fingerprint {stored}"),
        )),
    }
}
