// The README's quick start is examples/quickstart.ts, which the build compiles and the
// end-to-end test runs: the two must not drift apart.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';

const root = join(__dirname, '..', '..', '..');

test('readme: the quick start is examples/quickstart.ts, as it is', () => {
  const readme = readFileSync(join(root, 'README.md'), 'utf8');
  const section = readme.slice(readme.indexOf('## Quick start'));
  const block = /```ts\n([\s\S]*?)```/.exec(section)?.[1];
  assert.equal(block, readFileSync(join(root, 'examples', 'quickstart.ts'), 'utf8'));
});
