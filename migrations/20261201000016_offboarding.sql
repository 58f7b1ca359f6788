-- Offboarding: an endpoint, or a whole tenant, is deleted in two steps. First it is marked, in
-- one statement every tier sees at once: the front tier answers 404 for a `deleting` endpoint
-- (its batch insert reserves numbers only for `active` ones), the sequencer neither sweeps nor
-- claims it, and the control plane no longer shows it. Then the control plane purges its rows in
-- batches and, last, deletes the endpoint's row under its counter's and fence's locks; a restart
-- finds what is still marked and finishes it. The id can be registered again once it is gone.
ALTER TABLE webhook_endpoints DROP CONSTRAINT webhook_endpoints_status_check;
ALTER TABLE webhook_endpoints ADD CONSTRAINT webhook_endpoints_status_check
    CHECK (status IN ('active', 'paused', 'deleting'));
CREATE INDEX webhook_endpoints_deleting ON webhook_endpoints (id) WHERE status = 'deleting';

-- A tenant being deleted: its endpoints are marked with it, and the tenant's row (with its
-- destination, broker user and publishing fence) goes once they are gone and its queues and
-- broker user are removed from the broker.
ALTER TABLE tenants ADD COLUMN deleting_since timestamptz;
