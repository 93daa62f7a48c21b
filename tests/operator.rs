//! The operator's commands around retention and claims (issue 14): the purge floor,
//! and `claims list` / `claims resolve`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::backends::TestDb;
use common::{counted_since, run_cli, zone_exit, TempEnv};
use idemwatch::engine::consumers::zone_exit_sms;
use idemwatch::engine::crash::{CrashPlan, CrashPoint, CrashStyle};
use idemwatch::engine::envelope::Envelope;
use idemwatch::engine::metrics::ConsumerCounts;
use idemwatch::engine::runner::RunnerSettings;
use idemwatch::engine::store::{self, ClaimState};
use idemwatch::engine::{Engine, EngineConfig};
use idemwatch::sim::sandbox_provider::{self, SandboxHandle};
use idemwatch_testkit::on_every_backend;

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

/// A consumer dropped a duplicate whose key had been processed 3 h before (kept by
/// the store in `duplicate_ages`): `purge --older-than 2h` is refused with exit 2,
/// naming the consumer and the age, and deletes nothing; `--force` purges; a
/// retention above the oldest duplicate is allowed.
#[test]
fn purge_below_the_oldest_duplicate_is_refused_unless_forced() {
    let env = TempEnv::new();
    let url = format!("sqlite://{}", env.path("ages.db").display());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(store::open(&url)).unwrap();
    rt.block_on(store.note_duplicate_age("trip-counter", 3.0 * 3600.0))
        .unwrap();
    let e = zone_exit("34-PA-1", 1);
    let write = store::BusinessWrite::CountZoneExit {
        device_id: "34-PA-1".into(),
    };
    rt.block_on(store.record_once("trip-counter", &e.key(), &e.fingerprint(), &write))
        .unwrap();
    let purge = |older_than: &str, force: bool| {
        let mut args = vec!["purge", "--older-than", older_than, "--db", &url, "--json"];
        if force {
            args.push("--force");
        }
        run_cli(&env, &args)
    };
    let (code, out, err) = purge("2h", false);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("oldest duplicate trip-counter"), "{err}");
    assert!(err.contains("3h") && err.contains("--force"), "{err}");
    let kept = rt
        .block_on(store.processed_keys("trip-counter", ""))
        .unwrap();
    assert_eq!(kept.len(), 1, "refused before any row went");

    let (code, out, err) = purge("4h", false);
    assert_eq!(code, 0, "{out}{err}");
    // Forced below it: the purge runs (the row, younger than 2h, stays).
    let (code, out, err) = purge("2h", true);
    assert_eq!(code, 0, "{out}{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect(&out);
    assert_eq!(doc["deleted"], 0, "the row is younger than 2h: {doc}");
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

// ---- claims: the sweeper, list and resolve ----------------------------------------

on_every_backend!(
    an_expired_claim_is_redriven_with_its_provider_key_without_a_redelivery,
    serve_finishes_a_claim_left_in_doubt_by_itself,
    purge_from_the_command_line_keeps_a_claim_in_doubt_and_takes_finished_ones,
    a_refusal_the_sweeper_meets_is_dead_lettered_and_counted_once,
);

/// An engine of the SMS consumer alone with a short claim lease, and its sandbox.
async fn sms_engine(db: &TestDb, lease: Duration) -> (Engine, SandboxHandle) {
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let mut cfg = EngineConfig::new(&db.url, &db.queue_url(), &sandbox.url(), &sandbox.url());
    cfg.consumers = vec![zone_exit_sms::NAME.into()];
    cfg.claim_lease = lease;
    cfg.runner = RunnerSettings {
        lease_batch: 1,
        idle_poll: Duration::from_millis(5),
        ..RunnerSettings::default()
    };
    (Engine::open(&cfg).await.unwrap(), sandbox)
}

/// A worker dies at `point` handling `env`, then the queue loses the message: the
/// claim is left `claimed` with no redelivery to come.
async fn strand(engine: &Engine, env: &Envelope, point: CrashPoint) {
    engine
        .publish(&[env.to_json_line().into_bytes()])
        .await
        .unwrap();
    let dies = Arc::new(CrashPlan::at(point, 1, CrashStyle::Unwind));
    let worker = engine.worker(zone_exit_sms::NAME, dies, None).unwrap();
    assert!(worker.run_until_idle().await.is_err(), "the worker died");
    engine
        .queue
        .purge_queue(&engine.queue_name(zone_exit_sms::NAME))
        .await
        .unwrap();
    let claim = engine
        .store
        .claim(zone_exit_sms::NAME, &env.key())
        .await
        .unwrap()
        .expect("a claim");
    assert_eq!(claim.state, ClaimState::Claimed);
}

async fn an_expired_claim_is_redriven_with_its_provider_key_without_a_redelivery(db: &TestDb) {
    let lease = Duration::from_millis(300);
    let (engine, sandbox) = sms_engine(db, lease).await;
    let env = zone_exit("34-SW-1", 1);
    // The SMS went out; the worker died before recording it.
    strand(&engine, &env, CrashPoint::AfterSideEffect).await;
    assert_eq!(sandbox.state().sent_sms().len(), 1);
    // Within the lease the claim is not in doubt: nothing to do.
    let early = engine.sweep_claims().await.unwrap();
    assert_eq!(early.in_doubt, 0, "{early:?}");
    tokio::time::sleep(lease * 2).await;
    let before = engine.summary().consumers[zone_exit_sms::NAME].clone();
    let swept = engine.sweep_claims().await.unwrap();
    assert_eq!((swept.in_doubt, swept.finished), (1, 1), "{swept:?}");
    // Finished by the sweep, counted as processed once (the runner never counted
    // it: its worker died), the resend as a provider replay: the provider's second
    // call for the key, the sweeper's (`idem_provider_repeat_calls_total`).
    let after = &engine.summary().consumers[zone_exit_sms::NAME];
    assert_eq!(
        counted_since(&before, after),
        ConsumerCounts {
            processed: 1,
            side_effects_suppressed: 1,
            provider_repeat_calls: 1,
            ..ConsumerCounts::default()
        }
    );
    assert!(engine.metrics.encode().contains(&format!(
        "idem_provider_repeat_calls_total{{consumer=\"{}\",reason=\"sweeper_redrive\"}} 1",
        zone_exit_sms::NAME
    )));
    assert!(engine.metrics.encode().contains(&format!(
        "idem_messages_processed_total{{consumer=\"{}\"}} {}",
        zone_exit_sms::NAME,
        after.processed
    )));
    let claim = engine
        .store
        .claim(zone_exit_sms::NAME, &env.key())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claim.state, ClaimState::Sent);
    assert_eq!(claim.attempts, 2);
    // The resend carried the claim's provider key, so the provider replayed its
    // first answer: one SMS.
    let requests = sandbox.state().sms_requests();
    assert_eq!(requests.len(), 2);
    assert!(requests
        .iter()
        .all(|r| r.idempotency_key.as_deref() == Some(claim.provider_key.as_str())));
    assert!(requests[1].replayed);
    assert_eq!(sandbox.state().sent_sms().len(), 1);
    // Nothing left in doubt: a second sweep finds nothing.
    assert_eq!(engine.sweep_claims().await.unwrap().in_doubt, 0);
}

