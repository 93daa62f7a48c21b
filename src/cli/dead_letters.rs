//! `idemwatch dead-letters list|replay` (docs/CONTRACT.md §8): find dead letters and send them
//! back to their consumer's queue. The replay itself is `engine::replay`.

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use serde::Serialize;

use super::report::parse_time;
use super::{print_json, CliError, CliResult, EXIT_OK};
use idemwatch::engine::replay::{self, ReplayPlan, ReplayReport, ReplayStatus};
use idemwatch::engine::store::repair::MAX_LISTED;
use idemwatch::engine::store::{self, DeadLetter, DeadLetterFilter};
use idemwatch::engine::{default_db_url, default_queue_url, queue};
use idemwatch::monitor::bytes::escaped;

#[derive(Debug, Args)]
pub struct DeadLettersArgs {
    #[command(subcommand)]
    pub action: DeadLettersAction,
}

#[derive(Debug, Subcommand)]
pub enum DeadLettersAction {
    /// List dead letters, newest first.
    List(ListArgs),
    /// Re-publish dead letters' raw bytes to their consumer's queue.
    Replay(ReplayArgs),
}

/// The filters both actions share.
#[derive(Debug, Clone, Args)]
pub struct FilterArgs {
    /// Only this consumer's dead letters.
    #[arg(long)]
    pub consumer: Option<String>,
    /// Only this reason (max_deliveries, provider_rejected, key_conflict, …).
    #[arg(long)]
    pub reason: Option<String>,
    /// Received at or after: RFC 3339, `now`, or a duration before now (`2h`).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub since: Option<DateTime<Utc>>,
    /// At most this many (newest first).
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub limit: i64,
    /// Database URL (default: SQLite in the data dir).
    #[arg(long, env = idemwatch::engine::ENV_DB, hide_env_values = true)]
    pub db: Option<String>,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Leave out dead letters already replayed.
    #[arg(long)]
    pub not_replayed: bool,
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Only these dead letters (repeatable, or several after one --id); already
    /// replayed ones included.
    #[arg(long = "id", value_name = "N", num_args = 1..)]
    pub ids: Vec<i64>,
    /// Also replay dead letters replayed before (a replay that failed again is a new
    /// dead letter of its own, so by default only rows never replayed go).
    #[arg(long)]
    pub include_replayed: bool,
    /// Say what would be replayed; publish and record nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Queue URL (default: the embedded queue next to the database).
    #[arg(long, env = idemwatch::engine::ENV_QUEUE, hide_env_values = true)]
    pub queue: Option<String>,
}

impl FilterArgs {
    fn to_filter(&self) -> Result<DeadLetterFilter, CliError> {
        if self.limit <= 0 || self.limit > MAX_LISTED {
            return Err(CliError::usage(format!(
                "--limit must be between 1 and {MAX_LISTED}"
            )));
        }
        Ok(DeadLetterFilter {
            consumer: self.consumer.clone(),
            reason: self.reason.clone(),
            since: self.since,
            limit: self.limit,
            ..DeadLetterFilter::default()
        })
    }

    fn db_url(&self) -> String {
        self.db.clone().unwrap_or_else(default_db_url)
    }
}

pub async fn run(args: DeadLettersArgs) -> CliResult {
    match args.action {
        DeadLettersAction::List(a) => list(a).await,
        DeadLettersAction::Replay(a) => replay_cmd(a).await,
    }
}

/// One dead letter as `list --json` prints it: the raw bytes as text (lossy) and
/// as hex, so a script gets them exactly.
#[derive(Serialize)]
struct ListedLetter<'a> {
    #[serde(flatten)]
    letter: &'a DeadLetter,
    raw_hex: String,
}

async fn list(args: ListArgs) -> CliResult {
    let mut filter = args.filter.to_filter()?;
    filter.include_replayed = !args.not_replayed;
    let store = store::open(&args.filter.db_url())
        .await
        .map_err(CliError::unavailable)?;
    let letters = store
        .find_dead_letters(&filter)
        .await
        .map_err(CliError::unavailable)?;
    if args.filter.json {
        let rows: Vec<ListedLetter> = letters
            .iter()
            .map(|letter| ListedLetter {
                letter,
                raw_hex: hex::encode(&letter.raw),
            })
            .collect();
        print_json(&serde_json::json!({ "count": rows.len(), "dead_letters": rows }));
        return Ok(EXIT_OK);
    }
    if letters.is_empty() {
        println!("no dead letters match");
        return Ok(EXIT_OK);
    }
    println!(
        "{:>8}  {:<20}  {:<14}  {:<18}  {:>8}  detail / raw",
        "id", "received", "consumer", "reason", "replayed"
    );
    for d in &letters {
        println!(
            "{:>8}  {:<20}  {:<14}  {:<18}  {:>8}  {}",
            d.id,
            idemwatch::clock::date_time(d.received_at),
            d.consumer,
            d.reason,
            d.replay_count,
            d.detail
                .as_deref()
                .map_or_else(|| "-".to_string(), |t| clipped(t.as_bytes()))
        );
        println!("{:>8}  {}", "", clipped(&d.raw));
    }
    Ok(EXIT_OK)
}

async fn replay_cmd(args: ReplayArgs) -> CliResult {
    let mut filter = args.filter.to_filter()?;
    filter.ids = args.ids.clone();
    filter.include_replayed = args.include_replayed;
    let db = args.filter.db_url();
    let store = store::open(&db).await.map_err(CliError::unavailable)?;
    let queue_url = args.queue.clone().unwrap_or_else(|| default_queue_url(&db));
    let queue = queue::open(&queue_url)
        .await
        .map_err(CliError::unavailable)?;
    let plan = ReplayPlan {
        filter,
        dry_run: args.dry_run,
        namespace: None,
    };
    let result = replay::replay(store.as_ref(), queue.as_ref(), &plan).await;
    queue.close().await;
    let report = result.map_err(CliError::unavailable)?;
    if args.filter.json {
        print_json(&report);
    } else {
        print_report(&report, &queue.redacted_url());
    }
    Ok(EXIT_OK)
}

/// Escaped (never a control sequence on the terminal) and cut to one line's worth.
fn clipped(raw: &[u8]) -> String {
    const WIDTH: usize = 120;
    let text = escaped(raw);
    match text.char_indices().nth(WIDTH) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

fn print_report(report: &ReplayReport, queue: &str) {
    for l in &report.letters {
        let what = match (l.status, l.status.skipped_because()) {
            (ReplayStatus::WouldReplay, _) => "would replay to".to_string(),
            (_, Some(why)) => format!("skipped ({why})"),
            (_, None) => "replayed to".to_string(),
        };
        println!(
            "{:>8}  {:<14}  {:<18}  {what} {}{}",
            l.id,
            l.consumer,
            l.reason,
            l.queue.as_deref().unwrap_or(""),
            if l.rearmed_claim {
                " (its failed claim re-armed: sends once)"
            } else {
                ""
            }
        );
    }
    println!(
        "{} {} of {} dead letters on {queue}{}",
        if report.dry_run {
            "would replay"
        } else {
            "replayed"
        },
        report.replayed,
        report.matched,
        if report.skipped > 0 {
            format!(", {} skipped", report.skipped)
        } else {
            String::new()
        }
    );
}
