//! The dashboard's data layer: sources in, plain-data [`Snapshot`]s out.
//!
//! No terminal types here, so the same snapshot feeds `idemwatch snapshot --json`
//! and the TUI. A [`Monitor`] owns the sources (scrape targets, the database) and the
//! memory between polls (counter readings for rates, restart detection, bounded
//! series); each [`Monitor::poll`] yields one [`Snapshot`]. The TUI runs it on its
//! own task with [`Monitor::spawn`] and receives snapshots over a `watch` channel,
//! so a slow source never blocks a frame.
//!
//! Beside it: [`config`], the dashboard's config file, and [`report`], a snapshot
//! turned into the post-mortem's HTML/JSON/CSV.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use serde::Serialize;
use tokio::sync::{mpsc, watch};

use crate::config::Config;

pub mod alerts;
pub mod bytes;
pub mod config;
pub mod db;
pub mod deploys;
pub mod history;
pub mod jetstream;
pub mod markers;
pub mod promql;
pub mod ratios;
/// The Prometheus text parser and scraper live below every layer that reads an
/// exposition (the monitor here, the live drill): one parser, no backwards arrow.
pub use idemwatch_base::exposition as prometheus;
pub mod rates;
pub mod replay;
pub mod report;
pub mod series;
pub mod targets;
pub mod vehicles;
pub mod windows;
pub mod zoom;

use alerts::{Alert, AlertInputs, AlertLog, AlertRecord};
use db::{DbError, DbPoller, DbStats, DeadLetterDetail};
use deploys::{ConsumerSteps, DeployBudget};
use history::{Fetched, History, HistoryClient, HistoryRequest, HistoryState, HistoryStatus};
use markers::TimelineMarker;
use prometheus::Scraper;
use series::{Point, MAX_RETENTION};
use targets::{BrokerStatus, ConsumerSeries, ConsumerStatus, TargetStatus, TargetTracker};
use vehicles::VehicleDetail;
use zoom::Zoom;

/// Why a monitor could not be built (a poll itself never fails: a failing source is
/// reported inside the snapshot).
#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error("cannot build the HTTP client: {0}")]
    Http(#[from] reqwest::Error),
    #[error(transparent)]
    Db(#[from] DbError),
}

/// Restart markers the dashboard remembers.
const SCRAPED_MARKERS_KEPT: usize = 200;
/// Markers per snapshot.
const MARKERS_SHOWN: usize = 50;
/// History rows of the selected vehicle.
const VEHICLE_DETAIL_ROWS: i64 = 500;

/// The charted series of one consumer over the current zoom span.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerChart {
    pub target: String,
    pub consumer: String,
    pub span_seconds: u64,
    /// The span fits the data the dashboard has had so far, not a zoom level
    /// ([`zoom::fitted_span`]): the chart shows everything there is.
    pub span_fitted: bool,
    /// Points before this time come from the Prometheus server's history, the rest
    /// from the dashboard's own scrapes; None when the chart holds no history.
    pub history_until: Option<DateTime<Utc>>,
    pub processed_per_s: Vec<Point>,
    pub duplicates_per_s: Vec<Point>,
    /// Gaps (None) where a scrape failed or nothing flowed: the ratio of each poll.
    pub duplicate_ratio: Vec<Point>,
    /// The ratio over the minute (and the five minutes) before each poll: the
    /// Overview's `dup %` column as it stood then.
    pub duplicate_ratio_1m: Vec<Point>,
    pub duplicate_ratio_5m: Vec<Point>,
    /// Deliveries flagged redelivered, and dead letters (all reasons), per second:
    /// read at the chart's cursor and in a report, history and own scrapes alike.
    pub redelivered_per_s: Vec<Point>,
    pub dead_lettered_per_s: Vec<Point>,
}

/// A broker's redeliveries per second over the current zoom span.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BrokerChart {
    pub target: String,
    pub redelivered_per_s: Vec<Point>,
}

