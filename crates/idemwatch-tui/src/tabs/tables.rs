//! Tables: the dedup table's health (size, inserts, oldest row against retention),
//! claims in doubt, dead letters (each one opens to its raw bytes), markers.
//!
//! ```text
//! ┌ Dedup table ───────────────┐┌ Inserts ────────────────────┐
//! ├ Claims in doubt ───────────┤├ Dead letters (Enter opens) ──┤
//! ├ Dead letters by reason ────┤├ Markers ─────────────────────┤
//! └────────────────────────────┘└──────────────────────────────┘
//! a dead letter open:
//! ┌ Dead letter #12 — consumer · reason · received · size ─────┐
//! │ detail                                                      │
//! │ text (escaped)   │ hex dump (offset, 16 bytes, ASCII)       │
//! └─────────────────────────────────────────────────────────────┘
//! ```
//! Under 100 columns one list at a time fills the tab, the others named with their
//! counts on a strip above it (←/→ switches).

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Cell, Paragraph, Row, Wrap};
use ratatui::Frame;

use crate::app::App;
use crate::format;
use crate::lists::{self, ListId, ListState};
use crate::theme::Theme;
use crate::widgets::{fit_title, list_table, panel, waiting, ListTable};
use idemwatch_monitor::db::{CountMethod, DbStats, SourceStatus};

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let Some(snap) = &app.snapshot else {
        return waiting(frame, area, "the tables", theme);
    };
    let Some(db) = &snap.database else {
        frame.render_widget(
            Paragraph::new("no database configured: add [database] to the config")
                .block(panel(" Tables ", theme)),
            area,
        );
        return;
    };
    if app.raw.is_some() {
        return raw_view(frame, area, app, theme);
    }
    if app.compact() {
        return compact(frame, area, app, theme);
    }
    let [top, middle, bottom] = Layout::vertical([
        Constraint::Length(8),
        Constraint::Min(6),
        Constraint::Length(9),
    ])
    .areas(area);
    let [dedup_area, inserts_area] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(top);
    let [doubt_area, dead_area] =
        Layout::horizontal([Constraint::Percentage(45), Constraint::Percentage(55)]).areas(middle);
    let [reasons_area, markers_area] =
        Layout::horizontal([Constraint::Percentage(45), Constraint::Percentage(55)]).areas(bottom);
    dedup_panel(frame, dedup_area, db, theme);
    list_panel(frame, inserts_area, app, ListId::Inserts, theme);
    list_panel(frame, doubt_area, app, ListId::Claims, theme);
    list_panel(frame, dead_area, app, ListId::DeadLetters, theme);
    list_panel(frame, reasons_area, app, ListId::Reasons, theme);
    list_panel(frame, markers_area, app, ListId::Markers, theme);
}

/// One list at a time, the others named on a strip with their counts.
fn compact(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let [strip, body] = Layout::vertical([Constraint::Length(1), Constraint::Min(3)]).areas(area);
    let focused = app.focused().unwrap_or(ListId::Claims);
    let mut spans = Vec::new();
    for id in ListId::of(app.tab) {
        let (shown, _) = lists::counts(app, *id);
        let style = if *id == focused {
            theme.selected
        } else {
            theme.dim
        };
        spans.push(Span::styled(format!(" {} {shown} ", id.title()), style));
        spans.push(Span::raw(" "));
    }
    spans.push(Span::styled("←/→", theme.key));
    frame.render_widget(Paragraph::new(Line::from(spans)), strip);
    list_panel(frame, body, app, focused, theme);
}

fn dedup_panel(frame: &mut Frame, area: Rect, db: &DbStats, theme: &Theme) {
    let mut lines = vec![Line::raw(format!("database {}", db.url))];
    if let SourceStatus::Down { error } = &db.status {
        lines.push(Line::styled(format!("DOWN: {error}"), theme.crit));
    }
    if let Some(d) = &db.dedup {
        let total = match d.total_rows {
            Some(r) => match r.method {
                CountMethod::Exact => format!("{} rows", r.rows),
                CountMethod::Statistics => format!("~{} rows (planner statistics)", r.rows),
                CountMethod::AtLeast => format!("≥ {} rows", r.rows),
            },
            None => "—".into(),
        };
        lines.push(Line::raw(format!("processed_messages: {total}")));
        lines.push(Line::raw(format!(
            "oldest row: {} (retention {})",
            d.oldest_age_seconds
                .map(format::duration)
                .unwrap_or_else(|| "—".into()),
            format::duration(d.retention_seconds)
        )));
        lines.push(if d.purge_stalled {
            Line::styled(
                "PURGE STALLED: rows older than retention + 1 day",
                theme.crit,
            )
        } else {
            Line::styled("retention purge keeping up", theme.ok)
        });
    }
    for f in &db.failures {
        lines.push(Line::styled(
            format!("{} failed: {}", f.query, f.error),
            theme.warn,
        ));
    }
    frame.render_widget(
        Paragraph::new(lines).block(panel(" Dedup table ", theme)),
        area,
    );
}

