//! The dashboard's config file (docs/CONTRACT.md §7), TOML.
//!
//! Every section has defaults that describe idemwatch's own engine (docs/CONTRACT.md §3 table
//! names, docs/CONTRACT.md §5 metric names), so a config only states what differs: a user's own
//! dedup table, an exporter whose counters are named otherwise. Unknown keys are
//! rejected instead of ignored: a typo such as `poll_intervall` must not silently
//! leave the default in force while the operator believes otherwise.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use idemwatch_base::exposition::ScrapeLimits;
use idemwatch_engine::metrics::names;

/// `idemwatch serve`'s default `/metrics` address.
pub const LOCAL_METRICS_URL: &str = "http://127.0.0.1:9464/metrics";

/// Why a config could not be used. Every variant names the file, so an operator with
/// several configs knows which one to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// TOML syntax, a wrong type or an unknown key; toml's message names the key and
    /// shows the line.
    #[error("invalid config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// The TOML is well-formed but a value is unusable.
    #[error("invalid config {path}: `{key}`: {message}")]
    Value {
        path: PathBuf,
        key: String,
        message: String,
    },
}

/// The whole config file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// How often every source is polled.
    #[serde(with = "human_duration")]
    pub poll_interval: Duration,
    /// The time range the charts open with (zoom changes it at run time).
    #[serde(with = "human_duration")]
    pub chart_window: Duration,
    /// How long one scrape may take before the target counts as down.
    #[serde(with = "human_duration")]
    pub scrape_timeout: Duration,
    /// Bytes one scrape's body may have ("16MiB"): past it the target shows as down
    /// with "response too large".
    #[serde(with = "byte_size")]
    pub scrape_max_bytes: u64,
    /// Samples one scrape may have; past it, the same.
    pub scrape_max_samples: usize,
    /// `/metrics` endpoints to scrape, one per consumer process (or per service).
    pub targets: Vec<ScrapeTarget>,
    /// A Prometheus server that keeps history beyond what the dashboard has seen.
    pub prometheus: Option<PrometheusServer>,
    /// NATS servers whose JetStream redeliveries are charted (their monitoring
    /// endpoint, `nats-server -m PORT`).
    pub jetstream: Vec<JetStreamMonitor>,
    /// The business database holding the dedup table. None: no database view.
    pub database: Option<DatabaseConfig>,
    /// Metric-name overrides, for consumers that are not idemwatch.
    pub metrics: MetricNames,
    pub drills: DrillPermissions,
    /// When alerts fire.
    pub alerts: AlertRules,
    pub theme: Theme,
    /// The engine's deadlines on its database (`serve`, `consume`).
    pub engine: EngineSection,
    /// The engine's broker link (`serve`, `consume`).
    pub queue: QueueSection,
    /// Dedup windows the dashboard cannot read from a source.
    pub dedup_windows: DedupWindows,
}

/// `[dedup_windows]`: the windows compared with the duplicates' ages that no source
/// says (`windows.rs`; the retention, a Redis TTL and JetStream's window are read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DedupWindows {
    /// How long the provider keeps an Idempotency-Key: after it a retry with the same
    /// key is a new request. Compared for consumers with side effects.
    #[serde(with = "human_duration")]
    pub provider_key_lifetime: Duration,
}

/// Stripe's documented Idempotency-Key lifetime, the common one among providers.
pub const DEFAULT_PROVIDER_KEY_LIFETIME: Duration = Duration::from_secs(24 * 3600);

impl Default for DedupWindows {
    fn default() -> Self {
        DedupWindows {
            provider_key_lifetime: DEFAULT_PROVIDER_KEY_LIFETIME,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            poll_interval: Duration::from_secs(1),
            chart_window: Duration::from_secs(15 * 60),
            scrape_timeout: Duration::from_secs(2),
            scrape_max_bytes: ScrapeLimits::default().max_body_bytes,
            scrape_max_samples: ScrapeLimits::default().max_samples,
            targets: Vec::new(),
            prometheus: None,
            jetstream: Vec::new(),
            database: None,
            metrics: MetricNames::default(),
            drills: DrillPermissions::default(),
            alerts: AlertRules::default(),
            theme: Theme::default(),
            engine: EngineSection::default(),
            queue: QueueSection::default(),
            dedup_windows: DedupWindows::default(),
        }
    }
}