/// `idemwatch purge` as an operator runs it (the binary, batches of one row), beside
/// a claim in doubt whose SMS already went out: the claim and its dedup row stay, so
/// the message's redelivery after the purge resends under the claim's own provider
/// key and the provider replays (one SMS, not two); the finished claims go with their
/// rows. A second test of the purge's rule beside the conformance suite's, through
/// the command line and an actual redelivery instead of the store's own digest.
async fn purge_from_the_command_line_keeps_a_claim_in_doubt_and_takes_finished_ones(db: &TestDb) {
    let lease = Duration::from_millis(300);
    let (engine, sandbox) = sms_engine(db, lease).await;
    let device = "34-PCL-1";
    let in_doubt = zone_exit(device, 1);
    // The oldest row: the SMS went out, the worker died before recording it.
    strand(&engine, &in_doubt, CrashPoint::AfterSideEffect).await;
    let finished: Vec<Envelope> = (2..=4).map(|seq| zone_exit(device, seq)).collect();
    let bodies: Vec<Vec<u8>> = finished
        .iter()
        .map(|e| e.to_json_line().into_bytes())
        .collect();
    engine.publish(&bodies).await.unwrap();
    let worker = engine
        .worker(zone_exit_sms::NAME, Arc::new(CrashPlan::none()), None)
        .unwrap();
    worker.run_until_idle().await.unwrap();
    assert_eq!(sandbox.state().sent_sms().len(), 4);
    let provider_key = engine
        .store
        .claim(zone_exit_sms::NAME, &in_doubt.key())
        .await
        .unwrap()
        .expect("the claim in doubt")
        .provider_key;

    // Every row is older than the cutoff (timestamps are kept to the microsecond at
    // least; two seconds leave room for a server's rounding).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let json = |out: &str| -> serde_json::Value { serde_json::from_str(out).expect(out) };
    let purge = [
        "purge",
        "--db",
        &db.url,
        "--older-than",
        "1s",
        "--force",
        "--batch",
        "1",
        "--no-vacuum",
        "--json",
    ];
    let (code, out, err) = run_cli(&db.env, &purge);
    assert_eq!(code, 0, "{out}{err}");
    let done = json(&out);
    assert_eq!(
        (done["deleted"].as_u64(), done["interrupted"].as_bool()),
        (Some(3), Some(false)),
        "the finished rows, in batches of one past the held one: {done}"
    );
    let (code, out, err) = run_cli(
        &db.env,
        &["claims", "list", "--all", "--json", "--db", &db.url],
    );
    assert_eq!(code, 0, "{err}");
    let left = json(&out);
    assert_eq!(
        left["count"], 1,
        "finished claims go with their rows: {left}"
    );
    assert_eq!(left["claims"][0]["message_key"], in_doubt.key().as_str());
    assert_eq!(left["claims"][0]["state"], "claimed");
    let digest = engine.store.digest().await.unwrap();
    assert_eq!(digest.processed.len(), 1, "{:?}", digest.processed);
    assert_eq!(digest.processed[0].1, in_doubt.key().as_str());
    // Rerunning finds nothing more.
    let (code, out, err) = run_cli(&db.env, &purge);
    assert_eq!(
        (code, json(&out)["deleted"].as_u64()),
        (0, Some(0)),
        "{err}"
    );

    // The queue brings the message in doubt back after the purge, its lease over.
    tokio::time::sleep(lease * 2).await;
    engine
        .publish(&[in_doubt.to_json_line().into_bytes()])
        .await
        .unwrap();
    worker.run_until_idle().await.unwrap();
    let claim = engine
        .store
        .claim(zone_exit_sms::NAME, &in_doubt.key())
        .await
        .unwrap()
        .expect("the claim");
    assert_eq!(
        (claim.state, claim.attempts, claim.provider_key.as_str()),
        (ClaimState::Sent, 2, provider_key.as_str()),
        "taken over in doubt with its own provider key"
    );
    let to_it: Vec<_> = sandbox
        .state()
        .sms_requests()
        .into_iter()
        .filter(|r| r.idempotency_key.as_deref() == Some(provider_key.as_str()))
        .collect();
    assert_eq!(to_it.len(), 2, "{to_it:?}");
    assert!(to_it[1].replayed, "the provider replayed its first answer");
    assert_eq!(sandbox.state().sent_sms().len(), 4, "one SMS per message");
}

