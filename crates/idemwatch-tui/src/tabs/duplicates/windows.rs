//! Dedup windows: each consumer's duplicate ages (p50, p99, the oldest) against every
//! dedup window the dashboard knows, as margins (`idemwatch_monitor::windows`). A window
//! shorter than twice the oldest duplicate is in the warning colour (the
//! `dedup_window_short` WARN says the same in the alerts).
//!
//! ```text
//! ┌ Dedup windows: duplicate age (p50 / p99 / oldest) ──────────────────────────────┐
//! │ trip-counter   12 dup  p50 4.1 s  p99 9.8 s  oldest 3 h 12 m                     │
//! │   retention 7 d: margin 52×   seen-set TTL 1 h: margin 0.3× SHORT                │
//! └──────────────────────────────────────────────────────────────────────────────────┘
//! ```

use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use crate::app::App;
use crate::theme::Theme;
use crate::widgets::panel;
use idemwatch_monitor::windows::{format_margin, short_duration, ConsumerWindows};

/// Rows the panel wants: two per consumer shown, and its borders.
pub(super) fn rows(windows: &[&ConsumerWindows]) -> u16 {
    (windows.len() as u16 * 2).clamp(1, 8) + 2
}

/// The panel over `windows` (already filtered to the consumers on screen).
pub(super) fn windows_panel(
    frame: &mut Frame,
    area: Rect,
    windows: &[&ConsumerWindows],
    theme: &Theme,
) {
    let age = |s: Option<f64>| s.map_or_else(|| "-".into(), short_duration);
    let mut lines = Vec::new();
    for c in windows {
        lines.push(Line::from(vec![
            Span::styled(format!(" {:<15}", c.consumer), theme.title),
            Span::raw(format!(
                "{:>5} dup  p50 {}  p99 {}  oldest {}",
                c.count,
                age(c.p50_seconds),
                age(c.p99_seconds),
                age(c.max_seconds)
            )),
        ]));
        let mut margins = vec![Span::raw("   ")];
        if c.max_seconds.is_none() {
            margins.push(Span::styled(c.summary.clone(), theme.dim));
        }
        for w in c.windows.iter().filter(|_| c.max_seconds.is_some()) {
            let text = format!(
                "{} {}: margin {}{}   ",
                w.name,
                short_duration(w.seconds),
                w.margin.map_or_else(|| "-".into(), format_margin),
                if w.short { " SHORT" } else { "" }
            );
            margins.push(Span::styled(
                text,
                if w.short { theme.warn } else { theme.ok },
            ));
        }
        lines.push(Line::from(margins));
    }
    if lines.is_empty() {
        lines.push(Line::styled(" no consumer in view", theme.dim));
    }
    let title = " Dedup windows: duplicate age (p50 / p99 / oldest) against each window ";
    frame.render_widget(Paragraph::new(lines).block(panel(title, theme)), area);
}

/// The consumers of `app`'s snapshot in view (the filter, the selected chart), a
/// consumer with a window marked SHORT first: when the panel has fewer lines than
/// consumers, the warning is what must stay on screen.
pub(super) fn in_view(app: &App) -> Vec<&ConsumerWindows> {
    let Some(snap) = &app.snapshot else {
        return Vec::new();
    };
    let selected = app
        .chart
        .consumer
        .and_then(|i| snap.charts.get(i))
        .map(|c| (c.target.as_str(), c.consumer.as_str()));
    let mut shown = snap
        .windows
        .iter()
        .filter(|w| selected.is_none_or(|(t, c)| t == w.target && c == w.consumer))
        .filter(|w| app.matches(&format!("{}/{}", w.target, w.consumer)))
        .collect::<Vec<_>>();
    // Stable: the snapshot's order otherwise.
    shown.sort_by_key(|w| w.short().next().is_none());
    shown
}
