//! A full disk (issue 39, item 5): SQLite (store and embedded queue) on a small
//! tmpfs of the test's own, and a PostgreSQL tablespace on one (the test's own
//! database only; the server's WAL and every other database stay where they are).
//! While the disk is full the consumer pauses as for an outage — no dead letter, no
//! delivery spent, nothing acked that was not committed — and once space is freed it
//! goes on by itself: every message counted exactly once.
//!
//! Needs root (mount); without it the tests say so and are skipped, or fail with
//! `IDEMWATCH_REQUIRE_SERVICES=1`.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::backends::required;
use common::jepsen::{Publish, Tally};
use idemwatch::engine::consumers::trip_counter;
use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::deadlines::Deadlines;
use idemwatch::engine::health::PauseCause;
use idemwatch::engine::runner::RunnerSettings;
use idemwatch::engine::{Engine, EngineConfig};
use sqlx::Connection;

/// A tmpfs of `size` mounted on a fresh directory, unmounted on drop.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(size: &str) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0755"),
                "idw-full",
            ])
            .arg(dir.path())
            .output();
        match out {
            Ok(o) if o.status.success() => Some(SmallDisk { dir }),
            other => {
                let why = match other {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                    Err(e) => e.to_string(),
                };
                if required() {
                    panic!("a tmpfs is required (IDEMWATCH_REQUIRE_SERVICES=1): {why}");
                }
                eprintln!("SKIP: cannot mount a tmpfs ({why}); run as root");
                None
            }
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fill what is left with a file of ours; its path, to free the space again.
    fn fill(&self) -> PathBuf {
        let filler = self.path().join("filler");
        let _ = Command::new("dd")
            .args(["if=/dev/zero", "bs=64k"])
            .arg(format!("of={}", filler.display()))
            .output();
        filler
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .output();
    }
}

fn zone_exit_line(device: &str) -> Vec<u8> {
    format!(
        r#"{{"device_id":"{device}","seq":1,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X","phone":"+905551112233"}}}}"#
    )
    .into_bytes()
}

/// The trip-counter on `db_url` and `queue_url`, every delivery its only one
/// (`max_deliveries` 1: a counted failure is a dead letter at once).
async fn engine(db_url: &str, queue_url: &str) -> Arc<Engine> {
    let mut cfg = EngineConfig::new(
        db_url,
        queue_url,
        "http://127.0.0.1:9",
        "http://127.0.0.1:9",
    );
    cfg.consumers = vec![trip_counter::NAME.into()];
    cfg.deadlines = Deadlines {
        statement_timeout: Duration::from_secs(2),
        ..Deadlines::default()
    };
    cfg.runner = RunnerSettings {
        lease_batch: 8,
        prefetch: 8,
        max_deliveries: 1,
        retry_delay: Duration::from_millis(50),
        max_pause: Duration::from_millis(500),
        visibility_timeout: Duration::from_secs(20),
        idle_poll: Duration::from_millis(20),
        ..RunnerSettings::default()
    };
    Arc::new(Engine::open(&cfg).await.expect("the engine opens"))
}

/// Publish `n` zone exits, run the consumer while `filler` fills the disk, check it
/// pauses for the full disk without a dead letter, free the space, and count.
async fn full_then_freed(engine: Arc<Engine>, disk: &SmallDisk, before: usize, n: usize) {
    if let Ok(filter) = std::env::var("FULL_DISK_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    }
    let devices: Vec<String> = (0..n).map(|i| format!("FULL-{i}")).collect();
    let bodies: Vec<Vec<u8>> = devices.iter().map(|d| zone_exit_line(d)).collect();
    engine.publish(&bodies[..before]).await.unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.run(1, Arc::new(CrashPlan::none()), stopped).await })
    };
    let processed = || engine.summary().consumers[trip_counter::NAME].processed;
    common::wait_for("the first messages", Duration::from_secs(60), || {
        processed() >= before as u64
    })
    .await;
    // The rest arrive, the disk fills: the embedded queue is on it too, so the
    // rest are published first.
    engine.publish(&bodies[before..]).await.unwrap();
    let filler = disk.fill();
    let pause = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Some(p) = engine.pause(trip_counter::NAME) {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let stuck_at = processed();
    // Held full a while: whatever it tries fails for want of space.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let held = engine.pause(trip_counter::NAME);
    assert!(
        engine
            .store
            .dead_letters(10)
            .await
            .map_or(true, |d| d.is_empty()),
        "no dead letter while the disk is full"
    );
    std::fs::remove_file(&filler).expect("free the space");
    common::wait_for(
        "every message after the space is back",
        Duration::from_secs(120),
        || processed() >= n as u64,
    )
    .await;
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("stops")
        .unwrap()
        .expect("no crash");

    let pause = pause.expect("paused while the disk was full");
    assert!(
        matches!(pause.cause, PauseCause::Store | PauseCause::Queue),
        "{pause:?}"
    );
    assert!(
        held.is_some() || stuck_at < n as u64,
        "the full disk held the consumer: {held:?}"
    );
    let published: Vec<(String, Publish)> = devices
        .iter()
        .map(|d| (d.clone(), Publish::Acked))
        .collect();
    let mut effects = HashMap::new();
    for d in &devices {
        let count = engine.store.zone_exits(d).await.unwrap();
        effects.insert(d.clone(), u64::try_from(count).unwrap_or(0));
    }
    let tally = Tally::of(&published, &effects);
    eprintln!("{pause:?}; {tally}");
    assert_eq!(
        (tally.lost, tally.duplicated, tally.ok),
        (0, 0, n),
        "{tally}"
    );
    let c = &engine.summary().consumers[trip_counter::NAME];
    assert_eq!((c.processed, c.dead_lettered), (n as u64, 0), "{c:?}");
    assert!(engine.store.dead_letters(10).await.unwrap().is_empty());
    assert!(
        engine.pause(trip_counter::NAME).is_none(),
        "resumed by itself"
    );
}

