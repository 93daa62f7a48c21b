//! A duplicate budget per deploy: did this deploy cost more duplicates than deploys
//! usually do?
//!
//! Every deploy or restart marker (a `mark`ed deploy, the demo's, a restart the
//! scrapes or the Prometheus history found, a crash loop's group) owns a window:
//! from the marker to the next such marker, at most the configured settle time
//! (`[alerts] deploy_settle_time`), up to now while it lasts. Per consumer the
//! window's duplicates and deliveries give its ratio (docs/CONTRACT.md §5:
//! dup / (processed + dup)), judged against the budget (`[alerts]
//! deploy_duplicate_budget`, 0.4 % unless the consumer has its own). Beside it: the
//! peak of the minute ratio in the window, the baseline before the marker and how
//! long the consumer took to settle back to it.
//!
//! Everything here is pure: counts in ([`Step`]s, built from the dashboard's own
//! series or the Prometheus history by [`steps_from_rates`] and
//! [`steps_from_history`]), figures out ([`DeployBudget`]). The Monitor feeds it
//! each poll; `snapshot --json`, `report` and the Duplicates tab's Deploys panel
//! show the same figures, and `alerts` raises `deploy_over_budget` from them.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use serde::Serialize;

use crate::config::AlertRules;
use crate::history::HistoryPoint;
use crate::markers::{MarkerSource, TimelineMarker};
use crate::rates::{duplicate_ratio, WINDOW_1M};
use crate::ratios::NORMAL_DAY_RATIO;
use crate::series::{Point, RAW_RETENTION};
use crate::targets::ConsumerSeries;

/// The marker kinds that open a deploy window: a deploy, and a restart (a
/// Kubernetes rollout no hook marked is a restart of every pod).
pub const DEPLOY_KINDS: [&str; 2] = ["deploy", "restart"];

/// How far before a marker its baseline is read. Ten minutes hold a few thousand
/// deliveries at a fleet's usual rates: enough for a normal day's 1 in 10 000 to
/// read as a ratio rather than as zero or one duplicate's worth.
pub const BASELINE_SPAN: Duration = Duration::from_secs(600);

/// The ratio the peak and the settling are read from: the minute before each scrape,
/// as the Overview's `dup %` column shows it. A single scrape's ratio swings from
/// 0 to 11 % on one duplicate among eight messages; a minute does not.
pub const PEAK_SPAN: Duration = WINDOW_1M;

/// How many times its baseline a consumer's minute ratio may be and still count as
/// settled: at a normal day's 1 in 10 000, one duplicate more or less in a minute
/// moves the ratio by as much as the baseline itself.
pub const SETTLE_FACTOR: f64 = 2.0;

/// Deliveries over one interval between two readings, counted at its end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    pub end: DateTime<Utc>,
    pub processed: f64,
    pub duplicates: f64,
}

/// One consumer's steps, oldest first.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerSteps {
    pub target: String,
    pub consumer: String,
    pub steps: Vec<Step>,
}

/// Steps from two rate series of one consumer, point for point (the dashboard
/// pushes both at each scrape): each rate times the time since the reading before,
/// the interval the rate was measured over (a failed scrape in between is a gap
/// point, and the rate after it spans the gap: the counter was read last before it).
/// A rate missing on one side of a scrape is zero (the exporter has no such counter
/// yet); a point without either is a gap. The first point's interval starts at
/// `first_reading` when given (the scrape that read the counters first, which
/// pushed no rate), else the first point only opens the next one.
pub fn steps_from_rates(
    processed: &[Point],
    duplicates: &[Point],
    first_reading: Option<DateTime<Utc>>,
) -> Vec<Step> {
    let mut out = Vec::new();
    let mut last: Option<DateTime<Utc>> = first_reading;
    for (p, d) in processed.iter().zip(duplicates) {
        if p.at != d.at || (p.value.is_none() && d.value.is_none()) {
            continue;
        }
        if let Some(before) = last {
            let seconds = (p.at - before).num_milliseconds() as f64 / 1000.0;
            if seconds > 0.0 {
                out.push(Step {
                    end: p.at,
                    processed: p.value.unwrap_or(0.0) * seconds,
                    duplicates: d.value.unwrap_or(0.0) * seconds,
                });
            }
        }
        last = Some(p.at);
    }
    out
}

