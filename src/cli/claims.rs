//! `idemwatch claims list|resolve` (docs/CONTRACT.md §8): the side-effect claims, and an
//! operator's decision on one left in doubt when only the provider's own records can
//! say whether it went out (the sweeper, `engine::sweeper`, re-drives the rest).

use std::time::Duration;

use chrono::Utc;
use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;

use super::{print_json, CliError, CliResult, EXIT_OK};
use idemwatch::engine::default_db_url;
use idemwatch::engine::envelope::MessageKey;
use idemwatch::engine::store::repair::{ClaimFilter, MAX_LISTED};
use idemwatch::engine::store::{self, Claim, ClaimState};

#[derive(Debug, Args)]
pub struct ClaimsArgs {
    #[command(subcommand)]
    pub action: ClaimsAction,
    /// Database URL (default: SQLite in the data dir).
    #[arg(long, env = idemwatch::engine::ENV_DB, hide_env_values = true, global = true)]
    pub db: Option<String>,
    /// Machine-readable output.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ClaimsAction {
    /// Open claims (or every claim with --all), oldest first; those past the lease
    /// are in doubt.
    List(ListArgs),
    /// Finish an open claim as the provider's records say: sent or failed.
    Resolve(ResolveArgs),
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only this consumer's claims.
    #[arg(long)]
    pub consumer: Option<String>,
    /// Every claim, not only the open ones.
    #[arg(long)]
    pub all: bool,
    /// At most this many.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub limit: i64,
    /// The consumers' claim lease: an open claim older than this is in doubt.
    #[arg(long, value_parser = humantime::parse_duration, default_value = super::shown(idemwatch::engine::consumers::DEFAULT_CLAIM_LEASE), value_name = "DURATION")]
    pub claim_lease: Duration,
}

/// What the provider's records say happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Resolution {
    Sent,
    Failed,
}

#[derive(Debug, Args)]
pub struct ResolveArgs {
    #[arg(long)]
    pub consumer: String,
    /// The message key (`device:seq:event_type`).
    #[arg(long)]
    pub key: String,
    #[arg(long = "as", value_enum)]
    pub resolution: Resolution,
    /// Why (kept in the claim's detail beside "resolved by an operator").
    #[arg(long, value_name = "TEXT")]
    pub note: Option<String>,
}

/// One claim as `list --json` prints it.
#[derive(Serialize)]
struct ListedClaim<'a> {
    #[serde(flatten)]
    claim: &'a Claim,
    in_doubt: bool,
}

pub async fn run(args: ClaimsArgs) -> CliResult {
    let url = args.db.clone().unwrap_or_else(default_db_url);
    match args.action {
        ClaimsAction::List(a) => list(&url, a, args.json).await,
        ClaimsAction::Resolve(a) => resolve(&url, a, args.json).await,
    }
}

async fn list(url: &str, args: ListArgs, json: bool) -> CliResult {
    if args.limit <= 0 || args.limit > MAX_LISTED {
        return Err(CliError::usage(format!(
            "--limit must be between 1 and {MAX_LISTED}"
        )));
    }
    let store = store::open(url).await.map_err(CliError::unavailable)?;
    let filter = ClaimFilter {
        consumer: args.consumer.clone(),
        state: (!args.all).then_some(ClaimState::Claimed),
        limit: args.limit,
    };
    let claims = store
        .list_claims(&filter)
        .await
        .map_err(CliError::unavailable)?;
    let lease = chrono::Duration::from_std(args.claim_lease).unwrap_or(chrono::Duration::MAX);
    let now = Utc::now();
    let rows: Vec<ListedClaim> = claims
        .iter()
        .map(|claim| ListedClaim {
            claim,
            in_doubt: claim.state == ClaimState::Claimed
                && now.signed_duration_since(claim.claimed_at) >= lease,
        })
        .collect();
    if json {
        print_json(&serde_json::json!({
            "count": rows.len(),
            "in_doubt": rows.iter().filter(|r| r.in_doubt).count(),
            "claims": rows,
        }));
        return Ok(EXIT_OK);
    }
    if rows.is_empty() {
        println!("no {}claims", if args.all { "" } else { "open " });
        return Ok(EXIT_OK);
    }
    println!(
        "{:<14}  {:<36}  {:<8}  {:<20}  {:>8}  provider key / detail",
        "consumer", "key", "state", "claimed", "attempts"
    );
    for r in &rows {
        let c = r.claim;
        println!(
            "{:<14}  {:<36}  {:<8}  {:<20}  {:>8}  {}{}",
            c.consumer,
            c.message_key,
            if r.in_doubt {
                "IN DOUBT"
            } else {
                c.state.as_str()
            },
            idemwatch::clock::date_time(c.claimed_at),
            c.attempts,
            c.provider_key,
            c.detail
                .as_deref()
                .map(|d| format!(" / {d}"))
                .unwrap_or_default()
        );
    }
    Ok(EXIT_OK)
}

async fn resolve(url: &str, args: ResolveArgs, json: bool) -> CliResult {
    let store = store::open(url).await.map_err(CliError::unavailable)?;
    let state = match args.resolution {
        Resolution::Sent => ClaimState::Sent,
        Resolution::Failed => ClaimState::Failed,
    };
    let detail = format!(
        "resolved by an operator as {}{}",
        state.as_str(),
        args.note
            .as_deref()
            .map(|n| format!(": {n}"))
            .unwrap_or_default()
    );
    let resolved = store
        .resolve_claim(&args.consumer, &args.key, state, &detail)
        .await
        .map_err(CliError::unavailable)?;
    if !resolved {
        let now = store
            .claim(&args.consumer, &MessageKey::from_stored(args.key.clone()))
            .await
            .map_err(CliError::unavailable)?;
        return Err(CliError::usage(match now {
            Some(c) => format!(
                "the claim of {} for {} is already {}: only an open claim can be resolved",
                args.consumer,
                args.key,
                c.state.as_str()
            ),
            None => format!("no claim of {} for {}", args.consumer, args.key),
        }));
    }
    if json {
        print_json(&serde_json::json!({
            "consumer": args.consumer,
            "key": args.key,
            "state": state.as_str(),
            "detail": detail,
        }));
    } else {
        println!("{} {}: {detail}", args.consumer, args.key);
    }
    Ok(EXIT_OK)
}
