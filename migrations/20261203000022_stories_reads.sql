-- What a stories endpoint's reads show that its queue's messages say: a row closed by a merge
-- names the story it merged into (as the `closed` message does), a claimed notification names
-- its story, ticker and the event that claimed it (as the `notified` message does), and the
-- endpoint's state tells a reload in full that runs from one that is owed.

-- Written by the close that appended the row's `closed` change; null for a row that is open or
-- closed other than by a merge.
ALTER TABLE stories
    ADD COLUMN merged_into text,
    ADD CONSTRAINT stories_merged_into_closed CHECK (merged_into IS NULL OR closed);

-- Written by the claim's insert. Null `ticker`: a story with none; null `event_id` only on a
-- claim made before this migration whose `notified` change was already forgotten.
ALTER TABLE claimed
    ADD COLUMN story_id text,
    ADD COLUMN ticker   text,
    ADD COLUMN event_id text;

-- The round of the reload in full that began and has not finished; null when none runs (a
-- reload may still be owed: `reload_needed`).
ALTER TABLE stories_sync ADD COLUMN reload_round bigint;

-- Rows written before: the story from the key (every key is `strong:<story id>`), the rest
-- from what the outbox still holds.
UPDATE claimed SET story_id = substr(key, length('strong:') + 1);
ALTER TABLE claimed ALTER COLUMN story_id SET NOT NULL;
UPDATE claimed c SET ticker = n.ticker, event_id = n.event_id
FROM changes n
WHERE n.endpoint_id = c.endpoint_id AND n.kind = 'notification' AND n.subject = c.story_id;
UPDATE stories s SET merged_into = last_close.merged_into
FROM (SELECT DISTINCT ON (endpoint_id, subject) endpoint_id, subject, merged_into
      FROM changes WHERE kind = 'story' AND operation = 'closed'
      ORDER BY endpoint_id, subject, change_seq DESC) last_close
WHERE s.endpoint_id = last_close.endpoint_id AND s.id = last_close.subject AND s.closed
  AND last_close.merged_into IS NOT NULL;
