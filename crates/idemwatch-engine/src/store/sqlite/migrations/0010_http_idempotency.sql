-- The same pattern at the HTTP edge: Idempotency-Key on write endpoints.
-- One row per (caller scope, key): the request's fingerprint, its state, the lease of
-- an in-flight request, and the stored response replayed to every retry.
CREATE TABLE idempotency_keys (
    scope             TEXT NOT NULL,
    idem_key          TEXT NOT NULL,
    route             TEXT NOT NULL,
    fingerprint       TEXT NOT NULL,
    state             TEXT NOT NULL CHECK (state IN ('in_progress', 'completed')),
    locked_until      TEXT,
    response_status   INTEGER,
    response_headers  TEXT,
    response_body     BLOB,
    created_at        TEXT NOT NULL,
    completed_at      TEXT,
    expires_at        TEXT NOT NULL,
    PRIMARY KEY (scope, idem_key)
);
CREATE INDEX idempotency_keys_expires ON idempotency_keys (expires_at);

-- Two write endpoints that are naturally NOT idempotent: each call appends a row.
CREATE TABLE trip_notes (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    device_id   TEXT NOT NULL,
    text        TEXT NOT NULL,
    principal   TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
CREATE INDEX trip_notes_device ON trip_notes (device_id);

CREATE TABLE vehicle_commands (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    device_id   TEXT NOT NULL,
    command     TEXT NOT NULL,
    principal   TEXT NOT NULL,
    status      TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
CREATE INDEX vehicle_commands_device ON vehicle_commands (device_id);