/// Everything one poll yields: plain data, cheap to clone behind an `Arc`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Snapshot {
    /// 1 for the first poll; lets a receiver tell a new snapshot from a repeat.
    pub poll: u64,
    pub taken_at: DateTime<Utc>,
    pub targets: Vec<TargetStatus>,
    /// Per target and consumer: msgs/s, dup/s, dup %, redelivered/s, out_of_order/s,
    /// dead letters, side effects by result, claims in doubt, last restart.
    pub consumers: Vec<ConsumerStatus>,
    /// Targets that are a RabbitMQ broker's own exporter: its redelivery rate, ready
    /// and unacked messages.
    pub brokers: Vec<BrokerStatus>,
    /// The database's view (dedup health, claims in doubt, dead letters, markers,
    /// drill runs, vehicle anomalies); None when no database is configured.
    pub database: Option<DbStats>,
    /// What holds now, each with its start: incidents first, drills' effects last.
    pub alerts: Vec<Alert>,
    /// Each consumer's duplicate ages (p50, p99, the oldest) against every dedup
    /// window the dashboard knows, as margins (`windows.rs`).
    pub windows: Vec<windows::ConsumerWindows>,
    /// Alerts of this session that ended (for a report of the window); not in the
    /// JSON document.
    #[serde(skip)]
    pub ended_alerts: Vec<AlertRecord>,
    /// Database markers, scraped restarts and the restarts found in the Prometheus
    /// history, newest first.
    pub markers: Vec<TimelineMarker>,
    /// Each deploy or restart marker's window with its duplicates per consumer
    /// against the budget ([`deploys`]), newest first.
    pub deploys: Vec<DeployBudget>,
    /// The Prometheus server's history of the window before the dashboard's own
    /// scrapes (docs/CONTRACT.md §6); absent without a server or before its first answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub history: Option<History>,
    /// The history source as Sources shows it (up with its window, or down with
    /// why); absent without a server.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub history_source: Option<HistoryStatus>,
    /// The vehicle selected with [`MonitorCommand::SelectVehicle`], refreshed each
    /// poll.
    pub vehicle: Option<VehicleDetail>,
    /// The dead letter opened with [`MonitorCommand::OpenDeadLetter`], with all its
    /// bytes; not in the JSON document.
    #[serde(skip)]
    pub dead_letter: Option<DeadLetterDetail>,
    /// Chart data for the current zoom; not part of the JSON document (scripts want
    /// the numbers, not the curves).
    #[serde(skip)]
    pub charts: Vec<ConsumerChart>,
    #[serde(skip)]
    pub broker_charts: Vec<BrokerChart>,
}

/// Owns the sources and the history between polls.
pub struct Monitor {
    config: Config,
    scraper: Scraper,
    database: Option<DbPoller>,
    targets: Vec<TargetTracker>,
    /// NATS servers whose `/jsz` is read each poll, and the client that reads them.
    jetstream: Vec<jetstream::JetStreamTracker>,
    jetstream_client: reqwest::Client,
    scraped_markers: VecDeque<TimelineMarker>,
    zoom: Zoom,
    selected_vehicle: Option<String>,
    open_dead_letter: Option<i64>,
    alert_log: AlertLog,
    polls: u64,
    history: Option<HistoryTrack>,
    /// The first poll: the dashboard's own data begins here, history ends here.
    first_poll_at: Option<DateTime<Utc>>,
}

/// Which window the history covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HistoryWindow {
    /// The chart's zoom span before now (the dashboard).
    Chart,
    /// This long before now (`snapshot --history`).
    Last(Duration),
    /// A fixed window (`report --from --to`).
    Between(DateTime<Utc>, DateTime<Utc>),
}

/// A failed history fetch is retried after this long (not at every poll: a server
/// that is down would be asked every second).
const HISTORY_RETRY: Duration = Duration::from_secs(30);

