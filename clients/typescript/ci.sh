#!/usr/bin/env bash
# CI of the TypeScript consumer: install from the lock file, build (tsc, strict), run the unit
# tests and the Postgres store tests (RELAY_TEST_PG, default
# postgres://postgres@127.0.0.1:5432/postgres); then pack the package (`npm pack`), install the
# tarball into a fresh directory as a user does (`npm init -y && npm install <tarball>`), check
# what it holds (the exports, the types, the relay-consumer command) and type-check the quick
# start against it. The end-to-end tests against a real relay (test/e2e: `relay demo
# --external-consumer`, with this machine's Redis, RabbitMQ and its management plugin, and
# Postgres's initdb for a private server) run only when RELAY_BIN names a relay binary, from
# that directory, against the INSTALLED package: '@relay/consumer' resolves into its
# node_modules and `relay-consumer` is its node_modules/.bin/relay-consumer. See README.md.
#
# RELAY_CONSUMER_PACK_DIR: where the tarball is left (default: a temporary directory, removed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
here="$(pwd)"

export RELAY_TEST_PG="${RELAY_TEST_PG:-postgres://postgres@127.0.0.1:5432/postgres}"

work="$(mktemp -d -t relay-ts-ci-XXXXXX)"
trap 'rm -rf "$work"' EXIT

echo "== npm ci"
npm ci --no-audit --no-fund

echo "== build"
rm -rf dist
npx tsc -p tsconfig.json

echo "== unit tests"
node --test --test-concurrency=1 dist/test/unit/

echo "== Postgres store tests ($RELAY_TEST_PG)"
node --test --test-concurrency=1 dist/test/pg/

echo "== npm pack"
pack_dir="${RELAY_CONSUMER_PACK_DIR:-$work/pack}"
mkdir -p "$pack_dir"
# Built just above: the prepack script (a clean build) is not run again.
tarball="$pack_dir/$(npm pack --ignore-scripts --silent --pack-destination "$pack_dir")"
echo "packed $tarball"
listing="$(tar -tzf "$tarball")"
for want in package/package.json package/README.md package/CHANGELOG.md package/dist/src/index.js \
            package/dist/src/index.d.ts package/dist/src/cli.js package/dist/src/consumer.d.ts; do
  grep -qx "$want" <<<"$listing" || { echo "the tarball lacks $want" >&2; exit 1; }
done
if grep -q '^package/dist/\(test\|examples\|bench\)/' <<<"$listing"; then
  echo "the tarball holds tests, examples or the benchmark" >&2
  exit 1
fi
head -1 dist/src/cli.js | grep -qx '#!/usr/bin/env node' || { echo "dist/src/cli.js has no shebang" >&2; exit 1; }

echo "== install the tarball into a fresh directory"
app="$work/app"
mkdir -p "$app"
(cd "$app" && npm init -y >/dev/null && npm install --no-audit --no-fund "$tarball")
resolved="$(cd "$app" && node -p "require.resolve('@relay/consumer')")"
[[ "$resolved" == "$app/node_modules/@relay/consumer/dist/src/index.js" ]] || { echo "@relay/consumer resolves to $resolved" >&2; exit 1; }
version="$("$app/node_modules/.bin/relay-consumer" --version)"
[[ "$version" == "$(node -p "require('./package.json').version")" ]] || { echo "relay-consumer --version says $version" >&2; exit 1; }
"$app/node_modules/.bin/relay-consumer" --help >/dev/null
set +e
"$app/node_modules/.bin/relay-consumer" run >/dev/null 2>&1
usage=$?
set -e
[[ $usage -eq 2 ]] || { echo "relay-consumer run without its settings exited $usage, not 2" >&2; exit 1; }
(cd "$app" && node -e "
  const c = require('@relay/consumer');
  for (const name of ['RelayConsumer', 'PgStore', 'MemoryStore', 'RelayApi', 'PermanentError', 'verifyStore', 'stderrLogger']) {
    if (typeof c[name] !== 'function') throw new Error('@relay/consumer exports no ' + name);
  }
  if (c.VERSION !== require('@relay/consumer/package.json').version) throw new Error('VERSION');
")
echo "installed: $resolved; relay-consumer $version"

echo "== type-check the quick start against the installed package"
cp examples/quickstart.ts "$app/quickstart.ts"
cat > "$app/tsconfig.json" <<'EOF'
{
  "compilerOptions": {
    "target": "ES2022", "module": "commonjs", "moduleResolution": "node", "strict": true,
    "noEmit": true, "types": ["node"], "esModuleInterop": true
  },
  "files": ["quickstart.ts"]
}
EOF
"$here/node_modules/.bin/tsc" -p "$app/tsconfig.json"

if [[ -n "${RELAY_BIN:-}" ]]; then
  if compgen -G "dist/test/e2e/*.test.js" > /dev/null; then
    echo "== end-to-end tests against the installed package (RELAY_BIN=$RELAY_BIN)"
    # The compiled tests and examples, run from the application's directory: their imports of
    # '@relay/consumer' resolve into its node_modules, the command is its bin.
    mkdir -p "$app/test"
    cp -r dist/test/e2e dist/test/support "$app/test/"
    cp -r dist/examples "$app/examples"
    (cd "$app" && RELAY_CONSUMER_E2E_INSTALLED=1 node --test --test-concurrency=1 test/e2e/)
  else
    echo "== end-to-end tests: RELAY_BIN is set but dist/test/e2e holds no test" >&2
    exit 1
  fi
else
  echo "== end-to-end tests skipped (set RELAY_BIN to a relay binary to run them)"
fi
echo "== ok"
