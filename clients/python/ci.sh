#!/usr/bin/env bash
# relay-consumer's checks, against the package as a user installs it:
#   1. a wheel and an sdist built with `python -m build` (the build backend from PyPI) in a fresh
#      venv, from a copy of this directory (the checkout is left as it was);
#   2. the WHEEL installed, with its test extra, into another fresh venv; the tests run from a
#      directory where src/ is not on the path, and conftest.py checks that relay_consumer is
#      the installed one (RELAY_CONSUMER_REQUIRE_INSTALLED);
#   3. mypy --strict: the installed package (its files as the wheel put them), the examples,
#      the benchmark and the tests;
#   4. pytest: unit, property, Postgres (127.0.0.1:5432) and lifecycle tests (RabbitMQ on
#      127.0.0.1:5672 with its management API on 15672, guest);
#   5. when RELAY_BIN names the relay binary, the end-to-end tests against
#      `$RELAY_BIN demo --external-consumer` (tests/e2e, a few minutes; Postgres, Redis and
#      RabbitMQ on 127.0.0.1, and PostgreSQL's server binaries for a private store database).
# RELAY_CONSUMER_DIST=DIR keeps the built wheel and sdist there (clients/cross-check.sh uses it).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python=$(command -v python3.11 || command -v python3)
pip_quiet=(-q --disable-pip-version-check)

echo "ci.sh: building the wheel and the sdist (python -m build)"
"$python" -m venv "$work/build-venv"
"$work/build-venv/bin/pip" install "${pip_quiet[@]}" build
mkdir "$work/source"
(cd "$here" && tar --exclude=.mypy_cache --exclude=__pycache__ --exclude='*.egg-info' \
    --exclude=build --exclude=dist -cf - .) | tar -xf - -C "$work/source"
"$work/build-venv/bin/python" -m build --outdir "$work/dist" "$work/source" >"$work/build.log" 2>&1 ||
    { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/relay_consumer-*-py3-none-any.whl)
sdist=$(ls "$work"/dist/relay_consumer-*.tar.gz)
echo "ci.sh: built $(basename "$wheel") and $(basename "$sdist")"
if [ -n "${RELAY_CONSUMER_DIST:-}" ]; then
    mkdir -p "$RELAY_CONSUMER_DIST"
    cp "$wheel" "$sdist" "$RELAY_CONSUMER_DIST/"
fi

echo "ci.sh: installing the wheel (not the source tree) into a fresh venv"
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install "${pip_quiet[@]}" "$wheel[test]"
venv="$work/venv"
cd "$work" # src/ is not on the path from here
"$venv/bin/python" - <<'EOF'
import relay_consumer
assert "site-packages" in relay_consumer.__file__, relay_consumer.__file__
print(f"ci.sh: relay_consumer {relay_consumer.__version__} from {relay_consumer.__file__}")
EOF
"$venv/bin/relay-consumer" --version
"$venv/bin/python" -m relay_consumer --version

echo "ci.sh: mypy --strict (the installed package, the examples, the benchmark, the tests)"
# The installed package's files, copied out of site-packages (where mypy silences errors, the
# dependencies' included): exactly what the wheel holds.
installed=$("$venv/bin/python" -c 'import os, relay_consumer; print(os.path.dirname(relay_consumer.__file__))')
mkdir "$work/typed"
cp -r "$installed" "$work/typed/relay_consumer"
(cd "$work/typed" && "$venv/bin/mypy" --strict --config-file "$here/pyproject.toml" \
    --cache-dir "$work/mypy" relay_consumer)
"$venv/bin/mypy" --strict --config-file "$here/pyproject.toml" --cache-dir "$work/mypy" \
    "$here/examples" "$here/bench" "$here/tests"

export RELAY_CONSUMER_REQUIRE_INSTALLED=1
pytest=("$venv/bin/pytest" -p no:cacheprovider -c "$here/pyproject.toml" --rootdir "$here")
echo "ci.sh: unit, property, Postgres and lifecycle tests against the installed package"
"${pytest[@]}" -q -m 'not e2e' "$here/tests"
if [ -n "${RELAY_BIN:-}" ]; then
    if [ ! -x "$RELAY_BIN" ]; then
        echo "ci.sh: RELAY_BIN=$RELAY_BIN is not an executable file" >&2
        exit 1
    fi
    echo "ci.sh: the end-to-end tests against $RELAY_BIN demo --external-consumer"
    "${pytest[@]}" -q -m e2e -rA "$here/tests/e2e"
else
    echo "ci.sh: RELAY_BIN is not set: the end-to-end tests against a real relay are skipped"
fi
