"""What the end-to-end test drives: `relay demo --external-consumer`, the consumer as a
subprocess killed and started again, a scrambler on the same queue, the relay's API, and the
clean-up of everything made (even when the test fails)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
import psycopg

from relay_consumer import RelayApi, ReplayError, ResyncAnswer

HERE = Path(__file__).resolve().parent
PACKAGE = HERE.parent.parent
MANAGEMENT_URL = os.environ.get("RELAY_CONSUMER_E2E_MANAGEMENT_URL", "http://127.0.0.1:15672")
MANAGEMENT_AUTH = ("guest", "guest")
#: The broker URL of a user that may publish to the tenant's queue (the scrambler's duplicates).
ADMIN_AMQP_URL = os.environ.get("RELAY_CONSUMER_E2E_ADMIN_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")


def log(message: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {message}", flush=True)


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path} unreadable)"
    return "\n".join(text[-lines:])


# -- the demo ------------------------------------------------------------------------------------


class Demo:
    """`relay demo --external-consumer` with every listener on a port of the system's choosing;
    its JSON lines on stdout are kept by event name."""

    def __init__(self, relay_bin: str, workdir: Path) -> None:
        self.relay_bin = relay_bin
        self.workdir = workdir
        self.stderr_path = workdir / "demo.err"
        self.process: asyncio.subprocess.Process | None = None
        self.events: dict[str, dict[str, Any]] = {}
        self._seen = asyncio.Condition()
        self._reader: asyncio.Task[None] | None = None

    async def start(self, *, seed: int, duration_s: int, settle_timeout_s: int,
                    backup_at_s: int | None = None, restore_at_s: int | None = None) -> None:
        """The demo backs its database up at `backup_at_s` and restores it at `restore_at_s`
        (docs/restore.md's steps: every tier stopped, `pg_restore`, `relay restored`, the tiers
        started again at the same addresses, each feed endpoint rewound)."""
        env = dict(os.environ)
        env.setdefault("RELAY_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
        env.setdefault("RELAY_LOG_FORMAT", "text")
        env.setdefault("RUST_LOG", "warn")
        args = [
            self.relay_bin, "demo", "--external-consumer",
            "--duration-s", str(duration_s),
            "--faults", "all",
            "--seed", str(seed),
            "--settle-timeout-s", str(settle_timeout_s),
            "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0",
        ]
        if backup_at_s is not None and restore_at_s is not None:
            args += ["--backup-at-s", str(backup_at_s), "--restore-at-s", str(restore_at_s)]
        log("starting " + " ".join(args))
        with open(self.stderr_path, "wb") as err:
            self.process = await asyncio.create_subprocess_exec(
                *args, stdout=asyncio.subprocess.PIPE, stderr=err, env=env,
                start_new_session=True,
            )
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        with open(self.workdir / "demo.out", "ab") as out:
            async for raw in self.process.stdout:
                out.write(raw)
                out.flush()
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict) and "event" in line:
                    async with self._seen:
                        self.events.setdefault(str(line["event"]), line)
                        self._seen.notify_all()
        async with self._seen:
            self._seen.notify_all()

    async def event(self, name: str, timeout_s: float) -> dict[str, Any]:
        """The first `name` line, waiting for it; fails if the demo exits first."""
        deadline = time.monotonic() + timeout_s
        async with self._seen:
            while name not in self.events:
                if self.process is None or self.process.returncode is not None or (
                    self._reader is not None and self._reader.done()
                ):
                    raise AssertionError(
                        f"the demo exited before its {name!r} line:\n{tail(self.stderr_path)}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"no {name!r} line from the demo within {timeout_s} s:\n"
                        f"{tail(self.stderr_path)}"
                    )
                try:
                    await asyncio.wait_for(self._seen.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass
            return self.events[name]

    def has(self, name: str) -> bool:
        return name in self.events

    async def terminate(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`: the exit code (None when it had to be
        killed)."""
        if self.process is None:
            return None
        if self.process.returncode is not None:
            return self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.process.wait(), timeout_s)
        except asyncio.TimeoutError:
            self.process.kill()
            await self.process.wait()
            return None
        finally:
            if self._reader is not None:
                try:
                    await asyncio.wait_for(self._reader, 5)
                except (asyncio.TimeoutError, Exception):
                    self._reader.cancel()


# -- the consumer, as a subprocess ---------------------------------------------------------------


