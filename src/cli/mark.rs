//! `idemwatch mark deploy|incident|note --label TEXT`: a CD pipeline's line on every
//! dashboard's chart. One INSERT into `markers` (see `monitor::db::mark` for the
//! grant it needs); exit 2 on a bad time or label, 3 when the database cannot be
//! reached or refuses the row.

use std::path::PathBuf;

use chrono::{DateTime, Utc};
use clap::Args;
use serde::Serialize;

use super::report::parse_time;
use super::{print_json, CliError, CliResult, EXIT_OK};
use idemwatch::config::{Config, DatabaseConfig};
use idemwatch::engine::default_db_url;
use idemwatch::monitor::db::mark::{check_label, insert_marker, MarkError, MarkKind, NewMarker};
use idemwatch::redact::redact_url;

#[derive(Debug, Args)]
pub struct MarkArgs {
    /// What happened.
    #[arg(value_enum)]
    pub kind: MarkKind,
    /// The text on the chart, e.g. the version and who deployed it.
    #[arg(long, value_parser = check_label)]
    pub label: String,
    /// When it happened: RFC 3339, `now`, or a duration before now (`10m`).
    #[arg(long, value_name = "TIME", value_parser = parse_time, default_value = "now")]
    pub at: DateTime<Utc>,
    /// Database URL; overrides the config's (default: the engine's SQLite file).
    #[arg(long, env = idemwatch::engine::ENV_DB, hide_env_values = true)]
    pub db: Option<String>,
    /// Print the written marker as JSON (only JSON on stdout).
    #[arg(long)]
    pub json: bool,
}

/// What `--json` prints.
#[derive(Debug, Serialize)]
struct Marked<'a> {
    /// The row's id where the backend hands it over without a read (not on
    /// PostgreSQL, where reading it back would need a SELECT grant).
    id: Option<i64>,
    kind: &'static str,
    at: DateTime<Utc>,
    label: &'a str,
    database: String,
}

pub async fn run(args: MarkArgs, config_path: Option<PathBuf>) -> CliResult {
    let config = Config::discover(config_path.as_deref())
        .map_err(|e| CliError::usage(e.to_string()))?
        .unwrap_or_default();
    let database = match (args.db, config.database) {
        (Some(url), Some(mut db)) => {
            db.url = url;
            db
        }
        (Some(url), None) => DatabaseConfig::with_url(&url),
        (None, Some(db)) => db,
        (None, None) => DatabaseConfig::with_url(&default_db_url()),
    };
    let marker = NewMarker {
        kind: args.kind,
        at: args.at,
        label: args.label,
        detail: Some("idemwatch mark".into()),
    };
    let id = insert_marker(&database, &marker)
        .await
        .map_err(|e| match e {
            MarkError::Unsupported(_) => CliError::usage(e.to_string()),
            MarkError::Unreachable { .. } | MarkError::Refused { .. } => CliError::unavailable(e),
        })?;
    let database = redact_url(&database.url);
    if args.json {
        print_json(&Marked {
            id,
            kind: marker.kind.as_str(),
            at: marker.at,
            label: &marker.label,
            database,
        });
    } else {
        println!(
            "{} marker {:?} at {} written to {database}",
            marker.kind.as_str(),
            marker.label,
            marker.at.to_rfc3339()
        );
    }
    Ok(EXIT_OK)
}
