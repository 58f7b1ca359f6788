-- Which endpoints' reloads wait for one of a sequencer's reload slots (a feed reload's pass, a
-- stories endpoint's sync), and since when, for the endpoint's state: a tenant whose reloads
-- queue behind its own share of the slots sees it, and so does an operator whose process has
-- too few. A row is written only when a reload could not take a slot at once, and deleted when
-- it takes one (or stops waiting), so a reload that finds a slot free costs no write. `token`
-- is the waiting owner's fencing token: a row left by a process that stopped while it waited
-- names a token the endpoint's fence has moved past, and the state does not show it.
CREATE TABLE reload_slot_waits (
    endpoint_id    uuid PRIMARY KEY REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    tenant_id      uuid NOT NULL,
    token          bigint NOT NULL,
    waiting_since  timestamptz NOT NULL
);
