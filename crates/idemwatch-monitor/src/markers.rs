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
    /// Found in a Prometheus server's history of the window before the dashboard
    /// started (a new `process_start_time_seconds`, or a counter reset).
    Prometheus,
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

/// How long after a deploy (or a recorded restart) the restarts seen in the scrapes
/// are that deploy's own: a rolling restart replaces processes for a while after
/// its hook wrote the marker.
pub const EXPLAINED_AFTER: chrono::TimeDelta = chrono::TimeDelta::seconds(120);
/// Restarts of one target closer together than this are one marker ("restarted
/// 3×"): a crash loop is one event on the chart, not a wall of ticks.
pub const RESTART_DEBOUNCE: chrono::TimeDelta = chrono::TimeDelta::seconds(60);

/// How long after a restart the Prometheus history found (at the new start time)
/// the dashboard's scrapes may see that same restart (at the first scrape after it:
/// later by a poll interval, more when the target took a while to come back).
pub const SEEN_TWICE_WITHIN: chrono::TimeDelta = RESTART_DEBOUNCE;

/// The restarts without those found twice: a restart of the history that a scrape
/// saw too (same target, the scrape at most [`SEEN_TWICE_WITHIN`] after it, or up to
/// 5 s before it for clock skew) is the scrape's marker only. One to one, nearest
/// first, so a crash loop that both saw still counts each restart once.
fn seen_once(restarts: &[TimelineMarker]) -> Vec<&TimelineMarker> {
    let mut doubles = vec![false; restarts.len()];
    for s in restarts.iter().filter(|m| m.source == MarkerSource::Scrape) {
        let twin = restarts
            .iter()
            .enumerate()
            .filter(|(i, p)| {
                !doubles[*i]
                    && p.source == MarkerSource::Prometheus
                    && p.label == s.label
                    && s.at - p.at <= SEEN_TWICE_WITHIN
                    && p.at - s.at <= chrono::TimeDelta::seconds(5)
            })
            .min_by_key(|(_, p)| (s.at - p.at).abs())
            .map(|(i, _)| i);
        if let Some(i) = twin {
            doubles[i] = true;
        }
    }
    restarts
        .iter()
        .zip(doubles)
        .filter(|(_, double)| !double)
        .map(|(m, _)| m)
        .collect()
}

