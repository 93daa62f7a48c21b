//! `idemwatch snapshot`: one poll of every source, headless, for scripts and alerts.
//!
//! Rates need two counter readings, so it scrapes twice `--spacing` apart (1 s by
//! default) and prints the second poll. A source that is down is reported, not an
//! error: the exit code is 0 whenever the snapshot could be taken.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{print_json, CliError, CliResult, EXIT_OK};
use idemwatch::config::{Config, DatabaseConfig, PrometheusServer, ScrapeTarget};
use idemwatch::monitor::db::{CountMethod, SourceStatus};
use idemwatch::monitor::{self, Snapshot};

#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// Database URL; overrides the config's (default: the engine's SQLite file).
    #[arg(long, env = idemwatch::engine::ENV_DB, hide_env_values = true)]
    pub db: Option<String>,
    /// A /metrics endpoint as NAME=URL (repeatable); replaces the config's targets
    /// (default: local=http://127.0.0.1:9464/metrics).
    #[arg(long = "target", value_name = "NAME=URL", value_parser = parse_target)]
    pub targets: Vec<ScrapeTarget>,
    /// Time between the two scrapes that give rates.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    pub spacing: Duration,
    #[command(flatten)]
    pub scrape_cap: super::ScrapeCapArgs,
    /// Machine-readable snapshot (only JSON on stdout).
    #[arg(long)]
    pub json: bool,
    /// A Prometheus server (its base URL) whose history of the window before the
    /// snapshot goes into `history` and `markers`; overrides `[prometheus] url`.
    #[arg(long, value_name = "URL", env = "IDEMWATCH_PROMETHEUS", hide_env_values = true, value_parser = super::parse_http_url)]
    pub prometheus: Option<String>,
    /// How far back the history reaches (default: the config's chart window).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub history: Option<Duration>,
}

fn parse_target(raw: &str) -> Result<ScrapeTarget, String> {
    let (name, url) = raw
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=URL, got {raw:?}"))?;
    if name.trim().is_empty() {
        return Err("the target name is empty".into());
    }
    match url::Url::parse(url) {
        Ok(u) if u.scheme() == "http" || u.scheme() == "https" => Ok(ScrapeTarget {
            name: name.to_string(),
            url: url.to_string(),
        }),
        _ => Err(format!("{url:?} is not an http(s) URL")),
    }
}

pub async fn run(args: SnapshotArgs, config_path: Option<PathBuf>) -> CliResult {
    let mut config = Config::discover(config_path.as_deref())
        .map_err(|e| CliError::usage(e.to_string()))?
        .unwrap_or_default();
    if !args.targets.is_empty() {
        config.targets = args.targets;
    }
    if let Some(url) = args.db {
        match &mut config.database {
            Some(db) => db.url = url,
            None => config.database = Some(DatabaseConfig::with_url(&url)),
        }
    }
    args.scrape_cap.apply(&mut config);
    if let Some(url) = args.prometheus {
        config.prometheus = Some(PrometheusServer { url });
    }
    let history = args.history.unwrap_or(config.chart_window);
    let mut config = config.with_local_defaults();
    // One look, seconds long: a target that does not answer it is down now (the
    // dashboard's grace period is for one missed scrape in a long session).
    config.alerts.target_down_after = Duration::ZERO;
    let snapshot = monitor::snapshot_once(&config, args.spacing, Some(history))
        .await
        .map_err(|e| CliError::usage(e.to_string()))?;
    if args.json {
        print_json(&snapshot);
    } else {
        print!("{}", render_text(&snapshot));
    }
    Ok(EXIT_OK)
}

fn per_s(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2}/s"))
}

fn percent(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{:.3}%", v * 100.0))
}

/// A value a remote peer or a stored row chose (label values, errors, marker
/// labels), as the terminal may show it: control characters (escape sequences)
/// removed.
fn p(text: &str) -> std::borrow::Cow<'_, str> {
    idemwatch::redact::printable(text)
}