/// `[engine]`: how long the engine waits on its database (docs/CONTRACT.md §9); defaults and
/// why in [`idemwatch_engine::deadlines`]. The command line's `--statement-timeout`,
/// `--connect-timeout` and `--acquire-timeout` win over these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    /// The longest one store call (a transaction) may take; the server is told the
    /// same per statement and lock wait (SQLite: the busy timeout).
    #[serde(with = "human_duration")]
    pub statement_timeout: Duration,
    /// The longest opening a connection to the database or the broker may take.
    #[serde(with = "human_duration")]
    pub connect_timeout: Duration,
    /// The longest a store call waits for one of the pool's connections.
    #[serde(with = "human_duration")]
    pub acquire_timeout: Duration,
}

impl Default for EngineSection {
    fn default() -> Self {
        let d = idemwatch_engine::deadlines::Deadlines::default();
        EngineSection {
            statement_timeout: d.statement_timeout,
            connect_timeout: d.connect_timeout,
            acquire_timeout: d.acquire_timeout,
        }
    }
}

/// `[queue]`: the engine's broker link (docs/CONTRACT.md §9). `--heartbeat` wins over it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueSection {
    /// AMQP's heartbeat and NATS's ping interval: a link silent for two of them is
    /// closed and dialled again. An `amqp://…?heartbeat=S` in the URL wins for AMQP.
    #[serde(with = "human_duration")]
    pub heartbeat: Duration,
}

impl Default for QueueSection {
    fn default() -> Self {
        QueueSection {
            heartbeat: idemwatch_engine::deadlines::Deadlines::default().heartbeat,
        }
    }
}

/// One `/metrics` endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ScrapeTarget {
    /// Shown on screen and in alerts; unique within the config.
    pub name: String,
    pub url: String,
}

/// A NATS server's monitoring endpoint (`http://HOST:8222`): `/jsz` is read each poll.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JetStreamMonitor {
    /// Shown on screen beside the scrape targets.
    pub name: String,
    pub url: String,
}

/// A Prometheus server queried for history (`/api/v1/query_range`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PrometheusServer {
    pub url: String,
}

/// Live drills re-publish messages to the watched system: off unless enabled.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DrillPermissions {
    /// `live-redelivery` (re-publish processed messages to the watched system) may run
    /// from the dashboard, after a confirmation.
    pub allow_live: bool,
    /// The watched system's queue, e.g. `amqp://user:pass@broker:5672/%2f` (default:
    /// the embedded queue beside the database). Shown only through `redact_url`.
    pub queue: Option<String>,
    /// The `/metrics` a live drill watches (default: the first `[[targets]]` URL).
    pub metrics_url: Option<String>,
    /// The device broker `device-retransmit` sends its copies through
    /// (`mqtt://HOST:PORT`; default: none, the copies go straight into the queues).
    /// Shown only through `redact_url`.
    pub mqtt_broker: Option<String>,
}

