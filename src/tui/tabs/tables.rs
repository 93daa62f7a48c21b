//! Tables: the dedup table's health (size, inserts, oldest row against retention),
//! claims in doubt, dead letters by reason, recent markers.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Paragraph, Row, Table};
use ratatui::Frame;

use crate::monitor::db::{CountMethod, SourceStatus};
use crate::tui::app::App;
use crate::tui::format;
use crate::tui::theme::Theme;
use crate::tui::widgets::panel;

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let Some(snap) = &app.snapshot else {
        return crate::tui::widgets::waiting(frame, area, "the tables", theme);
    };
    let Some(db) = &snap.database else {
        frame.render_widget(
            Paragraph::new("no database configured: add [database] to the config")
                .block(panel(" Tables ", theme)),
            area,
        );
        return;
    };
    let [top, middle, bottom] = Layout::vertical([
        Constraint::Length(8),
        Constraint::Min(5),
        Constraint::Length(9),
    ])
    .areas(area);
    let [dedup_area, inserts_area] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(top);
    let [doubt_area, dead_area] =
        Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)]).areas(middle);

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
        dedup_area,
    );

    let inserts = db
        .dedup
        .as_ref()
        .map(|d| d.inserts.clone())
        .unwrap_or_default();
    let rows = inserts
        .iter()
        .filter(|i| app.matches(&i.consumer))
        .map(|i| {
            Row::new([
                Cell::from(i.consumer.clone()),
                Cell::from(i.last_minute.to_string()),
            ])
        });
    frame.render_widget(
        Table::new(rows, [Constraint::Length(18), Constraint::Min(8)])
            .header(Row::new(["consumer", "dedup rows / last minute"]).style(theme.title))
            .block(panel(" Inserts ", theme)),
        inserts_area,
    );

    let rows = db
        .claims_in_doubt
        .iter()
        .filter(|c| app.matches(&format!("{} {}", c.consumer, c.message_key)))
        .skip(usize::from(app.tables_scroll))
        .map(|c| {
            Row::new([
                Cell::from(c.consumer.clone()),
                Cell::from(c.message_key.clone()),
                Cell::from(format::duration(c.age_seconds)).style(theme.crit),
                Cell::from(c.attempts.to_string()),
            ])
        });
    frame.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(14),
                Constraint::Min(20),
                Constraint::Length(9),
                Constraint::Length(8),
            ],
        )
        .header(Row::new(["consumer", "message key", "age", "attempts"]).style(theme.title))
        .block(panel(
            format!(
                " Side effects in doubt: {} (sent or not? a retry reuses the provider key) ",
                db.claims_in_doubt_total
            ),
            theme,
        )),
        doubt_area,
    );

    let rows = db
        .dead_letters
        .iter()
        .filter(|d| app.matches(&format!("{} {}", d.consumer, d.reason)))
        .map(|d| {
            Row::new([
                Cell::from(d.consumer.clone()),
                Cell::from(d.reason.clone()),
                Cell::from(d.total.to_string()),
                Cell::from(d.last_hour.to_string()),
            ])
        });
    frame.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(14),
                Constraint::Length(19),
                Constraint::Length(7),
                Constraint::Min(6),
            ],
        )
        .header(Row::new(["consumer", "reason", "total", "last h"]).style(theme.title))
        .block(panel(" Dead letters (raw bytes kept) ", theme)),
        dead_area,
    );

    let rows = snap
        .markers
        .iter()
        .filter(|m| app.matches(&m.label))
        .take(7)
        .map(|m| {
            Row::new([
                Cell::from(format::clock(m.at)),
                Cell::from(m.kind.clone()).style(theme.marker(&m.kind)),
                Cell::from(m.label.clone()),
            ])
        });
    frame.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(9),
                Constraint::Length(8),
                Constraint::Min(20),
            ],
        )
        .header(Row::new(["at", "kind", "label"]).style(theme.title))
        .block(panel(" Markers ", theme)),
        bottom,
    );
}
