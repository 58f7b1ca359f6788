"""The command (``python -m relay_consumer``, ``relay-consumer``) as a subprocess: ``verify``
against a made-up relay API serving the store's own copy (equal: 0, a row changed: 1, an error:
2), and ``run`` against RabbitMQ (SIGTERM: 0 with its stats; a wrong password: 2 with the cause;
/metrics and /healthz served)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import psycopg
import pytest

from broker import AMQP_URL, OwnQueue, free_port
from builders import FEED, STORIES, feed, story
from relay_consumer import __version__
from relay_consumer.errors import classify
from relay_consumer.postgres import PostgresStore
from test_stores import feed_all

TOKEN = "tenant-token"


class FakeApi:
    """The relay's read API for one tenant, serving what the test puts in ``copies``."""

    def __init__(self) -> None:
        self.copy: dict[str, list[dict[str, Any]]] = {}
        self.stories: dict[str, list[dict[str, Any]]] = {}
        self.notifications: dict[str, list[dict[str, Any]]] = {}
        self.fail = False
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                if self.headers.get("authorization") != f"Bearer {TOKEN}":
                    return self.answer(401, {"error": "unauthorized"})
                if api.fail:
                    return self.answer(500, {"error": "internal"})
                url = urllib.parse.urlparse(self.path)
                parts = url.path.strip("/").split("/")
                if parts == ["v1", "endpoints"]:
                    rows = [{"id": e} for e in sorted(set(api.copy) | set(api.stories))]
                elif len(parts) == 4 and parts[:2] == ["v1", "endpoints"]:
                    table = {"copy": api.copy, "stories": api.stories,
                             "notifications": api.notifications}.get(parts[3])
                    if table is None:
                        return self.answer(404, {"error": "not found"})
                    rows = table.get(parts[2], [])
                else:
                    return self.answer(404, {"error": "not found"})
                self.answer(200, {"data": rows, "next_cursor": None})

            def answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()
    try:
        yield fake
    finally:
        fake.close()


def command(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay_consumer", *args],
        capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ),
    )


async def filled_store(dsn: str) -> None:
    store = await PostgresStore.open(dsn)
    try:
        await feed_all(store, [
            feed(1, subject="announcement:1", item={"a": 1}),
            feed(2, subject="announcement:2", item={"b": 1}),
            feed(3, "remove", subject="announcement:2"),
            story(1, "saved", "st_1", 1),
            story(2, "closed", "st_2", 3, merged_into="st_1"),
            story(3, "notified", "st_1", 1),
        ])
    finally:
        await store.close()


def relay_copy(api: FakeApi) -> None:
    """What the relay serves for the store above."""
    api.copy[FEED] = [
        {"subject": "announcement:1", "item_kind": "announcement", "generation": 99,
         "sequence": "0000000001.0000000001", "tombstone": False, "item": {"a": 1}},
    ]
    api.stories[STORIES] = [
        {"id": "st_1", "ticker": "ALFA B", "version": 1, "closed": False, "merged_into": None,
         "story": {"id": "st_1", "ticker": "ALFA B", "version": 1}},
        {"id": "st_2", "ticker": "ALFA B", "version": 3, "closed": True, "merged_into": "st_1",
         "story": None},
    ]
    api.notifications[STORIES] = [
        {"key": "strong:st_1", "story_id": "st_1", "event_id": "evt_1_3", "notified": True},
        {"key": "strong:st_9", "story_id": "st_9", "event_id": "evt_0", "notified": False},
    ]


