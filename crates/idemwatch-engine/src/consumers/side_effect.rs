//! The two-phase side effect shared by `zone-exit-sms` and `erp-webhook`:
//! claim (in the dedup transaction) → call the provider with the claim's key →
//! record `sent` / `failed`.
//!
//! Invariant: one external effect per distinct key. The claim makes a redelivery
//! that finds `sent` do nothing; the provider's Idempotency-Key closes the window the
//! claim cannot (a crash after the send, before the record): the in-doubt retry
//! reuses the same key and the provider replays instead of sending again.

use std::future::Future;

use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::{ConsumerMode, Deps, HandleError, Outcome, RetryCause};
use crate::crash::{CrashPlan, CrashPoint};
use crate::envelope::{Message, MessageKey, RejectReason, Rejection};
use crate::metrics::EffectResult;
use crate::provider::{ProviderError, ProviderReply};
use crate::store::{
    Claim, ClaimFinish, ClaimOutcome, ClaimRequest, ClaimResult, ClaimState, DedupOutcome,
    StoreError,
};

/// The provider key for one consumer's effect of one message. Derived, never random:
/// even with the claim row gone, the same message yields the same key.
pub fn provider_key(consumer: &str, key: &MessageKey) -> String {
    let mut h = Sha256::new();
    h.update(consumer.as_bytes());
    h.update(b"\n");
    h.update(key.as_str().as_bytes());
    format!("idemwatch-{}", &hex::encode(h.finalize())[..32])
}

/// What [`Store::claim_batch`](crate::store::Store::claim_batch) is asked for
/// one message: its key and fingerprint, its provider key, and the message itself,
/// kept beside the claim for the sweeper.
pub fn claim_request(consumer: &str, env: &Message) -> ClaimRequest {
    ClaimRequest {
        key: env.key().clone(),
        fingerprint: env.fingerprint().clone(),
        provider_key: provider_key(consumer, env.key()),
        message: env.to_json_line().into_bytes(),
    }
}

/// Perform `send` at most once per key, according to `mode`.
pub(crate) async fn perform<F, Fut>(
    consumer: &'static str,
    deps: &Deps,
    mode: ConsumerMode,
    env: &Message,
    crash: &CrashPlan,
    send: F,
) -> Result<Outcome, HandleError>
where
    F: FnOnce(Option<String>) -> Fut,
    Fut: Future<Output = Result<ProviderReply, ProviderError>>,
{
    let (key, fingerprint) = (env.key(), env.fingerprint());
    match mode {
        ConsumerMode::Naive => {
            let reply = send(None).await;
            crash.reach(CrashPoint::AfterSideEffect)?;
            Ok(match reply {
                Ok(_) => record(deps, consumer, EffectResult::Sent, false),
                Err(e) => provider_failed(deps, consumer, &e),
            })
        }
        // The report's seen-set design: the key, written after success, is the only
        // guard (no claim, no provider key), so a death between the send and the
        // write sends again on redelivery: `drill seen-set-window`.
        ConsumerMode::SeenSet => {
            match deps.seen_set.seen(consumer, key, fingerprint).await? {
                Some(DedupOutcome::KeyConflict { stored }) => return Ok(conflict(stored.as_str())),
                Some(_) => {
                    deps.metrics.side_effect(consumer, EffectResult::Suppressed);
                    return Ok(Outcome::Duplicate);
                }
                None => {}
            }
            let reply = send(None).await;
            crash.reach(CrashPoint::AfterSideEffect)?;
            match reply {
                Ok(r) => {
                    deps.seen_set.mark_seen(consumer, key, fingerprint).await?;
                    Ok(record(deps, consumer, sent_or_replayed(&r), false))
                }
                // Not marked seen: fixed and replayed, it is sent.
                Err(e) => Ok(provider_failed(deps, consumer, &e)),
            }
        }
        ConsumerMode::Idempotent => {
            // The claim and the message the sweeper re-drives it from, together.
            let request = claim_request(consumer, env);
            let claim = match deps
                .store
                .claim_one(consumer, &request, deps.claim_lease)
                .await?
            {
                ClaimOutcome::KeyConflict { stored } => return Ok(conflict(stored.as_str())),
                ClaimOutcome::Done(_) => {
                    deps.metrics.side_effect(consumer, EffectResult::Suppressed);
                    return Ok(Outcome::Duplicate);
                }
                ClaimOutcome::Busy => {
                    return Ok(Outcome::retry(
                        RetryCause::Busy,
                        "another delivery holds a live claim on this key",
                    ))
                }
                ClaimOutcome::Fresh(c) => (c, false),
                ClaimOutcome::InDoubt(c) => (c, true),
            };
            let (claim, in_doubt) = claim;
            if in_doubt {
                tracing::warn!(consumer, key = %key, attempts = claim.attempts,
                    "claim in doubt: resending with the same provider key");
            }
            crash.reach(CrashPoint::AfterClaim)?;
            let reply = send(Some(claim.provider_key.clone())).await;
            crash.reach(CrashPoint::AfterSideEffect)?;
            let answer = Answer {
                i: 0,
                provider_key: claim.provider_key,
                effect: None,
            };
            match reply {
                Ok(r) => {
                    let done = ClaimResult {
                        key: key.clone(),
                        finish: ClaimFinish::Done {
                            state: ClaimState::Sent,
                            detail: sent_detail(&r),
                        },
                    };
                    let answer = Answer {
                        effect: Some((sent_or_replayed(&r), in_doubt)),
                        ..answer
                    };
                    let recorded = finish_alone(deps, consumer, &done, &answer).await?;
                    Ok(recorded.unwrap_or_else(|| {
                        Outcome::retry(RetryCause::Message, "no outcome decided")
                    }))
                }
                Err(e) => {
                    // Refused for good: nothing went out; the claim says so, and the
                    // message is kept as a dead letter to be fixed and replayed.
                    // Throttled, failing or unreachable: we may not know whether it
                    // went out; keep the claim and its key, make it immediately
                    // retryable, give the delivery back (uncounted).
                    let finish = if e.infra_kind().is_none() {
                        ClaimFinish::Done {
                            state: ClaimState::Failed,
                            detail: e.to_string(),
                        }
                    } else {
                        ClaimFinish::Release {
                            detail: e.to_string(),
                        }
                    };
                    let result = ClaimResult {
                        key: key.clone(),
                        finish,
                    };
                    let recorded = finish_alone(deps, consumer, &result, &answer).await?;
                    Ok(recorded.unwrap_or_else(|| provider_failed(deps, consumer, &e)))
                }
            }
        }
    }
}

