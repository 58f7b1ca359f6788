#!/usr/bin/env bash
# CI of the Python consumer: a virtualenv in a temporary directory, the package installed with
# its test extras, mypy --strict (the package, the examples, the tests), then pytest: the unit
# tests and the store tests against Postgres (RELAY_CONSUMER_TEST_PG, default
# postgresql://postgres@127.0.0.1:5432/postgres). End-to-end tests against a real relay run only
# when RELAY_BIN names a relay binary and tests/e2e holds some (none is written yet).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

export RELAY_CONSUMER_TEST_PG="${RELAY_CONSUMER_TEST_PG:-postgresql://postgres@127.0.0.1:5432/postgres}"
PYTHON="${PYTHON:-python3}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
venv="$work/venv"

echo "== venv ($("$PYTHON" --version)) in $venv"
"$PYTHON" -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check -e '.[test]'

echo "== mypy --strict"
"$venv/bin/mypy" --strict --cache-dir "$work/mypy" src/relay_consumer examples
"$venv/bin/mypy" --strict --cache-dir "$work/mypy" tests

echo "== pytest: unit and Postgres store tests ($RELAY_CONSUMER_TEST_PG)"
"$venv/bin/pytest" -q -p no:cacheprovider --ignore=tests/e2e tests

if [[ -n "${RELAY_BIN:-}" ]]; then
  if compgen -G "tests/e2e/test_*.py" > /dev/null; then
    echo "== end-to-end tests (RELAY_BIN=$RELAY_BIN)"
    "$venv/bin/pytest" -q -p no:cacheprovider tests/e2e
  else
    echo "== end-to-end tests: RELAY_BIN is set but tests/e2e holds no test yet; nothing run"
  fi
else
  echo "== end-to-end tests skipped (set RELAY_BIN to a relay binary to run them)"
fi
echo "== ok"