/// One of the tab's lists, with its selection and sort: the list's own table
/// (below), its title cut to the panel's width.
fn list_panel(frame: &mut Frame, area: Rect, app: &App, id: ListId, theme: &Theme) {
    let state = app.list(id);
    let sorted = format!(
        "by {}{}",
        id.sorts()[state.sort.min(id.sorts().len() - 1)],
        if state.reversed { " ↑" } else { "" }
    );
    let mut table = match id {
        ListId::Claims => claims_table(app, state, &sorted, theme),
        ListId::DeadLetters => dead_letters_table(app, state, &sorted, theme),
        ListId::Reasons => reasons_table(app, state, &sorted, theme),
        ListId::Inserts => inserts_table(app, state, &sorted),
        _ => markers_table(app, state, &sorted, theme),
    };
    table.title = fit_title(table.title, area.width);
    list_table(frame, area, table, app.focused() == Some(id), theme);
}

/// Claims in doubt: `consumer │ message key │ age │ attempts`, the total in the
/// title (the database lists at most a page of them).
fn claims_table(app: &App, state: &ListState, sorted: &str, theme: &Theme) -> ListTable<'static> {
    let a = lists::claims(app);
    let total = app
        .snapshot
        .as_ref()
        .and_then(|s| s.database.as_ref())
        .map_or(0, |d| d.claims_in_doubt_total);
    let rows = a
        .rows
        .iter()
        .map(|(_, c)| {
            Row::new([
                Cell::from(c.consumer.clone()),
                Cell::from(c.message_key.clone()),
                // A released claim (the provider failed or did not answer in time)
                // has no claim time left: its retry is due.
                Cell::from(if c.released {
                    "retry due".to_string()
                } else {
                    format::duration(c.age_seconds)
                })
                .style(theme.crit),
                Cell::from(c.attempts.to_string()),
            ])
        })
        .collect();
    ListTable {
        title: format!(
            " Side effects in doubt: {total} ({} listed, {sorted}) — sent or not? a retry reuses the provider key ",
            a.count_label()
        ),
        header: Row::new(["consumer", "message key", "age", "attempts"]),
        widths: vec![
            Constraint::Length(14),
            Constraint::Min(20),
            Constraint::Length(9),
            Constraint::Length(8),
        ],
        rows,
        selected: a.selected(state),
    }
}

/// The style of a dead letter's reason: a key conflict (same key, different
/// payload) is the one that means data was refused.
fn reason_style(reason: &str, otherwise: Style, theme: &Theme) -> Style {
    if reason == "key_conflict" {
        theme.crit
    } else {
        otherwise
    }
}

/// Dead letters one by one: `id │ received │ consumer │ reason │ raw preview`.
fn dead_letters_table(
    app: &App,
    state: &ListState,
    sorted: &str,
    theme: &Theme,
) -> ListTable<'static> {
    let a = lists::dead_letters(app);
    let rows = a
        .rows
        .iter()
        .map(|(_, d)| {
            Row::new([
                Cell::from(format!("#{}", d.id)),
                Cell::from(format::clock(d.received_at)),
                Cell::from(d.consumer.clone()),
                Cell::from(d.reason.clone()).style(reason_style(&d.reason, theme.warn, theme)),
                Cell::from(d.preview.clone()).style(theme.dim),
            ])
        })
        .collect();
    ListTable {
        title: format!(
            " Dead letters ({}, {sorted}) — Enter opens the raw bytes, y copies the key ",
            a.count_label()
        ),
        header: Row::new(["id", "received", "consumer", "reason", "raw"]),
        widths: vec![
            Constraint::Length(6),
            Constraint::Length(9),
            Constraint::Length(14),
            Constraint::Length(18),
            Constraint::Min(10),
        ],
        rows,
        selected: a.selected(state),
    }
}

/// Dead letters by reason: `consumer │ reason │ total │ last hour`.
fn reasons_table(app: &App, state: &ListState, sorted: &str, theme: &Theme) -> ListTable<'static> {
    let a = lists::reasons(app);
    let rows = a
        .rows
        .iter()
        .map(|(_, d)| {
            Row::new([
                Cell::from(d.consumer.clone()),
                Cell::from(d.reason.clone()).style(reason_style(&d.reason, theme.base, theme)),
                Cell::from(d.total.to_string()),
                Cell::from(d.last_hour.to_string()),
            ])
        })
        .collect();
    ListTable {
        title: format!(" Dead letters by reason ({}, {sorted}) ", a.count_label()),
        header: Row::new(["consumer", "reason", "total", "last h"]),
        widths: vec![
            Constraint::Length(14),
            Constraint::Length(19),
            Constraint::Length(7),
            Constraint::Min(6),
        ],
        rows,
        selected: a.selected(state),
    }
}

