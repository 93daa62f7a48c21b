//! `idemwatch` without a subcommand: the dashboard. With a config it watches what
//! the config names; without one it opens on the live demo.

use std::io::IsTerminal;
use std::path::PathBuf;

use super::{CliError, CliResult, ScrapeCapArgs, EXIT_OK};
use idemwatch::config::{Config, PrometheusServer};
use idemwatch::demo::{Demo, DemoSettings};
use idemwatch::drills::DrillTarget;
use idemwatch::engine::{default_data_dir, default_queue_url};
use idemwatch::tui::theme::Theme;
use idemwatch::tui::{self, TuiError, TuiOptions};

pub async fn run(
    config_path: Option<PathBuf>,
    prometheus: Option<String>,
    scrape_cap: ScrapeCapArgs,
) -> CliResult {
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        return Err(CliError::usage(
            "stdout is not a terminal: the dashboard needs one. For scripts and alerts use `idemwatch snapshot --json`.",
        ));
    }
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let mut config =
        Config::discover(config_path.as_deref()).map_err(|e| CliError::usage(e.to_string()))?;
    if let (Some(url), Some(c)) = (&prometheus, &mut config) {
        c.prometheus = Some(PrometheusServer { url: url.clone() });
    }
    if let Some(c) = &mut config {
        scrape_cap.apply(c);
    }
    let opts = match config {
        Some(config) => TuiOptions {
            theme: Theme::pick(config.theme, no_color),
            drill_target: config.database.as_ref().map(|d| {
                DrillTarget::new(
                    &d.url,
                    &config
                        .drills
                        .queue
                        .clone()
                        .unwrap_or_else(|| default_queue_url(&d.url)),
                    None,
                    config
                        .drills
                        .metrics_url
                        .clone()
                        .or_else(|| config.targets.first().map(|t| t.url.clone())),
                    config.drills.mqtt_broker.clone(),
                )
            }),
            banner: None,
            demo: None,
            report_dir: default_data_dir().join("reports"),
            config,
        },
        None => {
            let settings = DemoSettings::in_dir(&default_data_dir().join("demo"));
            let demo = Demo::start(settings).await.map_err(CliError::unavailable)?;
            let e = &demo.endpoints;
            let banner = format!(
                " DEMO · embedded engine on SQLite in {} · metrics {} · SMS sandbox {} · D deploys now · --config FILE watches your own system ",
                e.dir.display(),
                e.metrics_url,
                e.sms_url
            );
            let mut config = e.monitor_config();
            if let Some(url) = prometheus {
                config.prometheus = Some(PrometheusServer { url });
            }
            scrape_cap.apply(&mut config);
            TuiOptions {
                config,
                theme: Theme::pick(Default::default(), no_color),
                drill_target: Some(DrillTarget::new(
                    &e.db_url,
                    &e.queue_url,
                    Some(e.drill_sms_url.clone()),
                    Some(e.metrics_url.clone()),
                    None,
                )),
                banner: Some(banner),
                report_dir: default_data_dir().join("reports"),
                demo: Some(std::sync::Arc::new(demo)),
            }
        }
    };
    match tui::run(opts).await {
        Ok(()) => Ok(EXIT_OK),
        Err(TuiError::NotATerminal) => Err(CliError::usage(TuiError::NotATerminal.to_string())),
        Err(e) => Err(CliError::unavailable(e)),
    }
}
