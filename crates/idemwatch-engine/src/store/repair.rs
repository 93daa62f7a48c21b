//! The operator's side of the store: finding dead letters to replay and recording
//! that they were replayed (docs/CONTRACT.md §8 `dead-letters`), and the claims an operator
//! lists and resolves by hand (`claims`).
//!
//! A trait of its own, a supertrait of [`super::Store`], so every store has it and
//! the consumers' hot path (one file per backend) stays apart from these rare,
//! human-driven statements (written once for every backend, in `repair_sql.rs`).

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{Claim, ClaimState, DeadLetter, StoreResult};

/// Most rows one listing returns: a dead-letter table can hold millions of rows
/// after a bad deploy, and a listing is read by a person or one script call.
pub const MAX_LISTED: i64 = 10_000;

/// Which dead letters a listing or a replay takes. Empty fields match everything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterFilter {
    pub consumer: Option<String>,
    pub reason: Option<String>,
    /// Received at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only these ids (empty: any id).
    pub ids: Vec<i64>,
    /// Also the letters already replayed. A replayed message that fails again is a
    /// new dead letter, so a second blanket replay would send the old row again;
    /// asking by `ids` always includes them.
    pub include_replayed: bool,
    /// Newest first, at most this many (capped at [`MAX_LISTED`]).
    pub limit: i64,
}

impl Default for DeadLetterFilter {
    fn default() -> Self {
        DeadLetterFilter {
            consumer: None,
            reason: None,
            since: None,
            ids: Vec::new(),
            include_replayed: true,
            limit: MAX_LISTED,
        }
    }
}

impl DeadLetterFilter {
    /// The newest `limit` dead letters, whatever they are.
    pub fn newest(limit: i64) -> Self {
        DeadLetterFilter {
            limit,
            ..DeadLetterFilter::default()
        }
    }

    /// The row limit actually applied.
    pub fn capped_limit(&self) -> i64 {
        self.limit.clamp(0, MAX_LISTED)
    }

    /// Whether already-replayed letters are taken.
    pub fn takes_replayed(&self) -> bool {
        self.include_replayed || !self.ids.is_empty()
    }
}

/// Operator statements every backend implements (see the module doc).
#[async_trait]
pub trait RepairStore: Send + Sync {
    /// Dead letters matching `filter`, newest first.
    async fn find_dead_letters(&self, filter: &DeadLetterFilter) -> StoreResult<Vec<DeadLetter>>;

    /// Record one replay of dead letter `id`: `replayed_at = now`, `replay_count + 1`.
    /// The `detail` (the last cause) is left as it was. `false` when there is no such row.
    async fn mark_replayed(&self, id: i64) -> StoreResult<bool>;

    /// Re-arm a `failed` claim for a replay of its `provider_rejected` dead letter:
    /// it becomes `claimed` again with an expired lease (claimed at the epoch), the
    /// same provider key, and `detail`, so the replayed message takes it over in
    /// doubt and sends once with that key. Without this the replay finds `failed`
    /// and is dropped as a duplicate: no SMS ever. `false` when the key has no
    /// `failed` claim (sent, open, or none): nothing is changed.
    async fn rearm_failed_claim(
        &self,
        consumer: &str,
        key: &str,
        detail: &str,
    ) -> StoreResult<bool>;

    /// Claims, oldest first: all of them, or only those in `state`, or of `consumer`.
    async fn list_claims(&self, filter: &ClaimFilter) -> StoreResult<Vec<Claim>>;

    /// Open claims of `consumers` taken before `claimed_before` (their lease is over:
    /// in doubt), with the message each was taken for (None on claims older than the
    /// `message` column), oldest first, at most `limit`.
    async fn stranded_claims(
        &self,
        consumers: &[&str],
        claimed_before: DateTime<Utc>,
        limit: i64,
    ) -> StoreResult<Vec<StrandedClaim>>;

    /// An operator's decision on an open claim, from the provider's own records:
    /// `claimed` becomes `state` with `detail`. `false` when there is no open claim
    /// for that key (already finished, or none): nothing is changed.
    async fn resolve_claim(
        &self,
        consumer: &str,
        key: &str,
        state: ClaimState,
        detail: &str,
    ) -> StoreResult<bool>;

    /// The newest `limit` dead letters ([`RepairStore::find_dead_letters`] unfiltered).
    async fn dead_letters(&self, limit: i64) -> StoreResult<Vec<DeadLetter>> {
        self.find_dead_letters(&DeadLetterFilter::newest(limit))
            .await
    }
}

/// Which claims [`RepairStore::list_claims`] returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimFilter {
    pub consumer: Option<String>,
    pub state: Option<ClaimState>,
    /// At most this many (capped at [`MAX_LISTED`]; 0 means the cap).
    pub limit: i64,
}

impl ClaimFilter {
    pub fn capped_limit(&self) -> i64 {
        if self.limit <= 0 {
            MAX_LISTED
        } else {
            self.limit.min(MAX_LISTED)
        }
    }
}

/// An open claim whose lease is over, with what is needed to finish it.
#[derive(Debug, Clone, PartialEq)]
pub struct StrandedClaim {
    pub claim: Claim,
    /// The envelope the claim was taken for, as JSON.
    pub message: Option<Vec<u8>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listing asks for at most `MAX_LISTED` rows and never a negative count; a
    /// claim listing's 0 (or less) is the cap, not "none".
    #[test]
    fn a_listing_takes_its_limit_up_to_the_cap() {
        let letters = |limit| DeadLetterFilter::newest(limit).capped_limit();
        assert_eq!(
            [-5, 0, 7, MAX_LISTED, MAX_LISTED + 1].map(letters),
            [0, 0, 7, MAX_LISTED, MAX_LISTED]
        );
        let claims = |limit| {
            ClaimFilter {
                limit,
                ..ClaimFilter::default()
            }
            .capped_limit()
        };
        assert_eq!(
            [-5, 0, 1, 7, MAX_LISTED + 1].map(claims),
            [MAX_LISTED, MAX_LISTED, 1, 7, MAX_LISTED]
        );
    }

    /// `newest` is the unfiltered listing (replayed letters included) with its own limit.
    #[test]
    fn the_newest_letters_are_every_letter_up_to_the_limit() {
        let newest = DeadLetterFilter::newest(3);
        let every = DeadLetterFilter::default();
        assert_eq!((newest.limit, newest.takes_replayed()), (3, true));
        assert_eq!(DeadLetterFilter { limit: 3, ..every }, newest);
    }

    /// A blanket listing leaves replayed letters out only when asked to; a listing by
    /// id always takes them (the operator named the row).
    #[test]
    fn replayed_letters_are_taken_unless_left_out_of_a_blanket_listing() {
        let takes = |include_replayed, ids: &[i64]| {
            DeadLetterFilter {
                include_replayed,
                ids: ids.to_vec(),
                ..DeadLetterFilter::default()
            }
            .takes_replayed()
        };
        assert_eq!(
            [
                takes(true, &[]),
                takes(false, &[]),
                takes(false, &[4]),
                takes(true, &[4])
            ],
            [true, false, true, true]
        );
    }
}
