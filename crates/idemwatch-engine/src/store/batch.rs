//! [`Store::record_batch`](super::Store::record_batch) reduced to what the database
//! has to be asked, so that every backend needs a handful of statements per batch
//! instead of two per message.
//!
//! Each distinct key is inserted once, in key order (concurrent batches then take
//! their row locks in the same order), with one multi-row `INSERT … ON CONFLICT DO
//! NOTHING` per chunk. Which keys that insert wrote comes back from the database;
//! every item's outcome is then worked out here exactly as if the items had been
//! inserted one by one, in order: the first item of a key is applied when its row
//! was written, a later item of the same key is a duplicate of it (or a key
//! conflict when its fingerprint differs), an item whose key was already there is a
//! duplicate of (or conflicts with) the stored row. The business writes of the
//! applied items are merged per row, so one upsert statement carries them all.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};

use super::{duplicate_or_conflict, Backend, BusinessWrite, DedupOutcome, Recordable, StoreError};

/// When each key found already stored was first processed (its `processed_at`), read
/// with its fingerprint by the same statement: a duplicate's age costs no extra read.
pub(crate) type FirstSeen = HashMap<String, DateTime<Utc>>;

/// Raise a consumer's oldest duplicate age (`duplicate_ages`) to `age_seconds` if it
/// is older than the one kept, with `observed_at` the time it was seen: one statement,
/// written once here for every backend (the batch paths run it on their own
/// transaction, `consumer_sql::note_duplicate_age_in` and SQLite's jobs, so the drop
/// and its age commit together).
/// Binds: consumer, age in seconds, observed at.
pub(crate) fn note_duplicate_age_sql(backend: Backend) -> &'static str {
    match backend {
        Backend::Sqlite | Backend::Postgres => {
            "INSERT INTO duplicate_ages (consumer, max_age_seconds, observed_at) VALUES (?, ?, ?)
             ON CONFLICT (consumer) DO UPDATE
             SET max_age_seconds = excluded.max_age_seconds, observed_at = excluded.observed_at
             WHERE excluded.max_age_seconds > duplicate_ages.max_age_seconds"
        }
        // Assignments run left to right: observed_at is decided on the old maximum.
        Backend::Mysql => {
            "INSERT INTO duplicate_ages (consumer, max_age_seconds, observed_at) VALUES (?, ?, ?)
             ON DUPLICATE KEY UPDATE
             observed_at = IF(VALUES(max_age_seconds) > max_age_seconds,
                              VALUES(observed_at), observed_at),
             max_age_seconds = GREATEST(max_age_seconds, VALUES(max_age_seconds))"
        }
    }
}

/// Rows per multi-row statement: 4 bind parameters each stays far below every
/// backend's limit (SQLite 32,766, PostgreSQL and MySQL 65,535).
pub(crate) const ROWS_PER_STATEMENT: usize = 500;

/// One batch of [`Recordable`]s, keyed.
pub(crate) struct DedupBatch<'a> {
    items: &'a [Recordable],
    /// For each item, the index of the first item with the same key.
    first: Vec<usize>,
    /// The first items of each key, sorted by key.
    distinct: Vec<&'a Recordable>,
}

impl<'a> DedupBatch<'a> {
    pub fn new(items: &'a [Recordable]) -> Self {
        let mut seen: HashMap<&str, usize> = HashMap::with_capacity(items.len());
        let first = items
            .iter()
            .enumerate()
            .map(|(i, item)| *seen.entry(item.key.as_str()).or_insert(i))
            .collect();
        let mut distinct: Vec<&Recordable> = seen.into_values().map(|i| &items[i]).collect();
        distinct.sort_by(|a, b| a.key.as_str().cmp(b.key.as_str()));
        DedupBatch {
            items,
            first,
            distinct,
        }
    }

    /// The first item of each key, in key order.
    pub fn distinct(&self) -> &[&'a Recordable] {
        &self.distinct
    }

