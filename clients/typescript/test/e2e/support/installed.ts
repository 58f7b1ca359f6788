// Which @relay/consumer the end-to-end tests run: they import '@relay/consumer' as a user does.
// ci.sh packs the library, installs the tarball into a fresh directory and runs the compiled
// tests from there, so the import resolves into that directory's node_modules and the command is
// its node_modules/.bin/relay-consumer (RELAY_CONSUMER_E2E_INSTALLED=1 makes the tests insist on
// it). Run from the build tree instead (`node --test dist/test/e2e/`), the import resolves to the
// package itself (its `exports`) and the command to its dist/src/cli.js.

import { existsSync, readFileSync } from 'node:fs';
import { dirname, join, sep } from 'node:path';

/** The directory of the @relay/consumer package in use, and where it was found. */
export function packageDir(): string {
  return dirname(require.resolve('@relay/consumer/package.json'));
}

/** Whether the package in use is an installed one (under node_modules). */
export function installed(): boolean {
  return packageDir().split(sep).includes('node_modules');
}

/** The command: the installed bin when there is one, else the package's cli through node. */
export function command(): { file: string; args: string[] } {
  if (process.env.RELAY_CONSUMER_BIN) return { file: process.env.RELAY_CONSUMER_BIN, args: [] };
  for (let dir = __dirname; ; dir = dirname(dir)) {
    const bin = join(dir, 'node_modules', '.bin', 'relay-consumer');
    if (existsSync(bin)) return { file: bin, args: [] };
    if (dirname(dir) === dir) break;
  }
  const pkg = JSON.parse(readFileSync(join(packageDir(), 'package.json'), 'utf8')) as { bin: Record<string, string> };
  return { file: process.execPath, args: [join(packageDir(), pkg.bin['relay-consumer']!)] };
}

/** Throws unless the package is the installed one, when RELAY_CONSUMER_E2E_INSTALLED=1 asks for it. */
export function checkInstalled(): string {
  const where = packageDir();
  const bin = command();
  if (process.env.RELAY_CONSUMER_E2E_INSTALLED === '1') {
    if (!installed()) throw new Error(`@relay/consumer resolves to ${where}, not to an installed package`);
    if (!bin.file.split(sep).includes('node_modules')) throw new Error(`relay-consumer is ${bin.file}, not an installed bin`);
  }
  return `@relay/consumer from ${where}; relay-consumer is ${[bin.file, ...bin.args].join(' ')}`;
}
