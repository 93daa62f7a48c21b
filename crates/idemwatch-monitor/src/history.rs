//! History from a Prometheus server: what happened before the dashboard started.
//!
//! The deploy that sent 7 SMS happened at 04:12; the on-call engineer opens the
//! dashboard at 07:30. The dashboard's own scrapes begin at 07:30, so whenever the
//! chart's window reaches further back (at start, on zoom-out up to 7 days) the
//! missing part is asked of the shop's Prometheus through `/api/v1/query_range`, at a
//! step that gives about one point per chart column. Prometheus computes the rates
//! (the expressions of [`super::promql`]); this module matches its series to the
//! configured targets by the `instance` label (the target URL's `host:port`), names
//! the others `job/instance`, keeps missing steps as gaps (never zeros), and turns
//! changes of `process_start_time_seconds` (or counter resets, for exporters without
//! a start time) into restart markers with `source = "prometheus"`.
//!
//! Every request has a timeout and every answer a size cap: a slow or huge answer is
//! an error shown in Sources, never a frozen or exhausted dashboard. The fetch runs
//! on its own task ([`super::Monitor`] polls it), so the live scrapes never wait on
//! it.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::markers::{MarkerSource, TimelineMarker};
use super::promql;
use super::series::Point;
use crate::config::{MetricNames, ScrapeTarget};
use idemwatch_base::redact::redact_url;

/// How long one history request may take (the queries of one fetch run together).
pub const HISTORY_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest answer read from Prometheus per query; a bigger one is an error. A
/// week at one point per column of a wide terminal is ~100 KiB per consumer.
pub const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;
/// The longest window asked for: the longest zoom.
pub const MAX_SPAN: Duration = super::series::MAX_RETENTION;
/// Points per series when no chart width is known (`snapshot`, `report`).
pub const DEFAULT_POINTS: u32 = 240;
/// Prometheus refuses more than 11 000 points per series; stay well under.
const MAX_POINTS: u32 = 5_000;
/// The shortest rate range: a rate over less than a few scrapes of a usual 15 s
/// interval is noise or nothing.
pub const MIN_RATE_RANGE: Duration = Duration::from_secs(60);

/// The step that gives `points` points over `span`: whole seconds, at least one.
pub fn step_for(span: Duration, points: u32) -> Duration {
    let points = u64::from(points.clamp(1, MAX_POINTS));
    Duration::from_secs(span.as_secs().div_ceil(points).max(1))
}

/// One step of one consumer's history. `None` is a gap: Prometheus had no sample
/// there (target down, not yet scraped), or nothing flowed (a ratio of 0/0).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HistoryPoint {
    /// Unix seconds.
    pub t: i64,
    pub duplicate_ratio: Option<f64>,
    pub processed_per_second: Option<f64>,
    pub duplicate_dropped_per_second: Option<f64>,
    /// Not in the JSON document (docs/CONTRACT.md §6 fixes its shape): read at the chart's
    /// cursor and in a report.
    #[serde(skip)]
    pub redelivered_per_second: Option<f64>,
    #[serde(skip)]
    pub dead_lettered_per_second: Option<f64>,
}

/// One consumer of one target over the window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerHistory {
    /// The configured target's name, or `job/instance` for an instance no target
    /// names.
    pub target: String,
    pub consumer: String,
    pub points: Vec<HistoryPoint>,
}

impl ConsumerHistory {
    /// One column as chart points.
    pub fn series(&self, value: impl Fn(&HistoryPoint) -> Option<f64>) -> Vec<Point> {
        self.points
            .iter()
            .map(|p| Point {
                at: DateTime::from_timestamp(p.t, 0).unwrap_or_default(),
                value: value(p),
            })
            .collect()
    }
}

