//! Number and time formatting shared by every screen.

use chrono::{DateTime, Utc};

/// `12.3/s`, `0.04/s`, `—` when unknown.
pub fn rate(v: Option<f64>) -> String {
    match v {
        None => "—".into(),
        Some(0.0) => "0".into(),
        Some(v) if v < 0.1 => format!("{v:.3}"),
        Some(v) if v < 10.0 => format!("{v:.2}"),
        Some(v) => format!("{v:.1}"),
    }
}

/// A ratio as a percentage: `0.010%`, `—` when nothing flowed.
pub fn pct(ratio: Option<f64>) -> String {
    match ratio {
        None => "—".into(),
        Some(0.0) => "0%".into(),
        Some(r) if r < 0.01 => format!("{:.3}%", r * 100.0),
        Some(r) => format!("{:.2}%", r * 100.0),
    }
}

/// A count that may be fractional in the exposition.
pub fn count(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v:.1}")
    }
}

/// `42s`, `3m 10s`, `2h 05m`, `3d 04h`.
pub fn duration(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {:02}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {:02}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// `12s ago`, or `—`.
pub fn ago(at: Option<DateTime<Utc>>, now: DateTime<Utc>) -> String {
    match at {
        None => "—".into(),
        Some(t) => format!("{} ago", duration((now - t).num_seconds())),
    }
}

/// `HH:MM:SS` in UTC.
pub fn clock(t: DateTime<Utc>) -> String {
    t.format("%H:%M:%S").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_read_like_an_operator_writes() {
        assert_eq!(pct(Some(0.0001)), "0.010%");
        assert_eq!(pct(Some(0.004)), "0.400%");
        assert_eq!(pct(Some(0.25)), "25.00%");
        assert_eq!(pct(None), "—");
        assert_eq!(rate(Some(12.345)), "12.3");
        assert_eq!(duration(190), "3m 10s");
        assert_eq!(duration(7 * 86_400 + 3600), "7d 01h");
    }
}
