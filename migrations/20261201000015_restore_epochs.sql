-- After the database is restored from a backup (docs/restore.md).
--
-- 1. Each endpoint's change stream has an epoch. The outbox numbers an endpoint's changes
--    1, 2, 3 ... within its epoch, and the message id is <endpoint>:<epoch>:<change_seq>. A backup
--    holds the counter as it was then: numbering on from it after a restore would send again
--    numbers the old relay had already sent, with other content. So a restore begins a new epoch
--    (`relay restored`): the old epoch's rows go, and the new stream opens with a snapshot of the
--    copy (a `snapshot_begin` marker, one `upsert` per item with `snapshot` set, a `snapshot_end`
--    marker), after which the live changes follow. An epoch only grows: the restore takes the
--    greater of one more than the backup's and the restore's time in milliseconds, so two
--    restores of the same backup never share one. Existing streams are epoch 1.
ALTER TABLE endpoint_change_counters ADD COLUMN epoch bigint NOT NULL DEFAULT 1
    CHECK (epoch >= 1);

-- A snapshot's rows (its markers and its upserts) have no event and no reload as their cause.
ALTER TABLE changes ADD COLUMN snapshot boolean NOT NULL DEFAULT false;
ALTER TABLE changes DROP CONSTRAINT changes_operation_check;
ALTER TABLE changes ADD CONSTRAINT changes_operation_check
    CHECK (operation IN ('upsert', 'remove', 'snapshot_begin', 'snapshot_end')) NOT VALID;
ALTER TABLE changes VALIDATE CONSTRAINT changes_operation_check;
ALTER TABLE changes DROP CONSTRAINT changes_check;
ALTER TABLE changes ADD CONSTRAINT changes_cause_check
    CHECK (num_nonnulls(event_id, reload_generation) + snapshot::int = 1) NOT VALID;
ALTER TABLE changes VALIDATE CONSTRAINT changes_cause_check;
ALTER TABLE changes ADD CONSTRAINT changes_snapshot_check
    CHECK (snapshot OR operation IN ('upsert', 'remove')) NOT VALID;
ALTER TABLE changes VALIDATE CONSTRAINT changes_snapshot_check;

-- 2. A restore the relay was told of (`relay restored`), one row per endpoint, held until the
--    endpoint's rewind is answered: the feed track's `through` and `last_was_reset` as the backup
--    kept them. Messages that arrive after the restart move the track's own `through`; the rewind
--    must still start from the backup's, or what the old relay applied after the backup is never
--    sent again. `restored_at` bounds the event ids applied since the restore, which are
--    forgotten when the rewind is answered: a rewind resends them under a newer generation.
CREATE TABLE endpoint_restores (
    endpoint_id     uuid PRIMARY KEY,
    tenant_id       uuid NOT NULL,
    through         text COLLATE "C",
    last_was_reset  boolean NOT NULL,
    restored_at     timestamptz NOT NULL
);
