-- The control plane's additions: the language each endpoint reads the upstream in.
--
-- The upstream serves /v1/feed and /v1/feed/items in a language (`lang`); the wire file's reload
-- rule reads the endpoint's language from GET /v1/webhook-endpoints/{id} as it is now, and a
-- refetch reads "in the endpoint's lang". The tenant states it when registering the endpoint so
-- that support can see it and a refetch need not ask first. Null for endpoints registered before
-- this column existed (or by the CLI without it): readers then ask the upstream.
ALTER TABLE webhook_endpoints
    ADD COLUMN lang text CHECK (lang ~ '^[a-z]{2,3}(-[A-Za-z0-9]{1,8})*$');

