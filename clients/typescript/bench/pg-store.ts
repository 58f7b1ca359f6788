// Throughput of the Postgres store: the library's consumer (RelayConsumer + PgStore) draining a
// queue pre-filled with N change messages, in messages per second.
//
//   npm run build && node dist/bench/pg-store.js [--messages 20000] [--runs 3] \
//       [--feed-endpoints 4] [--stories-endpoints 2] [--item-bytes 3000] [--prefetch 500] [--max-batch 500]
//
// The messages are built here, version 1 as docs/change-message.v1.schema.json and
// docs/story-message.v1.schema.json describe them (each is decoded by the library's own
// decodeChange before it is published): per feed endpoint a gapless stream of upserts (items
// of about --item-bytes bytes, shaped as the simulator's feed items), removals and item updates
// of a pool of subjects, opened by a snapshot; per stories endpoint stories saved, updated,
// closed (some merged into another), dropped by a reload round, and one notification per
// strong story. The endpoints' streams are interleaved on the queue, each in its order.
//
// Each run makes a vhost of its own through RabbitMQ's management API (RELAY_BENCH_AMQP_MANAGEMENT_URL,
// default http://guest:guest@127.0.0.1:15672), a quorum queue in it as the relay declares tenant
// queues, a fresh database on RELAY_TEST_PG's server (default
// postgres://postgres@127.0.0.1:5432/postgres), fills the queue, then times the consumer from
// start() until every message is applied and acknowledged, and removes the vhost and the
// database. It prints one JSON line per run and a summary.

import { randomBytes } from 'node:crypto';
import { Client } from 'pg';
import * as amqp from 'amqplib';
import { Change, decodeChange, FeedChange, messageId, PgStore, RelayConsumer, StoryMessage } from '../src';

interface Options {
  messages: number;
  runs: number;
  feedEndpoints: number;
  storiesEndpoints: number;
  itemBytes: number;
  prefetch: number;
  maxBatch: number;
}

function parseArgs(argv: string[]): Options {
  const options: Options = { messages: 20_000, runs: 1, feedEndpoints: 4, storiesEndpoints: 2, itemBytes: 3_000, prefetch: 500, maxBatch: 500 };
  for (let i = 0; i < argv.length; i += 2) {
    const name = argv[i]!.replace(/^--/, '').replace(/-([a-z])/g, (_, c: string) => c.toUpperCase()) as keyof Options;
    const value = Number(argv[i + 1]);
    if (!(name in options) || !Number.isFinite(value)) throw new Error(`unknown option or value: ${argv[i]} ${argv[i + 1]}`);
    options[name] = value;
  }
  return options;
}

const PG = process.env.RELAY_TEST_PG ?? 'postgres://postgres@127.0.0.1:5432/postgres';
const MANAGEMENT = new URL(process.env.RELAY_BENCH_AMQP_MANAGEMENT_URL ?? 'http://guest:guest@127.0.0.1:15672');
const AMQP_HOST = process.env.RELAY_BENCH_AMQP_HOST ?? '127.0.0.1:5672';

// A small seeded generator, so every run publishes the same messages.
function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const WORDS = ['order', 'intake', 'quarter', 'guidance', 'revenue', 'margin', 'contract', 'signs', 'raises', 'expects', 'board', 'dividend', 'acquisition', 'nordic', 'growth', 'record', 'delivery', 'wind', 'power', 'software'];

function sentence(random: () => number, words: number): string {
  const out: string[] = [];
  for (let i = 0; i < words; i++) out.push(WORDS[Math.floor(random() * WORDS.length)]!);
  return out.join(' ');
}

function timestamp(ms: number): string {
  return new Date(ms).toISOString();
}

