-- Each tenant's quotas where the operator set its own: a NULL column is the operator's default
-- (the settings RELAY_QUOTA_*, which every tier reads), so a changed default reaches every
-- tenant without one of its own, and a tenant with no row has every default. Gone with the
-- tenant.
CREATE TABLE tenant_quotas (
    tenant_id               uuid PRIMARY KEY REFERENCES tenants (id) ON DELETE CASCADE,
    -- Endpoints registered at once (those being deleted do not count).
    max_endpoints           integer CHECK (max_endpoints BETWEEN 1 AND 1000000),
    -- Messages the front tier takes per second for the tenant's endpoints together.
    max_messages_per_second integer CHECK (max_messages_per_second BETWEEN 1 AND 1000000),
    updated_at              timestamptz NOT NULL DEFAULT now()
);
