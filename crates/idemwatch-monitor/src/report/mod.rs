//! The post-mortem export: one window of what the dashboard knows (the duplicate
//! rate per consumer with its markers, per-consumer rates, the alerts that held,
//! dead letters by reason, claims in doubt, drill verdicts) as plain data, written
//! as a self-contained HTML page (inline SVG, no external asset: it opens from a
//! mail attachment or an incident ticket), JSON, or CSV.
//!
//! Built from a [`Snapshot`] (the dashboard's `e`: the window on screen, from the
//! session's own series) or by `idemwatch report` from a fresh poll of the
//! configured sources. Sits above the monitor and below the TUI and the CLI.

use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::alerts::AlertRecord;
use crate::db::{DeadLetterGroup, DrillRunSummary, InDoubtClaim};
use crate::deploys::DeployBudget;
use crate::markers::TimelineMarker;
use crate::Snapshot;

mod csv;
mod html;

/// Output formats of `idemwatch report`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Format {
    #[default]
    Html,
    Json,
    Csv,
}

impl Format {
    /// The file extension an export in this format takes.
    pub fn extension(self) -> &'static str {
        match self {
            Format::Html => "html",
            Format::Json => "json",
            Format::Csv => "csv",
        }
    }
}

/// One point of a consumer's window, in the shape of `snapshot --json`'s history.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ReportPoint {
    /// Unix seconds.
    pub t: i64,
    pub duplicate_ratio: Option<f64>,
    pub processed_per_second: Option<f64>,
    pub duplicate_dropped_per_second: Option<f64>,
    /// Beyond `snapshot --json`'s shape: deliveries flagged redelivered and dead
    /// letters (all reasons) per second.
    pub redelivered_per_second: Option<f64>,
    pub dead_lettered_per_second: Option<f64>,
}

/// One consumer over the window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerReport {
    pub target: String,
    pub consumer: String,
    /// Means over the window's points.
    pub processed_per_second: Option<f64>,
    pub duplicate_dropped_per_second: Option<f64>,
    /// Mean duplicates over mean traffic (docs/CONTRACT.md §5), and the highest point.
    pub duplicate_ratio: Option<f64>,
    pub peak_duplicate_ratio: Option<f64>,
    /// Means over the window's points, like the rates above.
    pub redelivered_per_second: Option<f64>,
    pub dead_lettered_per_second: Option<f64>,
    pub points: Vec<ReportPoint>,
}

/// Everything one report shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub generated_at: DateTime<Utc>,
    /// Where the rates come from: `dashboard` (the session's own scrapes),
    /// `prometheus` or `database`.
    pub source: String,
    pub consumers: Vec<ConsumerReport>,
    /// In the window, oldest first.
    pub markers: Vec<TimelineMarker>,
    /// The deploys and restarts marked in the window with their duplicate budget
    /// ([`crate::deploys`]; a window reaching past the report's end is as the poll
    /// saw it), oldest first.
    pub deploys: Vec<DeployBudget>,
    /// Alerts that held at some point in the window, oldest first.
    pub alerts: Vec<AlertRecord>,
    pub dead_letters: Vec<DeadLetterGroup>,
    pub claims_in_doubt_total: i64,
    pub claims_in_doubt: Vec<InDoubtClaim>,
    pub drill_runs: Vec<DrillRunSummary>,
    /// Each consumer's duplicate ages against its dedup windows, as at the report's
    /// snapshot (`crate::windows`).
    pub windows: Vec<crate::windows::ConsumerWindows>,
    /// What the report could not show and why.
    pub notes: Vec<String>,
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0u32), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / f64::from(n))
}

