"""What ``reach``'s exit status says, so scripts can branch on it:

====  ==============================================================
0     done; a waited-for task ``succeeded``
1     the task ``failed``
2     usage: bad arguments, bad JSON, no API key configured (the URL has a default)
3     the task ``expired`` (its deadline or its time limit passed)
4     the task was ``cancelled``
5     ``--timeout`` ran out while the task was still queued or running (it goes on)
6     the API refused the request (the problem's code is printed)
7     the API could not be reached (connection refused, timeout)
130   interrupted (Ctrl-C); a task already submitted goes on, and stderr names it (or, for
      a submit cut short, the idempotency key that reaches the task it may have made)
141   stdout was closed (``| head -1``): 128 + SIGPIPE, as Unix tools exit; a task already
      submitted goes on
====  ==============================================================
"""

from __future__ import annotations

OK = 0
FAILED = 1
USAGE = 2
EXPIRED = 3
CANCELLED = 4
STILL_RUNNING = 5
API_ERROR = 6
UNREACHABLE = 7
INTERRUPTED = 130
BROKEN_PIPE = 141

BY_STATUS = {"succeeded": OK, "failed": FAILED, "expired": EXPIRED, "cancelled": CANCELLED}


def for_status(status: str) -> int:
    """The exit status for a task that ended ``status`` (a task still running: OK)."""
    return BY_STATUS.get(status, OK)
