//! Duplicates: the duplicate rate over time, one line per consumer (or the selected
//! one), with the field report's baselines, a marker lane of labelled ticks
//! (deploys, restarts, drills, manual notes; kinds toggleable), a cursor to read one
//! column, and zoom from one minute up to the retention.
//!
//! ```text
//! ┌ Duplicate rate — all consumers — last 15 min · clamped at 0.60% (2 peaks ▲) ┐
//! │ 0.60%┤        ▲                                                          │
//! │      │   ⣀⡠⠔⠊⠉⠢⡀          ┊(cursor)                                      │
//! │ 0.30%┤┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄ deploy day 0.4%   │
//! │   0% ┼────┴────────────┴─────────────────────────────────────────────────│
//! │      04:00      04:04      04:08      04:12                               │
//! │      D deploy #1  R restart   X drill…   (the marker lane)               │
//! │ ── vehicle-state 0.010%  ── trip-counter 0%   cursor 04:08:12: …         │
//! ├ Broker redeliveries vs duplicates dropped (when a RabbitMQ target exists) ┤
//! ├ Markers in the window (newest first) ─────────────────────────────────────┤
//! ```
//! The y axis is clamped at the 95th percentile (×1.5, never below the deploy-day
//! baseline), so one 48 % spike does not flatten the 0.01 % and 0.4 % baselines
//! onto the zero row; clipped peaks are marked ▲. `g` switches to a log scale.

use chrono::{DateTime, Utc};
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::canvas::{Canvas, Line as CanvasLine};
use ratatui::widgets::{Axis, Chart, Dataset, GraphType, Paragraph, Wrap};
use ratatui::Frame;

use crate::monitor::alerts::{DEPLOY_DAY_RATIO, NORMAL_DAY_RATIO};
use crate::monitor::markers::{glyph, TimelineMarker};
use crate::monitor::series::Point;
use crate::monitor::targets::BrokerStatus;
use crate::monitor::{BrokerChart, ConsumerChart};
use crate::tui::app::{App, RateWindow, CURSOR_STEPS};
use crate::tui::format;
use crate::tui::theme::Theme;
use crate::tui::widgets::{panel, waiting, Y_LABELS};

/// The floor of the log scale, in percent (0.001 %): zero sits there.
const LOG_FLOOR_PCT: f64 = 0.001;

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

/// `1 min`, `15 min`, `6 h`, `7 d`.
pub fn span_label(seconds: u64) -> String {
    match seconds {
        s if s < 3600 => format!("{} min", s / 60),
        s if s < 86_400 => format!("{} h", s / 3600),
        s => format!("{} d", s / 86_400),
    }
}

/// A time on the x axis, as precise as the span needs.
pub fn axis_time(t: DateTime<Utc>, span_seconds: u64) -> String {
    match span_seconds {
        s if s <= 600 => t.format("%H:%M:%S").to_string(),
        s if s <= 86_400 => t.format("%H:%M").to_string(),
        _ => t.format("%m-%d %H:%M").to_string(),
    }
}

/// The chart's data in one place: what is drawn, over which window, at which scale.
struct Plot<'a> {
    now: DateTime<Utc>,
    span: u64,
    series: Vec<(usize, String, Segments)>,
    markers: Vec<&'a TimelineMarker>,
    scale: Scale,
    /// The line left of this time is the Prometheus server's history, right of it
    /// the dashboard's own scrapes.
    history_until: Option<DateTime<Utc>>,
    /// Redeliveries and dead letters per second of the charted consumers, read at
    /// the cursor (not drawn: the chart's scale is a ratio).
    redelivered: Vec<Segments>,
    dead_lettered: Vec<Segments>,
}

/// The y axis: a clamped linear scale, or a log one.
#[derive(Debug, Clone, Copy)]
enum Scale {
    Linear { max: f64, clipped: usize, peak: f64 },
    Log { max_decade: f64 },
}

