import { test } from 'node:test';
import assert from 'node:assert/strict';
import { MemoryStore } from '../../src/memory-store';
import { endpointId, upsert } from '../helpers';
import { storeSuite } from '../store-suite';

storeSuite('memory store', {
  async make(handlers) {
    const store = new MemoryStore({ handlers });
    return {
      store,
      items: async (e) => store.items(e),
      tombstones: async (e) => [...(store.feed.get(e) ?? new Map()).values()].filter((r) => r.tombstone).map((r) => r.subject),
      stories: async (e) =>
        new Map([...store.storyRows(e)].map(([id, r]) => [id, { version: r.version, closed: r.closed, merged_into: r.merged_into, story: r.story }])),
    };
  },
});

test('memory store: starts from the positions it is given', async () => {
  const e = endpointId();
  const store = new MemoryStore({ positions: new Map([[e, { epoch: 3, lastChangeSeq: 7 }]]) });
  assert.equal((await store.apply([upsert(e, 3, 7, 'a', 1, '1', {})])).skipped, 1);
  assert.equal((await store.apply([upsert(e, 3, 8, 'a', 1, '1', { ok: true })])).applied, 1);
  assert.deepEqual(store.items(e).get('a'), { ok: true });
});
