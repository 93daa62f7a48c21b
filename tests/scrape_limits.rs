//! Hostile scrape targets: one that streams forever, one that is gigantic. Each
//! scrape fails with "response too large", the target shows as down, and the
//! memory of the process that scrapes stays bounded (checked on a real `snapshot`
//! child through its peak RSS). The dashboard takes the body cap from its own
//! `--scrape-max-bytes`, as `snapshot` does.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idemwatch::config::MetricNames;
use idemwatch::monitor::db::SourceStatus;
use idemwatch::monitor::prometheus::{Sample, ScrapeLimits, Scraper, TOO_LARGE};
use idemwatch::monitor::targets::TargetTracker;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What a hostile `/metrics` sends after its headers.
#[derive(Debug, Clone, Copy)]
enum Hostile {
    /// One label value that never ends.
    EndlessLine,
    /// Valid samples, forever, chunked.
    EndlessSamples,
    /// A body announced as 64 GiB (it sends samples until the client goes).
    Announced,
}

/// Serve `what` on a loopback port, from a thread of its own (so a child process
/// can scrape it while the test waits on the child).
fn hostile_target(what: Hostile) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let mut head = [0u8; 4096];
                    let _ = stream.read(&mut head).await;
                    let (headers, first, piece): (&str, &[u8], Vec<u8>) = match what {
                        Hostile::EndlessLine => (
                            "Connection: close\r\n",
                            b"m{a=\"",
                            vec![b'a'; 64 * 1024],
                        ),
                        Hostile::EndlessSamples => (
                            "Connection: close\r\n",
                            b"",
                            b"m{a=\"x\"} 1\n".repeat(6000),
                        ),
                        Hostile::Announced => (
                            "Content-Length: 68719476736\r\n",
                            b"",
                            b"m{a=\"x\"} 1\n".repeat(6000),
                        ),
                    };
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n{headers}\r\n"
                    );
                    if stream.write_all(head.as_bytes()).await.is_err()
                        || stream.write_all(first).await.is_err()
                    {
                        return;
                    }
                    // Until the client hangs up.
                    while stream.write_all(&piece).await.is_ok() {}
                });
            }
        });
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the target starts")
}

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}/metrics")
}

/// A body cap small enough that the tests run fast, far above any line here.
const TEST_CAP: u64 = 1 << 20;

fn small_limits() -> ScrapeLimits {
    ScrapeLimits {
        max_body_bytes: TEST_CAP,
        ..ScrapeLimits::default()
    }
}

async fn scrape_error(limits: ScrapeLimits, what: Hostile) -> String {
    let scraper = Scraper::new(Duration::from_secs(60), limits).unwrap();
    let result = scraper.scrape("hostile", &url(hostile_target(what))).await;
    let error = result
        .outcome
        .clone()
        .expect_err("a hostile target cannot be up");
    // The target shows as down with that error.
    let mut tracker = TargetTracker::new("hostile", "x");
    tracker.observe(&result, &MetricNames::default());
    assert_eq!(
        tracker.status().status,
        SourceStatus::Down {
            error: error.clone()
        }
    );
    error
}

#[tokio::test]
async fn an_endless_line_is_refused_as_too_large() {
    let limits = ScrapeLimits {
        max_line_bytes: 4096,
        ..small_limits()
    };
    let error = scrape_error(limits, Hostile::EndlessLine).await;
    assert!(error.starts_with(TOO_LARGE), "{error}");
    assert!(error.contains("a line longer than 4096 bytes"), "{error}");
    // Without a line cap below it, the body cap ends it.
    let limits = ScrapeLimits {
        max_line_bytes: usize::MAX,
        ..small_limits()
    };
    let error = scrape_error(limits, Hostile::EndlessLine).await;
    assert_eq!(error, format!("{TOO_LARGE}: more than {TEST_CAP} bytes"));
}

#[tokio::test]
async fn endless_valid_samples_are_refused_at_the_sample_or_byte_cap() {
    let limits = ScrapeLimits {
        max_samples: 1000,
        ..small_limits()
    };
    let error = scrape_error(limits, Hostile::EndlessSamples).await;
    assert!(error.starts_with(TOO_LARGE), "{error}");
    assert!(error.contains("more than 1000 samples"), "{error}");
    let error = scrape_error(small_limits(), Hostile::EndlessSamples).await;
    assert_eq!(error, format!("{TOO_LARGE}: more than {TEST_CAP} bytes"));
}

#[tokio::test]
async fn a_gigantic_announced_body_is_refused_before_reading_it() {
    let error = scrape_error(ScrapeLimits::default(), Hostile::Announced).await;
    assert_eq!(
        error,
        format!(
            "{TOO_LARGE}: more than {} bytes",
            ScrapeLimits::default().max_body_bytes
        )
    );
}

