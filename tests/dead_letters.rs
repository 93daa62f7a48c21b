//! Dead letters can be replayed (issue 14, docs/CONTRACT.md §8): listing by consumer, reason,
//! time and id; a replay re-publishes the raw bytes to the consumer's own queue and
//! records it; a replayed message that was in fact processed is a duplicate (one
//! effect), so a replay is always safe. On every backend, through the library and
//! through the CLI, on the embedded queue and on RabbitMQ.

mod common;

use std::sync::Arc;

use common::amqp::{amqp_url, exclusive, namespace};
use common::backends::{Kind, TestDb};
use common::zone_exit;
use common::{run_cli, TempEnv};
use idemwatch::engine::consumers::{trip_counter, zone_exit_sms};
use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::envelope::{Envelope, RejectReason};
use idemwatch::engine::metrics::{ConsumerCounts, CountSummary};
use idemwatch::engine::replay::{self, ReplayPlan, ReplayStatus};
use idemwatch::engine::store::{self, ClaimState, DeadLetterFilter};
use idemwatch::engine::{Engine, EngineConfig};
use idemwatch::sim::sandbox_provider;
use idemwatch_testkit::on_every_backend;

on_every_backend!(
    replayed_dead_letters_are_processed_once_and_recorded,
    a_provider_rejected_dead_letter_replays_to_one_sms,
);

/// Run the engine's consumers until their queues are empty: counts before and after.
async fn drain(engine: &Engine) -> (CountSummary, CountSummary) {
    let before = engine.summary();
    let after = engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .unwrap();
    (before, after)
}

fn body(e: &Envelope) -> Vec<u8> {
    e.to_json_line().into_bytes()
}

