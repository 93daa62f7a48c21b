//! Snapshot tests of every screen, rendered with `TestBackend` from fixture data
//! with a fixed clock, at 160×45 and at 80×24 (the compact layouts). Review changes
//! with `cargo insta review`.

use std::sync::Arc;

use ratatui::backend::TestBackend;
use ratatui::Terminal;

use super::action::{Action, PromptKind};
use super::app::App;
use super::fixtures;
use super::lists::ListId;
use super::render::render;
use super::tab::Tab;
use super::theme::Theme;
use idemwatch_drills::twice::TwiceCheck;
use idemwatch_drills::{DrillReport, Scenario, Verdict};
use idemwatch_engine::consumers::{self, ConsumerMode};
use idemwatch_engine::store::Durability;
use idemwatch_monitor::{alerts, Snapshot};

fn app() -> App {
    app_with(fixtures::snapshot(fixtures::now()))
}

fn app_with(snapshot: Snapshot) -> App {
    let mut app = App::new(
        fixtures::now(),
        true,
        Some(" DEMO · embedded engine on SQLite in /tmp/demo · metrics http://127.0.0.1:40123/metrics · SMS sandbox http://127.0.0.1:40124 · D deploys now · --config FILE watches your own system ".into()),
    );
    app.update(Action::Snapshot(Arc::new(snapshot)));
    app
}

fn draw_at(app: &App, width: u16, height: u16, theme: &Theme) -> TestBackend {
    let mut app = app.clone();
    app.update(Action::Resize { width, height });
    let mut terminal = Terminal::new(TestBackend::new(width, height)).expect("test terminal");
    terminal.draw(|f| render(f, &app, theme)).expect("draw");
    terminal.backend().clone()
}

fn draw(app: &App) -> TestBackend {
    draw_at(app, 160, 45, &Theme::no_color())
}

/// The screen at 160×45 and at 80×24, both snapshotted.
fn both(name: &str, app: &App) -> (String, String) {
    let wide = draw_at(app, 160, 45, &Theme::no_color());
    let small = draw_at(app, 80, 24, &Theme::no_color());
    insta::assert_snapshot!(format!("{name}_160x45"), wide);
    insta::assert_snapshot!(format!("{name}_80x24"), small);
    (wide.to_string(), small.to_string())
}

fn on(tab: Tab) -> App {
    let mut a = app();
    a.update(Action::GoTo(tab));
    a
}

#[test]
fn overview() {
    let (wide, small) = both("overview", &on(Tab::Overview));
    // Rates over a minute by default, totals labelled, quiet told from no data.
    assert!(wide.contains("over the last 1 min"), "{wide}");
    assert!(wide.contains("Σ processed"), "{wide}");
    assert!(wide.contains("quiet 42s"), "{wide}");
    // The badge, on every tab, counts incidents only (the drill's ghost is not one).
    assert!(wide.contains("▲ 2 CRIT"), "{wide}");
    assert!(wide.contains("DRILL"), "{wide}");
    // Compact: full consumer names, the badge still there.
    assert!(small.contains("zone-exit-sms"), "{small}");
    assert!(small.contains("▲ 2 CRIT"), "{small}");
}

#[test]
fn overview_five_minute_rates() {
    let mut a = on(Tab::Overview);
    a.update(Action::CycleRateWindow);
    let screen = draw(&a).to_string();
    assert!(screen.contains("over the last 5 min"), "{screen}");
}

