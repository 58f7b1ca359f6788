-- What the sequencer keeps with each endpoint's copy, written in the same transactions as the
-- copy itself (so a backup holds them consistent with it).

-- How far the endpoint's stored messages are applied: every message with an arrival_seq at or
-- below `applied_arrival_seq` is done. Each apply transaction advances it with
-- `... where applied_arrival_seq = <what it read>`, so a message is applied at most once even if
-- two workers ever raced past the fence.
CREATE TABLE endpoint_apply_cursors (
    endpoint_id          uuid PRIMARY KEY,
    tenant_id            uuid NOT NULL,
    applied_arrival_seq  bigint NOT NULL DEFAULT 0,
    -- received_at of the last message applied, and when: the apply lag the control plane shows.
    last_received_at     timestamptz,
    last_applied_at      timestamptz
);

-- The per endpoint-and-track state of relay-rules' `EndpointTrack`: the generation held, the
-- access_version the copy is held under, the reload begun and not merged (begun again after a
-- restart), and the `through` of the last message of events applied (for a rewind after a
-- restore from backup).
CREATE TABLE endpoint_tracks (
    endpoint_id            uuid NOT NULL,
    track                  text NOT NULL,
    tenant_id              uuid NOT NULL,
    generation             bigint,
    access_version         text,
    through                text,
    last_was_reset         boolean NOT NULL DEFAULT false,
    last_reset_generation  bigint,
    -- The running reload ({generation, access_version, cause}), null when none runs.
    reload                 jsonb,
    reload_begun_at        timestamptz,
    updated_at             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (endpoint_id, track)
);

-- How each stored message was applied (for support: the control plane lists it beside the
-- message). One narrow row per message, written in the message's apply transaction.
CREATE TABLE message_applications (
    endpoint_id     uuid NOT NULL,
    arrival_seq     bigint NOT NULL,
    tenant_id       uuid NOT NULL,
    -- applied | test | ignored_track | older_generation | reload_begun | reload_superseded |
    -- malformed
    outcome         text NOT NULL,
    events_applied  integer NOT NULL DEFAULT 0,
    events_ignored  integer NOT NULL DEFAULT 0,
    applied_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (endpoint_id, arrival_seq)
);