/// What one fetch found (docs/CONTRACT.md §6 `snapshot --json` `history`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct History {
    /// Always `"prometheus"`.
    pub source: &'static str,
    /// Unix seconds.
    pub from: i64,
    pub to: i64,
    pub step_seconds: u64,
    pub consumers: Vec<ConsumerHistory>,
    /// Restarts found in the window; they go into the snapshot's `markers`.
    #[serde(skip)]
    pub restarts: Vec<TimelineMarker>,
}

/// What to fetch.
#[derive(Debug, Clone, PartialEq)]
pub struct HistoryRequest {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub step: Duration,
}

/// The history source as Sources shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HistoryStatus {
    /// The server's URL, any password as `***`.
    pub url: String,
    #[serde(flatten)]
    pub state: HistoryState,
}

/// Where the history source stands.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum HistoryState {
    /// Nothing asked yet (the window does not reach before the dashboard's start).
    Idle,
    /// A fetch is running.
    Fetching,
    /// The last fetch answered.
    Up {
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        step_seconds: u64,
        fetch_ms: u64,
        series: usize,
    },
    /// The last fetch failed: down, slow, or an error answer. Live scraping goes on.
    Down { error: String },
}

/// Queries one Prometheus server.
#[derive(Debug, Clone)]
pub struct HistoryClient {
    client: reqwest::Client,
    query_range: String,
    shown: String,
}

/// A matrix answer's series.
#[derive(Debug, Deserialize)]
struct Answer {
    status: String,
    #[serde(default)]
    data: Option<AnswerData>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default, rename = "errorType")]
    error_type: Option<String>,
}

#[derive(Debug, Deserialize)]
struct AnswerData {
    #[serde(default)]
    result: Vec<MatrixSeries>,
}

#[derive(Debug, Deserialize)]
struct MatrixSeries {
    metric: HashMap<String, String>,
    #[serde(default)]
    values: Vec<(f64, String)>,
}

/// The columns of a fetch, in the order of [`HistoryClient::queries`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Column {
    Processed,
    Duplicates,
    Redelivered,
    DeadLettered,
    Ratio,
}

const COLUMNS: [Column; 5] = [
    Column::Processed,
    Column::Duplicates,
    Column::Redelivered,
    Column::DeadLettered,
    Column::Ratio,
];

impl HistoryClient {
    /// A client of the server at `url` (its base, e.g. `http://prometheus:9090`).
    pub fn new(url: &str) -> Result<HistoryClient, reqwest::Error> {
        let client = reqwest::Client::builder()
            .timeout(HISTORY_TIMEOUT)
            .connect_timeout(HISTORY_TIMEOUT)
            .user_agent(concat!("idemwatch/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(HistoryClient {
            client,
            query_range: format!("{}/api/v1/query_range", url.trim_end_matches('/')),
            shown: redact_url(url),
        })
    }

    /// The URL as it may be shown.
    pub fn shown_url(&self) -> &str {
        &self.shown
    }

    /// The expressions of one fetch: a rate range of at least a step (so consecutive
    /// points do not skip samples) and at least [`MIN_RATE_RANGE`].
    fn queries(names: &MetricNames, step: Duration) -> Vec<(Column, String)> {
        let range = step.max(MIN_RATE_RANGE);
        COLUMNS
            .iter()
            .map(|c| {
                let expr = match c {
                    Column::Processed => promql::rate(names, &names.processed, range),
                    Column::Duplicates => promql::rate(names, &names.duplicate_dropped, range),
                    Column::Redelivered => promql::rate(names, &names.redelivered, range),
                    Column::DeadLettered => promql::rate(names, &names.dead_lettered, range),
                    Column::Ratio => promql::duplicate_ratio(names, range),
                };
                (*c, expr)
            })
            .collect()
    }

