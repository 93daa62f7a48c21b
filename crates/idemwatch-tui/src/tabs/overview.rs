//! Overview: every consumer at a glance, the alerts, and the state of each source.
//!
//! ```text
//! ┌ Consumers — over the last 1 min (w) · Σ since 04:01 ─────────────────────┐
//! │ consumer  state  msgs/s dup/s dup % redeliv late dead doubt Σproc Σdup … │
//! ├ Alerts (2) ─────────────────────────────┬ Sources ──────────────────────┤
//! │ CRIT 04:10:31 1m 32s  message → object  │ target up · url · samples     │
//! └─────────────────────────────────────────┴───────────────────────────────┘
//! ```
//! Under 100 columns the Σ columns go, the alerts take the whole width and the
//! sources shrink to one line each.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span, Text};
use ratatui::widgets::{Cell, Paragraph, Row, Wrap};
use ratatui::Frame;

use crate::app::{App, RateWindow};
use crate::format;
use crate::lists::{self, ListId};
use crate::theme::Theme;
use crate::widgets::{focus_title, list_table, panel, waiting, ListTable};
use idemwatch_engine::store::Durability;
use idemwatch_monitor::alerts::Alert;
use idemwatch_monitor::db::{DbStats, SourceStatus};
use idemwatch_monitor::history::{HistoryState, HistoryStatus};
use idemwatch_monitor::targets::{
    ConsumerStatus, Flow, IngressReading, TargetStatus, WindowCounts,
};

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let Some(snap) = &app.snapshot else {
        return waiting(frame, area, "the consumers", theme);
    };
    let shown = lists::consumers(app).rows.len() as u16;
    let [table_area, bottom] =
        Layout::vertical([Constraint::Length(shown + 3), Constraint::Min(4)]).areas(area);
    consumers_panel(frame, table_area, app, theme);
    if app.compact() {
        let sources = snap.targets.len() as u16 + u16::from(snap.database.is_some()) + 2;
        let [alerts_area, sources_area] =
            Layout::vertical([Constraint::Min(3), Constraint::Length(sources)]).areas(bottom);
        alerts_panel(frame, alerts_area, app, theme);
        sources_panel(frame, sources_area, app, theme);
    } else {
        let [alerts_area, sources_area] =
            Layout::horizontal([Constraint::Percentage(66), Constraint::Percentage(34)])
                .areas(bottom);
        alerts_panel(frame, alerts_area, app, theme);
        sources_panel(frame, sources_area, app, theme);
    }
}

/// The figures of the chosen window: (msgs/s, dup/s, dup %, redelivered, late,
/// dead) — counts over a minute or five, per-second rates for the last poll.
fn figures(c: &ConsumerStatus, window: RateWindow) -> [String; 6] {
    let counts = |w: &WindowCounts| {
        [
            format::rate(w.processed_per_second),
            format::rate(w.duplicate_dropped_per_second),
            format::pct(w.duplicate_ratio),
            format::count(w.redelivered),
            format::count(w.out_of_order),
            format::count(w.dead_lettered),
        ]
    };
    match window {
        RateWindow::OneMinute => counts(&c.window_1m),
        RateWindow::FiveMinutes => counts(&c.window_5m),
        RateWindow::LastPoll => [
            format::rate(c.processed.per_second),
            format::rate(c.duplicate_dropped.per_second),
            format::pct(c.duplicate_ratio),
            format::rate(c.redelivered.per_second),
            format::rate(c.out_of_order.per_second),
            format::rate(c.dead_lettered.per_second),
        ],
    }
}

