//! The duplicate-rate chart: the lines on a braille canvas, and drawn into the
//! buffer around them the baselines, clipped peaks, axes, marker lane, legend and
//! cursor.

use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::canvas::{Canvas, Line as CanvasLine};
use ratatui::widgets::{Paragraph, Wrap};
use ratatui::Frame;

use super::plot::{axis_time, ratio_label, span_label, Plot, Segments};
use super::scale::Scale;
use crate::app::{App, CURSOR_STEPS};
use crate::format;
use crate::theme::Theme;
use crate::widgets::{panel, Y_LABELS};
use idemwatch_monitor::alerts::{DEPLOY_DAY_RATIO, NORMAL_DAY_RATIO};
use idemwatch_monitor::markers::{glyph, TimelineMarker};

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
pub(super) fn chart_panel(
    frame: &mut Frame,
    area: Rect,
    app: &App,
    plot: &Plot<'_>,
    theme: &Theme,
) {
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
    // A fitted span says so: the chart is younger than its window, not zoomed in.
    let fitted_note = if plot.fitted { " (all so far)" } else { "" };
    format!(
        " Duplicate rate {} (w) — {which} — last {}{fitted_note} · {scale_note}{source_note} ",
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
                let label = format::fit(&m.label, right);
                buf.set_string(*x + 2, lane.y, &label, theme.marker(&m.kind));
                *x + 2 + label.chars().count() as u16
            })
        } else {
            let n = len.min(left);
            buf.set_string(
                *x - 1 - n as u16,
                lane.y,
                format::fit(&m.label, n),
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
