// The consumer against a broker double (test/support/broker.ts): what it acknowledges, holds,
// gives back and refuses, delivery by delivery; and its lifecycle: reconnecting after a
// connection closed or a store failure, stopping for good on a permanent failure, stop().

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { ConsumerErrorEvent, RelayConsumer } from '../../src/consumer';
import { PermanentError } from '../../src/errors';
import { Logger } from '../../src/logger';
import { MemoryStore } from '../../src/memory-store';
import { Change, RefusedMessage, StoryMessage } from '../../src/message';
import { ApplyOutcome, Store } from '../../src/store';
import { RelayApi, ReplayAnswer } from '../../src/api';
import { FakeBroker, until } from '../support/broker';
import { endpointId, feed, story, TENANT, upsert } from '../helpers';

const QUEUE = `relay.tenant.${TENANT}`;

/** A memory store that can fail, wait, and counts its closes. */
class TestStore implements Store {
  readonly inner: MemoryStore;
  failApplies = 0;
  failPositions = 0;
  gate: Promise<void> | undefined;
  applying = 0;
  closes = 0;

  constructor(inner = new MemoryStore()) {
    this.inner = inner;
  }

  async positions() {
    if (this.failPositions > 0) {
      this.failPositions -= 1;
      throw Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5999'), { code: 'ECONNREFUSED' });
    }
    return this.inner.positions();
  }

  held() {
    return this.inner.held();
  }

  async apply(changes: Change[], late: StoryMessage[] = [], held: Change[] = []): Promise<ApplyOutcome> {
    this.applying += 1;
    try {
      if (this.gate) await this.gate;
      if (this.failApplies > 0) {
        this.failApplies -= 1;
        throw Object.assign(new Error('terminating connection due to administrator command'), { code: '57P01', severity: 'FATAL' });
      }
      return await this.inner.apply(changes, late, held);
    } finally {
      this.applying -= 1;
    }
  }

  handPending() {
    return this.inner.handPending();
  }

  async close() {
    this.closes += 1;
  }
}

function lines(): Logger & { said: string[] } {
  const said: string[] = [];
  return { said, info: (m) => void said.push(`info ${m}`), warn: (m) => void said.push(`warn ${m}`), error: (m) => void said.push(`error ${m}`) };
}

test('consumer: acknowledges what it applied, held (kept by the store) or dropped', async () => {
  const broker = new FakeBroker();
  const store = new MemoryStore();
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: QUEUE, store, connect: broker.connect, prefetch: 50 });
  await consumer.start();
  assert.equal(broker.channel.prefetchCount, 50);
  const e = endpointId();
  broker.publish(upsert(e, 1, 1, 'a', 1, '1', { n: 1 }), upsert(e, 1, 3, 'a', 1, '3', { n: 3 }));
  await until(() => broker.acked.length === 2);
  assert.deepEqual((await store.held()).map((c) => c.change_seq), [3], 'held in the store, then acknowledged');
  assert.deepEqual(consumer.gaps().map((g) => g.missing), [[2]]);
  broker.publish(upsert(e, 1, 1, 'a', 1, '1', { n: 1 }), upsert(e, 1, 2, 'a', 1, '2', { n: 2 }));
  await until(() => broker.acked.length === 4);
  assert.deepEqual(store.items(e).get('a'), { n: 3 });
  assert.deepEqual(await store.held(), [], 'forgotten once applied');
  const stats = consumer.stats();
  assert.equal(stats.duplicates, 1);
  assert.equal(stats.reordered, 1);
  assert.equal(stats.deliveries, 4);
  assert.deepEqual(stats.endpoints[e], { epoch: 1, lastChangeSeq: 3, held: 0, lagS: stats.endpoints[e]!.lagS });
  assert.ok(typeof stats.endpoints[e]!.lagS === 'number');
  await consumer.stop();
  await consumer.done;
  assert.ok(broker.channel.closed && broker.connection.closed);
});

test('consumer: a notified change of an ended epoch is recorded (late), the rest of that epoch dropped', async () => {
  const broker = new FakeBroker();
  const handed: string[] = [];
  const store = new MemoryStore({ handlers: { notification: (n) => void handed.push(n.story_id) } });
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: QUEUE, store, connect: broker.connect });
  await consumer.start();
  const e = endpointId();
  broker.publish(story(e, 1, 1), story(e, 1, 3, { story_id: 'held', operation: 'notified' }));
  await until(() => broker.acked.length === 2);
  broker.publish(feed(e, 2, 1, { operation: 'snapshot_begin' }), story(e, 1, 4, { story_id: 'late', operation: 'notified' }));
  await until(() => broker.acked.length === 4);
  await until(() => handed.length === 2);
  assert.deepEqual(handed.sort(), ['held', 'late']);
  assert.equal(consumer.stats().lateNotifications, 2);
  assert.deepEqual(await store.held(), []);
  await consumer.stop();
});

