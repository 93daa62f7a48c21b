//! The faults production has most (issue 14), against real databases and a real
//! HTTP provider: a store outage longer than the whole retry budget, a provider that
//! throttles, fails or refuses, and a poison message in a batch. "Nothing lost,
//! nothing doubled" must hold through each; only what the message itself causes may
//! cost it a delivery or end as a dead letter.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::backends::{Kind, TestDb};
use common::outage::Outage;
use common::proxy::{server_addr, FaultProxy};
use common::{stop_and_assert_each_once, wait_for};
use idemwatch::engine::consumers::{trip_counter, zone_exit_sms};
use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::envelope::{Envelope, MessageKey};
use idemwatch::engine::health::{InfraKind, PauseCause};
use idemwatch::engine::runner::RunnerSettings;
use idemwatch::engine::store::ClaimState;
use idemwatch::engine::{Engine, EngineConfig};
use idemwatch::sim::sandbox_provider;
use idemwatch_testkit::on_every_backend;

on_every_backend!(
    poison_in_a_batch_of_16_costs_only_itself,
    a_nul_in_a_batch_is_refused_alike_on_every_backend,
    a_store_outage_longer_than_the_retry_budget_loses_nothing,
    a_refused_sms_result_in_a_batch_of_16_costs_only_itself,
);

fn zone_exit_line(device: &str, seq: u64) -> Vec<u8> {
    format!(
        r#"{{"device_id":"{device}","seq":{seq},"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X","phone":"+905551112233"}}}}"#
    )
    .into_bytes()
}

fn key_of(body: &[u8]) -> MessageKey {
    Envelope::parse(body).unwrap().key()
}

async fn engine(
    db_url: &str,
    queue_url: &str,
    consumer: &str,
    sms_url: &str,
    runner: RunnerSettings,
) -> Engine {
    let mut cfg = EngineConfig::new(db_url, queue_url, sms_url, sms_url);
    cfg.consumers = vec![consumer.to_string()];
    cfg.runner = runner;
    Engine::open(&cfg).await.unwrap()
}

/// Run the engine's consumers until the queue is empty, within 120 s.
async fn drain(engine: &Engine) {
    tokio::time::timeout(
        Duration::from_secs(120),
        engine.run_until_idle(Arc::new(CrashPlan::none()), None),
    )
    .await
    .expect("the queue drains")
    .unwrap();
}

/// The database refuses one device's counter row for what it holds: a constraint on
/// the servers, a trigger on SQLite (which cannot add a CHECK to a table). Nothing
/// a parser could know; the database's own words name the cause.
async fn refuse_device(db: &TestDb, device: &str) -> &'static str {
    match db.kind {
        Kind::Sqlite => {
            db.exec(&format!(
                "CREATE TRIGGER idw_poison BEFORE INSERT ON trip_counters \
                 WHEN NEW.device_id = '{device}' BEGIN SELECT RAISE(ABORT, 'idw_poison refuses this device'); END"
            ))
            .await
        }
        Kind::Postgres | Kind::Mysql => {
            db.exec(&format!(
                "ALTER TABLE trip_counters ADD CONSTRAINT idw_poison CHECK (device_id <> '{device}')"
            ))
            .await
        }
    }
    "idw_poison"
}

