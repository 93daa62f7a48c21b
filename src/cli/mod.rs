//! Command-line parsing (docs/CONTRACT.md §6). Each subcommand lives in its own file and only
//! calls the library layers.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use idemwatch::engine::consumers::{
    ConsumerMode, DEFAULT_CLAIM_LEASE, DEFAULT_PROVIDER_CONCURRENCY,
};
use idemwatch::engine::crash::CrashPoint;
use idemwatch::engine::deadlines::Deadlines;
use idemwatch::engine::runner::RunnerSettings;
use idemwatch::engine::seen_set::{SeenSetConfig, Unavailable};
use idemwatch::engine::store::{Durability, StoreError};
use idemwatch::engine::{default_db_url, default_queue_url, Engine, EngineConfig, EngineError};
use idemwatch::sim::sandbox_provider::{self, SandboxHandle};

pub mod bench;
pub mod chaos;
pub mod claims;
pub mod completions;
pub mod consume;
pub mod dashboard;
pub mod dead_letters;
#[cfg(test)]
mod defaults_test;
pub mod drill;
pub mod env_files;
pub mod ingest;
pub mod man;
pub mod mark;
pub mod publish;
pub mod purge;
pub mod report;
pub mod sandbox;
pub mod serve;
pub mod simulate;
pub mod snapshot;

/// Exit codes (docs/CONTRACT.md §6, plus 3 for an environment we could not reach). A failed
/// idempotent drill exits 1 (see `DrillReport::exit_code`).
pub const EXIT_OK: i32 = 0;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_UNAVAILABLE: i32 = 3;

/// An error with the exit code it maps to.
#[derive(Debug)]
pub struct CliError {
    pub code: i32,
    pub message: String,
}

/// The runtime's worker threads: `--runtime-threads`, else the cores minus one.
pub fn runtime_threads(asked: Option<usize>) -> usize {
    asked
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get().saturating_sub(1))
                .unwrap_or(1)
        })
        .max(1)
}

impl CliError {
    pub fn usage(message: impl Into<String>) -> Self {
        CliError {
            code: EXIT_USAGE,
            message: message.into(),
        }
    }

    pub fn unavailable(message: impl std::fmt::Display) -> Self {
        CliError {
            code: EXIT_UNAVAILABLE,
            message: message.to_string(),
        }
    }
}

pub type CliResult = Result<i32, CliError>;

/// `idemwatch --version`: the package's version and the commit it was built from
/// (`build.rs`; `unknown` outside a git checkout), so a bug report names the code.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("IDEMWATCH_GIT_COMMIT"),
    ")"
);

#[derive(Debug, Parser)]
#[command(
    name = "idemwatch",
    version = VERSION,
    about = "Watch and prove idempotent consumers: a terminal dashboard plus an embedded engine with redelivery drills",
    after_help = "Without a subcommand: the dashboard (a live demo on an embedded engine when no config is found)."
)]
pub struct Cli {
    /// Config file (TOML). Default: $XDG_CONFIG_HOME/idemwatch/config.toml if present.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Where logs go (the terminal belongs to the TUI and to --json output).
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        env = "IDEMWATCH_LOG_FILE",
        hide_env_values = true
    )]
    pub log_file: Option<PathBuf>,

    /// Threads of the async runtime. Default: one fewer than the cores (at least 1) —
    /// SQLite's connection threads and a local database server need a core of their
    /// own, and the runtime's share of the work is small. 1 runs everything on the
    /// main thread (tokio's current-thread scheduler).
    #[arg(
        long,
        global = true,
        value_name = "N",
        env = "IDEMWATCH_RUNTIME_THREADS",
        hide_env_values = true
    )]
    pub runtime_threads: Option<usize>,

    /// The dashboard's Prometheus server (base URL): the chart's window before the
    /// dashboard started comes from its history. Overrides `[prometheus] url`.
    #[arg(long, value_name = "URL", env = "IDEMWATCH_PROMETHEUS", hide_env_values = true, value_parser = parse_http_url)]
    pub prometheus: Option<String>,

    #[command(flatten)]
    pub scrape_cap: ScrapeCapArgs,

    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the consumers as a service; /metrics on --listen.
    Serve(serve::ServeArgs),
    /// Enqueue envelopes from a .jsonl file ('-' = stdin), one message per line.
    Publish(publish::PublishArgs),
    /// Run the consumers until the queue is empty, then print counts.
    Consume(consume::ConsumeArgs),
    /// Run one redelivery drill headless and print its report.
    Drill(drill::DrillArgs),
    /// Poll every source once and print what the dashboard would show.
    Snapshot(snapshot::SnapshotArgs),
    /// Write a deploy, incident or note marker that every dashboard shows (for CD
    /// pipelines: needs only INSERT on the markers table).
    Mark(mark::MarkArgs),
    /// Retention purge of processed_messages, in batches.
    Purge(purge::PurgeArgs),
    /// List side-effect claims, or resolve one left in doubt.
    Claims(claims::ClaimsArgs),
    /// List dead letters, or replay them to their consumer's queue.
    DeadLetters(dead_letters::DeadLettersArgs),
    /// A post-mortem report of a window (HTML with its chart, JSON or CSV).
    Report(report::ReportArgs),
    /// The SMS/ERP sandbox provider, standalone.
    SmsSandbox(sandbox::SandboxArgs),
    /// Print a deterministic fleet trace as JSON lines (feed it to `publish`).
    Simulate(simulate::SimulateArgs),
    /// Measurements at production scale on PostgreSQL (dashboard queries, purge).
    Bench(bench::BenchArgs),
    /// Several `serve` processes killed at random while a fleet publishes; then verify.
    Chaos(chaos::ChaosArgs),
    /// Take device messages in from a broker (MQTT QoS 1) onto the engine's queue.
    Ingest(ingest::IngestArgs),
    /// Print the completion script for a shell (bash, zsh, fish, elvish, powershell).
    Completions(completions::CompletionsArgs),
    /// Print the manual page (roff), or write one page per subcommand with --dir.
    Man(man::ManArgs),
}

