//! The pieces every screen draws with (a titled panel, a centred popup, the
//! "waiting for the first poll" placeholder). Their own module so that the frame and
//! the tabs both use them without importing each other.

use ratatui::layout::Rect;
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph};
use ratatui::Frame;

use super::theme::Theme;

/// A bordered block with a title, the look of every panel.
pub fn panel<'a>(title: impl Into<Line<'a>>, theme: &Theme) -> Block<'a> {
    Block::default()
        .borders(Borders::ALL)
        .border_style(theme.dim)
        .title(title)
        .title_style(theme.title)
}

/// A centred popup area.
pub fn centered(area: Rect, width: u16, height: u16) -> Rect {
    let width = width.min(area.width);
    let height = height.min(area.height);
    Rect {
        x: area.x + (area.width - width) / 2,
        y: area.y + (area.height - height) / 2,
        width,
        height,
    }
}

/// What a screen shows before the first poll arrives.
pub fn waiting(frame: &mut Frame, area: Rect, what: &str, theme: &Theme) {
    frame.render_widget(
        Paragraph::new(format!("waiting for the first poll of {what}…"))
            .style(theme.dim)
            .block(panel(" idemwatch ", theme)),
        area,
    );
}

/// A panel title marked when its list has the keys (↑↓, Enter, s act on it).
/// A panel title that fits `width` (borders and the focus mark included): the
/// explanation after " — " goes when there is no room for it, so the count and the
/// sort stay whole.
pub fn fit_title(title: String, width: u16) -> String {
    let room = usize::from(width.saturating_sub(3));
    match title.split_once(" — ") {
        Some((main, _)) if title.chars().count() > room => format!("{main} "),
        _ => title,
    }
}

pub fn focus_title<'a>(title: String, focused: bool) -> Line<'a> {
    if focused {
        Line::from(format!("▶{title}"))
    } else {
        Line::from(title)
    }
}

/// Width of the Duplicates chart's y-axis labels. Here, not in the tab, because the
/// app sizes the monitor's history step from the chart's columns
/// (`app::chart_columns`) and the app does not depend on the tabs.
pub const Y_LABELS: u16 = 7;
