//! The frame. Pure: reads `&App`, draws.
//!
//! ```text
//! ┌ header: tabs · live clock or FROZEN at HH:MM:SS · alert badge ┐
//! │ demo banner (whole parts, two rows, one under 30 rows)        │
//! │ the current tab                                               │
//! │ status / prompt line (what the filter hides)                  │
//! └ hint bar (as many hints as fit, then "? more")                ┘
//! ```

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Modifier;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Clear, Paragraph};
use ratatui::Frame;

use super::app::App;
use super::format;
use super::keymap;
use super::lists;
use super::tab::{header_prefix, header_title, Tab};
use super::tabs;
use super::theme::Theme;
use super::widgets::{centered, panel};

pub fn render(frame: &mut Frame, app: &App, theme: &Theme) {
    let area = frame.area();
    // Two banner rows where there is room, one in a short terminal.
    let banner = app.banner.as_deref().map_or_else(Vec::new, |b| {
        banner_lines(
            b,
            usize::from(area.width),
            if area.height < 30 { 1 } else { 2 },
        )
    });
    let [header, banner_area, body, status, hints] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(banner.len() as u16),
        Constraint::Min(3),
        Constraint::Length(1),
        Constraint::Length(1),
    ])
    .areas(area);
    render_header(frame, header, app, theme);
    if !banner.is_empty() {
        let lines: Vec<Line> = banner.into_iter().map(Line::from).collect();
        frame.render_widget(Paragraph::new(lines).style(theme.banner), banner_area);
    }
    match app.tab {
        Tab::Overview => tabs::overview::render(frame, body, app, theme),
        Tab::Duplicates => tabs::duplicates::render(frame, body, app, theme),
        Tab::Vehicles => tabs::vehicles::render(frame, body, app, theme),
        Tab::Drills => tabs::drills::render(frame, body, app, theme),
        Tab::Tables => tabs::tables::render(frame, body, app, theme),
        Tab::Inventory => tabs::inventory::render(frame, body, app, theme),
    }
    render_status(frame, status, app, theme);
    render_hints(frame, hints, app, theme);
    if let Some(scroll) = app.help {
        render_help(frame, body, app, scroll, theme);
    }
}

/// The banner's rows at `width`: its ` · `-separated parts kept whole (a part is
/// never broken across rows), and when they do not fit in `max_rows`, the parts that
/// name a path or URL dropped from the right (the Sources panel shows those) — what
/// the operator can do (`D`, `--config`) stays. A part wider than a row is cut "…".
fn banner_lines(text: &str, width: usize, max_rows: usize) -> Vec<String> {
    let sep = " · ";
    let mut parts: Vec<&str> = text
        .split(sep)
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    let pack = |parts: &[&str]| {
        let mut rows: Vec<String> = Vec::new();
        for part in parts {
            let part = format::fit(part, width);
            match rows.last_mut() {
                Some(row)
                    if row.chars().count() + sep.chars().count() + part.chars().count()
                        <= width =>
                {
                    row.push_str(sep);
                    row.push_str(&part);
                }
                _ => rows.push(part),
            }
        }
        rows
    };
    loop {
        let rows = pack(&parts);
        if rows.len() <= max_rows {
            return rows;
        }
        match parts.iter().rposition(|p| p.contains('/')) {
            Some(i) => {
                parts.remove(i);
            }
            None => return rows.into_iter().take(max_rows).collect(),
        }
    }
}

fn render_header(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let mut line = vec![Span::styled(header_prefix(area.width), theme.title)];
    for (i, tab) in Tab::ALL.iter().enumerate() {
        let style = if *tab == app.tab {
            theme.selected.add_modifier(Modifier::BOLD)
        } else {
            theme.base
        };
        line.push(Span::styled(
            header_title(i, *tab, area.width, app.tab),
            style,
        ));
        if i + 1 < Tab::ALL.len() {
            line.push(Span::styled("│", theme.dim));
        }
    }
    line.push(Span::raw(" "));
    line.push(match (&app.snapshot, app.frozen_at) {
        (_, Some(at)) => Span::styled(
            format!(
                " ❚❚ FROZEN at {} (+{} polls) ",
                format::clock(at),
                app.missed_while_frozen
            ),
            theme.warn.add_modifier(Modifier::REVERSED),
        ),
        (Some(s), None) => Span::styled(format!(" ● {} ", format::clock(s.taken_at)), theme.ok),
        (None, None) => Span::styled(" ○ waiting… ", theme.dim),
    });
    // The badge: incidents not acknowledged, on every tab.
    let (crit, warn) = app.alert_badge();
    if crit > 0 {
        line.push(Span::styled(
            format!(" ▲ {crit} CRIT "),
            theme.crit.add_modifier(Modifier::REVERSED),
        ));
    }
    if warn > 0 {
        line.push(Span::styled(
            format!(" △ {warn} WARN "),
            theme.warn.add_modifier(Modifier::REVERSED),
        ));
    }
    if crit + warn == 0 && app.snapshot.is_some() {
        line.push(Span::styled(" ✓ no alerts ", theme.ok));
    }
    frame.render_widget(Paragraph::new(Line::from(line)), area);
}

