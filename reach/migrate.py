"""Running the Alembic migrations from code (``reach migrate``, the dev stack, the tests).

A migration that changes a table (``ALTER TABLE ... ADD COLUMN``) takes its strongest lock.
While it waits for that lock behind a long reader (a ``pg_dump``, a report), every claim,
submit and finish queues behind the waiting ALTER: one stuck migration stops the whole
broker. So each try waits at most ``LOCK_TIMEOUT_S`` for a lock (Postgres's
``lock_timeout``), and gives up to let the queue move: the migration it was in rolls back
whole (each commits with its version; an index built concurrently and left invalid is built
again, ``migrations.concurrently``), and the next try starts there, after a pause,
``LOCK_TRIES`` tries in all; then it fails with a message that says why.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import psycopg.errors
from alembic import command
from alembic.config import Config
from sqlalchemy.exc import OperationalError

import migrations

log = logging.getLogger("reach.migrate")

LOCK_TIMEOUT_S = 5.0
LOCK_TRIES = 6
LOCK_PAUSE_S = 10.0


class MigrationBlocked(RuntimeError):
    """A migration could not take its locks: another session held them each time."""


def alembic_config(database_url: str, lock_timeout_s: float | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    # ConfigParser interpolates '%': a URL-encoded password must survive it.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    config.attributes["configure_logging"] = False
    if lock_timeout_s is not None:
        config.attributes["lock_timeout_ms"] = max(1, round(lock_timeout_s * 1000))
    return config


def upgrade(
    database_url: str,
    revision: str = "head",
    *,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
    tries: int = LOCK_TRIES,
    pause_s: float = LOCK_PAUSE_S,
) -> None:
    config = alembic_config(database_url, lock_timeout_s)
    for attempt in range(1, tries + 1):
        try:
            command.upgrade(config, revision)
            return
        except OperationalError as exc:
            if not isinstance(exc.orig, psycopg.errors.LockNotAvailable):
                raise
            if attempt == tries:
                raise MigrationBlocked(
                    f"the migrations could not take their locks in {tries} tries of"
                    f" {lock_timeout_s:g}s each: another session holds a lock on a table they"
                    " change (a long query, a dump, an open transaction; see pg_locks)"
                ) from exc
            log.warning(
                "migration try %d of %d could not take its locks in %gs; again in %gs",
                attempt,
                tries,
                lock_timeout_s,
                pause_s,
            )
            time.sleep(pause_s)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)
