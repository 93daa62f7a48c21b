//! The two-phase side effect shared by `zone-exit-sms` and `erp-webhook`:
//! claim (in the dedup transaction) → call the provider with the claim's key →
//! record `sent` / `failed`.
//!
//! Invariant: one external effect per distinct key. The claim makes a redelivery
//! that finds `sent` do nothing; the provider's Idempotency-Key closes the window the
//! claim cannot (a crash after the send, before the record): the in-doubt retry
//! reuses the same key and the provider replays instead of sending again.
//!
//! The provider's answer is never thrown away (issue 43): a record that fails for the
//! store's health keeps the answer in the process ([`Custody`](super::custody)) and
//! gives the batch back like any outage; the next delivery of the message (or the
//! claim sweeper) records it — the record is retried, never the send. The owner keeps
//! its claims while their calls run and confirms them before a late send
//! ([`Holding`]), and records an answer only while the claim is still its own
//! ([`ClaimResult::attempts`]): a frozen owner that wakes cannot send or finish over
//! the owner that took its claims over.

use std::future::Future;
use std::time::Instant;

use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::custody::{Kept, Taken, Ticket};
use super::holding::{Hold, Holding};
use super::{ConsumerMode, Deps, HandleError, Outcome, RetryCause};
use crate::crash::{CrashPlan, CrashPoint};
use crate::envelope::{Message, MessageKey, RejectReason, Rejection};
use crate::health::InfraKind;
use crate::metrics::{EffectResult, RepeatReason};
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

/// Who makes a call: a delivery of the message, or the claim sweeper re-driving a
/// claim from the message kept beside it. Only the reason a repeat call is counted
/// under differs (`idem_provider_repeat_calls_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Caller {
    Delivery,
    Sweeper,
}

/// Perform `send` at most once per key, according to `mode`.
pub(crate) async fn perform<F, Fut>(
    consumer: &'static str,
    deps: &Deps,
    mode: ConsumerMode,
    env: &Message,
    crash: &CrashPlan,
    caller: Caller,
    send: F,
) -> Result<Outcome, HandleError>
where
    F: FnOnce(Option<String>) -> Fut + Send,
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
        // One message alone is a batch of one: the same claim, the same hold on it,
        // the same record and the same keeping of an answer whose record failed.
        ConsumerMode::Idempotent => {
            let once = std::sync::Mutex::new(Some(send));
            let mut outcomes = perform_batch(consumer, deps, &[env], crash, caller, |_, key| {
                let send = once.lock().unwrap_or_else(|e| e.into_inner()).take();
                async move {
                    match send {
                        Some(send) => send(Some(key)).await,
                        // perform_batch calls once per claim it won, and there is one.
                        None => Err(ProviderError::Transport(
                            "a second send for one claim was refused".into(),
                        )),
                    }
                }
            })
            .await?;
            Ok(outcomes
                .pop()
                .unwrap_or_else(|| Outcome::retry(RetryCause::Message, "no outcome decided")))
        }
    }
}

/// A claim this batch won, and how.
struct Owned {
    /// The envelope's place among the batch's claimed envelopes.
    i: usize,
    claim: Claim,
    taking: Taking,
    ticket: Ticket,
}

/// How the batch came to own a claim: which decides whether its call may repeat an
/// earlier one (`idem_provider_repeat_calls_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Taking {
    /// The key's first claim.
    Fresh,
    /// Given back by an owner whose call failed at the provider: the retry it asked for.
    Released,
    /// Taken over from an owner whose lease ran out with no record: its call may have
    /// gone out.
    InDoubt,
}

