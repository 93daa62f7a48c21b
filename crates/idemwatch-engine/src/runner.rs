//! The runner: deliver → parse → handle (commit) → count → ack, with named crash
//! points between the steps.
//!
//! The ack is a separate step after the business commit, as with any real broker;
//! that gap is where the field report's 7 SMS came from, and where drills aim.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::{watch, Notify};

pub use super::consumers::DeliveryOutcome;
use super::consumers::{Consumer, HandleError, Outcome, Retry, RetryCause};
use super::crash::{CrashPlan, CrashPoint, Crashed};
use super::envelope::{EventType, Message, MessageKey, Parsed, RejectReason, Rejection};
use super::health::{Backoff, ConsumerHealth, InfraKind, PauseCause};
use super::metrics::{EffectResult, Metrics};
use super::queue::{Delivery, Queue, QueueError, QueueResult};
use super::seen_set::GuardedSeenSet;
use super::store::Store;

/// Knobs of the deliver/ack loop. [`RunnerSettings::default`] is the one home of their
/// defaults: the command line's flags and the drills read them from there.
#[derive(Debug, Clone, PartialEq)]
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
    /// The longest pause after an infrastructure failure (see `health.rs`): the pause
    /// starts at `retry_delay` and doubles per consecutive failure up to this. Also
    /// the most a provider's `Retry-After` is obeyed. Bounds how late a consumer
    /// notices that its store or provider is back.
    pub max_pause: Duration,
    /// Sleep between polls of an empty queue.
    pub idle_poll: Duration,
    /// Overlap the queue with the database: while one batch commits, ack the batch
    /// before it and lease the next one. Off, each batch is leased only once the one
    /// before it is acked (drills use that to keep their delivery traces exact).
    pub pipeline: bool,
    /// Pipelined only: deliveries leased per queue round trip, rounded up to whole
    /// batches. The worker handles them `lease_batch` per transaction and acks the
    /// committed ones together with its next lease, like a broker's prefetch: at batch
    /// 1, one queue round trip per `prefetch` messages instead of one per message.
    /// The price: a process that dies leaves up to this many leased deliveries to come
    /// back after the visibility timeout, the committed ones as counted duplicates. A
    /// worker that stops gives the ones it has not handled back at once. 1: lease one
    /// batch at a time.
    pub prefetch: usize,
    /// Pipelined only: the most deliveries one batch may gather. A consumer that
    /// handles few of the events on its queue (`zone-exit-sms` wants the zone exits,
    /// ~6 % of a fleet's traffic; `trip-counter` the same; `erp-webhook` the
    /// ignition-offs) fills its batch across leases: it takes deliveries until
    /// `lease_batch` of them are its own, leasing again while the queue has more, up to
    /// this many deliveries (and [`GATHER_MAX_BYTES`] of bodies); the others' events
    /// are acked as skipped with the batch. Without it a batch of 100 deliveries held
    /// ~6 SMS, and each batch waited one provider round trip for them. At most
    /// `lease_batch`: off (each batch is `lease_batch` deliveries).
    pub gather: usize,
}

/// The most bytes of message bodies one gathering batch holds (see
/// [`RunnerSettings::gather`]): a queue of large messages stops gathering early.
pub const GATHER_MAX_BYTES: usize = 8 << 20;

impl RunnerSettings {
    /// The pause after consecutive infrastructure failures.
    pub fn backoff(&self) -> Backoff {
        Backoff {
            base: self.retry_delay,
            cap: self.max_pause,
        }
    }

    /// Deliveries per transaction.
    pub fn batch(&self) -> usize {
        self.lease_batch.max(1)
    }

    /// The most deliveries one batch gathers, when it gathers across leases (pipelined,
    /// and `gather` above the batch); `None` otherwise.
    pub fn gather_limit(&self) -> Option<usize> {
        (self.pipeline && self.gather > self.batch()).then_some(self.gather)
    }

    /// Deliveries per lease: `prefetch` rounded up to whole batches when pipelined,
    /// one batch otherwise.
    pub fn lease_size(&self) -> usize {
        let batch = self.batch();
        if self.pipeline {
            batch * self.prefetch.max(1).div_ceil(batch)
        } else {
            batch
        }
    }
}

impl Default for RunnerSettings {
    fn default() -> Self {
        RunnerSettings {
            visibility_timeout: Duration::from_secs(30),
            max_deliveries: 10,
            lease_batch: DEFAULT_BATCH,
            batch_max_wait: Duration::ZERO,
            retry_delay: Duration::from_secs(1),
            max_retry_delay: crate::consumers::DEFAULT_CLAIM_LEASE,
            max_pause: Duration::from_secs(30),
            idle_poll: Duration::from_millis(100),
            pipeline: true,
            prefetch: 32,
            gather: DEFAULT_GATHER,
        }
    }
}

/// [`RunnerSettings::lease_batch`]'s default: deliveries per transaction. At 100 a
/// commit's fsync is shared by a hundred messages (BENCHMARKS.md: scaling with the
/// batch); the latency it adds is bounded by `batch_max_wait` (0 by default: a batch
/// is what is there).
pub const DEFAULT_BATCH: usize = 100;

/// [`RunnerSettings::gather`]'s default: ten batches of 100. A fleet's zone exits
/// (~6 %) then fill ~60 SMS per batch, two rounds of 32 calls in flight.
pub const DEFAULT_GATHER: usize = 1000;

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
    /// None when the bytes did not parse.
    pub key: Option<MessageKey>,
    pub outcome: DeliveryOutcome,
    pub redelivered: bool,
    pub delivery_count: u32,
    pub effect: Option<EffectResult>,
    pub took_over_in_doubt: bool,
    pub reason: Option<String>,
    /// From the lease of its batch to its ack decision, in microseconds (a batch
    /// leased ahead counts its wait).
    #[serde(default)]
    pub latency_us: u64,
}

/// A queue operation owed (see [`Worker::owed`]).
enum Owed {
    Ack(Delivery),
    GiveBack(Delivery),
}

/// `idem_consumer_busy_since_seconds` for the batch in hand, back to 0 on drop.
struct Busy<'a> {
    metrics: &'a Metrics,
    consumer: &'a str,
}

impl<'a> Busy<'a> {
    fn since_now(metrics: &'a Metrics, consumer: &'a str) -> Self {
        metrics.set_busy(consumer, Some(chrono::Utc::now()));
        Busy { metrics, consumer }
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.metrics.set_busy(self.consumer, None);
    }
}

/// What a paused worker does next.
enum Paused {
    /// Shutdown was asked.
    Stop,
    /// Look again (the pause was slept, or a probe failed).
    Again,
    /// The probe passed: try one delivery.
    Trial,
}

/// Receives every delivery's outcome, synchronously, before the ack: a process that
/// then dies at the ack crash point has already reported what it did.
pub type EventSink = Arc<dyn Fn(DeliveryEvent) + Send + Sync>;

/// Leased deliveries in hand, parsed for the consumer as soon as they are leased
/// (its own events with their key and fingerprint, see [`Message::parse_for`]):
/// pipelined, that happens while the batch before commits, off the path the batch
/// waits on. With a prefetch they are taken up a batch at a time.
struct Leased {
    deliveries: VecDeque<(Delivery, Result<Parsed, Rejection>)>,
    /// When the lease was asked for: the visibility timeout runs from here.
    leased_at: Instant,
    /// Whether a batch was taken from this lease yet.
    started: bool,
}

/// One batch taken up for handling, and when: latency counts from there (for the
/// first batch of a lease, from when the lease was asked for).
struct Batch {
    deliveries: Vec<(Delivery, Result<Parsed, Rejection>)>,
    at: Instant,
    /// Deliveries the consumer's handler will see (parsed, and an event it wants).
    own: usize,
    /// Bytes of the bodies.
    bytes: usize,
}

impl Batch {
    /// Move deliveries from `from` until this batch holds `want` of the consumer's
    /// own, `limit` deliveries or [`GATHER_MAX_BYTES`], or `from` is empty.
    fn gather(&mut self, from: &mut Leased, want: usize, limit: usize) {
        from.started = true;
        while self.own < want && self.deliveries.len() < limit && self.bytes < GATHER_MAX_BYTES {
            let Some(next) = from.deliveries.pop_front() else {
                return;
            };
            if matches!(&next.1, Ok(Parsed::Own(_))) {
                self.own += 1;
            }
            self.bytes += next.0.body.len();
            self.deliveries.push(next);
        }
    }