impl Scale {
    /// Percent values in, y coordinates out.
    fn y(self, pct: f64) -> f64 {
        match self {
            Scale::Linear { max, .. } => pct.min(max),
            Scale::Log { .. } => pct.max(LOG_FLOOR_PCT).log10(),
        }
    }

    fn bounds(self) -> [f64; 2] {
        match self {
            Scale::Linear { max, .. } => [0.0, max],
            Scale::Log { max_decade } => [LOG_FLOOR_PCT.log10(), max_decade],
        }
    }

    fn clipped(self, pct: f64) -> bool {
        matches!(self, Scale::Linear { max, .. } if pct > max)
    }

    /// (value in percent, label) ticks of the axis.
    fn ticks(self) -> Vec<(f64, String)> {
        match self {
            Scale::Linear { max, .. } => vec![
                (0.0, "0%".into()),
                (max / 2.0, format!("{:.2}%", max / 2.0)),
                (max, format!("{max:.2}%")),
            ],
            Scale::Log { max_decade } => (LOG_FLOOR_PCT.log10() as i32..=max_decade as i32)
                .map(|d| {
                    let v = 10f64.powi(d);
                    (v, format!("{}%", trim_pct(v)))
                })
                .collect(),
        }
    }
}

fn trim_pct(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The clamped linear scale: the 95th percentile ×1.5, never below the deploy-day
/// baseline ×1.25 (so both baselines stay readable).
fn linear_scale(values: &mut [f64]) -> Scale {
    let floor = DEPLOY_DAY_RATIO * 100.0 * 1.25;
    if values.is_empty() {
        return Scale::Linear {
            max: floor,
            clipped: 0,
            peak: 0.0,
        };
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let p95 = values[((values.len() - 1) as f64 * 0.95).round() as usize];
    let peak = values[values.len() - 1];
    let max = (p95 * 1.5).max(floor).min(peak.max(floor));
    Scale::Linear {
        max,
        clipped: values.iter().filter(|v| **v > max).count(),
        peak,
    }
}

/// The ratio the chart draws: over the window the Overview's `dup %` column reads
/// (`w`), so the line at "now" is the number in the table.
fn ratio_series(c: &ConsumerChart, window: RateWindow) -> &[Point] {
    match window {
        RateWindow::OneMinute => &c.duplicate_ratio_1m,
        RateWindow::FiveMinutes => &c.duplicate_ratio_5m,
        RateWindow::LastPoll => &c.duplicate_ratio,
    }
}

/// What that ratio is, for the title and the legend.
fn ratio_label(window: RateWindow) -> String {
    match window {
        RateWindow::LastPoll => "per poll".into(),
        w => format!("over {}", w.label()),
    }
}

fn plot<'a>(app: &'a App, charts: &[(usize, &ConsumerChart)]) -> Option<Plot<'a>> {
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

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let Some(snap) = &app.snapshot else {
        return waiting(frame, area, "the duplicate rate", theme);
    };
    let charts: Vec<(usize, &ConsumerChart)> = snap
        .charts
        .iter()
        .enumerate()
        .filter(|(i, c)| {
            app.chart.consumer.is_none_or(|sel| sel == *i)
                && app.matches(&format!("{}/{}", c.target, c.consumer))
        })
        .collect();
    let Some(plot) = plot(app, &charts) else {
        return;
    };
    let broker_rows = if snap.brokers.is_empty() || app.compact() {
        0
    } else {
        9
    };
    let marker_rows = if app.compact() {
        3
    } else {
        plot.markers.len().clamp(1, 6) as u16 + 2
    };
    let [chart_area, broker_area, list_area] = Layout::vertical([
        Constraint::Min(10),
        Constraint::Length(broker_rows),
        Constraint::Length(marker_rows),
    ])
    .areas(area);
    chart_panel(frame, chart_area, app, &plot, theme);
    if broker_rows > 0 {
        broker_panel(frame, broker_area, app, &charts, plot.span, theme);
    }
    markers_panel(frame, list_area, app, &plot, theme);
}

