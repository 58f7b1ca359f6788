// Which failures the consumer retries and which end it (clients/README.md, "Lifecycle").

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { classify, describeError, HandlerError, PermanentError } from '../../src/errors';
import { RefusedMessage } from '../../src/message';
import { VERSION } from '../../src/version';

const kind = (error: unknown) => {
  const c = classify(error);
  return c.kind === 'permanent' ? c.error.causeKind : c.kind;
};

test('errors: permanent causes of the broker and the store', () => {
  assert.equal(kind(new Error('Handshake terminated by server: 403 (ACCESS-REFUSED) with message "ACCESS_REFUSED - Login was refused"')), 'broker_auth');
  assert.equal(kind(Object.assign(new Error('Operation failed: BasicConsume; 404 (NOT-FOUND) with message "NOT_FOUND - no queue \'q\'"'), { code: 404 })), 'queue_not_found');
  assert.equal(kind(Object.assign(new Error('database "x" does not exist'), { code: '3D000', severity: 'FATAL' })), 'store_missing');
  assert.equal(kind(Object.assign(new Error('password authentication failed for user "u"'), { code: '28P01', severity: 'FATAL' })), 'store_auth');
  assert.equal(kind(Object.assign(new Error('no pg_hba.conf entry'), { code: '28000', severity: 'FATAL' })), 'store_auth');
  assert.equal(kind(new PermanentError('schema_newer', 'newer')), 'schema_newer');
});

test('errors: transient ones, and what is neither', () => {
  for (const error of [
    Object.assign(new Error('Connection closed: 320 (CONNECTION-FORCED) with message "CONNECTION_FORCED - Closed via management plugin"'), { code: 320 }),
    new Error('the channel closed'),
    Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5672'), { code: 'ECONNREFUSED' }),
    Object.assign(new Error('terminating connection due to administrator command'), { code: '57P01', severity: 'FATAL' }),
    Object.assign(new Error('could not serialize access'), { code: '40001', severity: 'ERROR' }),
    new Error('Connection terminated unexpectedly'),
  ]) assert.equal(kind(error), 'transient', error.message);
  assert.equal(kind(new HandlerError('upsert', new Error('mine'))), 'fatal');
  assert.equal(kind(new RefusedMessage('version', 'v is 2')), 'fatal');
});

test('errors: one line with the broker\'s code and text, or the SQLSTATE', () => {
  assert.equal(describeError(Object.assign(new Error('terminating connection'), { code: '57P01', severity: 'FATAL' })), 'terminating connection (SQLSTATE 57P01)');
  assert.equal(describeError(Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:1'), { code: 'ECONNREFUSED' })), 'connect ECONNREFUSED 127.0.0.1:1');
  assert.match(describeError(new HandlerError('upsert', new Error('mine'))), /the upsert handler threw: mine/);
});

test('version: the library says the version package.json has', () => {
  const pkg = JSON.parse(readFileSync(join(__dirname, '..', '..', '..', 'package.json'), 'utf8')) as { version: string };
  assert.equal(VERSION, pkg.version);
  assert.match(VERSION, /^\d+\.\d+\.\d+$/);
});