/// The history source of a monitor: its client, the last answer, a fetch in flight.
struct HistoryTrack {
    client: HistoryClient,
    window: HistoryWindow,
    /// Points per series: about two per chart column (braille), else a default.
    points: u32,
    /// The targets whose `instance` names history series (a report scrapes none).
    targets: Vec<crate::config::ScrapeTarget>,
    state: HistoryState,
    data: Option<History>,
    /// The request of `data`, or of the last failure with its time.
    answered: Option<HistoryRequest>,
    failed: Option<(HistoryRequest, std::time::Instant)>,
    running: Option<tokio::task::JoinHandle<Fetched>>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("targets", &self.config.targets.len())
            .field("database", &self.database)
            .field("polls", &self.polls)
            .finish()
    }
}

impl Monitor {
    /// A monitor of the config's targets and database. Nothing is contacted yet:
    /// sources that are down show as down in the first snapshot.
    pub fn new(config: &Config) -> Result<Monitor, MonitorError> {
        let scraper = Scraper::new(config.scrape_timeout, config.scrape_limits())?;
        let database = config.database.as_ref().map(DbPoller::new).transpose()?;
        let retention = config
            .database
            .as_ref()
            .map_or(MAX_RETENTION, |d| d.retention.min(MAX_RETENTION));
        Ok(Monitor {
            scraper,
            database,
            jetstream: config
                .jetstream
                .iter()
                .map(|j| jetstream::JetStreamTracker::new(&j.name, &j.url))
                .collect(),
            jetstream_client: jetstream::client(config.scrape_timeout)?,
            targets: config
                .targets
                .iter()
                .map(|t| TargetTracker::new(&t.name, &t.url))
                .collect(),
            scraped_markers: VecDeque::new(),
            zoom: Zoom::new(config.chart_window, retention),
            selected_vehicle: None,
            open_dead_letter: None,
            alert_log: AlertLog::default(),
            polls: 0,
            history: config
                .prometheus
                .as_ref()
                .map(|p| {
                    HistoryClient::new(&p.url).map(|client| HistoryTrack {
                        client,
                        window: HistoryWindow::Chart,
                        points: history::DEFAULT_POINTS,
                        targets: config.targets.clone(),
                        state: HistoryState::Idle,
                        data: None,
                        answered: None,
                        failed: None,
                        running: None,
                    })
                })
                .transpose()?,
            first_poll_at: None,
            config: config.clone(),
        })
    }

    /// Which window the Prometheus history covers (default: the chart's span).
    pub fn set_history_window(&mut self, window: HistoryWindow) {
        if let Some(h) = &mut self.history {
            h.window = window;
        }
    }

    /// Name history series after these targets (by their `instance`) even when the
    /// monitor scrapes none of them (`report`).
    pub fn set_history_targets(&mut self, targets: Vec<crate::config::ScrapeTarget>) {
        if let Some(h) = &mut self.history {
            h.targets = targets;
        }
    }

    /// The chart's width in terminal columns: history comes at about two points per
    /// column (the braille canvas's resolution), so a week is not fetched at 1 s.
    pub fn set_chart_columns(&mut self, columns: u16) {
        if let Some(h) = &mut self.history {
            h.points = u32::from(columns.max(10)) * 2;
        }
    }

    /// The window the history should cover now, if it reaches before the
    /// dashboard's own first scrape.
    fn wanted_history(&self, now: DateTime<Utc>) -> Option<HistoryRequest> {
        let h = self.history.as_ref()?;
        let own_start = self.first_poll_at.unwrap_or(now);
        let (from, to, span) = match h.window {
            HistoryWindow::Chart => {
                let span = self.zoom.span().min(history::MAX_SPAN);
                (
                    now - chrono::Duration::from_std(span).ok()?,
                    own_start,
                    span,
                )
            }
            HistoryWindow::Last(d) => {
                let d = d.min(history::MAX_SPAN);
                (now - chrono::Duration::from_std(d).ok()?, own_start, d)
            }
            HistoryWindow::Between(from, to) => (from, to, (to - from).to_std().ok()?),
        };
        (from < to).then(|| HistoryRequest {
            from,
            to,
            step: history::step_for(span, h.points),
        })
    }