async def test_verify_is_0_when_equal_1_on_a_difference_and_2_on_an_error(
    pg_database: str, api: FakeApi
) -> None:
    await filled_store(pg_database)
    relay_copy(api)
    flags = ["--store-dsn", pg_database, "--api-url", api.url, "--api-token", TOKEN]
    done = await asyncio.to_thread(command, "verify", *flags)
    assert done.returncode == 0, done
    lines = done.stdout.splitlines()
    assert sorted(lines) == sorted([
        f"{STORIES} equal (0 items, 2 stories, 1 notifications)",
        f"{FEED} equal (1 items, 0 stories, 0 notifications)",
    ]), lines
    # From the environment, one endpoint named.
    env = dict(os.environ, RELAY_STORE_DSN=pg_database, RELAY_API_URL=api.url,
               RELAY_API_TOKEN=TOKEN)
    done = await asyncio.to_thread(command, "verify", "--endpoint", FEED, env=env)
    assert done.returncode == 0 and done.stdout.startswith(f"{FEED} equal"), done
    # The relay's row raised to a later read of the same item (no change sent): equal; its
    # row at an earlier position than the store's: a difference of sequence.
    api.copy[FEED][0]["sequence"] = "0000000001.0000000009"
    done = await asyncio.to_thread(command, "verify", "--endpoint", FEED, *flags)
    assert done.returncode == 0, done
    assert done.stdout == f"{FEED} equal (1 items, 1 raised by the relay, 0 stories, 0 notifications)\n"
    api.copy[FEED][0].update(generation=1, sequence="0000000001.0000000000")
    done = await asyncio.to_thread(command, "verify", "--endpoint", FEED, *flags)
    assert done.returncode == 1, done
    assert f"{FEED} differs: items 1 different (announcement:1: sequence)" in done.stdout
    api.copy[FEED][0].update(generation=99, sequence="0000000001.0000000001")
    # One row changed in the store.
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute("""UPDATE relay_items SET item = '{"a": 2}' WHERE subject = 'announcement:1'""")
        conn.execute("UPDATE relay_stories SET merged_into = NULL WHERE story_id = 'st_2'")
    done = await asyncio.to_thread(command, "verify", *flags)
    assert done.returncode == 1, done
    assert f"{FEED} differs: items 1 different (announcement:1: item)" in done.stdout, done.stdout
    assert f"{STORIES} differs: stories 1 different (st_2: merged_into)" in done.stdout
    # A tombstone at the relay and none in the store is no difference; a missing item is.
    api.copy[FEED].append({"subject": "announcement:7", "item_kind": "announcement",
                           "sequence": "x", "tombstone": False, "item": {}})
    done = await asyncio.to_thread(command, "verify", "--endpoint", FEED, *flags)
    assert done.returncode == 1 and "1 missing (announcement:7)" in done.stdout, done.stdout
    # Errors: the API failing, the store's database missing, a flag missing.
    api.fail = True
    done = await asyncio.to_thread(command, "verify", *flags)
    assert done.returncode == 2 and "500" in done.stderr, done
    api.fail = False
    missing = pg_database.rsplit("/", 1)[0] + "/relay_consumer_test_no_such_database"
    done = await asyncio.to_thread(
        command, "verify", "--store-dsn", missing, "--api-url", api.url, "--api-token", TOKEN
    )
    assert done.returncode == 2 and "store_missing" in done.stderr, done
    done = await asyncio.to_thread(command, "verify", "--store-dsn", pg_database,
                                   env={k: v for k, v in os.environ.items()
                                        if not k.startswith("RELAY_")})
    assert done.returncode == 2 and "--api-url" in done.stderr, done


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


