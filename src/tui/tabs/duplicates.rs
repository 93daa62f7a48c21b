//! Duplicates: the duplicate rate over time, one line per consumer (or the selected
//! one), deploy / restart / drill markers as vertical lines, a normal-day baseline,
//! zoom from one minute up to the retention window.

use chrono::{DateTime, Utc};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Chart, Dataset, GraphType, Paragraph};
use ratatui::Frame;

use crate::monitor::series::Point;
use crate::monitor::{BrokerChart, ConsumerChart};
use crate::tui::app::App;
use crate::tui::format;
use crate::tui::theme::Theme;
use crate::tui::widgets::panel;

/// A normal day's duplicate rate (the field report: ~0.01 %).
const NORMAL_DAY_PCT: f64 = 0.01;
/// What a deploy day reaches (~0.4 %).
const DEPLOY_DAY_PCT: f64 = 0.4;

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

fn span_label(seconds: u64) -> String {
    match seconds {
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 86_400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let Some(snap) = &app.snapshot else {
        return crate::tui::widgets::waiting(frame, area, "the duplicate rate", theme);
    };
    let charts: Vec<(usize, &ConsumerChart)> = snap
        .charts
        .iter()
        .enumerate()
        .filter(|(i, c)| {
            app.chart_consumer.is_none_or(|sel| sel == *i)
                && app.matches(&format!("{}/{}", c.target, c.consumer))
        })
        .collect();
    let span = snap
        .charts
        .first()
        .map(|c| c.span_seconds)
        .unwrap_or(900)
        .max(60);
    let now = snap.taken_at;
    let x0 = -(span as f64);
    let markers: Vec<_> = snap
        .markers
        .iter()
        .chain(&app.local_markers)
        .filter(|m| (now - m.at).num_seconds() <= span as i64 && m.at <= now)
        .collect();

    let broker_rows = if snap.brokers.is_empty() { 0 } else { 10 };
    let [chart_area, broker_area, legend_area] = Layout::vertical([
        Constraint::Min(8),
        Constraint::Length(broker_rows),
        Constraint::Length(markers.len().clamp(1, 6) as u16 + 2),
    ])
    .areas(area);
    if broker_rows > 0 {
        render_broker(frame, broker_area, app, &charts, span, theme);
    }

    // The data must outlive the chart widget.
    let series: Vec<(usize, String, Segments)> = charts
        .iter()
        .map(|(i, c)| {
            (
                *i,
                format!("{}/{}", c.target, c.consumer),
                segments(&c.duplicate_ratio, now, 100.0),
            )
        })
        .collect();
    let peak = series
        .iter()
        .flat_map(|(_, _, segs)| segs.iter().flatten().map(|(_, y)| *y))
        .fold(0.0f64, f64::max);
    let y_max = (peak * 1.2).max(DEPLOY_DAY_PCT * 1.25);
    let baseline = [(x0, NORMAL_DAY_PCT), (0.0, NORMAL_DAY_PCT)];
    let deploy_day = [(x0, DEPLOY_DAY_PCT), (0.0, DEPLOY_DAY_PCT)];
    let marker_lines: Vec<[(f64, f64); 2]> = markers
        .iter()
        .map(|m| {
            let x = -(now - m.at).num_milliseconds() as f64 / 1000.0;
            [(x, 0.0), (x, y_max)]
        })
        .collect();

    let mut datasets = vec![
        Dataset::default()
            .name(format!("normal day {NORMAL_DAY_PCT}%"))
            .marker(Marker::Dot)
            .graph_type(GraphType::Line)
            .style(theme.dim)
            .data(&baseline),
        Dataset::default()
            .name(format!("deploy day {DEPLOY_DAY_PCT}%"))
            .marker(Marker::Dot)
            .graph_type(GraphType::Line)
            .style(theme.dim)
            .data(&deploy_day),
    ];
    for (m, line) in markers.iter().zip(&marker_lines) {
        datasets.push(
            Dataset::default()
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(theme.marker(&m.kind))
                .data(line),
        );
    }
    for (i, name, segs) in &series {
        for (k, seg) in segs.iter().enumerate() {
            let mut d = Dataset::default()
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(theme.series(*i))
                .data(seg);
            if k == 0 {
                d = d.name(name.clone());
            }
            datasets.push(d);
        }
    }
    let which = match app.chart_consumer.and_then(|i| snap.charts.get(i)) {
        Some(c) => format!("{}/{}", c.target, c.consumer),
        None => "all consumers".to_string(),
    };
    let title = format!(
        " Duplicate rate — {which} — last {} (+/- zoom, c consumer) ",
        span_label(span)
    );
    let x_labels = vec![
        Span::raw(format!("-{}", span_label(span))),
        Span::raw(format!("-{}", span_label(span / 2))),
        Span::raw("now"),
    ];
    let y_labels = vec![
        Span::raw("0%"),
        Span::raw(format!("{:.2}%", y_max / 2.0)),
        Span::raw(format!("{y_max:.2}%")),
    ];
    frame.render_widget(
        Chart::new(datasets)
            .block(panel(title, theme))
            .x_axis(
                Axis::default()
                    .bounds([x0, 0.0])
                    .labels(x_labels)
                    .style(theme.dim),
            )
            .y_axis(
                Axis::default()
                    .bounds([0.0, y_max])
                    .labels(y_labels)
                    .style(theme.dim),
            )
            .legend_position(Some(ratatui::widgets::LegendPosition::TopLeft))
            .hidden_legend_constraints((Constraint::Percentage(60), Constraint::Percentage(80))),
        chart_area,
    );

    let mut lines: Vec<Line> = markers
        .iter()
        .take(6)
        .map(|m| {
            Line::from(vec![
                Span::styled("▍", theme.marker(&m.kind)),
                Span::styled(format!("{:<8}", m.kind), theme.marker(&m.kind)),
                Span::raw(format!("{}  {}", format::clock(m.at), m.label)),
                Span::styled(format!("  ({})", format::ago(Some(m.at), now)), theme.dim),
            ])
        })
        .collect();
    if lines.is_empty() {
        lines.push(Line::styled(
            "no deploy, restart or drill in this window",
            theme.dim,
        ));
    }
    let now_line: Vec<Span> = charts
        .iter()
        .map(|(i, c)| {
            let status = snap
                .consumers
                .iter()
                .find(|s| s.target == c.target && s.consumer == c.consumer);
            Span::styled(
                format!(
                    " {}: {} ",
                    c.consumer,
                    format::pct(status.and_then(|s| s.duplicate_ratio))
                ),
                theme.series(*i),
            )
        })
        .collect();
    // The HTTP edge's own duplicates: retries answered from the stored response.
    let edge: Vec<Span> = snap
        .targets
        .iter()
        .flat_map(|t| t.http.values())
        .map(|outcomes| {
            let rate = |o: &str| outcomes.get(o).and_then(|r| r.per_second).unwrap_or(0.0);
            (rate("replayed"), rate("conflict"))
        })
        .reduce(|a, b| (a.0 + b.0, a.1 + b.1))
        .map(|(replayed, conflict)| {
            vec![Span::styled(
                format!(
                    " │ HTTP replays {}/s, conflicts {}/s ",
                    format::rate(Some(replayed)),
                    format::rate(Some(conflict))
                ),
                theme.dim,
            )]
        })
        .unwrap_or_default();
    frame.render_widget(
        Paragraph::new(lines).block(panel(
            Line::from([vec![Span::raw(" Markers │ now:")], now_line, edge].concat()),
            theme,
        )),
        legend_area,
    );
}

/// The broker's own redelivery rate (RabbitMQ's exporter) beside the consumers'
/// duplicate_dropped rate, in messages per second: every broker redelivery should
/// end as a dropped duplicate, so the two lines should move together.
fn render_broker(
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
    let x0 = -(span as f64);
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
        for (k, seg) in segs.iter().enumerate() {
            let mut d = Dataset::default()
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(theme.warn)
                .data(seg);
            if k == 0 {
                d = d.name(format!("{} redelivered/s", b.target));
            }
            datasets.push(d);
        }
    }
    for (i, name, segs) in &dropped {
        for (k, seg) in segs.iter().enumerate() {
            let mut d = Dataset::default()
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(theme.series(*i))
                .data(seg);
            if k == 0 {
                d = d.name(format!("{name} dropped/s"));
            }
            datasets.push(d);
        }
    }
    let status: Vec<String> = snap
        .brokers
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
    let title = format!(
        " Broker redeliveries vs duplicates dropped (msg/s) — {} ",
        status.join(" · ")
    );
    frame.render_widget(
        Chart::new(datasets)
            .block(panel(title, theme))
            .x_axis(Axis::default().bounds([x0, 0.0]).style(theme.dim))
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
