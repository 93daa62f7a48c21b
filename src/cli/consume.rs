//! `idemwatch consume --until-idle`: run the consumers until their queues are empty,
//! then print the counts (summed, and per consumer under "consumers").

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use super::{open_engine, print_json, CliError, CliResult, DurabilityArg, EngineArgs, EXIT_OK};
use idemwatch::engine::crash::{CrashPlan, CrashStyle};
use idemwatch::engine::runner::EventSink;

#[derive(Debug, Args)]
pub struct ConsumeArgs {
    /// Stop once every consumer's queue is empty (nothing ready, nothing in flight).
    #[arg(long, required = true)]
    pub until_idle: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub durability: DurabilityArg,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// Stream one JSON line per delivery outcome on stdout (drill supervisors read it).
    #[arg(long, hide = true)]
    pub events: bool,
}

/// `config_path`: `--config`, whose `[engine]` and `[queue]` deadlines apply under
/// the command line's.
pub async fn run(args: ConsumeArgs, config_path: Option<PathBuf>) -> CliResult {
    let (sms, webhook, _sandbox) = args.engine.provider_urls().await?;
    let mut cfg = args.engine.engine_config(&sms, &webhook);
    cfg.deadlines = args
        .engine
        .deadlines(super::config_deadlines(config_path.as_deref())?);
    cfg.durability = args.durability.durability;
    let engine = open_engine(&cfg).await?;
    let crash = Arc::new(match args.engine.crash_at {
        Some(point) => CrashPlan::at(
            point,
            1,
            if args.engine.crash_abort {
                CrashStyle::Abort
            } else {
                CrashStyle::Unwind
            },
        ),
        None => CrashPlan::none(),
    });
    // Written and flushed synchronously: an aborting process must not lose what it did.
    let sink: EventSink = Arc::new(|event| {
        if let Ok(line) = serde_json::to_string(&event) {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }
    });
    let result = engine
        .run_until_idle(crash, args.events.then_some(sink))
        .await;
    engine.queue.close().await;
    let summary = match result {
        Ok(s) => s,
        Err(crashed) => {
            return Err(CliError::unavailable(format!(
                "consumer stopped: {crashed}"
            )));
        }
    };
    if args.json {
        print_json(&summary);
    } else if !args.events {
        println!(
            "consumer          processed  duplicates  out_of_order  dead_lettered  redelivered"
        );
        for (name, c) in &summary.consumers {
            println!(
                "{name:<16} {:>10} {:>11} {:>13} {:>14} {:>12}",
                c.processed, c.duplicate_dropped, c.out_of_order, c.dead_lettered, c.redelivered
            );
        }
        let t = &summary.total;
        println!(
            "{:<16} {:>10} {:>11} {:>13} {:>14} {:>12}",
            "total",
            t.processed,
            t.duplicate_dropped,
            t.out_of_order,
            t.dead_lettered,
            t.redelivered
        );
    }
    Ok(EXIT_OK)
}
