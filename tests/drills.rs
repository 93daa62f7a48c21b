//! Drills from the command line, as an operator runs them: JSON on stdout, exit
//! codes, and real child processes that abort. (Every scenario in both modes, on
//! every backend, is in `conformance.rs`.)

mod common;

use common::{run_cli, TempEnv};

fn cli_drill(env: &TempEnv, args: &[&str]) -> (i32, serde_json::Value) {
    let (code, stdout, stderr) = run_cli(env, args);
    let json = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!("stdout is not one JSON document ({e}): {stdout}\nstderr: {stderr}")
    });
    (code, json)
}

#[test]
fn cli_crash_before_ack_json_both_modes_in_process_and_killed() {
    let env = TempEnv::new();
    for kill in [false, true] {
        let mut args = vec!["drill", "crash-before-ack", "--times", "7", "--json"];
        if kill {
            args.push("--kill-process");
        }
        let (code, r) = cli_drill(&env, &args);
        assert_eq!(code, 0, "{r}");
        assert_eq!(r["verdict"], "pass", "{r}");
        assert_eq!(r["sms_sent"], 1);
        assert_eq!(r["duplicate_dropped"], 6);
        assert_eq!(r["counter_delta"], 1);
        assert_eq!(r["kill_process"], kill);
        // The verdict in Jepsen's terms (docs/CONTRACT.md §9), flat in the report.
        for (field, want) in [
            ("lost", 0.0),
            ("duplicated", 0.0),
            ("recovered", 2.0),
            ("ok_fraction", 1.0),
            ("provider_repeat_calls", 0.0),
        ] {
            assert_eq!(r[field].as_f64(), Some(want), "{field} in {r}");
        }

        args.extend(["--mode", "naive"]);
        let (code, r) = cli_drill(&env, &args);
        assert_eq!(code, 0);
        assert_eq!(r["sms_sent"], 7, "{r}");
        assert_eq!(r["counter_delta"], 7);
        assert_eq!(r["verdict"], "fail");
        assert_eq!(
            (r["duplicated"].as_u64(), r["lost"].as_u64()),
            (Some(2), Some(0))
        );
    }
}

#[test]
fn cli_crash_after_send_with_real_process_kills() {
    let env = TempEnv::new();
    let (code, r) = cli_drill(
        &env,
        &["drill", "crash-after-send", "--kill-process", "--json"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["verdict"], "pass");
    assert_eq!(r["sms_sent"], 1);
    let keys = r["details"]["provider_keys"].as_array().unwrap();
    assert!(
        keys.len() == 2 && keys[0].is_string() && keys[0] == keys[1],
        "{r}"
    );

    let (code, r) = cli_drill(
        &env,
        &[
            "drill",
            "crash-after-send",
            "--kill-process",
            "--mode",
            "naive",
            "--json",
        ],
    );
    assert_eq!(code, 0);
    assert_eq!(r["sms_sent"], 2, "{r}");
}

#[test]
fn cli_rejects_bad_usage_with_exit_2() {
    let env = TempEnv::new();
    let (code, _, stderr) = run_cli(&env, &["drill", "teleport"]);
    assert_eq!(code, 2, "{stderr}");
    let (code, _, stderr) = run_cli(&env, &["drill", "crash-before-ack", "--times", "0"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--times"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_concurrent_duplicate_passes_on_postgres_and_mariadb() {
    use common::backends::{Kind, TestDb};
    for kind in [Kind::Postgres, Kind::Mysql] {
        let Some(db) = TestDb::new(kind).await else {
            continue;
        };
        let queue = db.queue_url();
        let (code, r) = cli_drill(
            &db.env,
            &[
                "drill",
                "concurrent-duplicate",
                "--db",
                &db.url,
                "--queue",
                &queue,
                "--json",
            ],
        );
        assert_eq!(code, 0, "{kind:?}: {r}");
        assert_eq!(r["verdict"], "pass", "{kind:?}: {r}");
        assert_eq!(
            (r["sms_sent"].as_u64(), r["counter_delta"].as_i64()),
            (Some(1), Some(1))
        );
        db.cleanup().await;
    }
}