/// [`perform`] in idempotent mode for a batch: the claims of the whole batch in one
/// transaction, the provider calls of the claims it won concurrently (at most
/// `deps.provider_concurrency` in flight, each with its own claim's provider key),
/// then every answer recorded in one transaction. One outcome per envelope, in order.
///
/// Answers this process kept from an earlier attempt (their record failed for the
/// store's health) are recorded first, never sent again; a key another batch of this
/// process holds is busy (see [`Custody`](super::custody::Custody)). While the calls
/// run, the claims are renewed and confirmed before a late send ([`Holding`]).
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
/// neighbours commit at once. When it fails for its health, every answer is kept and
/// the error returned: the runner gives the batch back and pauses, as for any outage.
pub(crate) async fn perform_batch<'e, F, Fut>(
    consumer: &'static str,
    deps: &Deps,
    batch: &[&'e Message],
    crash: &CrashPlan,
    caller: Caller,
    send: F,
) -> Result<Vec<Outcome>, HandleError>
where
    F: Fn(&'e Message, String) -> Fut,
    Fut: Future<Output = Result<ProviderReply, ProviderError>>,
{
    // `envs`: what is claimed (no two of one key and fingerprint); `place`: where
    // each envelope of the batch takes its outcome from.
    let (envs, place) = twins(batch);
    let mut outcomes: Vec<Option<Outcome>> = vec![None; envs.len()];
    // The key of an envelope with another fingerprint than its first in the batch is
    // claimed without a ticket of its own: the claim decides it (a key conflict).
    let mut free: Vec<(usize, Option<Ticket>)> = Vec::new();
    let mut kept: Vec<(usize, Ticket, Kept)> = Vec::new();
    let mut taken: std::collections::HashSet<&MessageKey> = std::collections::HashSet::new();
    for (i, env) in envs.iter().enumerate() {
        if !taken.insert(env.key()) {
            free.push((i, None));
            continue;
        }
        match deps.custody.take(consumer, env.key()) {
            Taken::Free(ticket) => free.push((i, Some(ticket))),
            Taken::Answered(ticket, answer) => kept.push((i, ticket, answer)),
            Taken::Busy => outcomes[i] = Some(held_here()),
        }
    }
    // What this process already knows is recorded first; an outage here is the
    // batch's, as before any send.
    let recorded_kept = !kept.is_empty();
    if recorded_kept {
        record_answers(deps, consumer, kept, &mut outcomes).await?;
    }
    let requests: Vec<ClaimRequest> = free
        .iter()
        .map(|(i, _)| claim_request(consumer, envs[*i]))
        .collect();
    let claimed_from = Instant::now();
    let claimed = if requests.is_empty() {
        Ok(Vec::new())
    } else {
        deps.store
            .claim_batch(consumer, &requests, deps.claim_lease)
            .await
    };
    let claims = match claimed {
        Ok(claims) => claims,
        // Kept answers just recorded keep their outcomes; the rest come back.
        Err(e) if recorded_kept && e.is_infrastructure() => {
            for (i, _) in &free {
                outcomes[*i] = Some(Outcome::of_store_error(&e));
            }
            Vec::new()
        }
        Err(e) => return Err(e.into()),
    };
    let mut owned: Vec<Owned> = Vec::new();
    for ((i, ticket), claim) in free.into_iter().zip(claims) {
        let (claim, taking) = match claim {
            ClaimOutcome::KeyConflict { stored } => {
                outcomes[i] = Some(conflict(stored.as_str()));
                continue;
            }
            ClaimOutcome::Done(..) => {
                let age = claim.duplicate_age(chrono::Utc::now());
                deps.metrics.duplicate_age(consumer, age);
                deps.metrics.side_effect(consumer, EffectResult::Suppressed);
                outcomes[i] = Some(Outcome::Duplicate);
                continue;
            }
            ClaimOutcome::Busy => {
                outcomes[i] = Some(Outcome::retry(
                    RetryCause::Busy,
                    "another delivery holds a live claim on this key",
                ));
                continue;
            }
            ClaimOutcome::Fresh(c) => (c, Taking::Fresh),
            ClaimOutcome::Released(c) => (c, Taking::Released),
            ClaimOutcome::InDoubt(c) => {
                tracing::warn!(consumer, key = %envs[i].key(), attempts = c.attempts,
                    "claim in doubt: resending with the same provider key");
                (c, Taking::InDoubt)
            }
        };
        // A claim is won once per key and batch, by the envelope that took the ticket.
        let Some(ticket) = ticket else {
            outcomes[i] = Some(held_here());
            continue;
        };
        owned.push(Owned {
            i,
            claim,
            taking,
            ticket,
        });
    }
    if !owned.is_empty() {
        crash.reach(CrashPoint::AfterClaim)?;
    }
    let holding = Holding::new(
        deps.store.as_ref(),
        consumer,
        deps.claim_lease,
        claimed_from,
        owned
            .iter()
            .map(|o| (envs[o.i].key().clone(), o.claim.attempts)),
    );
    let (holding, send) = (&holding, &send);
    let mut calls = futures::stream::iter(owned.into_iter().map(|o| {
        let env = envs[o.i];
        async move {
            let hold = holding.holds(env.key()).await;
            let reply = match hold {
                Hold::Yes => Some(send(env, o.claim.provider_key.clone()).await),
                Hold::Lost | Hold::Unconfirmed(_) => None,
            };
            (o, hold, reply)
        }
    }))
    .buffer_unordered(deps.provider_concurrency.max(1));
    let renewing = holding.keep_renewed();
    tokio::pin!(renewing);
    let mut answers: Vec<(usize, Ticket, Kept)> = Vec::new();
    loop {
        let next = tokio::select! {
            next = calls.next() => next,
            () = &mut renewing => None,
        };
        let Some((o, hold, reply)) = next else { break };
        let key = envs[o.i].key().clone();
        holding.answered(&key);
        let Some(reply) = reply else {
            outcomes[o.i] = Some(not_sent(&hold));
            continue;
        };
        crash.reach(CrashPoint::AfterSideEffect)?;
        if matches!(&reply, Ok(r) if r.replayed) {
            deps.metrics
                .provider_repeat_call(consumer, repeat_reason(o.taking, caller));
        }
        let in_doubt = o.taking != Taking::Fresh;
        let (finish, effect, decided) = match reply {
            Ok(r) => (
                ClaimFinish::Done {
                    state: ClaimState::Sent,
                    detail: sent_detail(&r),
                },
                Some((sent_or_replayed(&r), in_doubt)),
                None,
            ),
            // Refused for good: nothing went out. The claim says so, and the
            // message is kept as a `provider_rejected` dead letter.
            Err(e) if e.infra_kind().is_none() => (
                ClaimFinish::Done {
                    state: ClaimState::Failed,
                    detail: e.to_string(),
                },
                None,
                Some(provider_failed(deps, consumer, &e)),
            ),
            // Throttled, failing or unreachable; whether it went out is unknown:
            // keep the claim, retryable at once with the same key, and give the
            // delivery back uncounted.
            Err(e) => (
                ClaimFinish::Release {
                    detail: e.to_string(),
                },
                None,
                Some(provider_failed(deps, consumer, &e)),
            ),
        };
        let answer = Kept {
            result: ClaimResult::owned(key, finish, o.claim.attempts),
            provider_key: o.claim.provider_key,
            effect,
            decided,
            since: Instant::now(),
        };
        answers.push((o.i, o.ticket, answer));
    }
    drop(calls);
    record_answers(deps, consumer, answers, &mut outcomes).await?;
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

/// Record every answer of this process waiting for `consumer` (their record failed
/// earlier for the store's health): what the claim sweeper does on each tick, so that
/// an answer is recorded as soon as the store is back even when its message went to
/// another instance. Each recorded accepted send counts its message processed, as the
/// runner would have. Returns how many were recorded.
pub(crate) async fn record_kept(consumer: &'static str, deps: &Deps) -> Result<usize, StoreError> {
    let kept: Vec<(usize, Ticket, Kept)> = deps
        .custody
        .take_answered(consumer)
        .into_iter()
        .enumerate()
        .map(|(i, (ticket, answer))| (i, ticket, answer))
        .collect();
    if kept.is_empty() {
        return Ok(0);
    }
    let held_for = kept.iter().map(|(_, _, a)| a.since.elapsed()).max();
    let mut outcomes = vec![None; kept.len()];
    record_answers(deps, consumer, kept, &mut outcomes).await?;
    let recorded = outcomes
        .iter()
        .filter(|o| matches!(o, Some(Outcome::Processed { .. })))
        .count();
    for _ in 0..recorded {
        deps.metrics.processed(consumer);
    }
    tracing::info!(
        consumer,
        recorded,
        ?held_for,
        "recorded provider answers kept through a store outage"
    );
    Ok(recorded)
}

/// Record `answers` on their claims in one transaction, each as its owner, and set
/// each one's outcome. The store failing for its health keeps every answer (the
/// tickets keep them) and is the caller's error; any other failure records them one
/// by one ([`finish_one_by_one`]).
async fn record_answers(
    deps: &Deps,
    consumer: &str,
    answers: Vec<(usize, Ticket, Kept)>,
    outcomes: &mut [Option<Outcome>],
) -> Result<(), StoreError> {
    if answers.is_empty() {
        return Ok(());
    }
    let results: Vec<ClaimResult> = answers.iter().map(|(_, _, a)| a.result.clone()).collect();
    match deps.store.finish_batch(consumer, &results).await {
        Ok(lost) => {
            for (i, _ticket, a) in answers {
                outcomes[i] = Some(if lost.contains(&a.result.key) {
                    lost_claim(deps, consumer, &a).await
                } else {
                    recorded(deps, consumer, a)
                });
            }
            Ok(())
        }
        Err(e) if e.is_infrastructure() => {
            keep(consumer, answers, &e);
            Err(e)
        }
        Err(e) => {
            tracing::warn!(consumer, error = %e, batch = results.len(),
                "recording the batch's provider answers failed for a reason that is not the store's health: recording them one by one");
            finish_one_by_one(deps, consumer, answers, outcomes).await;
            Ok(())
        }
    }
}

/// Keep answers whose record failed for the store's health, for the next attempt.
fn keep(consumer: &str, answers: Vec<(usize, Ticket, Kept)>, e: &StoreError) {
    let sent = answers
        .iter()
        .filter(|(_, _, a)| a.effect.is_some())
        .count();
    tracing::warn!(consumer, error = %e, answers = answers.len(), sent,
        "the store could not record the provider's answers: kept, recorded when it is back (never sent again)");
    for (_, ticket, answer) in answers {
        ticket.keep(answer);
    }
}

/// The message's outcome once its answer is recorded: the accepted send counted, the
/// outcome decided at the answer (a refusal, a provider failure), or for a failure
/// whose record waited through an outage, a busy retry: sent again (under the same
/// key) on its next delivery, by a claim given back now.
fn recorded(deps: &Deps, consumer: &str, a: Kept) -> Outcome {
    match (a.effect, a.decided) {
        (Some((effect, in_doubt)), _) => record(deps, consumer, effect, in_doubt),
        (None, Some(decided)) => decided,
        (None, None) => Outcome::retry(
            RetryCause::Busy,
            "the provider's earlier failure is recorded: sent again on the next delivery",
        ),
    }
}

/// Why a call the provider answered as a replay (it had seen the key) was made:
/// expected of a takeover from an owner whose lease ran out (by a redelivery or the
/// sweeper) and of a retry after a call that failed or timed out; not of a key's
/// first claim.
fn repeat_reason(taking: Taking, caller: Caller) -> RepeatReason {
    match (taking, caller) {
        (Taking::InDoubt, Caller::Delivery) => RepeatReason::LeaseTakeover,
        (Taking::InDoubt, Caller::Sweeper) => RepeatReason::SweeperRedrive,
        (Taking::Released, _) => RepeatReason::ProviderRetry,
        (Taking::Fresh, _) => RepeatReason::Unexpected,
    }
}

/// The answer of a claim another owner holds now (this owner's lease ran out: a
/// frozen or cut-off process, and the claim was taken over). Not written over the new
/// owner's; the delivery comes back, uncounted, and finds the new owner's record.
///
/// An accepted call here and the new owner's make two calls for one key: counted once
/// (`idem_provider_repeat_calls_total{reason="lease_takeover"}`), here, unless the new
/// owner's record says the provider replayed its call (the new owner counted it then).
async fn lost_claim(deps: &Deps, consumer: &str, a: &Kept) -> Outcome {
    if let Some((effect, _)) = a.effect {
        // The call went out: the provider's own count is the truth of it.
        deps.metrics.side_effect(consumer, effect);
        let counted_by_taker = matches!(
            deps.store.claim(consumer, &a.result.key).await,
            Ok(Some(c)) if c.detail.as_deref().is_some_and(|d| d.starts_with(REPLAYED))
        );
        if !counted_by_taker {
            deps.metrics
                .provider_repeat_call(consumer, RepeatReason::LeaseTakeover);
        }
    }
    tracing::warn!(consumer, key = %a.result.key, provider_key = %a.provider_key,
        "the claim was taken over while this owner's call ran: its answer is not recorded over the new owner's");
    Outcome::retry(
        RetryCause::Busy,
        "another owner took the claim over while this call ran (this owner's lease ran out)",
    )
}

/// A key another batch of this process holds (its call in flight, or its answer
/// waiting to be recorded): busy, as a live claim would be.
fn held_here() -> Outcome {
    Outcome::retry(
        RetryCause::Busy,
        "this process holds the claim (its call in flight or its answer not yet recorded)",
    )
}

/// A claim that was not sent: another owner's now, or not confirmed (the store did not
/// answer the owner's renewal).
fn not_sent(hold: &Hold) -> Outcome {
    match hold {
        Hold::Unconfirmed(why) => Outcome::retry(
            RetryCause::Infra {
                kind: InfraKind::Store,
                after: None,
            },
            format!("not sent: could not confirm the claim before sending ({why})"),
        ),
        _ => Outcome::retry(
            RetryCause::Busy,
            "not sent: another owner took the claim over (this owner's lease ran out)",
        ),
    }
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

/// The batch's answers recorded one by one, each in its own statement, after the
/// batch's transaction failed for a reason that is not the store's health: one row
/// the database refuses (a constraint, a trigger) must not keep its neighbours'
/// claims live — they would all come back busy until the lease and be resent. Each
/// answer is settled by [`finish_alone`]. Once a statement fails for the store's
/// health, that answer and the ones not yet recorded are kept for a later record
/// (never sent again), their deliveries given back uncounted.
async fn finish_one_by_one(
    deps: &Deps,
    consumer: &str,
    answers: Vec<(usize, Ticket, Kept)>,
    outcomes: &mut [Option<Outcome>],
) {
    let mut down: Option<StoreError> = None;
    let mut kept = Vec::new();
    for (i, ticket, a) in answers {
        if down.is_some() {
            kept.push((i, ticket, a));
            continue;
        }
        match finish_alone(deps, consumer, &a).await {
            Ok(Some(o)) => outcomes[i] = Some(o),
            Ok(None) => outcomes[i] = Some(recorded(deps, consumer, a)),
            Err(e) => {
                down = Some(e);
                kept.push((i, ticket, a));
            }
        }
    }
    if let Some(e) = down {
        for (i, _, _) in &kept {
            outcomes[*i] = Some(Outcome::of_store_error(&e));
        }
        keep(consumer, kept, &e);
    }
}

/// Record one answer on its claim, as its owner, in a statement of its own.
/// `Ok(None)`: recorded, the outcome is [`recorded`]'s; `Ok(Some)`: the message's
/// outcome decided here; `Err`: the store's health failed it (kept, retried later).
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
    a: &Kept,
) -> Result<Option<Outcome>, StoreError> {
    let r = &a.result;
    let e = match crate::store::finish_claim(deps.store.as_ref(), consumer, r).await {
        Ok(true) => return Ok(None),
        Ok(false) => return Ok(Some(lost_claim(deps, consumer, a).await)),
        Err(e) if e.is_infrastructure() => return Err(e),
        Err(e) => e,
    };
    let (sent, effect) = match (&r.finish, a.effect) {
        (ClaimFinish::Done { detail, .. }, Some((effect, _))) if e.is_content() => (detail, effect),
        (ClaimFinish::Done { .. }, Some(_)) => return Ok(Some(Outcome::of_store_error(&e))),
        (ClaimFinish::Done { .. }, None) => {
            tracing::warn!(consumer, key = %r.key, error = %e,
                "the database refused to record the claim `failed`: it stays open");
            return Ok(a.decided.clone());
        }
        (ClaimFinish::Release { .. }, _) => return Ok(a.decided.clone()),
    };
    let refused = format!(
        "the provider accepted it ({sent}, provider key {}), but the database refused to record `sent` on its claim: {e}",
        a.provider_key
    );
    let close = ClaimResult {
        finish: ClaimFinish::Done {
            state: ClaimState::Failed,
            detail: format!("{refused}; closed `failed` so that nothing sends it again"),
        },
        ..r.clone()
    };
    let after = match crate::store::finish_claim(deps.store.as_ref(), consumer, &close).await {
        Ok(true) => "Its claim was closed `failed` instead, so no sweep or redelivery resends it \
                   and a replay of this letter is dropped as a duplicate."
            .to_string(),
        Ok(false) => return Ok(Some(lost_claim(deps, consumer, a).await)),
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

/// How a sent claim's detail starts when the provider replayed an earlier call.
const REPLAYED: &str = "provider replayed";

fn sent_detail(reply: &ProviderReply) -> String {
    if reply.replayed {
        format!("{REPLAYED} its first response ({})", reply.status)
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
        let outcomes = perform_batch("twin-test", &deps, &batch, &crash, Caller::Delivery, send)
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
        let outcomes = perform_batch(
            "twin-test",
            &deps,
            &[&c, &c],
            &crash,
            Caller::Delivery,
            failing,
        )
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
        perform(
            SMS,
            deps,
            mode,
            m,
            &CrashPlan::none(),
            Caller::Delivery,
            |_| async move { reply() },
        )
        .await
    }

    /// `envs` as one batch, every send accepted.
    async fn all_sent(deps: &Deps, envs: &[&Message]) -> Result<Vec<Outcome>, HandleError> {
        perform_batch(
            SMS,
            deps,
            envs,
            &CrashPlan::none(),
            Caller::Delivery,
            |_, _| async { sent() },
        )
        .await
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

    /// An outcome given back for the store's health, uncounted.
    fn assert_given_back(o: &Outcome) {
        assert!(
            matches!(
                o,
                Outcome::Retry(Retry {
                    cause: RetryCause::Infra {
                        kind: InfraKind::Store,
                        ..
                    },
                    ..
                })
            ),
            "{o:?}"
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
        let first = perform_batch(
            SMS,
            &deps,
            &envs,
            &CrashPlan::none(),
            Caller::Delivery,
            |env, _key| {
                let reply = match env.device_id.as_str() {
                    "34-ANS-0" => sent(),
                    "34-ANS-1" => accepted(true),
                    "34-ANS-2" => refused(),
                    _ => failing(),
                };
                async move { reply }
            },
        )
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
        let again = perform_batch(
            SMS,
            &deps,
            &envs,
            &CrashPlan::none(),
            Caller::Delivery,
            |env, key| {
                keys.lock().unwrap().push((env.device_id.clone(), key));
                async { sent() }
            },
        )
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
        let first = perform_batch(
            SMS,
            &deps,
            &[&msgs[0]],
            &CrashPlan::none(),
            Caller::Delivery,
            send,
        )
        .await
        .unwrap();
        assert_eq!(first, [processed(EffectResult::Sent, false)]);
        let crash = CrashPlan::at(CrashPoint::AfterClaim, 1, CrashStyle::Unwind);
        let done = perform_batch(SMS, &deps, &[&msgs[0]], &crash, Caller::Delivery, send)
            .await
            .unwrap();
        assert_eq!((done, crash.pending()), (vec![Outcome::Duplicate], 1));
        let died = perform_batch(SMS, &deps, &[&msgs[1]], &crash, Caller::Delivery, send).await;
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
    /// the whole message, its answer kept: the next attempt records it again and
    /// never sends.
    #[tokio::test]
    async fn a_refused_send_whose_claim_cannot_be_closed_stays_open() {
        let (dir, deps, msgs) = setup("34-CLOSE", 2).await;
        for (m, body) in msgs.iter().zip([REFUSE, DOWN]) {
            trigger(&dir, m.key(), "sent", REFUSE);
            trigger(&dir, m.key(), "failed", body);
        }
        let refused = alone(&deps, &msgs[0], sent).await.unwrap();
        assert_refused_but_sent(&refused, "refused too");
        assert_given_back(&alone(&deps, &msgs[1], sent).await.unwrap());
        assert_eq!(deps.custody.answers_kept(), 1);
        assert_given_back(&alone(&deps, &msgs[1], never).await.unwrap());
        assert_claims(&deps, &msgs, &[Claimed, Claimed]).await;
    }

    /// A provider that must not be called.
    fn never() -> Reply {
        panic!("the provider was called again for a key whose answer the process holds")
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
            outcomes.push(
                perform(SMS, &deps, mode, m, &crash, Caller::Delivery, send)
                    .await
                    .unwrap(),
            );
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
        let outcomes = perform_batch(
            SMS,
            &deps,
            &[x, y, x, y],
            &CrashPlan::none(),
            Caller::Delivery,
            |env, _| {
                calls.lock().unwrap().push(env.device_id.clone());
                async { refused() }
            },
        )
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
