-- The front tier's tables: tenants, the webhook endpoints they register with us, each
-- endpoint's signing secrets, and every message the relay answered 2xx for.
-- Every row carries its tenant, so the control plane can scope every query by it.

CREATE TABLE tenants (
    id          uuid PRIMARY KEY,
    name        text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- One row per upstream webhook endpoint. `id` is the upstream's webhook_endpoint_id: it is the
-- path the upstream posts to, so it is unique across all tenants.
CREATE TABLE webhook_endpoints (
    id                  uuid PRIMARY KEY,
    tenant_id           uuid NOT NULL REFERENCES tenants (id),
    status              text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'paused')),
    -- Where and how the sequencer reads the upstream's API for reloads and refetches.
    upstream_base_url   text,
    upstream_api_key    text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX webhook_endpoints_tenant ON webhook_endpoints (tenant_id);

-- Each endpoint may hold several secrets at once: during a rotation the upstream signs with the
-- new and the old one until the overlap ends. A secret with no expiry never expires.
-- Stored in the `whsec_<base64>` form: HMAC needs the key itself, so it cannot be hashed.
CREATE TABLE endpoint_secrets (
    id           bigserial PRIMARY KEY,
    tenant_id    uuid NOT NULL REFERENCES tenants (id),
    endpoint_id  uuid NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    secret       text NOT NULL CHECK (secret LIKE 'whsec\_%'),
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz,
    UNIQUE (endpoint_id, secret)
);
CREATE INDEX endpoint_secrets_endpoint ON endpoint_secrets (endpoint_id);

-- The per-endpoint arrival counter. A batch of inserts locks the counters it uses (in endpoint
-- order, so concurrent batches cannot deadlock) and takes numbers from them in the same
-- transaction as the messages: numbers therefore follow commit order per endpoint, and a reader
-- that applies "the next arrival_seq" can never skip a message that commits late. Kept apart
-- from webhook_endpoints so that the hot counter update does not touch (or fire triggers on)
-- the endpoint's own row.
CREATE TABLE endpoint_arrival_counters (
    endpoint_id       uuid PRIMARY KEY REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    last_arrival_seq  bigint NOT NULL DEFAULT 0
);

-- Every message answered 2xx, exactly as received. `body` holds the raw bytes the signature
-- was verified over; `track` and `generation` are copied out of it for the sequencer's queries.
-- No foreign key to webhook_endpoints: the insert only writes rows for endpoints whose counter
-- row it holds locked (and which are active), so the key check would add a row lock on the
-- endpoint per message (a heap write and a WAL record each) and prove nothing new.
CREATE TABLE messages (
    endpoint_id   uuid NOT NULL,
    arrival_seq   bigint NOT NULL,
    tenant_id     uuid NOT NULL,
    webhook_id    text NOT NULL,
    signed_at     timestamptz NOT NULL,
    attempt       integer,
    received_at   timestamptz NOT NULL,
    track         text,
    generation    bigint,
    body          bytea NOT NULL,
    PRIMARY KEY (endpoint_id, arrival_seq),
    UNIQUE (endpoint_id, webhook_id)
);
-- Typical messages are a few KB. Past about 2 KB Postgres would compress every body before
-- storing it, which costs more CPU than it saves; keep rows up to a page inline and
-- uncompressed, and let only large messages go to TOAST.
ALTER TABLE messages SET (toast_tuple_target = 8160);

-- The front tier caches endpoints and their secrets; these triggers tell it when one changed,
-- so a pause or a rotated secret takes effect at once rather than when a cache entry expires.
CREATE FUNCTION notify_endpoint_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('relay_endpoint_changed', COALESCE(NEW.id, OLD.id)::text);
    RETURN NULL;
END $$;

CREATE FUNCTION notify_endpoint_secret_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('relay_endpoint_changed', COALESCE(NEW.endpoint_id, OLD.endpoint_id)::text);
    RETURN NULL;
END $$;

CREATE TRIGGER webhook_endpoints_changed
    AFTER INSERT OR UPDATE OR DELETE ON webhook_endpoints
    FOR EACH ROW EXECUTE FUNCTION notify_endpoint_changed();

CREATE TRIGGER endpoint_secrets_changed
    AFTER INSERT OR UPDATE OR DELETE ON endpoint_secrets
    FOR EACH ROW EXECUTE FUNCTION notify_endpoint_secret_changed();
