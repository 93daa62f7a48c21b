//! Vehicles: the fleet-wide anomaly list and, for one vehicle, its current state
//! beside its history in arrival order, so an event that arrived behind a newer one
//! (or a state that went backwards) stands out.
//!
//! ```text
//! ┌ Vehicle anomalies (3) — Enter opens, o opens any id ──────────────┐
//! │ device        anomaly       detail                               │
//! └───────────────────────────────────────────────────────────────────┘
//! open:
//! ┌ 34-SIM-0007: current state ┐┌ history in arrival order (12) ────┐
//! │ last seq 319 …             ││ received seq event occurred mark  │
//! └────────────────────────────┘└───────────────────────────────────┘
//! ```
//! Under 100 columns the open vehicle's state sits above its history.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Paragraph, Row, Wrap};
use ratatui::Frame;

use crate::app::App;
use crate::format;
use crate::lists::{self, ListId};
use crate::theme::Theme;
use crate::widgets::{focus_title, list_table, panel, waiting, ListTable};
use idemwatch_monitor::vehicles::{DetailEvent, VehicleAnomaly, VehicleDetail};

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
    if app.snapshot.is_none() {
        return waiting(frame, area, "the vehicles", theme);
    }
    match &app.vehicles.open {
        Some(device) => detail(frame, area, app, device, theme),
        None => anomalies_panel(frame, area, app, theme),
    }
}

fn anomalies_panel(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let Some(v) = app
        .snapshot
        .as_ref()
        .and_then(|s| s.database.as_ref())
        .and_then(|d| d.vehicles.as_ref())
    else {
        frame.render_widget(
            Paragraph::new("no vehicle tables in the watched database (o opens a vehicle by id)")
                .block(panel(" Vehicles ", theme)),
            area,
        );
        return;
    };
    let arranged = lists::anomalies(app);
    let title = format!(
        " Vehicle anomalies ({}) — {} rows examined{}, {} late in the window — Enter opens, o opens any id, y copies ",
        arranged.count_label(),
        v.rows_examined,
        if v.truncated { " (newest only)" } else { "" },
        v.late_events_in_window
    );
    if arranged.rows.is_empty() {
        let text = if arranged.total == 0 {
            "no ordering anomaly: every state is at its newest applied event"
        } else {
            "every anomaly is filtered out"
        };
        frame.render_widget(
            Paragraph::new(text)
                .style(theme.ok)
                .block(panel(focus_title(title, true), theme)),
            area,
        );
        return;
    }
    // The only list of the tab while no vehicle is open: it always has the keys.
    let table = ListTable {
        title,
        header: Row::new(["device", "anomaly", "detail"]),
        widths: vec![
            Constraint::Length(16),
            Constraint::Length(13),
            Constraint::Min(20),
        ],
        rows: arranged
            .rows
            .iter()
            .map(|(_, a)| anomaly_row(a, theme))
            .collect(),
        selected: arranged.selected(app.list(ListId::Anomalies)),
    };
    list_table(frame, area, table, true, theme);
}

/// One anomaly: a state behind or a stored duplicate is an error, a late event a
/// warning, a gap plain; a drill's own device dimmed and said so.
fn anomaly_row(a: &VehicleAnomaly, theme: &Theme) -> Row<'static> {
    let (kind, detail) = describe(a);
    let style = match a {
        VehicleAnomaly::StateBehind { .. } | VehicleAnomaly::DuplicateHistory { .. } => theme.crit,
        VehicleAnomaly::LateEvent { .. } => theme.warn,
        VehicleAnomaly::SequenceGap { .. } => theme.base,
    };
    let drill = a
        .device_id()
        .starts_with(idemwatch_monitor::alerts::DRILL_DEVICE_PREFIX);
    Row::new([
        Cell::from(a.device_id().to_string()),
        Cell::from(kind).style(if drill { theme.dim } else { style }),
        Cell::from(if drill {
            format!("{detail} (a drill's own device)")
        } else {
            detail
        }),
    ])
}

fn detail(frame: &mut Frame, area: Rect, app: &App, device: &str, theme: &Theme) {
    let detail = app
        .snapshot
        .as_ref()
        .and_then(|s| s.vehicle.as_ref())
        .filter(|d| d.device_id == device);
    let Some(detail) = detail else {
        frame.render_widget(
            Paragraph::new(format!("loading {device}… (Esc back)"))
                .block(panel(format!(" {device} "), theme)),
            area,
        );
        return;
    };
    let [state_area, history_area] = if app.compact() {
        Layout::vertical([Constraint::Length(6), Constraint::Min(4)]).areas(area)
    } else {
        Layout::horizontal([Constraint::Length(34), Constraint::Min(30)]).areas(area)
    };
    state_panel(frame, state_area, app, detail, theme);
    history_panel(frame, history_area, app, detail, theme);
}

fn state_panel(frame: &mut Frame, area: Rect, app: &App, detail: &VehicleDetail, theme: &Theme) {
    let lines = match &detail.state {
        None => vec![Line::styled("no state row", theme.warn)],
        Some(s) => {
            let mut l = vec![
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
            ];
            if !app.compact() {
                l.extend([
                    Line::raw(""),
                    Line::styled("state only moves forward: an older", theme.dim),
                    Line::styled("seq goes to history, not here.", theme.dim),
                ]);
            }
            l
        }
    };
    frame.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .block(panel(
                format!(" {}: current state (Esc back) ", detail.device_id),
                theme,
            )),
        area,
    );
}

/// The open vehicle's history, each event marked against the state: applied,
/// arrived late, history only, or newer than the state (which went backwards).
fn history_panel(frame: &mut Frame, area: Rect, app: &App, detail: &VehicleDetail, theme: &Theme) {
    let arranged = lists::history(app);
    let highest_applied = detail
        .state
        .as_ref()
        .map(|s| s.last_seq)
        .unwrap_or(i64::MAX);
    let title = format!(
        " history ({}) {}{} — ↑↓ PgUp PgDn scroll, s sorts ",
        arranged.count_label(),
        if app.list(ListId::History).sort == 1 {
            "by seq"
        } else {
            "in arrival order, newest first"
        },
        if detail.truncated {
            " (newest rows)"
        } else {
            ""
        },
    );
    // The only list of the tab while a vehicle is open: it always has the keys.
    let table = ListTable {
        title,
        header: Row::new(["received", "seq", "event", "occurred", ""]),
        widths: vec![
            Constraint::Length(9),
            Constraint::Length(7),
            Constraint::Length(13),
            Constraint::Length(9),
            Constraint::Min(12),
        ],
        rows: arranged
            .rows
            .iter()
            .map(|(_, e)| history_row(e, highest_applied, theme))
            .collect(),
        selected: arranged.selected(app.list(ListId::History)),
    };
    list_table(frame, area, table, true, theme);
}

fn history_row(e: &DetailEvent, highest_applied: i64, theme: &Theme) -> Row<'static> {
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
}
