// What the end-to-end tests compare: a Postgres store's tables (the library's PgStore) against
// the relay's copies read through its API, and the store's positions against the relay's
// streams.

import { isDeepStrictEqual } from 'node:util';
import { Client } from 'pg';
import { RelayApi } from '@relay/consumer';

/**
 * Runs `run` with a connection of its own. The server may be shared with other test suites: a
 * connection refused as one too many (53300) is tried again for a while, not taken for a failure
 * of what is tested.
 */
export async function withClient<T>(url: string, run: (client: Client) => Promise<T>): Promise<T> {
  const deadline = Date.now() + 30_000;
  let client: Client;
  for (;;) {
    client = new Client({ connectionString: url });
    try {
      await client.connect();
      break;
    } catch (error) {
      await client.end().catch(() => {});
      if ((error as { code?: string }).code !== '53300' || Date.now() > deadline) throw error;
      await new Promise((resolve) => setTimeout(resolve, 250));
    }
  }
  try {
    return await run(client);
  } finally {
    await client.end().catch(() => {});
  }
}

export interface StreamState {
  epoch: number;
  lastChangeSeq: number;
  backlog: number;
}

/** Each endpoint's stream as the relay has it: its epoch, last change_seq and unpublished changes. */
export async function relayStreams(api: RelayApi, endpoints: string[]): Promise<Map<string, StreamState>> {
  const out = new Map<string, StreamState>();
  for (const endpoint of endpoints) {
    const state = await api.state(endpoint);
    out.set(endpoint, {
      epoch: Number(state.change_epoch),
      lastChangeSeq: Number(state.last_change_seq),
      backlog: Number(state.outbox_backlog),
    });
  }
  return out;
}

/** The store's positions (endpoint to epoch and last change_seq). */
export async function storePositions(url: string): Promise<Map<string, { epoch: number; lastChangeSeq: number }>> {
  return withClient(url, async (c) => {
    const exists = await c.query(`SELECT to_regclass('relay_positions') IS NOT NULL AS present`);
    if (!exists.rows[0].present) return new Map();
    const { rows } = await c.query<{ endpoint_id: string; epoch: string; last_change_seq: string }>(
      'SELECT endpoint_id, epoch, last_change_seq FROM relay_positions');
    return new Map(rows.map((r) => [r.endpoint_id, { epoch: Number(r.epoch), lastChangeSeq: Number(r.last_change_seq) }]));
  });
}

/**
 * Whether the store has caught up with every endpoint's stream (nothing left unpublished, the
 * store at the relay's epoch and last change_seq); the lagging ones otherwise.
 */
export async function caughtUp(url: string, api: RelayApi, endpoints: string[]): Promise<{ done: boolean; lagging: string[] }> {
  const streams = await relayStreams(api, endpoints);
  const positions = await storePositions(url);
  const lagging: string[] = [];
  for (const [endpoint, stream] of streams) {
    const position = positions.get(endpoint);
    if (stream.backlog > 0 || !position || position.epoch !== stream.epoch || position.lastChangeSeq !== stream.lastChangeSeq) {
      lagging.push(`${endpoint}: relay epoch ${stream.epoch} change_seq ${stream.lastChangeSeq} (unpublished ${stream.backlog}), store ${position ? `epoch ${position.epoch} change_seq ${position.lastChangeSeq}` : 'nothing'}`);
    }
  }
  return { done: lagging.length === 0, lagging };
}

/** The differences between two maps of rows, described (at most `shown` of each kind). */
export function diffRows(what: string, expected: Map<string, unknown>, actual: Map<string, unknown>, shown = 5): string[] {
  const missing = [...expected.keys()].filter((k) => !actual.has(k));
  const extra = [...actual.keys()].filter((k) => !expected.has(k));
  const differing = [...expected.keys()].filter((k) => actual.has(k) && !isDeepStrictEqual(expected.get(k), actual.get(k)));
  const out: string[] = [];
  if (missing.length) out.push(`${what}: ${missing.length} missing from the store, e.g. ${missing.slice(0, shown).join(', ')}`);
  if (extra.length) out.push(`${what}: ${extra.length} in the store the relay does not have, e.g. ${extra.slice(0, shown).map((k) => `${k} ${JSON.stringify(actual.get(k)).slice(0, 300)}`).join('; ')}`);
  for (const k of differing.slice(0, shown)) {
    out.push(`${what}: ${k} differs: relay ${JSON.stringify(expected.get(k)).slice(0, 400)} store ${JSON.stringify(actual.get(k)).slice(0, 400)}`);
  }
  if (differing.length > shown) out.push(`${what}: ${differing.length} rows differ in all`);
  return out;
}

