//! Every drill of the SPEC table, in both modes: the idempotent design passes with
//! the SPEC's figures, the naive one shows the harm.

mod common;

use common::{run_cli, TempEnv};
use idemwatch::drills::{self, DrillOptions, DrillReport, Scenario, Verdict};
use idemwatch::engine::consumers::ConsumerMode;
use idemwatch::engine::store::{self, MarkerKind};

async fn drill(env: &TempEnv, scenario: Scenario, mode: ConsumerMode) -> DrillReport {
    let mut opts = DrillOptions::new(scenario, &env.db_url(), &env.queue_url());
    opts.mode = mode;
    drills::run(opts).await.expect("drill runs")
}

fn failed_checks(r: &DrillReport) -> Vec<String> {
    r.details["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["ok"] == false)
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redelivered_zone_exit_sends_one_sms() {
    let env = TempEnv::new();
    let r = drill(&env, Scenario::CrashBeforeAck, ConsumerMode::Idempotent).await;
    assert_eq!(r.verdict, Verdict::Pass, "{}", r.render_text());
    assert_eq!(
        (
            r.times,
            r.deliveries,
            r.sms_sent,
            r.duplicate_dropped,
            r.counter_delta
        ),
        (7, 7, 1, 6, 1)
    );
    assert_eq!(r.exit_code(), 0);
    // The drill left its trace: a drill_runs row and a drill marker.
    let store = store::open(&env.db_url()).await.unwrap();
    let runs = store.drill_runs(10).await.unwrap();
    assert_eq!(runs[0].verdict.as_deref(), Some("pass"));
    assert_eq!(runs[0].report.as_ref().unwrap()["sms_sent"], 1);
    let markers = store.markers(10).await.unwrap();
    assert_eq!(markers[0].kind, MarkerKind::Drill);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn naive_consumer_sends_seven_sms() {
    let env = TempEnv::new();
    let r = drill(&env, Scenario::CrashBeforeAck, ConsumerMode::Naive).await;
    assert_eq!(r.verdict, Verdict::Fail);
    assert_eq!(
        (r.sms_sent, r.counter_delta, r.duplicate_dropped),
        (7, 7, 0)
    );
    assert_eq!(
        r.exit_code(),
        0,
        "a naive drill failing is the demonstration, not an error"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_after_send_resends_with_the_same_provider_key() {
    let env = TempEnv::new();
    let r = drill(&env, Scenario::CrashAfterSend, ConsumerMode::Idempotent).await;
    assert_eq!(r.verdict, Verdict::Pass, "{}", r.render_text());
    assert_eq!(r.sms_sent, 1);
    let keys = r.details["provider_keys"].as_array().unwrap();
    assert_eq!(keys.len(), 2);
    assert!(keys[0].is_string() && keys[0] == keys[1]);
    assert_eq!(r.details["claim"]["state"], "sent");
    assert_eq!(r.details["claim"]["attempts"], 2);

    let naive = drill(&env, Scenario::CrashAfterSend, ConsumerMode::Naive).await;
    assert_eq!(
        naive.sms_sent, 2,
        "without the key the provider sends twice"
    );
    assert_eq!(naive.verdict, Verdict::Fail);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn producer_double_publish_is_one_event() {
    let env = TempEnv::new();
    let r = drill(&env, Scenario::DoublePublish, ConsumerMode::Idempotent).await;
    assert_eq!(r.verdict, Verdict::Pass, "{}", r.render_text());
    assert_eq!(
        (r.sms_sent, r.counter_delta, r.duplicate_dropped),
        (1, 1, 1)
    );
    let naive = drill(&env, Scenario::DoublePublish, ConsumerMode::Naive).await;
    assert_eq!((naive.sms_sent, naive.counter_delta), (2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicate_loses_through_the_unique_constraint() {
    let env = TempEnv::new();
    let r = drill(
        &env,
        Scenario::ConcurrentDuplicate,
        ConsumerMode::Idempotent,
    )
    .await;
    assert_eq!(r.verdict, Verdict::Pass, "{}", r.render_text());
    assert_eq!(
        (r.sms_sent, r.counter_delta, r.duplicate_dropped),
        (1, 1, 1)
    );
    let naive = drill(&env, Scenario::ConcurrentDuplicate, ConsumerMode::Naive).await;
    assert_eq!((naive.sms_sent, naive.counter_delta), (2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn late_ignition_on_does_not_revive_vehicle() {
    let env = TempEnv::new();
    let r = drill(&env, Scenario::OutOfOrder, ConsumerMode::Idempotent).await;
    assert_eq!(r.verdict, Verdict::Pass, "{}", r.render_text());
    assert!(r.state_ok);
    assert_eq!(r.details["state"]["ignition"], "off");
    let history = r.details["history"].as_array().unwrap();
    assert_eq!(history.len(), 2);
    let late = history.iter().find(|h| h["seq"] == 900).unwrap();
    assert_eq!(late["applied"], false);

    let naive = drill(&env, Scenario::OutOfOrder, ConsumerMode::Naive).await;
    assert!(!naive.state_ok);
    assert_eq!(naive.details["state"]["ignition"], "on", "the ghost engine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn same_key_other_payload_is_dead_lettered_not_dropped() {
    let env = TempEnv::new();
    let r = drill(&env, Scenario::KeyConflict, ConsumerMode::Idempotent).await;
    assert_eq!(r.verdict, Verdict::Pass, "{}", r.render_text());
    assert_eq!(
        (r.dead_lettered, r.duplicate_dropped, r.sms_sent),
        (1, 0, 1)
    );
    let store = store::open(&env.db_url()).await.unwrap();
    let dead = store.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 3, "one per consumer");
    assert!(dead.iter().all(|d| d.reason == "key_conflict"));
    assert!(dead
        .iter()
        .all(|d| String::from_utf8_lossy(&d.raw).contains("\"zone\":\"Y\"")));

    let naive = drill(&env, Scenario::KeyConflict, ConsumerMode::Naive).await;
    assert_eq!((naive.sms_sent, naive.dead_lettered), (2, 0));
    assert!(failed_checks(&naive)
        .iter()
        .any(|c| c.contains("key_conflict")));
}

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

        args.extend(["--mode", "naive"]);
        let (code, r) = cli_drill(&env, &args);
        assert_eq!(code, 0);
        assert_eq!(r["sms_sent"], 7, "{r}");
        assert_eq!(r["counter_delta"], 7);
        assert_eq!(r["verdict"], "fail");
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