/// The chart with its axes, baselines, marker lane, legend and cursor line:
///
/// ```text
/// ┌ title: which consumers, the window, the scale, where the line comes from ┐
/// │ y labels ┤ the lines (braille canvas), ▲ clipped peaks, ┄ baselines      │
/// │          └──┴──────────┴──── the axis, a tick per marker ┊ history end   │
/// │             time labels                                                  │
/// │             marker lane                                                  │
/// │ legend (or the cursor's values)                                          │
/// └──────────────────────────────────────────────────────────────────────────┘
/// ```
fn chart_panel(frame: &mut Frame, area: Rect, app: &App, plot: &Plot<'_>, theme: &Theme) {
    let block = panel(chart_title(app, plot), theme);
    let inner = block.inner(area);
    frame.render_widget(block, area);
    if inner.height < 6 || inner.width < Y_LABELS + 10 {
        return;
    }
    // Rows: the plot, the axis, the time labels, the marker lane, the legend (two
    // rows when narrow, so every consumer stays named).
    let [plot_rows, axis_row, time_row, lane_row, legend_row] = Layout::vertical([
        Constraint::Min(2),
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Length(if app.compact() { 2 } else { 1 }),
    ])
    .areas(inner);
    let [labels, canvas_area] =
        Layout::horizontal([Constraint::Length(Y_LABELS), Constraint::Min(4)]).areas(plot_rows);
    let grid = Grid {
        area: canvas_area,
        x0: -(plot.span as f64),
        scale: plot.scale,
    };
    lines(frame, &grid, plot, theme);
    let buf = frame.buffer_mut();
    baselines(buf, &grid, theme);
    clipped_peaks(buf, &grid, plot, theme);
    y_labels(buf, labels, &grid, theme);
    x_axis(buf, axis_row, &grid, plot, theme);
    time_labels(buf, time_row, canvas_area, plot);
    marker_lane(buf, axis_row, lane_row, &grid, plot, theme);
    if let Some(step) = app.chart.cursor {
        cursor(buf, canvas_area, legend_row, axis_row, step, plot, theme);
    } else {
        let line = legend(app, plot, theme);
        frame.render_widget(Paragraph::new(line).wrap(Wrap { trim: true }), legend_row);
    }
}

/// The chart's title: which consumers, the ratio's window, the span, the scale
/// (with the clipped peaks), and where history ends and own scrapes begin.
fn chart_title(app: &App, plot: &Plot<'_>) -> String {
    let which = match app
        .chart
        .consumer
        .and_then(|i| app.snapshot.as_ref()?.charts.get(i))
    {
        Some(c) => format!("{}/{}", c.target, c.consumer),
        None => "all consumers".to_string(),
    };
    if app.compact() {
        // Under 100 columns: the same facts, short enough to be read whole.
        let which = which.split('/').nth(1).unwrap_or("all").to_string();
        let scale = match plot.scale {
            Scale::Linear {
                max, clipped: 0, ..
            } => format!("y ≤ {max:.2}%"),
            Scale::Linear { max, clipped, .. } => format!("y ≤ {max:.2}%, {clipped} ▲"),
            Scale::Log { .. } => "log".to_string(),
        };
        let source = if plot.history_until.is_some() {
            " · ◂ Prom┊live ▸"
        } else {
            ""
        };
        return format!(
            " Dup % {} — {which} — {} · {scale}{source} ",
            ratio_label(app.rate_window),
            span_label(plot.span)
        );
    }
    let scale_note = match plot.scale {
        Scale::Linear {
            max, clipped: 0, ..
        } => format!("y to {max:.2}%"),
        Scale::Linear {
            max, clipped, peak, ..
        } => format!("y clamped at {max:.2}%: {clipped} points above ▲ (peak {peak:.2}%)"),
        Scale::Log { .. } => "log scale".to_string(),
    };
    // Where each part of the line came from.
    let source_note = plot
        .history_until
        .map(|t| {
            format!(
                " · ◂ Prometheus history until {} ┊ own scrapes ▸",
                axis_time(t, plot.span)
            )
        })
        .unwrap_or_default();
    format!(
        " Duplicate rate {} (w) — {which} — last {} · {scale_note}{source_note} ",
        ratio_label(app.rate_window),
        span_label(plot.span)
    )
}

