"""Real services for the whole run: Postgres and Redis on their local ports when they answer,
embedded ones otherwise; a database of this run's own, migrated once; a Redis db of its own."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine

from broker import localservices, migrate
from broker.db.engines import sync_engine
from broker.settings import Settings

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[localservices.Services]:
    found = localservices.ensure_services(tmp_path_factory.mktemp("services"))
    yield found
    found.stop()


@pytest.fixture(scope="session")
def database_url(services: localservices.Services) -> Iterator[str]:
    name = f"reach_test_{os.getpid()}_{secrets.token_hex(3)}"
    url = localservices.create_database(services.database_url, name)
    migrate.upgrade(url)
    yield url
    localservices.drop_database(services.database_url, name)


@pytest.fixture(scope="session")
def redis_url(services: localservices.Services) -> Iterator[str]:
    url = localservices.with_redis_db(
        services.redis_url, localservices.free_redis_db(services.redis_url)
    )
    client = redis.Redis.from_url(url)
    client.set("reach:test-run", os.getpid())  # claims the db so a parallel run picks another
    yield url
    client.flushdb()
    client.close()


@pytest.fixture(scope="session")
def settings(database_url: str, redis_url: str) -> Settings:
    return Settings(
        database_url=database_url,
        redis_url=redis_url,
        broker_url=None,
        janitor_interval_s=0.5,
        lease_ttl_s=3,  # renewed every second: kill -9 shows as offline within 3 s
        max_payload_bytes=64 * 1024,
        agents=["workers.examples", "tests.agents"],
    )


@pytest.fixture(scope="session")
def engine(settings: Settings) -> Iterator[Engine]:
    built = sync_engine(settings)
    yield built
    built.dispose()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