/** A feed item shaped as the simulator renders one, padded with parts to about `bytes`. */
function feedItem(random: () => number, subject: string, version: number, bytes: number): Record<string, unknown> {
  const id = Number(subject.split(':')[1]);
  const base = Date.UTC(2026, 11, 1) + id * 60_000;
  const item: Record<string, unknown> = {
    access: 'full',
    changes: [],
    company: { company_id: 1000 + (id % 50), listed_exchange: 'XSTO', logo_url: null, market_exchange_id: 3, market_exchange_mic: 'XSTO', name: `Company ${id % 50} AB`, short_name: `C${id % 50}`, symbol: `C${id % 50}` },
    corrected_at: null,
    feed_item_id: subject,
    first_seq: id,
    flags: { corrected: false },
    head: { announcement_id: id, announcement_kind: 'order', edition_ids: [5000 + (id % 1000)], first_flash_at: timestamp(base), inside_information: true, language: 'sv', received_at: timestamp(base), report: null, route: 'press_release', title: sentence(random, 8) },
    item_kind: 'announcement',
    lang: 'en',
    op: version === 1 ? 'new' : 'changed',
    parts: [] as unknown[],
    published_at: timestamp(base),
  };
  const parts = item.parts as unknown[];
  for (let n = 0; JSON.stringify(item).length < bytes; n++) {
    parts.push({
      corrected: false, first_published_at: timestamp(base + n), headline: sentence(random, 10), inside_information: true, kicker: null,
      kind: 'story', lang: 'en', lede_first_sentence: sentence(random, 18), part_id: `story:${id * 10 + n}`, part_version: version,
      reason: version === 1 ? 'new' : 'update', relevance: 4, report: null, story_id: id * 10 + n, treatment: 'full',
      url: `https://app.example.com/articles/story/${id * 10 + n}`, version, version_published_at: timestamp(base + version * 1000),
    });
  }
  return item;
}

function story(random: () => number, id: string, ticker: string, version: number, bytes: number): Record<string, unknown> & { id: string } {
  const out: Record<string, unknown> & { id: string } = { id, ticker, version, headline: sentence(random, 9), strength: Math.floor(random() * 5), body: '' };
  out.body = sentence(random, Math.max(1, Math.floor((bytes - JSON.stringify(out).length) / 7)));
  return out;
}

