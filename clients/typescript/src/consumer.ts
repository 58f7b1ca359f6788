// The consumer: reads a tenant's queue with manual acknowledgement and a prefetch, follows each
// endpoint's stream (src/follower.ts), applies what follows in order through a store, and
// acknowledges a delivery only once what it carries is applied (committed with its position),
// or dropped as a repeat or stale. A change that comes ahead of its predecessors is held,
// unacknowledged, until they come; held changes are bounded, and a gap that does not fill in
// time is reported and, with the relay's API at hand, asked for again by a replay.

import { EventEmitter } from 'node:events';
import * as amqp from 'amqplib';
import { RelayApi, ReplayAnswer } from './api';
import { Follower, FollowerStats, Gap, Placed } from './follower';
import { Change, decodeChange, messageId, RefusedMessage, StoryMessage } from './message';
import { ApplyOutcome, Store } from './store';

export type AmqpConnection = amqp.ChannelModel;
export type Delivery = amqp.ConsumeMessage;

export interface ConsumerOptions {
  /** The tenant's broker URL, as the relay's API hands it out (its password included). */
  amqpUrl: string;
  /** The tenant's queue: `relay.tenant.<tenant id>`. */
  queue: string;
  store: Store;
  /** When given, a change of another tenant is refused. */
  tenantId?: string;
  /** Deliveries unacknowledged at once (default 500). */
  prefetch?: number;
  /** Deliveries taken into one store transaction at most (default 500). */
  maxBatch?: number;
  /** Changes held out of order per endpoint (default 200). */
  maxHeldPerEndpoint?: number;
  /** Changes held out of order in all (default 400; kept below the prefetch). */
  maxHeldTotal?: number;
  /** A gap still open after this long is reported, and replayed when `api` is given (default 10 s). */
  gapTimeoutMs?: number;
  /** The relay's API with a token of the tenant: used to replay the changes of a gap. */
  api?: RelayApi;
  /** Replay a gap's changes through `api` (default true when `api` is given). */
  replayGaps?: boolean;
  /**
   * What to do with a message this library refuses (another `v`, an unknown `kind`, malformed,
   * another tenant's). `stop` (the default): report it and stop, leaving it unacknowledged in
   * the queue, so nothing is lost and nothing is guessed until the library is upgraded.
   * `reject`: report it and nack it without requeue (the queue's dead-letter exchange gets it,
   * if it has one; otherwise it is gone), and go on: its endpoint's next changes then wait as a
   * gap.
   */
  onRefused?: 'stop' | 'reject';
  /** How long a change given back to the queue (a bound passed) waits before the nack (default 200 ms). */
  releaseDelayMs?: number;
  /** Opens the broker connection (default amqplib's `connect`). */
  connect?: (url: string) => Promise<AmqpConnection>;
}

export interface ConsumerStats extends FollowerStats {
  deliveries: number;
  refused: number;
  /** Applied changes the store found applied already (skipped). */
  skipped: number;
  /** Applied changes whose row write the store's conditions declined. */
  declined: number;
  notificationsRecorded: number;
  notificationsHanded: number;
  repeatedNotifications: number;
  replays: number;
  batches: number;
  /** Notifications of a stale epoch, recorded by story id rather than dropped. */
  lateNotifications: number;
}

export interface GapReport extends Gap {
  /** The missing change_seqs, `from` to `to`. */
  missing: number[];
}

/**
 * Events: `applied` (ApplyOutcome, changes), `gap` (GapReport), `replay` ({endpoint, from,
 * answer} or {endpoint, from, error}), `refused` (RefusedMessage, delivery), `error` (Error),
 * `stopped` (Error | undefined).
 */
export class RelayConsumer extends EventEmitter {
  readonly stats: ConsumerStats;
  private readonly options: Required<Omit<ConsumerOptions, 'tenantId' | 'api'>> & Pick<ConsumerOptions, 'tenantId' | 'api'>;
  private readonly follower: Follower<Delivery>;
  private connection: AmqpConnection | undefined;
  private channel: amqp.Channel | undefined;
  private consumerTag: string | undefined;
  private readonly inbox: Delivery[] = [];
  private pumping: Promise<void> | undefined;
  private pumpRun: Promise<void> | undefined;
  private stopping = false;
  private stoppedWith: { error: Error | undefined } | undefined;
  private gapTimer: NodeJS.Timeout | undefined;
  private readonly releaseTimers = new Set<NodeJS.Timeout>();
  private readonly lastReplay = new Map<string, number>();
  private notificationsOwed = false;
  private resolveDone!: (error: Error | undefined) => void;
  /** Settles when the consumer stopped: with the error that stopped it, or undefined. */
  readonly done: Promise<Error | undefined>;

