"""What a server process sets in the interpreter it runs in: the API's and every worker's.

The event loop a worker runs its async handlers on (the API's is uvicorn's, uvloop where
installed), the cyclic garbage collector, and, on Python 3.11, ``asyncio.wait_for``
(``keep_cancels``).

uvloop (libuv under asyncio's interface; installed with ``uvicorn[standard]`` on Linux and
macOS) runs the same coroutines with less CPU each: a bridge process making 10,000 calls
spent about 5 % less CPU a call on it (``docs/performance.md``, "uvloop under the worker's
coroutines"). ``REACH_EVENT_LOOP=asyncio`` keeps asyncio's own loop, for an agent library
that needs it; where uvloop is not installed, asyncio's is used.

The collector: CPython collects its youngest generation each time
700 more container objects have been made than freed; every tenth such collection also takes
the middle generation, and every tenth of those, once enough objects have survived, the whole
heap. A worker or an API process with hundreds of tasks or requests in flight keeps each
one's objects alive across several young collections, so they are promoted, and full
collections follow: each one a walk over the whole heap, with the 180,000 objects the
process's libraries left after start-up, 0.1-0.2 s of CPU here.

Measured (``docs/performance.md``, "The garbage collector"): a bridge process making 10,000
calls spent 4.3-4.8 s of its 16-18 s of CPU collecting, and an async worker running the model
phase's 2,000 tasks a quarter of its CPU. With the youngest generation collected every 10,000
net allocations, most objects die before a collection sees them: the same runs spent 0.4-1.0
and 0.37 s, with no full collection.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from collections.abc import Awaitable
from typing import Literal, TypeVar

PYTHON_GEN0_THRESHOLD = 700
T = TypeVar("T")
STOCK_WAIT_FOR = asyncio.wait_for  # the interpreter's own, before ``keep_cancels``
EventLoopKind = Literal["uvloop", "asyncio"]
log = logging.getLogger("reach.runtime")


def new_event_loop(kind: EventLoopKind) -> asyncio.AbstractEventLoop:
    """A new event loop of ``kind``: uvloop's, or asyncio's when asked or uvloop is missing."""
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("uvloop is not installed: async handlers run on asyncio's loop")
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def tune_collector(gen0_threshold: int) -> None:
    """Collect the youngest generation every ``gen0_threshold`` net allocations of container
    objects (0 leaves the interpreter's own); the older generations' thresholds are kept."""
    if gen0_threshold > 0:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(gen0_threshold, gen1, gen2)


def keep_cancels() -> None:
    """On Python 3.11, ``asyncio.wait_for`` as 3.12 has it (gh-86296), for every library in
    the process. 3.11's returns the awaited result when a cancel and that result land
    together, and the cancel is lost: redis-py waits so around every command's send, so a
    task cancelled in a Redis call could run on. An SSE stream whose client hung up as its
    SUBSCRIBE went out held its slot until its task ended; an async handler cut off at its
    deadline in a Redis call would go on. 3.12's waits under ``asyncio.timeout``, in the
    caller's own task, and keeps the cancel."""
    if sys.version_info < (3, 12) and asyncio.wait_for is not _wait_for:
        asyncio.wait_for = asyncio.tasks.wait_for = _wait_for  # type: ignore[assignment]


async def _wait_for(fut: Awaitable[T], timeout: float | None) -> T:  # noqa: ASYNC109
    """Python 3.12's ``asyncio.wait_for``."""
    if timeout is not None and timeout <= 0:
        task = asyncio.ensure_future(fut)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
        try:
            return task.result()
        except asyncio.CancelledError as exc:
            raise TimeoutError from exc
    async with asyncio.timeout(timeout):
        return await fut
