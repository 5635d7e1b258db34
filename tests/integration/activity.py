"""What Postgres is running now, sampled while a block runs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import psycopg

from broker.settings import Settings
from reach.localservices import libpq_url


@contextlib.contextmanager
def at_once(settings: Settings, running: str) -> Iterator[list[int]]:
    """How many statements ``running`` counts in Postgres, sampled until the block ends."""
    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        with psycopg.connect(libpq_url(settings.database_url), autocommit=True) as conn:
            while not done.is_set():
                seen.append(int(conn.execute(running).fetchone()[0]))  # type: ignore[index]

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join()