/// [`perform`] in idempotent mode for a batch: the claims of the whole batch in one
/// transaction, the provider calls of the claims it won concurrently (at most
/// `deps.provider_concurrency` in flight, each with its own claim's provider key),
/// then every answer recorded in one transaction. One outcome per envelope, in order.
///
/// A redelivery in the same batch as the delivery before it (same key, same
/// fingerprint: a producer's retry lands next to its first send more often than not)
/// is not claimed a second time: decided one by one it would find the first's live
/// claim and come back `Busy`, a retry after `retry_delay` only to be acked as a
/// duplicate then. It takes its twin's fate instead ([`twin_outcome`]). The same key
/// with another fingerprint is claimed as it comes, and conflicts there.
///
/// The ack of a finished call waits for the batch's slowest call, never longer: the
/// batch is the unit of commit and ack. A crash point reached after one call drops
/// the calls still in flight, as a dying process would; their claims stay `claimed`
/// and come back in doubt after the lease, resent with the same provider key.
///
/// When the database refuses the batch's record for a reason that is not its health
/// (one row refused by a constraint or a trigger), the answers are recorded one by
/// one ([`finish_one_by_one`]): only the refused one becomes a dead letter, its
/// neighbours commit at once.
pub(crate) async fn perform_batch<'e, F, Fut>(
    consumer: &'static str,
    deps: &Deps,
    batch: &[&'e Message],
    crash: &CrashPlan,
    send: F,
) -> Result<Vec<Outcome>, HandleError>
where
    F: Fn(&'e Message, String) -> Fut,
    Fut: Future<Output = Result<ProviderReply, ProviderError>>,
{
    // `envs`: what is claimed (no two of one key and fingerprint); `place`: where
    // each envelope of the batch takes its outcome from.
    let (envs, place) = twins(batch);
    let requests: Vec<ClaimRequest> = envs
        .iter()
        .map(|env| claim_request(consumer, env))
        .collect();
    let claims = deps
        .store
        .claim_batch(consumer, &requests, deps.claim_lease)
        .await?;
    let mut outcomes: Vec<Option<Outcome>> = vec![None; envs.len()];
    let mut owned: Vec<(usize, Claim, bool)> = Vec::new();
    for (i, claim) in claims.into_iter().enumerate() {
        match claim {
            ClaimOutcome::KeyConflict { stored } => outcomes[i] = Some(conflict(stored.as_str())),
            ClaimOutcome::Done(_) => {
                deps.metrics.side_effect(consumer, EffectResult::Suppressed);
                outcomes[i] = Some(Outcome::Duplicate);
            }
            ClaimOutcome::Busy => {
                outcomes[i] = Some(Outcome::retry(
                    RetryCause::Busy,
                    "another delivery holds a live claim on this key",
                ))
            }
            ClaimOutcome::Fresh(c) => owned.push((i, c, false)),
            ClaimOutcome::InDoubt(c) => {
                tracing::warn!(consumer, key = %requests[i].key, attempts = c.attempts,
                    "claim in doubt: resending with the same provider key");
                owned.push((i, c, true));
            }
        }
    }
    if !owned.is_empty() {
        crash.reach(CrashPoint::AfterClaim)?;
    }
    let mut calls = futures::stream::iter(owned.into_iter().map(|(i, claim, in_doubt)| {
        let call = send(envs[i], claim.provider_key.clone());
        async move { (i, in_doubt, claim.provider_key, call.await) }
    }))
    .buffer_unordered(deps.provider_concurrency.max(1));
    let mut results = Vec::new();
    let mut answers = Vec::new();
    while let Some((i, in_doubt, provider_key, reply)) = calls.next().await {
        crash.reach(CrashPoint::AfterSideEffect)?;
        let key = requests[i].key.clone();
        let (finish, effect) = match reply {
            Ok(r) => (
                ClaimFinish::Done {
                    state: ClaimState::Sent,
                    detail: sent_detail(&r),
                },
                Some((sent_or_replayed(&r), in_doubt)),
            ),
            // Refused for good: nothing went out. The claim says so, and the
            // message is kept as a `provider_rejected` dead letter.
            Err(e) if e.infra_kind().is_none() => {
                outcomes[i] = Some(provider_failed(deps, consumer, &e));
                (
                    ClaimFinish::Done {
                        state: ClaimState::Failed,
                        detail: e.to_string(),
                    },
                    None,
                )
            }
            Err(e) => {
                // Throttled, failing or unreachable; whether it went out is unknown:
                // keep the claim, retryable at once with the same key, and give the
                // delivery back uncounted.
                outcomes[i] = Some(provider_failed(deps, consumer, &e));
                (
                    ClaimFinish::Release {
                        detail: e.to_string(),
                    },
                    None,
                )
            }
        };
        results.push(ClaimResult { key, finish });
        answers.push(Answer {
            i,
            provider_key,
            effect,
        });
    }
    drop(calls);
    match deps.store.finish_batch(consumer, &results).await {
        Ok(()) => {
            for a in answers {
                if let Some((effect, in_doubt)) = a.effect {
                    outcomes[a.i] = Some(record(deps, consumer, effect, in_doubt));
                }
            }
        }
        Err(e) if e.is_infrastructure() => return Err(e.into()),
        Err(e) => {
            tracing::warn!(consumer, error = %e, batch = results.len(),
                "recording the batch's provider answers failed for a reason that is not the store's health: recording them one by one");
            finish_one_by_one(deps, consumer, &results, answers, &mut outcomes).await;
        }
    }
    let decided: Vec<Outcome> = outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Outcome::retry(RetryCause::Message, "no outcome decided")))
        .collect();
    Ok(place
        .into_iter()
        .map(|p| match p {
            Place::First(k) => decided[k].clone(),
            Place::Twin(k) => twin_outcome(deps, consumer, &decided[k]),
        })
        .collect())
}

