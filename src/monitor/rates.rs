//! Counter readings into rates: the increase per second across resets, restart
//! detection, and the duplicate ratio of SPEC §5. A counter that goes down was reset
//! by a restart and its new value is the whole increase since (it started at zero):
//! a burst that straddles a restart is counted, never a negative rate.

use chrono::{DateTime, Utc};
use serde::Serialize;

/// What one counter observation tells.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateObservation {
    /// Increase per second since the previous observation; None on the first.
    pub rate: Option<f64>,
    /// The increase itself.
    pub increase: Option<f64>,
    /// The counter went down: the process restarted (counters start at zero).
    pub reset: bool,
}

/// Turns successive readings of a monotonic counter into rates.
#[derive(Debug, Clone, Default)]
pub struct CounterRate {
    last: Option<(DateTime<Utc>, f64)>,
}

impl CounterRate {
    /// Feed one reading. A counter that goes down was reset by a restart: the new
    /// value is then the whole increase since the reset (it started from zero),
    /// never a negative rate.
    pub fn observe(&mut self, at: DateTime<Utc>, value: f64) -> RateObservation {
        let previous = self.last.replace((at, value));
        let Some((then, before)) = previous else {
            return RateObservation {
                rate: None,
                increase: None,
                reset: false,
            };
        };
        let reset = value < before;
        let increase = if reset { value } else { value - before };
        let seconds = (at - then).num_milliseconds() as f64 / 1000.0;
        RateObservation {
            rate: (seconds > 0.0).then(|| increase / seconds),
            increase: Some(increase),
            reset,
        }
    }

    /// The last reading, if any.
    pub fn last_value(&self) -> Option<f64> {
        self.last.map(|(_, v)| v)
    }
}

/// Duplicate rate (SPEC §5): dup / (processed + dup). None without traffic: "no
/// messages" is not "0% duplicates".
pub fn duplicate_ratio(processed_per_s: f64, duplicates_per_s: f64) -> Option<f64> {
    let total = processed_per_s + duplicates_per_s;
    (total.is_finite() && total > 0.0 && duplicates_per_s >= 0.0).then(|| duplicates_per_s / total)
}

/// Why a target was judged restarted.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "cause", rename_all = "snake_case")]
pub enum RestartCause {
    /// `process_start_time_seconds` changed.
    StartTimeChanged { before: f64, after: f64 },
    /// A counter went down.
    CounterReset { metric: String },
}

impl std::fmt::Display for RestartCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RestartCause::StartTimeChanged { before, after } => {
                write!(f, "process_start_time_seconds {before} → {after}")
            }
            RestartCause::CounterReset { metric } => write!(f, "{metric} went down"),
        }
    }
}

/// Detects restarts of one target across scrapes.
#[derive(Debug, Clone, Default)]
pub struct RestartDetector {
    start_time: Option<f64>,
}

impl RestartDetector {
    /// Feed one successful scrape: its start time (if exported) and the first counter
    /// seen to go down (if any). The first scrape never counts as a restart: we did
    /// not see the process before.
    pub fn observe(
        &mut self,
        start_time: Option<f64>,
        reset_counter: Option<&str>,
    ) -> Option<RestartCause> {
        let before = self.start_time;
        if start_time.is_some() {
            self.start_time = start_time;
        }
        match (before, start_time) {
            // Exporters print the start time with sub-second noise; one second apart is
            // the same process.
            (Some(b), Some(a)) if (a - b).abs() >= 1.0 => {
                return Some(RestartCause::StartTimeChanged {
                    before: b,
                    after: a,
                })
            }
            _ => {}
        }
        reset_counter.map(|m| RestartCause::CounterReset {
            metric: m.to_string(),
        })
    }
}
