//! Counter readings into rates: the increase per second across resets, restart
//! detection, and the duplicate ratio of docs/CONTRACT.md §5. A counter that goes down was reset
//! by a restart and its new value is the whole increase since (it started at zero):
//! a burst that straddles a restart is counted, never a negative rate.
//!
//! The dashboard shows rates over a window (one and five minutes) rather than the
//! last poll's: [`WindowedCounter`] keeps each scrape's increase for the longest
//! window, so a burst that lands between two polls, or straddles a restart, is in
//! the window's count whatever the poll interval.

use std::collections::VecDeque;
use std::time::Duration;

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
        self.observe_with(at, value, false)
    }

    /// A counter first seen after its target's first scrape: it was born in that
    /// interval, at zero, so its first reading is all increase (a restarted process
    /// exports a reason or result label only once it happened).
    pub fn born_at(at: DateTime<Utc>) -> CounterRate {
        CounterRate {
            last: Some((at, 0.0)),
        }
    }

    /// Feed one reading; `restarted` says the process is known to have restarted
    /// since the last one (a new `process_start_time_seconds`), so the counter
    /// started again from zero even if it already climbed past its old value.
    pub fn observe_with(
        &mut self,
        at: DateTime<Utc>,
        value: f64,
        restarted: bool,
    ) -> RateObservation {
        let previous = self.last.replace((at, value));
        let Some((then, before)) = previous else {
            return RateObservation {
                rate: None,
                increase: None,
                reset: false,
            };
        };
        let reset = restarted || value < before;
        let increase = if reset { value } else { value - before };
        let seconds = (at - then).num_milliseconds() as f64 / 1000.0;
        RateObservation {
            rate: (seconds > 0.0).then(|| increase / seconds),
            increase: Some(increase),
            reset,
        }
    }
}

/// Duplicate rate (docs/CONTRACT.md §5): dup / (processed + dup). None without traffic: "no
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

/// Windows the dashboard reads: one minute (the default columns, the alerts) and
/// five (the toggle, the deploy-window rule).
pub const WINDOW_1M: Duration = Duration::from_secs(60);
pub const WINDOW_5M: Duration = Duration::from_secs(300);
const WINDOWS: [Duration; 2] = [WINDOW_1M, WINDOW_5M];

/// One counter's increases per scrape over the last five minutes, summed over its
/// label sets and across restarts, with a running sum per window (read after every
/// scrape of every consumer: two numbers instead of the window's steps), and the
/// total since the dashboard started watching.
#[derive(Debug, Clone, Default)]
pub struct WindowedCounter {
    /// (scrape time, increase since the scrape before), oldest first.
    steps: VecDeque<(DateTime<Utc>, f64)>,
    /// Per window: the sum of the steps after `start[i]` and that start's index.
    sums: [f64; 2],
    starts: [usize; 2],
    /// The first reading: windows reaching before it are as long as the watch.
    first_at: Option<DateTime<Utc>>,
    /// The first reading's value plus every increase since: what every incarnation
    /// did together, as far as the dashboard saw.
    total: f64,
}

impl WindowedCounter {
    /// A first reading (of the counter, or of one more of its label sets): its value
    /// counts in the total (the work done before the dashboard looked), not in any
    /// window.
    pub fn first(&mut self, at: DateTime<Utc>, value: f64) {
        self.first_at.get_or_insert(at);
        self.total += value.max(0.0);
    }

    /// One scrape's increase (zero when it did not move, the whole new value after a
    /// reset). Only rises are kept as steps: a quiet counter costs nothing.
    pub fn add(&mut self, at: DateTime<Utc>, increase: f64) {
        self.first_at.get_or_insert(at);
        if increase > 0.0 {
            self.total += increase;
            self.steps.push_back((at, increase));
            for sum in &mut self.sums {
                *sum += increase;
            }
        }
        self.expire(at);
    }

    /// Drop the steps that left each window (a step at `now - span` has left it).
    fn expire(&mut self, now: DateTime<Utc>) {
        for (i, span) in WINDOWS.iter().enumerate() {
            let cut = now - chrono::Duration::from_std(*span).unwrap_or_default();
            while let Some((at, v)) = self.steps.get(self.starts[i]) {
                if *at > cut {
                    break;
                }
                self.sums[i] -= v;
                self.starts[i] += 1;
            }
            if self.starts[i] == self.steps.len() {
                self.sums[i] = 0.0;
            }
        }
        // The longest window (the last) has left these steps behind.
        let gone = self.starts[WINDOWS.len() - 1];
        self.steps.drain(..gone);
        for start in &mut self.starts {
            *start -= gone;
        }
    }

    fn index(span: Duration) -> usize {
        usize::from(span > WINDOW_1M)
    }

    /// The increase over the window ([`WINDOW_1M`] or [`WINDOW_5M`]) ending at the
    /// newest scrape.
    pub fn count(&self, span: Duration) -> f64 {
        self.sums[Self::index(span)].max(0.0)
    }

    /// How much of the window the dashboard has watched at `now`: the window's
    /// length once it has watched that long.
    pub fn covered(&self, now: DateTime<Utc>, span: Duration) -> Duration {
        let watched = self
            .first_at
            .and_then(|f| (now - f).to_std().ok())
            .unwrap_or_default();
        watched.min(span)
    }

    /// The mean rate per second over the window; None before two readings.
    pub fn rate(&self, now: DateTime<Utc>, span: Duration) -> Option<f64> {
        let seconds = self.covered(now, span).as_secs_f64();
        (seconds > 0.0).then(|| self.count(span) / seconds)
    }

    /// Every incarnation's increase together, plus the first reading.
    pub fn total(&self) -> f64 {
        self.total
    }

