-- Each endpoint's apply lag over the last two hours, for the console's chart of the last hour
-- (GET /v1/endpoints/{id}/activity). Every sequencer process samples every endpoint with stored
-- messages waiting every few seconds: one row per endpoint and minute, holding the most any
-- sample of that minute saw (the age of the oldest message waiting). An endpoint with nothing
-- waiting writes nothing: its lag was 0. Rows older than two hours are deleted by the sampler.
CREATE TABLE endpoint_lag_samples (
    endpoint_id  uuid NOT NULL,
    minute       timestamptz NOT NULL,
    tenant_id    uuid NOT NULL,
    apply_lag_s  double precision NOT NULL CHECK (apply_lag_s >= 0),
    PRIMARY KEY (endpoint_id, minute)
);
CREATE INDEX endpoint_lag_samples_minute ON endpoint_lag_samples (minute);