/// Merge both sources newest first, keeping at most `limit`. A restart the
/// database explains is not shown twice: a deploy or restart row up to 5 s after it
/// or up to [`EXPLAINED_AFTER`] before it wins, it carries the operator's label (its
/// detail then says the scrapes saw the restart). Scraped restarts of one target
/// within [`RESTART_DEBOUNCE`] of each other are one marker; a restart both the
/// history and the scrapes found counts once ([`seen_once`]).
pub fn merge(
    database: &[TimelineMarker],
    scraped: &[TimelineMarker],
    limit: usize,
) -> Vec<TimelineMarker> {
    let explains = |d: &TimelineMarker, s: &TimelineMarker| {
        matches!(d.kind.as_str(), "deploy" | "restart")
            && s.at - d.at <= EXPLAINED_AFTER
            && d.at - s.at <= chrono::TimeDelta::seconds(5)
    };
    let mut all: Vec<TimelineMarker> = database.to_vec();
    let mut restarts = seen_once(scraped);
    restarts.sort_by_key(|m| m.at);
    // (the group's first restart, how many, its last)
    let mut kept: Vec<(TimelineMarker, u32, DateTime<Utc>)> = Vec::new();
    for s in restarts {
        let nearest = all
            .iter_mut()
            .filter(|d| explains(d, s))
            .min_by_key(|d| (s.at - d.at).abs());
        if let Some(d) = nearest {
            let seen = format!("{} (seen in the scrapes)", s.label);
            match &mut d.detail {
                Some(detail) if detail.contains(&seen) => {}
                Some(detail) => *detail = format!("{detail}; {seen}"),
                None => d.detail = Some(seen),
            }
            continue;
        }
        match kept
            .iter_mut()
            .rev()
            .find(|(k, _, _)| k.kind == s.kind && k.label == s.label)
        {
            Some((_, n, last)) if s.at - *last <= RESTART_DEBOUNCE => {
                *n += 1;
                *last = s.at;
            }
            _ => kept.push((s.clone(), 1, s.at)),
        }
    }
    all.extend(kept.into_iter().map(|(mut m, n, last)| {
        if n > 1 {
            m.label = format!("{} {n}×", m.label);
            m.detail = Some(format!(
                "{}; the last at {}",
                m.detail.unwrap_or_default(),
                idemwatch_base::clock::clock(last)
            ));
        }
        m
    }));
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
        assert_eq!(times, vec![at(100), at(10)]);
        assert_eq!(
            merged[0].detail.as_deref(),
            Some("sms restarted (seen in the scrapes)")
        );
        assert_eq!(
            merged[1].detail.as_deref(),
            Some("sms restarted (seen in the scrapes)"),
            "40 s after the deploy: its rolling restart"
        );
        assert_eq!(merge(&db, &scraped, 1).len(), 1);
    }

    #[test]
    fn a_crash_loop_is_one_marker_and_separate_restarts_stay_apart() {
        let scraped: Vec<TimelineMarker> = [0, 20, 45, 90, 400]
            .iter()
            .map(|s| restart_marker("sms", at(*s), "counter reset"))
            .chain([restart_marker("erp", at(30), "counter reset")])
            .collect();
        let merged = merge(&[], &scraped, 10);
        let shown: Vec<(i64, &str)> = merged
            .iter()
            .map(|m| ((m.at - at(0)).num_seconds(), m.label.as_str()))
            .collect();
        assert_eq!(
            shown,
            vec![
                (400, "sms restarted"),
                (30, "erp restarted"),
                (0, "sms restarted 4×")
            ]
        );
    }

    /// One restart that both the Prometheus history (at the new start time) and the
    /// dashboard's own scrapes (at the scrape that saw it, seconds later) found is one
    /// marker, not "restarted 2×"; a second real restart a minute later is still
    /// counted.
    #[test]
    fn a_restart_in_the_history_and_in_the_scrapes_is_one_marker() {
        let from_history = |s: i64| TimelineMarker {
            source: MarkerSource::Prometheus,
            detail: Some("process_start_time_seconds changed (Prometheus history)".into()),
            ..restart_marker("sms", at(s), "")
        };
        let merged = merge(
            &[],
            &[
                from_history(0),
                restart_marker("sms", at(2), "new start time"),
            ],
            10,
        );
        assert_eq!(merged.len(), 1, "{merged:?}");
        assert_eq!(merged[0].label, "sms restarted");
        let merged = merge(
            &[],
            &[
                from_history(0),
                restart_marker("sms", at(2), "new start time"),
                from_history(40),
                restart_marker("sms", at(41), "new start time"),
            ],
            10,
        );
        assert_eq!(merged.len(), 1, "{merged:?}");
        assert_eq!(
            merged[0].label, "sms restarted 2×",
            "two restarts, each seen twice"
        );
    }

    #[test]
    fn twenty_minutes_of_deploys_show_one_marker_each() {
        // A deploy every two minutes, its rolling restart seen 6 s later.
        let db: Vec<TimelineMarker> = (0..10)
            .map(|i| TimelineMarker {
                at: at(i * 120),
                kind: "deploy".into(),
                label: format!("deploy #{i}"),
                detail: None,
                source: MarkerSource::Database,
            })
            .collect();
        let scraped: Vec<TimelineMarker> = (0..10)
            .map(|i| restart_marker("demo", at(i * 120 + 6), "new start time"))
            .collect();
        let merged = merge(&db, &scraped, 50);
        assert_eq!(merged.len(), 10);
        assert!(merged.iter().all(|m| m.kind == "deploy"), "{merged:?}");
    }
}
