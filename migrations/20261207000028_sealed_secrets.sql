-- Secrets sealed at rest (relay-seal): every signing secret, upstream API key and own-broker URL
-- is stored as a sealed value (AES-256-GCM under a data key of its own, wrapped by an operator's
-- key-encryption key that never enters the database) with the id of that key beside it, so a
-- backup, a replica or a `SELECT` yields none of them, and a rotation can count and re-seal what
-- an old key still holds.
--
-- The plain-text columns stay, nullable, only so that `relay migrate` can seal what an older
-- relay stored (it seals them in bounded batches, online, and empties them); every tier refuses
-- to start while one holds a value. Nothing writes them any more.

-- Signing secrets. The unique key on the plain text goes (an index would keep a copy of every
-- secret); a fingerprint keyed by the secret itself (relay-seal's `fingerprint`) tells whether an
-- endpoint holds a secret already.
ALTER TABLE endpoint_secrets
    DROP CONSTRAINT endpoint_secrets_endpoint_id_secret_key,
    ALTER COLUMN secret DROP NOT NULL,
    ADD COLUMN secret_sealed bytea,
    ADD COLUMN secret_key_id text,
    ADD COLUMN secret_fingerprint bytea,
    ADD CONSTRAINT endpoint_secrets_sealed_or_plain CHECK ((secret IS NULL) <> (secret_sealed IS NULL)),
    ADD CONSTRAINT endpoint_secrets_sealed_with_key CHECK (
        (secret_sealed IS NULL) = (secret_key_id IS NULL)
        AND (secret_sealed IS NULL) = (secret_fingerprint IS NULL));
CREATE UNIQUE INDEX endpoint_secrets_fingerprint ON endpoint_secrets (endpoint_id, secret_fingerprint);

-- The key that reads the tenant's feed upstream.
ALTER TABLE webhook_endpoints
    ADD COLUMN upstream_api_key_sealed bytea,
    ADD COLUMN upstream_api_key_key_id text,
    ADD CONSTRAINT webhook_endpoints_api_key_sealed_or_plain
        CHECK (upstream_api_key IS NULL OR upstream_api_key_sealed IS NULL),
    ADD CONSTRAINT webhook_endpoints_api_key_sealed_with_key
        CHECK ((upstream_api_key_sealed IS NULL) = (upstream_api_key_key_id IS NULL));

-- An own broker's URL, with its password.
ALTER TABLE tenant_destinations
    DROP CONSTRAINT tenant_destinations_check,
    ADD COLUMN amqp_url_sealed bytea,
    ADD COLUMN amqp_url_key_id text,
    ADD CONSTRAINT tenant_destinations_own_exchange_has_url
        CHECK ((kind = 'own_exchange') = (amqp_url IS NOT NULL OR amqp_url_sealed IS NOT NULL)),
    ADD CONSTRAINT tenant_destinations_url_sealed_or_plain
        CHECK (amqp_url IS NULL OR amqp_url_sealed IS NULL),
    ADD CONSTRAINT tenant_destinations_url_sealed_with_key
        CHECK ((amqp_url_sealed IS NULL) = (amqp_url_key_id IS NULL));
