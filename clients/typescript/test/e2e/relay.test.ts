// End to end against a real relay: `relay demo --external-consumer` (RELAY_BIN) runs every tier
// and the simulated upstream's feed and stories workloads with every fault, and leaves the
// tenant's queue to us. Everything imports '@relay/consumer' as a user does: run by ci.sh, the
// package installed from its tarball (support/installed.ts). The library's consumer and Postgres
// store run as a child process
// (support/runner.ts) on a database made for the test, killed with SIGKILL and started again at
// seeded random moments; a scrambler (a second consumer on the queue) takes deliveries and
// gives them back in shuffled order after short delays; a feed endpoint and the stories
// endpoint are resynced mid-run (new epochs opened by snapshots), and the relay's database is
// restored from a backup taken earlier in the run (the demo stops every tier, restores, starts
// them again and rewinds: new epochs the consumer did not ask for, and a relay that does not
// answer for a few seconds). Once the demo's verdict says
// the relay's copies equal the simulator's truth, the consumer drains to each endpoint's last
// change, and then the store's tables must equal the copies read through the API, and every
// notification the relay sent must have been handed to the callback exactly once across all the
// kills. Then the examples of examples/ run against the same relay.
//
// RELAY_BIN (the relay binary; skipped without), RELAY_TEST_PG (the Postgres server,
// default postgres://postgres@127.0.0.1:5432/postgres), RELAY_CONSUMER_E2E_SEED (default 4141),
// RELAY_CONSUMER_E2E_DURATION_S (the upstream's changing time, default 20),
// RELAY_CONSUMER_E2E_KILLS (default 5), RELAY_CONSUMER_E2E_KEEP_LOGS=1 keeps the logs' folder
// on success too.

import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { RelayApi, RelayApiError } from '@relay/consumer';
import { rng } from '../support/rng';
import { caughtUp, compareWithRelay, relayStreams, storePositions, withClient } from './support/compare';
import { Credentials, Demo, Restored, Started, Verdict } from './support/demo';
import { checkInstalled } from './support/installed';
import { Child, sleep, start, tail, until } from './support/processes';
import { Scrambler } from './support/scrambler';

const RELAY_BIN = process.env.RELAY_BIN;
const PG = process.env.RELAY_TEST_PG ?? 'postgres://postgres@127.0.0.1:5432/postgres';
const SEED = Number(process.env.RELAY_CONSUMER_E2E_SEED ?? 4141);
const DURATION_S = Number(process.env.RELAY_CONSUMER_E2E_DURATION_S ?? 20);
const KILLS = Number(process.env.RELAY_CONSUMER_E2E_KILLS ?? 5);
const TAG = `[seed ${SEED}]`;

function databaseUrl(name: string): string {
  const url = new URL(PG);
  url.pathname = `/${name}`;
  return url.toString();
}

/** The relay's RabbitMQ management API (guest, as on this machine): how many messages a queue holds. */
async function queueDepth(amqpUrl: string, queue: string): Promise<number | undefined> {
  const vhost = decodeURIComponent(new URL(amqpUrl).pathname.slice(1)) || '/';
  const management = process.env.RELAY_AMQP_MANAGEMENT_URL ?? 'http://127.0.0.1:15672';
  const user = process.env.RELAY_AMQP_MANAGEMENT_USER ?? 'guest';
  const password = process.env.RELAY_AMQP_MANAGEMENT_PASSWORD ?? 'guest';
  const answer = await fetch(`${management.replace(/\/+$/, '')}/api/queues/${encodeURIComponent(vhost)}/${encodeURIComponent(queue)}`, {
    headers: { authorization: `Basic ${Buffer.from(`${user}:${password}`).toString('base64')}` },
    signal: AbortSignal.timeout(5_000),
  });
  if (!answer.ok) return undefined;
  const body = (await answer.json()) as { messages?: number };
  return body.messages;
}

/**
 * POST resync, asked again while the endpoint's last snapshot is still being sent (409) or the
 * relay does not answer (its tiers are stopped for the restore).
 */
async function resync(api: RelayApi, endpoint: string): Promise<number> {
  const deadline = Date.now() + 60_000;
  for (;;) {
    try {
      return (await api.resync(endpoint)).epoch;
    } catch (error) {
      const again = error instanceof RelayApiError ? error.status === 409 : true;
      if (!again || Date.now() > deadline) throw error;
      await sleep(500);
    }
  }
}

