"""A soft time limit for one handler call, set per task (the agent's timeout or the time left
to the deadline, whichever is shorter). Celery's own limits are per task type, and all our
capabilities share one task type; this one is set for each call.

It uses SIGALRM, so it applies where the handler runs in the main thread of its process (the
prefork pool); elsewhere only Celery's hard limit applies. None is no limit; a limit of zero
or less is one already passed, anywhere: the body does not run.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class SoftTimeLimit(Exception):
    """The handler ran past its time; raised inside it so it can clean up."""


def _raise(signum: int, frame: FrameType | None) -> None:
    raise SoftTimeLimit("the handler ran past its time limit")


@contextmanager
def soft_limit(seconds: float | None) -> Iterator[None]:
    # Zero is the deadline reached (``Context.time_left_s`` stops there), not "no limit":
    # read as none, it let a handler run to Celery's hard limit, the longest of any agent's.
    if seconds is not None and seconds <= 0:
        raise SoftTimeLimit("the time limit had passed before the handler started")
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
