//! Chart markers: deploys, drills and manual notes from the `markers` table, and
//! restarts the dashboard saw itself in the scrapes (a counter reset or a new
//! `process_start_time_seconds`). One timeline, newest first, so a duplicate-rate
//! spike can be read next to the deploy or the restart that caused it.

use chrono::{DateTime, Utc};
use serde::Serialize;

/// Where a marker came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MarkerSource {
    /// A row of the `markers` table (written by deploy hooks, drills, operators).
    Database,
    /// Detected by the dashboard from two scrapes of a target.
    Scrape,
}

/// One vertical line on the charts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimelineMarker {
    pub at: DateTime<Utc>,
    /// `deploy`, `restart`, `drill`, `manual`, `incident`, `note` (a user's own table
    /// may have others).
    pub kind: String,
    pub label: String,
    pub detail: Option<String>,
    pub source: MarkerSource,
}

/// One letter per marker kind, for the chart's marker lane (terminal and report):
/// distinct from the plotted data even without colour.
pub fn glyph(kind: &str) -> &'static str {
    match kind {
        "deploy" => "D",
        "restart" => "R",
        "drill" => "X",
        "manual" => "M",
        "incident" => "I",
        "note" => "N",
        _ => "•",
    }
}

/// A restart marker for a target, from the scrape that revealed it.
pub fn restart_marker(target: &str, at: DateTime<Utc>, cause: &str) -> TimelineMarker {
    TimelineMarker {
        at,
        kind: "restart".into(),
        label: format!("{target} restarted"),
        detail: Some(cause.to_string()),
        source: MarkerSource::Scrape,
    }
}

/// Merge both sources newest first, keeping at most `limit`. A restart the database
/// already records (same kind within 5 s) is not shown twice: the row wins, it
/// carries the operator's label.
pub fn merge(
    database: &[TimelineMarker],
    scraped: &[TimelineMarker],
    limit: usize,
) -> Vec<TimelineMarker> {
    let near = |a: &TimelineMarker, b: &TimelineMarker| {
        a.kind == b.kind && (a.at - b.at).num_seconds().abs() <= 5
    };
    let mut all: Vec<TimelineMarker> = database.to_vec();
    all.extend(
        scraped
            .iter()
            .filter(|s| !database.iter().any(|d| near(d, s)))
            .cloned(),
    );
    all.sort_by_key(|m| std::cmp::Reverse(m.at));
    all.truncate(limit);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    #[test]
    fn merged_newest_first_without_double_restarts() {
        let db = vec![
            TimelineMarker {
                at: at(10),
                kind: "deploy".into(),
                label: "v2".into(),
                detail: None,
                source: MarkerSource::Database,
            },
            TimelineMarker {
                at: at(100),
                kind: "restart".into(),
                label: "sms restarted by k8s".into(),
                detail: None,
                source: MarkerSource::Database,
            },
        ];
        let scraped = vec![
            restart_marker("sms", at(102), "counter reset"),
            restart_marker("sms", at(50), "counter reset"),
        ];
        let merged = merge(&db, &scraped, 10);
        let times: Vec<_> = merged.iter().map(|m| m.at).collect();
        assert_eq!(times, vec![at(100), at(50), at(10)]);
        assert_eq!(merge(&db, &scraped, 1).len(), 1);
    }
}