/// Flags every engine-backed command shares (docs/CONTRACT.md §6 "common flags").
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Database URL: sqlite://PATH, postgres://…, mysql://… (default: SQLite in the data dir).
    /// A URL with a password belongs in IDEMWATCH_DB, or in a file named by IDEMWATCH_DB_FILE.
    #[arg(long, env = idemwatch::engine::ENV_DB, hide_env_values = true)]
    pub db: Option<String>,
    /// Queue URL (default: the embedded queue next to the database); from a file:
    /// IDEMWATCH_QUEUE_FILE.
    #[arg(long, env = idemwatch::engine::ENV_QUEUE, hide_env_values = true)]
    pub queue: Option<String>,
    /// Base URL of the SMS provider (default: an embedded sandbox).
    #[arg(long, env = idemwatch::engine::ENV_SMS_URL, hide_env_values = true)]
    pub sms_url: Option<String>,
    /// Base URL of the ERP webhook sink (default: same as --sms-url).
    #[arg(long, env = idemwatch::engine::ENV_WEBHOOK_URL, hide_env_values = true)]
    pub webhook_url: Option<String>,
    /// Idempotency mode of the consumers.
    #[arg(long, value_enum, default_value_t = ConsumerMode::Idempotent)]
    pub mode: ConsumerMode,
    /// Run only these consumers (repeatable; default: all four).
    #[arg(long = "consumer", value_name = "NAME")]
    pub consumers: Vec<String>,
    /// Deliveries leased and handled together: a transactional consumer commits the
    /// batch in one transaction and the queue acks it in one round trip.
    #[arg(
        long = "batch",
        alias = "lease-batch",
        default_value_t = RunnerSettings::default().lease_batch,
        value_name = "N"
    )]
    pub lease_batch: usize,
    /// Provider calls (SMS, webhooks) of one batch in flight at once, per
    /// side-effect consumer; each call keeps its own claim and provider key.
    #[arg(long, default_value_t = DEFAULT_PROVIDER_CONCURRENCY, value_name = "N")]
    pub provider_concurrency: usize,
    /// Once a batch's first delivery is in, how long to wait for it to fill (0: take
    /// what is there). Bounds the latency batching adds.
    #[arg(long, value_parser = humantime::parse_duration, default_value = shown(RunnerSettings::default().batch_max_wait), value_name = "DURATION")]
    pub batch_max_wait: Duration,
    /// Lease the next batch only once the current one is acked (by default the queue
    /// work overlaps the database commit).
    #[arg(long)]
    pub no_pipeline: bool,
    /// Deliveries leased per queue round trip (rounded up to whole batches) and
    /// handled a batch at a time, their acks sent with the next lease. A process that
    /// dies leaves up to this many to come back after the visibility timeout.
    #[arg(long, default_value_t = RunnerSettings::default().prefetch, value_name = "N")]
    pub prefetch: usize,
    /// The most deliveries one batch gathers across leases until it holds --batch of
    /// its consumer's own events (the SMS consumer wants ~6 % of a fleet's traffic);
    /// the other events are acked with it. At most --batch: off.
    #[arg(long, default_value_t = RunnerSettings::default().gather, value_name = "N")]
    pub gather: usize,

    /// Where `--mode seen-set` keeps its keys: redis://… (SET key NX PX ttl after
    /// success). Default: the database's processed_messages table.
    #[arg(
        long,
        value_name = "URL",
        env = env_files::ENV_SEEN_SET,
        hide_env_values = true
    )]
    pub seen_set: Option<String>,
    /// While the seen-set cannot be reached: pause like a store outage (fail-closed),
    /// or handle unchecked and count idem_seen_set_bypassed_total (fail-open).
    #[arg(long, value_enum, default_value_t = Unavailable::FailClosed)]
    pub seen_set_unavailable: Unavailable,
    /// How long a Redis seen-set key lives: the retention (as `purge --older-than`).
    #[arg(long, value_parser = humantime::parse_duration, default_value = shown(SeenSetConfig::default().ttl), value_name = "DURATION")]
    pub seen_set_ttl: Duration,

    /// The longest one store call (a transaction) may take before the consumer
    /// pauses and retries on a fresh connection; the database is told the same per
    /// statement. Overrides `[engine] statement_timeout` (default 20s).
    #[arg(long, value_parser = parse_deadline, value_name = "DURATION")]
    pub statement_timeout: Option<Duration>,
    /// The longest opening a database or broker connection may take. Overrides
    /// `[engine] connect_timeout` (default 10s).
    #[arg(long, value_parser = parse_deadline, value_name = "DURATION")]
    pub connect_timeout: Option<Duration>,
    /// The longest a store call waits for a pooled connection. Overrides `[engine]
    /// acquire_timeout` (default 10s).
    #[arg(long, value_parser = parse_deadline, value_name = "DURATION")]
    pub acquire_timeout: Option<Duration>,
    /// AMQP heartbeat / NATS ping interval: a broker link silent for two of them is
    /// dropped and dialled again. Overrides `[queue] heartbeat` (default 10s).
    #[arg(long, value_parser = parse_heartbeat, value_name = "DURATION")]
    pub heartbeat: Option<Duration>,

    // Tuning and drill plumbing: hidden from --help, used by drills' child processes.
    #[arg(long, hide = true)]
    pub namespace: Option<String>,
    #[arg(long, hide = true, default_value_t = ms(RunnerSettings::default().visibility_timeout))]
    pub visibility_ms: u64,
    #[arg(long, hide = true, default_value_t = ms(DEFAULT_CLAIM_LEASE))]
    pub claim_lease_ms: u64,
    #[arg(long, hide = true, default_value_t = ms(RunnerSettings::default().retry_delay))]
    pub retry_ms: u64,
    #[arg(long, hide = true, default_value_t = RunnerSettings::default().max_deliveries)]
    pub max_deliveries: u32,
    #[arg(long, hide = true, value_parser = clap::value_parser!(CrashPoint))]
    pub crash_at: Option<CrashPoint>,
    /// Die for real (abort) at --crash-at instead of stopping the worker.
    #[arg(long, hide = true)]
    pub crash_abort: bool,
}

