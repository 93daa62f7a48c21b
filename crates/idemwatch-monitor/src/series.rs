//! Bounded time series with explicit gaps (counter rates are in [`super::rates`], the
//! chart zoom in [`super::zoom`]).
//!
//! A failed collection pushes a gap, never a zero: a chart that drops to zero when a
//! target is down would read as "no duplicates", the one thing it must not claim.
//! Memory stays bounded by time: raw points are kept for an hour, one-minute means
//! for the whole retention window (7 days), so a week costs ~14k points per series
//! whatever the poll interval.

use std::collections::VecDeque;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

/// One point of a series; `value: None` is a gap (the collection failed).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Point {
    pub at: DateTime<Utc>,
    pub value: Option<f64>,
}

/// How long raw points are kept; older views use the per-minute means.
pub const RAW_RETENTION: Duration = Duration::from_secs(3600);
/// The longest view: the dedup table's retention.
pub const MAX_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
const MINUTE: i64 = 60;
const NANOS_PER_SECOND: i64 = 1_000_000_000;

/// A time-pruned series: raw points for [`RAW_RETENTION`], minute means up to
/// `retention`.
#[derive(Debug, Clone)]
pub struct Series {
    raw: Points,
    minutes: Points,
    retention: Duration,
    /// The minute being accumulated: (minute start, sum, count of values).
    open_minute: Option<(i64, f64, u32)>,
}

/// Points in the order they came, as two columns: their times in nanoseconds since
/// the epoch, and their values with NaN for a gap (a value is finite, see
/// [`Series::push`]) — 16 bytes a point instead of a [`Point`]'s 32 (or 20 with
/// chrono's 12-byte times), compared as integers; a mean reads only the values. The times of the
/// oldest and the newest are kept beside them: a push (thousands per scrape of a big
/// target) then reads no point, where reading each queue's ends would miss the cache.
#[derive(Debug, Clone)]
struct Points {
    at: VecDeque<i64>,
    value: VecDeque<f64>,
    oldest: Option<i64>,
    newest: Option<i64>,
    /// Every point is at or after the one before (false once the clock went back,
    /// until those points are gone): the points after a time are then a suffix.
    in_order: bool,
}

impl Points {
    fn new() -> Points {
        Points {
            at: VecDeque::new(),
            value: VecDeque::new(),
            oldest: None,
            newest: None,
            in_order: true,
        }
    }

    fn push(&mut self, at: i64, value: Option<f64>) {
        match self.newest {
            None => {
                self.in_order = true;
                self.oldest = Some(at);
            }
            Some(newest) if at < newest => self.in_order = false,
            Some(_) => {}
        }
        self.newest = Some(at);
        self.at.push_back(at);
        self.value.push_back(value.unwrap_or(f64::NAN));
    }

    /// Drop the points before `cut`, oldest first.
    fn prune(&mut self, cut: i64) {
        while self.oldest.is_some_and(|at| at < cut) {
            self.at.pop_front();
            self.value.pop_front();
            self.oldest = self.at.front().copied();
        }
        if self.at.is_empty() {
            self.newest = None;
        }
    }