/** The messages: each endpoint's gapless stream, interleaved. */
function buildMessages(options: Options, tenant: string): Change[] {
  const random = rng(41);
  const total = options.messages;
  const streams: Change[][] = [];
  const feedShare = Math.round((total * options.feedEndpoints) / (options.feedEndpoints + options.storiesEndpoints * 0.75));
  const perFeed = Math.floor(feedShare / Math.max(1, options.feedEndpoints));
  const perStories = options.storiesEndpoints > 0 ? Math.floor((total - perFeed * options.feedEndpoints) / options.storiesEndpoints) : 0;
  const changedAt = (seq: number) => timestamp(Date.UTC(2026, 11, 1) + seq * 1000);
  const diff = { added: [], changed: [], removed: [] };

  for (let e = 0; e < options.feedEndpoints; e++) {
    const endpoint = uuid(random);
    const out: FeedChange[] = [];
    const head = { v: 1 as const, tenant_id: tenant, webhook_endpoint_id: endpoint, epoch: 1 };
    const subjects = Math.max(10, Math.floor(perFeed / 3));
    const versions = new Map<string, number>();
    let seq = 0;
    let sequence = 0;
    const marker = (operation: 'snapshot_begin' | 'snapshot_end'): FeedChange => ({
      ...head, change_seq: ++seq, operation, subject: '', item_kind: null, generation: 1, sequence: null, event_id: null, reload_generation: null, snapshot: true, parts_diff: diff, changed_at: changedAt(seq),
    });
    out.push(marker('snapshot_begin'));
    const snapshotItems = Math.min(Math.floor(perFeed / 10), subjects);
    for (let i = 0; i < snapshotItems; i++) {
      const subject = `announcement:${e * 1_000_000 + i}`;
      versions.set(subject, 1);
      out.push({ ...head, change_seq: ++seq, operation: 'upsert', subject, item_kind: 'announcement', generation: 1, sequence: pad(++sequence), event_id: null, reload_generation: null, snapshot: true, item: feedItem(random, subject, 1, options.itemBytes), parts_diff: { added: ['story:1'], changed: [], removed: [] }, changed_at: changedAt(seq) });
    }
    out.push(marker('snapshot_end'));
    while (out.length < perFeed) {
      const subject = `announcement:${e * 1_000_000 + Math.floor(random() * subjects)}`;
      const version = (versions.get(subject) ?? 0) + 1;
      if (versions.has(subject) && random() < 0.1) {
        versions.delete(subject);
        out.push({ ...head, change_seq: ++seq, operation: 'remove', subject, item_kind: 'announcement', generation: 1, sequence: pad(++sequence), event_id: `evt-${e}-${seq}`, reload_generation: null, snapshot: false, parts_diff: { added: [], changed: [], removed: ['story:1'] }, changed_at: changedAt(seq) });
      } else {
        versions.set(subject, version);
        out.push({ ...head, change_seq: ++seq, operation: 'upsert', subject, item_kind: 'announcement', generation: 1, sequence: pad(++sequence), event_id: `evt-${e}-${seq}`, reload_generation: null, snapshot: false, item: feedItem(random, subject, version, options.itemBytes), parts_diff: { added: [], changed: ['story:1'], removed: [] }, changed_at: changedAt(seq) });
      }
    }
    streams.push(out);
  }

  for (let e = 0; e < options.storiesEndpoints; e++) {
    const endpoint = uuid(random);
    const out: StoryMessage[] = [];
    const head = { v: 1 as const, tenant_id: tenant, webhook_endpoint_id: endpoint, epoch: 1 };
    const open = new Map<string, { version: number; ticker: string }>();
    const notified = new Set<string>();
    let seq = 0;
    let next = 0;
    const storyBytes = Math.floor(options.itemBytes * 0.7);
    while (out.length < perStories) {
      const roll = random();
      const ids = [...open.keys()];
      if (ids.length < 20 || roll < 0.3) {
        const id = `s${e}-${next++}`;
        const ticker = `T${Math.floor(random() * 30)}`;
        open.set(id, { version: 1, ticker });
        out.push({ ...head, kind: 'story', change_seq: ++seq, operation: 'saved', story_id: id, ticker, version: 1, story: story(random, id, ticker, 1, storyBytes), event_id: `sevt-${e}-${seq}`, reload_round: null, changed_at: changedAt(seq) });
        continue;
      }
      const id = ids[Math.floor(random() * ids.length)]!;
      const row = open.get(id)!;
      if (roll < 0.75) {
        row.version += 1;
        out.push({ ...head, kind: 'story', change_seq: ++seq, operation: 'saved', story_id: id, ticker: row.ticker, version: row.version, story: story(random, id, row.ticker, row.version, storyBytes), event_id: `sevt-${e}-${seq}`, reload_round: null, changed_at: changedAt(seq) });
      } else if (roll < 0.85 && !notified.has(id)) {
        notified.add(id);
        out.push({ ...head, kind: 'notification', change_seq: ++seq, operation: 'notified', story_id: id, ticker: row.ticker, version: row.version, story: story(random, id, row.ticker, row.version, storyBytes), event_id: `sevt-${e}-${seq}`, reload_round: null, changed_at: changedAt(seq) });
      } else if (roll < 0.95) {
        open.delete(id);
        const merge = random() < 0.3 && ids.length > 1 ? ids.find((other) => other !== id) : undefined;
        out.push({ ...head, kind: 'story', change_seq: ++seq, operation: 'closed', story_id: id, ticker: row.ticker, version: row.version + 1, ...(merge ? { merged_into: merge } : {}), event_id: `sevt-${e}-${seq}`, reload_round: null, changed_at: changedAt(seq) });
      } else {
        open.delete(id);
        out.push({ ...head, kind: 'story', change_seq: ++seq, operation: 'dropped', story_id: id, ticker: row.ticker, version: row.version, event_id: null, reload_round: 1, changed_at: changedAt(seq) });
      }
    }
    streams.push(out);
  }

  // Interleaved as a publisher of many endpoints sends them: each stream in its order.
  const messages: Change[] = [];
  const cursors = streams.map(() => 0);
  let left = streams.reduce((n, s) => n + s.length, 0);
  while (left > 0) {
    const i = Math.floor(random() * streams.length);
    if (cursors[i]! >= streams[i]!.length) continue;
    messages.push(streams[i]![cursors[i]!++]!);
    left -= 1;
  }
  return messages;
}