fn flow_cell<'a>(c: &ConsumerStatus, app: &App, theme: &Theme) -> Cell<'a> {
    if let Some(p) = &c.paused {
        // Why and since when are in its alert; the cell says who is paused and how long.
        let since = p
            .since
            .map(|t| {
                let d = format::duration((app.now - t).num_seconds());
                // The largest unit only: the column is 11 wide.
                format!(" {}", d.split(' ').next().unwrap_or_default())
            })
            .unwrap_or_default();
        return Cell::from(format!("PAUSED{since}")).style(theme.crit);
    }
    if let Some(held) = c.waiting_seconds {
        // A batch held by a peer that has not answered (its alert says more).
        let d = format::duration(held);
        return Cell::from(format!(
            "WAITING {}",
            d.split(' ').next().unwrap_or_default()
        ))
        .style(theme.warn);
    }
    match c.flow {
        Flow::Flowing => Cell::from("flowing").style(theme.ok),
        Flow::NoDataYet => Cell::from("no data yet").style(theme.dim),
        Flow::Quiet { last_processed_at } => Cell::from(match last_processed_at {
            Some(t) => format!("quiet {}", format::duration((app.now - t).num_seconds())),
            None => "quiet".into(),
        })
        .style(theme.dim),
        Flow::Stalled { .. } => Cell::from("STALLED").style(theme.crit),
        Flow::Down => Cell::from("DOWN").style(theme.crit),
    }
}

/// Every consumer, one row each, in the chosen window's figures (`w`):
///
/// ```text
/// ┌ Consumers (4) — rates and counts over the last 1 min (w switches) · Σ = … ┐
/// │ [target] consumer state msgs/s dup/s dup % redeliv late dead doubt │ Σ … │
/// └──────────────── the Σ columns only at 100 columns and more ──────────────┘
/// ```
fn consumers_panel(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let arranged = lists::consumers(app);
    let columns = ConsumerColumns {
        // The target column only when there is more than one to tell apart.
        many_targets: app.snapshot.as_ref().is_some_and(|s| s.targets.len() > 1),
        compact: app.compact(),
        window: app.rate_window,
    };
    let table = ListTable {
        title: consumers_title(&arranged, app),
        header: Row::new(columns.header()),
        widths: columns.widths(),
        rows: arranged
            .rows
            .iter()
            .map(|(_, c)| columns.row(c, app, theme))
            .collect(),
        selected: arranged.selected(app.list(ListId::Consumers)),
    };
    list_table(
        frame,
        area,
        table,
        app.focused() == Some(ListId::Consumers),
        theme,
    );
}

/// Which columns the consumers' table has: a target column when there are several
/// targets, the Σ columns when there is room, "/s" on the counts of the last poll.
struct ConsumerColumns {
    many_targets: bool,
    compact: bool,
    window: RateWindow,
}

