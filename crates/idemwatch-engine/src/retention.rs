//! Retention of the dedup table: delete rows older than the retention in bounded
//! batches, one short transaction each.
//!
//! Why batches and not one `DELETE`: a single multi-million-row delete holds row
//! locks and a snapshot for minutes, bloats the WAL/binlog in one go and, if
//! interrupted, rolls everything back. A batch of a few thousand rows commits in
//! milliseconds, so a consumer inserting at the same time waits at most one batch,
//! and an interrupted purge keeps what it already deleted: rerunning it continues.
//! Why not daily partitions dropped whole: see `docs/SCALE.md` — the primary key of
//! a partitioned table must include the partition column, so `(consumer,
//! message_key)` would only be unique within a day, and a redelivery that crosses
//! midnight would be applied twice.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::store::{Store, StoreResult};

/// How long dedup rows are kept: `purge --older-than`'s default, the Redis seen-set's
/// key TTL and the dashboard's `database.retention`. A week outlasts any redelivery a
/// broker or a device makes (the floor below is minutes to an hour).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Rows deleted per purge transaction by default: short transactions beside the
/// consumers' writes, few enough round trips for millions of rows.
pub const DEFAULT_PURGE_BATCH: i64 = 5_000;

/// The least retention a purge may keep without `--force`, whatever the settings.
pub const MIN_RETENTION: Duration = Duration::from_secs(3600);

/// The settings of the consumers that write the database, as far as retention
/// cares: how long after its first delivery a message can still come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedeliveryWindow {
    pub claim_lease: Duration,
    pub visibility_timeout: Duration,
    pub max_deliveries: u32,
}

impl RedeliveryWindow {
    /// The purge floor: the largest of the claim lease, the redelivery window
    /// (visibility timeout × max deliveries) and [`MIN_RETENTION`]. A dedup row
    /// purged younger than this can still meet a redelivery of its message, which is
    /// then applied a second time: the very duplicate the row was there to stop.
    pub fn floor(&self) -> Duration {
        self.claim_lease
            .max(self.visibility_timeout.saturating_mul(self.max_deliveries))
            .max(MIN_RETENTION)
    }
}

/// Why a purge was refused before it touched anything.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RetentionRefused {
    #[error(
        "--older-than {asked} is below the purge floor of {floor} (the largest of the claim \
         lease, visibility timeout x max deliveries, and 1h): a message processed since then \
         can still be redelivered, and without its dedup row it would be applied twice; \
         --force purges anyway"
    )]
    BelowFloor { asked: String, floor: String },
    #[error("--older-than {0} reaches back before any time the database can hold")]
    TooLarge(String),
    #[error(
        "--older-than {asked} is below the oldest duplicate {consumer} has dropped: its key \
         had been processed {oldest} before (duplicate_ages); a copy that late after a purge \
         this young finds no dedup row and is applied twice; --force purges anyway"
    )]
    BelowDuplicateAge {
        asked: String,
        oldest: String,
        consumer: String,
    },
}

/// A purge keeping `older_than` is refused, unless `force`, when a consumer has already
/// dropped a duplicate older than that (`ages`, the store's `duplicate_ages`): the
/// field has shown that copies arrive that late, and the purge would forget their keys.
pub fn check_duplicate_ages(
    older_than: Duration,
    ages: &[crate::store::DuplicateAge],
    force: bool,
) -> Result<(), RetentionRefused> {
    let oldest = ages
        .iter()
        .max_by(|a, b| a.max_age_seconds.total_cmp(&b.max_age_seconds));
    match oldest {
        Some(a) if !force && a.max_age_seconds > older_than.as_secs_f64() => {
            let oldest = Duration::from_secs(a.max_age_seconds as u64);
            Err(RetentionRefused::BelowDuplicateAge {
                asked: humantime::format_duration(older_than).to_string(),
                oldest: humantime::format_duration(oldest).to_string(),
                consumer: a.consumer.clone(),
            })
        }
        _ => Ok(()),
    }
}

/// The cutoff of a purge keeping `older_than`, refused below `window`'s floor unless
/// `force`, and refused (not a panic) when `older_than` reaches past the calendar.
pub fn cutoff_for(
    now: DateTime<Utc>,
    older_than: Duration,
    window: RedeliveryWindow,
    force: bool,
) -> Result<DateTime<Utc>, RetentionRefused> {
    let shown = |d: Duration| humantime::format_duration(d).to_string();
    let floor = window.floor();
    if older_than < floor && !force {
        return Err(RetentionRefused::BelowFloor {
            asked: shown(older_than),
            floor: shown(floor),
        });
    }
    chrono::Duration::from_std(older_than)
        .ok()
        .and_then(|age| now.checked_sub_signed(age))
        .ok_or_else(|| RetentionRefused::TooLarge(shown(older_than)))
}

/// Where a running purge is, reported after every batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PurgeProgress {
    pub deleted: u64,
    pub batches: u64,
    pub elapsed_seconds: f64,
    pub rows_per_second: f64,
    pub last_batch_ms: f64,
}

