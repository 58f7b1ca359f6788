import { test } from 'node:test';
import assert from 'node:assert/strict';
import { decodeChange, isStoryMessage, messageId, RefusedMessage } from '../../src/message';
import { body, endpointId, feed, story } from '../helpers';

function refusal(input: unknown): RefusedMessage {
  try {
    decodeChange(typeof input === 'string' ? input : body(input));
  } catch (error) {
    assert.ok(error instanceof RefusedMessage, `expected a RefusedMessage, got ${String(error)}`);
    return error;
  }
  assert.fail('the message was accepted');
}

test('decodes a feed change, a story message and a notification', () => {
  const e = endpointId();
  const f = decodeChange(body(feed(e, 1, 1)));
  assert.equal(isStoryMessage(f), false);
  assert.equal(f.operation, 'upsert');
  const s = decodeChange(body(story(e, 1, 2)));
  assert.equal(isStoryMessage(s), true);
  const n = decodeChange(body(story(e, 1, 3, { operation: 'notified' })));
  assert.ok(isStoryMessage(n) && n.kind === 'notification');
  assert.equal(messageId(n), `${e}:1:3`);
  // Text and bytes alike.
  assert.deepEqual(decodeChange(JSON.stringify(feed(e, 2, 5))), feed(e, 2, 5));
});

test('refuses another version, naming it, before anything else', () => {
  const e = endpointId();
  for (const v of [2, 0, '1', null]) {
    const error = refusal({ ...feed(e, 1, 1), v });
    assert.equal(error.reason, 'version');
    assert.equal(error.version, v);
    assert.equal(error.messageId, `${e}:1:1`);
    assert.match(error.message, /unknown message version/);
  }
  const { v: _, ...noVersion } = feed(e, 1, 1);
  assert.equal(refusal(noVersion).reason, 'version');
  // A v2 body is refused as such even when nothing else in it is of version 1's shape.
  assert.equal(refusal({ v: 2, whatever: true }).reason, 'version');
});

test('refuses an unknown kind', () => {
  const error = refusal({ ...story(endpointId(), 1, 1), kind: 'poll' });
  assert.equal(error.reason, 'kind');
});

test('refuses malformed bodies', () => {
  const e = endpointId();
  assert.equal(refusal('not json').reason, 'malformed');
  assert.equal(refusal('[1]').reason, 'malformed');
  assert.equal(refusal({ ...feed(e, 1, 1), tenant_id: 'ABC' }).reason, 'malformed');
  assert.equal(refusal({ ...feed(e, 1, 1), webhook_endpoint_id: e.toUpperCase() }).reason, 'malformed');
  assert.equal(refusal({ ...feed(e, 0, 1) }).reason, 'malformed');
  assert.equal(refusal({ ...feed(e, 1, 0) }).reason, 'malformed');
  assert.equal(refusal({ ...feed(e, 1, 1.5) }).reason, 'malformed');
  assert.equal(refusal({ ...feed(e, 1, 1), operation: 'merge' }).reason, 'malformed');
  assert.equal(refusal({ ...feed(e, 1, 1), parts_diff: { added: [] } }).reason, 'malformed');
  assert.equal(refusal({ ...story(e, 1, 1), story_id: '' }).reason, 'malformed');
  assert.equal(refusal({ ...story(e, 1, 1), operation: 'edited' }).reason, 'malformed');
});

test('refuses fields that contradict each other', () => {
  const e = endpointId();
  const upsert = feed(e, 1, 1);
  const { item: _, ...noItem } = upsert;
  assert.equal(refusal(noItem).reason, 'inconsistent');
  assert.equal(refusal({ ...feed(e, 1, 1, { operation: 'remove' }), item: {} }).reason, 'inconsistent');
  assert.equal(refusal({ ...upsert, snapshot: true }).reason, 'inconsistent');
  assert.equal(refusal({ ...upsert, event_id: null }).reason, 'inconsistent');
  assert.equal(refusal({ ...feed(e, 1, 1, { operation: 'snapshot_begin' }), subject: 'x' }).reason, 'inconsistent');
  assert.equal(refusal({ ...feed(e, 1, 1, { operation: 'snapshot_end' }), snapshot: false, event_id: 'x' }).reason, 'inconsistent');
  assert.equal(refusal({ ...story(e, 1, 1, { operation: 'notified' }), kind: 'story' }).reason, 'inconsistent');
  assert.equal(refusal({ ...story(e, 1, 1), kind: 'notification' }).reason, 'inconsistent');
  assert.equal(refusal({ ...story(e, 1, 1), merged_into: 'story-2' }).reason, 'inconsistent');
  assert.equal(refusal({ ...story(e, 1, 1), story: { id: 'other' } }).reason, 'inconsistent');
  assert.equal(refusal({ ...story(e, 1, 1, { operation: 'closed' }), story: { id: 'story-1' } }).reason, 'inconsistent');
  assert.equal(refusal(story(e, 1, 1, { operation: 'dropped', reload_round: null, event_id: 'x' })).reason, 'inconsistent');
  assert.equal(refusal(story(e, 1, 1, { operation: 'notified', event_id: null, snapshot: true })).reason, 'inconsistent');
  // A closed story's merge is fine.
  assert.equal(decodeChange(body(story(e, 1, 1, { operation: 'closed', merged_into: 'story-2' }))).operation, 'closed');
});