/// The sweeper counts a refusal it dead-letters as the runner would
/// (`idem_dead_lettered_total{reason}`): its worker died, so nothing else ever counts
/// that message. The provider refuses the sweep's send for good: one
/// `provider_rejected` letter, counted once, and the claim closed `failed`, so a
/// second sweep neither resends nor counts it again.
async fn a_refusal_the_sweeper_meets_is_dead_lettered_and_counted_once(db: &TestDb) {
    let lease = Duration::from_millis(300);
    let (engine, sandbox) = sms_engine(db, lease).await;
    let sms = zone_exit_sms::NAME;
    let env = zone_exit("34-SW-3", 1);
    // Died after the claim, before the provider call: nothing went out.
    strand(&engine, &env, CrashPoint::AfterClaim).await;
    sandbox.state().reject_next(1);
    tokio::time::sleep(lease * 2).await;
    let counted =
        format!("idem_dead_lettered_total{{consumer=\"{sms}\",reason=\"provider_rejected\"}}");
    assert!(engine.metrics.encode().contains(&format!("{counted} 0")));
    let before = engine.summary().consumers[sms].clone();
    let swept = engine.sweep_claims().await.unwrap();
    assert_eq!(
        (swept.in_doubt, swept.finished, swept.dead_lettered),
        (1, 0, 1),
        "{swept:?}"
    );
    for _ in 0..2 {
        assert_eq!(
            counted_since(&before, &engine.summary().consumers[sms]),
            ConsumerCounts {
                dead_lettered: 1,
                side_effects_failed: 1,
                ..ConsumerCounts::default()
            }
        );
        assert!(engine.metrics.encode().contains(&format!("{counted} 1")));
        let dead = engine.store.dead_letters(10).await.unwrap();
        assert_eq!(dead.len(), 1, "{dead:?}");
        assert_eq!(
            (dead[0].reason.as_str(), &dead[0].raw),
            ("provider_rejected", &env.to_json_line().into_bytes())
        );
        let claim = engine.store.claim(sms, &env.key()).await.unwrap().unwrap();
        assert_eq!(claim.state, ClaimState::Failed);
        assert_eq!(sandbox.state().sms_requests().len(), 1);
        assert!(sandbox.state().sent_sms().is_empty());
        // Nothing left in doubt: the next sweep finds nothing.
        assert_eq!(engine.sweep_claims().await.unwrap().in_doubt, 0);
    }
}

