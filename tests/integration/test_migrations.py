"""Alembic is the only way the schema changes: from empty it must build exactly the models,
and every migration must go down and up again."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from broker.db.models import Base
from reach import localservices, migrate


@pytest.fixture
def empty_database(services: localservices.Services) -> Iterator[str]:
    name = f"reach_mig_{secrets.token_hex(4)}"
    url = localservices.create_database(services.database_url, name)
    yield url
    localservices.drop_database(services.database_url, name)


def schema_diff(url: str) -> list[object]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            diff: list[object] = compare_metadata(MigrationContext.configure(conn), Base.metadata)
            return diff
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_from_empty_equals_the_models(empty_database: str) -> None:
    migrate.upgrade(empty_database)
    assert schema_diff(empty_database) == []


def test_downgrade_to_base_and_upgrade_again(empty_database: str) -> None:
    migrate.upgrade(empty_database)
    migrate.downgrade(empty_database, "base")
    assert tables(empty_database) == {"alembic_version"}
    migrate.upgrade(empty_database)
    assert {"tasks", "api_keys"} <= tables(empty_database)
    assert schema_diff(empty_database) == []


def test_an_empty_database_differs_from_the_models(empty_database: str) -> None:
    # The comparison above is only worth something if it can see a difference.
    assert schema_diff(empty_database) != []


def test_a_migration_that_cannot_take_its_lock_gives_up_and_says_so_then_goes_through(
    empty_database: str,
) -> None:
    # Given a database one migration behind, and a session reading tasks in a long transaction
    migrate.upgrade(empty_database, "0021")
    with psycopg.connect(localservices.libpq_url(empty_database)) as reader:
        reader.execute("SELECT count(*) FROM tasks").fetchone()  # holds ACCESS SHARE on tasks
        # When the next migration (an ALTER TABLE on tasks) is run, its tries bounded
        # Then each try gives its lock up rather than queue every session behind it, and the
        # run fails saying why (before: it waited for as long as the reader lived)
        with pytest.raises(migrate.MigrationBlocked, match="could not take their locks"):
            migrate.upgrade(empty_database, lock_timeout_s=0.2, tries=2, pause_s=0.1)
        assert reader.execute("SELECT count(*) FROM tasks").fetchone() == (0,)
    # And once the reader is gone it goes through
    migrate.upgrade(empty_database)
    assert schema_diff(empty_database) == []
