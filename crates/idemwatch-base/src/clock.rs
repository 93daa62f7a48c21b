//! How a time is shown to a person: the one place for the display formats.
//!
//! Every surface that prints a time for an operator (the dashboard, the CLI's tables,
//! the post-mortem report, a marker's detail) shows it in UTC in one of these two
//! forms, so a row in `dead-letters` and the same row on the dashboard read alike.
//! How a time is *stored* is the SQL dialect's contract
//! (`engine::store::dialect`), not this one.

use chrono::{DateTime, Utc};

/// `HH:MM:SS`, UTC: a time within the window on screen.
pub const CLOCK: &str = "%H:%M:%S";

/// `YYYY-MM-DD HH:MM:SS`, UTC: a time that may be on another day.
pub const DATE_TIME: &str = "%Y-%m-%d %H:%M:%S";

/// `t` as [`CLOCK`].
pub fn clock(t: DateTime<Utc>) -> String {
    t.format(CLOCK).to_string()
}

/// `t` as [`DATE_TIME`].
pub fn date_time(t: DateTime<Utc>) -> String {
    t.format(DATE_TIME).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn both_forms_are_utc_and_zero_padded() {
        let t = Utc.with_ymd_and_hms(2026, 3, 4, 5, 6, 7).unwrap();
        assert_eq!(clock(t), "05:06:07");
        assert_eq!(date_time(t), "2026-03-04 05:06:07");
    }
}