async fn poison_in_a_batch_of_16_costs_only_itself(db: &TestDb) {
    let engine = engine(
        &db.url,
        &db.queue_url(),
        trip_counter::NAME,
        "http://127.0.0.1:9",
        RunnerSettings {
            lease_batch: 16,
            prefetch: 16,
            pipeline: false,
            max_deliveries: 1,
            idle_poll: Duration::from_millis(5),
            ..RunnerSettings::default()
        },
    )
    .await;
    // The schema exists once the engine opened the store.
    let cause = refuse_device(db, "POISON-8").await;
    let bodies: Vec<Vec<u8>> = (0..16)
        .map(|i| {
            let device = if i == 8 {
                "POISON-8".to_string()
            } else {
                format!("BATCH-{i}")
            };
            zone_exit_line(&device, 1)
        })
        .collect();
    engine.publish(&bodies).await.unwrap();
    engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .unwrap();

    let c = &engine.summary().consumers[trip_counter::NAME];
    assert_eq!((c.processed, c.dead_lettered), (15, 1), "{c:?}");
    let dead = engine.store.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].reason, "store_rejected");
    assert_eq!(dead[0].raw, bodies[8]);
    let detail = dead[0].detail.clone().unwrap_or_default();
    assert!(detail.contains(cause), "the database's words: {detail}");
    for i in (0..16).filter(|i| *i != 8) {
        assert_eq!(
            engine
                .store
                .zone_exits(&format!("BATCH-{i}"))
                .await
                .unwrap(),
            1
        );
    }
    assert_eq!(engine.store.zone_exits("POISON-8").await.unwrap(), 0);
    assert!(engine
        .queue
        .depth(trip_counter::NAME)
        .await
        .unwrap()
        .is_empty());
}

async fn a_nul_in_a_batch_is_refused_alike_on_every_backend(db: &TestDb) {
    let engine = engine(
        &db.url,
        &db.queue_url(),
        trip_counter::NAME,
        "http://127.0.0.1:9",
        RunnerSettings {
            lease_batch: 16,
            prefetch: 16,
            pipeline: false,
            idle_poll: Duration::from_millis(5),
            ..RunnerSettings::default()
        },
    )
    .await;
    // The field report's message: PostgreSQL cannot store it, SQLite and MariaDB
    // could. Refused by the parser, it is refused the same everywhere.
    let mut bodies: Vec<Vec<u8>> = (0..15)
        .map(|i| zone_exit_line(&format!("NUL-{i}"), 1))
        .collect();
    bodies.insert(3, zone_exit_line("34-\\u0000-NUL", 1));
    engine.publish(&bodies).await.unwrap();
    engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .unwrap();
    let c = &engine.summary().consumers[trip_counter::NAME];
    assert_eq!((c.processed, c.dead_lettered), (15, 1), "{c:?}");
    let dead = engine.store.dead_letters(10).await.unwrap();
    assert_eq!(
        (dead[0].reason.as_str(), &dead[0].raw),
        ("invalid_field", &bodies[3])
    );
    let detail = dead[0].detail.clone().unwrap_or_default();
    assert!(
        detail.contains("device_id") && detail.contains("U+0000"),
        "{detail}"
    );
}

