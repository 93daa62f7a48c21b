//! `idemwatch report --from T --to T --out FILE`: the post-mortem export of a past
//! window, headless. The database gives what it keeps (markers, dead letters by
//! reason, claims in doubt, drill verdicts); the duplicate rate over a past window
//! needs the history of a Prometheus server (the database keeps no duplicates), and
//! the report says so when there is none. The dashboard's `e` exports the window on
//! screen from the session's own scrapes.

use std::path::PathBuf;

use chrono::{DateTime, Utc};
use clap::Args;

use super::{CliError, CliResult, EXIT_OK};
use idemwatch::config::{Config, DatabaseConfig, PrometheusServer};
use idemwatch::engine::default_db_url;
use idemwatch::monitor::history::{HistoryState, HistoryStatus};
use idemwatch::monitor::{HistoryWindow, Monitor};
use idemwatch::report::{Format, Report};

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Start of the window: RFC 3339 (`2026-11-30T04:00:00Z`), `now`, or a duration
    /// before now (`30m`, `2h`).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub from: DateTime<Utc>,
    /// End of the window (same forms as --from).
    #[arg(long, value_name = "TIME", value_parser = parse_time, default_value = "now")]
    pub to: DateTime<Utc>,
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
    /// Where to write it (replaced if it exists).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Database URL; overrides the config's (default: the engine's SQLite file).
    #[arg(long, env = idemwatch::engine::ENV_DB, hide_env_values = true)]
    pub db: Option<String>,
    /// A Prometheus server (base URL) whose history gives the window's rates;
    /// overrides `[prometheus] url`.
    #[arg(long, value_name = "URL", env = "IDEMWATCH_PROMETHEUS", hide_env_values = true, value_parser = super::parse_http_url)]
    pub prometheus: Option<String>,
}

/// RFC 3339, `now`, or a duration before now.
pub fn parse_time(raw: &str) -> Result<DateTime<Utc>, String> {
    if raw == "now" {
        return Ok(Utc::now());
    }
    if let Ok(t) = DateTime::parse_from_rfc3339(raw) {
        return Ok(t.with_timezone(&Utc));
    }
    humantime::parse_duration(raw.trim_start_matches('-'))
        .map_err(|_| format!("{raw:?} is neither RFC 3339, `now` nor a duration like 30m"))
        .and_then(|d| {
            chrono::Duration::from_std(d)
                .ok()
                .and_then(|d| Utc::now().checked_sub_signed(d))
                .ok_or_else(|| format!("{raw:?} reaches back before any representable time"))
        })
}

pub async fn run(args: ReportArgs, config_path: Option<PathBuf>) -> CliResult {
    if args.from >= args.to {
        return Err(CliError::usage("--from must be before --to"));
    }
    let mut config = Config::discover(config_path.as_deref())
        .map_err(|e| CliError::usage(e.to_string()))?
        .unwrap_or_default();
    match (args.db, &mut config.database) {
        (Some(url), Some(db)) => db.url = url,
        (Some(url), None) => config.database = Some(DatabaseConfig::with_url(&url)),
        (None, None) => config.database = Some(DatabaseConfig::with_url(&default_db_url())),
        (None, Some(_)) => {}
    }
    if let Some(url) = args.prometheus {
        config.prometheus = Some(PrometheusServer { url });
    }
    // The window's data comes from the database and the Prometheus history: no
    // scrape of the live targets (their names still name the history's series).
    let targets = std::mem::take(&mut config.targets);
    let mut monitor = Monitor::new(&config).map_err(|e| CliError::usage(e.to_string()))?;
    monitor.set_history_targets(targets);
    monitor.set_history_window(HistoryWindow::Between(args.from, args.to));
    monitor.settle_history().await;
    let snapshot = monitor.poll().await;
    let source = if snapshot.history.is_some() {
        "prometheus"
    } else {
        "database"
    };
    let mut report = Report::for_window(&snapshot, args.from, args.to, source);
    let (alerts, notes) = monitor.past_alerts(&snapshot, args.from, args.to).await;
    report.set_past_alerts(alerts, &snapshot);
    report.notes.extend(notes);
    match (&config.prometheus, &snapshot.history_source) {
        (None, _) => report.notes.push("no Prometheus configured ([prometheus] url or --prometheus): the database keeps no duplicates, so the chart shows the markers only".into()),
        (Some(_), Some(HistoryStatus { url, state: HistoryState::Down { error } })) => report
            .notes
            .push(format!("the history of {url} could not be read ({error}): the chart shows the markers only")),
        (Some(_), _) => {}
    }
    report
        .write(args.format, &args.out)
        .map_err(|e| CliError::unavailable(format!("cannot write {}: {e}", args.out.display())))?;
    eprintln!(
        "report of {} – {} written to {}",
        args.from,
        args.to,
        args.out.display()
    );
    Ok(EXIT_OK)
}