function pad(n: number): string {
  return `${String(n).padStart(12, '0')}-0`;
}

function uuid(random: () => number): string {
  const hex = Array.from({ length: 32 }, () => Math.floor(random() * 16).toString(16)).join('');
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-4${hex.slice(13, 16)}-8${hex.slice(17, 20)}-${hex.slice(20, 32)}`;
}

async function management(method: string, path: string, body?: unknown): Promise<void> {
  const base = new URL(MANAGEMENT.toString());
  const auth = Buffer.from(`${decodeURIComponent(base.username)}:${decodeURIComponent(base.password)}`).toString('base64');
  base.username = '';
  base.password = '';
  const answer = await fetch(`${base.origin}/api${path}`, {
    method,
    headers: { authorization: `Basic ${auth}`, 'content-type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: AbortSignal.timeout(10_000),
  });
  if (!answer.ok && !(method === 'DELETE' && answer.status === 404)) throw new Error(`${method} ${path}: ${answer.status} ${await answer.text()}`);
}

async function admin(run: (client: Client) => Promise<unknown>): Promise<void> {
  const client = new Client({ connectionString: PG });
  await client.connect();
  try {
    await run(client);
  } finally {
    await client.end();
  }
}

interface RunResult {
  run: number;
  messages: number;
  bytes: number;
  seconds: number;
  messages_per_s: number;
  mb_per_s: number;
  batches: number;
  items: number;
  stories: number;
  notifications: number;
}

async function runOnce(options: Options, run: number, messages: Change[], bodies: Buffer[]): Promise<RunResult> {
  const tag = randomBytes(4).toString('hex');
  const vhost = `relay-ts-bench-${tag}`;
  const database = `relay_ts_bench_${tag}`;
  const queue = `relay.tenant.${messages[0]!.tenant_id}`;
  const user = decodeURIComponent(MANAGEMENT.username);
  const password = decodeURIComponent(MANAGEMENT.password);
  const amqpUrl = `amqp://${encodeURIComponent(user)}:${encodeURIComponent(password)}@${AMQP_HOST}/${encodeURIComponent(vhost)}`;
  const databaseUrl = new URL(PG);
  databaseUrl.pathname = `/${database}`;
  let store: PgStore | undefined;
  let consumer: RelayConsumer | undefined;
  try {
    await management('PUT', `/vhosts/${encodeURIComponent(vhost)}`, {});
    await management('PUT', `/permissions/${encodeURIComponent(vhost)}/${encodeURIComponent(user)}`, { configure: '.*', write: '.*', read: '.*' });
    await admin((c) => c.query(`CREATE DATABASE ${database}`));

    // Fill the queue (publisher confirms, persistent, the relay's message ids).
    const connection = await amqp.connect(amqpUrl);
    const channel = await connection.createConfirmChannel();
    await channel.assertQueue(queue, { durable: true, arguments: { 'x-queue-type': 'quorum' } });
    for (let i = 0; i < messages.length; i++) {
      const ok = channel.sendToQueue(queue, bodies[i]!, { persistent: true, messageId: messageId(messages[i]!), contentType: 'application/json' });
      if (!ok) await new Promise((resolve) => channel.once('drain', resolve));
      if (i % 2000 === 1999) await channel.waitForConfirms();
    }
    await channel.waitForConfirms();
    await connection.close();

    store = new PgStore({ connection: { connectionString: databaseUrl.toString(), max: 4 } });
    await store.migrate();
    const target = messages.length;
    let applied = 0;
    let finished!: () => void;
    const drained = new Promise<void>((resolve) => (finished = resolve));
    consumer = new RelayConsumer({ amqpUrl, queue, store, prefetch: options.prefetch, batchMax: options.maxBatch });
    consumer.on('applied', (outcome) => {
      applied += outcome.applied;
      if (applied >= target) finished();
    });
    const t0 = process.hrtime.bigint();
    await consumer.start();
    await Promise.race([drained, consumer.done]);
    // The last batch's acknowledgements are sent once `applied` is emitted; the time counts
    // until every message was applied and its acknowledgement written to the socket.
    const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
    const stats = consumer.stats();
    const counts = { items: 0, stories: 0, notifications: 0 };
    const { rows } = await store.pool.query(`SELECT (SELECT count(*) FROM relay_items) AS items, (SELECT count(*) FROM relay_stories) AS stories,
      (SELECT count(*) FROM relay_notifications) AS notifications`);
    // Stopping closes the store too.
    await consumer.stop();
    consumer = undefined;
    counts.items = Number(rows[0].items);
    counts.stories = Number(rows[0].stories);
    counts.notifications = Number(rows[0].notifications);
    const bytes = bodies.reduce((n, b) => n + b.length, 0);
    return {
      run, messages: target, bytes, seconds: round(seconds, 2), messages_per_s: Math.round(target / seconds),
      mb_per_s: round(bytes / seconds / 1e6, 1), batches: stats.batches, ...counts,
    };
  } finally {
    if (consumer) await consumer.stop().catch(() => {});
    if (store) await store.close().catch(() => {});
    await admin((c) => c.query(`DROP DATABASE IF EXISTS ${database} WITH (FORCE)`)).catch((e: Error) => console.error(`dropping ${database}: ${e.message}`));
    await management('DELETE', `/vhosts/${encodeURIComponent(vhost)}`).catch((e: Error) => console.error(`deleting vhost ${vhost}: ${e.message}`));
  }
}

