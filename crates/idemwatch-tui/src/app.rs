//! The dashboard's one state and its one `update`. Rendering only reads it; the
//! event loop performs the [`Effect`]s it returns.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::action::{Action, Effect, Prompt, PromptKind};
use super::lists::{self, ListId, ListState};
use super::tab::{tab_spans, Tab, COMPACT_WIDTH};
use idemwatch_drills::twice::TwiceCheck;
use idemwatch_drills::{DrillReport, Scenario};
use idemwatch_engine::consumers::ConsumerMode;
use idemwatch_monitor::alerts::AlertObject;
use idemwatch_monitor::markers::{MarkerSource, TimelineMarker};
use idemwatch_monitor::{MonitorCommand, Snapshot};

/// Rows PgUp/PgDn move (render is pure and does not report its heights).
pub const PAGE: isize = 10;
/// Steps of the chart cursor across the window.
pub const CURSOR_STEPS: u16 = 120;

/// Which rates the Overview shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RateWindow {
    /// Means over the last minute (the default: steady, and what the alerts read).
    #[default]
    OneMinute,
    FiveMinutes,
    /// The last poll's rate: jumpy, on demand.
    LastPoll,
}

impl RateWindow {
    pub fn label(self) -> &'static str {
        match self {
            RateWindow::OneMinute => "1 min",
            RateWindow::FiveMinutes => "5 min",
            RateWindow::LastPoll => "last poll",
        }
    }

    /// A consumer's duplicate ratio over this window: one reading for the Overview's
    /// `dup %` column and the chart's legend, so the two never disagree.
    pub fn duplicate_ratio(self, c: &idemwatch_monitor::targets::ConsumerStatus) -> Option<f64> {
        match self {
            RateWindow::OneMinute => c.window_1m.duplicate_ratio,
            RateWindow::FiveMinutes => c.window_5m.duplicate_ratio,
            RateWindow::LastPoll => c.duplicate_ratio,
        }
    }

    fn next(self) -> RateWindow {
        match self {
            RateWindow::OneMinute => RateWindow::FiveMinutes,
            RateWindow::FiveMinutes => RateWindow::LastPoll,
            RateWindow::LastPoll => RateWindow::OneMinute,
        }
    }
}

/// The Drills tab: what is picked, what runs, what came out.
#[derive(Debug, Clone, Default)]
pub struct DrillsView {
    pub mode: ConsumerMode,
    /// Waiting for `y` to run the selected drill.
    pub confirming: bool,
    pub running: Option<RunningDrill>,
    pub last: Option<Result<Box<DrillReport>, String>>,
    /// The verdict's lines scrolled past (every check stays reachable).
    pub verdict_scroll: u16,
}

#[derive(Debug, Clone)]
pub struct RunningDrill {
    pub scenario: Scenario,
    pub mode: ConsumerMode,
    pub started: DateTime<Utc>,
    pub progress: Vec<String>,
}

/// The Vehicles tab: when open, one vehicle's detail.
#[derive(Debug, Clone, Default)]
pub struct VehiclesView {
    /// The device whose state and history are shown.
    pub open: Option<String>,
}

/// The Duplicates chart's view.
#[derive(Debug, Clone, Default)]
pub struct ChartView {
    /// None = every consumer, Some(i) = the i-th chart.
    pub consumer: Option<usize>,
    /// Marker kinds hidden from the marker lane.
    pub hidden_kinds: BTreeSet<String>,
    /// Log scale instead of the clamped linear one.
    pub log: bool,
    /// The inspected column, in [`CURSOR_STEPS`] from the left edge.
    pub cursor: Option<u16>,
}

/// The Tables tab's dead letter opened to its raw bytes.
#[derive(Debug, Clone, Default)]
pub struct RawView {
    pub id: i64,
    pub scroll: u16,
    /// `p` asked "replay it?"; `y` replays, Esc cancels.
    pub confirm_replay: bool,
}

#[derive(Debug, Clone)]
pub struct App {
    pub tab: Tab,
    /// The newest snapshot, or the one frozen on screen.
    pub snapshot: Option<Arc<Snapshot>>,
    /// When `f` froze the display (wall clock); None while live.
    pub frozen_at: Option<DateTime<Utc>>,
    /// Polls that arrived while frozen (shown, not applied).
    pub missed_while_frozen: u64,
    /// The help overlay and how far it is scrolled.
    pub help: Option<u16>,
    pub filter: String,
    /// A line being typed (filter, vehicle id, marker label).
    pub prompt: Option<Prompt>,
    /// A live demo: shows the banner and enables `D`.
    pub demo: bool,
    /// Drills may run against the watched database (the demo, or `allow_live`).
    pub drills_allowed: bool,
    /// Manual markers added in this session (shown even when the database is
    /// read-only for the dashboard).
    pub local_markers: Vec<TimelineMarker>,
    pub banner: Option<String>,
    /// "now" for relative times; the event loop sets it, tests fix it.
    pub now: DateTime<Utc>,
    /// The terminal's size (clicks on the header, compact layouts).
    pub width: u16,
    pub height: u16,
    pub rate_window: RateWindow,
    pub chart: ChartView,
    pub vehicles: VehiclesView,
    pub drills: DrillsView,
    pub raw: Option<RawView>,
    pub inventory: Option<Vec<TwiceCheck>>,
    /// Per list: selection (by identity) and sort.
    pub lists: BTreeMap<ListId, ListState>,
    /// Per tab: the list that keys act on.
    pub focus: BTreeMap<Tab, ListId>,
    /// Alerts acknowledged (kept, dimmed, out of the badge) and silenced (hidden)
    /// for this session, by [`idemwatch_monitor::alerts::Alert::key`].
    pub acked: BTreeSet<String>,
    pub silenced: BTreeSet<String>,
    /// One line of feedback (marker added, drill refused…).
    pub status: Option<String>,
    pub should_quit: bool,
}

