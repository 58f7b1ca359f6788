// RabbitMQ's management API (http://127.0.0.1:15672, guest/guest on this machine; or
// RELAY_AMQP_MANAGEMENT_URL, _USER, _PASSWORD): the broker's connections, and closing one as an
// operator does (DELETE /api/connections/<name>: the client gets 320 CONNECTION_FORCED).

const base = () => (process.env.RELAY_AMQP_MANAGEMENT_URL ?? 'http://127.0.0.1:15672').replace(/\/+$/, '');
const auth = () => `Basic ${Buffer.from(`${process.env.RELAY_AMQP_MANAGEMENT_USER ?? 'guest'}:${process.env.RELAY_AMQP_MANAGEMENT_PASSWORD ?? 'guest'}`).toString('base64')}`;

export interface BrokerConnection {
  name: string;
  user: string;
  client_properties?: { connection_name?: string };
}

export async function connections(): Promise<BrokerConnection[]> {
  const answer = await fetch(`${base()}/api/connections`, { headers: { authorization: auth() }, signal: AbortSignal.timeout(5_000) });
  if (!answer.ok) throw new Error(`GET /api/connections answered ${answer.status}`);
  return (await answer.json()) as BrokerConnection[];
}

/** Closes a connection through the API, with the reason given (the client sees it in the close). */
export async function closeConnection(name: string, reason: string): Promise<void> {
  const answer = await fetch(`${base()}/api/connections/${encodeURIComponent(name)}`, {
    method: 'DELETE',
    headers: { authorization: auth(), 'x-reason': reason },
    signal: AbortSignal.timeout(5_000),
  });
  if (!answer.ok && answer.status !== 404) throw new Error(`DELETE /api/connections/${name} answered ${answer.status}`);
}

/** How many messages a queue holds (ready and unacknowledged). */
export async function queueDepth(amqpUrl: string, queue: string): Promise<number | undefined> {
  const vhost = decodeURIComponent(new URL(amqpUrl).pathname.slice(1)) || '/';
  const answer = await fetch(`${base()}/api/queues/${encodeURIComponent(vhost)}/${encodeURIComponent(queue)}`, {
    headers: { authorization: auth() },
    signal: AbortSignal.timeout(5_000),
  });
  if (!answer.ok) return undefined;
  return ((await answer.json()) as { messages?: number }).messages;
}
