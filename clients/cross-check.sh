#!/usr/bin/env bash
# The two consumer libraries as one design (clients/README.md): one library's store read by the
# other's `verify`, both installed as a user installs them.
#
#   RELAY_BIN=target/debug/relay clients/cross-check.sh
#
# 1. Builds and installs, each into a temporary directory: the Python wheel (`python -m build`
#    from a copy of clients/python; or RELAY_CONSUMER_PY_WHEEL=<wheel>) into a fresh venv, and
#    the TypeScript tarball (`npm pack` from a copy of clients/typescript after `npm ci`; or
#    RELAY_CONSUMER_TS_TARBALL=<tgz>) into a fresh npm project, run as `npx relay-consumer`.
# 2. Runs one `$RELAY_BIN demo --external-consumer --faults all` (its own database, tenant and
#    queue; SEED, DURATION_S from RELAY_CROSS_CHECK_SEED, RELAY_CROSS_CHECK_DURATION_S).
# 3. TypeScript writes: `npx relay-consumer run` consumes the demo's queue into store A (a
#    fresh database on 127.0.0.1:5432; the installed package's bin, which npx runs, started
#    directly so that SIGTERM reaches it) until the demo's verdict is in and A is at the relay's
#    last change of every endpoint (nothing held, nothing left to hand); SIGTERM, exit 0.
# 4. Python writes: every endpoint's changes are asked for again from change 1
#    (`POST /v1/endpoints/{id}/replay`, the same epoch), and `relay-consumer run` (Python)
#    consumes them into store B the same way; SIGTERM, exit 0.
# 5. Reads across: Python's `relay-consumer verify` on A and TypeScript's `npx relay-consumer
#    verify` on B (and each library's own verify on its own store), then A and B compared row
#    by row (items without tombstones, stories, notifications, positions).
# Exit 0 when every verify said equal and A equals B, 1 on any difference, 2 when it could not
# compare (a build, the demo or a consumer failing). Everything it made is removed at the end
# (RELAY_CROSS_CHECK_KEEP=DIR keeps the logs there).
set -Eeuo pipefail
trap 'exit 2' ERR # a step that fails is "could not compare", not a difference
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${RELAY_BIN:-}" ] || [ ! -x "$RELAY_BIN" ]; then
    echo "cross-check: set RELAY_BIN to the relay binary (e.g. target/debug/relay)" >&2
    exit 2
