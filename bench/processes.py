"""The processes a run starts, each in a session of its own, and how they are stopped.

Every child goes into one ``Children`` registry; leaving it (normally, on an error or on
Ctrl-C) stops them newest first: SIGTERM, then SIGKILL to the child's own process group, so a
Celery worker's pool processes go with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import psutil

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent


def process_cpu_s(proc: psutil.Process) -> float:
    """CPU seconds a process has used, to the nanosecond where the OS tells: Linux's
    process-wide CPU clock of another pid. ``cpu_times`` counts in 10 ms ticks, and each pool
    process of a short run rounds down to nothing there."""
    try:
        return time.clock_gettime(((~proc.pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, SCHED)
    except (OSError, OverflowError, AttributeError):
        pass
    with contextlib.suppress(psutil.Error):
        times = proc.cpu_times()
        return float(times.user + times.system)
    return 0.0


class Child:
    """One subprocess with its output in ``log_path``."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        # A session of its own: Ctrl-C reaches only us, and we stop children in order.
        self.process = subprocess.Popen(
            args,
            env=env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def family(self) -> list[psutil.Process]:
        """The process and its descendants (a prefork worker's pool), while they exist."""
        try:
            parent = psutil.Process(self.pid)
            return [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu_s(self) -> float:
        """CPU seconds used so far by the process and its live descendants."""
        return sum(process_cpu_s(proc) for proc in self.family())

    def stop(self, timeout_s: float = 20) -> None:
        if not self.alive():
            # It ended before we asked: say how, or a figure may be read without its cause.
            print(
                f"bench: {self.name} had already exited with {self.process.returncode};"
                f" see {self.log_path}",
                file=sys.stderr,
            )
        else:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout_s)
        # Whatever is left of its group (pool processes of a worker killed mid-way) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        self._log.close()


class Children:
    """The registry of started children; a context manager that stops them all on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._running: list[Child] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> Child:
        child = Child(name, args, env, self.log_dir / f"{name}.log")
        self._running.append(child)
        return child

    def stop(self, child: Child) -> None:
        child.stop()
        if child in self._running:
            self._running.remove(child)

    def stop_all(self) -> None:
        while self._running:
            self._running.pop().stop()

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def wait_until(
    ready: Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    child: Child | None = None,
    every_s: float = 0.05,
) -> None:
    """Poll ``ready`` until it holds; fail early when ``child`` exits, late after the timeout."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if child is not None and not child.alive():
            raise RuntimeError(f"{child.name} exited while {what}:\n{child.output()[-4000:]}")
        if time.monotonic() > deadline:
            tail = child.output()[-4000:] if child is not None else ""
            raise RuntimeError(f"timed out after {timeout_s:.0f}s {what}\n{tail}")
        time.sleep(every_s)


def celery_worker(
    children: Children,
    name: str,
    app: str,
    queues: str,
    concurrency: int,
    env: dict[str, str],
    pool: str = "prefork",
) -> Child:
    """``celery -A app worker``: prefork (or ``pool``), ``concurrency`` processes (or threads,
    greenlets), no gossip or mingle (one worker alone needs neither), warnings only (a log line
    per task would cost the worker)."""
    args = [str(BIN / "celery"), "-A", app, "worker", "-Q", queues, "-n", f"{name}@%h"]
    args += ["-P", pool, "-c", str(concurrency), "-l", "WARNING"]
    args += ["--without-gossip", "--without-mingle"]
    return children.start(name, args, env)


def child_env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "BENCH_"))}
    env.pop("DATABASE_URL", None)
    env.pop("REDIS_URL", None)
    # The benchmark's one tenant may hold every slot of a worker (``REACH_MAX_SLOTS_SHARE``
    # keeps a tenth of them for the other tenants by default): each phase compares systems at
    # the same number of calls in flight.
    env.setdefault("REACH_MAX_SLOTS_SHARE", "1")
    env.update(values, PYTHONPATH=str(ROOT))
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
