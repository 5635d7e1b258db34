"""Async handlers: one event loop per worker process, and the calls in flight on it.

An ``async def`` handler's coroutine runs on the process's one event loop. On the threads pool
(``-P threads -c 500``) the whole task runs there, with no thread of its own
(``workers.pool``, ``arun``); elsewhere (prefork) the task's thread waits for the coroutine
(``run``). So many handlers awaiting a model share one loop, one process, and whatever
clients the agent keeps per process (an ``aiohttp`` session).

Nothing here uses signals. A call ends in one of three ways: it returns (or raises), its time
runs out (``CallTimedOut``: the coroutine is cancelled, so it sees ``CancelledError`` at its
``await``), or the caller cancels the task (the coroutine is cancelled the same way, and its
waiter gets ``CallCancelled``). A cancel reaches the process through one Redis pub/sub
subscription (``CANCELS_CHANNEL``), read by a thread of its own.

A cancel is published only after the task's row moved to ``cancelled``, so after any claim
that won. A subscription that was up before the claim therefore hears every cancel of the
task: one that comes before the call is known here is kept (``RECENT_CANCEL_S``) and applied
when it is. Only a call claimed while the subscription was not up (the process starting,
Redis lost), or before a kept cancel was let go, asks Redis for the task's cancel flag, and a
new subscription asks it for every call in flight, for the cancels it could not hear.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import redis

from broker import redisclients, runtime
from broker.tasks.cancellation import CANCELS_CHANNEL, flag_key
from broker.tasks.resource import said

log = logging.getLogger("reach.worker")
CANCEL_LISTEN_RETRY_S = 1.0
# A tenant's payload of more JSON than this is worked on in Python (its schema check, the
# bridge's conversion to protobuf) in a thread, not on the loop every call here shares: that
# work takes about a second a MiB. A smaller one stays on the loop, spared the thread's hop.
ON_LOOP_BYTES = 64 * 2**10
# The threads for that work, apart from the loop's default ones, which every call's progress,
# outputs and session writes wait for: a burst of big payloads holds these alone. Python under
# the GIL runs no faster on more of them.
PAYLOAD_THREADS = 4
T = TypeVar("T")
# A cancel heard for no call in flight here is kept for a call that starts, for this long: a
# claim's way to its call takes milliseconds, or the seconds a big payload's check takes.
# Every process hears every tenant's cancels, so a bound by count alone (it was 4,096) let
# other tasks' cancels push out one heard a moment before, and its call ran to its timeout.
RECENT_CANCEL_S = 60.0
# And at most this many, far above a minute's cancels (about 240 bytes each). Whatever is let
# go, by age or by this cap, a call claimed before it was heard asks Redis for its flag.
RECENT_CANCELS_MAX = 200_000


_payload_pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_payload_pool_lock = threading.Lock()


async def off_the_loop(work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` on one of ``PAYLOAD_THREADS``, with the caller's context: for work on a
    payload past ``ON_LOOP_BYTES``."""
    context = contextvars.copy_context()
    call = functools.partial(context.run, work, *args)
    return await asyncio.get_running_loop().run_in_executor(_payload_threads(), call)


def _payload_threads() -> concurrent.futures.ThreadPoolExecutor:
    """This process's (a forked child makes its own: its parent's threads are not in it)."""
    global _payload_pool
    with _payload_pool_lock:
        if _payload_pool is None or _payload_pool[0] != os.getpid():
            threads = concurrent.futures.ThreadPoolExecutor(
                PAYLOAD_THREADS, thread_name_prefix="reach-payloads"
            )
            _payload_pool = (os.getpid(), threads)
        return _payload_pool[1]


class CallCancelled(Exception):
    """The caller cancelled the task while its coroutine ran."""


class CallTimedOut(Exception):
    """The coroutine ran past its time and was cancelled."""


class HandlerExited(Exception):
    """The handler raised a ``BaseException`` that is no ``Exception``: ``SystemExit`` or
    ``KeyboardInterrupt`` (``sys.exit()``, argparse's ``error``) where no signal could have, a
    library's own (as ``gevent.Timeout``), a sync handler's ``CancelledError``. It ended the
    handler, not the process. Raised on the event loop, it stopped the loop and every task on
    it; in a pool thread, it left the task's message held for good; in a prefork child, its
    task ended ``worker_lost``."""


class HandlerCancelledItself(Exception):
    """The handler raised ``CancelledError`` though nobody cancelled its task: a sub-task of
    its own that was cancelled, or a library's. A failure of the agent's, not a cancel."""