async fn replayed_dead_letters_are_processed_once_and_recorded(db: &TestDb) {
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let mut cfg = EngineConfig::new(&db.url, &db.queue_url(), &sandbox.url(), &sandbox.url());
    cfg.consumers = vec![trip_counter::NAME.into(), zone_exit_sms::NAME.into()];
    let engine = Engine::open(&cfg).await.unwrap();
    let done = zone_exit("34-DL-1", 1);
    let never = zone_exit("34-DL-2", 1);
    engine.publish(&[body(&done)]).await.unwrap();
    let s = engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .unwrap();
    assert_eq!(s.total.processed, 2);
    assert_eq!(sandbox.state().sent_sms().len(), 1);

    // Dead letters as the runner writes them: `done` after its commit (the ack was
    // lost and the queue gave up), `never` before any effect.
    let st = engine.store.as_ref();
    let gave_up = RejectReason::MaxDeliveries;
    let d_done = st
        .dead_letter(trip_counter::NAME, gave_up, "gave up", &body(&done))
        .await
        .unwrap();
    let d_sms = st
        .dead_letter(zone_exit_sms::NAME, gave_up, "gave up", &body(&done))
        .await
        .unwrap();
    let d_never = st
        .dead_letter(trip_counter::NAME, gave_up, "gave up", &body(&never))
        .await
        .unwrap();
    let d_bad = st
        .dead_letter(trip_counter::NAME, RejectReason::MalformedJson, "eof", b"{")
        .await
        .unwrap();

    // Listing: by consumer, reason, time and id, newest first.
    let find = |f: DeadLetterFilter| async move { st.find_dead_letters(&f).await.unwrap() };
    let ids = |v: Vec<store::DeadLetter>| v.iter().map(|d| d.id).collect::<Vec<_>>();
    let trip = DeadLetterFilter {
        consumer: Some(trip_counter::NAME.into()),
        ..Default::default()
    };
    assert_eq!(ids(find(trip.clone()).await), vec![d_bad, d_never, d_done]);
    let gave_up_trip = DeadLetterFilter {
        reason: Some("max_deliveries".into()),
        ..trip.clone()
    };
    assert_eq!(ids(find(gave_up_trip.clone()).await), vec![d_never, d_done]);
    let future = DeadLetterFilter {
        since: Some(chrono::Utc::now() + chrono::Duration::hours(1)),
        ..Default::default()
    };
    assert!(find(future).await.is_empty());
    let by_id = DeadLetterFilter {
        ids: vec![d_sms],
        ..Default::default()
    };
    assert_eq!(ids(find(by_id.clone()).await), vec![d_sms]);

    // A dry run names what would go and changes nothing.
    let mut plan = ReplayPlan {
        filter: gave_up_trip.clone(),
        dry_run: true,
        namespace: None,
    };
    let dry = replay::replay(st, engine.queue.as_ref(), &plan)
        .await
        .unwrap();
    assert_eq!((dry.matched, dry.replayed), (2, 2));
    assert!(dry
        .letters
        .iter()
        .all(|l| l.status == ReplayStatus::WouldReplay));
    assert!(engine
        .queue
        .depth(trip_counter::NAME)
        .await
        .unwrap()
        .is_empty());

    // The replay: oldest first, to the consumer's own queue only.
    plan.dry_run = false;
    let r = replay::replay(st, engine.queue.as_ref(), &plan)
        .await
        .unwrap();
    assert_eq!(
        r.letters.iter().map(|l| l.id).collect::<Vec<_>>(),
        vec![d_done, d_never]
    );
    assert_eq!(
        engine.queue.depth(trip_counter::NAME).await.unwrap().ready,
        2
    );
    assert!(engine
        .queue
        .depth(zone_exit_sms::NAME)
        .await
        .unwrap()
        .is_empty());
    let (before, after) = drain(&engine).await;
    let trip_after = &after.consumers[trip_counter::NAME];
    let trip_before = &before.consumers[trip_counter::NAME];
    assert_eq!(trip_after.processed - trip_before.processed, 1, "{after:?}");
    assert_eq!(
        trip_after.duplicate_dropped - trip_before.duplicate_dropped,
        1,
        "the already-processed message is a duplicate"
    );
    assert_eq!(st.zone_exits("34-DL-1").await.unwrap(), 1);
    assert_eq!(st.zone_exits("34-DL-2").await.unwrap(), 1);
    for d in find(gave_up_trip.clone()).await {
        assert_eq!(d.replay_count, 1);
        assert!(d.replayed_at.is_some());
        assert_eq!(d.detail.as_deref(), Some("gave up"), "the cause is kept");
    }

    // A second blanket replay leaves the replayed rows alone; by id they go again,
    // and again they are duplicates.
    plan.filter.include_replayed = false;
    let again = replay::replay(st, engine.queue.as_ref(), &plan)
        .await
        .unwrap();
    assert_eq!(again.matched, 0);
    plan.filter = DeadLetterFilter {
        ids: vec![d_done, d_sms],
        include_replayed: false,
        ..Default::default()
    };
    let by_ids = replay::replay(st, engine.queue.as_ref(), &plan)
        .await
        .unwrap();
    assert_eq!(by_ids.replayed, 2);
    let (before, after) = drain(&engine).await;
    assert_eq!(after.total.processed, before.total.processed);
    assert_eq!(
        after.total.duplicate_dropped - before.total.duplicate_dropped,
        2
    );
    assert_eq!(st.zone_exits("34-DL-1").await.unwrap(), 1);
    assert_eq!(
        sandbox.state().sent_sms().len(),
        1,
        "one SMS, however often it is replayed"
    );
    let counts: Vec<i64> = find(DeadLetterFilter {
        ids: vec![d_done, d_sms],
        ..Default::default()
    })
    .await
    .iter()
    .map(|d| d.replay_count)
    .collect();
    assert_eq!(counts, vec![1, 2]);
}