@dataclass
class ConsumerProcesses:
    """The consumer started as a subprocess again and again; each start is an instance."""

    command: list[str]
    workdir: Path
    env: dict[str, str]
    current: asyncio.subprocess.Process | None = None
    instance: int = 0
    killed: list[int] = field(default_factory=list)
    exits: dict[int, int] = field(default_factory=dict)

    def stdout_path(self, instance: int) -> Path:
        return self.workdir / f"consumer-{instance}.out"

    def stderr_path(self, instance: int) -> Path:
        return self.workdir / f"consumer-{instance}.err"

    async def start(self) -> None:
        assert self.current is None or self.current.returncode is not None
        self.instance += 1
        command = [part.replace("{instance}", str(self.instance)) for part in self.command]
        with open(self.stdout_path(self.instance), "wb") as out, open(
            self.stderr_path(self.instance), "wb"
        ) as err:
            self.current = await asyncio.create_subprocess_exec(
                *command, stdout=out, stderr=err, env=self.env, cwd=str(PACKAGE),
                start_new_session=True,
            )

    async def consuming(self, timeout_s: float = 30.0) -> None:
        """Until the current instance logs that it consumes (the library's INFO line
        ``consuming <queue>``): its signal handlers are in place by then."""
        deadline = time.monotonic() + timeout_s
        while "consuming " not in self.stderr_path(self.instance).read_text(errors="replace"):
            if not self.alive():
                raise AssertionError(
                    f"consumer #{self.instance} exited before consuming:\n"
                    f"{tail(self.stderr_path(self.instance))}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"consumer #{self.instance} not consuming in {timeout_s} s")
            await asyncio.sleep(0.1)

    def alive(self) -> bool:
        return self.current is not None and self.current.returncode is None

    async def kill(self) -> None:
        """SIGKILL: no chance to finish anything."""
        assert self.current is not None
        if self.current.returncode is None:
            self.current.send_signal(signal.SIGKILL)
            self.killed.append(self.instance)
        self.exits[self.instance] = await self.current.wait()

    async def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM (the consumer finishes its batch and returns): the exit code, or None when
        it had to be killed."""
        if self.current is None:
            return None
        if self.current.returncode is None:
            self.current.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.current.wait(), timeout_s)
            except asyncio.TimeoutError:
                await self.kill()
                return None
        code = self.current.returncode
        if code is not None:
            self.exits[self.instance] = code
        return code


# -- the scrambler -------------------------------------------------------------------------------


@dataclass
class ScramblerStats:
    cycles: int = 0
    taken: int = 0
    requeued: int = 0
    duplicated: int = 0


class Scrambler:
    """A plain aio-pika consumer on the tenant's queue, with the tenant's credentials: it takes
    deliveries beside the real consumer, holds them a little, and gives them back (nack with
    requeue) in shuffled order, so the real consumer meets later changes before earlier ones;
    some it also publishes again (as the broker's admin: the same body and message id), so
    they come twice.

    It works in cycles: consume a moment, stop consuming (basic.cancel), give back what it took
    in shuffled order, then leave the queue to the real consumer a moment. So it takes a message
    at most once a cycle: the tenant's queue moves a message delivered 20 times to its
    dead-letter queue, and a scrambler retaking what it just gave back would get it there.
    """

    def __init__(
        self,
        amqp_url: str,
        queue: str,
        rng: random.Random,
        *,
        prefetch: int = 24,
        duplicate_probability: float = 0.15,
    ) -> None:
        self.amqp_url = amqp_url
        self.queue = queue
        self.rng = rng
        self.prefetch = prefetch
        self.duplicate_probability = duplicate_probability
        self.stats = ScramblerStats()
        self._held: list[aio_pika.abc.AbstractIncomingMessage] = []
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._queue: aio_pika.abc.AbstractQueue | None = None
        self._admin: aio_pika.abc.AbstractConnection | None = None
        self._admin_channel: aio_pika.abc.AbstractChannel | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        self._connection = await aio_pika.connect(
            self.amqp_url, client_properties={"connection_name": "relay-consumer e2e scrambler"}
        )
        channel = await self._connection.channel()
        await channel.set_qos(prefetch_count=self.prefetch)
        self._queue = await channel.get_queue(self.queue, ensure=False)
        try:
            self._admin = await aio_pika.connect(ADMIN_AMQP_URL)
            self._admin_channel = await self._admin.channel()
        except Exception as error:  # duplicates are a bonus: the broker's own redeliveries stay
            log(f"scrambler: no admin connection for duplicates ({error})")
        self._task = asyncio.create_task(self._cycles())

    async def _take(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        self.stats.taken += 1
        self._held.append(message)

    async def _pause(self, seconds: float) -> bool:
        """Sleeps, or returns True at once when asked to stop."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
            return True
        except asyncio.TimeoutError:
            return False

    async def _cycles(self) -> None:
        assert self._queue is not None
        try:
            while not self._stopping.is_set():
                self.stats.cycles += 1
                tag = await self._queue.consume(self._take, no_ack=False)
                stopping = await self._pause(self.rng.uniform(0.3, 1.0))
                await self._queue.cancel(tag)
                if not stopping:
                    stopping = await self._pause(self.rng.uniform(0.05, 0.5))
                await self._release()
                if stopping or await self._pause(self.rng.uniform(0.5, 1.5)):
                    return
        except Exception as error:  # the connection closed under it: what it held goes back
            log(f"scrambler stopped: {type(error).__name__}: {error}")

    async def _release(self) -> None:
        held, self._held = self._held, []
        self.rng.shuffle(held)
        for message in held:
            if self._admin_channel is not None and self.rng.random() < self.duplicate_probability:
                await self._admin_channel.default_exchange.publish(
                    aio_pika.Message(
                        message.body,
                        message_id=message.message_id,
                        type=message.type,
                        content_type=message.content_type,
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    routing_key=self.queue,
                )
                self.stats.duplicated += 1
            await message.nack(requeue=True)
            self.stats.requeued += 1
            if self.rng.random() < 0.3:
                await asyncio.sleep(self.rng.uniform(0.0, 0.05))

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except (asyncio.TimeoutError, Exception):
                self._task.cancel()
        for connection in (self._connection, self._admin):
            if connection is not None:
                try:
                    await asyncio.wait_for(connection.close(), 5)
                except Exception:
                    pass  # closing gives back whatever is still held


# -- the relay's API -----------------------------------------------------------------------------


async def pages(api: RelayApi, path: str, **query: str) -> list[dict[str, Any]]:
    """Every row of a paged list (`data`, `next_cursor` passed as `after`)."""
    rows: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params = dict(query, limit="500")
        if after is not None:
            params["after"] = after
        page = await api.get(f"{path}?{urllib.parse.urlencode(params)}")
        rows += page["data"]
        after = page.get("next_cursor")
        if not after:
            return rows


async def resync(api: RelayApi, endpoint_id: str, attempts: int = 60) -> ResyncAnswer:
    """POST resync, again while the last snapshot is still being sent (409) or the relay is
    not answering (no status: its tiers are stopped for a restore)."""
    for attempt in range(attempts):
        try:
            return await api.resync(endpoint_id)
        except ReplayError as error:
            if error.status not in (409, None) or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


# -- clean-up ------------------------------------------------------------------------------------


def management(method: str, path: str) -> int:
    request = urllib.request.Request(MANAGEMENT_URL + path, method=method)
    token = ":".join(MANAGEMENT_AUTH).encode()
    request.add_header("authorization", "Basic " + base64.b64encode(token).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def queue_depth(queue: str) -> dict[str, Any] | None:
    request = urllib.request.Request(
        f"{MANAGEMENT_URL}/api/queues/%2f/{urllib.parse.quote(queue, safe='')}"
    )
    token = ":".join(MANAGEMENT_AUTH).encode()
    request.add_header("authorization", "Basic " + base64.b64encode(token).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            body: dict[str, Any] = json.loads(answer.read())
            return body
    except (urllib.error.URLError, OSError, ValueError):
        return None


def remove_demo_leftovers(started: dict[str, Any] | None, credentials: dict[str, Any] | None,
                          admin_dsn: str) -> None:
    """What a demo that could not clean up (killed) left: its database, its tenant's queues and
    broker user. Best effort."""
    if started is not None:
        database = urllib.parse.urlparse(str(started.get("database_url", ""))).path.lstrip("/")
        if database.startswith("relay_demo_"):
            with psycopg.connect(admin_dsn, autocommit=True) as admin:
                # And the database its restore made.
                for name in (database, database + "_restored"):
                    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            log(f"dropped the demo's databases {database}(_restored)")
    if credentials is not None:
        queue = str(credentials["queue"])
        for name in (queue, queue + ".dead-letter"):
            management("DELETE", f"/api/queues/%2f/{urllib.parse.quote(name, safe='')}")
        user = urllib.parse.urlparse(str(credentials["tenant_amqp_url"])).username
        if user:
            management("DELETE", f"/api/users/{urllib.parse.quote(user, safe='')}")
        log(f"removed the demo's queues and broker user ({queue})")


def python() -> str:
    return sys.executable