/// Where the plot's values fall on the screen: seconds before now to columns,
/// percent to rows, over the canvas's cells.
struct Grid {
    area: Rect,
    /// The left edge, in seconds before now (negative).
    x0: f64,
    scale: Scale,
}

impl Grid {
    fn col(&self, secs_before: f64) -> u16 {
        let f = ((secs_before - self.x0) / -self.x0).clamp(0.0, 1.0);
        self.area.x + ((f * f64::from(self.area.width - 1)).round() as u16)
    }

    fn row(&self, pct: f64) -> u16 {
        let [lo, hi] = self.scale.bounds();
        let f = ((self.scale.y(pct) - lo) / (hi - lo)).clamp(0.0, 1.0);
        self.area.bottom() - 1 - (f * f64::from(self.area.height - 1)).round() as u16
    }
}

/// Each consumer's runs as braille lines in its colour (a run of one point is a dot).
fn lines(frame: &mut Frame, grid: &Grid, plot: &Plot<'_>, theme: &Theme) {
    let scale = grid.scale;
    let series_styles: Vec<Color> = plot
        .series
        .iter()
        .map(|(i, _, _)| theme.series(*i).fg.unwrap_or(Color::Reset))
        .collect();
    frame.render_widget(
        Canvas::default()
            .x_bounds([grid.x0, 0.0])
            .y_bounds(scale.bounds())
            .marker(Marker::Braille)
            .paint(|ctx| {
                for ((_, _, segs), color) in plot.series.iter().zip(&series_styles) {
                    for seg in segs {
                        for w in seg.windows(2) {
                            ctx.draw(&CanvasLine::new(
                                w[0].0,
                                scale.y(w[0].1),
                                w[1].0,
                                scale.y(w[1].1),
                                *color,
                            ));
                        }
                        if let [only] = seg.as_slice() {
                            ctx.draw(&CanvasLine::new(
                                only.0,
                                scale.y(only.1),
                                only.0,
                                scale.y(only.1),
                                *color,
                            ));
                        }
                    }
                }
            }),
        grid.area,
    );
}

/// Clipped peaks: ▲ on the top row, at their columns.
fn clipped_peaks(buf: &mut Buffer, grid: &Grid, plot: &Plot<'_>, theme: &Theme) {
    for (_, _, segs) in &plot.series {
        for (x, y) in segs.iter().flatten() {
            if grid.scale.clipped(*y) {
                put(buf, grid.col(*x), grid.area.y, "▲", theme.crit);
            }
        }
    }
}

/// The y labels, right-aligned against their tick.
fn y_labels(buf: &mut Buffer, labels: Rect, grid: &Grid, theme: &Theme) {
    for (v, label) in grid.scale.ticks() {
        let row = grid.row(v);
        let text = format!("{label:>w$}┤", w = usize::from(Y_LABELS) - 1);
        buf.set_string(labels.x, row, text, theme.dim);
    }
}

/// The x axis, and on it where the Prometheus history ends (`┊`).
fn x_axis(buf: &mut Buffer, axis_row: Rect, grid: &Grid, plot: &Plot<'_>, theme: &Theme) {
    buf.set_string(
        grid.area.x - 1,
        axis_row.y,
        format!("└{}", "─".repeat(usize::from(grid.area.width))),
        theme.dim,
    );
    if let Some(t) = plot.history_until {
        let before = (plot.now - t).num_milliseconds() as f64 / 1000.0;
        if before < plot.span as f64 {
            put(buf, grid.col(-before), axis_row.y, "┊", theme.title);
        }
    }
}

fn put(buf: &mut Buffer, x: u16, y: u16, symbol: &str, style: Style) {
    if let Some(cell) = buf.cell_mut((x, y)) {
        cell.set_symbol(symbol).set_style(style);
    }
}

