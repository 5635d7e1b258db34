"""Waiting for the other side: poll until a fact holds, instead of sleeping a guess."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
LAST_SEEN_CHARS = 2000  # the statuses of a thousand tasks need not fill the report


def eventually(
    check: Callable[[], T],
    what: str,
    timeout_s: float = 30,
    interval_s: float = 0.05,
    until: Callable[[T], object] = bool,
) -> T:
    """Call ``check`` until ``until`` holds for its value (by default: until it is truthy) and
    return that value; the timeout only bounds a hang. A failure names ``what`` was awaited
    and the last value ``check`` gave."""
    deadline = time.monotonic() + timeout_s
    while not until(found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what} (last seen: {repr(found)[:LAST_SEEN_CHARS]})")
        time.sleep(interval_s)
    return found
