-- The publisher's tables and indexes.
--
-- One publisher owns a tenant at a time (a Redis lease, as the sequencer owns an endpoint); this
-- is its fencing token, one row per tenant, one higher on every acquisition. The statement that
-- marks changes published checks it under a share lock, so a publisher that stalled past its
-- lease cannot mark once another has taken the tenant over. Kept in Postgres, not Redis, for
-- the sequencer's reason: Redis here keeps nothing on disk, and a counter there would restart
-- below the tokens already handed out. Separate from `endpoint_fences`: that table is the
-- sequencer's, per endpoint; the publisher owns whole tenants.
CREATE TABLE publisher_fences (
    tenant_id   uuid PRIMARY KEY REFERENCES tenants (id) ON DELETE CASCADE,
    token       bigint NOT NULL,
    claimed_at  timestamptz NOT NULL DEFAULT now()
);

-- The publisher works tenant by tenant: which tenants have unpublished changes (a loose scan of
-- this index, one probe per tenant), and each of a tenant's endpoints' first unpublished change
-- (one probe per endpoint). Partial like `changes_unpublished`, so it holds only the backlog and
-- stays small while the publisher keeps up; a row leaves it when it is marked published.
CREATE INDEX changes_unpublished_tenant ON changes (tenant_id, endpoint_id, change_seq)
    WHERE published_at IS NULL;
