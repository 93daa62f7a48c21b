-- The message a side-effect claim was taken for (its envelope as JSON), so that a
-- claim left in doubt can be re-driven by the claim sweeper even when no redelivery
-- ever comes (the queue gave up on it, or it was purged). NULL on claims taken
-- before this column existed: those wait for a redelivery or `claims resolve`.
ALTER TABLE side_effect_claims ADD COLUMN message BLOB;