/// Steps of one consumer's series over the `span` before `now`: the last hour at
/// each scrape ([`steps_from_rates`] of the raw points), older ones from the minute
/// means the series keep beyond it (a minute's mean rate times the minute, counted
/// at the minute's start). `watched_since` is the consumer's first reading
/// ([`crate::targets::Totals::since`]): when the window reaches back to it, the
/// first rate's interval starts there (a two-poll `snapshot` has that one step).
pub fn steps_from_series(
    series: &ConsumerSeries,
    now: DateTime<Utc>,
    span: Duration,
    watched_since: Option<DateTime<Utc>>,
) -> Vec<Step> {
    let raw_span = span.min(RAW_RETENTION);
    let from = now - TimeDelta::from_std(raw_span).unwrap_or_default();
    let first_reading = watched_since.filter(|since| *since >= from);
    let processed = series.processed_per_s.window(now, raw_span);
    let duplicates = series.duplicates_per_s.window(now, raw_span);
    let mut steps = Vec::new();
    if span > RAW_RETENTION {
        // The minute means before the raw points (the last of them overlaps the
        // raw hour: cut it).
        let cut = processed.first().map_or(now, |p| p.at) - TimeDelta::minutes(1);
        let older = |points: Vec<Point>| -> Vec<Point> {
            points.into_iter().filter(|p| p.at < cut).collect()
        };
        steps = steps_from_rates(
            &older(series.processed_per_s.window(now, span)),
            &older(series.duplicates_per_s.window(now, span)),
            None,
        );
    }
    steps.extend(steps_from_rates(&processed, &duplicates, first_reading));
    steps
}

/// Steps from a Prometheus history: each point's rate times the query's step (the
/// server's rate is over at least a minute, so a step shorter than that is an
/// estimate of its own share; counts read from history are estimates, not the
/// exact counts of the dashboard's own scrapes).
pub fn steps_from_history(points: &[HistoryPoint], step_seconds: u64) -> Vec<Step> {
    let seconds = step_seconds as f64;
    points
        .iter()
        .filter(|p| p.processed_per_second.is_some() || p.duplicate_dropped_per_second.is_some())
        .filter_map(|p| {
            Some(Step {
                end: DateTime::from_timestamp(p.t, 0)?,
                processed: p.processed_per_second.unwrap_or(0.0) * seconds,
                duplicates: p.duplicate_dropped_per_second.unwrap_or(0.0) * seconds,
            })
        })
        .collect()
}

/// What ended a deploy's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowEnd {
    /// The next deploy or restart marker.
    NextMarker,
    /// The settle time passed.
    SettleTime,
    /// Not over yet: the figures so far, the verdict provisional.
    Open,
}

/// A window's duplicates against its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Nothing delivered in the window: no ratio to judge.
    NoTraffic,
    Within,
    Over,
}

impl WindowEnd {
    /// Its name in JSON and CSV.
    pub fn as_str(self) -> &'static str {
        match self {
            WindowEnd::NextMarker => "next_marker",
            WindowEnd::SettleTime => "settle_time",
            WindowEnd::Open => "open",
        }
    }
}

impl Verdict {
    /// Its name in JSON and CSV.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::NoTraffic => "no_traffic",
            Verdict::Within => "within",
            Verdict::Over => "over",
        }
    }

    /// How it reads in a table.
    pub fn label(self) -> &'static str {
        match self {
            Verdict::NoTraffic => "no traffic",
            Verdict::Within => "within",
            Verdict::Over => "OVER",
        }
    }
}

/// Where a consumer's baseline came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BaselineSource {
    /// Its own ratio before the marker.
    BeforeMarker,
    /// No delivery before the marker outside another deploy's unsettled time: the
    /// field report's normal day (0.01 %).
    NormalDay,
}