/// The normal-day and deploy-day baselines: dotted rows where no data is drawn,
/// named at their right end.
fn baselines(buf: &mut Buffer, grid: &Grid, theme: &Theme) {
    let area = grid.area;
    for (pct, name) in [
        (NORMAL_DAY_RATIO * 100.0, "normal day 0.01%"),
        (DEPLOY_DAY_RATIO * 100.0, "deploy day 0.4%"),
    ] {
        let y = grid.row(pct);
        for x in area.x..area.right() {
            if buf.cell((x, y)).is_some_and(|c| c.symbol() == " ") {
                put(buf, x, y, "┄", theme.dim);
            }
        }
        let label_x = area.right().saturating_sub(name.len() as u16 + 1);
        if (label_x..area.right()).all(|x| {
            buf.cell((x, y))
                .is_some_and(|c| c.symbol() == " " || c.symbol() == "┄")
        }) {
            buf.set_string(label_x, y, name, theme.dim);
        }
    }
}

/// Clock labels under the axis, as many as fit (5 on a wide chart).
fn time_labels(buf: &mut Buffer, row: Rect, area: Rect, plot: &Plot<'_>) {
    let sample = axis_time(plot.now, plot.span);
    let n = if area.width as usize > (sample.len() + 4) * 5 {
        5
    } else {
        3
    };
    for k in 0..n {
        let f = k as f64 / (n - 1) as f64;
        let at = plot.now
            - chrono::Duration::milliseconds(((1.0 - f) * plot.span as f64 * 1000.0) as i64);
        let text = axis_time(at, plot.span);
        let col = area.x + (f * f64::from(area.width - 1)).round() as u16;
        let x = col
            .saturating_sub(text.len() as u16 / 2)
            .clamp(area.x, area.right().saturating_sub(text.len() as u16));
        buf.set_string(x, row.y, text, Style::default());
    }
}

/// The marker lane: a tick on the axis and, on the lane below, the kind's letter
/// with as much of the label as fits before the next marker — or, where there is
/// more room before it (the newest deploy sits at the right edge), ending just
/// left of the letter.
fn marker_lane(
    buf: &mut Buffer,
    axis: Rect,
    lane: Rect,
    grid: &Grid,
    plot: &Plot<'_>,
    theme: &Theme,
) {
    let area = grid.area;
    let mut placed: Vec<(u16, &TimelineMarker)> = plot
        .markers
        .iter()
        .map(|m| {
            let secs = -(plot.now - m.at).num_milliseconds() as f64 / 1000.0;
            (grid.col(secs), *m)
        })
        .collect();
    placed.sort_by_key(|(x, _)| *x);
    // The first free column of the lane (after the previous marker's label).
    let mut free = area.x;
    for (i, (x, m)) in placed.iter().enumerate() {
        let style = theme.marker(&m.kind).add_modifier(Modifier::REVERSED);
        put(buf, *x, axis.y, "┴", theme.marker(&m.kind));
        put(buf, *x, lane.y, glyph(&m.kind), style);
        let next = placed
            .get(i + 1)
            .map(|(n, _)| *n)
            .unwrap_or(area.right() + 1);
        let len = m.label.chars().count();
        let right = usize::from(next.saturating_sub(*x + 3));
        // A space after what came before, and one before the letter.
        let left = usize::from(x.saturating_sub(free + 2));
        let label_end = if right >= len.min(left) || left < 3 {
            (right >= 3).then(|| {
                let label = fit(&m.label, right);
                buf.set_string(*x + 2, lane.y, &label, theme.marker(&m.kind));
                *x + 2 + label.chars().count() as u16
            })
        } else {
            let n = len.min(left);
            buf.set_string(
                *x - 1 - n as u16,
                lane.y,
                fit(&m.label, n),
                theme.marker(&m.kind),
            );
            None
        };
        free = label_end.unwrap_or(*x + 1).max(*x + 1);
    }
    if placed.is_empty() {
        buf.set_string(
            area.x,
            lane.y,
            "no deploy, restart or drill in this window",
            theme.dim,
        );
    }
}

