//! Ordering anomalies of the `vehicle-state` consumer, fleet-wide and for one vehicle.
//!
//! The detection is pure functions over rows (easy to test on crafted histories);
//! the queries that fetch those rows live with the backend's SQL in
//! [`super::db`], bounded to a recent window so they stay cheap on a history table
//! with hundreds of millions of rows.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use serde::Serialize;

/// One `vehicle_history` row as the dashboard needs it (no payload).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HistoryEvent {
    pub device_id: String,
    pub seq: i64,
    pub event_type: String,
    pub occurred_at: Option<DateTime<Utc>>,
    pub received_at: DateTime<Utc>,
    /// False for an event that arrived behind a newer seq and was kept but not applied.
    pub applied: bool,
}

/// One `vehicle_state` row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StateRow {
    pub device_id: String,
    pub last_seq: i64,
    pub last_event_type: String,
    pub ignition: Option<String>,
    pub occurred_at: Option<DateTime<Utc>>,
    pub updated_at: Option<DateTime<Utc>>,
}

/// Something an operator should look at.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VehicleAnomaly {
    /// An event that arrived behind a newer one: kept in history, not applied. Normal
    /// in small numbers (redeliveries arrive late); a burst means a stuck partition.
    LateEvent {
        device_id: String,
        seq: i64,
        event_type: String,
        received_at: DateTime<Utc>,
    },
    /// Seqs missing between two received ones: lost, or still in flight.
    SequenceGap {
        device_id: String,
        after_seq: i64,
        before_seq: i64,
        missing: i64,
    },
    /// The state row is older than an applied history row: the seq guard or the
    /// upsert went wrong (a naive consumer's ghost state).
    StateBehind {
        device_id: String,
        state_seq: i64,
        newest_applied_seq: i64,
    },
    /// The same (device, seq, event_type) stored more than once: only possible on a
    /// table without the unique key, and exactly what that key is for.
    DuplicateHistory {
        device_id: String,
        seq: i64,
        event_type: String,
        copies: usize,
    },
}

impl VehicleAnomaly {
    /// The device the anomaly is about.
    pub fn device_id(&self) -> &str {
        match self {
            VehicleAnomaly::LateEvent { device_id, .. }
            | VehicleAnomaly::SequenceGap { device_id, .. }
            | VehicleAnomaly::StateBehind { device_id, .. }
            | VehicleAnomaly::DuplicateHistory { device_id, .. } => device_id,
        }
    }
}

/// The fleet-wide anomaly list of one poll.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct VehicleAnomalies {
    /// History rows examined (the newest ones within the window).
    pub rows_examined: usize,
    /// The window held more rows than the limit: older ones were not examined.
    pub truncated: bool,
    /// `applied = false` rows received within the window.
    pub late_events_in_window: i64,
    pub anomalies: Vec<VehicleAnomaly>,
}

/// Gaps in one device's seqs: every run of missing numbers between the smallest and
/// the largest seq seen.
pub fn sequence_gaps(device_id: &str, seqs: &[i64]) -> Vec<VehicleAnomaly> {
    let mut sorted = seqs.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    sorted
        .windows(2)
        .filter(|w| w[1] - w[0] > 1)
        .map(|w| VehicleAnomaly::SequenceGap {
            device_id: device_id.to_string(),
            after_seq: w[0],
            before_seq: w[1],
            missing: w[1] - w[0] - 1,
        })
        .collect()
}

/// Anomalies in a window of history rows and the matching state rows: late events,
/// sequence gaps, states behind their newest applied row, duplicate history rows.
/// Ordered by device, then kind.
pub fn detect_anomalies(states: &[StateRow], rows: &[HistoryEvent]) -> Vec<VehicleAnomaly> {
    let mut by_device: BTreeMap<&str, Vec<&HistoryEvent>> = BTreeMap::new();
    for r in rows {
        by_device.entry(r.device_id.as_str()).or_default().push(r);
    }
    let state_seq: HashMap<&str, i64> = states
        .iter()
        .map(|s| (s.device_id.as_str(), s.last_seq))
        .collect();
    let mut out = Vec::new();
    for (device, events) in by_device {
        for e in events.iter().filter(|e| !e.applied) {
            out.push(VehicleAnomaly::LateEvent {
                device_id: device.to_string(),
                seq: e.seq,
                event_type: e.event_type.clone(),
                received_at: e.received_at,
            });
        }
        let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        out.extend(sequence_gaps(device, &seqs));
        let newest_applied = events.iter().filter(|e| e.applied).map(|e| e.seq).max();
        if let (Some(state), Some(newest)) = (state_seq.get(device), newest_applied) {
            if *state < newest {
                out.push(VehicleAnomaly::StateBehind {
                    device_id: device.to_string(),
                    state_seq: *state,
                    newest_applied_seq: newest,
                });
            }
        }
        let mut copies: BTreeMap<(i64, &str), usize> = BTreeMap::new();
        for e in &events {
            *copies.entry((e.seq, e.event_type.as_str())).or_default() += 1;
        }
        for ((seq, event_type), n) in copies {
            if n > 1 {
                out.push(VehicleAnomaly::DuplicateHistory {
                    device_id: device.to_string(),
                    seq,
                    event_type: event_type.to_string(),
                    copies: n,
                });
            }
        }
    }
    out
}

/// One history row in the single-vehicle view.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DetailEvent {
    #[serde(flatten)]
    pub event: HistoryEvent,
    /// Arrived behind a higher seq (whatever the `applied` column says: a naive
    /// consumer applies late events, which is the harm to show).
    pub late: bool,
}

/// One vehicle: its state beside its history in arrival order, late ones marked.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VehicleDetail {
    pub device_id: String,
    pub state: Option<StateRow>,
    pub history: Vec<DetailEvent>,
    /// Only the newest rows were loaded.
    pub truncated: bool,
}

/// Sort rows by arrival and mark each one that arrived behind a higher seq.
pub fn arrival_order(mut rows: Vec<HistoryEvent>) -> Vec<DetailEvent> {
    rows.sort_by(|a, b| a.received_at.cmp(&b.received_at).then(a.seq.cmp(&b.seq)));
    let mut highest: Option<i64> = None;
    rows.into_iter()
        .map(|event| {
            let behind = highest.is_some_and(|h| event.seq < h);
            highest = Some(highest.map_or(event.seq, |h| h.max(event.seq)));
            DetailEvent {
                late: behind || !event.applied,
                event,
            }
        })
        .collect()
}
