//! [`Store::claim_batch`](super::Store::claim_batch) decided once for every backend:
//! the backend reads, under its write lock (or row locks), the stored dedup rows and
//! claims of the batch's keys, and this module decides each request as one-by-one
//! [`Store::claim_side_effect`](super::Store::claim_side_effect) calls in order would
//! have: a new key is claimed fresh, a stored one is a key conflict, done, busy or
//! taken over (in doubt), and a key met again later in the same batch finds the claim
//! its first request just took (busy) or the state it found (done).

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{claim_step, duplicate_or_conflict, Claim, ClaimOutcome, ClaimState, ClaimStep};
use super::{DedupOutcome, Fingerprint, FirstSeen, MessageKey};

/// One side-effect message for [`Store::claim_batch`](super::Store::claim_batch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    pub key: MessageKey,
    pub fingerprint: Fingerprint,
    /// The provider key a fresh claim records (a takeover keeps the stored one).
    pub provider_key: String,
    /// The message the claim is taken for, kept beside a claim this batch takes
    /// (fresh or taken over), in the same transaction, for the claim sweeper
    /// ([`RepairStore::stranded_claims`](super::RepairStore::stranded_claims)).
    pub message: Vec<u8>,
}

/// What the provider's answer does to a claim, for
/// [`Store::finish_batch`](super::Store::finish_batch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimFinish {
    /// A final answer: `sent` or `failed`, with why.
    Done { state: ClaimState, detail: String },
    /// A transient failure: keep the claim and make it retryable at once
    /// ([`Store::release_claim`](super::Store::release_claim)).
    Release { detail: String },
}

/// One claim's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimResult {
    pub key: MessageKey,
    pub finish: ClaimFinish,
    /// The claim's `attempts` as its owner took it: the owner's fencing token. Every
    /// takeover adds one, so a result that carries it is written only while the claim
    /// is still `claimed` by that owner; an owner whose lease ran out and whose claim
    /// another took over (a frozen process woken up, a slow call) cannot finish it over
    /// the new owner's. `None`: written whatever holds the claim (an operator's tool).
    pub attempts: Option<i64>,
}

impl ClaimResult {
    /// The result of the owner that took the claim with `attempts`.
    pub fn owned(key: MessageKey, finish: ClaimFinish, attempts: i64) -> Self {
        ClaimResult {
            key,
            finish,
            attempts: Some(attempts),
        }
    }
}

/// What the backend writes once the outcomes are known.
#[derive(Debug, Default)]
pub(crate) struct ClaimWrites<'a> {
    /// New keys: a dedup row and a `claimed` claim each.
    pub fresh: Vec<&'a ClaimRequest>,
    /// In-doubt claims taken over: compare-and-set on the stored `claimed_at`.
    pub takeovers: Vec<(&'a ClaimRequest, DateTime<Utc>)>,
}

