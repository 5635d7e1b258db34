"""Group commit: calls that arrive while one is in flight go out together in the next.

A call that finds nothing in flight goes out at once, alone; calls that arrive meanwhile wait
for it and then go out as one batch (one statement, one Redis call). At rest this adds nothing;
under load one round trip serves many requests. ``Grouped`` serves coroutines on one event
loop (the API); ``ThreadGrouped`` serves threads (a worker on the threads pool).

A batch holds at most ``max_items``, and, given ``weigh``, at most ``max_bytes`` of what its
items weigh (always one item, however heavy): a group of rows goes out as one JSON parameter,
and Postgres refuses a ``jsonb`` value past 256 MiB (``ProgramLimitExceeded``, which psycopg
makes an ``OperationalError``, an outage's error): 100 results of 4 MiB failed each of their
callers, every try, where each alone went in. A batch runs in a context of its own, not the
one of the caller that happened to start it: its log lines are no task's.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from broker.outages import INFRASTRUCTURE_ERRORS

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("reach.grouping")
GROUP_MAX_BYTES = 32 * 1024 * 1024  # well inside Postgres's 256 MiB for one jsonb value


def _taken(items: list[T], max_bytes: int, weigh: Callable[[T], int] | None) -> int:
    """How many of ``items`` (the first ``max_items`` waiting), from the first, the next
    batch takes: at most ``max_bytes`` by ``weigh``, but always the first."""
    if weigh is None:
        return len(items)
    count, total = 0, 0
    for item in items:
        total += weigh(item)
        if count and total > max_bytes:
            break
        count += 1
    return count


class Grouped(Generic[T, R]):
    """``await grouped(item)`` answers what ``run_many(items)[i]`` answered for it.

    With ``retry_alone``, a batch that fails with an error about its data is tried again item
    by item, so one bad item fails only its own caller: right for one statement, which either
    applies whole or not at all. A Redis script that fails midway has applied its first part,
    so a second try would repeat it (an event twice, a token taken twice): there every caller
    gets the error. When Postgres or Redis is away, all get the error in any case.
    """

    def __init__(
        self,
        run_many: Callable[[list[T]], Awaitable[list[R]]],
        *,
        max_items: int,
        name: str,
        retry_alone: bool,
        weigh: Callable[[T], int] | None = None,
        max_bytes: int = GROUP_MAX_BYTES,
    ) -> None:
        self.run_many = run_many
        self.max_items = max_items
        self.name = name
        self.retry_alone = retry_alone
        self.weigh = weigh
        self.max_bytes = max_bytes
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def __call__(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._waiting.append((item, future))
        flusher = self._flusher
        if flusher is None or flusher.done() or flusher.get_loop() is not loop:
            self._flusher = asyncio.create_task(
                self._flush(), name=f"reach-group-{self.name}", context=contextvars.Context()
            )
        return await future

    async def _flush(self) -> None:
        while self._waiting:
            items = [item for item, _ in self._waiting[: self.max_items]]
            batch = self._waiting[: _taken(items, self.max_bytes, self.weigh)]
            del self._waiting[: len(batch)]
            try:
                answers = await self.run_many([item for item, _ in batch])
            except Exception as exc:
                if not _one_by_one(exc, len(batch), self.retry_alone, self.name):
                    for _, future in batch:
                        _settle(future, exc)
                    continue
                for item, future in batch:
                    try:
                        _settle(future, (await self.run_many([item]))[0])
                    except Exception as single:
                        _settle(future, single)
                continue
            for (_, future), answer in zip(batch, answers, strict=True):
                _settle(future, answer)


def _one_by_one(exc: Exception, size: int, retry_alone: bool, name: str) -> bool:
    """Whether a failed batch of ``size`` is tried again item by item (see ``Grouped``)."""
    if size == 1 or not retry_alone or isinstance(exc, INFRASTRUCTURE_ERRORS):
        return False
    log.warning("a group of %d %s failed (%r); one by one", size, name, exc)
    return True


class _Slot(Generic[T, R]):
    """One thread's call: its item, then its answer (or error), or the lead."""

    __slots__ = ("answer", "item", "lead", "ready")

    def __init__(self, item: T) -> None:
        self.item = item
        self.answer: R | BaseException | None = None
        self.lead = False
        self.ready = threading.Event()


class ThreadGrouped(Generic[T, R]):
    """``grouped(item)`` answers what ``run_many(items)[i]`` answered for it, for threads.

    No thread of its own: a caller that finds no group in flight leads. It takes what waits
    (itself first, up to ``max_items``), runs it on its own thread, passes the lead to the
    first caller that arrived meanwhile, and hands out the answers. So at rest a call runs
    alone, at once; under load each group waits for one round trip, never for a timer. The
    rules for a failed group are ``Grouped``'s.
    """

    def __init__(
        self,
        run_many: Callable[[list[T]], list[R]],
        *,
        max_items: int,
        name: str,
        retry_alone: bool,
        weigh: Callable[[T], int] | None = None,
        max_bytes: int = GROUP_MAX_BYTES,
    ) -> None:
        self.run_many = run_many
        self.max_items = max_items
        self.name = name
        self.retry_alone = retry_alone
        self.weigh = weigh
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._waiting: list[_Slot[T, R]] = []
        self._leading = False  # a group is in flight; while anything waits, always True

    def __call__(self, item: T) -> R:
        slot: _Slot[T, R] = _Slot(item)
        with self._lock:
            self._waiting.append(slot)
            leads = not self._leading
            self._leading = True
        if not leads:
            slot.ready.wait()
            if not slot.lead:
                return _answer(slot)
        batch: list[_Slot[T, R]] = []
        try:
            with self._lock:  # the lead: slot is first in line
                items = [s.item for s in self._waiting[: self.max_items]]
                batch = self._waiting[: _taken(items, self.max_bytes, self.weigh)]
                del self._waiting[: len(batch)]
            answers = contextvars.Context().run(self._answers, [s.item for s in batch])
        except BaseException as exc:  # a soft time limit's signal, say: everyone's
            answers = [exc] * len(batch)
        finally:  # whatever happened, the next group gets its leader
            with self._lock:
                if self._waiting:
                    self._waiting[0].lead = True
                    self._waiting[0].ready.set()
                else:
                    self._leading = False
        for waiter, answer in zip(batch, answers, strict=True):
            waiter.answer = answer
            if waiter is not slot:
                waiter.ready.set()
        return _answer(slot)

    def _answers(self, items: list[T]) -> list[R | BaseException]:
        try:
            return list(self.run_many(items))
        except Exception as exc:
            if not _one_by_one(exc, len(items), self.retry_alone, self.name):
                return [exc] * len(items)
        answers: list[R | BaseException] = []
        for item in items:
            try:
                answers.append(self.run_many([item])[0])
            except Exception as single:
                answers.append(single)
        return answers


def _answer(slot: _Slot[T, R]) -> R:
    if isinstance(slot.answer, BaseException):
        raise slot.answer
    return slot.answer  # type: ignore[return-value]


def _settle(future: asyncio.Future[R], outcome: R | BaseException) -> None:
    if future.done():  # its caller was cancelled (a client that went away)
        return
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except RuntimeError:  # its event loop is closed: nobody is waiting any more
        pass
