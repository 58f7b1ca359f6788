// A second consumer on the tenant's queue (plain amqplib, the tenant's credentials) that takes
// some deliveries and gives them back (nack with requeue) after a short delay, in shuffled
// order: the consumer under test then gets changes out of order, and some twice. It works in
// bursts (on, then off), so that no message comes near the queue's delivery limit.

import * as amqp from 'amqplib';
import { sleep } from './processes';

export interface ScramblerOptions {
  amqpUrl: string;
  queue: string;
  random: () => number;
  /** Deliveries it holds at once. */
  prefetch?: number;
  /** How long it holds a batch before giving it back, at most. */
  maxDelayMs?: number;
  /** Burst lengths: on for onMs, then off for offMs (each scaled by 0.5..1.5). */
  onMs?: number;
  offMs?: number;
}

export class Scrambler {
  taken = 0;
  givenBack = 0;
  private connection: amqp.ChannelModel | undefined;
  private channel: amqp.Channel | undefined;
  private running = false;
  private loop: Promise<void> | undefined;
  private held: amqp.ConsumeMessage[] = [];
  private flushing: NodeJS.Timeout | undefined;
  private failure: Error | undefined;

  constructor(private readonly options: ScramblerOptions) {}

  async start(): Promise<void> {
    this.connection = await amqp.connect(this.options.amqpUrl, { clientProperties: { connection_name: 'relay-ts-e2e scrambler' } });
    this.connection.on('error', (error: Error) => (this.failure ??= error));
    this.running = true;
    this.loop = this.bursts();
  }

  /** Stops taking, gives back what it holds, and closes; throws when the broker failed it. */
  async stop(): Promise<void> {
    this.running = false;
    await this.loop;
    await this.connection?.close().catch(() => {});
    if (this.failure) throw new Error(`the scrambler's connection failed: ${this.failure.message}`);
  }

  private async bursts(): Promise<void> {
    const { random } = this.options;
    const scaled = (ms: number) => Math.round(ms * (0.5 + random()));
    while (this.running) {
      await this.burst(scaled(this.options.onMs ?? 1500));
      let off = scaled(this.options.offMs ?? 2500);
      while (this.running && off > 0) {
        await sleep(Math.min(off, 100));
        off -= 100;
      }
    }
  }

  private async burst(ms: number): Promise<void> {
    const channel = await this.connection!.createChannel();
    this.channel = channel;
    channel.on('error', (error: Error) => (this.failure ??= error));
    await channel.prefetch(this.options.prefetch ?? 30);
    const { consumerTag } = await channel.consume(this.options.queue, (delivery) => {
      if (!delivery) return;
      this.taken += 1;
      this.held.push(delivery);
      this.flushing ??= setTimeout(() => this.flush(), Math.round(this.options.random() * (this.options.maxDelayMs ?? 300)));
    }, { noAck: false });
    const end = Date.now() + ms;
    while (this.running && Date.now() < end) await sleep(50);
    await channel.cancel(consumerTag).catch(() => {});
    if (this.flushing) clearTimeout(this.flushing);
    this.flush();
    await channel.close().catch(() => {});
    this.channel = undefined;
  }

  /** Gives back every delivery held, in shuffled order. */
  private flush(): void {
    this.flushing = undefined;
    const batch = this.held;
    this.held = [];
    for (let i = batch.length - 1; i > 0; i--) {
      const j = Math.floor(this.options.random() * (i + 1));
      [batch[i], batch[j]] = [batch[j]!, batch[i]!];
    }
    for (const delivery of batch) {
      try {
        this.channel?.nack(delivery, false, true);
        this.givenBack += 1;
      } catch {
        // the channel closed: the broker gives it back
      }
    }
  }
}
