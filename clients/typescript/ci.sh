#!/usr/bin/env bash
# CI of the TypeScript consumer: install from the lock file, build (tsc, strict), run the unit
# tests and the Postgres store tests (RELAY_TEST_PG, default
# postgres://postgres@127.0.0.1:5432/postgres). The end-to-end test against a real relay
# (test/e2e: `relay demo --external-consumer`, with this machine's Redis and RabbitMQ and its
# management plugin) runs only when RELAY_BIN names a relay binary; see README.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

export RELAY_TEST_PG="${RELAY_TEST_PG:-postgres://postgres@127.0.0.1:5432/postgres}"

echo "== npm ci"
npm ci --no-audit --no-fund

echo "== build"
rm -rf dist
npx tsc -p tsconfig.json

echo "== unit tests"
node --test --test-concurrency=1 dist/test/unit/

echo "== Postgres store tests ($RELAY_TEST_PG)"
node --test --test-concurrency=1 dist/test/pg/

if [[ -n "${RELAY_BIN:-}" ]]; then
  if compgen -G "dist/test/e2e/*.test.js" > /dev/null; then
    echo "== end-to-end tests (RELAY_BIN=$RELAY_BIN)"
    node --test --test-concurrency=1 dist/test/e2e/
  else
    echo "== end-to-end tests: RELAY_BIN is set but dist/test/e2e holds no test" >&2
    exit 1
  fi
else
  echo "== end-to-end tests skipped (set RELAY_BIN to a relay binary to run them)"
fi
echo "== ok"
