// End to end, the lifecycle of clients/README.md against a real relay (`relay demo
// --external-consumer`, RELAY_BIN), through the installed package: the `relay-consumer` command
// and '@relay/consumer' imported as a user does (see support/installed.ts), the store in a
// private Postgres server of the test's own (support/pgserver.ts), so that restarting it touches
// nothing else.
//
// - Permanent failures end it within seconds: a wrong broker password (the library's `done`
//   rejects with PermanentError(broker_auth); the command exits 2 naming it), a store database
//   that does not exist (store_missing), a wrong store password (store_auth).
// - One store, consumed in turn by four processes while the relay's workload runs:
//   1. `relay-consumer run` (with --metrics-addr): its broker connection is closed through
//      RabbitMQ's management API (320 CONNECTION_FORCED): it says why, reconnects and carries
//      on (/metrics, /healthz); SIGTERM, exit 0;
//   2. `relay-consumer run --batch-max 5` on a backlog made meanwhile (the workload, a resync's
//      snapshot), SIGTERM as soon as it receives it: it finishes the batch in hand and exits 0,
//      every notification it recorded handed;
//   3. `relay-consumer run` again, from where the second stopped; SIGTERM, exit 0;
//   4. the library in a process of its own (support/runner.ts, each notification written to an
//      outbox in the hand-over's transaction): the store's database is restarted under it
//      (`pg_ctl restart -m fast`): it reports the failures, reconnects and carries on; SIGTERM
//      once it has caught up with every endpoint, exit 0.
//   The store then equals the relay's copies read through the API, each notification the relay
//   sent was handed exactly once over the four processes (printed by the command, or written
//   to the outbox), and `relay-consumer verify` exits 0; after one row of the store is changed,
//   it exits 1 naming it.
//
// RELAY_CONSUMER_E2E_LIFECYCLE_SEED (default 57) seeds the demo; RELAY_CONSUMER_E2E_KEEP_LOGS=1
// keeps the logs of a passing run.

import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { PermanentError, PgStore, RelayApi, RelayConsumer } from '@relay/consumer';
import { caughtUp, compareWithRelay, withClient } from './support/compare';
import { Credentials, Demo, Started, Verdict } from './support/demo';
import { checkInstalled, command } from './support/installed';
import { closeConnection, connections, queueDepth } from './support/management';
import { freePort, PASSWORD, PASSWORD_ROLE, PrivatePostgres } from './support/pgserver';
import { Child, sleep, start, tail, until } from './support/processes';

const RELAY_BIN = process.env.RELAY_BIN;
const SEED = Number(process.env.RELAY_CONSUMER_E2E_LIFECYCLE_SEED ?? 57);
const DURATION_S = 24;
const TAG = `[lifecycle seed ${SEED}]`;

interface Line {
  event?: string;
  [key: string]: unknown;
}

/** A `relay-consumer` process: its stdout's JSON lines kept, its stderr in the log. */
interface Command {
  child: Child;
  lines: Line[];
  log: string;
  metricsPort?: number;
}

/** A log as written so far ('' before its first line). */
function text(path: string): string {
  return existsSync(path) ? readFileSync(path, 'utf8') : '';
}

function parseMetrics(text: string): Map<string, number> {
  const out = new Map<string, number>();
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const at = line.lastIndexOf(' ');
    out.set(line.slice(0, at), Number(line.slice(at + 1)));
  }
  return out;
}