async def _in_context(values: list[tuple[contextvars.ContextVar[Any], Any]], call: Any) -> Any:
    # A task made on the loop copies the loop thread's context, not the caller's: set the
    # caller's values in the task's own copy, so they stay with this coroutine alone.
    for var, value in values:
        var.set(value)
    return await call


async def _within(call: Coroutine[Any, Any, Any], timeout_s: float | None) -> Any:
    """``call``, which must have come to its end within ``timeout_s`` of its start, by its own
    clock (CallTimedOut otherwise). The caller cancels it, once, when its time is up; a
    result or failure that comes later (the caller waited for something else first, the
    ``running`` event's write) is not taken: a handler got that wait on top of its time.
    A second cancel of its own, at its limit, cut short the cleanup a handler runs when
    cancelled."""
    begun = time.monotonic()
    try:
        result = await call
    except Exception:
        if timeout_s is not None and time.monotonic() - begun > timeout_s:
            raise CallTimedOut(f"the handler failed after {timeout_s:.3f}s") from None
        raise
    except asyncio.CancelledError as exc:
        current = asyncio.current_task()
        if current is None or current.cancelling():  # the caller's cancel, or its time's
            raise
        raise HandlerCancelledItself(
            "the handler raised CancelledError, though nobody cancelled the task"
        ) from exc
    except BaseException as exc:  # SystemExit, KeyboardInterrupt, a library's own
        raise HandlerExited(f"the handler raised {said(exc, repr)}") from exc
    if timeout_s is not None and time.monotonic() - begun > timeout_s:
        raise CallTimedOut(f"the handler returned after {timeout_s:.3f}s")
    return result


def _left(timeout_s: float | None, begun: float, now: float) -> float | None:
    return None if timeout_s is None else max(0.0, timeout_s - (now - begun))


