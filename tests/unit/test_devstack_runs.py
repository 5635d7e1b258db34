"""What one ``reach dev`` run decides on its own: each worker's metrics port, which earlier
dev keys it revokes, the line it prints for a process that stopped, and the URL an operator
command names when it cannot connect."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from reach import cli, devstack

MODEL_URL = "http://127.0.0.1:8701"


def test_each_worker_of_the_dev_stack_serves_its_metrics_on_a_port_of_its_own(
    tmp_path: Path,
) -> None:
    # given the dev stack's workers (every process that runs `celery ... worker`)
    commands = devstack._commands(8000, 5555, tmp_path, MODEL_URL)
    workers = {name for name, argv in commands.items() if "worker" in argv}
    # when their ports are given from 9808 up
    ports = devstack.worker_metrics_ports(9808)
    # expect one each, none shared
    assert set(ports) == workers
    assert sorted(ports.values()) == list(range(9808, 9808 + len(workers)))
    # and 0 (metrics off) leaves them all off
    assert set(devstack.worker_metrics_ports(0).values()) == {0}


def _key(
    key_id: str, tenant: str = "dev", name: str | None = "reach dev", revoked: bool = False
) -> dict[str, object]:
    revoked_at = datetime(2026, 1, 1, tzinfo=UTC) if revoked else None
    return {"key_id": key_id, "tenant": tenant, "name": name, "revoked_at": revoked_at}


def test_a_run_revokes_only_the_live_keys_earlier_runs_printed() -> None:
    # given this run's key, two earlier runs' (one already revoked) and keys of others
    rows = [
        _key("earlier"),
        _key("older", revoked=True),
        _key("mine", name="ci"),
        _key("elsewhere", tenant="acme"),
        _key("unnamed", name=None),
        _key("now"),
    ]
    # expect only the earlier live dev key revoked
    assert devstack.earlier_dev_keys(rows, current="now") == ["earlier"]


def test_a_stopped_process_is_told_by_the_error_its_log_ends_with(tmp_path: Path) -> None:
    # given uvicorn's log of a taken port, which ends with its shutdown lines
    log = tmp_path / "api.log"
    log.write_text(
        "INFO:     Application startup complete.\n"
        "ERROR:    [Errno 98] error while attempting to bind on address "
        "('127.0.0.1', 8000): address already in use\n"
        "INFO:     Waiting for application shutdown.\n"
        "INFO:     Application shutdown complete.\n\n"
    )
    # expect one line naming the process, its status, the error and the log
    assert devstack.exit_message("api", 3, log) == (
        "api exited with 3: ERROR:    [Errno 98] error while attempting to bind on address "
        f"('127.0.0.1', 8000): address already in use (log: {log})"
    )
    # and a log without an error gives its last line; none at all, nothing
    quiet = tmp_path / "beat.log"
    quiet.write_text("starting\nstopped\n")
    assert devstack.last_error(quiet) == "stopped"
    assert devstack.last_error(tmp_path / "absent.log") == ""


def test_an_unreachable_database_is_named_without_its_password() -> None:
    assert (
        cli.without_password("postgresql+psycopg://reach:s3cret@db:5432/reach")
        == "postgresql+psycopg://reach:***@db:5432/reach"
    )
    assert cli.without_password("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    # libpq takes a password in the query too: it was printed as it was
    assert (
        cli.without_password("postgresql://u@db/reach?sslmode=require&PASSWORD=s3cret&x")
        == "postgresql://u@db/reach?sslmode=require&PASSWORD=***&x"
    )


def test_a_url_without_a_password_is_named_as_it_was_given() -> None:
    """urlunsplit drops the ``//`` of an empty host: ``postgresql:///reach?host=/tmp/s``
    was named ``postgresql:/reach?host=/tmp/s``."""
    for url in ("postgresql+psycopg:///reach?host=/tmp/s", "unix:///tmp/redis.sock?db=0"):
        assert cli.without_password(url) == url
    assert (
        cli.without_password("postgresql:///reach?host=/tmp/s&password=x")
        == "postgresql:///reach?host=/tmp/s&password=***"
    )


def test_only_what_libpq_refuses_of_the_url_is_named_as_the_urls_fault() -> None:
    """A statement's misuse (a closed cursor, a parameter count) is psycopg's plain
    ProgrammingError too: a bug, to be shown with its traceback, not blamed on the URL."""
    import psycopg

    with pytest.raises(psycopg.ProgrammingError) as refused:
        psycopg.connect("postgresql://u@127.0.0.1:1/db?connect_timeout=abc")
    assert cli._url_refused(refused.value) == "bad value for connect_timeout: 'abc'"

    def misused() -> None:
        raise psycopg.ProgrammingError("the cursor is closed")

    with pytest.raises(psycopg.ProgrammingError) as bug:
        misused()
    assert cli._url_refused(bug.value) is None
