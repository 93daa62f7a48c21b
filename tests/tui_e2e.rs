//! The dashboard in a real terminal (tmux): launch the demo, wait for data, visit
//! every tab, open help, resize, run a drill from the Drills tab and read its
//! verdict, quit — the terminal is restored and the exit code is 0. And a scrape
//! target that goes away shows as down while the dashboard keeps running, then
//! recovers.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{idemwatch_bin, KillOnDrop, TempEnv};

fn required() -> bool {
    std::env::var("IDEMWATCH_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// A tmux server of our own (its own socket), one session, one pane.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn start(env: &TempEnv, command: &str, width: u16, height: u16) -> Option<Tmux> {
        let socket = format!("idw-e2e-{}-{}", std::process::id(), rand::random::<u32>());
        let status = Command::new("tmux")
            .args([
                "-L",
                &socket,
                "-f",
                "/dev/null",
                "new-session",
                "-d",
                "-s",
                "e2e",
            ])
            .args(["-x", &width.to_string(), "-y", &height.to_string()])
            .arg(command)
            .env("HOME", env.dir.path())
            .env("XDG_DATA_HOME", env.path("data"))
            .env("XDG_CONFIG_HOME", env.path("config"))
            .env("TERM", "xterm-256color")
            .status();
        match status {
            Ok(s) if s.success() => Some(Tmux { socket }),
            other if !required() => {
                eprintln!("SKIP: tmux unavailable ({other:?})");
                None
            }
            other => panic!("tmux is required (IDEMWATCH_REQUIRE_SERVICES=1): {other:?}"),
        }
    }

    fn tmux(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .args(["-L", &self.socket])
            .args(args)
            .output()
            .expect("run tmux");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn screen(&self) -> String {
        self.tmux(&["capture-pane", "-p", "-t", "e2e"])
    }

    fn keys(&self, keys: &[&str]) {
        for k in keys {
            self.tmux(&["send-keys", "-t", "e2e", k]);
            std::thread::sleep(Duration::from_millis(150));
        }
    }

    /// Wait until the screen satisfies `ok`, or fail with the last screen.
    fn wait_for(&self, what: &str, timeout: Duration, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.screen();
            if ok(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; screen:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["-L", &self.socket, "kill-server"])
            .status();
    }
}

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
        s.contains("DEMO")
            && s.contains("vehicle-state  up")
            && !s.contains("vehicle-state  up   0 ")
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
        s.contains("keys — ? or Esc closes")
    });
    t.keys(&["Escape"]);
    t.wait_for("help closed", Duration::from_secs(5), |s| {
        !s.contains("keys — ? or Esc closes")
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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn_serve(env: &TempEnv, port: u16) -> KillOnDrop {
    KillOnDrop(
        Command::new(idemwatch_bin())
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--db", &env.db_url(), "--queue", &env.queue_url()])
            .env("IDEMWATCH_LOG_FILE", env.path("serve.log"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start serve"),
    )
}

#[test]
fn scrape_target_going_away_shows_down_and_recovers() {
    let env = TempEnv::new();
    let port = free_port();
    let mut serve = spawn_serve(&env, port);
    let config = env.path("watch.toml");
    std::fs::write(
        &config,
        format!(
            "poll_interval = \"500ms\"\n[[targets]]\nname = \"fleet-1\"\nurl = \"http://127.0.0.1:{port}/metrics\"\n[database]\nurl = \"{}\"\n",
            env.db_url()
        ),
    )
    .unwrap();
    let command = format!(
        "IDEMWATCH_LOG_FILE={log} {bin} --config {cfg}; sleep 600",
        log = env.path("tui.log").display(),
        bin = idemwatch_bin().display(),
        cfg = config.display()
    );
    let Some(t) = Tmux::start(&env, &command, 140, 40) else {
        return;
    };
    t.wait_for("target up", Duration::from_secs(20), |s| {
        s.contains("fleet-1 up")
    });
    assert!(!t.screen().contains("DEMO"), "a config means no demo");

    serve.stop();
    let s = t.wait_for("target down", Duration::from_secs(20), |s| {
        s.contains("fleet-1 DOWN")
    });
    assert!(s.contains("CRIT"), "a down target raises an alert:\n{s}");

    let _serve = spawn_serve(&env, port);
    t.wait_for("target back up", Duration::from_secs(20), |s| {
        s.contains("fleet-1 up")
    });
    t.keys(&["q"]);
}
