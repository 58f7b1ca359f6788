"""End to end, the lifecycle of clients/README.md against a real relay (`relay demo
--external-consumer`), through the command a user runs (`python -m relay_consumer run`, the
installed package), into a store in a private Postgres server of the test's own:

* a wrong broker password ends ``run()`` with ``PermanentError(broker_auth)`` within seconds,
  and a wrong store password with ``PermanentError(store_auth)``;
* SIGTERM in the middle of a batch: the command exits 0 having finished and marked what it
  handed, and the one started after it hands nothing again;
* the store's database restarted mid-run (``pg_ctl restart -m fast``): reported, reconnected,
  carried on;
* the broker connection closed through RabbitMQ's management API mid-run: the same;
* at the end the store is the relay's copy: the positions its last changes, every notification
  handed once across the processes, ``relay-consumer verify`` exits 0; after one row of the
  store is changed, it exits 1 naming it.

Runs only with ``RELAY_BIN``; ``RELAY_CONSUMER_E2E_LIFECYCLE_SEED`` (default 57) seeds the demo.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    MANAGEMENT_AUTH,
    MANAGEMENT_URL,
    Demo,
    log,
    management,
    remove_demo_leftovers,
    tail,
)
from pgserver import PASSWORD, PASSWORD_ROLE, PrivatePostgres  # noqa: E402
from relay_consumer import Consumer, ErrorReport, MemoryStore, PermanentError, RelayApi  # noqa: E402
from relay_consumer.postgres import PostgresStore  # noqa: E402

RELAY_BIN = os.environ.get("RELAY_BIN", "")
PG_ADMIN = os.environ.get(
    "RELAY_CONSUMER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres"
)
SEED = int(os.environ.get("RELAY_CONSUMER_E2E_LIFECYCLE_SEED", "57"))
DURATION_S = int(os.environ.get("RELAY_CONSUMER_E2E_LIFECYCLE_DURATION_S", "30"))
KEEP_LOGS = os.environ.get("RELAY_CONSUMER_E2E_KEEP_LOGS")
SETTLE_TIMEOUT_S = 120
DRAIN_TIMEOUT_S = 120

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (RELAY_BIN and os.path.isfile(RELAY_BIN) and os.access(RELAY_BIN, os.X_OK)),
        reason="end to end against a real relay: set RELAY_BIN to the relay binary",
    ),
]


def relay_consumer_script() -> list[str]:
    """The installed console script beside this interpreter, else ``python -m``."""
    script = Path(sys.executable).parent / "relay-consumer"
    return [str(script)] if script.exists() else [sys.executable, "-m", "relay_consumer"]


class Command:
    """`python -m relay_consumer run` as a subprocess, started again and again (instances)."""

    def __init__(self, workdir: Path, env: dict[str, str], metrics_port: int) -> None:
        self.workdir = workdir
        self.env = env
        self.metrics_port = metrics_port
        self.process: asyncio.subprocess.Process | None = None
        self.instance = 0
        self.exits: dict[int, dict[str, Any]] = {}

    def out(self, instance: int) -> Path:
        return self.workdir / f"command-{instance}.out"

    def err(self, instance: int) -> Path:
        return self.workdir / f"command-{instance}.err"

    async def start(self) -> None:
        assert self.process is None or self.process.returncode is not None
        self.instance += 1
        with open(self.out(self.instance), "wb") as out, open(self.err(self.instance), "wb") as err:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "relay_consumer", "run",
                "--metrics-addr", f"127.0.0.1:{self.metrics_port}",
                stdout=out, stderr=err, env=self.env, cwd=str(self.workdir),
                start_new_session=True,
            )

    def stderr(self) -> str:
        return self.err(self.instance).read_text(errors="replace")

    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def wait_for_line(self, text: str, timeout_s: float, poll_s: float = 0.1) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.stderr():
            if not self.alive():
                raise AssertionError(f"instance {self.instance} exited before {text!r}:\n"
                                     f"{tail(self.err(self.instance))}")
            if time.monotonic() > deadline:
                raise AssertionError(f"instance {self.instance}: no {text!r} in {timeout_s} s:\n"
                                     f"{tail(self.err(self.instance))}")
            await asyncio.sleep(poll_s)

    async def terminate(self, timeout_s: float = 30) -> int | None:
        """SIGTERM; the exit code (None when it had to be killed); its stats line kept."""
        assert self.process is not None
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout_s)
            except asyncio.TimeoutError:
                self.process.kill()
                await self.process.wait()
                return None
        lines = self.out(self.instance).read_text().strip().splitlines()
        if lines:
            self.exits[self.instance] = json.loads(lines[-1])
        return self.process.returncode

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()

    def metrics(self) -> dict[str, float]:
        """The exposition's samples, by name with labels."""
        text = _get(f"http://127.0.0.1:{self.metrics_port}/metrics")[1]
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def health(self) -> tuple[int, dict[str, Any]]:
        status, body = _get(f"http://127.0.0.1:{self.metrics_port}/healthz")
        return status, (json.loads(body) if body else {})


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""


