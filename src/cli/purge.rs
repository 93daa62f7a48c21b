//! `idemwatch purge --older-than 7d`: retention of the dedup table in bounded
//! batches (see `engine::retention` for why batches). Progress goes to stderr about
//! once a second; Ctrl-C stops between two batches (exit 130) and a rerun continues.
//! A retention below the purge floor (`RedeliveryWindow::floor`) is refused with
//! exit 2 unless `--force`: those rows can still meet a redelivery. So is one below
//! the oldest duplicate a consumer has dropped (the store's `duplicate_ages`, read
//! before anything is deleted): copies have been seen arriving that late. "Older than"
//! counts back from the database's clock (ARCHITECTURE.md, "Clocks").

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;

use super::{print_json, CliError, CliResult, EXIT_OK};
use idemwatch::engine::consumers::DEFAULT_CLAIM_LEASE;
use idemwatch::engine::default_db_url;
use idemwatch::engine::retention::{
    self, PurgePlan, RedeliveryWindow, DEFAULT_PURGE_BATCH, DEFAULT_RETENTION,
};
use idemwatch::engine::runner::RunnerSettings;
use idemwatch::engine::store;

/// Exit code of a purge stopped by Ctrl-C (the shell's 128 + SIGINT).
pub const EXIT_INTERRUPTED: i32 = 130;

#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Delete dedup rows processed longer ago than this (e.g. 7d, 36h).
    #[arg(long, value_parser = humantime::parse_duration, default_value = super::shown(DEFAULT_RETENTION))]
    pub older_than: Duration,
    /// Rows per batch (per transaction).
    #[arg(long, default_value_t = DEFAULT_PURGE_BATCH)]
    pub batch: i64,
    /// Sleep between batches (e.g. 10ms) to leave I/O to the consumers.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
    pub pause: Duration,
    /// Stop after this many rows (the rest is left for the next run).
    #[arg(long)]
    pub max_rows: Option<u64>,
    /// Skip the VACUUM (ANALYZE) (PostgreSQL) / ANALYZE TABLE (MySQL) after the purge.
    #[arg(long)]
    pub no_vacuum: bool,
    /// Purge even below the floor (the largest of --claim-lease, --visibility-timeout
    /// x --max-deliveries, and 1h) or below the oldest duplicate a consumer has
    /// dropped, accepting that a redelivery of a purged message is applied again.
    #[arg(long)]
    pub force: bool,
    /// The consumers' claim lease (as `serve` runs them), for the floor.
    #[arg(long, value_parser = humantime::parse_duration, default_value = super::shown(DEFAULT_CLAIM_LEASE), value_name = "DURATION")]
    pub claim_lease: Duration,
    /// The queue's visibility timeout (as `serve` runs it), for the floor.
    #[arg(long, value_parser = humantime::parse_duration, default_value = super::shown(RunnerSettings::default().visibility_timeout), value_name = "DURATION")]
    pub visibility_timeout: Duration,
    /// Deliveries before a message is dead-lettered (as `serve` runs it), for the floor.
    #[arg(long, default_value_t = RunnerSettings::default().max_deliveries, value_name = "N")]
    pub max_deliveries: u32,
    /// Database URL (default: SQLite in the data dir).
    #[arg(long, env = idemwatch::engine::ENV_DB, hide_env_values = true)]
    pub db: Option<String>,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

impl PurgeArgs {
    fn window(&self) -> RedeliveryWindow {
        RedeliveryWindow {
            claim_lease: self.claim_lease,
            visibility_timeout: self.visibility_timeout,
            max_deliveries: self.max_deliveries,
        }
    }
}

pub async fn run(args: PurgeArgs) -> CliResult {
    if args.batch <= 0 {
        return Err(CliError::usage("--batch must be positive"));
    }
    // Refused before the database is even opened: nothing is touched.
    let cutoff = retention::cutoff_for(
        chrono::Utc::now(),
        args.older_than,
        args.window(),
        args.force,
    )
    .map_err(|e| CliError::usage(e.to_string()))?;
    let url = args.db.clone().unwrap_or_else(default_db_url);
    let stores = store::open_with_edge(&url)
        .await
        .map_err(CliError::unavailable)?;
    let store = stores.store;
    let ages = store
        .duplicate_ages()
        .await
        .map_err(CliError::unavailable)?;
    retention::check_duplicate_ages(args.older_than, &ages, args.force)
        .map_err(|e| CliError::usage(e.to_string()))?;
    // The cutoff counts back from the database's clock where it has one: a host
    // whose own clock runs ahead would purge rows still within the retention.
    let now = store.db_now().await.map_err(CliError::unavailable)?;
    let cutoff =
        retention::cutoff_for(now, args.older_than, args.window(), args.force).unwrap_or(cutoff);
    let plan = PurgePlan {
        cutoff,
        batch: args.batch,
        pause: args.pause,
        max_rows: args.max_rows,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let on_signal = stop.clone();
    let signal = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\ninterrupt: stopping after the current batch (rerun to continue)");
            on_signal.store(true, Ordering::SeqCst);
        }
    });
    eprintln!(
        "purging dedup rows processed before {} from {} in batches of {}",
        plan.cutoff.to_rfc3339(),
        store.redacted_url(),
        plan.batch
    );
    let mut last_print = Instant::now();
    let summary = retention::purge(store.as_ref(), plan, &stop, |p| {
        if last_print.elapsed() >= Duration::from_secs(1) {
            last_print = Instant::now();
            eprintln!(
                "  {} rows in {} batches, {:.0} rows/s, last batch {:.1} ms",
                p.deleted, p.batches, p.rows_per_second, p.last_batch_ms
            );
        }
    })
    .await
    .map_err(CliError::unavailable)?;
    signal.abort();
    // Vacuum only after a complete run: an interrupted one is rerun anyway.
    let mut vacuum_seconds = None;
    if !args.no_vacuum && !summary.interrupted && summary.deleted > 0 {
        eprintln!("vacuuming the purged tables (--no-vacuum skips this)");
        let t = Instant::now();
        match store.after_purge().await {
            Ok(()) => vacuum_seconds = Some(t.elapsed().as_secs_f64()),
            // Not fatal: the rows are gone; autovacuum will get there eventually.
            Err(e) => eprintln!("warning: vacuum after the purge failed: {e}"),
        }
    }
    // Expired Idempotency-Keys of the write API go the same way, in the same batches.
    let mut keys = 0u64;
    loop {
        let n = stores
            .edge
            .purge_idempotency_batch(now, args.batch)
            .await
            .map_err(CliError::unavailable)?;
        if n == 0 {
            break;
        }
        keys += n;
    }
    if args.json {
        let mut doc = serde_json::to_value(&summary).unwrap_or_default();
        doc["db"] = store.redacted_url().into();
        doc["vacuum_seconds"] = vacuum_seconds.into();
        doc["idempotency_keys_deleted"] = keys.into();
        print_json(&doc);
    } else {
        println!(
            "purged {} dedup rows older than {} in {} batches ({:.2}s, {:.0} rows/s, slowest batch {:.1} ms){}",
            summary.deleted,
            summary.cutoff.to_rfc3339(),
            summary.batches,
            summary.seconds,
            summary.rows_per_second,
            summary.slowest_batch_ms,
            if summary.interrupted { "; interrupted, rerun to continue" } else { "" }
        );
        if let Some(s) = vacuum_seconds {
            println!("vacuumed in {s:.1}s");
        }
        println!("purged {keys} expired idempotency keys");
    }
    Ok(if summary.interrupted {
        EXIT_INTERRUPTED
    } else {
        EXIT_OK
    })
}
