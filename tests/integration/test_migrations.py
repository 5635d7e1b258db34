"""Alembic is the only way the schema changes: from empty it must build exactly the models,
and every migration must go down and up again."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

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
