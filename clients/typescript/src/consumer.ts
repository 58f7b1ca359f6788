// The consumer: reads a tenant's queue with manual acknowledgement and a prefetch, follows each
// endpoint's stream (src/follower.ts), and writes through a store, in one transaction per batch
// of deliveries, what the batch decided: the changes applied with their positions, the changes
// held (ahead of their predecessors), the late notifications. A delivery is acknowledged only
// once that commits (or when it was a repeat or stale). A gap that does not fill in time is
// reported and, with the relay's API at hand, asked for again by a replay.
//
// The lifecycle (clients/README.md): a session is the store's state loaded, the notifications
// still owed handed, a broker connection and channel, and consuming until something ends it. A
// transient failure (the connection or channel lost or closed, the broker not answering, the
// store's database restarting or unreachable) ends the session, and another begins after a
// jittered backoff, forever; what was not committed is redelivered. A permanent one (broker
// ACCESS_REFUSED, queue NOT_FOUND, the store's database missing or refusing the credentials, a
// newer store schema) ends the consumer: `done` rejects with a PermanentError. `stop()` finishes
// the batch in hand, closes the channel, the connection and the store, and resolves.

import { EventEmitter } from 'node:events';
import * as amqp from 'amqplib';
import { RelayApi, ReplayAnswer } from './api';
import { classify, describeError, HandlerError, PermanentCause, PermanentError } from './errors';
import { DEFAULT_LIMITS, Follower, Gap } from './follower';
import { Logger, quietLogger } from './logger';
import { Change, decodeChange, messageId, RefusedMessage, StoryMessage } from './message';
import { ApplyOutcome, Store } from './store';

export type AmqpConnection = amqp.ChannelModel;
export type Delivery = amqp.ConsumeMessage;

/** What the consumer tells `onError`: each failure, transient or permanent. */
export interface ConsumerErrorEvent {
  /** true: the consumer goes on (reconnects after `retryInMs`); false: it has stopped for good. */
  transient: boolean;
  error: Error;
  /** What happened, in one line: the broker's close code and text, Postgres's SQLSTATE. */
  cause: string;
  /** The wait before the next attempt (transient failures of the broker or the store). */
  retryInMs?: number;
  /** Why it stopped (permanent failures). */
  causeKind?: PermanentCause;
}

export interface ConsumerOptions {
  /** The tenant's broker URL, as the relay's API hands it out (its password included). */
  amqpUrl: string;
  /** The tenant's queue: `relay.tenant.<tenant id>`. */
  queue: string;
  store: Store;
  /** A change of another tenant is refused (default: the tenant the queue's name says). */
  tenantId?: string;
  /** Deliveries unacknowledged at once (default 256). */
  prefetch?: number;
  /** Deliveries taken into one store transaction at most (default 256). */
  batchMax?: number;
  /** Changes held out of order per endpoint (default 1,000). */
  maxHeldPerEndpoint?: number;
  /** Changes held out of order in all (default 10,000). */
  maxHeldTotal?: number;
  /** A gap still open after this long is reported, and replayed when `api` is given (default 10 s). */
  gapTimeoutMs?: number;
  /** The relay's API with a token of the tenant: used to replay the changes of a gap. */
  api?: RelayApi;
  /** Replay a gap's changes through `api` (default true when `api` is given). */
  replayGaps?: boolean;
  /**
   * What to do with a message this library refuses (another `v`, an unknown `kind`, malformed,
   * another tenant's). `stop` (the default): report it and stop (`done` rejects with the
   * RefusedMessage), leaving it unacknowledged in the queue, so nothing is lost and nothing is
   * guessed until the library is upgraded. `reject`: report it and nack it without requeue (the
   * queue's dead-letter exchange gets it), and go on: its endpoint's next changes then wait as a
   * gap.
   */
  onRefused?: 'stop' | 'reject';
  /** How long a change past the hold bounds waits before it is given back to the queue (default 200 ms). */
  releaseDelayMs?: number;
  /** The first reconnection's backoff step (default 500 ms); a wait is random up to the step. */
  backoffInitialMs?: number;
  /** The greatest backoff step (default 30 s). */
  backoffMaxMs?: number;
  /** Called with each failure, transient or permanent (see ConsumerErrorEvent). */
  onError?: (event: ConsumerErrorEvent) => void;
  /** Where the consumer's log lines go (default: nowhere). */
  logger?: Logger;
  /** The broker connection's name, as the management UI shows it (default `relay-consumer (typescript)`). */
  connectionName?: string;
  /** Opens the broker connection (default amqplib's `connect`, with a 10 s timeout). */
  connect?: (url: string) => Promise<AmqpConnection>;
}

