//! [`Store`] on SQLite (the embedded default), WAL mode.
//!
//! SQLite serialises writers. Every write transaction starts with `BEGIN IMMEDIATE`
//! so it takes the write lock up front: a transaction that reads before it writes
//! (the claim takeover) can then never fail with a busy snapshot under WAL. The
//! consumers' batch writes (the hot path) run on the file's own thread through
//! rusqlite (`crate::sqlite::thread`, the jobs in `batch.rs`); everything else
//! through sqlx. The pool options are in `crate::sqlite::conn`; the statements the same
//! on every backend are in the dialect layer's files. Beside it in this folder: the
//! backend's [`dialect`], the dashboard's read-only connection ([`readonly`]) and
//! its migrations.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::sqlite::SqliteSynchronous;
use sqlx::SqlitePool;

use super::*;
use crate::deadlines::DEFAULT_STATEMENT_TIMEOUT;
use crate::envelope::Message;
use crate::sqlite::conn::{connect_sqlite, migrate};
use crate::sqlite::thread::SqliteThread;

mod batch;
pub mod dialect;
pub(crate) mod readonly;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("src/store/sqlite/migrations");

/// The embedded SQLite store.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    /// The file's thread, which the batch writes run on (see `crate::sqlite::thread`).
    thread: SqliteThread,
    url: String,
    durability: Durability,
}

impl SqliteStore {
    /// Durable: `synchronous=FULL`, the WAL is fsynced at every commit. Relaxed:
    /// `NORMAL`, fsynced at checkpoints only, so a power cut can undo the last
    /// commits (a process crash cannot: the WAL is already in the OS).
    pub async fn open(url: &str, durability: Durability) -> StoreResult<Self> {
        Self::open_with(url, durability, DEFAULT_STATEMENT_TIMEOUT).await
    }

    /// [`SqliteStore::open`] with `busy` as the busy timeout: the statement deadline
    /// of a file with one writer at a time is the wait for the write lock.
    pub(crate) async fn open_with(
        url: &str,
        durability: Durability,
        busy: Duration,
    ) -> StoreResult<Self> {
        let synchronous = match durability {
            Durability::Durable => SqliteSynchronous::Full,
            Durability::Relaxed => SqliteSynchronous::Normal,
        };
        let pool = connect_sqlite(url, 8, synchronous, busy).await?;
        migrate(&MIGRATOR, &pool).await?;
        let thread = SqliteThread::for_url(url, synchronous, busy)?;
        Ok(SqliteStore {
            pool,
            thread,
            url: url.to_string(),
            durability,
        })
    }

    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

#[async_trait]
impl Store for SqliteStore {
    super::dialect::pooled_store!();

    async fn record_batch(
        &self,
        consumer: &str,
        items: &[Recordable],
    ) -> StoreResult<Vec<DedupOutcome>> {
        let (consumer, items) = (consumer.to_string(), items.to_vec());
        self.thread
            .write(move |tx| batch::record_batch(tx, &consumer, &items))
            .await
    }

    async fn apply_vehicle_batch(&self, envs: &[Message]) -> StoreResult<Vec<VehicleOutcome>> {
        let envs = envs.to_vec();
        self.thread
            .write(move |tx| batch::apply_vehicle_batch(tx, &envs))
            .await
    }

    async fn claim_batch(
        &self,
        consumer: &str,
        requests: &[ClaimRequest],
        lease: Duration,
    ) -> StoreResult<Vec<ClaimOutcome>> {
        let (consumer, requests) = (consumer.to_string(), requests.to_vec());
        self.thread
            .write(move |tx| batch::claim_batch(tx, &consumer, &requests, lease))
            .await
    }

    async fn finish_batch(
        &self,
        consumer: &str,
        results: &[ClaimResult],
    ) -> StoreResult<Vec<MessageKey>> {
        if results.is_empty() {
            return Ok(Vec::new());
        }
        let (consumer, results) = (consumer.to_string(), results.to_vec());
        self.thread
            .write(move |tx| batch::finish_batch(tx, &consumer, &results))
            .await
    }

