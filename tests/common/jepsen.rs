//! Jepsen's queue terms over effects (the `total-queue` checker's, counted per
//! message on what the consumers did rather than on what a dequeue returned): a small
//! tally for the fault tests, kept here until the drills' verdicts carry the same
//! fields (issue 39, item 4) and the tests can point at those.

use std::collections::HashMap;

/// How one publish ended, as the producer saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Publish {
    /// The queue confirmed it.
    Acked,
    /// It failed or timed out: it may or may not be in the queue (Jepsen's `info`).
    Indeterminate,
}

/// Each attempted message against the effects found for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    pub attempted: usize,
    pub acked: usize,
    /// Acked, and its effect is not there.
    pub lost: usize,
    /// Its effect is there more than once.
    pub duplicated: usize,
    /// Indeterminate, and its effect is there (once).
    pub recovered: usize,
    /// Its effect is there exactly once.
    pub ok: usize,
}

impl Tally {
    /// `published`: each message (by its key) and how its publish ended; `effects`:
    /// how many times each key's effect happened (a key absent: none).
    pub fn of(published: &[(String, Publish)], effects: &HashMap<String, u64>) -> Tally {
        let mut t = Tally {
            attempted: published.len(),
            ..Tally::default()
        };
        for (key, publish) in published {
            let n = effects.get(key).copied().unwrap_or(0);
            if *publish == Publish::Acked {
                t.acked += 1;
                if n == 0 {
                    t.lost += 1;
                }
            } else if n == 1 {
                t.recovered += 1;
            }
            if n == 1 {
                t.ok += 1;
            }
            if n > 1 {
                t.duplicated += 1;
            }
        }
        t
    }

    /// Messages whose effect is there exactly once, of those attempted.
    pub fn ok_fraction(&self) -> f64 {
        if self.attempted == 0 {
            return 1.0;
        }
        self.ok as f64 / self.attempted as f64
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "attempted {} acked {} lost {} duplicated {} recovered {} ok-fraction {:.3}",
            self.attempted,
            self.acked,
            self.lost,
            self.duplicated,
            self.recovered,
            self.ok_fraction()
        )
    }
}
