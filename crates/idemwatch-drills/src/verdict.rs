//! A drill's or chaos run's verdict in Jepsen's queue terms, over effects (docs/CONTRACT.md §9):
//! of the effects the run is about (an SMS, a webhook, a counter's +1, a state row),
//! how many were `lost` (never applied), `duplicated` (applied more than once),
//! `recovered` (applied exactly once although the way to it met a fault: a crash, a
//! takeover of a claim in doubt, a record retried), and the `ok_fraction` (applied as
//! expected, of all); beside them `provider_repeat_calls`, the provider's own count of
//! calls beyond the first per key (what a provider ignoring Idempotency-Key would have
//! turned into second SMS).
//!
//! The figures come from outside the engine where they can (the sandbox provider's
//! records, the business tables), never from its own counters: they are what the run
//! checks the engine against.

use std::collections::HashMap;

use serde::Serialize;

/// One effect a run is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EffectTally {
    pub name: String,
    /// How many times it should be applied by the run: 1 (exactly once) or 0 (it was
    /// applied before the run, or must never be: any application is one too many).
    pub expected: u64,
    /// How many times it was.
    pub applied: u64,
    /// Whether the way to it met a fault (its outcome was indeterminate for a while).
    pub interrupted: bool,
}

impl EffectTally {
    pub fn new(name: impl Into<String>, expected: u64, applied: u64, interrupted: bool) -> Self {
        EffectTally {
            name: name.into(),
            expected,
            applied,
            interrupted,
        }
    }

    fn lost(&self) -> bool {
        self.expected > 0 && self.applied == 0
    }

    /// Applied more than once in all: past what the run expected, or at all when it
    /// had been applied before (expected 0).
    fn duplicated(&self) -> bool {
        self.applied > self.expected
    }

    fn ok(&self) -> bool {
        self.applied == self.expected
    }
}

/// The verdict's figures (serialized flat into a drill's or chaos run's report).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EffectVerdict {
    /// Effects expected and never applied.
    pub lost: u64,
    /// Effects applied more than once.
    pub duplicated: u64,
    /// Effects applied exactly once although a fault met the way to them.
    pub recovered: u64,
    /// Effects applied as expected, of all the run is about (1 when it is about none).
    pub ok_fraction: f64,
    /// Provider calls beyond the first per key (the sandbox's records).
    pub provider_repeat_calls: u64,
}

impl EffectVerdict {
    pub fn of(effects: &[EffectTally], provider_repeat_calls: u64) -> Self {
        let count = |f: fn(&EffectTally) -> bool| effects.iter().filter(|e| f(e)).count() as u64;
        let ok = count(EffectTally::ok);
        EffectVerdict {
            lost: count(EffectTally::lost),
            duplicated: count(EffectTally::duplicated),
            recovered: count(|e| e.interrupted && e.expected == 1 && e.applied == 1),
            ok_fraction: if effects.is_empty() {
                1.0
            } else {
                ok as f64 / effects.len() as f64
            },
            provider_repeat_calls,
        }
    }

    /// One line for a terminal.
    pub fn render(&self) -> String {
        format!(
            "lost {}  duplicated {}  recovered {}  ok {:.1} %  provider repeat calls {}",
            self.lost,
            self.duplicated,
            self.recovered,
            self.ok_fraction * 100.0,
            self.provider_repeat_calls
        )
    }
}

/// Calls beyond the first per key: each call named by its Idempotency-Key, or by its
/// content when it carried none (a naive consumer's: the same SMS text twice is the
/// same effect twice).
pub fn repeat_calls<'a>(calls: impl IntoIterator<Item = (Option<&'a str>, String)>) -> u64 {
    let mut per: HashMap<String, u64> = HashMap::new();
    for (key, content) in calls {
        let name = match key {
            Some(k) => format!("key:{k}"),
            None => format!("content:{content}"),
        };
        *per.entry(name).or_default() += 1;
    }
    per.values().map(|n| n.saturating_sub(1)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lost, duplicated, recovered and the ok fraction as Jepsen's queue checker counts
    /// them, over effects: one never applied, one applied twice, one applied once
    /// after a crash, one must-not (applied before the run) applied again, one fine.
    #[test]
    fn a_verdict_counts_lost_duplicated_and_recovered_effects() {
        let effects = [
            EffectTally::new("sms never sent", 1, 0, true),
            EffectTally::new("sms sent twice", 1, 2, true),
            EffectTally::new("sms sent once after a crash", 1, 1, true),
            EffectTally::new("already applied, applied again", 0, 1, false),
            EffectTally::new("counter +1", 1, 1, false),
        ];
        let v = EffectVerdict::of(&effects, 3);
        assert_eq!(
            (v.lost, v.duplicated, v.recovered, v.provider_repeat_calls),
            (1, 2, 1, 3)
        );
        assert!((v.ok_fraction - 0.4).abs() < 1e-9, "{v:?}");
        assert_eq!(EffectVerdict::of(&[], 0).ok_fraction, 1.0);
        assert_eq!(
            v.render(),
            "lost 1  duplicated 2  recovered 1  ok 40.0 %  provider repeat calls 3"
        );
    }

    /// Calls count per key, or per content without one: a key called three times is
    /// two repeats, two identical keyless texts one, distinct ones none.
    #[test]
    fn repeat_calls_are_the_calls_beyond_the_first_per_key_or_content() {
        let calls = [
            (Some("k1"), "a".to_string()),
            (Some("k1"), "a".to_string()),
            (Some("k1"), "a".to_string()),
            (Some("k2"), "a".to_string()),
            (None, "left zone X".to_string()),
            (None, "left zone X".to_string()),
            (None, "left zone Y".to_string()),
        ];
        assert_eq!(repeat_calls(calls.iter().map(|(k, c)| (*k, c.clone()))), 3);
    }
}
