//! Everything that can happen to the dashboard, and the I/O it asks for in return.
//!
//! `App::update` takes an [`Action`] and returns [`Effect`]s: the state change is
//! pure (and tested as such); the event loop performs the effects.

use std::sync::Arc;

use idemwatch_drills::{DrillReport, Scenario};
use idemwatch_engine::consumers::ConsumerMode;
use idemwatch_monitor::Snapshot;

use super::tab::Tab;

/// What a line being typed is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    /// `/`: narrows every list of the tab as it is typed.
    Filter,
    /// `o`: open a vehicle by its device id.
    VehicleId,
    /// `m`: the label of a manual marker.
    MarkerLabel,
}

impl PromptKind {
    pub fn label(self) -> &'static str {
        match self {
            PromptKind::Filter => "filter",
            PromptKind::VehicleId => "open vehicle (device id)",
            PromptKind::MarkerLabel => "marker label",
        }
    }
}

/// A line being typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub kind: PromptKind,
    pub text: String,
}

/// Inputs to [`super::app::App::update`].
#[derive(Debug, Clone)]
pub enum Action {
    Quit,
    NextTab,
    PrevTab,
    GoTo(Tab),
    ToggleHelp,
    ToggleFreeze,
    StartPrompt(PromptKind),
    PromptInput(char),
    PromptBackspace,
    PromptDone,
    /// Esc: close whatever is open (help, prompt, a detail, a confirmation).
    Back,
    ZoomIn,
    ZoomOut,
    Up,
    Down,
    PageUp,
    PageDown,
    Home,
    End,
    /// ←/→: the next panel of the tab, or the chart cursor.
    Left,
    Right,
    /// `s`: sort the focused list by its next column; `S` reverses.
    Sort,
    SortReverse,
    Enter,
    /// Duplicates tab: all consumers → one at a time → all.
    CycleConsumer,
    /// Duplicates tab: show / hide one kind of marker.
    ToggleMarkerKind(&'static str),
    ToggleLogScale,
    /// Overview: 1-minute → 5-minute → last-poll rates.
    CycleRateWindow,
    /// Drills tab: idempotent ↔ naive.
    ToggleDrillMode,
    /// `y` on a question (a drill, a replay).
    Confirm,
    /// Tables tab, a dead letter open: replay it (asks first).
    ReplayDeadLetter,
    /// Overview alerts: acknowledge (kept, out of the badge) / silence (hidden).
    Acknowledge,
    Silence,
    /// `y` elsewhere: copy the selected key or device id (OSC 52).
    Copy,
    /// `e`: write the post-mortem report of the current window.
    Export,
    /// Demo only: simulate a deploy now.
    Deploy,
    /// A left click at a screen cell.
    Click {
        column: u16,
        row: u16,
    },
    ScrollUp,
    ScrollDown,
    /// The terminal's size (at start and on every change).
    Resize {
        width: u16,
        height: u16,
    },
    /// A new poll from the monitor.
    Snapshot(Arc<Snapshot>),
    DrillProgress(String),
    DrillFinished(Result<Box<DrillReport>, String>),
    TwiceChecked(Vec<idemwatch_drills::twice::TwiceCheck>),
    /// One line of feedback from an effect (report written, marker not saved…).
    Status(String),
    /// Slow clock: relative times on screen move on.
    Tick(chrono::DateTime<chrono::Utc>),
}

/// I/O the event loop performs for the app.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Ask the monitor for a poll now / a zoom / a vehicle's detail / a dead letter.
    Monitor(idemwatch_monitor::MonitorCommand),
    StartDrill {
        scenario: Scenario,
        mode: ConsumerMode,
    },
    AddMarker {
        label: String,
    },
    Deploy,
    /// Put this text on the terminal's clipboard (OSC 52: works over SSH).
    Copy(String),
    /// Write the report of the window on screen.
    Export,
    /// Re-publish this dead letter to its consumer's queue (`engine::replay`).
    ReplayDeadLetter(i64),
}