/// A library default duration as a flag's default: what `--help` shows, in the form
/// `humantime` parses back (`0s`, `30s`, `1m`, `7days`). The defaults themselves live
/// with the settings they belong to (`RunnerSettings::default()`, the engine's
/// constants), never here.
pub fn shown(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// A library default duration in the milliseconds of the hidden tuning flags.
pub fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl EngineArgs {
    pub fn db_url(&self) -> String {
        self.db.clone().unwrap_or_else(default_db_url)
    }

    pub fn queue_url(&self) -> String {
        self.queue
            .clone()
            .unwrap_or_else(|| default_queue_url(&self.db_url()))
    }

    /// `--seen-set`, `--seen-set-unavailable` and `--seen-set-ttl` together.
    pub fn seen_set_config(&self) -> SeenSetConfig {
        SeenSetConfig {
            url: self.seen_set.clone(),
            unavailable: self.seen_set_unavailable,
            ttl: self.seen_set_ttl,
        }
    }

    /// `base` (the config's `[engine]` and `[queue]`, or the defaults) with the
    /// deadline flags given on the command line over it.
    pub fn deadlines(&self, base: Deadlines) -> Deadlines {
        Deadlines {
            statement_timeout: self.statement_timeout.unwrap_or(base.statement_timeout),
            connect_timeout: self.connect_timeout.unwrap_or(base.connect_timeout),
            acquire_timeout: self.acquire_timeout.unwrap_or(base.acquire_timeout),
            heartbeat: self.heartbeat.unwrap_or(base.heartbeat),
        }
    }

    /// The engine config; `sms_url` must already be resolved (see [`provider_urls`]).
    /// Its deadlines are the flags' over the defaults; the commands that read the
    /// config file put its sections under the flags ([`Self::deadlines`]).
    pub fn engine_config(&self, sms_url: &str, webhook_url: &str) -> EngineConfig {
        let mut cfg = EngineConfig::new(&self.db_url(), &self.queue_url(), sms_url, webhook_url);
        cfg.mode = self.mode;
        cfg.consumers = self.consumers.clone();
        cfg.namespace = self.namespace.clone();
        cfg.claim_lease = Duration::from_millis(self.claim_lease_ms);
        cfg.seen_set = self.seen_set_config();
        cfg.provider_concurrency = self.provider_concurrency.max(1);
        cfg.deadlines = self.deadlines(Deadlines::default());
        cfg.runner = RunnerSettings {
            visibility_timeout: Duration::from_millis(self.visibility_ms),
            max_deliveries: self.max_deliveries,
            lease_batch: self.lease_batch.max(1),
            batch_max_wait: self.batch_max_wait,
            pipeline: !self.no_pipeline,
            prefetch: self.prefetch,
            gather: self.gather,
            retry_delay: Duration::from_millis(self.retry_ms),
            max_retry_delay: Duration::from_millis(self.claim_lease_ms),
            ..RunnerSettings::default()
        };
        cfg
    }

    /// Provider URLs, starting an embedded sandbox when none is given. The handle
    /// must live as long as the engine uses it.
    pub async fn provider_urls(&self) -> Result<(String, String, Option<SandboxHandle>), CliError> {
        let (sms, handle) = match &self.sms_url {
            Some(u) => (u.clone(), None),
            None => {
                let h = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
                    .await
                    .map_err(|e| {
                        CliError::unavailable(format!("cannot start the embedded SMS sandbox: {e}"))
                    })?;
                tracing::info!(url = %h.url(), "embedded SMS/ERP sandbox started");
                (h.url(), Some(h))
            }
        };
        let webhook = self.webhook_url.clone().unwrap_or_else(|| sms.clone());
        Ok((sms, webhook, handle))
    }
}

/// A deadline flag: a duration of at least 100ms (the config's floor too: a deadline
/// of nothing would fail every call).
fn parse_deadline(text: &str) -> Result<Duration, String> {
    at_least(text, Duration::from_millis(100))
}

/// `--heartbeat`: at least 1s (AMQP counts it in whole seconds).
fn parse_heartbeat(text: &str) -> Result<Duration, String> {
    at_least(text, Duration::from_secs(1))
}

fn at_least(text: &str, least: Duration) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d < least {
        return Err(format!(
            "must be at least {}",
            humantime::format_duration(least)
        ));
    }
    Ok(d)
}