async fn serve_finishes_a_claim_left_in_doubt_by_itself(db: &TestDb) {
    let lease = Duration::from_millis(300);
    let (engine, sandbox) = sms_engine(db, lease).await;
    let env = zone_exit("34-SW-2", 1);
    // Died after the claim, before the provider call: nothing went out.
    strand(&engine, &env, CrashPoint::AfterClaim).await;
    assert!(sandbox.state().sent_sms().is_empty());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = engine.run(1, Arc::new(CrashPlan::none()), stopped);
    let watch = async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let claim = engine
                .store
                .claim(zone_exit_sms::NAME, &env.key())
                .await
                .unwrap();
            if claim.is_some_and(|c| c.state == ClaimState::Sent) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the claim was never finished"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = stop.send(true);
    };
    let (ran, ()) = tokio::join!(running, watch);
    ran.unwrap();
    let sent = sandbox.state().sent_sms();
    assert_eq!(sent.len(), 1);
    let claim = engine
        .store
        .claim(zone_exit_sms::NAME, &env.key())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        sent[0].idempotency_key.as_deref(),
        Some(claim.provider_key.as_str())
    );
}

/// `claims list` shows the open claim in doubt; `claims resolve` finishes it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_list_and_resolve_from_the_command_line() {
    let env = TempEnv::new();
    let stuck = zone_exit("34-CL-1", 5);
    {
        let st = store::open(&env.db_url()).await.unwrap();
        st.claim_side_effect(
            zone_exit_sms::NAME,
            &stuck.key(),
            &stuck.fingerprint(),
            "idemwatch-test-key",
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    }
    let json = |out: &str| -> serde_json::Value { serde_json::from_str(out).expect(out) };
    let (code, out, err) = run_cli(&env, &["claims", "list", "--json", "--claim-lease", "0s"]);
    assert_eq!(code, 0, "{err}");
    let listed = json(&out);
    assert_eq!(
        (listed["count"].as_u64(), listed["in_doubt"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(listed["claims"][0]["message_key"], stuck.key().as_str());
    assert_eq!(listed["claims"][0]["provider_key"], "idemwatch-test-key");
    let (code, out, _) = run_cli(&env, &["claims", "list"]);
    assert_eq!(code, 0);
    assert!(out.contains(stuck.key().as_str()), "{out}");

    let key = stuck.key().to_string();
    let resolve = [
        "claims",
        "resolve",
        "--consumer",
        zone_exit_sms::NAME,
        "--key",
        &key,
    ];
    let (code, out, err) = run_cli(
        &env,
        &[
            &resolve[..],
            &["--as", "sent", "--note", "in the provider's log", "--json"],
        ]
        .concat(),
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["state"], "sent");
    let (code, _, err) = run_cli(&env, &[&resolve[..], &["--as", "failed"]].concat());
    assert_eq!(code, 2, "only an open claim can be resolved");
    assert!(err.contains("already sent"), "{err}");
    let (code, _, err) = run_cli(
        &env,
        &[
            "claims",
            "resolve",
            "--consumer",
            zone_exit_sms::NAME,
            "--key",
            "nope:1:zone_exit",
            "--as",
            "sent",
        ],
    );
    assert_eq!(code, 2);
    assert!(err.contains("no claim"), "{err}");

    let (_, out, _) = run_cli(&env, &["claims", "list", "--json"]);
    assert_eq!(json(&out)["count"], 0);
    let (_, out, _) = run_cli(&env, &["claims", "list", "--all", "--json"]);
    let all = json(&out);
    assert_eq!(all["claims"][0]["state"], "sent");
    assert_eq!(
        all["claims"][0]["detail"],
        "resolved by an operator as sent: in the provider's log"
    );
}
