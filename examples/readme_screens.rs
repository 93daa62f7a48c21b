//! The README's pictures, from the real screens: starts the live demo (embedded
//! engine, simulator, a deploy 20 s in), polls it like the dashboard does, and
//! after the deploy renders every tab, and the chart around the deploy, into SVG
//! files under `assets/screens/` (or the directory given).
//!
//! `cargo run --example readme_screens [-- DIR]` (about a minute and a half).

use std::sync::Arc;
use std::time::Duration;

use idemwatch::demo::{Demo, DemoSettings};
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
    let demo = Demo::start(settings).await?;
    let mut monitor = Monitor::new(&demo.endpoints.monitor_config())?;
    // One minute: the deploy (20 s in) and what follows fill the chart.
    monitor.zoom_mut().zoom_in();
    monitor.zoom_mut().zoom_in();
    let banner = " DEMO · embedded engine on SQLite · D deploys now ".to_string();
    let mut app = App::new(chrono::Utc::now(), true, Some(banner));
    app.update(Action::Resize {
        width: 140,
        height: 40,
    });
    let mut device = None;
    for second in 0..75 {
        let snapshot = Arc::new(monitor.poll().await);
        if second == 50 {
            // Follow a vehicle with an anomaly (else any) for the detail screen.
            device = snapshot
                .database
                .as_ref()
                .and_then(|d| d.vehicles.as_ref())
                .and_then(|v| v.anomalies.first())
                .map(|a| a.device_id().to_string())
                .or_else(|| Some("34-SIM-0001".to_string()));
            monitor.select_vehicle(device.clone());
        }
        app.update(Action::Snapshot(snapshot));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let theme = Theme::default_colors();
    let shoot = |app: &App, name: &str| -> Result<(), Box<dyn std::error::Error>> {
        let mut terminal = Terminal::new(TestBackend::new(app.width, app.height))?;
        terminal.draw(|f| render(f, app, &theme))?;
        let path = out.join(format!("{name}.svg"));
        std::fs::write(&path, buffer_to_svg(terminal.backend().buffer()))?;
        println!("{}", path.display());
        Ok(())
    };
    for (tab, name) in [
        (Tab::Overview, "overview"),
        (Tab::Duplicates, "duplicates"),
        (Tab::Vehicles, "vehicles"),
        (Tab::Drills, "drills"),
        (Tab::Tables, "tables"),
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