/// `/proc/<pid>/status`'s `VmHWM` (peak resident set), in KiB.
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Run `snapshot` against `target` and follow its peak RSS until it exits; returns
/// (peak KiB, stdout).
fn snapshot_peak(target: &str, extra: &[&str], home: &Path) -> (u64, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemwatch"))
        .arg("snapshot")
        .args(["--json", "--target", target, "--spacing", "1s"])
        .args(["--db", &format!("sqlite://{}", home.join("x.db").display())])
        .args(extra)
        .env("XDG_CONFIG_HOME", home.join("config"))
        .env("IDEMWATCH_LOG_FILE", home.join("idemwatch.log"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run idemwatch");
    let pid = child.id();
    let mut peak = 0;
    let started = Instant::now();
    loop {
        if let Some(kib) = peak_rss_kib(pid) {
            peak = peak.max(kib);
        }
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("snapshot did not finish within two minutes");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut stdout = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    (peak, stdout)
}

#[test]
fn snapshot_memory_stays_bounded_whatever_a_target_sends() {
    let home = tempfile::tempdir().unwrap();
    let cap = TEST_CAP.to_string();
    let max_samples = 20_000;
    let config = home.path().join("config.toml");
    std::fs::write(&config, format!("scrape_max_samples = {max_samples}\n")).unwrap();
    let config = config.display().to_string();
    // What the same snapshot costs against a target that is simply down.
    let (baseline, _) = snapshot_peak(
        "quiet=http://127.0.0.1:1/metrics",
        &["--config", &config, "--scrape-max-bytes", &cap],
        home.path(),
    );
    assert!(baseline > 0, "no VmHWM read from /proc");
    for what in [
        Hostile::EndlessLine,
        Hostile::EndlessSamples,
        Hostile::Announced,
    ] {
        let target = format!("hostile={}", url(hostile_target(what)));
        let (peak, stdout) = snapshot_peak(
            &target,
            &["--config", &config, "--scrape-max-bytes", &cap],
            home.path(),
        );
        let doc: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON document");
        let t = &doc["targets"][0];
        assert_eq!(t["status"], "down", "{what:?}: {t}");
        let error = t["error"].as_str().unwrap_or_default();
        assert!(error.starts_with(TOO_LARGE), "{what:?}: {error}");
        // The body is parsed as it arrives and never kept: what a scrape may hold
        // is a line and the parsed samples, each at most its cap. Twice that for
        // the samples' vector growth and the client's buffers, and twice again for
        // the allocator (without caps an endless line took hundreds of MiB within
        // a few seconds).
        let held = TEST_CAP + (max_samples * std::mem::size_of::<Sample>()) as u64;
        let added = peak.saturating_sub(baseline) * 1024;
        assert!(
            added < 4 * held,
            "{what:?}: peak RSS {peak} KiB, {baseline} KiB against a down target"
        );
        eprintln!("{what:?}: peak RSS {peak} KiB ({baseline} KiB against a down target)");
    }
}

/// A well-formed page of `bytes` bytes or a little more (distinct series), with its
/// Content-Length, to every request: over a small cap, far under the default one.
fn sized_target(bytes: usize) -> SocketAddr {
    let mut body = String::new();
    while body.len() < bytes {
        body.push_str(&format!("idem_sized{{i=\"{}\"}} 1\n", body.len()));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            let body = std::sync::Arc::new(body);
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let body = body.clone();
                tokio::spawn(async move {
                    let mut head = [0u8; 4096];
                    let _ = stream.read(&mut head).await;
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
                         Content-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.write_all(body.as_bytes()).await;
                });
            }
        });
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the target starts")
}

/// The dashboard in a real terminal with `--scrape-max-bytes 64KiB`: a 200 KiB page
/// (16 MiB is the default cap) shows as down, "response too large"; a small one
/// beside it is up.
#[test]
fn the_dashboard_takes_the_scrape_body_cap_from_its_flag() {
    use common::tmux::Tmux;

    let env = common::TempEnv::new();
    let big = url(sized_target(200 * 1024));
    let small = url(sized_target(100));
    let config = env.path("watch.toml");
    std::fs::write(
        &config,
        format!(
            "poll_interval = \"500ms\"\n[[targets]]\nname = \"big\"\nurl = \"{big}\"\n\
             [[targets]]\nname = \"small\"\nurl = \"{small}\"\n"
        ),
    )
    .unwrap();
    let command = format!(
        "IDEMWATCH_LOG_FILE={log} {bin} --config {cfg} --scrape-max-bytes 64KiB; sleep 600",
        log = env.path("tui.log").display(),
        bin = common::idemwatch_bin().display(),
        cfg = config.display()
    );
    let Some(t) = Tmux::start(&env, &command, 200, 40) else {
        return;
    };
    let screen = t.wait_for("big down, small up", Duration::from_secs(40), |s| {
        s.contains("small up") && s.contains("big DOWN")
    });
    // The sources panel shows the error as far as its width allows.
    assert!(
        screen.contains(&format!("{TOO_LARGE}: more than 65536")),
        "{screen}"
    );
    t.keys(&["q"]);
}