export interface Compared {
  problems: string[];
  items: number;
  /** Items the relay raised to a later (generation, sequence) without a change, the same content. */
  raised: number;
  stories: number;
  closedStories: number;
  merged: number;
  notifications: number;
}

/**
 * Compares the store's copies with the relay's, read through the API: each feed endpoint's live
 * items (subject, kind, sequence, item; not `generation`: a reload that reads an item again
 * unchanged moves the relay's row to the reload's generation without a change message, so the
 * copy's generation can be ahead of the last change's), the stories endpoint's stories open and
 * closed (ticker, version, closed, merged_into, snapshot), and the notifications recorded with
 * those the relay claimed and sent (`notified`).
 */
export async function compareWithRelay(url: string, api: RelayApi, feedEndpoints: string[], storiesEndpoint: string): Promise<Compared> {
  const problems: string[] = [];
  const result: Compared = { problems, items: 0, raised: 0, stories: 0, closedStories: 0, merged: 0, notifications: 0 };
  await withClient(url, async (c) => {
    for (const endpoint of feedEndpoints) {
      const relay = new Map<string, unknown>();
      const relayRows = new Map<string, { generation: number; sequence: string }>();
      for (const row of await api.copy(endpoint)) {
        if (row.tombstone) continue;
        relay.set(row.subject, { item_kind: row.item_kind, sequence: row.sequence, item: row.item });
        relayRows.set(row.subject, { generation: Number(row.generation), sequence: row.sequence });
      }
      const { rows } = await c.query(
        'SELECT subject, item_kind, generation, sequence, item FROM relay_items WHERE endpoint_id = $1 AND NOT tombstone', [endpoint]);
      const store = new Map<string, unknown>(rows.map((r) => {
        const mine = { item_kind: r.item_kind, sequence: r.sequence, item: r.item };
        const theirs = relayRows.get(r.subject);
        // The relay raises its row to a later (generation, sequence) without a change when an
        // event or a reload finds the item unchanged (services/rules/src/event.rs): the same
        // content at an earlier position is the copy the stream gives.
        if (theirs && theirs.sequence !== r.sequence && isDeepStrictEqual(relay.get(r.subject), { ...mine, sequence: theirs.sequence })
            && earlier(Number(r.generation), r.sequence, theirs.generation, theirs.sequence)) {
          mine.sequence = theirs.sequence;
          result.raised += 1;
        }
        return [r.subject, mine];
      }));
      result.items += store.size;
      problems.push(...diffRows(`feed endpoint ${endpoint} items`, relay, store));
    }
    const relayStories = new Map<string, unknown>();
    for (const s of await api.stories(storiesEndpoint)) {
      relayStories.set(s.id, { ticker: s.ticker, version: Number(s.version), closed: s.closed, merged_into: s.merged_into, story: s.story ?? null });
    }
    const { rows: storyRows } = await c.query(
      'SELECT story_id, ticker, version, closed, merged_into, story FROM relay_stories WHERE endpoint_id = $1', [storiesEndpoint]);
    const storeStories = new Map<string, unknown>(storyRows.map((r) => [r.story_id, { ticker: r.ticker, version: Number(r.version), closed: r.closed, merged_into: r.merged_into, story: r.story }]));
    result.stories = storeStories.size;
    result.closedStories = storyRows.filter((r) => r.closed).length;
    result.merged = storyRows.filter((r) => r.merged_into !== null).length;
    problems.push(...diffRows(`stories endpoint ${storiesEndpoint} stories`, relayStories, storeStories));

    const claimed = new Map<string, unknown>();
    for (const n of await api.notifications(storiesEndpoint)) if (n.notified) claimed.set(n.story_id, { ticker: n.ticker, event_id: n.event_id });
    const { rows: noteRows } = await c.query(
      'SELECT story_id, ticker, event_id, handed_at FROM relay_notifications WHERE endpoint_id = $1', [storiesEndpoint]);
    const recorded = new Map<string, unknown>(noteRows.map((r) => [r.story_id, { ticker: r.ticker, event_id: r.event_id }]));
    result.notifications = recorded.size;
    problems.push(...diffRows(`stories endpoint ${storiesEndpoint} notifications`, claimed, recorded));
    const unhanded = noteRows.filter((r) => r.handed_at === null).map((r) => r.story_id);
    if (unhanded.length) problems.push(`notifications recorded and never handed: ${unhanded.join(', ')}`);
  });
  return result;
}

/** (generation, sequence) a before b, sequences compared as bytes. */
function earlier(generationA: number, sequenceA: string | null, generationB: number, sequenceB: string | null): boolean {
  if (generationA !== generationB) return generationA < generationB;
  return Buffer.compare(Buffer.from(sequenceA ?? ''), Buffer.from(sequenceB ?? '')) < 0;
}