    /// Collect a finished fetch; start one when the wanted window is not covered
    /// (at start, after a zoom-out, a finer step after a zoom-in). Never waits.
    fn drive_history(&mut self, now: DateTime<Utc>) {
        let wanted = self.wanted_history(now);
        let Some(h) = &mut self.history else {
            return;
        };
        if h.running.as_ref().is_some_and(|r| r.is_finished()) {
            if let Some(Some(Ok(fetched))) = h.running.take().map(|r| r.now_or_never()) {
                h.absorb(fetched);
            }
        }
        let Some(wanted) = wanted else {
            return;
        };
        if h.running.is_some() || covers(h.answered.as_ref(), &wanted) {
            return;
        }
        if let Some((failed, at)) = &h.failed {
            if covers(Some(failed), &wanted) && at.elapsed() < HISTORY_RETRY {
                return;
            }
        }
        h.state = HistoryState::Fetching;
        h.running = Some(tokio::spawn(history::fetch_timed(
            h.client.clone(),
            wanted,
            h.targets.clone(),
            self.config.metrics.clone(),
        )));
    }

    /// Wait for a history fetch in flight (bounded by the client's timeouts), for a
    /// headless command that prints once.
    pub async fn settle_history(&mut self) {
        let now = Utc::now();
        self.drive_history(now);
        if let Some(h) = &mut self.history {
            if let Some(running) = h.running.take() {
                match running.await {
                    Ok(fetched) => h.absorb(fetched),
                    Err(e) => {
                        h.state = HistoryState::Down {
                            error: format!("history fetch stopped: {e}"),
                        }
                    }
                }
            }
        }
    }