/// SQLite's store and the embedded queue on a 4 MiB tmpfs that fills up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_disk_under_sqlite_pauses_and_resumes_without_a_dead_letter() {
    let Some(disk) = SmallDisk::mount("4m") else {
        return;
    };
    let db = format!("sqlite://{}", disk.path().join("store.db").display());
    let queue = format!("sqlite://{}", disk.path().join("queue.db").display());
    let engine = engine(&db, &queue).await;
    full_then_freed(engine, &disk, 20, 300).await;
}

/// A PostgreSQL database whose tablespace is a 32 MiB tmpfs of the test's own (the
/// server's WAL stays on its own disk: only this database's tables run out).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_postgres_tablespace_pauses_and_resumes_without_a_dead_letter() {
    let admin = std::env::var("IDEMWATCH_PG_URL")
        .unwrap_or_else(|_| common::backends::PG_DEFAULT.to_string());
    let Ok(mut conn) = sqlx::PgConnection::connect(&admin).await else {
        if required() {
            panic!("PostgreSQL is required (IDEMWATCH_REQUIRE_SERVICES=1) at {admin}");
        }
        eprintln!("SKIP: PostgreSQL unreachable at {admin}");
        return;
    };
    let Some(disk) = SmallDisk::mount("32m") else {
        return;
    };
    // The tablespace's directory must belong to the server's user.
    let space = disk.path().join("pg");
    std::fs::create_dir(&space).unwrap();
    let chowned = Command::new("chown")
        .arg("postgres:postgres")
        .arg(&space)
        .output();
    assert!(chowned.is_ok_and(|o| o.status.success()), "chown postgres");
    let _ = Command::new("chmod").arg("0755").arg(disk.path()).output();
    let name = format!("idw_full_{}_{}", std::process::id(), rand::random::<u16>());
    struct Cleanup {
        admin: String,
        name: String,
    }
    impl Drop for Cleanup {
        fn drop(&mut self) {
            // Runs after the test's runtime: a blocking client of its own.
            let (admin, name) = (self.admin.clone(), self.name.clone());
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    if let Ok(mut c) = sqlx::PgConnection::connect(&admin).await {
                        for sql in [
                            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
                            format!("DROP TABLESPACE IF EXISTS {name}"),
                        ] {
                            let _ = sqlx::query(&sql).execute(&mut c).await;
                        }
                    }
                });
            })
            .join();
        }
    }
    for sql in [
        format!("CREATE TABLESPACE {name} LOCATION '{}'", space.display()),
        format!("CREATE DATABASE {name} TABLESPACE {name}"),
    ] {
        sqlx::query(&sql).execute(&mut conn).await.unwrap();
    }
    let _cleanup = Cleanup {
        admin: admin.clone(),
        name: name.clone(),
    };
    let mut url = url::Url::parse(&admin).unwrap();
    url.set_path(&format!("/{name}"));
    let queue_dir = tempfile::tempdir().unwrap();
    let queue = format!("sqlite://{}", queue_dir.path().join("queue.db").display());
    let engine = engine(url.as_str(), &queue).await;
    full_then_freed(engine.clone(), &disk, 20, 300).await;
    drop(engine);
}
