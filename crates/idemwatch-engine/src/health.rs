//! Whether a consumer may lease now: a circuit breaker over its store and provider.
//!
//! An outage is not the message's fault. Before this, every delivery that met a
//! database outage used up one of its `max_deliveries`, and a five-minute outage
//! dead-lettered every message in flight. Now an infrastructure failure (the store
//! unreachable, reset or timing out; the provider unreachable, 5xx, throttling) opens
//! the breaker: the failed deliveries go back uncounted, the worker stops leasing,
//! waits an exponential back-off with jitter (or the provider's `Retry-After`), then
//! probes — the store with a ping, then one delivery as a trial — and resumes by
//! itself on the first batch that gets through. While open, `idem_consumer_paused`
//! is 1 for the cause, so the dashboard can say who is paused, since when and why.
//!
//! One breaker per consumer, shared by its workers: they all stand on the same store
//! and provider.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::metrics::Metrics;

/// Kept here for the breaker's callers; the words live in [`idemwatch_base::vocab`].
pub use idemwatch_base::vocab::{InfraKind, PauseCause};

/// The pause after consecutive infrastructure failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// After the first failure.
    pub base: Duration,
    /// Never longer than this, however many failures (and however long a
    /// `Retry-After` asks for: a provider asking for an hour is asked again sooner,
    /// which costs one more 429).
    pub cap: Duration,
}

impl Backoff {
    /// `base` doubled per earlier consecutive failure, capped, then "equal jitter":
    /// between half and all of it, so that workers paused together do not all come
    /// back in the same millisecond. `jitter` is in [0, 1).
    pub fn delay(&self, failures: u32, jitter: f64) -> Duration {
        let doublings = failures.saturating_sub(1).min(20);
        let full = self
            .base
            .saturating_mul(1u32 << doublings)
            .min(self.cap.max(self.base));
        let half = full / 2;
        half + half.mul_f64(jitter.clamp(0.0, 1.0))
    }
}

/// A consumer's pause, as the dashboard and the logs see it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pause {
    pub cause: PauseCause,
    /// The last failure's kind and words.
    pub kind: InfraKind,
    pub last_error: String,
    /// When the first failure of this pause happened.
    pub since: DateTime<Utc>,
    /// Consecutive failures (failed probes included).
    pub failures: u32,
}

#[derive(Debug)]
struct Open {
    pause: Pause,
    /// No lease before this.
    until: Instant,
}

/// The breaker of one consumer.
#[derive(Debug)]
pub struct ConsumerHealth {
    consumer: String,
    backoff: Backoff,
    metrics: Arc<Metrics>,
    open: Mutex<Option<Open>>,
}

