//! Drills: pick a scenario and a mode, confirm, watch it run, read the verdict with
//! its counts; the history of runs comes from `drill_runs`.
//!
//! ```text
//! ┌ Redelivery drills ─────┐┌ Verdict (PgUp/PgDn scroll) ──────────────┐
//! │ mode: idempotent       ││ PASS crash-before-ack … every check      │
//! │ ▶ crash-before-ack     ││  ok  SMS actually sent: expected 1, got 1 │
//! ├ History (drill_runs) ──┴──────────────────────────────────────────┤
//! └────────────────────────────────────────────────────────────────────┘
//! ```
//! Under 100 columns the scenario list narrows to its names.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Modifier;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Cell, Clear, Paragraph, Row, Table, TableState, Wrap};
use ratatui::Frame;

use crate::app::{App, RunningDrill};
use crate::format;
use crate::lists::{self, ListId};
use crate::theme::Theme;
use crate::widgets::{centered, focus_title, panel};
use idemwatch_drills::{DrillReport, Scenario, Verdict};

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let history_rows = if app.compact() { 6 } else { 8 };
    let [top, history_area] =
        Layout::vertical([Constraint::Min(8), Constraint::Length(history_rows)]).areas(area);
    let list_width = if app.compact() { 28 } else { 46 };
    let [list_area, result_area] =
        Layout::horizontal([Constraint::Length(list_width), Constraint::Min(30)]).areas(top);
    scenarios_panel(frame, list_area, app, theme);
    verdict_panel(frame, result_area, app, theme);
    history_panel(frame, history_area, app, theme);
    if app.drills.confirming {
        confirm_popup(frame, area, app, theme);
    }
}

fn scenarios_panel(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let selected = app.scenario();
    let mut lines = vec![
        Line::from(vec![
            Span::raw("mode: "),
            Span::styled(app.drills.mode.as_str(), theme.key),
            Span::styled("  (n switches)", theme.dim),
        ]),
        Line::raw(""),
    ];
    for (_, s) in lists::scenarios(app).rows {
        let style = if *s == selected {
            theme.selected
        } else {
            theme.base
        };
        lines.push(Line::styled(format!(" {} ", s.as_str()), style));
        if *s == selected && !app.compact() {
            lines.push(Line::styled(format!("   {}", s.describe()), theme.dim));
        }
    }
    let focused = app.focused() == Some(ListId::Scenarios);
    frame.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .block(panel(
                focus_title(" Redelivery drills (Enter runs) ".to_string(), focused),
                theme,
            )),
        area,
    );
}

/// The running drill's progress, or the last verdict with every check (scrolls):
///
/// ```text
/// ┌ Verdict (14 lines; PgUp/PgDn scroll) ──────────────────────────┐
/// │  PASS   crash-before-ack (idempotent) run #12 in 840 ms        │
/// │ deliveries 2  sms_sent 1  webhooks 0  duplicate_dropped 1 …    │
/// │ lost 0  duplicated 0  recovered 1  ok 100.0 %  provider repe…  │
/// │  ok   SMS actually sent: expected 1, got 1                     │
/// │  FAIL …                                                        │
/// └────────────────────────────────────────────────────────────────┘
/// ```
fn verdict_panel(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let result: Vec<Line> = match (&app.drills.running, &app.drills.last) {
        (Some(r), _) => progress_lines(r, app, theme),
        (None, None) => no_drill_lines(theme),
        (None, Some(Err(e))) => vec![Line::styled(
            format!("the drill could not run: {e}"),
            theme.crit,
        )],
        (None, Some(Ok(r))) => verdict_lines(r, theme),
    };
    let total = result.len();
    let title = if total > usize::from(area.height.saturating_sub(2)) {
        format!(" Verdict ({total} lines; PgUp/PgDn scroll) ")
    } else {
        " Verdict ".to_string()
    };
    frame.render_widget(
        Paragraph::new(result)
            .wrap(Wrap { trim: false })
            .scroll((app.drills.verdict_scroll, 0))
            .block(panel(title, theme)),
        area,
    );
}

/// A drill under way: what runs for how long, and its last twelve progress lines.
fn progress_lines(r: &RunningDrill, app: &App, theme: &Theme) -> Vec<Line<'static>> {
    let mut l = vec![Line::styled(
        format!(
            "running {} ({}) for {}…",
            r.scenario,
            r.mode.as_str(),
            format::duration((app.now - r.started).num_seconds())
        ),
        theme.warn,
    )];
    l.extend(
        r.progress
            .iter()
            .rev()
            .take(12)
            .rev()
            .map(|p| Line::raw(format!("  {p}"))),
    );
    l
}

/// Before the session's first drill: what a drill touches and what it never does.
fn no_drill_lines(theme: &Theme) -> Vec<Line<'static>> {
    vec![
        Line::styled("no drill run in this session yet", theme.dim),
        Line::raw(""),
        // One line, wrapped to the panel's width by the paragraph.
        Line::raw(
            "A drill runs against the watched database and queue in its own corner \
             (its own queue namespace and device id): live rows are never touched. \
             Except live-redelivery: it re-publishes to the watched system itself, \
             only with [drills] allow_live (or in the demo) and after a confirmation.",
        ),
    ]
}