function round(value: number, digits: number): number {
  const f = 10 ** digits;
  return Math.round(value * f) / f;
}

async function main(): Promise<void> {
  const options = parseArgs(process.argv.slice(2));
  const tenant = '5e1a7c00-0000-4000-8000-00000000be4c';
  const messages = buildMessages(options, tenant);
  // Every message as the library reads it: decoded (and so checked) before it is published.
  const bodies = messages.map((m) => {
    const body = Buffer.from(JSON.stringify(m));
    decodeChange(body);
    return body;
  });
  const kinds = new Map<string, number>();
  for (const m of messages) {
    const key = 'kind' in m ? `${m.kind}:${m.operation}` : `feed:${m.operation}`;
    kinds.set(key, (kinds.get(key) ?? 0) + 1);
  }
  const bytes = bodies.reduce((n, b) => n + b.length, 0);
  console.log(JSON.stringify({ event: 'messages', count: messages.length, mean_bytes: Math.round(bytes / messages.length), kinds: Object.fromEntries(kinds), options }));
  const results: RunResult[] = [];
  for (let run = 1; run <= options.runs; run++) {
    const result = await runOnce(options, run, messages, bodies);
    results.push(result);
    console.log(JSON.stringify({ event: 'run', ...result }));
  }
  const rates = results.map((r) => r.messages_per_s).sort((a, b) => a - b);
  console.log(JSON.stringify({ event: 'summary', runs: rates.length, messages_per_s: rates, median: rates[Math.floor(rates.length / 2)] }));
}

main().catch((error: Error) => {
  console.error(error);
  process.exitCode = 1;
});
