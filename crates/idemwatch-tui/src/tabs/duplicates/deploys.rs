//! The Deploys panel: each deploy's (or restart's) window with its duplicates per
//! consumer against the budget, newest first — the deploy-day question "did this
//! deploy cost more duplicates than deploys usually do?" answered under the chart
//! that shows the spike.
//!
//! ```text
//! ┌ Deploys: duplicates per window against the budget (2, newest first) ─────────────────┐
//! │deploy / consumer             dups deliveries   dup %  budget peak 1m  settled  verdict │
//! │ D  07:51:06 demo deploy #2     11        447   2.46% open 46s                OVER so far│
//! │    demo-engine/trip-counter     1         25   4.00%  0.400%   3.70%        —  OVER so far│
//! │ D  07:49:06 demo deploy #1     13       1142   1.14% 2m 00s → next           OVER     │
//! │    demo-engine/vehicle-state    9        968  0.930%  0.400%   2.30%   1m 09s  OVER     │
//! └───────────────────────────────────────────────────────────────────────────────────────┘
//! ```
//! Short of room, each deploy keeps its own row and only its consumers over budget
//! (worst first), and the last row counts what was left out.
//! The figures are `snapshot --json`'s `deploys` (`idemwatch_monitor::deploys`);
//! an open window's verdict is provisional ("so far"): its first minute is all
//! spike.

use ratatui::layout::Rect;
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use crate::app::App;
use crate::format;
use crate::theme::Theme;
use crate::widgets::panel;
use idemwatch_monitor::deploys::{DeployBudget, Verdict, WindowEnd};
use idemwatch_monitor::markers::glyph;

/// Lines the panel would fill: a header, then per deploy its line and one per
/// consumer (what a panel of `rows` lines shows first: the newest deploys).
pub(super) fn lines_wanted(app: &App) -> usize {
    app.snapshot.as_ref().map_or(0, |s| {
        1 + s
            .deploys
            .iter()
            .map(|d| 1 + consumers(app, d).count())
            .sum::<usize>()
    })
}

/// The deploy's consumers the filter keeps.
fn consumers<'a>(
    app: &'a App,
    d: &'a DeployBudget,
) -> impl Iterator<Item = &'a idemwatch_monitor::deploys::ConsumerBudget> + 'a {
    d.consumers
        .iter()
        .filter(move |c| app.matches(&format!("{}/{}", c.target, c.consumer)))
}

fn verdict_span(verdict: Verdict, open: bool, theme: &Theme) -> Span<'static> {
    let style = match verdict {
        Verdict::Over => theme.crit,
        Verdict::Within => theme.ok,
        Verdict::NoTraffic => theme.dim,
    };
    let text = if open && verdict != Verdict::NoTraffic {
        format!("{} so far", verdict.label())
    } else {
        verdict.label().to_string()
    };
    Span::styled(text, style)
}

/// The window, in the blank columns of a deploy's row: "open 45s" (so far),
/// "2m 00s → next" (ended by the next marker), "10m 00s settle" (by the settle
/// time).
fn window_text(d: &DeployBudget) -> String {
    let span = format::duration(d.window_seconds);
    match d.ends {
        WindowEnd::Open => format!("open {span}"),
        WindowEnd::NextMarker => format!("{span} → next"),
        WindowEnd::SettleTime => format!("{span} settle"),
    }
}

fn count(v: f64) -> String {
    format!("{v:.0}")
}

/// The numeric columns (header, width); a compact screen keeps dups, dup %,
/// budget and settled.
const COLUMNS: [(&str, usize, bool); 6] = [
    ("dups", 5, true),
    ("deliveries", 10, false),
    ("dup %", 7, true),
    ("budget", 7, true),
    ("peak 1m", 7, false),
    ("settled", 8, true),
];

/// A row's name cell and its numeric cells, aligned under the header.
fn cells(name: &str, name_width: usize, values: [String; 6], compact: bool) -> String {
    let mut out = format!("{:<name_width$}", format::fit(name, name_width));
    for ((_, width, in_compact), value) in COLUMNS.iter().zip(values) {
        if compact && !in_compact {
            continue;
        }
        out.push_str(&format!(" {value:>width$}"));
    }
    out.push_str("  ");
    out
}