/// Where one envelope of a batch is decided: as the `k`-th of the envelopes claimed,
/// or as the twin of that one (a redelivery of it in the same batch).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Place {
    First(usize),
    Twin(usize),
}

/// The envelopes of `envs` to claim (the first delivery of each key and fingerprint,
/// in order) and, for every envelope, where its outcome comes from.
fn twins<'e>(envs: &[&'e Message]) -> (Vec<&'e Message>, Vec<Place>) {
    let mut firsts: Vec<&'e Message> = Vec::with_capacity(envs.len());
    let mut by_key: std::collections::HashMap<&MessageKey, usize> =
        std::collections::HashMap::with_capacity(envs.len());
    let mut place = Vec::with_capacity(envs.len());
    for env in envs {
        match by_key.get(env.key()) {
            Some(&k) if firsts[k].fingerprint() == env.fingerprint() => place.push(Place::Twin(k)),
            seen => {
                if seen.is_none() {
                    by_key.insert(env.key(), firsts.len());
                }
                place.push(Place::First(firsts.len()));
                firsts.push(env);
            }
        }
    }
    (firsts, place)
}

/// The outcome of a redelivery decided with its twin in the same batch: what a claim
/// after the twin's would have found. The twin's effect happened, was suppressed, or
/// was refused for good (its claim is `sent` or `failed`): a duplicate, suppressed.
/// The twin comes back (busy, an outage, a throttling provider): so does it. The key
/// is stored with another fingerprint: a key conflict for it as well.
fn twin_outcome(deps: &Deps, consumer: &str, twin: &Outcome) -> Outcome {
    match twin {
        Outcome::Retry(r) => Outcome::Retry(r.clone()),
        Outcome::Rejected(r) if r.reason == RejectReason::KeyConflict => {
            Outcome::Rejected(r.clone())
        }
        _ => {
            deps.metrics.side_effect(consumer, EffectResult::Suppressed);
            Outcome::Duplicate
        }
    }
}

/// A provider's answer waiting to be recorded on its claim (phase 3).
struct Answer {
    /// The envelope's place in its batch.
    i: usize,
    /// The claim's provider key: the send went out under it.
    provider_key: String,
    /// What happened at the provider when it accepted (sent, or an earlier send
    /// replayed) and whether the claim was taken over in doubt; `None` when the
    /// outcome was decided at the answer (refused, throttled, failing).
    effect: Option<(EffectResult, bool)>,
}