/// With `max_deliveries = 1`, a single delivery spent on the outage would cost a
/// message: the whole retry budget is one failure. The outage lasts until the
/// consumer has failed on it at least twice, with messages arriving meanwhile; after
/// recovery every effect is there exactly once and nothing is dead-lettered.
async fn a_store_outage_longer_than_the_retry_budget_loses_nothing(db: &TestDb) {
    let proxy = match db.kind {
        Kind::Mysql => Some(FaultProxy::start(server_addr(&db.url, 3306).await).await),
        _ => None,
    };
    let url = proxy
        .as_ref()
        .map_or(db.url.clone(), |p| p.url_through(&db.url));
    let engine = Arc::new(
        engine(
            &url,
            &db.queue_url(),
            trip_counter::NAME,
            "http://127.0.0.1:9",
            RunnerSettings {
                lease_batch: 4,
                max_deliveries: 1,
                retry_delay: Duration::from_millis(20),
                max_pause: Duration::from_millis(300),
                // Longer than SQLite's busy timeout: no lease runs out while a
                // write waits for the lock.
                visibility_timeout: Duration::from_secs(120),
                idle_poll: Duration::from_millis(10),
                ..RunnerSettings::default()
            },
        )
        .await,
    );
    let consumer = trip_counter::NAME;
    let processed = || engine.summary().consumers[consumer].processed;
    let before: Vec<Vec<u8>> = (0..4)
        .map(|i| zone_exit_line(&format!("OUT-{i}"), 1))
        .collect();
    engine.publish(&before).await.unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let worker = engine
        .worker(consumer, Arc::new(CrashPlan::none()), None)
        .unwrap();
    let running = tokio::spawn(async move { worker.run(stopped).await });
    wait_for("the first messages", Duration::from_secs(60), || {
        processed() == 4
    })
    .await;

    let outage = Outage::start(db, proxy.as_ref()).await;
    let during: Vec<Vec<u8>> = (4..12)
        .map(|i| zone_exit_line(&format!("OUT-{i}"), 1))
        .collect();
    engine.publish(&during).await.unwrap();
    // A failure and a failed probe or trial on the servers; on SQLite each failure
    // costs the store's busy timeout (30 s), so one.
    let failures = if db.kind == Kind::Sqlite { 1 } else { 2 };
    wait_for("failures on the outage", Duration::from_secs(240), || {
        engine
            .pause(consumer)
            .is_some_and(|p| p.failures >= failures)
    })
    .await;
    let pause = engine
        .pause(consumer)
        .expect("paused while the store is down");
    // SQLite's lock outage is its busy timeout firing: a deadline, `kind="timeout"`.
    let kind = if db.kind == Kind::Sqlite {
        InfraKind::Timeout(PauseCause::Store)
    } else {
        InfraKind::Store
    };
    assert_eq!((pause.cause, pause.kind), (PauseCause::Store, kind));
    assert!(engine.metrics.encode().contains(&format!(
        "idem_consumer_paused{{consumer=\"{consumer}\",cause=\"store\"}} 1"
    )));
    outage.end(proxy.as_ref()).await;

    wait_for(
        "every message after recovery",
        Duration::from_secs(240),
        || processed() == 12,
    )
    .await;
    stop_and_assert_each_once(&engine, consumer, stop, running, "OUT-", 12).await;
    assert!(engine.pause(consumer).is_none(), "resumed by itself");
    assert!(engine.metrics.encode().contains(&format!(
        "idem_consumer_paused{{consumer=\"{consumer}\",cause=\"store\"}} 0"
    )));
}

/// A provider run for zone-exit-sms with one kind of fault armed; every SMS once.
struct ProviderRun {
    engine: Engine,
    sandbox: sandbox_provider::SandboxHandle,
    bodies: Vec<Vec<u8>>,
    _env: common::TempEnv,
}

async fn provider_run(arm: impl FnOnce(&sandbox_provider::SandboxState), n: usize) -> ProviderRun {
    let env = common::TempEnv::new();
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    arm(sandbox.state());
    let engine = engine(
        &env.db_url(),
        &env.queue_url(),
        zone_exit_sms::NAME,
        &sandbox.url(),
        RunnerSettings {
            lease_batch: 4,
            // One counted failure would dead-letter: a throttled or failing provider
            // must cost nothing.
            max_deliveries: 1,
            retry_delay: Duration::from_millis(20),
            max_pause: Duration::from_secs(2),
            idle_poll: Duration::from_millis(5),
            ..RunnerSettings::default()
        },
    )
    .await;
    let bodies: Vec<Vec<u8>> = (0..n)
        .map(|i| zone_exit_line(&format!("SMS-{i}"), 1))
        .collect();
    engine.publish(&bodies).await.unwrap();
    drain(&engine).await;
    ProviderRun {
        engine,
        sandbox,
        bodies,
        _env: env,
    }
}

