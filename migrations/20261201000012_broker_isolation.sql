-- Tenant isolation on the broker side.
--
-- A destination the publisher refused (it resolved to the relay's own broker, or to an address
-- the operator does not allow; checked at every connect, since a DNS answer can change after
-- the control plane accepted it): why, and since when, so the tenant can read it from
-- GET /v1/destination. Cleared when a connect succeeds or the destination is set again.
ALTER TABLE tenant_destinations
    ADD COLUMN refused_reason text,
    ADD COLUMN refused_at timestamptz;

-- Each tenant's own credentials on the relay's broker: a RabbitMQ user that may consume the
-- tenant's queue and nothing else. The password is never stored here (RabbitMQ keeps only its
-- salted hash); it is shown to the tenant once, when made or rotated.
CREATE TABLE tenant_broker_users (
    tenant_id   uuid PRIMARY KEY REFERENCES tenants (id) ON DELETE CASCADE,
    username    text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    rotated_at  timestamptz NOT NULL DEFAULT now()
);
