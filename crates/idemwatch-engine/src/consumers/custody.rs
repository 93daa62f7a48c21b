//! What this process holds of its side effects between the claim and the record:
//! the keys whose provider call one of its batches is making, and the provider's
//! answers it could not record yet (issue 43).
//!
//! A provider's answer is never thrown away. When recording it fails for the store's
//! health (a full disk, an outage, a statement timeout that starts mid-batch), the
//! answer is kept here and the batch is given back like any outage; when its message
//! comes back (or the claim sweeper's next tick, whichever is first) the answer is
//! recorded — the record is retried, never the send. Only a process that did not
//! survive leaves a claim for a takeover to resend under the same provider key.
//!
//! A key held here is busy for every other batch and for the claim sweeper of this
//! process: before this, a sweeper that saw the claim's lease run out during an outage
//! re-drove it while the same process still had its answer, and the provider was
//! called twice for the key. Entries are added only for claims the store granted, and
//! an answer is kept only after its batch failed for the store's health (the batch is
//! then given back and the consumer pauses), so what is kept is bounded by what the
//! consumers had leased when the store failed.
//!
//! Hand-written: a map under a mutex, ours because what it guards (a claim's owner
//! token, the answer a record needs) is ours.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::Outcome;
use crate::envelope::MessageKey;
use crate::metrics::EffectResult;
use crate::store::ClaimResult;

/// A provider's answer waiting to be recorded on its claim.
#[derive(Debug, Clone)]
pub(crate) struct Kept {
    /// What the record writes, with the owner's token ([`ClaimResult::attempts`]).
    pub result: ClaimResult,
    /// The claim's provider key: the send went out under it.
    pub provider_key: String,
    /// What happened at the provider when it accepted (sent, or an earlier send
    /// replayed) and whether the claim was taken over; `None` for a release
    /// (throttled, failing: resent under the same key) or a final refusal.
    pub effect: Option<(EffectResult, bool)>,
    /// The message's outcome decided at the answer (a `provider_rejected` dead letter,
    /// the provider's retry), which stands once the answer is recorded.
    pub decided: Option<Outcome>,
    /// When the record first failed.
    pub since: Instant,
}

#[derive(Debug)]
enum Held {
    /// A batch of this process took the key: its claim, and maybe its call in flight.
    InHand,
    /// The provider answered; the record failed for the store's health.
    Answered(Kept),
}

/// The keys this process holds, per consumer. One per engine, shared by its consumers'
/// workers and its claim sweeper.
#[derive(Debug, Default)]
pub struct Custody {
    held: Mutex<HashMap<(String, String), Held>>,
}

/// What [`Custody::take`] found for a key.
pub(crate) enum Taken {
    /// Nobody here holds it: the ticket holds it now.
    Free(Ticket),
    /// Another batch of this process holds it (its call may be in flight).
    Busy,
    /// An answer of this process waits to be recorded: the ticket holds it now.
    Answered(Ticket, Kept),
}

/// One key in a batch's hands: let go when dropped (the batch is done with it, or the
/// process is dying with it), unless [`Ticket::keep`] left an answer in its place.
pub(crate) struct Ticket {
    custody: Arc<Custody>,
    slot: Option<(String, String)>,
}

impl Custody {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Held>> {
        // Each entry is written whole: a panic elsewhere cannot leave one half-written.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Take `key` of `consumer` for one batch (see [`Taken`]).
    pub(crate) fn take(self: &Arc<Self>, consumer: &str, key: &MessageKey) -> Taken {
        let slot = (consumer.to_string(), key.as_str().to_string());
        let mut held = self.lock();
        let found = held.insert(slot.clone(), Held::InHand);
        let ticket = Ticket {
            custody: self.clone(),
            slot: Some(slot),
        };
        match found {
            None => Taken::Free(ticket),
            Some(Held::Answered(kept)) => Taken::Answered(ticket, kept),
            Some(Held::InHand) => {
                // Still the other batch's: put it back as it was.
                let mut ticket = ticket;
                ticket.slot = None;
                Taken::Busy
            }
        }
    }

    /// Every answer of `consumer` waiting to be recorded, each taken with its ticket.
    pub(crate) fn take_answered(self: &Arc<Self>, consumer: &str) -> Vec<(Ticket, Kept)> {
        let mut held = self.lock();
        let slots: Vec<(String, String)> = held
            .iter()
            .filter(|((c, _), h)| c == consumer && matches!(h, Held::Answered(_)))
            .map(|(slot, _)| slot.clone())
            .collect();
        slots
            .into_iter()
            .filter_map(|slot| match held.insert(slot.clone(), Held::InHand) {
                Some(Held::Answered(kept)) => Some((
                    Ticket {
                        custody: self.clone(),
                        slot: Some(slot),
                    },
                    kept,
                )),
                _ => None,
            })
            .collect()
    }

    /// Answers waiting to be recorded, all consumers.
    pub fn answers_kept(&self) -> usize {
        self.lock()
            .values()
            .filter(|h| matches!(h, Held::Answered(_)))
            .count()
    }
}

impl Ticket {
    /// Keep `answer` for a later record instead of letting the key go.
    pub(crate) fn keep(mut self, answer: Kept) {
        if let Some(slot) = self.slot.take() {
            self.custody.lock().insert(slot, Held::Answered(answer));
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.custody.lock().remove(&slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ClaimFinish, ClaimState};

    fn kept(key: &MessageKey) -> Kept {
        Kept {
            result: ClaimResult::owned(
                key.clone(),
                ClaimFinish::Done {
                    state: ClaimState::Sent,
                    detail: "sent (200)".into(),
                },
                1,
            ),
            provider_key: "pk".into(),
            effect: Some((EffectResult::Sent, false)),
            decided: None,
            since: Instant::now(),
        }
    }

    /// A key is one batch's at a time; an answer kept outlives its batch and is handed
    /// to the next taker (a redelivery or the sweeper), once; a dropped ticket lets go.
    #[test]
    fn a_kept_answer_goes_to_the_next_taker_once_and_a_dropped_ticket_lets_go() {
        let custody = Arc::new(Custody::default());
        let key = MessageKey::from_stored("D:1:zone_exit".into());
        let Taken::Free(ticket) = custody.take("sms", &key) else {
            panic!("a free key")
        };
        assert!(matches!(custody.take("sms", &key), Taken::Busy));
        assert!(matches!(custody.take("erp", &key), Taken::Free(_)));
        ticket.keep(kept(&key));
        assert_eq!(custody.answers_kept(), 1);
        let Taken::Answered(ticket, answer) = custody.take("sms", &key) else {
            panic!("the kept answer")
        };
        assert_eq!(answer.provider_key, "pk");
        assert!(matches!(custody.take("sms", &key), Taken::Busy));
        assert!(custody.take_answered("sms").is_empty());
        ticket.keep(answer);
        let taken = custody.take_answered("sms");
        assert_eq!(taken.len(), 1);
        assert_eq!(custody.answers_kept(), 0);
        drop(taken);
        assert!(matches!(custody.take("sms", &key), Taken::Free(_)));
    }
}