    async fn purge_processed_batch(&self, cutoff: DateTime<Utc>, batch: i64) -> StoreResult<u64> {
        consumer_sql::purge_picked_batch(&*self.sql().0, cutoff, batch).await
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use sqlx::sqlite::SqliteConnectOptions;
    use sqlx::ConnectOptions;

    use super::*;
    use crate::store::repair::{ClaimFilter, StrandedClaim};
    use crate::store::vehicle_batch::tests::event;

    fn item(key: &str, device: &str) -> Recordable {
        Recordable {
            key: MessageKey::from_stored(key.to_string()),
            fingerprint: Fingerprint::from_stored(format!("fp-{key}")),
            write: BusinessWrite::CountZoneExit {
                device_id: device.into(),
            },
        }
    }

    /// Whether another connection takes the write lock within 5 s (an abandoned
    /// job may still be running on the store's thread).
    async fn lock_frees(url: &str) -> bool {
        for _ in 0..500 {
            if lock_is_free(url).await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// Whether another connection could take the write lock right now.
    async fn lock_is_free(url: &str) -> bool {
        let mut probe = SqliteConnectOptions::from_str(url)
            .unwrap()
            .busy_timeout(Duration::ZERO)
            .connect()
            .await
            .unwrap();
        match sqlx::query("BEGIN IMMEDIATE").execute(&mut probe).await {
            Ok(_) => {
                sqlx::query("ROLLBACK").execute(&mut probe).await.unwrap();
                true
            }
            Err(_) => false,
        }
    }

    #[tokio::test]
    async fn a_failed_or_abandoned_batch_leaves_no_transaction_behind() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("s.db").display());
        let store = SqliteStore::open(&url, Durability::Durable).await.unwrap();
        sqlx::query(
            "CREATE TRIGGER boom BEFORE INSERT ON trip_counters WHEN NEW.device_id = 'BOOM'
             BEGIN SELECT RAISE(ABORT, 'boom'); END",
        )
        .execute(store.pool())
        .await
        .unwrap();

        // Fails in its last call, after its dedup rows went in: none of it stays.
        let failed = store
            .record_batch("c", &[item("k1", "D1"), item("k2", "BOOM")])
            .await;
        assert!(failed.is_err());
        assert!(store.processed_keys("c", "k").await.unwrap().is_empty());
        assert_eq!(store.zone_exits("D1").await.unwrap(), 0);
        assert!(lock_frees(&url).await);

        // Abandoned by its caller once handed to the store's thread: the job runs
        // whole there or, if it had not started, not at all; either way the lock
        // comes back and the batch kept all of it or nothing. (The thread's own
        // tests abandon a job half-way through: `sqlite_thread::tests`.)
        for attempt in 0..20 {
            let counted_before = store.zone_exits("D3").await.unwrap();
            let key = format!("abandoned-{attempt}");
            let batch = [item(&key, "D3")];
            let mut abandoned = Box::pin(store.record_batch("c", &batch));
            let _ = futures::poll!(&mut abandoned);
            tokio::time::sleep(Duration::from_millis(attempt % 3)).await;
            drop(abandoned);
            assert!(lock_frees(&url).await, "the abandoned batch's lock");
            let kept = store.processed_keys("c", &key).await.unwrap().len();
            let counted = store.zone_exits("D3").await.unwrap();
            assert_eq!(
                counted - counted_before,
                kept as i64,
                "dedup row without its business row or the reverse"
            );
        }

        // And the store goes on.
        let ok = store
            .record_batch("c", &[item("k4", "D1"), item("k4", "D1")])
            .await
            .unwrap();
        let ok: Vec<_> = ok.into_iter().map(DedupOutcome::without_age).collect();
        let dup = DedupOutcome::Duplicate { first_at: None };
        assert_eq!(ok, [DedupOutcome::Applied, dup]);
        assert_eq!(store.zone_exits("D1").await.unwrap(), 1);
    }

    fn request(key: &str) -> ClaimRequest {
        ClaimRequest {
            key: MessageKey::from_stored(key.to_string()),
            fingerprint: Fingerprint::from_stored(format!("fp-{key}")),
            provider_key: format!("pk-{key}"),
            message: key.as_bytes().to_vec(),
        }
    }

    fn result(key: &str, finish: ClaimFinish) -> ClaimResult {
        ClaimResult {
            key: MessageKey::from_stored(key.to_string()),
            finish,
            attempts: None,
        }
    }

    /// Claim `a` sent ("ok"), `b` failed ("refused"), `c` released ("later").
    fn finished_a_b_c() -> [ClaimResult; 3] {
        let done = |state, detail: &str| ClaimFinish::Done {
            state,
            detail: detail.to_string(),
        };
        [
            result("a", done(ClaimState::Sent, "ok")),
            result("b", done(ClaimState::Failed, "refused")),
            result(
                "c",
                ClaimFinish::Release {
                    detail: "later".to_string(),
                },
            ),
        ]
    }

    /// Each batch job on the store's thread (`batch.rs`) answers for every
    /// item of its batch and reads what the batches before it stored: a key or an
    /// event is a duplicate in the next batch, a vehicle's state makes an older event
    /// late, a claim is busy until finished, then done, or in doubt at once when
    /// released. (The conformance suite's SQLite half checks the same against
    /// one-by-one calls; this is the one the `--lib` mutation runs reach.)
    #[tokio::test]
    async fn each_batch_job_answers_every_item_and_reads_what_the_batches_before_stored() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("s.db").display());
        let store = SqliteStore::open(&url, Durability::Durable).await.unwrap();