  constructor(options: ConsumerOptions) {
    super();
    const prefetch = options.prefetch ?? 500;
    this.options = {
      prefetch,
      maxBatch: options.maxBatch ?? 500,
      maxHeldPerEndpoint: options.maxHeldPerEndpoint ?? 200,
      maxHeldTotal: Math.min(options.maxHeldTotal ?? 400, Math.max(1, prefetch - 1)),
      gapTimeoutMs: options.gapTimeoutMs ?? 10_000,
      replayGaps: options.replayGaps ?? options.api !== undefined,
      onRefused: options.onRefused ?? 'stop',
      releaseDelayMs: options.releaseDelayMs ?? 200,
      connect: options.connect ?? ((url: string) => amqp.connect(url)),
      amqpUrl: options.amqpUrl,
      queue: options.queue,
      store: options.store,
      tenantId: options.tenantId,
      api: options.api,
    };
    this.follower = new Follower<Delivery>({
      maxHeldPerEndpoint: this.options.maxHeldPerEndpoint,
      maxHeldTotal: this.options.maxHeldTotal,
    });
    this.stats = Object.assign(this.follower.stats, {
      deliveries: 0, refused: 0, skipped: 0, declined: 0, notificationsRecorded: 0, notificationsHanded: 0,
      repeatedNotifications: 0, replays: 0, batches: 0, lateNotifications: 0,
    }) as ConsumerStats;
    this.done = new Promise((resolve) => (this.resolveDone = resolve));
    // An 'error' with no listener would throw; the error is also what `done` settles with.
    this.on('error', () => {});
  }

  /** Resumes from the store's positions, hands notifications still owed, and starts consuming. */
  async start(): Promise<void> {
    for (const [endpoint, position] of await this.options.store.positions()) this.follower.resume(endpoint, position);
    await this.handNotifications();
    const connection = await this.options.connect(this.options.amqpUrl);
    this.connection = connection;
    connection.on('error', (error: Error) => this.fail(new Error(`the broker connection failed: ${error.message}`)));
    connection.on('close', () => this.fail(new Error('the broker connection closed')));
    const channel = await connection.createChannel();
    this.channel = channel;
    channel.on('error', (error: Error) => this.fail(new Error(`the channel failed: ${error.message}`)));
    channel.on('close', () => this.fail(new Error('the channel closed')));
    await channel.prefetch(this.options.prefetch);
    const { consumerTag } = await channel.consume(
      this.options.queue,
      (delivery) => {
        if (delivery === null) {
          this.fail(new Error(`the broker cancelled the consumer of ${this.options.queue}`));
          return;
        }
        this.stats.deliveries += 1;
        this.inbox.push(delivery);
        this.kick();
      },
      { noAck: false },
    );
    this.consumerTag = consumerTag;
    const every = Math.max(50, Math.min(1000, Math.floor(this.options.gapTimeoutMs / 2)));
    this.gapTimer = setInterval(() => this.checkGaps(), every);
    this.gapTimer.unref();
  }

  /** Stops consuming, finishes the batch under way, and closes: what is unacknowledged goes back to the queue. */
  async stop(): Promise<void> {
    await this.shutdown(undefined);
  }

  /** The gaps open now (changes held waiting for predecessors). */
  gaps(): GapReport[] {
    return this.follower.gaps(0).map(report);
  }

  private kick(): void {
    if (this.pumping || this.stopping) return;
    this.pumpRun = this.pump();
    this.pumping = this.pumpRun
      .catch((error: Error) => this.fail(error))
      .finally(() => {
        this.pumping = undefined;
        if (this.inbox.length > 0 && !this.stopping) this.kick();
      });
  }

