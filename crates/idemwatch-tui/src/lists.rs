//! Every list the dashboard shows, arranged once: filtered by `/`, sorted by the
//! list's chosen column, each row keyed by its identity (a device, a consumer, a
//! dead letter's id), so a selection follows the row and not its position when a
//! poll reorders the list. Rendering and navigation read the same arrangement.

use std::cmp::Ordering;
use std::collections::BTreeSet;

use idemwatch_drills::Scenario;
use idemwatch_monitor::alerts::Alert;
use idemwatch_monitor::db::{
    ConsumerInserts, DeadLetterGroup, DeadLetterRow, DrillRunSummary, InDoubtClaim,
};
use idemwatch_monitor::markers::TimelineMarker;
use idemwatch_monitor::targets::ConsumerStatus;
use idemwatch_monitor::vehicles::{DetailEvent, VehicleAnomaly};
use idemwatch_monitor::Snapshot;

use super::tab::Tab;

/// What the lists are arranged from: the dashboard's state as arranging reads it.
/// The app implements it, so this module never names the app and the two do not
/// import each other (the app calls the arrangers to resolve its cursor; the tabs
/// call them to draw).
pub trait Source {
    /// The newest poll, if one came.
    fn snapshot(&self) -> Option<&Snapshot>;
    /// A list's sort column, direction and selection.
    fn list(&self, id: ListId) -> &ListState;
    /// Does `text` pass the `/` filter?
    fn matches(&self, text: &str) -> bool;
    /// The alerts the operator silenced, by key.
    fn silenced(&self) -> &BTreeSet<String>;
    /// Markers written from this dashboard and not yet in a poll.
    fn local_markers(&self) -> &[TimelineMarker];
    /// The device whose state and history the Vehicles tab shows.
    fn open_vehicle(&self) -> Option<&String>;
    /// The tab on screen.
    fn tab(&self) -> Tab;
}

/// The lists, by screen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ListId {
    Consumers,
    Alerts,
    Anomalies,
    History,
    Scenarios,
    DrillRuns,
    Claims,
    DeadLetters,
    Reasons,
    Inserts,
    Markers,
}

impl ListId {
    /// The lists of a tab, in focus order (`←`/`→` moves between them).
    pub fn of(tab: Tab) -> &'static [ListId] {
        match tab {
            Tab::Overview => &[ListId::Consumers, ListId::Alerts],
            Tab::Duplicates => &[],
            Tab::Vehicles => &[ListId::Anomalies],
            Tab::Drills => &[ListId::Scenarios, ListId::DrillRuns],
            Tab::Tables => &[
                ListId::Claims,
                ListId::DeadLetters,
                ListId::Reasons,
                ListId::Inserts,
                ListId::Markers,
            ],
            Tab::Inventory => &[],
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            ListId::Consumers => "consumers",
            ListId::Alerts => "alerts",
            ListId::Anomalies => "anomalies",
            ListId::History => "history",
            ListId::Scenarios => "scenarios",
            ListId::DrillRuns => "drill runs",
            ListId::Claims => "claims in doubt",
            ListId::DeadLetters => "dead letters",
            ListId::Reasons => "by reason",
            ListId::Inserts => "inserts",
            ListId::Markers => "markers",
        }
    }

    /// The columns it can be sorted by (the first is the default order).
    pub fn sorts(self) -> &'static [&'static str] {
        match self {
            ListId::Consumers => &["name", "msgs/s", "dup %", "dead", "in doubt"],
            ListId::Alerts => &["severity", "newest", "object"],
            ListId::Anomalies => &["severity", "device"],
            ListId::History => &["arrival", "seq"],
            ListId::Scenarios => &["catalogue"],
            ListId::DrillRuns => &["newest", "scenario", "verdict"],
            ListId::Claims => &["oldest", "consumer", "attempts"],
            ListId::DeadLetters => &["newest", "reason", "consumer"],
            ListId::Reasons => &["key_conflict first", "total", "last hour", "consumer"],
            ListId::Inserts => &["consumer", "rows/min"],
            ListId::Markers => &["newest", "kind"],
        }
    }
}

/// Where a list stands: its selected row's identity and its sort.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListState {
    pub selected: Option<String>,
    pub sort: usize,
    pub reversed: bool,
}

