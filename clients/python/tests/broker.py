"""RabbitMQ for the lifecycle tests: a queue of the test's own (as guest, on 127.0.0.1), messages
published to it, and the management API (closing a connection as an operator would)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import aio_pika

from builders import encode

AMQP_URL = os.environ.get("RELAY_CONSUMER_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/%2f")
MANAGEMENT_URL = os.environ.get("RELAY_CONSUMER_TEST_MANAGEMENT", "http://127.0.0.1:15672")
MANAGEMENT_AUTH = ("guest", "guest")


def management(method: str, path: str) -> tuple[int, Any]:
    request = urllib.request.Request(MANAGEMENT_URL + path, method=method)
    token = ":".join(MANAGEMENT_AUTH).encode()
    request.add_header("authorization", "Basic " + base64.b64encode(token).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            text = answer.read()
            return int(answer.status), json.loads(text) if text else None
    except urllib.error.HTTPError as error:
        return int(error.code), None


def connections_named(name: str) -> list[str]:
    """The broker's names of the open connections whose client-given name is ``name``."""
    _, rows = management("GET", "/api/connections")
    return [
        str(row["name"])
        for row in rows or []
        if (row.get("client_properties") or {}).get("connection_name") == name
    ]


async def close_connection(name: str, timeout_s: float = 20.0) -> int:
    """Closes, through the management API, the connections named ``name`` (as an operator
    would: the broker sends CONNECTION_FORCED); waits until the broker lists one (its list lags
    a few seconds). How many it closed."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await asyncio.to_thread(connections_named, name)
        if found:
            for broker_name in found:
                await asyncio.to_thread(
                    management, "DELETE", f"/api/connections/{urllib.parse.quote(broker_name, safe='')}"
                )
            return len(found)
        if time.monotonic() > deadline:
            raise AssertionError(f"no broker connection named {name!r} in {timeout_s} s")
        await asyncio.sleep(0.25)


class OwnQueue:
    """A classic queue of the test's own on the default vhost, deleted afterwards."""

    def __init__(self) -> None:
        self.name = f"relay-consumer-test-{secrets.token_hex(6)}"
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None

    async def __aenter__(self) -> OwnQueue:
        self._connection = await aio_pika.connect(AMQP_URL)
        self._channel = await self._connection.channel()
        await self._channel.declare_queue(self.name, durable=True)
        return self

    async def publish(self, bodies: list[dict[str, Any]]) -> None:
        assert self._channel is not None
        for body in bodies:
            await self._channel.default_exchange.publish(
                aio_pika.Message(
                    encode(body),
                    message_id=f"{body['webhook_endpoint_id']}:{body['epoch']}:{body['change_seq']}",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=self.name,
            )

    async def depth(self) -> int:
        """Messages in the queue, ready and unacknowledged (a passive declare: ready only, so
        asked when nothing consumes)."""
        assert self._channel is not None
        queue = await self._channel.declare_queue(self.name, passive=True)
        count = queue.declaration_result.message_count
        return int(count or 0)

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            try:
                await self._channel.queue_delete(self.name)
            except Exception:
                pass
        if self._connection is not None:
            await self._connection.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
