//! What really differs between the SQL backends, in one place per backend: how a
//! database's error codes are read (infrastructure or content, see
//! [`super::Failure`]), and the stored time format of the backends that keep time
//! as text. The store, the HTTP-edge store and the monitor's queries share it.

use chrono::{DateTime, NaiveDateTime, Utc};

pub(crate) mod mysql;
pub(crate) mod postgres;
pub(crate) mod sqlite;

/// The stored timestamp format of TEXT time columns (SQLite): fixed-width UTC with
/// microseconds, so that text order is time order. Written here only.
const TEXT_TIME_FORMAT: &str = "%Y-%m-%dT%H:%M:%S%.6fZ";

/// A time as the engine stores it in a TEXT column.
pub(crate) fn text_time(t: DateTime<Utc>) -> String {
    t.format(TEXT_TIME_FORMAT).to_string()
}

/// A TEXT time column read back: the engine's form (any RFC 3339), or SQLite's
/// `YYYY-MM-DD HH:MM:SS[.fff]` (a user's own table written with `datetime()`).
pub(crate) fn parse_text_time(s: &str) -> Option<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Some(t.with_timezone(&Utc));
    }
    NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f")
        .ok()
        .map(|n| n.and_utc())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_timestamps_sort_as_text_and_read_back() {
        let a = DateTime::from_timestamp(1_700_000_000, 5_000).unwrap();
        let b = DateTime::from_timestamp(1_700_000_000, 50_000_000).unwrap();
        assert!(text_time(a) < text_time(b));
        assert_eq!(parse_text_time(&text_time(b)), Some(b));
        assert_eq!(text_time(b), "2023-11-14T22:13:20.050000Z");
    }

    #[test]
    fn reads_both_timestamp_forms() {
        let engine = parse_text_time("2026-11-30T04:12:03.000000Z").unwrap();
        let sqlite = parse_text_time("2026-11-30 04:12:03").unwrap();
        assert_eq!(engine, sqlite);
        assert!(parse_text_time("yesterday").is_none());
    }
}