/// The batch's distinct keys, sorted: the order every backend locks them in, so
/// two batches never wait on each other in a cycle.
pub(crate) fn sorted_keys(requests: &[ClaimRequest]) -> Vec<&str> {
    let mut keys: Vec<&str> = requests.iter().map(|r| r.key.as_str()).collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// Decide every request. `stored_hash`: the fingerprint of each key already in
/// `processed_messages`, `first_seen` its `processed_at`; `claims`: the stored claim of
/// each such key; `now`: the claim time the backend will write (as it reads back).
pub(crate) fn decide<'a>(
    consumer: &str,
    requests: &'a [ClaimRequest],
    stored_hash: &HashMap<String, String>,
    first_seen: &FirstSeen,
    claims: &HashMap<String, Claim>,
    now: DateTime<Utc>,
    lease: Duration,
) -> (Vec<ClaimOutcome>, ClaimWrites<'a>) {
    let mut writes = ClaimWrites::default();
    // Per key met so far in this batch: the fingerprint its row holds, and what its
    // first request left behind.
    let mut met: HashMap<&str, (String, ClaimOutcome)> = HashMap::new();
    let outcomes = requests
        .iter()
        .map(|req| {
            let key = req.key.as_str();
            if let Some((row_hash, first)) = met.get(key) {
                if let DedupOutcome::KeyConflict { stored } =
                    duplicate_or_conflict(row_hash.clone(), &req.fingerprint, None)
                {
                    return ClaimOutcome::KeyConflict { stored };
                }
                return match first {
                    ClaimOutcome::Done(state, at) => ClaimOutcome::Done(*state, *at),
                    // A claim this batch just took (or one still live) is busy.
                    _ => ClaimOutcome::Busy,
                };
            }
            let (row_hash, outcome) = match stored_hash.get(key) {
                None => {
                    writes.fresh.push(req);
                    let claim = Claim {
                        consumer: consumer.to_string(),
                        message_key: key.to_string(),
                        provider_key: req.provider_key.clone(),
                        state: ClaimState::Claimed,
                        claimed_at: now,
                        finished_at: None,
                        attempts: 1,
                        detail: None,
                    };
                    (
                        req.fingerprint.as_str().to_string(),
                        ClaimOutcome::Fresh(claim),
                    )
                }
                Some(hash) => {
                    let first = first_seen.get(key).copied();
                    let outcome = match duplicate_or_conflict(hash.clone(), &req.fingerprint, None)
                    {
                        DedupOutcome::KeyConflict { stored } => {
                            ClaimOutcome::KeyConflict { stored }
                        }
                        // A dedup row without a claim: recorded by another mode. Done.
                        _ => match claims.get(key) {
                            None => ClaimOutcome::Done(ClaimState::Sent, first),
                            Some(claim) => match claim_step(claim, now, lease) {
                                ClaimStep::Done(state) => ClaimOutcome::Done(state, first),
                                ClaimStep::Busy => ClaimOutcome::Busy,
                                ClaimStep::TakeOver => {
                                    writes.takeovers.push((req, claim.claimed_at));
                                    let released = claim.claimed_at == DateTime::UNIX_EPOCH;
                                    let mut claim = claim.clone();
                                    claim.attempts += 1;
                                    claim.claimed_at = now;
                                    if released {
                                        ClaimOutcome::Released(claim)
                                    } else {
                                        ClaimOutcome::InDoubt(claim)
                                    }
                                }
                            },
                        },
                    };
                    (hash.clone(), outcome)
                }
            };
            met.insert(key, (row_hash, outcome.clone()));
            outcome
        })
        .collect();
    (outcomes, writes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: &str, fp: &str) -> ClaimRequest {
        ClaimRequest {
            key: MessageKey::from_stored(key.to_string()),
            fingerprint: Fingerprint::from_stored(fp.to_string()),
            provider_key: format!("pk-{key}"),
            message: Vec::new(),
        }
    }

    fn claim(key: &str, state: ClaimState, claimed_at: DateTime<Utc>) -> Claim {
        Claim {
            consumer: "c".into(),
            message_key: key.into(),
            provider_key: format!("stored-{key}"),
            state,
            claimed_at,
            finished_at: None,
            attempts: 1,
            detail: None,
        }
    }

    /// The keys a backend reads (and locks) before deciding: every key of the batch,
    /// once, sorted. An empty list decides every stored key as fresh; the insert of a
    /// key already stored then fails as a unique violation, which the engine reads as
    /// a race lost (an infrastructure failure) and retries uncounted, on every
    /// delivery: a worker with a redelivered zone exit never goes idle. This fails at
    /// once where the conformance suite's drills hang until their timeout.
    #[test]
    fn a_claim_batch_reads_each_of_its_keys_once_in_sorted_order() {
        let requests = [
            req("b", "f1"),
            req("a", "f2"),
            req("b", "f3"),
            req("c", "f4"),
        ];
        assert_eq!(sorted_keys(&requests), ["a", "b", "c"]);
        assert_eq!(sorted_keys(&requests[..1]), ["b"]);
        assert!(sorted_keys(&[]).is_empty());
    }

    #[test]
    fn requests_are_decided_as_one_by_one_claims() {
        let now = Utc::now();
        let lease = Duration::from_secs(60);
        let old = now - chrono::Duration::seconds(120);
        let requests = vec![
            req("new", "f1"),
            req("new", "f1"),  // same key again: the claim just taken is live
            req("new", "f9"),  // same key, other bytes
            req("sent", "f2"), // finished
            req("live", "f3"), // claimed within the lease
            req("doubt", "f4"),
            req("given", "f7"), // released after a provider failure
            req("other", "f0"), // stored with another fingerprint
            req("bare", "f5"),  // a dedup row without a claim
            req("sent", "f2"),
        ];
        let stored: HashMap<String, String> = [
            ("sent", "f2"),
            ("live", "f3"),
            ("doubt", "f4"),
            ("given", "f7"),
            ("other", "f6"),
            ("bare", "f5"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .into();
        let claims: HashMap<String, Claim> = [
            claim("sent", ClaimState::Sent, old),
            claim("live", ClaimState::Claimed, now),
            claim("doubt", ClaimState::Claimed, old),
            claim("given", ClaimState::Claimed, DateTime::UNIX_EPOCH),
        ]
        .map(|c| (c.message_key.clone(), c))
        .into();
        let first_seen: FirstSeen = [("sent".to_string(), old)].into();
        let (outcomes, writes) = decide("c", &requests, &stored, &first_seen, &claims, now, lease);
        let labels: Vec<String> = outcomes
            .iter()
            .map(|o| match o {
                ClaimOutcome::Fresh(c) => format!("fresh {}", c.provider_key),
                ClaimOutcome::InDoubt(c) => format!("doubt {} {}", c.provider_key, c.attempts),
                ClaimOutcome::Released(c) => format!("released {} {}", c.provider_key, c.attempts),
                ClaimOutcome::Done(s, at) => {
                    format!(
                        "done {}{}",
                        s.as_str(),
                        if *at == Some(old) { " old" } else { "" }
                    )
                }
                ClaimOutcome::Busy => "busy".into(),
                ClaimOutcome::KeyConflict { stored } => format!("conflict {stored}"),
            })
            .collect();
        assert_eq!(
            labels,
            [
                "fresh pk-new",
                "busy",
                "conflict f1",
                "done sent old",
                "busy",
                "doubt stored-doubt 2",
                "released stored-given 2",
                "conflict f6",
                "done sent",
                "done sent old",
            ]
        );
        assert_eq!(writes.fresh.len(), 1);
        assert_eq!(writes.takeovers.len(), 2);
        assert_eq!(writes.takeovers[0].1, old);
    }
}