static NO_LIST: ListState = ListState {
    selected: None,
    sort: 0,
    reversed: false,
};

impl App {
    pub fn new(now: DateTime<Utc>, demo: bool, banner: Option<String>) -> App {
        App {
            tab: Tab::Overview,
            snapshot: None,
            frozen_at: None,
            missed_while_frozen: 0,
            help: None,
            filter: String::new(),
            prompt: None,
            demo,
            drills_allowed: demo,
            local_markers: Vec::new(),
            banner,
            now,
            width: 160,
            height: 45,
            rate_window: RateWindow::default(),
            chart: ChartView::default(),
            vehicles: VehiclesView::default(),
            drills: DrillsView::default(),
            raw: None,
            inventory: None,
            lists: BTreeMap::new(),
            focus: BTreeMap::new(),
            acked: BTreeSet::new(),
            silenced: BTreeSet::new(),
            status: None,
            should_quit: false,
        }
    }

    /// Under [`COMPACT_WIDTH`] columns.
    pub fn compact(&self) -> bool {
        self.width < COMPACT_WIDTH
    }

    pub fn frozen(&self) -> bool {
        self.frozen_at.is_some()
    }

    /// Does `text` pass the `/` filter?
    pub fn matches(&self, text: &str) -> bool {
        self.filter.is_empty() || text.to_lowercase().contains(&self.filter.to_lowercase())
    }

    pub fn list(&self, id: ListId) -> &ListState {
        self.lists.get(&id).unwrap_or(&NO_LIST)
    }

    fn list_mut(&mut self, id: ListId) -> &mut ListState {
        self.lists.entry(id).or_default()
    }

    /// The list keys act on in the current tab (the open vehicle's history while
    /// one is open).
    pub fn focused(&self) -> Option<ListId> {
        if self.tab == Tab::Vehicles && self.vehicles.open.is_some() {
            return Some(ListId::History);
        }
        let lists = ListId::of(self.tab);
        self.focus
            .get(&self.tab)
            .copied()
            .filter(|f| lists.contains(f))
            .or_else(|| lists.first().copied())
    }

    /// The selected scenario of the Drills tab.
    pub fn scenario(&self) -> Scenario {
        self.list(ListId::Scenarios)
            .selected
            .as_deref()
            .and_then(|k| Scenario::ALL.iter().find(|s| s.as_str() == k))
            .copied()
            .unwrap_or(Scenario::ALL[0])
    }

