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
//! ├ Deploys: each window's duplicates per consumer against the budget ───────┤
//! ├ Markers in the window (newest first) ─────────────────────────────────────┤
//! ```
//! The y axis is clamped at the 95th percentile (×1.5, never below the deploy-day
//! baseline), so one 48 % spike does not flatten the 0.01 % and 0.4 % baselines
//! onto the zero row; clipped peaks are marked ▲. `g` switches to a log scale.
//!
//! `plot.rs` gathers what is drawn, `scale.rs` the y axis, `chart.rs` draws the chart,
//! `broker.rs` the broker panel, `deploys.rs` the Deploys panel; the markers' list
//! is here.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Modifier;
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use crate::app::App;
use crate::format;
use crate::theme::Theme;
use crate::widgets::{panel, waiting};
use idemwatch_monitor::markers::glyph;
use idemwatch_monitor::ConsumerChart;

mod broker;
mod chart;
mod deploys;
mod plot;
mod scale;

use broker::broker_panel;
use chart::chart_panel;
use plot::{plot, Plot};

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
    let has_deploys = !snap.deploys.is_empty();
    let marker_rows = if app.compact() {
        3
    } else {
        plot.markers.len().clamp(1, if has_deploys { 4 } else { 6 }) as u16 + 2
    };
    // The Deploys panel: a compact screen keeps the newest deploy's lines, a wide one
    // up to a dozen (header, each deploy, its consumers).
    let deploy_rows = if app.compact() {
        6
    } else {
        deploys::lines_wanted(app).clamp(2, 12) as u16 + 2
    };
    let [chart_area, broker_area, deploy_area, list_area] = Layout::vertical([
        Constraint::Min(10),
        Constraint::Length(broker_rows),
        Constraint::Length(deploy_rows),
        Constraint::Length(marker_rows),
    ])
    .areas(area);
    chart_panel(frame, chart_area, app, &plot, theme);
    if broker_rows > 0 {
        broker_panel(frame, broker_area, app, &charts, plot.span, theme);
    }
    deploys::deploys_panel(frame, deploy_area, app, theme);
    markers_panel(frame, list_area, app, &plot, theme);
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