impl ConsumerHealth {
    pub fn new(consumer: &str, backoff: Backoff, metrics: Arc<Metrics>) -> Self {
        ConsumerHealth {
            consumer: consumer.to_string(),
            backoff,
            metrics,
            open: Mutex::new(None),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Open>> {
        // The state is one Option written whole: a panic elsewhere cannot leave it
        // half-written, so a poisoned lock is still good.
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An infrastructure failure (one per batch, whatever the number of deliveries it
    /// hit): open the breaker, or keep it open longer. Returns how long until the next
    /// lease: the provider's `after` when it said, else the back-off.
    pub fn failed(&self, kind: InfraKind, after: Option<Duration>, why: &str) -> Duration {
        let mut open = self.lock();
        let failures = open.as_ref().map_or(0, |o| o.pause.failures) + 1;
        let wait = match after {
            Some(after) => after.min(self.backoff.cap),
            None => self.backoff.delay(failures, rand::random::<f64>()),
        };
        let since = open.as_ref().map_or_else(Utc::now, |o| o.pause.since);
        let previous = open.as_ref().map(|o| o.pause.cause);
        let cause = kind.cause();
        if previous != Some(cause) {
            if let Some(previous) = previous {
                self.metrics.set_paused(&self.consumer, previous, None);
            }
            self.metrics.set_paused(&self.consumer, cause, Some(since));
        }
        if previous.is_none() {
            tracing::warn!(consumer = %self.consumer, cause = cause.as_str(), kind = kind.as_str(),
                error = why, pause = ?wait, "infrastructure failure: pausing the consumer (deliveries go back uncounted)");
        } else {
            tracing::debug!(consumer = %self.consumer, cause = cause.as_str(), kind = kind.as_str(),
                error = why, pause = ?wait, failures, "still paused");
        }
        self.metrics.set_pause_retries(&self.consumer, failures);
        *open = Some(Open {
            pause: Pause {
                cause,
                kind,
                last_error: why.to_string(),
                since,
                failures,
            },
            until: Instant::now() + wait,
        });
        wait
    }

    /// A batch got through: close the breaker.
    pub fn recovered(&self) {
        let mut open = self.lock();
        if let Some(open) = open.take() {
            self.closed(open);
        }
    }

    /// The part that was unhealthy answered (a queue's lease went through): close the
    /// breaker if that part is what opened it, else leave it to its own probe.
    pub fn recovered_from(&self, cause: PauseCause) {
        let mut open = self.lock();
        if open.as_ref().is_some_and(|o| o.pause.cause == cause) {
            if let Some(open) = open.take() {
                self.closed(open);
            }
        }
    }

    fn closed(&self, open: Open) {
        self.metrics
            .set_paused(&self.consumer, open.pause.cause, None);
        self.metrics.set_pause_retries(&self.consumer, 0);
        tracing::info!(consumer = %self.consumer, cause = open.pause.cause.as_str(),
            failures = open.pause.failures, since = %open.pause.since, "resumed");
    }

    /// The current pause, if any.
    pub fn pause(&self) -> Option<Pause> {
        self.lock().as_ref().map(|o| o.pause.clone())
    }

    /// How long until the next lease: `None` when closed, zero when the pause is
    /// over and a probe is due (the breaker stays open until a batch gets through).
    pub fn wait_left(&self) -> Option<Duration> {
        self.lock()
            .as_ref()
            .map(|o| o.until.saturating_duration_since(Instant::now()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_back_off_doubles_with_jitter_and_stays_under_its_cap() {
        let b = Backoff {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(30),
        };
        assert_eq!(b.delay(1, 0.0), Duration::from_millis(500));
        assert_eq!(b.delay(1, 1.0), Duration::from_secs(1));
        assert_eq!(b.delay(3, 1.0), Duration::from_secs(4));
        assert_eq!(b.delay(3, 0.0), Duration::from_secs(2));
        assert_eq!(b.delay(50, 1.0), Duration::from_secs(30));
        assert!(b.delay(50, 0.5) >= Duration::from_secs(15));
    }

    #[test]
    fn a_pause_opens_on_failure_says_why_and_closes_on_recovery() {
        let metrics = Arc::new(Metrics::new());
        let h = ConsumerHealth::new(
            "trip-counter",
            Backoff {
                base: Duration::from_millis(100),
                cap: Duration::from_secs(10),
            },
            metrics.clone(),
        );
        assert_eq!(h.wait_left(), None);
        let first = h.failed(InfraKind::Store, None, "connection refused");
        assert!(first <= Duration::from_millis(100));
        let p = h.pause().unwrap();
        assert_eq!((p.cause, p.failures), (PauseCause::Store, 1));
        assert!(metrics
            .encode()
            .contains("idem_consumer_paused{consumer=\"trip-counter\",cause=\"store\"} 1"));
        // A provider asking for 3 s gets 3 s; one asking for an hour gets the cap.
        assert_eq!(
            h.failed(
                InfraKind::ProviderThrottled,
                Some(Duration::from_secs(3)),
                "429"
            ),
            Duration::from_secs(3)
        );
        let p = h.pause().unwrap();
        assert_eq!((p.cause, p.failures), (PauseCause::Provider, 2));
        let text = metrics.encode();
        assert!(text.contains("idem_consumer_paused{consumer=\"trip-counter\",cause=\"store\"} 0"));
        assert!(
            text.contains("idem_consumer_paused{consumer=\"trip-counter\",cause=\"provider\"} 1")
        );
        assert_eq!(
            h.failed(
                InfraKind::ProviderThrottled,
                Some(Duration::from_secs(3600)),
                "429"
            ),
            Duration::from_secs(10)
        );
        assert!(h.wait_left().unwrap() > Duration::from_secs(9));
        h.recovered();
        assert_eq!(h.wait_left(), None);
        assert!(metrics
            .encode()
            .contains("idem_consumer_paused{consumer=\"trip-counter\",cause=\"provider\"} 0"));
    }
}
