//! The frame: header with tabs, the demo banner, the current tab, the status and
//! filter line, the hint bar, and the help overlay. Pure: reads `&App`, draws.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Modifier;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph, Wrap};
use ratatui::Frame;

use super::app::App;
use super::format;
use super::keymap;
use super::tab::{tab_spans, Tab, HEADER_PREFIX};
use super::tabs;
use super::theme::Theme;
use super::widgets::centered;

pub fn render(frame: &mut Frame, app: &App, theme: &Theme) {
    let area = frame.area();
    let banner_rows = u16::from(app.banner.is_some());
    let [header, banner, body, status, hints] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(banner_rows),
        Constraint::Min(3),
        Constraint::Length(1),
        Constraint::Length(1),
    ])
    .areas(area);
    render_header(frame, header, app, theme);
    if let Some(text) = &app.banner {
        frame.render_widget(Paragraph::new(text.as_str()).style(theme.banner), banner);
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
    if app.show_help {
        render_help(frame, area, app, theme);
    }
}

fn render_header(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let spans = tab_spans();
    let mut line = vec![Span::styled(HEADER_PREFIX, theme.title)];
    for (i, tab) in Tab::ALL.iter().enumerate() {
        let label = format!(" {} {} ", i + 1, tab.title());
        let style = if *tab == app.tab {
            theme.selected.add_modifier(Modifier::BOLD)
        } else {
            theme.base
        };
        line.push(Span::styled(label, style));
        if i + 1 < spans.len() {
            line.push(Span::styled("│", theme.dim));
        }
    }
    let live = match (&app.snapshot, app.frozen) {
        (_, true) => Span::styled(
            format!(" ❚❚ FROZEN (+{} polls) ", app.missed_while_frozen),
            theme.warn.add_modifier(Modifier::REVERSED),
        ),
        (Some(s), false) => {
            Span::styled(format!(" ● {} UTC ", format::clock(s.taken_at)), theme.ok)
        }
        (None, false) => Span::styled(" ○ waiting for the first poll… ", theme.dim),
    };
    line.push(Span::raw("  "));
    line.push(live);
    frame.render_widget(Paragraph::new(Line::from(line)), area);
}

fn render_status(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let line = if app.filter_editing {
        Line::from(vec![
            Span::styled("filter: ", theme.key),
            Span::raw(app.filter.clone()),
            Span::styled("▏", theme.key),
            Span::styled("  (Enter keeps it, Esc clears it)", theme.dim),
        ])
    } else {
        let mut spans = Vec::new();
        if !app.filter.is_empty() {
            spans.push(Span::styled(
                format!("filter \"{}\"  ", app.filter),
                theme.key,
            ));
        }
        if let Some(s) = &app.status {
            spans.push(Span::styled(s.clone(), theme.dim));
        }
        Line::from(spans)
    };
    frame.render_widget(Paragraph::new(line), area);
}

fn render_hints(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let mut spans = Vec::new();
    for (keys, what) in keymap::hints(app) {
        spans.push(Span::styled(format!(" {keys}"), theme.key));
        spans.push(Span::styled(format!(" {what} "), theme.dim));
    }
    frame.render_widget(Paragraph::new(Line::from(spans)), area);
}

fn render_help(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
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
    let popup = centered(area, 64, lines.len() as u16 + 2);
    frame.render_widget(Clear, popup);
    frame.render_widget(
        Paragraph::new(lines).wrap(Wrap { trim: false }).block(
            Block::default()
                .borders(Borders::ALL)
                .title(" keys — ? or Esc closes "),
        ),
        popup,
    );
}