/// The provider refuses a zone exit's SMS (400): a `provider_rejected` dead letter
/// and a `failed` claim. The provider is fixed (it refused only that once); the
/// replay re-arms the claim, so exactly one SMS goes out, under the claim's own
/// provider key, and the claim ends `sent`. A second replay is a duplicate.
async fn a_provider_rejected_dead_letter_replays_to_one_sms(db: &TestDb) {
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    sandbox.state().reject_next(1);
    let mut cfg = EngineConfig::new(&db.url, &db.queue_url(), &sandbox.url(), &sandbox.url());
    cfg.consumers = vec![zone_exit_sms::NAME.into()];
    let engine = Engine::open(&cfg).await.unwrap();
    let e = zone_exit("34-REJ-1", 1);
    engine.publish(&[body(&e)]).await.unwrap();
    drain(&engine).await;
    let st = engine.store.as_ref();
    let rejected = DeadLetterFilter {
        reason: Some("provider_rejected".into()),
        ..Default::default()
    };
    let dead = st.find_dead_letters(&rejected).await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].raw, body(&e));
    let claim = || async {
        st.claim(zone_exit_sms::NAME, &e.key())
            .await
            .unwrap()
            .unwrap()
    };
    let refused = claim().await;
    assert_eq!(refused.state, ClaimState::Failed);
    assert!(sandbox.state().sent_sms().is_empty());

    // A dry run says the claim would be re-armed, and leaves it failed.
    let mut plan = ReplayPlan {
        filter: rejected.clone(),
        dry_run: true,
        namespace: None,
    };
    let dry = replay::replay(st, engine.queue.as_ref(), &plan)
        .await
        .unwrap();
    assert!(dry.letters[0].rearmed_claim);
    assert_eq!(claim().await.state, ClaimState::Failed);

    plan.dry_run = false;
    let r = replay::replay(st, engine.queue.as_ref(), &plan)
        .await
        .unwrap();
    assert_eq!(r.replayed, 1);
    let (before, after) = drain(&engine).await;
    let (b, a) = (
        &before.consumers[zone_exit_sms::NAME],
        &after.consumers[zone_exit_sms::NAME],
    );
    assert_eq!(
        common::counted_since(b, a),
        ConsumerCounts {
            processed: 1,
            side_effects_sent: 1,
            ..ConsumerCounts::default()
        }
    );
    let sent = sandbox.state().sent_sms();
    assert_eq!(sent.len(), 1, "exactly one SMS after the fix: {sent:?}");
    assert!(r.letters[0].rearmed_claim);
    assert_eq!(
        sent[0].idempotency_key.as_ref(),
        Some(&refused.provider_key)
    );
    let done = claim().await;
    assert_eq!(
        (done.state, &done.provider_key),
        (ClaimState::Sent, &refused.provider_key)
    );
    let replayed = &st.find_dead_letters(&rejected).await.unwrap()[0];
    assert_eq!(replayed.replay_count, 1);
    assert!(replayed.replayed_at.is_some());

    // Replayed again (by id): the claim is `sent`, nothing to re-arm, a duplicate.
    plan.filter = DeadLetterFilter {
        ids: vec![replayed.id],
        ..Default::default()
    };
    let again = replay::replay(st, engine.queue.as_ref(), &plan)
        .await
        .unwrap();
    assert_eq!((again.replayed, again.letters[0].rearmed_claim), (1, false));
    let (before, after) = drain(&engine).await;
    assert_eq!(
        after.total.duplicate_dropped - before.total.duplicate_dropped,
        1
    );
    assert_eq!(sandbox.state().sent_sms().len(), 1, "still one SMS");
    assert_eq!(claim().await.state, ClaimState::Sent);
    assert!(st
        .find_dead_letters(&DeadLetterFilter {
            reason: Some("provider_rejected".into()),
            include_replayed: false,
            ..Default::default()
        })
        .await
        .unwrap()
        .is_empty());
}