    /// Whether a gathering batch may take more: fewer than `want` of its own, under
    /// `limit` and [`GATHER_MAX_BYTES`].
    fn wants_more(&self, want: usize, limit: usize) -> bool {
        self.own < want && self.deliveries.len() < limit && self.bytes < GATHER_MAX_BYTES
    }
}

impl Leased {
    /// `wants`: the consumer's events (see [`Consumer::wants`]).
    fn new(deliveries: Vec<Delivery>, at: Instant, wants: impl Fn(EventType) -> bool) -> Self {
        Leased {
            deliveries: deliveries
                .into_iter()
                .map(|d| {
                    let parsed = Message::parse_for(&d.body, &wants);
                    (d, parsed)
                })
                .collect(),
            leased_at: at,
            started: false,
        }
    }

    fn none() -> Self {
        Leased::new(Vec::new(), Instant::now(), |_| false)
    }

    fn is_empty(&self) -> bool {
        self.deliveries.is_empty()
    }

    /// The next batch of up to `n` deliveries.
    fn take(&mut self, n: usize) -> Batch {
        let at = if self.started {
            Instant::now()
        } else {
            self.leased_at
        };
        self.started = true;
        let n = n.min(self.deliveries.len());
        Batch {
            deliveries: self.deliveries.drain(..n).collect(),
            at,
            own: 0,
            bytes: 0,
        }
    }

