//! The review rule of the field report, as a property: "what happens if I call this
//! handler twice with the same message?" For every consumer, handling a fleet trace
//! with duplicates (in any order) leaves the database, the SMS/ERP sandbox and the
//! counters exactly as handling each distinct message once, in the same order.

mod common;

use std::sync::Arc;

use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::metrics::CountSummary;
use idemwatch::engine::store::StateDigest;
use idemwatch::engine::{Engine, EngineConfig};
use idemwatch::sim::fleet::{FleetConfig, FleetSim};
use idemwatch::sim::sandbox_provider::{self, SandboxClient};
use proptest::prelude::*;

/// Everything observable after a run, minus wall-clock columns.
#[derive(Debug, PartialEq)]
struct Outcome {
    digest: StateDigest,
    sms: Vec<(String, String, Option<String>)>,
    webhooks: Vec<String>,
    processed: Vec<(String, u64, u64, u64)>,
}

/// A scratch directory on tmpfs when there is one: fsync is the slow part here and
/// durability is not what this property is about.
fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

async fn run(messages: &[Vec<u8>]) -> Outcome {
    let dir = scratch();
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let cfg = EngineConfig::new(
        &format!("sqlite://{}", dir.path().join("db.sqlite").display()),
        &format!("sqlite://{}", dir.path().join("queue.sqlite").display()),
        &sandbox.url(),
        &sandbox.url(),
    );
    let engine = Engine::open(&cfg).await.unwrap();
    engine.publish(messages).await.unwrap();
    let summary: CountSummary = engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .unwrap();
    let client = SandboxClient::new(sandbox.url()).unwrap();
    let mut sms: Vec<_> = client
        .sent_sms()
        .await
        .unwrap()
        .into_iter()
        .map(|s| (s.to, s.text, s.idempotency_key))
        .collect();
    sms.sort();
    let mut webhooks: Vec<_> = client
        .sent_erp()
        .await
        .unwrap()
        .into_iter()
        .map(|w| w.body.to_string())
        .collect();
    webhooks.sort();
    Outcome {
        digest: engine.store.digest().await.unwrap(),
        sms,
        webhooks,
        processed: summary
            .consumers
            .iter()
            .map(|(name, c)| {
                (
                    name.clone(),
                    c.processed,
                    c.out_of_order,
                    c.side_effects_sent,
                )
            })
            .collect(),
    }
}

/// A permuted trace and the same trace with duplicates inserted after their originals.
fn traces() -> impl Strategy<Value = (Vec<Vec<u8>>, Vec<Vec<u8>>)> {
    (any::<u64>(), 1usize..4, 8usize..48)
        .prop_flat_map(|(seed, vehicles, n)| {
            let mut sim = FleetSim::new(FleetConfig {
                vehicles,
                seed,
                redelivery_rate: 0.0,
                late_rate: 0.05,
                ..FleetConfig::default()
            });
            let raw: Vec<Vec<u8>> = sim.take_n(n).into_iter().map(|m| m.raw).collect();
            let len = raw.len();
            (
                Just(raw).prop_shuffle(),
                proptest::collection::vec((0..len, 0usize..len + 1), 1..len.max(2)),
            )
        })
        .prop_map(|(once, dups)| {
            let mut twice = once.clone();
            for (which, offset) in dups {
                // Insert a copy somewhere after the original's first occurrence.
                let first = twice.iter().position(|m| *m == once[which]).unwrap_or(0);
                let at = (first + 1 + offset).min(twice.len());
                twice.insert(at, once[which].clone());
            }
            (once, twice)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn handling_duplicates_equals_handling_once((once, twice) in traces()) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (a, b) = rt.block_on(async { (run(&once).await, run(&twice).await) });
        prop_assert!(twice.len() > once.len());
        prop_assert_eq!(a, b);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_handled_twice_in_a_row_changes_nothing() {
    let mut sim = FleetSim::new(FleetConfig {
        vehicles: 3,
        seed: 7,
        redelivery_rate: 0.0,
        late_rate: 0.05,
        ..FleetConfig::default()
    });
    let once: Vec<Vec<u8>> = sim.take_n(120).into_iter().map(|m| m.raw).collect();
    let twice: Vec<Vec<u8>> = once.iter().flat_map(|m| [m.clone(), m.clone()]).collect();
    let (a, b) = (run(&once).await, run(&twice).await);
    assert!(!a.sms.is_empty(), "the trace should contain zone exits");
    assert!(!a.webhooks.is_empty(), "the trace should contain trip ends");
    assert_eq!(a, b);
}
