//! [`Store::apply_vehicle_batch`](super::Store::apply_vehicle_batch) reduced to what
//! the database has to be asked, as `batch.rs` does for the dedup table: a backend
//! reads, under its write lock, which history rows of the batch are already stored
//! and each device's stored `last_seq`, and this module decides every event's outcome
//! exactly as one-by-one calls in order would have: an event already in history (or
//! earlier in the batch) is a duplicate or a key conflict; a new one is applied when
//! its seq is newer than the device's state at that point (the stored one, moved by
//! the batch's earlier applied events), else it is late. The backend then inserts the
//! new history rows with their `applied` flag and runs the state upsert of each
//! applied event in order — the same upsert the one-by-one path runs, so the columns
//! an event keeps (`COALESCE`) are carried exactly as before.

use std::collections::HashMap;

use chrono::{DateTime, Utc};

use super::{vehicle_duplicate_or_conflict, StoreResult, VehicleFacts, VehicleOutcome};
use crate::envelope::{Envelope, Fingerprint, Message};

/// A history row's identity: `(device_id, seq, event_type)`.
pub(crate) type HistoryKey<'a> = (&'a str, i64, &'static str);

/// The history rows of a batch already stored, by identity: each one's payload hash
/// (duplicate or conflict) and when it was received (the duplicate's age; None where
/// a backend could not read it), read by the same statement.
pub(crate) type StoredHistory = HashMap<(String, i64, String), (String, Option<DateTime<Utc>>)>;

/// One event of a batch, with what every backend writes for it.
pub(crate) struct VehicleItem<'a> {
    pub env: &'a Envelope,
    pub fingerprint: &'a Fingerprint,
    pub facts: VehicleFacts<'a>,
}

impl<'a> VehicleItem<'a> {
    pub fn key(&self) -> HistoryKey<'a> {
        (
            self.env.device_id.as_str(),
            self.facts.seq,
            self.facts.event_type,
        )
    }
}

/// A batch of vehicle events, keyed.
pub(crate) struct VehicleBatch<'a> {
    pub items: Vec<VehicleItem<'a>>,
    /// For each item, the index of the first item with the same history key.
    first: Vec<usize>,
}

/// What the backend writes once the outcomes are known.
pub(crate) struct VehicleWrites<'b, 'a> {
    /// New history rows, in batch order, with their `applied` flag.
    pub history: Vec<(&'b VehicleItem<'a>, bool)>,
    /// The applied events, in batch order: one state upsert each.
    pub upserts: Vec<&'b VehicleItem<'a>>,
}

impl<'b, 'a> VehicleWrites<'b, 'a> {
    /// The applied events in rounds: round k holds each device's k-th applied event,
    /// in batch order. A backend that upserts a round in one multi-row statement never
    /// touches a row twice in it, and every device still sees its events in order.
    pub fn upsert_rounds(&self) -> Vec<Vec<&'b VehicleItem<'a>>> {
        let mut rounds: Vec<Vec<&'b VehicleItem<'a>>> = Vec::new();
        let mut next_round: HashMap<&str, usize> = HashMap::new();
        for item in &self.upserts {
            let k = next_round.entry(item.env.device_id.as_str()).or_insert(0);
            if rounds.len() == *k {
                rounds.push(Vec::new());
            }
            rounds[*k].push(item);
            *k += 1;
        }
        rounds
    }
}

impl<'a> VehicleBatch<'a> {
    pub fn new(envs: &'a [Message]) -> StoreResult<Self> {
        let items = envs
            .iter()
            .map(|env| {
                Ok(VehicleItem {
                    env: env.envelope(),
                    fingerprint: env.fingerprint(),
                    facts: VehicleFacts::of(env)?,
                })
            })
            .collect::<StoreResult<Vec<_>>>()?;
        let mut seen: HashMap<HistoryKey<'a>, usize> = HashMap::with_capacity(items.len());
        let first = items
            .iter()
            .enumerate()
            .map(|(i, item)| *seen.entry(item.key()).or_insert(i))
            .collect();
        Ok(VehicleBatch { items, first })
    }