fn render_status(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let mut spans = Vec::new();
    if let Some(p) = &app.prompt {
        spans.push(Span::styled(format!("{}: ", p.kind.label()), theme.key));
        spans.push(Span::raw(p.text.clone()));
        spans.push(Span::styled("▏", theme.key));
        spans.push(Span::styled("  Enter keeps it, Esc cancels", theme.dim));
    }
    if !app.filter.is_empty() {
        let (shown, total) = lists::tab_counts(app);
        let hidden = total - shown;
        spans.push(Span::styled(
            format!(
                "  filter \"{}\": {shown} of {total} rows shown, {hidden} hidden  ",
                app.filter
            ),
            if shown == 0 { theme.warn } else { theme.key },
        ));
    }
    if app.prompt.is_none() {
        if let Some(s) = &app.status {
            spans.push(Span::styled(s.clone(), theme.dim));
        }
    }
    frame.render_widget(Paragraph::new(Line::from(spans)), area);
}

/// As many hints as fit, the current tab's first, then "? more".
fn render_hints(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let more = " ? more";
    let budget = usize::from(area.width).saturating_sub(more.len());
    let mut used = 0;
    let mut spans = Vec::new();
    let all = keymap::hints(app);
    let mut shown = 0;
    for (keys, what) in &all {
        let w = keys.chars().count() + what.chars().count() + 3;
        if used + w > budget {
            continue;
        }
        used += w;
        shown += 1;
        spans.push(Span::styled(format!(" {keys}"), theme.key));
        spans.push(Span::styled(format!(" {what} "), theme.dim));
    }
    if shown < all.len() && !spans.iter().any(|s| s.content.trim() == "?") {
        spans.push(Span::styled(more, theme.key));
    }
    frame.render_widget(Paragraph::new(Line::from(spans)), area);
}

fn render_help(frame: &mut Frame, area: Rect, app: &App, scroll: u16, theme: &Theme) {
    let mut lines = Vec::new();
    for (title, rows) in keymap::help_sections(app) {
        lines.push(Line::from(Span::styled(title, theme.title)));
        for (keys, help) in rows {
            lines.push(Line::from(vec![
                Span::styled(format!("  {keys:<8}"), theme.key),
                Span::raw(help),
            ]));
        }
        lines.push(Line::raw(""));
    }
    let total = lines.len() as u16;
    let popup = centered(area, 70, total + 2);
    let visible = popup.height.saturating_sub(2);
    let scroll = scroll.min(total.saturating_sub(visible));
    let title = if total > visible {
        format!(
            " keys {}-{} of {} — ↑↓ PgUp PgDn scroll, ? or Esc closes ",
            scroll + 1,
            (scroll + visible).min(total),
            total
        )
    } else {
        " keys — ? or Esc closes ".to_string()
    };
    frame.render_widget(Clear, popup);
    frame.render_widget(
        Paragraph::new(lines)
            .scroll((scroll, 0))
            .block(panel(title, theme)),
        popup,
    );
}

#[cfg(test)]
mod tests {
    use super::banner_lines;

    const DEMO: &str = " DEMO · embedded engine on SQLite in /home/op/.local/share/idemwatch/demo · metrics http://127.0.0.1:43099/metrics · SMS sandbox http://127.0.0.1:39807 · D deploys now · --config FILE watches your own system ";

    #[test]
    fn the_banner_keeps_its_parts_whole_and_what_the_operator_can_do() {
        // Wide: everything, no part broken across the two rows.
        let wide = banner_lines(DEMO, 160, 2);
        assert_eq!(wide.len(), 2, "{wide:?}");
        assert!(
            wide[0].ends_with("SMS sandbox http://127.0.0.1:39807"),
            "{wide:?}"
        );
        assert_eq!(
            wide[1],
            "D deploys now · --config FILE watches your own system"
        );
        assert!(wide.iter().all(|r| r.chars().count() <= 160));
        // 80×24: one row, the URLs and the path go, the keys stay.
        assert_eq!(
            banner_lines(DEMO, 80, 1),
            ["DEMO · D deploys now · --config FILE watches your own system"]
        );
        // 80 columns, two rows: the data directory comes back first.
        let two = banner_lines(DEMO, 80, 2);
        assert!(two.iter().all(|r| r.chars().count() <= 80), "{two:?}");
        assert!(two.concat().contains("D deploys now"), "{two:?}");
        assert!(two.concat().contains("/idemwatch/demo"), "{two:?}");
        // Narrower than a part: cut, never wider than the screen.
        let tiny = banner_lines(DEMO, 12, 1);
        assert!(tiny[0].chars().count() <= 12, "{tiny:?}");
    }
}
