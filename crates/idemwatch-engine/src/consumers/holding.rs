//! An owner's hold on the claims of one batch while their provider calls run (issue
//! 39, a frozen instance).
//!
//! A claim is the owner's until its lease runs out; then a redelivery or the claim
//! sweeper takes it over and resends under the same provider key. Two things made
//! that happen to owners that were alive: a provider call slower than the lease (the
//! claim looked abandoned while its call was still running), and an owner frozen
//! (SIGSTOP, a VM pause) past its lease, which on waking sent the calls of its batch
//! that had not started yet, over the new owner's. So:
//!
//! - while the batch's calls run, its open claims are renewed every third of the
//!   lease ([`Holding::keep_renewed`]), on the database's clock;
//! - before each send, an owner that has not confirmed its claims for half a lease
//!   (it may have been frozen) confirms them first ([`Holding::holds`]) and sends only
//!   the ones still its own; one it cannot confirm (the store does not answer) is not
//!   sent: given back, uncounted.
//!
//! Durations here are the process's monotonic clock, measured from just before the
//! claim (or renewal) was asked for, so the owner's view of its lease is never longer
//! than the database's. The calls physically in flight when an owner froze are the
//! only ones a takeover can repeat (`idem_provider_repeat_calls_total`).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::envelope::MessageKey;
use crate::store::Store;

/// What [`Holding::holds`] says of one claim before its send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Hold {
    /// Still this owner's: send.
    Yes,
    /// Another owner's now (taken over, or finished by someone else): do not send.
    Lost,
    /// Not confirmed for half a lease and the store did not answer: do not send now.
    Unconfirmed(String),
}

#[derive(Debug)]
struct State {
    /// When the last confirmation (the claim, or a renewal) was asked for.
    since: Instant,
    /// Claims not answered yet: key → the owner's token (`attempts`).
    open: HashMap<String, (MessageKey, i64)>,
    /// Claims found to be another owner's.
    lost: HashSet<String>,
    /// Why the last renewal failed, while it is the last word.
    failing: Option<String>,
}

/// The claims of one batch, held while their calls run.
pub(crate) struct Holding<'a> {
    store: &'a dyn Store,
    consumer: &'a str,
    lease: Duration,
    state: Mutex<State>,
    /// One renewal at a time (a periodic one and the senders' checks).
    renewing: tokio::sync::Mutex<()>,
}