describe(`the consumer against a real relay ${TAG}`, { skip: RELAY_BIN ? false : 'RELAY_BIN is not set' }, () => {
  const random = rng(SEED);
  const logDir = mkdtempSync(join(tmpdir(), `relay-ts-e2e-${SEED}-`));
  const databases: string[] = [];
  let demo: Demo | undefined;
  let started: Started;
  let credentials: Credentials;
  let api: RelayApi;
  let demoExit: number | string | undefined;
  let failed = false;
  const children = new Set<Child>();

  async function freshDatabase(): Promise<string> {
    const name = `relay_ts_e2e_${randomBytes(5).toString('hex')}`;
    await withClient(PG, (c) => c.query(`CREATE DATABASE ${name}`));
    databases.push(name);
    return databaseUrl(name);
  }

  /** The environment of the consumer, the examples and the command (clients/README.md's names). */
  function consumerEnv(database: string): NodeJS.ProcessEnv {
    const env = { ...process.env };
    // A node child of the test runner with this set takes itself for a test file.
    delete env.NODE_TEST_CONTEXT;
    return {
      ...env,
      RELAY_STORE_DSN: database,
      RELAY_AMQP_URL: credentials.tenant_amqp_url,
      RELAY_QUEUE: credentials.queue,
      RELAY_API_URL: started.api_base_url,
      RELAY_API_TOKEN: credentials.tenant_token,
    };
  }

  before(async () => {
    console.log(`${TAG} end-to-end run: RELAY_CONSUMER_E2E_SEED=${SEED} RELAY_CONSUMER_E2E_DURATION_S=${DURATION_S} RELAY_CONSUMER_E2E_KILLS=${KILLS}; logs in ${logDir}`);
    console.log(`${TAG} ${checkInstalled()}`);
    // The backup early, the restore late: the resyncs in between are lost with the database
    // (the restore's epochs come after theirs), and one asked while it runs waits for it.
    const backupAtS = Math.max(1, Math.round((0.1 + random() * 0.15) * DURATION_S));
    const restoreAtS = Math.min(DURATION_S, Math.max(backupAtS + 1, Math.round((0.6 + random() * 0.2) * DURATION_S)));
    console.log(`${TAG} backup at ${backupAtS} s, restore at ${restoreAtS} s`);
    demo = new Demo({ relayBin: RELAY_BIN!, seed: SEED, durationS: DURATION_S, logDir, restore: { backupAtS, restoreAtS } });
    started = await demo.event<Started>('started', 180_000);
    credentials = await demo.event<Credentials>('credentials', 10_000);
    api = new RelayApi(started.api_base_url, credentials.tenant_token);
  });

  after(async () => {
    for (const child of children) await child.stop('SIGKILL');
    if (demo && !demo.child.done) demoExit = await demo.stop();
    await withClient(PG, async (c) => {
      for (const name of databases) await c.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
    });
    if (failed || process.env.RELAY_CONSUMER_E2E_KEEP_LOGS) console.log(`${TAG} logs kept in ${logDir}`);
    else rmSync(logDir, { recursive: true, force: true });
  });

  test(`kills, scrambled redeliveries and resyncs: the store equals the relay's copies, each notification handed once ${TAG}`, { timeout: (DURATION_S + 400) * 1000 }, async () => {
    try {
      await scenario();
    } catch (error) {
      failed = true;
      throw error;
    }
  });

  async function scenario(): Promise<void> {
    const database = await freshDatabase();
    const handedLog = join(logDir, 'handed.log');
    writeFileSync(handedLog, '');
    const runnerLog = join(logDir, 'runner.log');
    const feedEndpoints = started.webhook_endpoint_ids;
    const storiesEndpoint = started.stories_endpoint_id;
    const all = [...feedEndpoints, storiesEndpoint];

    // The consumer's settings, drawn from the seed: small holds make it give changes back too.
    const prefetch = [50, 200, 500][Math.floor(random() * 3)]!;
    const runnerEnv = {
      ...consumerEnv(database),
      RUNNER_HANDED_LOG: handedLog,
      RUNNER_PREFETCH: String(prefetch),
      RUNNER_MAX_BATCH: String(1 + Math.floor(random() * 200)),
      RUNNER_MAX_HELD_PER_ENDPOINT: String(10 + Math.floor(random() * 100)),
      RUNNER_MAX_HELD_TOTAL: String(Math.max(2, Math.floor(prefetch * 0.8))),
      RUNNER_GAP_TIMEOUT_MS: '3000',
    };
    console.log(`${TAG} consumer settings: ${JSON.stringify(Object.fromEntries(Object.entries(runnerEnv).filter(([k]) => k.startsWith('RUNNER_'))))}`);

    let runner: Child | undefined;
    let unexpected: string | undefined;
    let runs = 0;
    const startRunner = () => {
      runs += 1;
      const child = start(process.execPath, [join(__dirname, 'support', 'runner.js')], runnerLog, { env: runnerEnv });
      children.add(child);
      child.exited.then((code) => {
        children.delete(child);
        if (runner === child && code !== 'SIGKILL' && code !== 0) unexpected ??= `the consumer (run ${runs}) exited with ${code}; its log ends:\n${tail(runnerLog)}`;
      });
      runner = child;
    };
    const checkRunner = () => assert.equal(unexpected, undefined, `${TAG} ${unexpected}`);
    startRunner();

    const scrambler = new Scrambler({ amqpUrl: credentials.tenant_amqp_url, queue: credentials.queue, random, prefetch: 20 + Math.floor(random() * 40) });
    await scrambler.start();

    // Kills at seeded moments over the upstream's changing and the relay's settling.
    const killTimes = Array.from({ length: KILLS }, () => 1_000 + random() * (DURATION_S + 4) * 1000).sort((a, b) => a - b);
    const feedResynced = feedEndpoints[Math.floor(random() * feedEndpoints.length)]!;
    const resyncTimes = [0.3, 0.55].map((f) => (f + random() * 0.2) * DURATION_S * 1000);
    console.log(`${TAG} kills at ${killTimes.map((t) => (t / 1000).toFixed(1)).join(', ')} s; resyncs of feed endpoint ${feedResynced} at ${(resyncTimes[0]! / 1000).toFixed(1)} s and of the stories endpoint at ${(resyncTimes[1]! / 1000).toFixed(1)} s`);
    const t0 = Date.now();
    let verdictSeen = false;
    let kills = 0;
    const chaos = (async () => {
      for (const at of killTimes) {
        await sleep(Math.max(0, t0 + at - Date.now()));
        if (verdictSeen || unexpected) return;
        const victim = runner!;
        victim.process.kill('SIGKILL');
        await victim.exited;
        kills += 1;
        await sleep(random() * 1_500);
        startRunner();
      }
    })();
    const resyncs: { endpoint: string; epoch: number }[] = [];
    const resyncing = (async () => {
      for (const [i, endpoint] of [feedResynced, storiesEndpoint].entries()) {
        await sleep(Math.max(0, t0 + resyncTimes[i]! - Date.now()));
        resyncs.push({ endpoint, epoch: await resync(api, endpoint) });
      }
    })();

    const verdict = await demo!.event<Verdict>('verdict', (DURATION_S + 300) * 1000);
    verdictSeen = true;
    await Promise.all([chaos, resyncing]);
    checkRunner();
    console.log(`${TAG} verdict after ${((Date.now() - t0) / 1000).toFixed(1)} s: ok ${verdict.ok}, feed changes ${verdict.feed_changes}, story changes ${verdict.story_changes}, settled in ${verdict.settled_in_s} s; resyncs ${JSON.stringify(resyncs)}`);
    assert.equal(verdict.ok, true, `${TAG} the demo's verdict is not ok: ${JSON.stringify(verdict)}`);
    assert.equal(resyncs.length, 2, `${TAG} both resyncs were asked for`);
    const restored = await demo!.event<Restored>('restored', 5_000);
    console.log(`${TAG} restored into ${restored.database_url}: rewinds ${JSON.stringify(Object.fromEntries(Object.entries(restored.rewinds).map(([e, a]) => [e, a.outcome])))}`);
    assert.deepEqual(Object.keys(restored.rewinds).sort(), [...feedEndpoints].sort(), `${TAG} every feed endpoint was rewound after the restore`);

    await scrambler.stop();
    console.log(`${TAG} the scrambler took ${scrambler.taken} deliveries and gave back ${scrambler.givenBack}; the consumer was killed ${kills} times (${runs} runs)`);

    // Drain: the store at every endpoint's last change.
    let last: string[] = [];
    try {
      await until('the consumer catching up', 120_000, async () => {
        checkRunner();
        const state = await caughtUp(database, api, all);
        last = state.lagging;
        return state.done ? true : undefined;
      }, 500);
    } catch (error) {
      throw new Error(`${TAG} ${(error as Error).message}: ${last.join('; ')}; the consumer's log ends:\n${tail(runnerLog)}`);
    }
    console.log(`${TAG} drained after ${((Date.now() - t0) / 1000).toFixed(1)} s`);
    const finalRunner = runner!;
    runner = undefined;
    const code = await finalRunner.stop('SIGTERM', 30_000);
    assert.equal(code, 0, `${TAG} the consumer's exit on SIGTERM; its log ends:\n${tail(runnerLog)}`);
    const stopped = readFileSync(runnerLog, 'utf8').split('\n').filter((l) => l.includes('"event":"stopped"')).pop();
    console.log(`${TAG} last run's stats: ${stopped}`);

    const compared = await compareWithRelay(database, api, feedEndpoints, storiesEndpoint);
    console.log(`${TAG} compared: ${compared.items} items, ${compared.stories} stories (${compared.closedStories} closed, ${compared.merged} merged), ${compared.notifications} notifications`);
    assert.deepEqual(compared.problems, [], `${TAG} the store differs from the relay's copies`);
    assert.ok(compared.items > 0 && compared.stories > 0 && compared.notifications > 0, `${TAG} the run had items, stories and notifications`);

    // Every notification handed exactly once: the callback's outbox rows (written with the
    // hand-over's transaction) one per story; the log file (written before the commit) at least
    // once each, and more only when a kill came between the write and the commit.
    const outbox = await withClient(database, async (c) => (await c.query<{ story_id: string; n: string }>(
      'SELECT story_id, count(*) AS n FROM e2e_outbox WHERE endpoint_id = $1 GROUP BY story_id', [storiesEndpoint])).rows);
    const twice = outbox.filter((r) => Number(r.n) !== 1);
    assert.deepEqual(twice, [], `${TAG} notifications handed (committed) more than once`);
    const claimed = (await api.notifications(storiesEndpoint)).filter((n) => n.notified).map((n) => n.story_id).sort();
    assert.deepEqual(outbox.map((r) => r.story_id).sort(), claimed, `${TAG} the notifications handed are those the relay claimed and sent`);
    const logged = new Map<string, number>();
    for (const line of readFileSync(handedLog, 'utf8').split('\n')) {
      if (!line) continue;
      const [endpoint, storyId] = line.split(' ');
      const key = `${endpoint} ${storyId}`;
      logged.set(key, (logged.get(key) ?? 0) + 1);
    }
    const repeatedInLog = [...logged.values()].filter((n) => n > 1).length;
    assert.deepEqual([...logged.keys()].map((k) => k.split(' ')[1]).sort(), claimed, `${TAG} every notification reached the callback`);
    assert.ok(repeatedInLog <= kills, `${TAG} ${repeatedInLog} notifications logged twice with only ${kills} kills`);
    console.log(`${TAG} notifications: ${outbox.length} handed once each (${repeatedInLog} written twice to the log file outside the transaction, by a kill before the commit)`);

    const dead = await queueDepth(credentials.tenant_amqp_url, `${credentials.queue}.dead-letter`);
    console.log(`${TAG} dead-lettered messages: ${dead ?? 'unknown'}`);
  }

  test(`the examples keep copies of the same relay ${TAG}`, { timeout: 300_000 }, async () => {
    try {
      await examples();
    } catch (error) {
      failed = true;
      throw error;
    }
  });

  async function examples(): Promise<void> {
    const feedEndpoints = started.webhook_endpoint_ids;
    const storiesEndpoint = started.stories_endpoint_id;
    const all = [...feedEndpoints, storiesEndpoint];
    await demo!.event<Verdict>('verdict', (DURATION_S + 300) * 1000);
    const examplesDir = join(__dirname, '..', '..', 'examples');

    // Each resync below is asked for while the publisher may still hold the tenant: the holder
    // notices the tenant's publishing token moved at its next sweep and gives the tenant up, and
    // its successor sends the new epoch (services/publisher/src/tenant.rs).
    // Each example starts from nothing: a resync of every endpoint puts a snapshot of each copy
    // on the queue (epoch n + 1, change_seq 1 on), which the example applies from scratch.
    let lastDatabase = '';
    for (const [script, signal] of [['quickstart.js', 'SIGINT'], ['consume-into-postgres.js', 'SIGTERM']] as const) {
      const database = await freshDatabase();
      lastDatabase = database;
      for (const endpoint of all) await resync(api, endpoint);
      const log = join(logDir, `example-${script}.log`);
      const child = start(process.execPath, [join(examplesDir, script)], log, { env: consumerEnv(database) });
      children.add(child);
      let lagging: string[] = [];
      try {
        await until(`examples/${script} catching up`, 90_000, async () => {
          if (child.done) throw new Error(`examples/${script} exited; its log ends:\n${tail(log)}`);
          const state = await caughtUp(database, api, all);
          lagging = state.lagging;
          return state.done ? true : undefined;
        }, 500);
      } catch (error) {
        const depth = await queueDepth(credentials.tenant_amqp_url, credentials.queue).catch(() => undefined);
        throw new Error(`${TAG} ${(error as Error).message}: ${lagging.join('; ')}; the queue holds ${depth}; its log ends:\n${tail(log)}`);
      }
      const code = await child.stop(signal, 30_000);
      children.delete(child);
      assert.equal(code, 0, `${TAG} examples/${script} on ${signal}; its log ends:\n${tail(log)}`);
      const compared = await compareWithRelay(database, api, feedEndpoints, storiesEndpoint);
      // A resync sends the copies again, not the notifications: the example's store has none of
      // them, which is right (they were handed by the first consumer).
      const problems = compared.problems.filter((p) => !p.includes('notifications: '));
      assert.deepEqual(problems, [], `${TAG} examples/${script}'s store differs from the relay's copies`);
      console.log(`${TAG} examples/${script}: ${compared.items} items and ${compared.stories} stories equal the relay's`);
    }

    await rebuildExample(lastDatabase);

    // The memory example: it prints each snapshot's beginning and what it applies; stopped with
    // Ctrl-C once the queue is empty.
    for (const endpoint of all) await resync(api, endpoint);
    const log = join(logDir, 'example-memory.js.log');
    const child = start(process.execPath, [join(examplesDir, 'memory.js')], log, { env: consumerEnv('') });
    children.add(child);
    await until('examples/memory.js applying every snapshot', 90_000, async () => {
      if (child.done) throw new Error(`${TAG} examples/memory.js exited; its log ends:\n${tail(log)}`);
      const text = existsSync(log) ? readFileSync(log, 'utf8') : '';
      const begun = all.every((e) => text.includes(`snapshot of ${e} begins`));
      const depth = await queueDepth(credentials.tenant_amqp_url, credentials.queue);
      return begun && depth === 0 ? true : undefined;
    }, 500);
    const code = await child.stop('SIGINT', 30_000);
    children.delete(child);
    assert.equal(code, 0, `${TAG} examples/memory.js on SIGINT; its log ends:\n${tail(log)}`);
    console.log(`${TAG} examples/memory.js applied every endpoint's snapshot`);

    demoExit = await demo!.stop();
    assert.equal(demoExit, 0, `${TAG} the demo's exit on SIGTERM; its log ends:\n${tail(demo!.logPath)}`);
  }

  /**
   * examples/rebuild.js --from-scratch on the database the last example filled: it empties the
   * store's copies and positions and resyncs every endpoint itself (no resync here before it),
   * then rebuilds each from its snapshot, printing each epoch's beginning and end. Then, with it
   * still running, every endpoint is resynced here, as a restore of the relay begins the new
   * epochs without the consumer asking: it rebuilds again. Each time its store must reach every
   * endpoint's epoch and last change_seq and equal the relay's copies.
   */
  async function rebuildExample(database: string): Promise<void> {
    const feedEndpoints = started.webhook_endpoint_ids;
    const storiesEndpoint = started.stories_endpoint_id;
    const all = [...feedEndpoints, storiesEndpoint];
    const script = 'rebuild.js';
    const log = join(logDir, `example-${script}.log`);
    const text = () => (existsSync(log) ? readFileSync(log, 'utf8') : '');
    const held = (await storePositions(database)).size;
    assert.equal(held, all.length, `${TAG} the database given to examples/${script} holds every endpoint's position`);
    const epochs = async () => new Map([...(await relayStreams(api, all))].map(([e, s]) => [e, s.epoch]));
    const before = await epochs();

    const child = start(process.execPath, [join(__dirname, '..', '..', 'examples', script), '--from-scratch'], log, { env: consumerEnv(database) });
    children.add(child);
    const rebuilt = async (what: string, expected: Map<string, number>, from: number) => {
      let lagging: string[] = [];
      try {
        await until(`examples/${script} ${what}`, 90_000, async () => {
          if (child.done) throw new Error(`examples/${script} exited; its log ends:\n${tail(log)}`);
          // Every endpoint's new epoch begun and rebuilt, in this order, as printed after `from`.
          const printed = text().slice(from);
          lagging = all.filter((e) => {
            const begins = printed.indexOf(`endpoint ${e}: epoch ${expected.get(e)} begins, rebuilding from its snapshot\n`);
            const done = printed.indexOf(`endpoint ${e}: rebuilt (epoch ${expected.get(e)}: `);
            return begins < 0 || done < begins;
          }).map((e) => `${e}: epoch ${expected.get(e)} not begun and rebuilt in the log`);
          if (lagging.length > 0) return undefined;
          const state = await caughtUp(database, api, all);
          lagging = state.lagging;
          return state.done ? true : undefined;
        }, 500);
      } catch (error) {
        throw new Error(`${TAG} ${(error as Error).message}: ${lagging.join('; ')}; its log ends:\n${tail(log)}`);
      }
      const compared = await compareWithRelay(database, api, feedEndpoints, storiesEndpoint);
      // A resync sends the copies again, not the notifications (as above).
      const problems = compared.problems.filter((p) => !p.includes('notifications: '));
      assert.deepEqual(problems, [], `${TAG} examples/${script}'s store differs from the relay's copies ${what}`);
      console.log(`${TAG} examples/${script} ${what}: ${compared.items} items and ${compared.stories} stories equal the relay's`);
    };

    // 1. --from-scratch: the store emptied, every endpoint resynced by the example, each to a
    // greater epoch than it had (the relay's epochs grow, not necessarily by one).
    const asked = await until(`examples/${script} resyncing every endpoint`, 90_000, () => {
      if (child.done) throw new Error(`${TAG} examples/${script} exited; its log ends:\n${tail(log)}`);
      const found = new Map<string, number>();
      for (const m of text().matchAll(/^endpoint (\S+) \((?:feed|stories)\): resync asked, epoch (\d+)$/gm)) found.set(m[1]!, Number(m[2]));
      return all.every((e) => found.has(e)) ? found : undefined;
    }, 250);
    assert.deepEqual([...asked.keys()].sort(), [...all].sort(), `${TAG} examples/${script} resynced the tenant's endpoints, no other`);
    for (const e of all) assert.ok(asked.get(e)! > before.get(e)!, `${TAG} ${e}: the example's resync began epoch ${asked.get(e)} after ${before.get(e)}`);
    await rebuilt('from scratch', asked, 0);
    const output = text();
    assert.ok(output.includes(`the store is empty (it held ${all.length} endpoints' positions)\n`), `${TAG} examples/${script} emptied the store; its log:\n${tail(log)}`);
    assert.deepEqual(await epochs(), asked, `${TAG} each endpoint resynced once, by the example`);

    // 2. New epochs it did not ask for (as after a restore of the relay): rebuilt again.
    const from = output.length;
    const again = new Map<string, number>();
    for (const endpoint of all) again.set(endpoint, await resync(api, endpoint));
    await rebuilt('after new epochs it did not ask for', again, from);

    const code = await child.stop('SIGTERM', 30_000);
    children.delete(child);
    assert.equal(code, 0, `${TAG} examples/${script} on SIGTERM; its log ends:\n${tail(log)}`);
    assert.match(text(), /\nstopped: \{/, `${TAG} examples/${script} said it stopped`);
  }
});