/// A finished drill: the verdict, the counts, its effects in Jepsen's terms, then each
/// check, expected against got.
fn verdict_lines(r: &DrillReport, theme: &Theme) -> Vec<Line<'static>> {
    let style = if r.verdict == Verdict::Pass {
        theme.ok
    } else {
        theme.crit
    };
    let mut l = vec![
        Line::from(vec![
            Span::styled(format!(" {} ", r.verdict.as_str().to_uppercase()), style.add_modifier(Modifier::REVERSED)),
            Span::raw(format!("  {} ({}) run #{} in {} ms", r.scenario, r.mode.as_str(), r.run_id, r.duration_ms)),
        ]),
        Line::raw(format!(
            "deliveries {}  sms_sent {}  webhooks {}  duplicate_dropped {}  counter_delta {}  dead_lettered {}  state_ok {}",
            r.deliveries, r.sms_sent, r.webhooks_sent, r.duplicate_dropped, r.counter_delta, r.dead_lettered, r.state_ok
        )),
        Line::raw(r.effects.render()),
    ];
    if let Some(checks) = r.details.get("checks").and_then(|c| c.as_array()) {
        for c in checks {
            let ok = c.get("ok").and_then(|v| v.as_bool()).unwrap_or(false);
            l.push(Line::from(vec![
                Span::styled(
                    if ok { " ok   " } else { " FAIL " },
                    if ok { theme.ok } else { theme.crit },
                ),
                Span::raw(format!(
                    "{}: expected {}, got {}",
                    c.get("name").and_then(|v| v.as_str()).unwrap_or("?"),
                    c.get("expected").cloned().unwrap_or_default(),
                    c.get("actual").cloned().unwrap_or_default()
                )),
            ]));
        }
    }
    if r.mode == idemwatch_engine::consumers::ConsumerMode::Naive && r.verdict == Verdict::Fail {
        l.push(Line::styled(
            "naive mode: this failure is the harm the pattern prevents",
            theme.dim,
        ));
    }
    l
}

fn history_panel(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let arranged = lists::drill_runs(app);
    let rows = arranged.rows.iter().map(|(_, r)| {
        let verdict = r.verdict.clone().unwrap_or_else(|| "running".into());
        let style = match verdict.as_str() {
            "pass" => theme.ok,
            "fail" if r.mode == "naive" => theme.warn,
            "fail" | "error" => theme.crit,
            _ => theme.dim,
        };
        Row::new([
            Cell::from(format!("#{}", r.id)),
            Cell::from(r.scenario.clone()),
            Cell::from(r.mode.clone()),
            Cell::from(verdict).style(style),
            Cell::from(format::ago(r.started_at, app.now)),
        ])
    });
    let focused = app.focused() == Some(ListId::DrillRuns);
    let mut state =
        TableState::default().with_selected(arranged.selected(app.list(ListId::DrillRuns)));
    frame.render_stateful_widget(
        Table::new(
            rows,
            [
                Constraint::Length(6),
                Constraint::Length(22),
                Constraint::Length(11),
                Constraint::Length(8),
                Constraint::Min(8),
            ],
        )
        .header(Row::new(["run", "scenario", "mode", "verdict", "started"]).style(theme.title))
        .row_highlight_style(theme.selected)
        .block(panel(
            focus_title(
                format!(" History (drill_runs: {}) ", arranged.count_label()),
                focused,
            ),
            theme,
        )),
        area,
        &mut state,
    );
}

fn confirm_popup(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let live = app.scenario() == Scenario::LiveRedelivery;
    let popup = centered(area, 62, if live { 10 } else { 7 });
    frame.render_widget(Clear, popup);
    let mut text = if live {
        vec![
            Line::styled(
                "LIVE drill: this touches the watched system.",
                theme.crit.add_modifier(Modifier::BOLD),
            ),
            Line::raw(format!(
                "Re-publish {} already-processed messages to its own queues \
                 and watch its /metrics: duplicate_dropped must rise by \
                 exactly that, and no counter, state or SMS may move.",
                Scenario::LiveRedelivery.default_times()
            )),
        ]
    } else {
        vec![
            Line::raw(format!(
                "Run {} in {} mode?",
                app.scenario(),
                app.drills.mode.as_str()
            )),
            Line::styled(
                "It writes a drill_runs row and a drill marker, in its own namespace.",
                theme.dim,
            ),
        ]
    };
    text.extend([
        Line::raw(""),
        Line::from(vec![
            Span::styled(" y ", theme.key),
            Span::raw(if live { "run it live   " } else { "run   " }),
            Span::styled(" Esc ", theme.key),
            Span::raw("cancel"),
        ]),
    ]);
    frame.render_widget(
        Paragraph::new(text).wrap(Wrap { trim: false }).block(panel(
            if live {
                " Confirm LIVE drill "
            } else {
                " Confirm drill "
            },
            theme,
        )),
        popup,
    );
}