impl<'a> Holding<'a> {
    /// `claimed_from`: just before the claims were asked for. `held`: each claim's key
    /// and the owner's token.
    pub fn new(
        store: &'a dyn Store,
        consumer: &'a str,
        lease: Duration,
        claimed_from: Instant,
        held: impl IntoIterator<Item = (MessageKey, i64)>,
    ) -> Self {
        let open = held
            .into_iter()
            .map(|(key, attempts)| (key.as_str().to_string(), (key, attempts)))
            .collect();
        Holding {
            store,
            consumer,
            lease,
            state: Mutex::new(State {
                since: claimed_from,
                open,
                lost: HashSet::new(),
                failing: None,
            }),
            renewing: tokio::sync::Mutex::new(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Written field by field from values computed outside: never half-written.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Without a round trip: `Some` when the answer is known (lost, or confirmed
    /// within half a lease), `None` when the claim must be confirmed first.
    fn known(&self, key: &MessageKey) -> Option<Hold> {
        let s = self.lock();
        if s.lost.contains(key.as_str()) {
            Some(Hold::Lost)
        } else if s.since.elapsed() < self.lease / 2 {
            Some(Hold::Yes)
        } else {
            None
        }
    }

    /// Whether this owner may send `key` now (see [`Hold`]).
    pub async fn holds(&self, key: &MessageKey) -> Hold {
        if let Some(known) = self.known(key) {
            return known;
        }
        let _turn = self.renewing.lock().await;
        if self.known(key).is_none() {
            self.renew_now().await;
        }
        self.known(key).unwrap_or_else(|| {
            let why = self.lock().failing.clone().unwrap_or_default();
            Hold::Unconfirmed(why)
        })
    }

    /// `key` was answered: no longer renewed.
    pub fn answered(&self, key: &MessageKey) {
        self.lock().open.remove(key.as_str());
    }

    /// Renew the open claims every third of the lease, forever (dropped with the
    /// batch's calls).
    pub async fn keep_renewed(&self) {
        let every = (self.lease / 3).max(Duration::from_millis(10));
        loop {
            tokio::time::sleep(every).await;
            let _turn = self.renewing.lock().await;
            if self.lock().since.elapsed() >= every {
                self.renew_now().await;
            }
        }
    }

    async fn renew_now(&self) {
        let asked = Instant::now();
        let open: Vec<(MessageKey, i64)> = self.lock().open.values().cloned().collect();
        if open.is_empty() {
            return;
        }
        match self.store.renew_claims(self.consumer, &open).await {
            Ok(renewed) => {
                let renewed: HashSet<&str> = renewed.iter().map(|k| k.as_str()).collect();
                let mut s = self.lock();
                for (key, _) in &open {
                    if !renewed.contains(key.as_str()) {
                        tracing::warn!(consumer = self.consumer, key = %key,
                            "claim taken over by another owner while this one held it (its lease ran out: frozen or cut off?): not sent again by this owner");
                        s.lost.insert(key.as_str().to_string());
                        s.open.remove(key.as_str());
                    }
                }
                s.since = asked;
                s.failing = None;
            }
            Err(e) => {
                tracing::warn!(consumer = self.consumer, error = %e, claims = open.len(),
                    "could not renew the claims of calls in flight");
                self.lock().failing = Some(e.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{deps, zone_exit};
    use super::*;
    use crate::consumers::claim_request;
    use crate::store::ClaimOutcome;

    const SMS: &str = "zone-exit-sms";

    /// An owner that sends within half a lease of its claim does so without a round
    /// trip; one that comes back later (frozen) confirms first: a claim another owner
    /// took over meanwhile is lost (not sent), one still its own is renewed and sent.
    #[tokio::test]
    async fn a_late_owner_confirms_its_claim_before_sending() {
        let dir = tempfile::tempdir().unwrap();
        let deps = deps(&dir).await;
        let store = deps.store.as_ref();
        let lease = Duration::from_millis(300);
        let m = zone_exit("HOLD-1", 1, "X");
        let request = claim_request(SMS, &m);
        let asked = Instant::now();
        let first = store
            .claim_batch(SMS, std::slice::from_ref(&request), lease)
            .await
            .unwrap();
        assert!(matches!(&first[..], [ClaimOutcome::Fresh(c)] if c.attempts == 1));
        let frozen = Holding::new(store, SMS, lease, asked, [(m.key().clone(), 1)]);
        assert_eq!(frozen.holds(m.key()).await, Hold::Yes);

        // Frozen past the lease: a redelivery takes the claim over.
        tokio::time::sleep(lease + lease / 3).await;
        let asked = Instant::now();
        let taken = store.claim_batch(SMS, &[request], lease).await.unwrap();
        assert!(matches!(&taken[..], [ClaimOutcome::InDoubt(c)] if c.attempts == 2));
        assert_eq!(frozen.holds(m.key()).await, Hold::Lost);
        assert_eq!(
            frozen.holds(m.key()).await,
            Hold::Lost,
            "known, no round trip"
        );

        // The new owner, late too, still holds it: renewed, sent.
        let late = Holding::new(store, SMS, lease, asked, [(m.key().clone(), 2)]);
        tokio::time::sleep(lease * 2 / 3).await;
        let before = store.claim(SMS, m.key()).await.unwrap().unwrap().claimed_at;
        assert_eq!(late.holds(m.key()).await, Hold::Yes);
        let after = store.claim(SMS, m.key()).await.unwrap().unwrap().claimed_at;
        assert!(after > before, "renewed: {before} → {after}");
    }
}