/// Alert thresholds an operator may tune (`[alerts]`); the duplicate-rate ones are
/// the field report's baselines and live in `monitor::alerts`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertRules {
    /// A scrape target raises its CRIT only once it has failed this long: one
    /// missed scrape during a restart is not an outage.
    #[serde(with = "human_duration")]
    pub target_down_after: Duration,
    /// Dead letters of one reason within five minutes that make a burst (a single
    /// `key_conflict` always does).
    pub dead_letter_burst: u32,
    /// The share of a deploy's window's deliveries that may be duplicates
    /// (dup / (processed + dup), docs/CONTRACT.md §5) before the deploy is over
    /// budget ([`crate::deploys`]). Default: the field report's deploy day, 0.4 %
    /// ([`crate::ratios::DEPLOY_DAY_RATIO`]): a deploy costing more than deploys
    /// usually do is worth a look even when nothing else alerts.
    pub deploy_duplicate_budget: f64,
    /// Per consumer (by its name), a budget of its own: a consumer whose duplicates
    /// cost money (an SMS sender) may be held to less than a counter that only
    /// drops them.
    pub deploy_duplicate_budget_by_consumer: std::collections::BTreeMap<String, f64>,
    /// The longest window a deploy owns: from its marker to the next deploy or
    /// restart, at most this long. A rolling restart plus the broker's visibility
    /// timeout is over well within it; longer, and a window would also count the
    /// next ordinary day's duplicates as the deploy's.
    #[serde(with = "human_duration")]
    pub deploy_settle_time: Duration,
}

/// A deploy's window lasts at most this long unless the config says otherwise
/// ([`AlertRules::deploy_settle_time`]).
pub const DEFAULT_DEPLOY_SETTLE_TIME: Duration = Duration::from_secs(600);

impl Default for AlertRules {
    fn default() -> Self {
        AlertRules {
            target_down_after: Duration::from_secs(15),
            dead_letter_burst: 5,
            deploy_duplicate_budget: crate::ratios::DEPLOY_DAY_RATIO,
            deploy_duplicate_budget_by_consumer: std::collections::BTreeMap::new(),
            deploy_settle_time: DEFAULT_DEPLOY_SETTLE_TIME,
        }
    }
}

impl AlertRules {
    /// The deploy duplicate budget of one consumer: its own, else the default.
    pub fn deploy_budget_of(&self, consumer: &str) -> f64 {
        self.deploy_duplicate_budget_by_consumer
            .get(consumer)
            .copied()
            .unwrap_or(self.deploy_duplicate_budget)
    }
}

/// Colour scheme. `no-color` is for terminals (and people) that need it; the
/// `NO_COLOR` environment variable selects it as well.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Theme {
    #[default]
    Default,
    NoColor,
    HighContrast,
    Light,
}

/// The business database and where the watched tables and columns are.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// `sqlite://PATH`, `postgres://…` or `mysql://…` (read-only use). Shown only
    /// through `redact_url`.
    pub url: String,
    /// Dedup rows older than this are purged; an oldest row much older means the purge
    /// stopped running.
    #[serde(default = "default_retention", with = "human_duration")]
    pub retention: Duration,
    /// A claim left `claimed` longer than this is in doubt (docs/CONTRACT.md §3).
    #[serde(default = "default_claim_lease", with = "human_duration")]
    pub claim_lease: Duration,
    #[serde(default)]
    pub tables: TableMapping,
}

fn default_retention() -> Duration {
    idemwatch_engine::retention::DEFAULT_RETENTION
}

fn default_claim_lease() -> Duration {
    idemwatch_engine::consumers::DEFAULT_CLAIM_LEASE
}

impl DatabaseConfig {
    /// A database section with every default, for `--db URL` without a config.
    pub fn with_url(url: &str) -> Self {
        DatabaseConfig {
            url: url.to_string(),
            retention: default_retention(),
            claim_lease: default_claim_lease(),
            tables: TableMapping::default(),
        }
    }
}

/// Table and column names of the watched database. Defaults are docs/CONTRACT.md §3's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TableMapping {
    pub processed_messages: ProcessedMessagesTable,
    pub side_effect_claims: ClaimsTable,
    pub dead_letters: DeadLettersTable,
    pub vehicle_state: VehicleStateTable,
    pub vehicle_history: VehicleHistoryTable,
    pub markers: MarkersTable,
    pub drill_runs: DrillRunsTable,
}