/// One consumer in one deploy's window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerBudget {
    pub target: String,
    pub consumer: String,
    /// Deliveries processed and duplicates dropped in the window (exact from the
    /// dashboard's own scrapes; estimated from a Prometheus history's rates).
    pub processed: f64,
    pub duplicates: f64,
    /// dup / (processed + dup) over the window; None without traffic.
    pub ratio: Option<f64>,
    /// This consumer's budget (its own, else `deploy_duplicate_budget`).
    pub budget: f64,
    pub verdict: Verdict,
    /// The highest minute ratio ([`PEAK_SPAN`]) at a scrape in the window, and when.
    pub peak_ratio: Option<f64>,
    pub peak_at: Option<DateTime<Utc>>,
    /// The ratio the consumer settles back to ([`baseline`] says how it is read).
    pub baseline_ratio: f64,
    pub baseline_source: BaselineSource,
    /// Seconds from the marker until the minute ratio came back within
    /// [`SETTLE_FACTOR`] × the baseline (at least the normal day's) and stayed there
    /// for the rest of the window; 0 when it never rose above; None when it had not
    /// by the window's end (or, while the window is open, has not yet).
    pub settle_seconds: Option<i64>,
}

/// One deploy (or restart) and its window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeployBudget {
    pub at: DateTime<Utc>,
    /// `deploy` or `restart`.
    pub kind: String,
    pub label: String,
    pub source: MarkerSource,
    /// The window's end (now while it is open).
    pub until: DateTime<Utc>,
    pub window_seconds: i64,
    pub ends: WindowEnd,
    /// Every consumer together.
    pub processed: f64,
    pub duplicates: f64,
    pub ratio: Option<f64>,
    /// The worst consumer's verdict.
    pub verdict: Verdict,
    /// Per consumer with data in or before the window, by target and name.
    pub consumers: Vec<ConsumerBudget>,
}

impl DeployBudget {
    /// Its window has closed: the verdict is final.
    pub fn closed(&self) -> bool {
        self.ends != WindowEnd::Open
    }
}

/// Counts kept to the thousandth: a rate times its interval is the counter's whole
/// increase up to floating-point noise, which a reader should not see as 13.999999.
fn tidy(count: f64) -> f64 {
    // + 0.0: an empty sum is -0.0, which JSON would print as such.
    (count * 1000.0).round() / 1000.0 + 0.0
}

/// Sum of the steps ending in `(from, to]` (found by bisection: a poll reads a
/// few windows of an hour of steps per consumer, not the hour each time).
fn counts(steps: &[Step], from: DateTime<Utc>, to: DateTime<Utc>) -> (f64, f64) {
    let first = steps.partition_point(|s| s.end <= from);
    let last = steps.partition_point(|s| s.end <= to);
    steps[first..last.max(first)]
        .iter()
        .fold((0.0, 0.0), |(p, d), s| (p + s.processed, d + s.duplicates))
}

/// The consumer's baseline before a marker at `at`: its ratio over the
/// [`BASELINE_SPAN`] before the marker, leaving out the time an earlier deploy had
/// not yet settled (`quiet_from`: from when the consumer was back at its baseline
/// after the deploy before) — a deploy's spike is no baseline for the next one.
/// Without a delivery in that span, the field report's normal day: deploys every
/// few minutes (the demo's) leave no quiet time, and "back to baseline" then means
/// back to what a day without deploys costs.
pub fn baseline(
    steps: &[Step],
    at: DateTime<Utc>,
    quiet_from: Option<DateTime<Utc>>,
) -> (f64, BaselineSource) {
    let span = TimeDelta::from_std(BASELINE_SPAN).unwrap_or_default();
    let from = quiet_from.map_or(at - span, |q| q.max(at - span));
    let (p, d) = counts(steps, from, at);
    match duplicate_ratio(p, d) {
        Some(r) if from < at => (r, BaselineSource::BeforeMarker),
        _ => (NORMAL_DAY_RATIO, BaselineSource::NormalDay),
    }
}