/** `stats()`: counts since the consumer was made, and each endpoint's position. */
export interface ConsumerStats {
  deliveries: number;
  /** Batches of deliveries taken from the queue. */
  batches: number;
  /** Store transactions committed (a batch's applied and held changes, late notifications). */
  commits: number;
  refused: number;
  gapsReported: number;
  replaysAsked: number;
  /** Changes past the hold bounds acknowledged because a replay asked for sends them again. */
  overflowDropped: number;
  notificationsHanded: number;
  /** Notifications of an older epoch than their endpoint's, recorded by story id rather than dropped. */
  lateNotifications: number;
  /** Sessions begun again after a transient failure. */
  reconnects: number;
  /** Failures reported to onError (transient and permanent). */
  errors: number;
  /** Per endpoint: its position, the changes held, and the lag (s). */
  endpoints: Record<string, EndpointStats>;
  /** Changes received (decoded). */
  received: number;
  /** Changes applied (committed with their positions). */
  applied: number;
  duplicates: number;
  stale: number;
  /** Changes that came ahead of their predecessors (held). */
  reordered: number;
  /** Changes past a hold bound. */
  overflows: number;
  /** Changes past a hold bound given back to the queue (no replay covered them). */
  released: number;
  snapshots: number;
  /** Applied changes the store found applied already (skipped). */
  skipped: number;
  /** Applied changes whose row write the store's conditions declined. */
  declined: number;
  notificationsRecorded: number;
  repeatedNotifications: number;
}

export interface EndpointStats {
  epoch: number;
  lastChangeSeq: number;
  /** Changes held, waiting for their predecessors. */
  held: number;
  /**
   * Seconds: now less the `changed_at` of the last change applied, as of the last commit; null
   * before this process committed a change of the endpoint.
   */
  lagS: number | null;
}

export type HealthStatus = 'starting' | 'ok' | 'reconnecting' | 'stopped' | 'failed';

export interface Health {
  status: HealthStatus;
  /** Consuming on a live channel now. */
  connected: boolean;
  /** ISO time of the last commit, null before the first. */
  lastCommitAt: string | null;
  /** The last failure's cause, null before the first. */
  lastError: string | null;
}

export interface GapReport extends Gap {
  /** The missing change_seqs, `from` to `to`. */
  missing: number[];
}

