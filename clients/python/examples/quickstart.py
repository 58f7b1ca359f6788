import asyncio
import logging
import os
import signal
import sys

from relay_consumer import Consumer, ErrorReport, Notification, PermanentError, RelayApi
from relay_consumer.postgres import PostgresStore


def notified(n: Notification) -> None:
    # After the commit that recorded it, then marked handed: n.key is an idempotence key.
    print(f"strong story {n.story_id} ({n.ticker}), key {n.key}", flush=True)


def failed(report: ErrorReport) -> None:
    # Transient failures are retried for ever (and logged); a permanent one ends run().
    if not report.transient:
        print(f"giving up: {report.cause_kind}", file=sys.stderr, flush=True)


async def main() -> int:
    logging.basicConfig(level=logging.INFO)
    api = None  # optional: with it, a gap that does not fill is asked for again
    if os.environ.get("RELAY_API_URL") and os.environ.get("RELAY_API_TOKEN"):
        api = RelayApi(os.environ["RELAY_API_URL"], os.environ["RELAY_API_TOKEN"])
    consumer = Consumer(
        os.environ["RELAY_AMQP_URL"],  # amqp://<username>:<password>@<host>:<port>/<vhost>
        os.environ["RELAY_QUEUE"],  # relay.tenant.<tenant id>
        PostgresStore(os.environ["RELAY_STORE_DSN"]),  # the database must exist
        on_notification=notified,
        on_error=failed,
        api=api,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, consumer.stop)
    try:
        await consumer.run()  # returns after stop(): batch in hand finished, everything closed
    except PermanentError as error:
        print(f"stopped for good: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
