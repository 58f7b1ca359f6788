// The consumer against a broker double (the `connect` option): what it acknowledges, gives back
// and refuses, delivery by delivery.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { EventEmitter } from 'node:events';
import { AmqpConnection, Delivery, RelayConsumer } from '../../src/consumer';
import { MemoryStore } from '../../src/memory-store';
import { body, endpointId, feed, story, TENANT, upsert } from '../helpers';

class FakeChannel extends EventEmitter {
  acked: number[] = [];
  nacked: { tag: number; requeue: boolean }[] = [];
  prefetchCount = 0;
  closed = false;
  private deliver: ((d: Delivery | null) => void) | undefined;
  private tag = 0;
  async prefetch(n: number) { this.prefetchCount = n; }
  async consume(_queue: string, on: (d: Delivery | null) => void) { this.deliver = on; return { consumerTag: 'ctag' }; }
  async cancel() {}
  async close() { this.closed = true; }
  ack(d: Delivery) { this.acked.push(d.fields.deliveryTag); }
  nack(d: Delivery, _all: boolean, requeue: boolean) { this.nacked.push({ tag: d.fields.deliveryTag, requeue }); }
  /** Delivers a body; returns its delivery tag. */
  send(message: unknown): number {
    this.tag += 1;
    const content = typeof message === 'string' ? Buffer.from(message) : body(message);
    this.deliver!({ content, fields: { deliveryTag: this.tag }, properties: {} } as unknown as Delivery);
    return this.tag;
  }
}

function broker(): { channel: FakeChannel; connect: () => Promise<AmqpConnection> } {
  const channel = new FakeChannel();
  const connection = Object.assign(new EventEmitter(), {
    createChannel: async () => channel,
    close: async () => {},
  });
  return { channel, connect: async () => connection as unknown as AmqpConnection };
}

async function until(what: () => boolean, ms = 2000): Promise<void> {
  const end = Date.now() + ms;
  while (!what()) {
    if (Date.now() > end) throw new Error('timed out waiting');
    await new Promise((r) => setTimeout(r, 5));
  }
}

test('consumer: acknowledges what it applied or dropped, holds what is ahead until it fills', async () => {
  const { channel, connect } = broker();
  const store = new MemoryStore();
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: `relay.tenant.${TENANT}`, store, connect, tenantId: TENANT, prefetch: 50 });
  await consumer.start();
  assert.equal(channel.prefetchCount, 50);
  const e = endpointId();
  const t1 = channel.send(upsert(e, 1, 1, 'a', 1, '1', { n: 1 }));
  const t3 = channel.send(upsert(e, 1, 3, 'a', 1, '3', { n: 3 }));
  await until(() => channel.acked.includes(t1));
  assert.equal(channel.acked.includes(t3), false, 'held, not acknowledged');
  assert.deepEqual(consumer.gaps().map((g) => g.missing), [[2]]);
  const again = channel.send(upsert(e, 1, 1, 'a', 1, '1', { n: 1 }));
  const t2 = channel.send(upsert(e, 1, 2, 'a', 1, '2', { n: 2 }));
  await until(() => channel.acked.includes(t3) && channel.acked.includes(again) && channel.acked.includes(t2));
  assert.deepEqual(store.items(e).get('a'), { n: 3 });
  assert.equal(consumer.stats.duplicates, 1);
  assert.equal(consumer.stats.reordered, 1);
  await consumer.stop();
  assert.equal(await consumer.done, undefined);
  assert.ok(channel.closed);
});

test('consumer: hands each story notification once, after the change that recorded it', async () => {
  const { channel, connect } = broker();
  const handed: string[] = [];
  const store = new MemoryStore({ handlers: { notification: (n) => void handed.push(n.story_id) } });
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: 'q', store, connect });
  await consumer.start();
  const e = endpointId();
  channel.send(story(e, 1, 1, { story_id: 'x', operation: 'notified' }));
  channel.send(story(e, 1, 2, { story_id: 'x', operation: 'notified' }));
  const last = channel.send(story(e, 1, 1, { story_id: 'x', operation: 'notified' }));
  await until(() => channel.acked.includes(last));
  await until(() => consumer.stats.notificationsHanded === 1);
  assert.deepEqual(handed, ['x']);
  assert.equal(consumer.stats.repeatedNotifications, 1);
  await consumer.stop();
});

test('consumer: stops at a message of another version, leaving it and what follows unacknowledged', async () => {
  const { channel, connect } = broker();
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: 'q', store: new MemoryStore(), connect });
  const refused: string[] = [];
  consumer.on('refused', (error) => refused.push(error.reason));
  await consumer.start();
  const e = endpointId();
  const t1 = channel.send(feed(e, 1, 1));
  await until(() => channel.acked.includes(t1));
  const bad = channel.send({ ...feed(e, 1, 2), v: 2 });
  const error = await consumer.done;
  assert.match(String(error), /unknown message version/);
  assert.deepEqual(refused, ['version']);
  assert.equal(channel.acked.includes(bad), false);
  assert.deepEqual(channel.nacked, []);
  assert.ok(channel.closed);
});

test('consumer: with onRefused reject, nacks a refused message without requeue and goes on', async () => {
  const { channel, connect } = broker();
  const store = new MemoryStore();
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: 'q', store, connect, onRefused: 'reject', tenantId: TENANT });
  await consumer.start();
  const e = endpointId();
  const other = channel.send({ ...feed(e, 1, 1), tenant_id: '99999999-2222-4333-8444-555555555555' });
  const bad = channel.send('{"v":1,"kind":"poll"}');
  const ok = channel.send(feed(e, 1, 1));
  await until(() => channel.acked.includes(ok));
  assert.deepEqual(channel.nacked, [{ tag: other, requeue: false }, { tag: bad, requeue: false }]);
  assert.equal(consumer.stats.refused, 2);
  assert.equal(consumer.stopped, undefined);
  await consumer.stop();
});

test('consumer: gives back to the queue what passes the hold bound', async () => {
  const { channel, connect } = broker();
  const consumer = new RelayConsumer({
    amqpUrl: 'amqp://x', queue: 'q', store: new MemoryStore(), connect, maxHeldPerEndpoint: 1, releaseDelayMs: 10,
  });
  await consumer.start();
  const e = endpointId();
  channel.send(feed(e, 1, 3));
  const t5 = channel.send(feed(e, 1, 5));
  await until(() => channel.nacked.length === 1);
  assert.deepEqual(channel.nacked, [{ tag: t5, requeue: true }]);
  await consumer.stop();
});

test('consumer: resumes from the store positions', async () => {
  const { channel, connect } = broker();
  const e = endpointId();
  const store = new MemoryStore({ positions: new Map([[e, { epoch: 2, lastChangeSeq: 5 }]]) });
  const consumer = new RelayConsumer({ amqpUrl: 'amqp://x', queue: 'q', store, connect });
  await consumer.start();
  const old = channel.send(feed(e, 1, 9));
  const repeat = channel.send(feed(e, 2, 5));
  const next = channel.send(feed(e, 2, 6));
  await until(() => [old, repeat, next].every((t) => channel.acked.includes(t)));
  assert.equal(consumer.stats.stale, 1);
  assert.equal(consumer.stats.duplicates, 1);
  assert.equal(consumer.stats.applied, 1);
  assert.deepEqual((await store.positions()).get(e), { epoch: 2, lastChangeSeq: 6 });
  await consumer.stop();
});
