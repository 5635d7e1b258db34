"""The services one run measures against: Postgres and Redis found or started by
``reach.localservices``, a fresh migrated database and an empty Redis db of the run's own,
both removed afterwards."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from reach import localservices, migrate

DATA_DIR = Path(__file__).resolve().parent.parent / ".reach" / "bench"


@dataclass(frozen=True)
class Stores:
    database_url: str  # SQLAlchemy form, postgresql+psycopg://...
    redis_url: str
    embedded: tuple[str, ...]

    @property
    def libpq_url(self) -> str:
        return localservices.libpq_url(self.database_url)


@contextlib.contextmanager
def fresh_stores() -> Iterator[Stores]:
    services = localservices.ensure_services(DATA_DIR)
    name = f"reach_bench_{os.getpid()}_{secrets.token_hex(3)}"
    created = False
    client: redis.Redis | None = None
    try:
        database_url = localservices.create_database(services.database_url, name)
        created = True
        migrate.upgrade(database_url)
        redis_url = localservices.claim_redis_db(services.redis_url)  # a parallel run: another
        client = redis.Redis.from_url(redis_url)
        yield Stores(database_url, redis_url, tuple(services.embedded))
    finally:
        if client is not None:
            client.flushdb()
            client.close()
        if created:
            localservices.drop_database(services.database_url, name)
        services.stop()