        let mut recorded = Vec::new();
        for batch in [
            vec![item("k1", "D1")],
            vec![item("k1", "D1"), item("k2", "D1")],
        ] {
            let got = store.record_batch("c", &batch).await.unwrap();
            recorded.push(
                got.into_iter()
                    .map(DedupOutcome::without_age)
                    .collect::<Vec<_>>(),
            );
        }
        use DedupOutcome::Applied;
        let dup = DedupOutcome::Duplicate { first_at: None };
        assert_eq!(recorded, [vec![Applied], vec![dup, Applied]]);
        assert_eq!(store.zone_exits("D1").await.unwrap(), 2);

        let position = r#""lat":1.0,"lon":2.0"#;
        let first = [event("V1", 5, "position", position)];
        assert_eq!(
            store.apply_vehicle_batch(&first).await.unwrap(),
            [VehicleOutcome::Applied]
        );
        let next = [
            event("V1", 5, "position", position),
            event("V1", 4, "position", position),
            event("V1", 6, "zone_enter", r#""zone":"Z""#),
        ];
        let decided = store.apply_vehicle_batch(&next).await.unwrap();
        assert_eq!(
            decided
                .iter()
                .cloned()
                .map(VehicleOutcome::without_age)
                .collect::<Vec<_>>(),
            [
                VehicleOutcome::Duplicate { first_at: None },
                VehicleOutcome::Late,
                VehicleOutcome::Applied
            ]
        );
        // The duplicate carries when its history row was received: moments ago.
        let age = decided[0].duplicate_age(chrono::Utc::now()).unwrap();
        assert!(age < std::time::Duration::from_secs(60), "{age:?}");
        let state = store.vehicle_state("V1").await.unwrap().unwrap();
        assert_eq!((state.last_seq, state.zone.as_deref()), (6, Some("Z")));
        assert_eq!(store.vehicle_history("V1").await.unwrap().len(), 3);

        let lease = Duration::from_secs(3600);
        let keys = [request("a"), request("b"), request("c")];
        let claimed = store.claim_batch("s", &keys, lease).await.unwrap();
        assert!(
            matches!(
                &claimed[..],
                [ClaimOutcome::Fresh(a), ClaimOutcome::Fresh(_), ClaimOutcome::Fresh(_)]
                    if a.provider_key == "pk-a"
            ),
            "{claimed:?}"
        );
        let busy = store.claim_batch("s", &keys[..1], lease).await.unwrap();
        assert_eq!(busy, [ClaimOutcome::Busy]);
        let results = finished_a_b_c();
        store.finish_batch("s", &results).await.unwrap();
        let again = store.claim_batch("s", &keys, lease).await.unwrap();
        // Each finished claim is a duplicate that knows when its key was first
        // processed, and its age is kept for the consumer.
        assert!(
            matches!(
                again[..2],
                [
                    ClaimOutcome::Done(ClaimState::Sent, Some(_)),
                    ClaimOutcome::Done(ClaimState::Failed, Some(_))
                ]
            ),
            "{again:?}"
        );
        let kept = store.duplicate_ages().await.unwrap();
        assert!(kept.iter().any(|a| a.consumer == "s"), "{kept:?}");
        assert!(
            matches!(&again[2], ClaimOutcome::Released(c) if c.provider_key == "pk-c"),
            "{again:?}"
        );
        let a = store.claim("s", &keys[0].key).await.unwrap().unwrap();
        assert_eq!(
            (a.state, a.detail.as_deref()),
            (ClaimState::Sent, Some("ok"))
        );
        assert!(a.finished_at.is_some());
        let c = store.claim("s", &keys[2].key).await.unwrap().unwrap();
        assert_eq!((c.state, c.attempts), (ClaimState::Claimed, 2));
    }

