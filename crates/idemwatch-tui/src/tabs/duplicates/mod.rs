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
//! ├ Dedup windows: duplicate age (p50 / p99 / oldest) against each window ────┤
//! ├ Markers in the window (newest first) ─────────────────────────────────────┤
//! ```
//! The y axis is clamped at the 95th percentile (×1.5, never below the deploy-day
//! baseline), so one 48 % spike does not flatten the 0.01 % and 0.4 % baselines
//! onto the zero row; clipped peaks are marked ▲. `g` switches to a log scale.
//!
//! `plot.rs` gathers what is drawn, `scale.rs` the y axis, `chart.rs` draws the chart,
//! `broker.rs` the broker panel, `deploys.rs` the Deploys panel, `windows.rs` the dedup
//! windows; the markers' list is here.

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
mod windows;

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
    let in_view = windows::in_view(app);
    let window_rows = if app.compact() {
        0
    } else {
        windows::rows(&in_view)
    };
    // The Deploys panel: a compact screen keeps the newest deploy's lines, a wide one
    // up to a dozen (header, each deploy, its consumers), fewer beside the windows.
    let deploy_rows = if app.compact() {
        6
    } else {
        let most = if window_rows > 0 { 8 } else { 12 };
        deploys::lines_wanted(app).clamp(2, most) as u16 + 2
    };
    // The chart keeps room to read a spike (16 rows on a wide screen); the panels
    // under it give up lines first, so the heights are decided here rather than left
    // to an over-constrained layout (whose solver may split a shortage differently
    // from one frame to the next).
    let chart_rows = if app.compact() { 10 } else { 16 };
    let [broker_rows, deploy_rows, window_rows, marker_rows] = fit_under_chart(
        area.height.saturating_sub(chart_rows),
        [broker_rows, deploy_rows, window_rows, marker_rows],
    );
    let [chart_area, broker_area, deploy_area, windows_area, list_area] = Layout::vertical([
        Constraint::Fill(1),
        Constraint::Length(broker_rows),
        Constraint::Length(deploy_rows),
        Constraint::Length(window_rows),
        Constraint::Length(marker_rows),
    ])
    .areas(area);
    chart_panel(frame, chart_area, app, &plot, theme);
    if broker_rows > 0 {
        broker_panel(frame, broker_area, app, &charts, plot.span, theme);
    }
    deploys::deploys_panel(frame, deploy_area, app, theme);
    if window_rows > 0 {
        windows::windows_panel(frame, windows_area, &in_view, theme);
    }
    markers_panel(frame, list_area, app, &plot, theme);
}

/// The heights of the panels under the chart (broker, deploys, windows, markers)
/// within `room` rows: the windows and the Deploys panels give up their last lines
/// first (each down to a header and a line: 4 rows), then the markers (to 3), then
/// the windows panel and the broker panel go.
fn fit_under_chart(room: u16, wanted: [u16; 4]) -> [u16; 4] {
    let [mut broker, mut deploys, mut windows, mut markers] = wanted;
    let total = |b: u16, d: u16, w: u16, m: u16| b + d + w + m;
    while total(broker, deploys, windows, markers) > room {
        if windows > 4 && windows >= deploys {
            windows -= 1;
        } else if deploys > 4 {
            deploys -= 1;
        } else if windows > 4 {
            windows -= 1;
        } else if markers > 3 {
            markers -= 1;
        } else if windows > 0 {
            windows = 0;
        } else if broker > 0 {
            broker = 0;
        } else {
            break;
        }
    }
    [broker, deploys, windows, markers]
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

#[cfg(test)]
mod tests {
    use super::fit_under_chart;

    #[test]
    fn the_panels_under_the_chart_give_up_lines_in_order_and_never_overflow() {
        // Room for everything: nothing changes.
        assert_eq!(fit_under_chart(40, [9, 10, 8, 6]), [9, 10, 8, 6]);
        // Short by 9: the windows and the deploys shrink, taking turns.
        assert_eq!(fit_under_chart(24, [9, 10, 8, 6]), [9, 5, 4, 6]);
        // Shorter: both at their floor, then the markers to 3, then the windows go.
        assert_eq!(fit_under_chart(20, [9, 10, 8, 6]), [9, 4, 4, 3]);
        assert_eq!(fit_under_chart(17, [9, 10, 8, 6]), [9, 4, 0, 3]);
        // Then the broker; what is left is never more than the room, down to the
        // deploys' and the markers' floors.
        assert_eq!(fit_under_chart(8, [9, 10, 8, 6]), [0, 4, 0, 3]);
        for room in 0..60 {
            let got = fit_under_chart(room, [9, 10, 8, 6]);
            assert!(got.iter().sum::<u16>() <= room.max(7), "{room}: {got:?}");
        }
    }
}