    /// The config it runs with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The alerts a dashboard watching at the time would have listed over
    /// `from..=to` ([`replay::replay`]): the rules run again over the snapshot's
    /// history and markers and the database's dead letters. The notes say what the
    /// replay could not read.
    pub async fn past_alerts(
        &self,
        snapshot: &Snapshot,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> (Vec<AlertRecord>, Vec<String>) {
        let mut notes = Vec::new();
        let lookback = chrono::Duration::from_std(replay::DEAD_LETTER_LOOKBACK).unwrap_or_default();
        let (arrivals, url) = match &self.database {
            Some(db) => match db.dead_letter_arrivals(from - lookback, to).await {
                Ok((rows, capped)) => {
                    if capped {
                        notes.push(format!(
                            "more than {} dead letters in the window: the alerts replayed only the first ones",
                            db::ARRIVALS_CAP
                        ));
                    }
                    (rows, db.redacted_url().to_string())
                }
                Err(e) => {
                    notes.push(format!(
                        "the dead letters of the window could not be read ({e}): no dead-letter alert replayed"
                    ));
                    (Vec::new(), db.redacted_url().to_string())
                }
            },
            None => (Vec::new(), String::new()),
        };
        let drill_runs = snapshot
            .database
            .as_ref()
            .map_or(&[][..], |d| d.drill_runs.as_slice());
        let records = replay::replay(&replay::ReplayInputs {
            from,
            to,
            history: snapshot.history.as_ref(),
            dead_letters: &arrivals,
            markers: &snapshot.markers,
            drill_runs,
            rules: &self.config.alerts,
            database_url: &url,
        });
        (records, notes)
    }

    /// Poll every source once (scrapes and database concurrently) and build the
    /// snapshot. Rates need two polls: the first snapshot has totals, rates are None.
    pub async fn poll(&mut self) -> Snapshot {
        let endpoints: Vec<(String, String)> = self
            .config
            .targets
            .iter()
            .map(|t| (t.name.clone(), t.url.clone()))
            .collect();
        let now = Utc::now();
        if self.first_poll_at.is_none() {
            self.first_poll_at = Some(now);
        }
        // Until there is a history or a full window of own data, the chart spans what
        // it has (zoom.rs): the first deploy fills it instead of a sliver.
        let own_data = self
            .first_poll_at
            .and_then(|first| (now - first).to_std().ok());
        self.zoom.fit(if self.history.is_some() {
            None
        } else {
            own_data
        });
        self.drive_history(now);
        let scrapes = self.scraper.scrape_all(&endpoints);
        let database = async {
            match &self.database {
                Some(db) => Some(db.poll(now).await),
                None => None,
            }
        };
        let vehicle = async {
            match (&self.database, &self.selected_vehicle) {
                (Some(db), Some(device)) => {
                    db.vehicle_detail(device, VEHICLE_DETAIL_ROWS).await.ok()
                }
                _ => None,
            }
        };
        let dead_letter = async {
            match (&self.database, self.open_dead_letter) {
                (Some(db), Some(id)) => db.dead_letter(id).await.ok().flatten(),
                _ => None,
            }
        };
        let max_bytes = self.config.scrape_max_bytes;
        let jsz = futures::future::join_all(
            self.jetstream
                .iter()
                .map(|j| jetstream::fetch(&self.jetstream_client, j.url(), max_bytes)),
        );
        let (scrapes, database, vehicle, dead_letter, jsz) =
            tokio::join!(scrapes, database, vehicle, dead_letter, jsz);
        for (tracker, answer) in self.jetstream.iter_mut().zip(jsz) {
            tracker.observe(now, answer);
        }
        for (tracker, scrape) in self.targets.iter_mut().zip(&scrapes) {
            if let Some(marker) = tracker.observe(scrape, &self.config.metrics) {
                self.scraped_markers.push_back(marker);
                if self.scraped_markers.len() > SCRAPED_MARKERS_KEPT {
                    self.scraped_markers.pop_front();
                }
            }
        }
        self.polls += 1;
        let mut snapshot = self.build_snapshot(now, database, vehicle);
        snapshot.dead_letter = dead_letter;
        snapshot
    }

    fn build_snapshot(
        &mut self,
        now: DateTime<Utc>,
        database: Option<DbStats>,
        vehicle: Option<VehicleDetail>,
    ) -> Snapshot {
        let targets: Vec<TargetStatus> = self.targets.iter().map(|t| t.status().clone()).collect();
        let consumers: Vec<ConsumerStatus> = self
            .targets
            .iter()
            .flat_map(|t| t.consumers().cloned())
            .collect();
        let mut scraped: Vec<TimelineMarker> = self.scraped_markers.iter().cloned().collect();
        let history = self.history.as_ref().and_then(|h| h.data.clone());
        if let Some(h) = &history {
            scraped.extend(h.restarts.iter().cloned());
        }
        let db_markers = database
            .as_ref()
            .map(|d| d.markers.as_slice())
            .unwrap_or(&[]);
        let markers = markers::merge(db_markers, &scraped, MARKERS_SHOWN);
        let brokers: Vec<BrokerStatus> = self
            .targets
            .iter()
            .filter_map(|t| t.broker().cloned())
            .chain(self.jetstream.iter().map(|j| j.status().clone()))
            .collect();
        let no_ages = std::collections::BTreeMap::new();
        let windows = windows::evaluate(&windows::WindowInputs {
            consumers: &consumers,
            targets: &targets,
            brokers: &brokers,
            stored_max: database
                .as_ref()
                .and_then(|d| d.duplicate_ages.as_ref())
                .unwrap_or(&no_ages),
            retention: self.config.database.as_ref().map(|d| d.retention),
            provider_key_lifetime: self.config.dedup_windows.provider_key_lifetime,
        });
        let deploys = deploys::budgets(
            &markers,
            &self.deploy_steps(now, history.as_ref(), &markers),
            &self.config.alerts,
            now,
        );
        let mut alerts = alerts::evaluate_at(&AlertInputs {
            now,
            targets: &targets,
            consumers: &consumers,
            database: database.as_ref(),
            markers: &markers,
            deploys: &deploys,
            rules: &self.config.alerts,
            windows: &windows,
        });
        self.alert_log.track(now, &mut alerts);
        let ended_alerts = self
            .alert_log
            .between(now - chrono::Duration::hours(24), now)
            .into_iter()
            .filter(|r| r.ended.is_some())
            .collect();
        Snapshot {
            poll: self.polls,
            taken_at: now,
            targets,
            consumers,
            database,
            alerts,
            ended_alerts,
            markers,
            deploys,
            history_source: self.history.as_ref().map(|h| HistoryStatus {
                url: h.client.shown_url().to_string(),
                state: h.state.clone(),
            }),
            charts: self.charts(now, history.as_ref()),
            history,
            vehicle,
            dead_letter: None,
            brokers,
            windows,
            broker_charts: self
                .targets
                .iter()
                .filter_map(|t| {
                    t.broker_redelivered_series()
                        .map(|s| (t.status().name.clone(), s))
                })
                .chain(
                    self.jetstream
                        .iter()
                        .map(|j| (j.status().target.clone(), j.redelivered_series())),
                )
                .map(|(target, s)| BrokerChart {
                    target,
                    redelivered_per_s: s.window(now, self.zoom.span()),
                })
                .collect(),
        }
    }

    /// Each consumer's chart over the zoom span: the history before the first poll,
    /// the own scrapes after it, one line; consumers only the history knows (an
    /// instance no target names) with their history alone.
    fn charts(&self, now: DateTime<Utc>, history: Option<&History>) -> Vec<ConsumerChart> {
        let span = self.zoom.span();
        let mut charts: Vec<ConsumerChart> = self
            .targets
            .iter()
            .flat_map(|t| {
                t.consumer_names().filter_map(move |c| {
                    t.series(c)
                        .map(|s| chart(t.status().name.as_str(), c, s, now, self.zoom))
                })
            })
            .collect();
        let (Some(history), Some(own_start)) = (history, self.first_poll_at) else {
            return charts;
        };
        let from = match self.history.as_ref().map(|h| h.window) {
            Some(HistoryWindow::Between(from, _)) => from,
            _ => now - chrono::Duration::from_std(span).unwrap_or(chrono::Duration::MAX),
        };
        for h in &history.consumers {
            let before = |p: &history::HistoryPoint| {
                let at = DateTime::from_timestamp(p.t, 0).unwrap_or_default();
                at >= from && at < own_start
            };
            let part = |value: fn(&history::HistoryPoint) -> Option<f64>| -> Vec<Point> {
                h.points
                    .iter()
                    .filter(|p| before(p))
                    .map(|p| Point {
                        at: DateTime::from_timestamp(p.t, 0).unwrap_or_default(),
                        value: value(p),
                    })
                    .collect()
            };
            let index = match charts
                .iter()
                .position(|c| c.target == h.target && c.consumer == h.consumer)
            {
                Some(i) => i,
                None => {
                    charts.push(ConsumerChart {
                        target: h.target.clone(),
                        consumer: h.consumer.clone(),
                        span_seconds: span.as_secs(),
                        span_fitted: self.zoom.is_fitted(),
                        history_until: None,
                        processed_per_s: Vec::new(),
                        duplicates_per_s: Vec::new(),
                        duplicate_ratio: Vec::new(),
                        duplicate_ratio_1m: Vec::new(),
                        duplicate_ratio_5m: Vec::new(),
                        redelivered_per_s: Vec::new(),
                        dead_lettered_per_s: Vec::new(),
                    });
                    charts.len() - 1
                }
            };
            let c = &mut charts[index];
            c.history_until = Some(own_start);
            c.processed_per_s
                .splice(0..0, part(|p| p.processed_per_second));
            c.duplicates_per_s
                .splice(0..0, part(|p| p.duplicate_dropped_per_second));
            c.duplicate_ratio.splice(0..0, part(|p| p.duplicate_ratio));
            // Prometheus' ratio is over at least a minute: it stands for the
            // windowed ratios as well.
            c.duplicate_ratio_1m
                .splice(0..0, part(|p| p.duplicate_ratio));
            c.duplicate_ratio_5m
                .splice(0..0, part(|p| p.duplicate_ratio));
            c.redelivered_per_s
                .splice(0..0, part(|p| p.redelivered_per_second));
            c.dead_lettered_per_s
                .splice(0..0, part(|p| p.dead_lettered_per_second));
        }
        charts
    }

    /// Every consumer's deliveries as counts ([`deploys::Step`]) from the baseline
    /// before the oldest deploy or restart marker up to now: the Prometheus history
    /// before the first poll, the dashboard's own scrapes after it (the last hour
    /// at each scrape, older ones by the minute means the series keep).
    fn deploy_steps(
        &self,
        now: DateTime<Utc>,
        history: Option<&History>,
        markers: &[TimelineMarker],
    ) -> Vec<ConsumerSteps> {
        let Some(oldest) = markers
            .iter()
            .filter(|m| deploys::DEPLOY_KINDS.contains(&m.kind.as_str()))
            .map(|m| m.at)
            .min()
        else {
            return Vec::new();
        };
        let lead = deploys::BASELINE_SPAN + deploys::PEAK_SPAN;
        let span = (now - oldest)
            .to_std()
            .unwrap_or_default()
            .saturating_add(lead)
            .min(MAX_RETENTION);
        let mut out: Vec<ConsumerSteps> = Vec::new();
        for t in &self.targets {
            for c in t.consumer_names() {
                let Some(s) = t.series(c) else {
                    continue;
                };
                let since = t
                    .consumers()
                    .find(|status| status.consumer == c)
                    .and_then(|status| status.totals.since);
                let steps = deploys::steps_from_series(s, now, span, since);
                out.push(ConsumerSteps {
                    target: t.status().name.clone(),
                    consumer: c.to_string(),
                    steps,
                });
            }
        }
        if let (Some(history), Some(own_start)) = (history, self.first_poll_at) {
            for h in &history.consumers {
                let before: Vec<history::HistoryPoint> = h
                    .points
                    .iter()
                    .filter(|p| p.t < own_start.timestamp())
                    .copied()
                    .collect();
                let steps = deploys::steps_from_history(&before, history.step_seconds);
                match out
                    .iter_mut()
                    .find(|c| c.target == h.target && c.consumer == h.consumer)
                {
                    Some(c) => {
                        c.steps.splice(0..0, steps);
                    }
                    None => out.push(ConsumerSteps {
                        target: h.target.clone(),
                        consumer: h.consumer.clone(),
                        steps,
                    }),
                }
            }
        }
        // In time order for the windows' bisection (a clock that went back leaves
        // the series' points out of order).
        for c in &mut out {
            c.steps.sort_by_key(|s| s.end);
        }
        out
    }

    /// The series of one consumer of one target (the whole bounded history).
    pub fn series(&self, target: &str, consumer: &str) -> Option<&ConsumerSeries> {
        self.targets
            .iter()
            .find(|t| t.status().name == target)
            .and_then(|t| t.series(consumer))
    }

    /// The chart zoom; its span is used for [`Snapshot::charts`].
    pub fn zoom_mut(&mut self) -> &mut Zoom {
        &mut self.zoom
    }

    /// Follow one vehicle (its state beside its history) in every snapshot; None
    /// stops it.
    pub fn select_vehicle(&mut self, device_id: Option<String>) {
        self.selected_vehicle = device_id;
    }

    /// Run on a tokio task: poll every `poll_interval`, publish each snapshot, obey
    /// commands. Ends when the handle (its command sender) is dropped.
    pub fn spawn(mut self) -> MonitorHandle {
        let (snapshot_tx, snapshots) = watch::channel(None::<Arc<Snapshot>>);
        let (commands, mut command_rx) = mpsc::channel::<MonitorCommand>(16);
        let period = self.config.poll_interval;
        let task = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(period);
            // After a slow poll, wait a full period instead of bursting to catch up.
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticker.tick() => {}
                    command = command_rx.recv() => match command {
                        None => break,
                        Some(MonitorCommand::PollNow) => {}
                        Some(MonitorCommand::ZoomIn) => { self.zoom.zoom_in(); }
                        Some(MonitorCommand::ZoomOut) => { self.zoom.zoom_out(); }
                        Some(MonitorCommand::ChartColumns(columns)) => self.set_chart_columns(columns),
                        Some(MonitorCommand::SelectVehicle(device)) => self.select_vehicle(device),
                        Some(MonitorCommand::OpenDeadLetter(id)) => self.open_dead_letter = id,
                    },
                }
                let snapshot = Arc::new(self.poll().await);
                if snapshot_tx.send(Some(snapshot)).is_err() {
                    break;
                }
            }
        });
        MonitorHandle {
            snapshots,
            commands,
            task,
        }
    }
}

