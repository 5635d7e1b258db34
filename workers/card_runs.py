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


class LineClosed(Exception):
    """The process is stopping: a run that would wait in line does not start at all (its task
    goes back to its queue, ``Runner``)."""


@dataclass(eq=False)
class _Waiter:
    wake: Callable[[], None]
    given: bool = False  # a run ending handed it its place
    closed: bool = False  # the process is stopping: it gives up


class CardRuns:
    """The runs of each bounded card in this process, and those waiting for one to end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[Hashable, int] = {}
        self._bounds: dict[Hashable, int] = {}  # each card's, as its last run came with it
        self._waiting: dict[Hashable, collections.deque[_Waiter]] = {}
        self._closed = False

    def running(self, card: Hashable) -> int:
        with self._lock:
            return self._runs.get(card, 0)

    def waiting(self, card: Hashable) -> int:
        with self._lock:
            return len(self._waiting.get(card, ()))

    def close(self) -> None:
        """The process is stopping (a warm shutdown): the runs waiting in line, and any that
        would, give up (``LineClosed``) instead of starting on its way out."""
        with self._lock:
            self._closed = True
            waiters = [w for line in self._waiting.values() for w in line]
            self._waiting.clear()
            for waiter in waiters:
                waiter.closed = True
        for waiter in waiters:
            waiter.wake()

    @contextlib.contextmanager
    def held(self, card: Hashable, bound: int | None) -> Iterator[None]:
        """A run of ``card`` (at most ``bound`` at once; None: no bound), for a thread."""
        if bound is None:
            yield
            return
        woken = threading.Event()
        waiter = _Waiter(woken.set)
        if not self._enter(card, bound, waiter):
            try:
                woken.wait()
            except BaseException:
                self._give_up(card, waiter)
                raise
            if waiter.closed:
                raise LineClosed(card)
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
            if waiter.closed:
                raise LineClosed(card)
        try:
            yield
        finally:
            self._leave(card)

    def _enter(self, card: Hashable, bound: int, waiter: _Waiter) -> bool:
        """True when the run may start now; else it waits in line (``waiter``). A bound
        raised since the line formed lets its first ones start now."""
        with self._lock:
            self._bounds[card] = bound
            runs = self._runs.get(card, 0)
            if runs < bound and card not in self._waiting:
                self._runs[card] = runs + 1
                return True
            if self._closed:
                raise LineClosed(card)
            self._waiting.setdefault(card, collections.deque()).append(waiter)
            admitted = self._admitted(card)
        for first in admitted:
            first.wake()
        return waiter.given

    def _leave(self, card: Hashable) -> None:
        """A run ended: its place goes to the first in line while the card's bound (as its
        last run came with it) allows, else it is free."""
        with self._lock:
            runs = self._runs[card] - 1
            if runs:
                self._runs[card] = runs
            else:
                del self._runs[card]
            admitted = self._admitted(card)
        for waiter in admitted:
            waiter.wake()

    def _admitted(self, card: Hashable) -> list[_Waiter]:
        """The first in line that may start now, counted as running (under the lock)."""
        line, bound = self._waiting.get(card), self._bounds.get(card, 0)
        admitted = []
        while line and self._runs.get(card, 0) < bound:
            waiter = line.popleft()
            waiter.given = True
            self._runs[card] = self._runs.get(card, 0) + 1
            admitted.append(waiter)
        if line is not None and not line:
            del self._waiting[card]
        if card not in self._runs and card not in self._waiting:
            self._bounds.pop(card, None)
        return admitted

    def _give_up(self, card: Hashable, waiter: _Waiter) -> None:
        with self._lock:
            if not waiter.given:
                if not waiter.closed:
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
