"""Keeps a tenant's copies in this process's memory and prints each change as it is applied.

    RELAY_AMQP_URL='amqp://<username>:<password>@<host>:<port>/<vhost>' \
    RELAY_QUEUE=relay.tenant.<tenant id> python examples/memory.py

RELAY_AMQP_URL is the ``amqp_url`` that ``POST /v1/broker/credentials`` answered, with its
``password`` put after the username. Optionally RELAY_API_URL and RELAY_API_TOKEN (a token of the
tenant): a gap that does not fill in time is then asked for again with
``POST /v1/endpoints/<id>/replay``. Ctrl-C (or SIGTERM) stops it; the copy is gone with the
process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from relay_consumer import (
    Consumer,
    FeedChange,
    Gap,
    Handlers,
    MemoryStore,
    Notification,
    RelayApi,
    StoryChange,
)


def upserted(change: FeedChange) -> None:
    print(f"{change.endpoint_id} {change.epoch}:{change.change_seq} upsert {change.subject}")


def removed(change: FeedChange) -> None:
    print(f"{change.endpoint_id} {change.epoch}:{change.change_seq} remove {change.subject}")


def story(change: StoryChange) -> None:
    merged = f" into {change.merged_into}" if change.merged_into else ""
    print(
        f"{change.endpoint_id} {change.epoch}:{change.change_seq} story {change.operation} "
        f"{change.story_id} v{change.version}{merged}"
    )


def notified(notification: Notification) -> None:
    print(f"NOTIFY {notification.ticker} {notification.story_id} (key {notification.key})")


def gap(waiting: Gap) -> None:
    print(f"waiting on {waiting.endpoint_id}: change_seqs {waiting.missing} ({waiting.held} held)")


async def main() -> None:
    logging.basicConfig(level=logging.INFO)
    amqp_url = os.environ["RELAY_AMQP_URL"]
    queue = os.environ["RELAY_QUEUE"]
    api = None
    if os.environ.get("RELAY_API_URL") and os.environ.get("RELAY_API_TOKEN"):
        api = RelayApi(os.environ["RELAY_API_URL"], os.environ["RELAY_API_TOKEN"])
    store = MemoryStore(
        Handlers(
            upsert=upserted,
            remove=removed,
            story_saved=story,
            story_closed=story,
            story_dropped=story,
        )
    )
    consumer = Consumer(
        amqp_url,
        queue,
        store,
        on_notification=notified,
        on_gap=gap,
        api=api,
    )
    for stop in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(stop, consumer.stop)
    await consumer.run()
    for endpoint in store.endpoints():
        print(
            f"{endpoint}: at {store.position(endpoint)}, {len(store.items(endpoint))} items, "
            f"{len(store.stories(endpoint))} stories"
        )


if __name__ == "__main__":
    asyncio.run(main())
