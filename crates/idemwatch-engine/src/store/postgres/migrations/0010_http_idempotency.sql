-- The same pattern at the HTTP edge: Idempotency-Key on write endpoints.
CREATE TABLE idempotency_keys (
    scope             text        NOT NULL,
    idem_key          text        NOT NULL,
    route             text        NOT NULL,
    fingerprint       text        NOT NULL,
    state             text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    locked_until      timestamptz,
    response_status   integer,
    response_headers  jsonb,
    response_body     bytea,
    created_at        timestamptz NOT NULL,
    completed_at      timestamptz,
    expires_at        timestamptz NOT NULL,
    PRIMARY KEY (scope, idem_key)
);
CREATE INDEX idempotency_keys_expires ON idempotency_keys (expires_at);

CREATE TABLE trip_notes (
    id          bigserial PRIMARY KEY,
    device_id   text        NOT NULL,
    text        text        NOT NULL,
    principal   text        NOT NULL,
    created_at  timestamptz NOT NULL
);
CREATE INDEX trip_notes_device ON trip_notes (device_id);

CREATE TABLE vehicle_commands (
    id          bigserial PRIMARY KEY,
    device_id   text        NOT NULL,
    command     text        NOT NULL,
    principal   text        NOT NULL,
    status      text        NOT NULL,
    created_at  timestamptz NOT NULL
);
CREATE INDEX vehicle_commands_device ON vehicle_commands (device_id);
