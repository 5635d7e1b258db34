"""Agent-Reach workers: ``celery -A workers worker -Q <capability>``.

Agents import the SDK from here: ``from workers import agent, Context, AgentFailure``.
The Celery app is built on first access to ``workers.app``, from the environment's settings.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

from workers.sdk import AgentFailure, Context, Retryable, SessionConflict, agent

__all__ = ["AgentFailure", "Context", "Retryable", "SessionConflict", "agent", "app"]

_app: Any = None


METRICS_DIR_PREFIX = "reach-metrics-"
METRICS_DIR_OWNER = "owner"  # in each folder made here: "<host name> <pid>" of its process


def _prepare_metrics_dir() -> None:
    """Prefork children share metrics through files (prometheus-client's multiprocess mode);
    the folder must be known before prometheus_client is first imported.

    A folder made here is removed when this process exits cleanly (a worker's warm or cold
    shutdown, beat, any ``celery -A workers`` command). One left by a process killed with -9
    is removed by the next process of this host to start (``sweep_metrics_dirs``)."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        parent = Path(tempfile.gettempdir())
        sweep_metrics_dirs(parent)
        made = Path(tempfile.mkdtemp(prefix=METRICS_DIR_PREFIX))
        (made / METRICS_DIR_OWNER).write_text(f"{socket.gethostname()} {os.getpid()}")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(made)
        atexit.register(_remove_metrics_dir, made, os.getpid())
    # The celery command may have imported prometheus_client already (Flower's CLI plugin
    # does), fixing its value class before the folder was set: choose it again. Metrics are
    # created after this, when broker.observability.metrics is imported.
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


def _remove_metrics_dir(folder: Path, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # never a forked child's exit, should one run atexit
        shutil.rmtree(folder, ignore_errors=True)


def sweep_metrics_dirs(parent: Path) -> list[Path]:
    """Remove the metrics folders in ``parent`` that a process of this host made and that is
    gone; the folders removed. A folder whose owner is another host's (a /tmp shared across
    containers), still running, or unknown (none written: made before owners were) stays."""
    host = socket.gethostname()
    removed = []
    for folder in parent.glob(METRICS_DIR_PREFIX + "*"):
        try:
            owner_host, _, pid = (folder / METRICS_DIR_OWNER).read_text().partition(" ")
        except OSError:
            continue
        if owner_host == host and pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def __getattr__(name: str) -> Any:
    # Celery's `-A workers` looks up `workers.app`; building it here, not at import, keeps
    # settings out of import time for code that only needs the SDK.
    global _app
    if name in ("app", "celery"):
        if _app is None:
            _prepare_metrics_dir()
            from broker.settings import Settings
            from workers.application import create_celery_app

            _app = create_celery_app(Settings())
        return _app
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
