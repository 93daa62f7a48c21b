//! The runner: deliver → parse → handle (commit) → count → ack, with named crash
//! points between the steps.
//!
//! The ack is a separate step after the business commit, as with any real broker;
//! that gap is where the field report's 7 SMS came from, and where drills aim.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::watch;

use super::consumers::{Consumer, HandleError, Outcome};
use super::crash::{CrashPlan, CrashPoint, Crashed};
use super::envelope::{Envelope, RejectReason, Rejection};
use super::metrics::{EffectResult, Metrics};
use super::queue::{Delivery, Queue, QueueResult};
use super::store::Store;

/// Knobs of the deliver/ack loop.
#[derive(Debug, Clone)]
pub struct RunnerSettings {
    /// How long a leased delivery stays invisible before it is redelivered.
    pub visibility_timeout: Duration,
    /// Past this many deliveries a message is dead-lettered (`max_deliveries`).
    pub max_deliveries: u32,
    /// Deliveries leased per poll, and handled as one batch: a consumer whose effects
    /// are all in the database commits the batch in one transaction and the queue
    /// acks it in one round trip.
    pub lease_batch: usize,
    /// How long to wait for a batch to fill once its first delivery is in (0: take
    /// what is there). Bounds the latency batching adds.
    pub batch_max_wait: Duration,
    /// When a handler says "not now": how long until the delivery comes back (doubled
    /// per earlier delivery, see [`retry_backoff`]).
    pub retry_delay: Duration,
    /// The cap of that doubling: the claim lease, so a message whose claim a dead
    /// process left behind comes back soon after the claim is in doubt.
    pub max_retry_delay: Duration,
    /// Sleep between polls of an empty queue.
    pub idle_poll: Duration,
    /// Overlap the queue with the database: while one batch commits, ack the batch
    /// before it and lease the next one. Off, each batch is leased only once the one
    /// before it is acked (drills use that to keep their delivery traces exact).
    pub pipeline: bool,
}

impl Default for RunnerSettings {
    fn default() -> Self {
        RunnerSettings {
            visibility_timeout: Duration::from_secs(30),
            max_deliveries: 10,
            lease_batch: 16,
            batch_max_wait: Duration::ZERO,
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(60),
            idle_poll: Duration::from_millis(100),
            pipeline: true,
        }
    }
}

/// `retry_delay` doubled per earlier delivery, capped at `cap`. A fixed delay would
/// burn through `max_deliveries` in seconds while a dead process's claim is still
/// within its lease (60 s): the message would be dead-lettered and its SMS never sent.
/// Doubling outlasts the lease well before the limit.
pub fn retry_backoff(retry_delay: Duration, delivery_count: u32, cap: Duration) -> Duration {
    let doublings = delivery_count.saturating_sub(1).min(16);
    retry_delay
        .saturating_mul(1u32 << doublings)
        .min(cap.max(retry_delay))
}

/// What happened to one delivery; streamed to drills (and, as JSON lines, from a
/// child consumer process to its supervising drill).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct DeliveryEvent {
    pub consumer: String,
    pub key: Option<String>,
    pub outcome: String,
    pub redelivered: bool,
    pub delivery_count: u32,
    pub effect: Option<String>,
    pub took_over_in_doubt: bool,
    pub reason: Option<String>,
    /// From the lease of its batch to its ack decision, in microseconds (a batch
    /// leased ahead counts its wait).
    #[serde(default)]
    pub latency_us: u64,
}

/// Receives every delivery's outcome, synchronously, before the ack: a process that
/// then dies at the ack crash point has already reported what it did.
pub type EventSink = Arc<dyn Fn(DeliveryEvent) + Send + Sync>;

/// A leased batch and when its lease was taken (latency counts from there).
/// The bodies are parsed as soon as they are leased: pipelined, that happens while
/// the batch before commits, off the path the batch waits on.
struct Leased {
    deliveries: Vec<Delivery>,
    parsed: Vec<Result<Envelope, Rejection>>,
    at: Instant,
}

impl Leased {
    fn new(deliveries: Vec<Delivery>, at: Instant) -> Self {
        let parsed = deliveries
            .iter()
            .map(|d| Envelope::parse(&d.body))
            .collect();
        Leased {
            deliveries,
            parsed,
            at,
        }
    }