/// Dedup rows inserted per consumer over the last minute.
fn inserts_table(app: &App, state: &ListState, sorted: &str) -> ListTable<'static> {
    let a = lists::inserts(app);
    let rows = a
        .rows
        .iter()
        .map(|(_, i)| {
            Row::new([
                Cell::from(i.consumer.clone()),
                Cell::from(i.last_minute.to_string()),
            ])
        })
        .collect();
    ListTable {
        title: format!(" Inserts ({}, {sorted}) ", a.count_label()),
        header: Row::new(["consumer", "dedup rows / last minute"]),
        widths: vec![Constraint::Length(18), Constraint::Min(8)],
        rows,
        selected: a.selected(state),
    }
}

/// The timeline's markers: `at │ kind │ label`, the kind in its marker colour.
fn markers_table(app: &App, state: &ListState, sorted: &str, theme: &Theme) -> ListTable<'static> {
    let a = lists::markers(app);
    let rows = a
        .rows
        .iter()
        .map(|(_, m)| {
            Row::new([
                Cell::from(format::clock(m.at)),
                Cell::from(m.kind.clone()).style(theme.marker(&m.kind)),
                Cell::from(m.label.clone()),
            ])
        })
        .collect();
    ListTable {
        title: format!(" Markers ({}, {sorted}) — m adds one ", a.count_label()),
        header: Row::new(["at", "kind", "label"]),
        widths: vec![
            Constraint::Length(9),
            Constraint::Length(8),
            Constraint::Min(20),
        ],
        rows,
        selected: a.selected(state),
    }
}

/// One dead letter: who refused it and why, then its raw bytes as escaped text and
/// as a hex dump, scrolling together.
fn raw_view(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let Some(raw) = &app.raw else {
        return;
    };
    let letter = app
        .snapshot
        .as_ref()
        .and_then(|s| s.dead_letter.as_ref())
        .filter(|d| d.id == raw.id);
    let Some(d) = letter else {
        frame.render_widget(
            Paragraph::new(format!("loading dead letter #{}… (Esc back)", raw.id))
                .block(panel(" Dead letter ", theme)),
            area,
        );
        return;
    };
    let title = format!(
        " Dead letter #{} — {} · {} · received {} · {} bytes — ↑↓ PgUp PgDn scroll, y copies the key, Esc back ",
        d.id,
        d.consumer,
        d.reason,
        format::clock(d.received_at),
        d.raw.len()
    );
    let detail_rows = if app.compact() { 3 } else { 4 };
    let [detail_area, bytes_area] =
        Layout::vertical([Constraint::Length(detail_rows), Constraint::Min(3)]).areas(area);
    let mut detail = vec![Line::from(vec![
        Span::styled("reason  ", theme.title),
        Span::styled(d.reason.clone(), reason_style(&d.reason, theme.warn, theme)),
    ])];
    detail.push(Line::from(vec![
        Span::styled("detail  ", theme.title),
        Span::raw(d.detail.clone().unwrap_or_else(|| "—".into())),
    ]));
    frame.render_widget(
        Paragraph::new(detail)
            .wrap(Wrap { trim: false })
            .block(panel(title, theme)),
        detail_area,
    );
    let hex = idemwatch_monitor::bytes::hex_dump(&d.raw);
    let text = idemwatch_monitor::bytes::escaped_lines(&d.raw, 64);
    let rows = hex.len().max(text.len()) as u16;
    let scroll = raw.scroll.min(rows.saturating_sub(1));
    let (text_area, hex_area) = if app.compact() {
        let [a, b] = Layout::vertical([Constraint::Percentage(40), Constraint::Percentage(60)])
            .areas(bytes_area);
        (a, b)
    } else {
        let [a, b] =
            Layout::horizontal([Constraint::Min(40), Constraint::Length(80)]).areas(bytes_area);
        (a, b)
    };
    frame.render_widget(
        Paragraph::new(text.into_iter().map(Line::raw).collect::<Vec<_>>())
            .scroll((scroll, 0))
            .block(panel(" text (non-printable bytes as \\xNN) ", theme)),
        text_area,
    );
    frame.render_widget(
        Paragraph::new(hex.into_iter().map(Line::raw).collect::<Vec<_>>())
            .scroll((scroll, 0))
            .block(panel(" hex ", theme)),
        hex_area,
    );
}
