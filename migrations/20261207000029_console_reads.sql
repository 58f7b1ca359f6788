-- What the console shows beside an endpoint's id: a name its tenant gives it (optional; the
-- upstream knows the endpoint by its id only).
ALTER TABLE webhook_endpoints ADD COLUMN name text CHECK (char_length(name) BETWEEN 1 AND 200);

-- Each endpoint's activity over the last eight days, in quarter hours, for the console's charts
-- of a day and a week (GET /v1/endpoints/{id}/activity?window=day|week). Nothing is written
-- per message: every sequencer process samples every endpoint every few seconds, and a quarter
-- hour's row keeps the highest arrival number and change number seen in it and the greatest
-- apply lag. The messages received in a quarter hour are its arrivals_through less the row
-- before it's (arrival numbers have no gaps; an endpoint's first row counts from 0, as its
-- numbers do); the changes written, the same of changes_through within one epoch (a new epoch
-- numbers its changes from 1 again). An endpoint with nothing new since its last row and
-- nothing waiting writes no row. Rows older than eight days are deleted by the sampler, but
-- each endpoint's latest.
CREATE TABLE endpoint_activity_samples (
    endpoint_id       uuid NOT NULL,
    quarter           timestamptz NOT NULL,
    tenant_id         uuid NOT NULL,
    arrivals_through  bigint NOT NULL CHECK (arrivals_through >= 0),
    change_epoch      bigint NOT NULL CHECK (change_epoch >= 1),
    changes_through   bigint NOT NULL CHECK (changes_through >= 0),
    apply_lag_s       double precision NOT NULL CHECK (apply_lag_s >= 0),
    PRIMARY KEY (endpoint_id, quarter)
);
CREATE INDEX endpoint_activity_samples_quarter ON endpoint_activity_samples (quarter);

-- The endpoints registered before this table: a row far in the past with their numbers now, so
-- that their first sample counts only what came after it, not all they ever received.
INSERT INTO endpoint_activity_samples
    (endpoint_id, quarter, tenant_id, arrivals_through, change_epoch, changes_through,
     apply_lag_s)
SELECT n.endpoint_id, TIMESTAMPTZ '2000-01-01 00:00:00+00', e.tenant_id, n.last_arrival_seq,
       COALESCE(k.epoch, 1), COALESCE(k.last, 0), 0
FROM endpoint_arrival_counters n
JOIN webhook_endpoints e ON e.id = n.endpoint_id
LEFT JOIN endpoint_change_counters k ON k.endpoint_id = n.endpoint_id;
