#!/usr/bin/env bash
# relay-consumer's checks: a fresh venv, the package with its test deps from PyPI, mypy --strict,
# pytest (unit, property, and the Postgres store against 127.0.0.1:5432).
# The end-to-end test against `relay demo --external-consumer` is not written yet (see README).
set -euo pipefail
cd "$(dirname "$0")"
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check -e '.[test]'
"$venv/bin/mypy" --strict src
"$venv/bin/pytest" -q -p no:cacheprovider tests