    /// The newest scrape whose increase was above zero, if in the window kept.
    pub fn last_rise(&self) -> Option<DateTime<Utc>> {
        self.steps.back().map(|(at, _)| *at)
    }

    /// When the dashboard first read this counter.
    pub fn watched_since(&self) -> Option<DateTime<Utc>> {
        self.first_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap_or_default()
    }

    #[test]
    fn a_counter_that_restarts_above_its_old_value_still_counts_from_zero() {
        let mut c = CounterRate::default();
        c.observe(t(0), 5.0);
        // The new process did 7 before the scrape: 7 > 5 reads as +2 without the
        // restart signal, +7 with it.
        assert_eq!(c.clone().observe(t(1), 7.0).increase, Some(2.0));
        let o = c.observe_with(t(1), 7.0, true);
        assert_eq!(o.increase, Some(7.0));
        assert!(o.reset);
    }

    #[test]
    fn a_counter_born_between_scrapes_counts_its_first_value() {
        let mut c = CounterRate::born_at(t(0));
        assert_eq!(c.observe(t(2), 4.0).increase, Some(4.0));
    }

    #[test]
    fn window_counts_keep_a_burst_between_polls_and_across_a_restart() {
        let mut w = WindowedCounter::default();
        w.first(t(0), 100.0);
        for s in 1..=30 {
            w.add(t(s), 0.0);
        }
        w.add(t(31), 6.0); // a burst in one poll
        w.add(t(32), 3.0); // the restarted process's first 3
        assert_eq!(w.count(WINDOW_1M), 9.0);
        assert_eq!(w.total(), 109.0);
        assert_eq!(w.rate(t(32), WINDOW_1M), Some(9.0 / 32.0));
        for s in 33..=92 {
            w.add(t(s), 0.0);
        }
        assert_eq!(w.count(WINDOW_1M), 0.0, "the burst left the minute");
        assert_eq!(w.count(WINDOW_5M), 9.0, "and is still in the five minutes");
        assert_eq!(w.last_rise(), Some(t(32)));
        for s in 93..=400 {
            w.add(t(s), 0.0);
        }
        assert_eq!(w.count(WINDOW_5M), 0.0);
        assert!(w.steps.is_empty(), "bounded by the longest window");
    }

    #[test]
    fn a_counter_read_again_at_the_same_value_did_not_restart() {
        let mut c = CounterRate::default();
        c.observe(t(0), 5.0);
        let o = c.observe(t(2), 5.0);
        assert!(!o.reset, "an idle counter is no restart");
        assert_eq!(o.increase, Some(0.0), "not its whole value again");
        assert_eq!(o.rate, Some(0.0));
    }

    #[test]
    fn two_readings_at_one_instant_have_an_increase_but_no_rate() {
        let mut c = CounterRate::default();
        c.observe(t(0), 5.0);
        let o = c.observe(t(0), 8.0);
        assert_eq!(o.increase, Some(3.0));
        assert_eq!(o.rate, None, "no time passed: no rate, not an infinite one");
        let o = c.observe(t(0) + chrono::Duration::milliseconds(500), 9.0);
        assert_eq!(o.rate, Some(2.0), "half a second is 0.5 s, not 500");
    }

    #[test]
    fn an_unbounded_or_negative_duplicate_count_has_no_ratio() {
        assert_eq!(duplicate_ratio(f64::INFINITY, 1.0), None);
        assert_eq!(duplicate_ratio(1.0, f64::INFINITY), None);
        assert_eq!(
            duplicate_ratio(5.0, -1.0),
            None,
            "a negative rate is a bug, not 0%"
        );
        assert_eq!(duplicate_ratio(3.0, 1.0), Some(0.25));
    }

    #[test]
    fn a_restart_cause_reads_as_what_was_seen() {
        let changed = RestartCause::StartTimeChanged {
            before: 1000.0,
            after: 5000.5,
        };
        assert_eq!(
            changed.to_string(),
            "process_start_time_seconds 1000 → 5000.5"
        );
        let reset = RestartCause::CounterReset {
            metric: "idem_messages_processed_total".into(),
        };
        assert_eq!(reset.to_string(), "idem_messages_processed_total went down");
    }

    #[test]
    fn a_step_leaving_the_minute_takes_only_its_own_increase_with_it() {
        let mut w = WindowedCounter::default();
        w.first(t(0), 0.0);
        w.add(t(10), 5.0);
        w.add(t(50), 3.0);
        w.add(t(69), 0.0);
        assert_eq!(w.count(WINDOW_1M), 8.0, "t(10) is 59 s old: still in");
        w.add(t(70), 0.0);
        assert_eq!(w.count(WINDOW_1M), 3.0, "t(10) is a minute old: gone");
        assert_eq!(w.count(WINDOW_5M), 8.0);
        w.add(t(110), 0.0);
        assert_eq!(w.count(WINDOW_1M), 0.0);
        assert_eq!(w.last_rise(), Some(t(50)));
    }

    #[test]
    fn a_window_watched_for_no_time_has_no_rate() {
        let mut w = WindowedCounter::default();
        w.first(t(0), 10.0);
        assert_eq!(w.watched_since(), Some(t(0)));
        assert_eq!(w.rate(t(0), WINDOW_1M), None, "not 0/0");
        assert_eq!(w.covered(t(30), WINDOW_1M), Duration::from_secs(30));
        assert_eq!(w.covered(t(90), WINDOW_1M), WINDOW_1M);
        w.add(t(30), 6.0);
        assert_eq!(w.rate(t(30), WINDOW_1M), Some(0.2));
        assert_eq!(w.total(), 16.0);
    }
}