    fn none() -> Self {
        Leased::new(Vec::new(), Instant::now())
    }
}

/// One worker consuming one consumer's queue.
pub struct Worker {
    consumer: Arc<dyn Consumer>,
    queue: Arc<dyn Queue>,
    queue_name: String,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    crash: Arc<CrashPlan>,
    settings: RunnerSettings,
    events: Option<EventSink>,
}

impl Worker {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        consumer: Arc<dyn Consumer>,
        queue: Arc<dyn Queue>,
        queue_name: String,
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
        crash: Arc<CrashPlan>,
        settings: RunnerSettings,
        events: Option<EventSink>,
    ) -> Self {
        Worker {
            consumer,
            queue,
            queue_name,
            store,
            metrics,
            crash,
            settings,
            events,
        }
    }

    pub fn consumer_name(&self) -> &'static str {
        self.consumer.name()
    }

    /// Ack `done` (a committed batch, possibly empty), then lease a batch: up to
    /// `lease_batch` deliveries, waiting up to `batch_max_wait` for it to fill once
    /// the first one is in.
    async fn ack_then_lease(&self, done: Vec<Delivery>) -> Leased {
        let size = self.settings.lease_batch.max(1);
        let at = Instant::now();
        let (acked, leased) = self
            .queue
            .ack_then_lease(
                &done,
                &self.queue_name,
                size,
                self.settings.visibility_timeout,
            )
            .await;
        if let Err(e) = acked {
            tracing::warn!(error = %e, "ack failed: the deliveries will come back");
        }
        let mut deliveries = self.leased_or_warn(leased).await;
        if !deliveries.is_empty()
            && deliveries.len() < size
            && !self.settings.batch_max_wait.is_zero()
        {
            let deadline = at + self.settings.batch_max_wait;
            while deliveries.len() < size && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(2)).await;
                let more = self
                    .queue
                    .lease(
                        &self.queue_name,
                        size - deliveries.len(),
                        self.settings.visibility_timeout,
                    )
                    .await;
                deliveries.extend(self.leased_or_warn(more).await);
            }
        }
        Leased::new(deliveries, at)
    }

    async fn leased_or_warn(&self, leased: QueueResult<Vec<Delivery>>) -> Vec<Delivery> {
        match leased {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(queue = %self.queue_name, error = %e, "lease failed");
                tokio::time::sleep(self.settings.idle_poll).await;
                Vec::new()
            }
        }
    }

    async fn ack(&self, deliveries: Vec<Delivery>) {
        if deliveries.is_empty() {
            return;
        }
        if let Err(e) = self.queue.ack_batch(&deliveries).await {
            tracing::warn!(error = %e, "ack failed: the deliveries will come back");
        }
    }

    /// Run until the queue is empty (nothing ready, nothing in flight).
    pub async fn run_until_idle(&self) -> Result<(), Crashed> {
        self.drive(None).await
    }

    /// Run until `shutdown` turns true. Stops between batches, never inside one:
    /// the batch in hand is handled and acked first.
    pub async fn run(&self, mut shutdown: watch::Receiver<bool>) -> Result<(), Crashed> {
        self.drive(Some(&mut shutdown)).await
    }

    /// The deliver loop. Pipelined (the default), each turn handles batch N while,
    /// alongside, batch N-1 (committed by the previous turn) is acked and batch N+1
    /// leased: the queue's round trips overlap the database's commit instead of
    /// adding to it. An ack still only ever follows its batch's commit; a process
    /// that dies leaves its leased-ahead batch to come back after the visibility
    /// timeout, like a broker's prefetch.
    async fn drive(&self, mut shutdown: Option<&mut watch::Receiver<bool>>) -> Result<(), Crashed> {
        let stopping =
            |s: &Option<&mut watch::Receiver<bool>>| s.as_ref().is_some_and(|s| *s.borrow());
        let mut unacked: Vec<Delivery> = Vec::new();
        let mut next = if stopping(&shutdown) {
            Leased::none()
        } else {
            self.ack_then_lease(Vec::new()).await
        };
        loop {
            if next.deliveries.is_empty() {
                if !unacked.is_empty() && !stopping(&shutdown) {
                    // The lease that ran beside the last batch found nothing. A broker
                    // whose prefetch that batch filled could send nothing before its
                    // ack: ack it and lease again before going idle.
                    next = self.ack_then_lease(std::mem::take(&mut unacked)).await;
                    continue;
                }
                self.ack(std::mem::take(&mut unacked)).await;
                if self.idle(&mut shutdown).await {
                    return Ok(());
                }
                next = self.ack_then_lease(Vec::new()).await;
                continue;
            }
            let current = std::mem::replace(&mut next, Leased::none());
            let previous = std::mem::take(&mut unacked);
            let ahead = self.settings.pipeline && !stopping(&shutdown);
            let (handled, leased) = tokio::join!(self.handle(current), async {
                if ahead {
                    self.ack_then_lease(previous).await
                } else {
                    self.ack(previous).await;
                    Leased::none()
                }
            });
            unacked = handled?;
            next = leased;
            if !ahead {
                let done = std::mem::take(&mut unacked);
                if stopping(&shutdown) {
                    self.ack(done).await;
                } else {
                    next = self.ack_then_lease(done).await;
                }
            }
        }
    }

    /// Nothing leased: `true` to stop (the queue is drained, or shutdown was asked),
    /// else wait a little before the next lease.
    async fn idle(&self, shutdown: &mut Option<&mut watch::Receiver<bool>>) -> bool {
        match shutdown {
            Some(rx) => {
                if *rx.borrow() {
                    return true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(self.settings.idle_poll) => {}
                    _ = rx.changed() => {}
                }
                *rx.borrow()
            }
            None => match self.queue.depth(&self.queue_name).await {
                Ok(d) if d.is_empty() => true,
                Ok(_) => {
                    tokio::time::sleep(self.settings.idle_poll.min(Duration::from_millis(25)))
                        .await;
                    false
                }
                Err(e) => {
                    tracing::warn!(error = %e, "queue depth failed");
                    tokio::time::sleep(self.settings.idle_poll).await;
                    false
                }
            },
        }
    }

    /// Handle one leased batch: settle what needs no handler (bad input, other event
    /// types), hand the rest to the consumer in one call, count. Returns the
    /// deliveries to ack, once past the after-commit crash point.
    async fn handle(&self, leased: Leased) -> Result<Vec<Delivery>, Crashed> {
        let started = Instant::now();
        let batch = leased.deliveries;
        let consumer = self.consumer.name();
        let mut settled: Vec<(Delivery, DeliveryEvent, bool)> = Vec::with_capacity(batch.len());
        let mut pending: Vec<(Delivery, DeliveryEvent)> = Vec::new();
        let mut envs: Vec<Envelope> = Vec::new();
        for (delivery, parsed) in batch.into_iter().zip(leased.parsed) {
            let mut event = DeliveryEvent {
                consumer: consumer.to_string(),
                key: None,
                outcome: String::new(),
                redelivered: delivery.redelivered,
                delivery_count: delivery.delivery_count,
                effect: None,
                took_over_in_doubt: false,
                reason: None,
                latency_us: 0,
            };
            if delivery.redelivered {
                self.metrics.redelivered(consumer);
            }
            match self.classify(&delivery, parsed, &mut event).await {
                Ok(env) => {
                    pending.push((delivery, event));
                    envs.push(env);
                }
                Err(ack) => settled.push((delivery, event, ack)),
            }
        }
        if !pending.is_empty() {
            let outcomes = match self.consumer.handle_batch(&envs, &self.crash).await {
                Ok(o) => o,
                Err(HandleError::Crashed(c)) => return Err(c),
                Err(HandleError::Store(e)) => {
                    tracing::warn!(consumer, error = %e, "store error: the batch will be retried");
                    vec![Outcome::Retry(e.to_string()); envs.len()]
                }
            };
            self.crash.reach(CrashPoint::AfterHandle)?;
            for ((delivery, mut event), outcome) in pending.into_iter().zip(outcomes) {
                let ack = self.settle(&delivery, outcome, &mut event).await;
                settled.push((delivery, event, ack));
            }
        }
        let elapsed = started.elapsed();
        let latency = leased.at.elapsed();
        let mut to_ack = Vec::with_capacity(settled.len());
        for (delivery, mut event, ack) in settled {
            self.metrics
                .observe_handler(consumer, elapsed.as_secs_f64());
            event.latency_us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
            if let Some(sink) = &self.events {
                sink(event);
            }
            if ack {
                to_ack.push(delivery);
            }
        }
        if !to_ack.is_empty() {
            self.crash.reach(CrashPoint::AfterCommitBeforeAck)?;
        }
        Ok(to_ack)
    }

    /// Parse and route one delivery. `Ok(env)`: for the consumer to handle;
    /// `Err(ack)`: settled here (dead-lettered, or not this consumer's event).
    async fn classify(
        &self,
        delivery: &Delivery,
        parsed: Result<Envelope, Rejection>,
        event: &mut DeliveryEvent,
    ) -> Result<Envelope, bool> {
        if delivery.delivery_count > self.settings.max_deliveries {
            let detail = format!(
                "gave up after {} deliveries",
                delivery.delivery_count.saturating_sub(1)
            );
            return Err(self
                .dead_letter(RejectReason::MaxDeliveries, &detail, delivery, event)
                .await);
        }
        let env = match parsed {
            Ok(env) => env,
            Err(rejection) => {
                return Err(self
                    .dead_letter(rejection.reason, &rejection.detail, delivery, event)
                    .await)
            }
        };
        event.key = Some(env.key().to_string());
        if !self.consumer.wants(env.event_type) {
            event.outcome = "skipped".into();
            return Err(true);
        }
        Ok(env)
    }

    /// Count one handler outcome. Returns whether to ack.
    async fn settle(
        &self,
        delivery: &Delivery,
        outcome: Outcome,
        event: &mut DeliveryEvent,
    ) -> bool {
        let consumer = self.consumer.name();
        event.outcome = outcome.label().to_string();
        match outcome {
            Outcome::Processed {
                effect,
                took_over_in_doubt,
            } => {
                self.metrics.processed(consumer);
                event.effect = effect.map(|e: EffectResult| e.as_str().to_string());
                event.took_over_in_doubt = took_over_in_doubt;
            }
            Outcome::Late => {
                self.metrics.processed(consumer);
                self.metrics.out_of_order(consumer);
            }
            Outcome::Duplicate => self.metrics.duplicate_dropped(consumer),
            Outcome::Skipped => {}
            Outcome::Rejected(r) => {
                return self.dead_letter(r.reason, &r.detail, delivery, event).await
            }
            Outcome::Retry(why) => {
                event.reason = Some(why);
                let delay = retry_backoff(
                    self.settings.retry_delay,
                    delivery.delivery_count,
                    self.settings.max_retry_delay,
                );
                if let Err(e) = self.queue.nack(delivery, delay).await {
                    tracing::warn!(error = %e, "nack failed: the lease will expire instead");
                }
                return false;
            }
        }
        true
    }

    /// Keep the raw bytes and the reason; ack only once they are safely stored.
    async fn dead_letter(
        &self,
        reason: RejectReason,
        detail: &str,
        delivery: &Delivery,
        event: &mut DeliveryEvent,
    ) -> bool {
        let consumer = self.consumer.name();
        event.reason = Some(format!("{reason}: {detail}"));
        match self
            .store
            .dead_letter(consumer, reason, detail, &delivery.body)
            .await
        {
            Ok(_) => {
                self.metrics.dead_lettered(consumer, reason);
                event.outcome = "dead_lettered".into();
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "dead-letter insert failed: leaving the delivery unacked");
                event.outcome = "retry".into();
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_past_a_claim_lease_before_max_deliveries() {
        let (d, lease) = (Duration::from_secs(1), Duration::from_secs(60));
        assert_eq!(retry_backoff(d, 1, lease), d);
        assert_eq!(retry_backoff(d, 3, lease), Duration::from_secs(4));
        assert_eq!(retry_backoff(d, 40, lease), lease);
        let waited: Duration = (1..=10).map(|n| retry_backoff(d, n, lease)).sum();
        assert!(waited > Duration::from_secs(60), "{waited:?}");
    }
}
