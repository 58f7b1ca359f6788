from __future__ import annotations

import os
import secrets
import sys
import pathlib
from typing import AsyncIterator, Iterator

import psycopg
import pytest

from relay_consumer import MemoryStore, Store
from relay_consumer.postgres import PostgresStore

sys.path.insert(0, str(pathlib.Path(__file__).parent))

def pytest_configure(config: pytest.Config) -> None:
    """With RELAY_CONSUMER_REQUIRE_INSTALLED (ci.sh), the tests must run against the package
    installed from the wheel, never the source tree."""
    if os.environ.get("RELAY_CONSUMER_REQUIRE_INSTALLED"):
        import relay_consumer

        if "site-packages" not in (relay_consumer.__file__ or ""):
            raise pytest.UsageError(
                f"relay_consumer is imported from {relay_consumer.__file__}, not from an "
                "installed package (RELAY_CONSUMER_REQUIRE_INSTALLED is set)"
            )


PG_ADMIN = os.environ.get("RELAY_CONSUMER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _dsn(database: str) -> str:
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + database


def _fresh_database() -> Iterator[str]:
    name = f"relay_consumer_test_{secrets.token_hex(6)}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _dsn(name)
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A fresh database for one test, dropped after it: its DSN."""
    yield from _fresh_database()


@pytest.fixture
def second_database() -> Iterator[str]:
    """Another fresh database for the same test."""
    yield from _fresh_database()


@pytest.fixture(params=["memory", "postgres"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    dsn = request.getfixturevalue("pg_database")
    pg = await PostgresStore.open(dsn)
    try:
        yield pg
    finally:
        await pg.close()
