"""reach.localservices against real Postgres and Redis: the local ones, or embedded ones
(the URL rewriting is unit-tested in ``tests/unit/test_localservices.py``)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import LiteralString
from urllib.parse import urlsplit

import psycopg
import pytest
import redis
import sqlalchemy

from reach.localservices import (
    CLAIM_KEY,
    LOCAL_POSTGRES_URL,
    LOCAL_REDIS_URL,
    Services,
    claim_redis_db,
    create_database,
    drop_database,
    ensure_services,
    libpq_url,
    tcp_answers,
    with_database,
)
from tests.conftest import IN_CI

LOCAL_SERVICES_RUN = tcp_answers("127.0.0.1", 5432) and tcp_answers("127.0.0.1", 6379)


@pytest.fixture
def new_name(services: Services) -> Iterator[Callable[[], str]]:
    made: list[str] = []

    def make() -> str:
        made.append(f"reach_test_{uuid.uuid4().hex[:16]}")
        return made[-1]

    yield make
    for name in reversed(made):  # copies first: a template cannot go while a copy is made
        drop_database(services.database_url, name)


def query_one(url: str, statement: LiteralString, *params: object) -> object:
    with psycopg.connect(libpq_url(url)) as conn:
        row = conn.execute(statement, params).fetchone()
    assert row is not None
    return row[0]


def database_exists(admin_url: str, name: str) -> bool:
    return bool(query_one(admin_url, "select count(*) from pg_database where datname = %s", name))


def redis_port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


# --- detection ----------------------------------------------------------------------------------


def test_tcp_answers_tells_a_listening_port_from_a_closed_one() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert tcp_answers("127.0.0.1", port)
    assert not tcp_answers("127.0.0.1", port)


def test_ensure_services_uses_the_running_local_services(tmp_path: Path) -> None:
    if not LOCAL_SERVICES_RUN:
        if IN_CI:  # CI runs local services (RabbitMQ's tests require theirs there too)
            pytest.fail("Postgres and Redis must answer on 127.0.0.1:5432 and :6379 in CI")
        pytest.skip("no Postgres/Redis on their usual ports")
    found = ensure_services(tmp_path)
    try:
        assert found.database_url == LOCAL_POSTGRES_URL
        assert found.redis_url == LOCAL_REDIS_URL
        assert found.embedded == []
    finally:
        found.stop()
    assert tcp_answers("127.0.0.1", 6379), "stop() must leave external services alone"
    assert list(tmp_path.iterdir()) == []


def test_ensure_services_uses_given_urls_as_they_are(tmp_path: Path) -> None:
    given_db, given_redis = "postgresql+psycopg://u@nowhere:1/x", "redis://nowhere:1/0"
    found = ensure_services(tmp_path, database_url=given_db, redis_url=given_redis)
    assert (found.database_url, found.redis_url, found.embedded) == (given_db, given_redis, [])
    found.stop()


# --- databases ----------------------------------------------------------------------------------


def test_create_database_copies_a_template_and_drop_removes_both(
    services: Services, new_name: Callable[[], str]
) -> None:
    template_name, copy_name = new_name(), new_name()
    template_url = create_database(services.database_url, template_name)
    with psycopg.connect(libpq_url(template_url), autocommit=True) as conn:
        conn.execute("create table marker (v int); insert into marker values (42)")

    copy_url = create_database(services.database_url, copy_name, template=template_name)

    assert copy_url == with_database(services.database_url, copy_name)
    assert query_one(copy_url, "select v from marker") == 42
    drop_database(services.database_url, copy_name)
    drop_database(services.database_url, template_name)
    assert not database_exists(services.database_url, copy_name)
    assert not database_exists(services.database_url, template_name)


def test_create_database_twice_needs_exist_ok(
    services: Services, new_name: Callable[[], str]
) -> None:
    name = new_name()
    url = create_database(services.database_url, name)

    assert create_database(services.database_url, name, exist_ok=True) == url
    with pytest.raises(psycopg.errors.DuplicateDatabase):
        create_database(services.database_url, name)


def test_drop_database_ignores_a_missing_database(services: Services) -> None:
    name = f"reach_missing_{uuid.uuid4().hex[:16]}"
    drop_database(services.database_url, name)  # no error
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
    assert found is None


def test_drop_database_disconnects_open_sessions(
    services: Services, new_name: Callable[[], str]
) -> None:
    name = new_name()
    url = create_database(services.database_url, name)
    with psycopg.connect(libpq_url(url)) as _held_open:
        drop_database(services.database_url, name)
    assert not database_exists(services.database_url, name)


# --- redis --------------------------------------------------------------------------------------


@pytest.fixture
def claim(services: Services) -> Iterator[Callable[[], str]]:
    """Claims Redis dbs as the project does; every one claimed is emptied afterwards."""
    claimed: list[str] = []

    def take() -> str:
        claimed.append(claim_redis_db(services.redis_url))
        return claimed[-1]

    yield take
    for url in claimed:
        with redis.Redis.from_url(url) as client:
            client.flushdb()


def test_a_claimed_redis_db_was_empty_and_is_marked_as_ours(claim: Callable[[], str]) -> None:
    url = claim()
    with redis.Redis.from_url(url) as client:
        assert client.dbsize() == 1
        assert client.get(CLAIM_KEY) == f"{socket.gethostname()}:{os.getpid()}".encode()
    assert claim() != url  # a second claim gets another


def test_a_db_left_by_a_killed_run_is_emptied_and_claimed_again(
    claim: Callable[[], str],
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid of this host that no longer runs
    url = claim()
    with redis.Redis.from_url(url) as client:
        client.set(CLAIM_KEY, f"{socket.gethostname()}:{gone.pid}")
        client.set("leftover", "1")
        assert claim() == url
        assert client.get("leftover") is None


@pytest.mark.parametrize("owner", ["this host, alive", "another host"])
def test_a_db_claimed_by_a_live_or_unknown_process_is_left_alone(
    claim: Callable[[], str], owner: str
) -> None:
    alive = f"{socket.gethostname()}:{os.getppid()}"
    marker = alive if owner == "this host, alive" else "elsewhere:1"
    url = claim()
    with redis.Redis.from_url(url) as client:
        client.set(CLAIM_KEY, marker)
        assert claim() != url
        assert client.get(CLAIM_KEY) == marker.encode()


# --- embedded -----------------------------------------------------------------------------------


def test_embedded_services_start_answer_and_stop(tmp_path: Path) -> None:
    found = ensure_services(tmp_path, prefer_local=False)
    try:
        assert found.embedded == ["postgres", "redis"]
        assert found.database_url.startswith("postgresql+psycopg://")
        assert query_one(found.database_url, "select 1") == 1
        engine = sqlalchemy.create_engine(found.database_url)  # the form the app is given
        with engine.connect() as conn:
            assert conn.execute(sqlalchemy.text("select 1")).scalar_one() == 1
        engine.dispose()
        with redis.Redis.from_url(found.redis_url) as client:
            assert client.ping()
    finally:
        found.stop()

    assert not tcp_answers("127.0.0.1", redis_port(found.redis_url))
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(libpq_url(found.database_url), connect_timeout=2)
    found.stop()  # idempotent


def test_embedded_postgres_keeps_its_data_between_runs(tmp_path: Path) -> None:
    skip_redis = {"redis_url": "redis://unused:1/0"}
    first = ensure_services(tmp_path, prefer_local=False, **skip_redis)
    try:
        create_database(first.database_url, "kept")
    finally:
        first.stop()

    second = ensure_services(tmp_path, prefer_local=False, **skip_redis)
    try:
        assert second.embedded == ["postgres"]
        assert query_one(with_database(second.database_url, "kept"), "select 1") == 1
    finally:
        second.stop()


@pytest.mark.parametrize("left_starting", [True, False], ids=["left-starting", "never-started"])
def test_an_embedded_postgres_slower_than_pg_ctls_timeout_is_waited_for_and_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, left_starting: bool
) -> None:
    """pgserver gives ``pg_ctl start`` 10 s; on a loaded machine a start took longer, and
    ``ensure_services`` failed (before: TimeoutExpired, and every later try got pgserver's
    unstarted handle back). Here the first ``pg_ctl start`` times out either after it set the
    postmaster going (which goes on without it) or before."""
    import pgserver.postgres_server as pgserver_module

    real_pg_ctl = pgserver_module.pg_ctl
    starts: list[list[str]] = []

    def slow_pg_ctl(args: list[str], **kwargs: object) -> str:
        if args[-1] == "start" and not starts:
            starts.append(args)
            if left_starting:  # the postmaster goes on starting, pg_ctl does not wait for it
                real_pg_ctl([a for a in args if a != "-w"], **kwargs)
            else:  # pg_ctl made its log and was stopped before it started anything
                log = Path(str(kwargs["pgdata"])) / "log"
                log.touch()
                if kwargs.get("user"):  # pgserver runs the server as a user of its own
                    shutil.chown(log, user=str(kwargs["user"]))
            raise subprocess.TimeoutExpired(cmd="pg_ctl", timeout=10)
        answer: str = real_pg_ctl(args, **kwargs)
        return answer

    monkeypatch.setattr(pgserver_module, "pg_ctl", slow_pg_ctl)
    found = ensure_services(tmp_path, prefer_local=False, redis_url="redis://unused:1/0")
    try:
        assert starts, "the first pg_ctl start did not time out"
        assert found.embedded == ["postgres"]
        assert query_one(found.database_url, "select 1") == 1
    finally:
        found.stop()
    # One server, stopped with the services: none left running past them
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(libpq_url(found.database_url), connect_timeout=2)
    assert not (tmp_path / "postgres" / "postmaster.pid").exists()


def test_embedded_postgres_starts_in_a_folder_whose_path_has_a_space(tmp_path: Path) -> None:
    """pgserver passed Postgres its socket's folder unquoted: ``postgres: invalid argument:
    "space/.reach/postgres"``, and the run command failed in any checkout under a path such as
    ``~/My Projects``."""
    folder = tmp_path / "My Projects" / ".reach"
    found = ensure_services(folder, prefer_local=False, redis_url="redis://unused:1/0")
    try:
        assert found.embedded == ["postgres"]
        assert query_one(found.database_url, "select 1") == 1
    finally:
        found.stop()
    assert not (folder / "postgres" / "postmaster.pid").exists()


def test_a_run_killed_before_its_cleanup_does_not_keep_the_next_runs_server_running(
    tmp_path: Path,
) -> None:
    """pgserver stops the server when the last process it lists as using it leaves; a run
    killed (SIGKILL, the OOM killer) stayed listed, and every later run left the server
    running when it stopped."""
    skip_redis = {"redis_url": "redis://unused:1/0"}
    first = ensure_services(tmp_path, prefer_local=False, **skip_redis)
    first.stop()
    ended = subprocess.Popen(["true"])
    ended.wait()  # a pid that ran and ended, as a killed run's has
    handles = tmp_path / "postgres" / ".handle_pids.json"
    handles.write_text(json.dumps([ended.pid]))

    second = ensure_services(tmp_path, prefer_local=False, **skip_redis)
    try:
        assert query_one(second.database_url, "select 1") == 1
    finally:
        second.stop()
    assert not (tmp_path / "postgres" / "postmaster.pid").exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(libpq_url(second.database_url), connect_timeout=2)
