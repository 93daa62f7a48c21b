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

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Paragraph, Row, Table, Wrap};
use ratatui::Frame;

use crate::drills::Verdict;
use crate::engine::consumers::{self, RiskClass};
use crate::tui::app::App;
use crate::tui::theme::Theme;
use crate::tui::widgets::panel;

fn mechanism(risk: RiskClass) -> &'static str {
    match risk {
        RiskClass::Natural => "seq-guarded upsert + insert-once history",
        RiskClass::Accumulation => "dedup row + business row in one transaction",
        RiskClass::ExternalSideEffect => "two-phase claim + provider Idempotency-Key",
    }
}

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let [table_area, note_area] =
        Layout::vertical([Constraint::Length(8), Constraint::Min(3)]).areas(area);
    let rows = consumers::FLEET_CONSUMERS
        .iter()
        .filter(|c| app.matches(c))
        .map(|name| {
            let risk = consumers::risk_class(name).unwrap_or(RiskClass::Accumulation);
            let check = app
                .inventory
                .as_ref()
                .and_then(|all| all.iter().find(|c| c.consumer == *name));
            let (verdict, detail) = match (check, &app.inventory) {
                (Some(c), _) if c.verdict == Verdict::Pass => {
                    (Cell::from("same result").style(theme.ok), c.detail.clone())
                }
                (Some(c), _) => (Cell::from("DIFFERS").style(theme.crit), c.detail.clone()),
                (None, None) => (Cell::from("checking…").style(theme.dim), String::new()),
                (None, Some(_)) => (Cell::from("not run").style(theme.warn), String::new()),
            };
            Row::new([
                Cell::from(name.to_string()),
                Cell::from(risk.as_str()),
                Cell::from(check.map(|c| c.mode.as_str()).unwrap_or("idempotent")),
                Cell::from(mechanism(risk)),
                verdict,
                Cell::from(detail),
            ])
        });
    frame.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(14),
                Constraint::Length(21),
                Constraint::Length(11),
                Constraint::Length(44),
                Constraint::Length(12),
                Constraint::Min(10),
            ],
        )
        .header(
            Row::new([
                "consumer",
                "risk class",
                "mode",
                "mechanism",
                "twice?",
                "detail",
            ])
            .style(theme.title),
        )
        .block(panel(
            " Consumer inventory — \"what if this handler runs twice?\" ",
            theme,
        )),
        table_area,
    );
    frame.render_widget(
        Paragraph::new(vec![
            Line::raw("The twice check delivers a fleet trace once, then every message twice in a row, on a scratch SQLite database with its own sandbox provider, and compares rows, SMS, webhooks and counters."),
            Line::styled("Review rule for every new consumer: if the answer is not \"the same result\", the design goes back.", theme.dim),
        ])
        .wrap(Wrap { trim: true })
        .block(panel(" How ", theme)),
        note_area,
    );
}