/// The batch's answers recorded one by one, each in its own statement, after the
/// batch's transaction failed for a reason that is not the store's health: one row
/// the database refuses (a constraint, a trigger) must not keep its neighbours'
/// claims live — they would all come back busy until the lease and be resent. Each
/// answer is settled by [`finish_alone`]. Once a statement fails for the store's
/// health, the answers not yet recorded are given back for a retry (their claims
/// stay open and come back in doubt, resent under the same provider key).
async fn finish_one_by_one(
    deps: &Deps,
    consumer: &str,
    results: &[ClaimResult],
    answers: Vec<Answer>,
    outcomes: &mut [Option<Outcome>],
) {
    let mut down: Option<Outcome> = None;
    for (r, a) in results.iter().zip(answers) {
        // A release that could not be written leaves the provider's own retry.
        let release = matches!(r.finish, ClaimFinish::Release { .. });
        let outcome = match &down {
            Some(down) => (!release).then(|| down.clone()),
            None => match finish_alone(deps, consumer, r, &a).await {
                Ok(o) => o,
                Err(e) => {
                    let o = Outcome::of_store_error(&e);
                    down = Some(o.clone());
                    (!release).then_some(o)
                }
            },
        };
        if let Some(o) = outcome {
            outcomes[a.i] = Some(o);
        }
    }
}

/// Record one answer on its claim in a statement of its own. `Ok(None)`: keep the
/// outcome decided at the answer; `Ok(Some)`: the message's outcome; `Err`: the
/// store's health failed it (retry later, uncounted).
///
/// When the database refuses a `sent` for what the row holds (a constraint or a
/// trigger: the same every time), the effect DID happen, but the claim cannot say
/// so. Left `claimed`, the claim sweeper would re-drive it after every lease: the
/// provider replays, the record is refused again, and a new dead letter is written
/// on every sweep. So the claim is closed `failed` in a second, smaller statement —
/// the one final state besides `sent`, and one that every reader (a redelivery, the
/// sweeper, a replay) takes as "never send this again" — and the message becomes one
/// `store_rejected` dead letter naming the database's words, that the effect
/// happened, and its provider key, for the operator to check in the provider's own
/// records. `claims resolve` does not apply (it finishes open claims only); a
/// replay of the letter finds the closed claim and is dropped as a duplicate.
///
/// A `failed` or a release that is refused leaves the outcome decided at the answer
/// (`provider_rejected`, or the provider's retry); any other refusal (a bug, a
/// schema that does not match) is a counted retry.
async fn finish_alone(
    deps: &Deps,
    consumer: &str,
    r: &ClaimResult,
    a: &Answer,
) -> Result<Option<Outcome>, StoreError> {
    let e = match crate::store::finish_claim(deps.store.as_ref(), consumer, r).await {
        Ok(()) => {
            return Ok(a
                .effect
                .map(|(effect, in_doubt)| record(deps, consumer, effect, in_doubt)))
        }
        Err(e) if e.is_infrastructure() => return Err(e),
        Err(e) => e,
    };
    let (sent, effect) = match (&r.finish, a.effect) {
        (ClaimFinish::Done { detail, .. }, Some((effect, _))) if e.is_content() => (detail, effect),
        (ClaimFinish::Done { .. }, Some(_)) => return Ok(Some(Outcome::of_store_error(&e))),
        (ClaimFinish::Done { .. }, None) => {
            tracing::warn!(consumer, key = %r.key, error = %e,
                "the database refused to record the claim `failed`: it stays open");
            return Ok(None);
        }
        (ClaimFinish::Release { .. }, _) => return Ok(None),
    };
    let refused = format!(
        "the provider accepted it ({sent}, provider key {}), but the database refused to record `sent` on its claim: {e}",
        a.provider_key
    );
    let closed = deps
        .store
        .finish_side_effect(
            consumer,
            &r.key,
            ClaimState::Failed,
            &format!("{refused}; closed `failed` so that nothing sends it again"),
        )
        .await;
    let after = match closed {
        Ok(()) => "Its claim was closed `failed` instead, so no sweep or redelivery resends it \
                   and a replay of this letter is dropped as a duplicate."
            .to_string(),
        Err(c) if c.is_infrastructure() => return Err(c),
        Err(c) => format!(
            "Closing its claim `failed` was refused too ({c}): it stays open, the claim \
             sweeper re-drives it after its lease (the provider replays), and \
             `claims resolve --as sent` finishes it."
        ),
    };
    tracing::warn!(consumer, key = %r.key, provider_key = %a.provider_key, error = %e,
        "the database refused to record a send that happened: dead-lettered as store_rejected");
    deps.metrics.side_effect(consumer, effect);
    Ok(Some(Outcome::Rejected(Rejection::new(
        RejectReason::StoreRejected,
        format!("{refused}. The effect DID happen: do not send it again. {after}"),
    ))))
}

fn sent_detail(reply: &ProviderReply) -> String {
    if reply.replayed {
        format!("provider replayed its first response ({})", reply.status)
    } else {
        format!("sent ({})", reply.status)
    }
}

