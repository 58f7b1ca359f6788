#!/usr/bin/env node
// `relay-consumer`: the command of clients/README.md ("The command").
//
//   relay-consumer run --amqp-url URL --queue Q --store-dsn DSN [--api-url URL --api-token T]
//                      [--metrics-addr HOST:PORT] [--prefetch N] [--batch-max N]
//   relay-consumer verify --store-dsn DSN --api-url URL --api-token T [--endpoint ID ...]
//
// A flag beats its environment variable (RELAY_AMQP_URL, RELAY_QUEUE, RELAY_STORE_DSN,
// RELAY_API_URL, RELAY_API_TOKEN, RELAY_METRICS_ADDR, RELAY_PREFETCH, RELAY_BATCH_MAX).
// `run` exits 0 after SIGTERM or SIGINT, 2 on a permanent failure (the cause on stderr); each
// notification handed is printed on stdout as a JSON line (`{"event":"notification",...}`), and
// at the end what it did (`{"event":"exited","code":...,"stats":...}`); the log goes to stderr.
// `verify` prints one line per endpoint and exits 0 when every endpoint is equal, 1 on a
// difference, 2 on an error.

import { createServer, Server } from 'node:http';
import { RelayApi } from './api';
import { RelayConsumer } from './consumer';
import { describeError, PermanentError } from './errors';
import { stderrLogger } from './logger';
import { PgStore } from './pg-store';
import { verdictLine, verifyStore } from './verify';
import { VERSION } from './version';

const USAGE = `relay-consumer ${VERSION}: keeps an exact copy of a tenant's relay endpoints in Postgres.

usage:
  relay-consumer run --amqp-url URL --queue Q --store-dsn DSN
                     [--api-url URL --api-token T] [--metrics-addr HOST:PORT]
                     [--prefetch N] [--batch-max N]
  relay-consumer verify --store-dsn DSN --api-url URL --api-token T [--endpoint ID ...]
  relay-consumer --version

A flag beats its environment variable: RELAY_AMQP_URL, RELAY_QUEUE, RELAY_STORE_DSN,
RELAY_API_URL, RELAY_API_TOKEN, RELAY_METRICS_ADDR, RELAY_PREFETCH, RELAY_BATCH_MAX.

run     consumes the queue into the store until SIGTERM or SIGINT (exit 0) or a permanent
        failure (exit 2). Prints each notification handed as a JSON line on stdout, and the
        stats as a last one; logs on stderr. With --metrics-addr: GET /metrics (Prometheus
        text) and GET /healthz (200 while ok or reconnecting, 503 otherwise).
verify  compares the store with the relay's copy through the API: one line per endpoint,
        exit 0 when all are equal, 1 on a difference, 2 on an error.
`;

const FLAGS: Record<string, { env?: string; many?: boolean }> = {
  'amqp-url': { env: 'RELAY_AMQP_URL' },
  queue: { env: 'RELAY_QUEUE' },
  'store-dsn': { env: 'RELAY_STORE_DSN' },
  'api-url': { env: 'RELAY_API_URL' },
  'api-token': { env: 'RELAY_API_TOKEN' },
  'metrics-addr': { env: 'RELAY_METRICS_ADDR' },
  prefetch: { env: 'RELAY_PREFETCH' },
  'batch-max': { env: 'RELAY_BATCH_MAX' },
  endpoint: { many: true },
};

class UsageError extends Error {}

interface Parsed {
  command: string;
  get(name: string): string | undefined;
  need(name: string): string;
  all(name: string): string[];
  number(name: string): number | undefined;
}

function parse(argv: string[], env: NodeJS.ProcessEnv): Parsed {
  const [command, ...rest] = argv;
  if (!command) throw new UsageError('no command given');
  const values = new Map<string, string[]>();
  for (let i = 0; i < rest.length; i++) {
    const arg = rest[i]!;
    if (!arg.startsWith('--')) throw new UsageError(`unexpected argument: ${arg}`);
    const eq = arg.indexOf('=');
    const name = eq >= 0 ? arg.slice(2, eq) : arg.slice(2);
    if (!FLAGS[name]) throw new UsageError(`unknown flag: --${name}`);
    let value: string | undefined = eq >= 0 ? arg.slice(eq + 1) : rest[++i];
    if (value === undefined) throw new UsageError(`--${name} needs a value`);
    if (!FLAGS[name]!.many && values.has(name)) throw new UsageError(`--${name} given twice`);
    values.set(name, [...(values.get(name) ?? []), value]);
    value = undefined;
  }
  const get = (name: string) => values.get(name)?.[0] ?? (FLAGS[name]!.env ? env[FLAGS[name]!.env!] || undefined : undefined);
  return {
    command,
    get,
    need(name) {
      const value = get(name);
      if (!value) throw new UsageError(`--${name}${FLAGS[name]!.env ? ` (or ${FLAGS[name]!.env})` : ''} is required`);
      return value;
    },
    all: (name) => values.get(name) ?? [],
    number(name) {
      const value = get(name);
      if (value === undefined) return undefined;
      const n = Number(value);
      if (!Number.isSafeInteger(n) || n < 1) throw new UsageError(`--${name} is not a whole number of 1 or more: ${value}`);
      return n;
    },
  };
}

/** `host:port` (`[::1]:9464` for IPv6) as node:http listens on it. */
function hostPort(addr: string): { host: string; port: number } {
  const m = /^(?:\[([^\]]+)\]|([^:]*)):(\d+)$/.exec(addr);
  if (!m) throw new UsageError(`--metrics-addr is not HOST:PORT: ${addr}`);
  return { host: m[1] ?? (m[2] || '0.0.0.0'), port: Number(m[3]) };
}