/// The human summary: sources first (is anything down?), then alerts, then numbers.
pub fn render_text(s: &Snapshot) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "idemwatch snapshot at {}", s.taken_at.to_rfc3339());
    let _ = writeln!(out, "\nTargets");
    for t in &s.targets {
        let state = match &t.status {
            SourceStatus::Up => format!(
                "up ({} samples, {} ms)",
                t.samples,
                t.scrape_ms.unwrap_or(0)
            ),
            SourceStatus::Down { error } => format!("DOWN: {}", p(error)),
        };
        let _ = writeln!(out, "  {:<12} {:<40} {state}", p(&t.name), p(&t.url));
    }
    let _ = writeln!(out, "\nAlerts");
    if s.alerts.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for a in &s.alerts {
        let _ = writeln!(out, "  [{:?}] {}", a.severity, p(&a.message));
    }
    let _ = writeln!(out, "\nConsumers");
    let _ = writeln!(
        out,
        "  {:<24} {:>10} {:>10} {:>9} {:>12} {:>10} {:>8}",
        "target/consumer", "msgs", "dups", "dup %", "redelivered", "late", "dead"
    );
    for c in &s.consumers {
        let _ = writeln!(
            out,
            "  {:<24} {:>10} {:>10} {:>9} {:>12} {:>10} {:>8}",
            p(&format!("{}/{}", c.target, c.consumer)),
            per_s(c.processed.per_second),
            per_s(c.duplicate_dropped.per_second),
            percent(c.duplicate_ratio),
            per_s(c.redelivered.per_second),
            per_s(c.out_of_order.per_second),
            c.dead_lettered.total,
        );
    }
    if !s.windows.is_empty() {
        let _ = writeln!(out, "\nDedup windows: duplicate age (p50 / p99 / oldest)");
        let age = |v: Option<f64>| v.map_or_else(|| "-".into(), monitor::windows::short_duration);
        for w in &s.windows {
            let _ = writeln!(
                out,
                "  {:<24} p50 {} p99 {} · {}",
                p(&format!("{}/{}", w.target, w.consumer)),
                age(w.p50_seconds),
                age(w.p99_seconds),
                p(&w.summary)
            );
        }
    }
    if let Some(db) = &s.database {
        let _ = writeln!(out, "\nDatabase {}", p(&db.url));
        match &db.status {
            SourceStatus::Down { error } => {
                let _ = writeln!(out, "  DOWN: {}", p(error));
            }
            SourceStatus::Up => render_db(&mut out, db),
        }
    }
    if !s.deploys.is_empty() {
        let _ = writeln!(
            out,
            "\nDeploys (newest first): duplicates per window against the budget"
        );
        for d in s.deploys.iter().take(5) {
            let _ = writeln!(
                out,
                "  {} {:<8} {}  {} s ({})  {}",
                idemwatch::clock::date_time(d.at),
                d.kind,
                p(&d.label),
                d.window_seconds,
                d.ends.as_str(),
                d.verdict.as_str()
            );
            for c in &d.consumers {
                let _ = writeln!(
                    out,
                    "    {:<28} {:>6.0} dups of {:>8.0} {:>9} (budget {}) {}",
                    p(&format!("{}/{}", c.target, c.consumer)),
                    c.duplicates,
                    c.processed + c.duplicates,
                    percent(c.ratio),
                    percent(Some(c.budget)),
                    c.verdict.as_str()
                );
            }
        }
    }
    if !s.markers.is_empty() {
        let _ = writeln!(out, "\nMarkers (newest first)");
        for m in s.markers.iter().take(10) {
            let _ = writeln!(
                out,
                "  {} {:<8} {}",
                idemwatch::clock::date_time(m.at),
                m.kind,
                p(&m.label)
            );
        }
    }
    out
}

fn render_db(out: &mut String, db: &idemwatch::monitor::db::DbStats) {
    if let Some(d) = &db.dedup {
        let rows = d.total_rows.map_or_else(
            || "-".into(),
            |r| match r.method {
                CountMethod::Exact => r.rows.to_string(),
                CountMethod::Statistics => format!("~{} (statistics)", r.rows),
                CountMethod::AtLeast => format!(">= {}", r.rows),
            },
        );
        let _ = writeln!(out, "  dedup rows: {rows}");
        let oldest = d.oldest_age_seconds.map_or_else(
            || "-".into(),
            |a| {
                format!(
                    "{:.1} h (retention {} h)",
                    a as f64 / 3600.0,
                    d.retention_seconds / 3600
                )
            },
        );
        let _ = writeln!(out, "  oldest dedup row: {oldest}");
        for i in &d.inserts {
            let _ = writeln!(
                out,
                "  inserted last minute: {:<16} {}",
                p(&i.consumer),
                i.last_minute
            );
        }
    }
    let _ = writeln!(out, "  claims in doubt: {}", db.claims_in_doubt_total);
    for c in &db.claims_in_doubt {
        let _ = writeln!(
            out,
            "    {} {} age {} s, {} attempt(s)",
            p(&c.consumer),
            p(&c.message_key),
            c.age_seconds,
            c.attempts
        );
    }
    for g in &db.dead_letters {
        let _ = writeln!(
            out,
            "  dead letters {}/{}: {} ({} last hour)",
            p(&g.consumer),
            p(&g.reason),
            g.total,
            g.last_hour
        );
    }
    if let Some(v) = &db.vehicles {
        let _ = writeln!(
            out,
            "  vehicles: {} anomalies in {} recent history rows ({} late events)",
            v.anomalies.len(),
            v.rows_examined,
            v.late_events_in_window
        );
    }
    for r in db.drill_runs.iter().take(5) {
        let _ = writeln!(
            out,
            "  drill #{} {} ({}): {}",
            r.id,
            p(&r.scenario),
            p(&r.mode),
            p(r.verdict.as_deref().unwrap_or("running"))
        );
    }
    for f in &db.failures {
        let _ = writeln!(out, "  query {} failed: {}", f.query, p(&f.error));
    }
}
