import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createServer, IncomingMessage } from 'node:http';
import { AddressInfo } from 'node:net';
import { RelayApi, RelayApiError } from '../../src/api';

/** A stand-in for the relay's API: answers each request with `answer`, remembering the requests. */
async function withApi(answer: (request: IncomingMessage, url: URL) => { status: number; body: unknown }, run: (base: string, seen: { method: string; url: URL; auth: string | undefined }[]) => Promise<void>): Promise<void> {
  const seen: { method: string; url: URL; auth: string | undefined }[] = [];
  const server = createServer((request, response) => {
    const url = new URL(request.url ?? '/', 'http://localhost');
    seen.push({ method: request.method ?? '', url, auth: request.headers.authorization });
    const { status, body } = answer(request, url);
    response.writeHead(status, { 'content-type': 'application/json' });
    response.end(JSON.stringify(body));
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  try {
    await run(`http://127.0.0.1:${(server.address() as AddressInfo).port}/`, seen);
  } finally {
    await new Promise((resolve) => server.close(resolve));
  }
}

function endpoint(id: string): Record<string, unknown> {
  return { id, source: 'feed', lang: 'en', status: 'active', upstream_base_url: null, upstream_api_key_set: false, created_at: '2026-01-01T00:00:00Z', updated_at: '2026-01-01T00:00:00Z' };
}

test('endpoints() follows GET /v1/endpoints page by page with the tenant token', async () => {
  const ids = ['00000000-0000-4000-8000-000000000001', '00000000-0000-4000-8000-000000000002', '00000000-0000-4000-8000-000000000003'];
  await withApi(
    (_request, url) => {
      // Pages of two: the cursor is the last id of the page.
      const after = url.searchParams.get('after');
      const from = after === null ? 0 : ids.indexOf(after) + 1;
      const data = ids.slice(from, from + 2).map(endpoint);
      return { status: 200, body: { data, next_cursor: from + 2 < ids.length ? ids[from + 1] : null } };
    },
    async (base, seen) => {
      const listed = await new RelayApi(base, 'tok').endpoints();
      assert.deepEqual(listed.map((e) => e.id), ids);
      assert.equal(seen.length, 2);
      assert.ok(seen.every((r) => r.method === 'GET' && r.url.pathname === '/v1/endpoints' && r.auth === 'Bearer tok'));
      assert.equal(seen[0]!.url.searchParams.get('after'), null);
      assert.equal(seen[1]!.url.searchParams.get('after'), ids[1]);
    },
  );
});

test('resync() answers the new epoch; a 409 is a RelayApiError with its status', async () => {
  let calls = 0;
  await withApi(
    () => (++calls === 1
      ? { status: 409, body: { error: 'conflict', detail: "epoch 3's snapshot is still being sent" } }
      : { status: 202, body: { webhook_endpoint_id: 'e', epoch: 4, snapshot_items: 10 } }),
    async (base, seen) => {
      const api = new RelayApi(base, 'tok');
      await assert.rejects(api.resync('e'), (error: unknown) => error instanceof RelayApiError && error.status === 409);
      assert.deepEqual(await api.resync('e'), { webhook_endpoint_id: 'e', epoch: 4, snapshot_items: 10 });
      assert.ok(seen.every((r) => r.method === 'POST' && r.url.pathname === '/v1/endpoints/e/resync'));
    },
  );
});