    /// Fetch the window: every column and the restarts, concurrently. Any failing
    /// query fails the fetch (a chart with half its columns would mislead).
    pub async fn fetch(
        &self,
        request: &HistoryRequest,
        targets: &[ScrapeTarget],
        names: &MetricNames,
    ) -> Result<History, String> {
        let step = request.step.max(Duration::from_secs(1));
        let to = request.to.timestamp();
        // The grid ends exactly at `to`, where the dashboard's own scrapes take over:
        // the last history point meets the first live one.
        let step_s = i64::try_from(step.as_secs()).unwrap_or(i64::MAX);
        let steps = (to - request.from.timestamp()).max(0).div_euclid(step_s)
            + i64::from((to - request.from.timestamp()).rem_euclid(step_s) != 0);
        let from = to - steps * step_s;
        let queries = Self::queries(names, step);
        let restarts_expr = format!(
            "max by (job, instance) (max_over_time({}[{}]))",
            names.process_start_time,
            promql::duration(step)
        );
        let resets_expr = format!(
            "sum by (job, instance) (resets({}[{}]))",
            names.processed,
            promql::duration(step.max(MIN_RATE_RANGE))
        );
        let columns = futures::future::join_all(
            queries
                .iter()
                .map(|(_, expr)| self.query(expr, from, to, step)),
        );
        let (columns, starts, resets) = tokio::join!(
            columns,
            self.query(&restarts_expr, from, to, step),
            self.query(&resets_expr, from, to, step)
        );
        let instances = InstanceNames::new(targets);
        let mut by_consumer: BTreeMap<(String, String), BTreeMap<i64, HistoryPoint>> =
            BTreeMap::new();
        for ((column, _), answer) in queries.iter().zip(columns) {
            for series in answer? {
                let target = instances.name(&series.metric);
                let consumer = series
                    .metric
                    .get(&names.consumer_label)
                    .cloned()
                    .unwrap_or_default();
                let points = by_consumer.entry((target, consumer)).or_default();
                for (t, raw) in &series.values {
                    let t = t.round() as i64;
                    let value = raw.parse::<f64>().ok().filter(|v| v.is_finite());
                    let p = points.entry(t).or_insert_with(|| empty_point(t));
                    match column {
                        Column::Processed => p.processed_per_second = value,
                        Column::Duplicates => p.duplicate_dropped_per_second = value,
                        Column::Redelivered => p.redelivered_per_second = value,
                        Column::DeadLettered => p.dead_lettered_per_second = value,
                        Column::Ratio => p.duplicate_ratio = value,
                    }
                }
            }
        }
        let consumers = by_consumer
            .into_iter()
            .map(|((target, consumer), points)| ConsumerHistory {
                target,
                consumer,
                points: on_grid(from, to, step_s, &points),
            })
            .collect();
        let starts = starts?;
        let mut restarts = restarts_from_start_times(&instances, &starts, from);
        let with_start: Vec<String> = starts.iter().map(|s| instances.name(&s.metric)).collect();
        restarts.extend(restarts_from_resets(
            &instances,
            &resets?,
            &with_start,
            step_s,
        ));
        restarts.sort_by_key(|m| m.at);
        Ok(History {
            source: "prometheus",
            from,
            to,
            step_seconds: step.as_secs(),
            consumers,
            restarts,
        })
    }

    /// One `query_range`, its answer capped at [`MAX_ANSWER_BYTES`].
    async fn query(
        &self,
        expr: &str,
        from: i64,
        to: i64,
        step: Duration,
    ) -> Result<Vec<MatrixSeries>, String> {
        let mut response = self
            .client
            .get(&self.query_range)
            .query(&[
                ("query", expr.to_string()),
                ("start", from.to_string()),
                ("end", to.to_string()),
                ("step", format!("{}s", step.as_secs())),
            ])
            .send()
            .await
            .map_err(|e| {
                format!(
                    "{}: {}",
                    self.shown,
                    idemwatch_base::exposition::error_chain(&e)
                )
            })?;
        let status = response.status();
        let mut body = Vec::new();
        while let Some(piece) = response.chunk().await.map_err(|e| {
            format!(
                "{}: {}",
                self.shown,
                idemwatch_base::exposition::error_chain(&e)
            )
        })? {
            if body.len() + piece.len() > MAX_ANSWER_BYTES {
                return Err(format!(
                    "{}: an answer larger than {} MiB",
                    self.shown,
                    MAX_ANSWER_BYTES / (1024 * 1024)
                ));
            }
            body.extend_from_slice(&piece);
        }
        let answer: Answer = serde_json::from_slice(&body).map_err(|e| {
            format!(
                "{}: HTTP {status}, not a Prometheus API answer ({e})",
                self.shown
            )
        })?;
        if answer.status != "success" {
            return Err(format!(
                "{}: {} {}",
                self.shown,
                answer.error_type.unwrap_or_default(),
                answer.error.unwrap_or_else(|| format!("HTTP {status}"))
            ));
        }
        Ok(answer.data.map(|d| d.result).unwrap_or_default())
    }
}