#[test]
fn overview_flags_a_relaxed_target_in_the_warning_style() {
    let mut snap = fixtures::snapshot(fixtures::now());
    snap.targets[0].durability = Some(Durability::Relaxed);
    // The alert comes from the monitor's own rule, not from the fixture.
    snap.alerts
        .extend(alerts::evaluate(&snap.targets, &[], None));
    let a = app_with(snap);
    let text = draw(&a).to_string();
    assert!(
        text.contains("demo-engine up  relaxed durability"),
        "{text}"
    );
    assert!(
        text.contains("demo-engine runs with relaxed durability: a power cut can"),
        "{text}"
    );

    let theme = Theme::default_colors();
    let coloured = draw_at(&a, 160, 45, &theme);
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

/// A consumer whose store stopped answering: the Overview says what, since when, how
/// often it was tried and what failed last — the monitor's own words, from its own
/// rule over the engine's pause metrics.
#[test]
fn overview_names_why_a_consumer_is_paused_or_waiting_and_since_when() {
    use idemwatch_monitor::targets::PausedReading;
    let mut snap = fixtures::snapshot(fixtures::now());
    let trip = snap
        .consumers
        .iter_mut()
        .find(|c| c.consumer == "trip-counter")
        .expect("the fixture's trip-counter");
    let mut paused = PausedReading {
        cause: "store".into(),
        since: Some(fixtures::now() - chrono::Duration::seconds(236)),
        last_error_kind: Some("timeout".into()),
        retries: Some(3),
        summary: String::new(),
    };
    paused.summary = paused.summarize();
    trip.paused = Some(paused);
    // And one whose batch has waited 21 s on a peer, before any deadline fired.
    let sms = snap
        .consumers
        .iter_mut()
        .find(|c| c.consumer == "zone-exit-sms")
        .expect("the fixture's zone-exit-sms");
    sms.waiting_seconds = Some(21);
    // Only the pause's own alert: the fixture's other consumers raise theirs already.
    let paused_only: Vec<_> = snap
        .consumers
        .iter()
        .filter(|c| c.paused.is_some() || c.waiting_seconds.is_some())
        .cloned()
        .collect();
    // First, as the monitor sorts it: a CRIT incident whose consumer moves nothing.
    let pause_alerts = alerts::evaluate(&snap.targets, &paused_only, None);
    snap.alerts.splice(0..0, pause_alerts);
    let (wide, small) = both("overview_paused", &app_with(snap));
    for screen in [&wide, &small] {
        assert!(screen.contains("PAUSED"), "{screen}");
        assert!(screen.contains("store not answering"), "{screen}");
    }
    assert!(wide.contains("WAITING 21s"), "{wide}");
    assert!(wide.contains("one batch in hand for 21s"), "{wide}");
    // The alert's line wraps in its column, beside the sources.
    for part in [
        "store not answering since 04:08:07, 3",
        "retries, last: timeout; messages wait in the queue",
    ] {
        assert!(wide.contains(part), "{part:?} in {wide}");
    }
}

#[test]
fn overview_before_the_first_poll() {
    let a = App::new(fixtures::now(), false, None);
    insta::assert_snapshot!(draw(&a));
}

#[test]
fn duplicates_all_consumers_with_markers() {
    let (wide, small) = both("duplicates", &on(Tab::Duplicates));
    // Markers are labelled ticks on their own lane, letters not data glyphs.
    assert!(wide.contains("D demo deploy #1"), "{wide}");
    assert!(wide.contains("deploy day 0.4%"), "{wide}");
    assert!(
        wide.contains("04:12:03") || wide.contains("04:12"),
        "{wide}"
    );
    assert!(small.contains("Dup % over 1 min"), "{small}");
}

#[test]
fn duplicates_one_consumer_with_the_cursor_and_drills_hidden() {
    let mut a = on(Tab::Duplicates);
    a.update(Action::CycleConsumer);
    a.update(Action::CycleConsumer);
    a.update(Action::CycleConsumer);
    a.update(Action::ToggleMarkerKind("drill"));
    for _ in 0..40 {
        a.update(Action::Left);
    }
    let (wide, _) = both("duplicates_cursor", &a);
    assert!(wide.contains("cursor 04:"), "{wide}");
    assert!(wide.contains("hidden: drill"), "{wide}");
}

#[test]
fn duplicates_log_scale() {
    let mut a = on(Tab::Duplicates);
    a.update(Action::ToggleLogScale);
    let screen = draw(&a).to_string();
    assert!(screen.contains("log scale"), "{screen}");
    assert!(screen.contains("0.001%"), "{screen}");
}

#[test]
fn vehicles_anomaly_list() {
    both("vehicles", &on(Tab::Vehicles));
}

#[test]
fn vehicle_state_beside_history() {
    let mut a = on(Tab::Vehicles);
    a.update(Action::Down);
    a.update(Action::Down);
    a.update(Action::Enter);
    assert_eq!(a.vehicles.open.as_deref(), Some("34-SIM-0007"));
    let (_, small) = both("vehicle_detail", &a);
    assert!(small.contains("ignition_off"), "{small}");
}

#[test]
fn vehicle_opened_by_id() {
    let mut a = on(Tab::Overview);
    a.update(Action::StartPrompt(PromptKind::VehicleId));
    for c in "34-SIM-0007".chars() {
        a.update(Action::PromptInput(c));
    }
    a.update(Action::PromptDone);
    assert_eq!(a.tab, Tab::Vehicles);
    assert_eq!(a.vehicles.open.as_deref(), Some("34-SIM-0007"));
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
    assert_eq!(a.scenario(), Scenario::LiveRedelivery);
    a.update(Action::Enter);
    let screen = draw(&a);
    let text = format!("{screen:?}");
    assert!(text.contains("LIVE drill"), "{text}");
    insta::assert_snapshot!(screen);
}

fn verdict(checks: usize) -> DrillReport {
    let checks: Vec<serde_json::Value> = (0..checks)
        .map(|i| serde_json::json!({"name": format!("check {i}"), "expected": 1, "actual": 1, "ok": true}))
        .collect();
    DrillReport {
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
        effects: idemwatch_drills::EffectVerdict::of(
            &[idemwatch_drills::EffectTally::new("SMS", 1, 1, true)],
            0,
        ),
        duration_ms: 1919,
        details: serde_json::json!({ "checks": checks }),
    }
}

#[test]
fn drills_verdict_every_check_reachable_at_80x24() {
    let mut a = on(Tab::Drills);
    a.update(Action::DrillFinished(Ok(Box::new(verdict(9)))));
    let (_, small) = both("drills_verdict", &a);
    assert!(
        !small.contains("check 8"),
        "the ninth check is below the fold"
    );
    a.update(Action::PageDown);
    let scrolled = draw_at(&a, 80, 24, &Theme::no_color()).to_string();
    assert!(scrolled.contains("check 8"), "{scrolled}");
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
    let (wide, small) = both("tables", &on(Tab::Tables));
    assert!(wide.contains("key_conflict"), "{wide}");
    assert!(small.contains("claims in doubt 1"), "{small}");
}

#[test]
fn a_dead_letter_opens_to_its_raw_bytes() {
    let mut a = on(Tab::Tables);
    a.update(Action::Right); // the dead letters
    assert_eq!(a.focused(), Some(ListId::DeadLetters));
    a.update(Action::Down);
    a.update(Action::Down);
    a.update(Action::Enter);
    assert_eq!(a.raw.as_ref().map(|r| r.id), Some(7));
    let (wide, small) = both("dead_letter_raw", &a);
    assert!(wide.contains("00000000  7b 22 64 65 76 69 63 65"), "{wide}");
    assert!(
        wide.contains("same key 34-SIM-0003:311:zone_exit"),
        "{wide}"
    );
    assert!(small.contains("key_conflict"), "{small}");
    // y copies the key.
    let effects = a.update(Action::Copy);
    assert_eq!(
        effects,
        vec![super::action::Effect::Copy(
            "34-SIM-0003:311:zone_exit".into()
        )]
    );
}

#[test]
fn an_open_dead_letter_is_replayed_only_after_confirmation() {
    use super::keymap::action_for;
    use crossterm::event::{KeyCode, KeyEvent};
    let mut a = on(Tab::Tables);
    a.update(Action::Right);
    // No dead letter open: p does nothing.
    assert!(a.update(Action::ReplayDeadLetter).is_empty());
    assert!(a.status.is_none());
    a.update(Action::Down);
    a.update(Action::Down);
    a.update(Action::Enter);
    assert!(a.update(Action::ReplayDeadLetter).is_empty(), "asks first");
    assert!(a
        .status
        .as_deref()
        .is_some_and(|s| s.contains("replay dead letter #7")));
    // While asked, y is the answer, not a copy.
    let y = KeyEvent::from(KeyCode::Char('y'));
    assert!(matches!(action_for(y, &a), Some(Action::Confirm)));
    // Esc cancels and keeps the dead letter open.
    a.update(Action::Back);
    assert!(a.raw.is_some());
    assert!(matches!(action_for(y, &a), Some(Action::Copy)));
    assert!(a.update(Action::Confirm).is_empty());
    a.update(Action::ReplayDeadLetter);
    let effects = a.update(Action::Confirm);
    assert_eq!(effects, vec![super::action::Effect::ReplayDeadLetter(7)]);
    assert!(
        a.update(Action::Confirm).is_empty(),
        "one question, one replay"
    );
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
            // The twice check's own wording: the detail wraps, never cut.
            detail: "same result: 4 SMS, 0 webhooks, 60 history rows, 60 dedup rows".into(),
        })
        .collect();
    a.update(Action::TwiceChecked(checks));
    both("inventory", &a);
}

