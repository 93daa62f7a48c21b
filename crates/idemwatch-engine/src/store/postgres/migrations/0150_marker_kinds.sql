-- `idemwatch mark deploy|incident|note` (SPEC §8): markers gain the kinds `incident`
-- and `note`.
ALTER TABLE markers DROP CONSTRAINT IF EXISTS markers_kind_check;
ALTER TABLE markers ADD CONSTRAINT markers_kind_check
    CHECK (kind IN ('deploy', 'restart', 'drill', 'manual', 'incident', 'note'));
