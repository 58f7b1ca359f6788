// A broker double for the consumer's unit tests (the `connect` option): one queue, channels that
// deliver up to their prefetch, acknowledgements, requeues, and what the real broker does when a
// channel or connection goes away (what was not acknowledged is delivered again, redelivered).
// It can refuse a connection, lose a queue, and close a connection as the management API does
// (320 CONNECTION_FORCED).

import { EventEmitter } from 'node:events';
import { AmqpConnection, Delivery } from '../../src/consumer';

interface Message {
  content: Buffer;
  redelivered: boolean;
}

export class FakeChannel extends EventEmitter {
  readonly unacked = new Map<number, Message>();
  prefetchCount = 0;
  closed = false;
  cancelled = false;
  private consumer: ((d: Delivery | null) => void) | undefined;
  private tag = 0;

  constructor(private readonly broker: FakeBroker, readonly connection: FakeConnection) {
    super();
  }

  async prefetch(n: number) {
    this.prefetchCount = n;
  }

  async consume(queue: string, on: (d: Delivery | null) => void) {
    if (!this.broker.queueExists) {
      const error = Object.assign(new Error(`Operation failed: BasicConsume; 404 (NOT-FOUND) with message "NOT_FOUND - no queue '${queue}' in vhost '/'"`), { code: 404 });
      this.closeBy(error);
      throw error;
    }
    this.consumer = on;
    this.broker.dispatch();
    return { consumerTag: 'ctag' };
  }

  async cancel() {
    this.cancelled = true;
    this.consumer = undefined;
  }

  async close() {
    if (this.closed) throw new Error('Channel closed');
    this.closeBy(undefined);
  }

  ack(d: Delivery) {
    if (this.closed) throw new Error('Channel closed');
    const message = this.unacked.get(d.fields.deliveryTag);
    if (!message) throw new Error(`PRECONDITION_FAILED - unknown delivery tag ${d.fields.deliveryTag}`);
    this.unacked.delete(d.fields.deliveryTag);
    this.broker.acked.push(message.content.toString());
    this.broker.dispatch();
  }

  nack(d: Delivery, _all: boolean, requeue: boolean) {
    if (this.closed) throw new Error('Channel closed');
    const message = this.unacked.get(d.fields.deliveryTag);
    if (!message) throw new Error(`PRECONDITION_FAILED - unknown delivery tag ${d.fields.deliveryTag}`);
    this.unacked.delete(d.fields.deliveryTag);
    if (requeue) this.broker.ready.push({ content: message.content, redelivered: true });
    else this.broker.rejected.push(message.content.toString());
    this.broker.dispatch();
  }

  /** Delivers what fits in the prefetch. */
  take(): boolean {
    if (this.closed || !this.consumer || this.cancelled) return false;
    let took = false;
    while (this.broker.ready.length > 0 && this.unacked.size < this.prefetchCount) {
      const message = this.broker.ready.shift()!;
      this.tag += 1;
      this.unacked.set(this.tag, message);
      this.consumer({ content: message.content, fields: { deliveryTag: this.tag, redelivered: message.redelivered }, properties: {} } as unknown as Delivery);
      took = true;
    }
    return took;
  }

  /** Closed (by the client, or the server with an error): what was not acknowledged is ready again. */
  closeBy(error: Error | undefined) {
    if (this.closed) return;
    this.closed = true;
    const back = [...this.unacked.values()].map((m) => ({ content: m.content, redelivered: true }));
    this.unacked.clear();
    this.broker.ready.unshift(...back);
    if (error) this.emit('error', error);
    this.emit('close');
    this.broker.dispatch();
  }
}

export class FakeConnection extends EventEmitter {
  readonly channels: FakeChannel[] = [];
  closed = false;

  constructor(private readonly broker: FakeBroker) {
    super();
  }

  async createChannel() {
    if (this.closed) throw new Error('Connection closed');
    const channel = new FakeChannel(this.broker, this);
    this.channels.push(channel);
    return channel;
  }

  async close() {
    if (this.closed) throw new Error('Connection closed');
    this.closeBy(undefined);
  }

  /** As amqplib does on a server's connection.close: the channels close, then the connection with the error. */
  closeBy(error: Error | undefined) {
    if (this.closed) return;
    this.closed = true;
    for (const channel of this.channels) channel.closeBy(undefined);
    this.emit('close', error);
  }

  /** The management API's DELETE /api/connections/<name>. */
  force(): void {
    this.closeBy(Object.assign(new Error('Connection closed: 320 (CONNECTION-FORCED) with message "CONNECTION_FORCED - Closed via management plugin"'), { code: 320 }));
  }
}

export class FakeBroker {
  readonly ready: Message[] = [];
  readonly acked: string[] = [];
  readonly rejected: string[] = [];
  readonly connections: FakeConnection[] = [];
  queueExists = true;
  /** Errors the next connection attempts fail with, in order. */
  readonly refuse: Error[] = [];
  connects = 0;
  private scheduled = false;

  readonly connect = async (): Promise<AmqpConnection> => {
    this.connects += 1;
    const error = this.refuse.shift();
    if (error) throw error;
    const connection = new FakeConnection(this);
    this.connections.push(connection);
    return connection as unknown as AmqpConnection;
  };

  publish(...messages: unknown[]): void {
    for (const m of messages) this.ready.push({ content: Buffer.from(typeof m === 'string' ? m : JSON.stringify(m)), redelivered: false });
    this.dispatch();
  }

  /** The channel in use (the last one opened). */
  get channel(): FakeChannel {
    const channels = this.connections.flatMap((c) => c.channels);
    return channels[channels.length - 1]!;
  }

  get connection(): FakeConnection {
    return this.connections[this.connections.length - 1]!;
  }

  /** Unacknowledged deliveries on open channels. */
  get inFlight(): number {
    return this.connections.flatMap((c) => c.channels).reduce((n, ch) => n + (ch.closed ? 0 : ch.unacked.size), 0);
  }

  dispatch(): void {
    if (this.scheduled) return;
    this.scheduled = true;
    setImmediate(() => {
      this.scheduled = false;
      for (const channel of this.connections.flatMap((c) => c.channels)) channel.take();
    });
  }
}

export async function until(what: () => boolean, ms = 3000, label = 'a condition'): Promise<void> {
  const end = Date.now() + ms;
  while (!what()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${label}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}