pub(super) fn deploys_panel(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let Some(snap) = &app.snapshot else {
        return;
    };
    let compact = app.compact();
    let rows = usize::from(area.height.saturating_sub(2));
    let numbers: usize = COLUMNS
        .iter()
        .filter(|c| !compact || c.2)
        .map(|c| c.1 + 1)
        .sum();
    // As wide as the longest name shown, within what is left beside the numbers
    // and a verdict ("within so far").
    let room = usize::from(area.width.saturating_sub(2))
        .saturating_sub(numbers + 16)
        .clamp(16, 40);
    let longest = snap
        .deploys
        .iter()
        .flat_map(|d| {
            consumers(app, d)
                .map(|c| c.target.chars().count() + c.consumer.chars().count() + 1)
                .chain([9 + d.label.chars().count()])
        })
        .max()
        .unwrap_or(0);
    let name_width = (longest + 4).max(16).min(room);
    let header = COLUMNS.map(|c| c.0.to_string());
    let mut lines: Vec<Line> = vec![Line::styled(
        format!(
            "{}verdict",
            cells("deploy / consumer", name_width, header, compact)
        ),
        theme.dim.add_modifier(Modifier::BOLD),
    )];
    // Short of room (the chart keeps its 16 rows; a 45-row screen leaves this panel
    // a few), every deploy keeps its own row and only its consumers over budget,
    // worst first, and the last row says what is left out: before, the panel showed
    // the newest deploy's first consumer and cut the rest without a word.
    let short = lines_wanted(app) > rows && rows > 2;
    let mut hidden = 0usize;
    for d in &snap.deploys {
        let open = d.ends == WindowEnd::Open;
        let head = format!("{} {}", format::clock(d.at), d.label);
        let blank = String::new;
        // The window where the deploy row has no budget, peak or settle time.
        let tail: usize = COLUMNS[3..]
            .iter()
            .filter(|c| !compact || c.2)
            .map(|c| c.1 + 1)
            .sum();
        let mut row = cells(
            &head,
            name_width.saturating_sub(4),
            [
                count(d.duplicates),
                count(d.processed + d.duplicates),
                format::pct(d.ratio),
                blank(),
                blank(),
                blank(),
            ],
            compact,
        );
        // The tail and the two spaces before the verdict are ASCII blanks.
        row.truncate(row.len().saturating_sub(tail + 2));
        row.push_str(&format!(
            " {:<w$}  ",
            window_text(d),
            w = tail.saturating_sub(1)
        ));
        lines.push(Line::from(vec![
            Span::styled(
                format!(" {} ", glyph(&d.kind)),
                theme.marker(&d.kind).add_modifier(Modifier::REVERSED),
            ),
            Span::styled(
                format!(" {row}"),
                Style::default().add_modifier(Modifier::BOLD),
            ),
            verdict_span(d.verdict, open, theme),
        ]));
        let mut shown: Vec<_> = consumers(app, d).collect();
        if short {
            let all = shown.len();
            shown.retain(|c| c.verdict == Verdict::Over);
            shown.sort_by(|a, b| {
                b.ratio
                    .partial_cmp(&a.ratio)
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
            hidden += all - shown.len();
        }
        for c in shown {
            let name = format!("{}/{}", c.target, c.consumer);
            lines.push(Line::from(vec![
                Span::raw(format!(
                    "    {}",
                    cells(
                        &name,
                        name_width.saturating_sub(4),
                        [
                            count(c.duplicates),
                            count(c.processed + c.duplicates),
                            format::pct(c.ratio),
                            format::pct(Some(c.budget)),
                            format::pct(c.peak_ratio),
                            c.settle_seconds
                                .map_or_else(|| "—".to_string(), format::duration),
                        ],
                        compact,
                    )
                )),
                verdict_span(c.verdict, open, theme),
            ]));
        }
    }
    if short && (lines.len() > rows || hidden > 0) {
        let room = rows - 1;
        hidden += lines.len().saturating_sub(room);
        lines.truncate(room);
        lines.push(Line::styled(
            format!(
                "… {hidden} more (within budget, or older): / filters, snapshot --json has all"
            ),
            theme.dim,
        ));
    }
    if snap.deploys.is_empty() {
        lines.push(Line::styled(
            "no deploy or restart marker yet (`idemwatch mark deploy`, or D in the demo)",
            theme.dim,
        ));
    }
    let shown = snap.deploys.len();
    let title =
        format!(" Deploys: duplicates per window against the budget ({shown}, newest first) ");
    frame.render_widget(Paragraph::new(lines).block(panel(title, theme)), area);
}
