//! Snapshot tests of every screen, rendered with `TestBackend` from fixture data
//! with a fixed clock. Review changes with `cargo insta review`.

use std::sync::Arc;

use ratatui::backend::TestBackend;
use ratatui::Terminal;

use super::action::Action;
use super::app::App;
use super::fixtures;
use super::render::render;
use super::tab::Tab;
use super::theme::Theme;
use crate::drills::twice::TwiceCheck;
use crate::drills::{DrillReport, Scenario, Verdict};
use crate::engine::consumers::{self, ConsumerMode};
use crate::engine::store::Durability;
use crate::monitor::{alerts, Snapshot};

fn app() -> App {
    app_with(fixtures::snapshot(fixtures::now()))
}

fn app_with(snapshot: Snapshot) -> App {
    let mut app = App::new(
        fixtures::now(),
        true,
        Some(" DEMO · embedded engine on SQLite in /tmp/demo · D deploys now ".into()),
    );
    app.update(Action::Snapshot(Arc::new(snapshot)));
    app
}

fn draw(app: &App) -> TestBackend {
    draw_with(app, &Theme::no_color())
}

fn draw_with(app: &App, theme: &Theme) -> TestBackend {
    let mut terminal = Terminal::new(TestBackend::new(120, 34)).expect("test terminal");
    terminal.draw(|f| render(f, app, theme)).expect("draw");
    terminal.backend().clone()
}

fn on(tab: Tab) -> App {
    let mut a = app();
    a.update(Action::GoTo(tab));
    a
}

#[test]
fn overview() {
    insta::assert_snapshot!(draw(&on(Tab::Overview)));
}

#[test]
fn overview_flags_a_relaxed_target_in_the_warning_style() {
    let mut snap = fixtures::snapshot(fixtures::now());
    snap.targets[0].durability = Some(Durability::Relaxed);
    // The alert comes from the monitor's own rule, not from the fixture.
    snap.alerts
        .extend(alerts::evaluate(&snap.targets, &[], None));
    let a = app_with(snap);
    let screen = draw(&a);
    let text = screen.to_string();
    assert!(
        text.contains("demo-engine up  relaxed durability"),
        "{text}"
    );
    assert!(
        text.contains("WARN demo-engine runs with relaxed durability: a power cut can"),
        "{text}"
    );
    insta::assert_snapshot!(screen);

    let theme = Theme::default_colors();
    let coloured = draw_with(&a, &theme);
    let buffer = coloured.buffer();
    let width = buffer.area.width;
    let (x, y) = (0..buffer.area.height)
        .find_map(|y| {
            let row: String = (0..width).map(|x| buffer[(x, y)].symbol()).collect();
            row.find("up  relaxed durability")
                .map(|byte| (row[..byte].chars().count() as u16 + 4, y))
        })
        .expect("the target row names its durability");
    for dx in 0.."relaxed durability".len() as u16 {
        assert_eq!(buffer[(x + dx, y)].style().fg, theme.warn.fg, "cell {dx}");
    }
}

#[test]
fn overview_before_the_first_poll() {
    let a = App::new(fixtures::now(), false, None);
    insta::assert_snapshot!(draw(&a));
}

#[test]
fn duplicates_all_consumers_with_markers() {
    insta::assert_snapshot!(draw(&on(Tab::Duplicates)));
}

#[test]
fn duplicates_one_consumer() {
    let mut a = on(Tab::Duplicates);
    a.update(Action::CycleConsumer);
    a.update(Action::CycleConsumer);
    a.update(Action::CycleConsumer);
    insta::assert_snapshot!(draw(&a));
}

#[test]
fn vehicles_anomaly_list() {
    insta::assert_snapshot!(draw(&on(Tab::Vehicles)));
}

#[test]
fn vehicle_state_beside_history() {
    let mut a = on(Tab::Vehicles);
    a.update(Action::Enter);
    assert_eq!(a.vehicles.open.as_deref(), Some("34-SIM-0007"));
    insta::assert_snapshot!(draw(&a));
}