async def until(what: str, check: Any, timeout_s: float, poll_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await asyncio.to_thread(check)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout_s} s")
        await asyncio.sleep(poll_s)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_lifecycle_against_a_relay_through_the_command() -> None:
    ctx = f"[lifecycle, seed {SEED}]"
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="relay-consumer-lifecycle-"))
    pg = PrivatePostgres()
    demo = Demo(RELAY_BIN, workdir)
    command: Command | None = None
    demo_exit: int | None = -1
    passed = False
    try:
        pg.start()
        with psycopg.connect(pg.dsn(), autocommit=True) as admin:
            admin.execute("CREATE DATABASE copy")
            admin.execute(f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{PASSWORD}'")
            admin.execute(f"GRANT ALL ON DATABASE copy TO {PASSWORD_ROLE}")
        with psycopg.connect(pg.dsn("copy"), autocommit=True) as conn:
            conn.execute(f"GRANT ALL ON SCHEMA public TO {PASSWORD_ROLE}")
        store_dsn = pg.dsn("copy", PASSWORD_ROLE, PASSWORD)
        log(f"{ctx} private Postgres on port {pg.port}")

        rng = random.Random(SEED)
        await demo.start(seed=SEED, duration_s=DURATION_S, settle_timeout_s=SETTLE_TIMEOUT_S)
        started = await demo.event("started", 240)
        credentials = await demo.event("credentials", 30)
        amqp_url = str(credentials["tenant_amqp_url"])
        queue = str(credentials["queue"])
        api = RelayApi(str(started["api_base_url"]), str(credentials["tenant_token"]))
        endpoints = [str(e) for e in started["webhook_endpoint_ids"]] + [
            str(started["stories_endpoint_id"])
        ]
        log(f"{ctx} demo up: api {api.base}, queue {queue}")

        # (c) Permanent failures end run() within seconds, with the cause.
        await _permanent(ctx, _wrong_password(amqp_url), queue, MemoryStore(), "broker_auth")
        await _permanent(ctx, amqp_url, queue,
                         PostgresStore(pg.dsn("copy", PASSWORD_ROLE, "not-the-password")),
                         "store_auth")
        await _permanent(ctx, amqp_url, queue, PostgresStore(pg.dsn("no_such_database")),
                         "store_missing")

        # A backlog gathers while no consumer runs (notifications among it, now and then).
        await asyncio.sleep(8 + rng.uniform(0, 2))
        env = dict(
            os.environ, PYTHONUNBUFFERED="1", RELAY_AMQP_URL=amqp_url, RELAY_QUEUE=queue,
            RELAY_STORE_DSN=store_dsn, RELAY_API_URL=api.base, RELAY_API_TOKEN=api.token,
            RELAY_BATCH_MAX="8",
        )
        command = Command(workdir, env, _free_port())

        # (d) SIGTERM in the middle of a batch: exit 0, everything it handed marked.
        mid_batch = await _sigterm_mid_batch(ctx, command, store_dsn)

        # The next instance hands nothing again.
        await command.start()
        await command.wait_for_line("consuming ", 30)
        await until("a commit of the next instance",
                    lambda: command.metrics().get("relay_consumer_commits_total", 0) > 0, 30)

        # (b) The store's database restarted, while the workload still runs (a commit must
        # meet the lost connection).
        before = command.metrics()
        commit_before = command.health()[1].get("last_commit_at")
        pg.restart()
        log(f"{ctx} restarted the store's database (pg_ctl restart -m fast)")
        await until("the restart reported and carried through", lambda: (
            command.metrics().get('relay_consumer_errors_total{kind="transient"}', 0)
            > before.get('relay_consumer_errors_total{kind="transient"}', 0)
            and command.health()[1].get("status") == "ok"
            and command.health()[1].get("last_commit_at") != commit_before
        ), 60)
        assert command.metrics().get('relay_consumer_errors_total{kind="permanent"}') == 0

        # (a) The broker connection closed through the management API.
        reconnects = command.metrics().get("relay_consumer_reconnects_total", 0)
        name = f"relay-consumer (python) pid {command.process.pid if command.process else 0}"
        closed = await until("the command's broker connection listed",
                             lambda: _close_connections(name), 20, poll_s=0.5)
        log(f"{ctx} closed {closed} broker connection(s) named {name!r} (management API)")
        await until("the close reported and reconnected", lambda: (
            command.metrics().get("relay_consumer_reconnects_total", 0) > reconnects
            and "CONNECTION_FORCED" in command.stderr()
            and command.metrics().get("relay_consumer_up") == 1
            and command.health()[0] == 200
            and command.health()[1].get("status") == "ok"
        ), 30)

        # The demo's verdict, then the store at the relay's last changes.
        verdict = await demo.event("verdict", DURATION_S + SETTLE_TIMEOUT_S + 60)
        assert verdict["ok"] is True, f"{ctx} the demo's verdict: {json.dumps(verdict)}"
        await _drain(api, endpoints, store_dsn, command, ctx)
        code = await command.terminate()
        assert code == 0, f"{ctx} exit {code}:\n{tail(command.err(command.instance))}"

        # Every notification handed once across the instances (a store restart between a
        # handing and its mark may hand one again: the library's at-least-once window, said
        # in a line of its own).
        with psycopg.connect(store_dsn) as conn:
            recorded, unhanded = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE handed_at IS NULL) "
                "FROM relay_notifications"
            ).fetchone() or (0, 0)
        handed = sum(e["stats"]["notifications_handed"] for e in command.exits.values())
        marks_failed = sum(
            command.err(i).read_text(errors="replace").count("marking notifications handed failed")
            for i in range(1, command.instance + 1)
        )
        assert unhanded == 0 and recorded <= handed <= recorded + marks_failed, (
            f"{ctx} {recorded} notifications recorded, {handed} handed over "
            f"{command.instance} instances ({command.exits})"
        )
        log(f"{ctx} {recorded} notifications recorded, {handed} handed in all "
            f"({mid_batch} deliveries in the batch SIGTERM found)")

        # (e) verify: equal, then a row changed.
        await _verify(ctx, store_dsn, api, endpoints)

        demo_exit = await demo.terminate()
        assert demo_exit == 0, f"{ctx} the demo exited {demo_exit}:\n{tail(demo.stderr_path)}"
        log(f"{ctx} passed in {time.monotonic() - began:.0f} s")
        passed = True
    finally:
        if command is not None:
            await command.kill()
        if demo_exit == -1:
            demo_exit = await demo.terminate()
        if demo_exit != 0:
            remove_demo_leftovers(demo.events.get("started"), demo.events.get("credentials"),
                                  PG_ADMIN)
        pg.stop()
        if not passed:
            print(f"{ctx} demo stderr, last lines:\n{tail(demo.stderr_path, 30)}")
            if command is not None and command.instance:
                print(f"{ctx} command #{command.instance} stderr, last lines:\n"
                      f"{tail(command.err(command.instance), 30)}")
        if KEEP_LOGS:
            shutil.copytree(workdir, Path(KEEP_LOGS) / workdir.name)
        shutil.rmtree(workdir, ignore_errors=True)