impl ConsumerReport {
    /// A consumer's summary from its points.
    pub fn from_points(target: &str, consumer: &str, points: Vec<ReportPoint>) -> Self {
        let processed = mean(points.iter().filter_map(|p| p.processed_per_second));
        let dups = mean(points.iter().filter_map(|p| p.duplicate_dropped_per_second));
        let ratio = match (processed, dups) {
            (Some(p), Some(d)) => crate::rates::duplicate_ratio(p, d),
            _ => None,
        };
        ConsumerReport {
            target: target.to_string(),
            consumer: consumer.to_string(),
            processed_per_second: processed,
            duplicate_dropped_per_second: dups,
            duplicate_ratio: ratio,
            peak_duplicate_ratio: points
                .iter()
                .filter_map(|p| p.duplicate_ratio)
                .reduce(f64::max),
            redelivered_per_second: mean(points.iter().filter_map(|p| p.redelivered_per_second)),
            dead_lettered_per_second: mean(
                points.iter().filter_map(|p| p.dead_lettered_per_second),
            ),
            points,
        }
    }
}

impl Report {
    /// The window on the dashboard's screen: its zoom's span up to the snapshot,
    /// from the session's own scrapes.
    pub fn from_snapshot(snapshot: &Snapshot) -> Report {
        let to = snapshot.taken_at;
        let span = snapshot
            .charts
            .first()
            .map(|c| c.span_seconds)
            .unwrap_or(900);
        let from = to - chrono::Duration::seconds(i64::try_from(span).unwrap_or(i64::MAX));
        Report::for_window(snapshot, from, to, "dashboard")
    }

