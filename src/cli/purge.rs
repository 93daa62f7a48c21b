//! `idemwatch purge --older-than 7d`: retention of the dedup table in bounded
//! batches. Each batch is its own short transaction: interrupt it and rerun it at will.

use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;

use super::{print_json, CliError, CliResult, EXIT_OK};
use idemwatch::engine::default_db_url;
use idemwatch::engine::store;

#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Delete dedup rows processed longer ago than this (e.g. 7d, 36h).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "7d")]
    pub older_than: Duration,
    /// Rows per batch (per transaction).
    #[arg(long, default_value_t = 5_000)]
    pub batch: i64,
    /// Database URL (default: SQLite in the data dir).
    #[arg(long, env = "IDEMWATCH_DB")]
    pub db: Option<String>,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: PurgeArgs) -> CliResult {
    if args.batch <= 0 {
        return Err(CliError::usage("--batch must be positive"));
    }
    let url = args.db.clone().unwrap_or_else(default_db_url);
    let stores = store::open_with_edge(&url)
        .await
        .map_err(CliError::unavailable)?;
    let store = stores.store;
    let age = chrono::Duration::from_std(args.older_than)
        .map_err(|_| CliError::usage("--older-than is too large"))?;
    let cutoff = chrono::Utc::now() - age;
    let started = Instant::now();
    let (mut total, mut batches) = (0u64, 0u64);
    loop {
        let n = store
            .purge_processed_batch(cutoff, args.batch)
            .await
            .map_err(CliError::unavailable)?;
        if n == 0 {
            break;
        }
        total += n;
        batches += 1;
        if !args.json {
            eprintln!("purged {total} rows in {batches} batches…");
        }
    }
    // Expired Idempotency-Keys of the write API go the same way, in the same batches.
    let mut keys = 0u64;
    loop {
        let n = stores
            .edge
            .purge_idempotency_batch(chrono::Utc::now(), args.batch)
            .await
            .map_err(CliError::unavailable)?;
        if n == 0 {
            break;
        }
        keys += n;
    }
    let elapsed = started.elapsed().as_secs_f64();
    if args.json {
        print_json(&json!({
            "deleted": total, "batches": batches, "idempotency_keys_deleted": keys, "cutoff": cutoff.to_rfc3339(),
            "seconds": elapsed, "db": store.redacted_url(),
        }));
    } else {
        println!(
            "purged {total} dedup rows older than {cutoff} in {batches} batches ({elapsed:.2}s)"
        );
    }
    Ok(EXIT_OK)
}
