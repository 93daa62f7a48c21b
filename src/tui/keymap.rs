//! The one keymap. The `?` help overlay and the key-hint bar are both generated from
//! [`BINDINGS`], so they can never disagree with what the keys do.

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

use super::action::Action;
use super::app::App;
use super::tab::Tab;

/// Where a binding applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Global,
    Tab(Tab),
    /// Only in the live demo.
    Demo,
}

/// One key binding: the keys, what they do, and how it is shown.
#[derive(Debug, Clone, Copy)]
pub struct Binding {
    pub keys: &'static [KeyCode],
    /// As shown in help and the hint bar.
    pub label: &'static str,
    pub help: &'static str,
    pub scope: Scope,
    /// Shown in the bottom hint bar (help lists every binding).
    pub hint: bool,
    pub action: fn() -> Action,
}

const fn b(
    keys: &'static [KeyCode],
    label: &'static str,
    help: &'static str,
    scope: Scope,
    hint: bool,
    action: fn() -> Action,
) -> Binding {
    Binding {
        keys,
        label,
        help,
        scope,
        hint,
        action,
    }
}

pub const BINDINGS: &[Binding] = &[
    b(
        &[KeyCode::Char('q')],
        "q",
        "quit (the terminal is restored)",
        Scope::Global,
        true,
        || Action::Quit,
    ),
    b(
        &[KeyCode::Char('?')],
        "?",
        "help",
        Scope::Global,
        true,
        || Action::ToggleHelp,
    ),
    b(
        &[KeyCode::Tab],
        "Tab",
        "next tab",
        Scope::Global,
        true,
        || Action::NextTab,
    ),
    b(
        &[KeyCode::BackTab],
        "S-Tab",
        "previous tab",
        Scope::Global,
        false,
        || Action::PrevTab,
    ),
    b(
        &[KeyCode::Char('1')],
        "1",
        "Overview",
        Scope::Global,
        false,
        || Action::GoTo(Tab::Overview),
    ),
    b(
        &[KeyCode::Char('2')],
        "2",
        "Duplicates",
        Scope::Global,
        false,
        || Action::GoTo(Tab::Duplicates),
    ),
    b(
        &[KeyCode::Char('3')],
        "3",
        "Vehicles",
        Scope::Global,
        false,
        || Action::GoTo(Tab::Vehicles),
    ),
    b(
        &[KeyCode::Char('4')],
        "4",
        "Drills",
        Scope::Global,
        false,
        || Action::GoTo(Tab::Drills),
    ),
    b(
        &[KeyCode::Char('5')],
        "5",
        "Tables",
        Scope::Global,
        false,
        || Action::GoTo(Tab::Tables),
    ),
    b(
        &[KeyCode::Char('6')],
        "6",
        "Inventory",
        Scope::Global,
        false,
        || Action::GoTo(Tab::Inventory),
    ),
    b(
        &[KeyCode::Char('f')],
        "f",
        "freeze / unfreeze the display",
        Scope::Global,
        true,
        || Action::ToggleFreeze,
    ),
    b(
        &[KeyCode::Char('m')],
        "m",
        "add a manual marker now",
        Scope::Global,
        true,
        || Action::AddMarker,
    ),
    b(
        &[KeyCode::Char('/')],
        "/",
        "filter rows by text",
        Scope::Global,
        true,
        || Action::StartFilter,
    ),
    b(
        &[KeyCode::Esc],
        "Esc",
        "close / back",
        Scope::Global,
        false,
        || Action::Back,
    ),
    b(
        &[KeyCode::Char('D')],
        "D",
        "simulate a deploy now",
        Scope::Demo,
        true,
        || Action::Deploy,
    ),
    b(
        &[KeyCode::Char('+'), KeyCode::Char('=')],
        "+",
        "zoom in (down to 1 min)",
        Scope::Tab(Tab::Duplicates),
        true,
        || Action::ZoomIn,
    ),
    b(
        &[KeyCode::Char('-')],
        "-",
        "zoom out (up to the retention)",
        Scope::Tab(Tab::Duplicates),
        true,
        || Action::ZoomOut,
    ),
    b(
        &[KeyCode::Char('c')],
        "c",
        "one consumer / all consumers",
        Scope::Tab(Tab::Duplicates),
        true,
        || Action::CycleConsumer,
    ),
    b(
        &[KeyCode::Up, KeyCode::Char('k')],
        "↑/k",
        "select previous",
        Scope::Tab(Tab::Vehicles),
        true,
        || Action::Up,
    ),
    b(
        &[KeyCode::Down, KeyCode::Char('j')],
        "↓/j",
        "select next",
        Scope::Tab(Tab::Vehicles),
        true,
        || Action::Down,
    ),
    b(
        &[KeyCode::Enter],
        "Enter",
        "open the vehicle: state beside history",
        Scope::Tab(Tab::Vehicles),
        true,
        || Action::Enter,
    ),
    b(
        &[KeyCode::Up, KeyCode::Char('k')],
        "↑/k",
        "previous scenario",
        Scope::Tab(Tab::Drills),
        true,
        || Action::Up,
    ),
    b(
        &[KeyCode::Down, KeyCode::Char('j')],
        "↓/j",
        "next scenario",
        Scope::Tab(Tab::Drills),
        true,
        || Action::Down,
    ),
    b(
        &[KeyCode::Char('n')],
        "n",
        "mode: idempotent / naive",
        Scope::Tab(Tab::Drills),
        true,
        || Action::ToggleDrillMode,
    ),
    b(
        &[KeyCode::Enter],
        "Enter",
        "run the drill (asks first)",
        Scope::Tab(Tab::Drills),
        true,
        || Action::Enter,
    ),
    b(
        &[KeyCode::Char('y')],
        "y",
        "confirm",
        Scope::Tab(Tab::Drills),
        false,
        || Action::Confirm,
    ),
    b(
        &[KeyCode::Up, KeyCode::Char('k')],
        "↑/k",
        "scroll",
        Scope::Tab(Tab::Tables),
        false,
        || Action::Up,
    ),
    b(
        &[KeyCode::Down, KeyCode::Char('j')],
        "↓/j",
        "scroll",
        Scope::Tab(Tab::Tables),
        false,
        || Action::Down,
    ),
];