impl ConsumerColumns {
    /// "/s" after the count columns' names when they are per-second rates.
    fn per(&self) -> &'static str {
        if self.window == RateWindow::LastPoll {
            "/s"
        } else {
            ""
        }
    }

    fn header(&self) -> Vec<String> {
        let mut header = Vec::new();
        if self.many_targets {
            header.push("target".to_string());
        }
        header.extend(["consumer", "state", "msgs/s", "dup/s", "dup %"].map(String::from));
        header.extend(["redeliv", "late", "dead"].map(|h| format!("{h}{}", self.per())));
        header.push("doubt".into());
        if !self.compact {
            header.extend(
                [
                    "Σ processed",
                    "Σ dup",
                    "Σ dead",
                    "Σ sent/suppr/fail",
                    "restarted",
                ]
                .map(String::from),
            );
        }
        header
    }

    fn widths(&self) -> Vec<Constraint> {
        let compact = self.compact;
        let per = self.per().len() as u16;
        let mut widths = Vec::new();
        if self.many_targets {
            widths.push(Constraint::Length(if compact { 10 } else { 12 }));
        }
        widths.extend([
            Constraint::Length(14),
            Constraint::Length(if compact { 10 } else { 11 }),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(7),
            Constraint::Length(7 + per),
            Constraint::Length(5 + per),
            Constraint::Length(5 + per),
            Constraint::Length(5),
        ]);
        if !compact {
            widths.extend([
                Constraint::Length(11),
                Constraint::Length(6),
                Constraint::Length(6),
                Constraint::Length(17),
                Constraint::Min(9),
            ]);
        }
        widths
    }

    /// One consumer's row; its dup % coloured against the field report's baselines.
    fn row(&self, c: &ConsumerStatus, app: &App, theme: &Theme) -> Row<'static> {
        let [msgs, dups, pct, redeliv, late, dead] = figures(c, self.window);
        let dup_style = match self.window.duplicate_ratio(c) {
            Some(r) if r >= idemwatch_monitor::alerts::DUPLICATE_RATIO_ALERT => theme.crit,
            Some(r) if r > idemwatch_monitor::alerts::DEPLOY_DAY_RATIO => theme.warn,
            _ => theme.base,
        };
        let mut cells = Vec::new();
        if self.many_targets {
            cells.push(Cell::from(c.target.clone()));
        }
        cells.push(Cell::from(c.consumer.clone()));
        cells.push(flow_cell(c, app, theme));
        cells.push(Cell::from(msgs));
        cells.push(Cell::from(dups));
        cells.push(Cell::from(pct).style(dup_style));
        cells.push(Cell::from(redeliv));
        cells.push(Cell::from(late));
        cells.push(Cell::from(dead));
        cells.push(match c.claims_in_doubt {
            Some(n) if n > 0.0 => Cell::from(format::count(n)).style(theme.crit),
            Some(n) => Cell::from(format::count(n)),
            None => Cell::from("—"),
        });
        if !self.compact {
            cells.extend(totals_cells(c, app));
        }
        Row::new(cells)
    }
}

/// The Σ columns: every incarnation of the consumer since the dashboard first saw it.
fn totals_cells(c: &ConsumerStatus, app: &App) -> [Cell<'static>; 5] {
    let t = &c.totals;
    let effect = |k: &str| format::count(t.side_effects.get(k).copied().unwrap_or(0.0));
    [
        Cell::from(format::count(t.processed)),
        Cell::from(format::count(t.duplicate_dropped)),
        Cell::from(format::count(t.dead_lettered)),
        Cell::from(format!(
            "{}/{}/{}",
            effect("sent"),
            effect("suppressed"),
            effect("failed")
        )),
        Cell::from(format::ago(c.last_restart, app.now)),
    ]
}

/// The consumers' title: the window, and since when (and across how many
/// restarts) the Σ columns count.
fn consumers_title(arranged: &lists::Arranged<'_, ConsumerStatus>, app: &App) -> String {
    let window = app.rate_window;
    if app.compact() {
        return format!(
            " Consumers ({}) — {} (w) ",
            arranged.count_label(),
            window.label()
        );
    }
    let since = arranged
        .rows
        .iter()
        .filter_map(|(_, c)| c.totals.since)
        .min();
    let restarts = arranged
        .rows
        .iter()
        .map(|(_, c)| c.totals.restarts)
        .max()
        .unwrap_or(0);
    format!(
        " Consumers ({}) — rates and counts over the {} (w switches) · Σ = every incarnation since {} ({} restart{}) ",
        arranged.count_label(),
        match window {
            RateWindow::LastPoll => "last poll (per second)".to_string(),
            w => format!("last {}", w.label()),
        },
        since.map(format::clock).unwrap_or_else(|| "—".into()),
        restarts,
        if restarts == 1 { "" } else { "s" }
    )
}

