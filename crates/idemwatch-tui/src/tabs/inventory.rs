//! Inventory: each consumer with its risk class, its idempotency mechanism, and the
//! result of the "twice" check (the field report's review rule, run on a scratch
//! database).
//!
//! ```text
//! ┌ Consumer inventory — "what if this handler runs twice?" ──────────┐
//! │ consumer  risk class  mode  mechanism  twice?  detail             │
//! ├ How ──────────────────────────────────────────────────────────────┤
//! └───────────────────────────────────────────────────────────────────┘
//! ```
//! Cells wrap (a row grows) instead of being cut; under 100 columns the mode and
//! the detail go under the verdict, and the note gives way when the table needs
//! its rows.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Paragraph, Row, Table, Wrap};
use ratatui::Frame;

use crate::app::App;
use crate::format;
use crate::theme::Theme;
use crate::widgets::panel;
use idemwatch_drills::Verdict;
use idemwatch_engine::consumers::{self, RiskClass};

fn mechanism(risk: RiskClass) -> &'static str {
    match risk {
        RiskClass::Natural => "seq-guarded upsert + insert-once history",
        RiskClass::Accumulation => "dedup row + business row in one transaction",
        RiskClass::ExternalSideEffect => "two-phase claim + provider Idempotency-Key",
    }
}

/// The most lines a cell may take (the detail of a failed check is the longest).
const CELL_LINES: usize = 3;

/// Text wrapped to a column, as lines.
fn wrapped(text: &str, width: u16) -> Vec<Line<'static>> {
    format::wrap(text, usize::from(width), CELL_LINES)
        .into_iter()
        .map(Line::raw)
        .collect()
}

/// The header and column widths inside the panel. Wide: consumer, risk class, mode,
/// mechanism, twice?, detail (the rest). Under
/// [`COMPACT_WIDTH`](crate::tab::COMPACT_WIDTH): consumer, risk class,
/// mechanism, and the verdict followed by its detail (the rest); the risk
/// class and the mechanism wrap instead of being cut.
fn columns<'a>(inner: u16, compact: bool) -> (Vec<&'a str>, Vec<u16>) {
    let (header, fixed): (Vec<&str>, Vec<u16>) = if compact {
        (
            vec![
                "consumer",
                "risk class",
                "mechanism",
                "twice? · mode · detail",
            ],
            vec![13, 12, 24],
        )
    } else {
        (
            vec![
                "consumer",
                "risk class",
                "mode",
                "mechanism",
                "twice?",
                "detail",
            ],
            vec![14, 21, 11, 44, 12],
        )
    };
    let used: u16 = fixed.iter().sum::<u16>() + u16::try_from(fixed.len()).unwrap_or(0);
    let mut widths = fixed;
    widths.push(inner.saturating_sub(used).max(10));
    (header, widths)
}

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let compact = app.compact();
    let (mut header, w) = columns(area.width.saturating_sub(2), compact);
    let run_mode = app
        .inventory
        .as_ref()
        .and_then(|all| all.first())
        .map_or("idempotent", |c| c.mode.as_str());
    let compact_header = format!("twice? ({run_mode})");
    if compact {
        if let Some(last) = header.last_mut() {
            *last = &compact_header;
        }
    }
    let mut height = 3u16;
    let rows: Vec<Row> = consumers::FLEET_CONSUMERS
        .iter()
        .filter(|c| app.matches(c))
        .map(|name| {
            let (row, lines) = consumer_row(name, app, &w, theme);
            height += lines;
            row
        })
        .collect();
    // The table first: the note below it only where three lines of it fit.
    let [table_area, note_area] =
        Layout::vertical([Constraint::Length(height.max(8)), Constraint::Min(0)]).areas(area);
    frame.render_widget(
        Table::new(rows, w.into_iter().map(Constraint::Length))
            .header(Row::new(header).style(theme.title))
            .block(panel(
                " Consumer inventory — \"what if this handler runs twice?\" ",
                theme,
            )),
        table_area,
    );
    if note_area.height >= 3 {
        note_panel(frame, note_area, theme);
    }
}

/// One consumer's row, wrapped to the column widths `w`, and how many lines it
/// takes.
fn consumer_row(name: &str, app: &App, w: &[u16], theme: &Theme) -> (Row<'static>, u16) {
    let risk = consumers::risk_class(name).unwrap_or(RiskClass::Accumulation);
    let check = app
        .inventory
        .as_ref()
        .and_then(|all| all.iter().find(|c| c.consumer == name));
    let (verdict, style) = match (check, &app.inventory) {
        (Some(c), _) if c.verdict == Verdict::Pass => ("same result", theme.ok),
        (Some(_), _) => ("DIFFERS", theme.crit),
        (None, None) => ("checking…", theme.dim),
        (None, Some(_)) => ("not run", theme.warn),
    };
    let mode = check.map(|c| c.mode.as_str()).unwrap_or("idempotent");
    let detail = check.map(|c| c.detail.as_str()).unwrap_or("");
    let detail_width = w[w.len() - 1];
    let cells: Vec<Vec<Line<'static>>> = if app.compact() {
        // The verdict heads its detail (a passing detail starts with it); the
        // mode is the header's (one run checks every consumer in one mode).
        let text = if detail.starts_with(verdict) {
            detail.to_string()
        } else {
            format!("{verdict}: {detail}")
        };
        let mut last = wrapped(text.trim_end_matches([':', ' ']), detail_width);
        if let Some(first) = last.first_mut() {
            *first = first.clone().style(style);
        }
        vec![
            wrapped(name, w[0]),
            wrapped(risk.as_str(), w[1]),
            wrapped(mechanism(risk), w[2]),
            last,
        ]
    } else {
        vec![
            wrapped(name, w[0]),
            wrapped(risk.as_str(), w[1]),
            wrapped(mode, w[2]),
            wrapped(mechanism(risk), w[3]),
            vec![Line::styled(verdict, style)],
            wrapped(detail, detail_width),
        ]
    };
    let lines = cells.iter().map(Vec::len).max().unwrap_or(1);
    let lines = u16::try_from(lines).unwrap_or(1);
    (
        Row::new(cells.into_iter().map(Cell::from)).height(lines),
        lines,
    )
}

/// What the twice check does, and the review rule it stands for.
fn note_panel(frame: &mut Frame, area: Rect, theme: &Theme) {
    frame.render_widget(
        Paragraph::new(vec![
            Line::raw("The twice check delivers a fleet trace once, then every message twice in a row, on a scratch SQLite database with its own sandbox provider, and compares rows, SMS, webhooks and counters."),
            Line::styled("Review rule for every new consumer: if the answer is not \"the same result\", the design goes back.", theme.dim),
        ])
        .wrap(Wrap { trim: true })
        .block(panel(" How ", theme)),
        area,
    );
}
