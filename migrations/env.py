from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine, pool

from broker.db.engines import bounded
from broker.db.models import Base
from broker.settings import Settings
from reach.migrate import take_migration_lock

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

url = config.get_main_option("sqlalchemy.url") or Settings().database_url


def run_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    engine = create_engine(bounded(url), poolclass=pool.NullPool)
    with engine.connect() as connection:
        # A lock not had in time fails the try rather than queue every other session behind
        # it (``reach.migrate``).
        lock_timeout_ms = config.attributes.get("lock_timeout_ms")
        if lock_timeout_ms is not None:
            connection.exec_driver_sql(f"SET lock_timeout = {int(lock_timeout_ms)}")
            connection.commit()
        # One run at a time, the next waiting for this one within a try's lock_timeout (no
        # lock_timeout, as with the ``alembic`` command: as long as it takes), then finding
        # nothing left to do.
        take_migration_lock(connection, None if lock_timeout_ms is None else lock_timeout_ms / 1000)
        # Each migration commits with its version: one that fails leaves the database at the
        # one before it, whole. In one transaction for the lot, the indexes built or dropped
        # concurrently (outside it) stayed, while the versions that recorded them rolled back.
        context.configure(
            connection=connection, target_metadata=Base.metadata, transaction_per_migration=True
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
