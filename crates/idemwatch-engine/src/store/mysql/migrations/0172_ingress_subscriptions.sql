-- The MQTT topic filters an ingress session was last subscribed to (issue 44): a
-- broker keeps a persistent session's subscriptions across reconnects, so a filter
-- dropped from `ingest mqtt --topic` must be unsubscribed by name, and MQTT has no way
-- to ask which filters a session holds. `session` is the broker's host:port and the
-- client id; `filters` a JSON array of the filters as subscribed ($share/… included).
CREATE TABLE ingress_subscriptions (
    session     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL PRIMARY KEY,
    filters     MEDIUMTEXT   NOT NULL,
    updated_at  DATETIME(6)  NOT NULL
) ENGINE=InnoDB;
