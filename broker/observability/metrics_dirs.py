"""The folder a process keeps its metrics in when it has children that count too: a
``celery -A workers`` process's prefork children, ``reach api --workers N``'s API processes.
They share metrics through files (prometheus-client's multiprocess mode), in
``$TMPDIR/reach-metrics-*`` unless ``PROMETHEUS_MULTIPROC_DIR`` names a folder of the
operator's.

The process that serves a folder holds an exclusive ``flock`` on its ``lock`` file for as long
as it runs (its pool children inherit it), and removes the folder when it exits cleanly. A
folder left by a process killed with -9 is removed by a process starting later, once nobody
holds its lock and it is ``ABANDONED_AFTER_S`` old. A pid written in the folder was not
enough: ``--detach`` execs the worker in a new process, so the pid that made the folder is
gone while the worker uses it, and a pid of another container's namespace says nothing here.
The age covers the moment of a detach when no process holds the lock yet: the worker takes
it again when it starts (``choose``, and ``hold_again`` after beat's in-process detach, which
closes every open file: ``workers.metrics_dirs`` connects it to Celery's signals)."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "reach-metrics-"
LOCK = "lock"
ABANDONED_AFTER_S = 600.0
DETACH_EXIT_S = 5.0


@dataclass
class _Held:
    folder: Path
    fd: int
    pid: int


_held: _Held | None = None


def choose() -> Path:
    """Choose this process's folder, before prometheus-client's metrics are made, and name it
    in the environment its children inherit. A folder of ours in the environment is taken
    when its lock is free (this worker before ``--detach`` made it); when another process
    holds it (``celery multi``, or a task's subprocess), this one makes its own."""
    named = os.environ.get(ENV)
    if named is None or ((Path(named) / LOCK).exists() and not _hold(Path(named))):
        parent = Path(tempfile.gettempdir())
        sweep(parent)
        made = Path(tempfile.mkdtemp(prefix=PREFIX))
        if not _hold(made, create=True):
            raise RuntimeError(f"cannot lock the metrics folder {made}")
        os.environ[ENV] = str(made)
    # The command may have imported prometheus_client already (Flower's CLI plugin does for
    # celery's), fixing its value class before the folder was set: choose it again. Metrics
    # are created after this, when broker.observability.metrics is imported.
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    return Path(os.environ[ENV])


def hold_again(**_: object) -> None:
    """When a worker or beat starts (Celery's signals), after any detach: beat's ``--detach``
    forks in process and closes every file, the lock's too, so it is taken again under the
    new pid."""
    global _held
    held = _held
    if held is None:
        return
    if _same_file(held.fd, held.folder / LOCK):  # still open, if forked: the lock is ours
        _held = _Held(held.folder, held.fd, os.getpid())
    else:  # the processes the detach left are exiting: they may hold it a moment longer
        _hold(held.folder, wait_s=DETACH_EXIT_S)


def sweep(parent: Path, abandoned_after_s: float = ABANDONED_AFTER_S) -> list[Path]:
    """Remove the metrics folders in ``parent`` whose lock nobody holds and that are older than
    ``abandoned_after_s``; the folders removed. One without a lock file (made by a version
    before the locks, or being made) stays."""
    removed = []
    for folder in parent.glob(PREFIX + "*"):
        try:
            age_s = time.time() - (folder / LOCK).stat().st_mtime
        except OSError:
            continue
        fd = _lock(folder / LOCK) if age_s >= abandoned_after_s else None
        if fd is None:
            continue
        try:  # under the lock: a process that takes it after finds the folder gone
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(folder)
    return removed


def _hold(folder: Path, *, create: bool = False, wait_s: float = 0) -> bool:
    global _held
    deadline = time.monotonic() + wait_s
    fd = _lock(folder / LOCK, create=create)
    while fd is None and time.monotonic() < deadline:
        time.sleep(0.05)
        fd = _lock(folder / LOCK)
    if fd is None:
        return False
    if _held is None:
        atexit.register(_remove_held)
    _held = _Held(folder, fd, os.getpid())
    return True


def _lock(path: Path, *, create: bool = False) -> int | None:
    """An open file holding ``path``'s exclusive lock, or None: another process holds it, or
    the folder is gone (a sweep removed it between the open and the lock)."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    if not _same_file(fd, path):
        os.close(fd)
        return None
    return fd


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still ``path``: a detach may have closed it, and its number be reused."""
    try:
        opened, named = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino)


def _remove_held() -> None:
    held = _held
    # Never a forked pool child's exit, should one run atexit; nor a lock a detach closed.
    if held is not None and held.pid == os.getpid() and _same_file(held.fd, held.folder / LOCK):
        shutil.rmtree(held.folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(held.fd)
