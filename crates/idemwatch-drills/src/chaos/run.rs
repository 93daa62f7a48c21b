//! The chaos run proper: publish in the background while the killer SIGKILLs and
//! restarts one random instance on its schedule, then stop every instance and let
//! one last in-process consumer drain what the last kills left unacked.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use super::setup::{Arena, Instance};
use super::verify::ready_total;
use super::{
    say, setup_failed, ChaosOptions, KillSchedule, CHAOS_CLAIM_LEASE, CHAOS_MAX_DELIVERIES,
    PROGRESS_POLL,
};
use crate::DrillError;
use idemwatch_engine::crash::CrashPlan;
use idemwatch_engine::runner::RunnerSettings;

/// What the killing phase did.
pub(super) struct Storm {
    pub kills: u64,
    pub publish_seconds: f64,
}

/// What was left after the instances stopped.
pub(super) struct Drained {
    /// Deliveries the last consumer handled (processed, duplicates, dead letters).
    pub after_stop: u64,
    /// Messages still on the queues at the very end.
    pub left_on_queues: u64,
}

/// Publish the truth in the background, counting the deliveries put on the queues
/// (one per message and queue) for a killer that goes by progress, and kill until
/// everything is published and the queues are empty, or the drain timeout.
pub(super) async fn kill_while_publishing(
    opts: &ChaosOptions,
    arena: &Arena,
    instances: &mut [Instance],
) -> Result<Storm, DrillError> {
    let bodies: Vec<Vec<u8>> = arena.truth.messages.iter().map(|m| m.raw.clone()).collect();
    let batch = opts.publish_batch.max(1);
    let publish_started = Instant::now();
    let published = Arc::new(AtomicU64::new(0));
    let publishing = {
        let (queue, published) = (arena.queue.clone(), published.clone());
        let queues = arena.queue_names.clone();
        tokio::spawn(async move {
            for chunk in bodies.chunks(batch) {
                queue.publish(&queues, chunk).await?;
                published.fetch_add((chunk.len() * queues.len()) as u64, Ordering::SeqCst);
            }
            Ok::<f64, idemwatch_engine::queue::QueueError>(publish_started.elapsed().as_secs_f64())
        })
    };

    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(opts.seed ^ 0x5eed);
    let mut kills = 0u64;
    let mut publish_seconds = None;
    let mut publishing = Some(publishing);
    let deadline = Instant::now() + opts.drain_timeout;
    let mut last_report = Instant::now();
    let (tick, mut next_kill_at) = match opts.kill_every {
        KillSchedule::Every(d) => (d, 0),
        KillSchedule::EveryMessages(n) => (PROGRESS_POLL, n.max(1)),
    };
    loop {
        tokio::time::sleep(tick).await;
        if let Some(p) = publishing.as_ref() {
            if p.is_finished() {
                let done = publishing
                    .take()
                    .ok_or_else(|| setup_failed("publisher vanished"))?
                    .await
                    .map_err(setup_failed)?
                    .map_err(setup_failed)?;
                say(opts, format!("all messages published in {done:.1}s"));
                publish_seconds = Some(done);
            }
        }
        let ready = ready_total(arena.queue.as_ref(), &arena.queue_names).await;
        // Taken off the queues: acked (embedded queue), or handed to an instance (a
        // broker's ready count does not hold its unacked deliveries).
        let taken = published.load(Ordering::SeqCst).saturating_sub(ready);
        // A kill point passed and not served yet. Kill points passed between two looks
        // are caught up one per look, and they are served even once the queues are
        // empty: instances that took everything in a burst still hold unacked
        // deliveries, and the schedule promises as many kills on a fast machine as on
        // a slow one (a run that ended at the first empty look got 2 kills instead of
        // 13 when consumption outran the looks).
        let owed =
            matches!(opts.kill_every, KillSchedule::EveryMessages(_)) && taken >= next_kill_at;
        if publishing.is_none() && ready == 0 && !owed {
            break;
        }
        if Instant::now() > deadline {
            say(opts, "drain timeout: stopping the kills");
            break;
        }
        if let KillSchedule::EveryMessages(n) = opts.kill_every {
            if !owed {
                continue;
            }
            next_kill_at += n.max(1);
        }
        let victim = rng.random_range(0..instances.len());
        instances[victim].kill().await;
        kills += 1;
        instances[victim].start()?;
        if last_report.elapsed() > Duration::from_secs(10) {
            say(
                opts,
                format!("{kills} kills so far; {ready} messages ready on the queues"),
            );
            last_report = Instant::now();
        }
    }
    let publish_seconds = match (publish_seconds, publishing) {
        (Some(s), _) => s,
        (None, Some(p)) => p.await.map_err(setup_failed)?.map_err(setup_failed)?,
        (None, None) => 0.0,
    };
    Ok(Storm {
        kills,
        publish_seconds,
    })
}

/// Let the instances finish what they hold, kill them all (the last kill of the
/// run), and drain: whatever the last kills left unacked comes back to one last
/// in-process consumer.
pub(super) async fn stop_and_drain(
    opts: &ChaosOptions,
    arena: &Arena,
    instances: &mut [Instance],
    kills: u64,
) -> Result<Drained, DrillError> {
    tokio::time::sleep(Duration::from_secs(1)).await;
    for inst in instances.iter_mut() {
        inst.kill().await;
    }
    say(opts, format!("{kills} kills; draining what is left"));
    let drain_cfg = {
        let mut c = arena.cfg.clone();
        c.claim_lease = CHAOS_CLAIM_LEASE;
        c.runner = RunnerSettings {
            idle_poll: Duration::from_millis(50),
            retry_delay: Duration::from_millis(250),
            max_retry_delay: CHAOS_CLAIM_LEASE,
            max_deliveries: CHAOS_MAX_DELIVERIES,
            ..RunnerSettings::default()
        };
        c
    };
    let drained = arena
        .engine(&drain_cfg)?
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .map_err(setup_failed)?;
    Ok(Drained {
        after_stop: drained.total.processed
            + drained.total.duplicate_dropped
            + drained.total.dead_lettered,
        left_on_queues: ready_total(arena.queue.as_ref(), &arena.queue_names).await,
    })
}
