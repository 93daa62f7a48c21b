//! The pieces every screen draws with (a titled panel, a centred popup, the
//! "waiting for the first poll" placeholder, a list drawn as a table). Their own module so that the frame and
//! the tabs both use them without importing each other.

use ratatui::layout::{Constraint, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Table, TableState};
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

/// A panel title marked when its list has the keys (↑↓, Enter, s act on it).
pub fn focus_title<'a>(title: String, focused: bool) -> Line<'a> {
    if focused {
        Line::from(format!("▶{title}"))
    } else {
        Line::from(title)
    }
}

/// A list's selected row: reversed while the list has the keys, underlined when
/// another list has them (so the selection is still seen, but not mistaken for the
/// one ↑↓ moves).
pub fn row_highlight(focused: bool, theme: &Theme) -> Style {
    if focused {
        theme.selected
    } else {
        theme.base.add_modifier(Modifier::UNDERLINED)
    }
}

/// One of the tabs' lists as the tab builds it: the panel's title, the column
/// header, the column widths, the rows as shown, and which of them is selected.
pub struct ListTable<'a> {
    pub title: String,
    pub header: Row<'a>,
    pub widths: Vec<Constraint>,
    pub rows: Vec<Row<'a>>,
    pub selected: Option<usize>,
}

/// Draw a list the way every list looks: a header in the title style, the
/// selection highlighted ([`row_highlight`]), the title marked when focused.
pub fn list_table(
    frame: &mut Frame,
    area: Rect,
    list: ListTable<'_>,
    focused: bool,
    theme: &Theme,
) {
    let mut state = TableState::default().with_selected(list.selected);
    frame.render_stateful_widget(
        Table::new(list.rows, list.widths)
            .header(list.header.style(theme.title))
            .row_highlight_style(row_highlight(focused, theme))
            .block(panel(focus_title(list.title, focused), theme)),
        area,
        &mut state,
    );
}

/// Width of the Duplicates chart's y-axis labels. Here, not in the tab, because the
/// app sizes the monitor's history step from the chart's columns
/// (`app::chart_columns`) and the app does not depend on the tabs.
pub const Y_LABELS: u16 = 7;
