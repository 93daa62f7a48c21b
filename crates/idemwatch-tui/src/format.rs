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

pub use idemwatch_base::clock::clock;

/// `text` in at most `width` characters, `…` where it was cut.
pub fn fit(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// `text` in lines of at most `width` characters, broken between words, at most
/// `max_lines` of them; the last ends in `…` when text was left out. A long alert
/// then keeps its object on a second line instead of losing it at the edge.
pub fn wrap(text: &str, width: usize, max_lines: usize) -> Vec<String> {
    let width = width.max(1);
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split(' ') {
        let len = line.chars().count();
        let need = word.chars().count() + usize::from(len > 0);
        if len > 0 && len + need > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    let cut = lines.len() > max_lines;
    lines.truncate(max_lines.max(1));
    for l in &mut lines {
        if l.chars().count() > width {
            *l = fit(l, width);
        }
    }
    if cut {
        if let Some(last) = lines.last_mut() {
            let keep = width.saturating_sub(1).min(last.chars().count());
            *last = last.chars().take(keep).collect::<String>() + "…";
        }
    }
    lines
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

    #[test]
    fn wrap_breaks_between_words_and_marks_what_it_leaves_out() {
        assert_eq!(wrap("a bb ccc", 4, 3), vec!["a bb", "ccc"]);
        assert_eq!(wrap("short", 10, 2), vec!["short"]);
        assert_eq!(wrap("one two three four", 8, 2), vec!["one two", "three…"]);
        assert_eq!(wrap("abcdefghij", 4, 2), vec!["abc…"]);
    }
}