async function serveMetrics(addr: string, consumer: RelayConsumer, log: (line: string) => void): Promise<Server> {
  const { host, port } = hostPort(addr);
  const server = createServer((request, response) => {
    const path = (request.url ?? '/').split('?')[0];
    if (request.method !== 'GET' && request.method !== 'HEAD') {
      response.writeHead(405, { allow: 'GET, HEAD' }).end();
    } else if (path === '/metrics') {
      response.writeHead(200, { 'content-type': 'text/plain; version=0.0.4; charset=utf-8', 'cache-control': 'no-store' }).end(consumer.metricsText());
    } else if (path === '/healthz') {
      const health = consumer.health();
      const ok = health.status === 'ok' || health.status === 'reconnecting';
      response.writeHead(ok ? 200 : 503, { 'content-type': 'application/json', 'cache-control': 'no-store' }).end(`${JSON.stringify(health)}\n`);
    } else {
      response.writeHead(404, { 'content-type': 'text/plain' }).end('not found: GET /metrics or /healthz\n');
    }
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, host, () => resolve());
  });
  // A server left open must not keep the process alive once the consumer stopped.
  server.unref();
  const bound = server.address();
  if (bound && typeof bound === 'object') {
    const shown = bound.family === 'IPv6' ? `[${bound.address}]` : bound.address;
    log(`relay-consumer: serving /metrics and /healthz on http://${shown}:${bound.port}`);
  }
  return server;
}

async function run(args: Parsed): Promise<number> {
  const amqpUrl = args.need('amqp-url');
  const queue = args.need('queue');
  const dsn = args.need('store-dsn');
  const apiUrl = args.get('api-url');
  const apiToken = args.get('api-token');
  if ((apiUrl === undefined) !== (apiToken === undefined)) throw new UsageError('--api-url and --api-token go together');
  const prefetch = args.number('prefetch');
  const batchMax = args.number('batch-max');
  const metricsAddr = args.get('metrics-addr');
  const logger = stderrLogger();

  const store = new PgStore({
    connection: dsn,
    handlers: {
      // Printed in the hand-over's transaction, before it commits: once, unless the process
      // dies between the two (a stop after SIGTERM finishes the hand-over first).
      notification: (n) => void process.stdout.write(`${JSON.stringify({ event: 'notification', ...n })}\n`),
    },
  });
  const consumer = new RelayConsumer({
    amqpUrl,
    queue,
    store,
    api: apiUrl && apiToken ? new RelayApi(apiUrl, apiToken) : undefined,
    prefetch,
    batchMax,
    logger,
    connectionName: `relay-consumer (typescript) pid ${process.pid}`,
  });
  let signalled: string | undefined;
  const onSignal = (signal: NodeJS.Signals) => {
    if (signalled) {
      logger.info(`relay-consumer: ${signal}: stopping already`);
      return;
    }
    signalled = signal;
    logger.info(`relay-consumer: ${signal}`);
    void consumer.stop();
  };
  process.on('SIGTERM', onSignal);
  process.on('SIGINT', onSignal);
  let server: Server | undefined;
  let code: number;
  try {
    if (metricsAddr) server = await serveMetrics(metricsAddr, consumer, logger.info);
    await consumer.start();
    await consumer.done;
    code = 0;
  } catch (error) {
    await consumer.stop();
    process.stderr.write(error instanceof PermanentError
      ? `relay-consumer: permanent failure (${error.causeKind}): ${error.message}\n`
      : `relay-consumer: stopped by ${describeError(error)}\n`);
    code = 2;
  } finally {
    server?.close();
  }
  // What this process did, once, as a JSON line (as the Python command prints it).
  process.stdout.write(`${JSON.stringify({ event: 'exited', code, stats: consumer.stats() })}\n`);
  return code;
}

async function verify(args: Parsed): Promise<number> {
  const dsn = args.need('store-dsn');
  const api = new RelayApi(args.need('api-url'), args.need('api-token'));
  const verdicts = await verifyStore({ connection: dsn, api, endpoints: args.all('endpoint') });
  for (const v of verdicts) process.stdout.write(`${verdictLine(v)}\n`);
  if (verdicts.length === 0) {
    process.stderr.write('relay-consumer verify: no endpoint to compare\n');
    return 2;
  }
  return verdicts.every((v) => v.equal) ? 0 : 1;
}

async function main(argv: string[]): Promise<number> {
  if (argv[0] === '--help' || argv[0] === '-h' || argv[0] === 'help') {
    process.stdout.write(USAGE);
    return 0;
  }
  if (argv[0] === '--version' || argv[0] === 'version') {
    process.stdout.write(`${VERSION}\n`);
    return 0;
  }
  try {
    const args = parse(argv, process.env);
    if (args.command === 'run') return await run(args);
    if (args.command === 'verify') return await verify(args);
    throw new UsageError(`unknown command: ${args.command}`);
  } catch (error) {
    if (error instanceof UsageError) {
      process.stderr.write(`relay-consumer: ${error.message}\n\n${USAGE}`);
      return 2;
    }
    process.stderr.write(error instanceof PermanentError
      ? `relay-consumer: permanent failure (${error.causeKind}): ${error.message}\n`
      : `relay-consumer ${argv[0]}: ${describeError(error)}\n`);
    return 2;
  }
}

main(process.argv.slice(2)).then((code) => {
  process.exitCode = code;
  // Whatever was left open (none should be) does not keep the process: it ends soon after.
  setTimeout(() => process.exit(code), 2_000).unref();
});