test('consumer: hands each story notification once, after the change that recorded it', async () => {
  const broker = new FakeBroker();
  const handed: string[] = [];
  const store = new MemoryStore({ handlers: { notification: (n) => void handed.push(n.story_id) } });
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: 'q', store, connect: broker.connect });
  await consumer.start();
  const e = endpointId();
  broker.publish(story(e, 1, 1, { story_id: 'x', operation: 'notified' }), story(e, 1, 2, { story_id: 'x', operation: 'notified' }));
  broker.publish(story(e, 1, 1, { story_id: 'x', operation: 'notified' }));
  await until(() => broker.acked.length === 3);
  await until(() => consumer.stats().notificationsHanded === 1);
  assert.deepEqual(handed, ['x']);
  assert.equal(consumer.stats().repeatedNotifications, 1);
  await consumer.stop();
});

test('consumer: stops at a message of another version, leaving it and what follows unacknowledged', async () => {
  const broker = new FakeBroker();
  const store = new TestStore();
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: 'q', store, connect: broker.connect });
  const refused: string[] = [];
  consumer.on('refused', (error) => refused.push(error.reason));
  await consumer.start();
  const e = endpointId();
  broker.publish(feed(e, 1, 1));
  await until(() => broker.acked.length === 1);
  broker.publish({ ...feed(e, 1, 2), v: 2 }, feed(e, 1, 3));
  await assert.rejects(consumer.done, (error: Error) => error instanceof RefusedMessage && /unknown message version/.test(error.message));
  assert.deepEqual(refused, ['version']);
  assert.equal(broker.acked.length, 1);
  assert.equal(broker.ready.length, 2, 'both back in the queue');
  assert.ok(broker.channel.closed && broker.connection.closed);
  assert.equal(store.closes, 1, 'the store closed');
  assert.equal(consumer.health().status, 'failed');
  await consumer.stop(); // resolves, a no-op
});

test('consumer: with onRefused reject, nacks a refused message without requeue and goes on', async () => {
  const broker = new FakeBroker();
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: QUEUE, store: new MemoryStore(), connect: broker.connect, onRefused: 'reject' });
  await consumer.start();
  const e = endpointId();
  broker.publish({ ...feed(e, 1, 1), tenant_id: '99999999-2222-4333-8444-555555555555' }, '{"v":1,"kind":"poll"}', feed(e, 1, 1));
  await until(() => broker.acked.length === 1);
  assert.equal(broker.rejected.length, 2);
  assert.equal(consumer.stats().refused, 2);
  assert.equal(consumer.health().status, 'ok');
  await consumer.stop();
});

test('consumer: past the hold bound a change goes back to the queue, or is dropped when a replay sends it again', async () => {
  const broker = new FakeBroker();
  const consumer = new RelayConsumer({
    amqpUrl: 'amqp://x', queue: 'q', store: new MemoryStore(), connect: broker.connect, maxHeldPerEndpoint: 1, releaseDelayMs: 10,
  });
  await consumer.start();
  const e = endpointId();
  broker.publish(feed(e, 1, 3));
  await until(() => broker.acked.length === 1);
  broker.publish(feed(e, 1, 5));
  await until(() => consumer.stats().released >= 2, 3000, 'the change given back and taken again');
  assert.equal(broker.acked.length, 1);
  await consumer.stop();

  const replayed: [string, number][] = [];
  const api = {
    replay: async (endpoint: string, from: number): Promise<ReplayAnswer> => {
      replayed.push([endpoint, from]);
      return { webhook_endpoint_id: endpoint, epoch: 1, from_change_seq: from, through_change_seq: 9 };
    },
  } as unknown as RelayApi;
  const other = new FakeBroker();
  const second = new RelayConsumer({ amqpUrl: 'amqp://x', queue: 'q', store: new MemoryStore(), connect: other.connect, maxHeldPerEndpoint: 1, api });
  await second.start();
  other.publish(feed(e, 1, 3));
  await until(() => other.acked.length === 1);
  other.publish(feed(e, 1, 5), feed(e, 1, 6));
  await until(() => other.acked.length === 3);
  assert.deepEqual(replayed, [[e, 1]], 'one replay asked, covering both');
  assert.equal(second.stats().overflowDropped, 2);
  assert.equal(second.stats().replaysAsked, 1);
  await second.stop();
});