/// Is `binding` active in the app's current context?
pub fn active(binding: &Binding, app: &App) -> bool {
    match binding.scope {
        Scope::Global => true,
        Scope::Tab(t) => t == app.tab,
        Scope::Demo => app.demo,
    }
}

/// The action for a key press, if any. Text entry (the filter prompt) takes every
/// printable key first; Ctrl-C always quits.
pub fn action_for(key: KeyEvent, app: &App) -> Option<Action> {
    if key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c') {
        return Some(Action::Quit);
    }
    if app.filter_editing {
        return match key.code {
            KeyCode::Enter => Some(Action::FilterDone),
            KeyCode::Esc => Some(Action::Back),
            KeyCode::Backspace => Some(Action::FilterBackspace),
            KeyCode::Char(c) => Some(Action::FilterInput(c)),
            _ => None,
        };
    }
    // A tab's own binding wins over a global one on the same key.
    BINDINGS
        .iter()
        .filter(|b| active(b, app) && b.keys.contains(&key.code))
        .min_by_key(|b| matches!(b.scope, Scope::Global))
        .map(|b| (b.action)())
}

/// `(keys, description)` for the hint bar: global hints, then the current tab's.
pub fn hints(app: &App) -> Vec<(&'static str, &'static str)> {
    let mut out: Vec<_> = BINDINGS
        .iter()
        .filter(|b| b.hint && active(b, app) && !matches!(b.scope, Scope::Global))
        .map(|b| (b.label, short(b.help)))
        .collect();
    out.extend(
        BINDINGS
            .iter()
            .filter(|b| b.hint && matches!(b.scope, Scope::Global))
            .map(|b| (b.label, short(b.help))),
    );
    out
}

/// The hint bar's short form: the help text up to the first ' (' or ':'.
fn short(help: &'static str) -> &'static str {
    let end = help
        .find(" (")
        .or_else(|| help.find(':'))
        .unwrap_or(help.len());
    &help[..end]
}

/// Help overlay sections: (title, [(keys, help)]).
pub fn help_sections(app: &App) -> Vec<(String, Vec<(&'static str, &'static str)>)> {
    let mut sections = vec![(
        "Everywhere".to_string(),
        BINDINGS
            .iter()
            .filter(|b| b.scope == Scope::Global)
            .map(|b| (b.label, b.help))
            .collect::<Vec<_>>(),
    )];
    // This tab's keys first: the overlay may be taller than the terminal.
    let tab_rows = |tab: Tab| -> Vec<(&'static str, &'static str)> {
        BINDINGS
            .iter()
            .filter(|b| b.scope == Scope::Tab(tab))
            .map(|b| (b.label, b.help))
            .collect()
    };
    let mut order = vec![app.tab];
    order.extend(Tab::ALL.into_iter().filter(|t| *t != app.tab));
    for (i, tab) in order.into_iter().enumerate() {
        let rows = tab_rows(tab);
        if !rows.is_empty() {
            sections.push((tab.title().to_string(), rows));
        }
        if i == 0 && app.demo {
            sections.push((
                "Demo".to_string(),
                BINDINGS
                    .iter()
                    .filter(|b| b.scope == Scope::Demo)
                    .map(|b| (b.label, b.help))
                    .collect(),
            ));
        }
    }
    sections
}
