//! The dashboard in a real terminal (tmux): launch the demo, wait for data, visit
//! every tab, open help, resize, run a drill from the Drills tab and read its
//! verdict, quit — the terminal is restored and the exit code is 0. And a scrape
//! target that goes away shows as down while the dashboard keeps running, then
//! recovers.

mod common;

use std::time::{Duration, Instant};

use common::services::free_port;
use common::tmux::{self, Tmux};
use common::{idemwatch_bin, serve as spawn_serve, TempEnv};

#[test]
fn demo_dashboard_end_to_end_in_a_real_terminal() {
    let env = TempEnv::new();
    let exit_file = env.path("exit-code");
    let command = format!(
        "IDEMWATCH_LOG_FILE={log} {bin}; echo $? > {exit}; sleep 600",
        log = env.path("tui.log").display(),
        bin = idemwatch_bin().display(),
        exit = exit_file.display()
    );
    let Some(t) = Tmux::start(&env, &command, 140, 40) else {
        return;
    };

    // Live data within seconds: the demo's consumers have processed something.
    t.wait_for("live demo data", Duration::from_secs(30), |s| {
        s.contains("DEMO") && s.contains("vehicle-state  flowing")
    });
    for (key, title) in [
        ("2", "Duplicate rate"),
        ("3", "Vehicle anomalies"),
        ("4", "Redelivery drills"),
        ("5", "Dedup table"),
        ("6", "Consumer inventory"),
        ("Tab", "Consumers"),
    ] {
        t.keys(&[key]);
        t.wait_for(title, Duration::from_secs(5), |s| s.contains(title));
    }
    t.keys(&["?"]);
    t.wait_for("help overlay", Duration::from_secs(5), |s| {
        s.contains("? or Esc closes")
    });
    t.keys(&["Escape"]);
    t.wait_for("help closed", Duration::from_secs(5), |s| {
        !s.contains("? or Esc closes")
    });

    t.tmux(&["resize-window", "-t", "e2e", "-x", "100", "-y", "30"]);
    t.wait_for("redraw after resize", Duration::from_secs(5), |s| {
        let lines: Vec<&str> = s.lines().collect();
        lines.len() <= 30
            && lines.iter().any(|l| l.contains("Consumers"))
            && s.contains("idemwatch")
    });
    t.tmux(&["resize-window", "-t", "e2e", "-x", "140", "-y", "40"]);

    // A drill from the Drills tab, through the engine's library API.
    t.keys(&["4", "Enter"]);
    t.wait_for("confirmation", Duration::from_secs(5), |s| {
        s.contains("Confirm drill")
    });
    t.keys(&["y"]);
    let s = t.wait_for("drill verdict", Duration::from_secs(60), |s| {
        s.contains(" PASS ")
    });
    assert!(
        s.contains("sms_sent 1") && s.contains("duplicate_dropped 6"),
        "{s}"
    );

    t.keys(&["q"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !exit_file.exists() {
        assert!(
            Instant::now() < deadline,
            "idemwatch did not exit; screen:\n{}",
            t.screen()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(200));
    let code = std::fs::read_to_string(&exit_file).unwrap_or_default();
    assert_eq!(code.trim(), "0", "exit code");
    // Terminal restored: out of the alternate screen, mouse reporting off, no TUI left.
    assert_eq!(
        t.tmux(&["display", "-p", "-t", "e2e", "#{alternate_on}"])
            .trim(),
        "0"
    );
    assert_eq!(
        t.tmux(&["display", "-p", "-t", "e2e", "#{mouse_any_flag}"])
            .trim(),
        "0"
    );
    assert!(!t.screen().contains("1 Overview │"), "{}", t.screen());
}

/// What the tool is for, within the demo's first minute and a half, as a new user
/// sees it: the Duplicates chart spans the data there is (not a 15-minute window
/// with a sliver at its edge), the Vehicles tab lists a real ordering anomaly (a
/// tunnel device's flushed events, kept in history by the seq-guarded upsert) and
/// opens that vehicle's state beside its history, and after the first deploy (40 s
/// in) a claim in doubt appears and resolves by itself.
#[test]
fn demo_shows_an_ordering_anomaly_and_a_claim_in_doubt_within_its_first_minutes() {
    let env = TempEnv::new();
    let command = format!(
        "IDEMWATCH_LOG_FILE={log} {bin}; sleep 600",
        log = env.path("tui.log").display(),
        bin = idemwatch_bin().display(),
    );
    let started = Instant::now();
    let Some(t) = Tmux::start(&env, &command, 140, 40) else {
        return;
    };
    t.wait_for("live demo data", Duration::from_secs(30), |s| {
        s.contains("DEMO") && s.contains("vehicle-state  flowing")
    });
    t.keys(&["2"]);
    let s = t.wait_for("the fitted chart", Duration::from_secs(10), |s| {
        s.contains("Duplicate rate")
    });
    assert!(
        s.contains("last 1 min (all so far)"),
        "the chart opens on the one minute of data there is, not 15 min:\n{s}"
    );

    t.keys(&["3"]);
    let left = Duration::from_secs(90).saturating_sub(started.elapsed());
    let s = t.wait_for("an ordering anomaly within 90 s", left, |s| {
        s.contains("Vehicle anomalies") && s.contains("late event")
    });
    let at = started.elapsed();
    eprintln!("first anomaly listed {:.0} s after start", at.as_secs_f64());
    assert!(
        s.contains("arrived behind a newer one: history only"),
        "{s}"
    );
    // The first late event's vehicle opens: the state, at the newer seq, beside the
    // history where the flushed events are marked.
    let row = s
        .lines()
        .filter(|l| l.contains("34-SIM-"))
        .position(|l| l.contains("late event"))
        .expect("a late event row");
    t.keys(&vec!["Down"; row + 1]);
    t.keys(&["Enter"]);
    let s = t.wait_for("state beside history", Duration::from_secs(10), |s| {
        s.contains("current state") && s.contains("LATE: history only")
    });
    assert!(
        s.contains("last seq") && s.contains("in arrival order"),
        "{s}"
    );
    t.keys(&["Escape"]);

    // The first deploy (40 s in) kills a provider call in flight: its claim is in
    // doubt once the demo's 20 s lease runs out, then the sweeper or a redelivery
    // resends it under the same key and it is gone.
    t.keys(&["1"]);
    let in_doubt = |s: &str| {
        s.lines().any(|l| {
            l.split("claims in doubt: ")
                .nth(1)
                .and_then(|n| n.split_whitespace().next())
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|n| n > 0)
        })
    };
    let s = t.wait_for(
        "a claim in doubt",
        Duration::from_secs(150).saturating_sub(started.elapsed()),
        in_doubt,
    );
    eprintln!(
        "claim in doubt {:.0} s after start:\n{s}",
        started.elapsed().as_secs_f64()
    );
    t.wait_for(
        "the claim in doubt resolved",
        Duration::from_secs(60),
        |s| s.contains("claims in doubt: 0"),
    );
    eprintln!(
        "resolved {:.0} s after start",
        started.elapsed().as_secs_f64()
    );
    t.keys(&["q"]);
}

/// The dashboard's command line watching `serve` on `port` (target `fleet-1`) and the
/// env's database (its queue for replays), polling every 500 ms; the shell stays
/// after it exits.
fn watch_fleet(env: &TempEnv, port: u16) -> String {
    // The env's queue too: `p` replays a dead letter into it.
    let toml = tmux::one_target_config(env, "fleet-1", port, true)
        + &format!("[drills]\nqueue = \"{}\"\n", env.queue_url());
    tmux::dashboard_command(env, &toml, &[])
}

#[test]
fn scrape_target_going_away_shows_down_and_recovers() {
    let env = TempEnv::new();
    let port = free_port();
    let mut serve = spawn_serve(&env, port);
    let command = watch_fleet(&env, port);
    let Some(t) = Tmux::start(&env, &command, 140, 40) else {
        return;
    };
    t.wait_for("target up", Duration::from_secs(20), |s| {
        s.contains("fleet-1 up")
    });
    assert!(!t.screen().contains("DEMO"), "a config means no demo");

    serve.stop();
    t.wait_for("target down", Duration::from_secs(20), |s| {
        s.contains("fleet-1 DOWN")
    });
    // The CRIT comes once it has been down for [alerts] target_down_after (15 s).
    t.wait_for("target-down alert", Duration::from_secs(40), |s| {
        s.contains("CRIT") && s.contains("target fleet-1 is down")
    });

    let _serve = spawn_serve(&env, port);
    t.wait_for("target back up", Duration::from_secs(20), |s| {
        s.contains("fleet-1 up")
    });
    t.keys(&["q"]);
}

/// The field report's other harm, seen from the dashboard: a producer sends the same
/// key with another payload (and 10 lines of garbage). The key_conflict alert names
/// its object; Enter jumps to the Tables tab on that dead letter; Enter opens its raw
/// bytes; `p` then `y` replays it (the database counts the replay); the dead-letter
/// list scrolls (Home, End, PgDn); the help scrolls in a small terminal; `e` writes
/// the report of the window, self-contained.
#[test]
fn key_conflict_alert_jumps_to_the_dead_letter_and_its_raw_bytes() {
    let env = TempEnv::new();
    let port = free_port();
    let _serve = spawn_serve(&env, port);
    let events = env.path("conflict.jsonl");
    std::fs::write(
        &events,
        concat!(
            r#"{"device_id":"E2E-7","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{"zone":"X"}}"#,
            "\n",
            r#"{"device_id":"E2E-7","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{"zone":"Y"}}"#,
            "\n"
        )
        .to_string()
            // More dead letters than the panel has rows (40 from 4 consumers), fewer
            // than the 50 newest the dashboard lists: the list must scroll.
            + &(0..10).map(|i| format!("not json {i}\n")).collect::<String>(),
    )
    .unwrap();
    let command = watch_fleet(&env, port);
    let Some(t) = Tmux::start(&env, &command, 120, 40) else {
        return;
    };
    t.wait_for("target up", Duration::from_secs(20), |s| {
        s.contains("fleet-1 up")
    });
    let (code, _, err) = common::run_cli(
        &env,
        &[
            "publish",
            events.to_str().unwrap(),
            "--db",
            &env.db_url(),
            "--queue",
            &env.queue_url(),
        ],
    );
    assert_eq!(code, 0, "publish: {err}");

    // The alert, critical, with its object.
    t.wait_for("key_conflict alert", Duration::from_secs(30), |s| {
        s.contains("CRIT") && s.contains("key_conflict dead letter")
    });
    // → focuses the alerts, ↓ selects the first (key conflicts first), Enter jumps.
    t.keys(&["Right", "Down", "Enter"]);
    let s = t.wait_for("jump to the dead letter", Duration::from_secs(10), |s| {
        s.contains("▶ Dead letters") && s.contains("from alert:")
    });
    assert!(s.contains("5 Tables"), "{s}");
    t.keys(&["Enter"]);
    let s = t.wait_for("raw bytes", Duration::from_secs(10), |s| {
        s.contains("Dead letter #") && s.contains("00000000  7b 22 64 65 76 69 63 65")
    });
    assert!(s.contains("key_conflict"), "{s}");
    assert!(
        s.contains(r#"{"device_id":"E2E-7""#),
        "the escaped text:\n{s}"
    );

    // `p` asks, `y` replays it to its consumer's queue; the database counts it.
    t.keys(&["p"]);
    t.wait_for("the replay question", Duration::from_secs(10), |s| {
        s.contains("y replays, Esc cancels")
    });
    t.keys(&["y"]);
    let s = t.wait_for("replayed", Duration::from_secs(30), |s| {
        s.contains(" replayed to ") || s.contains("not replayed")
    });
    let id: i64 = s
        .split("dead letter #")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no dead letter id in the status line:\n{s}"));
    assert!(
        s.contains(&format!("dead letter #{id} replayed to ")),
        "{s}"
    );
    let (code, out, err) = common::run_cli(
        &env,
        &["dead-letters", "list", "--json", "--db", &env.db_url()],
    );
    assert_eq!(code, 0, "dead-letters list: {err}");
    let listed: serde_json::Value = serde_json::from_str(&out).expect("list --json");
    let replayed = listed["dead_letters"]
        .as_array()
        .and_then(|a| a.iter().find(|d| d["id"].as_i64() == Some(id)))
        .unwrap_or_else(|| panic!("#{id} not listed: {out}"));
    assert_eq!(replayed["replay_count"].as_i64(), Some(1), "{replayed}");
    t.keys(&["Escape"]);

    // The dead-letter list (focused after the jump) scrolls: End shows the oldest,
    // Home the newest, PgDn moves a page.
    let visible_ids = |s: &str| -> Vec<i64> {
        s.lines()
            .filter_map(|l| l.split("│#").nth(1))
            .filter_map(|rest| rest.split(' ').next()?.parse().ok())
            .collect()
    };
    t.keys(&["Home"]);
    let top = t.wait_for("the newest dead letters", Duration::from_secs(10), |s| {
        !visible_ids(s).is_empty() && !visible_ids(s).contains(&1)
    });
    let newest = visible_ids(&top)[0];
    t.keys(&["End"]);
    let bottom = t.wait_for("the oldest dead letter", Duration::from_secs(10), |s| {
        visible_ids(s).contains(&1)
    });
    assert!(!visible_ids(&bottom).contains(&newest), "{bottom}");
    // Three pages (PgDn moves 10 rows): past what the panel shows at 40 rows.
    t.keys(&["Home", "PageDown", "PageDown", "PageDown"]);
    t.wait_for("pages down", Duration::from_secs(10), |s| {
        let ids = visible_ids(s);
        !ids.is_empty() && !ids.contains(&newest) && !ids.contains(&1)
    });

    // A small terminal: the compact header, and help that scrolls.
    t.tmux(&["resize-window", "-t", "e2e", "-x", "80", "-y", "24"]);
    t.keys(&["?"]);
    let first = t.wait_for("help, first page", Duration::from_secs(5), |s| {
        s.contains("keys 1-")
    });
    t.keys(&["PageDown"]);
    let next = t.wait_for("help, scrolled", Duration::from_secs(5), |s| {
        s.contains("keys 11-")
    });
    assert_ne!(first, next);
    t.keys(&["Escape"]);

    // `e` writes the report of the window on screen.
    t.keys(&["e"]);
    let s = t.wait_for("report written", Duration::from_secs(10), |s| {
        s.contains("report written to")
    });
    let dir = env.path("data").join("idemwatch").join("reports");
    let written: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}\n{s}", dir.display()))
        .filter_map(Result::ok)
        .collect();
    assert_eq!(written.len(), 1, "{written:?}");
    let page = std::fs::read_to_string(written[0].path()).unwrap();
    assert!(
        page.contains("<svg") && page.contains("key_conflict"),
        "{page}"
    );
    // Self-contained: nothing is loaded from outside (a mail attachment opens it).
    for external in ["src=", "href=\"http", "<link", "url(", "@import"] {
        assert!(
            !page.contains(external),
            "the report loads {external}…:\n{page}"
        );
    }
    t.keys(&["q"]);
}

/// A CD pipeline's `idemwatch mark deploy` while the dashboard runs: the marker is on
/// the Duplicates chart's lane and in its marker list within a poll or two.
#[test]
fn a_pipelines_deploy_marker_shows_on_the_running_dashboard() {
    let env = TempEnv::new();
    let port = free_port();
    let _serve = spawn_serve(&env, port);
    let command = watch_fleet(&env, port);
    let Some(t) = Tmux::start(&env, &command, 140, 40) else {
        return;
    };
    t.wait_for("target up", Duration::from_secs(20), |s| {
        s.contains("fleet-1 up")
    });
    t.keys(&["2"]);
    t.wait_for("the chart", Duration::from_secs(5), |s| {
        s.contains("Duplicate rate")
    });
    let (code, _, err) = common::run_cli(
        &env,
        &[
            "mark",
            "deploy",
            "--label",
            "fleet v9.9.9 from CD",
            "--db",
            &env.db_url(),
        ],
    );
    assert_eq!(code, 0, "mark: {err}");
    let s = t.wait_for("the deploy marker", Duration::from_secs(10), |s| {
        s.contains("fleet v9.9.9 from CD")
    });
    assert!(s.contains("D "), "the lane's deploy glyph:\n{s}");
    t.keys(&["q"]);
}