/// A list as shown: the rows that pass the filter, in order, and how many there are
/// without it.
#[derive(Debug)]
pub struct Arranged<'a, T> {
    pub rows: Vec<(String, &'a T)>,
    pub total: usize,
}

impl<T> Arranged<'_, T> {
    /// The selected row's index, if it is shown.
    pub fn selected(&self, state: &ListState) -> Option<usize> {
        let key = state.selected.as_deref()?;
        self.rows.iter().position(|(k, _)| k == key)
    }

    pub fn keys(&self) -> Vec<String> {
        self.rows.iter().map(|(k, _)| k.clone()).collect()
    }

    /// "3 of 7" when the filter hides some, else "7".
    pub fn count_label(&self) -> String {
        if self.rows.len() == self.total {
            self.total.to_string()
        } else {
            format!("{} of {}", self.rows.len(), self.total)
        }
    }
}

/// Filter by `/`, sort by the list's column, key by identity.
fn arrange<'a, T>(
    app: &dyn Source,
    id: ListId,
    items: impl Iterator<Item = &'a T>,
    key: impl Fn(&T) -> String,
    text: impl Fn(&T) -> String,
    order: impl Fn(usize, &T, &T) -> Ordering,
) -> Arranged<'a, T> {
    let state = app.list(id);
    let mut total = 0;
    let mut rows: Vec<(String, &T)> = items
        .inspect(|_| total += 1)
        .filter(|t| app.matches(&text(t)))
        .map(|t| (key(t), t))
        .collect();
    rows.sort_by(|(_, a), (_, b)| {
        let o = order(state.sort, a, b);
        if state.reversed {
            o.reverse()
        } else {
            o
        }
    });
    Arranged { rows, total }
}

fn by_f64(a: f64, b: f64) -> Ordering {
    a.partial_cmp(&b).unwrap_or(Ordering::Equal)
}

pub fn consumer_key(c: &ConsumerStatus) -> String {
    format!("{}/{}", c.target, c.consumer)
}

pub fn consumers(app: &dyn Source) -> Arranged<'_, ConsumerStatus> {
    let items = app
        .snapshot()
        .map(|s| s.consumers.as_slice())
        .unwrap_or(&[]);
    arrange(
        app,
        ListId::Consumers,
        items.iter(),
        consumer_key,
        |c| format!("{} {}", c.target, c.consumer),
        |sort, a, b| match sort {
            1 => by_f64(
                b.window_1m.processed_per_second.unwrap_or(0.0),
                a.window_1m.processed_per_second.unwrap_or(0.0),
            ),
            2 => by_f64(
                b.window_1m.duplicate_ratio.unwrap_or(0.0),
                a.window_1m.duplicate_ratio.unwrap_or(0.0),
            ),
            3 => by_f64(b.window_5m.dead_lettered, a.window_5m.dead_lettered),
            4 => by_f64(
                b.claims_in_doubt.unwrap_or(0.0),
                a.claims_in_doubt.unwrap_or(0.0),
            ),
            _ => consumer_key(a).cmp(&consumer_key(b)),
        },
    )
}

/// Alerts not silenced, incidents first (the monitor's order) unless sorted.
pub fn alerts(app: &dyn Source) -> Arranged<'_, Alert> {
    let items = app.snapshot().map(|s| s.alerts.as_slice()).unwrap_or(&[]);
    arrange(
        app,
        ListId::Alerts,
        items.iter().filter(|a| !app.silenced().contains(&a.key())),
        Alert::key,
        |a| format!("{} {}", a.message, a.object.label()),
        |sort, a, b| match sort {
            1 => b.since.cmp(&a.since),
            2 => a.object.cmp(&b.object),
            // The sort is stable: the monitor's order.
            _ => Ordering::Equal,
        },
    )
}

fn anomaly_rank(a: &VehicleAnomaly) -> u8 {
    match a {
        VehicleAnomaly::StateBehind { .. } => 0,
        VehicleAnomaly::DuplicateHistory { .. } => 1,
        VehicleAnomaly::LateEvent { .. } => 2,
        VehicleAnomaly::SequenceGap { .. } => 3,
    }
}

