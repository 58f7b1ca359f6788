-- Each stored message's number of events, as the front tier read it (1 for a stories webhook;
-- null for a body it could not read, and for messages stored before this column).
--
-- How a message was applied used to be one row of `message_applications` per message, written
-- in its apply transaction. Almost every message is applied with all its events, and that needs
-- no row: the apply cursor passing the message says it was applied, and this count says how many
-- events were. `message_applications` now holds the exceptions only (a test message, another
-- track, an older generation, a reload begun or superseded, events ignored, a quarantine).
ALTER TABLE messages ADD COLUMN events integer CHECK (events >= 0);