    /// The keys the insert did not write: their stored fingerprints are needed.
    pub fn not_inserted(&self, inserted: &HashSet<String>) -> Vec<&'a str> {
        self.distinct
            .iter()
            .map(|item| item.key.as_str())
            .filter(|key| !inserted.contains(*key))
            .collect()
    }

    /// The distinct items whose key is not among the `stored` ones, in key order,
    /// and their keys: what an insert made under a lock that keeps `stored` true
    /// writes.
    pub fn fresh(
        &self,
        stored: &HashMap<String, String>,
    ) -> (Vec<&'a Recordable>, HashSet<String>) {
        let fresh: Vec<&Recordable> = self
            .distinct
            .iter()
            .copied()
            .filter(|item| !stored.contains_key(item.key.as_str()))
            .collect();
        let keys = fresh
            .iter()
            .map(|item| item.key.as_str().to_string())
            .collect();
        (fresh, keys)
    }

    /// Each item's outcome. `inserted`: the keys this batch's insert wrote;
    /// `stored`: the fingerprint already stored under every other key, `first_seen`
    /// when it was processed; `now`: when this batch wrote its rows (a key twice in
    /// the batch was first processed then).
    pub fn outcomes(
        &self,
        inserted: &HashSet<String>,
        stored: &HashMap<String, String>,
        first_seen: &FirstSeen,
        now: DateTime<Utc>,
    ) -> Result<Vec<DedupOutcome>, StoreError> {
        self.items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let key = item.key.as_str();
                let first = self.first[i];
                if inserted.contains(key) {
                    return Ok(if i == first {
                        DedupOutcome::Applied
                    } else {
                        // The row this batch wrote holds the first item's fingerprint.
                        let written = self.items[first].fingerprint.as_str().to_string();
                        duplicate_or_conflict(written, &item.fingerprint, Some(now))
                    });
                }
                match stored.get(key) {
                    Some(s) => Ok(duplicate_or_conflict(
                        s.clone(),
                        &item.fingerprint,
                        first_seen.get(key).copied(),
                    )),
                    // Neither written nor found: deleted under us (a purge). Transient:
                    // the batch is retried.
                    None => Err(StoreError::RowVanished {
                        key: key.to_string(),
                    }),
                }
            })
            .collect()
    }

    /// The oldest duplicate of the batch: how long ago (at `now`) its key was first
    /// processed, in seconds; None when the batch dropped no duplicate with a known
    /// first time. What [`note_duplicate_age_sql`] keeps per consumer.
    pub fn oldest_duplicate(outcomes: &[DedupOutcome], now: DateTime<Utc>) -> Option<f64> {
        super::oldest_age(outcomes.iter().map(|o| o.duplicate_age(now)))
    }

    /// The applied items' zone exits, merged per device (in device order).
    pub fn zone_exits(&self, outcomes: &[DedupOutcome]) -> Vec<(&'a str, i64)> {
        let mut counts: HashMap<&str, i64> = HashMap::new();
        for (item, outcome) in self.items.iter().zip(outcomes) {
            if *outcome != DedupOutcome::Applied {
                continue;
            }
            match &item.write {
                BusinessWrite::CountZoneExit { device_id } => {
                    *counts.entry(device_id.as_str()).or_insert(0) += 1
                }
            }
        }
        let mut merged: Vec<(&str, i64)> = counts.into_iter().collect();
        merged.sort_unstable();
        merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{Fingerprint, MessageKey};

    fn item(key: &str, fp: &str, device: &str) -> Recordable {
        Recordable {
            key: MessageKey::from_stored(key.to_string()),
            fingerprint: Fingerprint::from_stored(fp.to_string()),
            write: BusinessWrite::CountZoneExit {
                device_id: device.into(),
            },
        }
    }

    #[test]
    fn outcomes_are_those_of_one_by_one_inserts() {
        let items = vec![
            item("b", "f1", "D1"),
            item("a", "f2", "D1"),
            item("b", "f1", "D1"), // same key, same bytes: duplicate of item 0
            item("b", "f9", "D2"), // same key, other bytes: conflict with item 0
            item("c", "f3", "D2"), // already stored, same fingerprint
            item("d", "f4", "D2"), // already stored, other fingerprint
            item("a", "f2", "D3"),
        ];
        let batch = DedupBatch::new(&items);
        let keys: Vec<&str> = batch.distinct().iter().map(|r| r.key.as_str()).collect();
        assert_eq!(keys, ["a", "b", "c", "d"]);
        let inserted: HashSet<String> = ["a", "b"].map(String::from).into();
        let stored: HashMap<String, String> =
            [("c".into(), "f3".into()), ("d".into(), "f0".into())].into();
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let c_at = now - chrono::Duration::seconds(3 * 3600 + 12 * 60);
        let first_seen: FirstSeen = [("c".into(), c_at), ("d".into(), c_at)].into();
        let out = batch
            .outcomes(&inserted, &stored, &first_seen, now)
            .unwrap();
        let conflict = |s: &str| DedupOutcome::KeyConflict {
            stored: Fingerprint::from_stored(s.into()),
        };
        assert_eq!(
            out,
            vec![
                DedupOutcome::Applied,
                DedupOutcome::Applied,
                DedupOutcome::Duplicate {
                    first_at: Some(now)
                },
                conflict("f1"),
                DedupOutcome::Duplicate {
                    first_at: Some(c_at)
                },
                conflict("f0"),
                DedupOutcome::Duplicate {
                    first_at: Some(now)
                },
            ]
        );
        assert_eq!(batch.zone_exits(&out), vec![("D1", 2)]);
        // The stored duplicate is the oldest: 3 h 12 m; a conflict has no age.
        let later = now + chrono::Duration::seconds(1);
        assert_eq!(
            DedupBatch::oldest_duplicate(&out, later),
            Some(3.0 * 3600.0 + 12.0 * 60.0 + 1.0)
        );
        assert_eq!(DedupBatch::oldest_duplicate(&out[..2], later), None);
    }

    #[test]
    fn a_key_neither_written_nor_stored_is_an_error_not_a_guess() {
        let items = vec![item("a", "f", "D")];
        let batch = DedupBatch::new(&items);
        let none = batch.outcomes(
            &HashSet::new(),
            &HashMap::new(),
            &FirstSeen::new(),
            Utc::now(),
        );
        assert!(none.is_err());
    }
}