/// The alerts, the newest first; each may take two or three rows so that its end
/// and its object are never cut:
///
/// ```text
/// ┌ Alerts (2), 1 silenced — Enter jumps, a acknowledges, z silences ─────────┐
/// │          since    for     alert  → its object (Enter)                     │
/// │ CRIT     04:10:31 1m 32s  duplicate rate 1.2% over 1 min …  → consumer …  │
/// └ (under 100 columns no "since" and the object on a line of its own) ───────┘
/// ```
fn alerts_panel(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let arranged = lists::alerts(app);
    let focused = app.focused() == Some(ListId::Alerts);
    let silenced = app.silenced.len();
    let title = format!(
        " Alerts ({}){} — Enter jumps, a acknowledges, z silences ",
        arranged.count_label(),
        if silenced > 0 {
            format!(", {silenced} silenced")
        } else {
            String::new()
        }
    );
    if arranged.rows.is_empty() {
        let text = if arranged.total == 0 {
            Line::styled(
                "no alerts: duplicates are being dropped, nothing in doubt",
                theme.ok,
            )
        } else {
            Line::styled("every alert is filtered out or silenced", theme.dim)
        };
        frame.render_widget(
            Paragraph::new(text).block(panel(focus_title(title, focused), theme)),
            area,
        );
        return;
    }
    let compact = app.compact();
    // The message column: the inner width less the fixed columns and their gaps.
    let fixed: u16 = if compact { 8 + 7 + 2 } else { 8 + 8 + 7 + 3 };
    let message_width = usize::from(area.width.saturating_sub(2 + fixed)).max(20);
    let (header, widths) = if compact {
        (
            vec!["", "for", "alert"],
            vec![
                Constraint::Length(8),
                Constraint::Length(7),
                Constraint::Min(20),
            ],
        )
    } else {
        (
            vec!["", "since", "for", "alert  → its object (Enter)"],
            vec![
                Constraint::Length(8),
                Constraint::Length(8),
                Constraint::Length(7),
                Constraint::Min(30),
            ],
        )
    };
    let table = ListTable {
        title,
        header: Row::new(header),
        widths,
        rows: arranged
            .rows
            .iter()
            .map(|(key, a)| alert_row(a, app.acked.contains(key), app, message_width, theme))
            .collect(),
        selected: arranged.selected(app.list(ListId::Alerts)),
    };
    list_table(frame, area, table, focused, theme);
}

/// One alert: its tag (severity, `ack`, or `DRILL` dimmed: a drill's alert is not
/// an incident), since when and for how long, and its message.
fn alert_row(
    a: &Alert,
    acked: bool,
    app: &App,
    message_width: usize,
    theme: &Theme,
) -> Row<'static> {
    let drill = !a.is_incident();
    let (tag, style) = match (drill, acked) {
        (true, _) => ("DRILL".to_string(), theme.dim),
        (false, true) => (format!("{} ack", a.severity.tag()), theme.dim),
        (false, false) => (
            a.severity.tag().to_string(),
            match a.severity {
                idemwatch_monitor::alerts::Severity::Critical => theme.crit,
                idemwatch_monitor::alerts::Severity::Warning => theme.warn,
            },
        ),
    };
    let since = a.since.map(format::clock).unwrap_or_else(|| "—".into());
    let lasted = a
        .since
        .map(|s| format::duration((app.now - s).num_seconds()))
        .unwrap_or_default();
    let text_style = if drill || acked {
        theme.dim
    } else {
        theme.base
    };
    let lines = alert_lines(a, message_width, text_style, app.compact(), theme);
    let height = lines.len() as u16;
    let mut cells = vec![Cell::from(tag).style(style)];
    if !app.compact() {
        cells.push(Cell::from(since));
    }
    cells.push(Cell::from(lasted));
    cells.push(Cell::from(Text::from(lines)));
    Row::new(cells).height(height)
}

/// An alert's message wrapped to its column, and (at full width) the object Enter
/// jumps to, on the last line if it fits there.
fn alert_lines(
    a: &Alert,
    message_width: usize,
    text_style: Style,
    compact: bool,
    theme: &Theme,
) -> Vec<Line<'static>> {
    let mut message = a.message.clone();
    if let idemwatch_monitor::alerts::Cause::Drill { what } = &a.cause {
        message = format!("{message} — caused by {what}, not an incident");
    }
    // More lines when the alert does not fit in one: its end (the numbers, the
    // deploy it belongs to) and the object Enter jumps to must not be cut.
    let mut lines: Vec<Line> = format::wrap(&message, message_width, 2)
        .into_iter()
        .map(|l| Line::styled(l, text_style))
        .collect();
    if !compact {
        let object = format!("→ {}", a.object.label());
        let last = lines.last().map_or(0, |l| l.width());
        match lines.last_mut() {
            Some(l) if last + 2 + object.chars().count() <= message_width => {
                l.push_span(Span::styled(format!("  {object}"), theme.dim));
            }
            _ => lines.push(Line::styled(object, theme.dim)),
        }
    }
    lines
}

