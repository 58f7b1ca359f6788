"""The command: ``relay-consumer`` (or ``python -m relay_consumer``), as clients/README.md gives
it (the TypeScript library's ``npx relay-consumer`` takes the same subcommands and flags).

``run --amqp-url URL --queue Q --store-dsn DSN [--api-url URL --api-token T]
[--metrics-addr HOST:PORT]`` runs a consumer into the Postgres store until SIGTERM or SIGINT
(exit 0) or a permanent failure (exit 2, the cause on stderr). With ``--metrics-addr`` it serves
``GET /metrics`` (the Prometheus text exposition) and ``GET /healthz`` (the health answer as
JSON: 200 while ``ok`` or ``reconnecting``, 503 otherwise).

``verify --store-dsn DSN --api-url URL --api-token T [--endpoint ID ...]`` compares the store with
the relay's copy through the API; one line per endpoint (``equal`` or the first differences);
exit 0 when every endpoint is equal, 1 on a difference, 2 on an error.

A flag beats its environment variable: ``RELAY_AMQP_URL``, ``RELAY_QUEUE``, ``RELAY_STORE_DSN``,
``RELAY_API_URL``, ``RELAY_API_TOKEN``, ``RELAY_METRICS_ADDR``, and (environment only)
``RELAY_PREFETCH``, ``RELAY_BATCH_MAX``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Sequence

from ._version import __version__
from .consumer import Consumer
from .errors import PermanentError, describe
from .messages import MessageRefused
from .postgres import PostgresStore
from .replay import RelayApi, ReplayError
from .store import StoreError
from .verify import verify

log = logging.getLogger("relay_consumer")

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(EXIT_ERROR)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="relay-consumer",
        description="Keep an exact copy of the relay's endpoints from a tenant's queue in "
        "Postgres (run), or compare a copy with the relay's (verify).",
    )
    parser.add_argument("--version", action="version", version=f"relay-consumer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,verify}")

    run = commands.add_parser(
        "run",
        help="consume the tenant's queue into a Postgres store until SIGTERM or SIGINT",
        description="Consume the tenant's queue into a Postgres store until SIGTERM or SIGINT "
        "(exit 0) or a permanent failure (exit 2). Environment: RELAY_AMQP_URL, RELAY_QUEUE, "
        "RELAY_STORE_DSN, RELAY_API_URL, RELAY_API_TOKEN, RELAY_METRICS_ADDR, RELAY_PREFETCH "
        "(256), RELAY_BATCH_MAX (256); a flag beats its variable.",
    )
    run.add_argument("--amqp-url", help="the tenant's broker URL, password included "
                     "(RELAY_AMQP_URL)")
    run.add_argument("--queue", help="relay.tenant.<tenant id> (RELAY_QUEUE)")
    run.add_argument("--store-dsn", help="the store's Postgres DSN (RELAY_STORE_DSN)")
    run.add_argument("--api-url", help="the relay's API, to ask for gaps again (RELAY_API_URL)")
    run.add_argument("--api-token", help="a token of the tenant (RELAY_API_TOKEN)")
    run.add_argument("--metrics-addr", metavar="HOST:PORT",
                     help="serve GET /metrics and GET /healthz there (RELAY_METRICS_ADDR)")

    check = commands.add_parser(
        "verify",
        help="compare a store with the relay's copy through its API",
        description="Compare the store with the relay's copy through the API: one line per "
        "endpoint; exit 0 when every endpoint is equal, 1 on a difference, 2 on an error. "
        "Environment: RELAY_STORE_DSN, RELAY_API_URL, RELAY_API_TOKEN; a flag beats its "
        "variable.",
    )
    check.add_argument("--store-dsn", help="the store's Postgres DSN (RELAY_STORE_DSN)")
    check.add_argument("--api-url", help="the relay's API (RELAY_API_URL)")
    check.add_argument("--api-token", help="a token of the tenant (RELAY_API_TOKEN)")
    check.add_argument("--endpoint", action="append", default=[], metavar="ID",
                       help="an endpoint to compare (again for more; default: every endpoint "
                       "of the token's tenant)")
    return parser


def _setting(
    parser: argparse.ArgumentParser, value: str | None, variable: str, flag: str,
    required: bool = True,
) -> str | None:
    if value is None or value == "":
        value = os.environ.get(variable) or None
    if value is None and required:
        parser.error(f"{flag} (or {variable}) is required")
    return value


def _positive(parser: argparse.ArgumentParser, variable: str, default: int) -> int:
    text = os.environ.get(variable)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        parser.error(f"{variable}={text!r} is not a whole number of 1 or more")
    return value


def _address(parser: argparse.ArgumentParser, text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        parser.error(f"--metrics-addr {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run_command(parser, args)
    return _verify_command(parser, args)


# -- run -----------------------------------------------------------------------------------------


def _run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    amqp_url = _setting(parser, args.amqp_url, "RELAY_AMQP_URL", "--amqp-url")
    queue = _setting(parser, args.queue, "RELAY_QUEUE", "--queue")
    dsn = _setting(parser, args.store_dsn, "RELAY_STORE_DSN", "--store-dsn")
    api_url = _setting(parser, args.api_url, "RELAY_API_URL", "--api-url", required=False)
    token = _setting(parser, args.api_token, "RELAY_API_TOKEN", "--api-token", required=False)
    if (api_url is None) != (token is None):
        parser.error("--api-url and --api-token (RELAY_API_URL, RELAY_API_TOKEN) go together")
    metrics = _setting(parser, args.metrics_addr, "RELAY_METRICS_ADDR", "--metrics-addr",
                       required=False)
    address = _address(parser, metrics) if metrics else None
    prefetch = _positive(parser, "RELAY_PREFETCH", 256)
    batch_max = _positive(parser, "RELAY_BATCH_MAX", 256)
    assert amqp_url is not None and queue is not None and dsn is not None
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per failure, the library's: the AMQP client's own account of a lost connection
    # (an ERROR and a WARNING of its own each time) is left out.
    for noisy in ("aiormq", "aio_pika"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    consumer = Consumer(
        amqp_url,
        queue,
        PostgresStore(dsn),
        prefetch=prefetch,
        batch_max=batch_max,
        api=RelayApi(api_url, token) if api_url and token else None,
        connection_name=f"relay-consumer (python) pid {os.getpid()}",
    )
    return asyncio.run(_run(consumer, address))


async def _run(consumer: Consumer, address: tuple[str, int] | None) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, consumer.stop)
    server: asyncio.Server | None = None
    try:
        if address is not None:
            server = await _serve_metrics(consumer, *address)
        await consumer.run()
        code = EXIT_OK
    except PermanentError as error:
        print(f"relay-consumer: permanent failure ({error.cause_kind}): {error.message}",
              file=sys.stderr, flush=True)
        code = EXIT_ERROR
    except Exception as error:
        print(f"relay-consumer: stopped by {describe(error)}", file=sys.stderr, flush=True)
        if not isinstance(error, MessageRefused):
            log.debug("the failure", exc_info=error)
        code = EXIT_ERROR
    finally:
        if server is not None:
            server.close()
            await server.wait_closed()
    # The stats, once, as a JSON line: what this process did (notifications handed included).
    print(json.dumps({"event": "exited", "code": code, "stats": consumer.stats().as_dict()}),
          flush=True)
    return code


async def _serve_metrics(consumer: Consumer, host: str, port: int) -> asyncio.Server:
    """GET /metrics and GET /healthz, HTTP/1.1, one answer per connection."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            method, _, rest = head.decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, kind, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == "/metrics":
                status = "200 OK"
                kind = "text/plain; version=0.0.4; charset=utf-8"
                body = consumer.metrics_text().encode()
            elif path == "/healthz":
                health = consumer.health()
                good = health.status in ("ok", "reconnecting")
                status = "200 OK" if good else "503 Service Unavailable"
                kind = "application/json"
                body = (json.dumps(health.as_dict()) + "\n").encode()
            else:
                status, kind, body = "404 Not Found", "text/plain", b"/metrics or /healthz\n"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                "Cache-Control: no-store\r\nConnection: close\r\n\r\n".encode()
            )
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, host, port)
    where = ", ".join(str(s.getsockname()) for s in server.sockets)
    log.info("serving /metrics and /healthz on %s", where)
    return server


# -- verify --------------------------------------------------------------------------------------


def _verify_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    dsn = _setting(parser, args.store_dsn, "RELAY_STORE_DSN", "--store-dsn")
    api_url = _setting(parser, args.api_url, "RELAY_API_URL", "--api-url")
    token = _setting(parser, args.api_token, "RELAY_API_TOKEN", "--api-token")
    assert dsn is not None and api_url is not None and token is not None
    try:
        verdicts = asyncio.run(
            verify(dsn, RelayApi(api_url, token), args.endpoint,
                   each=lambda v: print(v.line(), flush=True))
        )
    except (PermanentError, StoreError, ReplayError, OSError, KeyError, ValueError) as error:
        print(f"relay-consumer verify: {describe(error)}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    if not verdicts:
        print("relay-consumer verify: no endpoint to compare", file=sys.stderr, flush=True)
        return EXIT_ERROR
    return EXIT_OK if all(v.equal for v in verdicts) else EXIT_DIFFERENT
