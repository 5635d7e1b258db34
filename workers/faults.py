"""Fault injection for the tests, never set in production.

``REACH_FAULT_CRASH_AFTER_FINISH``: capabilities (comma-separated) whose pool process kills
itself (SIGKILL) right after a task's final state is written to Postgres and before its final
event is appended: the crash that once left a finished task's event stream open. Read once
when the runner is built; unset, the crash point is one test of an empty set.

``REACH_FAULT_CRASH_AFTER_GROUP``: ``claims`` and/or ``finishes``: the process kills itself
right after it writes a group of more than one claim (before any of their handlers starts) or
of more than one final state (before any of their final events).

``REACH_FAULT_DIRECT_FAILS``: capabilities whose runs without Celery's request (on the event
loop or a pool thread, ``workers.pool``) fail before their claim, as when Postgres is away:
the message must take Celery's way.
"""

from __future__ import annotations

import os
import signal

CRASH_AFTER_FINISH = "REACH_FAULT_CRASH_AFTER_FINISH"
CRASH_AFTER_GROUP = "REACH_FAULT_CRASH_AFTER_GROUP"
DIRECT_FAILS = "REACH_FAULT_DIRECT_FAILS"


def _names(variable: str) -> frozenset[str]:
    return frozenset(c.strip() for c in os.environ.get(variable, "").split(",") if c)


def crash_after_finish() -> frozenset[str]:
    return _names(CRASH_AFTER_FINISH)


def crash_after_group() -> frozenset[str]:
    return _names(CRASH_AFTER_GROUP)


def direct_fails() -> frozenset[str]:
    return _names(DIRECT_FAILS)


def crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