test('consumer: resumes from the store positions and held changes', async () => {
  const broker = new FakeBroker();
  const e = endpointId();
  const memory = new MemoryStore({ positions: new Map([[e, { epoch: 2, lastChangeSeq: 5 }]]) });
  await memory.apply([], [], [feed(e, 2, 7)]);
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: 'q', store: memory, connect: broker.connect });
  await consumer.start();
  broker.publish(feed(e, 1, 9), feed(e, 2, 5), feed(e, 2, 7), feed(e, 2, 6));
  await until(() => broker.acked.length === 4);
  const stats = consumer.stats();
  assert.equal(stats.stale, 1);
  assert.equal(stats.duplicates, 2);
  assert.equal(stats.applied, 2);
  assert.deepEqual((await memory.positions()).get(e), { epoch: 2, lastChangeSeq: 7 });
  await consumer.stop();
});

test('consumer: a connection closed by the broker (320) is reported with its reason, and it reconnects and carries on', async () => {
  const broker = new FakeBroker();
  const store = new MemoryStore();
  const events: ConsumerErrorEvent[] = [];
  const log = lines();
  const consumer = new RelayConsumer({
    amqpUrl: 'amqp://x', queue: QUEUE, store, connect: broker.connect, prefetch: 3, batchMax: 2,
    onError: (event) => events.push(event), logger: log, backoffInitialMs: 20,
  });
  await consumer.start();
  const e = endpointId();
  const changes = Array.from({ length: 30 }, (_, i) => upsert(e, 1, i + 1, `s${i % 4}`, 1, String(i + 1).padStart(3, '0'), { i }));
  broker.publish(...changes.slice(0, 10));
  await until(() => broker.acked.length >= 4);
  broker.connection.force();
  assert.equal(consumer.health().connected, false);
  broker.publish(...changes.slice(10));
  await until(() => (consumer.stats().endpoints[e]?.lastChangeSeq ?? 0) === 30, 5000, 'the stream applied to its end');
  assert.equal(broker.connects, 2);
  assert.equal(events.length, 1);
  assert.equal(events[0]!.transient, true);
  assert.match(events[0]!.cause, /320 \(CONNECTION-FORCED\).*Closed via management plugin/);
  assert.ok(events[0]!.retryInMs! >= 0 && events[0]!.retryInMs! <= 20);
  assert.deepEqual(log.said.filter((l) => l.startsWith('warn')), [`warn relay-consumer: ${events[0]!.cause}; reconnecting in ${(events[0]!.retryInMs! / 1000).toFixed(1)} s`]);
  assert.equal(consumer.stats().reconnects, 1);
  assert.equal(consumer.health().status, 'ok');
  assert.match(consumer.metricsText(), /^relay_consumer_reconnects_total 1$/m);
  assert.match(consumer.metricsText(), /^relay_consumer_errors_total\{kind="transient"\} 1$/m);
  assert.deepEqual(store.items(e).get('s1'), { i: 29 });
  await consumer.stop();
});

test('consumer: a store failure ends the session; the next one starts from the store, nothing lost', async () => {
  const broker = new FakeBroker();
  const store = new TestStore();
  const events: ConsumerErrorEvent[] = [];
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: QUEUE, store, connect: broker.connect, onError: (ev) => events.push(ev), backoffInitialMs: 10 });
  await consumer.start();
  const e = endpointId();
  broker.publish(feed(e, 1, 1), feed(e, 1, 3));
  await until(() => broker.acked.length === 2);
  store.failApplies = 1;
  store.failPositions = 2;
  broker.publish(feed(e, 1, 2), feed(e, 1, 4));
  await until(() => (consumer.stats().endpoints[e]?.lastChangeSeq ?? 0) === 4 && consumer.health().status === 'ok', 5000, 'caught up');
  assert.deepEqual((await store.inner.positions()).get(e), { epoch: 1, lastChangeSeq: 4 });
  assert.deepEqual(events.map((ev) => ev.transient), [true, true, true]);
  assert.match(events[0]!.cause, /SQLSTATE 57P01/);
  assert.match(events[1]!.cause, /ECONNREFUSED/);
  // The step doubles: each wait at most 10, 20, 40 ms.
  events.forEach((ev, i) => assert.ok(ev.retryInMs! <= 10 * 2 ** i, `wait ${i}: ${ev.retryInMs}`));
  await consumer.stop();
});

test('consumer: the broker refusing the credentials is permanent: done rejects within the first attempt', async () => {
  const broker = new FakeBroker();
  broker.refuse.push(new Error('Handshake terminated by server: 403 (ACCESS-REFUSED) with message "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. For details see the broker logfile."'));
  const store = new TestStore();
  const events: ConsumerErrorEvent[] = [];
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: 'q', store, connect: broker.connect, onError: (ev) => events.push(ev) });
  await assert.rejects(consumer.start(), (error: Error) => error instanceof PermanentError && error.causeKind === 'broker_auth');
  await assert.rejects(consumer.done, (error: Error) => error instanceof PermanentError && error.causeKind === 'broker_auth');
  assert.equal(broker.connects, 1);
  assert.deepEqual(events.map((ev) => [ev.transient, ev.causeKind]), [[false, 'broker_auth']]);
  assert.equal(store.closes, 1);
  assert.equal(consumer.health().status, 'failed');
  assert.match(consumer.metricsText(), /^relay_consumer_errors_total\{kind="permanent"\} 1$/m);
});

