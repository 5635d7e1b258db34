"""reach.localservices without services: rewriting Postgres and Redis URLs."""

from __future__ import annotations

import pytest

from reach.localservices import (
    LOCAL_POSTGRES_URL,
    LOCAL_REDIS_URL,
    libpq_url,
    with_database,
    with_redis_db,
)

# --- URL rewriting ------------------------------------------------------------------------------


def test_with_database_replaces_only_the_database_of_a_tcp_url() -> None:
    given = "postgresql+psycopg://app:secret@db.example:6543/postgres?sslmode=require"
    expect = "postgresql+psycopg://app:secret@db.example:6543/reach_7?sslmode=require"
    assert with_database(given, "reach_7") == expect


def test_with_database_keeps_the_socket_directory_of_a_socket_url() -> None:
    given = "postgresql+psycopg://postgres@/postgres?host=/tmp/pg sock"
    assert with_database(given, "other") == "postgresql+psycopg://postgres@/other?host=/tmp/pg sock"


def test_with_database_keeps_an_empty_host() -> None:
    assert with_database("postgresql:///postgres?host=/s", "x") == "postgresql:///x?host=/s"


@pytest.mark.parametrize("name", ["", "1abc", 'x"; drop database postgres; --', "a b", "a" * 64])
def test_with_database_rejects_unsafe_names(name: str) -> None:
    with pytest.raises(ValueError, match="not a safe database name"):
        with_database(LOCAL_POSTGRES_URL, name)


def test_libpq_url_drops_the_sqlalchemy_driver() -> None:
    given = "postgresql+psycopg://postgres@/postgres?host=/run/pg"
    assert libpq_url(given) == "postgresql://postgres@/postgres?host=/run/pg"


@pytest.mark.parametrize(
    ("given", "db", "expect"),
    [
        ("redis://127.0.0.1:6379/0", 7, "redis://127.0.0.1:6379/7"),
        ("redis://:pw@h:1", 3, "redis://:pw@h:1/3"),
        ("rediss://h:1/2?db=2&ssl_cert_reqs=none", 5, "rediss://h:1/5?ssl_cert_reqs=none"),
        ("unix:///tmp/redis.sock?db=1", 4, "unix:///tmp/redis.sock?db=4"),
    ],
)
def test_with_redis_db_points_at_the_other_database(given: str, db: int, expect: str) -> None:
    assert with_redis_db(given, db) == expect


def test_with_redis_db_rejects_a_negative_index() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        with_redis_db(LOCAL_REDIS_URL, -1)