    /// The part of one snapshot that falls in `from..=to`: the charted points, the
    /// markers, the alerts that held, the drill runs that started; dead letters and
    /// claims in doubt as the database has them now.
    pub fn for_window(
        snapshot: &Snapshot,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        source: &str,
    ) -> Report {
        let in_window = |t: DateTime<Utc>| t >= from && t <= to;
        let consumers = snapshot
            .charts
            .iter()
            .map(|c| {
                let points = c
                    .duplicate_ratio
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| in_window(r.at))
                    .map(|(i, r)| ReportPoint {
                        t: r.at.timestamp(),
                        duplicate_ratio: r.value,
                        processed_per_second: c.processed_per_s.get(i).and_then(|p| p.value),
                        duplicate_dropped_per_second: c
                            .duplicates_per_s
                            .get(i)
                            .and_then(|p| p.value),
                        redelivered_per_second: c.redelivered_per_s.get(i).and_then(|p| p.value),
                        dead_lettered_per_second: c
                            .dead_lettered_per_s
                            .get(i)
                            .and_then(|p| p.value),
                    })
                    .collect();
                ConsumerReport::from_points(&c.target, &c.consumer, points)
            })
            .collect();
        let mut alerts: Vec<AlertRecord> = snapshot
            .ended_alerts
            .iter()
            .filter(|r| r.started <= to && r.ended.is_none_or(|e| e >= from))
            .cloned()
            .collect();
        alerts.extend(
            snapshot
                .alerts
                .iter()
                .filter(|a| a.since.is_none_or(|s| s <= to) && snapshot.taken_at >= from)
                .map(|a| AlertRecord {
                    alert: a.clone(),
                    started: a.since.unwrap_or(snapshot.taken_at),
                    ended: None,
                }),
        );
        alerts.sort_by_key(|r| r.started);
        let db = snapshot.database.as_ref();
        let mut report = Report {
            from,
            to,
            generated_at: Utc::now(),
            source: source.to_string(),
            consumers,
            markers: Vec::new(),
            deploys: Vec::new(),
            alerts,
            dead_letters: db.map(|d| d.dead_letters.clone()).unwrap_or_default(),
            claims_in_doubt_total: db.map_or(0, |d| d.claims_in_doubt_total),
            claims_in_doubt: db.map(|d| d.claims_in_doubt.clone()).unwrap_or_default(),
            drill_runs: Vec::new(),
            windows: snapshot.windows.clone(),
            notes: Vec::new(),
        };
        report.set_markers(&snapshot.markers);
        report.set_deploys(&snapshot.deploys);
        report.set_drill_runs(db.map(|d| d.drill_runs.as_slice()).unwrap_or(&[]));
        if db.is_none() {
            report
                .notes
                .push("no database configured: no dead letters, claims or drill runs".into());
        }
        report
    }

    /// The alerts of a past window: those replayed over it
    /// ([`crate::Monitor::past_alerts`]), and of the poll's own alerts those
    /// the replay cannot see (a database down, claims in doubt…) when the window
    /// reaches the poll (they are about now).
    pub fn set_past_alerts(&mut self, replayed: Vec<AlertRecord>, snapshot: &Snapshot) {
        let reaches_poll = snapshot.taken_at - self.to <= chrono::Duration::minutes(1);
        let mut alerts = replayed;
        if reaches_poll {
            alerts.extend(
                snapshot
                    .alerts
                    .iter()
                    .filter(|a| !crate::replay::REPLAYED_KINDS.contains(&a.kind.name()))
                    .map(|a| AlertRecord {
                        alert: a.clone(),
                        started: a.since.unwrap_or(snapshot.taken_at),
                        ended: None,
                    }),
            );
        }
        alerts.sort_by_key(|r| r.started);
        self.alerts = alerts;
    }

    /// Keep the markers of the window, oldest first.
    pub fn set_markers(&mut self, markers: &[TimelineMarker]) {
        let mut m: Vec<TimelineMarker> = markers
            .iter()
            .filter(|m| m.at >= self.from && m.at <= self.to)
            .cloned()
            .collect();
        m.sort_by_key(|m| m.at);
        self.markers = m;
    }

    /// Keep the deploys marked in the window, oldest first.
    pub fn set_deploys(&mut self, deploys: &[DeployBudget]) {
        let mut d: Vec<DeployBudget> = deploys
            .iter()
            .filter(|d| d.at >= self.from && d.at <= self.to)
            .cloned()
            .collect();
        d.sort_by_key(|d| d.at);
        self.deploys = d;
    }

    /// Keep the drill runs that started in the window.
    pub fn set_drill_runs(&mut self, runs: &[DrillRunSummary]) {
        self.drill_runs = runs
            .iter()
            .filter(|r| r.started_at.is_some_and(|s| s >= self.from && s <= self.to))
            .cloned()
            .collect();
    }

    /// The report in one format.
    pub fn render(&self, format: Format) -> String {
        match format {
            Format::Html => html::page(self),
            Format::Json => serde_json::to_string_pretty(self).unwrap_or_default(),
            Format::Csv => csv::table(self),
        }
    }

    /// Write it to `path` (created or replaced).
    pub fn write(&self, format: Format, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.render(format))
    }

    /// The name an export of this report takes in a directory: the window's end to
    /// the second, so a directory of exports lists in time order and a later
    /// window never replaces an earlier one.
    pub fn file_name(&self, format: Format) -> String {
        format!(
            "idemwatch-report-{}.{}",
            self.to.format("%Y%m%d-%H%M%S"),
            format.extension()
        )
    }

    /// Write it into `dir` (created if missing) under [`Report::file_name`]: the
    /// path, and whether it was written (the dashboard's `e` names the path either
    /// way on its status line).
    pub fn export_into(&self, format: Format, dir: &Path) -> (PathBuf, std::io::Result<()>) {
        let path = dir.join(self.file_name(format));
        let written = std::fs::create_dir_all(dir).and_then(|()| self.write(format, &path));
        (path, written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report_to(to: DateTime<Utc>) -> Report {
        Report {
            from: to - chrono::Duration::minutes(15),
            to,
            generated_at: to,
            source: "dashboard".into(),
            consumers: Vec::new(),
            markers: Vec::new(),
            deploys: Vec::new(),
            alerts: Vec::new(),
            windows: Vec::new(),
            dead_letters: Vec::new(),
            claims_in_doubt_total: 0,
            claims_in_doubt: Vec::new(),
            drill_runs: Vec::new(),
            notes: Vec::new(),
        }
    }

    #[test]
    fn an_export_is_named_by_its_window_end_in_a_directory_it_creates() {
        let to = chrono::TimeZone::with_ymd_and_hms(&Utc, 2026, 11, 30, 4, 12, 3).unwrap();
        let scratch = tempfile::tempdir().expect("scratch dir");
        let dir = scratch.path().join("reports");
        let (path, written) = report_to(to).export_into(Format::Html, &dir);
        written.expect("written");
        assert_eq!(path, dir.join("idemwatch-report-20261130-041203.html"));
        let page = std::fs::read_to_string(&path).expect("the page");
        assert!(page.starts_with("<!DOCTYPE html>"), "{}", &page[..40]);
        let (json, written) = report_to(to).export_into(Format::Json, &dir);
        written.expect("written");
        assert_eq!(
            json.file_name().unwrap(),
            "idemwatch-report-20261130-041203.json"
        );
    }

    /// A deploy of the window is in every format: an HTML table row per consumer, a
    /// CSV row of section `deploy`, the JSON `deploys` array; one before the window is
    /// left out.
    #[test]
    fn the_deploys_of_the_window_are_in_every_format() {
        use crate::deploys::{budgets, ConsumerSteps, Step};
        use crate::markers::MarkerSource;
        let to = chrono::TimeZone::with_ymd_and_hms(&Utc, 2026, 11, 30, 4, 15, 0).unwrap();
        let at = |s: i64| to - chrono::Duration::seconds(s);
        let steps = (0..1200)
            .map(|s| Step {
                end: at(1200 - s),
                processed: 10.0,
                duplicates: if s == 500 { 7.0 } else { 0.0 },
            })
            .collect();
        let marker = |s: i64, label: &str| TimelineMarker {
            at: at(s),
            kind: "deploy".into(),
            label: label.into(),
            detail: None,
            source: MarkerSource::Database,
        };
        let deploys = budgets(
            &[marker(1100, "v1"), marker(300, "v2")],
            &[ConsumerSteps {
                target: "fleet".into(),
                consumer: "zone-exit-sms".into(),
                steps,
            }],
            &crate::config::AlertRules::default(),
            to,
        );
        let mut r = report_to(to);
        r.set_deploys(&deploys);
        assert_eq!(r.deploys.len(), 1, "v1 was marked before the window");
        assert_eq!(r.deploys[0].label, "v2");
        let html = r.render(Format::Html);
        assert!(
            html.contains("<h2>Deploys: duplicate budget per window</h2>"),
            "{html}"
        );
        assert!(html.contains("<td>fleet/zone-exit-sms</td>"), "{html}");
        let csv = r.render(Format::Csv);
        let row = csv
            .lines()
            .find(|l| l.starts_with("deploy,"))
            .expect("a deploy row");
        assert!(row.contains(",fleet,zone-exit-sms,v2,0,"), "{row}");
        assert!(row.contains("verdict=within"), "{row}");
        let json: serde_json::Value = serde_json::from_str(&r.render(Format::Json)).unwrap();
        assert_eq!(json["deploys"][0]["consumers"][0]["duplicates"], 0.0);
        assert_eq!(json["deploys"][0]["ends"], "open");
        // The deploy before: 7 duplicates among 6000 (its window ended at the settle
        // time, 10 min, before the next).
        let v1 = &deploys[1].consumers[0];
        assert_eq!((v1.processed, v1.duplicates), (6000.0, 7.0));
    }

    #[test]
    fn an_export_that_cannot_be_written_still_names_its_path() {
        let scratch = tempfile::tempdir().expect("scratch dir");
        // A file where the directory should be.
        let blocked = scratch.path().join("reports");
        std::fs::write(&blocked, "").expect("a file");
        let (path, written) = report_to(Utc::now()).export_into(Format::Csv, &blocked);
        assert!(written.is_err());
        assert!(path.starts_with(&blocked) && path.extension().unwrap() == "csv");
    }
}