  private async pump(): Promise<void> {
    while (this.inbox.length > 0 && !this.stopping) {
      const batch = this.inbox.splice(0, this.options.maxBatch);
      const toApply: Placed<Delivery>[] = [];
      const toAck: Delivery[] = [];
      const toRelease: Delivery[] = [];
      const late: Placed<Delivery>[] = [];
      let refusedStop: RefusedMessage | undefined;
      for (const delivery of batch) {
        let change: Change;
        try {
          change = decodeChange(delivery.content);
          if (this.options.tenantId !== undefined && change.tenant_id !== this.options.tenantId) {
            throw new RefusedMessage('other_tenant', `change ${messageId(change)} is tenant ${change.tenant_id}'s, not ${this.options.tenantId}'s`, 1, messageId(change));
          }
        } catch (error) {
          if (!(error instanceof RefusedMessage)) throw error;
          this.stats.refused += 1;
          this.emit('refused', error, delivery);
          if (this.options.onRefused === 'reject') {
            this.channel?.nack(delivery, false, false);
            continue;
          }
          refusedStop = error;
          break;
        }
        const verdict = this.follower.receive(change, delivery);
        const stale = verdict.outcome === 'stale' ? [{ change, token: delivery }, ...verdict.stale] : verdict.stale;
        for (const placed of stale) {
          if ('kind' in placed.change && placed.change.operation === 'notified') late.push(placed);
          else toAck.push(placed.token);
        }
        if (verdict.outcome === 'apply') toApply.push(...verdict.apply);
        else if (verdict.outcome === 'held') toRelease.push(...verdict.released.map((p) => p.token));
        else if (verdict.outcome === 'duplicate') toAck.push(delivery);
      }
      if (toApply.length > 0 || late.length > 0) {
        this.stats.batches += 1;
        const outcome: ApplyOutcome = await this.options.store.apply(
          toApply.map((p) => p.change),
          late.map((p) => p.change as StoryMessage),
        );
        this.stats.lateNotifications += late.length;
        for (const placed of late) this.channel?.ack(placed.token);
        this.stats.skipped += outcome.skipped;
        this.stats.declined += outcome.declined;
        this.stats.notificationsRecorded += outcome.notifications;
        this.stats.repeatedNotifications += outcome.repeatedNotifications;
        for (const placed of toApply) this.channel?.ack(placed.token);
        if (outcome.notifications > 0) this.notificationsOwed = true;
        this.emit('applied', outcome, toApply.map((p) => p.change));
      }
      for (const delivery of toAck) this.channel?.ack(delivery);
      for (const delivery of toRelease) this.release(delivery);
      if (this.notificationsOwed) await this.handNotifications();
      if (refusedStop) {
        // Everything after the refused message (it included) stays unacknowledged: the broker
        // puts it back as the channel closes.
        this.inbox.length = 0;
        void this.shutdown(refusedStop);
        return;
      }
    }
  }

  private async handNotifications(): Promise<void> {
    this.notificationsOwed = false;
    try {
      this.stats.notificationsHanded += await this.options.store.handPending();
    } catch (error) {
      // Left pending: handed at the next batch, or the next start.
      this.notificationsOwed = true;
      this.emit('error', new Error(`handing a notification failed: ${(error as Error).message}`));
    }
  }

  private release(delivery: Delivery): void {
    const timer = setTimeout(() => {
      this.releaseTimers.delete(timer);
      if (!this.stopping) this.channel?.nack(delivery, false, true);
    }, this.options.releaseDelayMs);
    this.releaseTimers.add(timer);
  }

  private checkGaps(): void {
    const now = Date.now();
    for (const gap of this.follower.gaps(this.options.gapTimeoutMs)) {
      const last = this.lastReplay.get(gap.endpoint) ?? 0;
      if (now - last < this.options.gapTimeoutMs) continue;
      this.lastReplay.set(gap.endpoint, now);
      const gapReport = report(gap);
      this.emit('gap', gapReport);
      const api = this.options.api;
      if (!api || !this.options.replayGaps) continue;
      this.stats.replays += 1;
      api.replay(gap.endpoint, gap.from).then(
        (answer: ReplayAnswer) => this.emit('replay', { endpoint: gap.endpoint, from: gap.from, answer }),
        (error: Error) => this.emit('replay', { endpoint: gap.endpoint, from: gap.from, error }),
      );
    }
  }

  private fail(error: Error): void {
    if (this.stopping) return;
    this.emit('error', error);
    void this.shutdown(error);
  }

  private async shutdown(error: Error | undefined): Promise<void> {
    if (this.stopping) {
      await this.done;
      return;
    }
    this.stopping = true;
    if (this.gapTimer) clearInterval(this.gapTimer);
    for (const timer of this.releaseTimers) clearTimeout(timer);
    this.releaseTimers.clear();
    const channel = this.channel;
    if (channel && this.consumerTag) await channel.cancel(this.consumerTag).catch(() => {});
    if (this.pumpRun) await this.pumpRun.catch(() => {});
    // Closing gives back every delivery not acknowledged: the held ones, the released ones, and
    // whatever was still in the inbox.
    await channel?.close().catch(() => {});
    await this.connection?.close().catch(() => {});
    this.stoppedWith = { error };
    this.emit('stopped', error);
    this.resolveDone(error);
  }

  /** Whether the consumer has stopped, and with what. */
  get stopped(): { error: Error | undefined } | undefined {
    return this.stoppedWith;
  }
}

function report(gap: Gap): GapReport {
  const missing: number[] = [];
  for (let seq = gap.from; seq <= gap.to && missing.length < 10_000; seq++) missing.push(seq);
  return { ...gap, missing };
}