fn empty_point(t: i64) -> HistoryPoint {
    HistoryPoint {
        t,
        duplicate_ratio: None,
        processed_per_second: None,
        duplicate_dropped_per_second: None,
        redelivered_per_second: None,
        dead_lettered_per_second: None,
    }
}

/// Every step of the window, the missing ones as gaps.
fn on_grid(
    from: i64,
    to: i64,
    step: i64,
    points: &BTreeMap<i64, HistoryPoint>,
) -> Vec<HistoryPoint> {
    let step = step.max(1);
    let mut out = Vec::new();
    let mut t = from;
    while t <= to {
        out.push(points.get(&t).copied().unwrap_or_else(|| empty_point(t)));
        t += step;
    }
    out
}

/// Instance label → configured target name.
struct InstanceNames {
    by_instance: HashMap<String, String>,
}

impl InstanceNames {
    fn new(targets: &[ScrapeTarget]) -> InstanceNames {
        let by_instance = targets
            .iter()
            .filter_map(|t| Some((instance_of(&t.url)?, t.name.clone())))
            .collect();
        InstanceNames { by_instance }
    }

    /// The target a series belongs to: the configured one with its `instance`, else
    /// `job/instance`.
    fn name(&self, labels: &HashMap<String, String>) -> String {
        let instance = labels.get("instance").map(String::as_str).unwrap_or("");
        match self.by_instance.get(instance) {
            Some(name) => name.clone(),
            None => format!(
                "{}/{instance}",
                labels.get("job").map(String::as_str).unwrap_or("")
            ),
        }
    }
}

/// The `instance` label Prometheus gives a scrape of `url`: its `host:port`.
pub fn instance_of(url: &str) -> Option<String> {
    let u = url::Url::parse(url).ok()?;
    let host = u.host_str()?;
    let port = u.port_or_known_default()?;
    Some(format!("{host}:{port}"))
}

fn restart(target: &str, at: DateTime<Utc>, cause: String) -> TimelineMarker {
    TimelineMarker {
        at,
        kind: "restart".into(),
        label: format!("{target} restarted"),
        detail: Some(cause),
        source: MarkerSource::Prometheus,
    }
}

/// A new `process_start_time_seconds` (its newest value per step) is a restart at
/// that very time; the first value is where the window starts, not a restart.
fn restarts_from_start_times(
    instances: &InstanceNames,
    starts: &[MatrixSeries],
    from: i64,
) -> Vec<TimelineMarker> {
    let mut out = Vec::new();
    for s in starts {
        let target = instances.name(&s.metric);
        let mut previous: Option<f64> = None;
        for (_, raw) in &s.values {
            let Ok(start) = raw.parse::<f64>() else {
                continue;
            };
            if previous.is_some_and(|p| start > p) && start.round() as i64 >= from {
                if let Some(at) = DateTime::from_timestamp(start.floor() as i64, 0) {
                    out.push(restart(
                        &target,
                        at,
                        "process_start_time_seconds changed (Prometheus history)".into(),
                    ));
                }
            }
            previous = Some(previous.map_or(start, |p| p.max(start)));
        }
    }
    out
}

