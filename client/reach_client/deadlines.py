"""The end of a caller's wait (``tasks.wait``, ``run``): each request and each pause within
it is cut to the time left, so that ``timeout=`` bounds the whole wait, not each request."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reach_client.plans import Request

Clock = Callable[[], float]


class DeadlinePassed(Exception):
    """The deadline passed before a request could be answered: the plan that set it says
    what that means to its caller (``WaitTimeoutError``, with the task as last seen)."""


@dataclass(frozen=True)
class Deadline:
    at: float  # on ``clock``
    clock: Clock = time.monotonic

    @classmethod
    def after(cls, seconds: float | None, clock: Clock = time.monotonic) -> Deadline | None:
        """The deadline ``seconds`` from now; None (no deadline) for None."""
        return None if seconds is None else cls(clock() + seconds, clock)

    def left_s(self) -> float:
        return max(0.0, self.at - self.clock())

    @property
    def passed(self) -> bool:
        return self.left_s() <= 0

    def bound(self, request: Request) -> Request:
        """``request`` with no phase waiting past the deadline; ``DeadlinePassed`` when no
        time is left to send it."""
        left = self.left_s()
        if left <= 0:
            raise DeadlinePassed
        return replace(request, within_s=left)

    def cut(self, seconds: float) -> float:
        """A pause of ``seconds``, ending by the deadline at the latest."""
        return min(seconds, self.left_s())
