-- idemwatch business tables on SQLite (SPEC §3). Timestamps are TEXT in the fixed
-- form YYYY-MM-DDTHH:MM:SS.ffffffZ so that text order is time order.

-- Dedup table: the unique key IS the duplicate detector.
CREATE TABLE processed_messages (
    consumer      TEXT NOT NULL,
    message_key   TEXT NOT NULL,
    payload_hash  TEXT NOT NULL,
    processed_at  TEXT NOT NULL,
    PRIMARY KEY (consumer, message_key)
) WITHOUT ROWID;
-- Per-minute rates, oldest row and the retention purge are range scans on this.
CREATE INDEX processed_messages_processed_at ON processed_messages (processed_at);
CREATE INDEX processed_messages_consumer_at ON processed_messages (consumer, processed_at);

CREATE TABLE side_effect_claims (
    consumer      TEXT NOT NULL,
    message_key   TEXT NOT NULL,
    provider_key  TEXT NOT NULL,
    state         TEXT NOT NULL CHECK (state IN ('claimed', 'sent', 'failed')),
    claimed_at    TEXT NOT NULL,
    finished_at   TEXT,
    attempts      INTEGER NOT NULL DEFAULT 1,
    detail        TEXT,
    PRIMARY KEY (consumer, message_key)
) WITHOUT ROWID;
CREATE INDEX side_effect_claims_state ON side_effect_claims (state, claimed_at);

CREATE TABLE vehicle_state (
    device_id        TEXT PRIMARY KEY,
    last_seq         INTEGER NOT NULL,
    last_event_type  TEXT NOT NULL,
    ignition         TEXT CHECK (ignition IN ('on', 'off')),
    zone             TEXT,
    lat              REAL,
    lon              REAL,
    occurred_at      TEXT NOT NULL,
    updated_at       TEXT NOT NULL
);

CREATE TABLE vehicle_history (
    device_id     TEXT NOT NULL,
    seq           INTEGER NOT NULL,
    event_type    TEXT NOT NULL,
    occurred_at   TEXT NOT NULL,
    received_at   TEXT NOT NULL,
    applied       INTEGER NOT NULL,
    payload       TEXT NOT NULL,
    payload_hash  TEXT NOT NULL,
    PRIMARY KEY (device_id, seq, event_type)
);
CREATE INDEX vehicle_history_late ON vehicle_history (applied, received_at);
CREATE INDEX vehicle_history_received ON vehicle_history (received_at);

CREATE TABLE trip_counters (
    device_id   TEXT PRIMARY KEY,
    zone_exits  INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE dead_letters (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer     TEXT NOT NULL,
    reason       TEXT NOT NULL,
    detail       TEXT,
    raw          BLOB NOT NULL,
    received_at  TEXT NOT NULL
);
CREATE INDEX dead_letters_reason ON dead_letters (reason, received_at);

CREATE TABLE markers (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    kind    TEXT NOT NULL CHECK (kind IN ('deploy', 'restart', 'drill', 'manual')),
    at      TEXT NOT NULL,
    label   TEXT NOT NULL,
    detail  TEXT
);
CREATE INDEX markers_at ON markers (at);

CREATE TABLE drill_runs (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    scenario     TEXT NOT NULL,
    mode         TEXT NOT NULL,
    started_at   TEXT NOT NULL,
    finished_at  TEXT,
    verdict      TEXT,
    report       TEXT
);