    /// A store file's directories are made when it is opened (the default store is
    /// in a data directory a first run has not made yet); where one cannot be made
    /// (a file stands in its place), the error names it.
    #[tokio::test]
    async fn a_store_file_gets_its_directories_made_or_an_error_that_names_them() {
        let dir = tempfile::tempdir().unwrap();
        let nested = dir.path().join("data").join("idemwatch");
        let url = format!("sqlite://{}", nested.join("s.db").display());
        let store = SqliteStore::open(&url, Durability::Durable).await.unwrap();
        assert_eq!(store.zone_exits("D1").await.unwrap(), 0);
        assert!(nested.join("s.db").is_file());

        let file = dir.path().join("a-file");
        std::fs::write(&file, "").unwrap();
        let url = format!("sqlite://{}", file.join("s.db").display());
        match SqliteStore::open(&url, Durability::Durable).await {
            Err(StoreError::CreateDir { path, .. }) => assert_eq!(path, file),
            other => panic!("{other:?}"),
        }
    }

    /// SQLite's store with [`Store::finish_batch`]'s provided body, which MySQL runs
    /// (it has no job of its own for it), in place of SQLite's job; every other
    /// method is SQLite's own.
    struct ProvidedFinish(SqliteStore);

    #[async_trait]
    impl Store for ProvidedFinish {
        fn sql(&self) -> SqlHandle {
            self.0.sql()
        }
        fn redacted_url(&self) -> String {
            self.0.redacted_url()
        }
        fn durability(&self) -> Durability {
            self.0.durability()
        }
        async fn record_batch(
            &self,
            c: &str,
            items: &[Recordable],
        ) -> StoreResult<Vec<DedupOutcome>> {
            self.0.record_batch(c, items).await
        }
        async fn apply_vehicle_batch(&self, envs: &[Message]) -> StoreResult<Vec<VehicleOutcome>> {
            self.0.apply_vehicle_batch(envs).await
        }
        async fn claim_batch(
            &self,
            c: &str,
            requests: &[ClaimRequest],
            lease: Duration,
        ) -> StoreResult<Vec<ClaimOutcome>> {
            self.0.claim_batch(c, requests, lease).await
        }
        async fn purge_processed_batch(
            &self,
            cutoff: DateTime<Utc>,
            batch: i64,
        ) -> StoreResult<u64> {
            self.0.purge_processed_batch(cutoff, batch).await
        }
    }