/// Declares one table's mapping struct with its docs/CONTRACT.md §3 defaults, and lists its
/// identifiers for validation, so a new column cannot be forgotten there.
macro_rules! table_mapping {
    ($(#[$doc:meta])* $name:ident, $table:literal { $($field:ident = $default:literal),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct $name {
            pub table: String,
            $(pub $field: String,)*
        }

        impl Default for $name {
            fn default() -> Self {
                $name {
                    table: $table.to_string(),
                    $($field: $default.to_string(),)*
                }
            }
        }

        impl $name {
            /// (key, identifier) pairs, for validation.
            fn identifiers(&self) -> Vec<(&'static str, &str)> {
                vec![("table", self.table.as_str()) $(, (stringify!($field), self.$field.as_str()))*]
            }
        }
    };
}

table_mapping!(
    /// The dedup table: one row per (consumer, key) ever processed.
    ProcessedMessagesTable, "processed_messages" {
        consumer = "consumer", message_key = "message_key", processed_at = "processed_at",
    }
);
table_mapping!(
    /// Two-phase side-effect claims.
    ClaimsTable, "side_effect_claims" {
        consumer = "consumer", message_key = "message_key", state = "state",
        claimed_at = "claimed_at", attempts = "attempts",
    }
);
table_mapping!(
    /// Messages that could not be processed, kept with a reason.
    DeadLettersTable, "dead_letters" {
        id = "id", consumer = "consumer", reason = "reason", received_at = "received_at",
        detail = "detail", raw = "raw",
    }
);
table_mapping!(
    /// The newest state per device (seq-guarded upsert).
    VehicleStateTable, "vehicle_state" {
        device_id = "device_id", last_seq = "last_seq", last_event_type = "last_event_type",
        ignition = "ignition", occurred_at = "occurred_at", updated_at = "updated_at",
    }
);
table_mapping!(
    /// Every event once, in arrival order, late ones with `applied = false`.
    VehicleHistoryTable, "vehicle_history" {
        device_id = "device_id", seq = "seq", event_type = "event_type",
        occurred_at = "occurred_at", received_at = "received_at", applied = "applied",
    }
);
table_mapping!(
    /// Deploy/restart/drill/manual markers for the charts.
    MarkersTable, "markers" {
        id = "id", kind = "kind", at = "at", label = "label", detail = "detail",
    }
);
table_mapping!(
    /// Past drill runs and their verdicts.
    DrillRunsTable, "drill_runs" {
        id = "id", scenario = "scenario", mode = "mode", started_at = "started_at",
        finished_at = "finished_at", verdict = "verdict",
    }
);

