//! Everything that can happen to the dashboard, and the I/O it asks for in return.
//!
//! `App::update` takes an [`Action`] and returns [`Effect`]s: the state change is
//! pure (and tested as such); the event loop performs the effects.

use std::sync::Arc;

use crate::drills::{DrillReport, Scenario};
use crate::engine::consumers::ConsumerMode;
use crate::monitor::Snapshot;

use super::tab::Tab;

/// Inputs to [`super::app::App::update`].
#[derive(Debug, Clone)]
pub enum Action {
    Quit,
    NextTab,
    PrevTab,
    GoTo(Tab),
    ToggleHelp,
    ToggleFreeze,
    AddMarker,
    StartFilter,
    FilterInput(char),
    FilterBackspace,
    FilterDone,
    /// Esc: close whatever is open (help, filter, a detail, a confirmation).
    Back,
    ZoomIn,
    ZoomOut,
    Up,
    Down,
    Enter,
    /// Duplicates tab: all consumers → one at a time → all.
    CycleConsumer,
    /// Drills tab: idempotent ↔ naive.
    ToggleDrillMode,
    Confirm,
    /// Demo only: simulate a deploy now.
    Deploy,
    /// A left click at a screen cell.
    Click {
        column: u16,
        row: u16,
    },
    ScrollUp,
    ScrollDown,
    /// The terminal changed size: redraw.
    Resize,
    /// A new poll from the monitor.
    Snapshot(Arc<Snapshot>),
    DrillProgress(String),
    DrillFinished(Result<Box<DrillReport>, String>),
    TwiceChecked(Vec<crate::drills::twice::TwiceCheck>),
    /// Slow clock: relative times on screen move on.
    Tick(chrono::DateTime<chrono::Utc>),
}

/// I/O the event loop performs for the app.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Ask the monitor for a poll now / a zoom / a vehicle's detail.
    Monitor(crate::monitor::MonitorCommand),
    StartDrill {
        scenario: Scenario,
        mode: ConsumerMode,
    },
    AddMarker {
        label: String,
    },
    Deploy,
}