    /// Consumers charted on the Duplicates tab, in snapshot order.
    pub fn chart_names(&self) -> Vec<String> {
        self.snapshot
            .as_ref()
            .map(|s| {
                s.charts
                    .iter()
                    .map(|c| format!("{}/{}", c.target, c.consumer))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Incident alerts not acknowledged or silenced: (critical, warning), for the
    /// header badge on every tab.
    pub fn alert_badge(&self) -> (usize, usize) {
        let Some(s) = &self.snapshot else {
            return (0, 0);
        };
        s.alerts
            .iter()
            .filter(|a| {
                a.is_incident()
                    && !self.acked.contains(&a.key())
                    && !self.silenced.contains(&a.key())
            })
            .fold((0, 0), |(c, w), a| match a.severity {
                idemwatch_monitor::alerts::Severity::Critical => (c + 1, w),
                idemwatch_monitor::alerts::Severity::Warning => (c, w + 1),
            })
    }

    /// Apply one action. Returns the I/O to perform. One line per action: what an
    /// action does beyond a line is a method of its own below.
    pub fn update(&mut self, action: Action) -> Vec<Effect> {
        let mut effects = Vec::new();
        match action {
            Action::Quit => self.should_quit = true,
            Action::NextTab => self.switch(self.tab.offset(1)),
            Action::PrevTab => self.switch(self.tab.offset(-1)),
            Action::GoTo(t) => self.switch(t),
            Action::ToggleHelp => self.help = if self.help.is_some() { None } else { Some(0) },
            Action::ToggleFreeze => effects.extend(self.toggle_freeze()),
            Action::StartPrompt(kind) => self.start_prompt(kind),
            Action::PromptInput(c) => self.edit_prompt(|text| text.push(c)),
            Action::PromptBackspace => self.edit_prompt(|text| {
                text.pop();
            }),
            Action::PromptDone => effects.extend(self.prompt_done()),
            Action::Back => effects.extend(self.back()),
            Action::ZoomIn => effects.push(Effect::Monitor(MonitorCommand::ZoomIn)),
            Action::ZoomOut => effects.push(Effect::Monitor(MonitorCommand::ZoomOut)),
            Action::Up | Action::ScrollUp => self.scroll(-1),
            Action::Down | Action::ScrollDown => self.scroll(1),
            Action::PageUp => self.scroll(-PAGE),
            Action::PageDown => self.scroll(PAGE),
            Action::Home => self.scroll(isize::MIN / 2),
            Action::End => self.scroll(isize::MAX / 2),
            Action::Left => self.sideways(-1),
            Action::Right => self.sideways(1),
            Action::Sort => self.next_sort(),
            Action::SortReverse => self.reverse_sort(),
            Action::Enter => effects.extend(self.enter()),
            Action::CycleConsumer => self.cycle_consumer(),
            Action::ToggleMarkerKind(kind) => self.toggle_marker_kind(kind),
            Action::ToggleLogScale => self.chart.log = !self.chart.log,
            Action::CycleRateWindow => self.rate_window = self.rate_window.next(),
            Action::ToggleDrillMode => self.next_drill_mode(),
            Action::Confirm => effects.extend(self.confirm()),
            Action::ReplayDeadLetter => self.ask_replay(),
            Action::Acknowledge => self.mark_alert(false),
            Action::Silence => self.mark_alert(true),
            Action::Copy => effects.extend(self.copy()),
            Action::Export => effects.push(Effect::Export),
            Action::Deploy => effects.extend(self.deploy()),
            Action::Click { column, row } => self.click(column, row),
            Action::Resize { width, height } => effects.extend(self.resize(width, height)),
            Action::Snapshot(snapshot) => self.take_snapshot(snapshot),
            Action::DrillProgress(line) => self.drill_progress(line),
            Action::DrillFinished(result) => effects.push(self.drill_finished(result)),
            Action::TwiceChecked(checks) => self.inventory = Some(checks),
            Action::Status(line) => self.status = Some(line),
            Action::Tick(now) => {
                if !self.frozen() {
                    self.now = now.max(self.now);
                }
            }
        }
        effects
    }

    /// Freeze the screen (snapshots are counted, not shown), or thaw it and poll now.
    fn toggle_freeze(&mut self) -> Option<Effect> {
        self.missed_while_frozen = 0;
        match self.frozen_at.take() {
            Some(_) => Some(Effect::Monitor(MonitorCommand::PollNow)),
            None => {
                self.frozen_at = Some(self.now);
                None
            }
        }
    }

    fn start_prompt(&mut self, kind: PromptKind) {
        self.help = None;
        self.prompt = Some(Prompt {
            kind,
            text: String::new(),
        });
    }

    /// Edit the open prompt's text; the filter follows its prompt as it is typed.
    fn edit_prompt(&mut self, edit: impl FnOnce(&mut String)) {
        if let Some(p) = &mut self.prompt {
            edit(&mut p.text);
            if p.kind == PromptKind::Filter {
                self.filter = p.text.clone();
            }
        }
    }

    /// The focused list by its next column (`s`), ascending again.
    fn next_sort(&mut self) {
        if let Some(id) = self.focused() {
            let n = id.sorts().len();
            let l = self.list_mut(id);
            l.sort = (l.sort + 1) % n;
            l.reversed = false;
            self.status = Some(format!("{} sorted by {}", id.title(), id.sorts()[l.sort]));
        }
    }

    fn reverse_sort(&mut self) {
        if let Some(id) = self.focused() {
            let l = self.list_mut(id);
            l.reversed = !l.reversed;
        }
    }

    /// The chart's consumer: all, then each one, then all again.
    fn cycle_consumer(&mut self) {
        let n = self.chart_names().len();
        self.chart.consumer = match self.chart.consumer {
            None if n > 0 => Some(0),
            Some(i) if i + 1 < n => Some(i + 1),
            _ => None,
        };
    }

    fn toggle_marker_kind(&mut self, kind: &'static str) {
        if !self.chart.hidden_kinds.remove(kind) {
            self.chart.hidden_kinds.insert(kind.to_string());
        }
    }

    /// idempotent → naive → seen-set → idempotent; a pending confirmation is for
    /// the old mode, so it goes.
    fn next_drill_mode(&mut self) {
        self.drills.mode = match self.drills.mode {
            ConsumerMode::Idempotent => ConsumerMode::Naive,
            ConsumerMode::Naive => ConsumerMode::SeenSet,
            ConsumerMode::SeenSet => ConsumerMode::Idempotent,
        };
        self.drills.confirming = false;
    }

    /// `D`: a simulated deploy, in the demo only.
    fn deploy(&mut self) -> Option<Effect> {
        if !self.demo {
            return None;
        }
        self.status = Some("simulated deploy: consumers restart mid-flight".into());
        Some(Effect::Deploy)
    }

    /// A click on the tab bar switches to the tab under it.
    fn click(&mut self, column: u16, row: u16) {
        if row != 0 {
            return;
        }
        if let Some(i) = tab_spans(self.width, self.tab)
            .iter()
            .position(|(a, b)| (*a..=*b).contains(&column))
        {
            self.switch(Tab::ALL[i]);
        }
    }

    /// A new terminal size; a new width changes how many points the chart needs.
    fn resize(&mut self, width: u16, height: u16) -> Option<Effect> {
        let columns = (width != self.width)
            .then(|| Effect::Monitor(MonitorCommand::ChartColumns(chart_columns(width))));
        self.width = width;
        self.height = height;
        columns
    }

    /// A poll's snapshot: shown, unless the screen is frozen (then only counted).
    fn take_snapshot(&mut self, snapshot: Arc<Snapshot>) {
        if self.frozen() {
            self.missed_while_frozen += 1;
        } else {
            self.now = snapshot.taken_at;
            self.snapshot = Some(snapshot);
            self.clamp_selections();
        }
    }

    /// A running drill's progress line; the last 200 are kept.
    fn drill_progress(&mut self, line: String) {
        if let Some(r) = &mut self.drills.running {
            r.progress.push(line);
            let excess = r.progress.len().saturating_sub(200);
            r.progress.drain(..excess);
        }
    }

    /// A drill's end: its verdict on the status line and in the panel, and a poll
    /// now so its run and marker show at once.
    fn drill_finished(&mut self, result: Result<Box<DrillReport>, String>) -> Effect {
        self.drills.running = None;
        self.drills.verdict_scroll = 0;
        self.status = Some(match &result {
            Ok(r) => format!(
                "drill {} ({}): {}",
                r.scenario,
                r.mode.as_str(),
                r.verdict.as_str()
            ),
            Err(e) => format!("drill failed to run: {e}"),
        });
        self.drills.last = Some(result);
        Effect::Monitor(MonitorCommand::PollNow)
    }

    fn switch(&mut self, tab: Tab) {
        self.tab = tab;
        self.help = None;
        self.drills.confirming = false;
    }

    fn prompt_done(&mut self) -> Vec<Effect> {
        let Some(p) = self.prompt.take() else {
            return Vec::new();
        };
        let text = p.text.trim().to_string();
        match p.kind {
            PromptKind::Filter => Vec::new(),
            PromptKind::VehicleId if !text.is_empty() => {
                self.tab = Tab::Vehicles;
                self.open_vehicle(text)
            }
            PromptKind::MarkerLabel if !text.is_empty() => self.add_marker(text),
            _ => Vec::new(),
        }
    }

    fn add_marker(&mut self, label: String) -> Vec<Effect> {
        self.status = Some(format!("marker \"{label}\" added"));
        if self.demo {
            // The demo's own database takes the marker; it comes back with the next
            // poll like any other.
            return vec![Effect::AddMarker { label }];
        }
        // The dashboard only reads a watched system: keep the marker here.
        self.local_markers.push(TimelineMarker {
            at: self.now,
            kind: "manual".into(),
            label,
            detail: Some("added in this session".into()),
            source: MarkerSource::Database,
        });
        Vec::new()
    }

    fn open_vehicle(&mut self, device: String) -> Vec<Effect> {
        self.list_mut(ListId::History).selected = None;
        self.vehicles.open = Some(device.clone());
        vec![Effect::Monitor(MonitorCommand::SelectVehicle(Some(device)))]
    }

    fn back(&mut self) -> Vec<Effect> {
        if let Some(p) = self.prompt.take() {
            if p.kind == PromptKind::Filter {
                self.filter.clear();
            }
        } else if self.help.is_some() {
            self.help = None;
        } else if self.drills.confirming {
            self.drills.confirming = false;
        } else if let Some(raw) = self.raw.as_mut().filter(|r| r.confirm_replay) {
            raw.confirm_replay = false;
            self.status = Some("replay cancelled".into());
        } else if self.raw.is_some() && self.tab == Tab::Tables {
            self.raw = None;
            return vec![Effect::Monitor(MonitorCommand::OpenDeadLetter(None))];
        } else if self.vehicles.open.is_some() && self.tab == Tab::Vehicles {
            self.vehicles.open = None;
            return vec![Effect::Monitor(MonitorCommand::SelectVehicle(None))];
        } else if self.tab == Tab::Duplicates && self.chart.cursor.is_some() {
            self.chart.cursor = None;
        } else if !self.filter.is_empty() {
            self.filter.clear();
        }
        Vec::new()
    }

    /// Up/down by `by` rows in whatever has the keys: help, the raw view, the
    /// verdict, the focused list.
    fn scroll(&mut self, by: isize) {
        let shift = |v: u16| -> u16 { (v as isize + by).clamp(0, 10_000) as u16 };
        if let Some(h) = self.help {
            self.help = Some(shift(h));
            return;
        }
        if let Some(raw) = self.raw.as_mut().filter(|_| self.tab == Tab::Tables) {
            raw.scroll = shift(raw.scroll);
            return;
        }
        if self.tab == Tab::Drills && self.focused() == Some(ListId::Scenarios) {
            if by.abs() >= PAGE {
                // PgUp/PgDn/Home/End scroll the verdict; ↑/↓ pick the scenario.
                self.drills.verdict_scroll = shift(self.drills.verdict_scroll);
                return;
            }
            if self.drills.running.is_some() || self.drills.confirming {
                return;
            }
        }
        if let Some(id) = self.focused() {
            self.move_selection(id, by);
        }
    }

    fn move_selection(&mut self, id: ListId, by: isize) {
        let keys = lists::keys(self, id);
        if keys.is_empty() {
            return;
        }
        let current = self
            .list(id)
            .selected
            .as_ref()
            .and_then(|k| keys.iter().position(|x| x == k))
            // The scenario list always shows one picked: the first.
            .or((id == ListId::Scenarios).then_some(0));
        let next = match current {
            None if by < 0 => keys.len() - 1,
            None => 0,
            Some(i) => (i as isize + by).clamp(0, keys.len() as isize - 1) as usize,
        };
        self.list_mut(id).selected = Some(keys[next].clone());
        if id == ListId::Scenarios {
            self.drills.confirming = false;
            self.drills.verdict_scroll = 0;
        }
    }

    /// ←/→: the chart cursor on the Duplicates tab, else the next panel.
    fn sideways(&mut self, by: i16) {
        if self.tab == Tab::Duplicates {
            let at = self.chart.cursor.unwrap_or(CURSOR_STEPS) as i16;
            self.chart.cursor = Some((at + by).clamp(0, CURSOR_STEPS as i16) as u16);
            return;
        }
        let lists = ListId::of(self.tab);
        if lists.len() < 2 || self.raw.is_some() {
            return;
        }
        let i = self
            .focused()
            .and_then(|f| lists.iter().position(|l| *l == f))
            .unwrap_or(0);
        let next = lists[(i as isize + by as isize).rem_euclid(lists.len() as isize) as usize];
        self.focus.insert(self.tab, next);
    }

    fn enter(&mut self) -> Vec<Effect> {
        match (self.tab, self.focused()) {
            (Tab::Overview, Some(ListId::Alerts)) => self.jump_to_alert(),
            (Tab::Overview, Some(ListId::Consumers)) => {
                // Open the consumer's duplicate-rate chart.
                let Some(key) = self.list(ListId::Consumers).selected.clone() else {
                    return Vec::new();
                };
                self.chart.consumer = self.chart_names().iter().position(|n| *n == key);
                self.switch(Tab::Duplicates);
                Vec::new()
            }
            (Tab::Vehicles, Some(ListId::Anomalies)) => {
                let selected = self.list(ListId::Anomalies).selected.clone();
                let device = selected
                    .as_deref()
                    .and_then(|k| k.split('|').next())
                    .map(str::to_string);
                match device {
                    Some(d) => self.open_vehicle(d),
                    None => Vec::new(),
                }
            }
            (Tab::Drills, Some(ListId::Scenarios)) => {
                if !self.drills_allowed {
                    self.status = Some(
                        "drills against a configured system are off: set [drills] allow_live = true".into(),
                    );
                } else if self.drills.running.is_some() {
                    self.status = Some("a drill is already running".into());
                } else {
                    self.drills.confirming = true;
                }
                Vec::new()
            }
            (Tab::Tables, Some(ListId::DeadLetters)) if self.raw.is_none() => {
                let Some(id) = self
                    .list(ListId::DeadLetters)
                    .selected
                    .as_deref()
                    .and_then(|k| k.parse::<i64>().ok())
                else {
                    return Vec::new();
                };
                self.raw = Some(RawView {
                    id,
                    ..RawView::default()
                });
                vec![Effect::Monitor(MonitorCommand::OpenDeadLetter(Some(id)))]
            }
            _ => Vec::new(),
        }
    }

    /// Enter on an alert: its tab, and its row there.
    fn jump_to_alert(&mut self) -> Vec<Effect> {
        let Some(key) = self.list(ListId::Alerts).selected.clone() else {
            return Vec::new();
        };
        let Some(alert) = self
            .snapshot
            .as_ref()
            .and_then(|s| s.alerts.iter().find(|a| a.key() == key))
            .cloned()
        else {
            return Vec::new();
        };
        self.status = Some(format!("from alert: {}", alert.message));
        match alert.object {
            AlertObject::Target { target } => {
                let first = lists::consumers(self)
                    .rows
                    .iter()
                    .find(|(_, c)| c.target == target)
                    .map(|(k, _)| k.clone());
                self.focus.insert(Tab::Overview, ListId::Consumers);
                self.list_mut(ListId::Consumers).selected = first;
                Vec::new()
            }
            AlertObject::Consumer { target, consumer }
            | AlertObject::Deploy {
                target, consumer, ..
            } => {
                let name = format!("{target}/{consumer}");
                self.chart.consumer = self.chart_names().iter().position(|n| *n == name);
                self.list_mut(ListId::Consumers).selected = Some(name);
                self.switch(Tab::Duplicates);
                Vec::new()
            }
            AlertObject::Database => {
                self.switch(Tab::Tables);
                Vec::new()
            }
            AlertObject::Claim {
                consumer,
                message_key,
            } => {
                self.switch(Tab::Tables);
                self.focus.insert(Tab::Tables, ListId::Claims);
                self.list_mut(ListId::Claims).selected = Some(format!("{consumer}|{message_key}"));
                Vec::new()
            }
            AlertObject::DeadLetters { consumer, reason } => {
                self.jump_to_dead_letters(&consumer, &reason)
            }
            AlertObject::Device { device_id } => {
                self.switch(Tab::Vehicles);
                self.open_vehicle(device_id)
            }
        }
    }

    /// An alert about a consumer's dead letters of one reason: the newest of them
    /// selected on the Tables tab, or opened by id when it is older than the
    /// listed page.
    fn jump_to_dead_letters(&mut self, consumer: &str, reason: &str) -> Vec<Effect> {
        self.switch(Tab::Tables);
        self.raw = None;
        self.focus.insert(Tab::Tables, ListId::DeadLetters);
        let listed = lists::dead_letters(self)
            .rows
            .iter()
            .filter(|(_, d)| d.consumer == consumer && d.reason == reason)
            .max_by_key(|(_, d)| d.id)
            .map(|(k, _)| k.clone());
        if listed.is_some() {
            self.list_mut(ListId::DeadLetters).selected = listed;
            return Vec::new();
        }
        // Older than the newest ones listed (a burst of other dead letters
        // came after it): its group knows its id, and it opens by id.
        let newest_id = self
            .snapshot
            .as_ref()
            .and_then(|s| s.database.as_ref())
            .and_then(|d| {
                d.dead_letters
                    .iter()
                    .find(|g| g.consumer == consumer && g.reason == reason)
            })
            .and_then(|g| g.newest_id);
        let Some(id) = newest_id else {
            return Vec::new();
        };
        self.list_mut(ListId::DeadLetters).selected = Some(id.to_string());
        self.status = Some(format!(
            "from alert: dead letter #{id} ({consumer} {reason}) is older than the listed ones: opened by id"
        ));
        self.raw = Some(RawView {
            id,
            ..RawView::default()
        });
        vec![Effect::Monitor(MonitorCommand::OpenDeadLetter(Some(id)))]
    }

    /// `a` acknowledges (kept, out of the badge), `z` silences (hidden) the selected
    /// alert for this session.
    fn mark_alert(&mut self, silence: bool) {
        if self.tab != Tab::Overview {
            return;
        }
        let Some(key) = self.list(ListId::Alerts).selected.clone() else {
            self.status = Some("select an alert first (→ focuses the alerts)".into());
            return;
        };
        if silence {
            self.silenced.insert(key);
            self.list_mut(ListId::Alerts).selected = None;
            self.status = Some("alert silenced for this session".into());
        } else if !self.acked.remove(&key) {
            self.acked.insert(key);
            self.status = Some("alert acknowledged".into());
        }
    }

    /// `y`: the selected row's key or device id, to the terminal's clipboard.
    fn copy(&mut self) -> Vec<Effect> {
        let text = match (self.tab, self.focused()) {
            (Tab::Vehicles, Some(ListId::History)) => self.vehicles.open.clone(),
            (Tab::Vehicles, _) => self
                .list(ListId::Anomalies)
                .selected
                .as_deref()
                .and_then(|k| k.split('|').next())
                .map(str::to_string),
            (Tab::Tables, Some(ListId::Claims)) => self
                .list(ListId::Claims)
                .selected
                .as_deref()
                .and_then(|k| k.split_once('|'))
                .map(|(_, key)| key.to_string()),
            (Tab::Tables, Some(ListId::DeadLetters)) => self.selected_dead_letter_key(),
            (Tab::Overview, Some(ListId::Consumers)) => {
                self.list(ListId::Consumers).selected.clone()
            }
            (Tab::Overview, Some(ListId::Alerts)) => self.selected_alert_object(),
            _ => None,
        };
        match text {
            Some(t) => {
                self.status = Some(format!("copied {t} (OSC 52)"));
                vec![Effect::Copy(t)]
            }
            None => {
                self.status = Some("nothing to copy here".into());
                Vec::new()
            }
        }
    }

    fn selected_alert_object(&self) -> Option<String> {
        let key = self.list(ListId::Alerts).selected.as_ref()?;
        let a = self
            .snapshot
            .as_ref()?
            .alerts
            .iter()
            .find(|a| a.key() == *key)?;
        Some(match &a.object {
            AlertObject::Claim { message_key, .. } => message_key.clone(),
            AlertObject::Device { device_id } => device_id.clone(),
            other => other.label(),
        })
    }

    /// The message key of the selected dead letter (or its device id when the raw
    /// bytes do not parse that far).
    fn selected_dead_letter_key(&self) -> Option<String> {
        let id: i64 = self
            .list(ListId::DeadLetters)
            .selected
            .as_ref()?
            .parse()
            .ok()?;
        let row = self
            .snapshot
            .as_ref()?
            .database
            .as_ref()?
            .recent_dead_letters
            .iter()
            .find(|d| d.id == id)?;
        row.message_key.clone().or_else(|| row.device_id.clone())
    }

    /// `p` on an open dead letter: ask before re-publishing it.
    fn ask_replay(&mut self) {
        if self.tab != Tab::Tables {
            return;
        }
        if let Some(raw) = self.raw.as_mut() {
            raw.confirm_replay = true;
            self.status = Some(format!(
                "replay dead letter #{} to its consumer's queue (a processed message is dropped as a duplicate)? y replays, Esc cancels",
                raw.id
            ));
        }
    }

    fn confirm(&mut self) -> Vec<Effect> {
        if self.tab == Tab::Tables {
            let Some(raw) = self.raw.as_mut().filter(|r| r.confirm_replay) else {
                return Vec::new();
            };
            raw.confirm_replay = false;
            self.status = Some(format!("replaying dead letter #{}…", raw.id));
            return vec![Effect::ReplayDeadLetter(raw.id)];
        }
        if self.tab != Tab::Drills || !self.drills.confirming || self.drills.running.is_some() {
            return Vec::new();
        }
        self.drills.confirming = false;
        let scenario = self.scenario();
        let mode = self.drills.mode;
        self.drills.running = Some(RunningDrill {
            scenario,
            mode,
            started: self.now,
            progress: Vec::new(),
        });
        vec![Effect::StartDrill { scenario, mode }]
    }

    fn clamp_selections(&mut self) {
        let charts = self.chart_names().len();
        if self.chart.consumer.is_some_and(|i| i >= charts) {
            self.chart.consumer = None;
        }
    }
}

/// The chart's plotting columns in a terminal `width` wide (the panel's borders and
/// the y labels off): the monitor fits the history's step to them.
pub fn chart_columns(width: u16) -> u16 {
    width.saturating_sub(2 + super::widgets::Y_LABELS)
}

/// The lists arrange what the app holds (see [`lists::Source`]).
impl lists::Source for App {
    fn snapshot(&self) -> Option<&Snapshot> {
        self.snapshot.as_deref()
    }

    fn list(&self, id: ListId) -> &ListState {
        App::list(self, id)
    }

    fn matches(&self, text: &str) -> bool {
        App::matches(self, text)
    }

    fn silenced(&self) -> &BTreeSet<String> {
        &self.silenced
    }

    fn local_markers(&self) -> &[TimelineMarker] {
        &self.local_markers
    }

    fn open_vehicle(&self) -> Option<&String> {
        self.vehicles.open.as_ref()
    }

    fn tab(&self) -> Tab {
        self.tab
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures;
    use idemwatch_monitor::db::DeadLetterRow;

    fn app() -> App {
        App::new(DateTime::UNIX_EPOCH, true, None)
    }

    fn with_snapshot() -> App {
        let mut a = App::new(fixtures::now(), true, None);
        a.update(Action::Snapshot(Arc::new(fixtures::snapshot(
            fixtures::now(),
        ))));
        a
    }

    #[test]
    fn tabs_cycle_both_ways() {
        let mut a = app();
        a.update(Action::PrevTab);
        assert_eq!(a.tab, Tab::Inventory);
        a.update(Action::NextTab);
        a.update(Action::NextTab);
        assert_eq!(a.tab, Tab::Duplicates);
    }

    #[test]
    fn drill_runs_only_after_confirmation() {
        let mut a = app();
        a.update(Action::GoTo(Tab::Drills));
        a.update(Action::Down);
        assert!(
            a.update(Action::Confirm).is_empty(),
            "no confirmation pending"
        );
        assert!(a.update(Action::Enter).is_empty());
        assert!(a.drills.confirming);
        a.update(Action::ToggleDrillMode);
        assert!(
            !a.drills.confirming,
            "changing the mode cancels the question"
        );
        a.update(Action::Enter);
        let effects = a.update(Action::Confirm);
        assert_eq!(
            effects,
            vec![Effect::StartDrill {
                scenario: Scenario::CrashAfterSend,
                mode: ConsumerMode::Naive
            }]
        );
        assert!(a.drills.running.is_some());
        a.update(Action::Enter);
        assert!(a.update(Action::Confirm).is_empty(), "one drill at a time");
    }

    #[test]
    fn frozen_display_keeps_its_snapshot_and_says_since_when() {
        let mut a = app();
        a.update(Action::ToggleFreeze);
        assert_eq!(a.frozen_at, Some(DateTime::UNIX_EPOCH));
        let snap = Arc::new(fixtures::snapshot(DateTime::UNIX_EPOCH));
        a.update(Action::Snapshot(snap));
        assert!(a.snapshot.is_none());
        assert_eq!(a.missed_while_frozen, 1);
        assert_eq!(
            a.update(Action::ToggleFreeze),
            vec![Effect::Monitor(MonitorCommand::PollNow)]
        );
    }

    #[test]
    fn escape_closes_the_innermost_thing_first() {
        let mut a = app();
        a.update(Action::StartPrompt(PromptKind::Filter));
        a.update(Action::PromptInput('x'));
        assert_eq!(a.filter, "x");
        a.update(Action::Back);
        assert!(a.prompt.is_none() && a.filter.is_empty());
        a.update(Action::ToggleHelp);
        a.update(Action::Back);
        assert!(a.help.is_none());
    }

    #[test]
    fn clicking_a_tab_title_opens_it() {
        let mut a = app();
        let (first, _) = tab_spans(a.width, a.tab)[4];
        a.update(Action::Click {
            column: first + 2,
            row: 0,
        });
        assert_eq!(a.tab, Tab::Tables);
        a.update(Action::Click {
            column: first + 2,
            row: 5,
        });
        assert_eq!(a.tab, Tab::Tables, "only the header row switches tabs");
    }

    #[test]
    fn deploy_only_in_the_demo() {
        let mut real = App::new(DateTime::UNIX_EPOCH, false, None);
        assert!(real.update(Action::Deploy).is_empty());
        assert_eq!(app().update(Action::Deploy), vec![Effect::Deploy]);
    }

    #[test]
    fn the_selected_vehicle_stays_selected_when_a_poll_reorders_the_list() {
        let mut a = with_snapshot();
        a.update(Action::GoTo(Tab::Vehicles));
        a.update(Action::Down);
        a.update(Action::Down);
        let picked = a.list(ListId::Anomalies).selected.clone();
        let mut snap = fixtures::snapshot(fixtures::now());
        if let Some(v) = snap.database.as_mut().and_then(|d| d.vehicles.as_mut()) {
            v.anomalies.reverse();
        }
        a.update(Action::Snapshot(Arc::new(snap)));
        assert_eq!(a.list(ListId::Anomalies).selected, picked);
        let device = picked
            .as_deref()
            .and_then(|k| k.split('|').next())
            .map(str::to_string);
        let effects = a.update(Action::Enter);
        assert_eq!(a.vehicles.open, device, "Enter opens the selected device");
        assert_eq!(
            effects,
            vec![Effect::Monitor(MonitorCommand::SelectVehicle(device))]
        );
    }

    #[test]
    fn enter_on_an_alert_jumps_to_its_object() {
        let mut a = with_snapshot();
        a.update(Action::Right); // focus the alerts
        a.update(Action::Down);
        let first = a.list(ListId::Alerts).selected.clone();
        assert!(first.is_some());
        // The fixture's first alert is the claim in doubt: Tables, its row.
        a.update(Action::Enter);
        assert_eq!(a.tab, Tab::Tables);
        assert_eq!(a.focused(), Some(ListId::Claims));
        assert_eq!(
            a.list(ListId::Claims).selected.as_deref(),
            Some("zone-exit-sms|34-SIM-0003:311:zone_exit")
        );
    }

    /// A key conflict older than the newest dead letters listed (here every listed
    /// one is another reason's, as after a burst of 60 newer ones): Enter on its
    /// alert opens it by the id its group carries.
    #[test]
    fn an_alert_opens_a_dead_letter_older_than_the_listed_ones() {
        let mut snap = fixtures::snapshot(fixtures::now());
        let db = snap.database.as_mut().expect("the fixture's database");
        let template = db.recent_dead_letters[0].clone();
        db.recent_dead_letters = (100..160)
            .rev()
            .map(|id| DeadLetterRow {
                id,
                ..template.clone()
            })
            .collect();
        snap.alerts.retain(|a| {
            matches!(&a.object, AlertObject::DeadLetters { reason, .. } if reason == "key_conflict")
        });
        assert_eq!(snap.alerts.len(), 1, "the fixture's key_conflict alert");
        let mut a = App::new(fixtures::now(), true, None);
        a.update(Action::Snapshot(Arc::new(snap)));
        a.update(Action::Right); // focus the alerts
        a.update(Action::Down);
        let effects = a.update(Action::Enter);
        assert_eq!(a.tab, Tab::Tables);
        assert_eq!(
            effects,
            vec![Effect::Monitor(MonitorCommand::OpenDeadLetter(Some(7)))]
        );
        assert_eq!(a.raw.as_ref().map(|r| r.id), Some(7));
        assert_eq!(a.list(ListId::DeadLetters).selected.as_deref(), Some("7"));
    }

    #[test]
    fn acknowledged_and_silenced_alerts_leave_the_badge() {
        let mut a = with_snapshot();
        let (crit, _) = a.alert_badge();
        assert!(crit >= 2, "{crit}");
        a.update(Action::Right);
        a.update(Action::Down);
        a.update(Action::Acknowledge);
        assert_eq!(a.alert_badge().0, crit - 1);
        a.update(Action::Down);
        a.update(Action::Silence);
        assert_eq!(a.alert_badge().0, crit - 2);
        assert_eq!(lists::alerts(&a).rows.len(), lists::alerts(&a).total);
    }

    #[test]
    fn a_marker_asks_for_its_label() {
        let mut a = App::new(fixtures::now(), false, None);
        a.update(Action::StartPrompt(PromptKind::MarkerLabel));
        for c in "db failover".chars() {
            a.update(Action::PromptInput(c));
        }
        a.update(Action::PromptDone);
        assert_eq!(a.local_markers.len(), 1);
        assert_eq!(a.local_markers[0].label, "db failover");
    }

    #[test]
    fn help_scrolls() {
        let mut a = app();
        a.update(Action::ToggleHelp);
        a.update(Action::PageDown);
        a.update(Action::Down);
        assert_eq!(a.help, Some(PAGE as u16 + 1));
        a.update(Action::Home);
        assert_eq!(a.help, Some(0));
    }
}
