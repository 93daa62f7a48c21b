//! `idemwatch drill SCENARIO`: one redelivery drill, headless, with its verdict.

use clap::Args;

use super::{print_json, CliError, CliResult, EngineArgs};
use idemwatch::drills::{self, DrillError, DrillOptions, Scenario};

#[derive(Debug, Args)]
pub struct DrillArgs {
    /// Which failure to reproduce.
    #[arg(value_enum)]
    pub scenario: Scenario,
    /// Deliveries (crash-before-ack, default 7), publishes (double-publish, default 2),
    /// requests (client-retry, default 6) or copies of a device's publish
    /// (device-retransmit, default 3).
    #[arg(long)]
    pub times: Option<u32>,
    /// device-retransmit: the device broker the copies go through (default: none,
    /// straight into the queues).
    #[arg(
        long,
        value_name = "URL",
        env = "IDEMWATCH_MQTT_BROKER",
        hide_env_values = true
    )]
    pub broker: Option<String>,
    /// Run each consumer as a real child process that aborts at the crash point.
    #[arg(long)]
    pub kill_process: bool,
    /// live-redelivery: the watched system's metrics endpoint.
    #[arg(long, default_value = "http://127.0.0.1:9464/metrics")]
    pub metrics_url: String,
    /// live-redelivery: how many processed messages to re-publish.
    #[arg(long, default_value_t = 5)]
    pub k: u32,
    /// live-redelivery: how long to wait for the duplicates to be dropped.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout: std::time::Duration,
    /// live-redelivery: yes, re-publish into the running system (it is off otherwise).
    #[arg(long)]
    pub yes_live: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Machine-readable report.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: DrillArgs) -> CliResult {
    let mut opts = DrillOptions::new(
        args.scenario,
        &args.engine.db_url(),
        &args.engine.queue_url(),
    );
    opts.times = args.times;
    opts.mode = args.engine.mode;
    opts.kill_process = args.kill_process;
    opts.sms_url = args.engine.sms_url.clone();
    opts.webhook_url = args.engine.webhook_url.clone();
    opts.live.metrics_url = args.metrics_url.clone();
    opts.live.k = args.k;
    opts.live.timeout = args.timeout;
    opts.live.namespace = args.engine.namespace.clone();
    opts.live.confirmed = args.yes_live;
    opts.seen_set = args.engine.seen_set_config();
    opts.mqtt_broker = args.broker.clone();
    if args.kill_process {
        opts.child_exe = Some(std::env::current_exe().map_err(|e| {
            CliError::unavailable(format!("cannot find the idemwatch executable: {e}"))
        })?);
    }
    let report = drills::run(opts).await.map_err(|e| match e {
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
