// Keeps a tenant's copies in memory and prints what changes.
//
//   RELAY_AMQP_URL='amqp://<username>:<password>@<host>:<port>/<vhost>' \
//   RELAY_QUEUE=relay.tenant.<tenant id> node dist/examples/memory.js
//
// RELAY_AMQP_URL is the credentials' amqp_url with their password put after the username.
// SIGTERM or Ctrl-C stops it.

import { MemoryStore, RelayConsumer, stderrLogger } from '@relay/consumer';

async function main(): Promise<void> {
  const amqpUrl = process.env.RELAY_AMQP_URL;
  const queue = process.env.RELAY_QUEUE;
  if (!amqpUrl || !queue) throw new Error('set RELAY_AMQP_URL and RELAY_QUEUE');
  const store = new MemoryStore({
    handlers: {
      upsert: (c, { written }) => void (written && console.log(`upsert ${c.webhook_endpoint_id} ${c.subject}`, c.item)),
      remove: (c, { written }) => void (written && console.log(`remove ${c.webhook_endpoint_id} ${c.subject}`)),
      snapshotBegin: (c) => console.log(`snapshot of ${c.webhook_endpoint_id} begins (epoch ${c.epoch})`),
      storySaved: (m, { written }) => void (written && console.log(`story ${m.story_id} v${m.version}`)),
      storyClosed: (m) => console.log(`story ${m.story_id} closed${m.merged_into ? `, merged into ${m.merged_into}` : ''}`),
      notification: (n) => console.log(`NOTIFY ${n.story_id} (${n.ticker ?? '-'})`),
    },
  });
  const consumer = new RelayConsumer({ amqpUrl, queue, store, logger: stderrLogger() });
  consumer.on('gap', (gap) => console.warn(`waiting for ${gap.endpoint} change_seq ${gap.from}..${gap.to}`));
  process.once('SIGINT', () => void consumer.stop());
  process.once('SIGTERM', () => void consumer.stop());
  await consumer.start();
  await consumer.done;
}

main().catch((error) => {
  console.error(error);
  process.exitCode = 2;
});
