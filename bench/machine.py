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
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil

SERVICES = ("postgres", "redis-server")

Key = tuple[int, float]  # (pid, start time): a pid reused by a new process is a new key


@dataclass(frozen=True)
class Cpu:
    """A process's CPU seconds: its own, and its children's that it has waited for (the
    kernel adds a child's whole CPU, its own waited-for children's included, to its parent's
    when the parent reaps it); and its parent's pid."""

    own_s: float
    children_s: float
    parent: int = 0


@dataclass(frozen=True)
class Snapshot:
    at: float
    busy_s: float  # all CPUs, all processes
    # This process, its descendants and the shared services, by key.
    ours: dict[Key, Cpu]


def snapshot() -> Snapshot:
    times = psutil.cpu_times()
    busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
    return Snapshot(time.monotonic(), busy, _ours())


def _ours() -> dict[Key, Cpu]:
    me = psutil.Process(os.getpid())
    family = {me.pid, *(c.pid for c in me.children(recursive=True))}
    return _cpu_of(lambda proc: proc.pid in family or _is_service(proc))


def _is_service(proc: psutil.Process) -> bool:
    return (proc.info["name"] or "").startswith(SERVICES)


def _cpu_of(wanted: Callable[[psutil.Process], bool]) -> dict[Key, Cpu]:
    found = {}
    for proc in psutil.process_iter(["name", "cpu_times", "create_time", "ppid"]):
        cpu = proc.info["cpu_times"]
        if cpu is not None and wanted(proc):
            own, children = cpu.user + cpu.system, cpu.children_user + cpu.children_system
            found[(proc.pid, proc.info["create_time"])] = Cpu(own, children, proc.info["ppid"])
    return found


def used_s(start: dict[Key, Cpu], end: dict[Key, Cpu]) -> float:
    """CPU seconds a set of processes used between two readings, those that ended in between
    included. A process that ended was reaped by its parent, and its CPU moved into the
    parent's children's figure (and on up, as each parent is reaped): when an ancestor is still
    in the set (a Postgres backend under the postmaster, a pool child under its worker, a
    worker under this process), what the ended one used after ``start`` is that ancestor's
    gain less what the ended one had at ``start``. What a process left to no ancestor in the
    set is lost, so this is never more than was used."""
    used = sum(cpu.own_s - start[key].own_s for key, cpu in end.items() if key in start)
    used += sum(cpu.own_s + cpu.children_s for key, cpu in end.items() if key not in start)
    reaped = {
        key: cpu.children_s - start[key].children_s for key, cpu in end.items() if key in start
    }
    owed = dict.fromkeys(reaped, 0.0)  # what ended processes had at ``start``, by ancestor
    by_pid = {key[0]: key for key in start}
    for key, cpu in start.items():
        if key in end:
            continue
        ancestor, seen = by_pid.get(cpu.parent), {key}
        while ancestor is not None and ancestor not in end and ancestor not in seen:
            seen.add(ancestor)
            ancestor = by_pid.get(start[ancestor].parent)
        if ancestor in owed:
            owed[ancestor] += cpu.own_s + cpu.children_s
    return used + sum(max(0.0, reaped[key] - owed[key]) for key in reaped)


def services_cpu() -> dict[Key, Cpu]:
    """The CPU of each Postgres and Redis process alive now."""
    return _cpu_of(_is_service)


def services_cpu_since(start: dict[Key, Cpu]) -> float:
    """CPU seconds Postgres and Redis used since ``start`` (a ``services_cpu()``), a backend
    that exited within the phase included (``used_s``). The services are shared, so this
    includes any other client's work: a rough figure, read it with ``foreign_cores``."""
    return used_s(start, services_cpu())


@contextlib.contextmanager
def cpu_spent(**processes: Callable[[], float]) -> Iterator[dict[str, float]]:
    """CPU seconds used while the block runs, filled in when it ends: by each named process
    (``processes``: a reading of its CPU seconds so far, such as ``Child.cpu_s``), by this one
    (``client``: the publisher or HTTP client, and the benchmark's own polling) and by
    Postgres and Redis (``services``: shared, so rough; ``services_cpu_since``). A figure of
    one process alone leaves out whatever a system moves to its other processes."""
    at_start = {name: read() for name, read in processes.items()}
    client_at_start, services_at_start = time.process_time(), services_cpu()
    spent: dict[str, float] = {}
    yield spent
    spent.update({name: read() - at_start[name] for name, read in processes.items()})
    spent["client"] = time.process_time() - client_at_start
    spent["services"] = services_cpu_since(services_at_start)


def per_task_ms(spent: dict[str, float], done: int) -> dict[str, float]:
    """``cpu_spent``'s seconds as ms per task done (not per task asked for: a run that lost
    some would look cheaper), each as ``<name>_cpu_ms_per_task``, and their sum as
    ``all_cpu_ms_per_task``."""

    def ms(seconds: float) -> float:
        return round(seconds * 1000 / max(1, done), 3)

    figures = {f"{name}_cpu_ms_per_task": ms(seconds) for name, seconds in spent.items()}
    figures["all_cpu_ms_per_task"] = ms(sum(spent.values()))
    return figures


def foreign_cores(start: Snapshot, end: Snapshot) -> float:
    """Cores kept busy by others between two snapshots (1.0: one whole core). Our processes
    that ended in between count as ours through the parents that reaped them (``used_s``);
    any CPU that cannot be traced counts as foreign: an overestimate, never an under."""
    elapsed = end.at - start.at
    if elapsed <= 0:
        return 0.0
    ours = used_s(start.ours, end.ours)
    return round(max(0.0, (end.busy_s - start.busy_s - ours) / elapsed), 3)


LOOP_ADDITIONS = 5_000_000


def loop_s(rounds: int = 3) -> float:
    """Seconds a bare Python loop of ``LOOP_ADDITIONS`` additions takes, the best of
    ``rounds``: the CPU's own speed this hour, which on a virtual machine changes without any
    steal time or load to show for it. A run records it at its start and end, to be read
    beside another run's. It is not the whole of a slow hour: the cost of each hop between
    processes and of each flush to disk varies apart from it (``docs/performance.md``)."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        total = 0
        for i in range(LOOP_ADDITIONS):
            total += i
        best = min(best, time.perf_counter() - started)
    return round(best, 3)


def speed_line(start_s: float, end_s: float) -> str:
    """The report's line for two ``loop_s`` readings, at a run's start and end."""
    return (
        f"The machine's speed: a Python loop of {LOOP_ADDITIONS:,} additions took {start_s} s"
        f" at the start of the run and {end_s} s at its end"
    )


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
