"""How busy the machine is with work that is not ours.

A two-core machine shared with anything else (another test run, a build) gives figures that
mean nothing, so each phase records the CPU used by processes outside this run, and a run can
wait for a quiet machine before it starts. Postgres and Redis count as ours: they are shared
services, and their work for this run cannot be told apart from their work for others.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil

SERVICES = ("postgres", "redis-server")


@dataclass(frozen=True)
class Snapshot:
    at: float
    busy_s: float  # all CPUs, all processes
    # CPU seconds of this process, its descendants and the shared services, by (pid, start).
    ours: dict[tuple[int, float], float]


def snapshot() -> Snapshot:
    times = psutil.cpu_times()
    busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
    return Snapshot(time.monotonic(), busy, _ours())


def _ours() -> dict[tuple[int, float], float]:
    me = psutil.Process(os.getpid())
    family = {me.pid, *(c.pid for c in me.children(recursive=True))}
    found = {}
    for proc in psutil.process_iter(["name", "cpu_times", "create_time"]):
        cpu = proc.info["cpu_times"]
        if cpu is None:
            continue
        if proc.pid in family or (proc.info["name"] or "").startswith(SERVICES):
            found[(proc.pid, proc.info["create_time"])] = cpu.user + cpu.system
    return found


def services_cpu() -> dict[tuple[int, float], float]:
    """CPU seconds each Postgres and Redis process alive now has used, by (pid, start)."""
    found = {}
    for proc in psutil.process_iter(["name", "cpu_times", "create_time"]):
        cpu = proc.info["cpu_times"]
        if cpu is not None and (proc.info["name"] or "").startswith(SERVICES):
            found[(proc.pid, proc.info["create_time"])] = cpu.user + cpu.system
    return found


def services_cpu_since(start: dict[tuple[int, float], float]) -> float:
    """CPU seconds Postgres and Redis used since ``start`` (a ``services_cpu()``): per process,
    so a backend that exits within the phase drops out of both ends instead of making the
    figure negative. The services are shared, so this includes any other client's work: a
    rough figure, read it with ``foreign_cores``."""
    return sum(cpu - start.get(key, 0.0) for key, cpu in services_cpu().items())


def foreign_cores(start: Snapshot, end: Snapshot) -> float:
    """Cores kept busy by others between two snapshots (1.0: one whole core). What our
    processes that ended in between used counts as foreign: an overestimate, never an under."""
    elapsed = end.at - start.at
    if elapsed <= 0:
        return 0.0
    ours = sum(cpu - start.ours.get(key, 0.0) for key, cpu in end.ours.items())
    return round(max(0.0, (end.busy_s - start.busy_s - ours) / elapsed), 3)


def wait_quiet(max_wait_s: float, threshold_cores: float, window_s: float = 2.0) -> float:
    """Wait (at most ``max_wait_s``) until others use under ``threshold_cores``; the last
    measured figure."""
    deadline = time.monotonic() + max_wait_s
    while True:
        start = snapshot()
        time.sleep(window_s)
        busy = foreign_cores(start, snapshot())
        if busy < threshold_cores or time.monotonic() >= deadline:
            return busy


class Meter:
    """Records, per named phase, the cores others kept busy while it ran."""

    def __init__(self) -> None:
        self.foreign: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = snapshot()
        yield
        self.foreign[name] = foreign_cores(start, snapshot())