    #[async_trait]
    impl RepairStore for ProvidedFinish {
        async fn find_dead_letters(&self, f: &DeadLetterFilter) -> StoreResult<Vec<DeadLetter>> {
            self.0.find_dead_letters(f).await
        }
        async fn mark_replayed(&self, id: i64) -> StoreResult<bool> {
            self.0.mark_replayed(id).await
        }
        async fn rearm_failed_claim(&self, c: &str, key: &str, detail: &str) -> StoreResult<bool> {
            self.0.rearm_failed_claim(c, key, detail).await
        }
        async fn list_claims(&self, f: &ClaimFilter) -> StoreResult<Vec<Claim>> {
            self.0.list_claims(f).await
        }
        async fn stranded_claims(
            &self,
            consumers: &[&str],
            claimed_before: DateTime<Utc>,
            limit: i64,
        ) -> StoreResult<Vec<StrandedClaim>> {
            self.0
                .stranded_claims(consumers, claimed_before, limit)
                .await
        }
        async fn resolve_claim(
            &self,
            c: &str,
            key: &str,
            state: ClaimState,
            detail: &str,
        ) -> StoreResult<bool> {
            self.0.resolve_claim(c, key, state, detail).await
        }
    }

    /// [`Store::finish_batch`]'s provided body (MySQL's) records each result on its
    /// claim as SQLite's own job does: a final answer closes the claim with its
    /// detail, a release keeps it open, noted and in doubt at once, a claim with no
    /// result is left as it was, and no result at all changes nothing.
    #[tokio::test]
    async fn the_provided_finish_batch_records_each_result_as_sqlites_own_job_does() {
        let dir = tempfile::tempdir().unwrap();
        let open = |name: &str| {
            let url = format!("sqlite://{}", dir.path().join(name).display());
            async move { SqliteStore::open(&url, Durability::Durable).await.unwrap() }
        };
        let own: Box<dyn Store> = Box::new(open("own.db").await);
        let provided: Box<dyn Store> = Box::new(ProvidedFinish(open("provided.db").await));
        let lease = Duration::from_secs(3600);
        let keys = [request("a"), request("b"), request("c"), request("d")];
        let results = finished_a_b_c();
        let mut seen = Vec::new();
        for store in [&own, &provided] {
            let claimed = store.claim_batch("s", &keys, lease).await.unwrap();
            assert!(claimed.iter().all(|c| matches!(c, ClaimOutcome::Fresh(_))));
            store.finish_batch("s", &[]).await.unwrap();
            store.finish_batch("s", &results).await.unwrap();
            let mut claims = Vec::new();
            for k in &keys {
                let c = store.claim("s", &k.key).await.unwrap().unwrap();
                claims.push((c.state, c.detail, c.attempts, c.finished_at.is_some()));
            }
            let again = store.claim_batch("s", &keys, lease).await.unwrap();
            let again: Vec<_> = again
                .iter()
                .map(|o| match o {
                    ClaimOutcome::Released(c) => format!("released {}", c.provider_key),
                    ClaimOutcome::Done(state, _) => format!("Done({state:?})"),
                    other => format!("{other:?}"),
                })
                .collect();
            seen.push((claims, again));
        }
        let (claimed, sent, failed) = (ClaimState::Claimed, ClaimState::Sent, ClaimState::Failed);
        let text = |s: &str| Some(s.to_string());
        assert_eq!(
            seen[1].0,
            [
                (sent, text("ok"), 1, true),
                (failed, text("refused"), 1, true),
                (claimed, text("later"), 1, false),
                (claimed, None, 1, false),
            ]
        );
        assert_eq!(
            seen[1].1,
            ["Done(Sent)", "Done(Failed)", "released pk-c", "Busy"]
        );
        assert_eq!(seen[0], seen[1], "SQLite's own job, then the provided body");
    }
}
