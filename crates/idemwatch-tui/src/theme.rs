//! Colours, in one place. `NO_COLOR` (or `theme = "no-color"`) keeps only bold,
//! reverse and underline, so nothing depends on colour alone.

use ratatui::style::{Color, Modifier, Style};

use idemwatch_monitor::config::Theme as ThemeName;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Theme {
    pub color: bool,
    pub base: Style,
    pub dim: Style,
    pub title: Style,
    pub selected: Style,
    pub ok: Style,
    pub warn: Style,
    pub crit: Style,
    pub banner: Style,
    pub key: Style,
}

/// One colour per charted consumer, cycled.
const SERIES: [Color; 6] = [
    Color::Cyan,
    Color::Yellow,
    Color::Magenta,
    Color::Green,
    Color::LightBlue,
    Color::LightRed,
];

impl Theme {
    /// The theme for a config choice, overridden to no colour by `NO_COLOR`.
    pub fn pick(name: ThemeName, no_color_env: bool) -> Theme {
        if no_color_env || name == ThemeName::NoColor {
            return Theme::no_color();
        }
        match name {
            ThemeName::HighContrast => Theme {
                dim: Style::default().fg(Color::White),
                ..Theme::default_colors()
            },
            ThemeName::Light => Theme {
                base: Style::default().fg(Color::Black),
                dim: Style::default().fg(Color::DarkGray),
                title: Style::default()
                    .fg(Color::Blue)
                    .add_modifier(Modifier::BOLD),
                ..Theme::default_colors()
            },
            _ => Theme::default_colors(),
        }
    }

    pub fn default_colors() -> Theme {
        Theme {
            color: true,
            base: Style::default(),
            dim: Style::default().fg(Color::DarkGray),
            title: Style::default()
                .fg(Color::Cyan)
                .add_modifier(Modifier::BOLD),
            selected: Style::default().add_modifier(Modifier::REVERSED),
            ok: Style::default().fg(Color::Green),
            warn: Style::default().fg(Color::Yellow),
            crit: Style::default().fg(Color::Red).add_modifier(Modifier::BOLD),
            banner: Style::default().fg(Color::Black).bg(Color::Yellow),
            key: Style::default()
                .fg(Color::Cyan)
                .add_modifier(Modifier::BOLD),
        }
    }

    pub fn no_color() -> Theme {
        Theme {
            color: false,
            base: Style::default(),
            dim: Style::default(),
            title: Style::default().add_modifier(Modifier::BOLD),
            selected: Style::default().add_modifier(Modifier::REVERSED),
            ok: Style::default(),
            warn: Style::default().add_modifier(Modifier::BOLD),
            crit: Style::default().add_modifier(Modifier::BOLD | Modifier::UNDERLINED),
            banner: Style::default().add_modifier(Modifier::REVERSED),
            key: Style::default().add_modifier(Modifier::BOLD),
        }
    }

    pub fn series(&self, i: usize) -> Style {
        if self.color {
            Style::default().fg(SERIES[i % SERIES.len()])
        } else {
            Style::default()
        }
    }

    /// Marker lines on the chart, by kind.
    pub fn marker(&self, kind: &str) -> Style {
        if !self.color {
            return Style::default().add_modifier(Modifier::DIM);
        }
        match kind {
            "deploy" => Style::default().fg(Color::LightYellow),
            "restart" => Style::default().fg(Color::LightRed),
            "drill" => Style::default().fg(Color::LightMagenta),
            "incident" => Style::default().fg(Color::Red),
            _ => Style::default().fg(Color::Gray),
        }
    }
}
