-- Stored messages the sequencer set aside because they can never be applied: a body that is not
-- a v1 message (the signature proves it came from the upstream, so it was stored), or one whose
-- apply kept failing. The message row itself stays in `messages`; the apply cursor has moved past
-- it and a reload brought the copy to what the upstream holds without it. Written in the same
-- transaction as that cursor move and the reload's track row.
CREATE TABLE quarantined_messages (
    endpoint_id     uuid NOT NULL,
    arrival_seq     bigint NOT NULL,
    tenant_id       uuid NOT NULL,
    -- Why it cannot be applied: the parse error, or the last failure of its apply.
    reason          text NOT NULL,
    -- How many times its apply was tried (1 for a body that does not parse).
    attempts        integer NOT NULL,
    quarantined_at  timestamptz NOT NULL DEFAULT now(),
    -- quarantined: waiting for the tenant; retried: stored again as a new arrival (`retried_as`,
    -- its new arrival_seq); discarded: kept for audit, never applied.
    status          text NOT NULL DEFAULT 'quarantined'
                    CHECK (status IN ('quarantined', 'retried', 'discarded')),
    resolved_at     timestamptz,
    retried_as      bigint,
    PRIMARY KEY (endpoint_id, arrival_seq)
);
-- The endpoint's state counts the ones waiting, and shows the latest reason.
CREATE INDEX quarantined_messages_waiting ON quarantined_messages (endpoint_id, quarantined_at)
    WHERE status = 'quarantined';
-- Such a message's row in message_applications says `quarantined` (beside the outcomes of
-- ..._sequencer_state.sql; `malformed` is no longer written).
