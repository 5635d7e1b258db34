"""A card's ``max_concurrency`` in the process that runs its tasks, whoever took the message.

On the threads pool with a Redis broker the loop consumer keeps a card's messages in its
queue while the card holds its bound (``workers.loop_consumer``): nothing waits here then.
Where Celery's consumer takes the messages (OpenTelemetry on, a broker that is not Redis, a
message the loop leaves to it), it takes as many as its prefetch allows, so the bound is
held here instead: a run past it waits, before its claim, for one of the card's runs to end,
holding its message (unacked) and its thread or coroutine. Runs wait in the order they came.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from dataclasses import dataclass

from broker.registry.model import Card


@dataclass(eq=False)
class _Waiter:
    wake: Callable[[], None]
    given: bool = False  # a run ending handed it its place


class CardRuns:
    """The runs of each bounded card in this process, and those waiting for one to end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[Hashable, int] = {}
        self._waiting: dict[Hashable, collections.deque[_Waiter]] = {}

    def running(self, card: Hashable) -> int:
        with self._lock:
            return self._runs.get(card, 0)

    def waiting(self, card: Hashable) -> int:
        with self._lock:
            return len(self._waiting.get(card, ()))

    @contextlib.contextmanager
    def held(self, card: Hashable, bound: int | None) -> Iterator[None]:
        """A run of ``card`` (at most ``bound`` at once; None: no bound), for a thread."""
        if bound is None:
            yield
            return
        woken = threading.Event()
        if not self._enter(card, bound, _Waiter(woken.set)):
            woken.wait()
        try:
            yield
        finally:
            self._leave(card)

    @contextlib.asynccontextmanager
    async def held_async(self, card: Hashable, bound: int | None) -> AsyncIterator[None]:
        """``held`` for a coroutine: it waits without its loop's thread."""
        if bound is None:
            yield
            return
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        waiter = _Waiter(lambda: _wake(loop, woken))
        if not self._enter(card, bound, waiter):
            try:
                await woken
            except BaseException:  # cancelled while it waited: its place, if given, goes on
                self._give_up(card, waiter)
                raise
        try:
            yield
        finally:
            self._leave(card)

    def _enter(self, card: Hashable, bound: int, waiter: _Waiter) -> bool:
        """True when the run may start now; else it waits in line (``waiter``)."""
        with self._lock:
            runs = self._runs.get(card, 0)
            if runs < bound and card not in self._waiting:
                self._runs[card] = runs + 1
                return True
            self._waiting.setdefault(card, collections.deque()).append(waiter)
            return False

    def _leave(self, card: Hashable) -> None:
        """A run ended: its place goes to the first in line, else it is free."""
        with self._lock:
            line = self._waiting.get(card)
            if not line:
                runs = self._runs[card] - 1
                if runs:
                    self._runs[card] = runs
                else:
                    del self._runs[card]
                return
            waiter = line.popleft()
            if not line:
                del self._waiting[card]
            waiter.given = True
        waiter.wake()

    def _give_up(self, card: Hashable, waiter: _Waiter) -> None:
        with self._lock:
            if not waiter.given:
                line = self._waiting[card]
                line.remove(waiter)
                if not line:
                    del self._waiting[card]
                return
        self._leave(card)


def bound_of(card: Card) -> tuple[Hashable, int | None]:
    """The key a card's runs are counted by, and its ``max_concurrency`` (None: no bound).
    By capability and agent, whatever its version: an agent registered again at a new
    version with calls in flight got as many more."""
    return (card.capability, card.agent_id), card.max_concurrency or None


def _wake(loop: asyncio.AbstractEventLoop, woken: asyncio.Future[None]) -> None:
    with contextlib.suppress(RuntimeError):  # its loop closed: the process is ending
        loop.call_soon_threadsafe(_settle, woken)


def _settle(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
