-- `idemwatch mark deploy|incident|note` (SPEC §8): markers gain the kinds `incident`
-- and `note`. SQLite cannot alter a CHECK constraint, so the table is rebuilt with
-- its rows and ids.
CREATE TABLE markers_new (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    kind    TEXT NOT NULL CHECK (kind IN ('deploy', 'restart', 'drill', 'manual', 'incident', 'note')),
    at      TEXT NOT NULL,
    label   TEXT NOT NULL,
    detail  TEXT
);
INSERT INTO markers_new (id, kind, at, label, detail) SELECT id, kind, at, label, detail FROM markers;
DROP TABLE markers;
ALTER TABLE markers_new RENAME TO markers;
CREATE INDEX markers_at ON markers (at);
