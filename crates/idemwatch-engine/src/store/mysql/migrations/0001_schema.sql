-- idemwatch business tables on MySQL / MariaDB (SPEC §3), InnoDB, UTC DATETIME(6).
-- Keys use a binary collation: message keys and device ids are case-sensitive.

CREATE TABLE processed_messages (
    consumer      VARCHAR(64)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_key   VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    payload_hash  CHAR(64)     CHARACTER SET ascii NOT NULL,
    processed_at  DATETIME(6)  NOT NULL,
    PRIMARY KEY (consumer, message_key),
    KEY processed_messages_consumer_at (consumer, processed_at),
    KEY processed_messages_processed_at (processed_at)
) ENGINE=InnoDB;

CREATE TABLE side_effect_claims (
    consumer      VARCHAR(64)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_key   VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    provider_key  VARCHAR(255) NOT NULL,
    state         VARCHAR(16)  NOT NULL,
    claimed_at    DATETIME(6)  NOT NULL,
    finished_at   DATETIME(6)  NULL,
    attempts      BIGINT       NOT NULL DEFAULT 1,
    detail        TEXT         NULL,
    PRIMARY KEY (consumer, message_key),
    KEY side_effect_claims_state (state, claimed_at)
) ENGINE=InnoDB;

CREATE TABLE vehicle_state (
    device_id        VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL PRIMARY KEY,
    last_seq         BIGINT       NOT NULL,
    last_event_type  VARCHAR(32)  NOT NULL,
    ignition         VARCHAR(3)   NULL,
    zone             VARCHAR(255) NULL,
    lat              DOUBLE       NULL,
    lon              DOUBLE       NULL,
    occurred_at      DATETIME(6)  NOT NULL,
    updated_at       DATETIME(6)  NOT NULL
) ENGINE=InnoDB;

CREATE TABLE vehicle_history (
    device_id     VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    seq           BIGINT       NOT NULL,
    event_type    VARCHAR(32)  NOT NULL,
    occurred_at   DATETIME(6)  NOT NULL,
    received_at   DATETIME(6)  NOT NULL,
    applied       BOOLEAN      NOT NULL,
    payload       LONGTEXT     NOT NULL,
    payload_hash  CHAR(64)     CHARACTER SET ascii NOT NULL,
    PRIMARY KEY (device_id, seq, event_type),
    KEY vehicle_history_received (received_at),
    KEY vehicle_history_late (applied, received_at)
) ENGINE=InnoDB;

CREATE TABLE trip_counters (
    device_id   VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL PRIMARY KEY,
    zone_exits  BIGINT NOT NULL DEFAULT 0
) ENGINE=InnoDB;

CREATE TABLE dead_letters (
    id           BIGINT AUTO_INCREMENT PRIMARY KEY,
    consumer     VARCHAR(64)  NOT NULL,
    reason       VARCHAR(32)  NOT NULL,
    detail       TEXT         NULL,
    raw          LONGBLOB     NOT NULL,
    received_at  DATETIME(6)  NOT NULL,
    KEY dead_letters_received (received_at)
) ENGINE=InnoDB;

CREATE TABLE markers (
    id      BIGINT AUTO_INCREMENT PRIMARY KEY,
    kind    VARCHAR(16)  NOT NULL,
    at      DATETIME(6)  NOT NULL,
    label   VARCHAR(255) NOT NULL,
    detail  TEXT         NULL,
    KEY markers_at (at)
) ENGINE=InnoDB;

CREATE TABLE drill_runs (
    id           BIGINT AUTO_INCREMENT PRIMARY KEY,
    scenario     VARCHAR(64)  NOT NULL,
    mode         VARCHAR(16)  NOT NULL,
    started_at   DATETIME(6)  NOT NULL,
    finished_at  DATETIME(6)  NULL,
    verdict      VARCHAR(16)  NULL,
    report       LONGTEXT     NULL
) ENGINE=InnoDB;