/// One row per anomaly, keyed by its device and what it says.
pub fn anomalies(app: &dyn Source) -> Arranged<'_, VehicleAnomaly> {
    let items = app
        .snapshot()
        .and_then(|s| s.database.as_ref())
        .and_then(|d| d.vehicles.as_ref())
        .map(|v| v.anomalies.as_slice())
        .unwrap_or(&[]);
    arrange(
        app,
        ListId::Anomalies,
        items.iter(),
        |a| format!("{}|{a:?}", a.device_id()),
        |a| a.device_id().to_string(),
        |sort, a, b| match sort {
            1 => a.device_id().cmp(b.device_id()),
            _ => anomaly_rank(a)
                .cmp(&anomaly_rank(b))
                .then_with(|| a.device_id().cmp(b.device_id())),
        },
    )
}

/// The open vehicle's history, newest arrival first.
pub fn history(app: &dyn Source) -> Arranged<'_, DetailEvent> {
    let items = app
        .snapshot()
        .and_then(|s| s.vehicle.as_ref())
        .filter(|v| Some(&v.device_id) == app.open_vehicle())
        .map(|v| v.history.as_slice())
        .unwrap_or(&[]);
    arrange(
        app,
        ListId::History,
        // Stored in arrival order; shown newest first.
        items.iter().rev(),
        |e| format!("{}:{}", e.event.seq, e.event.event_type),
        |e| format!("{} {}", e.event.seq, e.event.event_type),
        |sort, a, b| match sort {
            1 => b.event.seq.cmp(&a.event.seq),
            _ => Ordering::Equal,
        },
    )
}

pub fn scenarios(app: &dyn Source) -> Arranged<'_, Scenario> {
    arrange(
        app,
        ListId::Scenarios,
        Scenario::ALL.iter(),
        |s| s.as_str().to_string(),
        |s| s.as_str().to_string(),
        |_, _, _| Ordering::Equal,
    )
}

pub fn drill_runs(app: &dyn Source) -> Arranged<'_, DrillRunSummary> {
    let items = app
        .snapshot()
        .and_then(|s| s.database.as_ref())
        .map(|d| d.drill_runs.as_slice())
        .unwrap_or(&[]);
    arrange(
        app,
        ListId::DrillRuns,
        items.iter(),
        |r| r.id.to_string(),
        |r| {
            format!(
                "{} {} {}",
                r.scenario,
                r.mode,
                r.verdict.as_deref().unwrap_or("")
            )
        },
        |sort, a, b| match sort {
            1 => a.scenario.cmp(&b.scenario),
            2 => a.verdict.cmp(&b.verdict),
            _ => b.id.cmp(&a.id),
        },
    )
}

pub fn claims(app: &dyn Source) -> Arranged<'_, InDoubtClaim> {
    let items = app
        .snapshot()
        .and_then(|s| s.database.as_ref())
        .map(|d| d.claims_in_doubt.as_slice())
        .unwrap_or(&[]);
    arrange(
        app,
        ListId::Claims,
        items.iter(),
        |c| format!("{}|{}", c.consumer, c.message_key),
        |c| format!("{} {}", c.consumer, c.message_key),
        |sort, a, b| match sort {
            1 => a.consumer.cmp(&b.consumer),
            2 => b.attempts.cmp(&a.attempts),
            _ => b.age_seconds.cmp(&a.age_seconds),
        },
    )
}

pub fn dead_letters(app: &dyn Source) -> Arranged<'_, DeadLetterRow> {
    let items = app
        .snapshot()
        .and_then(|s| s.database.as_ref())
        .map(|d| d.recent_dead_letters.as_slice())
        .unwrap_or(&[]);
    arrange(
        app,
        ListId::DeadLetters,
        items.iter(),
        |d| d.id.to_string(),
        |d| format!("{} {} {}", d.consumer, d.reason, d.preview),
        |sort, a, b| match sort {
            // key_conflict first: an identity bug upstream outranks bad bytes.
            1 => (a.reason != "key_conflict", &a.reason, b.id).cmp(&(
                b.reason != "key_conflict",
                &b.reason,
                a.id,
            )),
            2 => (&a.consumer, b.id).cmp(&(&b.consumer, a.id)),
            _ => b.id.cmp(&a.id),
        },
    )
}