def _wrong_password(amqp_url: str) -> str:
    scheme, rest = amqp_url.split("://", 1)
    userinfo, host = rest.split("@", 1)
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:not-the-password@{host}"


async def _permanent(ctx: str, amqp_url: str, queue: str, store: Any, kind: str) -> None:
    reports: list[ErrorReport] = []
    consumer = Consumer(amqp_url, queue, store, on_error=reports.append)
    began = time.monotonic()
    with pytest.raises(PermanentError) as raised:
        await asyncio.wait_for(consumer.run(), 15)
    took = time.monotonic() - began
    assert raised.value.cause_kind == kind, f"{ctx} {raised.value}"
    assert [(r.transient, r.cause_kind) for r in reports] == [(False, kind)], reports
    assert took < 10, f"{ctx} {kind} took {took:.1f} s"
    log(f"{ctx} {kind}: run() raised PermanentError in {took:.2f} s: {raised.value}")


async def _sigterm_mid_batch(ctx: str, command: Command, store_dsn: str) -> int:
    """Starts the command and sends SIGTERM as soon as it consumes, again until the signal
    finds a batch in hand (its log line says so): exit 0, and every notification it recorded
    is marked handed, so the next instance hands none again."""
    for attempt in range(1, 9):
        await command.start()
        await command.wait_for_line("consuming ", 60, poll_s=0.01)
        # Into the backlog: the first attempt at once, later ones a little further.
        await asyncio.sleep(0.05 * (attempt - 1))
        code = await command.terminate()
        err = command.stderr()
        assert code == 0, f"{ctx} SIGTERM: exit {code}:\n{tail(command.err(command.instance))}"
        found = re.search(r"stopping: finishing the batch in hand \((\d+) deliveries\)", err)
        with psycopg.connect(store_dsn) as conn:
            unhanded = conn.execute(
                "SELECT count(*) FROM relay_notifications WHERE handed_at IS NULL"
            ).fetchone()
        assert unhanded == (0,), f"{ctx} notifications left unhanded after SIGTERM: {unhanded}"
        stats = command.exits[command.instance]["stats"]
        if found:
            log(f"{ctx} SIGTERM found a batch of {found.group(1)} in hand (attempt {attempt}): "
                f"exit 0, {stats['commits']} commits, {stats['notifications_handed']} "
                "notifications handed and marked")
            return int(found.group(1))
        log(f"{ctx} SIGTERM found no batch in hand (attempt {attempt}): again")
    raise AssertionError(f"{ctx} SIGTERM never found a batch in hand")