/// A provider's failure as the runner sees it: a retry that does not count against
/// the message (throttled, 5xx, unreachable), or a `provider_rejected` dead letter
/// with the status and the (capped) body — never "processed".
fn provider_failed(deps: &Deps, consumer: &str, e: &ProviderError) -> Outcome {
    match e.infra_kind() {
        Some(kind) => Outcome::retry(
            RetryCause::Infra {
                kind,
                after: e.retry_after(),
            },
            e.to_string(),
        ),
        None => {
            deps.metrics.side_effect(consumer, EffectResult::Failed);
            Outcome::Rejected(Rejection::new(
                RejectReason::ProviderRejected,
                e.to_string(),
            ))
        }
    }
}

fn sent_or_replayed(reply: &ProviderReply) -> EffectResult {
    if reply.replayed {
        EffectResult::Suppressed
    } else {
        EffectResult::Sent
    }
}

fn record(deps: &Deps, consumer: &str, result: EffectResult, in_doubt: bool) -> Outcome {
    deps.metrics.side_effect(consumer, result);
    Outcome::Processed {
        effect: Some(result),
        took_over_in_doubt: in_doubt,
    }
}

fn conflict(stored: &str) -> Outcome {
    Outcome::Rejected(Rejection::new(
        RejectReason::KeyConflict,
        format!("key already recorded with fingerprint {stored}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::super::tests::{deps, exec, zone_exit};
    use super::super::Retry;
    use super::*;
    use crate::crash::{CrashStyle, Crashed};
    use crate::envelope::EventType;
    use crate::health::InfraKind;
    use std::sync::Mutex;
    use ClaimState::{Claimed, Failed, Sent};

    /// A redelivery in the batch of its first delivery is decided with it: claimed
    /// and sent once, the redelivery a duplicate at once (one by one it came back
    /// busy, a retry a second later); the same key with another payload still meets
    /// the first's claim and conflicts; a twin of a retried send comes back with it.
    #[tokio::test]
    async fn a_redelivery_in_the_batch_of_its_first_delivery_is_decided_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let deps = deps(&dir).await;
        let (a, b, other) = (
            zone_exit("TWIN-1", 1, "depot"),
            zone_exit("TWIN-1", 2, "depot"),
            zone_exit("TWIN-1", 1, "port"),
        );
        assert_eq!(a.event_type, EventType::ZoneExit);
        let sent = Mutex::new(Vec::new());
        let send = |env: &Message, key: String| {
            sent.lock().unwrap().push((env.seq, key));
            async {
                Ok(ProviderReply {
                    status: 202,
                    replayed: false,
                    body: String::new(),
                })
            }
        };
        let batch = [&a, &b, &a, &other, &b];
        let crash = CrashPlan::none();
        let outcomes = perform_batch("twin-test", &deps, &batch, &crash, send)
            .await
            .unwrap();
        let sent_once = Outcome::Processed {
            effect: Some(EffectResult::Sent),
            took_over_in_doubt: false,
        };
        assert_eq!(outcomes[0], sent_once);
        assert_eq!(outcomes[1], sent_once);
        assert_eq!(outcomes[2], Outcome::Duplicate);
        assert!(
            matches!(&outcomes[3], Outcome::Rejected(r) if r.reason == RejectReason::KeyConflict),
            "{:?}",
            outcomes[3]
        );
        assert_eq!(outcomes[4], Outcome::Duplicate);
        let sent = sent.into_inner().unwrap();
        assert_eq!(
            sent.iter().map(|(seq, _)| *seq).collect::<Vec<_>>(),
            vec![1, 2],
            "each key sent once"
        );
        let counts = deps.metrics.counts("twin-test");
        assert_eq!(counts.side_effects_sent, 2);
        assert_eq!(counts.side_effects_suppressed, 2);

        // The provider fails: the first and its twin both come back, uncounted, and
        // the claim is released for the retry under the same provider key.
        let c = zone_exit("TWIN-1", 3, "depot");
        let failing = |_: &Message, _: String| async {
            Err(ProviderError::Unavailable {
                status: 503,
                body: "down".into(),
            })
        };
        let outcomes = perform_batch("twin-test", &deps, &[&c, &c], &crash, failing)
            .await
            .unwrap();
        assert_eq!(outcomes[0], outcomes[1]);
        assert!(
            matches!(&outcomes[0], Outcome::Retry(r) if matches!(r.cause, RetryCause::Infra { .. })),
            "{:?}",
            outcomes[0]
        );
    }

    const SMS: &str = "zone-exit-sms";

    type Reply = Result<ProviderReply, ProviderError>;

    fn accepted(replayed: bool) -> Reply {
        Ok(ProviderReply {
            status: 200,
            replayed,
            body: String::new(),
        })
    }

    fn sent() -> Reply {
        accepted(false)
    }

    fn refused() -> Reply {
        Err(ProviderError::Rejected {
            status: 400,
            body: "recipient_refused".into(),
        })
    }

    fn failing() -> Reply {
        Err(ProviderError::Unavailable {
            status: 503,
            body: "down".into(),
        })
    }

    /// A SQLite store in a tempdir and `n` zone exits of devices `{prefix}-{i}`.
    async fn setup(prefix: &str, n: usize) -> (tempfile::TempDir, Deps, Vec<Message>) {
        let dir = tempfile::tempdir().unwrap();
        let deps = deps(&dir).await;
        let msgs = (0..n)
            .map(|i| zone_exit(&format!("{prefix}-{i}"), 1, "X"))
            .collect();
        (dir, deps, msgs)
    }

    /// `m` alone in idempotent mode (the claim sweeper's path), the provider
    /// answering `reply`.
    async fn alone(deps: &Deps, m: &Message, reply: fn() -> Reply) -> Result<Outcome, HandleError> {
        let mode = ConsumerMode::Idempotent;
        perform(SMS, deps, mode, m, &CrashPlan::none(), |_| async move {
            reply()
        })
        .await
    }

    /// `envs` as one batch, every send accepted.
    async fn all_sent(deps: &Deps, envs: &[&Message]) -> Result<Vec<Outcome>, HandleError> {
        perform_batch(SMS, deps, envs, &CrashPlan::none(), |_, _| async { sent() }).await
    }

    fn processed(effect: EffectResult, took_over_in_doubt: bool) -> Outcome {
        Outcome::Processed {
            effect: Some(effect),
            took_over_in_doubt,
        }
    }

    /// The reason and detail of a rejection, the cause of a retry, or the outcome.
    fn fate(o: &Outcome) -> String {
        match o {
            Outcome::Rejected(r) => format!("{}: {}", r.reason, r.detail),
            Outcome::Retry(Retry { cause, .. }) => format!("retry {cause:?}"),
            o => format!("{o:?}"),
        }
    }

    /// A `store_rejected` dead letter that names the database's refusal and says the
    /// effect happened, and `more`.
    fn assert_refused_but_sent(o: &Outcome, more: &str) {
        let fate = fate(o);
        for words in ["store_rejected: ", "idw_refuse", "DID happen", more] {
            assert!(fate.contains(words), "{words:?} in {fate}");
        }
    }

    fn assert_outage<T: std::fmt::Debug>(r: &Result<T, HandleError>) {
        assert!(
            matches!(r, Err(HandleError::Store(e)) if e.is_infrastructure()),
            "{r:?}"
        );
    }

    /// Each of `msgs` has a claim, in the state `want` gives it.
    async fn assert_claims(deps: &Deps, msgs: &[Message], want: &[ClaimState]) {
        let mut states = Vec::new();
        for m in msgs {
            let claim = deps.store.claim(SMS, m.key()).await.unwrap();
            states.push(claim.expect("a claim").state);
        }
        assert_eq!(states, want);
    }

    /// A batch of sends, each answered its own way: sent, replayed, refused for good,
    /// failing. Each answer is recorded on its own claim: `sent` (twice), `failed`
    /// (nothing went out, never send it again), and a release — the claim stays open
    /// and the next delivery takes it over in doubt and sends it under the same key,
    /// while the three finished ones are duplicates.
    #[tokio::test]
    async fn a_batch_records_each_answer_on_its_own_claim() {
        let (_dir, deps, msgs) = setup("34-ANS", 4).await;
        let envs: Vec<&Message> = msgs.iter().collect();
        let first = perform_batch(SMS, &deps, &envs, &CrashPlan::none(), |env, _key| {
            let reply = match env.device_id.as_str() {
                "34-ANS-0" => sent(),
                "34-ANS-1" => accepted(true),
                "34-ANS-2" => refused(),
                _ => failing(),
            };
            async move { reply }
        })
        .await
        .unwrap();
        assert_eq!(
            first[..2],
            [
                processed(EffectResult::Sent, false),
                processed(EffectResult::Suppressed, false)
            ]
        );
        let infra = RetryCause::Infra {
            kind: InfraKind::ProviderUnavailable,
            after: None,
        };
        assert_eq!(
            first[2..].iter().map(fate).collect::<Vec<_>>(),
            [
                "provider_rejected: provider rejected the request (400): recipient_refused"
                    .to_string(),
                format!("retry {infra:?}")
            ]
        );
        assert_claims(&deps, &msgs, &[Sent, Sent, Failed, Claimed]).await;
        let keys = std::sync::Mutex::new(Vec::new());
        let again = perform_batch(SMS, &deps, &envs, &CrashPlan::none(), |env, key| {
            keys.lock().unwrap().push((env.device_id.clone(), key));
            async { sent() }
        })
        .await
        .unwrap();
        assert_eq!(
            again,
            [
                Outcome::Duplicate,
                Outcome::Duplicate,
                Outcome::Duplicate,
                processed(EffectResult::Sent, true)
            ]
        );
        assert_eq!(
            keys.into_inner().unwrap(),
            [("34-ANS-3".to_string(), provider_key(SMS, msgs[3].key()))]
        );
        assert_claims(&deps, &msgs[3..], &[Sent]).await;
    }

    /// The crash point between the claims and the sends is reached when the batch won
    /// a claim (nothing sent: the claim comes back in doubt) and not when it has
    /// nothing to send.
    #[tokio::test]
    async fn a_batch_reaches_the_after_claim_point_only_when_it_has_a_send_to_make() {
        let (_dir, deps, msgs) = setup("34-CRASH", 2).await;
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let send = |_: &Message, _: String| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { sent() }
        };
        let first = perform_batch(SMS, &deps, &[&msgs[0]], &CrashPlan::none(), send)
            .await
            .unwrap();
        assert_eq!(first, [processed(EffectResult::Sent, false)]);
        let crash = CrashPlan::at(CrashPoint::AfterClaim, 1, CrashStyle::Unwind);
        let done = perform_batch(SMS, &deps, &[&msgs[0]], &crash, send)
            .await
            .unwrap();
        assert_eq!((done, crash.pending()), (vec![Outcome::Duplicate], 1));
        let died = perform_batch(SMS, &deps, &[&msgs[1]], &crash, send).await;
        assert!(
            matches!(
                died,
                Err(HandleError::Crashed(Crashed(CrashPoint::AfterClaim)))
            ),
            "{died:?}"
        );
        assert_eq!(crash.pending(), 0);
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_claims(&deps, &msgs[1..], &[Claimed]).await;
    }

    /// A trigger that runs `body` before an update of `key`'s claim to `state`
    /// (SQLite cannot add a CHECK to a table; a trigger's error is what the database
    /// says of the row).
    fn trigger(dir: &tempfile::TempDir, key: &MessageKey, state: &str, body: &str) {
        let key = key.as_str();
        exec(
            dir,
            &format!(
                "CREATE TABLE IF NOT EXISTS idw_one (x INTEGER PRIMARY KEY);
                 INSERT OR IGNORE INTO idw_one VALUES (1);
                 CREATE TRIGGER \"idw {state} {key}\" BEFORE UPDATE ON side_effect_claims
                 WHEN NEW.state = '{state}' AND NEW.message_key = '{key}'
                 BEGIN {body}; END;"
            ),
        );
    }

    /// The database refuses the row for what it holds (SQLITE_CONSTRAINT_TRIGGER).
    const REFUSE: &str = "SELECT RAISE(ABORT, 'idw_refuse: not this row')";
    /// A unique key taken (SQLITE_CONSTRAINT_PRIMARYKEY): another writer got there
    /// first, a race the store reports as its health, retried later.
    const DOWN: &str = "INSERT INTO idw_one VALUES (1)";
    /// An error that is neither (SQLITE_ERROR): a bug, a schema that does not match.
    const BROKEN: &str = "SELECT json('not json')";

    /// The database refuses the batch's record for one row's content: the answers are
    /// recorded one by one, the refused `sent` becomes one `store_rejected` dead letter
    /// saying the SMS went out, its claim is closed `failed`, and the answers after it
    /// commit as sent.
    #[tokio::test]
    async fn a_refused_record_in_a_batch_costs_only_its_own_message() {
        let (dir, deps, msgs) = setup("34-REF", 3).await;
        trigger(&dir, msgs[0].key(), "sent", REFUSE);
        let envs: Vec<&Message> = msgs.iter().collect();
        let outcomes = all_sent(&deps, &envs).await.unwrap();
        assert_refused_but_sent(&outcomes[0], "closed `failed`");
        assert_eq!(
            outcomes[1..],
            [
                processed(EffectResult::Sent, false),
                processed(EffectResult::Sent, false)
            ]
        );
        assert_claims(&deps, &msgs, &[Failed, Sent, Sent]).await;
    }

    /// A refused `sent` whose closing `failed` is refused too: still one
    /// `store_rejected` dead letter saying the SMS went out, and that the claim stays
    /// open for the sweeper (the provider replays) and `claims resolve`. A closing
    /// `failed` that fails for the store's health instead is an uncounted retry of
    /// the whole message (its claim still open, taken over in doubt later).
    #[tokio::test]
    async fn a_refused_send_whose_claim_cannot_be_closed_stays_open() {
        let (dir, deps, msgs) = setup("34-CLOSE", 2).await;
        for (m, body) in msgs.iter().zip([REFUSE, DOWN]) {
            trigger(&dir, m.key(), "sent", REFUSE);
            trigger(&dir, m.key(), "failed", body);
        }
        let refused = alone(&deps, &msgs[0], sent).await.unwrap();
        assert_refused_but_sent(&refused, "refused too");
        assert_outage(&alone(&deps, &msgs[1], sent).await);
        assert_claims(&deps, &msgs, &[Claimed, Claimed]).await;
    }

    /// A `sent` that cannot be recorded for the store's health is the store's failure,
    /// alone or in a batch: the batch is not recorded one by one (every statement would
    /// meet the same outage), and nothing is dead-lettered; the claims stay open.
    #[tokio::test]
    async fn a_record_failing_for_the_stores_health_is_an_error_not_an_outcome() {
        let (dir, deps, msgs) = setup("34-DOWN", 3).await;
        trigger(&dir, msgs[0].key(), "sent", DOWN);
        trigger(&dir, msgs[2].key(), "sent", DOWN);
        assert_outage(&all_sent(&deps, &[&msgs[1], &msgs[0]]).await);
        assert_outage(&alone(&deps, &msgs[2], sent).await);
        assert_claims(&deps, &msgs, &[Claimed, Claimed, Claimed]).await;
    }

    /// A `sent` the database fails for a reason that is neither the row's content nor
    /// its health (a bug, a schema that does not match) is a counted retry: the claim
    /// is not closed, since nothing says the row is wrong.
    #[tokio::test]
    async fn a_record_failing_for_another_reason_is_a_counted_retry() {
        let (dir, deps, msgs) = setup("34-BUG", 1).await;
        trigger(&dir, msgs[0].key(), "sent", BROKEN);
        let outcome = alone(&deps, &msgs[0], sent).await.unwrap();
        assert_eq!(fate(&outcome), "retry Message");
        assert_claims(&deps, &msgs, &[Claimed]).await;
    }

    /// One message alone (the path of the claim sweeper and of a batch's retry):
    /// sent under its claim's provider key and recorded `sent`, refused and recorded
    /// `failed`, failing and released (open, taken over in doubt next time).
    #[tokio::test]
    async fn one_message_alone_records_its_answer_on_its_claim() {
        let (_dir, deps, msgs) = setup("34-ONE", 3).await;
        let mut outcomes = Vec::new();
        for (m, reply) in msgs.iter().zip([sent(), refused(), failing()]) {
            let want = provider_key(SMS, m.key());
            let send = |key: Option<String>| async move {
                assert_eq!(key, Some(want));
                reply
            };
            let mode = ConsumerMode::Idempotent;
            let crash = CrashPlan::none();
            outcomes.push(perform(SMS, &deps, mode, m, &crash, send).await.unwrap());
        }
        assert_eq!(outcomes[0], processed(EffectResult::Sent, false));
        assert!(fate(&outcomes[1]).starts_with("provider_rejected: "));
        assert!(fate(&outcomes[2]).starts_with("retry Infra"));
        assert_claims(&deps, &msgs, &[Sent, Failed, Claimed]).await;
        let again = alone(&deps, &msgs[2], || accepted(true)).await.unwrap();
        assert_eq!(again, processed(EffectResult::Suppressed, true));
    }

    /// A redelivery in the batch of its first delivery takes the first's fate as a
    /// second claim after it would have found it: a key conflict stays a key conflict
    /// (its key is stored with another fingerprint), a refusal for good is a
    /// duplicate (the claim is `failed`: never send it again). One call in all.
    #[tokio::test]
    async fn a_twin_conflicts_with_its_first_and_is_a_duplicate_of_its_refusal() {
        let (_dir, deps, msgs) = setup("34-TWIN", 2).await;
        let stored = zone_exit("34-TWIN-0", 1, "elsewhere");
        assert_eq!(stored.key(), msgs[0].key());
        let first = all_sent(&deps, &[&stored]).await.unwrap();
        assert_eq!(first, [processed(EffectResult::Sent, false)]);
        let calls = std::sync::Mutex::new(Vec::new());
        let (x, y) = (&msgs[0], &msgs[1]);
        let outcomes = perform_batch(SMS, &deps, &[x, y, x, y], &CrashPlan::none(), |env, _| {
            calls.lock().unwrap().push(env.device_id.clone());
            async { refused() }
        })
        .await
        .unwrap();
        let fates: Vec<String> = outcomes.iter().map(fate).collect();
        let kinds: Vec<&str> = fates.iter().map(|f| f.split(':').next().unwrap()).collect();
        let want = [
            "key_conflict",
            "provider_rejected",
            "key_conflict",
            "Duplicate",
        ];
        assert_eq!(kinds, want, "{fates:?}");
        assert_eq!(calls.into_inner().unwrap(), ["34-TWIN-1"]);
        assert_claims(&deps, &msgs, &[Sent, Failed]).await;
    }

    /// The claim's detail tells an operator reading `claims` whether this delivery
    /// sent the effect or the provider replayed an earlier send, and with what status;
    /// the effect counted is `sent` or `suppressed` accordingly.
    #[test]
    fn a_sent_claim_says_whether_the_provider_sent_or_replayed() {
        let reply = |replayed| ProviderReply {
            status: 202,
            replayed,
            body: String::new(),
        };
        assert_eq!(sent_detail(&reply(false)), "sent (202)");
        assert_eq!(
            sent_detail(&reply(true)),
            "provider replayed its first response (202)"
        );
        assert_eq!(sent_or_replayed(&reply(false)), EffectResult::Sent);
        assert_eq!(sent_or_replayed(&reply(true)), EffectResult::Suppressed);
    }
}