class _LoopTask:
    """A task on the loop that another thread (the cancel listener) may cancel."""

    __slots__ = ("_task",)

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self._task = task

    def cancel(self) -> bool:
        self._task.get_loop().call_soon_threadsafe(self._task.cancel)
        return True


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's thread. A ``BaseException`` out of a callback (never a handler's, which
    ``_within`` turns into failures) ends it, and every task on it with it: said loudly."""
    try:
        loop.run_forever()
    except BaseException:
        log.critical("the event loop stopped: no task of this process can run", exc_info=True)
        raise


def _retrieved(task: asyncio.Task[Any]) -> None:
    # A call cut short (its time ran out) is not awaited any more: what it came to is read
    # here, so asyncio does not log it as never retrieved.
    if not task.cancelled():
        task.exception()


class Calls:
    """The process's event loop (started on first use, again in a forked child) and the
    coroutines running on it, by task id, so a cancel can reach them."""

    def __init__(self, redis_url: str, event_loop: runtime.EventLoopKind = "uvloop") -> None:
        self.redis_url = redis_url
        self.event_loop = event_loop
        self._lock = threading.Lock()
        self._pid = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: dict[uuid.UUID, concurrent.futures.Future[Any] | _LoopTask] = {}
        self._recent: OrderedDict[uuid.UUID, float] = OrderedDict()  # id: heard at (monotonic)
        self._listening_since: float | None = None  # monotonic; None: not subscribed

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                self._running, self._recent, self._listening_since = {}, OrderedDict(), None
                self._loop = runtime.new_event_loop(self.event_loop)
                threading.Thread(
                    target=_run_loop, args=(self._loop,), name="reach-loop", daemon=True
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
        claimed_at: float,
        cancelled: Callable[[], bool],
        started: Callable[[], None] | None = None,
    ) -> Any:
        """Run ``call`` on the loop and wait for it, at most ``timeout_s``; the caller's
        context goes with it. ``claimed_at`` (monotonic): when the task's claim began; a
        cancel since then was heard if the subscription was up before. Otherwise
        ``cancelled`` (the task's flag) is asked, once the call is known to the listener.
        ``started``: run on this thread while the coroutine starts; if it raises, the
        coroutine is cancelled."""
        loop = self._started()
        values = list(contextvars.copy_context().items())
        begun = time.monotonic()
        limited = _within(call, timeout_s)
        future = asyncio.run_coroutine_threadsafe(_in_context(values, limited), loop)
        with self._lock:
            self._running[task_id] = future
            heard = self._recent.pop(task_id, None) is not None
            since = self._listening_since
        try:
            if started is not None:
                try:
                    started()
                except BaseException:
                    future.cancel()
                    raise
            if heard or ((since is None or since > claimed_at) and cancelled()):
                future.cancel()
            return future.result(timeout=_left(timeout_s, begun, time.monotonic()))
        except TimeoutError:  # the wait's, or the handler's own: only the first is ours
            if future.done():
                return future.result()
            future.cancel()
            raise CallTimedOut(f"the handler ran past {timeout_s:.3f}s") from None
        except concurrent.futures.CancelledError:
            raise CallCancelled("the caller cancelled the task") from None
        finally:
            with self._lock:
                self._running.pop(task_id, None)

    async def arun(
        self,
        task_id: uuid.UUID,
        call: Coroutine[Any, Any, Any],
        *,
        timeout_s: float | None,
        claimed_at: float,
        cancelled: Callable[[], Awaitable[bool]],
        started: Callable[[], Awaitable[None]],
    ) -> Any:
        """``run`` for a caller that is itself a coroutine on the loop (the threads pool's
        direct path, ``workers.pool``): the call runs as a task of its own, with a copy of
        the caller's context, and no thread waits for it."""
        loop = asyncio.get_running_loop()
        begun = loop.time()
        task = loop.create_task(_within(call, timeout_s))
        task.add_done_callback(_retrieved)
        with self._lock:
            self._running[task_id] = _LoopTask(task)
            heard = self._recent.pop(task_id, None) is not None
            since = self._listening_since
        try:
            try:
                await started()
            except BaseException:
                task.cancel()
                raise
            if heard or ((since is None or since > claimed_at) and await cancelled()):
                task.cancel()
            done, _ = await asyncio.wait((task,), timeout=_left(timeout_s, begun, loop.time()))
            if not done:
                task.cancel()
                raise CallTimedOut(f"the handler ran past {timeout_s:.3f}s")
            try:
                return task.result()
            except asyncio.CancelledError:
                raise CallCancelled("the caller cancelled the task") from None
        finally:
            with self._lock:
                self._running.pop(task_id, None)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The process's event loop, started if it was not."""
        return self._started()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def _listen(self, pid: int) -> None:
        """Cancel the running coroutine of each task id published on ``CANCELS_CHANNEL``."""
        while self._pid in (0, pid):
            try:
                client = redisclients.sync_client(
                    self.redis_url, socket_keepalive=True, client_name=f"reach-cancels-{pid}"
                )
                pubsub = client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]  # untyped in older redis
                pubsub.subscribe(CANCELS_CHANNEL)
                for message in pubsub.listen():  # type: ignore[no-untyped-call, unused-ignore]
                    if message.get("type") == "subscribe":
                        self._subscribed(client)
                    elif message.get("type") == "message":
                        self._cancel(message.get("data"))
            except redis.RedisError as exc:
                log.warning("cancel listener lost Redis (%s); subscribing again", exc)
                with self._lock:
                    self._listening_since = None
                threading.Event().wait(CANCEL_LISTEN_RETRY_S)

    def _subscribed(self, client: redis.Redis) -> None:
        """From now on every cancel is heard; the calls already in flight may have missed
        theirs, so their flags are read once."""
        with self._lock:
            self._listening_since = time.monotonic()
            in_flight = list(self._running)
        if in_flight:
            pipe = client.pipeline(transaction=False)
            for task_id in in_flight:
                pipe.exists(flag_key(task_id))
            for task_id, flagged in zip(in_flight, pipe.execute(), strict=True):
                if flagged:
                    self._cancel(str(task_id))

    def _cancel(self, data: Any) -> None:
        try:
            task_id = uuid.UUID(data.decode() if isinstance(data, bytes) else str(data))
        except ValueError:
            return
        with self._lock:
            future = self._running.get(task_id)
            if future is None:
                self._keep(task_id, time.monotonic())
        if future is not None:
            log.info("cancelling the running coroutine of task %s", task_id)
            future.cancel()

    def _keep(self, task_id: uuid.UUID, now: float) -> None:
        """Keep a cancel heard for no call in flight, oldest first; let go of those past
        ``RECENT_CANCEL_S`` or ``RECENT_CANCELS_MAX``. With the lock held."""
        self._recent[task_id] = now
        self._recent.move_to_end(task_id)  # heard again: kept from now
        while self._recent:
            oldest, heard_at = next(iter(self._recent.items()))
            if heard_at > now - RECENT_CANCEL_S and len(self._recent) <= RECENT_CANCELS_MAX:
                return
            del self._recent[oldest]
            # A call claimed before this cancel was heard may have been its task's: from now
            # on such a call asks Redis, as one claimed before the subscription was up does.
            if self._listening_since is not None:
                self._listening_since = max(self._listening_since, heard_at)