    /// The first item of each history key, in batch order: what the history read asks.
    pub fn distinct(&self) -> impl Iterator<Item = &VehicleItem<'a>> {
        self.items
            .iter()
            .enumerate()
            .filter(|(i, _)| self.first[*i] == *i)
            .map(|(_, item)| item)
    }

    /// The batch's devices, each once, sorted.
    pub fn devices(&self) -> Vec<&'a str> {
        let mut d: Vec<&str> = self
            .items
            .iter()
            .map(|i| i.env.device_id.as_str())
            .collect();
        d.sort_unstable();
        d.dedup();
        d
    }

    /// Every item's outcome and the writes they need. `stored`: the payload hash and
    /// received time of each history key already stored; `last_seq`: each device's
    /// stored state; `now`: the received time of the rows this batch writes (a repeat
    /// inside the batch is a duplicate of age ~0).
    pub fn decide<'b>(
        &'b self,
        stored: &StoredHistory,
        last_seq: &HashMap<String, i64>,
        now: DateTime<Utc>,
    ) -> (Vec<VehicleOutcome>, VehicleWrites<'b, 'a>) {
        let mut current: HashMap<&str, i64> =
            last_seq.iter().map(|(d, s)| (d.as_str(), *s)).collect();
        let mut writes = VehicleWrites {
            history: Vec::new(),
            upserts: Vec::new(),
        };
        let outcomes = self
            .items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let (device, seq, event_type) = item.key();
                let stored_hash = stored.get(&(device.to_string(), seq, event_type.to_string()));
                if let Some((hash, received_at)) = stored_hash {
                    return vehicle_duplicate_or_conflict(
                        hash.clone(),
                        item.fingerprint,
                        *received_at,
                    );
                }
                let first = self.first[i];
                if first != i {
                    // The row the first item of this key wrote holds its fingerprint.
                    let written = self.items[first].fingerprint.as_str().to_string();
                    return vehicle_duplicate_or_conflict(written, item.fingerprint, Some(now));
                }
                let newer = current.get(device).is_none_or(|&c| seq > c);
                writes.history.push((item, newer));
                if newer {
                    current.insert(device, seq);
                    writes.upserts.push(item);
                    VehicleOutcome::Applied
                } else {
                    VehicleOutcome::Late
                }
            })
            .collect();
        (outcomes, writes)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A vehicle event as it arrives (also for the SQLite store's tests).
    pub(in crate::store) fn event(
        device: &str,
        seq: u64,
        event_type: &str,
        extra: &str,
    ) -> Message {
        Message::parse(
            format!(
                r#"{{"device_id":"{device}","seq":{seq},"event_type":"{event_type}","occurred_at":"2026-11-30T04:12:03Z","payload":{{{extra}}}}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    #[test]
    fn outcomes_are_those_of_one_by_one_calls() {
        let envs = vec![
            event("D1", 5, "position", r#""lat":1.0,"lon":2.0"#),
            event("D1", 3, "position", r#""lat":1.0,"lon":2.0"#), // older than 5: late
            event("D1", 5, "position", r#""lat":1.0,"lon":2.0"#), // same key, same bytes
            event("D1", 5, "position", r#""lat":9.0,"lon":2.0"#), // same key, other bytes
            event("D2", 1, "ignition_on", ""),                    // stored state is at 4: late
            event("D2", 7, "ignition_off", ""),                   // newer: applied
            event("D3", 2, "position", r#""lat":1.0,"lon":2.0"#), // already in history
            event("D1", 6, "zone_exit", r#""zone":"Z""#),         // newer than 5: applied
        ];
        let batch = VehicleBatch::new(&envs).unwrap();
        assert_eq!(batch.distinct().count(), 6);
        assert_eq!(batch.devices(), ["D1", "D2", "D3"]);
        let d3 = envs[6].fingerprint().as_str().to_string();
        let received = "2026-11-30T04:12:05Z".parse::<DateTime<Utc>>().unwrap();
        let now = "2026-11-30T05:12:05Z".parse::<DateTime<Utc>>().unwrap();
        let stored = [(
            ("D3".to_string(), 2, "position".to_string()),
            (d3, Some(received)),
        )]
        .into();
        let last_seq = [("D2".to_string(), 4), ("D3".to_string(), 9)].into();
        let (outcomes, writes) = batch.decide(&stored, &last_seq, now);
        let conflict = VehicleOutcome::KeyConflict {
            stored: envs[0].fingerprint().clone(),
        };
        assert_eq!(
            outcomes,
            vec![
                VehicleOutcome::Applied,
                VehicleOutcome::Late,
                // A repeat inside the batch: the row the batch writes, received now.
                VehicleOutcome::Duplicate {
                    first_at: Some(now)
                },
                conflict,
                VehicleOutcome::Late,
                VehicleOutcome::Applied,
                // The stored row's received time: an hour old.
                VehicleOutcome::Duplicate {
                    first_at: Some(received)
                },
                VehicleOutcome::Applied,
            ]
        );
        let ages: Vec<u64> = outcomes
            .iter()
            .filter_map(|o| o.duplicate_age(now))
            .map(|a| a.as_secs())
            .collect();
        assert_eq!(ages, [0, 3600]);
        assert_eq!(
            VehicleOutcome::oldest_duplicate(&outcomes, now),
            Some(3600.0)
        );
        let history: Vec<(i64, bool)> = writes
            .history
            .iter()
            .map(|(i, applied)| (i.facts.seq, *applied))
            .collect();
        assert_eq!(
            history,
            [(5, true), (3, false), (1, false), (7, true), (6, true)]
        );
        let upserts: Vec<i64> = writes.upserts.iter().map(|i| i.facts.seq).collect();
        assert_eq!(upserts, [5, 7, 6]);
        // D1 twice (5 then 6), D2 once: two rounds, D1's events in their order.
        let rounds: Vec<Vec<(&str, i64)>> = writes
            .upsert_rounds()
            .iter()
            .map(|r| {
                r.iter()
                    .map(|i| (i.env.device_id.as_str(), i.facts.seq))
                    .collect()
            })
            .collect();
        assert_eq!(rounds, [vec![("D1", 5), ("D2", 7)], vec![("D1", 6)]]);
    }
}