/// Every source the dashboard reads, and whether it answers:
///
/// ```text
/// ┌ Sources ───────────────────────────────────┐
/// │ engine up  relaxed durability              │  a target (then, at full width,
/// │   http://…/metrics  412 samples in 3 ms    │  its URL, the seen-set bypass,
/// │ database up  claims in doubt: 0            │  ingress and HTTP edge rates)
/// │ prometheus history up: 11-30 03:12 – …     │
/// └────────────────────────────────────────────┘
/// ```
fn sources_panel(frame: &mut Frame, area: Rect, app: &App, theme: &Theme) {
    let Some(snap) = &app.snapshot else {
        return;
    };
    let compact = app.compact();
    let mut lines = Vec::new();
    for t in snap.targets.iter().filter(|t| app.matches(&t.name)) {
        lines.extend(target_lines(t, app, compact, theme));
    }
    match &snap.database {
        None => lines.push(Line::styled("database: not configured", theme.dim)),
        Some(db) => lines.extend(database_lines(db, compact, theme)),
    }
    if let Some(h) = &snap.history_source {
        lines.push(history_line(h, theme));
    }
    frame.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .block(panel(" Sources ", theme)),
        area,
    );
}

/// A scrape target: up or down (and since when), then at full width its URL, the
/// consumers that bypassed the seen-set, the ingress and HTTP edge rates.
fn target_lines(t: &TargetStatus, app: &App, compact: bool, theme: &Theme) -> Vec<Line<'static>> {
    let (state, style) = match (&t.status, t.down_since) {
        (SourceStatus::Up, _) => ("up".to_string(), theme.ok),
        (SourceStatus::Down { error }, Some(since)) => (
            format!(
                "DOWN for {}: {error}",
                format::duration((app.now - since).num_seconds())
            ),
            theme.crit,
        ),
        (SourceStatus::Down { error }, None) => (format!("DOWN: {error}"), theme.crit),
    };
    let mut row = vec![
        Span::styled(format!("{} ", t.name), theme.title),
        Span::styled(state, style),
    ];
    if t.durability == Some(Durability::Relaxed) {
        row.push(Span::raw("  "));
        row.push(Span::styled("relaxed durability", theme.warn));
    }
    let mut lines = vec![Line::from(row)];
    if compact {
        return lines;
    }
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
    let bypassed: f64 = t.seen_set_bypassed.values().sum();
    if bypassed > 0.0 {
        let who: Vec<String> = t
            .seen_set_bypassed
            .iter()
            .filter(|(_, n)| **n > 0.0)
            .map(|(c, n)| format!("{c} {}", format::count(*n)))
            .collect();
        lines.push(Line::styled(
            format!("  seen-set bypassed: {} (fail-open)", who.join(" · ")),
            theme.warn,
        ));
    }
    for (source, r) in &t.ingress {
        lines.extend(ingress_lines(source, r, theme));
    }
    for (route, outcomes) in &t.http {
        let rate = |o: &str| format::rate(outcomes.get(o).and_then(|r| r.per_second));
        lines.push(Line::raw(format!(
            "  {route}: executed {}/s · replayed {}/s · conflict {}/s",
            rate("executed"),
            rate("replayed"),
            rate("conflict")
        )));
    }
    lines
}

