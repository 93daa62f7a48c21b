//! The README's pictures, from the real screens: starts the live demo (embedded
//! engine, simulator with its tunnel devices, a deploy 20 s in, the provider slow
//! 25 s in), polls it like the dashboard does, renders the Overview and the Tables
//! tab while claims are in doubt, and after the deploy every tab, a vehicle whose
//! tunnel flush arrived late, and the chart around the deploy, into SVG files under
//! `assets/screens/` (or the directory given).
//!
//! `cargo run --example readme_screens [-- DIR]` (about a minute and a half). The
//! pictures show a live run: the anomalies and counts differ from run to run.

use std::sync::Arc;
use std::time::Duration;

use idemwatch::demo::{Demo, DemoSettings};
use idemwatch::monitor::vehicles::VehicleAnomaly;
use idemwatch::monitor::Monitor;
use idemwatch::tui::action::{Action, PromptKind};
use idemwatch::tui::app::App;
use idemwatch::tui::render::render;
use idemwatch::tui::svg::buffer_to_svg;
use idemwatch::tui::tab::Tab;
use idemwatch::tui::theme::Theme;
use ratatui::backend::TestBackend;
use ratatui::Terminal;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "assets/screens".into()),
    );
    std::fs::create_dir_all(&out)?;
    let work = tempfile::tempdir()?;
    let mut settings = DemoSettings::in_dir(work.path());
    settings.first_deploy_after = Duration::from_secs(20);
    settings.slow_first_after = Duration::from_secs(25);
    let demo = Demo::start(settings).await?;
    // The chart fits the data (no zoom): the deploy 20 s in and what follows fill it.
    let mut monitor = Monitor::new(&demo.endpoints.monitor_config())?;
    let banner = " DEMO · embedded engine on SQLite · D deploys now ".to_string();
    let mut app = App::new(chrono::Utc::now(), true, Some(banner));
    app.update(Action::Resize {
        width: 140,
        height: 40,
    });
    let theme = Theme::default_colors();
    let shoot = |app: &App, name: &str| -> Result<(), Box<dyn std::error::Error>> {
        let mut terminal = Terminal::new(TestBackend::new(app.width, app.height))?;
        terminal.draw(|f| render(f, app, &theme))?;
        let path = out.join(format!("{name}.svg"));
        std::fs::write(&path, buffer_to_svg(terminal.backend().buffer()))?;
        println!("{}", path.display());
        Ok(())
    };
    let mut device = None;
    let mut in_doubt_seen = None;
    for second in 0..75 {
        let snapshot = Arc::new(monitor.poll().await);
        if device.is_none() {
            // Follow the first vehicle whose tunnel flush arrived late, preferring one
            // with an ignition among the flushed events (the field report's ghost).
            let late: Vec<_> = snapshot
                .database
                .as_ref()
                .and_then(|d| d.vehicles.as_ref())
                .map(|v| {
                    v.anomalies
                        .iter()
                        .filter(|a| matches!(a, VehicleAnomaly::LateEvent { .. }))
                        .collect()
                })
                .unwrap_or_default();
            let ignition = late.iter().find(|a| {
                matches!(a, VehicleAnomaly::LateEvent { event_type, .. } if event_type.starts_with("ignition"))
            });
            device = ignition.or(late.first()).map(|a| a.device_id().to_string());
            if device.is_some() {
                monitor.select_vehicle(device.clone());
            }
        }
        let doubt = snapshot
            .database
            .as_ref()
            .is_some_and(|d| d.claims_in_doubt_total > 0);
        app.update(Action::Snapshot(snapshot));
        // A few seconds into the claims in doubt: the consumers paused, the alert,
        // the claims listed.
        if doubt && in_doubt_seen.is_none() {
            in_doubt_seen = Some(second);
        }
        if in_doubt_seen.map(|s| s + 3) == Some(second) {
            for (tab, name) in [(Tab::Overview, "overview"), (Tab::Tables, "tables")] {
                app.update(Action::GoTo(tab));
                shoot(&app, name)?;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    if in_doubt_seen.is_none() {
        return Err("no claim came into doubt: the slow provider did not show".into());
    }
    for (tab, name) in [
        (Tab::Duplicates, "duplicates"),
        (Tab::Vehicles, "vehicles"),
        (Tab::Drills, "drills"),
        (Tab::Inventory, "inventory"),
    ] {
        app.update(Action::GoTo(tab));
        shoot(&app, name)?;
    }
    if let Some(device) = device {
        app.update(Action::StartPrompt(PromptKind::VehicleId));
        for c in device.chars() {
            app.update(Action::PromptInput(c));
        }
        app.update(Action::PromptDone);
        shoot(&app, "vehicle")?;
        app.update(Action::Back);
    }
    // The chart around the deploy: trip-counter (a low-rate consumer, so its spike is
    // high), the cursor a few seconds after the deploy.
    app.update(Action::GoTo(Tab::Duplicates));
    app.update(Action::CycleConsumer);
    app.update(Action::CycleConsumer);
    for _ in 0..80 {
        app.update(Action::Left);
    }
    shoot(&app, "deploy")?;
    // The compact layout.
    app.update(Action::Back);
    app.update(Action::Resize {
        width: 80,
        height: 24,
    });
    app.update(Action::GoTo(Tab::Overview));
    shoot(&app, "overview-80x24")?;
    drop(demo);
    Ok(())
}
