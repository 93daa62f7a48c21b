//! Every file under tests/valid_configs loads; every file under
//! tests/invalid_configs fails with a message naming the file and what to fix
//! (its first line says `# expect: TEXT`). The shipped example loads too.

use std::path::{Path, PathBuf};

use idemwatch_monitor::config::Config;

fn fixtures(dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("fixture dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "too few fixtures in {}", dir.display());
    files
}

#[test]
fn every_valid_config_loads() {
    for path in fixtures("valid_configs") {
        if let Err(e) = Config::load(&path) {
            panic!("{} should load: {e}", path.display());
        }
    }
}

#[test]
fn every_invalid_config_fails_with_a_useful_message() {
    for path in fixtures("invalid_configs") {
        let text = std::fs::read_to_string(&path).unwrap();
        let expect = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{} lacks an '# expect:' line", path.display()));
        match Config::load(&path) {
            Ok(_) => panic!("{} should be refused", path.display()),
            Err(e) => {
                let message = e.to_string();
                assert!(
                    message.contains(&path.display().to_string()),
                    "message does not name the file: {message}"
                );
                assert!(
                    message.contains(expect),
                    "{}: expected {expect:?} in: {message}",
                    path.display()
                );
                assert!(!message.contains("hunter2"), "a secret leaked: {message}");
            }
        }
    }
}

#[test]
fn the_shipped_example_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/config.example.toml");
    let config = Config::load(&path).expect("the example config loads");
    assert_eq!(config.targets.len(), 2);
    assert!(!config.drills.allow_live);
}

#[test]
fn mapping_and_overrides_are_read() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/valid_configs");
    let c = Config::load(&dir.join("own_dedup_table.toml")).unwrap();
    let db = c.database.unwrap();
    assert_eq!(db.tables.processed_messages.table, "inbox");
    assert_eq!(db.tables.processed_messages.processed_at, "done_at");
    assert_eq!(
        db.tables.vehicle_state.table, "vehicle_state",
        "default kept"
    );
    assert_eq!(db.retention, std::time::Duration::from_secs(3 * 86400));
    let c = Config::load(&dir.join("other_exporter.toml")).unwrap();
    assert_eq!(c.metrics.consumer_label, "handler");
    assert_eq!(c.metrics.redelivered, "idem_messages_redelivered_total");
    assert!(c.drills.allow_live);
    assert_eq!(
        c.drills.metrics_url.as_deref(),
        Some("https://billing.internal:8443/metrics")
    );
    assert!(c
        .drills
        .queue
        .as_deref()
        .is_some_and(|q| q.starts_with("amqp://")));
}

/// `[engine]` and `[queue]` become the engine's deadlines; a config without them
/// has the defaults the example names.
#[test]
fn the_engine_deadlines_are_read_and_default_as_the_example_says() {
    use idemwatch_engine::deadlines::Deadlines;
    use std::time::Duration;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/valid_configs");
    let c = Config::load(&dir.join("engine_deadlines.toml")).unwrap();
    assert_eq!(
        c.deadlines(),
        Deadlines {
            statement_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            acquire_timeout: Duration::from_secs(3),
            heartbeat: Duration::from_secs(4),
        }
    );
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/config.example.toml");
    assert_eq!(
        Config::load(&example).unwrap().deadlines(),
        Deadlines::default()
    );
    assert_eq!(Config::default().deadlines(), Deadlines::default());
    assert_eq!(
        Deadlines::default().statement_timeout,
        Duration::from_secs(20)
    );
}

/// The deploy budget's keys: the example states the defaults, a consumer's own
/// budget wins over the default for it alone, and an unusable value names its key.
#[test]
fn the_deploy_budget_is_read_with_per_consumer_overrides() {
    use std::time::Duration;
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/config.example.toml");
    let alerts = Config::load(&example).unwrap().alerts;
    assert_eq!(alerts, idemwatch_monitor::config::AlertRules::default());
    assert_eq!(alerts.deploy_duplicate_budget, 0.004);
    assert_eq!(alerts.deploy_settle_time, Duration::from_secs(600));
    let path = Path::new("inline.toml");
    let c = Config::from_toml(
        "[alerts]\ndeploy_duplicate_budget = 0.002\ndeploy_settle_time = \"5m\"\n\
         [alerts.deploy_duplicate_budget_by_consumer]\nzone-exit-sms = 0.0005\n",
        path,
    )
    .unwrap();
    assert_eq!(c.alerts.deploy_budget_of("zone-exit-sms"), 0.0005);
    assert_eq!(c.alerts.deploy_budget_of("trip-counter"), 0.002);
    assert_eq!(c.alerts.deploy_settle_time, Duration::from_secs(300));
    for (text, key) in [
        (
            "[alerts]\ndeploy_duplicate_budget = 0.0\n",
            "alerts.deploy_duplicate_budget",
        ),
        (
            "[alerts]\ndeploy_duplicate_budget = 4.0\n",
            "alerts.deploy_duplicate_budget",
        ),
        (
            "[alerts.deploy_duplicate_budget_by_consumer]\nsms = -1.0\n",
            "alerts.deploy_duplicate_budget_by_consumer.sms",
        ),
        (
            "[alerts]\ndeploy_settle_time = \"10s\"\n",
            "alerts.deploy_settle_time",
        ),
    ] {
        let err = Config::from_toml(text, path).unwrap_err().to_string();
        assert!(err.contains(key), "{text}: {err}");
    }
}