impl TableMapping {
    /// Every identifier with its config key, e.g.
    /// `("database.tables.processed_messages.processed_at", "processed_at")`.
    pub fn identifiers(&self) -> Vec<(String, &str)> {
        let groups: [(&str, Vec<(&'static str, &str)>); 7] = [
            ("processed_messages", self.processed_messages.identifiers()),
            ("side_effect_claims", self.side_effect_claims.identifiers()),
            ("dead_letters", self.dead_letters.identifiers()),
            ("vehicle_state", self.vehicle_state.identifiers()),
            ("vehicle_history", self.vehicle_history.identifiers()),
            ("markers", self.markers.identifiers()),
            ("drill_runs", self.drill_runs.identifiers()),
        ];
        groups
            .into_iter()
            .flat_map(|(table, ids)| {
                ids.into_iter()
                    .map(move |(key, id)| (format!("database.tables.{table}.{key}"), id))
            })
            .collect()
    }
}

/// Metric names the dashboard reads (docs/CONTRACT.md §5 by default). Counter names are the
/// sample names, i.e. with `_total`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricNames {
    pub processed: String,
    pub duplicate_dropped: String,
    pub redelivered: String,
    pub out_of_order: String,
    pub dead_lettered: String,
    pub side_effects: String,
    pub claims_in_doubt: String,
    pub process_start_time: String,
    /// Requests at an HTTP edge with Idempotency-Key (labels: route, outcome).
    pub http_requests: String,
    /// A gauge at 1 whose `durability` label says how the engine commits
    /// (`durable` / `relaxed`).
    pub engine_info: String,
    /// Seen-set checks skipped under fail-open while the seen-set (Redis) was down.
    pub seen_set_bypassed: String,
    /// Device messages an ingress took in (labels: source, dup_flag).
    pub ingress_messages: String,
    /// 1 while an ingress (label `source`) holds its broker connection.
    pub ingress_connected: String,
    /// When an ingress's current state (connected or not) began.
    pub ingress_state_since: String,
    /// An ingress's failures (labels: source, kind).
    pub ingress_errors: String,
    /// When an ingress last failed with each `kind`.
    pub ingress_error_last: String,
    /// Messages an ingress dead-lettered at its door (labels: source, reason).
    pub ingress_dead_lettered: String,
    /// 1 while a consumer stops leasing because its store or provider (label
    /// `cause`) is unhealthy.
    pub paused: String,
    /// When the current pause began (seconds since the epoch, 0 while running).
    pub paused_since: String,
    /// Failed tries in the current pause (0 while running).
    pub pause_retries: String,
    /// When the batch in hand was taken up (0 between batches).
    pub busy_since: String,
    /// Deliveries given back by infrastructure failures (label `kind`).
    pub infra_errors: String,
    /// When a consumer last met an infrastructure failure of each `kind`.
    pub infra_error_last: String,
    /// Second provider calls for one key (label `reason`: lease_takeover,
    /// sweeper_redrive, provider_retry, unexpected).
    pub provider_repeat_calls: String,
    /// The histogram of dropped duplicates' ages (its `_bucket` series are read).
    pub duplicate_age: String,
    /// The oldest duplicate age a process has dropped.
    pub duplicate_age_max: String,
    /// A Redis seen-set's key TTL (0 or absent: no Redis seen-set).
    pub seen_set_ttl: String,
    /// The label that names the consumer on every per-consumer metric.
    pub consumer_label: String,
    pub reason_label: String,
    pub result_label: String,
}

impl Default for MetricNames {
    fn default() -> Self {
        MetricNames {
            processed: names::PROCESSED.exposed.into(),
            duplicate_dropped: names::DUPLICATE_DROPPED.exposed.into(),
            redelivered: names::REDELIVERED.exposed.into(),
            out_of_order: names::OUT_OF_ORDER.exposed.into(),
            dead_lettered: names::DEAD_LETTERED.exposed.into(),
            side_effects: names::SIDE_EFFECTS.exposed.into(),
            claims_in_doubt: names::CLAIMS_IN_DOUBT.exposed.into(),
            process_start_time: names::PROCESS_START.exposed.into(),
            http_requests: names::HTTP_REQUESTS.exposed.into(),
            engine_info: names::ENGINE_INFO.exposed.into(),
            seen_set_bypassed: names::SEEN_SET_BYPASSED.exposed.into(),
            ingress_messages: names::INGRESS_MESSAGES.exposed.into(),
            ingress_connected: names::INGRESS_CONNECTED.exposed.into(),
            ingress_state_since: names::INGRESS_STATE_SINCE.exposed.into(),
            ingress_errors: names::INGRESS_ERRORS.exposed.into(),
            ingress_error_last: names::INGRESS_ERROR_LAST.exposed.into(),
            ingress_dead_lettered: names::INGRESS_DEAD_LETTERED.exposed.into(),
            paused: names::PAUSED.exposed.into(),
            paused_since: names::PAUSED_SINCE.exposed.into(),
            pause_retries: names::PAUSE_RETRIES.exposed.into(),
            busy_since: names::BUSY_SINCE.exposed.into(),
            infra_errors: names::INFRA_ERRORS.exposed.into(),
            infra_error_last: names::INFRA_ERROR_LAST.exposed.into(),
            provider_repeat_calls: names::PROVIDER_REPEAT_CALLS.exposed.into(),
            duplicate_age: names::DUPLICATE_AGE.into(),
            duplicate_age_max: names::DUPLICATE_AGE_MAX.exposed.into(),
            seen_set_ttl: names::SEEN_SET_TTL.exposed.into(),
            consumer_label: "consumer".into(),
            reason_label: "reason".into(),
            result_label: "result".into(),
        }
    }
}

/// True for a plain SQL identifier (`^[A-Za-z_][A-Za-z0-9_]*$`). Only such names are
/// ever put into SQL text, so a mapping can never inject SQL whatever the quoting.
pub fn is_plain_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl Config {
    /// Parse and validate a config file's text; `path` is only used in messages.
    pub fn from_toml(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        config.validate(path)?;
        Ok(config)
    }

    /// Read, parse and validate one file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_toml(&text, path)
    }