/// How a purge ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PurgeSummary {
    pub cutoff: DateTime<Utc>,
    pub deleted: u64,
    pub batches: u64,
    pub seconds: f64,
    pub rows_per_second: f64,
    /// The longest batch: the most a concurrent writer of the same rows could wait.
    pub slowest_batch_ms: f64,
    /// Stopped between two batches on request; rerun to continue.
    pub interrupted: bool,
}

/// Knobs of one purge run.
#[derive(Debug, Clone, Copy)]
pub struct PurgePlan {
    pub cutoff: DateTime<Utc>,
    /// Rows per batch (per transaction).
    pub batch: i64,
    /// Sleep between batches, to leave I/O to the consumers.
    pub pause: Duration,
    /// Stop after this many rows (None: until done).
    pub max_rows: Option<u64>,
}

/// Purge until no row is older than the cutoff, `stop` is raised (checked between
/// batches, so a batch is never cut in half), or `max_rows` is reached.
pub async fn purge(
    store: &dyn Store,
    plan: PurgePlan,
    stop: &AtomicBool,
    mut on_batch: impl FnMut(&PurgeProgress),
) -> StoreResult<PurgeSummary> {
    let started = Instant::now();
    let (mut deleted, mut batches, mut slowest) = (0u64, 0u64, Duration::ZERO);
    let mut interrupted = false;
    loop {
        if stop.load(Ordering::SeqCst) {
            interrupted = true;
            break;
        }
        let batch = match plan.max_rows {
            Some(max) if deleted >= max => break,
            Some(max) => plan
                .batch
                .min(i64::try_from(max - deleted).unwrap_or(i64::MAX)),
            None => plan.batch,
        };
        let t = Instant::now();
        let n = store.purge_processed_batch(plan.cutoff, batch).await?;
        let took = t.elapsed();
        if n == 0 {
            break;
        }
        slowest = slowest.max(took);
        deleted += n;
        batches += 1;
        let elapsed = started.elapsed().as_secs_f64();
        on_batch(&PurgeProgress {
            deleted,
            batches,
            elapsed_seconds: elapsed,
            rows_per_second: rate(deleted, elapsed),
            last_batch_ms: took.as_secs_f64() * 1000.0,
        });
        if !plan.pause.is_zero() {
            tokio::time::sleep(plan.pause).await;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(PurgeSummary {
        cutoff: plan.cutoff,
        deleted,
        batches,
        seconds,
        rows_per_second: rate(deleted, seconds),
        slowest_batch_ms: slowest.as_secs_f64() * 1000.0,
        interrupted,
    })
}

fn rate(rows: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        rows as f64 / seconds
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULTS: RedeliveryWindow = RedeliveryWindow {
        claim_lease: Duration::from_secs(60),
        visibility_timeout: Duration::from_secs(30),
        max_deliveries: 10,
    };

    #[test]
    fn the_floor_is_the_largest_of_lease_redelivery_window_and_an_hour() {
        assert_eq!(DEFAULTS.floor(), MIN_RETENTION);
        let slow = RedeliveryWindow {
            visibility_timeout: Duration::from_secs(600),
            ..DEFAULTS
        };
        assert_eq!(slow.floor(), Duration::from_secs(6000));
        let long_lease = RedeliveryWindow {
            claim_lease: Duration::from_secs(7200),
            ..DEFAULTS
        };
        assert_eq!(long_lease.floor(), Duration::from_secs(7200));
    }

    #[test]
    fn a_purge_below_the_floor_is_refused_unless_forced() {
        let now = Utc::now();
        let ten_min = Duration::from_secs(600);
        let refused = cutoff_for(now, ten_min, DEFAULTS, false).unwrap_err();
        assert!(matches!(refused, RetentionRefused::BelowFloor { .. }));
        assert!(refused.to_string().contains("1h"), "{refused}");
        // The floor itself is the least a purge may keep: allowed.
        assert_eq!(
            now - cutoff_for(now, DEFAULTS.floor(), DEFAULTS, false).unwrap(),
            chrono::Duration::hours(1)
        );
        let forced = cutoff_for(now, ten_min, DEFAULTS, true).unwrap();
        assert_eq!(now - forced, chrono::Duration::minutes(10));
        let week = Duration::from_secs(7 * 86_400);
        assert_eq!(
            now - cutoff_for(now, week, DEFAULTS, false).unwrap(),
            chrono::Duration::days(7)
        );
    }

    /// Refused below the oldest duplicate of any consumer, naming it; allowed at or
    /// above it, with --force, or with no duplicate seen yet.
    #[test]
    fn a_purge_younger_than_the_oldest_duplicate_is_refused_unless_forced() {
        let age = |consumer: &str, max_age_seconds: f64| crate::store::DuplicateAge {
            consumer: consumer.into(),
            max_age_seconds,
            observed_at: Utc::now(),
        };
        let ages = [age("trip-counter", 3600.0), age("zone-exit-sms", 11_520.0)];
        let two_hours = Duration::from_secs(7200);
        let refused = check_duplicate_ages(two_hours, &ages, false).unwrap_err();
        let text = refused.to_string();
        assert!(
            text.contains("zone-exit-sms") && text.contains("3h 12m"),
            "{text}"
        );
        assert!(text.contains("--older-than 2h"), "{text}");
        assert_eq!(check_duplicate_ages(two_hours, &ages, true), Ok(()));
        let four_hours = Duration::from_secs(4 * 3600);
        assert_eq!(check_duplicate_ages(four_hours, &ages, false), Ok(()));
        assert_eq!(check_duplicate_ages(two_hours, &[], false), Ok(()));
    }

    #[test]
    fn huge_durations_are_an_error_not_a_panic() {
        for huge in [
            Duration::MAX,
            Duration::from_secs(u64::MAX / 2),
            // Within chrono's Duration, beyond its calendar.
            Duration::from_secs(400_000 * 365 * 86_400),
        ] {
            assert!(matches!(
                cutoff_for(Utc::now(), huge, DEFAULTS, false),
                Err(RetentionRefused::TooLarge(_))
            ));
        }
        let overflowing = RedeliveryWindow {
            visibility_timeout: Duration::MAX,
            ..DEFAULTS
        };
        assert_eq!(overflowing.floor(), Duration::MAX);
    }

    /// What a purge reports is what it did, on a real store (SQLite in a temp dir):
    /// the progress counts every row and batch and times each batch, the summary's
    /// rate is rows over seconds and its slowest batch the slowest reported, the
    /// pause is slept between batches, a bounded run stops at its rows exactly, and
    /// a purge with nothing to do reports zeros (the operator reads these to pace a
    /// purge beside live consumers).
    #[tokio::test]
    async fn a_purge_reports_what_it_did_and_pauses_between_batches() {
        use crate::envelope::Envelope;
        use crate::store::{self, BusinessWrite};

        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("purge.db").display());
        let store = store::open(&url).await.unwrap();
        let write = BusinessWrite::CountZoneExit {
            device_id: "34-R-1".into(),
        };
        for seq in 0..8 {
            let line = format!(
                r#"{{"device_id":"34-R-1","seq":{seq},"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{{"zone":"X"}}}}"#
            );
            let env = Envelope::parse(line.as_bytes()).unwrap();
            store
                .record_once("trip-counter", &env.key(), &env.fingerprint(), &write)
                .await
                .unwrap();
        }
        let pause = Duration::from_millis(30);
        let plan = PurgePlan {
            cutoff: Utc::now() + chrono::Duration::seconds(5),
            batch: 3,
            pause,
            max_rows: Some(5),
        };
        let go = AtomicBool::new(false);
        let mut seen = Vec::new();
        let bounded = purge(store.as_ref(), plan, &go, |p| seen.push(*p))
            .await
            .unwrap();
        assert_eq!(
            (bounded.deleted, bounded.batches, bounded.interrupted),
            (5, 2, false)
        );
        assert_eq!(
            seen.iter()
                .map(|p| (p.deleted, p.batches))
                .collect::<Vec<_>>(),
            [(3, 1), (5, 2)]
        );
        // The first batch is nearly all of the time before its report.
        let first = seen[0];
        assert!(
            first.last_batch_ms >= first.elapsed_seconds * 500.0
                && first.last_batch_ms <= first.elapsed_seconds * 1000.0,
            "{first:?}"
        );
        for p in &seen {
            let expected = p.deleted as f64 / p.elapsed_seconds;
            assert!(
                (p.rows_per_second - expected).abs() < 1e-9 * expected,
                "{p:?}"
            );
        }
        let slowest = seen.iter().map(|p| p.last_batch_ms).fold(0.0, f64::max);
        assert_eq!(bounded.slowest_batch_ms, slowest);
        let expected = 5.0 / bounded.seconds;
        assert!((bounded.rows_per_second - expected).abs() < 1e-9 * expected);
        assert!(
            bounded.seconds >= 2.0 * pause.as_secs_f64(),
            "a pause after each batch: {bounded:?}"
        );

        let rest = PurgePlan {
            max_rows: None,
            pause: Duration::ZERO,
            ..plan
        };
        let done = purge(store.as_ref(), rest, &go, |_| {}).await.unwrap();
        assert_eq!((done.deleted, done.batches), (3, 1));
        let nothing = purge(store.as_ref(), rest, &go, |_| {}).await.unwrap();
        assert_eq!(
            (nothing.deleted, nothing.batches, nothing.slowest_batch_ms),
            (0, 0, 0.0)
        );
        assert_eq!(nothing.rows_per_second, 0.0);
        // No time, no rate (not infinity, not NaN).
        assert_eq!(rate(0, 0.0), 0.0);
        assert_eq!(rate(10, 0.0), 0.0);
    }
}
