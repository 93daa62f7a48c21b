-- Dead letters can be replayed (SPEC §8): when the last replay went out and how many
-- replays there were. A replayed message that fails again becomes a new dead letter
-- with its own cause; this row keeps the one it had.
ALTER TABLE dead_letters ADD COLUMN replayed_at TEXT;
ALTER TABLE dead_letters ADD COLUMN replay_count INTEGER NOT NULL DEFAULT 0;
CREATE INDEX dead_letters_consumer ON dead_letters (consumer, received_at);