async def test_run_serves_metrics_and_health_and_exits_0_on_sigterm(pg_database: str) -> None:
    port = free_port()
    async with OwnQueue() as queue:
        await queue.publish([feed(seq, subject=f"announcement:{seq % 5}") for seq in range(1, 31)])
        env = dict(os.environ, RELAY_AMQP_URL=AMQP_URL, RELAY_QUEUE=queue.name,
                   RELAY_STORE_DSN=pg_database, RELAY_BATCH_MAX="4")
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "relay_consumer", "run", "--metrics-addr", f"127.0.0.1:{port}",
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                status, text = await asyncio.to_thread(
                    http_get, f"http://127.0.0.1:{port}/metrics"
                ) if await port_open(port) else (0, "")
                if f'relay_consumer_last_change_seq{{endpoint="{FEED}"}} 30' in text:
                    break
                assert time.monotonic() < deadline, text
                await asyncio.sleep(0.2)
            assert status == 200 and "relay_consumer_up 1" in text
            status, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/healthz")
            health = json.loads(body)
            assert status == 200 and health["status"] == "ok" and health["connected"] is True
            assert health["last_commit_at"] and health["last_error"] is None
            assert (await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/nope"))[0] == 404
            process.send_signal(signal.SIGTERM)
            out, err = await asyncio.wait_for(process.communicate(), 20)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 0, err.decode()
    exited = json.loads(out.decode().strip().splitlines()[-1])
    assert exited["event"] == "exited" and exited["code"] == 0
    assert exited["stats"]["deliveries"] == 30
    assert exited["stats"]["endpoints"][FEED]["last_change_seq"] == 30
    assert "consuming relay-consumer-test-" in err.decode()


async def port_open(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


async def test_run_with_a_wrong_password_exits_2_with_the_cause_within_seconds(
    pg_database: str,
) -> None:
    wrong = AMQP_URL.replace("guest:guest@", "guest:wrong@")
    began = time.monotonic()
    async with OwnQueue() as queue:
        done = await asyncio.to_thread(
            command, "run", "--amqp-url", wrong, "--queue", queue.name, "--store-dsn", pg_database,
            timeout=30,
        )
    assert done.returncode == 2, done
    assert "permanent failure (broker_auth)" in done.stderr and "ACCESS_REFUSED" in done.stderr
    assert time.monotonic() - began < 15


def test_the_command_answers_its_version_and_refuses_missing_settings() -> None:
    done = command("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"relay-consumer {__version__}"
    bare = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    done = command("run", "--queue", "q", env=bare)
    assert done.returncode == 2 and "--amqp-url (or RELAY_AMQP_URL) is required" in done.stderr
    done = command("run", "--amqp-url", AMQP_URL, "--queue", "q", "--store-dsn", "x",
                   "--api-url", "http://x", env=bare)
    assert done.returncode == 2 and "go together" in done.stderr
    script = Path(sys.executable).parent / "relay-consumer"
    if script.exists():  # installed (not run from a checkout without the package installed)
        done = subprocess.run([str(script), "--version"], capture_output=True, text=True)
        assert done.stdout.strip() == f"relay-consumer {__version__}"


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ('connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  '
         'database "x" does not exist', "store_missing"),
        ('connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  '
         'password authentication failed for user "u"', "store_auth"),
        ('connection failed: FATAL:  role "nobody" does not exist', "store_auth"),
        ('connection failed: FATAL:  no pg_hba.conf entry for host "127.0.0.1"', "store_auth"),
        ("connection failed: Connection refused", "transient"),
        ("consuming input failed: terminating connection due to administrator command",
         "transient"),
    ],
)
def test_a_store_failure_is_classified_by_its_cause(message: str, kind: str) -> None:
    assert classify(psycopg.OperationalError(message)) == kind


PACKAGE = Path(__file__).resolve().parents[1]


def test_the_readmes_quick_start_is_examples_quickstart_py() -> None:
    readme = (PACKAGE / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert block == (PACKAGE / "examples" / "quickstart.py").read_text()


async def test_the_quick_start_runs_as_a_program_and_stops_on_sigterm(pg_database: str) -> None:
    async with OwnQueue() as queue:
        await queue.publish([
            feed(1, subject="announcement:1"),
            story(1, "saved", "st_1"),
            story(2, "notified", "st_1"),
        ])
        env = dict(os.environ, RELAY_AMQP_URL=AMQP_URL, RELAY_QUEUE=queue.name,
                   RELAY_STORE_DSN=pg_database, PYTHONUNBUFFERED="1")
        env.pop("RELAY_API_URL", None)
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(PACKAGE / "examples" / "quickstart.py"), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert process.stdout is not None
            line = await asyncio.wait_for(process.stdout.readline(), 30)
            assert line.decode().startswith(f"strong story st_1 (ALFA B), key {STORIES}:1:2")
            process.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(process.communicate(), 20)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.returncode == 0, err.decode()
        assert "consumer stopped" in err.decode()
    with psycopg.connect(pg_database) as conn:
        assert conn.execute(
            "SELECT count(*) FROM relay_notifications WHERE handed_at IS NOT NULL"
        ).fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM relay_items").fetchone() == (1,)
