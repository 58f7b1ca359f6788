-- How many calls to each endpoint's upstream have failed in a row since the last that answered
-- well: the endpoint's state shows it beside the last failure, so a reload or read that keeps
-- failing (and backs off) is told from one that failed once. A success sets it back to 0.
ALTER TABLE endpoint_upstream_status
    ADD COLUMN consecutive_failures integer NOT NULL DEFAULT 0;

-- A row failing now has failed at least once.
UPDATE endpoint_upstream_status SET consecutive_failures = 1 WHERE failing_since IS NOT NULL;
