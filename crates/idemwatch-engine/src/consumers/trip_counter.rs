//! `trip-counter`: `trip_counters.zone_exits + 1` per distinct `zone_exit`.
//! Accumulation is not naturally idempotent: transactional dedup.

use async_trait::async_trait;

use super::{Consumer, ConsumerMode, Deps, HandleError, Outcome};
use crate::crash::{CrashPlan, CrashPoint};
use crate::envelope::{EventType, Message, RejectReason, Rejection};
use crate::store::{BusinessWrite, DedupOutcome, Recordable};

pub const NAME: &str = "trip-counter";

pub struct TripCounter {
    deps: Deps,
    mode: ConsumerMode,
}

impl TripCounter {
    pub fn new(deps: Deps, mode: ConsumerMode) -> Self {
        TripCounter { deps, mode }
    }
}

fn dedup_outcome(d: DedupOutcome) -> Outcome {
    match d {
        DedupOutcome::Applied => Outcome::Processed {
            effect: None,
            took_over_in_doubt: false,
        },
        DedupOutcome::Duplicate { .. } => Outcome::Duplicate,
        DedupOutcome::KeyConflict { stored } => Outcome::Rejected(Rejection::new(
            RejectReason::KeyConflict,
            format!("key already recorded with fingerprint {stored}"),
        )),
    }
}

#[async_trait]
impl Consumer for TripCounter {
    fn name(&self) -> &'static str {
        NAME
    }

    fn mode(&self) -> ConsumerMode {
        self.mode
    }

    fn wants(&self, event: EventType) -> bool {
        event == EventType::ZoneExit
    }

    async fn handle_batch(
        &self,
        envs: &[Message],
        crash: &CrashPlan,
    ) -> Result<Vec<Outcome>, HandleError> {
        if self.mode != ConsumerMode::Idempotent {
            return super::one_by_one(self, envs, crash).await;
        }
        let items: Vec<Recordable> = envs
            .iter()
            .map(|env| Recordable {
                key: env.key().clone(),
                fingerprint: env.fingerprint().clone(),
                write: BusinessWrite::CountZoneExit {
                    device_id: env.device_id.clone(),
                },
            })
            .collect();
        let outcomes = self.deps.store.record_batch(NAME, &items).await?;
        let now = chrono::Utc::now();
        for dup in outcomes
            .iter()
            .filter(|o| matches!(o, DedupOutcome::Duplicate { .. }))
        {
            self.deps
                .metrics
                .duplicate_age(NAME, dup.duplicate_age(now));
        }
        Ok(outcomes.into_iter().map(dedup_outcome).collect())
    }

    async fn handle(&self, env: &Message, crash: &CrashPlan) -> Result<Outcome, HandleError> {
        let write = BusinessWrite::CountZoneExit {
            device_id: env.device_id.clone(),
        };
        let store = &self.deps.store;
        let (key, fingerprint) = (env.key(), env.fingerprint());
        Ok(match self.mode {
            // Dedup row and +1 in one transaction: no window at all.
            ConsumerMode::Idempotent => {
                let outcome = store.record_once(NAME, key, fingerprint, &write).await?;
                if matches!(outcome, DedupOutcome::Duplicate { .. }) {
                    let age = outcome.duplicate_age(chrono::Utc::now());
                    self.deps.metrics.duplicate_age(NAME, age);
                }
                dedup_outcome(outcome)
            }
            // +1, then record the key: a crash in between counts twice on redelivery.
            ConsumerMode::SeenSet => {
                let seen_set = &self.deps.seen_set;
                if let Some(seen) = seen_set.seen(NAME, key, fingerprint).await? {
                    return Ok(dedup_outcome(seen));
                }
                store.apply_unguarded(&write).await?;
                crash.reach(CrashPoint::AfterSideEffect)?;
                seen_set.mark_seen(NAME, key, fingerprint).await?;
                dedup_outcome(DedupOutcome::Applied)
            }
            ConsumerMode::Naive => {
                store.apply_unguarded(&write).await?;
                dedup_outcome(DedupOutcome::Applied)
            }
        })
    }
}
