"""Async handlers: one event loop per worker process, and the calls in flight on it.

A worker started with the threads pool (``-P threads -c 500``) runs each task in a thread of
its own; an ``async def`` handler's coroutine runs on the process's one event loop, and the
task's thread only waits for it. So many handlers awaiting a model share one loop, one
process, and whatever clients the agent keeps per process (an ``aiohttp`` session).

Nothing here uses signals. A call ends in one of three ways: it returns (or raises), its time
runs out (``CallTimedOut``: the coroutine is cancelled, so it sees ``CancelledError`` at its
``await``), or the caller cancels the task (the coroutine is cancelled the same way, and the
thread gets ``CallCancelled``). A cancel reaches the process through one Redis pub/sub
subscription (``CANCELS_CHANNEL``), read by a thread of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import os
import threading
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import redis

from broker.tasks.cancellation import CANCELS_CHANNEL

log = logging.getLogger("reach.worker")
CANCEL_LISTEN_RETRY_S = 1.0


class CallCancelled(Exception):
    """The caller cancelled the task while its coroutine ran."""


class CallTimedOut(Exception):
    """The coroutine ran past its time and was cancelled."""


async def _in_context(values: list[tuple[contextvars.ContextVar[Any], Any]], call: Any) -> Any:
    # A task made on the loop copies the loop thread's context, not the caller's: set the
    # caller's values in the task's own copy, so they stay with this coroutine alone.
    for var, value in values:
        var.set(value)
    return await call


class Calls:
    """The process's event loop (started on first use, again in a forked child) and the
    coroutines running on it, by task id, so a cancel can reach them."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self._lock = threading.Lock()
        self._pid = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: dict[uuid.UUID, concurrent.futures.Future[Any]] = {}

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                self._running = {}
                self._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=self._loop.run_forever, name="reach-loop", daemon=True
                ).start()
                threading.Thread(
                    target=self._listen, args=(os.getpid(),), name="reach-cancels", daemon=True
                ).start()
                self._pid = os.getpid()
            return self._loop

    def run(
        self,
        task_id: uuid.UUID,
        call: Coroutine[Any, Any, Any],
        *,
        timeout_s: float | None,
        cancelled: Callable[[], bool],
    ) -> Any:
        """Run ``call`` on the loop and wait for it, at most ``timeout_s``; the caller's
        context goes with it. ``cancelled`` is asked once the call is known to the listener,
        for a cancel that came before."""
        loop = self._started()
        values = list(contextvars.copy_context().items())
        future = asyncio.run_coroutine_threadsafe(_in_context(values, call), loop)
        self._running[task_id] = future
        try:
            if cancelled():
                future.cancel()
            return future.result(timeout=timeout_s)
        except TimeoutError:  # the wait's, or the handler's own: only the first is ours
            if future.done():
                return future.result()
            future.cancel()
            raise CallTimedOut(f"the handler ran past {timeout_s:.3f}s") from None
        except concurrent.futures.CancelledError:
            raise CallCancelled("the caller cancelled the task") from None
        finally:
            self._running.pop(task_id, None)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def _listen(self, pid: int) -> None:
        """Cancel the running coroutine of each task id published on ``CANCELS_CHANNEL``."""
        while self._pid in (0, pid):
            try:
                client = redis.Redis.from_url(self.redis_url, socket_keepalive=True)
                pubsub = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
                pubsub.subscribe(CANCELS_CHANNEL)
                for message in pubsub.listen():
                    self._cancel(message.get("data"))
            except redis.RedisError as exc:
                log.warning("cancel listener lost Redis (%s); subscribing again", exc)
                threading.Event().wait(CANCEL_LISTEN_RETRY_S)

    def _cancel(self, data: Any) -> None:
        try:
            task_id = uuid.UUID(data.decode() if isinstance(data, bytes) else str(data))
        except ValueError:
            return
        future = self._running.get(task_id)
        if future is not None:
            log.info("cancelling the running coroutine of task %s", task_id)
            future.cancel()