    /// The config to use: `explicit` (`--config`) if given, else
    /// `$XDG_CONFIG_HOME/idemwatch/config.toml` if it exists, else None (demo mode).
    pub fn discover(explicit: Option<&Path>) -> Result<Option<Config>, ConfigError> {
        if let Some(path) = explicit {
            return Config::load(path).map(Some);
        }
        match default_config_path() {
            Some(path) if path.is_file() => Config::load(&path).map(Some),
            _ => Ok(None),
        }
    }

    /// The engine's deadlines this config names (`[engine]`, `[queue]`).
    pub fn deadlines(&self) -> idemwatch_engine::deadlines::Deadlines {
        idemwatch_engine::deadlines::Deadlines {
            statement_timeout: self.engine.statement_timeout,
            connect_timeout: self.engine.connect_timeout,
            acquire_timeout: self.engine.acquire_timeout,
            heartbeat: self.queue.heartbeat,
        }
    }

    /// What one scrape may cost: the body and sample caps from the config, the line
    /// cap from the defaults (never above the body's).
    pub fn scrape_limits(&self) -> ScrapeLimits {
        let defaults = ScrapeLimits::default();
        ScrapeLimits {
            max_body_bytes: self.scrape_max_bytes,
            max_line_bytes: defaults
                .max_line_bytes
                .min(usize::try_from(self.scrape_max_bytes).unwrap_or(usize::MAX)),
            max_samples: self.scrape_max_samples,
        }
    }

