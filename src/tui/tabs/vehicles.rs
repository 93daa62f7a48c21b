//! Vehicles: the fleet-wide anomaly list and, for one vehicle, its current state
//! beside its history in arrival order, so an event that arrived behind a newer one
//! (or a state that went backwards) stands out.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Paragraph, Row, Table, Wrap};
use ratatui::Frame;

use crate::monitor::vehicles::VehicleAnomaly;
use crate::tui::app::App;
use crate::tui::format;
use crate::tui::theme::Theme;
use crate::tui::widgets::panel;

fn describe(a: &VehicleAnomaly) -> (&'static str, String) {
    match a {
        VehicleAnomaly::LateEvent {
            seq, event_type, ..
        } => (
            "late event",
            format!("{event_type} seq {seq} arrived behind a newer one: history only"),
        ),
        VehicleAnomaly::SequenceGap {
            after_seq,
            before_seq,
            missing,
            ..
        } => (
            "seq gap",
            format!("{missing} missing between {after_seq} and {before_seq}"),
        ),
        VehicleAnomaly::StateBehind {
            state_seq,
            newest_applied_seq,
            ..
        } => (
            "STATE BEHIND",
            format!("state at seq {state_seq}, newest applied history seq {newest_applied_seq}"),
        ),
        VehicleAnomaly::DuplicateHistory {
            seq,
            event_type,
            copies,
            ..
        } => (
            "dup history",
            format!("{event_type} seq {seq} stored {copies} times"),
        ),
    }
}

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let Some(snap) = &app.snapshot else {
        return crate::tui::widgets::waiting(frame, area, "the vehicles", theme);
    };
    if let Some(device) = &app.vehicles.open {
        return render_detail(frame, area, app, device, theme);
    }
    let Some(v) = snap.database.as_ref().and_then(|d| d.vehicles.as_ref()) else {
        frame.render_widget(
            Paragraph::new("no vehicle tables in the watched database")
                .block(panel(" Vehicles ", theme)),
            area,
        );
        return;
    };
    let devices = app.anomaly_devices();
    let rows: Vec<Row> =
        v.anomalies
            .iter()
            .filter(|a| app.matches(a.device_id()))
            .map(|a| {
                let (kind, detail) = describe(a);
                let selected = devices
                    .get(app.vehicles.selected)
                    .is_some_and(|d| d == a.device_id());
                let style = match a {
                    VehicleAnomaly::StateBehind { .. }
                    | VehicleAnomaly::DuplicateHistory { .. } => theme.crit,
                    VehicleAnomaly::LateEvent { .. } => theme.warn,
                    VehicleAnomaly::SequenceGap { .. } => theme.base,
                };
                let row = Row::new([
                    Cell::from(a.device_id().to_string()),
                    Cell::from(kind).style(style),
                    Cell::from(detail),
                ]);
                if selected {
                    row.style(theme.selected)
                } else {
                    row
                }
            })
            .collect();
    let title = format!(
        " Vehicle anomalies — {} rows examined{}, {} late events in the window (Enter opens a vehicle) ",
        v.rows_examined,
        if v.truncated { " (newest only)" } else { "" },
        v.late_events_in_window
    );
    if rows.is_empty() {
        frame.render_widget(
            Paragraph::new("no ordering anomaly: every state is at its newest applied event")
                .style(theme.ok)
                .block(panel(title, theme)),
            area,
        );
        return;
    }
    frame.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(16),
                Constraint::Length(13),
                Constraint::Min(20),
            ],
        )
        .header(Row::new(["device", "anomaly", "detail"]).style(theme.title))
        .block(panel(title, theme)),
        area,
    );
}

fn render_detail(frame: &mut Frame, area: Rect, app: &App, device: &str, theme: &Theme) {
    let detail = app
        .snapshot
        .as_ref()
        .and_then(|s| s.vehicle.as_ref())
        .filter(|d| d.device_id == device);
    let [state_area, history_area] =
        Layout::horizontal([Constraint::Length(34), Constraint::Min(30)]).areas(area);
    let Some(detail) = detail else {
        frame.render_widget(
            Paragraph::new(format!("loading {device}…")).block(panel(format!(" {device} "), theme)),
            area,
        );
        return;
    };
    let state_lines = match &detail.state {
        None => vec![Line::styled("no state row", theme.warn)],
        Some(s) => vec![
            Line::raw(format!("last seq     {}", s.last_seq)),
            Line::raw(format!("last event   {}", s.last_event_type)),
            Line::raw(format!(
                "ignition     {}",
                s.ignition.as_deref().unwrap_or("—")
            )),
            Line::raw(format!(
                "occurred     {}",
                s.occurred_at
                    .map(format::clock)
                    .unwrap_or_else(|| "—".into())
            )),
            Line::raw(format!(
                "updated      {}",
                format::ago(s.updated_at, app.now)
            )),
            Line::raw(""),
            Line::styled("state only moves forward: an older", theme.dim),
            Line::styled("seq goes to history, not here.", theme.dim),
        ],
    };
    frame.render_widget(
        Paragraph::new(state_lines)
            .wrap(Wrap { trim: false })
            .block(panel(
                format!(" {device}: current state (Esc back) "),
                theme,
            )),
        state_area,
    );
    let highest_applied = detail
        .state
        .as_ref()
        .map(|s| s.last_seq)
        .unwrap_or(i64::MAX);
    let rows = detail.history.iter().rev().map(|e| {
        let ev = &e.event;
        let mark = if !ev.applied {
            Cell::from("LATE: history only").style(theme.warn)
        } else if e.late {
            Cell::from("arrived late").style(theme.warn)
        } else if ev.seq > highest_applied {
            Cell::from("NEWER THAN STATE").style(theme.crit)
        } else {
            Cell::from("applied").style(theme.ok)
        };
        Row::new([
            Cell::from(format::clock(ev.received_at)),
            Cell::from(ev.seq.to_string()),
            Cell::from(ev.event_type.clone()),
            Cell::from(
                ev.occurred_at
                    .map(format::clock)
                    .unwrap_or_else(|| "—".into()),
            ),
            mark,
        ])
    });
    frame.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(9),
                Constraint::Length(7),
                Constraint::Length(13),
                Constraint::Length(9),
                Constraint::Min(12),
            ],
        )
        .header(Row::new(["received", "seq", "event", "occurred", ""]).style(theme.title))
        .block(panel(
            format!(
                " history in arrival order, newest first{} ",
                if detail.truncated {
                    " (newest rows)"
                } else {
                    ""
                }
            ),
            theme,
        )),
        history_area,
    );
}
