"""The benchmark's CPU accounting: a process of ours that ends within a phase counts as ours,
through the parent that reaps it, and not as another's load on the machine."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import psycopg
import pytest
from sqlalchemy.engine import make_url

from bench import machine
from bench.machine import Cpu

# A process that burns CPU for a while and prints the CPU seconds it used.
BURN = """
import time
until = time.process_time() + {seconds}
while time.process_time() < until:
    pass
print(time.process_time())
"""
# One that runs BURN in a child of its own, waits for it, and prints what the child printed.
PARENT_OF_BURN = """
import subprocess, sys
print(subprocess.run([sys.executable, "-c", {burn!r}], capture_output=True, text=True,
                     check=True).stdout.strip())
"""
# A tick of the kernel's CPU clock (/proc counts in 1/100 s), on each of user and system time.
TICKS_S = 0.02


def test_given_readings_expect_what_each_process_used_in_between() -> None:
    start = {
        (1, 0.0): Cpu(1.0, 0.0, parent=0),
        (2, 0.0): Cpu(2.0, 0.5, parent=1),
        (3, 0.0): Cpu(4.0, 0.0, parent=9),
    }
    end = {
        # 1 used 0.2 and reaped 2, which had used 0.4 more and reaped 0.1 more since the start
        (1, 0.0): Cpu(1.2, 3.0, parent=0),
        # born after the start, with a child of its own it has reaped
        (4, 0.0): Cpu(0.3, 0.1, parent=1),
    }
    # 3 ended with no parent in the set: what it used after the start is lost, and what it had
    # at the start is not taken from the others
    assert machine.used_s(start, end) == pytest.approx(0.2 + 0.4 + 0.1 + 0.3 + 0.1)
    assert machine.used_s(start, {}) == 0.0


def test_given_a_chain_that_ended_expect_it_counted_through_the_ancestor_left() -> None:
    start = {
        (1, 0.0): Cpu(1.0, 0.0, parent=0),
        (2, 0.0): Cpu(2.0, 0.0, parent=1),  # a worker
        (3, 0.0): Cpu(3.0, 0.0, parent=2),  # its pool child, reaped by it, then it by 1
    }
    end = {(1, 0.0): Cpu(1.0, 2.5 + 3.5, parent=0)}
    assert machine.used_s(start, end) == pytest.approx(0.5 + 0.5)
    # the worker was killed first, so its child went to init: never more than was used
    lost = {(1, 0.0): Cpu(1.0, 2.5, parent=0)}
    assert machine.used_s(start, lost) == 0.0


@pytest.mark.parametrize("script", ["burn", "parent_of_burn"])
def test_a_process_of_ours_that_ended_within_a_phase_counts_as_ours(script: str) -> None:
    burn = BURN.format(seconds=0.4)
    code = burn if script == "burn" else PARENT_OF_BURN.format(burn=burn)
    start = machine.snapshot()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    end = machine.snapshot()
    burned_s = float(done.stdout.strip())
    assert burned_s >= 0.4
    # before, an ended process dropped out of both readings, and its CPU counted as foreign
    assert machine.used_s(start.ours, end.ours) >= burned_s - TICKS_S


def test_a_postgres_backend_that_ended_within_a_phase_counts_in_the_services(
    database_url: str,
) -> None:
    conn = psycopg.connect(
        make_url(database_url).set(drivername="postgresql").render_as_string(False)
    )
    backend = psutil.Process(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
    start = machine.services_cpu()
    before = backend.cpu_times()
    until = time.monotonic() + 10
    while sum(backend.cpu_times()[:2]) - sum(before[:2]) < 0.4 and time.monotonic() < until:
        conn.execute("SELECT count(*) FROM generate_series(1, 500000)")
    used = backend.cpu_times()
    conn.close()
    psutil.wait_procs([backend], timeout=10)
    burned_s = sum(used[:2]) - sum(before[:2])
    assert burned_s >= 0.4
    # before, the backend dropped out of both readings with everything it had used
    assert machine.services_cpu_since(start) >= burned_s - TICKS_S
