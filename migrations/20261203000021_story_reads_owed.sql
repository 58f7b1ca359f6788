-- A fetch-on-notify read that still failed after its tries: the event is applied for its other
-- effects and the cursor (messages or catch-up) moves on, and the story is owed a read, written
-- in the same transaction that moved the cursor. The endpoint's sync reads it again when
-- `next_attempt_at` comes, saves or closes the story from what it reads, and deletes the row in
-- that transaction, only if no failed read recorded it again meanwhile (`recorded` unchanged):
-- a newer event whose read failed keeps its debt. Rows of an endpoint go with it (offboarding's
-- ENDPOINT_TABLES); no foreign key, as for `stories`: only the sequencer writes here, under the
-- endpoint's fence and writer lock.
CREATE TABLE story_reads_owed (
    endpoint_id      uuid NOT NULL,
    story_id         text NOT NULL,
    tenant_id        uuid NOT NULL,
    -- The first failed read the row stands for; a later one keeps it.
    owed_since       timestamptz NOT NULL DEFAULT now(),
    -- Runs whose read of it failed and recorded it: bumped by each, never by the sync's retries.
    recorded         bigint NOT NULL DEFAULT 1,
    -- The sync's reads of it that failed; the next waits longer, to a cap.
    attempts         integer NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    last_error       text,
    PRIMARY KEY (endpoint_id, story_id)
);
-- The sync's due reads, and the sweep's endpoints with reads due.
CREATE INDEX story_reads_owed_due ON story_reads_owed (endpoint_id, next_attempt_at);
