//! The operator's commands around retention and claims (issue 14): the purge floor,
//! and `claims list` / `claims resolve`.

mod common;

use common::{run_cli, TempEnv};

/// `purge --older-than` below max(claim lease, visibility x max deliveries, 1h) is
/// refused with exit 2 and the reason, unless --force; huge durations are a clear
/// error, never a panic.
#[test]
fn purge_below_the_floor_is_refused_unless_forced() {
    let env = TempEnv::new();
    let (code, out, err) = run_cli(&env, &["purge", "--older-than", "10m"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("purge floor of 1h"), "{err}");
    assert!(err.contains("--force"), "{err}");
    assert!(
        !env.path("idemwatch.db").exists(),
        "refused before the database is opened"
    );

    let (code, out, err) = run_cli(&env, &["purge", "--older-than", "10m", "--force", "--json"]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect(&out);
    assert_eq!(doc["deleted"], 0);

    let (code, _, err) = run_cli(&env, &["purge", "--older-than", "2h"]);
    assert_eq!(code, 0, "{err}");

    // The floor follows the consumers' settings: 10m x 10 deliveries = 100m.
    let (code, _, err) = run_cli(
        &env,
        &[
            "purge",
            "--older-than",
            "90m",
            "--visibility-timeout",
            "10m",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("purge floor of 1h 40m"), "{err}");
    let (code, _, err) = run_cli(
        &env,
        &["purge", "--older-than", "3h", "--claim-lease", "4h"],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("purge floor of 4h"), "{err}");
}

#[test]
fn huge_purge_durations_are_a_clear_error() {
    let env = TempEnv::new();
    for huge in ["300000y", "100000000000y", "99999999999999999999999s"] {
        let (code, out, err) = run_cli(&env, &["purge", "--older-than", huge]);
        assert_eq!(code, 2, "{huge}: {out}{err}");
        assert!(!err.contains("panicked"), "{huge}: {err}");
        assert!(err.contains("older-than"), "{huge}: {err}");
    }
}