/// The minute ratio at each step's end, for the steps `from..to` (indices): the
/// deliveries of the steps ending within [`PEAK_SPAN`] before it, those before the
/// window too (the ratio as the Overview showed it then).
fn minute_ratios(steps: &[Step], range: std::ops::Range<usize>) -> Vec<Option<f64>> {
    let span = TimeDelta::from_std(PEAK_SPAN).unwrap_or_default();
    // The first step the window's first minute reaches.
    let mut first = steps.get(range.start).map_or(range.start, |s| {
        steps.partition_point(|b| b.end <= s.end - span)
    });
    let (mut p, mut d) = (0.0, 0.0);
    let mut out = Vec::with_capacity(range.len());
    for (i, s) in steps.iter().enumerate().take(range.end).skip(first) {
        p += s.processed;
        d += s.duplicates;
        while steps[first].end <= s.end - span {
            p -= steps[first].processed;
            d -= steps[first].duplicates;
            first += 1;
        }
        if i >= range.start {
            out.push(duplicate_ratio(p.max(0.0), d.max(0.0)));
        }
    }
    out
}

/// One consumer's figures in the window `(at, until]`, and from when it was back
/// at its baseline (the next deploy's `quiet_from`).
fn consumer_budget(
    c: &ConsumerSteps,
    at: DateTime<Utc>,
    until: DateTime<Utc>,
    open: bool,
    quiet_from: Option<DateTime<Utc>>,
    rules: &AlertRules,
) -> Option<(ConsumerBudget, DateTime<Utc>)> {
    let start = c.steps.partition_point(|s| s.end <= at);
    // An open window has every reading since its marker: the poll's own scrape
    // finished after the poll's `now` (a two-poll snapshot has no other).
    let end = if open {
        c.steps.len()
    } else {
        c.steps.partition_point(|s| s.end <= until)
    };
    if start == end {
        // No reading in the window: nothing known (a consumer that started later,
        // or a window before the dashboard's data).
        return None;
    }
    let window = &c.steps[start..end];
    let processed: f64 = window.iter().map(|s| s.processed).sum();
    let duplicates: f64 = window.iter().map(|s| s.duplicates).sum();
    let (processed, duplicates) = (tidy(processed), tidy(duplicates));
    let ratio = duplicate_ratio(processed, duplicates);
    let budget = rules.deploy_budget_of(&c.consumer);
    let verdict = match ratio {
        None => Verdict::NoTraffic,
        Some(r) if r > budget => Verdict::Over,
        Some(_) => Verdict::Within,
    };
    let (baseline_ratio, baseline_source) = baseline(&c.steps, at, quiet_from);
    let level = baseline_ratio.max(NORMAL_DAY_RATIO) * SETTLE_FACTOR;
    let minute = minute_ratios(&c.steps, start..end);
    let peak = minute
        .iter()
        .zip(window)
        .filter_map(|(r, s)| r.map(|r| (r, s.end)))
        .fold(
            None,
            |best: Option<(f64, DateTime<Utc>)>, (r, t)| match best {
                Some((b, _)) if b >= r => best,
                _ => Some((r, t)),
            },
        );
    let last_above = minute.iter().rposition(|r| r.is_some_and(|r| r > level));
    let (settle_seconds, settled_at) = match last_above {
        None => (Some(0), at),
        Some(i) if i + 1 < window.len() => {
            let settled = window[i + 1].end;
            (Some((settled - at).num_seconds()), settled)
        }
        // Above at the window's last reading: not settled (yet, while open). The
        // next deploy's baseline then finds no quiet time before it.
        Some(_) => (None, until),
    };
    Some((
        ConsumerBudget {
            target: c.target.clone(),
            consumer: c.consumer.clone(),
            processed,
            duplicates,
            ratio,
            budget,
            verdict,
            peak_ratio: peak.map(|(r, _)| r),
            peak_at: peak.map(|(_, t)| t),
            baseline_ratio,
            baseline_source,
            settle_seconds,
        },
        settled_at,
    ))
}