impl ProviderRun {
    /// Exactly one accepted SMS per zone exit in `sent`, each under its own key;
    /// every claim settled (none left `claimed`, so none can be in doubt).
    async fn assert_each_sent_once(&self, sent: &[usize]) {
        let accepted = self.sandbox.state().sent_sms();
        assert_eq!(accepted.len(), sent.len(), "{accepted:?}");
        let mut keys: Vec<_> = accepted.iter().map(|s| s.idempotency_key.clone()).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), sent.len(), "one key per SMS");
        for i in sent {
            let claim = self
                .engine
                .store
                .claim(zone_exit_sms::NAME, &key_of(&self.bodies[*i]))
                .await
                .unwrap()
                .expect("a claim");
            assert_eq!(claim.state, ClaimState::Sent, "{claim:?}");
        }
        assert!(self
            .engine
            .store
            .claims_in_doubt(Duration::ZERO)
            .await
            .unwrap()
            .is_empty());
        assert!(
            self.engine.pause(zone_exit_sms::NAME).is_none(),
            "resumed by itself"
        );
    }

    /// A provider that answered `status` `times` times (a retry, never a loss) and then
    /// 200: every one of the 20 zone exits sent exactly once, nothing dead-lettered, and
    /// each of those answers counted as an infrastructure error of `kind`.
    async fn assert_retried_to_one_sms_each(&self, status: u16, times: u64, kind: InfraKind) {
        assert_eq!(self.answered(status) as u64, times);
        self.assert_each_sent_once(&(0..20).collect::<Vec<_>>())
            .await;
        let c = &self.engine.summary().consumers[zone_exit_sms::NAME];
        assert_eq!(
            (c.processed, c.side_effects_sent, c.dead_lettered),
            (20, 20, 0),
            "{c:?}"
        );
        assert_eq!(
            self.engine.metrics.infra_errors(zone_exit_sms::NAME, kind),
            times
        );
    }

    fn answered(&self, status: u16) -> usize {
        self.sandbox
            .state()
            .sms_requests()
            .iter()
            .filter(|r| r.status == status)
            .count()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_throttling_provider_gets_one_sms_per_zone_exit() {
    let run = provider_run(|s| s.throttle_next(3, Duration::from_secs(1)), 20).await;
    run.assert_retried_to_one_sms_each(429, 3, InfraKind::ProviderThrottled)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_provider_gets_one_sms_per_zone_exit() {
    let run = provider_run(|s| s.fail_next(7), 20).await;
    run.assert_retried_to_one_sms_each(503, 7, InfraKind::ProviderUnavailable)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_provider_refusal_is_a_dead_letter_not_a_processed_message() {
    let run = provider_run(|s| s.reject_next(1), 6).await;
    assert_eq!(run.answered(400), 1);
    // The calls of a batch go out concurrently, so the refused request is whichever
    // reached the provider first: find it by its dead letter's raw bytes.
    let dead = run.engine.store.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    let refused = run
        .bodies
        .iter()
        .position(|b| *b == dead[0].raw)
        .expect("the dead letter keeps one of the published bodies");
    let others: Vec<usize> = (0..6).filter(|i| *i != refused).collect();
    run.assert_each_sent_once(&others).await;
    let c = &run.engine.summary().consumers[zone_exit_sms::NAME];
    assert_eq!(
        (
            c.processed,
            c.side_effects_sent,
            c.side_effects_failed,
            c.dead_lettered
        ),
        (5, 5, 1, 1),
        "{c:?}"
    );
    assert_eq!(
        (dead[0].reason.as_str(), &dead[0].raw),
        ("provider_rejected", &run.bodies[refused])
    );
    let detail = dead[0].detail.clone().unwrap_or_default();
    assert!(
        detail.contains("400") && detail.contains("recipient_refused"),
        "{detail}"
    );
    let claim = run
        .engine
        .store
        .claim(zone_exit_sms::NAME, &key_of(&run.bodies[refused]))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claim.state, ClaimState::Failed);
}

/// The database refuses to record `sent` for one key's claim: a trigger on SQLite, a
/// CHECK on the servers. Nothing a parser could know, and the SMS did go out.
async fn refuse_sent(db: &TestDb, key: &MessageKey) -> &'static str {
    let key = key.as_str();
    match db.kind {
        Kind::Sqlite => {
            db.exec(&format!(
                "CREATE TRIGGER idw_poison BEFORE UPDATE ON side_effect_claims \
                 WHEN NEW.state = 'sent' AND NEW.message_key = '{key}' \
                 BEGIN SELECT RAISE(ABORT, 'idw_poison refuses to record this send'); END"
            ))
            .await
        }
        Kind::Postgres | Kind::Mysql => {
            db.exec(&format!(
                "ALTER TABLE side_effect_claims ADD CONSTRAINT idw_poison \
                 CHECK (NOT (message_key = '{key}' AND state = 'sent'))"
            ))
            .await
        }
    }
    "idw_poison"
}

/// A sandbox SMS provider and the zone-exit-sms consumer on `db` taking batches of 16,
/// one transaction each, every delivery its only one (`max_deliveries` 1: a counted
/// retry is a dead letter at once), claims leased for `lease`.
async fn sms_batch_of_16(
    db: &TestDb,
    lease: Duration,
) -> (sandbox_provider::SandboxHandle, Engine) {
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let mut cfg = EngineConfig::new(&db.url, &db.queue_url(), &sandbox.url(), &sandbox.url());
    cfg.consumers = vec![zone_exit_sms::NAME.into()];
    cfg.claim_lease = lease;
    cfg.runner = RunnerSettings {
        lease_batch: 16,
        prefetch: 16,
        pipeline: false,
        max_deliveries: 1,
        retry_delay: Duration::from_millis(20),
        idle_poll: Duration::from_millis(5),
        ..RunnerSettings::default()
    };
    (sandbox, Engine::open(&cfg).await.unwrap())
}

/// A batch of 16 zone exits whose SMS all go out, the record of one refused by the
/// database: its 15 neighbours are processed at once (no claim left live, no resend),
/// the refused one is one `store_rejected` dead letter saying the SMS did go out and
/// under which provider key, and its claim is closed so that the claim sweeper,
/// past the lease, neither resends it nor writes another dead letter.
async fn a_refused_sms_result_in_a_batch_of_16_costs_only_itself(db: &TestDb) {
    let lease = Duration::from_millis(800);
    let (sandbox, engine) = sms_batch_of_16(db, lease).await;
    let bodies: Vec<Vec<u8>> = (0..16)
        .map(|i| zone_exit_line(&format!("REC-{i}"), 1))
        .collect();
    let refused = key_of(&bodies[8]);
    // The schema exists once the engine opened the store.
    let cause = refuse_sent(db, &refused).await;
    engine.publish(&bodies).await.unwrap();
    drain(&engine).await;

    let sms = zone_exit_sms::NAME;
    let c = &engine.summary().consumers[sms];
    assert_eq!(
        (c.processed, c.dead_lettered, c.side_effects_sent),
        (15, 1, 16),
        "{c:?}"
    );
    // One request per zone exit: nothing was resent, not even under its own key.
    assert_eq!(sandbox.state().sms_requests().len(), 16);
    assert_eq!(sandbox.state().sent_sms().len(), 16);
    let claim = |body: &[u8]| {
        let key = key_of(body);
        let store = engine.store.clone();
        async move { store.claim(sms, &key).await.unwrap().expect("a claim") }
    };
    for (i, body) in bodies.iter().enumerate() {
        let state = claim(body).await.state;
        let want = if i == 8 {
            ClaimState::Failed
        } else {
            ClaimState::Sent
        };
        assert_eq!(state, want, "REC-{i}");
    }
    let closed = claim(&bodies[8]).await;
    let dead = engine.store.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(
        (dead[0].reason.as_str(), &dead[0].raw),
        ("store_rejected", &bodies[8])
    );
    let detail = dead[0].detail.clone().unwrap_or_default();
    for words in [cause, "DID happen", closed.provider_key.as_str()] {
        assert!(detail.contains(words), "{words:?} in {detail}");
    }

    // Past the lease the claim sweeper finds nothing to re-drive: no resend, no
    // second dead letter.
    tokio::time::sleep(lease * 2).await;
    for _ in 0..2 {
        let swept = engine.sweep_claims().await.unwrap();
        assert_eq!(swept, Default::default(), "{swept:?}");
    }
    assert_eq!(engine.store.dead_letters(10).await.unwrap().len(), 1);
    assert_eq!(sandbox.state().sms_requests().len(), 16);
    let c = &engine.summary().consumers[sms];
    assert_eq!((c.processed, c.dead_lettered), (15, 1), "{c:?}");
    assert!(engine.metrics.encode().contains(&format!(
        "idem_dead_lettered_total{{consumer=\"{sms}\",reason=\"store_rejected\"}} 1"
    )));
}

/// The store fails for its health in the middle of recording a batch's answers one
/// by one (PostgreSQL: the batch's record is refused for one key by a CHECK — the
/// message's content, so the answers are recorded one by one — and a later key's
/// single-row record raises a serialization failure, 40001, an outage): the answers
/// from that key on are uncounted retries, never dead letters, and once the store is
/// well again each is recorded as sent under its own provider key, its SMS sent
/// once. Kills the `!release` → `release` mutants of `finish_one_by_one`, which
/// turned those sent-but-unrecorded answers into counted retries (with
/// `max_deliveries` 1: dead letters).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outage_while_recording_one_by_one_retries_the_rest_uncounted() {
    let Some(db) = TestDb::new(Kind::Postgres).await else {
        return;
    };
    let (sandbox, engine) = sms_batch_of_16(&db, Duration::from_millis(800)).await;
    let bodies: Vec<Vec<u8>> = (0..16)
        .map(|i| zone_exit_line(&format!("OUT-{i}"), 1))
        .collect();
    let cause = refuse_sent(&db, &key_of(&bodies[4])).await;
    // The batch's record is one UPDATE … FROM UNNEST: there the trigger lets the row
    // through and the CHECK refuses key 4 (content: one by one follows). Key 8's own
    // UPDATE then fails as an outage would.
    db.exec(
        "CREATE FUNCTION idw_down() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         IF position('UNNEST' in upper(current_query())) > 0 THEN RETURN NEW; END IF; \
         RAISE EXCEPTION 'idw_down: the store is failing' USING ERRCODE = '40001'; END $$",
    )
    .await;
    db.exec(&format!(
        "CREATE TRIGGER idw_down BEFORE UPDATE ON side_effect_claims FOR EACH ROW \
         WHEN (NEW.state = 'sent' AND NEW.message_key = '{}') EXECUTE FUNCTION idw_down()",
        key_of(&bodies[8]).as_str()
    ))
    .await;
    engine.publish(&bodies).await.unwrap();
    let sms = zone_exit_sms::NAME;
    let heal = async {
        // The first pass is over once every SMS went out and key 4 is a dead letter.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while sandbox.state().sms_requests().len() < 16
            || engine.store.dead_letters(10).await.unwrap().is_empty()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the first pass never ended"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        db.exec("DROP TRIGGER idw_down ON side_effect_claims").await;
    };
    tokio::join!(drain(&engine), heal);

    let dead = engine.store.dead_letters(10).await.unwrap();
    assert_eq!(
        dead.len(),
        1,
        "only the refused record is a dead letter: {dead:?}"
    );
    assert_eq!(
        (dead[0].reason.as_str(), &dead[0].raw),
        ("store_rejected", &bodies[4])
    );
    assert!(dead[0].detail.clone().unwrap_or_default().contains(cause));
    let c = &engine.summary().consumers[sms];
    assert_eq!((c.processed, c.dead_lettered), (15, 1), "{c:?}");
    assert_eq!(sandbox.state().sent_sms().len(), 16, "each SMS sent once");
    for (i, body) in bodies.iter().enumerate() {
        let claim = engine.store.claim(sms, &key_of(body)).await.unwrap();
        let want = if i == 4 {
            ClaimState::Failed
        } else {
            ClaimState::Sent
        };
        assert_eq!(claim.expect("a claim").state, want, "OUT-{i}");
    }
    db.cleanup().await;
}
