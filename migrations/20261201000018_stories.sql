-- The stories source (seed 000): an endpoint is either the feed's (everything before this) or
-- the stories API's. A stories endpoint keeps a copy of its tickers' stories by the seed's two
-- writes, claims its notifications, and catches up from `GET /v1/events`.

-- The kind is fixed when the endpoint is registered: a copy of one kind is never read as the
-- other. A stories endpoint always has its mode and its tickers; a feed endpoint has neither.
ALTER TABLE webhook_endpoints
    ADD COLUMN source       text NOT NULL DEFAULT 'feed' CHECK (source IN ('feed', 'stories')),
    ADD COLUMN stories_mode text CHECK (stories_mode IN ('snapshot', 'fetch_on_notify')),
    ADD COLUMN tickers      text[],
    ADD CONSTRAINT webhook_endpoints_stories_settings
        CHECK ((source = 'stories') = (stories_mode IS NOT NULL AND tickers IS NOT NULL));

-- Seed 000's table, one per endpoint: one row per story, kept when the story closes (the row
-- is what stops a closed story coming back). `version` is a bigint rather than the seed's
-- integer: it holds every version the event parser accepts, so no event fails on the column.
-- No foreign key to webhook_endpoints, as for copy_items: only the sequencer writes here, under
-- the endpoint's fence and writer lock.
CREATE TABLE stories (
    endpoint_id  uuid NOT NULL,
    id           text NOT NULL,
    tenant_id    uuid NOT NULL,
    ticker       text,
    version      bigint NOT NULL,
    closed       boolean NOT NULL DEFAULT false,
    story        jsonb,            -- the snapshot; null once closed
    PRIMARY KEY (endpoint_id, id),
    CHECK (closed = (story IS NULL))
);
-- A reload's second step (the stories the copy holds open) and a ticker's removal.
CREATE INDEX stories_by_ticker ON stories (endpoint_id, ticker) WHERE NOT closed;

-- Seed 000's claimed notifications, per endpoint: a key is claimed by the single insert that
-- writes it, and a notification is appended only when that insert returned a row. Kept through
-- reloads, so a story is never notified twice.
CREATE TABLE claimed (
    endpoint_id  uuid NOT NULL,
    key          text NOT NULL,
    tenant_id    uuid NOT NULL,
    claimed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (endpoint_id, key)
);

-- Each stories endpoint's catch-up and reload state. `cursor` is the catch-up cursor after the
-- last page applied (null: from the start of the window), written in the transaction that
-- applied the page. `rounds` counts the reloads and ticker loads begun: the round a reload's
-- writes name as their cause. `loaded_tickers` are the tickers whose stories were loaded once
-- (a ticker added later is loaded when the worker sees it missing here). `reload_needed` is set
-- by a 410 (or an operator) and cleared by the reload's last step.
CREATE TABLE stories_sync (
    endpoint_id     uuid PRIMARY KEY,
    tenant_id       uuid NOT NULL,
    cursor          text,
    rounds          bigint NOT NULL DEFAULT 0,
    loaded_tickers  text[] NOT NULL DEFAULT '{}',
    reload_needed   boolean NOT NULL DEFAULT true,
    caught_up_at    timestamptz,
    reloaded_at     timestamptz,
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- The outbox carries a stories endpoint's changes too, in the same gapless change_seq per
-- endpoint: `kind` says which message a row becomes. A story row is `saved` (its snapshot in
-- `item`), `closed` (with `merged_into` when it merged away) or `dropped` (its ticker was removed
-- from the endpoint); a notification is `notified` (the snapshot of the event that claimed it).
-- `story_version` is the row's version after the write, `ticker` the row's. A stories change has
-- no feed position: generation 0, no sequence, no parts.
ALTER TABLE changes
    ADD COLUMN kind          text NOT NULL DEFAULT 'item',
    ADD COLUMN story_version bigint,
    ADD COLUMN ticker        text,
    ADD COLUMN merged_into   text;
ALTER TABLE changes ADD CONSTRAINT changes_kind_check
    CHECK (CASE kind
               WHEN 'item' THEN operation IN ('upsert', 'remove', 'snapshot_begin', 'snapshot_end')
                                AND story_version IS NULL AND merged_into IS NULL
                                AND ticker IS NULL
               WHEN 'story' THEN operation IN ('saved', 'closed', 'dropped')
                                 AND story_version IS NOT NULL
                                 AND (merged_into IS NULL OR operation = 'closed')
               WHEN 'notification' THEN operation = 'notified' AND story_version IS NOT NULL
                                        AND merged_into IS NULL
               ELSE false
           END) NOT VALID;
ALTER TABLE changes VALIDATE CONSTRAINT changes_kind_check;
ALTER TABLE changes DROP CONSTRAINT changes_operation_check;
ALTER TABLE changes ADD CONSTRAINT changes_operation_check
    CHECK (operation IN ('upsert', 'remove', 'snapshot_begin', 'snapshot_end',
                         'saved', 'closed', 'dropped', 'notified')) NOT VALID;
ALTER TABLE changes VALIDATE CONSTRAINT changes_operation_check;
ALTER TABLE changes DROP CONSTRAINT changes_snapshot_check;
ALTER TABLE changes ADD CONSTRAINT changes_snapshot_check
    CHECK (snapshot OR operation NOT IN ('snapshot_begin', 'snapshot_end')) NOT VALID;
ALTER TABLE changes VALIDATE CONSTRAINT changes_snapshot_check;
ALTER TABLE changes DROP CONSTRAINT changes_check1;
ALTER TABLE changes ADD CONSTRAINT changes_item_check
    CHECK ((operation IN ('upsert', 'saved', 'notified')) = (item IS NOT NULL)) NOT VALID;
ALTER TABLE changes VALIDATE CONSTRAINT changes_item_check;