/// The budget of every deploy and restart marker up to `now`, newest first.
/// `consumers`' steps must be in time order.
pub fn budgets(
    markers: &[TimelineMarker],
    consumers: &[ConsumerSteps],
    rules: &AlertRules,
    now: DateTime<Utc>,
) -> Vec<DeployBudget> {
    let mut deploys: Vec<&TimelineMarker> = markers
        .iter()
        .filter(|m| DEPLOY_KINDS.contains(&m.kind.as_str()) && m.at <= now)
        .collect();
    deploys.sort_by_key(|m| m.at);
    let settle = TimeDelta::from_std(rules.deploy_settle_time).unwrap_or(TimeDelta::MAX);
    // Per consumer: from when it was back at its baseline after the deploy before.
    let mut quiet_from: BTreeMap<(&str, &str), DateTime<Utc>> = BTreeMap::new();
    let mut out = Vec::with_capacity(deploys.len());
    for (i, m) in deploys.iter().enumerate() {
        let cap =
            m.at.checked_add_signed(settle)
                .unwrap_or(DateTime::<Utc>::MAX_UTC);
        let next = deploys.get(i + 1).map(|n| n.at);
        let (until, ends) = match next {
            Some(n) if n <= cap => (n, WindowEnd::NextMarker),
            _ if cap <= now => (cap, WindowEnd::SettleTime),
            _ => (now, WindowEnd::Open),
        };
        let mut per_consumer = Vec::new();
        for c in consumers {
            let key = (c.target.as_str(), c.consumer.as_str());
            let Some((budget, settled_at)) = consumer_budget(
                c,
                m.at,
                until,
                ends == WindowEnd::Open,
                quiet_from.get(&key).copied(),
                rules,
            ) else {
                continue;
            };
            quiet_from.insert(key, settled_at);
            per_consumer.push(budget);
        }
        per_consumer.sort_by(|a, b| (&a.target, &a.consumer).cmp(&(&b.target, &b.consumer)));
        let processed = tidy(per_consumer.iter().map(|c| c.processed).sum());
        let duplicates = tidy(per_consumer.iter().map(|c| c.duplicates).sum());
        out.push(DeployBudget {
            at: m.at,
            kind: m.kind.clone(),
            label: m.label.clone(),
            source: m.source,
            until,
            window_seconds: (until - m.at).num_seconds(),
            ends,
            processed,
            duplicates,
            ratio: duplicate_ratio(processed, duplicates),
            verdict: per_consumer
                .iter()
                .map(|c| c.verdict)
                .max()
                .unwrap_or(Verdict::NoTraffic),
            consumers: per_consumer,
        });
    }
    out.reverse();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap_or_default()
    }

    fn deploy(s: i64, label: &str) -> TimelineMarker {
        TimelineMarker {
            at: t(s),
            kind: "deploy".into(),
            label: label.into(),
            detail: None,
            source: MarkerSource::Database,
        }
    }

    /// One step a second from `from` to `to` (ends), `per_s` processed each, and
    /// the duplicates listed as (second, count).
    fn trace(from: i64, to: i64, per_s: f64, dups: &[(i64, f64)]) -> Vec<Step> {
        (from..=to)
            .map(|s| Step {
                end: t(s),
                processed: per_s,
                duplicates: dups.iter().filter(|(at, _)| *at == s).map(|(_, n)| n).sum(),
            })
            .collect()
    }

    fn consumer(name: &str, steps: Vec<Step>) -> ConsumerSteps {
        ConsumerSteps {
            target: "fleet".into(),
            consumer: name.into(),
            steps,
        }
    }

    /// Two deploys of known cost: the first's window ends at the second marker
    /// (300 s), the second's at the settle time (600 s); every figure is exact.
    #[test]
    fn two_deploys_of_known_duplicate_counts() {
        let rules = AlertRules::default();
        // 10 processed a second from t=-600; a normal-day duplicate at -300; deploy
        // #1 at 0 costs 6 + 4 + 2 duplicates (at 1, 2, 30); deploy #2 at 300 costs 1
        // (at 301).
        let steps = trace(
            -600,
            1000,
            10.0,
            &[(-300, 1.0), (1, 6.0), (2, 4.0), (30, 2.0), (301, 1.0)],
        );
        let markers = [deploy(0, "v1"), deploy(300, "v2")];
        let out = budgets(&markers, &[consumer("sms", steps)], &rules, t(1000));
        assert_eq!(out.len(), 2);
        let (second, first) = (&out[0], &out[1]);
        assert_eq!(first.label, "v1");
        assert_eq!(first.ends, WindowEnd::NextMarker);
        assert_eq!((first.until, first.window_seconds), (t(300), 300));
        let c = &first.consumers[0];
        assert_eq!((c.processed, c.duplicates), (3000.0, 12.0));
        assert_eq!(c.ratio, Some(12.0 / 3012.0));
        assert_eq!(c.verdict, Verdict::Within, "0.398 % < 0.4 %");
        assert_eq!(c.budget, 0.004);
        // The minute before t=30: 600 processed, 12 duplicates.
        assert_eq!(c.peak_ratio, Some(12.0 / 612.0));
        assert_eq!(c.peak_at, Some(t(30)));
        // Baseline: the ten minutes before, one duplicate among 6000 (t -599..0).
        assert_eq!(c.baseline_source, BaselineSource::BeforeMarker);
        assert_eq!(c.baseline_ratio, 1.0 / 6001.0);
        // Above 2 × 1/6001 until the duplicate at 30 leaves the minute: at 90.
        assert_eq!(c.settle_seconds, Some(90));

        assert_eq!(second.label, "v2");
        assert_eq!(second.ends, WindowEnd::SettleTime);
        assert_eq!((second.until, second.window_seconds), (t(900), 600));
        let c = &second.consumers[0];
        assert_eq!((c.processed, c.duplicates), (6000.0, 1.0));
        assert_eq!(c.verdict, Verdict::Within);
        // Its baseline: from the first deploy's settling (90) to 300, no duplicate.
        assert_eq!(c.baseline_source, BaselineSource::BeforeMarker);
        assert_eq!(c.baseline_ratio, 0.0);
        // One duplicate in 600 is 0.17 %, above twice the normal day's 0.01 %.
        assert_eq!(c.settle_seconds, Some(61));
        assert_eq!((second.processed, second.duplicates), (6000.0, 1.0));
    }

    #[test]
    fn a_deploy_over_its_consumers_own_budget_is_over_and_the_others_within() {
        let mut rules = AlertRules::default();
        rules
            .deploy_duplicate_budget_by_consumer
            .insert("sms".into(), 0.001);
        let dups = [(5, 3.0)];
        let consumers = [
            consumer("counter", trace(-10, 200, 10.0, &dups)),
            consumer("sms", trace(-10, 200, 10.0, &dups)),
        ];
        // The poll's scrape ended after its `now` (199): still the open window's.
        let out = budgets(&[deploy(0, "v3")], &consumers, &rules, t(199));
        let d = &out[0];
        assert_eq!(d.ends, WindowEnd::Open, "200 s of a 600 s window");
        assert!(!d.closed());
        let verdicts: Vec<(&str, Verdict, f64)> = d
            .consumers
            .iter()
            .map(|c| (c.consumer.as_str(), c.verdict, c.budget))
            .collect();
        // 3 in 2003 deliveries: 0.15 %.
        assert_eq!(
            verdicts,
            vec![
                ("counter", Verdict::Within, 0.004),
                ("sms", Verdict::Over, 0.001)
            ]
        );
        assert_eq!(d.verdict, Verdict::Over, "the worst consumer's");
        assert_eq!((d.processed, d.duplicates), (4000.0, 6.0));
    }

    #[test]
    fn back_to_back_deploys_fall_back_to_the_normal_day_and_a_spike_at_the_end_is_unsettled() {
        let rules = AlertRules::default();
        // Duplicates right before the second marker: the first window ends above
        // its baseline; the second has no quiet time before it.
        let steps = trace(1, 400, 10.0, &[(1, 5.0), (119, 5.0), (130, 1.0)]);
        let out = budgets(
            &[deploy(0, "a"), deploy(120, "b")],
            &[consumer("c", steps)],
            &rules,
            t(400),
        );
        let (b, a) = (&out[0].consumers[0], &out[1].consumers[0]);
        assert_eq!(
            a.baseline_source,
            BaselineSource::NormalDay,
            "no data before 0"
        );
        assert_eq!(a.baseline_ratio, NORMAL_DAY_RATIO);
        assert_eq!(
            a.settle_seconds, None,
            "above its baseline at the window's end"
        );
        assert_eq!(b.baseline_source, BaselineSource::NormalDay);
        assert_eq!(
            b.settle_seconds,
            Some(70),
            "the duplicate at 130 left the minute at 190"
        );
        assert_eq!(out[0].ends, WindowEnd::Open);
    }

    #[test]
    fn no_traffic_is_no_ratio_and_a_consumer_without_readings_is_left_out() {
        let rules = AlertRules::default();
        let idle = consumer("idle", trace(0, 100, 0.0, &[]));
        let later = consumer("later", trace(700, 800, 1.0, &[]));
        let out = budgets(&[deploy(10, "v")], &[idle, later], &rules, t(800));
        let d = &out[0];
        assert_eq!(d.consumers.len(), 1);
        assert_eq!(d.consumers[0].verdict, Verdict::NoTraffic);
        assert_eq!(d.consumers[0].ratio, None);
        assert_eq!(d.consumers[0].settle_seconds, Some(0));
        assert_eq!(d.verdict, Verdict::NoTraffic);
        assert_eq!(d.ends, WindowEnd::SettleTime);
    }

    #[test]
    fn rates_become_counts_over_the_interval_they_were_measured_over() {
        let p = |s: i64, v: Option<f64>| Point { at: t(s), value: v };
        // A failed scrape at 2: the rate at 4 spans 1..4 (3 s).
        let processed = [
            p(0, Some(9.0)),
            p(1, Some(10.0)),
            p(2, None),
            p(4, Some(5.0)),
        ];
        let duplicates = [
            p(0, Some(0.0)),
            p(1, Some(2.0)),
            p(2, None),
            p(4, Some(1.0)),
        ];
        let steps = steps_from_rates(&processed, &duplicates, None);
        assert_eq!(
            steps,
            vec![
                Step {
                    end: t(1),
                    processed: 10.0,
                    duplicates: 2.0
                },
                Step {
                    end: t(4),
                    processed: 15.0,
                    duplicates: 3.0
                },
            ]
        );
        // The counters read first a second before the first rate: its step too.
        let steps = steps_from_rates(&processed, &duplicates, Some(t(-1)));
        assert_eq!(steps.len(), 3);
        assert_eq!(
            steps[0],
            Step {
                end: t(0),
                processed: 9.0,
                duplicates: 0.0
            }
        );
        let history = [HistoryPoint {
            t: 1_800_000_060,
            duplicate_ratio: None,
            processed_per_second: Some(2.0),
            duplicate_dropped_per_second: None,
            redelivered_per_second: None,
            dead_lettered_per_second: None,
        }];
        assert_eq!(
            steps_from_history(&history, 30),
            vec![Step {
                end: t(60),
                processed: 60.0,
                duplicates: 0.0
            }]
        );
    }

    #[test]
    fn markers_other_than_deploys_and_restarts_open_no_window() {
        let rules = AlertRules::default();
        let mut drill = deploy(5, "drill");
        drill.kind = "drill".into();
        let restart = TimelineMarker {
            kind: "restart".into(),
            source: MarkerSource::Scrape,
            ..deploy(50, "sms restarted")
        };
        let steps = trace(0, 100, 1.0, &[]);
        let out = budgets(&[drill, restart], &[consumer("c", steps)], &rules, t(100));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].kind, "restart");
        assert_eq!(out[0].window_seconds, 50);
    }
}
