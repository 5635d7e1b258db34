"""The folder each ``celery -A workers`` process keeps its metrics in
(``broker.observability.metrics_dirs``).

A worker started with ``--detach`` wrote the pid of the process that made its folder, which
exits at the detach: the next ``celery -A workers`` command of the host took the running
worker's folder for abandoned and removed it, and each pool process forked after that failed
every task it claimed (its metrics file could not be made)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import redis

from broker.observability import metrics_dirs
from broker.registry.model import lease_key
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import BIN, ROOT, ServedApp, environment, start_worker, wait_for_task
from tests.integration.test_capacity import stack_for

__all__ = ["stack_for"]  # a fixture of test_capacity's, used here
LONG_AGO_S = 2 * metrics_dirs.ABANDONED_AFTER_S


def _folders(parent: Path) -> list[Path]:
    return sorted(parent.glob(metrics_dirs.PREFIX + "*"))


def _backdate(folder: Path) -> None:
    """Make the folder look made ``LONG_AGO_S`` ago (its lock file says when)."""
    made = time.time() - LONG_AGO_S
    lock = folder / metrics_dirs.LOCK
    os.utime(lock if lock.exists() else folder, (made, made))


def _celery(settings: Settings, temp: Path, *args: str) -> None:
    """``celery -A workers <args>`` with its temporary files in ``temp``, run to its end."""
    env = {k: v for k, v in environment(settings).items() if k != metrics_dirs.ENV}
    subprocess.run(
        [str(BIN / "celery"), "-A", "workers", *args],
        env={**env, "TMPDIR": str(temp)},
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.fixture
def detached(
    settings: Settings, own_redis: str, tmp_path: Path
) -> Iterator[Callable[[], psutil.Process]]:
    """``celery -A workers worker --detach`` serving ``echo`` on the test's own Redis db, its
    temporary files in ``tmp_path/tmp``; stopped through its pid file at the end."""
    local = settings.model_copy(update={"redis_url": own_redis})
    pidfile, logfile = tmp_path / "worker.pid", tmp_path / "worker.log"

    def start() -> psutil.Process:
        name = f"detached-{secrets.token_hex(3)}"
        args = ["worker", "--detach", f"--pidfile={pidfile}", f"--logfile={logfile}"]
        args += ["-Q", "echo", "-n", f"{name}@%h", "-c", "1", "-l", "INFO"]
        _celery(local, tmp_path / "tmp", *args, "--without-gossip", "--without-mingle")
        lease = lease_key(f"{name}@{socket.gethostname()}")
        with redis.Redis.from_url(own_redis) as client:  # its lease: it serves echo
            eventually(lambda: client.exists(lease), "the detached worker to be ready", 60)
        return psutil.Process(int(pidfile.read_text()))

    (tmp_path / "tmp").mkdir()
    yield start
    if pidfile.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
        eventually(lambda: not pidfile.exists(), "the detached worker to stop", 60)


def test_a_detached_workers_metrics_folder_stays_while_it_runs_and_goes_at_its_clean_stop(
    settings: Settings,
    tmp_path: Path,
    detached: Callable[[], psutil.Process],
    stack_for: Callable[..., ServedApp],
    make_key: KeyMaker,
) -> None:
    temp = tmp_path / "tmp"
    api = stack_for()
    _, token = make_key()
    # Given a worker started with --detach (the process that made its folder is gone)
    worker = detached()
    folder = Path(worker.environ()[metrics_dirs.ENV])
    assert folder.parent == temp

    # When another celery -A workers command runs on the host, even long after
    _backdate(folder)
    _celery(settings, temp, "report")

    # Expect the worker's folder still there
    assert folder.exists()
    # ... and a pool process forked after (the one before killed) still running tasks
    [child] = worker.children()
    child.kill()
    eventually(
        lambda: [c.pid for c in worker.children()] not in ([], [child.pid]),
        "the worker to fork a new pool process",
    )
    with client_for(api, token) as http:
        submitted = http.post("/tasks", json={"capability": "echo", "payload": {"n": 1}})
        assert submitted.status_code == 202, submitted.text
        task = wait_for_task(http, submitted.json()["task_id"], {"succeeded", "failed"})
    assert task["status"] == "succeeded", task

    # ... and the folder removed by the worker when it stops cleanly
    os.kill(worker.pid, signal.SIGTERM)
    eventually(lambda: not worker.is_running(), "the detached worker to stop", 60)
    assert not folder.exists()


def test_a_folder_goes_once_nobody_holds_its_lock_and_it_is_old(
    settings: Settings, tmp_path: Path
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {"TMPDIR": str(temp)}
    queue = f"test.metrics-{secrets.token_hex(3)}"  # a queue nothing is sent to
    # Given a worker killed with -9, whose folder stays, a running one, and a folder of a
    # version before the locks (none in it)
    killed = start_worker(settings, queue, "metrics-killed", tmp_path, env, concurrency=1)
    [left] = _folders(temp)
    killed.kill_hard()
    running = start_worker(settings, queue, "metrics-running", tmp_path, env, concurrency=1)
    [held] = [f for f in _folders(temp) if f != left]
    unlocked = temp / f"{metrics_dirs.PREFIX}before-locks"
    unlocked.mkdir()

    try:
        # When a celery command runs soon after, expect the killed one's folder still there:
        # it may be a worker's between its --detach and its start
        _celery(settings, temp, "report")
        assert _folders(temp) == sorted([left, held, unlocked])

        # ... and when one runs once they are old, the killed one's removed, the others kept
        _backdate(left)
        _backdate(held)
        _backdate(unlocked)
        _celery(settings, temp, "report")
        assert _folders(temp) == sorted([held, unlocked])
    finally:
        running.stop()

    # ... and the running one's removed when it stops cleanly
    assert _folders(temp) == [unlocked]
