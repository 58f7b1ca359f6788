-- Where each tenant's changes go. No row means the default: a durable quorum queue that the
-- relay declares for the tenant on its own broker. `own_exchange` sends to the tenant's own
-- broker, exchange and routing key instead; `amqp_url` then holds credentials, so the control
-- plane never returns it.
CREATE TABLE tenant_destinations (
    tenant_id    uuid PRIMARY KEY REFERENCES tenants (id) ON DELETE CASCADE,
    kind         text NOT NULL CHECK (kind IN ('relay_queue', 'own_exchange')),
    amqp_url     text,
    exchange     text,
    routing_key  text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CHECK ((kind = 'own_exchange') = (amqp_url IS NOT NULL)),
    CHECK (kind = 'relay_queue' OR (exchange IS NOT NULL AND routing_key IS NOT NULL))
);
