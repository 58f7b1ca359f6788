-- Items and their changes compressed with lz4 instead of pglz.
--
-- A feed item's JSON is a few kilobytes, past the size at which Postgres compresses a value
-- (about 2 kB), so every item the sequencer writes is compressed twice (its copy row and its
-- change row) and read back by the publisher and the control plane. With the default pglz,
-- compression alone took about 6% of the machine's CPU at 2,000 messages/s (perf, BENCHMARKS.md);
-- lz4 does the same work several times faster, for a little less saving of space. Only values
-- written from now on are compressed this way: rows already stored keep pglz and read as before.
-- Needs a server built with lz4 (PostgreSQL 14 and later as packaged by Debian, Ubuntu and the
-- official images).
ALTER TABLE copy_items
    ALTER COLUMN item SET COMPRESSION lz4,
    ALTER COLUMN parts SET COMPRESSION lz4;

ALTER TABLE changes
    ALTER COLUMN item SET COMPRESSION lz4,
    ALTER COLUMN parts_diff SET COMPRESSION lz4;
