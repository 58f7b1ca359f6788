-- The sequencer's fencing tokens: one row per endpoint, whose token rises by one each time a
-- worker takes ownership of the endpoint. Every transaction that applies the endpoint's
-- messages checks, under a share lock on this row, that the token is still its own; a worker
-- that stalled past its Redis lock's expiry therefore cannot write once another has taken over.
-- Kept in Postgres rather than Redis because Redis here keeps nothing on disk: a counter there
-- would start again at 1 after a restart, below the tokens already handed out.
CREATE TABLE endpoint_fences (
    endpoint_id  uuid PRIMARY KEY REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    token        bigint NOT NULL,
    claimed_at   timestamptz NOT NULL DEFAULT now()
);