def _close_connections(name: str) -> int:
    """Closes, as an operator would through the management API (DELETE
    /api/connections/<name>), the broker connections whose client-given name is ``name``: how
    many (none until the broker lists it, a few seconds after it opened)."""
    request = urllib.request.Request(MANAGEMENT_URL + "/api/connections")
    token = ":".join(MANAGEMENT_AUTH).encode()
    request.add_header("authorization", "Basic " + base64.b64encode(token).decode())
    with urllib.request.urlopen(request, timeout=10) as answer:
        rows = json.loads(answer.read())
    names = [
        str(row["name"]) for row in rows
        if (row.get("client_properties") or {}).get("connection_name") == name
    ]
    for broker_name in names:
        management("DELETE", f"/api/connections/{urllib.parse.quote(broker_name, safe='')}")
    return len(names)


async def _drain(api: RelayApi, endpoints: list[str], dsn: str, command: Command,
                 ctx: str) -> None:
    """Until the store's position of every endpoint is the relay's last change, nothing is
    held and nothing is left to hand."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        targets: dict[str, tuple[int, int]] = {}
        backlog = 0
        for endpoint in endpoints:
            state = await api.get(f"/v1/endpoints/{endpoint}/state")
            targets[endpoint] = (int(state["change_epoch"]), int(state["last_change_seq"]))
            backlog += int(state["outbox_backlog"])
        with psycopg.connect(dsn) as conn:
            positions = {
                e: (epoch, last) for e, epoch, last in conn.execute(
                    "SELECT endpoint_id::text, epoch, last_change_seq FROM relay_positions"
                ).fetchall()
            }
            held, unhanded = conn.execute(
                "SELECT (SELECT count(*) FROM relay_held), "
                "(SELECT count(*) FROM relay_notifications WHERE handed_at IS NULL)"
            ).fetchone() or (-1, -1)
        if backlog == 0 and held == 0 and unhanded == 0 and positions == targets:
            log(f"{ctx} drained to {targets}")
            return
        if not command.alive():
            raise AssertionError(f"{ctx} the command exited while draining:\n"
                                 f"{tail(command.err(command.instance))}")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{ctx} not drained in {DRAIN_TIMEOUT_S} s: relay at {targets} (backlog "
                f"{backlog}), store at {positions}, {held} held, {unhanded} unhanded"
            )
        await asyncio.sleep(0.5)


async def _verify(ctx: str, dsn: str, api: RelayApi, endpoints: list[str]) -> None:
    script = relay_consumer_script()
    flags = ["--store-dsn", dsn, "--api-url", api.base, "--api-token", api.token]

    async def run(*extra: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            *script, "verify", *flags, *extra,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode is not None
        return process.returncode, out.decode(), err.decode()

    code, out, err = await run()
    lines = out.strip().splitlines()
    assert code == 0, f"{ctx} verify exited {code}:\n{out}\n{err}"
    assert sorted(line.split(" ", 1)[0] for line in lines) == sorted(endpoints), lines
    assert all(" equal (" in line for line in lines), lines
    log(f"{ctx} verify: exit 0\n" + "\n".join(lines))
    # One row of the store changed: a difference, named.
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT endpoint_id::text, subject FROM relay_items WHERE NOT tombstone "
            "ORDER BY endpoint_id, subject LIMIT 1"
        ).fetchone()
        assert row is not None, f"{ctx} no item in the store"
        conn.execute(
            """UPDATE relay_items SET item = item || '{"corrupted": true}'::jsonb """
            "WHERE endpoint_id = %s AND subject = %s",
            row,
        )
    code, out, err = await run()
    assert code == 1, f"{ctx} verify after a row changed exited {code}:\n{out}\n{err}"
    assert f"{row[0]} differs: items 1 different ({row[1]}: item)" in out, out
    log(f"{ctx} verify after {row[1]} of {row[0]} was changed: exit 1, "
        f"{[line for line in out.splitlines() if 'differs' in line]}")