fn chart(
    target: &str,
    consumer: &str,
    series: &ConsumerSeries,
    now: DateTime<Utc>,
    zoom: Zoom,
) -> ConsumerChart {
    let span = zoom.span();
    ConsumerChart {
        target: target.to_string(),
        consumer: consumer.to_string(),
        span_seconds: span.as_secs(),
        span_fitted: zoom.is_fitted(),
        history_until: None,
        processed_per_s: series.processed_per_s.window(now, span),
        duplicates_per_s: series.duplicates_per_s.window(now, span),
        duplicate_ratio: series.duplicate_ratio.window(now, span),
        duplicate_ratio_1m: series.duplicate_ratio_1m.window(now, span),
        duplicate_ratio_5m: series.duplicate_ratio_5m.window(now, span),
        redelivered_per_s: series.redelivered_per_s.window(now, span),
        dead_lettered_per_s: series.dead_lettered_per_s.window(now, span),
    }
}

/// What the TUI can ask of a running monitor. Each command is followed by an
/// immediate poll, so the answer arrives as the next snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MonitorCommand {
    PollNow,
    ZoomIn,
    ZoomOut,
    SelectVehicle(Option<String>),
    /// Read one dead letter's raw bytes into every snapshot; None stops it.
    OpenDeadLetter(Option<i64>),
    /// The chart is this many columns wide (the history's step follows it).
    ChartColumns(u16),
}

