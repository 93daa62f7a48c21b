-- The same pattern at the HTTP edge: Idempotency-Key on write endpoints.
CREATE TABLE idempotency_keys (
    scope             VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    idem_key          VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    route             VARCHAR(128) NOT NULL,
    fingerprint       CHAR(64) CHARACTER SET ascii NOT NULL,
    state             VARCHAR(16)  NOT NULL,
    locked_until      DATETIME(6)  NULL,
    response_status   INT          NULL,
    response_headers  TEXT         NULL,
    response_body     LONGBLOB     NULL,
    created_at        DATETIME(6)  NOT NULL,
    completed_at      DATETIME(6)  NULL,
    expires_at        DATETIME(6)  NOT NULL,
    PRIMARY KEY (scope, idem_key),
    KEY idempotency_keys_expires (expires_at)
) ENGINE=InnoDB;

CREATE TABLE trip_notes (
    id          BIGINT AUTO_INCREMENT PRIMARY KEY,
    device_id   VARCHAR(128) NOT NULL,
    text        TEXT         NOT NULL,
    principal   VARCHAR(128) NOT NULL,
    created_at  DATETIME(6)  NOT NULL,
    KEY trip_notes_device (device_id)
) ENGINE=InnoDB;

CREATE TABLE vehicle_commands (
    id          BIGINT AUTO_INCREMENT PRIMARY KEY,
    device_id   VARCHAR(128) NOT NULL,
    command     VARCHAR(32)  NOT NULL,
    principal   VARCHAR(128) NOT NULL,
    status      VARCHAR(16)  NOT NULL,
    created_at  DATETIME(6)  NOT NULL,
    KEY vehicle_commands_device (device_id)
) ENGINE=InnoDB;
