//! One file per screen; each is a pure `render(frame, area, &App, &Theme)`.

pub mod drills;
pub mod duplicates;
pub mod inventory;
pub mod overview;
pub mod tables;
pub mod vehicles;

use ratatui::layout::Rect;
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use super::render::panel;
use super::theme::Theme;

/// What a screen shows before the first poll arrives.
pub fn waiting(frame: &mut Frame, area: Rect, what: &str, theme: &Theme) {
    frame.render_widget(
        Paragraph::new(format!("waiting for the first poll of {what}…"))
            .style(theme.dim)
            .block(panel(" idemwatch ", theme)),
        area,
    );
}