#[test]
fn help_overlay_lists_the_keymap_and_scrolls() {
    let mut a = on(Tab::Duplicates);
    a.update(Action::ToggleHelp);
    let (_, small) = both("help", &a);
    assert!(small.contains("scroll"), "{small}");
    a.update(Action::End);
    let end = draw_at(&a, 80, 24, &Theme::no_color()).to_string();
    assert_ne!(end, small, "End scrolls the help");
}

#[test]
fn filter_says_how_many_rows_it_hides_on_every_list_of_the_tab() {
    let mut a = on(Tab::Tables);
    a.update(Action::StartPrompt(PromptKind::Filter));
    for c in "sms".chars() {
        a.update(Action::PromptInput(c));
    }
    a.update(Action::PromptDone);
    let screen = draw(&a).to_string();
    assert!(screen.contains("filter \"sms\":"), "{screen}");
    assert!(screen.contains("rows shown"), "{screen}");
    assert!(screen.contains("Inserts (1 of 3"), "{screen}");
    insta::assert_snapshot!(screen);
}

#[test]
fn frozen_header_says_since_when() {
    let mut a = on(Tab::Overview);
    a.update(Action::ToggleFreeze);
    a.update(Action::Snapshot(Arc::new(fixtures::snapshot(
        fixtures::now(),
    ))));
    assert!(draw(&a)
        .to_string()
        .contains("FROZEN at 04:12:03 (+1 polls)"));
}

#[test]
fn narrow_terminal_does_not_panic() {
    for tab in Tab::ALL {
        let mut a = on(tab);
        a.update(Action::ToggleHelp);
        draw_at(&a, 40, 12, &Theme::default_colors());
        a.update(Action::ToggleHelp);
        draw_at(&a, 40, 12, &Theme::default_colors());
        draw_at(&a, 220, 60, &Theme::default_colors());
    }
}

#[test]
fn a_fail_open_seen_set_bypass_shows_in_sources() {
    let mut a = on(Tab::Overview);
    let mut snap = (**a.snapshot.as_ref().expect("fixture snapshot")).clone();
    snap.targets[0]
        .seen_set_bypassed
        .insert("zone-exit-sms".into(), 4.0);
    a.snapshot = Some(Arc::new(snap));
    let text = draw(&a).to_string();
    assert!(
        text.contains("seen-set bypassed: zone-exit-sms 4"),
        "{text}"
    );
    // Without a bypass the line is not there.
    assert!(!draw(&on(Tab::Overview))
        .to_string()
        .contains("seen-set bypassed"));
}
