#!/usr/bin/env bash
# relay-consumer's checks: a fresh venv, the package with its test deps from PyPI, mypy --strict
# (the library, the examples, the benchmark, the e2e harness), pytest (unit, property, and the
# Postgres store against 127.0.0.1:5432), and, when RELAY_BIN names the relay binary, the
# end-to-end test against `$RELAY_BIN demo --external-consumer` (tests/e2e, about 70 s;
# Postgres, Redis and RabbitMQ with its management API on 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")"
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check -e '.[test]'
"$venv/bin/mypy" --strict src examples bench tests/e2e
"$venv/bin/pytest" -q -p no:cacheprovider -m 'not e2e' tests
if [ -n "${RELAY_BIN:-}" ]; then
    if [ ! -x "$RELAY_BIN" ]; then
        echo "ci.sh: RELAY_BIN=$RELAY_BIN is not an executable file" >&2
        exit 1
    fi
    echo "ci.sh: the end-to-end test against $RELAY_BIN demo --external-consumer"
    "$venv/bin/pytest" -q -p no:cacheprovider -m e2e -rA tests/e2e
else
    echo "ci.sh: RELAY_BIN is not set: the end-to-end test against a real relay is skipped"
fi