test('consumer: a queue that does not exist is permanent (queue_not_found)', async () => {
  const broker = new FakeBroker();
  broker.queueExists = false;
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: 'relay.tenant.nope', store: new MemoryStore(), connect: broker.connect });
  await assert.rejects(consumer.start(), (error: Error) => error instanceof PermanentError && error.causeKind === 'queue_not_found');
  assert.ok(broker.connection.closed);
});

test('consumer: stop() finishes the batch in hand, commits and acknowledges it, closes everything, and resolves', async () => {
  const broker = new FakeBroker();
  const store = new TestStore();
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: QUEUE, store, connect: broker.connect, batchMax: 3, prefetch: 10 });
  await consumer.start();
  const e = endpointId();
  let open!: () => void;
  store.gate = new Promise((resolve) => (open = resolve));
  broker.publish(...Array.from({ length: 8 }, (_, i) => feed(e, 1, i + 1)));
  await until(() => store.applying === 1, 3000, 'a batch in hand');
  const stopping = consumer.stop();
  const again = consumer.stop();
  await new Promise((r) => setTimeout(r, 20));
  assert.equal(broker.channel.cancelled, true, 'no more deliveries taken');
  assert.equal(broker.channel.closed, false, 'the batch in hand is finished first');
  open();
  await stopping;
  await again;
  await consumer.done;
  assert.equal(broker.acked.length, 3, 'the batch in hand committed and acknowledged, nothing more');
  assert.deepEqual((await store.inner.positions()).get(e), { epoch: 1, lastChangeSeq: 3 });
  assert.equal(broker.ready.length, 5, 'the rest back in the queue');
  assert.ok(broker.channel.closed && broker.connection.closed);
  assert.equal(store.closes, 1);
  assert.equal(consumer.health().status, 'stopped');
});

test('consumer: stop() during a backoff wait resolves at once; before start() it closes the store', async () => {
  const broker = new FakeBroker();
  for (let i = 0; i < 10; i++) broker.refuse.push(Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5672'), { code: 'ECONNREFUSED' }));
  const events: ConsumerErrorEvent[] = [];
  const consumer = new RelayConsumer({
    amqpUrl: 'amqp://x', queue: 'q', store: new MemoryStore(), connect: broker.connect, backoffInitialMs: 60_000, backoffMaxMs: 60_000,
    onError: (ev) => events.push(ev),
  });
  const started = consumer.start();
  await until(() => events.length === 1);
  assert.equal(consumer.health().status, 'reconnecting');
  const t0 = Date.now();
  await consumer.stop();
  assert.ok(Date.now() - t0 < 1000);
  await started;
  const store = new TestStore();
  const never = new RelayConsumer({ amqpUrl: 'amqp://x', queue: 'q', store, connect: broker.connect });
  await never.stop();
  await never.done;
  assert.equal(store.closes, 1);
});

test('consumer: health, stats and metrics', async () => {
  const broker = new FakeBroker();
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: QUEUE, store: new MemoryStore(), connect: broker.connect });
  assert.deepEqual(consumer.health(), { status: 'starting', connected: false, lastCommitAt: null, lastError: null });
  await consumer.start();
  const e = endpointId();
  broker.publish(feed(e, 3, 1, { operation: 'snapshot_begin', changed_at: new Date(Date.now() - 2000).toISOString() }), feed(e, 3, 4));
  await until(() => broker.acked.length === 2);
  const health = consumer.health();
  assert.equal(health.status, 'ok');
  assert.equal(health.connected, true);
  assert.ok(health.lastCommitAt !== null);
  const stats = consumer.stats();
  assert.equal(stats.commits, 1);
  assert.ok(stats.endpoints[e]!.lagS! >= 1.9 && stats.endpoints[e]!.lagS! < 10);
  const text = consumer.metricsText();
  for (const name of ['deliveries_total', 'commits_total', 'refused_total', 'reconnects_total', 'errors_total', 'up', 'last_change_seq', 'lag_seconds', 'held']) {
    assert.match(text, new RegExp(`^# TYPE relay_consumer_${name} (counter|gauge)$`, 'm'));
  }
  assert.match(text, /^relay_consumer_deliveries_total 2$/m);
  assert.match(text, /^relay_consumer_up 1$/m);
  assert.match(text, new RegExp(`^relay_consumer_last_change_seq\\{endpoint="${e}"\\} 1$`, 'm'));
  assert.match(text, new RegExp(`^relay_consumer_held\\{endpoint="${e}"\\} 1$`, 'm'));
  await consumer.stop();
  assert.match(consumer.metricsText(), /^relay_consumer_up 0$/m);
});
