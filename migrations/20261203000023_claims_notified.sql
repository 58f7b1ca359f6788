-- Whether a claim sent its notification: a strong story that became strong before its endpoint
-- was registered is claimed without one (relay-rules' decide_notify), and the tenant's list of
-- claims says which were sent. Claims made before this column were all sent.
ALTER TABLE claimed ADD COLUMN notified boolean NOT NULL DEFAULT true;