    /// Fill what a config leaves out with the local defaults: the engine's own
    /// `/metrics` (`local=http://127.0.0.1:9464/metrics`) and database
    /// (`engine::default_db_url()`). Used when no config file exists.
    pub fn with_local_defaults(mut self) -> Config {
        if self.targets.is_empty() {
            self.targets.push(ScrapeTarget {
                name: "local".into(),
                url: LOCAL_METRICS_URL.into(),
            });
        }
        if self.database.is_none() {
            self.database = Some(DatabaseConfig::with_url(&idemwatch_engine::default_db_url()));
        }
        self
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let bad = |key: String, message: String| ConfigError::Value {
            path: path.to_path_buf(),
            key,
            message,
        };
        if self.poll_interval < Duration::from_millis(100) {
            return Err(bad("poll_interval".into(), "must be at least 100ms".into()));
        }
        if self.chart_window < Duration::from_secs(60) {
            return Err(bad("chart_window".into(), "must be at least 1m".into()));
        }
        if self.scrape_timeout.is_zero() {
            return Err(bad("scrape_timeout".into(), "must be above zero".into()));
        }
        if self.scrape_max_bytes < MIN_SCRAPE_BYTES {
            return Err(bad(
                "scrape_max_bytes".into(),
                format!("must be at least {MIN_SCRAPE_BYTES} bytes"),
            ));
        }
        if self.scrape_max_samples == 0 {
            return Err(bad(
                "scrape_max_samples".into(),
                "must be above zero".into(),
            ));
        }
        let budget = |b: f64| b.is_finite() && b > 0.0 && b <= 1.0;
        if !budget(self.alerts.deploy_duplicate_budget) {
            return Err(bad(
                "alerts.deploy_duplicate_budget".into(),
                "must be a ratio above 0 and at most 1 (0.004 is 0.4 %)".into(),
            ));
        }
        for (consumer, b) in &self.alerts.deploy_duplicate_budget_by_consumer {
            if !budget(*b) {
                return Err(bad(
                    format!("alerts.deploy_duplicate_budget_by_consumer.{consumer}"),
                    "must be a ratio above 0 and at most 1 (0.004 is 0.4 %)".into(),
                ));
            }
        }
        if self.alerts.deploy_settle_time < Duration::from_secs(60) {
            return Err(bad(
                "alerts.deploy_settle_time".into(),
                "must be at least 1m (a deploy's redeliveries take a visibility timeout to come back)".into(),
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, t) in self.targets.iter().enumerate() {
            if t.name.trim().is_empty() {
                return Err(bad(
                    format!("targets[{i}].name"),
                    "must not be empty".into(),
                ));
            }
            if !names.insert(t.name.as_str()) {
                return Err(bad(
                    format!("targets[{i}].name"),
                    format!("duplicate target name {:?}", t.name),
                ));
            }
            check_http_url(&t.url).map_err(|m| bad(format!("targets[{i}].url"), m))?;
        }
        if let Some(p) = &self.prometheus {
            check_http_url(&p.url).map_err(|m| bad("prometheus.url".into(), m))?;
        }
        for (i, j) in self.jetstream.iter().enumerate() {
            if j.name.trim().is_empty() {
                return Err(bad(
                    format!("jetstream[{i}].name"),
                    "must not be empty".into(),
                ));
            }
            check_http_url(&j.url).map_err(|m| bad(format!("jetstream[{i}].url"), m))?;
        }
        for (key, d, least) in [
            (
                "engine.statement_timeout",
                self.engine.statement_timeout,
                Duration::from_millis(100),
            ),
            (
                "engine.connect_timeout",
                self.engine.connect_timeout,
                Duration::from_millis(100),
            ),
            (
                "engine.acquire_timeout",
                self.engine.acquire_timeout,
                Duration::from_millis(100),
            ),
            // AMQP counts its heartbeat in whole seconds.
            (
                "queue.heartbeat",
                self.queue.heartbeat,
                Duration::from_secs(1),
            ),
        ] {
            if d < least {
                return Err(bad(
                    key.into(),
                    format!(
                        "must be at least {} (a deadline of nothing fails every call)",
                        humantime::format_duration(least)
                    ),
                ));
            }
        }
        if let Some(broker) = &self.drills.mqtt_broker {
            idemwatch_engine::ingress::broker_address(broker)
                .map_err(|e| bad("drills.mqtt_broker".into(), e.to_string()))?;
        }
        if let Some(db) = &self.database {
            if !["sqlite:", "postgres:", "postgresql:", "mysql:", "mariadb:"]
                .iter()
                .any(|s| db.url.starts_with(s))
            {
                return Err(bad(
                    "database.url".into(),
                    format!(
                        "unsupported URL {} (expected sqlite://, postgres:// or mysql://)",
                        idemwatch_engine::store::redact_url(&db.url)
                    ),
                ));
            }
            if db.retention < Duration::from_secs(60) {
                return Err(bad(
                    "database.retention".into(),
                    "must be at least 1m".into(),
                ));
            }
            for (key, id) in db.tables.identifiers() {
                if !is_plain_identifier(id) {
                    return Err(bad(
                        key,
                        format!("{id:?} is not a plain SQL identifier ([A-Za-z_][A-Za-z0-9_]*)"),
                    ));
                }
            }
        }
        Ok(())
    }
}

fn check_http_url(raw: &str) -> Result<(), String> {
    match url::Url::parse(raw) {
        Ok(u) if u.scheme() == "http" || u.scheme() == "https" => Ok(()),
        Ok(u) => Err(format!(
            "expected an http(s) URL, got scheme {:?}",
            u.scheme()
        )),
        Err(e) => Err(format!("not a URL ({e})")),
    }
}

/// `$XDG_CONFIG_HOME/idemwatch/config.toml` (or the platform's config directory).
pub fn default_config_path() -> Option<PathBuf> {
    dirs::config_dir().map(|d| d.join("idemwatch").join("config.toml"))
}

/// Durations as humantime strings (`"1s"`, `"15m"`, `"7d"`): what operators write.
/// The smallest body cap a config may set: below it even an empty engine's
/// exposition would not fit.
pub const MIN_SCRAPE_BYTES: u64 = 4096;

/// A size as written in a config or on the command line: bytes (`65536`) or with a
/// binary unit (`64KiB`, `16MiB`, `1GiB`).
pub fn parse_byte_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let unit_bytes: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => {
            return Err(format!(
                "invalid size {text:?}: unknown unit {other:?} (write e.g. \"65536\", \"64KiB\", \"16MiB\")"
            ))
        }
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit_bytes))
        .ok_or_else(|| {
            format!("invalid size {text:?} (write e.g. \"65536\", \"64KiB\", \"16MiB\")")
        })
}

