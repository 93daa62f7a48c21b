//! The one keymap. The `?` help overlay and the key-hint bar are both generated from
//! [`BINDINGS`], so they can never disagree with what the keys do.

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

use super::action::{Action, PromptKind};
use super::app::App;
use super::lists::ListId;
use super::tab::Tab;

/// Where a binding applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Global,
    Tab(Tab),
    /// Only in the live demo.
    Demo,
    /// On a tab, while one of its lists has the focus (Tables: Enter opens a dead
    /// letter, so the hint shows only with the dead letters focused).
    List(Tab, ListId),
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
        "help (scrolls with ↑↓ PgUp PgDn)",
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
        &[KeyCode::Up, KeyCode::Char('k')],
        "↑/k",
        "select previous / scroll up",
        Scope::Global,
        false,
        || Action::Up,
    ),
    b(
        &[KeyCode::Down, KeyCode::Char('j')],
        "↓/j",
        "select next / scroll down",
        Scope::Global,
        false,
        || Action::Down,
    ),
    b(
        &[KeyCode::PageUp],
        "PgUp",
        "a page up",
        Scope::Global,
        false,
        || Action::PageUp,
    ),
    b(
        &[KeyCode::PageDown],
        "PgDn",
        "a page down",
        Scope::Global,
        false,
        || Action::PageDown,
    ),
    b(
        &[KeyCode::Home],
        "Home",
        "to the top",
        Scope::Global,
        false,
        || Action::Home,
    ),
    b(
        &[KeyCode::End],
        "End",
        "to the bottom",
        Scope::Global,
        false,
        || Action::End,
    ),
    b(
        &[KeyCode::Left, KeyCode::Char('h')],
        "←/h",
        "previous panel of the tab",
        Scope::Global,
        false,
        || Action::Left,
    ),
    b(
        &[KeyCode::Right, KeyCode::Char('l')],
        "→/l",
        "next panel of the tab",
        Scope::Global,
        false,
        || Action::Right,
    ),
    b(
        &[KeyCode::Char('s')],
        "s",
        "sort the list by its next column",
        Scope::Global,
        false,
        || Action::Sort,
    ),
    b(
        &[KeyCode::Char('S')],
        "S",
        "reverse the sort",
        Scope::Global,
        false,
        || Action::SortReverse,
    ),
    b(
        &[KeyCode::Char('/')],
        "/",
        "filter every list of the tab",
        Scope::Global,
        true,
        || Action::StartPrompt(PromptKind::Filter),
    ),
    b(
        &[KeyCode::Char('o')],
        "o",
        "open a vehicle by its device id",
        Scope::Global,
        false,
        || Action::StartPrompt(PromptKind::VehicleId),
    ),
    b(
        &[KeyCode::Char('y')],
        "y",
        "copy the selected key or device id (OSC 52)",
        Scope::Global,
        false,
        || Action::Copy,
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
        "add a labelled manual marker now",
        Scope::Global,
        false,
        || Action::StartPrompt(PromptKind::MarkerLabel),
    ),
    b(
        &[KeyCode::Char('e')],
        "e",
        "export the window as an HTML report",
        Scope::Global,
        true,
        || Action::Export,
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
        &[KeyCode::Enter],
        "Enter",
        "jump to the alert's object (on a consumer: its chart)",
        Scope::Tab(Tab::Overview),
        true,
        || Action::Enter,
    ),
    b(
        &[KeyCode::Char('w')],
        "w",
        "rates over 1 min / 5 min / the last poll",
        Scope::Tab(Tab::Overview),
        true,
        || Action::CycleRateWindow,
    ),
    b(
        &[KeyCode::Char('a')],
        "a",
        "acknowledge the selected alert",
        Scope::Tab(Tab::Overview),
        true,
        || Action::Acknowledge,
    ),
    b(
        &[KeyCode::Char('z')],
        "z",
        "silence the selected alert for this session",
        Scope::Tab(Tab::Overview),
        false,
        || Action::Silence,
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
        &[KeyCode::Left, KeyCode::Char('h')],
        "←/→",
        "move the cursor (values at one time; Esc hides it)",
        Scope::Tab(Tab::Duplicates),
        true,
        || Action::Left,
    ),
    b(
        &[KeyCode::Right, KeyCode::Char('l')],
        "→",
        "cursor right",
        Scope::Tab(Tab::Duplicates),
        false,
        || Action::Right,
    ),
    b(
        &[KeyCode::Char('g')],
        "g",
        "log scale / clamped linear scale",
        Scope::Tab(Tab::Duplicates),
        true,
        || Action::ToggleLogScale,
    ),
    b(
        &[KeyCode::Char('x')],
        "x",
        "hide / show drill markers",
        Scope::Tab(Tab::Duplicates),
        true,
        || Action::ToggleMarkerKind("drill"),
    ),
    b(
        &[KeyCode::Char('d')],
        "d",
        "hide / show deploy markers",
        Scope::Tab(Tab::Duplicates),
        false,
        || Action::ToggleMarkerKind("deploy"),
    ),
    b(
        &[KeyCode::Char('r')],
        "r",
        "hide / show restart markers",
        Scope::Tab(Tab::Duplicates),
        false,
        || Action::ToggleMarkerKind("restart"),
    ),
    b(
        &[KeyCode::Char('u')],
        "u",
        "hide / show manual markers",
        Scope::Tab(Tab::Duplicates),
        false,
        || Action::ToggleMarkerKind("manual"),
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
        &[KeyCode::Char('n')],
        "n",
        "mode: idempotent / naive / seen-set",
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
        &[KeyCode::Enter],
        "Enter",
        "open the dead letter: raw bytes, reason, detail",
        Scope::List(Tab::Tables, ListId::DeadLetters),
        true,
        || Action::Enter,
    ),
    b(
        &[KeyCode::Char('p')],
        "p",
        "replay the open dead letter to its consumer's queue (asks first)",
        Scope::Tab(Tab::Tables),
        false,
        || Action::ReplayDeadLetter,
    ),
];

/// Is `binding` active in the app's current context?
pub fn active(binding: &Binding, app: &App) -> bool {
    match binding.scope {
        Scope::Global => true,
        Scope::Tab(t) => t == app.tab,
        Scope::Demo => app.demo,
        Scope::List(t, list) => t == app.tab && app.focused() == Some(list),
    }
}

/// The action for a key press, if any. Text entry (the filter prompt) takes every
/// printable key first; Ctrl-C always quits.
pub fn action_for(key: KeyEvent, app: &App) -> Option<Action> {
    if key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c') {
        return Some(Action::Quit);
    }
    if app.prompt.is_some() {
        return match key.code {
            KeyCode::Enter => Some(Action::PromptDone),
            KeyCode::Esc => Some(Action::Back),
            KeyCode::Backspace => Some(Action::PromptBackspace),
            KeyCode::Char(c) => Some(Action::PromptInput(c)),
            _ => None,
        };
    }
    // A question on screen takes `y` (run the drill, replay the dead letter).
    let replay_asked = app.raw.as_ref().is_some_and(|r| r.confirm_replay);
    if key.code == KeyCode::Char('y') && (app.drills.confirming || replay_asked) {
        return Some(Action::Confirm);
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
            .filter(|b| match b.scope {
                Scope::Tab(t) | Scope::List(t, _) => t == tab,
                _ => false,
            })
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
