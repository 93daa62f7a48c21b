//! The dashboard's one state and its one `update`. Rendering only reads it; the
//! event loop performs the [`Effect`]s it returns.

use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::action::{Action, Effect};
use super::tab::{tab_spans, Tab};
use crate::drills::twice::TwiceCheck;
use crate::drills::{DrillReport, Scenario};
use crate::engine::consumers::ConsumerMode;
use crate::monitor::{MonitorCommand, Snapshot};

/// The Drills tab: what is picked, what runs, what came out.
#[derive(Debug, Clone, Default)]
pub struct DrillsView {
    pub selected: usize,
    pub mode: ConsumerMode,
    /// Waiting for `y` to run the selected drill.
    pub confirming: bool,
    pub running: Option<RunningDrill>,
    pub last: Option<Result<Box<DrillReport>, String>>,
}

#[derive(Debug, Clone)]
pub struct RunningDrill {
    pub scenario: Scenario,
    pub mode: ConsumerMode,
    pub started: DateTime<Utc>,
    pub progress: Vec<String>,
}

impl DrillsView {
    pub fn scenario(&self) -> Scenario {
        Scenario::ALL[self.selected.min(Scenario::ALL.len() - 1)]
    }
}

/// The Vehicles tab: the anomaly list and, when open, one vehicle's detail.
#[derive(Debug, Clone, Default)]
pub struct VehiclesView {
    pub selected: usize,
    /// The device whose state and history are shown.
    pub open: Option<String>,
}

#[derive(Debug, Clone)]
pub struct App {
    pub tab: Tab,
    /// The newest snapshot, or the one frozen on screen.
    pub snapshot: Option<Arc<Snapshot>>,
    pub frozen: bool,
    /// Polls that arrived while frozen (shown, not applied).
    pub missed_while_frozen: u64,
    pub show_help: bool,
    pub filter: String,
    pub filter_editing: bool,
    /// A live demo: shows the banner and enables `D`.
    pub demo: bool,
    /// Drills may run against the watched database (the demo, or `allow_live`).
    pub drills_allowed: bool,
    /// Manual markers added in this session (shown even when the database is
    /// read-only for the dashboard).
    pub local_markers: Vec<crate::monitor::markers::TimelineMarker>,
    pub banner: Option<String>,
    /// "now" for relative times; the event loop sets it, tests fix it.
    pub now: DateTime<Utc>,
    /// Duplicates tab: None = every consumer, Some(i) = the i-th.
    pub chart_consumer: Option<usize>,
    pub vehicles: VehiclesView,
    pub drills: DrillsView,
    pub tables_scroll: u16,
    pub inventory: Option<Vec<TwiceCheck>>,
    /// One line of feedback (marker added, drill refused…).
    pub status: Option<String>,
    pub should_quit: bool,
}

impl App {
    pub fn new(now: DateTime<Utc>, demo: bool, banner: Option<String>) -> App {
        App {
            tab: Tab::Overview,
            snapshot: None,
            frozen: false,
            missed_while_frozen: 0,
            show_help: false,
            filter: String::new(),
            filter_editing: false,
            demo,
            drills_allowed: demo,
            local_markers: Vec::new(),
            banner,
            now,
            chart_consumer: None,
            vehicles: VehiclesView::default(),
            drills: DrillsView::default(),
            tables_scroll: 0,
            inventory: None,
            status: None,
            should_quit: false,
        }
    }

    /// Does `text` pass the `/` filter?
    pub fn matches(&self, text: &str) -> bool {
        self.filter.is_empty() || text.to_lowercase().contains(&self.filter.to_lowercase())
    }

