"""Group commit: calls that arrive while one is in flight go out together in the next.

A call that finds nothing in flight goes out at once, alone; calls that arrive meanwhile wait
for it and then go out as one batch (one statement, one Redis call). At rest this adds nothing;
under load one round trip serves many requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from broker.outages import INFRASTRUCTURE_ERRORS

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("reach.grouping")


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
    ) -> None:
        self.run_many = run_many
        self.max_items = max_items
        self.name = name
        self.retry_alone = retry_alone
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def __call__(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._waiting.append((item, future))
        flusher = self._flusher
        if flusher is None or flusher.done() or flusher.get_loop() is not loop:
            self._flusher = asyncio.create_task(self._flush(), name=f"reach-group-{self.name}")
        return await future

    async def _flush(self) -> None:
        while self._waiting:
            batch = self._waiting[: self.max_items]
            del self._waiting[: len(batch)]
            try:
                answers = await self.run_many([item for item, _ in batch])
            except Exception as exc:
                alone = self.retry_alone and not isinstance(exc, INFRASTRUCTURE_ERRORS)
                if len(batch) == 1 or not alone:
                    for _, future in batch:
                        _settle(future, exc)
                    continue
                log.warning("a group of %d %s failed (%r); one by one", len(batch), self.name, exc)
                for item, future in batch:
                    try:
                        _settle(future, (await self.run_many([item]))[0])
                    except Exception as single:
                        _settle(future, single)
                continue
            for (_, future), answer in zip(batch, answers, strict=True):
                _settle(future, answer)


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
