-- How often each stored message came again (answered 200, not stored again), and when last:
-- for the tenant's message listing. Counted by the front tier's batch insert in its own
-- statement, on the row already stored.
ALTER TABLE messages
    ADD COLUMN duplicates        integer NOT NULL DEFAULT 0,
    ADD COLUMN last_duplicate_at timestamptz;