/// An ingress (`ingest mqtt --listen`): its link to the broker and since when, its
/// rate and DUP-flag share, then what it dead-lettered at its door and its last
/// error, in lines that fit the panel:
///
/// ```text
///   ingress mqtt: connected since 04:10:07
///     40.2 msg/s · DUP 0.249% (48210 in, 31 DUP)
///     dead letters: too_large 2
///     last error: connect 04:08:55 (3 so far)
/// ```
fn ingress_lines(source: &str, r: &IngressReading, theme: &Theme) -> Vec<Line<'static>> {
    let since = r
        .state_since
        .map(|t| format!(" since {}", format::clock(t)))
        .unwrap_or_default();
    let mut head = vec![Span::raw(format!("  ingress {source}"))];
    match r.connected {
        Some(true) => head.push(Span::styled(format!(": connected{since}"), theme.ok)),
        Some(false) => head.push(Span::styled(format!(": DISCONNECTED{since}"), theme.crit)),
        None => {}
    }
    // The share of the traffic the broker flagged DUP (its redeliveries to the
    // ingress): over the last interval when there is traffic, else over its life.
    let share = match (r.received.per_second, r.dup_flagged.per_second) {
        (Some(all), Some(dup)) if all > 0.0 => Some(dup / all),
        _ if r.received.total > 0.0 => Some(r.dup_flagged.total / r.received.total),
        _ => None,
    };
    let mut lines = vec![
        Line::from(head),
        Line::raw(format!(
            "    {} msg/s · DUP {} ({} in, {} DUP)",
            format::rate(r.received.per_second),
            format::pct(share),
            format::count(r.received.total),
            format::count(r.dup_flagged.total)
        )),
    ];
    let kept: Vec<String> = r
        .dead_lettered
        .iter()
        .filter(|(_, n)| **n > 0.0)
        .map(|(reason, n)| format!("{reason} {}", format::count(*n)))
        .collect();
    if !kept.is_empty() {
        lines.push(Line::styled(
            format!("    dead letters: {}", kept.join(" · ")),
            theme.warn,
        ));
    }
    if let Some(e) = &r.last_error {
        lines.push(Line::styled(
            format!(
                "    last error: {} {} ({} so far)",
                e.kind,
                format::clock(e.at),
                format::count(e.count)
            ),
            theme.dim,
        ));
    }
    lines
}

/// The watched database: up or down, the claims in doubt, then at full width its
/// URL, the poll's time and the dedup table's size and oldest row.
fn database_lines(db: &DbStats, compact: bool, theme: &Theme) -> Vec<Line<'static>> {
    let (state, style) = match &db.status {
        SourceStatus::Up => ("up".to_string(), theme.ok),
        SourceStatus::Down { error } => (format!("DOWN: {error}"), theme.crit),
    };
    let mut lines = vec![Line::from(vec![
        Span::styled("database ", theme.title),
        Span::styled(state, style),
        Span::styled(
            format!("  claims in doubt: {}", db.claims_in_doubt_total),
            if db.claims_in_doubt_total > 0 {
                theme.crit
            } else {
                theme.base
            },
        ),
    ])];
    if compact {
        return lines;
    }
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
    lines
}

/// The Prometheus history source: what it covers, or why it is not on the chart
/// (the live scrapes go on either way).
fn history_line(h: &HistoryStatus, theme: &Theme) -> Line<'static> {
    let (state, style) = match &h.state {
        HistoryState::Idle => (
            "idle (the chart starts after the dashboard)".to_string(),
            theme.dim,
        ),
        HistoryState::Fetching => ("fetching…".to_string(), theme.dim),
        HistoryState::Up {
            from,
            to,
            step_seconds,
            fetch_ms,
            series,
        } => (
            format!(
                "up: {} – {} at {step_seconds} s, {series} series in {fetch_ms} ms",
                from.format("%m-%d %H:%M"),
                idemwatch_base::clock::clock(*to)
            ),
            theme.ok,
        ),
        HistoryState::Down { error } => (format!("DOWN: {error}"), theme.warn),
    };
    Line::from(vec![
        Span::styled("prometheus history ", theme.title),
        Span::styled(state, style),
    ])
}
