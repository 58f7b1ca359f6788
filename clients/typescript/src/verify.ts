// `relay-consumer verify`: a store compared with the relay's copy, read through its API
// (clients/README.md, "The command"), as the Python library's verify does. Per endpoint:
//
// - feed items (`GET /v1/endpoints/{id}/copy`): subject, item_kind, sequence, item; tombstones
//   left out on both sides; `generation` is not compared. The relay moves a row to a later
//   (generation, sequence) without sending a change when an event or a reload finds the item
//   unchanged (`Decision::Unchanged`, services/rules/src/event.rs): a copy built from the stream
//   keeps the earlier one. So a sequence differs only when the store's (generation, sequence) is
//   not at or before the relay's; an item at an earlier read of the same content is equal, and
//   counted in the line ("raised by the relay");
// - stories (`GET .../stories?include_closed=true`): id, ticker, version, closed, merged_into,
//   story;
// - notifications (`GET .../notifications`, those the relay sent): story id, event id.
//
// The store is read, never written.

import { isDeepStrictEqual } from 'node:util';
import { Client, ClientConfig } from 'pg';
import { RelayApi } from './api';
import { PermanentError } from './errors';
import { SCHEMA_VERSION } from './pg-store';

export interface VerifyOptions {
  /** The store's database: a connection string or pg's client settings. */
  connection: string | ClientConfig;
  /** The relay's API with a token of the tenant. */
  api: RelayApi;
  /** The endpoints to compare (default: every endpoint of the token's tenant). */
  endpoints?: string[];
}

export interface Difference {
  /** `items`, `stories` or `notifications`. */
  kind: string;
  /** At the relay, not in the store. */
  missing: string[];
  /** In the store, not at the relay. */
  extra: string[];
  /** In both, with the fields that differ. */
  different: [string, string][];
}

export interface EndpointVerdict {
  endpoint: string;
  equal: boolean;
  /** The relay's rows compared. */
  items: number;
  stories: number;
  notifications: number;
  /** Items the relay holds at a later (generation, sequence) than the store, with the same content. */
  raised: number;
  differences: Difference[];
}

/** Differing keys a line names per kind. */
const SHOWN = 3;

/** Compares the store with the relay's copy, endpoint by endpoint. */
export async function verifyStore(options: VerifyOptions): Promise<EndpointVerdict[]> {
  const endpoints = options.endpoints && options.endpoints.length > 0
    ? options.endpoints
    : (await options.api.endpoints()).map((e) => e.id);
  const client = new Client(typeof options.connection === 'string' ? { connectionString: options.connection } : options.connection);
  await client.connect();
  try {
    const schema = await client.query<{ present: boolean }>(`SELECT to_regclass('relay_consumer_schema') IS NOT NULL AS present`);
    if (schema.rows[0]?.present) {
      const { rows } = await client.query<{ version: number | null }>('SELECT max(version) AS version FROM relay_consumer_schema');
      const version = rows[0]?.version ?? 0;
      if (version > SCHEMA_VERSION) {
        throw new PermanentError('schema_newer', `the store's schema is version ${version}; this library reads version ${SCHEMA_VERSION} at most`);
      }
    }
    const out: EndpointVerdict[] = [];
    for (const endpoint of endpoints) out.push(await verifyEndpoint(client, options.api, endpoint));
    return out;
  } finally {
    await client.end().catch(() => {});
  }
}

type Rows = Map<string, Record<string, unknown>>;