/// `label` in at most `n` columns, "…" where it was cut.
fn fit(label: &str, n: usize) -> String {
    if label.chars().count() <= n {
        return label.to_string();
    }
    let mut cut: String = label.chars().take(n.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// Each consumer's colour and its current rate over the chart's window: the same
/// number as the Overview's `dup %` column.
fn legend<'a>(app: &App, plot: &Plot<'_>, theme: &Theme) -> Line<'a> {
    let Some(snap) = &app.snapshot else {
        return Line::default();
    };
    let mut spans: Vec<Span> = Vec::new();
    for (i, name, _) in &plot.series {
        let ratio = snap
            .consumers
            .iter()
            .find(|c| format!("{}/{}", c.target, c.consumer) == *name)
            .and_then(|c| app.rate_window.duplicate_ratio(c));
        let short = name.split('/').nth(1).unwrap_or(name);
        spans.push(Span::styled(format!("── {short} "), theme.series(*i)));
        spans.push(Span::raw(format!("{}  ", format::pct(ratio))));
    }
    if !app.compact() {
        spans.push(Span::styled(
            format!("({}; ←/→ cursor)", ratio_label(app.rate_window)),
            theme.dim,
        ));
    }
    Line::from(spans)
}

/// The cursor column and, on the legend row, the values there.
#[allow(clippy::too_many_arguments)]
fn cursor(
    buf: &mut Buffer,
    area: Rect,
    row: Rect,
    axis: Rect,
    step: u16,
    plot: &Plot<'_>,
    theme: &Theme,
) {
    let f = f64::from(step) / f64::from(CURSOR_STEPS);
    let x = area.x + (f * f64::from(area.width - 1)).round() as u16;
    for y in area.y..area.bottom() {
        if buf
            .cell((x, y))
            .is_some_and(|c| c.symbol() == " " || c.symbol() == "┄")
        {
            put(buf, x, y, "┊", theme.key);
        }
    }
    put(buf, x, axis.y, "┼", theme.key);
    let secs = -(1.0 - f) * plot.span as f64;
    // Half a column either side of the cursor belongs to it.
    let half = plot.span as f64 / f64::from(area.width.max(1)) / 2.0;
    let readout = cursor_readout(plot, secs, half, theme);
    buf.set_line(row.x, row.y, &readout, row.width);
}

/// What the cursor reads at `secs` before now: its time, each consumer's ratio
/// (the nearest point within reach), the redeliveries and dead letters summed over
/// the charted consumers, and the markers within `half` a column.
fn cursor_readout<'a>(plot: &Plot<'_>, secs: f64, half: f64, theme: &Theme) -> Line<'a> {
    let at = plot.now + chrono::Duration::milliseconds((secs * 1000.0) as i64);
    let mut spans = vec![Span::styled(
        format!("cursor {}: ", axis_time(at, plot.span.min(600))),
        theme.key,
    )];
    let reach = half.max(plot.span as f64 / 60.0);
    let nearest = |segs: &Segments| {
        segs.iter()
            .flatten()
            .min_by(|a, b| (a.0 - secs).abs().total_cmp(&(b.0 - secs).abs()))
            .filter(|p| (p.0 - secs).abs() <= reach)
            .map(|p| p.1)
    };
    for (i, name, segs) in &plot.series {
        let short = name.split('/').nth(1).unwrap_or(name);
        spans.push(Span::styled(
            format!(
                "{short} {}  ",
                nearest(segs).map_or("—".to_string(), |v| format!("{v:.3}%"))
            ),
            theme.series(*i),
        ));
    }
    // Summed over the charted consumers: what the duplicates came from, and what
    // was lost to the dead letters, at that moment (history or own scrapes).
    let sum = |all: &[Segments]| {
        all.iter()
            .filter_map(nearest)
            .fold(None, |acc: Option<f64>, v| Some(acc.unwrap_or(0.0) + v))
    };
    spans.push(Span::styled(
        format!(
            "redeliv {}/s dead {}/s  ",
            format::rate(sum(&plot.redelivered)),
            format::rate(sum(&plot.dead_lettered))
        ),
        theme.dim,
    ));
    for m in &plot.markers {
        let ms = -(plot.now - m.at).num_milliseconds() as f64 / 1000.0;
        if (ms - secs).abs() <= half.max(1.0) {
            spans.push(Span::styled(
                format!("{} {}  ", glyph(&m.kind), m.label),
                theme.marker(&m.kind),
            ));
        }
    }
    Line::from(spans)
}

