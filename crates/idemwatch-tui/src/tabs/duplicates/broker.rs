//! The broker's redeliveries beside the consumers' dropped duplicates.

use ratatui::layout::{Constraint, Rect};
use ratatui::style::Style;
use ratatui::symbols::Marker;
use ratatui::text::Span;
use ratatui::widgets::{Axis, Chart, Dataset, GraphType};
use ratatui::Frame;

use super::plot::{segments, Segments};
use crate::app::App;
use crate::theme::Theme;
use crate::widgets::panel;
use idemwatch_monitor::targets::BrokerStatus;
use idemwatch_monitor::{BrokerChart, ConsumerChart};

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
pub(super) fn broker_panel(
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
