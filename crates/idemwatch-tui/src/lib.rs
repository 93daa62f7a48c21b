//! The terminal dashboard. Owns the terminal: one event loop, one `App`,
//! `update(Action)`, and render functions that only read state, one file per tab.

pub mod action;
pub mod app;
pub mod demo;
pub mod event_loop;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod format;
pub mod keymap;
pub mod lists;
pub mod render;
#[cfg(test)]
mod screens_test;
pub mod svg;
pub mod tab;
pub mod tabs;
pub mod theme;
pub mod widgets;

use std::io::IsTerminal;
use std::sync::Arc;

use crate::demo::Demo;
use idemwatch_drills::DrillTarget;
use idemwatch_monitor::config::Config;
use theme::Theme;

#[derive(Debug, thiserror::Error)]
pub enum TuiError {
    #[error("stdout is not a terminal: the dashboard needs one (for scripts and alerts use `idemwatch snapshot --json`)")]
    NotATerminal,
    #[error("terminal error: {0}")]
    Terminal(#[from] std::io::Error),
    #[error("{0}")]
    Setup(String),
}

/// What the dashboard watches and how it looks.
pub struct TuiOptions {
    pub config: Config,
    /// The live demo, when running without a config.
    pub demo: Option<Arc<Demo>>,
    pub banner: Option<String>,
    pub theme: Theme,
    /// Where the Drills tab runs drills (None: no database to drill against).
    pub drill_target: Option<Arc<DrillTarget>>,
    /// Where `e` writes its report.
    pub report_dir: std::path::PathBuf,
}

/// Run the dashboard until `q`; the terminal is restored on every exit path
/// (ratatui's panic hook covers panics).
pub async fn run(opts: TuiOptions) -> Result<(), TuiError> {
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        return Err(TuiError::NotATerminal);
    }
    let mut terminal = ratatui::init();
    let _ = crossterm::execute!(std::io::stdout(), crossterm::event::EnableMouseCapture);
    let result = event_loop::run(&mut terminal, opts).await;
    let _ = crossterm::execute!(std::io::stdout(), crossterm::event::DisableMouseCapture);
    ratatui::restore();
    result
}