    /// The points at or after `from`, oldest first, as (time, value or gap). In time
    /// order the older points are a prefix: a one-minute mean at a one-second poll
    /// reads 60 values, not the hour kept.
    fn since(
        &self,
        from: DateTime<Utc>,
    ) -> impl Iterator<Item = (DateTime<Utc>, Option<f64>)> + '_ {
        let from = nanos(from);
        let in_order = self.in_order;
        let skip = if !in_order || self.oldest.is_none_or(|at| at >= from) {
            0
        } else {
            self.first_at_or_after(from)
        };
        self.at
            .range(skip..)
            .zip(self.value.range(skip..))
            .filter(move |(at, _)| in_order || **at >= from)
            .map(|(at, value)| (time(*at), (!value.is_nan()).then_some(*value)))
    }

    /// The index of the first point at or after `from`, the points being in time
    /// order. Galloping back from the newest, then bisecting the last stride: the
    /// windows asked for are short suffixes, found in the few cache lines the last
    /// push touched instead of by probes spread over the hour kept.
    fn first_at_or_after(&self, from: i64) -> usize {
        let len = self.at.len();
        // Invariant: every index >= hi is at or after `from`, every index < lo before.
        let (mut lo, mut hi) = (0, len);
        let mut stride = 1;
        while stride <= len {
            let probe = len - stride;
            if self.at[probe] < from {
                lo = probe + 1;
                break;
            }
            hi = probe;
            stride *= 2;
        }
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.at[mid] < from {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    fn latest(&self) -> Option<Point> {
        Some(Point {
            at: time(*self.at.back()?),
            value: self.value.back().filter(|v| !v.is_nan()).copied(),
        })
    }

    fn len(&self) -> usize {
        self.at.len()
    }
}

/// A point of [`Points::since`].
fn point((at, value): (DateTime<Utc>, Option<f64>)) -> Point {
    Point { at, value }
}

/// A time as [`Points`] keeps it: nanoseconds since the epoch (1677 to 2262; a
/// time outside, none a scrape has, is clamped to the nearest end).
fn nanos(at: DateTime<Utc>) -> i64 {
    at.timestamp_nanos_opt().unwrap_or(if at.timestamp() < 0 {
        i64::MIN
    } else {
        i64::MAX
    })
}

/// The time of [`nanos`].
fn time(nanos: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_nanos(nanos)
}

/// A span in the nanoseconds of [`nanos`].
fn span_nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

impl Default for Series {
    fn default() -> Self {
        Series::new(MAX_RETENTION)
    }
}

fn to_chrono(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

impl Series {
    /// An empty series keeping minute means for `retention` (the longest zoom).
    pub fn new(retention: Duration) -> Series {
        Series {
            raw: Points::new(),
            minutes: Points::new(),
            retention,
            open_minute: None,
        }
    }

    /// Add a value (or a gap with `None`) observed at `at`, and drop what is older
    /// than the retention.
    pub fn push(&mut self, at: DateTime<Utc>, value: Option<f64>) {
        let value = value.filter(|v| v.is_finite());
        // The time in nanoseconds once: the point, its minute and the cuts read it.
        let at = nanos(at);
        self.raw.push(at, value);
        let minute = at.div_euclid(NANOS_PER_SECOND * MINUTE) * MINUTE;
        match &mut self.open_minute {
            Some((m, sum, n)) if *m == minute => {
                if let Some(v) = value {
                    *sum += v;
                    *n += 1;
                }
            }
            _ => {
                self.close_minute();
                self.open_minute = Some((minute, value.unwrap_or(0.0), u32::from(value.is_some())));
            }
        }
        self.prune(at);
    }

    /// A failed collection.
    pub fn push_gap(&mut self, at: DateTime<Utc>) {
        self.push(at, None);
    }

    fn close_minute(&mut self) {
        if let Some((m, sum, n)) = self.open_minute.take() {
            let value = (n > 0).then(|| sum / f64::from(n));
            self.minutes.push(m.saturating_mul(NANOS_PER_SECOND), value);
        }
    }

    fn prune(&mut self, now: i64) {
        self.raw
            .prune(now.saturating_sub(span_nanos(RAW_RETENTION.min(self.retention))));
        self.minutes
            .prune(now.saturating_sub(span_nanos(self.retention)));
    }

    /// The newest point, gap or not.
    pub fn latest(&self) -> Option<Point> {
        self.raw.latest()
    }

    /// The points of the last `span` before `now`: raw points when they cover it,
    /// minute means (plus the newest raw point) beyond.
    pub fn window(&self, now: DateTime<Utc>, span: Duration) -> Vec<Point> {
        let from = now - to_chrono(span);
        if span <= RAW_RETENTION {
            return self.raw.since(from).map(point).collect();
        }
        let mut out: Vec<Point> = self.minutes.since(from).map(point).collect();
        if let Some((m, sum, n)) = self.open_minute {
            let at = DateTime::<Utc>::from_timestamp(m, 0).unwrap_or_default();
            out.push(Point {
                at,
                value: (n > 0).then(|| sum / f64::from(n)),
            });
        }
        out
    }

    /// Mean of the values of the last `span` (gaps ignored); None without values.
    pub fn mean_over(&self, now: DateTime<Utc>, span: Duration) -> Option<f64> {
        let (sum, n) = self
            .raw
            .since(now - to_chrono(span))
            .filter_map(|(_, value)| value)
            .fold((0.0, 0u32), |(s, n), v| (s + v, n + 1));
        (n > 0).then(|| sum / f64::from(n))
    }

    /// Number of points held (raw + minute means): what bounds the memory.
    pub fn len(&self) -> usize {
        self.raw.len() + self.minutes.len()
    }

    /// Nothing collected yet (the chart shows "waiting for data", not a flat line).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
