-- `copy_items_generation` served one statement, a reload's drop of the rows older than its
-- generation (`copy.rs`, run once per reload pass), and cost every apply: `generation` is
-- written by nearly every event, so no update of a copy row could be a heap-only update, and
-- each wrote both indexes. The drop reads the endpoint's rows by the primary key instead (its
-- leading column), as the merge before it already does.
--
-- Inserts leave 15% of each page free, so an item's new version usually fits on its old
-- version's page, which a heap-only update needs.
DROP INDEX copy_items_generation;
ALTER TABLE copy_items SET (fillfactor = 85);
