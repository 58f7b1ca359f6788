// Consume a tenant's queue into Postgres: the copies, positions, held changes and notifications
// in the store's tables (relay_items, relay_stories, relay_notifications, relay_positions,
// relay_held), and each notification printed and logged in a table of yours, once, in the
// transaction that marks it handed.
//
//   RELAY_AMQP_URL=amqp://relay-tenant-…:…@127.0.0.1:5672/%2f \
//   RELAY_QUEUE=relay.tenant.<tenant id> \
//   RELAY_STORE_DSN=postgres://postgres@127.0.0.1:5432/mycopy \
//   RELAY_API_URL=http://127.0.0.1:8081 RELAY_API_TOKEN=<token> \
//   node dist/examples/consume-into-postgres.js
//
// Stop it with SIGTERM or Ctrl-C (it finishes its batch); kill it at any moment and start it
// again: it resumes from the positions saved with the rows.

import { AmqpConnection, PgStore, RelayApi, RelayConsumer } from '@relay/consumer';

export interface RunOptions {
  env?: NodeJS.ProcessEnv;
  /** Opens the broker connection (tests wrap it). */
  connect?: (url: string) => Promise<AmqpConnection>;
  log?: (line: Record<string, unknown>) => void;
}

export async function run(options: RunOptions = {}): Promise<RelayConsumer> {
  const env = options.env ?? process.env;
  const need = (name: string): string => {
    const value = env[name];
    if (!value) throw new Error(`${name} is not set`);
    return value;
  };
  const log = options.log ?? ((line) => console.log(JSON.stringify(line)));
  const store = new PgStore({
    connection: need('RELAY_STORE_DSN'),
    handlers: {
      // Handed once: this insert commits with the store's mark that the notification was handed.
      notification: async (n, { client }) => {
        await client.query(
          `CREATE TABLE IF NOT EXISTS example_notification_log (
             endpoint_id uuid NOT NULL, story_id text NOT NULL, ticker text,
             handed_at timestamptz NOT NULL DEFAULT now())`,
        );
        await client.query('INSERT INTO example_notification_log (endpoint_id, story_id, ticker) VALUES ($1, $2, $3)', [n.endpoint, n.story_id, n.ticker]);
        log({ event: 'notification', endpoint: n.endpoint, story_id: n.story_id, ticker: n.ticker, headline: n.story?.['headline'] ?? null });
      },
    },
  });
  const api = env.RELAY_API_URL && env.RELAY_API_TOKEN ? new RelayApi(env.RELAY_API_URL, env.RELAY_API_TOKEN) : undefined;
  const consumer = new RelayConsumer({
    amqpUrl: need('RELAY_AMQP_URL'),
    queue: need('RELAY_QUEUE'),
    store,
    api,
    connect: options.connect,
    onError: (e) => log({ event: 'error', transient: e.transient, cause: e.cause, retry_in_ms: e.retryInMs ?? null, cause_kind: e.causeKind ?? null }),
  });
  consumer.on('gap', (gap) => log({ event: 'gap', endpoint: gap.endpoint, epoch: gap.epoch, from: gap.from, to: gap.to, held: gap.held }));
  consumer.on('replay', (r) => log({ event: 'replay', endpoint: r.endpoint, from: r.from, error: r.error ? String(r.error.message) : undefined }));
  consumer.on('refused', (error) => log({ event: 'refused', reason: error.reason, message_id: error.messageId, error: error.message }));
  await consumer.start();
  log({ event: 'consuming', queue: env.RELAY_QUEUE });
  return consumer;
}

if (require.main === module) {
  run().then(
    (consumer) => {
      const stop = () => void consumer.stop();
      process.once('SIGTERM', stop);
      process.once('SIGINT', stop);
      consumer.done.then(
        () => {
          console.log(JSON.stringify({ event: 'stopped', error: null, stats: consumer.stats() }));
          process.exitCode = 0;
        },
        (error: Error) => {
          console.log(JSON.stringify({ event: 'stopped', error: error.message, stats: consumer.stats() }));
          process.exitCode = 2;
        },
      );
    },
    (error: Error) => {
      console.error(error);
      process.exitCode = 2;
    },
  );
}
