//! `idemwatch chaos`: several `serve` processes on one queue and one database, killed
//! at random while a fleet publishes duplicates and late events; then the end state
//! is checked against what was published.

use std::time::Duration;

use clap::Args;

use super::{print_json, CliError, CliResult};
use idemwatch::drills::chaos::{self, ChaosOptions, KillSchedule};
use idemwatch::drills::DrillError;
use idemwatch::engine::{default_db_url, default_queue_url};

#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// `idemwatch serve` processes competing on the queues.
    #[arg(long, default_value_t = 4)]
    pub instances: usize,
    /// Messages to publish (duplicates included).
    #[arg(long, default_value_t = 20_000)]
    pub events: usize,
    /// Share of messages that are copies of earlier ones.
    #[arg(long, default_value_t = 0.1)]
    pub dup_rate: f64,
    /// Share of events held back to arrive after newer ones.
    #[arg(long, default_value_t = 0.01)]
    pub late_rate: f64,
    /// SIGKILL one random instance this often (and restart it).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub kill_every: Duration,
    /// Instead of --kill-every: SIGKILL one random instance each time N more
    /// deliveries were taken off the queues, so that a fast machine gets as many kills
    /// as a slow one.
    #[arg(long, value_name = "N", conflicts_with = "kill_every")]
    pub kill_every_messages: Option<u64>,
    /// Seed of the fleet and of the victim choice (default: random).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Give up waiting for the queues to drain after this long.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Database URL (default: SQLite in the data dir).
    #[arg(long, env = idemwatch::engine::ENV_DB, hide_env_values = true)]
    pub db: Option<String>,
    /// Queue URL, e.g. amqp://guest:guest@127.0.0.1:5672/%2f (default: the embedded queue).
    #[arg(long, env = idemwatch::engine::ENV_QUEUE, hide_env_values = true)]
    pub queue: Option<String>,
    /// Machine-readable report.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: ChaosArgs) -> CliResult {
    let db = args.db.clone().unwrap_or_else(default_db_url);
    let queue = args.queue.clone().unwrap_or_else(|| default_queue_url(&db));
    let exe = std::env::current_exe()
        .map_err(|e| CliError::unavailable(format!("cannot find the idemwatch executable: {e}")))?;
    let mut opts = ChaosOptions::new(&db, &queue, exe);
    opts.instances = args.instances;
    opts.events = args.events;
    opts.dup_rate = args.dup_rate;
    opts.late_rate = args.late_rate;
    opts.kill_every = match args.kill_every_messages {
        Some(n) => KillSchedule::EveryMessages(n),
        None => KillSchedule::Every(args.kill_every),
    };
    opts.drain_timeout = args.timeout;
    if let Some(seed) = args.seed {
        opts.seed = seed;
    }
    if !args.json {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        opts.progress = Some(tx);
        tokio::spawn(async move {
            while let Some(line) = rx.recv().await {
                eprintln!("{line}");
            }
        });
    }
    let report = chaos::run(opts).await.map_err(|e| match e {
        DrillError::Usage(m) => CliError::usage(m),
        other => CliError::unavailable(other),
    })?;
    if args.json {
        print_json(&report);
    } else {
        print!("{}", report.render_text());
    }
    Ok(report.exit_code())
}
