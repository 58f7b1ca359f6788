-- Reload rounds (relay-rules' rule R-MERGE-SAME-GENERATION). A reload under the generation the
-- copy already holds (after a restore from backup, a refetch that kept failing, a message under
-- another access_version at the held generation) cannot tell, by generation alone, the items
-- the upstream withdrew before it began from those written while it read. Each track counts the
-- reloads begun on it; each copy row keeps the count current when it was written, and a reload
-- keeps its own number in its JSON. Constant defaults: no table rewrite.
ALTER TABLE endpoint_tracks ADD COLUMN reloads_begun bigint NOT NULL DEFAULT 0;
ALTER TABLE copy_items ADD COLUMN round bigint NOT NULL DEFAULT 0;
