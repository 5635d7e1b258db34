"""Real services for the whole run: the servers REACH_DATABASE_URL/DATABASE_URL and
REACH_REDIS_URL/REDIS_URL name, else Postgres and Redis on their local ports when they answer,
else embedded ones; a database of this run's own, migrated once; a Redis db of its own."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine

from broker.db.engines import sync_engine
from broker.settings import Settings, psycopg_url
from reach import localservices, migrate

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def services() -> Iterator[localservices.Services]:
    # Outside pytest's temp root: as root, pgserver runs Postgres as its own user and must be
    # able to enter the data folder, which another pytest session would lock again (0700).
    data_dir = Path(tempfile.mkdtemp(prefix="reach-services-"))
    # Only their servers are used: each run makes a database and claims a Redis db of its own.
    database_url = os.environ.get("REACH_DATABASE_URL") or os.environ.get("DATABASE_URL")
    redis_url = os.environ.get("REACH_REDIS_URL") or os.environ.get("REDIS_URL")
    try:
        found = localservices.ensure_services(
            data_dir,
            database_url=database_url and psycopg_url(database_url),
            redis_url=redis_url,
        )
    except localservices.EmbeddedUnavailable as exc:
        shutil.rmtree(data_dir, ignore_errors=True)
        pytest.exit(str(exc), returncode=1)
    yield found
    found.stop()
    shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def database_url(services: localservices.Services) -> Iterator[str]:
    name = f"reach_test_{os.getpid()}_{secrets.token_hex(3)}"
    url = localservices.create_database(services.database_url, name)
    migrate.upgrade(url)
    yield url
    localservices.drop_database(services.database_url, name)


@pytest.fixture(scope="session")
def redis_url(services: localservices.Services) -> Iterator[str]:
    url = localservices.claim_redis_db(services.redis_url)  # a parallel run picks another
    client = redis.Redis.from_url(url)
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
        reaper_interval_s=1,
        sweep_interval_s=1,
        sweep_after_s=3,
        max_payload_bytes=64 * 1024,
        agents=["workers.examples", "tests.agents"],
        # Webhooks reach the tests' receivers on 127.0.0.1 (only that address), on a
        # schedule of five attempts compressed into about a second.
        webhook_allow=["127.0.0.1"],
        webhook_schedule_s=[0, 0.2, 0.2, 0.2, 0.2],
        webhook_timeout_s=5,
        # The sweep (lost attempts, expired bodies) every second.
        webhook_sweep_interval_s=1,
    )


@pytest.fixture(scope="session")
def engine(settings: Settings) -> Iterator[Engine]:
    built = sync_engine(settings)
    yield built
    built.dispose()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
