//! Ordering anomalies on crafted histories.

use chrono::{DateTime, Utc};
use idemwatch_monitor::vehicles::{
    arrival_order, detect_anomalies, sequence_gaps, HistoryEvent, StateRow, VehicleAnomaly,
};

fn t(s: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
}

fn ev(device: &str, seq: i64, event_type: &str, received: i64, applied: bool) -> HistoryEvent {
    HistoryEvent {
        device_id: device.into(),
        seq,
        event_type: event_type.into(),
        occurred_at: Some(t(seq)),
        received_at: t(received),
        applied,
    }
}

fn state(device: &str, seq: i64) -> StateRow {
    StateRow {
        device_id: device.into(),
        last_seq: seq,
        last_event_type: "ignition_off".into(),
        ignition: Some("off".into()),
        occurred_at: None,
        updated_at: None,
    }
}

#[test]
fn clean_history_has_no_anomaly() {
    let rows: Vec<_> = (1..=5)
        .map(|s| ev("34-ABC-123", s, "position", s, true))
        .collect();
    assert!(detect_anomalies(&[state("34-ABC-123", 5)], &rows).is_empty());
}

#[test]
fn late_ignition_on_is_reported_as_late() {
    let rows = vec![
        ev("34-ABC-123", 48210, "position", 1, true),
        ev("34-ABC-123", 48212, "ignition_off", 2, true),
        ev("34-ABC-123", 48211, "ignition_on", 3, false),
    ];
    let found = detect_anomalies(&[state("34-ABC-123", 48212)], &rows);
    assert_eq!(
        found,
        vec![VehicleAnomaly::LateEvent {
            device_id: "34-ABC-123".into(),
            seq: 48211,
            event_type: "ignition_on".into(),
            received_at: t(3),
        }]
    );
}

#[test]
fn missing_seqs_are_gaps() {
    assert_eq!(
        sequence_gaps("d", &[7, 1, 2, 3, 7, 10]),
        vec![
            VehicleAnomaly::SequenceGap {
                device_id: "d".into(),
                after_seq: 3,
                before_seq: 7,
                missing: 3
            },
            VehicleAnomaly::SequenceGap {
                device_id: "d".into(),
                after_seq: 7,
                before_seq: 10,
                missing: 2
            },
        ]
    );
    assert!(sequence_gaps("d", &[]).is_empty());
    assert!(sequence_gaps("d", &[4]).is_empty());
}

#[test]
fn state_behind_its_applied_history_is_the_ghost_state() {
    // A naive consumer let seq 11 overwrite seq 12.
    let rows = vec![
        ev("v1", 11, "ignition_on", 1, true),
        ev("v1", 12, "ignition_off", 2, true),
    ];
    let found = detect_anomalies(&[state("v1", 11)], &rows);
    assert_eq!(
        found,
        vec![VehicleAnomaly::StateBehind {
            device_id: "v1".into(),
            state_seq: 11,
            newest_applied_seq: 12
        }]
    );
}

#[test]
fn duplicate_history_rows_are_counted() {
    let rows = vec![
        ev("v1", 1, "zone_exit", 1, true),
        ev("v1", 1, "zone_exit", 2, true),
        ev("v1", 1, "zone_exit", 3, true),
        ev("v1", 1, "position", 3, true),
    ];
    let found = detect_anomalies(&[state("v1", 1)], &rows);
    assert_eq!(
        found,
        vec![VehicleAnomaly::DuplicateHistory {
            device_id: "v1".into(),
            seq: 1,
            event_type: "zone_exit".into(),
            copies: 3
        }]
    );
}

#[test]
fn detail_is_in_arrival_order_with_late_ones_marked() {
    // Received out of seq order; the naive table says applied for all of them.
    let rows = vec![
        ev("v1", 3, "ignition_off", 30, true),
        ev("v1", 1, "ignition_on", 10, true),
        ev("v1", 2, "ignition_on", 40, true),
        ev("v1", 4, "position", 50, true),
    ];
    let detail = arrival_order(rows);
    let order: Vec<(i64, bool)> = detail.iter().map(|d| (d.event.seq, d.late)).collect();
    assert_eq!(order, vec![(1, false), (3, false), (2, true), (4, false)]);
    // An unapplied row is late even if it came in order of arrival.
    let detail = arrival_order(vec![ev("v1", 9, "position", 1, false)]);
    assert!(detail[0].late);
}
