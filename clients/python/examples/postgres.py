"""Keeps a tenant's copies in Postgres (the tables relay_positions, relay_items, relay_stories,
relay_notifications and relay_held, made when missing) and hands each story notification once,
writing it to an outbox table of its own in the same transaction as the copy and the position.

    RELAY_AMQP_URL='amqp://<username>:<password>@<host>:<port>/<vhost>' \
    RELAY_QUEUE=relay.tenant.<tenant id> RELAY_STORE_DSN=postgresql://... python examples/postgres.py

RELAY_AMQP_URL is the ``amqp_url`` that ``POST /v1/broker/credentials`` answered, with its
``password`` put after the username. Optionally RELAY_API_URL and RELAY_API_TOKEN (a token of the
tenant): a gap that does not fill in time is then asked for again with
``POST /v1/endpoints/<id>/replay``. Ctrl-C (or SIGTERM) stops it; started again, it carries on
from the positions kept.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

import psycopg

from relay_consumer import Consumer, Gap, Notification, RelayApi
from relay_consumer.postgres import PostgresStore

OUTBOX = """
CREATE TABLE IF NOT EXISTS my_outbox (
    endpoint_id uuid NOT NULL,
    story_id text NOT NULL,
    ticker text,
    message_key text NOT NULL,
    PRIMARY KEY (endpoint_id, story_id)
)
"""


async def to_outbox(connection: psycopg.AsyncConnection[Any], n: Notification) -> None:
    """Runs inside the commit that recorded the notification: kept exactly once with it."""
    await connection.execute(
        "INSERT INTO my_outbox (endpoint_id, story_id, ticker, message_key) "
        "VALUES (%s, %s, %s, %s)",
        (n.endpoint_id, n.story_id, n.ticker, n.key),
    )


def handed(n: Notification) -> None:
    """After the commit: at least once (again after a crash before it was marked handed)."""
    print(f"NOTIFY {n.ticker} {n.story_id} (key {n.key})")


def gap(waiting: Gap) -> None:
    print(f"waiting on {waiting.endpoint_id}: change_seqs {waiting.missing} ({waiting.held} held)")


async def main() -> None:
    logging.basicConfig(level=logging.INFO)
    amqp_url = os.environ["RELAY_AMQP_URL"]
    queue = os.environ["RELAY_QUEUE"]
    database = os.environ["RELAY_STORE_DSN"]
    api = None
    if os.environ.get("RELAY_API_URL") and os.environ.get("RELAY_API_TOKEN"):
        api = RelayApi(os.environ["RELAY_API_URL"], os.environ["RELAY_API_TOKEN"])
    async with await PostgresStore.open(
        database, on_notification_in_transaction=to_outbox
    ) as store:
        await store.connection.execute(OUTBOX)
        consumer = Consumer(
            amqp_url,
            queue,
            store,
            on_notification=handed,
            on_gap=gap,
            api=api,
        )
        for stop in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(stop, consumer.stop)
        await consumer.run()


if __name__ == "__main__":
    asyncio.run(main())
