-- How each endpoint's calls to its upstream (the sequencer's reads: reloads, refetches) fare, for
-- the endpoint's state: the last failure's kind and text, when failing began, when the last one
-- happened, and when the upstream answered well again. No row: no call has failed yet. A success
-- writes only to end a failing stretch, so an endpoint whose upstream answers costs no write.
CREATE TABLE endpoint_upstream_status (
    endpoint_id      uuid PRIMARY KEY REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    tenant_id        uuid NOT NULL,
    -- A name for users: certificate_unknown_issuer, certificate_expired, connect, timeout,
    -- status, refused, ...
    last_error_kind  text NOT NULL,
    -- The failure with its whole chain of causes.
    last_error       text NOT NULL,
    -- Set by the first failure after a success; NULL once a call answers well again.
    failing_since    timestamptz,
    last_failure_at  timestamptz NOT NULL,
    -- When a success last ended a failing stretch.
    last_success_at  timestamptz
);
