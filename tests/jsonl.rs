//! A `.jsonl` file with duplicates, late events and garbage, through `publish` and
//! `consume --until-idle --json`: the counts match and every garbage line is in
//! `dead_letters` with its raw bytes.

mod common;

use std::collections::HashSet;
use std::io::Write;

use common::{run_cli, TempEnv};
use idemwatch::engine::envelope::{Envelope, EventType};
use idemwatch::engine::store;
use idemwatch::sim::fleet::{FleetConfig, FleetSim, SimKind};

/// Lines no consumer may drop or choke on, with the reason each must get. (A line
/// over the envelope's size limit never gets this far: `publish` refuses the file,
/// see tests/untrusted_input.rs.)
fn garbage() -> Vec<(Vec<u8>, &'static str)> {
    vec![
        (b"this is not json".to_vec(), "malformed_json"),
        (b"{\"device_id\":\"34-X\",\"seq\":1".to_vec(), "malformed_json"),
        (b"\xff\xfe\x00binary\x01".to_vec(), "malformed_json"),
        (br#"{"device_id":"34-X","event_type":"position","occurred_at":"2026-11-30T04:12:03Z"}"#.to_vec(), "missing_field"),
        (br#"{"device_id":"34-X","seq":"12","event_type":"position","occurred_at":"2026-11-30T04:12:03Z","payload":{"lat":1,"lon":2}}"#.to_vec(), "invalid_field"),
        (br#"{"device_id":"34-X","seq":12,"event_type":"teleport","occurred_at":"2026-11-30T04:12:03Z"}"#.to_vec(), "unknown_event_type"),
    ]
}

#[test]
fn publish_then_consume_counts_match_and_garbage_is_kept() {
    let env = TempEnv::new();
    let mut sim = FleetSim::new(FleetConfig {
        vehicles: 4,
        seed: 2026,
        redelivery_rate: 0.05,
        late_rate: 0.03,
        ..FleetConfig::default()
    });
    let mut lines: Vec<Vec<u8>> = Vec::new();
    let mut late = 0;
    for (i, m) in sim.take_n(400).into_iter().enumerate() {
        if m.kind == SimKind::Late {
            late += 1;
        }
        lines.push(m.raw.clone());
        if i % 50 == 0 {
            lines.push(m.raw); // an extra producer-side duplicate
        }
    }
    assert!(late > 0, "the trace should hold late events");
    let mut rows = lines.clone();
    for (k, (g, _)) in garbage().into_iter().enumerate() {
        rows.insert(37 * (k + 1), g);
    }
    let path = env.path("events.jsonl");
    let mut f = std::fs::File::create(&path).unwrap();
    for r in &rows {
        f.write_all(r).unwrap();
        f.write_all(b"\n").unwrap();
    }
    drop(f);

    // Expected counts, computed independently from the parsed trace.
    let envs: Vec<Envelope> = lines.iter().map(|l| Envelope::parse(l).unwrap()).collect();
    let expect = |wants: &dyn Fn(EventType) -> bool| {
        let mut seen = HashSet::new();
        let (mut distinct, mut dups) = (0u64, 0u64);
        for e in envs.iter().filter(|e| wants(e.event_type)) {
            if seen.insert(e.key()) {
                distinct += 1;
            } else {
                dups += 1;
            }
        }
        (distinct, dups)
    };
    let (exits, exit_dups) = expect(&|t| t == EventType::ZoneExit);
    let (all, all_dups) = expect(&|_| true);
    let (trips, trip_dups) = expect(&|t| t == EventType::IgnitionOff);

    let (code, out, err) = run_cli(&env, &["publish", path.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let published: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(published["published"], rows.len());

    let (code, out, err) = run_cli(&env, &["consume", "--until-idle", "--json"]);
    assert_eq!(code, 0, "{err}");
    let c: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let g = garbage().len() as u64;
    let per = &c["consumers"];
    assert_eq!(per["vehicle-state"]["processed"], all, "{c}");
    assert_eq!(per["vehicle-state"]["duplicate_dropped"], all_dups);
    assert!(per["vehicle-state"]["out_of_order"].as_u64().unwrap() >= 1);
    assert_eq!(per["trip-counter"]["processed"], exits);
    assert_eq!(per["trip-counter"]["duplicate_dropped"], exit_dups);
    assert_eq!(per["zone-exit-sms"]["processed"], exits);
    assert_eq!(per["zone-exit-sms"]["side_effects_sent"], exits);
    assert_eq!(per["erp-webhook"]["processed"], trips);
    assert_eq!(per["erp-webhook"]["duplicate_dropped"], trip_dups);
    for name in [
        "vehicle-state",
        "trip-counter",
        "zone-exit-sms",
        "erp-webhook",
    ] {
        assert_eq!(per[name]["dead_lettered"], g, "{name}: {c}");
    }
    assert_eq!(c["dead_lettered"], 4 * g);
    assert_eq!(c["processed"], all + 2 * exits + trips);
    assert_eq!(c["duplicate_dropped"], all_dups + 2 * exit_dups + trip_dups);

    // Every garbage line is kept, byte for byte, with its reason.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dead = rt.block_on(async {
        let s = store::open(&env.db_url()).await.unwrap();
        s.dead_letters(1000).await.unwrap()
    });
    for (raw, reason) in garbage() {
        let hits: Vec<_> = dead.iter().filter(|d| d.raw == raw).collect();
        assert_eq!(
            hits.len(),
            4,
            "one per consumer for {:?}",
            String::from_utf8_lossy(&raw[..raw.len().min(40)])
        );
        assert!(
            hits.iter().all(|d| d.reason == reason),
            "{reason}: {:?}",
            hits[0]
        );
    }
    assert!(dead
        .iter()
        .all(|d| d.detail.as_deref().is_some_and(|s| !s.is_empty())));
}

/// `simulate --tunnel-rate`: the trace a user can feed their own system carries the
/// demo's tunnel flushes (older seqs of a device right behind a newer one), the
/// same bytes for the same seed; a rate outside 0..=1 is a usage error.
#[test]
fn simulate_with_tunnels_is_deterministic_and_flushes_older_seqs_late() {
    let env = TempEnv::new();
    let args = [
        "simulate",
        "--messages",
        "3000",
        "--seed",
        "5",
        "--late-rate",
        "0",
        "--redelivery-rate",
        "0",
        "--tunnel-rate",
        "0.02",
    ];
    let (code, out, err) = run_cli(&env, &args);
    assert_eq!(code, 0, "{err}");
    let (_, again, _) = run_cli(&env, &args);
    assert_eq!(out, again, "same seed, same bytes");
    let mut newest: std::collections::HashMap<String, u64> = Default::default();
    let mut behind = 0;
    for line in out.lines() {
        let e = Envelope::parse(line.as_bytes()).expect("a simulated line parses");
        let max = newest.entry(e.device_id.clone()).or_default();
        if e.seq < *max {
            behind += 1;
        }
        *max = (*max).max(e.seq);
    }
    // Late events are off: every older seq behind a newer one is a tunnel's flush.
    assert!(behind > 100, "events behind a newer one: {behind}");

    let (code, _, err) = run_cli(&env, &["simulate", "--tunnel-rate", "1.5"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--tunnel-rate"), "{err}");
}
