"""Running the Alembic migrations from code (``reach migrate``, the dev stack, the tests).

A migration that changes a table (``ALTER TABLE ... ADD COLUMN``) takes its strongest lock.
While it waits for that lock behind a long reader (a ``pg_dump``, a report), every claim,
submit and finish queues behind the waiting ALTER: one stuck migration stops the whole
broker. So each try waits at most ``LOCK_TIMEOUT_S`` for a lock (Postgres's
``lock_timeout``), and gives up to let the queue move: the migration it was in rolls back
whole (each commits with its version; an index built concurrently and left invalid is built
again, ``migrations.concurrently``), and the next try starts there, after a pause,
``LOCK_TRIES`` tries in all; then it fails with a message that says why. One run migrates a
database at a time (``take_migration_lock``): another waits for it within the same tries,
then finds nothing left to do.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import psycopg.errors
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError

import migrations

log = logging.getLogger("reach.migrate")

LOCK_TIMEOUT_S = 5.0
LOCK_TRIES = 6
LOCK_PAUSE_S = 10.0
# The advisory lock a run holds in the database it migrates ("reach.mg"), and how often one
# waiting for it asks again.
MIGRATION_LOCK = int.from_bytes(b"reach.mg", "big")
MIGRATION_LOCK_POLL_S = 0.1


class MigrationBlocked(RuntimeError):
    """A migration could not take its locks: another session held them each time."""


class MigrationRunning(Exception):
    """Another run held the migration lock for as long as a try may wait."""


def take_migration_lock(connection: Connection, timeout_s: float | None) -> None:
    """Hold the migration lock on ``connection``'s session until it closes, waiting at most
    ``timeout_s`` (None: as long as it takes) for another run to let it go.

    Two runs at once both created ``alembic_version`` or ran the same migration, and one
    failed. The waiting run asks in short transactions and holds none in between: a
    ``CREATE INDEX CONCURRENTLY`` of the running one waits for every open transaction, and a
    waiter blocked in ``pg_advisory_lock`` inside one deadlocked with it."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        taken = connection.exec_driver_sql(
            f"SELECT pg_try_advisory_lock({MIGRATION_LOCK})"
        ).scalar_one()
        connection.commit()
        if taken:
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise MigrationRunning("another migration of this database is running")
        time.sleep(MIGRATION_LOCK_POLL_S)


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
        except (OperationalError, MigrationRunning) as exc:
            if isinstance(exc, OperationalError) and not isinstance(
                exc.orig, psycopg.errors.LockNotAvailable
            ):
                raise
            if attempt == tries:
                raise MigrationBlocked(
                    f"the migrations could not take their locks in {tries} tries of"
                    f" {lock_timeout_s:g}s each: another session holds a lock on a table they"
                    " change (a long query, a dump, an open transaction; see pg_locks), or"
                    " another migration is running"
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