#[test]
fn drills_confirmation() {
    let mut a = on(Tab::Drills);
    a.update(Action::Enter);
    insta::assert_snapshot!(draw(&a));
}

#[test]
fn drills_live_confirmation_says_it_is_live() {
    let mut a = on(Tab::Drills);
    for _ in 0..Scenario::ALL.len() {
        a.update(Action::Down);
    }
    assert_eq!(a.drills.scenario(), Scenario::LiveRedelivery);
    a.update(Action::Enter);
    let screen = draw(&a);
    let text = format!("{screen:?}");
    assert!(text.contains("LIVE drill"), "{text}");
    insta::assert_snapshot!(screen);
}

#[test]
fn drills_verdict() {
    let mut a = on(Tab::Drills);
    let report = DrillReport {
        run_id: 3,
        scenario: Scenario::CrashBeforeAck,
        mode: ConsumerMode::Idempotent,
        times: 7,
        kill_process: false,
        deliveries: 7,
        sms_sent: 1,
        webhooks_sent: 0,
        duplicate_dropped: 6,
        counter_delta: 1,
        dead_lettered: 0,
        state_ok: true,
        verdict: Verdict::Pass,
        duration_ms: 1919,
        details: serde_json::json!({"checks": [
            {"name": "SMS actually sent", "expected": 1, "actual": 1, "ok": true},
            {"name": "duplicates dropped", "expected": 6, "actual": 6, "ok": true}
        ]}),
    };
    a.update(Action::DrillFinished(Ok(Box::new(report))));
    insta::assert_snapshot!(draw(&a));
}

#[test]
fn drills_running() {
    let mut a = on(Tab::Drills);
    a.update(Action::Enter);
    a.update(Action::Confirm);
    a.update(Action::DrillProgress(
        "zone-exit-sms: incarnation 1 died at after-commit-before-ack".into(),
    ));
    insta::assert_snapshot!(draw(&a));
}

#[test]
fn tables() {
    insta::assert_snapshot!(draw(&on(Tab::Tables)));
}

#[test]
fn inventory_with_twice_checks() {
    let mut a = on(Tab::Inventory);
    let checks = consumers::FLEET_CONSUMERS
        .iter()
        .map(|c| TwiceCheck {
            consumer: c.to_string(),
            risk: consumers::risk_class(c).expect("known consumer"),
            mode: ConsumerMode::Idempotent,
            messages: 60,
            verdict: Verdict::Pass,
            detail: "same result".into(),
        })
        .collect();
    a.update(Action::TwiceChecked(checks));
    insta::assert_snapshot!(draw(&a));
}

#[test]
fn help_overlay_lists_the_keymap() {
    let mut a = on(Tab::Duplicates);
    a.update(Action::ToggleHelp);
    insta::assert_snapshot!(draw(&a));
}

#[test]
fn filter_narrows_the_consumers() {
    let mut a = on(Tab::Overview);
    a.update(Action::StartFilter);
    for c in "sms".chars() {
        a.update(Action::FilterInput(c));
    }
    let screen = draw(&a).to_string();
    assert!(screen.contains("zone-exit-sms"));
    assert!(!screen.contains("trip-counter   "), "{screen}");
    insta::assert_snapshot!(screen);
}

#[test]
fn frozen_header() {
    let mut a = on(Tab::Overview);
    a.update(Action::ToggleFreeze);
    a.update(Action::Snapshot(Arc::new(fixtures::snapshot(
        fixtures::now(),
    ))));
    assert!(draw(&a).to_string().contains("FROZEN (+1 polls)"));
}

#[test]
fn narrow_terminal_does_not_panic() {
    for tab in Tab::ALL {
        let mut a = on(tab);
        a.update(Action::ToggleHelp);
        let mut terminal = Terminal::new(TestBackend::new(40, 12)).expect("test terminal");
        terminal
            .draw(|f| render(f, &a, &Theme::default_colors()))
            .expect("draw");
    }
}