fi
RELAY_BIN=$(cd "$(dirname "$RELAY_BIN")" && pwd)/$(basename "$RELAY_BIN")
pg_admin=${RELAY_CONSUMER_TEST_PG:-postgresql://postgres@127.0.0.1:5432/postgres}
seed=${RELAY_CROSS_CHECK_SEED:-61}
duration=${RELAY_CROSS_CHECK_DURATION_S:-20}
work=$(mktemp -d "${TMPDIR:-/tmp}/relay-cross-check.XXXXXX")
tag=$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')
db_a="relay_xcheck_${tag}_ts"
db_b="relay_xcheck_${tag}_py"
dsn_a="${pg_admin%/*}/$db_a"
dsn_b="${pg_admin%/*}/$db_b"
demo_pid=""
consumer_pid=""
started_at=$(date +%s)

say() { printf '[cross-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { say "$*" >&2; exit 2; }

cleanup() {
    local code=$?
    set +e
    if [ -n "$consumer_pid" ] && kill -0 "$consumer_pid" 2>/dev/null; then
        kill -KILL "$consumer_pid" 2>/dev/null
        wait "$consumer_pid" 2>/dev/null
    fi
    if [ -n "$demo_pid" ] && kill -0 "$demo_pid" 2>/dev/null; then
        kill -TERM "$demo_pid" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$demo_pid" 2>/dev/null || break; sleep 1; done
        kill -KILL "$demo_pid" 2>/dev/null
        wait "$demo_pid" 2>/dev/null
    fi
    if [ -x "$work/py/bin/python" ]; then
        "$work/py/bin/python" "$work/xcheck.py" drop "$pg_admin" "$db_a" "$db_b" 2>/dev/null
    fi
    if [ $code -ne 0 ]; then
        for log in "$work"/*.err; do
            [ -f "$log" ] || continue
            echo "--- last lines of $(basename "$log")" >&2
            tail -n 25 "$log" >&2
        done
    fi
    if [ -n "${RELAY_CROSS_CHECK_KEEP:-}" ]; then
        mkdir -p "$RELAY_CROSS_CHECK_KEEP"
        cp "$work"/*.out "$work"/*.err "$RELAY_CROSS_CHECK_KEEP"/ 2>/dev/null
    fi
    rm -rf "$work"
    exit $code
}
trap cleanup EXIT
trap 'exit 2' INT TERM

# -- the packages, installed ---------------------------------------------------------------------

python=$(command -v python3.11 || command -v python3)
say "Python: the wheel (built here unless RELAY_CONSUMER_PY_WHEEL names one), installed into a fresh venv"
"$python" -m venv "$work/py"
if [ -n "${RELAY_CONSUMER_PY_WHEEL:-}" ]; then
    wheel=$RELAY_CONSUMER_PY_WHEEL
else
    "$python" -m venv "$work/build-venv"
    "$work/build-venv/bin/pip" install -q --disable-pip-version-check build
    mkdir "$work/py-source"
    (cd "$root/clients/python" && tar --exclude=.mypy_cache --exclude=__pycache__ \
        --exclude='*.egg-info' --exclude=build --exclude=dist -cf - .) | tar -xf - -C "$work/py-source"
    "$work/build-venv/bin/python" -m build --wheel --outdir "$work/dist" "$work/py-source" \
        >"$work/py-build.out" 2>"$work/py-build.err" || fail "the wheel did not build"
    wheel=$(ls "$work"/dist/relay_consumer-*.whl)
fi
"$work/py/bin/pip" install -q --disable-pip-version-check "$wheel"
py() { "$work/py/bin/relay-consumer" "$@"; }
say "Python: $(py --version) from $(basename "$wheel")"

say "TypeScript: the tarball (packed here unless RELAY_CONSUMER_TS_TARBALL names one), installed into a fresh npm project"
if [ -n "${RELAY_CONSUMER_TS_TARBALL:-}" ]; then
    tarball=$RELAY_CONSUMER_TS_TARBALL
else
    mkdir -p "$work/ts-source" "$work/dist"
    (cd "$root/clients/typescript" && tar --exclude=node_modules --exclude=dist -cf - .) |
        tar -xf - -C "$work/ts-source"
    (cd "$work/ts-source" && npm ci --no-audit --no-fund --loglevel=error >"$work/ts-build.out" \
        2>"$work/ts-build.err" && npm pack --pack-destination "$work/dist" >>"$work/ts-build.out" \
        2>>"$work/ts-build.err") || fail "the TypeScript tarball did not pack"
    tarball=$(ls "$work"/dist/*.tgz)
fi
mkdir "$work/ts-app"
(cd "$work/ts-app" && npm init -y >/dev/null &&
    npm install --no-audit --no-fund --loglevel=error "$tarball" >"$work/ts-install.out" \
        2>"$work/ts-install.err") || fail "the TypeScript tarball did not install"
ts() { (cd "$work/ts-app" && npx --no-install relay-consumer "$@"); }
say "TypeScript: $(ts --version) from $(basename "$tarball")"

# The helper: the demo's lines, the relay's API and the stores (the installed Python package's
# dependencies: psycopg; its RelayApi).
cat >"$work/xcheck.py" <<'EOF'
import asyncio, json, sys, time
import psycopg
from relay_consumer import RelayApi

def event(path, name, timeout):
    deadline = time.monotonic() + float(timeout)
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row, dict) and row.get("event") == name:
                        print(json.dumps(row))
                        return 0
        except FileNotFoundError:
            pass
        time.sleep(0.2)
    print(f"no {name!r} line from the demo in {timeout} s", file=sys.stderr)
    return 1

async def pages(api, path):
    rows, after = [], None
    while True:
        query = "limit=500" + (f"&after={after}" if after else "")
        page = await api.get(f"{path}?{query}")
        rows += page["data"]
        after = page.get("next_cursor")
        if not after:
            return rows

async def drain(dsn, url, token, timeout, pid):
    api = RelayApi(url, token)
    endpoints = [e["id"] for e in await pages(api, "/v1/endpoints")]
    deadline = time.monotonic() + float(timeout)
    while True:
        targets, backlog = {}, 0
        for e in endpoints:
            state = await api.get(f"/v1/endpoints/{e}/state")
            targets[e] = (int(state["change_epoch"]), int(state["last_change_seq"]))
            backlog += int(state["outbox_backlog"])
        try:
            with psycopg.connect(dsn) as conn:
                positions = {e: (a, b) for e, a, b in conn.execute(
                    "SELECT endpoint_id::text, epoch, last_change_seq FROM relay_positions")}
                held, unhanded = conn.execute(
                    "SELECT (SELECT count(*) FROM relay_held), (SELECT count(*) FROM "
                    "relay_notifications WHERE handed_at IS NULL)").fetchone()
        except psycopg.Error as error:
            positions, held, unhanded = {}, -1, -1
        if backlog == 0 and held == 0 and unhanded == 0 and positions == targets:
            print(json.dumps({e: list(t) for e, t in targets.items()}))
            return 0
        try:
            import os
            os.kill(int(pid), 0)
        except OSError:
            print("the consumer exited while draining", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print(f"not drained in {timeout} s: relay {targets} (backlog {backlog}), store "
                  f"{positions}, {held} held, {unhanded} unhanded", file=sys.stderr)
            return 1
        await asyncio.sleep(0.5)

async def replay(url, token):
    api = RelayApi(url, token)
    for e in await pages(api, "/v1/endpoints"):
        answer = await api.replay(e["id"], 1)
        print(f"replay of {answer.endpoint_id}: epoch {answer.epoch}, changes "
              f"{answer.from_change_seq}-{answer.through_change_seq}")
        if answer.from_change_seq != 1:
            print("not from change 1", file=sys.stderr)
            return 1
    return 0

QUERIES = {
    "items": "SELECT endpoint_id::text, subject, item_kind, sequence, item FROM relay_items "
             "WHERE NOT tombstone",
    "stories": "SELECT endpoint_id::text, story_id, ticker, version, closed, merged_into, story "
               "FROM relay_stories",
    "notifications": "SELECT endpoint_id::text, story_id, event_id, handed_at IS NOT NULL "
                     "FROM relay_notifications",
    "positions": "SELECT endpoint_id::text, epoch, last_change_seq FROM relay_positions",
    "held": "SELECT endpoint_id::text, epoch, change_seq FROM relay_held",
}

def compare(a, b):
    differ = 0
    with psycopg.connect(a) as ca, psycopg.connect(b) as cb:
        for name, sql in QUERIES.items():
            ra = {json.dumps(r, default=str, sort_keys=True) for r in ca.execute(sql)}
            rb = {json.dumps(r, default=str, sort_keys=True) for r in cb.execute(sql)}
            if ra == rb:
                print(f"{name}: {len(ra)} rows, the same in both stores")
            else:
                differ = 1
                print(f"{name}: {len(ra - rb)} rows only in the TypeScript store "
                      f"{sorted(ra - rb)[:3]}, {len(rb - ra)} only in the Python store "
                      f"{sorted(rb - ra)[:3]}")
    return differ

def create(admin, *names):
    with psycopg.connect(admin, autocommit=True) as conn:
        for n in names:
            conn.execute(f'CREATE DATABASE "{n}"')
    return 0

def drop(admin, *names):
    with psycopg.connect(admin, autocommit=True) as conn:
        for n in names:
            conn.execute(f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)')
    return 0

command, args = sys.argv[1], sys.argv[2:]
if command == "event":
    sys.exit(event(*args))
if command == "field":
    print(json.loads(args[0])[args[1]])
    sys.exit(0)
if command == "drain":
    sys.exit(asyncio.run(drain(*args)))
if command == "replay":
    sys.exit(asyncio.run(replay(*args)))
if command == "compare":
    sys.exit(compare(*args))
if command == "create":
    sys.exit(create(*args))
if command == "drop":
    sys.exit(drop(*args))
sys.exit(f"unknown helper command {command}")
EOF
helper() { "$work/py/bin/python" "$work/xcheck.py" "$@"; }

# -- the demo ------------------------------------------------------------------------------------

helper create "$pg_admin" "$db_a" "$db_b"
say "starting $RELAY_BIN demo --external-consumer (seed $seed, $duration s)"
RELAY_DATABASE_URL=${RELAY_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres} \
RELAY_LOG_FORMAT=text RUST_LOG=${RUST_LOG:-warn} \
    "$RELAY_BIN" demo --external-consumer --duration-s "$duration" --faults all --seed "$seed" \
    --settle-timeout-s 120 --listen 127.0.0.1:0 --api-listen 127.0.0.1:0 \
    --metrics-listen 127.0.0.1:0 >"$work/demo.out" 2>"$work/demo.err" &
demo_pid=$!
started=$(helper event "$work/demo.out" started 240) || fail "the demo did not start"
credentials=$(helper event "$work/demo.out" credentials 30) || fail "no credentials line"
export RELAY_AMQP_URL RELAY_QUEUE RELAY_API_URL RELAY_API_TOKEN
RELAY_AMQP_URL=$(helper field "$credentials" tenant_amqp_url)
RELAY_QUEUE=$(helper field "$credentials" queue)
RELAY_API_URL=$(helper field "$started" api_base_url)
RELAY_API_TOKEN=$(helper field "$credentials" tenant_token)
say "demo up: API $RELAY_API_URL, queue $RELAY_QUEUE"

# run_consumer NAME DSN COMMAND...: runs the command until the store is drained, then SIGTERM.
run_consumer() {
    local name=$1 dsn=$2
    shift 2
    RELAY_STORE_DSN=$dsn "$@" >"$work/$name.out" 2>"$work/$name.err" &
    consumer_pid=$!
    if [ "$name" = typescript-run ]; then
        helper event "$work/demo.out" verdict $((duration + 240)) >"$work/verdict.json" ||
            fail "no verdict from the demo"
        grep -q '"ok": *true' "$work/verdict.json" || fail "the demo's verdict is not ok: $(cat "$work/verdict.json")"
    fi
    helper drain "$dsn" "$RELAY_API_URL" "$RELAY_API_TOKEN" 180 "$consumer_pid" >"$work/$name.drained" ||
        fail "$name did not bring its store to the relay's last changes"
    kill -TERM "$consumer_pid"
    local code=0
    wait "$consumer_pid" || code=$?
    consumer_pid=""
    [ $code -eq 0 ] || fail "$name exited $code on SIGTERM"
    say "$name: the store is at the relay's last change of every endpoint; SIGTERM: exit 0"
}

say "TypeScript writes: relay-consumer run (the tarball's bin, as npx runs it) into $db_a"
# The bin npx resolves, run directly: npx itself exits on SIGTERM without waiting for the
# command it started, which would leave the consumer running unsignalled.
run_consumer typescript-run "$dsn_a" "$work/ts-app/node_modules/.bin/relay-consumer" run

say "asking the relay for every endpoint's changes again, from change 1"
helper replay "$RELAY_API_URL" "$RELAY_API_TOKEN" >"$work/replay.out" ||
    fail "the replays were not taken: $(cat "$work/replay.out")"
sed 's/^/  /' "$work/replay.out"
say "Python writes: relay-consumer run into $db_b"
run_consumer python-run "$dsn_b" "$work/py/bin/relay-consumer" run

# -- the reads across ----------------------------------------------------------------------------

differences=0
verify() { # WHO WHOSE-STORE DSN
    local who=$1 whose=$2 dsn=$3 code=0
    say "$who verify of the $whose store:"
    if [ "$who" = Python ]; then
        py verify --store-dsn "$dsn" >"$work/verify.out" 2>"$work/verify.err" || code=$?
    else
        ts verify --store-dsn "$dsn" >"$work/verify.out" 2>"$work/verify.err" || code=$?
    fi
    sed 's/^/  /' "$work/verify.out"
    if [ $code -ne 0 ]; then
        sed 's/^/  /' "$work/verify.err"
        say "$who verify of the $whose store: exit $code"
        if [ $code -eq 1 ]; then differences=1; else fail "$who verify could not compare"; fi
    fi
}
verify Python TypeScript "$dsn_a"
verify TypeScript Python "$dsn_b"
verify TypeScript TypeScript "$dsn_a"
verify Python Python "$dsn_b"
say "the two stores, row by row:"
helper compare "$dsn_a" "$dsn_b" | sed 's/^/  /' || differences=1

kill -TERM "$demo_pid"
demo_code=0
wait "$demo_pid" || demo_code=$?
demo_pid=""
[ $demo_code -eq 0 ] || fail "the demo exited $demo_code on SIGTERM"
if [ $differences -ne 0 ]; then
    say "DIFFERENT: a store read by the other library differs (in $(($(date +%s) - started_at)) s)"
    exit 1
fi
say "equal: each library's store read by the other's verify, and the two stores row by row (in $(($(date +%s) - started_at)) s)"
