// Keeps a tenant's copies in Postgres (the tables relay_positions, relay_feed_items,
// relay_stories, relay_notifications, made when missing) and hands each story notification
// once, writing it to an outbox table of its own in the same transaction as the hand-over.
//
//   RELAY_AMQP_URL='amqp://<username>:<password>@<host>:<port>/<vhost>' \
//   RELAY_TENANT_ID=<tenant id> DATABASE_URL=postgres://... node dist/examples/postgres.js
//
// Optionally RELAY_API_URL and RELAY_TOKEN (a token of the tenant): a gap that does not fill
// in time is then asked for again with POST /v1/endpoints/<id>/replay.

import { PgStore, RelayApi, RelayConsumer } from '../src';

async function main(): Promise<void> {
  const amqpUrl = process.env.RELAY_AMQP_URL;
  const tenantId = process.env.RELAY_TENANT_ID;
  const database = process.env.DATABASE_URL;
  if (!amqpUrl || !tenantId || !database) throw new Error('set RELAY_AMQP_URL, RELAY_TENANT_ID and DATABASE_URL');
  const store = new PgStore({
    connection: database,
    handlers: {
      notification: async (n, { client }) => {
        await client.query('CREATE TABLE IF NOT EXISTS my_outbox (endpoint uuid, story_id text, ticker text, PRIMARY KEY (endpoint, story_id))');
        await client.query('INSERT INTO my_outbox VALUES ($1, $2, $3)', [n.endpoint, n.story_id, n.ticker]);
      },
    },
  });
  const api = process.env.RELAY_API_URL && process.env.RELAY_TOKEN ? new RelayApi(process.env.RELAY_API_URL, process.env.RELAY_TOKEN) : undefined;
  const consumer = new RelayConsumer({ amqpUrl, queue: `relay.tenant.${tenantId}`, tenantId, store, api });
  consumer.on('applied', (outcome) => console.log(`applied ${outcome.applied}, skipped ${outcome.skipped}`));
  consumer.on('gap', (gap) => console.warn(`waiting for ${gap.endpoint} change_seq ${gap.from}..${gap.to}`));
  consumer.on('replay', (r) => console.warn('replay', r));
  process.once('SIGINT', () => void consumer.stop());
  await consumer.start();
  const error = await consumer.done;
  await store.close();
  if (error) throw error;
}

main().catch((error) => {
  console.error(error);
  process.exitCode = 1;
});
