//! The dashboard's data layer: sources in, plain-data [`Snapshot`]s out.
//!
//! No terminal types here, so the same snapshot feeds `idemwatch snapshot --json`
//! and the TUI. A [`Monitor`] owns the sources (scrape targets, the database) and the
//! memory between polls (counter readings for rates, restart detection, bounded
//! series); each [`Monitor::poll`] yields one [`Snapshot`]. The TUI runs it on its
//! own task with [`Monitor::spawn`] and receives snapshots over a `watch` channel,
//! so a slow source never blocks a frame.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::{mpsc, watch};

use crate::config::Config;

pub mod alerts;
pub mod bytes;
pub mod db;
pub mod markers;
pub mod promql;
/// The Prometheus text parser and scraper live below every layer that reads an
/// exposition (the monitor here, the live drill): one parser, no backwards arrow.
pub use crate::exposition as prometheus;
pub mod rates;
pub mod series;
pub mod targets;
pub mod vehicles;
pub mod zoom;

use alerts::{Alert, AlertInputs, AlertLog, AlertRecord};
use db::{DbError, DbPoller, DbStats, DeadLetterDetail};
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
    pub processed_per_s: Vec<Point>,
    pub duplicates_per_s: Vec<Point>,
    /// Gaps (None) where a scrape failed or nothing flowed: the ratio of each poll.
    pub duplicate_ratio: Vec<Point>,
    /// The ratio over the minute (and the five minutes) before each poll: the
    /// Overview's `dup %` column as it stood then.
    pub duplicate_ratio_1m: Vec<Point>,
    pub duplicate_ratio_5m: Vec<Point>,
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
    /// Alerts of this session that ended (for a report of the window); not in the
    /// JSON document.
    #[serde(skip)]
    pub ended_alerts: Vec<AlertRecord>,
    /// Database markers and scraped restarts, newest first.
    pub markers: Vec<TimelineMarker>,
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
    scraped_markers: VecDeque<TimelineMarker>,
    zoom: Zoom,
    selected_vehicle: Option<String>,
    open_dead_letter: Option<i64>,
    alert_log: AlertLog,
    polls: u64,
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
            config: config.clone(),
        })
    }

    /// The config it runs with.
    pub fn config(&self) -> &Config {
        &self.config
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
        let (scrapes, database, vehicle, dead_letter) =
            tokio::join!(scrapes, database, vehicle, dead_letter);
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
        let scraped: Vec<TimelineMarker> = self.scraped_markers.iter().cloned().collect();
        let db_markers = database
            .as_ref()
            .map(|d| d.markers.as_slice())
            .unwrap_or(&[]);
        let markers = markers::merge(db_markers, &scraped, MARKERS_SHOWN);
        let mut alerts = alerts::evaluate_at(&AlertInputs {
            now,
            targets: &targets,
            consumers: &consumers,
            database: database.as_ref(),
            markers: &markers,
            rules: &self.config.alerts,
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
            vehicle,
            dead_letter: None,
            charts: self.charts(now),
            brokers: self
                .targets
                .iter()
                .filter_map(|t| t.broker().cloned())
                .collect(),
            broker_charts: self
                .targets
                .iter()
                .filter_map(|t| {
                    t.broker_redelivered_series().map(|s| BrokerChart {
                        target: t.status().name.clone(),
                        redelivered_per_s: s.window(now, self.zoom.span()),
                    })
                })
                .collect(),
        }
    }

    fn charts(&self, now: DateTime<Utc>) -> Vec<ConsumerChart> {
        let span = self.zoom.span();
        self.targets
            .iter()
            .flat_map(|t| {
                t.consumer_names().filter_map(move |c| {
                    t.series(c)
                        .map(|s| chart(t.status().name.as_str(), c, s, now, span))
                })
            })
            .collect()
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
    span: Duration,
) -> ConsumerChart {
    ConsumerChart {
        target: target.to_string(),
        consumer: consumer.to_string(),
        span_seconds: span.as_secs(),
        processed_per_s: series.processed_per_s.window(now, span),
        duplicates_per_s: series.duplicates_per_s.window(now, span),
        duplicate_ratio: series.duplicate_ratio.window(now, span),
        duplicate_ratio_1m: series.duplicate_ratio_1m.window(now, span),
        duplicate_ratio_5m: series.duplicate_ratio_5m.window(now, span),
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
pub async fn snapshot_once(config: &Config, spacing: Duration) -> Result<Snapshot, MonitorError> {
    let mut monitor = Monitor::new(config)?;
    monitor.poll().await;
    tokio::time::sleep(spacing).await;
    Ok(monitor.poll().await)
}
