"""The consumer the end-to-end test runs as a subprocess (so that killing it is a real SIGKILL):
the library's ``Consumer`` into a ``PostgresStore``, handing each notification twice over:

* inside the commit (``on_notification_in_transaction``): a row in ``e2e_handed`` (no unique
  key, so a second handing would show as a second row). The library's contract says this one
  is exactly once;
* after the commit (``on_notification``): a JSON line appended to ``--log`` with this process's
  instance number. The contract says at least once: again only when the process died between
  the handler and the mark (README, "Notifications, once").

    python runner.py --amqp-url ... --queue relay.tenant.<id> --dsn postgresql://... \
        --log handed.jsonl --instance 3 [--api-url ... --token ...]

SIGTERM stops it cleanly (the batch in hand is finished); it prints its stats to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any, Callable

import psycopg

import aio_pika.abc

from relay_consumer import Change, Consumer, Gap, Notification, RelayApi
from relay_consumer.postgres import PostgresStore

HANDED_TABLE = """
CREATE TABLE IF NOT EXISTS e2e_handed (
    id bigserial PRIMARY KEY,
    endpoint_id uuid NOT NULL,
    story_id text NOT NULL,
    message_key text NOT NULL,
    instance integer NOT NULL,
    handed_at timestamptz NOT NULL DEFAULT now()
)
"""


class Tracing(Consumer):
    """Writes each delivery it reads (the body, whether redelivered) to a trace file, for a
    failure's diagnosis."""

    trace_fd = -1
    instance = 0

    def _decode(self, message: aio_pika.abc.AbstractIncomingMessage) -> Change:
        change = super()._decode(message)
        if self.trace_fd >= 0:
            line = {"instance": self.instance, "redelivered": bool(message.redelivered),
                    "body": json.loads(message.body)}
            os.write(self.trace_fd, (json.dumps(line) + "\n").encode())
        return change


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--amqp-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--instance", type=int, required=True)
    parser.add_argument("--api-url")
    parser.add_argument("--token")
    parser.add_argument("--prefetch", type=int, default=256)
    parser.add_argument("--batch-max", type=int, default=256)
    parser.add_argument("--gap-timeout-s", type=float, default=5.0)
    parser.add_argument("--trace", help="a file to append every delivery read to")
    parser.add_argument("--notification-delay-s", type=float, default=0.0)
    args = parser.parse_args()
    # Taken from the first moment: a SIGTERM that comes while the runner is still starting (the
    # test stops it soon after a restart) stops it as cleanly as one that comes later; the
    # consumer's stop before its run makes the run return at once.
    stop_requested = False
    stoppers: list[Callable[[], object]] = []

    def on_term() -> None:
        nonlocal stop_requested
        stop_requested = True
        for stopper in stoppers:
            stopper()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s runner#{args.instance} %(levelname)s %(message)s",
    )
    log_fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    async def in_transaction(connection: psycopg.AsyncConnection[Any], n: Notification) -> None:
        await connection.execute(
            "INSERT INTO e2e_handed (endpoint_id, story_id, message_key, instance) "
            "VALUES (%s, %s, %s, %s)",
            (n.endpoint_id, n.story_id, n.key, args.instance),
        )

    async def handed(n: Notification) -> None:
        # One unbuffered write per line: what returned from os.write survives a SIGKILL.
        line = {"key": n.key, "endpoint_id": n.endpoint_id, "story_id": n.story_id,
                "instance": args.instance}
        os.write(log_fd, (json.dumps(line) + "\n").encode())
        # A slow effect: the window between handing and the mark, where a kill hands it again.
        await asyncio.sleep(args.notification_delay_s)

    def gap(g: Gap) -> None:
        logging.warning("gap reported: %s epoch %d missing %s", g.endpoint_id, g.epoch, g.missing)

    store = await PostgresStore.open(args.dsn, on_notification_in_transaction=in_transaction)
    await store.connection.execute(HANDED_TABLE)
    api = RelayApi(args.api_url, args.token) if args.api_url and args.token else None
    consumer = Tracing(
        args.amqp_url,
        args.queue,
        store,
        prefetch=args.prefetch,
        batch_max=args.batch_max,
        gap_timeout_s=args.gap_timeout_s,
        on_notification=handed,
        on_gap=gap,
        api=api,
        connection_name=f"relay-consumer e2e runner #{args.instance}",
    )
    consumer.instance = args.instance
    if args.trace:
        consumer.trace_fd = os.open(args.trace, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    stoppers.append(consumer.stop)
    if stop_requested:
        consumer.stop()
    print(json.dumps({"event": "running", "instance": args.instance, "pid": os.getpid()}),
          flush=True)
    try:
        await consumer.run()
    finally:
        await store.close()
        os.close(log_fd)
        print(f"runner#{args.instance} stats: {consumer.stats()}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