const TENANT_QUEUE = /^relay\.tenant\.([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$/;

/** A session's broker RPC that does not answer in this long is a broker not answering. */
const RPC_TIMEOUT_MS = 30_000;
/** A session that consumed this long starts the backoff over. */
const BACKOFF_RESET_MS = 30_000;

type Resolved = Required<Omit<ConsumerOptions, 'tenantId' | 'api' | 'onError'>> & Pick<ConsumerOptions, 'tenantId' | 'api' | 'onError'>;

/** One connection's life: from loading the store's state to its end. */
class Session {
  connection: AmqpConnection | undefined;
  channel: amqp.Channel | undefined;
  consumerTag: string | undefined;
  readonly inbox: Delivery[] = [];
  pumpRun: Promise<void> | undefined;
  /** Deliveries of the batch being applied (0 between batches). */
  inBatch = 0;
  gapTimer: NodeJS.Timeout | undefined;
  readonly releaseTimers = new Set<NodeJS.Timeout>();
  consumingSince: number | undefined;
  /** Ended: takes no more deliveries; the batch in hand finishes. */
  over = false;
  readonly ended: Promise<Error | undefined>;
  private readonly reasons: Error[] = [];
  private resolveEnded!: (error: Error | undefined) => void;

  constructor() {
    this.ended = new Promise((resolve) => (this.resolveEnded = resolve));
  }

  /** Remembers an error that may explain the end (a connection's 'error' comes before its close). */
  note(error: Error): void {
    this.reasons.push(error);
  }

  /**
   * Ends the session, with the reason when one is given. The events of one close come in the
   * same turn (the channels' 'close', then the connection's with the broker's code and text):
   * the session ends after them, with the most telling.
   */
  end(error?: Error): void {
    if (error) this.reasons.push(error);
    if (this.over) return;
    this.over = true;
    setImmediate(() => {
      const coded = this.reasons.find((e) => (e as { code?: unknown }).code !== undefined);
      this.resolveEnded(coded ?? this.reasons[0]);
    });
  }
}

/**
 * Events: `applied` (ApplyOutcome, changes), `gap` (GapReport), `replay` ({endpoint, from,
 * answer} or {endpoint, from, error}), `refused` (RefusedMessage, delivery), `error` (Error,
 * each failure also given to `onError`), `stopped` (the error that ended it, or undefined).
 */
export class RelayConsumer extends EventEmitter {
  /**
   * Settles when the consumer ended: resolves after `stop()`, rejects with the error that ended
   * it otherwise (a PermanentError, a RefusedMessage with `onRefused: 'stop'`, a HandlerError).
   */
  readonly done: Promise<void>;
  private readonly options: Resolved;
  private readonly follower: Follower;
  private readonly logger: Logger;
  private readonly counts = {
    deliveries: 0, batches: 0, commits: 0, refused: 0, gapsReported: 0, replaysAsked: 0, overflowDropped: 0,
    notificationsHanded: 0, lateNotifications: 0, reconnects: 0, transientErrors: 0, permanentErrors: 0,
    released: 0, skipped: 0, declined: 0, notificationsRecorded: 0, repeatedNotifications: 0,
  };
  /** Per endpoint, the changed_at (ms) of the last change applied, as of the last commit. */
  private readonly changedAt = new Map<string, number>();
  private readonly replayed = new Map<string, { answer: ReplayAnswer; at: number }>();
  private readonly gapReported = new Map<string, number>();
  private session: Session | undefined;
  private running: Promise<void> | undefined;
  private stopRequested = false;
  private status: HealthStatus = 'starting';
  private lastCommitAt: number | null = null;
  private lastError: string | null = null;
  private notificationsOwed = false;
  private wake: (() => void) | undefined;
  private readonly firstSession: Promise<void>;
  private settleFirst!: (error?: Error) => void;
  private settleDone!: (error?: Error) => void;

  constructor(options: ConsumerOptions) {
    super();
    const tenantFromQueue = TENANT_QUEUE.exec(options.queue)?.[1];
    this.options = {
      prefetch: options.prefetch ?? 256,
      batchMax: options.batchMax ?? 256,
      maxHeldPerEndpoint: options.maxHeldPerEndpoint ?? DEFAULT_LIMITS.maxHeldPerEndpoint,
      maxHeldTotal: options.maxHeldTotal ?? DEFAULT_LIMITS.maxHeldTotal,
      gapTimeoutMs: options.gapTimeoutMs ?? 10_000,
      replayGaps: options.replayGaps ?? options.api !== undefined,
      onRefused: options.onRefused ?? 'stop',
      releaseDelayMs: options.releaseDelayMs ?? 200,
      backoffInitialMs: options.backoffInitialMs ?? 500,
      backoffMaxMs: options.backoffMaxMs ?? 30_000,
      logger: options.logger ?? quietLogger,
      connectionName: options.connectionName ?? 'relay-consumer (typescript)',
      connect: options.connect ?? ((url: string) => amqp.connect(url, {
        timeout: 10_000,
        clientProperties: { connection_name: this.options.connectionName },
      })),
      amqpUrl: options.amqpUrl,
      queue: options.queue,
      store: options.store,
      tenantId: options.tenantId ?? tenantFromQueue,
      api: options.api,
      onError: options.onError,
    };
    if (this.options.prefetch < 1 || this.options.batchMax < 1) throw new RangeError('prefetch and batchMax must be 1 or more');
    this.logger = this.options.logger;
    this.follower = new Follower({
      maxHeldPerEndpoint: this.options.maxHeldPerEndpoint,
      maxHeldTotal: this.options.maxHeldTotal,
    });
    this.done = new Promise((resolve, reject) => {
      this.settleDone = (error) => (error ? reject(error) : resolve());
    });
    this.firstSession = new Promise((resolve, reject) => {
      this.settleFirst = (error) => (error ? reject(error) : resolve());
    });
    // Whoever awaits them sees the rejection; nobody awaiting them is not an unhandled one.
    this.done.catch(() => {});
    this.firstSession.catch(() => {});
    // An 'error' with no listener would throw: errors go to onError, the logger and `done`.
    this.on('error', () => {});
  }

  /**
   * Starts consuming: resolves once the first session consumes (the store's positions and held
   * changes loaded, the notifications still owed handed, the queue consumed), retrying transient
   * failures meanwhile; rejects as `done` does when the consumer ends for good first, resolves
   * when `stop()` comes first. A second call answers the same.
   */
  start(): Promise<void> {
    this.running ??= this.run();
    return this.firstSession;
  }

  /**
   * Stops: takes no more deliveries, finishes the batch in hand (applies and commits it, then
   * acknowledges it), closes the channel, the connection and the store, and resolves (also when
   * the consumer had ended otherwise). Safe to call from a signal handler, and more than once.
   */
  async stop(): Promise<void> {
    if (!this.stopRequested) {
      this.stopRequested = true;
      if (this.status === 'failed' || this.status === 'stopped') return;
      const session = this.session;
      const inHand = session && !session.over && session.inBatch > 0
        ? ` (finishing the batch in hand, ${session.inBatch} deliveries; ${session.inbox.length} not taken go back to the queue)`
        : '';
      this.logger.info(`relay-consumer: stopping${inHand}`);
      this.session?.end();
      this.wake?.();
      this.running ??= this.finish(undefined);
    }
    await this.done.catch(() => {});
  }

  /** The gaps open now (changes held waiting for predecessors). */
  gaps(): GapReport[] {
    return this.follower.gaps(0).map(report);
  }

  stats(): ConsumerStats {
    const c = this.counts;
    const f = this.follower.stats;
    const endpoints: Record<string, EndpointStats> = {};
    const now = Date.now();
    for (const e of this.follower.endpointStates()) {
      const changed = this.changedAt.get(e.endpoint);
      const lagS = changed === undefined ? null : Math.max(0, (now - changed) / 1000);
      endpoints[e.endpoint] = { epoch: e.epoch, lastChangeSeq: e.lastChangeSeq, held: e.held, lagS };
    }
    return {
      deliveries: c.deliveries, batches: c.batches, commits: c.commits, refused: c.refused, gapsReported: c.gapsReported,
      replaysAsked: c.replaysAsked, overflowDropped: c.overflowDropped, notificationsHanded: c.notificationsHanded,
      lateNotifications: c.lateNotifications, reconnects: c.reconnects, errors: c.transientErrors + c.permanentErrors,
      endpoints,
      received: f.received, applied: f.applied, duplicates: f.duplicates, stale: f.stale, reordered: f.reordered,
      overflows: f.overflows, released: c.released, snapshots: f.snapshots, skipped: c.skipped, declined: c.declined,
      notificationsRecorded: c.notificationsRecorded, repeatedNotifications: c.repeatedNotifications,
    };
  }

  health(): Health {
    return {
      status: this.status,
      connected: this.connected,
      lastCommitAt: this.lastCommitAt === null ? null : new Date(this.lastCommitAt).toISOString(),
      lastError: this.lastError,
    };
  }

  /** The Prometheus text exposition of the consumer's counters and gauges (clients/README.md). */
  metricsText(): string {
    const s = this.stats();
    const c = this.counts;
    const lines: string[] = [];
    const metric = (name: string, type: string, help: string, samples: [string, number][]) => {
      lines.push(`# HELP ${name} ${help}`, `# TYPE ${name} ${type}`);
      for (const [labels, value] of samples) lines.push(`${name}${labels} ${value}`);
    };
    const per = (value: (e: EndpointStats) => number | null): [string, number][] =>
      Object.entries(s.endpoints).flatMap(([id, e]) => {
        const v = value(e);
        return v === null ? [] : [[`{endpoint="${id}"}`, v] as [string, number]];
      });
    metric('relay_consumer_deliveries_total', 'counter', 'Deliveries taken from the queue.', [['', s.deliveries]]);
    metric('relay_consumer_commits_total', 'counter', 'Store transactions committed.', [['', s.commits]]);
    metric('relay_consumer_refused_total', 'counter', 'Deliveries refused (unknown version or kind, malformed, another tenant).', [['', s.refused]]);
    metric('relay_consumer_reconnects_total', 'counter', 'Sessions begun again after a transient failure.', [['', s.reconnects]]);
    metric('relay_consumer_errors_total', 'counter', 'Failures, by kind.', [['{kind="transient"}', c.transientErrors], ['{kind="permanent"}', c.permanentErrors]]);
    metric('relay_consumer_up', 'gauge', '1 while consuming on a live channel.', [['', this.connected ? 1 : 0]]);
    metric('relay_consumer_last_change_seq', 'gauge', "The last change_seq applied of the endpoint's epoch.", per((e) => e.lastChangeSeq));
    metric('relay_consumer_lag_seconds', 'gauge', 'Now less the changed_at of the last change applied (as of the last commit).', per((e) => e.lagS));
    metric('relay_consumer_held', 'gauge', 'Changes held, waiting for their predecessors.', per((e) => e.held));
    return `${lines.join('\n')}\n`;
  }

  private get connected(): boolean {
    return this.status === 'ok' && this.session !== undefined && !this.session.over;
  }

  // -- the sessions ----------------------------------------------------------------------------

  private async run(): Promise<void> {
    let step = this.options.backoffInitialMs;
    let attempt = 0;
    try {
      for (;;) {
        if (this.stopRequested) break;
        if (attempt > 0) this.counts.reconnects += 1;
        attempt += 1;
        const session = new Session();
        this.session = session;
        let error: unknown;
        try {
          error = await this.runSession(session);
        } catch (thrown) {
          error = thrown;
        }
        if (this.stopRequested) break;
        const classified = classify(error);
        if (classified.kind !== 'transient') {
          await this.finish(classified.kind === 'permanent' ? classified.error : asError(error));
          return;
        }
        const consumed = session.consumingSince === undefined ? 0 : Date.now() - session.consumingSince;
        if (consumed >= BACKOFF_RESET_MS) step = this.options.backoffInitialMs;
        const wait = Math.round(Math.random() * step);
        step = Math.min(step * 2, this.options.backoffMaxMs);
        this.status = 'reconnecting';
        this.report(asError(error ?? new Error('the session ended')), true, wait);
        await new Promise<void>((resolve) => {
          const timer = setTimeout(resolve, wait);
          this.wake = () => {
            clearTimeout(timer);
            resolve();
          };
        });
        this.wake = undefined;
      }
      await this.finish(undefined);
    } catch (error) {
      await this.finish(asError(error));
    }
  }

  /** One session, from loading the store's state to its end: answers the error that ended it. */
  private async runSession(session: Session): Promise<Error | undefined> {
    try {
      const store = this.options.store;
      const [positions, held] = await Promise.all([store.positions(), store.held()]);
      const ready = this.follower.restore(positions, held);
      if (ready.length > 0) await this.commit(ready, [], []);
      this.notificationsOwed = true;
      await this.handNotifications();
      if (this.stopRequested) return undefined;

      const connection = await timed(this.options.connect(this.options.amqpUrl), 'connecting to the broker');
      session.connection = connection;
      connection.on('error', (error: Error) => session.note(error));
      connection.on('close', (error?: Error) => session.end(error ?? new Error('the broker connection closed')));
      if (this.stopRequested || session.over) return await this.teardown(session);
      const channel = await timed(connection.createChannel(), 'opening a channel');
      session.channel = channel;
      channel.on('error', (error: Error) => session.note(error));
      channel.on('close', () => session.end(new Error('the channel closed')));
      await timed(channel.prefetch(this.options.prefetch), 'setting the prefetch');
      const { consumerTag } = await timed(channel.consume(this.options.queue, (delivery) => this.onDelivery(session, delivery), { noAck: false }), `consuming ${this.options.queue}`);
      session.consumerTag = consumerTag;
      if (session.over) return await this.teardown(session);
      session.consumingSince = Date.now();
      this.status = 'ok';
      this.logger.info(`relay-consumer: consuming ${this.options.queue} (prefetch ${this.options.prefetch}, batch ${this.options.batchMax})`);
      this.settleFirst();
      const every = Math.max(50, Math.min(1000, Math.floor(this.options.gapTimeoutMs / 2)));
      session.gapTimer = setInterval(() => void this.checkGaps().catch(() => {}), every);
      session.gapTimer.unref();
      await session.ended;
      return await this.teardown(session);
    } catch (error) {
      session.end(asError(error));
      const reason = await this.teardown(session);
      // A broker RPC that failed as the connection closed says less than the close itself.
      throw classify(error).kind === 'transient' && reason ? reason : error;
    }
  }

  /**
   * Ends a session: no more deliveries taken (the consumer cancelled), the batch in hand
   * finished, the channel and connection closed (what was not acknowledged goes back to the
   * queue). Answers the error that ended it.
   */
  private async teardown(session: Session): Promise<Error | undefined> {
    session.end();
    const reason = await session.ended;
    if (session.gapTimer) clearInterval(session.gapTimer);
    for (const timer of session.releaseTimers) clearTimeout(timer);
    session.releaseTimers.clear();
    const channel = session.channel;
    if (channel && session.consumerTag) await timed(channel.cancel(session.consumerTag), 'cancelling').catch(() => {});
    if (session.pumpRun) await session.pumpRun.catch(() => {});
    session.inbox.length = 0;
    await timed(channel?.close() ?? Promise.resolve(), 'closing the channel').catch(() => {});
    await timed(session.connection?.close() ?? Promise.resolve(), 'closing the connection').catch(() => {});
    return reason;
  }

  /** The end: the store closed, `done` settled (rejected with `error` when there is one). */
  private async finish(error: Error | undefined): Promise<void> {
    if (error) {
      this.status = 'failed';
      this.report(error, false);
    }
    try {
      await this.options.store.close();
    } catch (closing) {
      this.logger.warn(`relay-consumer: closing the store failed: ${describeError(closing)}`);
    }
    if (!error) {
      this.status = 'stopped';
      this.logger.info('relay-consumer: stopped');
    }
    this.emit('stopped', error);
    this.settleFirst(error);
    this.settleDone(error);
  }

  private report(error: Error, transient: boolean, retryInMs?: number): void {
    const cause = describeError(error);
    this.lastError = cause;
    const event: ConsumerErrorEvent = { transient, error, cause };
    if (transient) {
      this.counts.transientErrors += 1;
      if (retryInMs !== undefined) {
        event.retryInMs = retryInMs;
        this.logger.warn(`relay-consumer: ${cause}; reconnecting in ${(retryInMs / 1000).toFixed(1)} s`);
      } else {
        this.logger.warn(`relay-consumer: ${cause}`);
      }
    } else {
      this.counts.permanentErrors += 1;
      if (error instanceof PermanentError) event.causeKind = error.causeKind;
      this.logger.error(`relay-consumer: stopped for good${event.causeKind ? ` (${event.causeKind})` : ''}: ${cause}`);
    }
    try {
      this.options.onError?.(event);
    } catch (hook) {
      this.logger.error(`relay-consumer: the onError hook threw: ${describeError(hook)}`);
    }
    this.emit('error', error);
  }

  // -- deliveries ------------------------------------------------------------------------------

  private onDelivery(session: Session, delivery: Delivery | null): void {
    if (delivery === null) {
      session.end(new Error(`the broker cancelled the consumer of ${this.options.queue}`));
      return;
    }
    this.counts.deliveries += 1;
    // After the end a delivery is not taken: it goes back to the queue with the channel.
    if (session.over) return;
    session.inbox.push(delivery);
    this.kick(session);
  }

  private kick(session: Session): void {
    if (session.pumpRun || session.over) return;
    // Begun in the next turn: the deliveries of one read from the socket make one batch.
    session.pumpRun = new Promise<void>((resolve) => setImmediate(resolve))
      .then(() => this.pump(session))
      .catch((error: unknown) => session.end(asError(error)))
      .finally(() => {
        session.pumpRun = undefined;
        if (session.inbox.length > 0 && !session.over) this.kick(session);
      });
  }

  private async pump(session: Session): Promise<void> {
    while (session.inbox.length > 0 && !session.over) {
      const deliveries = session.inbox.splice(0, this.options.batchMax);
      session.inBatch = deliveries.length;
      try {
        await this.batch(session, deliveries);
      } finally {
        session.inBatch = 0;
      }
    }
  }

  /** One batch: decided, written in one store transaction, then acknowledged. */
  private async batch(session: Session, deliveries: Delivery[]): Promise<void> {
    this.counts.batches += 1;
    const apply: Change[] = [];
    const late: StoryMessage[] = [];
    const held = new Map<string, Change>();
    const settled: Delivery[] = [];
    const released: Delivery[] = [];
    let refusedStop: RefusedMessage | undefined;
    const ended = (changes: Change[]) => {
      for (const change of changes) {
        held.delete(messageId(change));
        if ('kind' in change && change.operation === 'notified') late.push(change);
      }
    };
    for (const delivery of deliveries) {
      let change: Change;
      try {
        change = decodeChange(delivery.content);
        if (this.options.tenantId !== undefined && change.tenant_id !== this.options.tenantId) {
          throw new RefusedMessage('other_tenant', `change ${messageId(change)} is tenant ${change.tenant_id}'s, not ${this.options.tenantId}'s`, 1, messageId(change));
        }
      } catch (error) {
        if (!(error instanceof RefusedMessage)) throw error;
        this.counts.refused += 1;
        this.emit('refused', error, delivery);
        if (this.options.onRefused === 'reject') {
          this.logger.error(`relay-consumer: refused a delivery, rejected to the dead-letter queue: ${error.message}`);
          safely(() => session.channel?.nack(delivery, false, false));
          continue;
        }
        this.logger.error(`relay-consumer: refused a delivery; stopping (it stays in the queue): ${error.message}`);
        refusedStop = error;
        break;
      }
      const verdict = this.follower.receive(change);
      if (verdict.outcome !== 'overflow') ended(verdict.stale);
      switch (verdict.outcome) {
        case 'apply':
          for (const c of verdict.apply) held.delete(messageId(c));
          apply.push(...verdict.apply);
          settled.push(delivery);
          break;
        case 'held':
          held.set(messageId(change), change);
          settled.push(delivery);
          break;
        case 'duplicate':
          settled.push(delivery);
          break;
        case 'stale':
          ended([change]);
          settled.push(delivery);
          break;
        case 'overflow':
          if (await this.overflowCovered(change, verdict.gap)) {
            this.counts.overflowDropped += 1;
            settled.push(delivery);
          } else {
            released.push(delivery);
          }
          break;
      }
    }
    if (apply.length > 0 || late.length > 0 || held.size > 0) await this.commit(apply, late, [...held.values()]);
    for (const delivery of settled) safely(() => session.channel?.ack(delivery));
    for (const delivery of released) this.release(session, delivery);
    if (this.notificationsOwed) await this.handNotifications();
    if (refusedStop) {
      // Everything after the refused message (it included) stays unacknowledged: the broker
      // puts it back as the channel closes.
      session.end(refusedStop);
    }
  }

  private async commit(apply: Change[], late: StoryMessage[], held: Change[]): Promise<void> {
    const outcome: ApplyOutcome = await this.options.store.apply(apply, late, held);
    const now = Date.now();
    this.counts.commits += 1;
    this.lastCommitAt = now;
    this.counts.lateNotifications += late.length;
    this.counts.skipped += outcome.skipped;
    this.counts.declined += outcome.declined;
    this.counts.notificationsRecorded += outcome.notifications;
    this.counts.repeatedNotifications += outcome.repeatedNotifications;
    const last = new Map<string, string>();
    for (const change of apply) last.set(change.webhook_endpoint_id, change.changed_at);
    for (const [endpoint, changedAt] of last) {
      const at = Date.parse(changedAt);
      if (!Number.isNaN(at)) this.changedAt.set(endpoint, at);
    }
    if (outcome.notifications > 0) this.notificationsOwed = true;
    if (apply.length > 0) this.emit('applied', outcome, apply);
  }

  /**
   * Hands the notifications recorded and not handed yet. Your handler's throw leaves them
   * pending (handed after the next batch, or at the next session) and is reported; a failure of
   * the store ends the session.
   */
  private async handNotifications(): Promise<void> {
    this.notificationsOwed = false;
    try {
      this.counts.notificationsHanded += await this.options.store.handPending();
    } catch (error) {
      this.notificationsOwed = true;
      if (!(error instanceof HandlerError)) throw error;
      this.report(error, true);
    }
  }

  /** Gives a change back to the queue (nack with requeue) after a short delay: it comes again. */
  private release(session: Session, delivery: Delivery): void {
    this.counts.released += 1;
    const timer = setTimeout(() => {
      session.releaseTimers.delete(timer);
      if (!session.over) safely(() => session.channel?.nack(delivery, false, true));
    }, this.options.releaseDelayMs);
    session.releaseTimers.add(timer);
  }

  // -- gaps ------------------------------------------------------------------------------------

  /**
   * A change past the hold bounds: acknowledged (dropped) when a replay asked of the relay
   * sends it again, given back to the queue otherwise.
   */
  private async overflowCovered(change: Change, gap: Gap): Promise<boolean> {
    if (!this.options.api || !this.options.replayGaps) return false;
    const covers = (answer: ReplayAnswer) =>
      answer.epoch === change.epoch && answer.from_change_seq <= change.change_seq && change.change_seq <= answer.through_change_seq;
    const recent = this.replayed.get(gap.endpoint);
    if (recent && Date.now() - recent.at < this.options.gapTimeoutMs && recent.answer.from_change_seq <= gap.from && covers(recent.answer)) return true;
    const answer = await this.replay(gap);
    return answer !== undefined && covers(answer);
  }

  private async checkGaps(): Promise<void> {
    const now = Date.now();
    for (const gap of this.follower.gaps(this.options.gapTimeoutMs)) {
      const last = this.gapReported.get(gap.endpoint) ?? 0;
      if (now - last < this.options.gapTimeoutMs) continue;
      this.gapReported.set(gap.endpoint, now);
      this.counts.gapsReported += 1;
      const gapReport = report(gap);
      this.logger.warn(`relay-consumer: endpoint ${gap.endpoint} epoch ${gap.epoch}: change_seqs ${gap.from}-${gap.to} have not come (${gap.held} held, ${((now - gap.since) / 1000).toFixed(1)} s)`);
      this.emit('gap', gapReport);
      if (this.options.api && this.options.replayGaps) await this.replay(gap);
    }
  }

  private async replay(gap: Gap): Promise<ReplayAnswer | undefined> {
    const api = this.options.api!;
    this.counts.replaysAsked += 1;
    try {
      const answer = await api.replay(gap.endpoint, gap.from);
      this.replayed.set(gap.endpoint, { answer, at: Date.now() });
      this.logger.info(`relay-consumer: replay asked: endpoint ${gap.endpoint} epoch ${answer.epoch} changes ${answer.from_change_seq}-${answer.through_change_seq}`);
      this.emit('replay', { endpoint: gap.endpoint, from: gap.from, answer });
      return answer;
    } catch (error) {
      this.logger.warn(`relay-consumer: replay of endpoint ${gap.endpoint} from ${gap.from} failed: ${describeError(error)}`);
      this.emit('replay', { endpoint: gap.endpoint, from: gap.from, error });
      return undefined;
    }
  }
}

function report(gap: Gap): GapReport {
  const missing: number[] = [];
  for (let seq = gap.from; seq <= gap.to && missing.length < 10_000; seq++) missing.push(seq);
  return { ...gap, missing };
}

function asError(error: unknown): Error {
  return error instanceof Error ? error : new Error(String(error));
}

/** An acknowledgement on a channel that closed meanwhile throws: the delivery comes again. */
function safely(act: () => void): void {
  try {
    act();
  } catch {
    // the channel is gone: what it did not acknowledge is redelivered
  }
}

/** A broker RPC that does not answer in time is a broker not answering (a transient failure). */
function timed<T>(promise: Promise<T>, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`the broker did not answer in ${RPC_TIMEOUT_MS / 1000} s (${what})`)), RPC_TIMEOUT_MS);
  });
  return Promise.race([promise, late]).finally(() => clearTimeout(timer));
}
