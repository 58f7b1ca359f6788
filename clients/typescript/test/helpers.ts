// Builders of version 1 messages for the tests, shaped as docs/change-message.v1.schema.json and
// docs/story-message.v1.schema.json describe them.

import { randomUUID } from 'node:crypto';
import { FeedChange, StoryMessage } from '../src/message';

export const TENANT = '11111111-2222-4333-8444-555555555555';

export function endpointId(): string {
  return randomUUID();
}

type FeedExtra = Partial<FeedChange>;

export function feed(endpoint: string, epoch: number, seq: number, extra: FeedExtra = {}): FeedChange {
  const operation = extra.operation ?? 'upsert';
  const marker = operation === 'snapshot_begin' || operation === 'snapshot_end';
  const snapshot = extra.snapshot ?? marker;
  const base: FeedChange = {
    v: 1,
    tenant_id: TENANT,
    webhook_endpoint_id: endpoint,
    epoch,
    change_seq: seq,
    operation,
    subject: marker ? '' : 'sub-1',
    item_kind: marker ? null : 'item',
    generation: 1,
    sequence: marker ? null : '0001',
    event_id: snapshot ? null : `evt-${epoch}-${seq}`,
    reload_generation: null,
    snapshot,
    parts_diff: { added: [], changed: [], removed: [] },
    changed_at: '2026-12-01T10:00:00.000Z',
  };
  const out: FeedChange = { ...base, ...extra };
  if (operation === 'upsert' && out.item === undefined) out.item = { value: seq };
  if (operation !== 'upsert') delete out.item;
  return out;
}

export function upsert(endpoint: string, epoch: number, seq: number, subject: string, generation: number, sequence: string, item: Record<string, unknown>): FeedChange {
  return feed(endpoint, epoch, seq, { operation: 'upsert', subject, generation, sequence, item });
}

export function remove(endpoint: string, epoch: number, seq: number, subject: string, generation: number, sequence: string): FeedChange {
  return feed(endpoint, epoch, seq, { operation: 'remove', subject, generation, sequence });
}

type StoryExtra = Partial<StoryMessage>;

export function story(endpoint: string, epoch: number, seq: number, extra: StoryExtra = {}): StoryMessage {
  const operation = extra.operation ?? 'saved';
  const storyId = extra.story_id ?? 'story-1';
  const snapshot = extra.snapshot === true;
  const out: StoryMessage = {
    v: 1,
    kind: operation === 'notified' ? 'notification' : 'story',
    tenant_id: TENANT,
    webhook_endpoint_id: endpoint,
    epoch,
    change_seq: seq,
    operation,
    story_id: storyId,
    ticker: 'ACME',
    version: 1,
    event_id: snapshot || operation === 'dropped' ? null : `evt-${epoch}-${seq}`,
    reload_round: operation === 'dropped' ? 1 : null,
    changed_at: '2026-12-01T10:00:00.000Z',
    ...extra,
  };
  if ((operation === 'saved' || operation === 'notified') && out.story === undefined) {
    out.story = { id: out.story_id, headline: `v${out.version}` };
  }
  return out;
}

export function body(message: unknown): Buffer {
  return Buffer.from(JSON.stringify(message));
}