describe(`the lifecycle against a real relay ${TAG}`, { skip: RELAY_BIN ? false : 'RELAY_BIN is not set' }, () => {
  const logDir = mkdtempSync(join(tmpdir(), `relay-ts-e2e-lifecycle-${SEED}-`));
  const children = new Set<Child>();
  let pg: PrivatePostgres;
  let demo: Demo | undefined;
  let started: Started;
  let credentials: Credentials;
  let api: RelayApi;
  let failed = false;
  let runs = 0;

  function env(extra: Record<string, string> = {}): NodeJS.ProcessEnv {
    const out: NodeJS.ProcessEnv = { ...process.env, ...extra };
    delete out.NODE_TEST_CONTEXT;
    return out;
  }

  /** Starts `relay-consumer <args>`; stdout's JSON lines are kept. */
  function relayConsumer(args: string[], environment: NodeJS.ProcessEnv, name: string): Command {
    const { file, args: pre } = command();
    const log = join(logDir, `${name}.log`);
    const lines: Line[] = [];
    const child = start(file, [...pre, ...args], log, {
      env: environment,
      onLine: (line) => {
        try {
          lines.push(JSON.parse(line) as Line);
        } catch {
          lines.push({ text: line });
        }
      },
    });
    children.add(child);
    void child.exited.then(() => children.delete(child));
    return { child, lines, log };
  }

  function consumerEnv(database: string): NodeJS.ProcessEnv {
    return env({
      RELAY_AMQP_URL: credentials.tenant_amqp_url,
      RELAY_QUEUE: credentials.queue,
      RELAY_STORE_DSN: database,
      RELAY_API_URL: started.api_base_url,
      RELAY_API_TOKEN: credentials.tenant_token,
    });
  }

  function wrongPassword(url: string): string {
    const u = new URL(url);
    u.password = 'not-the-password';
    return u.toString();
  }

  async function metricsOf(c: Command): Promise<Map<string, number>> {
    const answer = await fetch(`http://127.0.0.1:${c.metricsPort}/metrics`, { signal: AbortSignal.timeout(3_000) });
    return parseMetrics(await answer.text());
  }

  async function healthOf(c: Command): Promise<{ code: number; status: string; connected: boolean }> {
    const answer = await fetch(`http://127.0.0.1:${c.metricsPort}/healthz`, { signal: AbortSignal.timeout(3_000) });
    const body = (await answer.json()) as { status: string; connected: boolean };
    return { code: answer.status, ...body };
  }

  before(async () => {
    console.log(`${TAG} ${checkInstalled()}; logs in ${logDir}`);
    pg = new PrivatePostgres();
    await pg.start();
    console.log(`${TAG} a private Postgres on port ${pg.port} (${pg.root})`);
    demo = new Demo({ relayBin: RELAY_BIN!, seed: SEED, durationS: DURATION_S, logDir });
    started = await demo.event<Started>('started', 180_000);
    credentials = await demo.event<Credentials>('credentials', 10_000);
    api = new RelayApi(started.api_base_url, credentials.tenant_token);
  });

  after(async () => {
    for (const child of children) await child.stop('SIGKILL');
    if (demo && !demo.child.done) {
      const code = await demo.stop();
      if (code !== 0) console.log(`${TAG} the demo exited ${code}; its log ends:\n${tail(demo.logPath)}`);
    }
    pg?.stop();
    if (failed || process.env.RELAY_CONSUMER_E2E_KEEP_LOGS) console.log(`${TAG} logs kept in ${logDir}`);
    else rmSync(logDir, { recursive: true, force: true });
  });

  test(`permanent failures end it within seconds, naming the cause ${TAG}`, { timeout: 120_000 }, async () => {
    try {
      const database = await pg.createDatabase('relay_ts_permanent');
      // The library: a wrong broker password.
      const store = new PgStore({ connection: database });
      const causes: string[] = [];
      const consumer = new RelayConsumer({
        amqpUrl: wrongPassword(credentials.tenant_amqp_url), queue: credentials.queue, store,
        onError: (e) => causes.push(`${e.transient ? 'transient' : 'permanent'} ${e.causeKind ?? ''}`),
      });
      const t0 = Date.now();
      await consumer.start().catch(() => {});
      await assert.rejects(consumer.done, (error: Error) => error instanceof PermanentError && error.causeKind === 'broker_auth' && /ACCESS_REFUSED/.test(error.message));
      const took = Date.now() - t0;
      console.log(`${TAG} the library with a wrong broker password: done rejected with PermanentError(broker_auth) after ${took} ms`);
      assert.ok(took < 10_000, `${TAG} within seconds (${took} ms)`);
      assert.deepEqual(causes, ['permanent broker_auth']);
      assert.equal(consumer.health().status, 'failed');
      assert.equal(store.pool.ending, true, `${TAG} the store was closed`);

      // The command: the broker, a missing database, a wrong store password.
      const cases: [string, NodeJS.ProcessEnv, string][] = [
        ['a wrong broker password', { ...consumerEnv(database), RELAY_AMQP_URL: wrongPassword(credentials.tenant_amqp_url) }, 'broker_auth'],
        ['a store database that does not exist', consumerEnv(pg.dsn('relay_ts_no_such_database')), 'store_missing'],
        ['a wrong store password', consumerEnv(pg.dsn('relay_ts_permanent', PASSWORD_ROLE, 'wrong')), 'store_auth'],
      ];
      for (const [what, environment, cause] of cases) {
        const t1 = Date.now();
        const c = relayConsumer(['run'], environment, `permanent-${cause}`);
        const code = await c.child.exited;
        const ms = Date.now() - t1;
        const log = readFileSync(c.log, 'utf8');
        console.log(`${TAG} relay-consumer run with ${what}: exit ${code} after ${ms} ms: ${log.split('\n').filter((l) => l.startsWith('relay-consumer:')).join(' ')}`);
        assert.equal(code, 2, `${TAG} ${what}: exit 2; its log:\n${log}`);
        assert.match(log, new RegExp(`^relay-consumer: permanent failure \\(${cause}\\): `, 'm'), `${TAG} ${what}`);
        assert.ok(ms < 10_000, `${TAG} ${what}: within seconds (${ms} ms)`);
        assert.equal(c.lines.find((l) => l.event === 'exited')?.code, 2);
      }
      // The right password is let in (the refusal above was the password's).
      const right = await PgStore.open(pg.dsn('relay_ts_permanent', PASSWORD_ROLE, PASSWORD));
      await right.close();
    } catch (error) {
      failed = true;
      throw error;
    }
  });

  test(`a management-API close, SIGTERMs mid-batch and a database restart: the store equals the relay's copies, each notification handed once ${TAG}`, { timeout: (DURATION_S + 300) * 1000 }, async () => {
    try {
      await scenario();
    } catch (error) {
      failed = true;
      throw error;
    }
  });

  async function scenario(): Promise<void> {
    const database = await pg.createDatabase('relay_ts_lifecycle');
    const feedEndpoints = started.webhook_endpoint_ids;
    const storiesEndpoint = started.stories_endpoint_id;
    const all = [...feedEndpoints, storiesEndpoint];
    const t0 = Date.now();
    const at = (s: number) => sleep(Math.max(0, t0 + s * 1000 - Date.now()));
    const since = () => `${((Date.now() - t0) / 1000).toFixed(1)} s`;
    const commands: Command[] = [];

    // 1. The command, batches of 5, its metrics served.
    const port = await freePort();
    const first: Command = relayConsumer(['run', '--metrics-addr', `127.0.0.1:${port}`, '--batch-max', '5'], consumerEnv(database), 'run-1');
    first.metricsPort = port;
    commands.push(first);
    runs += 1;
    await until('the first run consuming', 30_000, async () => {
      if (first.child.done) throw new Error(`the first run exited; its log:\n${tail(first.log)}`);
      return (await healthOf(first).catch(() => undefined))?.status === 'ok' ? true : undefined;
    }, 200);
    console.log(`${TAG} ${since()}: relay-consumer run (pid ${first.child.process.pid}) consuming`);

    // (a) Its connection closed through the management API.
    await at(3);
    const name = `relay-consumer (typescript) pid ${first.child.process.pid}`;
    const connection = await until(`the first run's connection listed by the management API`, 30_000, async () =>
      (await connections()).find((c) => c.client_properties?.connection_name === name), 250);
    await closeConnection(connection.name, 'relay-ts-e2e: closed mid-run');
    console.log(`${TAG} ${since()}: closed its connection ${connection.name} through the management API`);
    const warned = await until('the close reported, with its reason', 15_000, () =>
      text(first.log).split('\n').find((l) => l.includes('WARN') && l.includes('320 (CONNECTION-FORCED)')), 100);
    assert.match(warned, /CONNECTION_FORCED - relay-ts-e2e: closed mid-run"; reconnecting in \d+\.\d s$/, `${TAG} one line, the close code and text, the wait`);
    await until('it reconnecting', 30_000, async () => {
      const [m, h] = [await metricsOf(first), await healthOf(first)];
      return m.get('relay_consumer_reconnects_total')! >= 1 && h.status === 'ok' && h.code === 200 && m.get('relay_consumer_up') === 1 ? true : undefined;
    }, 200);
    assert.equal(first.child.done, false, `${TAG} the first run carried on`);
    const errors = await metricsOf(first);
    console.log(`${TAG} ${since()}: reported "${warned.slice(warned.indexOf('WARN'))}", reconnected (relay_consumer_reconnects_total ${errors.get('relay_consumer_reconnects_total')}, errors ${errors.get('relay_consumer_errors_total{kind="transient"}')} transient)`);

    await at(6);
    first.child.process.kill('SIGTERM');
    assert.equal(await first.child.exited, 0, `${TAG} the first run's exit on SIGTERM; its log:\n${tail(first.log)}`);
    assert.equal(first.lines.find((l) => l.event === 'exited')?.code, 0);
    console.log(`${TAG} ${since()}: the first run stopped (exit 0)`);

    // (d) SIGTERM mid-batch: a backlog made while nothing consumes (the workload, and a resync's
    // snapshot), taken by a run with batches of 5 and stopped as soon as it receives it: it
    // finishes the batch in hand and exits 0, every notification it recorded handed.
    const resynced = feedEndpoints[0]!;
    await api.resync(resynced);
    const backlog = await until('a backlog of 40 messages or more', 30_000, async () => {
      const depth = (await queueDepth(credentials.tenant_amqp_url, credentials.queue)) ?? 0;
      return depth >= 40 ? depth : undefined;
    }, 200);
    console.log(`${TAG} ${since()}: ${backlog} messages in the queue`);
    const secondPort = await freePort();
    const second: Command = relayConsumer(['run', '--metrics-addr', `127.0.0.1:${secondPort}`, '--batch-max', '5'], consumerEnv(database), 'run-2');
    second.metricsPort = secondPort;
    commands.push(second);
    runs += 1;
    await until('the second run receiving the backlog', 30_000, async () => {
      if (second.child.done) throw new Error(`the second run exited; its log:\n${tail(second.log)}`);
      const m = await metricsOf(second).catch(() => undefined);
      return (m?.get('relay_consumer_deliveries_total') ?? 0) > 0 ? true : undefined;
    }, 10);
    second.child.process.kill('SIGTERM');
    const secondCode = await second.child.exited;
    const stopping = readFileSync(second.log, 'utf8').split('\n').find((l) => l.includes('relay-consumer: stopping'));
    console.log(`${TAG} ${since()}: SIGTERM as the backlog (the snapshot of ${resynced} in it) arrived: exit ${secondCode}; "${stopping?.slice(stopping.indexOf('INFO'))}"`);
    assert.equal(secondCode, 0, `${TAG} the second run's exit on SIGTERM; its log:\n${tail(second.log)}`);
    assert.match(stopping ?? '', /stopping \(finishing the batch in hand, [1-5] deliveries; \d+ not taken go back to the queue\)/, `${TAG} SIGTERM came mid-batch`);
    assert.equal(second.lines.find((l) => l.event === 'exited')?.code, 0);
    const unhanded = await withClient(database, async (c) => Number((await c.query('SELECT count(*) AS n FROM relay_notifications WHERE handed_at IS NULL')).rows[0].n));
    assert.equal(unhanded, 0, `${TAG} every notification the second run recorded was handed before it exited`);

    // The command again, from where the second stopped; SIGTERM.
    const third = relayConsumer(['run'], consumerEnv(database), 'run-3');
    commands.push(third);
    runs += 1;
    await until('the third run consuming', 30_000, () => {
      if (third.child.done) throw new Error(`the third run exited; its log:\n${tail(third.log)}`);
      return text(third.log).includes('relay-consumer: consuming') ? true : undefined;
    }, 50);
    await sleep(2_000);
    third.child.process.kill('SIGTERM');
    assert.equal(await third.child.exited, 0, `${TAG} the third run's exit on SIGTERM; its log:\n${tail(third.log)}`);
    console.log(`${TAG} ${since()}: the third run stopped (exit 0): ${JSON.stringify((third.lines.find((l) => l.event === 'exited')?.stats as Record<string, unknown> | undefined)?.deliveries)} deliveries`);

    // 3. The library in a process of its own; the store's database restarted under it.
    const runnerLog = join(logDir, 'runner.log');
    const handedLog = join(logDir, 'handed.log');
    const runnerLines: Line[] = [];
    const runner = start(process.execPath, [join(__dirname, 'support', 'runner.js')], runnerLog, {
      env: { ...consumerEnv(database), RUNNER_HANDED_LOG: handedLog },
      onLine: (line) => {
        try {
          runnerLines.push(JSON.parse(line) as Line);
        } catch {
          // not ours
        }
      },
    });
    children.add(runner);
    runs += 1;
    await until('the library consuming', 30_000, () => {
      if (runner.done) throw new Error(`the runner exited; its log:\n${tail(runnerLog)}`);
      return runnerLines.some((l) => l.event === 'consuming') ? true : undefined;
    }, 100);
    await sleep(2_000);
    const positionsBefore = await withClient(database, async (c) => Number((await c.query('SELECT coalesce(sum(last_change_seq), 0) AS n FROM relay_positions')).rows[0].n));
    pg.restart();
    console.log(`${TAG} ${since()}: restarted the store's database (pg_ctl restart -m fast)`);
    await until('the restart reported', 20_000, () => (runnerLines.some((l) => l.event === 'error') ? true : undefined), 100);
    const reported = runnerLines.filter((l) => l.event === 'error');
    assert.ok(reported.every((l) => l.transient === true), `${TAG} transient: ${JSON.stringify(reported)}`);
    console.log(`${TAG} the library reported: ${reported.map((l) => `${l.cause} (again in ${l.retry_in_ms} ms)`).join('; ')}`);
    await until('the library carrying on after the restart', 30_000, async () => {
      if (runner.done) throw new Error(`the runner exited; its log:\n${tail(runnerLog)}`);
      const n = await withClient(database, async (c) => Number((await c.query('SELECT coalesce(sum(last_change_seq), 0) AS n FROM relay_positions')).rows[0].n)).catch(() => positionsBefore);
      return n > positionsBefore ? true : undefined;
    }, 250);

    const verdict = await demo!.event<Verdict>('verdict', (DURATION_S + 240) * 1000);
    console.log(`${TAG} ${since()}: verdict ok ${verdict.ok}, feed changes ${verdict.feed_changes}, story changes ${verdict.story_changes}`);
    assert.equal(verdict.ok, true, `${TAG} the demo's verdict: ${JSON.stringify(verdict)}`);
    let lagging: string[] = [];
    try {
      await until('the library catching up', 120_000, async () => {
        if (runner.done) throw new Error('the runner exited');
        const state = await caughtUp(database, api, all);
        lagging = state.lagging;
        return state.done ? true : undefined;
      }, 500);
    } catch (error) {
      throw new Error(`${TAG} ${(error as Error).message}: ${lagging.join('; ')}; the runner's log ends:\n${tail(runnerLog)}`);
    }
    const stopAt = Date.now();
    const runnerCode = await runner.stop('SIGTERM', 30_000);
    const stopMs = Date.now() - stopAt;
    assert.equal(runnerCode, 0, `${TAG} the library's exit on SIGTERM; its log:\n${tail(runnerLog)}`);
    // stop() closes the store too: nothing (a pool's idle connections, 10 s) keeps the process.
    assert.ok(stopMs < 5_000, `${TAG} the library's process exited ${stopMs} ms after SIGTERM`);
    const stats = runnerLines.find((l) => l.event === 'stopped')?.stats as Record<string, number> | undefined;
    console.log(`${TAG} ${since()}: caught up; the library stopped (exit 0, ${stopMs} ms after SIGTERM), ${stats?.reconnects} reconnects, ${stats?.errors} errors`);
    assert.ok((stats?.reconnects ?? 0) >= 1, `${TAG} the library reconnected after the restart`);

    // The store equals the relay's copies.
    const compared = await compareWithRelay(database, api, feedEndpoints, storiesEndpoint);
    console.log(`${TAG} compared: ${compared.items} items (${compared.raised} raised by the relay without a change), ${compared.stories} stories, ${compared.notifications} notifications`);
    assert.deepEqual(compared.problems, [], `${TAG} the store differs from the relay's copies`);
    assert.ok(compared.items > 0 && compared.stories > 0, `${TAG} the run had items and stories`);

    // Each notification the relay sent, handed exactly once over the three processes.
    const handed = new Map<string, string[]>();
    const note = (story: string, by: string) => handed.set(story, [...(handed.get(story) ?? []), by]);
    for (const [i, c] of commands.entries()) {
      for (const l of c.lines) if (l.event === 'notification' && l.endpoint === storiesEndpoint) note(String(l.story_id), `run ${i + 1}`);
    }
    const outbox = await withClient(database, async (c) => (await c.query<{ story_id: string }>(
      'SELECT story_id FROM e2e_outbox WHERE endpoint_id = $1', [storiesEndpoint])).rows);
    for (const r of outbox) note(r.story_id, 'the library');
    const twice = [...handed].filter(([, by]) => by.length > 1);
    assert.deepEqual(twice, [], `${TAG} notifications handed more than once`);
    const claimed = (await api.notifications(storiesEndpoint)).filter((n) => n.notified).map((n) => n.story_id).sort();
    assert.deepEqual([...handed.keys()].sort(), claimed, `${TAG} the notifications handed are those the relay sent`);
    const by = (who: string) => [...handed.values()].filter((b) => b[0] === who).length;
    console.log(`${TAG} notifications: ${handed.size} handed once each (${commands.map((_, i) => `run ${i + 1}: ${by(`run ${i + 1}`)}`).join(', ')}, the library: ${by('the library')})`);

    // (e) verify: equal; then one row changed, and it says so.
    const verify = relayConsumer(['verify'], consumerEnv(database), 'verify-1');
    const equal = await verify.child.exited;
    const lines = verify.lines.map((l) => String(l.text ?? JSON.stringify(l)));
    console.log(`${TAG} relay-consumer verify: exit ${equal}\n  ${lines.join('\n  ')}`);
    assert.equal(equal, 0, `${TAG} verify at the end; its output:\n${lines.join('\n')}\n${tail(verify.log)}`);
    assert.equal(lines.length, all.length);
    assert.ok(lines.every((l) => / equal \(/.test(l)));
    const changed = await withClient(database, async (c) => (await c.query<{ endpoint_id: string; subject: string }>(
      `UPDATE relay_items SET item = jsonb_set(item, '{corrupted}', 'true')
       WHERE (endpoint_id, subject) = (SELECT endpoint_id, subject FROM relay_items WHERE NOT tombstone ORDER BY endpoint_id, subject LIMIT 1)
       RETURNING endpoint_id, subject`)).rows[0]!);
    const again = relayConsumer(['verify'], consumerEnv(database), 'verify-2');
    const differs = await again.child.exited;
    const after = again.lines.map((l) => String(l.text ?? JSON.stringify(l)));
    console.log(`${TAG} changed the item ${changed.subject} of ${changed.endpoint_id}; relay-consumer verify: exit ${differs}\n  ${after.join('\n  ')}`);
    assert.equal(differs, 1, `${TAG} verify after a row was changed`);
    assert.ok(after.some((l) => l === `${changed.endpoint_id} differs: items 1 different (${changed.subject}: item)`), `${TAG} the line names it:\n${after.join('\n')}`);
    assert.equal(after.filter((l) => / equal \(/.test(l)).length, all.length - 1);
  }
});