async function verifyEndpoint(client: Client, api: RelayApi, endpoint: string): Promise<EndpointVerdict> {
  const relayRows = new Map((await api.copy(endpoint)).filter((r) => !r.tombstone).map((r) => [r.subject, r]));
  const relayItems: Rows = new Map([...relayRows].map(([subject, r]) => [subject, { item_kind: r.item_kind, sequence: r.sequence, item: r.item }]));
  const myItems: Rows = new Map();
  let raised = 0;
  const items = await client.query(
    'SELECT subject, item_kind, generation, sequence, item FROM relay_items WHERE endpoint_id = $1 AND NOT tombstone', [endpoint]);
  for (const r of items.rows) {
    const mine = { item_kind: r.item_kind, sequence: r.sequence, item: r.item };
    const relay = relayRows.get(r.subject);
    if (relay && r.sequence !== relay.sequence && mine.item_kind === relay.item_kind && isDeepStrictEqual(mine.item, relay.item)
        && before(Number(r.generation), r.sequence, Number(relay.generation), relay.sequence)) {
      // Equal: the relay raised its row without a change (above).
      mine.sequence = relay.sequence;
      raised += 1;
    }
    myItems.set(r.subject, mine);
  }

  const relayStories: Rows = new Map((await api.stories(endpoint)).map((s) => [s.id, {
    ticker: s.ticker, version: Number(s.version), closed: s.closed, merged_into: s.merged_into, story: s.story ?? null,
  }]));
  const stories = await client.query(
    'SELECT story_id, ticker, version, closed, merged_into, story FROM relay_stories WHERE endpoint_id = $1', [endpoint]);
  const myStories: Rows = new Map(stories.rows.map((r) => [r.story_id, {
    ticker: r.ticker, version: Number(r.version), closed: r.closed, merged_into: r.merged_into, story: r.story,
  }]));

  const relayNotifications: Rows = new Map((await api.notifications(endpoint)).filter((n) => n.notified !== false).map((n) => [n.story_id, { event_id: n.event_id }]));
  const notes = await client.query('SELECT story_id, event_id FROM relay_notifications WHERE endpoint_id = $1', [endpoint]);
  const myNotifications: Rows = new Map(notes.rows.map((r) => [r.story_id, { event_id: r.event_id }]));

  const differences = [
    compare('items', myItems, relayItems),
    compare('stories', myStories, relayStories),
    compare('notifications', myNotifications, relayNotifications),
  ].filter((d) => d.missing.length + d.extra.length + d.different.length > 0);
  return {
    endpoint, equal: differences.length === 0, items: relayItems.size, stories: relayStories.size,
    notifications: relayNotifications.size, raised, differences,
  };
}

/** (generation, sequence) a before b, sequences compared as byte strings (COLLATE "C"). */
function before(generationA: number, sequenceA: string | null, generationB: number, sequenceB: string | null): boolean {
  if (generationA !== generationB) return generationA < generationB;
  return Buffer.compare(Buffer.from(sequenceA ?? '', 'utf8'), Buffer.from(sequenceB ?? '', 'utf8')) < 0;
}

function compare(kind: string, mine: Rows, relay: Rows): Difference {
  const keys = (m: Rows) => [...m.keys()];
  const byteOrder = (a: string, b: string) => Buffer.compare(Buffer.from(a), Buffer.from(b));
  const difference: Difference = {
    kind,
    missing: keys(relay).filter((k) => !mine.has(k)).sort(byteOrder),
    extra: keys(mine).filter((k) => !relay.has(k)).sort(byteOrder),
    different: [],
  };
  for (const key of keys(relay).filter((k) => mine.has(k)).sort(byteOrder)) {
    const fields = Object.keys(relay.get(key)!).filter((f) => !isDeepStrictEqual(mine.get(key)![f] ?? null, relay.get(key)![f] ?? null));
    if (fields.length > 0) difference.different.push([key, fields.join(', ')]);
  }
  return difference;
}

function listed(keys: string[]): string {
  return `${keys.slice(0, SHOWN).join(', ')}${keys.length > SHOWN ? ', ...' : ''}`;
}

function describe(d: Difference): string {
  const parts: string[] = [];
  if (d.missing.length) parts.push(`${d.missing.length} missing (${listed(d.missing)})`);
  if (d.extra.length) parts.push(`${d.extra.length} extra (${listed(d.extra)})`);
  if (d.different.length) {
    const shown = d.different.slice(0, SHOWN).map(([k, what]) => `${k}: ${what}`).join(', ');
    parts.push(`${d.different.length} different (${shown}${d.different.length > SHOWN ? ', ...' : ''})`);
  }
  return `${d.kind} ${parts.join('; ')}`;
}

/**
 * One line per endpoint, as the Python library's: `<id> equal (<n> items[, <r> raised by the
 * relay], <s> stories, <k> notifications)` or `<id> differs: <kind> <n> missing (...); ... | ...`.
 */
export function verdictLine(v: EndpointVerdict): string {
  if (v.equal) {
    const raised = v.raised ? `, ${v.raised} raised by the relay` : '';
    return `${v.endpoint} equal (${v.items} items${raised}, ${v.stories} stories, ${v.notifications} notifications)`;
  }
  return `${v.endpoint} differs: ${v.differences.map(describe).join(' | ')}`;
}
