-- The oldest duplicate each consumer has dropped (issue 41): how long before it its key
-- had first been processed, in seconds, kept in the same transaction as the drop and
-- only raised. `purge` refuses an --older-than below it (a purge that young would let
-- such a duplicate through again) and the dashboard compares every dedup window to it.
CREATE TABLE duplicate_ages (
    consumer         text NOT NULL PRIMARY KEY,
    max_age_seconds  double precision NOT NULL,
    observed_at      timestamptz NOT NULL
);
