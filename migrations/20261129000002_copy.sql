-- Each endpoint's copy of the feed, the event ids applied to it, and the outbox of changes the
-- relay sends on. The sequencer writes all three in one transaction per decision, so a backup
-- holds them consistent with each other (reading rule "Keep the event ids you applied with the
-- copy, in the same transactions and backups").
--
-- No foreign keys to webhook_endpoints, as for `messages`: these rows are written only by the
-- sequencer for endpoints whose stored messages it applies, and a key check would add a lock on
-- the endpoint row per write. Removing an endpoint's copy is the control plane's explicit job.

-- What the copy holds of each subject: the item, or the tombstone a removal leaves (kept until a
-- reload of a later generation drops it, so that an older update arriving late cannot bring the
-- item back). `generation` and `sequence` are the position of the event (or reload read) that
-- wrote the row; every write compares against them in its own `where` (relay-rules'
-- `precedence`). Sequences compare as strings (the wire file's rule): `collate "C"` makes `<`
-- a byte comparison, whatever the database's default collation.
CREATE TABLE copy_items (
    endpoint_id  uuid NOT NULL,
    subject      text NOT NULL,
    tenant_id    uuid NOT NULL,
    generation   bigint NOT NULL CHECK (generation >= 0),
    sequence     text COLLATE "C" NOT NULL,
    tombstone    boolean NOT NULL,
    -- From the item; for a tombstone, from the subject's prefix (null when it names no kind).
    item_kind    text,
    company_id   bigint,
    -- The item's [{part_id, part_version}], in its order: what the outbox's parts diff compares.
    parts        jsonb NOT NULL DEFAULT '[]',
    -- The item's JSON as received; null for a tombstone.
    item         jsonb,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (endpoint_id, subject),
    CHECK (tombstone = (item IS NULL))
);
-- A reload's drop (`delete ... where generation < $g`) reads one endpoint's older rows.
CREATE INDEX copy_items_generation ON copy_items (endpoint_id, generation);

-- The event ids applied to each endpoint's copy (rule "De-duplicate events by id, for each
-- endpoint"), inserted in the transaction that applies the event.
--
-- Retention (proposed, not yet enforced by a job): an id is needed only while the upstream may
-- send its event again: retries (a day at most before the backlog becomes a reset:
-- reset_after_failing_s) and rewinds after a restore, which resend what was applied since the
-- backup. So keep ids for as long as the oldest backup that may be restored, plus a day; delete
-- `where applied_at < now() - that`. Losing an id too early cannot corrupt the copy (every write
-- is conditional on position, so re-applying an event changes nothing); it only costs a repeated
-- refetch read.
CREATE TABLE applied_events (
    endpoint_id  uuid NOT NULL,
    event_id     text NOT NULL,
    tenant_id    uuid NOT NULL,
    applied_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (endpoint_id, event_id)
);
CREATE INDEX applied_events_applied_at ON applied_events (applied_at);

-- The per-endpoint counter of `changes`. Every write that appends a change advances it in the same
-- transaction (`last = last + 1 ... returning last`), which holds the row locked until commit:
-- writers of one endpoint queue here, so numbers follow commit order and have no gaps (a rolled
-- back transaction rolls its number back too).
CREATE TABLE endpoint_change_counters (
    endpoint_id  uuid PRIMARY KEY,
    tenant_id    uuid NOT NULL,
    last         bigint NOT NULL DEFAULT 0
);

-- The outbox: each change of an endpoint's copy, numbered 1, 2, 3 ... per endpoint with no gaps,
-- so a publisher that sends "the next change_seq" can never skip one that commits late. Replaying
-- an endpoint's changes in order onto an empty map rebuilds its copy's items.
CREATE TABLE changes (
    endpoint_id        uuid NOT NULL,
    change_seq         bigint NOT NULL CHECK (change_seq >= 1),
    tenant_id          uuid NOT NULL,
    operation          text NOT NULL CHECK (operation IN ('upsert', 'remove')),
    subject            text NOT NULL,
    item_kind          text,
    -- The position written: the event's, or the reload read's. A reload's drop has no sequence of
    -- its own: its removals carry the reload's generation and a null sequence.
    generation         bigint NOT NULL,
    sequence           text COLLATE "C",
    -- What caused it: an event (its id), or a reload's merge (its generation).
    event_id           text,
    reload_generation  bigint,
    -- The item stored, on upsert.
    item               jsonb,
    -- {added, changed, removed} part ids against the item held before.
    parts_diff         jsonb NOT NULL,
    created_at         timestamptz NOT NULL DEFAULT now(),
    published_at       timestamptz,
    PRIMARY KEY (endpoint_id, change_seq),
    CHECK ((event_id IS NULL) <> (reload_generation IS NULL)),
    CHECK ((operation = 'upsert') = (item IS NOT NULL))
);
-- The publisher reads each endpoint's unpublished changes in order.
CREATE INDEX changes_unpublished ON changes (endpoint_id, change_seq) WHERE published_at IS NULL;