/// The operator's path: `dead-letters list`, `replay --dry-run`, `replay`, then
/// `consume`, all through the binary on the embedded queue and SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_list_and_replay_from_the_command_line() {
    let env = TempEnv::new();
    let done = zone_exit("34-CLI-1", 7);
    let never = zone_exit("34-CLI-2", 7);
    let file = env.path("in.jsonl");
    std::fs::write(&file, done.to_json_line() + "\n").unwrap();
    let file = file.display().to_string();
    let consumer = ["--consumer", trip_counter::NAME];
    let (code, _, err) = run_cli(&env, &[&["publish", &file][..], &consumer].concat());
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run_cli(
        &env,
        &[&["consume", "--until-idle", "--json"][..], &consumer].concat(),
    );
    assert_eq!(code, 0, "{err}");
    {
        let st = store::open(&env.db_url()).await.unwrap();
        for e in [&done, &never] {
            st.dead_letter(
                trip_counter::NAME,
                RejectReason::MaxDeliveries,
                "gave up after 10 deliveries",
                &body(e),
            )
            .await
            .unwrap();
        }
    }
    let json = |out: &str| -> serde_json::Value { serde_json::from_str(out).expect(out) };

    let (code, out, err) = run_cli(
        &env,
        &[
            "dead-letters",
            "list",
            "--reason",
            "max_deliveries",
            "--json",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let listed = json(&out);
    assert_eq!(listed["count"], 2);
    assert_eq!(listed["dead_letters"][0]["raw"], never.to_json_line());
    assert_eq!(
        listed["dead_letters"][0]["raw_hex"],
        hex::encode(never.to_json_line())
    );
    assert_eq!(listed["dead_letters"][0]["replay_count"], 0);

    let (code, out, err) = run_cli(
        &env,
        &[
            "dead-letters",
            "replay",
            "--consumer",
            trip_counter::NAME,
            "--dry-run",
            "--json",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["letters"][0]["status"], "would_replay");
    let (code, out, err) = run_cli(
        &env,
        &[
            "dead-letters",
            "replay",
            "--consumer",
            trip_counter::NAME,
            "--json",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["replayed"], 2);

    let (code, out, err) = run_cli(
        &env,
        &[&["consume", "--until-idle", "--json"][..], &consumer].concat(),
    );
    assert_eq!(code, 0, "{err}");
    let counts = json(&out);
    assert_eq!(
        (
            counts["processed"].as_u64(),
            counts["duplicate_dropped"].as_u64()
        ),
        (Some(1), Some(1)),
        "{counts}"
    );
    let st = store::open(&env.db_url()).await.unwrap();
    assert_eq!(st.zone_exits("34-CLI-1").await.unwrap(), 1);
    assert_eq!(st.zone_exits("34-CLI-2").await.unwrap(), 1);

    let (code, out, _) = run_cli(&env, &["dead-letters", "list"]);
    assert_eq!(code, 0);
    assert!(out.contains("gave up after 10 deliveries"), "{out}");
    let (code, _, err) = run_cli(&env, &["dead-letters", "list", "--since", "yesterday-ish"]);
    assert_eq!(code, 2, "{err}");
}

/// The same replay through RabbitMQ: the raw bytes reach the consumer's queue on the
/// broker and a processed message comes back as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_replays_through_rabbitmq() {
    let Some(amqp) = amqp_url().await else {
        return;
    };
    let _turn = exclusive().await;
    let Some(db) = TestDb::new(Kind::Sqlite).await else {
        return;
    };
    let mut cfg = EngineConfig::new(&db.url, &amqp, "http://127.0.0.1:9", "http://127.0.0.1:9");
    cfg.consumers = vec![trip_counter::NAME.into()];
    cfg.namespace = Some(namespace("replay"));
    let engine = Engine::open(&cfg).await.unwrap();
    let done = zone_exit("34-AMQP-1", 3);
    engine.publish(&[body(&done)]).await.unwrap();
    engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .unwrap();
    let id = engine
        .store
        .dead_letter(
            trip_counter::NAME,
            RejectReason::MaxDeliveries,
            "gave up",
            &body(&done),
        )
        .await
        .unwrap();
    let plan = ReplayPlan {
        filter: DeadLetterFilter {
            ids: vec![id],
            ..Default::default()
        },
        dry_run: false,
        namespace: cfg.namespace.clone(),
    };
    let r = replay::replay(engine.store.as_ref(), engine.queue.as_ref(), &plan)
        .await
        .unwrap();
    assert_eq!(r.replayed, 1);
    let (before, after) = drain(&engine).await;
    assert_eq!(
        after.total.duplicate_dropped - before.total.duplicate_dropped,
        1
    );
    assert_eq!(engine.store.zone_exits("34-AMQP-1").await.unwrap(), 1);
    engine
        .queue
        .remove_queue(&engine.queue_name(trip_counter::NAME))
        .await
        .unwrap();
    engine.queue.close().await;
}

/// What the dashboard's Tables tab calls after its confirmation: one dead letter by
/// id, on the database and queue the dashboard watches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboards_replay_of_one_dead_letter() {
    let env = TempEnv::new();
    let st = store::open(&env.db_url()).await.unwrap();
    let e = zone_exit("34-TUI-1", 1);
    let id = st
        .dead_letter(
            trip_counter::NAME,
            RejectReason::MaxDeliveries,
            "gave up",
            &body(&e),
        )
        .await
        .unwrap();
    let r = replay::replay_by_id(&env.db_url(), &env.queue_url(), id)
        .await
        .unwrap();
    assert_eq!((r.replayed, r.letters[0].replay_count), (1, 1));
    assert_eq!(r.letters[0].queue.as_deref(), Some(trip_counter::NAME));
    let q = idemwatch::engine::queue::open(&env.queue_url())
        .await
        .unwrap();
    assert_eq!(q.depth(trip_counter::NAME).await.unwrap().ready, 1);
    let missing = replay::replay_by_id(&env.db_url(), &env.queue_url(), id + 100)
        .await
        .unwrap();
    assert_eq!(missing.matched, 0);
}