/// The database's dead letters per consumer and reason: key conflicts first (an
/// identity bug upstream), then the biggest.
pub fn reasons(app: &dyn Source) -> Arranged<'_, DeadLetterGroup> {
    let items = app
        .snapshot()
        .and_then(|s| s.database.as_ref())
        .map(|d| d.dead_letters.as_slice())
        .unwrap_or(&[]);
    arrange(
        app,
        ListId::Reasons,
        items.iter(),
        |g| format!("{}|{}", g.consumer, g.reason),
        |g| format!("{} {}", g.consumer, g.reason),
        |sort, a, b| match sort {
            1 => b.total.cmp(&a.total),
            2 => b.last_hour.cmp(&a.last_hour),
            3 => (&a.consumer, &a.reason).cmp(&(&b.consumer, &b.reason)),
            _ => (a.reason != "key_conflict", std::cmp::Reverse(a.total))
                .cmp(&(b.reason != "key_conflict", std::cmp::Reverse(b.total))),
        },
    )
}

pub fn inserts(app: &dyn Source) -> Arranged<'_, ConsumerInserts> {
    let items = app
        .snapshot()
        .and_then(|s| s.database.as_ref())
        .and_then(|d| d.dedup.as_ref())
        .map(|d| d.inserts.as_slice())
        .unwrap_or(&[]);
    arrange(
        app,
        ListId::Inserts,
        items.iter(),
        |i| i.consumer.clone(),
        |i| i.consumer.clone(),
        |sort, a, b| match sort {
            1 => b.last_minute.cmp(&a.last_minute),
            _ => a.consumer.cmp(&b.consumer),
        },
    )
}

/// The database's markers and this session's own, newest first.
pub fn markers(app: &dyn Source) -> Arranged<'_, TimelineMarker> {
    let items = app.snapshot().map(|s| s.markers.as_slice()).unwrap_or(&[]);
    arrange(
        app,
        ListId::Markers,
        items.iter().chain(app.local_markers()),
        |m| format!("{}|{}|{}", m.at.timestamp_millis(), m.kind, m.label),
        |m| format!("{} {}", m.kind, m.label),
        |sort, a, b| match sort {
            1 => a.kind.cmp(&b.kind).then(b.at.cmp(&a.at)),
            _ => b.at.cmp(&a.at),
        },
    )
}

/// The keys of a list in display order (for moving its selection).
pub fn keys(app: &dyn Source, id: ListId) -> Vec<String> {
    match id {
        ListId::Consumers => consumers(app).keys(),
        ListId::Alerts => alerts(app).keys(),
        ListId::Anomalies => anomalies(app).keys(),
        ListId::History => history(app).keys(),
        ListId::Scenarios => scenarios(app).keys(),
        ListId::DrillRuns => drill_runs(app).keys(),
        ListId::Claims => claims(app).keys(),
        ListId::DeadLetters => dead_letters(app).keys(),
        ListId::Reasons => reasons(app).keys(),
        ListId::Inserts => inserts(app).keys(),
        ListId::Markers => markers(app).keys(),
    }
}

/// (shown, total) rows of a list.
pub fn counts(app: &dyn Source, id: ListId) -> (usize, usize) {
    fn c<T>(a: Arranged<'_, T>) -> (usize, usize) {
        (a.rows.len(), a.total)
    }
    match id {
        ListId::Consumers => c(consumers(app)),
        ListId::Alerts => c(alerts(app)),
        ListId::Anomalies => c(anomalies(app)),
        ListId::History => c(history(app)),
        ListId::Scenarios => c(scenarios(app)),
        ListId::DrillRuns => c(drill_runs(app)),
        ListId::Claims => c(claims(app)),
        ListId::DeadLetters => c(dead_letters(app)),
        ListId::Reasons => c(reasons(app)),
        ListId::Inserts => c(inserts(app)),
        ListId::Markers => c(markers(app)),
    }
}

/// What the filter hides on the current tab: (shown, total) over all its lists.
pub fn tab_counts(app: &dyn Source) -> (usize, usize) {
    let mut ids: Vec<ListId> = ListId::of(app.tab()).to_vec();
    if app.tab() == Tab::Vehicles && app.open_vehicle().is_some() {
        ids = vec![ListId::History];
    }
    ids.iter()
        .map(|id| counts(app, *id))
        .fold((0, 0), |(s, t), (a, b)| (s + a, t + b))
}