/// Counter resets of targets without a start time: one marker per run of steps with
/// resets, at the run's first step (the restart happened within the step before).
fn restarts_from_resets(
    instances: &InstanceNames,
    resets: &[MatrixSeries],
    with_start: &[String],
    step: i64,
) -> Vec<TimelineMarker> {
    let mut out = Vec::new();
    for s in resets {
        let target = instances.name(&s.metric);
        if with_start.contains(&target) {
            continue;
        }
        let mut last_positive: Option<i64> = None;
        for (t, raw) in &s.values {
            let t = t.round() as i64;
            if raw.parse::<f64>().is_ok_and(|v| v > 0.0) {
                let continues = last_positive.is_some_and(|p| t - p <= step);
                if !continues {
                    if let Some(at) = DateTime::from_timestamp(t, 0) {
                        out.push(restart(
                            &target,
                            at,
                            "counter reset (Prometheus history)".into(),
                        ));
                    }
                }
                last_positive = Some(t);
            }
        }
    }
    out
}

/// A fetch in flight or done, with how long it took.
#[derive(Debug)]
pub struct Fetched {
    pub request: HistoryRequest,
    pub result: Result<History, String>,
    pub took: Duration,
}

/// Run one fetch and time it.
pub async fn fetch_timed(
    client: HistoryClient,
    request: HistoryRequest,
    targets: Vec<ScrapeTarget>,
    names: MetricNames,
) -> Fetched {
    let started = Instant::now();
    let result = client.fetch(&request, &targets, &names).await;
    Fetched {
        request,
        result,
        took: started.elapsed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_week_fits_a_chart_of_200_columns() {
        assert_eq!(step_for(MAX_SPAN, 400), Duration::from_secs(1512));
        assert_eq!(
            step_for(Duration::from_secs(60), 400),
            Duration::from_secs(1)
        );
        assert_eq!(
            step_for(Duration::from_secs(3600), 0),
            Duration::from_secs(3600)
        );
    }

    #[test]
    fn instances_are_host_and_port() {
        assert_eq!(
            instance_of("http://10.0.0.5:9464/metrics").as_deref(),
            Some("10.0.0.5:9464")
        );
        assert_eq!(
            instance_of("https://sms.example/metrics").as_deref(),
            Some("sms.example:443")
        );
        let names = InstanceNames::new(&[ScrapeTarget {
            name: "sms".into(),
            url: "http://10.0.0.5:9464/metrics".into(),
        }]);
        let labels = |i: &str| {
            HashMap::from([
                ("instance".to_string(), i.to_string()),
                ("job".to_string(), "fleet".to_string()),
            ])
        };
        assert_eq!(names.name(&labels("10.0.0.5:9464")), "sms");
        assert_eq!(names.name(&labels("10.0.0.6:9464")), "fleet/10.0.0.6:9464");
    }

    #[test]
    fn missing_steps_are_gaps() {
        let mut points = BTreeMap::new();
        let mut p = empty_point(20);
        p.processed_per_second = Some(3.0);
        points.insert(20, p);
        let grid = on_grid(0, 40, 10, &points);
        assert_eq!(grid.len(), 5);
        assert_eq!(grid[2].processed_per_second, Some(3.0));
        assert_eq!(grid[1].processed_per_second, None);
    }

    #[test]
    fn a_new_start_time_is_one_restart_at_that_time() {
        let names = InstanceNames::new(&[]);
        let series = MatrixSeries {
            metric: HashMap::from([("instance".to_string(), "h:1".to_string())]),
            values: vec![
                (100.0, "50".into()),
                (110.0, "50".into()),
                (120.0, "115.5".into()),
                (130.0, "115.5".into()),
            ],
        };
        let found = restarts_from_start_times(&names, &[series], 100);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].at.timestamp(), 115);
        assert_eq!(found[0].source, MarkerSource::Prometheus);
    }
}
