-- Items (in the copy and in the outbox) kept as JSON text (`json`) instead of `jsonb`.
--
-- Nothing queries into an item: the sequencer writes it, and the publisher, the control plane
-- and the sequencer itself (to compare it with the next version) read it back whole, as text.
-- With `jsonb`, Postgres parsed every item it was given into its binary form (twice per
-- change: the copy row and the change row) and printed it back to text on every read; `json`
-- only checks the text is JSON and keeps it as given. The relay writes items as compact JSON,
-- so what the outbox holds is what the change message carries, byte for byte.
--
-- Changing the type rewrites both tables, under an exclusive lock, once. The columns keep lz4
-- (the type change resets a column's compression to the server's default, pglz).
ALTER TABLE copy_items ALTER COLUMN item TYPE json USING item::json;
ALTER TABLE copy_items ALTER COLUMN item SET COMPRESSION lz4;

ALTER TABLE changes ALTER COLUMN item TYPE json USING item::json;
ALTER TABLE changes ALTER COLUMN item SET COMPRESSION lz4;
