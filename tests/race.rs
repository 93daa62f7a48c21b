//! Two (or more) workers racing on the same keys never double an effect: real
//! concurrency (a multi-threaded runtime, several pool connections) on SQLite.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::TempEnv;
use idemwatch::engine::consumers::{trip_counter, zone_exit_sms};
use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::envelope::{Envelope, EventType, Fingerprint, MessageKey};
use idemwatch::engine::runner::RunnerSettings;
use idemwatch::engine::store::{self, BusinessWrite, ClaimOutcome, DedupOutcome};
use idemwatch::engine::{Engine, EngineConfig};
use idemwatch::sim::sandbox_provider::{self, SandboxClient};

fn zone_exit(device: &str, seq: u64) -> Envelope {
    Envelope::parse(
        format!(
            r#"{{"device_id":"{device}","seq":{seq},"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X","phone":"+905551112233"}}}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_workers_never_double_an_effect() {
    let env = TempEnv::new();
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let mut cfg = EngineConfig::new(
        &env.db_url(),
        &env.queue_url(),
        &sandbox.url(),
        &sandbox.url(),
    );
    cfg.consumers = vec![trip_counter::NAME.into(), zone_exit_sms::NAME.into()];
    cfg.runner = RunnerSettings {
        lease_batch: 1,
        retry_delay: Duration::from_millis(20),
        idle_poll: Duration::from_millis(5),
        ..RunnerSettings::default()
    };
    let engine = Engine::open(&cfg).await.unwrap();
    let keys = 60u64;
    // Every key published 3 times, copies adjacent so racing workers get them together.
    let bodies: Vec<Vec<u8>> = (0..keys)
        .flat_map(|k| {
            let line = zone_exit(&format!("34-R-{}", k % 6), k)
                .to_json_line()
                .into_bytes();
            [line.clone(), line.clone(), line]
        })
        .collect();
    engine.publish(&bodies).await.unwrap();
    let workers: Vec<_> = [trip_counter::NAME, zone_exit_sms::NAME]
        .iter()
        .flat_map(|c| (0..4).map(|_| engine.worker(c, Arc::new(CrashPlan::none()), None).unwrap()))
        .collect();
    let results = futures::future::join_all(workers.iter().map(|w| w.run_until_idle())).await;
    assert!(results.iter().all(Result::is_ok));

    let s = engine.summary();
    let (trip, sms) = (
        &s.consumers[trip_counter::NAME],
        &s.consumers[zone_exit_sms::NAME],
    );
    assert_eq!(
        (trip.processed, trip.duplicate_dropped),
        (keys, 2 * keys),
        "{s:?}"
    );
    assert_eq!(
        (sms.processed, sms.duplicate_dropped),
        (keys, 2 * keys),
        "{s:?}"
    );
    let mut counted = 0;
    for d in 0..6 {
        counted += engine.store.zone_exits(&format!("34-R-{d}")).await.unwrap();
    }
    assert_eq!(counted, keys as i64);
    let sent = SandboxClient::new(sandbox.url())
        .unwrap()
        .sent_sms()
        .await
        .unwrap();
    assert_eq!(sent.len() as u64, keys, "exactly one SMS per key");
    let distinct: HashSet<_> = sent.iter().map(|s| s.idempotency_key.clone()).collect();
    assert_eq!(distinct.len() as u64, keys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_key_many_concurrent_transactions_one_winner() {
    let env = TempEnv::new();
    let store = store::open(&env.db_url()).await.unwrap();
    let key = MessageKey::new("34-ABC-123", 48211, EventType::ZoneExit);
    let fp = zone_exit("34-ABC-123", 48211).fingerprint();
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (store, key, fp) = (store.clone(), key.clone(), fp.clone());
            tokio::spawn(async move {
                let write = BusinessWrite::CountZoneExit {
                    device_id: "34-ABC-123".into(),
                };
                store
                    .record_once("trip-counter", &key, &fp, &write)
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap());
    }
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == DedupOutcome::Applied)
            .count(),
        1
    );
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == DedupOutcome::Duplicate)
            .count(),
        15
    );
    assert_eq!(store.zone_exits("34-ABC-123").await.unwrap(), 1);

    let claims: Vec<_> = (0..16)
        .map(|_| {
            let (store, key, fp) = (store.clone(), key.clone(), fp.clone());
            tokio::spawn(async move {
                store
                    .claim_side_effect("zone-exit-sms", &key, &fp, "pk-1", Duration::from_secs(60))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut fresh = 0;
    for c in claims {
        match c.await.unwrap() {
            ClaimOutcome::Fresh(_) => fresh += 1,
            ClaimOutcome::Busy => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(fresh, 1, "exactly one owner of the send");
    let other = Fingerprint::of(&serde_json::Map::new(), &chrono::Utc::now());
    assert!(matches!(
        store
            .record_once(
                "trip-counter",
                &key,
                &other,
                &BusinessWrite::CountZoneExit {
                    device_id: "34-ABC-123".into()
                }
            )
            .await
            .unwrap(),
        DedupOutcome::KeyConflict { .. }
    ));
}
