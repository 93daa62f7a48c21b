//! What the chart draws, gathered once per frame: each consumer's ratio as runs of
//! points (a gap breaks the line), the markers in the window, the scale, and the
//! clock labels of the x axis.

use chrono::{DateTime, Utc};

use super::scale::{linear_scale, Scale};
use crate::app::{App, RateWindow};
use idemwatch_monitor::alerts::DEPLOY_DAY_RATIO;
use idemwatch_monitor::markers::TimelineMarker;
use idemwatch_monitor::series::Point;
use idemwatch_monitor::ConsumerChart;

/// Runs of chart points, one line each.
pub type Segments = Vec<Vec<(f64, f64)>>;

/// Contiguous runs of a series as (seconds before now, value) points: a gap (no
/// scrape, or nothing flowed) breaks the line instead of drawing a false zero.
pub fn segments(points: &[Point], now: DateTime<Utc>, scale: f64) -> Segments {
    let mut out = Vec::new();
    let mut run: Vec<(f64, f64)> = Vec::new();
    for p in points {
        match p.value {
            Some(v) => run.push((-(now - p.at).num_milliseconds() as f64 / 1000.0, v * scale)),
            None => {
                if !run.is_empty() {
                    out.push(std::mem::take(&mut run));
                }
            }
        }
    }
    if !run.is_empty() {
        out.push(run);
    }
    out
}

/// `1 min`, `1 min 30 s` (a span fitted to the data), `15 min`, `6 h`, `7 d`.
pub fn span_label(seconds: u64) -> String {
    match seconds {
        s if s < 3600 && s % 60 != 0 => format!("{} min {} s", s / 60, s % 60),
        s if s < 3600 => format!("{} min", s / 60),
        s if s < 86_400 => format!("{} h", s / 3600),
        s => format!("{} d", s / 86_400),
    }
}

/// A time on the x axis, as precise as the span needs.
pub fn axis_time(t: DateTime<Utc>, span_seconds: u64) -> String {
    match span_seconds {
        s if s <= 600 => idemwatch_base::clock::clock(t),
        s if s <= 86_400 => t.format("%H:%M").to_string(),
        _ => t.format("%m-%d %H:%M").to_string(),
    }
}

/// The chart's data in one place: what is drawn, over which window, at which scale.
pub(super) struct Plot<'a> {
    pub(super) now: DateTime<Utc>,
    pub(super) span: u64,
    /// The span is all the data there is so far (zoom.rs), not a zoom level.
    pub(super) fitted: bool,
    pub(super) series: Vec<(usize, String, Segments)>,
    pub(super) markers: Vec<&'a TimelineMarker>,
    pub(super) scale: Scale,
    /// The line left of this time is the Prometheus server's history, right of it
    /// the dashboard's own scrapes.
    pub(super) history_until: Option<DateTime<Utc>>,
    /// Redeliveries and dead letters per second of the charted consumers, read at
    /// the cursor (not drawn: the chart's scale is a ratio).
    pub(super) redelivered: Vec<Segments>,
    pub(super) dead_lettered: Vec<Segments>,
}

/// The ratio the chart draws: over the window the Overview's `dup %` column reads
/// (`w`), so the line at "now" is the number in the table.
pub(super) fn ratio_series(c: &ConsumerChart, window: RateWindow) -> &[Point] {
    match window {
        RateWindow::OneMinute => &c.duplicate_ratio_1m,
        RateWindow::FiveMinutes => &c.duplicate_ratio_5m,
        RateWindow::LastPoll => &c.duplicate_ratio,
    }
}

/// What that ratio is, for the title and the legend.
pub(super) fn ratio_label(window: RateWindow) -> String {
    match window {
        RateWindow::LastPoll => "per poll".into(),
        w => format!("over {}", w.label()),
    }
}

pub(super) fn plot<'a>(app: &'a App, charts: &[(usize, &ConsumerChart)]) -> Option<Plot<'a>> {
    let snap = app.snapshot.as_ref()?;
    let now = snap.taken_at;
    let span = snap
        .charts
        .first()
        .map(|c| c.span_seconds)
        .unwrap_or(900)
        .max(60);
    let series: Vec<(usize, String, Segments)> = charts
        .iter()
        .map(|(i, c)| {
            (
                *i,
                format!("{}/{}", c.target, c.consumer),
                segments(ratio_series(c, app.rate_window), now, 100.0),
            )
        })
        .collect();
    let mut values: Vec<f64> = series
        .iter()
        .flat_map(|(_, _, s)| s.iter().flatten().map(|(_, y)| *y))
        .collect();
    let scale = if app.chart.log {
        let peak = values.iter().copied().fold(0.0f64, f64::max);
        Scale::Log {
            max_decade: (peak.max(DEPLOY_DAY_RATIO * 100.0) * 1.2).log10().ceil(),
        }
    } else {
        linear_scale(&mut values)
    };
    let markers = snap
        .markers
        .iter()
        .chain(&app.local_markers)
        .filter(|m| {
            m.at <= now
                && (now - m.at).num_seconds() <= span as i64
                && !app.chart.hidden_kinds.contains(&m.kind)
                && app.matches(&format!("{} {}", m.kind, m.label))
        })
        .collect();
    let history_until = charts.iter().filter_map(|(_, c)| c.history_until).min();
    Some(Plot {
        now,
        span,
        fitted: charts.iter().any(|(_, c)| c.span_fitted),
        series,
        markers,
        scale,
        history_until,
        redelivered: charts
            .iter()
            .map(|(_, c)| segments(&c.redelivered_per_s, now, 1.0))
            .collect(),
        dead_lettered: charts
            .iter()
            .map(|(_, c)| segments(&c.dead_lettered_per_s, now, 1.0))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_labels_read_as_clock_times_at_every_zoom() {
        let t = crate::fixtures::now();
        assert_eq!(axis_time(t, 60), "04:12:03");
        assert_eq!(axis_time(t, 3600), "04:12");
        assert_eq!(axis_time(t, 7 * 86_400), "11-30 04:12");
        assert_eq!(span_label(60), "1 min");
        assert_eq!(span_label(90), "1 min 30 s");
        assert_eq!(span_label(7 * 86_400), "7 d");
    }
}