    /// Held so long that their lease may run out before they are handled: another
    /// worker could get them meanwhile.
    fn is_stale(&self, visibility: Duration) -> bool {
        !self.is_empty() && self.leased_at.elapsed() > visibility / 2
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
    health: Arc<ConsumerHealth>,
    /// The consumer's seen-set, probed while it is the cause of a pause.
    seen_set: Option<GuardedSeenSet>,
    /// What the queue could not take when it was down (or its disk full): acks of
    /// committed deliveries and uncounted give-backs, made again before the next
    /// lease — else the leases run out meanwhile and the outage is counted against
    /// the messages (with a small `max_deliveries`, a committed message would end as
    /// a dead letter).
    owed: std::sync::Mutex<Vec<Owed>>,
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
        let health = Arc::new(ConsumerHealth::new(
            consumer.name(),
            settings.backoff(),
            metrics.clone(),
        ));
        Worker {
            consumer,
            queue,
            queue_name,
            store,
            metrics,
            crash,
            settings,
            events,
            health,
            seen_set: None,
            owed: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Share one breaker between the workers of one consumer: they stand on the same
    /// store and provider, so they pause and resume together.
    pub fn with_health(mut self, health: Arc<ConsumerHealth>) -> Self {
        self.health = health;
        self
    }

    /// The seen-set the consumer checks (`seen-set` mode): a pause it caused is probed
    /// with its ping rather than the store's.
    pub fn with_seen_set(mut self, seen_set: GuardedSeenSet) -> Self {
        self.seen_set = Some(seen_set);
        self
    }

    /// Ack `done` (committed deliveries, possibly none), then lease up to
    /// [`RunnerSettings::lease_size`] deliveries, waiting up to `batch_max_wait` for a
    /// batch's worth once the first one is in.
    async fn ack_then_lease(&self, done: Vec<Delivery>) -> Leased {
        self.ack_then_lease_up_to(done, self.settings.lease_size(), None)
            .await
    }

    /// [`Self::ack_then_lease`] of up to `size` deliveries; `beside`: run beside a
    /// batch being handled, notified when it is done ([`Queue::ack_then_lease_beside`]).
    async fn ack_then_lease_up_to(
        &self,
        done: Vec<Delivery>,
        size: usize,
        beside: Option<&Notify>,
    ) -> Leased {
        let batch = self.settings.batch();
        let at = Instant::now();
        if !self.settle_owed().await {
            return self.leased(Vec::new(), at);
        }
        let (queue, vis) = (&self.queue_name, self.settings.visibility_timeout);
        let (acked, leased) = match beside {
            Some(handled) => {
                self.queue
                    .ack_then_lease_beside(&done, queue, size, vis, handled)
                    .await
            }
            None => self.queue.ack_then_lease(&done, queue, size, vis).await,
        };
        if let Err(e) = acked {
            tracing::warn!(error = %e, "ack failed: acked again before the next lease");
            self.queue_failed(&e);
            self.owe_acks(done);
        }
        let mut deliveries = self.leased_or_warn(leased).await;
        if !deliveries.is_empty()
            && deliveries.len() < batch
            && !self.settings.batch_max_wait.is_zero()
        {
            let deadline = at + self.settings.batch_max_wait;
            while deliveries.len() < batch && Instant::now() < deadline {
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
        self.leased(deliveries, at)
    }

    /// Deliveries leased at `at`, parsed for this worker's consumer.
    fn leased(&self, deliveries: Vec<Delivery>, at: Instant) -> Leased {
        Leased::new(deliveries, at, |t| self.consumer.wants(t))
    }

    /// Give the deliveries in hand back to the queue (a stopping or paused worker, or
    /// a lease held too long), visible again after `delay`: the next lease gets them,
    /// flagged redelivered. They were never handled, so they use up no attempt.
    async fn release(&self, held: &mut Leased, delay: Duration) {
        for (delivery, _) in held.deliveries.drain(..) {
            self.give_back_uncounted(delivery, delay).await;
        }
    }

    /// Give `delivery` back without counting it; when the queue cannot take it now,
    /// owe it (see [`Worker::owed`]) rather than let its lease run out and count.
    async fn give_back_uncounted(&self, delivery: Delivery, delay: Duration) {
        if let Err(e) = self.queue.nack_uncounted(&delivery, delay).await {
            tracing::warn!(error = %e, "give-back failed: given back again before the next lease");
            self.lock_owed().push(Owed::GiveBack(delivery));
        }
    }

    /// Acks that failed: owed (see [`Worker::owed`]).
    fn owe_acks(&self, deliveries: Vec<Delivery>) {
        self.lock_owed()
            .extend(deliveries.into_iter().map(Owed::Ack));
    }

    fn lock_owed(&self) -> std::sync::MutexGuard<'_, Vec<Owed>> {
        // A list written whole under the lock: still good after a panic elsewhere.
        self.owed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The owed acks and give-backs, before any lease (the lease would take their
    /// expired deliveries again, counted). `false` when the queue still refuses: the
    /// consumer stays paused for it and leases nothing.
    async fn settle_owed(&self) -> bool {
        let owed = std::mem::take(&mut *self.lock_owed());
        if owed.is_empty() {
            return true;
        }
        let mut left = Vec::new();
        let mut failure = None;
        for o in owed {
            if failure.is_some() {
                left.push(o);
                continue;
            }
            let done = match &o {
                Owed::Ack(d) => self.queue.ack(d).await.map(|_| ()),
                Owed::GiveBack(d) => self.queue.nack_uncounted(d, Duration::ZERO).await,
            };
            if let Err(e) = done {
                failure = Some(e);
                left.push(o);
            }
        }
        let settled = left.is_empty();
        self.lock_owed().extend(left);
        if let Some(e) = failure {
            tracing::warn!(error = %e, "owed ack or give-back failed again");
            self.queue_failed(&e);
        }
        settled
    }

    async fn leased_or_warn(&self, leased: QueueResult<Vec<Delivery>>) -> Vec<Delivery> {
        match leased {
            Ok(b) => {
                self.health.recovered_from(PauseCause::Queue);
                b
            }
            Err(e) => {
                tracing::warn!(queue = %self.queue_name, error = %e, "lease failed");
                self.queue_failed(&e);
                Vec::new()
            }
        }
    }

    /// The queue or the broker link failed or went silent: an infrastructure failure
    /// like a store's. The consumer pauses (`cause="queue"`) instead of polling a dead
    /// link, and its trial lease after the back-off is the probe. Returns the pause.
    fn queue_failed(&self, e: &QueueError) -> Duration {
        let kind = e.infra_kind();
        self.metrics.infra_error(self.consumer.name(), kind);
        self.health.failed(kind, None, &e.to_string())
    }

    async fn ack(&self, deliveries: Vec<Delivery>) {
        if deliveries.is_empty() {
            return;
        }
        if let Err(e) = self.queue.ack_batch(&deliveries).await {
            tracing::warn!(error = %e, "ack failed: acked again before the next lease");
            self.queue_failed(&e);
            self.owe_acks(deliveries);
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
    /// alongside, the batches committed before it are acked and the next deliveries
    /// leased: the queue's round trips overlap the database's commit instead of adding
    /// to it. With a prefetch of several batches, that happens on the turn that takes
    /// the last batch in hand. An ack still only ever follows its batch's commit; a
    /// process that dies leaves its leased-ahead deliveries to come back after the
    /// visibility timeout, like a broker's prefetch.
    async fn drive(&self, mut shutdown: Option<&mut watch::Receiver<bool>>) -> Result<(), Crashed> {
        let stopping =
            |s: &Option<&mut watch::Receiver<bool>>| s.as_ref().is_some_and(|s| *s.borrow());
        let mut unacked: Vec<Delivery> = Vec::new();
        let mut held = if stopping(&shutdown) {
            Leased::none()
        } else {
            self.ack_then_lease(Vec::new()).await
        };
        loop {
            if held.is_stale(self.settings.visibility_timeout) {
                tracing::debug!(queue = %self.queue_name, held = held.deliveries.len(),
                    "deliveries held past half their lease: given back");
                self.release(&mut held, Duration::ZERO).await;
            }
            if self.health.wait_left().is_some() {
                // Paused: nothing in hand while the store or provider is unhealthy.
                let wait = self.health.wait_left().unwrap_or_default();
                self.release(&mut held, wait).await;
                self.ack(std::mem::take(&mut unacked)).await;
                match self.pause(wait, &mut shutdown).await {
                    Paused::Stop => return Ok(()),
                    Paused::Again => continue,
                    Paused::Trial => {
                        // Half open: one delivery tries the way; its batch closes the
                        // breaker if it gets through (see `judge`).
                        // A trial lease that failed paused the consumer again.
                        let Some(trial) = self.lease_trial().await else {
                            continue;
                        };
                        held = trial;
                        if held.is_empty() {
                            // Nothing waiting to try it with: resume, and let the next
                            // batch tell.
                            self.health.recovered();
                        }
                        if !held.is_empty() {
                            let trial = held.take(1);
                            unacked.extend(self.handle(trial).await?);
                            continue;
                        }
                    }
                }
            }
            if held.is_empty() {
                if !unacked.is_empty() && shutdown.is_some() && !stopping(&shutdown) {
                    // Serving, and the lease that ran beside the last batch found
                    // nothing. A broker whose prefetch that batch filled could send
                    // nothing before its ack: ack it and lease again before going idle.
                    // (Until idle, the batch is acked below and `idle` asks the queue
                    // whether anything is left before leasing again: a broker's lease
                    // on a drained queue would first sit out its whole long poll.)
                    held = self.ack_then_lease(std::mem::take(&mut unacked)).await;
                    continue;
                }
                self.ack(std::mem::take(&mut unacked)).await;
                if self.idle(&mut shutdown).await {
                    return Ok(());
                }
                held = self.ack_then_lease(Vec::new()).await;
                continue;
            }
            let batch = self.settings.batch();
            let current = match self.settings.gather_limit() {
                Some(limit) if !stopping(&shutdown) => {
                    self.gather(&mut held, &mut unacked, batch, limit).await
                }
                _ => held.take(batch),
            };
            let pipelined = self.settings.pipeline && !stopping(&shutdown);
            if pipelined && held.is_empty() {
                let previous = std::mem::take(&mut unacked);
                let done = Notify::new();
                let lease_size = self.settings.lease_size();
                let (handled, leased) = tokio::join!(
                    async {
                        let handled = self.handle(current).await;
                        done.notify_one();
                        handled
                    },
                    self.ack_then_lease_up_to(previous, lease_size, Some(&done))
                );
                unacked = handled?;
                held = leased;
                continue;
            }
            unacked.extend(self.handle(current).await?);
            if stopping(&shutdown) {
                self.release(&mut held, Duration::ZERO).await;
                self.ack(std::mem::take(&mut unacked)).await;
            } else if !self.settings.pipeline {
                held = self.ack_then_lease(std::mem::take(&mut unacked)).await;
            }
            // Else more of the prefetch is in hand: its acks go with the next lease.
        }
    }

    /// Take a batch that holds `batch` deliveries of the consumer's own, leasing again
    /// while the lease in hand runs out first and the queue has more, up to `limit`
    /// deliveries (see [`RunnerSettings::gather`]). The committed deliveries in
    /// `unacked` are acked with the first extra lease. Its latency counts from the
    /// first lease, so the time spent gathering is in it.
    async fn gather(
        &self,
        held: &mut Leased,
        unacked: &mut Vec<Delivery>,
        batch: usize,
        limit: usize,
    ) -> Batch {
        let mut current = held.take(0);
        current.gather(held, batch, limit);
        while held.is_empty() && current.wants_more(batch, limit) {
            let more = self
                .ack_then_lease_up_to(
                    std::mem::take(unacked),
                    limit - current.deliveries.len(),
                    None,
                )
                .await;
            if more.is_empty() {
                break;
            }
            *held = more;
            current.gather(held, batch, limit);
        }
        current
    }

    /// Sit out a pause of `wait`, then probe: the store with a ping when it is the
    /// cause (a failed ping keeps the breaker open, longer). A provider has no health
    /// endpoint of its own: the trial delivery is its probe.
    async fn pause(
        &self,
        wait: Duration,
        shutdown: &mut Option<&mut watch::Receiver<bool>>,
    ) -> Paused {
        if !wait.is_zero() {
            match shutdown {
                Some(rx) => {
                    if *rx.borrow() {
                        return Paused::Stop;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = rx.changed() => {}
                    }
                    if *rx.borrow() {
                        return Paused::Stop;
                    }
                }
                None => tokio::time::sleep(wait).await,
            }
            return Paused::Again;
        }
        // A queue has no probe of its own either: the trial lease is one.
        let probe = match self.health.pause().map(|p| p.cause) {
            Some(PauseCause::Store) => Some(self.store.ping().await),
            Some(PauseCause::SeenSet) => match &self.seen_set {
                Some(s) => Some(s.ping().await),
                None => None,
            },
            _ => None,
        };
        if let Some(Err(e)) = probe {
            if e.is_infrastructure() {
                let kind = e.infra_kind();
                self.metrics.infra_error(self.consumer.name(), kind);
                self.health.failed(kind, None, &e.to_string());
                return Paused::Again;
            }
        }
        Paused::Trial
    }

    /// Lease one delivery: the trial of a half-open breaker. `None` when the lease
    /// itself failed (the consumer is paused again, for the queue).
    async fn lease_trial(&self) -> Option<Leased> {
        let at = Instant::now();
        if !self.settle_owed().await {
            return None;
        }
        let leased = self
            .queue
            .lease(&self.queue_name, 1, self.settings.visibility_timeout)
            .await;
        let failed = leased.is_err();
        let deliveries = self.leased_or_warn(leased).await;
        (!failed).then(|| self.leased(deliveries, at))
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
    async fn handle(&self, batch: Batch) -> Result<Vec<Delivery>, Crashed> {
        let started = Instant::now();
        let consumer = self.consumer.name();
        // While the batch is in hand (cleared however `handle` ends): a batch held
        // long is a peer that has not answered yet, before any deadline fires.
        let _busy = Busy::since_now(&self.metrics, consumer);
        let mut settled: Vec<(Delivery, DeliveryEvent, bool)> =
            Vec::with_capacity(batch.deliveries.len());
        let mut pending: Vec<(Delivery, DeliveryEvent)> = Vec::new();
        let mut envs: Vec<Message> = Vec::new();
        for (delivery, parsed) in batch.deliveries {
            let mut event = DeliveryEvent {
                consumer: consumer.to_string(),
                key: None,
                // Until `classify` or `settle` says otherwise, the delivery goes back.
                outcome: DeliveryOutcome::Retry,
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
            let outcomes = self.handle_envelopes(&envs).await?;
            self.crash.reach(CrashPoint::AfterHandle)?;
            let pause = self.judge(&outcomes);
            for ((delivery, mut event), outcome) in pending.into_iter().zip(outcomes) {
                let ack = self.settle(&delivery, outcome, &mut event, pause).await;
                settled.push((delivery, event, ack));
            }
        }
        let elapsed = started.elapsed();
        let latency = batch.at.elapsed();
        tracing::trace!(
            consumer,
            size = settled.len(),
            handled_us = elapsed.as_micros() as u64,
            "batch handled"
        );
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

    /// One outcome per envelope. A batch whose transaction failed for the store's
    /// health is retried whole, later. One that failed for anything else is retried
    /// item by item: the message the database refuses is dead-lettered
    /// (`store_rejected`, with the database's words) and its neighbours commit, instead
    /// of one bad message taking the whole batch down with it.
    async fn handle_envelopes(&self, envs: &[Message]) -> Result<Vec<Outcome>, Crashed> {
        let e = match self.consumer.handle_batch(envs, &self.crash).await {
            Ok(outcomes) => return Ok(outcomes),
            Err(HandleError::Crashed(c)) => return Err(c),
            Err(HandleError::Store(e)) => e,
        };
        let consumer = self.consumer.name();
        if e.is_infrastructure() || envs.len() == 1 {
            tracing::warn!(consumer, error = %e, batch = envs.len(), "store error: the batch will be retried");
            return Ok(vec![Outcome::of_store_error(&e); envs.len()]);
        }
        tracing::warn!(consumer, error = %e, batch = envs.len(),
            "the batch's transaction failed for a reason that is not the store's health: retrying it message by message");
        let mut outcomes = Vec::with_capacity(envs.len());
        for env in envs {
            outcomes.push(match self.consumer.handle(env, &self.crash).await {
                Ok(o) => o,
                Err(HandleError::Crashed(c)) => return Err(c),
                Err(HandleError::Store(e)) => Outcome::of_store_error(&e),
            });
        }
        Ok(outcomes)
    }

    /// What a batch says about the store's and the provider's health: any
    /// infrastructure retry opens (or extends) the pause, returned here; a batch that
    /// got through with none closes it.
    fn judge(&self, outcomes: &[Outcome]) -> Option<Duration> {
        let consumer = self.consumer.name();
        let mut worst: Option<(InfraKind, Option<Duration>, &str)> = None;
        let mut through = false;
        for o in outcomes {
            match o {
                Outcome::Retry(Retry {
                    cause: RetryCause::Infra { kind, after },
                    why,
                }) => {
                    self.metrics.infra_error(consumer, *kind);
                    let later = match worst {
                        None => true,
                        Some((_, a, _)) => *after > a,
                    };
                    if later {
                        worst = Some((*kind, *after, why));
                    }
                }
                Outcome::Skipped => {}
                _ => through = true,
            }
        }
        match worst {
            Some((kind, after, why)) => Some(self.health.failed(kind, after, why)),
            None => {
                if through {
                    self.health.recovered();
                }
                None
            }
        }
    }

    /// Route one parsed delivery. `Ok(message)`: for the consumer to handle (its key
    /// and fingerprint were computed once, when the lease was parsed); `Err(ack)`:
    /// settled here (dead-lettered, or not this consumer's event).
    async fn classify(
        &self,
        delivery: &Delivery,
        parsed: Result<Parsed, Rejection>,
        event: &mut DeliveryEvent,
    ) -> Result<Message, bool> {
        if delivery.attempts > self.settings.max_deliveries {
            // The failures before this one did not get to say why (the process died,
            // or the lease ran out); a handler failure is dead-lettered with its cause
            // when it uses up the last attempt (see `settle`).
            let detail = format!(
                "gave up after {} deliveries that never finished (the consumer died or its lease ran out)",
                delivery.attempts.saturating_sub(1)
            );
            return Err(self
                .dead_letter(RejectReason::MaxDeliveries, &detail, delivery, event)
                .await);
        }
        match parsed {
            Ok(Parsed::Own(message)) => {
                event.key = Some(message.key().clone());
                Ok(message)
            }
            Ok(Parsed::Other(key)) => {
                event.key = Some(key);
                event.outcome = DeliveryOutcome::Skipped;
                Err(true)
            }
            Err(rejection) => Err(self
                .dead_letter(rejection.reason, &rejection.detail, delivery, event)
                .await),
        }
    }

    /// Count one handler outcome. Returns whether to ack. `pause`: the consumer's
    /// pause, when its batch met an infrastructure failure.
    async fn settle(
        &self,
        delivery: &Delivery,
        outcome: Outcome,
        event: &mut DeliveryEvent,
        pause: Option<Duration>,
    ) -> bool {
        let consumer = self.consumer.name();
        event.outcome = outcome.fate();
        match outcome {
            Outcome::Processed {
                effect,
                took_over_in_doubt,
            } => {
                self.metrics.processed(consumer);
                event.effect = effect;
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
            Outcome::Retry(Retry { cause, why }) => {
                let backoff =
                    |n| retry_backoff(self.settings.retry_delay, n, self.settings.max_retry_delay);
                let returned = match cause {
                    RetryCause::Message if delivery.attempts >= self.settings.max_deliveries => {
                        let detail = format!(
                            "gave up after {} deliveries; the last failed with: {why}",
                            delivery.attempts
                        );
                        return self
                            .dead_letter(RejectReason::MaxDeliveries, &detail, delivery, event)
                            .await;
                    }
                    RetryCause::Message => {
                        self.queue.nack(delivery, backoff(delivery.attempts)).await
                    }
                    // The claim's holder may be a dead process: doubling per delivery
                    // outlasts its lease, without spending the message's attempts.
                    RetryCause::Busy => {
                        let delay = backoff(delivery.delivery_count);
                        self.give_back_uncounted(delivery.clone(), delay).await;
                        Ok(())
                    }
                    RetryCause::Infra { .. } => {
                        let delay = pause.unwrap_or(self.settings.retry_delay);
                        self.give_back_uncounted(delivery.clone(), delay).await;
                        Ok(())
                    }
                };
                event.reason = Some(why);
                if let Err(e) = returned {
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
                event.outcome = DeliveryOutcome::DeadLettered;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "dead-letter insert failed: the delivery goes back");
                event.outcome = DeliveryOutcome::Retry;
                let returned = if e.is_infrastructure() {
                    let kind = e.infra_kind();
                    self.metrics.infra_error(consumer, kind);
                    let wait = self.health.failed(kind, None, &e.to_string());
                    self.give_back_uncounted(delivery.clone(), wait).await;
                    Ok(())
                } else {
                    self.queue.nack(delivery, self.settings.retry_delay).await
                };
                if let Err(e) = returned {
                    tracing::warn!(error = %e, "nack failed: the lease will expire instead");
                }
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consumers::Deps;
    use crate::envelope::EventType;
    use crate::queue::QueueDepth;
    use crate::store::StoreError;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn retries_back_off_past_a_claim_lease_before_max_deliveries() {
        let (d, lease) = (Duration::from_secs(1), Duration::from_secs(60));
        assert_eq!(retry_backoff(d, 1, lease), d);
        assert_eq!(retry_backoff(d, 3, lease), Duration::from_secs(4));
        assert_eq!(retry_backoff(d, 40, lease), lease);
        let waited: Duration = (1..=10).map(|n| retry_backoff(d, n, lease)).sum();
        assert!(waited > Duration::from_secs(60), "{waited:?}");
    }

    #[test]
    fn a_lease_is_the_prefetch_in_whole_batches_and_one_batch_unpipelined() {
        let with = |lease_batch, prefetch, pipeline| {
            RunnerSettings {
                lease_batch,
                prefetch,
                pipeline,
                ..RunnerSettings::default()
            }
            .lease_size()
        };
        assert_eq!(with(1, 32, true), 32);
        assert_eq!(with(10, 32, true), 40);
        assert_eq!(with(100, 32, true), 100);
        assert_eq!(with(1, 0, true), 1);
        assert_eq!(with(0, 1, true), 1);
        assert_eq!(with(1, 32, false), 1);
        assert_eq!(with(8, 32, false), 8);
    }

    #[test]
    fn a_batch_taken_after_the_first_counts_its_latency_from_when_it_is_taken() {
        let leased_at = Instant::now() - Duration::from_secs(5);
        let deliveries = (0..3)
            .map(|id| Delivery {
                id,
                queue: "q".into(),
                body: b"{}".to_vec(),
                delivery_count: 1,
                attempts: 1,
                redelivered: false,
                lease_token: "t".into(),
            })
            .collect();
        let mut held = Leased::new(deliveries, leased_at, |_| true);
        let first = held.take(2);
        assert_eq!((first.deliveries.len(), first.at), (2, leased_at));
        let second = held.take(2);
        assert_eq!(second.deliveries.len(), 1);
        assert!(second.at > leased_at + Duration::from_secs(4));
        assert!(held.is_empty());
        assert!(!held.is_stale(Duration::from_secs(1)));
        let mut old = Leased::new(
            vec![first.deliveries.into_iter().next().unwrap().0],
            leased_at,
            |_| true,
        );
        assert!(old.is_stale(Duration::from_secs(9)));
        assert!(!old.is_stale(Duration::from_secs(11)));
        old.take(1);
        assert!(!old.is_stale(Duration::from_secs(9)));
    }

    fn delivery(id: i64, body: Vec<u8>) -> Delivery {
        Delivery {
            id,
            queue: "q".into(),
            body,
            delivery_count: 1,
            attempts: 1,
            redelivered: false,
            lease_token: "t".into(),
        }
    }

    fn event(seq: u64, event_type: &str) -> Vec<u8> {
        format!(
            r#"{{"device_id":"34-G-1","seq":{seq},"event_type":"{event_type}","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X"}}}}"#
        )
        .into_bytes()
    }

    /// A lease of `bodies` for a consumer of the zone exits.
    fn leased(bodies: Vec<Vec<u8>>) -> Leased {
        let deliveries = bodies
            .into_iter()
            .enumerate()
            .map(|(i, b)| delivery(i as i64 + 1, b))
            .collect();
        Leased::new(deliveries, Instant::now(), |t| t == EventType::ZoneExit)
    }

    fn ids(batch: &Batch) -> Vec<i64> {
        batch.deliveries.iter().map(|(d, _)| d.id).collect()
    }

    /// A gathering batch (zone-exit-sms on a fleet's queue: few of the events are its
    /// own) takes deliveries until it holds `want` of its own, or `limit` deliveries,
    /// or GATHER_MAX_BYTES of bodies, whichever comes first — and says whether it
    /// may take more by the same three bounds.
    #[test]
    fn a_gathering_batch_stops_at_its_own_events_its_limit_or_its_bytes() {
        let gathered = |bodies: Vec<Vec<u8>>, want, limit| {
            let mut held = leased(bodies);
            let mut batch = held.take(0);
            batch.gather(&mut held, want, limit);
            (batch, held)
        };
        // Zone exits at odd seqs, ignition-ons between them.
        let mixed = |seq: u64| event(seq, ["ignition_on", "zone_exit"][(seq % 2) as usize]);
        let six = || (1..=6).map(mixed).collect::<Vec<_>>();
        // Two of its own: the third delivery is the second zone exit.
        let (batch, held) = gathered(six(), 2, 10);
        assert_eq!((ids(&batch), batch.own), (vec![1, 2, 3], 2));
        let bytes: usize = (1..=3).map(|seq| mixed(seq).len()).sum();
        assert_eq!(batch.bytes, bytes);
        assert_eq!(held.deliveries.len(), 3);
        assert!(!batch.wants_more(2, 10));
        assert!(batch.wants_more(3, 10));
        // The limit: four deliveries, two of them its own.
        let (batch, _) = gathered(six(), 10, 4);
        assert_eq!((ids(&batch), batch.own), (vec![1, 2, 3, 4], 2));
        assert!(!batch.wants_more(10, 4));
        assert!(batch.wants_more(10, 5));
        // The bytes: two bodies of 4 MiB fill it exactly; one byte less takes one more.
        let half = GATHER_MAX_BYTES / 2;
        let (batch, _) = gathered(vec![vec![b' '; half], vec![b' '; half], mixed(1)], 10, 10);
        assert_eq!(
            (ids(&batch), batch.own, batch.bytes),
            (vec![1, 2], 0, GATHER_MAX_BYTES)
        );
        assert!(!batch.wants_more(10, 10));
        let (batch, _) = gathered(
            vec![vec![b' '; half], vec![b' '; half - 1], mixed(1)],
            10,
            10,
        );
        assert_eq!((ids(&batch), batch.own), (vec![1, 2, 3], 1));
        // The delivery that crosses the bound is taken whole; then it stops.
        assert!(batch.bytes > GATHER_MAX_BYTES && !batch.wants_more(10, 10));
    }

    /// Gathering across leases is for a pipelined worker whose `gather` is above its
    /// batch; otherwise each batch is `lease_batch` deliveries.
    #[test]
    fn a_batch_gathers_only_when_pipelined_and_gather_is_above_the_batch() {
        let limit = |pipeline, lease_batch, gather| {
            RunnerSettings {
                pipeline,
                lease_batch,
                gather,
                ..RunnerSettings::default()
            }
            .gather_limit()
        };
        assert_eq!(limit(true, 100, 1000), Some(1000));
        assert_eq!(limit(true, 100, 101), Some(101));
        assert_eq!(limit(true, 100, 100), None);
        assert_eq!(limit(true, 100, 50), None);
        assert_eq!(limit(false, 100, 1000), None);
    }

    /// A `trip-counter` worker on queue `q`, over a SQLite store and an embedded queue
    /// in `dir` (nothing here reaches a provider).
    async fn worker(dir: &tempfile::TempDir, settings: RunnerSettings) -> (Worker, Arc<dyn Queue>) {
        use crate::consumers::{build, ConsumerMode};
        let consumer = |deps: &Deps| build("trip-counter", deps, ConsumerMode::Idempotent).unwrap();
        worker_of(dir, settings, consumer).await
    }

    /// [`worker`] of the consumer `consumer` builds.
    async fn worker_of(
        dir: &tempfile::TempDir,
        settings: RunnerSettings,
        consumer: impl FnOnce(&Deps) -> Arc<dyn Consumer>,
    ) -> (Worker, Arc<dyn Queue>) {
        let url = |file: &str| format!("sqlite://{}", dir.path().join(file).display());
        let store = crate::store::open(&url("store.db")).await.unwrap();
        let queue = crate::queue::open(&url("queue.db")).await.unwrap();
        let metrics = Arc::new(Metrics::new());
        let deps = Deps {
            seen_set: GuardedSeenSet::open(
                &crate::seen_set::SeenSetConfig::default(),
                store.clone(),
                metrics.clone(),
            )
            .unwrap(),
            store: store.clone(),
            provider: crate::provider::ProviderClient::new(
                "http://127.0.0.1:9",
                "http://127.0.0.1:9",
            ),
            metrics: metrics.clone(),
            claim_lease: Duration::from_secs(60),
            provider_concurrency: 1,
            custody: Arc::default(),
        };
        let consumer = consumer(&deps);
        let crash = Arc::new(CrashPlan::none());
        let w = Worker::new(
            consumer,
            queue.clone(),
            "q".into(),
            store,
            metrics,
            crash,
            settings,
            None,
        );
        (w, queue)
    }

    /// `batch_max_wait`: a lease that brought in less than a batch leases again until
    /// the batch is full, then stops at once (not at the deadline) and takes no more
    /// than the batch; an empty lease does not wait at all (a worker on an idle queue
    /// must not sit out the wait before each look).
    #[tokio::test]
    async fn a_short_lease_waits_for_a_full_batch_and_no_longer() {
        let dir = tempfile::tempdir().unwrap();
        let wait = Duration::from_secs(20);
        let settings = RunnerSettings {
            lease_batch: 4,
            pipeline: false,
            batch_max_wait: wait,
            ..RunnerSettings::default()
        };
        let (w, queue) = worker(&dir, settings).await;
        let q = vec!["q".to_string()];

        let started = Instant::now();
        assert!(w.ack_then_lease(Vec::new()).await.is_empty());
        assert!(
            started.elapsed() < wait / 4,
            "an empty lease waited {:?}",
            started.elapsed()
        );

        queue.publish(&q, &[event(1, "zone_exit")]).await.unwrap();
        let more: Vec<Vec<u8>> = (2..9).map(|seq| event(seq, "zone_exit")).collect();
        let later = {
            let (queue, q) = (queue.clone(), q.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                queue.publish(&q, &more).await.unwrap();
            })
        };
        let started = Instant::now();
        let held = w.ack_then_lease(Vec::new()).await;
        later.await.unwrap();
        assert_eq!(
            held.deliveries.len(),
            4,
            "one leased, then three of the seven published later"
        );
        assert!(
            started.elapsed() < wait / 4,
            "a full batch waited {:?}",
            started.elapsed()
        );
    }

    /// What a batch says about health: its latest Retry-After sets the pause (a
    /// provider that asked for 5 s is not called again after 1 s, nor after a backoff
    /// of our own); skipped events say nothing, so a batch of only them leaves a pause
    /// open, and one with a message that got through closes it.
    #[tokio::test]
    async fn a_batch_pauses_for_its_latest_retry_after_and_only_what_got_through_resumes() {
        let dir = tempfile::tempdir().unwrap();
        let settings = RunnerSettings {
            max_pause: Duration::from_secs(60),
            ..RunnerSettings::default()
        };
        let (w, _) = worker(&dir, settings).await;
        let infra = |after: Option<u64>| {
            Outcome::retry(
                RetryCause::Infra {
                    kind: InfraKind::ProviderThrottled,
                    after: after.map(Duration::from_secs),
                },
                "429",
            )
        };
        let pause = w.judge(&[
            infra(Some(1)),
            infra(Some(5)),
            infra(None),
            Outcome::Skipped,
        ]);
        assert_eq!(pause, Some(Duration::from_secs(5)));
        assert_eq!(
            w.health.pause().map(|p| p.kind),
            Some(InfraKind::ProviderThrottled)
        );

        assert_eq!(w.judge(&[Outcome::Skipped, Outcome::Skipped]), None);
        assert!(
            w.health.pause().is_some(),
            "skipped events closed the pause"
        );

        assert_eq!(w.judge(&[Outcome::Skipped, Outcome::Duplicate]), None);
        assert!(
            w.health.pause().is_none(),
            "a batch that got through left the pause open"
        );
    }

    /// A consumer whose batch transaction always fails with `error`, and whose
    /// one-by-one handling counts its calls and finds each message a duplicate.
    struct FailingBatch {
        error: fn() -> StoreError,
        alone: Arc<AtomicUsize>,
    }

    #[async_trait::async_trait]
    impl Consumer for FailingBatch {
        fn name(&self) -> &'static str {
            "failing-batch"
        }
        fn mode(&self) -> crate::consumers::ConsumerMode {
            crate::consumers::ConsumerMode::Idempotent
        }
        fn wants(&self, _event: EventType) -> bool {
            true
        }
        async fn handle_batch(
            &self,
            _envs: &[Message],
            _crash: &CrashPlan,
        ) -> Result<Vec<Outcome>, HandleError> {
            Err((self.error)().into())
        }
        async fn handle(&self, _env: &Message, _crash: &CrashPlan) -> Result<Outcome, HandleError> {
            self.alone.fetch_add(1, Ordering::SeqCst);
            Ok(Outcome::Duplicate)
        }
    }

    /// A failed batch transaction: for the store's health, the whole batch is retried
    /// later, without a statement per message against a store that is down; for
    /// anything else, a batch of several is retried message by message (the one the
    /// database refuses must not take its neighbours with it), and a batch of one
    /// takes its error as it is (handling it alone again would only repeat it).
    #[tokio::test]
    async fn a_failed_batch_is_retried_whole_for_an_outage_and_alone_for_anything_else() {
        let run = |error: fn() -> StoreError, n: u64| async move {
            let dir = tempfile::tempdir().unwrap();
            let alone = Arc::new(AtomicUsize::new(0));
            let consumer = {
                let alone = alone.clone();
                move |_: &Deps| Arc::new(FailingBatch { error, alone }) as Arc<dyn Consumer>
            };
            let (w, _) = worker_of(&dir, RunnerSettings::default(), consumer).await;
            let envs: Vec<Message> = (1..=n)
                .map(|seq| Message::parse(&event(seq, "zone_exit")).unwrap())
                .collect();
            let outcomes = w.handle_envelopes(&envs).await.unwrap();
            (outcomes, alone.load(Ordering::SeqCst))
        };
        let outage = || StoreError::LostRace { what: "k" };
        let refused = || StoreError::OutOfRange {
            what: "seq",
            value: "1".into(),
        };
        let of = |e: fn() -> StoreError, n| vec![Outcome::of_store_error(&e()); n];

        assert_eq!(run(outage, 3).await, (of(outage, 3), 0));
        assert_eq!(run(outage, 1).await, (of(outage, 1), 0));
        assert_eq!(run(refused, 1).await, (of(refused, 1), 0));
        assert_eq!(run(refused, 2).await, (vec![Outcome::Duplicate; 2], 2));
    }

    /// A consumer whose first `failures` calls fail in a way that is the message's
    /// (a counted retry), and whose later calls apply it.
    struct FailsFirst {
        failures: usize,
        calls: AtomicUsize,
    }

    #[async_trait::async_trait]
    impl Consumer for FailsFirst {
        fn name(&self) -> &'static str {
            "fails-first"
        }
        fn mode(&self) -> crate::consumers::ConsumerMode {
            crate::consumers::ConsumerMode::Idempotent
        }
        fn wants(&self, _event: EventType) -> bool {
            true
        }
        async fn handle(&self, _env: &Message, _crash: &CrashPlan) -> Result<Outcome, HandleError> {
            Ok(
                if self.calls.fetch_add(1, Ordering::SeqCst) < self.failures {
                    Outcome::retry(RetryCause::Message, "a bug")
                } else {
                    Outcome::Processed {
                        effect: None,
                        took_over_in_doubt: false,
                    }
                },
            )
        }
    }

    /// A handled batch returns what to ack: what it settled (applied, or kept as a
    /// dead letter), not what goes back to the queue for another try. A delivery left
    /// out of it is never acked (it comes back after its lease as a duplicate); one
    /// put in is lost if its retry was the only thing keeping it.
    #[tokio::test]
    async fn a_handled_batch_acks_what_it_settled_and_not_what_it_retries() {
        use DeliveryOutcome::{DeadLettered, Processed, Retry};
        let dir = tempfile::tempdir().unwrap();
        let settings = RunnerSettings {
            lease_batch: 3,
            pipeline: false,
            ..RunnerSettings::default()
        };
        let consumer = |_: &Deps| {
            let calls = AtomicUsize::new(0);
            Arc::new(FailsFirst { failures: 1, calls }) as Arc<dyn Consumer>
        };
        let (mut w, queue) = worker_of(&dir, settings, consumer).await;
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = seen.clone();
        w.events = Some(Arc::new(move |e: DeliveryEvent| {
            sink.lock().unwrap().push(e.outcome);
        }));
        let q = vec!["q".to_string()];
        let bodies = [event(1, "zone_exit"), event(2, "zone_exit"), b"{".to_vec()];
        queue.publish(&q, &bodies).await.unwrap();
        let mut held = w.ack_then_lease(Vec::new()).await;
        let ids: Vec<i64> = held.deliveries.iter().map(|(d, _)| d.id).collect();
        let batch = held.take(3);
        let mut acked: Vec<i64> = w
            .handle(batch)
            .await
            .unwrap()
            .iter()
            .map(|d| d.id)
            .collect();
        acked.sort_unstable();
        // The first call fails (a counted retry), the second applies, the third body
        // is not JSON.
        assert_eq!(acked, [ids[1], ids[2]]);
        let mut seen = seen.lock().unwrap().clone();
        seen.sort_by_key(|o| o.as_str());
        assert_eq!(seen, [DeadLettered, Processed, Retry]);
    }

    /// docs/CONTRACT.md §8's budget: a counted retry goes back to the queue until the message has
    /// used up `max_deliveries`, and the delivery that uses up the last one is
    /// dead-lettered with the cause, not delivered once more. So a message that fails
    /// twice in three is applied, and one that always fails ends as a dead letter on
    /// its third delivery.
    #[tokio::test]
    async fn a_counted_retry_comes_back_until_the_last_delivery_dead_letters_it() {
        use DeliveryOutcome::{DeadLettered, Processed, Retry};
        let run = |failures: usize| async move {
            let dir = tempfile::tempdir().unwrap();
            let settings = RunnerSettings {
                max_deliveries: 3,
                lease_batch: 1,
                pipeline: false,
                retry_delay: Duration::from_millis(1),
                max_retry_delay: Duration::from_millis(4),
                idle_poll: Duration::from_millis(1),
                ..RunnerSettings::default()
            };
            let consumer = move |_: &Deps| {
                let calls = AtomicUsize::new(0);
                Arc::new(FailsFirst { failures, calls }) as Arc<dyn Consumer>
            };
            let (mut w, queue) = worker_of(&dir, settings, consumer).await;
            let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
            let sink = seen.clone();
            w.events = Some(Arc::new(move |e: DeliveryEvent| {
                sink.lock()
                    .unwrap()
                    .push((e.delivery_count, e.outcome, e.reason));
            }));
            let q = vec!["q".to_string()];
            queue.publish(&q, &[event(1, "zone_exit")]).await.unwrap();
            let ran = tokio::time::timeout(HUNG, w.run_until_idle()).await;
            ran.expect("drained").unwrap();
            let seen = seen.lock().unwrap().clone();
            seen
        };
        let retry = |n| (n, Retry, Some("a bug".to_string()));
        assert_eq!(run(2).await, [retry(1), retry(2), (3, Processed, None)]);
        let gave_up = "max_deliveries: gave up after 3 deliveries; the last failed with: a bug";
        let last = (3, DeadLettered, Some(gave_up.to_string()));
        assert_eq!(run(10).await, [retry(1), retry(2), last]);
    }

    /// A worker that gathers batches of 2 of its own across leases of 2, up to 10
    /// deliveries, its lease round trips logged, on a queue of `others` events that
    /// are not its own.
    async fn gathering_worker(
        dir: &tempfile::TempDir,
        others: u64,
    ) -> (Worker, Arc<dyn Queue>, Arc<LeaseLog>) {
        let settings = RunnerSettings {
            lease_batch: 2,
            prefetch: 1,
            gather: 10,
            ..RunnerSettings::default()
        };
        let (mut w, queue) = worker(dir, settings).await;
        let log = LeaseLog::over(&mut w);
        let q = vec!["q".to_string()];
        let others: Vec<Vec<u8>> = (1..=others).map(|seq| event(seq, "ignition_on")).collect();
        queue.publish(&q, &others).await.unwrap();
        (w, queue, log)
    }

    /// A batch gathering across leases leases only what its limit leaves room for: a
    /// lease beyond it would hold deliveries no batch takes yet, their visibility
    /// timeout running, instead of leaving them on the queue for another worker.
    #[tokio::test]
    async fn a_gathering_batch_leases_no_more_than_its_limit_leaves() {
        let dir = tempfile::tempdir().unwrap();
        let (w, queue, log) = gathering_worker(&dir, 20).await;
        let mut held = w.ack_then_lease(Vec::new()).await;
        assert_eq!(held.deliveries.len(), 2);
        let batch = w.gather(&mut held, &mut Vec::new(), 2, 10).await;
        assert_eq!((batch.deliveries.len(), batch.own), (10, 0));
        assert!(
            held.is_empty(),
            "{} leased beyond the limit",
            held.deliveries.len()
        );
        let depth = queue.depth("q").await.unwrap();
        assert_eq!((depth.ready, depth.in_flight), (10, 10));
        // And in one round trip for all the room left: the lease of one batch, then
        // one of the 8 the limit leaves (a lease asking for less fills the batch in
        // more round trips, each one the batch waits for).
        assert_eq!(log.leases(), [(2, 2), (8, 8)]);
    }

    /// The worker's queue, with a log of its lease round trips: how many deliveries
    /// each asked for, and how many it brought.
    struct LeaseLog {
        queue: Arc<dyn Queue>,
        leases: std::sync::Mutex<Vec<(usize, usize)>>,
        /// The sizes of the acks sent on their own, not with a lease.
        acks: std::sync::Mutex<Vec<usize>>,
    }

    impl LeaseLog {
        /// Put a log between `w` and its queue.
        fn over(w: &mut Worker) -> Arc<LeaseLog> {
            let log = Arc::new(LeaseLog {
                queue: w.queue.clone(),
                leases: std::sync::Mutex::new(Vec::new()),
                acks: std::sync::Mutex::new(Vec::new()),
            });
            w.queue = log.clone();
            log
        }

        fn leases(&self) -> Vec<(usize, usize)> {
            self.leases.lock().unwrap().clone()
        }

        fn acks(&self) -> Vec<usize> {
            self.acks.lock().unwrap().clone()
        }

        fn record(&self, max: usize, leased: &QueueResult<Vec<Delivery>>) {
            let brought = leased.as_ref().map_or(0, Vec::len);
            self.leases.lock().unwrap().push((max, brought));
        }
    }

    #[async_trait::async_trait]
    impl Queue for LeaseLog {
        async fn publish(&self, queues: &[String], bodies: &[Vec<u8>]) -> QueueResult<()> {
            self.queue.publish(queues, bodies).await
        }
        async fn lease(
            &self,
            queue: &str,
            max: usize,
            visibility: Duration,
        ) -> QueueResult<Vec<Delivery>> {
            let leased = self.queue.lease(queue, max, visibility).await;
            self.record(max, &leased);
            leased
        }
        async fn ack_then_lease(
            &self,
            done: &[Delivery],
            queue: &str,
            max: usize,
            visibility: Duration,
        ) -> (QueueResult<()>, QueueResult<Vec<Delivery>>) {
            let (acked, leased) = self
                .queue
                .ack_then_lease(done, queue, max, visibility)
                .await;
            self.record(max, &leased);
            (acked, leased)
        }
        async fn ack(&self, delivery: &Delivery) -> QueueResult<bool> {
            self.queue.ack(delivery).await
        }
        async fn ack_batch(&self, deliveries: &[Delivery]) -> QueueResult<usize> {
            self.acks.lock().unwrap().push(deliveries.len());
            self.queue.ack_batch(deliveries).await
        }
        async fn nack(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()> {
            self.queue.nack(delivery, delay).await
        }
        async fn nack_uncounted(&self, delivery: &Delivery, delay: Duration) -> QueueResult<()> {
            self.queue.nack_uncounted(delivery, delay).await
        }
        async fn depth(&self, queue: &str) -> QueueResult<QueueDepth> {
            self.queue.depth(queue).await
        }
        async fn purge_queue(&self, queue: &str) -> QueueResult<u64> {
            self.queue.purge_queue(queue).await
        }
        fn redacted_url(&self) -> String {
            self.queue.redacted_url()
        }
    }

    /// A worker paused by its store or its seen-set pings that part before it leases a
    /// trial delivery. While the ping fails nothing more is leased (the delivery in
    /// hand when the worker found itself paused goes back at once): a message does not
    /// go back and forth through the queue, nor hit a database that is down, for the
    /// length of an outage. Once the ping passes, the trial delivery takes it.
    #[tokio::test]
    async fn a_paused_worker_leases_nothing_until_the_part_that_paused_it_answers() {
        use crate::seen_set::{RedisSeenSet, SeenSetConfig, Unavailable};
        use crate::store::{sqlite::SqliteStore, Durability};
        use DeliveryOutcome::Processed;
        let run = |kind: InfraKind, down: bool| async move {
            let dir = tempfile::tempdir().unwrap();
            let settings = RunnerSettings {
                lease_batch: 1,
                pipeline: false,
                retry_delay: Duration::from_millis(1),
                max_pause: Duration::from_millis(20),
                idle_poll: Duration::from_millis(1),
                ..RunnerSettings::default()
            };
            let (mut w, queue) = worker(&dir, settings).await;
            let log = LeaseLog::over(&mut w);
            let (store, metrics) = (w.store.clone(), w.metrics.clone());
            let sql_seen_set = GuardedSeenSet::open(&SeenSetConfig::default(), store, metrics);
            w.seen_set = Some(sql_seen_set.unwrap());
            match (kind, down) {
                (_, false) => {}
                (InfraKind::Store, true) => {
                    // The worker's database through connections that are all gone:
                    // every statement fails as an outage (sqlx's `PoolClosed`).
                    let url = format!("sqlite://{}", dir.path().join("store.db").display());
                    let gone = SqliteStore::open(&url, Durability::Durable).await.unwrap();
                    gone.pool().close().await;
                    w.store = Arc::new(gone);
                }
                (InfraKind::SeenSet, true) => {
                    // Nothing listens on port 1: a Redis seen-set there is refused.
                    let ttl = Duration::from_secs(60);
                    let refused = RedisSeenSet::new("redis://127.0.0.1:1", ttl).unwrap();
                    let (policy, metrics) = (Unavailable::FailClosed, w.metrics.clone());
                    w.seen_set = Some(GuardedSeenSet::new(Arc::new(refused), policy, metrics));
                }
                (kind, true) => unreachable!("{kind:?} has no ping"),
            }
            let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
            let sink = seen.clone();
            w.events = Some(Arc::new(move |e: DeliveryEvent| {
                sink.lock().unwrap().push((e.delivery_count, e.outcome));
            }));
            let q = vec!["q".to_string()];
            queue.publish(&q, &[event(1, "zone_exit")]).await.unwrap();
            w.health.failed(kind, None, "down");
            let within = Duration::from_millis(if down { 300 } else { 10_000 });
            let drained = tokio::time::timeout(within, w.run_until_idle()).await;
            let leased: usize = log.leases().iter().map(|(_, brought)| brought).sum();
            let paused = w.health.pause().map(|p| p.kind);
            let seen = seen.lock().unwrap().clone();
            (drained.is_ok(), leased, paused, seen)
        };
        for kind in [InfraKind::Store, InfraKind::SeenSet] {
            assert_eq!(
                run(kind, true).await,
                (false, 1, Some(kind), vec![]),
                "{kind:?} down"
            );
            let answered = (true, 2, None, vec![(2, Processed)]);
            assert_eq!(run(kind, false).await, answered, "{kind:?} back");
        }
    }

    /// How long a test lets a worker run before it calls it hung.
    const HUNG: Duration = Duration::from_secs(10);

    /// A serving worker (`run`) waits `idle_poll` between looks at an empty queue,
    /// rather than asking it again at once; handles what arrives, its ack going with
    /// the next lease; and stops when told, with nothing left in flight.
    #[tokio::test]
    async fn a_serving_worker_handles_what_arrives_and_stops_when_told() {
        let dir = tempfile::tempdir().unwrap();
        let idle_poll = Duration::from_millis(20);
        let settings = RunnerSettings {
            idle_poll,
            ..RunnerSettings::default()
        };
        let (mut w, queue) = worker(&dir, settings).await;
        let log = LeaseLog::over(&mut w);
        let (done, mut events) = tokio::sync::mpsc::unbounded_channel();
        w.events = Some(Arc::new(move |e: DeliveryEvent| {
            let _ = done.send((e.delivery_count, e.outcome));
        }));
        let (stop, shutdown) = watch::channel(false);
        let idle_for = idle_poll * 10;
        let serve = async {
            tokio::time::sleep(idle_for).await;
            let idle_leases = log.leases().len();
            let q = vec!["q".to_string()];
            queue.publish(&q, &[event(1, "zone_exit")]).await.unwrap();
            let handled = tokio::time::timeout(HUNG, events.recv()).await;
            // Its ack goes out with the next lease, not after the worker's next sleep.
            let acked = tokio::time::timeout(HUNG, async {
                while !queue.depth("q").await.unwrap().is_empty() {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            });
            let acked = acked.await.is_ok();
            stop.send(true).unwrap();
            (idle_leases, handled, acked)
        };
        let both = tokio::time::timeout(HUNG, async { tokio::join!(w.run(shutdown), serve) });
        let (ran, (idle_leases, handled, acked)) = both.await.expect("stopped when told");
        ran.unwrap();
        // One lease per idle_poll at the most (twice that, for a loaded machine's
        // timers): a worker that does not wait leases thousands of times.
        let most = 2 * (idle_for.as_millis() / idle_poll.as_millis()) as usize;
        assert!(
            (1..=most).contains(&idle_leases),
            "{idle_leases} leases of an empty queue in {idle_for:?}"
        );
        assert_eq!(
            handled.ok().flatten(),
            Some((1, DeliveryOutcome::Processed))
        );
        assert!(acked, "the delivery was never acked");
        assert_eq!(log.acks(), Vec::<usize>::new(), "acked apart from a lease");
    }

    /// Asked to stop with deliveries in hand, a worker handles one more batch of
    /// them, without gathering it across leases nor leasing beside it, gives the rest
    /// back and stops: nothing more is leased once it has been told.
    #[tokio::test]
    async fn a_stopping_worker_handles_one_more_batch_and_leases_no_more() {
        let dir = tempfile::tempdir().unwrap();
        let (mut w, queue, log) = gathering_worker(&dir, 40).await;
        let (stop, shutdown) = watch::channel(false);
        let handled = Arc::new(AtomicUsize::new(0));
        let count = handled.clone();
        // Told at the first delivery it handles.
        w.events = Some(Arc::new(move |_: DeliveryEvent| {
            count.fetch_add(1, Ordering::SeqCst);
            let _ = stop.send(true);
        }));
        let ran = tokio::time::timeout(HUNG, w.run(shutdown)).await;
        ran.expect("stopped when told").unwrap();
        // A batch gathered to its limit of 10 (a lease of 2, then of the 8 left), the
        // next one's 2 leased beside it; then those 2 alone.
        assert_eq!(log.leases(), [(2, 2), (8, 8), (2, 2)]);
        assert_eq!(handled.load(Ordering::SeqCst), 12);
        let depth = queue.depth("q").await.unwrap();
        assert_eq!((depth.ready, depth.in_flight), (28, 0));
    }

    /// A prefetch of several batches is handled a batch at a time from what is in
    /// hand, each delivery once: the deliveries still in hand are not leased over
    /// (they would come back only after their visibility timeout, as redeliveries).
    #[tokio::test]
    async fn a_prefetch_is_handled_a_batch_at_a_time_each_delivery_once() {
        let dir = tempfile::tempdir().unwrap();
        let settings = RunnerSettings {
            lease_batch: 2,
            prefetch: 4,
            gather: 0,
            visibility_timeout: Duration::from_secs(2),
            ..RunnerSettings::default()
        };
        let (mut w, queue) = worker(&dir, settings).await;
        let log = LeaseLog::over(&mut w);
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = seen.clone();
        w.events = Some(Arc::new(move |e: DeliveryEvent| {
            sink.lock().unwrap().push(e.delivery_count);
        }));
        let q = vec!["q".to_string()];
        let exits: Vec<Vec<u8>> = (1..=4).map(|seq| event(seq, "zone_exit")).collect();
        queue.publish(&q, &exits).await.unwrap();
        let ran = tokio::time::timeout(HUNG, w.run_until_idle()).await;
        ran.expect("drained").unwrap();
        assert_eq!(*seen.lock().unwrap(), [1; 4]);
        assert_eq!(log.leases(), [(4, 4), (4, 0)]);
    }

    /// A worker paused by an outage tries the way with one delivery at a time: while
    /// each trial fails, it leases nothing beside it (a prefetch leased then would
    /// only be given back at the next pause).
    #[tokio::test]
    async fn a_paused_worker_tries_one_delivery_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let settings = RunnerSettings {
            retry_delay: Duration::from_millis(1),
            max_pause: Duration::from_millis(20),
            ..RunnerSettings::default()
        };
        let consumer = |_: &Deps| {
            let outage = FailingBatch {
                error: || StoreError::LostRace { what: "k" },
                alone: Default::default(),
            };
            Arc::new(outage) as Arc<dyn Consumer>
        };
        let (mut w, queue) = worker_of(&dir, settings, consumer).await;
        let log = LeaseLog::over(&mut w);
        let q = vec!["q".to_string()];
        let exits: Vec<Vec<u8>> = (1..=5).map(|seq| event(seq, "zone_exit")).collect();
        queue.publish(&q, &exits).await.unwrap();
        let failing = tokio::time::timeout(Duration::from_millis(300), w.run_until_idle());
        assert!(failing.await.is_err(), "drained while every batch fails");
        let leases = log.leases();
        let lease_size = w.settings.lease_size();
        assert_eq!(leases.first(), Some(&(lease_size, 5)));
        // From the first trial on (before it, the first batch leased the rest of the
        // queue beside it), each lease is of one delivery.
        let asked: Vec<usize> = leases.iter().map(|(asked, _)| *asked).collect();
        let trials: Vec<usize> = asked.into_iter().skip_while(|&n| n != 1).collect();
        assert!(
            trials.len() > 1,
            "fewer than two trials in 300 ms: {leases:?}"
        );
        assert_eq!(trials, vec![1; trials.len()], "{leases:?}");
    }
}