/// The markers of the window, newest first, with their times.
fn markers_panel(frame: &mut Frame, area: Rect, app: &App, plot: &Plot<'_>, theme: &Theme) {
    let Some(snap) = &app.snapshot else {
        return;
    };
    let mut markers = plot.markers.clone();
    markers.sort_by_key(|m| std::cmp::Reverse(m.at));
    let hidden: Vec<&str> = app.chart.hidden_kinds.iter().map(String::as_str).collect();
    let rows = usize::from(area.height.saturating_sub(2));
    let mut lines: Vec<Line> = markers
        .iter()
        .take(rows)
        .map(|m| {
            Line::from(vec![
                Span::styled(
                    format!(" {} ", glyph(&m.kind)),
                    theme.marker(&m.kind).add_modifier(Modifier::REVERSED),
                ),
                Span::styled(format!(" {:<8}", m.kind), theme.marker(&m.kind)),
                Span::raw(format!("{}  {}", format::clock(m.at), m.label)),
                Span::styled(
                    format!("  ({})", format::ago(Some(m.at), plot.now)),
                    theme.dim,
                ),
            ])
        })
        .collect();
    if lines.is_empty() {
        lines.push(Line::styled(
            "no marker in this window (d/r/x/u show or hide a kind)",
            theme.dim,
        ));
    }
    // The HTTP edge's own duplicates: retries answered from the stored response.
    let edge = snap
        .targets
        .iter()
        .flat_map(|t| t.http.values())
        .map(|outcomes| {
            let rate = |o: &str| outcomes.get(o).and_then(|r| r.per_second).unwrap_or(0.0);
            (rate("replayed"), rate("conflict"))
        })
        .reduce(|a, b| (a.0 + b.0, a.1 + b.1))
        .map(|(replayed, conflict)| {
            format!(
                " │ HTTP replays {}/s, conflicts {}/s",
                format::rate(Some(replayed)),
                format::rate(Some(conflict))
            )
        })
        .unwrap_or_default();
    let title = format!(
        " Markers ({}{}){edge} ",
        markers.len(),
        if hidden.is_empty() {
            String::new()
        } else {
            format!(", hidden: {}", hidden.join(" "))
        }
    );
    frame.render_widget(Paragraph::new(lines).block(panel(title, theme)), area);
}

