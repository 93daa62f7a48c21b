//! The claim sweeper: no claim stays in doubt forever (issue 14).
//!
//! A claim left `claimed` past its lease is in doubt: the send may or may not have
//! happened. Usually a redelivery of its message takes it over. But a message can be
//! gone from the queue while its claim is still open (the queue gave up on it, it
//! was purged, a broker lost it), and then nothing would ever finish the claim. The
//! sweeper re-drives such claims itself, from the message kept beside the claim
//! (`side_effect_claims.message`): it hands the message to the consumer's own
//! handler, which takes the claim over with its compare-and-set and resends with
//! the claim's provider key, so the provider's dedup answers for a send that had
//! already gone out. A redelivery racing the sweeper loses the compare-and-set and
//! comes back later as a duplicate: one effect either way.
//!
//! A message the sweeper finishes is counted as the runner counts one it finishes
//! (`idem_messages_processed_total`, `idem_dead_lettered_total{reason}`; the side
//! effect itself is counted by the handler): the runner never sees it again but as
//! a duplicate, so without this the processed count would miss every message a
//! sweep finished and the duplicate ratio would read too high.
//!
//! Claims taken before the message was kept (NULL) cannot be re-driven here; they
//! wait for a redelivery or `idemwatch claims resolve`.
//!
//! A claim this process still holds is not re-driven: its call may be in flight, or
//! its answer waiting to be recorded after a store outage (see `consumers/custody.rs`);
//! the handler finds it held and leaves it, or records the answer it holds. Between
//! sweeps the loop records such kept answers every [`FLUSH_EVERY`], so one is recorded
//! within about a second of the store coming back, before the claim's lease could let
//! another instance take it over. "Past its lease" is decided on the database's clock
//! ([`Store::db_now`]).

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use serde::Serialize;
use tokio::sync::watch;

use super::consumers::{record_kept, Consumer, ConsumerMode, Deps, HandleError, Outcome};
use super::envelope::Message;
use super::metrics::Metrics;
use super::store::{Store, StoreError};

/// Claims re-driven per sweep at most: a sweep after a long provider outage must
/// not hold the loop for minutes; the next sweep takes the rest.
pub const MAX_PER_SWEEP: i64 = 500;

/// How often answers kept through a store outage are tried again between sweeps.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SweepReport {
    /// Open claims past their lease.
    pub in_doubt: usize,
    /// Finished by the sweep (sent, or the provider's stored answer replayed).
    pub finished: usize,
    /// Not finished this time (the provider still failing, another owner): left
    /// for the next sweep or a redelivery.
    pub left: usize,
    /// Refused for good by the provider: dead-lettered with the message.
    pub dead_lettered: usize,
    /// No message kept beside the claim: only a redelivery or `claims resolve`.
    pub without_message: usize,
}

/// Re-drive every in-doubt claim of `consumers` (idempotent ones only: a naive or
/// seen-set handler does not take claims and must not send without one).
pub async fn sweep(
    consumers: &[Arc<dyn Consumer>],
    store: &dyn Store,
    metrics: &Metrics,
    lease: Duration,
) -> Result<SweepReport, StoreError> {
    let claiming: Vec<&Arc<dyn Consumer>> = consumers
        .iter()
        .filter(|c| c.mode() == ConsumerMode::Idempotent)
        .collect();
    let names: Vec<&str> = claiming.iter().map(|c| c.name()).collect();
    let mut report = SweepReport::default();
    if names.is_empty() {
        return Ok(report);
    }
    let now = store.db_now().await?;
    let before = chrono::Duration::from_std(lease)
        .ok()
        .and_then(|lease| now.checked_sub_signed(lease))
        .unwrap_or(chrono::DateTime::<Utc>::MIN_UTC);
    let stranded = store.stranded_claims(&names, before, MAX_PER_SWEEP).await?;
    report.in_doubt = stranded.len();
    for s in stranded {
        let Some(consumer) = claiming.iter().find(|c| c.name() == s.claim.consumer) else {
            continue;
        };
        let Some(env) = s.message.as_deref().and_then(|m| Message::parse(m).ok()) else {
            report.without_message += 1;
            continue;
        };
        match consumer.redrive(&env).await {
            Ok(Outcome::Processed { .. }) => {
                metrics.processed(consumer.name());
                tracing::info!(consumer = consumer.name(), key = %s.claim.message_key,
                    attempts = s.claim.attempts + 1, "claim sweeper: in-doubt claim finished");
                report.finished += 1;
            }
            Ok(Outcome::Rejected(r)) => {
                let raw = s.message.unwrap_or_default();
                store
                    .dead_letter(consumer.name(), r.reason, &r.detail, &raw)
                    .await?;
                metrics.dead_lettered(consumer.name(), r.reason);
                report.dead_lettered += 1;
            }
            Ok(Outcome::Retry(retry)) => {
                tracing::warn!(consumer = consumer.name(), key = %s.claim.message_key,
                    why = %retry.why, "claim sweeper: claim still in doubt, retried at the next sweep");
                report.left += 1;
            }
            Ok(_) => report.left += 1,
            // The store away: the claims after this one would fail alike.
            Err(HandleError::Store(e)) if e.is_infrastructure() => return Err(e),
            // This claim's own trouble must not stop the sweep of the claims after
            // it (oldest first, so it would block them on every sweep).
            Err(HandleError::Store(e)) => {
                tracing::warn!(consumer = consumer.name(), key = %s.claim.message_key,
                    error = %e, "claim sweeper: could not re-drive this claim; left open");
                report.left += 1;
            }
            Err(HandleError::Crashed(_)) => report.left += 1,
        }
    }
    Ok(report)
}

/// How often [`run`] sweeps: twice per lease, between 100 ms and 30 s.
pub fn interval(lease: Duration) -> Duration {
    (lease / 2).clamp(Duration::from_millis(100), Duration::from_secs(30))
}

/// Sweep every [`interval`] until `shutdown`, and record the answers kept through a
/// store outage every [`FLUSH_EVERY`] between sweeps; a failed sweep or record (the
/// store away) is logged and tried again at the next tick.
pub async fn run(
    consumers: Vec<Arc<dyn Consumer>>,
    deps: Deps,
    mut shutdown: watch::Receiver<bool>,
) {
    let lease = deps.claim_lease;
    let every = interval(lease);
    let tick = every.min(FLUSH_EVERY);
    let mut since_sweep = Duration::ZERO;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = shutdown.changed() => {}
        }
        if *shutdown.borrow() {
            return;
        }
        since_sweep += tick;
        if deps.custody.answers_kept() > 0 {
            for c in consumers
                .iter()
                .filter(|c| c.mode() == ConsumerMode::Idempotent)
            {
                if let Err(e) = record_kept(c.name(), &deps).await {
                    tracing::warn!(consumer = c.name(), error = %e,
                        "kept provider answers still not recorded; trying again");
                }
            }
        }
        if since_sweep < every {
            continue;
        }
        since_sweep = Duration::ZERO;
        match sweep(&consumers, deps.store.as_ref(), &deps.metrics, lease).await {
            Ok(r) if r.in_doubt > 0 => tracing::info!(?r, "claim sweep"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "claim sweep failed; trying again later"),
        }
    }
}
