// A complete program: a copy of the tenant's endpoints in Postgres, each story notification
// written to an outbox table of yours in the transaction that marks it handed (so exactly once),
// stopped cleanly by SIGTERM or SIGINT (Ctrl-C). `relay-consumer run` does the same without the
// outbox. The README's quick start is this file.
import { PgStore, RelayApi, RelayConsumer, stderrLogger } from '@relay/consumer';

const env = (name: string): string => {
  const value = process.env[name];
  if (!value) throw new Error(`set ${name}`);
  return value;
};

async function main(): Promise<void> {
  const store = new PgStore({
    connection: env('RELAY_STORE_DSN'),
    handlers: {
      // Called once per notification, inside the transaction that marks it handed.
      notification: async (n, { client }) => {
        await client.query(
          `CREATE TABLE IF NOT EXISTS my_outbox (
             endpoint_id uuid, story_id text, ticker text, PRIMARY KEY (endpoint_id, story_id))`);
        await client.query('INSERT INTO my_outbox VALUES ($1, $2, $3)', [n.endpoint, n.story_id, n.ticker]);
      },
    },
  });
  const api = process.env.RELAY_API_URL && process.env.RELAY_API_TOKEN
    ? new RelayApi(process.env.RELAY_API_URL, process.env.RELAY_API_TOKEN) // replays gaps
    : undefined;
  const consumer = new RelayConsumer({
    amqpUrl: env('RELAY_AMQP_URL'), // the broker credentials' amqp_url, with the password in it
    queue: env('RELAY_QUEUE'), // relay.tenant.<tenant id>
    store,
    api,
    logger: stderrLogger(), // one line per reconnect and per error
    onError: (e) => {
      if (!e.transient) console.error(`stopped for good (${e.causeKind}): ${e.cause}`);
    },
  });
  process.once('SIGTERM', () => void consumer.stop());
  process.once('SIGINT', () => void consumer.stop());
  await consumer.start(); // resolves once consuming; reconnects by itself after that
  await consumer.done; // resolves after stop(); rejects with a PermanentError
  console.log(JSON.stringify(consumer.stats()));
}

main().catch((error) => {
  console.error(error);
  process.exitCode = 2;
});