/// The deadlines of the config file (`--config FILE`, else the default path when it
/// exists; `[engine]` and `[queue]`), or the defaults without one. A config that
/// does not parse is bad usage: the engine must not run on deadlines the operator
/// did not write.
pub fn config_deadlines(path: Option<&std::path::Path>) -> Result<Deadlines, CliError> {
    Ok(idemwatch::config::Config::discover(path)
        .map_err(|e| CliError::usage(e.to_string()))?
        .map_or_else(Deadlines::default, |c| c.deadlines()))
}

/// `--durability`, for the commands that run consumers (`serve`, `consume`, `bench
/// engine`). Not on drills: they prove idempotency, which durability does not change.
#[derive(Debug, Clone, Args)]
pub struct DurabilityArg {
    /// How the business database commits. relaxed is opt-in, refused on MySQL/MariaDB,
    /// and shown in /metrics (idem_engine_info) and on the dashboard.
    #[arg(long, value_enum, default_value_t = Durability::Durable)]
    pub durability: Durability,
}

/// Open the engine `cfg` names: a durability its backend refuses is bad usage (exit
/// 2), any other failure an environment we could not reach (exit 3).
pub async fn open_engine(cfg: &EngineConfig) -> Result<Engine, CliError> {
    Engine::open(cfg).await.map_err(|e| match e {
        EngineError::Store(StoreError::DurabilityUnsupported(m)) => CliError::usage(m),
        other => CliError::unavailable(other),
    })
}

