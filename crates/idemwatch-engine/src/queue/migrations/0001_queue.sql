-- The embedded queue: a broker in its own SQLite file (SPEC §3, last paragraph).
-- One row per (queue, message). A lease hides the row until visible_at; ack deletes it.
CREATE TABLE queue_messages (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    queue           TEXT NOT NULL,
    body            BLOB NOT NULL,
    published_at    INTEGER NOT NULL,   -- unix ms
    visible_at      INTEGER NOT NULL,   -- unix ms; leased rows are invisible until then
    delivery_count  INTEGER NOT NULL DEFAULT 0,
    lease_token     TEXT
);
CREATE INDEX queue_messages_ready ON queue_messages (queue, visible_at, id);
