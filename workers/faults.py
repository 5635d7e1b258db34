"""Fault injection for the tests, never set in production.

``REACH_FAULT_CRASH_AFTER_FINISH``: capabilities (comma-separated) whose pool process kills
itself (SIGKILL) right after a task's final state is written to Postgres and before its final
event is appended: the crash that once left a finished task's event stream open. Read once
when the runner is built; unset, the crash point is one test of an empty set.
"""

from __future__ import annotations

import os
import signal

CRASH_AFTER_FINISH = "REACH_FAULT_CRASH_AFTER_FINISH"


def crash_after_finish() -> frozenset[str]:
    return frozenset(c.strip() for c in os.environ.get(CRASH_AFTER_FINISH, "").split(",") if c)


def crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