/// `--scrape-max-bytes`: one definition for every command that scrapes targets
/// (the dashboard, `snapshot`), so the flag, its parser and its floor cannot drift.
#[derive(Debug, Clone, Default, Args)]
pub struct ScrapeCapArgs {
    /// Largest scrape body ("16MiB", "64KiB" or bytes); overrides the config's
    /// scrape_max_bytes. A larger one fails with "response too large".
    #[arg(long, value_name = "SIZE", value_parser = parse_scrape_max_bytes)]
    pub scrape_max_bytes: Option<u64>,
}

impl ScrapeCapArgs {
    /// The flag over the config's value, when given.
    pub fn apply(&self, config: &mut idemwatch::config::Config) {
        if let Some(max) = self.scrape_max_bytes {
            config.scrape_max_bytes = max;
        }
    }
}

/// The config's own floor: a body cap below it could not hold one engine's page.
fn parse_scrape_max_bytes(raw: &str) -> Result<u64, String> {
    use idemwatch::config::{parse_byte_size, MIN_SCRAPE_BYTES};
    match parse_byte_size(raw)? {
        n if n < MIN_SCRAPE_BYTES => Err(format!("must be at least {MIN_SCRAPE_BYTES} bytes")),
        n => Ok(n),
    }
}

/// An http(s) URL (`--prometheus`); a bad one is shown redacted.
pub fn parse_http_url(raw: &str) -> Result<String, String> {
    match url::Url::parse(raw) {
        Ok(u) if u.scheme() == "http" || u.scheme() == "https" => Ok(raw.to_string()),
        _ => Err(format!(
            "{} is not an http(s) URL",
            idemwatch::redact::redact_url(raw)
        )),
    }
}

/// Print a value as one JSON document on stdout.
pub fn print_json<T: serde::Serialize>(value: &T) {
    match serde_json::to_string_pretty(value) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("error: cannot encode JSON: {e}"),
    }
}

/// Generated text (a completion script, a manual page) on stdout. A reader that
/// stopped early (`| head`) is no error.
pub fn write_stdout(what: &str, bytes: &[u8]) -> CliResult {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Ok(()) => Ok(EXIT_OK),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(EXIT_OK),
        Err(e) => Err(CliError::unavailable(format!("cannot write {what}: {e}"))),
    }
}

#[cfg(test)]
mod scrape_cap_tests {
    use clap::Parser;

    use super::{Cli, Command};

    #[test]
    fn the_dashboard_and_snapshot_read_the_same_scrape_cap_flag() {
        let cli = Cli::try_parse_from(["idemwatch", "--scrape-max-bytes", "64KiB"]).unwrap();
        assert_eq!(cli.scrape_cap.scrape_max_bytes, Some(64 * 1024));
        assert!(cli.command.is_none(), "the dashboard");
        let cli =
            Cli::try_parse_from(["idemwatch", "snapshot", "--scrape-max-bytes", "5000"]).unwrap();
        let Some(Command::Snapshot(args)) = cli.command else {
            panic!("snapshot");
        };
        assert_eq!(args.scrape_cap.scrape_max_bytes, Some(5000));
        for bad in ["100", "16XB", ""] {
            let err = Cli::try_parse_from(["idemwatch", "--scrape-max-bytes", bad]).unwrap_err();
            assert!(err.to_string().contains("scrape-max-bytes"), "{bad}: {err}");
        }
        let mut config = idemwatch::config::Config::default();
        let default = config.scrape_max_bytes;
        super::ScrapeCapArgs::default().apply(&mut config);
        assert_eq!(
            config.scrape_max_bytes, default,
            "no flag, the config's value"
        );
    }
}

#[cfg(test)]
mod runtime_tests {
    use super::runtime_threads;

    #[test]
    fn runtime_threads_default_to_the_cores_but_one_and_never_zero() {
        assert_eq!(runtime_threads(Some(3)), 3);
        assert_eq!(runtime_threads(Some(0)), 1);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(runtime_threads(None), cores.saturating_sub(1).max(1));
    }
}

#[cfg(test)]
mod env_tests {
    use clap::CommandFactory;

    use super::Cli;

    /// `--help` prints `[env: NAME=VALUE]` for an env-backed flag unless told not
    /// to: a database URL in the environment would show its password.
    #[test]
    fn no_help_shows_an_environment_value() {
        fn walk(cmd: &clap::Command, path: &str, checked: &mut usize) {
            for arg in cmd.get_arguments() {
                if arg.get_env().is_some() {
                    *checked += 1;
                    assert!(
                        arg.is_hide_env_values_set(),
                        "{path} --{}: env value shown in --help",
                        arg.get_id()
                    );
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), checked);
            }
        }
        let mut checked = 0;
        walk(&Cli::command(), "idemwatch", &mut checked);
        assert!(checked > 0, "no env-backed argument found");
    }
}
