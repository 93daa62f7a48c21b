-- idemwatch business tables on PostgreSQL (SPEC §3).

-- Dedup table: the unique key IS the duplicate detector. Duplicates are inserted with
-- ON CONFLICT DO NOTHING, which finds the conflict in the index before writing a heap
-- tuple: no error, no aborted transaction, no dead tuple per redelivery.
CREATE TABLE processed_messages (
    consumer      text        NOT NULL,
    message_key   text        NOT NULL,
    payload_hash  text        NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_key)
);
-- Per-minute rates, oldest row and the retention purge are index range scans.
CREATE INDEX processed_messages_consumer_at ON processed_messages (consumer, processed_at);
CREATE INDEX processed_messages_processed_at ON processed_messages (processed_at);

CREATE TABLE side_effect_claims (
    consumer      text        NOT NULL,
    message_key   text        NOT NULL,
    provider_key  text        NOT NULL,
    state         text        NOT NULL CHECK (state IN ('claimed', 'sent', 'failed')),
    claimed_at    timestamptz NOT NULL,
    finished_at   timestamptz,
    attempts      bigint      NOT NULL DEFAULT 1,
    detail        text,
    PRIMARY KEY (consumer, message_key)
);
-- Claims in doubt are few; a partial index keeps that query tiny.
CREATE INDEX side_effect_claims_open ON side_effect_claims (claimed_at) WHERE state = 'claimed';

CREATE TABLE vehicle_state (
    device_id        text PRIMARY KEY,
    last_seq         bigint NOT NULL,
    last_event_type  text NOT NULL,
    ignition         text CHECK (ignition IN ('on', 'off')),
    zone             text,
    lat              double precision,
    lon              double precision,
    occurred_at      timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL
);

CREATE TABLE vehicle_history (
    device_id     text        NOT NULL,
    seq           bigint      NOT NULL,
    event_type    text        NOT NULL,
    occurred_at   timestamptz NOT NULL,
    received_at   timestamptz NOT NULL,
    applied       boolean     NOT NULL,
    payload       jsonb       NOT NULL,
    payload_hash  text        NOT NULL,
    PRIMARY KEY (device_id, seq, event_type)
);
CREATE INDEX vehicle_history_received ON vehicle_history (received_at);
CREATE INDEX vehicle_history_late ON vehicle_history (received_at) WHERE NOT applied;

CREATE TABLE trip_counters (
    device_id   text PRIMARY KEY,
    zone_exits  bigint NOT NULL DEFAULT 0
);

CREATE TABLE dead_letters (
    id           bigserial PRIMARY KEY,
    consumer     text        NOT NULL,
    reason       text        NOT NULL,
    detail       text,
    raw          bytea       NOT NULL,
    received_at  timestamptz NOT NULL
);
CREATE INDEX dead_letters_received ON dead_letters (received_at);

CREATE TABLE markers (
    id      bigserial PRIMARY KEY,
    kind    text        NOT NULL CHECK (kind IN ('deploy', 'restart', 'drill', 'manual')),
    at      timestamptz NOT NULL,
    label   text        NOT NULL,
    detail  text
);
CREATE INDEX markers_at ON markers (at);

CREATE TABLE drill_runs (
    id           bigserial PRIMARY KEY,
    scenario     text        NOT NULL,
    mode         text        NOT NULL,
    started_at   timestamptz NOT NULL,
    finished_at  timestamptz,
    verdict      text,
    report       jsonb
);
