//! Overview: every consumer at a glance, the alerts, and the state of each source.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Cell, Paragraph, Row, Table, Wrap};
use ratatui::Frame;

use crate::engine::store::Durability;
use crate::monitor::alerts::Severity;
use crate::monitor::db::SourceStatus;
use crate::tui::app::App;
use crate::tui::format;
use crate::tui::theme::Theme;
use crate::tui::widgets::panel;

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let Some(snap) = &app.snapshot else {
        return crate::tui::widgets::waiting(frame, area, "the consumers", theme);
    };
    let consumers = snap
        .consumers
        .iter()
        .filter(|c| app.matches(&format!("{} {}", c.target, c.consumer)))
        .count();
    let [table_area, bottom] =
        Layout::vertical([Constraint::Length(consumers as u16 + 3), Constraint::Min(4)])
            .areas(area);
    let [alerts_area, sources_area] =
        Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)]).areas(bottom);

    let header = Row::new([
        "target",
        "consumer",
        "up",
        "msgs/s",
        "dup/s",
        "dup %",
        "redeliv/s",
        "late/s",
        "dead",
        "sent/suppr/fail",
        "in doubt",
        "last restart",
    ])
    .style(theme.title);
    let rows = snap
        .consumers
        .iter()
        .filter(|c| app.matches(&format!("{} {}", c.target, c.consumer)))
        .map(|c| {
            let effect = |k: &str| {
                c.side_effects
                    .get(k)
                    .map(|r| format::count(r.total))
                    .unwrap_or_else(|| "0".into())
            };
            let dup_style = match c.duplicate_ratio {
                Some(r) if r >= crate::monitor::alerts::DUPLICATE_RATIO_ALERT => theme.crit,
                Some(r) if r > 0.0 => theme.warn,
                _ => theme.base,
            };
            Row::new([
                Cell::from(c.target.clone()),
                Cell::from(c.consumer.clone()),
                if c.up {
                    Cell::from("up").style(theme.ok)
                } else {
                    Cell::from("DOWN").style(theme.crit)
                },
                Cell::from(format::rate(c.processed.per_second)),
                Cell::from(format::rate(c.duplicate_dropped.per_second)),
                Cell::from(format::pct(c.duplicate_ratio)).style(dup_style),
                Cell::from(format::rate(c.redelivered.per_second)),
                Cell::from(format::rate(c.out_of_order.per_second)),
                Cell::from(format::count(c.dead_lettered.total)),
                Cell::from(format!(
                    "{}/{}/{}",
                    effect("sent"),
                    effect("suppressed"),
                    effect("failed")
                )),
                match c.claims_in_doubt {
                    Some(n) if n > 0.0 => Cell::from(format::count(n)).style(theme.crit),
                    Some(n) => Cell::from(format::count(n)),
                    None => Cell::from("—"),
                },
                Cell::from(format::ago(c.last_restart, app.now)),
            ])
        });
    let widths = [
        Constraint::Length(12),
        Constraint::Length(14),
        Constraint::Length(4),
        Constraint::Length(7),
        Constraint::Length(6),
        Constraint::Length(7),
        Constraint::Length(9),
        Constraint::Length(6),
        Constraint::Length(5),
        Constraint::Length(15),
        Constraint::Length(8),
        Constraint::Min(10),
    ];
    frame.render_widget(
        Table::new(rows, widths)
            .header(header)
            .block(panel(" Consumers ", theme)),
        table_area,
    );

    let alerts: Vec<Line> = if snap.alerts.is_empty() {
        vec![Line::styled(
            "no alerts: duplicates are being dropped, nothing in doubt",
            theme.ok,
        )]
    } else {
        snap.alerts
            .iter()
            .filter(|a| app.matches(&a.message))
            .map(|a| {
                let (tag, style) = match a.severity {
                    Severity::Critical => ("CRIT", theme.crit),
                    Severity::Warning => ("WARN", theme.warn),
                };
                Line::from(vec![
                    Span::styled(format!("{tag} "), style),
                    Span::raw(a.message.clone()),
                ])
            })
            .collect()
    };
    frame.render_widget(
        Paragraph::new(alerts)
            .wrap(Wrap { trim: true })
            .block(panel(format!(" Alerts ({}) ", snap.alerts.len()), theme)),
        alerts_area,
    );

    let mut lines = Vec::new();
    for t in &snap.targets {
        let (state, style) = match &t.status {
            SourceStatus::Up => ("up".to_string(), theme.ok),
            SourceStatus::Down { error } => (format!("DOWN: {error}"), theme.crit),
        };
        let mut row = vec![
            Span::styled(format!("{} ", t.name), theme.title),
            Span::styled(state, style),
        ];
        if t.durability == Some(Durability::Relaxed) {
            row.push(Span::raw("  "));
            row.push(Span::styled("relaxed durability", theme.warn));
        }
        lines.push(Line::from(row));
        lines.push(Line::styled(
            format!(
                "  {}  {} samples in {} ms",
                t.url,
                t.samples,
                t.scrape_ms
                    .map(|m| m.to_string())
                    .unwrap_or_else(|| "—".into())
            ),
            theme.dim,
        ));
        for (route, outcomes) in &t.http {
            let rate = |o: &str| format::rate(outcomes.get(o).and_then(|r| r.per_second));
            lines.push(Line::raw(format!(
                "  {route}: executed {}/s · replayed {}/s · conflict {}/s",
                rate("executed"),
                rate("replayed"),
                rate("conflict")
            )));
        }
    }
    match &snap.database {
        None => lines.push(Line::styled("database: not configured", theme.dim)),
        Some(db) => {
            let (state, style) = match &db.status {
                SourceStatus::Up => ("up".to_string(), theme.ok),
                SourceStatus::Down { error } => (format!("DOWN: {error}"), theme.crit),
            };
            lines.push(Line::from(vec![
                Span::styled("database ", theme.title),
                Span::styled(state, style),
            ]));
            lines.push(Line::styled(
                format!("  {}  polled in {} ms", db.url, db.duration_ms),
                theme.dim,
            ));
            if let Some(d) = &db.dedup {
                let rows = d
                    .total_rows
                    .map(|r| format!("{} rows ({:?})", r.rows, r.method).to_lowercase())
                    .unwrap_or_else(|| "—".into());
                lines.push(Line::raw(format!(
                    "  dedup table: {rows}, oldest {}",
                    d.oldest_age_seconds
                        .map(format::duration)
                        .unwrap_or_else(|| "—".into())
                )));
            }
            lines.push(Line::raw(format!(
                "  claims in doubt: {}",
                db.claims_in_doubt_total
            )));
        }
    }
    frame.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .block(panel(" Sources ", theme)),
        sources_area,
    );
}
