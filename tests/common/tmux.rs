//! A tmux server of the test's own, to drive the dashboard in a real terminal and
//! read its screen.

use std::process::Command;
use std::time::{Duration, Instant};

use super::backends::required;
use super::TempEnv;

/// A tmux server of our own (its own socket), one session, one pane.
pub struct Tmux {
    socket: String,
}

impl Tmux {
    pub fn start(env: &TempEnv, command: &str, width: u16, height: u16) -> Option<Tmux> {
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

    pub fn tmux(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .args(["-L", &self.socket])
            .args(args)
            .output()
            .expect("run tmux");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn screen(&self) -> String {
        self.tmux(&["capture-pane", "-p", "-t", "e2e"])
    }

    pub fn keys(&self, keys: &[&str]) {
        for k in keys {
            self.tmux(&["send-keys", "-t", "e2e", k]);
            std::thread::sleep(Duration::from_millis(150));
        }
    }

    /// Wait until the screen satisfies `ok`, or fail with the last screen.
    pub fn wait_for(&self, what: &str, timeout: Duration, ok: impl Fn(&str) -> bool) -> String {
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

/// The dashboard's command line: the config `toml` (written into the env) and `args`,
/// its log in the env; the shell stays after it exits, so its last screen can be read.
pub fn dashboard_command(env: &TempEnv, toml: &str, args: &[&str]) -> String {
    let config = env.path("watch.toml");
    std::fs::write(&config, toml).expect("write the dashboard's config");
    format!(
        "IDEMWATCH_LOG_FILE={log} {bin} --config {cfg} {args}; sleep 600",
        log = env.path("tui.log").display(),
        bin = super::idemwatch_bin().display(),
        cfg = config.display(),
        args = args.join(" ")
    )
}

/// A dashboard config: one scrape target, polled every 500 ms, and the env's
/// database when `with_db`.
pub fn one_target_config(env: &TempEnv, name: &str, port: u16, with_db: bool) -> String {
    let mut toml = format!(
        "poll_interval = \"500ms\"\n[[targets]]\nname = \"{name}\"\nurl = \"http://127.0.0.1:{port}/metrics\"\n"
    );
    if with_db {
        toml.push_str(&format!("[database]\nurl = \"{}\"\n", env.db_url()));
    }
    toml
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["-L", &self.socket, "kill-server"])
            .status();
    }
}