/// The broker's own redelivery rate (RabbitMQ's exporter) beside the consumers'
/// duplicate_dropped rate, in messages per second: every broker redelivery should
/// end as a dropped duplicate, so the two lines should move together.
///
/// ```text
/// ┌ Broker redeliveries vs duplicates dropped (msg/s) — rabbit: 2.0 redelivered/s… ┐
/// │ 2.4│      ⡠⠊⠉⠢⡀   (the broker's line in the warning colour,   rabbit redel… │
/// │    │ ⣀⣀⠔⠁    ⠈⠢⣀   each consumer's in its series colour)      trip dropped… │
/// │   0└──────────────────────────────────────────────────────────────────────── │
/// └────────────────────────────────────────────────────────────────────────────────┘
/// ```
fn broker_panel(
    frame: &mut Frame,
    area: Rect,
    app: &App,
    charts: &[(usize, &ConsumerChart)],
    span: u64,
    theme: &Theme,
) {
    let Some(snap) = &app.snapshot else {
        return;
    };
    let now = snap.taken_at;
    let brokers: Vec<(&BrokerChart, Segments)> = snap
        .broker_charts
        .iter()
        .map(|b| (b, segments(&b.redelivered_per_s, now, 1.0)))
        .collect();
    let dropped: Vec<(usize, String, Segments)> = charts
        .iter()
        .map(|(i, c)| {
            (
                *i,
                c.consumer.clone(),
                segments(&c.duplicates_per_s, now, 1.0),
            )
        })
        .collect();
    let peak = brokers
        .iter()
        .flat_map(|(_, s)| s.iter().flatten())
        .chain(dropped.iter().flat_map(|(_, _, s)| s.iter().flatten()))
        .map(|(_, y)| *y)
        .fold(0.0f64, f64::max);
    let y_max = (peak * 1.2).max(1.0);
    let mut datasets = Vec::new();
    for (b, segs) in &brokers {
        let name = format!("{} redelivered/s", b.target);
        datasets.extend(rate_lines(segs, name, theme.warn));
    }
    for (i, name, segs) in &dropped {
        datasets.extend(rate_lines(
            segs,
            format!("{name} dropped/s"),
            theme.series(*i),
        ));
    }
    let title = format!(
        " Broker redeliveries vs duplicates dropped (msg/s) — {} ",
        broker_status(&snap.brokers)
    );
    frame.render_widget(
        Chart::new(datasets)
            .block(panel(title, theme))
            .x_axis(
                Axis::default()
                    .bounds([-(span as f64), 0.0])
                    .style(theme.dim),
            )
            .y_axis(
                Axis::default()
                    .bounds([0.0, y_max])
                    .labels(vec![Span::raw("0"), Span::raw(format!("{y_max:.1}"))])
                    .style(theme.dim),
            )
            .legend_position(Some(ratatui::widgets::LegendPosition::TopRight))
            .hidden_legend_constraints((Constraint::Percentage(50), Constraint::Percentage(100))),
        area,
    );
}

/// One rate as chart lines, one per run; only the first run is named, so the
/// legend has one entry per rate.
fn rate_lines<'a>(segs: &'a Segments, name: String, style: Style) -> Vec<Dataset<'a>> {
    let mut name = Some(name);
    segs.iter()
        .map(|seg| {
            let d = Dataset::default()
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(style)
                .data(seg);
            match name.take() {
                Some(n) => d.name(n),
                None => d,
            }
        })
        .collect()
}

/// Each broker's redelivery rate and queue depths as its exporter reports them.
fn broker_status(brokers: &[BrokerStatus]) -> String {
    let status: Vec<String> = brokers
        .iter()
        .map(|b| {
            if !b.up {
                return format!("{}: down", b.target);
            }
            let n = |v: Option<f64>| v.map_or("?".to_string(), |v| format!("{v:.0}"));
            format!(
                "{}: {} redelivered/s, ready {}, unacked {}",
                b.target,
                b.redelivered
                    .per_second
                    .map_or("?".to_string(), |v| format!("{v:.1}")),
                n(b.messages_ready),
                n(b.messages_unacked)
            )
        })
        .collect();
    status.join(" · ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_spike_does_not_flatten_the_baselines() {
        // An hour of 0.01 % with one 48 % spike.
        let mut values: Vec<f64> = (0..3600).map(|_| 0.01).collect();
        values.extend([48.0, 30.0, 12.0]);
        let Scale::Linear { max, clipped, peak } = linear_scale(&mut values) else {
            panic!("linear");
        };
        assert!(max < 1.0, "{max}");
        assert!(
            max >= DEPLOY_DAY_RATIO * 100.0,
            "the deploy baseline is on the chart"
        );
        assert_eq!(clipped, 3);
        assert_eq!(peak, 48.0);
    }

    #[test]
    fn axis_labels_read_as_clock_times_at_every_zoom() {
        let t = crate::tui::fixtures::now();
        assert_eq!(axis_time(t, 60), "04:12:03");
        assert_eq!(axis_time(t, 3600), "04:12");
        assert_eq!(axis_time(t, 7 * 86_400), "11-30 04:12");
        assert_eq!(span_label(60), "1 min");
        assert_eq!(span_label(7 * 86_400), "7 d");
    }
}