/// The TUI's side of a spawned [`Monitor`].
#[derive(Debug)]
pub struct MonitorHandle {
    /// The newest snapshot (None before the first poll). `changed()` wakes on each.
    pub snapshots: watch::Receiver<Option<Arc<Snapshot>>>,
    pub commands: mpsc::Sender<MonitorCommand>,
    pub task: tokio::task::JoinHandle<()>,
}

/// One headless poll for `snapshot`: poll, wait `spacing`, poll again, so that the
/// snapshot has rates (a rate needs two counter readings).
///
/// With a Prometheus server, its history of `history` before now (default: the
/// chart window) is fetched meanwhile and awaited before the second poll.
pub async fn snapshot_once(
    config: &Config,
    spacing: Duration,
    history: Option<Duration>,
) -> Result<Snapshot, MonitorError> {
    let mut monitor = Monitor::new(config)?;
    if let Some(span) = history {
        monitor.set_history_window(HistoryWindow::Last(span));
    }
    monitor.poll().await;
    tokio::time::sleep(spacing).await;
    monitor.settle_history().await;
    Ok(monitor.poll().await)
}

/// The answered request covers the wanted one: it starts no later (within a step)
/// and its step is neither much coarser nor much finer.
fn covers(answered: Option<&HistoryRequest>, wanted: &HistoryRequest) -> bool {
    let Some(a) = answered else {
        return false;
    };
    let slack = chrono::Duration::from_std(wanted.step).unwrap_or_default();
    a.from <= wanted.from + slack
        && a.to >= wanted.to - slack
        && a.step <= wanted.step * 2
        && a.step * 2 >= wanted.step
}

impl HistoryTrack {
    /// Keep a finished fetch's answer (or its failure: the last good answer stays on
    /// the chart, the error goes to Sources).
    fn absorb(&mut self, fetched: Fetched) {
        match fetched.result {
            Ok(data) => {
                self.state = HistoryState::Up {
                    from: fetched.request.from,
                    to: fetched.request.to,
                    step_seconds: fetched.request.step.as_secs(),
                    fetch_ms: u64::try_from(fetched.took.as_millis()).unwrap_or(u64::MAX),
                    series: data.consumers.len(),
                };
                self.data = Some(data);
                self.answered = Some(fetched.request);
                self.failed = None;
            }
            Err(error) => {
                self.state = HistoryState::Down { error };
                self.failed = Some((fetched.request, std::time::Instant::now()));
            }
        }
    }
}