    /// Devices in the anomaly list, filtered, in display order.
    pub fn anomaly_devices(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        if let Some(v) = self
            .snapshot
            .as_ref()
            .and_then(|s| s.database.as_ref())
            .and_then(|d| d.vehicles.as_ref())
        {
            for a in &v.anomalies {
                let d = a.device_id().to_string();
                if self.matches(&d) && !out.contains(&d) {
                    out.push(d);
                }
            }
        }
        out
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

    /// Apply one action. Returns the I/O to perform.
    pub fn update(&mut self, action: Action) -> Vec<Effect> {
        let mut effects = Vec::new();
        match action {
            Action::Quit => self.should_quit = true,
            Action::NextTab => self.switch(self.tab.offset(1)),
            Action::PrevTab => self.switch(self.tab.offset(-1)),
            Action::GoTo(t) => self.switch(t),
            Action::ToggleHelp => self.show_help = !self.show_help,
            Action::ToggleFreeze => {
                self.frozen = !self.frozen;
                self.missed_while_frozen = 0;
                if !self.frozen {
                    effects.push(Effect::Monitor(MonitorCommand::PollNow));
                }
            }
            Action::AddMarker => {
                let label = format!("manual marker {}", self.now.format("%H:%M:%S"));
                self.status = Some(format!("added \"{label}\""));
                if self.demo {
                    // The demo's own database takes the marker; it comes back with the
                    // next poll like any other.
                    effects.push(Effect::AddMarker { label });
                } else {
                    // The dashboard only reads a watched system: keep the marker here.
                    self.local_markers
                        .push(crate::monitor::markers::TimelineMarker {
                            at: self.now,
                            kind: "manual".into(),
                            label,
                            detail: None,
                            source: crate::monitor::markers::MarkerSource::Database,
                        });
                }
            }
            Action::StartFilter => {
                self.filter_editing = true;
                self.show_help = false;
            }
            Action::FilterInput(c) => self.filter.push(c),
            Action::FilterBackspace => {
                self.filter.pop();
            }
            Action::FilterDone => self.filter_editing = false,
            Action::Back => self.back(),
            Action::ZoomIn => effects.push(Effect::Monitor(MonitorCommand::ZoomIn)),
            Action::ZoomOut => effects.push(Effect::Monitor(MonitorCommand::ZoomOut)),
            Action::Up => self.move_selection(-1),
            Action::Down => self.move_selection(1),
            Action::ScrollUp => self.move_selection(-1),
            Action::ScrollDown => self.move_selection(1),
            Action::Enter => effects.extend(self.enter()),
            Action::CycleConsumer => {
                let n = self.chart_names().len();
                self.chart_consumer = match self.chart_consumer {
                    None if n > 0 => Some(0),
                    Some(i) if i + 1 < n => Some(i + 1),
                    _ => None,
                };
            }
            Action::ToggleDrillMode => {
                self.drills.mode = match self.drills.mode {
                    ConsumerMode::Naive => ConsumerMode::Idempotent,
                    _ => ConsumerMode::Naive,
                };
                self.drills.confirming = false;
            }
            Action::Confirm => effects.extend(self.confirm_drill()),
            Action::Deploy => {
                if self.demo {
                    self.status = Some("simulated deploy: consumers restart mid-flight".into());
                    effects.push(Effect::Deploy);
                }
            }
            Action::Click { column, row } => {
                if row == 0 {
                    if let Some(i) = tab_spans()
                        .iter()
                        .position(|(a, b)| (*a..=*b).contains(&column))
                    {
                        self.switch(Tab::ALL[i]);
                    }
                }
            }
            // Nothing to keep: the next frame lays itself out for the new size.
            Action::Resize => {}
            Action::Snapshot(snapshot) => {
                if self.frozen {
                    self.missed_while_frozen += 1;
                } else {
                    self.now = snapshot.taken_at;
                    self.snapshot = Some(snapshot);
                    self.clamp_selections();
                }
            }
            Action::DrillProgress(line) => {
                if let Some(r) = &mut self.drills.running {
                    r.progress.push(line);
                    let excess = r.progress.len().saturating_sub(200);
                    r.progress.drain(..excess);
                }
            }
            Action::DrillFinished(result) => {
                self.drills.running = None;
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
                effects.push(Effect::Monitor(MonitorCommand::PollNow));
            }
            Action::TwiceChecked(checks) => self.inventory = Some(checks),
            Action::Tick(now) => {
                if !self.frozen {
                    self.now = now.max(self.now);
                }
            }
        }
        effects
    }

    fn switch(&mut self, tab: Tab) {
        self.tab = tab;
        self.show_help = false;
        self.drills.confirming = false;
    }

    fn back(&mut self) {
        if self.filter_editing {
            self.filter_editing = false;
            self.filter.clear();
        } else if self.show_help {
            self.show_help = false;
        } else if self.drills.confirming {
            self.drills.confirming = false;
        } else if self.vehicles.open.is_some() && self.tab == Tab::Vehicles {
            self.vehicles.open = None;
        } else if !self.filter.is_empty() {
            self.filter.clear();
        }
    }

    fn move_selection(&mut self, by: isize) {
        let step = |i: usize, n: usize| -> usize {
            if n == 0 {
                0
            } else {
                (i as isize + by).clamp(0, n as isize - 1) as usize
            }
        };
        match self.tab {
            Tab::Vehicles if self.vehicles.open.is_none() => {
                self.vehicles.selected = step(self.vehicles.selected, self.anomaly_devices().len());
            }
            Tab::Drills if self.drills.running.is_none() => {
                self.drills.selected = step(self.drills.selected, Scenario::ALL.len());
                self.drills.confirming = false;
            }
            Tab::Tables => {
                self.tables_scroll =
                    (i32::from(self.tables_scroll) + by as i32).clamp(0, 500) as u16;
            }
            _ => {}
        }
    }

    fn enter(&mut self) -> Vec<Effect> {
        match self.tab {
            Tab::Vehicles => {
                if self.vehicles.open.is_some() {
                    return Vec::new();
                }
                let devices = self.anomaly_devices();
                match devices.get(self.vehicles.selected) {
                    Some(d) => {
                        self.vehicles.open = Some(d.clone());
                        vec![Effect::Monitor(MonitorCommand::SelectVehicle(Some(
                            d.clone(),
                        )))]
                    }
                    None => Vec::new(),
                }
            }
            Tab::Drills => {
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
            _ => Vec::new(),
        }
    }

    fn confirm_drill(&mut self) -> Vec<Effect> {
        if self.tab != Tab::Drills || !self.drills.confirming || self.drills.running.is_some() {
            return Vec::new();
        }
        self.drills.confirming = false;
        let scenario = self.drills.scenario();
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
        let n = self.anomaly_devices().len();
        if self.vehicles.selected >= n {
            self.vehicles.selected = n.saturating_sub(1);
        }
        let charts = self.chart_names().len();
        if self.chart_consumer.is_some_and(|i| i >= charts) {
            self.chart_consumer = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn app() -> App {
        App::new(DateTime::UNIX_EPOCH, true, None)
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
    fn frozen_display_keeps_its_snapshot() {
        let mut a = app();
        a.update(Action::ToggleFreeze);
        let snap = Arc::new(crate::tui::fixtures::snapshot(DateTime::UNIX_EPOCH));
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
        a.update(Action::StartFilter);
        a.update(Action::FilterInput('x'));
        a.update(Action::Back);
        assert!(!a.filter_editing && a.filter.is_empty());
        a.update(Action::ToggleHelp);
        a.update(Action::Back);
        assert!(!a.show_help);
    }

    #[test]
    fn clicking_a_tab_title_opens_it() {
        let mut a = app();
        let (first, _) = tab_spans()[4];
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
}