mod byte_size {
    use super::*;

    pub fn serialize<S: serde::Serializer>(n: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(*n)
    }

    /// An integer (bytes) or a string with a unit.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Size {
            Bytes(u64),
            Text(String),
        }
        match Size::deserialize(d)? {
            Size::Bytes(n) => Ok(n),
            Size::Text(t) => parse_byte_size(&t).map_err(serde::de::Error::custom),
        }
    }
}

mod human_duration {
    use super::*;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text).map_err(|e| {
            serde::de::Error::custom(format!(
                "invalid duration {text:?} ({e}); write e.g. \"1s\", \"15m\", \"7d\""
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_means_every_default() {
        let c = Config::from_toml("", Path::new("x.toml")).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.poll_interval, Duration::from_secs(1));
        assert_eq!(c.chart_window, Duration::from_secs(900));
        assert!(!c.drills.allow_live);
    }

    #[test]
    fn scrape_caps_are_read_with_units_and_checked() {
        let c = Config::from_toml(
            "scrape_max_bytes = \"64KiB\"\nscrape_max_samples = 10\n",
            Path::new("x.toml"),
        )
        .unwrap();
        let limits = c.scrape_limits();
        assert_eq!((limits.max_body_bytes, limits.max_samples), (65536, 10));
        assert_eq!(limits.max_line_bytes, 65536, "a line never above the body");
        let c = Config::from_toml("scrape_max_bytes = 5000\n", Path::new("x.toml")).unwrap();
        assert_eq!(c.scrape_max_bytes, 5000);
        for bad in [
            "scrape_max_bytes = 10",
            "scrape_max_bytes = \"16MB\"",
            "scrape_max_samples = 0",
        ] {
            let e = Config::from_toml(bad, Path::new("x.toml"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("scrape_max"), "{bad}: {e}");
        }
        assert_eq!(parse_byte_size("1GiB"), Ok(1 << 30));
        assert!(parse_byte_size("99999999999GiB").is_err());
    }

    #[test]
    fn unknown_key_is_named_with_the_file() {
        let e = Config::from_toml("poll_intervall = \"2s\"\n", Path::new("/etc/iw.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/etc/iw.toml"), "{e}");
        assert!(e.contains("poll_intervall"), "{e}");
    }

    #[test]
    fn identifiers_that_could_inject_sql_are_refused() {
        let text = "[database]\nurl = \"sqlite://x.db\"\n[database.tables.processed_messages]\ntable = \"pm; DROP TABLE x\"\n";
        let e = Config::from_toml(text, Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("database.tables.processed_messages.table"),
            "{e}"
        );
        assert!(is_plain_identifier("_dedup_2"));
        assert!(!is_plain_identifier("2dedup"));
        assert!(!is_plain_identifier(""));
        assert!(!is_plain_identifier("a\"b"));
    }
}
